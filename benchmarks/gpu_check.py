"""The GPU check: the same code on CUDA, and the paper's scale measured without downloading Qwen3-8B.

    python benchmarks/gpu_check.py --out DIR                        # one H200: <= 8 minutes, no network
    python benchmarks/gpu_check.py --device cpu --quick --out DIR   # the same code, tiny, on CPU (< 5 min)

Needs only torch, transformers and this package (PYTHONPATH=platform; no Ray, no MLflow). Randomly
initialised targets of real shapes stand in for real weights: verify cost does not depend on the weights.
Writes DIR/gpu_check.json and DIR/gpu_check.md:

a. losslessness of tree decoding (single-stream decoder and the batched engine) against greedy AR, fp32 and
   bf16, on a SmolLM2-shaped target with a random head: identical outputs, and in bf16 the first-divergence
   rate against our AR and against HF `generate` (batched kernels may order near-ties differently);
b. the verify cost t(N), N = 1 … 256, and the batched step cost T(B, N), for SmolLM2- and Qwen3-8B-shaped
   targets in bf16, and the draft head's forward for 1, 2 and 5 layers at that hidden size;
c. the AR step against the memory-bandwidth floor (weight bytes / measured device copy bandwidth);
d. the speedup the step cost projects at the paper's τ (Qwen3-8B, budget 256) beside its measured speedups,
   and the batch-1 tokens/s it projects at JetSpec's τ (budget 128) beside JetSpec's own engine (B200), with
   the engine step at that budget split into its phases (draft, verify + acceptance walk, commit) against
   the verify forward and the weight-read floor: the biggest gap, named;
e. what CUDA graphs (torch.compile, reduce-overhead) and a static KV cache do to the AR step, on and off;
f. JetFlow's step core (`jetflow.stepcore`, graphs=compile: static KV, torch.compile per bucket) beside the eager
   engine: the engine step of one row, plain and with a tree, its compile seconds; and (in part a) the compiled
   engine's outputs against greedy AR.

Every part runs under a time budget and reports "skipped"/"failed: …" instead of stopping the whole check;
gpu_check.json is rewritten after every part, so a run stopped at a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

# (name, Hugging Face config fields) of the shapes measured; vocabularies as the real models'
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6),
}
QUICK = {  # --quick: the same structures, scaled down to run on 2 CPU cores
    "smollm2-135m": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=6, num_attention_heads=3,
                         num_key_value_heads=1, vocab_size=4096),
    "qwen3-8b": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=32, vocab_size=4096),
}
PAPER = {"MATH-500": (10.76, 9.64), "MT-Bench": (5.94, 4.58), "HumanEval": (7.78, 7.12)}  # (τ, speedup) at 256
# JetSpec's own engine (Qwen3-8B, one B200, batch 1, budget 128): (τ, tokens/s)
JETSPEC = {"MT-Bench": (4.88, 545.0), "HumanEval": (6.92, 867.0)}
JETSPEC_BUDGET = 128
# draft-head layers per shape: the demo preset's 2 for SmolLM2, the published Qwen3-8B DFlash heads' 5
HEAD_LAYERS = {"smollm2-135m": 2, "qwen3-8b": 5}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Budget:
    """Wall-clock budget: a part that would start past `limit_s` is skipped."""

    def __init__(self, limit_s: float):
        self.t0, self.limit_s = time.perf_counter(), limit_s

    @property
    def left(self) -> float:
        return self.limit_s - (time.perf_counter() - self.t0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_target(name: str, device: str, dtype: torch.dtype, quick: bool, seed: int = 0):
    """A randomly initialised TargetModel of `name`'s shape, built directly on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from jetflow.target import TargetModel

    fields = {**SHAPES[name], **(QUICK[name] if quick else {})}
    model_type = fields.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():  # sharper distributions than the 0.02-std init, so greedy ties are rare
        model.get_output_embeddings().weight.mul_(30.0 if quick else 8.0)
    return TargetModel(model, tokenizer=None, model_id=f"random-{name}", revision="random")


def random_head(target, layers: int = 1, seed: int = 0):
    from jetflow.head import DraftHead, HeadConfig

    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.for_target(target, num_hidden_layers=layers, block_size=16))
    return head.to(device=target.device, dtype=target.dtype).eval()


