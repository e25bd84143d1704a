"""The target's tree-masked forward and KV compaction, on the real SmolLM2 and tiny Llama/Qwen2/Qwen3."""

from __future__ import annotations

import pytest
import torch

from jetflow.decode import DecodeConfig, Decoder, encode_prompt
from jetflow.errors import PromptTooLongError, UnknownModelError
from jetflow.head import DraftHead, HeadConfig
from jetflow.target import TargetModel
from jetflow.tree import TreeSpec, build_tree
from tests.conftest import OracleDecoder, tiny_target

ARCHS = ("llama", "qwen2", "qwen3")


@torch.inference_mode()
def _tree_and_prefix(target: TargetModel, prompt_ids: list[int], budget: int, seed: int = 0):
    """A real draft tree (random causal head) rooted at the prompt's last token, and its prefix cache."""
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.for_target(target, block_size=8))
    decoder = Decoder(target, head)
    cfg = DecodeConfig(tree=TreeSpec(budget=budget, width=4))
    state = decoder._prefill(prompt_ids, cfg)
    top_v, top_i = decoder.draft(state, cfg)
    return build_tree(cfg.tree, state.anchor, top_v, top_i), state


@torch.inference_mode()
def _assert_tree_logits_equal_paths(target: TargetModel, prompt_ids: list[int], budget: int, atol: float):
    tree, state = _tree_and_prefix(target, prompt_ids, budget)
    assert tree.size == budget and tree.max_depth < tree.size - 1, "need a real (branching) tree"
    past = state.past
    mask = target.tree_mask(torch.from_numpy(tree.ancestor_mask()), past)
    out = target.forward(tree.token_tensor(), tree.depth_tensor() + past, state.cache, mask)
    tree_logits = target.logits(out.hidden)
    target.compact_cache(state.cache, past, torch.arange(0))  # back to the prefix alone
    for node in range(tree.size):
        path = tree.path_to(node)
        ids = torch.tensor([tree.tokens[i] for i in path])
        alone = target.forward(ids, torch.arange(past, past + len(path)), state.cache)
        torch.testing.assert_close(target.logits(alone.hidden[-1]), tree_logits[node], atol=atol, rtol=0)
        target.compact_cache(state.cache, past, torch.arange(0))


@pytest.mark.slow
def test_tree_node_logits_equal_running_its_root_to_node_path_alone_on_smollm(smollm):
    ids = encode_prompt(smollm.tokenizer, "Explain how a hash map handles collisions.")
    _assert_tree_logits_equal_paths(smollm, ids, budget=24, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_node_logits_equal_running_its_root_to_node_path_alone_on_tiny_models(arch):
    target = tiny_target(arch)
    _assert_tree_logits_equal_paths(target, list(range(3, 40)), budget=20, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("algorithm,budget", [("accum_logp", 16), ("chain", 8), ("top2gap", 64)])
def test_tiny_model_tree_decode_is_token_identical_to_hf_generate(arch, algorithm, budget):
    target = tiny_target(arch)
    prompt = [int(t) for t in torch.randint(1, 120, (24,), generator=torch.Generator().manual_seed(7))]
    expected = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40,
                                     pad_token_id=0)[0, len(prompt):].tolist()
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    cfg = DecodeConfig(tree=TreeSpec(algorithm, budget, width=4), max_new_tokens=40)
    assert Decoder(target, head).generate(prompt, cfg).token_ids == expected
    oracle = OracleDecoder(target, head, reference=prompt + expected, seed=3)
    result = oracle.generate(prompt, cfg)
    assert result.token_ids == expected
    assert result.stats.tau > 1.5


@torch.inference_mode()
def _ar_cache_and_features(target: TargetModel, tokens: list[int], layer_ids):
    cache = target.new_cache()
    out = target.forward(torch.tensor(tokens), torch.arange(len(tokens)), cache, None, layer_ids)
    return cache, out.features


@pytest.mark.slow
def test_kv_cache_after_every_round_equals_the_cache_of_ar_decoding_the_committed_tokens(smollm):
    """Also the head's context features: both must cover exactly prompt + generated[:-1]."""
    ids = encode_prompt(smollm.tokenizer, "List three uses of a binary search tree.")
    expected = Decoder(smollm).generate(ids, DecodeConfig(max_new_tokens=40)).token_ids
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(smollm))
    decoder = OracleDecoder(smollm, head, reference=ids + expected, seed=5)
    cfg = DecodeConfig(tree=TreeSpec(budget=32, width=5), max_new_tokens=40)
    rounds = 0
    for state in decoder.stream(ids, cfg):
        if state.finish_reason is not None:  # the last round may commit fewer tokens than it accepted
            break
        committed = ids + state.generated
        assert state.past == len(committed) - 1 and state.anchor == committed[-1]
        ref_cache, ref_feats = _ar_cache_and_features(smollm, committed[:-1], head.config.target_layer_ids)
        assert state.cache.get_seq_length() == ref_cache.get_seq_length()
        for ours, ref in zip(state.cache.layers, ref_cache.layers):
            torch.testing.assert_close(ours.keys, ref.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ours.values, ref.values, atol=1e-4, rtol=1e-4)
        with torch.inference_mode():
            ref_ctx = head.project_context(ref_feats)
        torch.testing.assert_close(state.ctx[: state.past], ref_ctx, atol=1e-4, rtol=1e-4)
        rounds += 1
    assert decoder.finish(state, cfg).token_ids == expected
    assert rounds < len(expected), "the oracle should have accepted multi-token paths"


