"""Draft head: checkpoints in the DFlash layout, causal vs bidirectional masking, config validation,
and refusal of a head that does not fit its target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from jetflow.decode import Decoder
from jetflow.errors import HeadMismatchError, HeadNotFoundError, InvalidSettingError, JetFlowError
from jetflow.head import DraftHead, HeadConfig, check_fits, load_head, save_head
from jetflow.target import default_layer_ids
from tests.conftest import tiny_target

CTX = 7        # context tokens in the single-block tests
BLOCK = 6      # block_size of the tiny heads


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target("qwen3")


def _head(target, causal: bool = True, seed: int = 0, **overrides) -> DraftHead:
    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(target, causal=causal, block_size=BLOCK, **overrides)
    return DraftHead(cfg).eval()


@pytest.fixture(scope="module")
def inputs(qwen3):
    """Real target taps for CTX random tokens, and the block [anchor, MASK x D] embedded by the target,
    as every head made by `_head` reads them.
    (raw features (1, T, k*H), block (1, B, H), ctx positions (1, T), block positions (1, B))."""
    cfg = _head(qwen3).config
    ids = torch.randint(0, qwen3.vocab_size - 1, (CTX + 1,), generator=torch.Generator().manual_seed(0))
    out = qwen3.forward(ids[:CTX], torch.arange(CTX), qwen3.new_cache(), None, cfg.target_layer_ids)
    block_ids = torch.tensor([int(ids[CTX])] + [cfg.mask_token_id] * cfg.depth)
    with torch.no_grad():
        block = qwen3.embed(block_ids)
    return (out.features[None].clone(), block[None].clone(), torch.arange(CTX)[None],
            torch.arange(CTX, CTX + BLOCK)[None])


@torch.no_grad()
def _run(head: DraftHead, features, block, ctx_pos, block_pos, mask=None) -> torch.Tensor:
    return head(head.project_context(features), block, ctx_pos, block_pos, mask)


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() > 1e-4


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_saved_and_loaded_head_gives_identical_outputs_and_keeps_its_config(qwen3, inputs, tmp_path, causal):
    head = _head(qwen3, causal=causal, extra={"note": "round trip"})
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head")

    assert torch.equal(_run(loaded, *inputs), _run(head, *inputs))
    cfg = loaded.config
    assert cfg.block_size == BLOCK
    assert cfg.target_layer_ids == head.config.target_layer_ids == default_layer_ids(qwen3.num_layers)
    assert cfg.mask_token_id == head.config.mask_token_id
    assert cfg.causal is causal
    assert cfg.target_model_id == "tiny-qwen3"
    assert cfg.target_revision == "random"
    assert cfg == head.config  # every other field too (sizes, eps, RoPE base, extra)


def test_checkpoint_uses_the_dflash_key_layout_and_config(qwen3, tmp_path):
    head = _head(qwen3, causal=False)
    save_head(head, tmp_path)
    per_layer = [
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "input_layernorm.weight", "post_attention_layernorm.weight",
    ]
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(head.config.num_hidden_layers) for name in per_layer
    }
    assert set(load_file(str(tmp_path / "model.safetensors"))) == expected

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == BLOCK
    assert config["dflash_config"]["block_size"] == BLOCK
    assert config["dflash_config"]["target_layer_ids"] == head.config.target_layer_ids
    assert config["dflash_config"]["mask_token_id"] == head.config.mask_token_id
    assert config["dflash_config"]["causal"] is False
    assert config["is_causal"] is False


# ------------------------------------------------------------------------------ masking
@pytest.mark.parametrize("j", [1, 3, BLOCK - 1])
def test_causal_head_outputs_before_a_block_position_ignore_it_and_bidirectional_ones_do_not(qwen3, inputs, j):
    for causal in (True, False):
        head = _head(qwen3, causal=causal)
        features, block, ctx_pos, block_pos = inputs
        changed = block.clone()
        changed[0, j] = torch.randn(block.shape[-1], generator=torch.Generator().manual_seed(1))
        before = _run(head, features, block, ctx_pos, block_pos)
        after = _run(head, features, changed, ctx_pos, block_pos)

        for i in range(j, BLOCK):
            assert _differs(after[0, i], before[0, i]), (causal, i)
        if causal:
            torch.testing.assert_close(after[0, :j], before[0, :j], rtol=0, atol=1e-6)
        else:
            for i in range(j):
                assert _differs(after[0, i], before[0, i]), (causal, i)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_context_features_reach_every_block_position(qwen3, inputs, causal):
    head = _head(qwen3, causal=causal)
    features, block, ctx_pos, block_pos = inputs
    changed = features.clone()
    changed[0, 0] = torch.randn(features.shape[-1], generator=torch.Generator().manual_seed(2)) * 3
    before = _run(head, features, block, ctx_pos, block_pos)
    after = _run(head, changed, block, ctx_pos, block_pos)
    for i in range(BLOCK):
        assert _differs(after[0, i], before[0, i]), i


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_explicit_block_mask_equals_the_default_mask(qwen3, inputs, causal):
    head = _head(qwen3, causal=causal)
    features, block, ctx_pos, block_pos = inputs
    mask = head.block_mask(CTX, BLOCK)
    assert mask.shape == (1, 1, BLOCK, CTX + BLOCK) and mask.dtype == torch.bool
    assert torch.equal(_run(head, features, block, ctx_pos, block_pos, mask=mask),
                       _run(head, features, block, ctx_pos, block_pos))


# -------------------------------------------------------------------- fit to the target
def _refusals(cfg: HeadConfig, target) -> list[str]:
    """The messages of check_fits and of Decoder(target, head), both of which must refuse."""
    messages = []
    with pytest.raises(HeadMismatchError) as by_check:
        check_fits(cfg, target)
    messages.append(str(by_check.value))
    with pytest.raises(HeadMismatchError) as by_decoder:
        Decoder(target, DraftHead(cfg))
    messages.append(str(by_decoder.value))
    return messages


def test_head_with_another_hidden_size_is_refused_naming_the_hidden_size(qwen3):
    cfg = HeadConfig.for_target(qwen3, hidden_size=qwen3.hidden_size * 2)
    for message in _refusals(cfg, qwen3):
        assert "hidden size" in message and str(qwen3.hidden_size * 2) in message
        assert "vocab" not in message and "target_layer_ids" not in message


def test_head_with_another_vocab_size_is_refused_naming_the_vocab_size(qwen3):
    cfg = HeadConfig.for_target(qwen3, vocab_size=qwen3.vocab_size + 64)
    for message in _refusals(cfg, qwen3):
        assert "vocab size" in message and str(qwen3.vocab_size + 64) in message
        assert "hidden size" not in message and "target_layer_ids" not in message


def test_head_tapping_layers_beyond_the_target_is_refused_naming_target_layer_ids(qwen3):
    cfg = HeadConfig.for_target(qwen3, target_layer_ids=[1, qwen3.num_layers, qwen3.num_layers + 3])
    for message in _refusals(cfg, qwen3):
        assert "target_layer_ids" in message
        assert f"[{qwen3.num_layers}, {qwen3.num_layers + 3}]" in message
        assert "hidden size" not in message and "vocab" not in message


def test_head_with_a_negative_layer_id_is_refused(qwen3):
    cfg = HeadConfig.for_target(qwen3, target_layer_ids=[-1, 2])
    for message in _refusals(cfg, qwen3):
        assert "target_layer_ids [-1]" in message


def test_head_made_for_the_target_fits_it(qwen3):
    cfg = HeadConfig.for_target(qwen3)
    check_fits(cfg, qwen3)
    assert Decoder(qwen3, DraftHead(cfg)).head is not None


# -------------------------------------------------------------------------- loading
def test_load_head_on_a_missing_path_raises_head_not_found(tmp_path):
    with pytest.raises(HeadNotFoundError, match="no head"):
        load_head(tmp_path / "nowhere")


def test_load_head_on_a_folder_without_weights_raises_head_not_found(qwen3, tmp_path):
    save_head(_head(qwen3), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert (tmp_path / "config.json").exists()
    with pytest.raises(HeadNotFoundError, match="model.safetensors"):
        load_head(tmp_path)


def test_load_head_resolves_a_bare_name_under_jetflow_home_heads(qwen3, tmp_path, monkeypatch):
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # the bare name must not be found relative to the working directory
    head = _head(qwen3, causal=False)
    save_head(head, tmp_path / "heads" / "my-head")
    loaded = load_head("my-head")
    assert loaded.config == head.config
    for (name, a), (_, b) in zip(sorted(loaded.state_dict().items()), sorted(head.state_dict().items())):
        assert torch.equal(a, b), name
    with pytest.raises(HeadNotFoundError, match="other-head"):
        load_head("other-head")


def test_load_head_on_a_model_folder_that_is_not_a_head_is_refused(qwen3, tmp_path):
    # e.g. `--head ~/.jetflow/models/smollm2-135m`: config.json and model.safetensors, but no dflash_config
    qwen3.model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    with pytest.raises((HeadNotFoundError, HeadMismatchError), match="head"):
        load_head(tmp_path)


def test_load_head_whose_weights_do_not_match_its_config_raises_head_mismatch(qwen3, tmp_path):
    save_head(_head(qwen3), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] *= 2  # same keys, other shapes
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadMismatchError, match="do not match"):
        load_head(tmp_path)


def test_load_head_with_an_unreadable_config_raises_a_user_error(qwen3, tmp_path):
    save_head(_head(qwen3), tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(JetFlowError, match="config.json"):
        load_head(tmp_path)


# ----------------------------------------------------------------------- validation
def _valid(**overrides) -> dict:
    return dict(hidden_size=64, vocab_size=128, target_layer_ids=[1, 2], mask_token_id=127,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16) | overrides


def test_head_config_accepts_a_valid_setting():
    assert HeadConfig(**_valid()).depth == 15


@pytest.mark.parametrize("block_size", [1, 0, -4])
def test_head_config_rejects_block_size_below_two(block_size):
    with pytest.raises(InvalidSettingError, match="block_size"):
        HeadConfig(**_valid(block_size=block_size))


def test_head_config_rejects_empty_target_layer_ids():
    with pytest.raises(InvalidSettingError, match="target_layer_ids"):
        HeadConfig(**_valid(target_layer_ids=[]))


@pytest.mark.parametrize("mask_token_id", [128, 1000, -1])
def test_head_config_rejects_mask_token_outside_the_vocab(mask_token_id):
    with pytest.raises(InvalidSettingError, match="mask_token_id"):
        HeadConfig(**_valid(mask_token_id=mask_token_id))


# ------------------------------------------------------------------ the real target
@pytest.mark.slow
def test_head_config_for_smollm_matches_the_target(smollm):
    cfg = HeadConfig.for_target(smollm)
    assert cfg.hidden_size == 576
    assert cfg.target_layer_ids == default_layer_ids(30) == [1, 8, 14, 20, 27]
    assert cfg.num_target_layers == 30
    assert 0 <= cfg.mask_token_id < smollm.vocab_size == cfg.vocab_size
    # MASK must not be a token of ordinary chat text (the anchor block would become ambiguous)
    chat = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                                add_generation_prompt=True, tokenize=False)
    assert cfg.mask_token_id not in smollm.tokenizer.encode(chat + " Four.", add_special_tokens=False)

    t = smollm.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    assert cfg.rope_theta == t.rope_parameters["rope_theta"] == 100000.0
    assert cfg.intermediate_size == t.intermediate_size
    assert cfg.max_position_embeddings == smollm.max_positions
    assert cfg.target_model_id == "smollm2-135m" and cfg.target_revision == smollm.revision != "unknown"

    head = DraftHead(cfg)
    check_fits(cfg, smollm)
    attn = head.layers[0].self_attn
    assert attn.q_proj.weight.shape == (9 * 64, 576) and attn.k_proj.weight.shape == (3 * 64, 576)
    assert head.fc.weight.shape == (576, 5 * 576)
