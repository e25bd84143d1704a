"""Sanity check of head learnability: train a fresh head on the blocks of ONE cached sequence and print
loss and per-depth top-1 agreement every few steps. A head that cannot overfit one sequence will not
learn from many. Needs a feature cache (run `jobs/datagen.py` or the demo first)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from jetflow.data.features import FeatureCache
from jetflow.paths import jetflow_home
from jetflow.target import TargetModel
from jetflow.train.blocks import sample_anchors
from jetflow.train.config import TrainConfig
from jetflow.train.losses import draft_loss
from jetflow.train.trainer import _teacher, block_forward, build_head


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--features", default=None, help="feature cache folder (default: the first under $JETFLOW_HOME)")
    p.add_argument("--sequence", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-4, help="3e-3 diverges without warmup (measured)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--final-norm-init", type=float, default=1.0, help="initial final-norm weight (0.05 = damped)")
    p.add_argument("--loss", default="ce")
    args = p.parse_args()
    folder = Path(args.features) if args.features else sorted((jetflow_home() / "features").iterdir())[0]
    target = TargetModel.load("smollm2-135m")
    data = FeatureCache(folder)
    head = build_head(TrainConfig(num_hidden_layers=2, block_size=args.block_size), target, data.meta["spec"]["layer_ids"])
    torch.nn.init.constant_(head.norm.weight, args.final_norm_init)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr)
    seq = data[args.sequence]
    anchors = sample_anchors(seq["response_start"], len(seq["tokens"]), args.block_size, args.anchors,
                             torch.Generator().manual_seed(0))
    t_ids, t_logp = _teacher(seq, anchors, head)
    for step in range(args.steps + 1):
        logits, labels = block_forward(head, target, seq, anchors)
        loss = draft_loss(logits, labels, t_ids, t_logp, args.loss)
        if step % 5 == 0:
            agree = (logits.argmax(-1) == labels).float().mean(0).tolist()
            print(f"step {step:3d}  loss {loss.item():7.3f}  agreement by depth {[round(a, 2) for a in agree]}")
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