def test_compact_cache_keeps_exactly_the_chosen_rows_in_order():
    target = tiny_target("llama")
    cache = target.new_cache()
    target.forward(torch.arange(1, 11), torch.arange(10), cache)
    before = [layer.keys.clone() for layer in cache.layers]
    keep = torch.tensor([0, 2, 5])
    target.compact_cache(cache, 4, keep)
    assert cache.get_seq_length() == 7
    for layer, old in zip(cache.layers, before):
        torch.testing.assert_close(layer.keys[:, :, :4], old[:, :, :4])
        torch.testing.assert_close(layer.keys[:, :, 4:], old[:, :, 4 + keep])


def test_prompt_too_long_is_refused_before_any_work():
    target = tiny_target("qwen3", max_positions=64)
    head = DraftHead(HeadConfig.for_target(target, block_size=8))
    with pytest.raises(PromptTooLongError, match="exceeds the target's 64 positions"):
        Decoder(target, head).generate(list(range(1, 50)), DecodeConfig(max_new_tokens=20))
    with pytest.raises(PromptTooLongError, match="empty"):
        Decoder(target).generate([], DecodeConfig(max_new_tokens=2))


def test_unknown_target_name_is_a_clear_error(tmp_path):
    with pytest.raises(UnknownModelError, match="not bundled"):
        TargetModel.load("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownModelError, match="no config.json"):
        TargetModel.load(str(tmp_path / "empty"))


def test_unsupported_architecture_is_refused():
    from transformers import AutoModelForCausalLM, GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnknownModelError, match="not supported"):
        TargetModel(model, tokenizer=None, model_id="gpt2-tiny")


def test_assert_greedy_allows_only_a_flip_at_an_fp32_tie():
    from tests.conftest import assert_greedy

    target = tiny_target("llama")
    prompt = [3, 1, 4, 1, 5]
    expected = Decoder(target).generate(prompt, DecodeConfig(max_new_tokens=6)).token_ids
    assert_greedy(target, prompt, expected, expected)
    wrong = expected[:3] + [(expected[3] + 1) % target.vocab_size] + expected[4:]
    with pytest.raises(AssertionError, match="not a tie"):
        assert_greedy(target, prompt, wrong, expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_query_attention_packs_instead_of_repeating_and_gives_hf_sdpas_output(arch, monkeypatch):
    """A masked multi-token forward (a tree verify, batched rows each under its own 4-D mask) through our
    attention equals Transformers' `sdpa` bit for bit and never repeats key/value heads; so does a one-token
    step over the cache (plain decoding), to rounding."""
    import copy

    import transformers.integrations.sdpa_attention as hf_sdpa
    from transformers import DynamicCache

    from jetflow.target.attention import GQA_SDPA
    from jetflow.target.model import cache_kwargs

    target = tiny_target(arch)
    assert target.model.config._attn_implementation == GQA_SDPA
    reference = copy.deepcopy(target.model)
    reference.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(1)
    b, n = 3, 25
    ids = torch.randint(0, target.vocab_size, (b, n), generator=g)
    visible = (torch.rand(b, n, n, generator=g) > 0.3) | torch.eye(n, dtype=torch.bool)
    mask = torch.zeros(b, 1, n, n).masked_fill_(~visible[:, None], torch.finfo(torch.float32).min)
    positions = torch.arange(n).expand(b, -1)
    step = torch.zeros(b, 1, 1, n + 1).masked_fill_(torch.rand(b, 1, 1, n + 1, generator=g) > 0.5,
                                                    torch.finfo(torch.float32).min)
    step[..., -1] = 0

    def run(model):
        cache = DynamicCache(config=model.config)
        tree = model(input_ids=ids, position_ids=positions, attention_mask=mask, **cache_kwargs(model, cache)).logits
        one = model(input_ids=ids[:, :1], position_ids=torch.full((b, 1), n), attention_mask=step,
                    **cache_kwargs(model, cache)).logits
        return tree, one

    def no_repeat(*args, **kwargs):
        raise AssertionError("key/value heads were repeated")

    with torch.inference_mode():
        want = run(reference)
        monkeypatch.setattr(hf_sdpa, "repeat_kv", no_repeat)
        got = run(target.model)
    assert torch.equal(got[0], want[0])
    # Transformers 5.24 folds one-token queries the same way (bit for bit); 5.20 repeats them (rounding differs)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_a_node_converts_the_bundled_target_whole_from_a_training_worker_of_any_rank(tmp_path, monkeypatch):
    """Transformers' `save_pretrained` writes nothing on a torch.distributed rank other than 0: a Ray Train worker
    of rank 1 converting its (fresh) node's copy left the tokenizer and no weights, and every later load on that
    node failed ("Should have a `model_type` key"). Here transformers is told it is rank 1 of a process group."""
    import transformers.distributed.mixin as mixin

    from jetflow.target.bundled import prepare_bundled

    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    out = prepare_bundled("smollm2-135m")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    monkeypatch.undo()
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    target = TargetModel.load("smollm2-135m")
    assert target.model.config.model_type == "llama"
