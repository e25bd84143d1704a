"""Serving benchmark: the real Ray Serve app on 127.0.0.1, driven by the `openai` client.

One Serve instance, side by side in one run:

1. single-request decode on HumanEval (code) prompts, speculation vs plain decoding: the same prompts
   alternate between a speculative app per tree budget and a plain app, one request at a time;
   decode tokens/s (server side, prefill excluded), end-to-end tokens/s (client side) and τ;
2. a bounded load (`--requests` chat requests from `--threads` threads) against an autoscaled app
   (1 → `--max-replicas`), with and without speculation: latency percentiles, aggregate tokens/s,
   failures, and the replica count over time (the autoscaler adding a replica under load);
3. resident memory (RSS) of one replica, from its /healthz.

    python benchmarks/serving.py --head ~/.jetflow/heads/demo --budgets 4,8
    python benchmarks/serving.py --head random --prompts 2 --requests 8     # a quick look

Prints a markdown report and writes it (plus raw JSON) under $JETFLOW_HOME/bench/serving.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date

import openai
import requests

from jetflow.data import load_prompts
from jetflow.paths import jetflow_home

TARGET = "smollm2-135m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def single_requests(base: str, apps: list[str], prompts: list[str], new_tokens: int) -> dict[str, dict]:
    """Each prompt to every app in turn (interleaved, so machine noise spreads evenly), one at a time."""
    clients = {a: openai.OpenAI(base_url=f"{base}/{a}/v1", api_key="unused", max_retries=0, timeout=600) for a in apps}
    raw = {a: {"tokens": 0, "decode_s": 0.0, "wall_s": 0.0, "rounds": 0, "texts": []} for a in apps}
    for a in apps:  # one unmeasured request per app: first-call allocations, lazy weights
        clients[a].chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           temperature=0)
    for prompt in prompts:
        for a in apps:
            t0 = time.perf_counter()
            r = clients[a].chat.completions.create(model=TARGET, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=new_tokens, temperature=0)
            wall = time.perf_counter() - t0
            jf = r.usage.model_extra["jetflow"]
            n = r.usage.completion_tokens
            raw[a]["tokens"] += n
            raw[a]["decode_s"] += n / jf["tokens_per_s"] if jf["tokens_per_s"] else 0.0
            raw[a]["wall_s"] += wall
            raw[a]["rounds"] += jf["rounds"]
            raw[a]["texts"].append(r.choices[0].message.content)
    out = {}
    for a, r in raw.items():
        out[a] = {"tokens": r["tokens"], "decode_tok_s": r["tokens"] / r["decode_s"],
                  "e2e_tok_s": r["tokens"] / r["wall_s"], "tau": r["tokens"] / r["rounds"], "texts": r["texts"]}
    return out


def load(base: str, app: str, prompts: list[str], n_requests: int, threads: int, new_tokens: int) -> dict:
    """`n_requests` chat requests from `threads` threads; per-request latency, replica count over time."""
    from ray import serve

    client = openai.OpenAI(base_url=f"{base}/{app}/v1", api_key="unused", max_retries=0, timeout=600)
    timeline: list[tuple[float, dict]] = []
    done = threading.Event()
    rss: dict[int, int] = {}
    t_start = time.perf_counter()

    def watch():
        while not done.is_set():
            states = dict(serve.status().applications[app].deployments["JetFlow"].replica_states)
            if not timeline or timeline[-1][1] != states:
                timeline.append((round(time.perf_counter() - t_start, 1), states))
            try:
                h = requests.get(f"{base}/{app}/healthz", timeout=5).json()
                rss[h["pid"]] = max(rss.get(h["pid"], 0), h["rss_bytes"])
            except requests.RequestException:
                pass
            time.sleep(0.5)

    def one(i: int):
        t0 = time.perf_counter()
        try:
            r = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
                                               max_tokens=new_tokens, temperature=0)
            return time.perf_counter() - t0, r.usage.completion_tokens, r.id, None
        except openai.OpenAIError as exc:
            return time.perf_counter() - t0, 0, None, repr(exc)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(one, range(n_requests)))
    finally:
        wall = time.perf_counter() - t_start
        done.set()
        watcher.join()
    ok = [r for r in results if r[3] is None]
    lat = [r[0] for r in ok]
    return {"app": app, "requests": n_requests, "threads": threads, "ok": len(ok), "failed": len(results) - len(ok),
            "unique_ids": len({r[2] for r in ok}), "errors": [r[3] for r in results if r[3]][:3],
            "p50_s": percentile(lat, 50) if lat else None, "p90_s": percentile(lat, 90) if lat else None,
            "p99_s": percentile(lat, 99) if lat else None, "mean_s": statistics.mean(lat) if lat else None,
            "tokens": sum(r[1] for r in ok), "wall_s": wall, "tok_s": sum(r[1] for r in ok) / wall,
            "replicas_over_time": timeline, "max_rss_bytes": rss}


def render(report: dict) -> str:
    """The markdown report (what BENCHMARKS.md quotes)."""
    args, ar, rows = report["args"], report["single"]["plain"], report["single"]["spec"]
    lines = [
        f"### Serving ({report['date']}, {TARGET}, fp32, {report['machine']}, head {args['head']})", "",
        (f"Single requests, {args['prompts']} HumanEval prompts, max_tokens {args['new_tokens']}, greedy, width "
         f"{args['width']}, {args['algorithm']}; plain decoding: {ar['decode_tok_s']:.1f} tok/s decode, "
         f"{ar['e2e_tok_s']:.1f} end to end. Machine load average (1 min) at start "
         f"{report['loadavg_start'][0]:.1f}, at end {report['loadavg_end'][0]:.1f} (other work shares the cores)."),
        "",
        "| budget | τ | decode tok/s | speedup (decode) | e2e tok/s | speedup (e2e) | identical to plain |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['budget']} | {r['tau']:.2f} | {r['decode_tok_s']:.1f} | {r['speedup_decode']:.2f}x | "
              f"{r['e2e_tok_s']:.1f} | {r['speedup_e2e']:.2f}x | {r['identical']} |" for r in rows]
    mib = ", ".join(f"{a} {v / 2**20:.0f}" for a, v in report["replica_rss_bytes"].items())
    lines += ["", f"Replica RSS after the single-request runs (MiB): {mib}"]
    for run in report.get("load", []):
        peak = max(run["max_rss_bytes"].values(), default=0) / 2**20
        timeline = "; ".join(f"{t}: {s}" for t, s in run["replicas_over_time"])
        lines += ["", (f"Load `{run['label']}` (1 torch thread per replica, up to {args['max_replicas']} replicas): "
                       f"{run['requests']} requests ({args['load_tokens']} max tokens) from "
                       f"{run['threads']} threads: ok {run['ok']}, failed {run['failed']}, unique ids "
                       f"{run['unique_ids']}; latency p50 {run['p50_s']:.2f} s, p90 {run['p90_s']:.2f} s, p99 "
                       f"{run['p99_s']:.2f} s; {run['tok_s']:.1f} tok/s aggregate over {run['wall_s']:.1f} s; "
                       f"peak replica RSS {peak:.0f} MiB"),
                  f"replicas over time (s → states): {timeline}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default="demo", help="head folder or name, models:/ URI, or 'random' (default demo)")
    p.add_argument("--budgets", default="4,8", help="tree budgets, one speculative app each")
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--algorithm", default="accum_logp")
    p.add_argument("--prompts", type=int, default=6, help="HumanEval prompts for the single-request runs")
    p.add_argument("--new-tokens", type=int, default=96, help="max_tokens of the single-request runs")
    p.add_argument("--requests", type=int, default=32, help="requests in each load run")
    p.add_argument("--threads", type=int, default=8, help="client threads in each load run")
    p.add_argument("--load-tokens", type=int, default=32, help="max_tokens of each load request")
    p.add_argument("--load-budget", type=int, default=None, help="budget of the speculative load app "
                                                                  "(default: the best single-request budget)")
    p.add_argument("--max-replicas", type=int, default=2)
    # 1 by default: with 2 OpenMP threads per replica on a contended 2-core machine, plain decoding (many
    # tiny ops, each a parallel region with a barrier) measured 4x slower than with 1 (2.5 vs 10.5 tok/s).
    p.add_argument("--torch-threads", type=int, default=1, help="intra-op threads per replica, single-request "
                                                                "runs (load runs: 1)")
    p.add_argument("--skip-load", action="store_true")
    args = p.parse_args(argv)

    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from jetflow.serving.app import build_app

    budgets = [int(b) for b in args.budgets.split(",")]
    prompts = [item.text for item in load_prompts("humaneval", limit=max(args.prompts, 8))]
    port = _free_port()
    common = {"torch_threads": args.torch_threads, "replica_cpus": 0.25, "max_tokens": 512,
              "max_prompt_tokens": 2048, "width": args.width, "algorithm": args.algorithm}
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    report: dict = {"date": str(date.today()), "machine": f"{platform.machine()}, {args.torch_threads} torch threads",
                    "head": args.head, "args": vars(args), "loadavg_start": os.getloadavg()}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        spec_apps = {b: f"spec-b{b}" for b in budgets}
        serve.run_many([RunTarget(build_app({**common, "head": "none"}), name="plain", route_prefix="/plain")]
                       + [RunTarget(build_app({**common, "head": args.head, "budget": b}), name=name,
                                    route_prefix=f"/{name}") for b, name in spec_apps.items()])
        single = single_requests(base, ["plain", *spec_apps.values()], prompts[: args.prompts], args.new_tokens)
        # after the runs: the weights are mmapped, so RSS right after start misses the pages not yet touched
        report["replica_rss_bytes"] = {a: requests.get(f"{base}/{a}/healthz", timeout=30).json()["rss_bytes"]
                                       for a in ["plain", *spec_apps.values()]}
        ar = single["plain"]
        rows = []
        for b, name in spec_apps.items():
            s = single[name]
            rows.append({"budget": b, "tau": s["tau"], "decode_tok_s": s["decode_tok_s"], "e2e_tok_s": s["e2e_tok_s"],
                         "speedup_decode": s["decode_tok_s"] / ar["decode_tok_s"],
                         "speedup_e2e": s["e2e_tok_s"] / ar["e2e_tok_s"], "identical": s["texts"] == ar["texts"]})
        report["single"] = {"plain": {k: v for k, v in ar.items() if k != "texts"}, "spec": rows}

        if not args.skip_load:
            best = args.load_budget or max(rows, key=lambda r: r["decode_tok_s"])["budget"]
            scaled = {**common, "min_replicas": 1, "max_replicas": args.max_replicas, "target_ongoing_requests": 2,
                      "upscale_delay_s": 0, "torch_threads": 1}
            serve.delete("plain")
            for name in spec_apps.values():
                serve.delete(name)
            report["load"] = []
            for label, head_args in (("plain", {"head": "none"}), (f"spec-b{best}", {"head": args.head, "budget": best})):
                serve.run(build_app({**scaled, **head_args}), name=f"load-{label}", route_prefix=f"/load-{label}")
                report["load"].append({"label": label, **load(base, f"load-{label}", prompts, args.requests,
                                                              args.threads, args.load_tokens)})
                serve.delete(f"load-{label}")
    finally:
        report["loadavg_end"] = os.getloadavg()
        serve.shutdown()
        ray.shutdown()

    text = render(report)
    print(text)
    out = jetflow_home() / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "serving.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
