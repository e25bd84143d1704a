"""cuDNN's SDPA backend is off in every attention call of the target and the draft head (`jetflow.sdpa`): on an
H200 it rebuilt an execution plan for every new key length, i.e. every decoding step — 8 ms of host time per
attention call in a 128-node tree step (benchmarks/HISTORY.md, "GPU"). PyTorch's backend switch is a global flag that
reads the same on a CPU, so these tests see at each call what a GPU would have chosen from."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetflow import sdpa
from jetflow.decode import DecodeConfig, Decoder
from jetflow.engine import Engine, EngineConfig
from jetflow.head import DraftHead, HeadConfig
from jetflow.tree import TreeSpec
from tests.conftest import tiny_target


@pytest.fixture
def seen(monkeypatch):
    """The cuDNN switch as each SDPA call found it (Transformers' sdpa and ours both call it through F)."""
    calls: list[bool] = []
    real = F.scaled_dot_product_attention

    def spying(*args, **kwargs):
        calls.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spying)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_target_attention_path_runs_without_cudnn_and_restores_the_switch(arch, seen):
    target = tiny_target(arch)
    layers = target.num_layers
    assert torch.backends.cuda.cudnn_sdp_enabled()  # PyTorch's default: the switch this module turns off
    cache = target.new_cache()
    prompt = torch.arange(3, 23)
    target.forward(prompt, torch.arange(20), cache)                          # causal prefill (Transformers' sdpa)
    ancestors = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    target.forward(torch.arange(30, 36), torch.arange(20, 26), cache, target.tree_mask(ancestors, 20))  # tree
    target.forward(torch.tensor([40]), torch.tensor([26]), cache)          # one-token step
    assert len(seen) == 3 * layers
    assert not any(seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after every call


def test_draft_head_and_engine_attention_run_without_cudnn(seen):
    target = tiny_target("qwen3")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, num_hidden_layers=2, block_size=6)).eval()
    h, dev = target.hidden_size, target.device
    with torch.inference_mode():  # the training forward: context features + a block
        head(torch.randn(1, 10, h), torch.randn(1, 6, h), torch.arange(10, device=dev)[None],
             torch.arange(10, 16, device=dev)[None])
    assert len(seen) == 2 and not any(seen)
    cfg = DecodeConfig(tree=TreeSpec(budget=8), max_new_tokens=6)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    Engine(target, head, EngineConfig(max_slots=2)).generate(prompts, cfg)   # head forward_cached + target
    Decoder(target, head).generate(prompts[0], cfg)
    assert len(seen) > 2 + 2 * target.num_layers and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_allow_cudnn_leaves_pytorchs_choice_and_a_switch_turned_off_stays_off(seen):
    target = tiny_target("llama", layers=2)
    ids, pos = torch.tensor([4, 5, 6]), torch.arange(3)
    old = sdpa.allow_cudnn(True)
    try:
        target.forward(ids, pos, target.new_cache())
    finally:
        sdpa.allow_cudnn(old)
    assert seen == [True, True]  # PyTorch's own choice, cuDNN included (what gpu_check measures beside ours)
    torch.backends.cuda.enable_cudnn_sdp(False)  # a user's own setting is never switched back on
    try:
        target.forward(ids, pos, target.new_cache())
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    assert seen[2:] == [False, False]


def test_attention_output_is_the_same_function_with_the_switch_either_way():
    """CPU has no cuDNN backend, so both settings must give the same output bit for bit: the switch chooses
    kernels, never the function."""
    target = tiny_target("qwen3")
    ids, pos = torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(3)), torch.arange(12)
    ours = target.forward(ids, pos, target.new_cache()).hidden
    old = sdpa.allow_cudnn(True)
    try:
        theirs = target.forward(ids, pos, target.new_cache()).hidden
    finally:
        sdpa.allow_cudnn(old)
    assert torch.equal(ours, theirs)
