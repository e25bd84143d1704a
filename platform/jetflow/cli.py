"""`jetflow` command line: generate text with (or without) a draft head, compare AR and speculative decoding
side by side, export a head for vLLM, prepare the bundled target. Every subcommand's options come from its
typed options class (`jetflow.config_cli`)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from jetflow.config_cli import add_dataclass_args, build_config, spilled_words
from jetflow.decode.config import DecodeConfig
from jetflow.errors import InvalidSettingError, JetFlowError
from jetflow.stepcore.modes import check_graphs
from jetflow.tree import TreeSpec

HEAD_HELP = ("head folder, name under $JETFLOW_HOME/heads, a published head's hub id (org/name), "
             "models:/NAME@ALIAS or models:/NAME/VERSION, 'random' or 'random-bidirectional' (random init)")
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class GenerateOptions:
    prompts: str | None = None           # a JSONL file, one object per line with 'prompt' or 'messages'
    model: str = "smollm2-135m"          # target: bundled name, local HF folder or hub id
    head: str | None = None              # the draft head (see --help's head forms); unset = plain AR
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    raw: bool = False                    # feed the prompt text as is, no chat template
    json: bool = False                   # one JSON object per prompt: text, token_ids, finish_reason, stats
    device: str = "auto"                 # where the target and head run: auto (cuda when there is a GPU), cpu,
                                         # cuda, cuda:N
    dtype: str = "float32"               # target and head weights: float32 (exactly greedy), bfloat16, float16
    graphs: str = "auto"                 # how steps run: off (the eager reference), compile (the step core,
                                         # torch.compile per bucket), auto (compile where this host's
                                         # `jetflow graphs --measure` says it pays, else off)

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHT_DTYPES:
            raise InvalidSettingError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.dtype!r}")
        if self.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise InvalidSettingError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        check_graphs(self.graphs)

    def placement(self):
        """(torch device, torch dtype) to load the target (and so the head) on."""
        import torch

        device = self.device if self.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(device), getattr(torch, self.dtype)


@dataclass
class DemoOptions:
    model: str = "smollm2-135m"          # target: bundled name, local HF folder or hub id
    head: str = "random"                 # the draft head (default: a random-init causal head)
    tree: TreeSpec = field(default_factory=lambda: TreeSpec(budget=32))
    prompts: int = 2                     # held-out prompts per set (MT-Bench, HumanEval)
    max_new_tokens: int = 48             # tokens generated per prompt


@dataclass
class ExportOptions:
    to: str = "vllm"                     # the engine that will load the checkpoint (vllm)
    head: str = ""                       # head folder or name under $JETFLOW_HOME/heads (required)
    out: str = ""                        # output folder, empty or absent (required)
    target: str | None = None            # the head's target (bundled name, folder, hub id): checks the head fits;
                                         # required for draft-vocabulary heads, whose LM-head rows are copied from it
    dtype: str | None = None             # cast weights: float32, bfloat16 or float16 (default: as stored)
    force: bool = False                  # replace a non-empty --out


def _read_prompts(path: str) -> list:
    """A JSONL prompt file (validated line by line by the prompt-set loader) → decoder inputs."""
    from jetflow.data import load_prompts

    if not Path(path).is_file():
        raise InvalidSettingError(f"prompts file {path} does not exist")
    items = load_prompts(path, split="all")
    if not items:
        raise InvalidSettingError(f"{path} holds no prompts")
    return [item.chat for item in items]


def cmd_generate(args: argparse.Namespace) -> int:
    from jetflow.engine import decoder_for
    from jetflow.head import HeadRef
    from jetflow.target import TargetModel

    opts: GenerateOptions = build_config(GenerateOptions, args)
    if opts.prompts and args.prompt:
        raise InvalidSettingError("give either a PROMPT or --prompts FILE, not both")
    prompts = _read_prompts(opts.prompts) if opts.prompts else [args.prompt]
    if prompts == [None]:
        raise InvalidSettingError("no prompt: give a PROMPT argument or --prompts FILE.jsonl")
    ref = HeadRef.parse(opts.head)
    ref.resolve()  # a missing head fails before the target loads
    device, dtype = opts.placement()
    target = TargetModel.load(opts.model, device=device, dtype=dtype)
    loaded = ref.load(target, seed=opts.decode.seed or 0)
    decoder = decoder_for(target, loaded.head if loaded else None, opts.graphs)
    if decoder.graphs == "compile":  # compile the step's graphs now, and say why and what it cost
        seconds = decoder.warm(0, opts.decode)
        print(f"[graphs: compile ({decoder.graphs_reason}): {len(decoder.compile_log)} step graphs compiled in "
              f"{seconds:.1f} s]", file=sys.stderr, flush=True)
    for prompt in prompts:
        result = decoder.generate(prompt, opts.decode, raw=opts.raw)
        if opts.json:
            print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}), flush=True)
        else:
            print(result.text)
            s = result.stats
            print(f"[{s.new_tokens} tokens, {s.rounds} rounds, tau {s.tau:.2f}, {s.tokens_per_s:.1f} tok/s, "
                  f"graphs {s.graphs}]", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Decode a few held-out prompts with AR and with tree speculation; show they are identical."""
    from jetflow.data import load_prompts
    from jetflow.decode import Decoder
    from jetflow.head import HeadRef
    from jetflow.target import TargetModel

    opts: DemoOptions = build_config(DemoOptions, args)
    ref = HeadRef.parse(opts.head)
    ref.resolve()
    target = TargetModel.load(opts.model)
    loaded = ref.load(target)
    label = "a random-init causal head (no trained head yet)" if ref.kind == "random" else loaded.label
    items = load_prompts("mtbench", limit=opts.prompts) + load_prompts("humaneval", limit=opts.prompts)
    ar, spec = Decoder(target), Decoder(target, loaded.head)
    tree = opts.tree.capped(loaded.head.config.block_size)
    print(f"target {target.model_id} ({target.revision}); head: {label}; tree {tree.label()}")
    ok = True
    for item in items:
        a = ar.generate(item.chat, DecodeConfig(max_new_tokens=opts.max_new_tokens))
        s = spec.generate(item.chat, DecodeConfig(tree=tree, max_new_tokens=opts.max_new_tokens))
        same = a.token_ids == s.token_ids
        ok &= same
        print(f"\n[{item.id}] {item.text[:70]!r}\n  -> {s.text[:110]!r}")
        print(f"  identical to AR: {same}; AR {a.stats.tokens_per_s:.1f} tok/s; speculative "
              f"{s.stats.tokens_per_s:.1f} tok/s, tau {s.stats.tau:.2f}")
    print("\nall outputs token-identical to AR greedy" if ok else "\nMISMATCH: speculative output differs from AR")
    return 0 if ok else 1


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from jetflow.target.bundled import prepare_bundled

    print(prepare_bundled(args.name, force=args.force))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a head as a checkpoint another engine loads; today vLLM's `dflash` speculative method."""
    from jetflow.head import HeadRef, check_fits, load_head
    from jetflow.vllm.export import DTYPES, export_vllm

    opts: ExportOptions = build_config(ExportOptions, args)
    if opts.to != "vllm":
        raise InvalidSettingError(f"--to {opts.to!r}: the only export target is vllm")
    if not opts.head or not opts.out:
        raise InvalidSettingError("export needs --head HEAD and --out DIR")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise InvalidSettingError(f"--dtype must be one of {', '.join(DTYPES)}, got {opts.dtype!r}")
    head_dir = HeadRef.parse(opts.head).resolve()
    lm_head_weight = lm_head_bias = None
    if opts.target:
        from jetflow.target import TargetModel

        cfg = load_head(head_dir).config  # a bad head fails before the target loads
        target = TargetModel.load(opts.target)
        check_fits(cfg, target)
        lm_head_weight, lm_head_bias = target.lm_head_weight, target.lm_head_bias
    out = export_vllm(head_dir, opts.out, lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias,
                      dtype=opts.dtype, overwrite=opts.force)
    spec = json.loads((out / "jetflow_export.json").read_text())["speculative_config"]
    print(out)
    print(f"vLLM: LLM(TARGET, speculative_config={json.dumps(spec)})", file=sys.stderr)
    return 0


