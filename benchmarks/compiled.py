"""Eager vs the compiled step core (`graphs=off` vs `graphs=compile`), side by side in one run, on this machine.

    python benchmarks/compiled.py --head demo                      # every part (~40 min on 2 CPU cores, cold cache)
    python benchmarks/compiled.py --head demo --parts single,verify --prompts 4
    python benchmarks/compiled.py --head demo --record             # also keep the verdict graphs=auto follows

Parts (compile time is always reported apart from the timings, which start after every graph is compiled):

- single: AR, and the serving setting (`--algorithm`/`--budget`/`--width`, the demo's by default) with the head,
  single stream on `--prompts` held-out MT-Bench + HumanEval prompts each, the two modes alternating prompt by
  prompt (`jetflow.eval.graphs`): decode tokens/s, their ratio, greedy outputs compared;
- verify: the engine step of one row at `--context` cached tokens for trees of N = 1 … 64 nodes, eager and
  compiled engines stepped in turn: the verify phase (target forward + acceptance) and the whole step;
- cache: what a second process pays to compile the same graphs (inductor's on-disk cache, fresh for the first);
- serve: the engine through Ray Serve at 1 and 8 clients, an eager and a compiled app of the same head and tree
  (policy fixed, 8 slots, prompts of at most 200 tokens: the held-out prompts here have 52-172), requests and
  load blocks alternating between them; the compiled replica's start (its graphs compiled before traffic) and
  both replicas' RSS;
- footprint: an engine process with Serve's settings at `--slots` slots (default 16, the replica memory goal's),
  eager and compiled, each fresh: resident anonymous and file-backed memory after its graphs are compiled
  and after serving as many requests;
- memory: the static KV's reservation and resident cost per token, at 8 and 16 slots, bundled target and Qwen3-8B.

Writes compiled.json and compiled.md under --out (default $JETFLOW_HOME/bench/compiled/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m"


def _prompts(target, n: int) -> list[list[int]]:
    from jetflow.data import load_prompts
    from jetflow.decode import encode_prompt

    items = load_prompts("mtbench", limit=n) + load_prompts("humaneval", limit=n)
    return [encode_prompt(target.tokenizer, it.chat) for it in items]


# ------------------------------------------------------------------------------------------ single stream
def part_single(args, target, head, tree) -> dict:
    from jetflow.eval.graphs import measure, measure_and_record

    prompts = _prompts(target, args.prompts)
    fn = measure_and_record if args.record else measure
    result = fn(target, prompts, head, tree, args.new_tokens, args.passes)
    if args.record:
        result, key = result
        result["recorded_for"] = key
    return result


# ------------------------------------------------------------------------------------------ verify t(N)
def part_verify(args, target, head) -> dict:
    import torch

    from jetflow.decode import DecodeConfig
    from jetflow.engine import Engine, EngineConfig
    from jetflow.engine.cost import _SetTree
    from jetflow.tree import TreeSpec

    sizes = [int(n) for n in args.nodes.split(",")]
    trees = [TreeSpec("accum_logp", n, 7) if n > 1 else TreeSpec(budget=1) for n in sizes]
    engines = {}
    prompt = [(17 * i + 5) % target.vocab_size for i in range(args.context + 1)]
    for mode in ("off", "compile"):
        policy = _SetTree(trees[0])
        engine = Engine(target, head, EngineConfig(max_slots=1, prefill_chunk=args.context + 1,
                                                   prefill_tokens=args.context + 1, graphs=mode), policy=policy)
        engine.add(prompt, DecodeConfig(tree=trees[-1], max_new_tokens=engine.max_len - args.context - 64))
        while engine.prefilling or engine.waiting:
            engine.step()
        engines[mode] = (engine, policy)
    samples = {(m, n): {"verify": [], "step": []} for m in engines for n in sizes}
    with torch.inference_mode():
        for k in range(args.repeats + 1):
            for j in (range(len(sizes)) if k % 2 == 0 else reversed(range(len(sizes)))):
                for mode in (("off", "compile") if (k + j) % 2 == 0 else ("compile", "off")):
                    engine, policy = engines[mode]
                    policy.tree = trees[j]
                    t0 = time.perf_counter()
                    engine.step()
                    if k:  # round 0: every shape once (the compiled engine compiles its graphs there)
                        samples[(mode, sizes[j])]["verify"].append(engine.times.verify * 1000)
                        samples[(mode, sizes[j])]["step"].append((time.perf_counter() - t0) * 1000)
    rows = []
    for n in sizes:
        off = {k: statistics.median(v) for k, v in samples[("off", n)].items()}
        on = {k: statistics.median(v) for k, v in samples[("compile", n)].items()}
        rows.append({"nodes": n, "eager_verify_ms": off["verify"], "compiled_verify_ms": on["verify"],
                     "verify_ratio": off["verify"] / on["verify"], "eager_step_ms": off["step"],
                     "compiled_step_ms": on["step"], "step_ratio": off["step"] / on["step"]})
    return {"context": args.context, "repeats": args.repeats, "rows": rows,
            "compile_s": engines["compile"][0].compile_s, "buckets": engines["compile"][0].compile_log}


# ------------------------------------------------------------------------------------------ compile cache
WARM_CHILD = """
import json, sys, time, torch
from jetflow.decode import DecodeConfig
from jetflow.engine import decoder_for
from jetflow.head import HeadRef
from jetflow.target import TargetModel
from jetflow.tree import TreeSpec
head, alg, budget, width, prompt_len, new = sys.argv[1:7]
t0 = time.perf_counter()
target = TargetModel.load("smollm2-135m")
loaded = HeadRef.parse(head).load(target)
dec = decoder_for(target, loaded.head, "compile")
ar = dec.warm(int(prompt_len), DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=int(new)))
tree = dec.warm(int(prompt_len), DecodeConfig(tree=TreeSpec(alg, int(budget), int(width)), max_new_tokens=int(new)))
print(json.dumps({"compile_s": ar + tree, "buckets": dec.compile_log, "wall_s": time.perf_counter() - t0}))
"""


def part_cache(args) -> dict:
    """Two fresh processes compile the same graphs, the first with an empty inductor cache."""
    import tempfile

    runs = []
    with tempfile.TemporaryDirectory(prefix="jf-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache + "/triton",
               "PYTHONPATH": str(ROOT / "platform")}
        for _ in range(2):
            proc = subprocess.run([sys.executable, "-c", WARM_CHILD, args.head, args.algorithm, str(args.budget),
                                   str(args.width), "300", str(args.new_tokens)], capture_output=True, text=True,
                                  env=env, timeout=3600)
            if proc.returncode:
                raise RuntimeError(proc.stderr[-2000:])
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {"first_process_s": runs[0]["compile_s"], "second_process_s": runs[1]["compile_s"],
            "ratio": runs[0]["compile_s"] / runs[1]["compile_s"], "buckets": runs[0]["buckets"],
            "second_buckets": runs[1]["buckets"]}


# ------------------------------------------------------------------------------------------ Serve
def part_serve(args) -> dict:
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import openai
    import ray
    import requests
    from ray import serve
    from ray.serve.api import RunTarget

    from jetflow.data import load_prompts
    from jetflow.serving.app import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts = [it.text for it in load_prompts("humaneval", limit=args.prompts)
               + load_prompts("mtbench", limit=args.prompts)]
    common = {"head": args.head, "algorithm": args.algorithm, "budget": args.budget, "width": args.width,
              "policy": "fixed", "max_slots": 8, "max_prompt_tokens": 200, "max_tokens": args.new_tokens,
              "default_max_tokens": args.new_tokens,
              "torch_threads": args.threads, "replica_cpus": 0.5}
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    out: dict = {"apps": {}}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        for mode in ("off", "compile"):
            t0 = time.perf_counter()
            serve.run_many([RunTarget(build_app({**common, "graphs": mode}), name=mode, route_prefix=f"/{mode}")])
            out["apps"][mode] = {"start_s": time.perf_counter() - t0}
        clients = {m: openai.OpenAI(base_url=f"{base}/{m}/v1", api_key="unused", max_retries=0, timeout=900)
                   for m in ("off", "compile")}

        def one(mode: str, prompt: str) -> tuple[int, str, float]:
            t0 = time.perf_counter()
            r = clients[mode].chat.completions.create(model=TARGET, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=args.new_tokens, temperature=0)
            return r.usage.completion_tokens, r.choices[0].message.content, time.perf_counter() - t0

        for mode in clients:  # one unmeasured request each
            one(mode, "hi")
        single = {m: {"tokens": 0, "wall_s": 0.0, "texts": []} for m in clients}
        for i, prompt in enumerate(prompts):
            for mode in (("off", "compile") if i % 2 == 0 else ("compile", "off")):
                n, text, wall = one(mode, prompt)
                single[mode]["tokens"] += n
                single[mode]["wall_s"] += wall
                single[mode]["texts"].append(text)
        out["one_client"] = {m: {"tok_s": r["tokens"] / r["wall_s"], "tokens": r["tokens"]} for m, r in single.items()}
        out["one_client"]["ratio"] = out["one_client"]["compile"]["tok_s"] / out["one_client"]["off"]["tok_s"]
        out["one_client"]["identical"] = single["off"]["texts"] == single["compile"]["texts"]
        load = {m: {"tokens": 0, "wall_s": 0.0, "texts": {}} for m in clients}
        for block in range(args.blocks):
            for mode in (("off", "compile") if block % 2 == 0 else ("compile", "off")):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(8) as pool:
                    results = list(pool.map(lambda p: one(mode, p), prompts * max(1, 16 // len(prompts))))
                load[mode]["wall_s"] += time.perf_counter() - t0
                load[mode]["tokens"] += sum(r[0] for r in results)
                for p, r in zip(prompts, results):
                    load[mode]["texts"].setdefault(p, r[1])
        out["eight_clients"] = {m: {"tok_s": r["tokens"] / r["wall_s"], "tokens": r["tokens"]} for m, r in load.items()}
        out["eight_clients"]["ratio"] = out["eight_clients"]["compile"]["tok_s"] / out["eight_clients"]["off"]["tok_s"]
        out["eight_clients"]["identical"] = load["off"]["texts"] == load["compile"]["texts"]
        for mode in clients:
            out["apps"][mode]["rss_bytes"] = requests.get(f"{base}/{mode}/healthz", timeout=30).json()["rss_bytes"]
    finally:
        serve.shutdown()
        ray.shutdown()
    out["common"] = common
    return out


# ------------------------------------------------------------------------------------------ memory
FOOTPRINT_CHILD = """
import gc, json, sys, torch
from jetflow.decode import DecodeConfig
from jetflow.engine import Engine, EngineConfig
from jetflow.head import HeadRef
from jetflow.target import TargetModel
from jetflow.tree import TreeSpec
head, alg, budget, width, slots, max_len, mode, threads = sys.argv[1:9]
torch.set_num_threads(int(threads))
def mem(stage, **kw):
    st = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("Rss")}
    stages.append({"stage": stage, "anon": st["RssAnon"], "file": st["RssFile"], **kw})