def median_ms(fn, device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


# ----------------------------------------------------------------------------------- a. losslessness
def part_lossless(args, budget: Budget) -> dict:
    out = {}
    for dname in ("fp32", "bf16"):
        if budget.left < 60:
            out[dname] = "skipped (time budget)"
            continue
        try:
            out[dname] = _lossless_in(args, DTYPES[dname])
        except Exception as exc:  # noqa: BLE001 - a CUDA failure in one dtype is a finding; go on with the other
            out[dname] = f"failed: {exc.__class__.__name__}: {exc}"
            traceback.print_exc()
    return out


def _lossless_in(args, dtype: torch.dtype) -> dict:
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.decode.lossless import first_divergence
    from jetflow.engine import Engine, EngineConfig
    from jetflow.tree import TreeSpec

    n_prompts, new, lengths = (2, 12, (8, 32)) if args.quick else (args.prompts, 64, (16, 128))
    target = make_target("smollm2-135m", args.device, dtype, args.quick)
    head = random_head(target, HEAD_LAYERS["smollm2-135m"])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, target.vocab_size - 5, (int(n),), generator=g).tolist()
               for n in torch.randint(*lengths, (n_prompts,), generator=g)]
    ar = [Decoder(target).generate(p, DecodeConfig(max_new_tokens=new)).token_ids for p in prompts]
    hf = [target.model.generate(torch.tensor([p], device=target.device), do_sample=False, max_new_tokens=new,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    res = {"prompts": n_prompts, "new_tokens": new,
           "ar_vs_hf": _divergences(target, prompts, list(zip(ar, hf)), first_divergence)}
    for budget_n in ((8, 32) if args.quick else (8, 64)):
        cfg = DecodeConfig(tree=TreeSpec(budget=budget_n), max_new_tokens=new)
        single = [Decoder(target, head).generate(p, cfg).token_ids for p in prompts]
        batched = [g.token_ids for g in Engine(target, head, EngineConfig(max_slots=n_prompts, graphs="off"))
                   .generate(prompts, cfg)]
        compiled = [g.token_ids for g in Engine(target, head, EngineConfig(
            max_slots=n_prompts, graphs="compile", graphs_backend=args.graphs_backend)).generate(prompts, cfg)]
        res[f"decoder_b{budget_n}_vs_ar"] = _divergences(target, prompts, list(zip(single, ar)), first_divergence)
        res[f"engine_b{budget_n}_vs_ar"] = _divergences(target, prompts, list(zip(batched, ar)), first_divergence)
        res[f"engine_b{budget_n}_vs_hf"] = _divergences(target, prompts, list(zip(batched, hf)), first_divergence)
        res[f"compiled_engine_b{budget_n}_vs_ar"] = _divergences(target, prompts, list(zip(compiled, ar)),
                                                                 first_divergence)
    return res


def _divergences(target, prompts, pairs, first_divergence) -> dict:
    """identical: outputs equal; ties: first difference at an fp32 tie of the target's top-2 logits; other:
    a real divergence (its positions)."""
    ident, ties, other = 0, 0, []
    for p, (got, ref) in zip(prompts, pairs):
        d = first_divergence(target, p, got, ref)
        if d is None:
            ident += 1
        elif d.tie:
            ties += 1
        else:
            other.append(d.index)
    return {"identical": ident, "tie_flips": ties, "divergent": len(other), "first_divergence_at": other,
            "first_divergence_rate": (ties + len(other)) / len(pairs)}


# ----------------------------------------------------------------------------------- b. cost curves
def part_costs(args, budget: Budget) -> dict:
    from jetflow.engine.cost import measure_step_curve
    from jetflow.eval.cost_model import time_verify

    out = {}
    nodes = [1, 2, 4, 8, 16, 32] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    batch = [1, 2, 4] if args.quick else [1, 2, 4, 8, 16, 32]
    step_nodes = [1, 4, 16] if args.quick else [1, 4, 16, 64, JETSPEC_BUDGET, 256]
    context = 64 if args.quick else 512
    for name in ("smollm2-135m", "qwen3-8b"):
        if budget.left < 90:
            out[name] = "skipped (time budget)"
            continue
        try:
            target = make_target(name, args.device, DTYPES[args.dtype], args.quick)
            rows = time_verify(target, nodes, context_tokens=context, repeats=3 if args.quick else 7,
                               variants=("verify",))
            t1 = rows[0].verify_ms
            res = {"context": context, "t_ms": {r.n: r.verify_ms for r in rows},
                   "t_over_t1": {r.n: r.verify_ms / t1 for r in rows}}
            heads = {}
            for layers in (1, 2, 5):
                head = random_head(target, layers)
                heads[layers] = _head_forward_ms(target, head, context, reps=3 if args.quick else 10)
            res["head_forward_ms"] = heads
            res.update(part_bandwidth(target, args))
            res["head_layers"] = HEAD_LAYERS[name]
            if budget.left > 60:
                from jetflow import sdpa

                head, n = random_head(target, HEAD_LAYERS[name]), 16 if args.quick else JETSPEC_BUDGET
                res["anatomy"] = part_anatomy(target, head, context, n, steps=3 if args.quick else 10)
                old = sdpa.allow_cudnn(True)  # side by side: PyTorch's own SDPA choice, cuDNN included
                try:
                    res["anatomy_cudnn_allowed"] = part_anatomy(target, head, context, n, steps=3 if args.quick else 10)
                finally:
                    sdpa.allow_cudnn(old)
            if budget.left > 60:
                curve = measure_step_curve(target, random_head(target, HEAD_LAYERS[name]), batch, step_nodes,
                                           context, repeats=2 if args.quick else 3)
                res["step_curve"] = curve.to_dict()
            out[name] = res
            del target
        except Exception as exc:  # noqa: BLE001 - report and go on with the next part
            out[name] = f"failed: {exc.__class__.__name__}: {exc}"
            traceback.print_exc()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


@torch.inference_mode()
def _head_forward_ms(target, head, context: int, reps: int) -> float:
    """One draft: the head over `context` projected features + a 16-token block, then the LM head on 15 rows."""
    dev, h = target.device, target.hidden_size
    ctx = torch.randn(1, context, h, device=dev, dtype=target.dtype)
    block = torch.randn(1, 16, h, device=dev, dtype=target.dtype)
    cpos, bpos = torch.arange(context, device=dev)[None], torch.arange(context, context + 16, device=dev)[None]

    def draft():
        out = head(ctx, block, cpos, bpos)
        return head.output_logits(target, out[0, 1:]).topk(7)

    return median_ms(draft, dev, reps)


@torch.inference_mode()
def part_anatomy(target, head, context: int, nodes: int, steps: int, graphs: str = "off",
                 backend: str = "inductor") -> dict:
    """Where one engine step of one row at an `nodes`-node accum_logp tree goes: the engine's own phase
    clocks (draft: head forward + top-W to the host + tree build; verify: the tree forward + the acceptance
    walk's LM-head rounds; commit: KV compaction + the head's context update), medians over `steps` steps
    after two warm-up steps (graphs=compile: the first compiles the step's buckets)."""
    from jetflow.decode import DecodeConfig
    from jetflow.engine import Engine, EngineConfig
    from jetflow.tree import TreeSpec

    engine = Engine(target, head, EngineConfig(max_slots=1, prefill_chunk=context, prefill_tokens=context,
                                               graphs=graphs, graphs_backend=backend))
    cfg = DecodeConfig(tree=TreeSpec("accum_logp", nodes, 7),
                       max_new_tokens=(steps + 4) * (head.config.block_size + 1))
    engine.add([(31 * i + 5) % target.vocab_size for i in range(context + 1)], cfg)
    while engine.prefilling or engine.waiting:
        engine.step()
    phases: dict[str, list[float]] = {"draft": [], "verify": [], "commit": [], "step": []}
    for k in range(steps + 2):
        t0 = time.perf_counter()
        engine.step()
        sync(target.device)
        if k >= 2 and engine.times.rows:
            t = engine.times
            for key, sec in (("draft", t.draft), ("verify", t.verify), ("commit", t.commit),
                             ("step", time.perf_counter() - t0)):
                phases[key].append(sec * 1000)
    out = {f"{k}_ms": statistics.median(v) for k, v in phases.items() if v}
    out.update({"nodes": nodes, "rows": 1, "context": context, "steps": len(phases["step"])})
    if engine.runner is not None:
        out["compile_s"] = engine.runner.compile_s
    return out


# ----------------------------------------------------------------------------------- c. bandwidth floor
@torch.inference_mode()
def part_bandwidth(target, args) -> dict:
    """The AR step (one token against `context` cached tokens) vs weight bytes / copy bandwidth."""
    dev = target.device
    nbytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    size = min(2 ** 28 if dev.type == "cuda" else 2 ** 26, nbytes // 2)
    src = torch.empty(size // 2, dtype=torch.float16, device=dev)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), dev, reps=10)
    bandwidth = 2 * src.numel() * src.element_size() / (copy_ms / 1000)  # bytes read + written per second
    cache = target.new_cache()
    context = 64 if args.quick else 512
    target.forward(torch.randint(0, target.vocab_size, (context,), device=dev), torch.arange(context, device=dev), cache)

    def step():
        out = target.forward(torch.tensor([5], device=dev), torch.tensor([context], device=dev), cache)
        target.logits(out.hidden).argmax(-1)
        cache.crop(-1)  # transformers 5.x: negative = tokens to drop

    ar_ms = median_ms(step, dev, reps=10)
    floor_ms = nbytes / bandwidth * 1000
    return {"weight_bytes": nbytes, "copy_bandwidth_gb_s": bandwidth / 1e9, "ar_step_ms": ar_ms,
            "bandwidth_floor_ms": floor_ms, "ar_over_floor": ar_ms / floor_ms}


# ----------------------------------------------------------------------------------- d. the paper's τ
def part_projection(costs: dict) -> dict:
    """Speedup = τ · T(1, 1) / T(1, 256) from the Qwen3-8B-shaped step curve (draft included), beside the
    paper's measured speedup; and the same from the isolated t(N) + the 5-layer head's forward."""
    from jetflow.engine.cost import StepCostCurve

    q = costs.get("qwen3-8b")
    if not isinstance(q, dict):
        return {"skipped": "no Qwen3-8B-shaped curve"}
    out = {}
    curve = StepCostCurve.from_dict(q["step_curve"]) if "step_curve" in q else None
    t = {int(k): v for k, v in q["t_ms"].items()}
    n = max(t)
    draft = q["head_forward_ms"].get(5) or q["head_forward_ms"].get("5")
    for name, (tau, paper) in PAPER.items():
        isolated = tau * t[1] / (t[n] + draft)
        row = {"tau": tau, "paper_speedup": paper, "isolated_projection": isolated, "nodes": n}
        if curve is not None:
            step = curve.speedup(1, min(256, max(curve.nodes)), tau)
            row.update({"step_projection": step, "step_over_paper": step / paper})
        row["isolated_over_paper"] = isolated / paper
        out[name] = row
    return out


def part_jetspec(costs: dict) -> dict:
    """Our engine's projected batch-1 tokens/s at Qwen3-8B shape, budget 128, at JetSpec's τ, beside JetSpec's
    measured tokens/s (B200), and the step's time split against its floor: which part is the biggest gap."""
    from jetflow.engine.cost import StepCostCurve

    q = costs.get("qwen3-8b")
    if not isinstance(q, dict):
        return {"skipped": "no Qwen3-8B-shaped measurements"}
    curve = StepCostCurve.from_dict(q["step_curve"]) if "step_curve" in q else None
    a = q.get("anatomy") if isinstance(q.get("anatomy"), dict) else {}
    n = a.get("nodes", JETSPEC_BUDGET)  # --quick: the scaled-down run's largest tree, to exercise the same code
    out: dict = {"budget": n, "device_note": "JetSpec: one B200; ours: this device"}
    if curve is None or n not in curve.nodes:
        return {**out, "skipped": f"no step curve at {n} nodes"}
    step = curve.step_ms(1, n)
    for name, (tau, tps) in JETSPEC.items():
        ours = tau * 1000 / step
        out[name] = {"tau": tau, "jetspec_tokens_per_s": tps, "jetspec_step_ms": tau * 1000 / tps,
                     "projected_tokens_per_s": ours, "projected_over_jetspec": ours / tps}
    out["step_ms"] = step
    out["ar_tokens_per_s"] = 1000 / curve.step_ms(1, 1)
    t = {int(k): v for k, v in q["t_ms"].items()}
    if a and n in t:
        forward, floor = t[n], q["bandwidth_floor_ms"]
        gaps = {  # each part's time beyond what it must cost
            "verify forward above the weight-read floor": forward - floor,
            "acceptance walk (LM-head rounds, host syncs)": a["verify_ms"] - forward,
            "draft (head forward, top-W to host, tree build)": a["draft_ms"],
            "commit (KV compaction, head context)": a["commit_ms"],
        }
        draft_forward = {int(k): v for k, v in q["head_forward_ms"].items()}.get(q.get("head_layers"))
        if draft_forward is not None:
            out["draft_head_forward_ms"] = draft_forward
            out["draft_host_ms"] = a["draft_ms"] - draft_forward
        out.update({"anatomy": a, "verify_forward_ms": forward, "bandwidth_floor_ms": floor, "gaps_ms": gaps,
                    "biggest_gap": max(gaps, key=gaps.get)})
    return out


# ----------------------------------------------------------------------------------- e. graphs, static KV
@torch.inference_mode()
def part_compile(args, budget: Budget) -> dict:
    """The AR step: DynamicCache eager; StaticCache eager; StaticCache + torch.compile(reduce-overhead) (CUDA
    graphs). Same token, same context."""
    from transformers import StaticCache

    if budget.left < 120:
        return {"skipped": "time budget"}
    out = {}
    target = make_target("smollm2-135m", args.device, DTYPES[args.dtype], args.quick)
    dev, model = target.device, target.model
    context = 64 if args.quick else 512
    ids = torch.randint(0, target.vocab_size, (1, context), device=dev)
    tok = torch.tensor([[5]], device=dev)
    pos = torch.tensor([[context]], device=dev)

    try:
        cache = target.new_cache()
        model(input_ids=ids, past_key_values=cache, use_cache=True)

        def step_dyn():
            model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # transformers 5.x: negative = tokens to drop

        out["dynamic_cache_eager_ms"] = median_ms(step_dyn, dev, reps=10)
        static = StaticCache(config=model.config, max_cache_len=context + 64)  # each call appends one token
        model(input_ids=ids, past_key_values=static, use_cache=True, cache_position=torch.arange(context, device=dev))

        def step_static(m=model):
            return m(input_ids=tok, position_ids=pos, past_key_values=static, use_cache=True,
                     cache_position=pos[0]).logits

        out["static_cache_eager_ms"] = median_ms(step_static, dev, reps=10)
        if budget.left > 90 and args.device == "cuda":
            compiled = torch.compile(model, mode="reduce-overhead", fullgraph=False)
            out["static_cache_compiled_ms"] = median_ms(lambda: step_static(compiled), dev, reps=10, warmup=5)
        else:
            out["static_cache_compiled_ms"] = "skipped (CPU or time budget)"
    except Exception as exc:  # noqa: BLE001
        out["failed"] = f"{exc.__class__.__name__}: {exc}"
        traceback.print_exc()
    return out


# ----------------------------------------------------------------------------------- f. the step core
def part_stepcore(args, budget: Budget) -> dict:
    """The engine step of one row (SmolLM2 shape), eager vs the compiled step core, side by side: a plain
    step and a `nodes`-node tree, each mode's phases as `part_anatomy` clocks them, and the compile seconds."""
    if budget.left < 120:
        return {"skipped": "time budget"}
    target = make_target("smollm2-135m", args.device, DTYPES[args.dtype], args.quick)
    head = random_head(target, HEAD_LAYERS["smollm2-135m"])
    context, steps = (64, 3) if args.quick else (512, 10)
    out = {"backend": args.graphs_backend, "context": context}
    for nodes in (1, 16 if args.quick else JETSPEC_BUDGET):
        for graphs in ("off", "compile"):
            out[f"{graphs}_n{nodes}"] = part_anatomy(target, head, context, nodes, steps, graphs, args.graphs_backend)
        out[f"speedup_n{nodes}"] = out[f"off_n{nodes}"]["step_ms"] / out[f"compile_n{nodes}"]["step_ms"]
    return out


# ----------------------------------------------------------------------------------- report
def markdown(report: dict) -> str:
    lines = [f"# GPU check — {report['device_name']}, {report['dtype']}{' (quick, scaled-down shapes)' if report['quick'] else ''}",
             f"{report['date']}; torch {report['torch']}, transformers {report['transformers']}; "
             f"{report['seconds']:.0f} s", ""]
    lines.append("## a. Losslessness (random SmolLM2-shaped target, random head)")
    for dname, res in report["lossless"].items():
        if isinstance(res, str):
            lines.append(f"- {dname}: {res}")
            continue
        cells = ", ".join(f"{k}: {v['identical']}/{res['prompts']} identical, {v['tie_flips']} tie flips, "
                          f"{v['divergent']} divergent" for k, v in res.items() if isinstance(v, dict))
        lines.append(f"- {dname}: {cells}")
    lines += ["", "## b, c. Verify cost, step cost, head forward, bandwidth floor"]
    for name, res in report["costs"].items():
        if isinstance(res, str):
            lines.append(f"- {name}: {res}")
            continue
        ratios = ", ".join(f"t({n})/t(1) {r:.2f}" for n, r in res["t_over_t1"].items())
        heads = ", ".join(f"{k} layers {v:.2f} ms" for k, v in res["head_forward_ms"].items())
        lines.append(f"- {name}: t(1) {res['t_ms'][1]:.2f} ms; {ratios}; head forward {heads}; AR step "
                     f"{res['ar_step_ms']:.2f} ms vs bandwidth floor {res['bandwidth_floor_ms']:.2f} ms "
                     f"({res['ar_over_floor']:.2f}x; copy bandwidth {res['copy_bandwidth_gb_s']:.0f} GB/s)")
        if "anatomy" in res and "anatomy_cudnn_allowed" in res:
            a, c = res["anatomy"], res["anatomy_cudnn_allowed"]
            lines.append(f"  - engine step, 1 row, {a['nodes']} nodes: {a['step_ms']:.1f} ms (draft {a['draft_ms']:.1f}, "
                         f"verify {a['verify_ms']:.1f}, commit {a['commit_ms']:.1f}); with cuDNN SDPA allowed "
                         f"{c['step_ms']:.1f} ms (draft {c['draft_ms']:.1f}, verify {c['verify_ms']:.1f}, "
                         f"commit {c['commit_ms']:.1f})")
        if "step_curve" in res:
            c = res["step_curve"]
            grid = "; ".join(f"B={b}: " + ", ".join(f"N={n} {ms:.1f}" for n, ms in zip(c["nodes"], row))
                             for b, row in zip(c["batch"], c["ms"]))
            lines.append(f"  - engine step T(B, N) ms: {grid}")
    lines += ["", "## d. Projected speedup at the paper's τ (Qwen3-8B shape, budget 256)",
              "| set | τ | paper | projected (step cost) | projected (isolated t(N) + 5-layer draft) |",
              "|---|---|---|---|---|"]
    for name, row in report["projection"].items():
        if isinstance(row, dict):
            step = f"{row['step_projection']:.2f}x ({row['step_over_paper']:.2f} of paper)" if "step_projection" in row else "–"
            lines.append(f"| {name} | {row['tau']} | {row['paper_speedup']}x | {step} | "
                         f"{row['isolated_projection']:.2f}x ({row['isolated_over_paper']:.2f}) |")
        else:
            lines.append(f"| {name} | {row} | | | |")
    js = report.get("jetspec", {})
    lines += ["", f"## d'. Beside JetSpec's engine (Qwen3-8B, B200, batch 1, budget {JETSPEC_BUDGET}; ours at "
                  f"{js.get('budget', JETSPEC_BUDGET)})"]
    if "skipped" in js or not js:
        lines.append(f"- {js.get('skipped', 'not run')}")
    else:
        lines += ["| set | τ | JetSpec tok/s | JetSpec ms/step | ours projected tok/s | ours/JetSpec |", "|---|---|---|---|---|---|"]
        for name in JETSPEC:
            r = js[name]
            lines.append(f"| {name} | {r['tau']} | {r['jetspec_tokens_per_s']:.0f} | {r['jetspec_step_ms']:.2f} | "
                         f"{r['projected_tokens_per_s']:.0f} | {r['projected_over_jetspec']:.2f} |")
        lines.append(f"- our step T(1, {js['budget']}) {js['step_ms']:.2f} ms; AR {js['ar_tokens_per_s']:.0f} tok/s")
        if "gaps_ms" in js:
            lines.append(f"- verify forward t({js['budget']}) {js['verify_forward_ms']:.2f} ms vs weight-read floor "
                         f"{js['bandwidth_floor_ms']:.2f} ms; engine phases: " +
                         ", ".join(f"{k} {v:.2f} ms" for k, v in js["anatomy"].items() if k.endswith("_ms")))
            lines.append("- time beyond what each part must cost: " +
                         "; ".join(f"{k} {v:.2f} ms" for k, v in js["gaps_ms"].items()) +
                         f". Biggest: **{js['biggest_gap']}**")
    lines += ["", "## e. AR step: CUDA graphs and static KV", json.dumps(report["compile"], indent=1, default=str)]
    core = report.get("stepcore") or {}
    lines += ["", f"## f. The step core (graphs=compile, backend {core.get('backend', '?')}) beside the eager engine, "
                  "1 row, SmolLM2 shape"]
    if not core or "skipped" in core or "failed" in core:
        lines.append(f"- {core.get('skipped') or core.get('failed') or 'not run'}")
    else:
        for key in [k for k in core if k.startswith("speedup_n")]:
            n = key.removeprefix("speedup_n")
            off, on = core[f"off_n{n}"], core[f"compile_n{n}"]
            lines.append(f"- {n} node(s): eager step {off['step_ms']:.2f} ms (draft {off['draft_ms']:.2f}, verify "
                         f"{off['verify_ms']:.2f}), compiled {on['step_ms']:.2f} ms (draft {on['draft_ms']:.2f}, verify "
                         f"{on['verify_ms']:.2f}): **{core[key]:.2f}x**; compiled in {on.get('compile_s', 0):.1f} s")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--quick", action="store_true", help="scaled-down shapes and sizes (CPU)")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (default 450 s, quick 280 s)")
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--parts", default="a,b,c,d,e,f", help="which parts to run (b includes c)")
    p.add_argument("--prompts", type=int, default=8, help="random prompts of the losslessness part (not --quick)")
    p.add_argument("--commit", default=None, help="the git commit measured (recorded in the report)")
    p.add_argument("--graphs-backend", default="inductor", help="torch.compile backend of the step core (parts a, f; "
                                                                "eager / aot_eager: capture only, for a rehearsal)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    budget = Budget(args.budget_s or (280 if args.quick else 450))
    parts = set(args.parts.split(","))
    from datetime import datetime, timezone

    import transformers

    from jetflow.eval.cost_model import device_name

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": args.device,
              "device_name": device_name(torch.device(args.device)), "dtype": args.dtype, "quick": args.quick,
              "torch": torch.__version__, "transformers": transformers.__version__, "commit": args.commit}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = [("lossless", "a", lambda: part_lossless(args, budget)), ("costs", "b", lambda: part_costs(args, budget)),
             ("projection", "d", lambda: part_projection(report["costs"])),
             ("jetspec", "d", lambda: part_jetspec(report["costs"])), ("compile", "e", lambda: part_compile(args, budget)),
             ("stepcore", "f", lambda: part_stepcore(args, budget))]
    for key, part, run in steps:
        report[key] = {}
        if part in parts:
            try:
                report[key] = run()
            except Exception as exc:  # noqa: BLE001 - one part's failure is a finding, not the end of the check
                report[key] = {"failed": f"{exc.__class__.__name__}: {exc}"}
                traceback.print_exc()
        report["seconds"] = budget.limit_s - budget.left
        # written after every part: a run stopped at the device's time limit still leaves what it measured
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"[gpu_check] {key} done at {report['seconds']:.0f} s", flush=True)
    md = markdown(report)
    (out / "gpu_check.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