@dataclass
class GraphsOptions:
    measure: bool = False                # measure eager vs compiled decoding on this host, side by side, and keep
                                         # the verdict `graphs=auto` follows ($JETFLOW_HOME/cache/graphs.json)
    model: str = "smollm2-135m"          # target: bundled name, local HF folder or hub id
    head: str | None = None              # also measure a tree setting with this head (default: AR only)
    tree: TreeSpec = field(default_factory=TreeSpec)  # the tree setting measured with --head
    prompts: int = 4                     # held-out prompts per set (MT-Bench, HumanEval)
    max_new_tokens: int = 32             # tokens generated per prompt
    passes: int = 1                      # passes over the prompts (modes alternate prompt by prompt)


def cmd_graphs(args: argparse.Namespace) -> int:
    """Show what `graphs=auto` resolves to on this host; with --measure, measure it first."""
    import torch

    from jetflow.stepcore.modes import read_verdict, resolve_graphs, verdicts_file

    opts: GraphsOptions = build_config(GraphsOptions, args)
    if opts.measure:
        from jetflow.data import load_prompts
        from jetflow.decode import encode_prompt
        from jetflow.head import HeadRef
        from jetflow.eval.graphs import measure_and_record
        from jetflow.target import TargetModel

        ref = HeadRef.parse(opts.head)
        ref.resolve()
        target = TargetModel.load(opts.model)
        loaded = ref.load(target)
        items = load_prompts("mtbench", limit=opts.prompts) + load_prompts("humaneval", limit=opts.prompts)
        prompts = [encode_prompt(target.tokenizer, it.chat) for it in items]
        tree = opts.tree.capped(loaded.head.config.block_size) if loaded else None
        result, key = measure_and_record(target, prompts, loaded.head if loaded else None, tree,
                                         opts.max_new_tokens, opts.passes)
        print(f"compiled {len(result['buckets'])} buckets in {result['compile_s']:.1f} s")
        for label, r in result["settings"].items():
            print(f"{label}: eager {r['eager_tok_s']:.1f} tok/s, compiled {r['compiled_tok_s']:.1f} tok/s "
                  f"({r['ratio']:.2f}x), lossless {r['lossless']}")
        print(f"verdict for {key}: ratio {result['ratio']:.2f} -> auto = {resolve_graphs('auto', key)[0]} "
              f"(kept in {verdicts_file()})")
        return 0
    from jetflow.stepcore.modes import host_key

    key = host_key("cuda" if torch.cuda.is_available() else "cpu", opts.model, "float32", torch.get_num_threads())
    mode, why = resolve_graphs("auto", key)
    print(f"graphs=auto on this host ({key}): {mode} — {why}")
    verdict = read_verdict(key)
    if verdict:
        print(json.dumps(verdict, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode prompts; speculative with --head, plain AR without",
                       description=f"Decode prompts; speculative with --head ({HEAD_HELP}), plain AR without.")
    g.add_argument("prompt", nargs="?", help="a user turn (chat-templated unless --raw)")
    add_dataclass_args(g, GenerateOptions, "generation")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="AR vs tree-speculative decoding on held-out prompts, side by side",
                       description=f"AR vs tree-speculative decoding on held-out prompts (--head: {HEAD_HELP}).")
    add_dataclass_args(d, DemoOptions, "demo")
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("export", help="write a head as a checkpoint vLLM's dflash speculative method loads")
    add_dataclass_args(e, ExportOptions, "export")
    e.set_defaults(func=cmd_export)

    gr = sub.add_parser("graphs", help="what graphs=auto means on this host; --measure: eager vs compiled, measured",
                        description=cmd_graphs.__doc__)
    add_dataclass_args(gr, GraphsOptions, "graphs")
    gr.set_defaults(func=cmd_graphs)

    p = sub.add_parser("prepare-model", help="convert a bundled target into $JETFLOW_HOME/models (once)")
    p.add_argument("name", help="bundled target name, e.g. smollm2-135m")
    p.add_argument("--force", action="store_true", help="convert again even if present")
    p.set_defaults(func=cmd_prepare_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    spilled = spilled_words(args)
    if spilled and getattr(args, "prompt", "absent") is None and len(spilled) == 1:
        args.prompt = spilled[0]  # `generate --json "a prompt"`: the word is the prompt, not --json's value
    elif spilled:
        parser.error(f"expected true/false after a flag, got {' '.join(map(repr, spilled))}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except JetFlowError as exc:
        print(f"jetflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
