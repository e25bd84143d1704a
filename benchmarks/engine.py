"""The batched engine under load, side by side in one run: aggregate tokens/s and per-request latency at each
concurrency (a closed loop of that many clients, as one replica serves them) for plain decoding, speculation
at a fixed budget and the load-aware policy; time to first token; the gaps of a running stream while a long
prompt is admitted (chunked prefill); peak RSS with every slot full; the reference single-stream Decoder on
the same prompts; and the cost model's predicted speedup beside the measured one.

    python benchmarks/engine.py --head demo --budget 8 --out ~/.jetflow/bench/engine
    python benchmarks/engine.py --head random --concurrency 1,4 --requests 4 --new-tokens 16   # a quick look

Writes report.json, report.md and tokens_per_s.png to --out, prints the markdown, and logs an MLflow run
(experiment jetflow/<target>, run name "engine benchmark") unless --no-mlflow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

import psutil
import torch

from jetflow.decode import DecodeConfig, Decoder, encode_prompt
from jetflow.engine import Engine, EngineConfig
from jetflow.engine.cost import cached_step_curve
from jetflow.eval.cost_model import device_name, measure_verify_curve
from jetflow.tree import TreeSpec

MODES = ("plain", "speculative", "auto")


class PeakRSS:
    """The process's peak resident memory while running (sampled every 50 ms)."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class ClosedLoop:
    """`concurrency` clients on one engine, each sending its next request when its last one finishes, until
    `requests` are done. The loop keeps its own clock: the time of its engine's steps, summed — what a
    replica running only this engine would take — so several loops can be stepped in turn (`lockstep`) and
    a host whose speed drifts slows each of them alike. Per request: latency (queue + prefill + decode) and
    time to first token, on that clock."""

    def __init__(self, engine: Engine, prompts: list[list[int]], cfg: DecodeConfig, concurrency: int,
                 requests: int):
        self.engine, self.cfg, self.requests = engine, cfg, requests
        self.queue = [prompts[i % len(prompts)] for i in range(requests)]
        self.clock = self.prefill_s = 0.0
        self.arrival, self.first, self.latency, self.rows = {}, {}, [], []
        self.tokens = self.done = 0
        for _ in range(min(concurrency, requests)):
            self._submit()

    def _submit(self) -> None:
        rid = self.engine.add(self.queue.pop(0), self.cfg)
        self.arrival[rid] = self.clock

    @property
    def finished(self) -> bool:
        return self.done >= self.requests

    def step(self) -> None:
        t0 = time.perf_counter()
        events = self.engine.step()
        self.clock += time.perf_counter() - t0
        self.prefill_s += self.engine.times.prefill
        if self.engine.times.rows:
            self.rows.append(self.engine.times.rows)
        for event in events:
            self.tokens += len(event.tokens)
            if event.tokens and event.request_id not in self.first:
                self.first[event.request_id] = self.clock - self.arrival[event.request_id]
            if event.finished:
                self.done += 1
                self.latency.append(self.clock - self.arrival[event.request_id])
                if self.queue:
                    self._submit()

    def result(self) -> dict:
        seconds, rows = self.clock, self.rows
        latency, ttft = self.latency, sorted(self.first.values())
        q = statistics.quantiles(latency, n=100) if len(latency) > 1 else latency * 99
        return {"tokens_per_s": self.tokens / seconds, "seconds": seconds, "tokens": self.tokens,
                "requests": self.requests, "prefill_s": self.prefill_s,
                "decode_tokens_per_s": self.tokens / max(seconds - self.prefill_s, 1e-9),
                "p50_s": statistics.median(latency), "p99_s": q[98], "ttft_p50_s": statistics.median(ttft),
                "ttft_p99_s": (statistics.quantiles(ttft, n=100)[98] if len(ttft) > 1 else ttft[0]),
                "decode_rows": {str(b): rows.count(b) for b in sorted(set(rows))},  # rows of a decode step: steps
                "mean_rows": statistics.mean(rows) if rows else 0.0}


