"""Shared fixtures: the real bundled target (loaded once per session), tiny random targets of each
supported architecture, and a noisy-oracle drafter that makes deep acceptance happen on demand."""

from __future__ import annotations

import os
import random

import pytest
import torch

from jetflow.decode import Decoder
from jetflow.engine import Engine
from jetflow.target import TargetModel


# `make test` runs the suite in two pytest-xdist workers, one per core (-n 2 --dist loadfile
# --no-loadscope-reorder). Each worker's torch takes one intra-op thread, so the two do not spin OpenMP
# threads against each other (subprocesses and Ray workers set their own).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# `graphs=auto` (the default of the engine, the CLI, evaluations and Serve) compiles where this host's measurement
# in $JETFLOW_HOME says it pays: the suite runs the eager reference unless a test asks for the step core itself.
os.environ.setdefault("JETFLOW_GRAPHS", "off")

# A worker takes a whole test file (its module fixtures — a Ray Serve app, an MLflow server, reference
# decodes — are built once, in one process), except the files in SPREAD, whose tests go one at a time to
# whichever worker is free. Work goes out in collection order, so the longest files come first and the
# spread tests last, where they fill in until both workers finish together.
LONGEST_FIRST = ("test_serving.py", "test_sweeps.py", "test_live_tracking.py", "test_train.py", "test_engine.py",
                 "test_eval.py", "test_lm_eval.py", "test_cli.py", "test_sampling_lossless.py")
SPREAD = ("test_decoder_lossless.py",)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: len(rank) + 1 if item.path.name in SPREAD else rank.get(item.path.name, len(rank)))


class _FilesThenSpreadTests:
    """`--dist loadfile`, with each test of a SPREAD file a unit of its own. (xdist's `loadgroup` would say
    this with marks, but it groups by rewriting node ids, which pytest 9.2 no longer reads.)"""

    @pytest.hookimpl
    def pytest_xdist_make_scheduler(self, config, log):
        from xdist.scheduler import LoadFileScheduling

        if config.getvalue("dist") != "loadfile":
            return None

        class Scheduling(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                return nodeid if path.rsplit("/", 1)[-1] in SPREAD else path

        return Scheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_FilesThenSpreadTests())


@pytest.fixture(scope="session")
def smollm() -> TargetModel:
    return TargetModel.load("smollm2-135m")


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (the engine's single-thread replicas; faster beside xdist's 2 workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    """`n` prompts of token ids in 1..119 (the tiny targets' vocabulary), lengths in [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 120, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def tiny_target(arch: str, vocab: int = 128, max_positions: int = 512, seed: int = 0,
                logit_scale: float = 30.0, layers: int = 6) -> TargetModel:
    """A random tiny Llama / Qwen2 / Qwen3 (no tokenizer: decode token ids)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  eos_token_id=vocab - 1, bos_token_id=0, tie_word_embeddings=False)
    cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](**common)
    if arch == "qwen3":
        cfg.head_dim = 16
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # sharper distributions than the 0.02-std init, so argmax ties are rare
        model.get_output_embeddings().weight.mul_(logit_scale)
    return TargetModel(model, tokenizer=None, model_id=f"tiny-{arch}", revision="random")


def seeded_sampling_case():
    """A tiny Llama, a random head, 5 prompts with seeded sampling settings (temperature 0.8, top-p 0.9, a tree
    of 8), and the reference decoder's tokens for each → (target, head, prompts, configs, reference)."""
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.head import DraftHead, HeadConfig
    from jetflow.tree import TreeSpec

    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    prompts = random_prompts(5, seed=4)
    cfgs = [DecodeConfig(tree=TreeSpec("accum_logp", 8, 3), temperature=0.8, top_p=0.9, seed=s, max_new_tokens=20)
            for s in range(5)]
    reference = [Decoder(target, head).generate(p, c).token_ids for p, c in zip(prompts, cfgs)]
    return target, head, prompts, cfgs, reference


def assert_greedy(target, prompt_ids: list[int], got: list[int], expected: list[int]) -> None:
    """`got` is greedy decoding's `expected`: token-identical, or first different where the target's own top
    two logits are an fp32 tie and `got` took the other one (`jetflow.decode.lossless`)."""
    from jetflow.decode.lossless import first_divergence

    d = first_divergence(target, prompt_ids, got, expected)
    assert d is None or d.tie, (f"diverged at {d.index}: got {d.got}, greedy {d.expected}, top-2 logit gap "
                                f"{d.gap:.3g} (not a tie)")


class OracleDecoder(Decoder):
    """Drafts from a known continuation: at each depth the true next token sits at a random rank
    (or is missing), the other ranks are random tokens. Lets tests force deep, off-spine acceptance."""

    def __init__(self, target, head, reference: list[int], miss: float = 0.15, seed: int = 0):
        super().__init__(target, head)
        self.reference = reference  # prompt + expected continuation
        self.miss = miss
        self.rng = random.Random(seed)

    def draft(self, state, cfg, branches=()):
        return oracle_draft(self.rng, self.target.vocab_size, cfg.tree.width, self.reference, state.past,
                            self.head.config.depth, self.miss, branches)


def oracle_draft(rng, vocab: int, w: int, reference: list[int], past: int, depth: int, miss: float,
                 branches=()) -> tuple[list, list]:
    """The noisy oracle's rows for depths 1..depth after position `past` of `reference`. With `branches`
    (path_conditional_refresh's second pass, depth-1 tokens): per branch, the rows of depths 2..depth — the
    oracle's when the branch is the true depth-1 token, rows missing the truth otherwise (a wrong path has
    no true continuation)."""
    def rows(first: int, knows: bool):
        vals, toks = [], []
        for k in range(first, depth + 1):
            pos = past + k
            true = reference[pos] if pos < len(reference) else None
            row = [t for t in rng.sample(range(vocab), w + 1) if t != true][:w]
            if knows and true is not None and rng.random() > miss:
                # mostly rank 0 (the spine), sometimes deeper ranks (off-spine branches)
                row[rng.choices(range(w), weights=[20] + [1] * (w - 1))[0]] = true
            vals.append([-0.3 - 0.4 * r for r in range(w)])  # branches compete with the spine
            toks.append(row)
        return vals, toks

    if not branches:
        return rows(1, True)
    true1 = reference[past + 1] if past + 1 < len(reference) else None
    out = [rows(2, c == true1) for c in branches]
    return [o[0] for o in out], [o[1] for o in out]


class OracleEngine(Engine):
    """The batched engine with the same noisy-oracle drafter as `OracleDecoder`, per request: each request's
    expected continuation is `references[prompt tuple]`."""

    def __init__(self, target, head, references: dict[tuple, list[int]], config=None, miss: float = 0.15,
                 seed: int = 0):
        super().__init__(target, head, config)
        self.references, self.miss, self.rng = references, miss, random.Random(seed)

    def _draft(self, idx, trees):
        values, tokens = [], []
        for i, tree in zip(idx, trees):
            vals, toks = self._oracle(i, tree.width)
            values.append(vals)
            tokens.append(toks)
        return values, tokens

    def _redraft(self, i, width, branches):
        return self._oracle(i, width, branches)

    def _oracle(self, i, width, branches=()):
        seq = self.running[i]
        return oracle_draft(self.rng, self.target.vocab_size, width, self.references[tuple(seq.request.prompt_ids)],
                            seq.past, self.head.config.depth, self.miss, branches)
