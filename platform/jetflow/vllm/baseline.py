"""The vLLM rows of an evaluation: vLLM's own greedy AR decoding, and its `dflash` chain speculation with a
head exported by `jetflow export --to vllm`, on the evaluation's prompts (a GPU node's vLLM, or vLLM's CPU
build in .venv-vllm: `make setup-vllm`).

Rows follow the evaluation report's row contract (`jetflow.tracking.report.ReportRow`) with methods
`vllm_ar` and `vllm_dflash`, plus what only these rows have: `speedup_vs_vllm_ar` (the two vLLM engines
against each other) and `timing: "end_to_end"` — vLLM's generate() is timed whole, prefill included, so
their tokens/s compare with each other, not with the decode-only tokens/s of our rows. `lossless` of the
DFlash row = its tokens equal vLLM AR's, token for token (same engine, same dtype).

Needs vLLM only when a run starts; everything before — rows, arguments, the speculative config — is plain
Python, tested with a stand-in runner (and for real, with vLLM's CPU build, by `make test-vllm`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from jetflow.errors import InvalidSettingError
from jetflow.tree import TreeSpec
from jetflow.vllm.generate import VllmRun, dflash_config, generate_greedy
from jetflow.vllm.regenerate import model_source

VLLM_METHODS = ("vllm_ar", "vllm_dflash")


def exported_depth(exported: str | Path) -> int:
    """Drafted tokens per step of an exported head: block_size - 1, from its config.json."""
    from jetflow.head.formats import draft_value

    config_file = Path(exported) / "config.json"
    if not config_file.is_file():
        raise InvalidSettingError(f"{exported} is not an exported head (no config.json); write one with "
                                  "`jetflow export --to vllm --head HEAD --out DIR`")
    return int(draft_value(json.loads(config_file.read_text()), "block_size", 16)) - 1


def vllm_rows(model: str, prompts: Mapping[str, Sequence[Sequence[int]]], stop_ids: Sequence[int],
              max_new_tokens: int, *, exported_head: str | Path | None = None, dtype: str = "auto",
              gpu_memory_utilization: float = 0.45,
              run: Callable[..., VllmRun] = generate_greedy) -> list[dict]:
    """Greedy-decode `prompts` ({dataset: [token ids, ...]}) on vLLM for target `model` (bundled name, folder
    or hub id): AR, and DFlash chain speculation with `exported_head` when given (a folder written by
    `jetflow export --to vllm`; num_speculative_tokens = its block_size - 1). One engine per method, each
    dataset's prompts one after another (batch 1, as our timed rows). `dtype`: vLLM's name of the precision
    (pass the target's: vLLM's "auto" runs an fp32 checkpoint in bf16). Returns one row per dataset × method.
    `run` is `jetflow.vllm.generate.generate_greedy` (tests pass a stand-in)."""
    if max_new_tokens < 1:
        raise InvalidSettingError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sets = [name for name in prompts if prompts[name]]
    if not sets:
        raise InvalidSettingError("no prompts to decode")
    flat = [list(p) for name in sets for p in prompts[name]]
    depth = exported_depth(exported_head) if exported_head is not None else 0
    engine = {"dtype": dtype, "gpu_memory_utilization": gpu_memory_utilization,
              "max_model_len": max(map(len, flat)) + max_new_tokens + depth + 1}
    source = model_source(model)
    runs = {"vllm_ar": run(source, flat, max_new_tokens, list(stop_ids), **engine)}
    if exported_head is not None:
        runs["vllm_dflash"] = run(source, flat, max_new_tokens, list(stop_ids),
                                  speculative_config=dflash_config(exported_head, depth), **engine)

    rows, start = [], 0
    for name in sets:
        span = range(start, start + len(prompts[name]))
        start = span.stop
        ar = _totals(runs["vllm_ar"], span)
        for method, r in runs.items():
            t = _totals(r, span)
            chain = TreeSpec("chain", budget=depth + 1, width=1) if method == "vllm_dflash" else None
            rows.append({
                "dataset": name, "method": method, "algorithm": chain.algorithm if chain else None,
                "budget": chain.budget if chain else 1, "width": 1, "temperature": 0.0,
                "tree": chain.to_dict() if chain else None,
                # τ (METHOD.md §4): tokens per target step, bonus included; AR commits one per step
                "tau": 1 + t["accepted"] / t["drafts"] if chain and t["drafts"] else (1.0 if not chain else None),
                "tokens_per_s": t["tokens_per_s"],
                "speedup_vs_vllm_ar": t["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else None,
                "lossless": ([r.token_ids[i] for i in span] == [runs["vllm_ar"].token_ids[i] for i in span]
                             if chain else None),
                "tokens": t["tokens"], "prompts": len(span), "timed_prompts": len(span),
                "timing": "end_to_end", "vllm_version": r.vllm_version,
            })
    return rows


def _totals(run: VllmRun, span: range) -> dict:
    tokens = sum(len(run.token_ids[i]) for i in span)
    seconds = sum(run.prompt_seconds[i] for i in span)
    return {"tokens": tokens, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "drafts": sum(run.prompt_drafts[i] for i in span), "accepted": sum(run.prompt_accepted[i] for i in span)}
