"""vLLM as the regeneration backend (`RegenConfig(backend="vllm")`).

Same prompts, same chat template, same stop tokens, same shard files and manifest as the HF backend:
only the engine that produces the response ids differs. vLLM schedules a whole shard at once
(continuous batching), so `batch_size` does not apply. A plug-in of `data.regenerate` (its `PLUGINS`), which
imports this module by name when the backend is asked for: `check()` and `regenerate_shard(...)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jetflow.data.prompts import PromptItem
from jetflow.data.shards import SCHEMA, cut_at_stop, encode_shard, write_shard
from jetflow.vllm import require_vllm


def model_source(name: str) -> str:
    """What vLLM loads for a JetFlow target name: a bundled target's converted HF folder, a local
    folder, or a hub id as given."""
    from jetflow.target.bundled import BUNDLED, prepare_bundled

    if name in BUNDLED:
        return str(prepare_bundled(name))
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


def engine(cfg):
    """This process's vLLM engine for a `RegenConfig`: its target, in its dtype (fp32 on a CPU), long enough for
    a prompt and its answer (`jetflow.vllm.engine`: built once)."""
    from jetflow.vllm.engine import engine as vllm_engine
    from jetflow.vllm.engine import on_cpu, vllm_dtype

    # A GPU captures CUDA graphs (a regeneration's thousands of steps repay the capture). On vLLM's CPU build
    # compiling (inductor) took 73 s to start against 21 s eager, for 47 against 40 tok/s single-stream on the
    # bundled target (shared 2-core host): eager, the engine the baseline rows and tests build too.
    return vllm_engine(model_source(cfg.model), dtype=vllm_dtype(cfg.target_dtype()),
                       max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens, enforce_eager=on_cpu())


def rows_from_outputs(encoded: list[tuple[str, list[int]]], generated: Sequence[Sequence[int]],
                      eos: set[int]) -> tuple[dict[str, list], int]:
    """[(prompt_id, prompt ids)] and each prompt's generated ids (vLLM's CompletionOutput.token_ids)
    → (SCHEMA columns, response tokens). Cut at the first stop token exactly as the HF backend cuts."""
    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    tokens = 0
    for (pid, ids), gen in zip(encoded, generated, strict=True):
        resp, finish = cut_at_stop(list(gen), eos)
        rows["prompt_id"].append(pid)
        rows["prompt_ids"].append(ids)
        rows["response_ids"].append(resp)
        rows["finish_reason"].append(finish)
        tokens += len(resp)
    return rows, tokens


def check() -> None:
    """VllmUnavailableError (with the install command) when vLLM is not installed."""
    require_vllm("regeneration with backend='vllm'")


def regenerate_shard(cfg, items: list[PromptItem], path: Path, target=None) -> dict:
    """The vLLM twin of `data.regenerate.regenerate_shard`: answer one shard of `cfg` (a `RegenConfig`), write
    it atomically, return counts. `target` (a TargetModel) supplies the tokenizer and stop ids."""
    vllm = require_vllm("regeneration with backend='vllm'")
    from jetflow.decode.prompt import stop_token_ids
    from jetflow.target import TargetModel

    target = target or TargetModel.load(cfg.model)
    encoded, skipped = encode_shard(items, target.tokenizer, cfg.max_prompt_tokens)
    eos = stop_token_ids(target)  # the same stops the decoder and the HF backend use
    generated: list[Sequence[int]] = []
    if encoded:
        params = vllm.SamplingParams(
            max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=1.0, top_k=0,
            stop_token_ids=sorted(eos), detokenize=False,
        )
        llm = engine(cfg)
        outputs = llm.generate([vllm.TokensPrompt(prompt_token_ids=ids) for _, ids in encoded], params,
                               use_tqdm=False)
        generated = [out.outputs[0].token_ids for out in outputs]  # vLLM returns them in input order
    rows, tokens = rows_from_outputs(encoded, generated, eos)
    write_shard(rows, path)
    return {"prompts": len(encoded), "skipped": skipped, "response_tokens": tokens}