def lockstep(loops: list[ClosedLoop]) -> list[dict]:
    """Step the loops in turn (one step each, the order reversed every other round) until every one is done;
    each loop's figures on its own clock. Loops that finish early leave the others stepping alone."""
    k = 0
    while not all(loop.finished for loop in loops):
        for loop in (loops if k % 2 == 0 else reversed(loops)):
            if not loop.finished:
                loop.step()
        k += 1
    return [loop.result() for loop in loops]


def loop_speedup(curve, spec_rows: dict, plain_rows: dict, nodes: int, tau: float) -> float:
    """The step-cost model's decode-only speedup at the batch sizes the closed loops actually ran (a loop of C
    clients holds fewer than C rows while requests are prefilled and as it drains): each mode's predicted
    tokens per ms, τ·ΣB / ΣT(B, N) over its own decode steps (τ = 1 and N = 1 for plain), as a ratio.
    `*_rows`: {rows of a step: how many steps}."""
    def rate(hist: dict, n: int, t: float) -> float:
        steps = [(int(b), k) for b, k in hist.items()]
        return t * sum(b * k for b, k in steps) / sum(curve.step_ms(b, n) * k for b, k in steps)

    return rate(spec_rows, nodes, tau) / rate(plain_rows, 1, 1.0)


def admission_gaps(engine: Engine, stream_prompt: list[int], long_prompt: list[int], new_tokens: int) -> dict:
    """A running stream's gaps between token events, and those of the steps that also fed a chunk of a long
    prompt admitted meanwhile."""
    cfg = DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=new_tokens)
    rid = engine.add(stream_prompt, cfg)
    stamps, prefilled = [], []
    admitted, finished = False, False
    while not finished:
        events = engine.step()
        now = time.perf_counter()
        for e in events:
            if e.request_id == rid and e.tokens:
                stamps.append(now)
                prefilled.append(engine.times.prefill > 0)
            finished = finished or (e.request_id == rid and e.finished)
        if len(stamps) >= 8 and not admitted:  # the stream runs steadily: the long prompt arrives
            engine.add(long_prompt, DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=4))
            admitted = True
    while engine.has_work():
        engine.step()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    during = sorted(g for g, pre in zip(gaps, prefilled[1:]) if pre)
    p99 = during[min(len(during) - 1, int(0.99 * len(during)))] if during else float("nan")
    return {"median_gap_ms": statistics.median(gaps) * 1000, "p99_gap_while_admitting_ms": p99 * 1000,
            "admission_steps": len(during), "long_prompt_tokens": len(long_prompt)}


def one_stream(target, head, prompts: list[list[int]], tree: TreeSpec, curve, new_tokens: int, reps: int) -> dict:
    """Concurrency 1 against the Decoder, side by side: per mode (plain, speculative), `reps` alternating
    passes over the prompts, one request at a time, of the Decoder and of a one-slot engine configured as
    in the table (its policy, the cost curve); wall-clock tokens/s of each pass, prefill included on both
    sides. Alternating passes put host drift into both columns alike (the table's decoder rates are taken
    minutes before its engine rows)."""
    out = {}
    for mode, t, policy in (("plain", TreeSpec(budget=1), "plain"), ("speculative", tree, "fixed")):
        cfg = DecodeConfig(tree=t, max_new_tokens=new_tokens)
        dec = Decoder(target, head)
        engine = Engine(target, head, EngineConfig(max_slots=1, policy=policy, cost_curve=curve))
        runs = {"decoder": lambda ids: dec.generate(ids, cfg), "engine": lambda ids: engine.generate([ids], cfg)[0]}
        for run in runs.values():
            run(prompts[0])  # warm-up
        rates: dict[str, list[float]] = {"decoder": [], "engine": []}
        for _ in range(reps):
            for name, run in runs.items():
                t0, toks = time.perf_counter(), 0
                for ids in prompts:
                    toks += len(run(ids).token_ids)
                rates[name].append(toks / (time.perf_counter() - t0))
        ratios = [e / d for e, d in zip(rates["engine"], rates["decoder"])]
        out[mode] = {"decoder_tokens_per_s": rates["decoder"], "engine_tokens_per_s": rates["engine"],
                     "ratios": ratios, "median_ratio": statistics.median(ratios)}
        print(f"one stream, {mode}: engine / Decoder per pass {', '.join(f'{r:.2f}' for r in ratios)}", flush=True)
    return out


