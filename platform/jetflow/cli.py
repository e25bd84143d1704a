"""`jetflow` command line: generate text with (or without) a draft head, export a head for vLLM, prepare the
bundled target."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jetflow.errors import InvalidSettingError, JetFlowError

RANDOM_HEADS = {"random": True, "random-bidirectional": False}


def _positive(name: str):
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {value!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {n}")
        return n

    return parse


def _read_prompts(path: str) -> list:
    """A JSONL prompt file (validated line by line by the prompt-set loader) → decoder inputs."""
    from jetflow.data import load_prompts

    if not Path(path).is_file():
        raise InvalidSettingError(f"prompts file {path} does not exist")
    items = load_prompts(path, split="all")
    if not items:
        raise InvalidSettingError(f"{path} holds no prompts")
    return [item.chat for item in items]


def load_head_arg(spec: str | None, target, seed: int = 0):
    """None → no head (AR); 'random' / 'random-bidirectional' → random init; else a path or head name."""
    if spec is None:
        return None
    import torch

    from jetflow.head import DraftHead, HeadConfig, load_head

    if spec in RANDOM_HEADS:
        torch.manual_seed(seed)
        return DraftHead(HeadConfig.for_target(target, causal=RANDOM_HEADS[spec]))
    return load_head(spec)


def cmd_generate(args: argparse.Namespace) -> int:
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.head import resolve_head_path
    from jetflow.target import TargetModel

    cfg = DecodeConfig(budget=args.budget, width=args.width, algorithm=args.algorithm,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       max_new_tokens=args.max_new_tokens, stop=args.stop or [], seed=args.seed)
    if args.prompts and args.prompt:
        raise InvalidSettingError("give either a PROMPT or --prompts FILE, not both")
    prompts = _read_prompts(args.prompts) if args.prompts else [args.prompt]
    if prompts == [None]:
        raise InvalidSettingError("no prompt: give a PROMPT argument or --prompts FILE.jsonl")
    if args.head and args.head not in RANDOM_HEADS:
        resolve_head_path(args.head)  # a missing head fails before the target loads
    target = TargetModel.load(args.model)
    decoder = Decoder(target, load_head_arg(args.head, target, args.seed or 0))
    for prompt in prompts:
        result = decoder.generate(prompt, cfg, raw=args.raw)
        if args.json:
            print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}), flush=True)
        else:
            print(result.text)
            s = result.stats
            print(f"[{s.new_tokens} tokens, {s.rounds} rounds, tau {s.tau:.2f}, {s.tokens_per_s:.1f} tok/s]",
                  file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Decode a few held-out prompts with AR and with tree speculation; show they are identical."""
    from jetflow.data import load_prompts
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.head import load_head
    from jetflow.target import TargetModel

    target = TargetModel.load(args.model)
    head = load_head(args.head) if args.head else load_head_arg("random", target, 0)
    label = args.head or "a random-init causal head (no trained head yet)"
    items = load_prompts("mtbench", limit=args.prompts) + load_prompts("humaneval", limit=args.prompts)
    ar, spec = Decoder(target), Decoder(target, head)
    print(f"target {target.model_id} ({target.revision}); head: {label}")
    ok = True
    for item in items:
        a = ar.generate(item.chat, DecodeConfig(max_new_tokens=args.max_new_tokens))
        s = spec.generate(item.chat, DecodeConfig(budget=args.budget, max_new_tokens=args.max_new_tokens))
        same = a.token_ids == s.token_ids
        ok &= same
        print(f"\n[{item.id}] {item.text[:70]!r}\n  -> {s.text[:110]!r}")
        print(f"  identical to AR: {same}; AR {a.stats.tokens_per_s:.1f} tok/s; speculative (budget {args.budget}) "
              f"{s.stats.tokens_per_s:.1f} tok/s, tau {s.stats.tau:.2f}")
    print("\nall outputs token-identical to AR greedy" if ok else "\nMISMATCH: speculative output differs from AR")
    return 0 if ok else 1


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from jetflow.target.bundled import prepare_bundled

    print(prepare_bundled(args.name, force=args.force))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a head as a checkpoint another engine loads; today vLLM's `dflash` speculative method."""
    from jetflow.head import check_fits, load_head
    from jetflow.vllm.export import export_vllm

    lm_head_weight = lm_head_bias = None
    if args.target:
        from jetflow.target import TargetModel

        cfg = load_head(args.head).config  # a bad head fails before the target loads
        target = TargetModel.load(args.target)
        check_fits(cfg, target)
        lm_head_weight, lm_head_bias = target.lm_head_weight, target.lm_head_bias
    out = export_vllm(args.head, args.out, lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias,
                      dtype=args.dtype, overwrite=args.force)
    spec = json.loads((out / "jetflow_export.json").read_text())["speculative_config"]
    print(out)
    print(f"vLLM: LLM(TARGET, speculative_config={json.dumps(spec)})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode prompts; speculative with --head, plain AR without")
    g.add_argument("prompt", nargs="?", help="a user turn (chat-templated unless --raw)")
    g.add_argument("--prompts", metavar="FILE.jsonl", help="one JSON object per line with 'prompt' or 'messages'")
    g.add_argument("--model", default="smollm2-135m", help="bundled name, local HF folder or hub id")
    g.add_argument("--head", help="head folder or name under $JETFLOW_HOME/heads; 'random' or "
                                  "'random-bidirectional' for a random-init head; omit for AR")
    g.add_argument("--budget", type=_positive("--budget"), default=32, help="tree nodes per round, root counted")
    g.add_argument("--width", type=_positive("--width"), default=7, help="top-W draft tokens per depth")
    g.add_argument("--algorithm", default="accum_logp", help="tree algorithm: accum_logp, chain, top2gap")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=128)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (and random-head init)")
    g.add_argument("--raw", action="store_true", help="feed the prompt text as is, no chat template")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt: text, token_ids, stats")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="AR vs tree-speculative decoding on held-out prompts, side by side")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--head", help="head folder or name (default: a random-init causal head)")
    d.add_argument("--budget", type=_positive("--budget"), default=32)
    d.add_argument("--prompts", type=_positive("--prompts"), default=2, help="prompts per set (MT-Bench, HumanEval)")
    d.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=48)
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("export", help="write a head as a checkpoint vLLM's dflash speculative method loads")
    e.add_argument("--to", required=True, choices=["vllm"], help="the engine that will load the checkpoint")
    e.add_argument("--head", required=True, help="head folder or name under $JETFLOW_HOME/heads")
    e.add_argument("--out", required=True, metavar="DIR", help="output folder (must be empty or absent)")
    e.add_argument("--target", help="the head's target (bundled name, folder, hub id): checks the head fits; "
                                    "required for draft-vocabulary heads, whose LM-head rows are copied from it")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: as stored)")
    e.add_argument("--force", action="store_true", help="replace a non-empty --out")
    e.set_defaults(func=cmd_export)

    p = sub.add_parser("prepare-model", help="convert a bundled target into $JETFLOW_HOME/models (once)")
    p.add_argument("name", help="bundled target name, e.g. smollm2-135m")
    p.add_argument("--force", action="store_true", help="convert again even if present")
    p.set_defaults(func=cmd_prepare_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except JetFlowError as exc:
        print(f"jetflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
