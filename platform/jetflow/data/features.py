"""Feature cache: tapped target hidden states and the teacher's top-K next-token log-probs for every
regenerated sequence, keyed by content so every sweep trial shares one cache.

Key = (target id, revision, tapped layers, chat template, max length, top-K, data content hash).
Layout: one safetensors file per shard of sequences, flat over tokens:
  tokens (T,) int32 · features (T, k*H) fp16 · teacher_ids (T, K) int32 · teacher_logp (T, K) fp16
  offsets (n+1,) int64 · response_start (n,) int64
Bytes per token = 2·k·H + 4 + 6·K (SmolLM2, k=5, K=8: 5,812 B/token). Teacher row p is the target's
distribution for x_{p+1}; it is only computed from the last prompt token on (rows before stay zero). Shards are written atomically, so an interrupted build resumes.

Where: the folder `features/<key>` of cluster storage (`jetflow.storage`; `$JETFLOW_HOME` on one machine), each
shard published as it is written, so a build resumed on another node skips what storage holds, and every
Ray Train worker reads the cache through its own node's copy.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from jetflow.errors import InvalidSettingError

FP16_MAX = 65504.0


@dataclass(frozen=True)
class FeatureSpec:
    layer_ids: tuple[int, ...]
    max_len: int = 768
    teacher_topk: int = 8
    shard_sequences: int = 64

    @classmethod
    def for_target(cls, target, num_taps: int, max_len: int) -> "FeatureSpec":
        """The default taps (spread from layer 1 to n-3) of `target`."""
        from jetflow.target.model import default_layer_ids

        return cls(layer_ids=tuple(default_layer_ids(target.num_layers, num_taps)), max_len=max_len)

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureSpec":
        """The inverse of `asdict` (a cache's `features.json` "spec", a Ray Train loop config)."""
        return cls(**{**d, "layer_ids": tuple(d["layer_ids"])})

    def bytes_per_token(self, hidden: int) -> int:
        return 2 * len(self.layer_ids) * hidden + 4 + 6 * self.teacher_topk


def feature_key(target, spec: FeatureSpec, data_manifest: dict) -> str:
    content = {
        "target": target.model_id, "revision": target.revision, "layers": list(spec.layer_ids),
        "template": data_manifest.get("chat_template_sha256"), "max_len": spec.max_len,
        "topk": spec.teacher_topk, "data": data_manifest["content_sha256"],
    }
    if target.dtype != torch.float32:  # a bf16/fp16 target taps other numbers: its own cache (fp32 keeps its key)
        content["dtype"] = str(target.dtype).removeprefix("torch.")
    blob = json.dumps(content, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@torch.inference_mode()
def sequence_features(target, ids: list[int], layer_ids, topk: int, teacher_from: int = 0):
    """(S, k*H) taps, (S, K) teacher ids, (S, K) teacher log-probs for one sequence. Teacher rows
    before `teacher_from` (the prompt, which no block drafts) are left zero: the LM head is the
    expensive part."""
    cache = target.new_cache()
    dev = target.device
    out = target.forward(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), cache, None,
                         tuple(layer_ids))
    s = len(ids)
    t_ids = torch.zeros((s, topk), dtype=torch.int32)
    t_logp = torch.zeros((s, topk), dtype=torch.float32)
    logp = torch.log_softmax(target.logits(out.hidden[teacher_from:]).float(), dim=-1)
    top = logp.topk(topk, dim=-1)
    t_ids[teacher_from:], t_logp[teacher_from:] = top.indices.to(torch.int32).cpu(), top.values.cpu()
    return out.features.cpu(), t_ids, t_logp  # stored on the CPU, whatever device computed them


def _usable(row: dict, spec: FeatureSpec) -> bool:
    return min(len(row["prompt_ids"]) + len(row["response_ids"]), spec.max_len) > len(row["prompt_ids"])


def sequence_item(target, spec: FeatureSpec, row: dict) -> dict | None:
    """One regenerated row → the training item the cache stores (fp16 features and teacher log-probs),
    or None when no response token fits within `max_len`."""
    if not _usable(row, spec):
        return None
    ids = (row["prompt_ids"] + row["response_ids"])[: spec.max_len]
    f, ti, tl = sequence_features(target, ids, spec.layer_ids, spec.teacher_topk,
                                  teacher_from=len(row["prompt_ids"]) - 1)
    peak = f.abs().max().item()
    if peak > FP16_MAX:
        raise InvalidSettingError(f"tapped activations reach {peak:.3g} > fp16 range; tap other layers")
    return {"tokens": torch.tensor(ids, dtype=torch.long), "features": f.half(), "teacher_ids": ti.long(),
            "teacher_logp": tl.half(), "response_start": len(row["prompt_ids"])}


def build_features(regen_dir: Path, target, spec: FeatureSpec, out: Path | None = None, progress: bool = True) -> Path:
    """Compute (or resume) the feature cache for a regenerated dataset. Returns its folder."""
    from tqdm import tqdm

    from jetflow.data.regenerate import MANIFEST, load_regenerated
    from jetflow.storage import storage

    manifest = json.loads((regen_dir / MANIFEST).read_text())
    rel, present = None, {}
    if out is None:  # the content-keyed folder in cluster storage: shards already there are kept
        rel = f"features/{feature_key(target, spec, manifest)}"
        out, present = storage().staging(rel), storage().files(rel)
    out.mkdir(parents=True, exist_ok=True)
    data = load_regenerated(regen_dir)
    n = len(data)
    shards = [(i, min(i + spec.shard_sequences, n)) for i in range(0, n, spec.shard_sequences)]
    for s, (lo, hi) in enumerate(tqdm(shards, desc="features", unit="shard", disable=not progress)):
        path = out / f"shard-{s:05d}.safetensors"
        if path.exists() or path.name in present:
            continue
        toks, feats, t_ids, t_logp, offsets, starts = [], [], [], [], [0], []
        for row in data.select(range(lo, hi)):
            item = sequence_item(target, spec, row)
            if item is None:
                continue
            toks.append(item["tokens"].to(torch.int32))
            feats.append(item["features"])
            t_ids.append(item["teacher_ids"].to(torch.int32))
            t_logp.append(item["teacher_logp"])
            offsets.append(offsets[-1] + len(item["tokens"]))
            starts.append(item["response_start"])
        tensors = {
            "tokens": torch.cat(toks), "features": torch.cat(feats), "teacher_ids": torch.cat(t_ids),
            "teacher_logp": torch.cat(t_logp), "offsets": torch.tensor(offsets, dtype=torch.int64),
            "response_start": torch.tensor(starts, dtype=torch.int64),
        }
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        if rel is not None:
            storage().publish(rel, [path.name])
    meta = {"spec": asdict(spec), "data_manifest": manifest, "shards": len(shards),
            "target_model_id": target.model_id, "target_revision": target.revision,
            "bytes_per_token": spec.bytes_per_token(target.hidden_size)}
    (out / "features.json").write_text(json.dumps(meta, indent=2) + "\n")
    if rel is not None:
        storage().publish(rel, ["features.json"])
    return out


class FeatureCache:
    """Read side: sequences of (tokens, features, teacher ids, teacher log-probs, response start)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "features.json").read_text())
        self._index: list[tuple[int, int]] = []
        self._shards: list[dict[str, torch.Tensor]] = []
        for s in range(self.meta["shards"]):
            shard = load_file(str(self.folder / f"shard-{s:05d}.safetensors"))
            self._shards.append(shard)
            self._index += [(s, j) for j in range(len(shard["response_start"]))]

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | int]:
        s, j = self._index[i]
        shard = self._shards[s]
        lo, hi = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
        return {"tokens": shard["tokens"][lo:hi].long(), "features": shard["features"][lo:hi],
                "teacher_ids": shard["teacher_ids"][lo:hi].long(), "teacher_logp": shard["teacher_logp"][lo:hi],
                "response_start": int(shard["response_start"][j])}

    @property
    def tokens(self) -> int:
        return sum(int(s["offsets"][-1]) for s in self._shards)


class OnlineFeatures:
    """The feature cache's read side computed on the fly from the regenerated data (no disk beyond the
    Arrow tokens): each item is one target forward, bit-identical to what `build_features` stores.
    For when disk is short; costs a target forward per sequence per epoch."""

    def __init__(self, regen_dir: Path, target, spec: FeatureSpec):
        from jetflow.data.regenerate import MANIFEST, load_regenerated

        self.target, self.spec, self.regen_dir = target, spec, Path(regen_dir)
        manifest = json.loads((Path(regen_dir) / MANIFEST).read_text())
        data = load_regenerated(Path(regen_dir))
        self._rows = [row for row in data if _usable(row, spec)]
        self.meta = {"spec": asdict(spec), "data_manifest": manifest, "online": True,
                     "target_model_id": target.model_id, "target_revision": target.revision,
                     "bytes_per_token": 0}

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | int]:
        return sequence_item(self.target, self.spec, self._rows[i])

    @property
    def tokens(self) -> int:
        return sum(min(len(r["prompt_ids"]) + len(r["response_ids"]), self.spec.max_len) for r in self._rows)