def replica_rss(model: str, head: str, tree: TreeSpec, prompts: list[list[int]], slots: int, new_tokens: int) -> dict:
    """Peak RSS of what a Serve replica holds — the target, the head and one engine with every slot full —
    measured in a fresh process (this one also holds the prompt sets, the reference decoders, the cost curve
    and the earlier engines): its peak resident set (VmHWM) after decoding `slots` requests at once at the
    speculative setting. The prompts' token ids come on stdin, so the child never loads a prompt set. Also its RSS once
    loaded and once warm (one request of one token decoded): the weights are memory-mapped and become
    resident at the first forward."""
    code = (
        "import json, resource, sys\n"
        "from jetflow.decode import DecodeConfig\n"
        "from jetflow.engine import Engine, EngineConfig\n"
        "from jetflow.head import HeadRef\n"
        "from jetflow.target import TargetModel\n"
        "from jetflow.tree import TreeSpec\n"
        "model, head, tree, new = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])\n"
        "prompts = json.load(sys.stdin)\n"
        "target = TargetModel.load(model)\n"
        "h = HeadRef.parse(head).load(target).head\n"
        "def rss():  # this process's peak: VmHWM (ru_maxrss would start at the parent's RSS, kept across exec)\n"
        "    try:\n"
        "        with open('/proc/self/status') as f:\n"
        "            return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM:'))\n"
        "    except (OSError, StopIteration):\n"
        "        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "loaded = rss()\n"
        "Engine(target, h, EngineConfig(max_slots=1)).generate(prompts[:1], DecodeConfig(max_new_tokens=1))\n"
        "warm = rss()\n"
        "engine = Engine(target, h, EngineConfig(max_slots=len(prompts)))\n"
        "engine.generate(prompts, DecodeConfig(tree=TreeSpec.from_dict(tree), max_new_tokens=new))\n"
        "print(json.dumps({'loaded_bytes': loaded, 'warm_bytes': warm, 'peak_bytes': rss(),"
        " 'slots': len(prompts), 'prompt_tokens': sum(map(len, prompts))}))\n"
    )
    batch = [prompts[i % len(prompts)] for i in range(slots)]
    done = subprocess.run([sys.executable, "-c", code, model, head, json.dumps(tree.to_dict()), str(new_tokens)],
                          input=json.dumps(batch), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--head", default="demo", help="head folder, name, models:/ URI, or 'random'")
    p.add_argument("--budget", type=int, default=8, help="the speculative mode's tree budget (the sweep's best)")
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--requests", type=int, default=16, help="requests per (mode, concurrency): at least 2x concurrency")
    p.add_argument("--prompts", type=int, default=8, help="prompts per set (MT-Bench, HumanEval), spread")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-prompt", type=int, default=2048, help="tokens of the prompt admitted during a stream")
    p.add_argument("--out", default=str(Path.home() / ".jetflow" / "bench" / "engine"))
    p.add_argument("--one-stream-reps", type=int, default=3,
                   help="alternating passes of the Decoder and a one-slot engine (concurrency 1, side by side)")
    p.add_argument("--one-stream-only", action="store_true",
                   help="run only that side-by-side comparison (prints it, writes one_stream.json under --out)")
    p.add_argument("--no-mlflow", action="store_true")
    args = p.parse_args(argv)

    from jetflow.data import spread_prompts
    from jetflow.head import HeadRef
    from jetflow.target import TargetModel

    levels = [int(c) for c in args.concurrency.split(",")]
    target = TargetModel.load(args.model)
    head = HeadRef.parse(args.head).load(target).head
    tree = TreeSpec("accum_logp", args.budget, args.width).capped(head.config.block_size)
    items = spread_prompts("mtbench", args.prompts) + spread_prompts("humaneval", args.prompts)
    prompts = [encode_prompt(target.tokenizer, it.chat) for it in items]
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": str(date.today()), "device": device_name(target.device), "target": target.model_id,
                    "head": args.head, "tree": tree.to_dict(), "new_tokens": args.new_tokens,
                    "prompts": len(prompts), "loadavg_start": psutil.getloadavg()}

    curve = cached_step_curve(target, head, max_slots=max(levels), max_budget=tree.budget)
    report["step_curve"] = curve.to_dict()
    report["one_stream"] = one_stream(target, head, prompts, tree, curve, args.new_tokens, args.one_stream_reps)
    if args.one_stream_only:
        report["loadavg_end"] = psutil.getloadavg()
        (out / "one_stream.json").write_text(json.dumps(report, indent=2) + "\n")
        return 0

    # the reference single-stream decoder on the same prompts (what serving ran before the engine)
    single = {}
    for name, t in (("plain", TreeSpec(budget=1)), ("speculative", tree)):
        dec = Decoder(target, head)
        dec.generate(prompts[0], DecodeConfig(tree=t, max_new_tokens=4))
        toks = secs = rounds = prefill = 0
        step_ms = []
        for ids in prompts:
            g = dec.generate(ids, DecodeConfig(tree=t, max_new_tokens=args.new_tokens))
            toks, secs, rounds = toks + len(g.token_ids), secs + g.stats.decode_s, rounds + g.stats.rounds
            prefill += g.stats.prefill_s
            step_ms.append(g.stats.decode_s / g.stats.rounds * 1000)
        # decode-only (what the Decoder reports) and end to end (prefill included, as the engine's closed loop is)
        single[name] = {"tokens_per_s": toks / secs, "e2e_tokens_per_s": toks / (secs + prefill), "tau": toks / rounds,
                        "round_ms": statistics.median(step_ms)}
    report["decoder"] = single
    # the old cost model's prediction at batch 1 (isolated verify t(N) + measured draft) for this head and tree
    old = measure_verify_curve(target, [tree.budget], head=head)
    report["isolated_curve_prediction_b1"] = old.predict_speedup(single["speculative"]["tau"], tree.budget)

    results: dict = {m: {} for m in MODES}
    with PeakRSS() as rss:
        for c in levels:  # the three modes' loops stepped in turn, side by side on one clock each
            cfg = DecodeConfig(tree=tree, max_new_tokens=args.new_tokens)
            loops = []
            for mode in MODES:
                policy = {"plain": "plain", "speculative": "fixed", "auto": "auto"}[mode]
                engine = Engine(target, head, EngineConfig(max_slots=c, policy=policy, cost_curve=curve,
                                                           tau_prior={tree.budget: single["speculative"]["tau"]}))
                engine.generate([prompts[0]], DecodeConfig(tree=tree, max_new_tokens=2))  # warm-up
                loops.append(ClosedLoop(engine, prompts, cfg, c, max(args.requests, 2 * c)))
            for mode, loop, r in zip(MODES, loops, lockstep(loops)):
                if mode == "auto":
                    r["budgets_chosen"] = loop.engine.policy.current
                results[mode][c] = r
                print(f"{mode:12s} c={c:2d}: {r['tokens_per_s']:6.1f} tok/s, p50 {r['p50_s']:.2f} s, "
                      f"p99 {r['p99_s']:.2f} s, ttft p50 {r['ttft_p50_s']:.2f} s", flush=True)
            report["peak_rss_bytes_at"] = {**report.get("peak_rss_bytes_at", {}), str(c): rss.peak}
    report["results"] = {m: {str(c): r for c, r in v.items()} for m, v in results.items()}
    report["peak_rss_bytes"] = rss.peak

    # predicted vs measured speedup of the speculative mode over plain, per concurrency
    pred = {}
    mean_prompt = statistics.mean(len(p) - 1 for p in prompts)  # the last prompt token is fed by the first decode step
    tau = single["speculative"]["tau"]
    for c in levels:
        spec, plain = results["speculative"][c], results["plain"][c]
        pred[str(c)] = {"measured": spec["tokens_per_s"] / plain["tokens_per_s"],
                        "measured_decode_only": spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                        "predicted_decode_only": curve.speedup(c, tree.budget, tau),
                        "predicted": curve.serving_speedup(c, tree.budget, tau, mean_prompt, args.new_tokens),
                        "predicted_at_loop_rows": loop_speedup(curve, spec["decode_rows"], plain["decode_rows"],
                                                               tree.budget, tau)}
    report["prediction"] = pred

    report["replica_rss"] = replica_rss(args.model, args.head, tree, prompts, max(levels), args.new_tokens)

    engine = Engine(target, None, EngineConfig(max_slots=2, cost_curve=curve))
    long_prompt = [(17 * i + 3) % target.vocab_size for i in range(args.long_prompt)]
    report["admission"] = admission_gaps(engine, prompts[0], long_prompt, 64)
    report["loadavg_end"] = psutil.getloadavg()

    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report, levels)
    (out / "report.md").write_text(md)
    fig = chart(report, levels)
    fig.savefig(out / "tokens_per_s.png")
    print(md)
    if not args.no_mlflow:
        from jetflow.tracking.store import client, experiment_for

        c = client()
        run = c.create_run(experiment_for(target.model_id), run_name="engine benchmark",
                           tags={"jetflow.kind": "benchmark", "jetflow.head.name": args.head})
        for mode, by_c in results.items():
            for lvl, r in by_c.items():
                c.log_metric(run.info.run_id, f"tokens_per_s/{mode}/c{lvl}", r["tokens_per_s"])
                c.log_metric(run.info.run_id, f"p99_s/{mode}/c{lvl}", r["p99_s"])
        for name in ("report.json", "report.md", "tokens_per_s.png"):
            c.log_artifact(run.info.run_id, str(out / name))
        c.set_terminated(run.info.run_id)
    return 0


