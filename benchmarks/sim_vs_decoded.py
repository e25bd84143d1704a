"""Does the decoder accept what the training monitor predicts? Decoded τ beside the simulated tree walk
on the same held-out prompts.

    python benchmarks/sim_vs_decoded.py --head demo [--sets mtbench,humaneval] [--prompts 16]
        [--new-tokens 64] [--budget 32] [--width 7] [--threads 2]

For each prompt (`--prompts` spread over its set's eval split): the real decoder's τ (greedy, tree
`accum_logp`); then its output — the target's greedy continuation, since decoding is lossless — goes
through the target once for its tapped features, and every response position becomes an anchor of the
*training* forward (`block_forward`, the block-causal mask) and of the tree walk the monitor runs.
`sim_walk` follows the anchors the decoder visits (next anchor = anchor + accepted + 1): equal to the
decoded τ when training and inference agree. `sim_all` averages over every anchor, as the monitor
does on its held-out blocks; it weighs easy stretches by their length, not by the few rounds they take.
Prints one JSON line per set. A gap between the monitor's held-out τ and these numbers is then the
prompts' distribution, not a train/infer mismatch.

It also splits the anchors by whether the answer is *copying* there: an anchor is copyable when it and
the next `COPY_SPAN` tokens occurred together earlier in the sequence (prompt or answer), as when a
HumanEval answer repeats the function's signature. `copyable_share` and the committed tokens per round at
copyable and at other anchors tell how well the head drafts what it could read from its context.
"""

from __future__ import annotations

import argparse
import json
import sys

COPY_SPAN = 3


def copyable(ids: list[int], pos: int, span: int = COPY_SPAN) -> bool:
    """ids[pos .. pos+span] occurred, in that order, somewhere before pos."""
    pattern = ids[pos: pos + span + 1]
    return len(pattern) == span + 1 and any(ids[j: j + span + 1] == pattern for j in range(pos - span))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="head name under $JETFLOW_HOME/heads or a folder")
    p.add_argument("--sets", default="mtbench,humaneval", help="comma-separated eval prompt sets")
    p.add_argument("--prompts", type=int, default=16, help="prompts per set, spread over its eval split")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = p.parse_args(argv)

    import torch

    from jetflow.data import spread_prompts
    from jetflow.data.features import sequence_features
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.head import load_head
    from jetflow.target import TargetModel
    from jetflow.train.monitor import tree_accepted_for_blocks
    from jetflow.train.trainer import block_forward
    from jetflow.tree import TreeSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    head = load_head(args.head).eval()
    target = TargetModel.load(head.config.target_model_id)
    block = head.config.block_size
    decoder = Decoder(target, head)
    tree = TreeSpec("accum_logp", args.budget, args.width)
    cfg = DecodeConfig(tree=tree, max_new_tokens=args.new_tokens)
    for name in args.sets.split(","):
        committed = rounds = walk_committed = walk_rounds = 0
        every: list[int] = []
        by_copy: dict[bool, list[int]] = {True: [], False: []}
        depth1: list[bool] = []
        per_prompt = []
        for item in spread_prompts(name, args.prompts):
            g = decoder.generate(item.chat, cfg)
            committed += sum(g.stats.committed_per_round)
            rounds += g.stats.rounds
            per_prompt.append(round(g.stats.tau, 2))
            prompt_ids = decoder.encode(item.chat)
            ids = prompt_ids + list(g.token_ids)
            anchors = torch.arange(len(prompt_ids), len(ids) - block + 1)
            if not anchors.numel():
                continue
            feats, _, _ = sequence_features(target, ids, head.config.target_layer_ids, 1, teacher_from=len(ids) - 1)
            with torch.no_grad():
                logits, labels = block_forward(head, target, {"tokens": torch.tensor(ids), "features": feats.half()},
                                               anchors)
            accepted = tree_accepted_for_blocks(logits, labels, tree)
            every += accepted
            for a, acc in zip(anchors.tolist(), accepted):
                by_copy[copyable(ids, a)].append(acc + 1)
            depth1 += (logits[:, 0].argmax(-1) == labels[:, 0]).tolist()
            i = 0
            while i < len(accepted):
                walk_committed += accepted[i] + 1
                walk_rounds += 1
                i += accepted[i] + 1
        print(json.dumps({
            "set": name, "prompts": len(per_prompt), "decoded_tau": round(committed / max(1, rounds), 3),
            "sim_walk_tau": round(walk_committed / max(1, walk_rounds), 3),
            "sim_all_tau": round((sum(every) + len(every)) / max(1, len(every)), 3),
            "agree_d1": round(sum(depth1) / max(1, len(depth1)), 3),
            "copyable_share": round(len(by_copy[True]) / max(1, len(every)), 3),
            "committed_at_copyable": round(sum(by_copy[True]) / max(1, len(by_copy[True])), 3),
            "committed_at_other": round(sum(by_copy[False]) / max(1, len(by_copy[False])), 3),
            "decoded_tau_per_prompt": per_prompt,
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
