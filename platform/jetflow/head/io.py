"""Head checkpoints: `config.json` (DFlash layout) + `model.safetensors`, and the fit check against a target."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from jetflow.errors import HeadMismatchError, HeadNotFoundError
from jetflow.head.config import HeadConfig
from jetflow.head.model import DraftHead
from jetflow.head.ref import local_head_path

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def save_head(head: DraftHead, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    save_file(state, str(path / WEIGHTS), metadata={"format": "pt", "layout": "dflash"})
    config = head.config.to_dflash_dict()
    config["dtype"] = str(next(head.parameters()).dtype).removeprefix("torch.")
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path


def load_head(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DraftHead:
    path = local_head_path(path)
    if not (path / CONFIG).exists() or not (path / WEIGHTS).exists():
        raise HeadNotFoundError(f"{path} is not a head checkpoint: it needs {CONFIG} and {WEIGHTS}")
    try:
        cfg = HeadConfig.from_dflash_dict(json.loads((path / CONFIG).read_text()))
    except json.JSONDecodeError as exc:
        raise HeadNotFoundError(f"{path / CONFIG} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except (KeyError, TypeError) as exc:
        raise HeadNotFoundError(
            f"{path} is not a draft-head checkpoint: its config.json lacks {exc} "
            "(a DFlash-layout head needs dflash_config.target_layer_ids and mask_token_id)"
        ) from None
    except HeadMismatchError as exc:  # a field the head does not implement, or conflicting causal flags
        raise HeadMismatchError(f"{path / CONFIG}: {exc}") from None
    head = DraftHead(cfg)
    try:
        missing, unexpected = head.load_state_dict(load_file(str(path / WEIGHTS)), strict=False)
    except RuntimeError as exc:  # size mismatches between config.json and the weights
        first = next((ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln), str(exc)[:200])
        raise HeadMismatchError(f"{path}: weights do not match its config.json ({first})") from None
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise HeadMismatchError(f"{path}: weights do not match its config (missing {missing[:4]}, unexpected {unexpected[:4]})")
    head = head.to(device=device, dtype=dtype).eval()
    from jetflow.tree.profile import PROFILE_FILE, AcceptanceProfile  # tree/ does not import head/

    if (path / PROFILE_FILE).exists():  # the head's own acceptance profile, for depth_rank_histogram & co.
        head.tree_profile = AcceptanceProfile.load(path / PROFILE_FILE)
    return head


def check_fits(cfg: HeadConfig, target) -> None:
    """Refuse a head that cannot read `target`'s features or write into its vocabulary; say which part."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab size {cfg.vocab_size} != target's {target.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers")
    if problems:
        raise HeadMismatchError(
            f"head (trained for {cfg.target_model_id or 'an unnamed target'}) does not fit target "
            f"{target.model_id}: " + "; ".join(problems)
        )
