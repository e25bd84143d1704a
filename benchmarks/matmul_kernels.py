"""CPU GEMM kernels for the shapes the decoder runs (fp32): which formulation is fastest, and what
oneDNN weight prepacking would buy. Prints a markdown table; median of repeated runs."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from jetflow.eval.timing import median_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    shapes = {"LM head 49152x576": (49152, 576), "MLP up 1536x576": (1536, 576), "MLP down 576x1536": (576, 1536)}
    print("| weight | rows | F.linear ms | (V,H)@(H,m) ms | x@W^T contiguous ms | oneDNN prepacked ms | max abs diff prepacked |")
    print("|---|---|---|---|---|---|---|")
    for name, (o, i) in shapes.items():
        w = torch.randn(o, i) * 0.02
        wt = w.t().contiguous()
        for m in (1, 8, 32):
            x = torch.randn(m, i)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            ref = F.linear(x, w)
            diff = (torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "") - ref).abs().max().item()
            print(f"| {name} | {m} | {median_ms(lambda: F.linear(x, w), args.reps):.2f} | "
                  f"{median_ms(lambda: (w @ x.T).T, args.reps):.2f} | {median_ms(lambda: x @ wt, args.reps):.2f} | "
                  f"{median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, 'none', [], ''), args.reps):.2f} | "
                  f"{diff:.1e} |")


if __name__ == "__main__":
    main()