def markdown(report: dict, levels: list[int]) -> str:
    dec = report["decoder"]
    res = report["results"]
    lines = [f"Engine benchmark {report['date']}, {report['device']}, head {report['head']}, tree "
             f"{report['tree']}, {report['prompts']} prompts, {report['new_tokens']} new tokens; load average "
             f"{report['loadavg_start'][0]:.1f} → {report['loadavg_end'][0]:.1f}", "",
             f"Reference Decoder, one stream: plain {dec['plain']['tokens_per_s']:.1f} tok/s; speculative "
             f"{dec['speculative']['tokens_per_s']:.1f} tok/s (τ {dec['speculative']['tau']:.2f}).", "",
             "| concurrency | plain tok/s | spec tok/s | auto tok/s | auto / best | plain p50 / p99 s | spec p50 / p99 s | "
             "auto p50 / p99 s | TTFT p50 plain / spec / auto s | spec/plain measured | predicted (decode only) | "
             "spec/plain decode-only measured | predicted at the loop's rows | mean rows plain / spec | "
             "plain decode-only tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in levels:
        k = str(c)
        p, s, a = res["plain"][k], res["speculative"][k], res["auto"][k]
        best = max(p["tokens_per_s"], s["tokens_per_s"])
        pr = report["prediction"][k]
        lines.append(f"| {c} | {p['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} | {a['tokens_per_s']:.1f} | "
                     f"{a['tokens_per_s'] / best:.2f} | {p['p50_s']:.2f} / {p['p99_s']:.2f} | "
                     f"{s['p50_s']:.2f} / {s['p99_s']:.2f} | {a['p50_s']:.2f} / {a['p99_s']:.2f} | "
                     f"{p['ttft_p50_s']:.2f} / {s['ttft_p50_s']:.2f} / {a['ttft_p50_s']:.2f} | "
                     f"{pr['measured']:.2f}x | {pr['predicted']:.2f}x ({pr['predicted_decode_only']:.2f}x) | "
                     f"{pr['measured_decode_only']:.2f}x | {pr['predicted_at_loop_rows']:.2f}x | "
                     f"{p['mean_rows']:.1f} / {s['mean_rows']:.1f} | {p['decode_tokens_per_s']:.1f} |")
    adm = report["admission"]
    c8 = res['plain'].get('8', {})
    rss = report["replica_rss"]
    lines += ["", f"Plain at concurrency 8 vs the single-stream Decoder: end to end (prefill included in both) "
              f"{c8.get('tokens_per_s', float('nan')) / dec['plain']['e2e_tokens_per_s']:.2f}x "
              f"({dec['plain']['e2e_tokens_per_s']:.1f} tok/s alone); decode only (prefill steps excluded in both) "
              f"{c8.get('decode_tokens_per_s', float('nan')) / dec['plain']['tokens_per_s']:.2f}x; the engine's "
              f"end-to-end over the Decoder's decode-only {c8.get('tokens_per_s', float('nan')) / dec['plain']['tokens_per_s']:.2f}x. "
              f"At concurrency 1, engine / Decoder end to end: plain "
              f"{res['plain'].get('1', {}).get('tokens_per_s', float('nan')) / dec['plain']['e2e_tokens_per_s']:.2f}, "
              f"speculative {res['speculative'].get('1', {}).get('tokens_per_s', float('nan')) / dec['speculative']['e2e_tokens_per_s']:.2f}; "
              f"decode only: plain {res['plain'].get('1', {}).get('decode_tokens_per_s', float('nan')) / dec['plain']['tokens_per_s']:.2f}, "
              f"speculative {res['speculative'].get('1', {}).get('decode_tokens_per_s', float('nan')) / dec['speculative']['tokens_per_s']:.2f}.",
              f"Admitting a {adm['long_prompt_tokens']}-token prompt beside a running stream: its median gap "
              f"{adm['median_gap_ms']:.0f} ms, p99 gap while admitting {adm['p99_gap_while_admitting_ms']:.0f} ms "
              f"({adm['admission_steps']} steps).",
              f"Peak RSS of a replica (a fresh process: target, head, one engine with all {rss['slots']} slots "
              f"full): {rss['peak_bytes'] / 2 ** 30:.2f} GiB ({rss['loaded_bytes'] / 2 ** 30:.2f} GiB once loaded, "
              f"{rss['warm_bytes'] / 2 ** 30:.2f} GiB after a first forward); "
              f"of this whole benchmark process: {report['peak_rss_bytes'] / 2 ** 30:.2f} GiB.",
              f"Concurrency 1 side by side (alternating passes, wall clock, prefill included): engine / Decoder "
              f"median {report['one_stream']['plain']['median_ratio']:.2f} plain, "
              f"{report['one_stream']['speculative']['median_ratio']:.2f} speculative.",
              f"Isolated-t(N) cost model at batch 1 predicted {report['isolated_curve_prediction_b1']:.2f}x for the "
              f"speculative mode; the step-cost model predicts {report['prediction'][str(levels[0])]['predicted']:.2f}x, "
              f"measured {report['prediction'][str(levels[0])]['measured']:.2f}x."]
    return "\n".join(lines) + "\n"


def chart(report: dict, levels: list[int]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for mode in MODES:
        ax.plot(levels, [report["results"][mode][str(c)]["tokens_per_s"] for c in levels], marker="o", label=mode)
    ax.axhline(report["decoder"]["plain"]["tokens_per_s"], color="gray", linestyle=":", label="Decoder, one stream")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens/s (all requests)")
    ax.set_title(f"engine throughput, {report['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    sys.exit(main())
