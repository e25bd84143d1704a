"""A head that drafts nothing but its copy candidates: the baseline a trained copy head must beat.

    python benchmarks/copy_only_head.py --out DIR [--copy-ngram 3] [--block-size 8] [--model smollm2-135m]
    python benchmarks/sim_vs_decoded.py --head DIR --prompts 40

Its layers are identities (zeroed o_proj and down_proj), so each block position's output is the final
norm of its input: the MASK embedding plus the copy candidate at that depth (`jetflow.head.copy`). The
candidate's own logit dominates, so the tree's spine is the copied continuation — prompt-lookup decoding
through JetFlow's tree and decoder — and the other branches (and positions without a match) are noise.
The difference between a trained copy head's τ and this one's is what training adds to the copying.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder to save the head in (pass it to --head)")
    p.add_argument("--copy-ngram", type=int, default=3)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args(argv)

    from jetflow.head import DraftHead, HeadConfig, save_head
    from jetflow.target import TargetModel

    target = TargetModel.load(args.model)
    head = DraftHead(HeadConfig.for_target(target, copy_ngram=args.copy_ngram, block_size=args.block_size,
                                           num_hidden_layers=1))
    head.identity_layers()
    print(save_head(head, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
