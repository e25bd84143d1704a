"""Where an engine step's time goes on a GPU: torch.profiler over a few steps, each engine phase labelled.

    python benchmarks/gpu_profile.py --out DIR                        # one GPU, Qwen3-8B shape: ~2 minutes
    python benchmarks/gpu_profile.py --device cpu --quick --out DIR   # the same code, tiny, on CPU

`benchmarks/gpu_check.py` times the engine's phases (draft, verify + acceptance walk, commit) with the
engine's own clocks; this profiles the same steps to say what inside each phase costs: host time (Python,
kernel launches, host syncs) against the time the device is busy. Three cases, on a randomly initialised
target of the shape (as gpu_check's; `make_target`, `random_head` come from it):

- `engine-b1-n<N>`: one row, an N-node accum_logp tree (N = JetSpec's budget, 128), the published head's layers;
- `engine-b1-plain`: the same engine, budget 1 (plain decoding through the engine);
- `target-step`: `TargetModel.forward` of one token + its logits (the AR loop's step).

Per case and per step: wall ms, device-busy ms (sum of kernel times), kernel launches, host↔device copies and
synchronizations; per labelled phase the host (CPU) ms, the device ms of the kernels it launched and its
launches. Writes DIR/gpu_profile.json and one profiler table per case (DIR/profile-<case>.txt, ops by
self CPU time).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import HEAD_LAYERS, JETSPEC_BUDGET, make_target, random_head, sync  # noqa: E402

LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
COPY = ("cudaMemcpyAsync", "cudaMemcpy")
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def label(obj, attr: str, name: str) -> None:
    """Run obj.attr under a profiler label (an instance's method or a module's function)."""
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def labelled(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    setattr(obj, attr, labelled)


def label_engine(engine) -> None:
    import jetflow.engine.engine as engine_module

    label(engine.policy, "choose", "draft/policy")
    label(engine, "_draft", "draft/head+topk")
    label(engine, "_round_context", "draft/round_context")
    label(engine_module, "build_tree", "draft/build_tree")
    label(engine, "_verify", "verify/forward")
    label(engine, "_accept", "verify/accept_walk")
    label(engine, "_commit", "commit")
    if engine.head is not None:
        label(engine.head, "forward_cached", "draft/head+topk/head_forward")
        label(engine.head, "output_logits", "draft/head+topk/lm_head")


def profile_case(fn, device: torch.device, steps: int, warmup: int = 2) -> tuple[dict, str]:
    for _ in range(warmup):
        fn()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            sync(device)
            walls.append((time.perf_counter() - t0) * 1000)
    from torch.autograd import DeviceType

    events = prof.key_averages()
    raw = prof.events()
    per_step = {"wall_ms": statistics.median(walls), "steps": steps}

    def count(names):
        return sum(e.count for e in events if e.key in names) / steps

    # device busy: the kernels' own time ranges (a label also appears on the device's timeline as a user
    # annotation spanning its kernels and the gaps between them: not counted)
    kernels = [e for e in raw if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    per_step["device_busy_ms"] = sum(e.time_range.elapsed_us() for e in kernels) / 1000 / steps
    per_step["kernel_launches"] = count(LAUNCH)
    per_step["memcpy_calls"] = count(COPY)
    per_step["syncs"] = count(SYNC)
    per_step["aten_ops"] = sum(e.count for e in events if e.key.startswith("aten::")) / steps  # nested ones too
    phases: dict[str, dict] = {}
    for e in raw:  # the labels' host ranges, and the kernels launched inside them
        if e.device_type == DeviceType.CPU and ("/" in e.name or e.name == "commit"):
            ph = phases.setdefault(e.name, {"host_ms": 0.0, "device_ms": 0.0, "calls": 0.0})
            ph["host_ms"] += e.time_range.elapsed_us() / 1000 / steps
            ph["device_ms"] += e.device_time_total / 1000 / steps
            ph["calls"] += 1 / steps
    launches: dict[str, int] = {}
    for ev in raw:  # launches per phase: the innermost labelled range around each launch
        if ev.name in LAUNCH:
            parent, owner = ev.cpu_parent, "(outside phases)"
            while parent is not None:
                if parent.name in phases:
                    owner = parent.name
                    break
                parent = parent.cpu_parent
            launches[owner] = launches.get(owner, 0) + 1
    for name, n in launches.items():
        phases.setdefault(name, {})["kernel_launches"] = n / steps
    per_step["phases"] = phases
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = events.table(sort_by="self_cpu_time_total", row_limit=40)
    if device.type == "cuda":
        table += "\n\n" + events.table(sort_by=sort, row_limit=25)
    return per_step, table


@torch.inference_mode()
def run(args) -> dict:
    from jetflow.decode import DecodeConfig
    from jetflow.engine import Engine, EngineConfig
    from jetflow.tree import TreeSpec

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    target = make_target(args.shape, args.device, dtype, args.quick)
    head = random_head(target, HEAD_LAYERS[args.shape])
    context = 64 if args.quick else 512
    nodes = 16 if args.quick else JETSPEC_BUDGET
    prompt = [(31 * i + 5) % target.vocab_size for i in range(context + 1)]
    from jetflow.eval.cost_model import device_name

    report = {"device_name": device_name(device), "shape": args.shape, "dtype": args.dtype, "context": context, "nodes": nodes, "quick": args.quick,
              "torch": torch.__version__, "cases": {}}
    out = Path(args.out)
    for case, budget in ((f"engine-b1-n{nodes}", nodes), ("engine-b1-plain", 1)):
        engine = Engine(target, head if budget > 1 else None,
                        # the eager engine: its phases are Python methods to label (a compiled step is one graph)
                        EngineConfig(max_slots=1, prefill_chunk=context, prefill_tokens=context, graphs="off"))
        tree = TreeSpec("accum_logp", budget, 7) if budget > 1 else TreeSpec(budget=1)
        engine.add(prompt, DecodeConfig(tree=tree, max_new_tokens=(args.steps + 4) * 17))
        while engine.prefilling or engine.waiting:
            engine.step()
        label_engine(engine)
        stats, table = profile_case(engine.step, device, args.steps)
        report["cases"][case] = stats
        (out / f"profile-{case}.txt").write_text(table + "\n")
        del engine
    cache = target.new_cache()
    target.forward(torch.tensor(prompt[:context], device=device), torch.arange(context, device=device), cache)
    tok, pos = torch.tensor([5], device=device), torch.tensor([context], device=device)

    def step():
        h = target.forward(tok, pos, cache)
        target.logits(h.hidden).argmax(-1).item()
        cache.crop(-1)

    stats, table = profile_case(step, device, args.steps)
    report["cases"]["target-step"] = stats
    (out / "profile-target-step.txt").write_text(table + "\n")
    return report


def summary(report: dict) -> str:
    lines = [f"# Engine step profile — {report['shape']}, {report['dtype']}, context {report['context']}, "
             f"{report['device_name']}", "",
             "| case | wall ms | device busy ms | kernel launches | aten ops | host↔device copies | syncs |",
             "|---|---|---|---|---|---|---|"]
    for case, s in report["cases"].items():
        lines.append(f"| {case} | {s['wall_ms']:.2f} | {s['device_busy_ms']:.2f} | {s['kernel_launches']:.0f} | "
                     f"{s['aten_ops']:.0f} | {s['memcpy_calls']:.0f} | {s['syncs']:.0f} |")
    for case, s in report["cases"].items():
        if not s["phases"]:
            continue
        lines += ["", f"## {case}: phases, per step", "| phase | host ms | device ms | calls | kernel launches |",
                  "|---|---|---|---|---|"]
        for name, p in sorted(s["phases"].items()):
            lines.append(f"| {name} | {p.get('host_ms', 0):.2f} | {p.get('device_ms', 0):.2f} | "
                         f"{p.get('calls', 0):.1f} | {p.get('kernel_launches', 0):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(HEAD_LAYERS))
    p.add_argument("--steps", type=int, default=5, help="profiled steps per case (after 2 warm-up steps)")
    p.add_argument("--quick", action="store_true", help="scaled-down shapes (CPU)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = run(args)
    (Path(args.out) / "gpu_profile.json").write_text(json.dumps(report, indent=2) + "\n")
    md = summary(report)
    (Path(args.out) / "gpu_profile.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
