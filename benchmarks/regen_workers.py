"""Regeneration scaling over Ray workers, measured side by side in one run.

    python benchmarks/regen_workers.py [--prompts 64] [--shard-size 16] [--max-new-tokens 96]

Regenerates the same shards three times, into fresh temporary folders, and prints response tokens/s for:
  1 core    one process, torch on one thread (what one Ray worker with num_cpus=1 gets)
  N actors  `workers=N` Ray actors, one CPU each (N = the machine's cores unless --workers)
  in-proc   one process, torch on every core (what `workers=1` does on this machine)
The ratio "N actors / 1 core" is the scaling a cluster sees when each worker brings its own cores; all
three runs should produce the same content hash (thread counts change float summation order, so a
near-tie could in principle flip a greedy token; the script reports, it does not assert).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from jetflow.data.regenerate import MANIFEST, RegenConfig, regenerate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--shard-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    args = p.parse_args()

    import ray

    cfg = RegenConfig(num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, batch_size=args.shard_size,
                      shard_size=args.shard_size)
    threads = torch.get_num_threads()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        def run(name: str, c: RegenConfig) -> None:
            t0 = time.perf_counter()
            out = regenerate(c, out=Path(tmp) / name, progress=False)
            seconds = time.perf_counter() - t0
            manifest = json.loads((out / MANIFEST).read_text())
            results[name] = (manifest["response_tokens"] / seconds, manifest["content_sha256"])
            print(f"{name:>10}: {manifest['sequences']} sequences, {manifest['response_tokens']} response tokens "
                  f"in {seconds:.1f} s = {results[name][0]:.1f} tok/s", flush=True)

        torch.set_num_threads(1)
        run("1 core", cfg)
        torch.set_num_threads(threads)
        ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
        try:
            run(f"{args.workers} actors", dataclasses.replace(cfg, workers=args.workers))
        finally:
            ray.shutdown()
        run("in-proc", cfg)
    rate = {k: v[0] for k, v in results.items()}
    print(f"{args.workers} actors / 1 core: {rate[f'{args.workers} actors'] / rate['1 core']:.2f}x; "
          f"{args.workers} actors / in-proc ({threads} threads): {rate[f'{args.workers} actors'] / rate['in-proc']:.2f}x")
    print("same content hash:", len({v[1] for v in results.values()}) == 1)


if __name__ == "__main__":
    main()