stages = []
target = TargetModel.load("smollm2-135m")
loaded = HeadRef.parse(head).load(target)
tree = TreeSpec(alg, int(budget), int(width))
engine = Engine(target, loaded.head, EngineConfig(max_slots=int(slots), max_model_len=int(max_len), policy="fixed",
                                                  graphs=mode))
engine.warm_lm_head()
mem("engine built")
buckets = lambda: len(engine.compile_log)
if engine.runner is not None:  # Serve's warm: the step's graphs
    engine.warm_graphs(tree.width)
    mem("graphs compiled", buckets=buckets())
prompts = [[(17 * i + 5 * k) % target.vocab_size for i in range(200)] for k in range(int(slots))]
engine.generate(prompts, DecodeConfig(tree=tree, max_new_tokens=32))
gc.collect()
mem(f"{slots} requests served", buckets=buckets())
print(json.dumps(stages))
"""


def part_footprint(args) -> dict:
    """Resident memory of an engine process with Serve's settings (`--slots`, max_model_len 200 + `--new-tokens`),
    eager and compiled, each in a fresh process: anonymous (the heap, the KV, compiled code, packed weights) and
    file-backed (the mmapped weights, libraries) apart, after the graphs are compiled, and after serving `--slots`
    requests."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    out = {}
    for mode in ("off", "compile"):
        proc = subprocess.run([sys.executable, "-c", FOOTPRINT_CHILD, args.head, args.algorithm, str(args.budget),
                               str(args.width), str(args.slots), str(200 + args.new_tokens), mode, "1"],
                              capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"slots": args.slots, "modes": out}


