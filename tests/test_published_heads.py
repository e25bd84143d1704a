"""Heads published by others load right, and ours load in their tools.

Checkpoints are written here the way the published formats document them — the config.json fields of the
paper's (JetSpec) heads, of DFlash's heads (z-lab, transformers-4-style configs) — with the DFlash weight names,
never by calling their code. Each must draft, through our decoder, exactly what a head of its kind drafts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from jetflow.decode import DecodeConfig, Decoder
from jetflow.errors import HeadMismatchError, HeadNotFoundError
from jetflow.head import DraftHead, HeadConfig, load_head, save_head
from jetflow.head.formats import published_layer_ids
from jetflow.tree import TreeSpec
from tests.conftest import tiny_target

BLOCK = 6
PROMPT = [3, 17, 42, 8, 99, 23, 57, 11, 64, 5, 30]


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target("qwen3")


def reference_head(target, causal: bool, **overrides) -> DraftHead:
    """A head of the kind under test, built by us: the reference the published checkpoint must equal."""
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, causal=causal, block_size=BLOCK, num_hidden_layers=2,
                                           **overrides))
    with torch.no_grad():  # sharper than the 0.02-std init, so a causal and a bidirectional head draft apart
        for p in head.parameters():
            p.mul_(20 if p.dim() == 2 else 1)
    return head.eval()


def paper_config(cfg: HeadConfig, causal_head: bool) -> dict:
    """config.json of a head published with the paper: the DFlash layout with `dflash_config.causal_head`."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "num_target_layers": cfg.num_target_layers, "dtype": "float32",
        "dflash_config": {"block_size": cfg.block_size, "target_layer_ids": cfg.target_layer_ids,
                          "mask_token_id": cfg.mask_token_id, "causal_head": causal_head},
    }


def dflash_transformers4_config(cfg: HeadConfig) -> dict:
    """config.json as DFlash's published heads carry it: transformers-4 style (rope_theta at the top,
    torch_dtype, rope_scaling null, layer_types, sliding-window settings switched off), `block_size` at the top,
    no causal flag (DFlash heads are bidirectional)."""
    n = cfg.num_hidden_layers
    return {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": cfg.vocab_size - 1, "initializer_range": 0.02,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": n,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": ["full_attention"] * n, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": n, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1", "use_cache": True, "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_target_layers, "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids},
    }