def part_memory() -> dict:
    """The static KV: what it reserves and what a held token costs resident (the reservation is virtual on a CPU)."""
    from jetflow.engine.engine import STATIC_MAX_TREE
    from jetflow.stepcore.buckets import key_window

    shapes = {"smollm2-135m (fp32)": (30, 3, 64, 4), "qwen3-8b (bf16)": (36, 8, 128, 2)}
    out = {}
    for name, (layers, kv, d, itemsize) in shapes.items():
        per_token = 2 * layers * kv * d * itemsize
        for max_len in (2560, 4096):
            cap = key_window(max_len + STATIC_MAX_TREE) + 1
            for slots in (8, 16):
                out[f"{name}, {slots} slots, max_model_len {max_len}"] = {
                    "per_token_bytes": per_token, "capacity": cap,
                    "reserved_gib": per_token * cap * slots / 2**30,
                    "resident_gib_full": per_token * (max_len + 1) * slots / 2**30}
    return out


# ------------------------------------------------------------------------------------------ report
def markdown(r: dict) -> str:
    lines = [f"### Eager vs compiled step core ({r['date']}, {r['machine']}, torch threads {r['threads']}, "
             f"git {r['commit']})", ""]
    if "single" in r:
        s = r["single"]
        lines += [f"Single stream, {s['prompts']} prompts, {s['new_tokens']} tokens, {s['passes']} pass(es); compile "
                  f"{s['compile_s']:.0f} s ({len(s['buckets'])} graphs) before timing:", "",
                  "| setting | eager tok/s | compiled tok/s | compiled/eager | lossless |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['eager_tok_s']:.1f} | {v['compiled_tok_s']:.1f} | **{v['ratio']:.2f}** | {v['lossless']} |"
                  for k, v in s["settings"].items()]
    if "verify" in r:
        v = r["verify"]
        lines += ["", f"Engine step of 1 row at {v['context']} cached tokens, median of {v['repeats']} (compile "
                      f"{v['compile_s']:.0f} s apart):", "",
                  "| N | eager verify ms | compiled verify ms | ratio | eager step ms | compiled step ms | ratio |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {x['nodes']} | {x['eager_verify_ms']:.1f} | {x['compiled_verify_ms']:.1f} | {x['verify_ratio']:.2f} "
                  f"| {x['eager_step_ms']:.1f} | {x['compiled_step_ms']:.1f} | {x['step_ratio']:.2f} |" for x in v["rows"]]
    if "cache" in r:
        c = r["cache"]
        lines += ["", f"Compiling the same {len(c['buckets'])} graphs: first process {c['first_process_s']:.1f} s, "
                      f"second (inductor cache warm) {c['second_process_s']:.1f} s ({c['ratio']:.1f}x less)"]
    if "serve" in r:
        s = r["serve"]
        a = s["apps"]
        lines += ["", f"Ray Serve, one replica per app, {s['common']['algorithm']} b{s['common']['budget']}, policy "
                      f"fixed, 8 slots: app start eager {a['off']['start_s']:.0f} s, compiled {a['compile']['start_s']:.0f} s "
                      f"(graphs compiled before traffic); RSS eager {a['off']['rss_bytes'] / 2**30:.2f} GiB, compiled "
                      f"{a['compile']['rss_bytes'] / 2**30:.2f} GiB", "",
                  "| clients | eager tok/s | compiled tok/s | compiled/eager | identical |", "|---|---|---|---|---|"]
        for label, key in (("1", "one_client"), ("8", "eight_clients")):
            x = s[key]
            lines.append(f"| {label} | {x['off']['tok_s']:.1f} | {x['compile']['tok_s']:.1f} | **{x['ratio']:.2f}** | "
                         f"{x['identical']} |")
    if "footprint" in r:
        f = r["footprint"]
        lines += ["", f"Engine process, {f['slots']} slots, Serve's settings (1 thread), fresh process per mode: resident "
                      "memory, anonymous + file-backed (the mmapped weights, libraries):", "",
                  "| mode | stage | compiled graphs | anon MiB | file MiB | total GiB |", "|---|---|---|---|---|---|"]
        lines += [f"| {mode} | {x['stage']} | {x.get('buckets', 0)} | {x['anon'] / 2**20:.0f} | {x['file'] / 2**20:.0f} "
                  f"| {(x['anon'] + x['file']) / 2**30:.2f} |" for mode, stages in f["modes"].items() for x in stages]
    if "memory" in r:
        lines += ["", "| static KV | per token | capacity | reserved | resident when every slot is full |",
                  "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['per_token_bytes'] / 1024:.0f} KiB | {v['capacity']} | {v['reserved_gib']:.2f} GiB | "
                  f"{v['resident_gib_full']:.2f} GiB |" for k, v in r["memory"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default="demo", help="head folder or name, models:/ URI, or 'random' (default demo)")
    p.add_argument("--algorithm", default="best_first", help="the serving setting's tree algorithm (the demo's)")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts per set (MT-Bench, HumanEval)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--passes", type=int, default=1)
    p.add_argument("--context", type=int, default=300, help="cached tokens behind the verify part's steps")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--blocks", type=int, default=4, help="load blocks of 8 clients per app, alternating")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (this process and the replicas)")
    p.add_argument("--slots", type=int, default=16, help="the footprint part's engine slots")
    p.add_argument("--parts", default="single,verify,cache,serve,footprint,memory")
    p.add_argument("--record", action="store_true", help="keep part single's verdict for graphs=auto")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from jetflow.head import HeadRef
    from jetflow.paths import jetflow_home
    from jetflow.target import TargetModel
    from jetflow.tree import TreeSpec

    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    report: dict = {"date": str(date.today()), "machine": platform.processor() or platform.machine(),
                    "threads": args.threads, "commit": commit, "args": vars(args), "loadavg_start": os.getloadavg()}
    try:
        report["machine"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = Path(args.out) if args.out else jetflow_home() / "bench" / "compiled"
    out.mkdir(parents=True, exist_ok=True)
    target = head = tree = None
    if {"single", "verify"} & set(parts):
        target = TargetModel.load(TARGET)
        loaded = HeadRef.parse(args.head).load(target)
        head = loaded.head if loaded else None
        tree = TreeSpec(args.algorithm, args.budget, args.width)
    for part in parts:
        t0 = time.perf_counter()
        if part == "single":
            report["single"] = part_single(args, target, head, tree)
        elif part == "verify":
            report["verify"] = part_verify(args, target, head)
        elif part == "cache":
            report["cache"] = part_cache(args)
        elif part == "serve":
            report["serve"] = part_serve(args)
        elif part == "footprint":
            report["footprint"] = part_footprint(args)
        elif part == "memory":
            report["memory"] = part_memory()
        else:
            raise SystemExit(f"unknown part {part!r}")
        report.setdefault("part_seconds", {})[part] = time.perf_counter() - t0
        report["loadavg_end"] = os.getloadavg()
        (out / "compiled.json").write_text(json.dumps(report, indent=2, default=str))
        print(f"[compiled] {part} done in {report['part_seconds'][part]:.0f} s", flush=True)
    text = markdown(report)
    (out / "compiled.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