def write_checkpoint(path, head: DraftHead, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def drafted(target, head: DraftHead) -> torch.Tensor:
    """(D, V) logits our decoder drafts after PROMPT."""
    decoder = Decoder(target, head)
    with torch.inference_mode():
        return decoder.draft_logits(decoder._prefill(PROMPT, DecodeConfig(tree=TreeSpec(budget=8))))


@pytest.mark.parametrize("causal", [True, False], ids=["causal_head-true", "causal_head-false"])
def test_a_head_saved_in_the_papers_layout_drafts_the_logits_of_its_kind(qwen3, tmp_path, causal):
    ref = reference_head(qwen3, causal)
    other = reference_head(qwen3, not causal)
    loaded = load_head(write_checkpoint(tmp_path / "paper", ref, paper_config(ref.config, causal_head=causal)))

    assert loaded.config.causal is causal
    torch.testing.assert_close(drafted(qwen3, loaded), drafted(qwen3, ref), atol=1e-5, rtol=0)
    # the other kind drafts other logits, so reading the flag wrong would fail the line above
    assert (drafted(qwen3, other) - drafted(qwen3, ref)).abs().max() > 1e-2


def test_a_dflash_head_with_a_transformers_4_config_loads_bidirectional_with_its_settings(qwen3, tmp_path):
    ref = reference_head(qwen3, causal=False)
    config = dflash_transformers4_config(ref.config)
    loaded = load_head(write_checkpoint(tmp_path / "dflash", ref, config))

    cfg = loaded.config
    assert cfg.causal is False
    assert (cfg.block_size, cfg.rope_theta, cfg.target_layer_ids, cfg.mask_token_id) == (
        BLOCK, ref.config.rope_theta, ref.config.target_layer_ids, ref.config.mask_token_id)
    torch.testing.assert_close(drafted(qwen3, loaded), drafted(qwen3, ref), atol=1e-5, rtol=0)


def test_a_missing_target_layer_ids_takes_the_published_default(qwen3, tmp_path):
    ref = reference_head(qwen3, causal=False, target_layer_ids=[1, 3])  # 2 draft layers, 6 target layers
    config = dflash_transformers4_config(ref.config)
    del config["dflash_config"]["target_layer_ids"]
    loaded = load_head(write_checkpoint(tmp_path / "default", ref, config))
    assert loaded.config.target_layer_ids == published_layer_ids(6, 2) == [1, 3]


def test_the_published_default_taps_one_layer_per_draft_layer():
    assert published_layer_ids(36, 5) == [1, 9, 17, 25, 33]   # Qwen3-8B, a 5-layer DFlash head
    assert published_layer_ids(28, 3) == [1, 13, 25]
    assert published_layer_ids(36, 1) == [18]                 # one draft layer: the middle target layer


def test_a_checkpoint_with_neither_taps_nor_target_depth_is_refused_naming_both(qwen3, tmp_path):
    ref = reference_head(qwen3, causal=False)
    config = dflash_transformers4_config(ref.config)
    del config["dflash_config"]["target_layer_ids"], config["num_target_layers"]
    with pytest.raises(HeadNotFoundError, match="target_layer_ids.*num_target_layers"):
        load_head(write_checkpoint(tmp_path / "none", ref, config))


@pytest.mark.parametrize("where,field,value", [
    ("", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    ("", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ("", "layer_types", ["sliding_attention", "full_attention"]),
    ("", "use_sliding_window", True),
    ("", "attention_bias", True),
    ("", "hidden_act", "gelu"),
    ("", "architectures", ["DFlash2DraftModel"]),
    ("", "eagle_aux_hidden_state_layer_ids", [1, 3]),
    ("", "some_new_field", 1),
    ("dflash_config", "conv_kernel_size", 2),
    ("dflash_config", "output_multiplier", 0.2),
    ("dflash_config", "final_logit_softcapping", 20.0),
])
def test_a_field_the_head_does_not_implement_is_an_error_naming_it(qwen3, tmp_path, where, field, value):
    ref = reference_head(qwen3, causal=False)
    config = dflash_transformers4_config(ref.config)
    (config[where] if where else config)[field] = value
    with pytest.raises(HeadMismatchError, match=field):
        load_head(write_checkpoint(tmp_path / "x", ref, config))


def test_causal_flags_that_disagree_are_refused(qwen3, tmp_path):
    ref = reference_head(qwen3, causal=True)
    config = paper_config(ref.config, causal_head=True)
    config["is_causal"] = False
    with pytest.raises(HeadMismatchError, match="causal flag twice"):
        load_head(write_checkpoint(tmp_path / "both", ref, config))


@pytest.mark.parametrize("causal", [True, False])
def test_heads_we_save_carry_the_causal_flag_under_every_published_name(qwen3, tmp_path, causal):
    save_head(reference_head(qwen3, causal), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # the paper's loader reads causal_head, vLLM is_causal then dflash_config.causal
    assert config["dflash_config"]["causal_head"] is causal
    assert config["dflash_config"]["causal"] is causal and config["is_causal"] is causal


def test_a_hub_id_resolves_to_the_published_head_in_the_local_hub_cache(qwen3, tmp_path, monkeypatch):
    """`--head org/name` (e.g. z-lab/Qwen3-8B-DFlash-b16) finds a head the hub client cached before, laid out
    the way that client lays it out (models--org--name/snapshots/<commit>, refs/main naming the commit)."""
    import huggingface_hub.constants

    from jetflow.head import HeadRef

    ref = reference_head(qwen3, causal=False)
    repo = tmp_path / "hub" / "models--some-lab--Tiny-DFlash"
    write_checkpoint(repo / "snapshots" / ("0" * 40), ref, dflash_transformers4_config(ref.config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    loaded = HeadRef.parse("some-lab/Tiny-DFlash").load(qwen3)
    assert loaded.path == repo / "snapshots" / ("0" * 40) and loaded.causal is False
    torch.testing.assert_close(drafted(qwen3, loaded.head), drafted(qwen3, ref), atol=1e-5, rtol=0)
