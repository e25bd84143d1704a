"""The main job on a simulated 3-node cluster beside the same job on one node: same machine, same preset, same
options, both from a fresh $JETFLOW_HOME (the target converted on first use, as on a new node).

    python benchmarks/cluster_main_job.py --preset smoke --out DIR      # root, iproute2 (the cluster needs both)

- one node: `sweeps/budget.py` as a user runs it on a laptop — a local Ray of this machine's cores, the sqlite
  store, storage = $JETFLOW_HOME;
- cluster: the same command as a driver on the head of `tests/cluster.py`'s cluster — a zero-CPU head and
  two worker nodes of one core each (the same two cores), each with its own $JETFLOW_HOME, S3 storage (moto)
  and an MLflow server — with JETFLOW_STORAGE and MLFLOW_TRACKING_URI set as a user would.

Both train the preset's head from an empty registry (regeneration on 2 actors, Ray Train on 2 workers), sweep
it and promote it. Prints (and writes DIR/cluster_main_job.json) the wall time of each, split as the job itself
records it: regeneration, features, training, held-out decoding (the head's provenance.json), the rest of
training-and-registering, the sweep, the whole.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def job_argv(preset: str) -> list[str]:
    return [sys.executable, str(ROOT / "sweeps" / "budget.py"), "--preset", preset, "--train-workers", "2",
            "--regen-workers", "2", "--budgets", "2,4", "--algorithms", "accum_logp", "--sets", "humaneval",
            "--prompts-per-set", "1", "--max-new-tokens", "16", "--concurrency", "1", "--max-concurrent", "2",
            "--name", "bench-sweep"]


def run_job(argv: list[str], env: dict, home: Path, log: Path) -> dict:
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    text = log.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"the main job failed (exit {proc.returncode}); its log: {log}\n{text[-3000:]}")
    m = re.search(r"(\d+) trials in [\d.]+ min \((\d+) s\); training before it [\d.]+ min \((\d+) s\); "
                  r"[\d.]+ min \((\d+) s\) in all", text)
    prov = json.loads((home / "heads" / argv[argv.index("--preset") + 1] / "provenance.json").read_text())
    t = prov["timings"]
    train_total = float(m[3]) if m else float("nan")
    return {"wall_s": wall, "job_s": float(m[4]) if m else float("nan"), "trials": int(m[1]) if m else 0,
            "sweep_s": float(m[2]) if m else float("nan"), "train_and_register_s": train_total,
            "datagen_s": t["datagen_s"], "features_s": t["features_s"], "train_s": t["train_s"], "eval_s": t["eval_s"],
            "register_and_other_s": train_total - sum(t[k] for k in ("datagen_s", "features_s", "train_s", "eval_s"))}


def one_node(preset: str, base: Path) -> dict:
    home = base / "one-node-home"
    env = {k: v for k, v in os.environ.items() if k not in ("JETFLOW_STORAGE", "JETFLOW_STORAGE_ENDPOINT",
                                                             "MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env.update(JETFLOW_HOME=str(home), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               TOKENIZERS_PARALLELISM="false")
    return run_job(job_argv(preset), env, home, base / "one-node.log")


def cluster(preset: str, base: Path) -> dict:
    from tests.cluster import cluster_unavailable, start_cluster

    reason = cluster_unavailable()
    if reason:
        raise SystemExit(f"no local cluster here: {reason}")
    home = base / "driver-home"
    t0 = time.perf_counter()
    with start_cluster(base / "cluster", home, workers=2) as c:
        started = time.perf_counter() - t0
        env = {**os.environ, **c.driver_env(), "TOKENIZERS_PARALLELISM": "false"}
        out = run_job(job_argv(preset), env, home, base / "cluster.log")
    return {**out, "cluster_start_s": started}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smoke", help="the training preset of both runs (default smoke)")
    p.add_argument("--out", default=None, help="folder for cluster_main_job.json (default: a temporary folder)")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="jf-cluster-bench-"))
    rows = {"one node (local Ray, 2 CPUs)": one_node(args.preset, base),
            "3-node cluster (0-CPU head + 2 × 1-CPU workers)": cluster(args.preset, base)}
    keys = ["datagen_s", "features_s", "train_s", "eval_s", "register_and_other_s", "train_and_register_s",
            "sweep_s", "job_s", "wall_s"]
    print(f"| run ({args.preset}) | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[k]:.0f}" for k in keys) + " |")
    a, b = rows.values()
    print(f"cluster / one node, whole job: {b['job_s'] / a['job_s']:.2f}x; cluster start {b['cluster_start_s']:.0f} s")
    out = Path(args.out) if args.out else base
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster_main_job.json").write_text(json.dumps({"preset": args.preset, "runs": rows}, indent=2) + "\n")
    print(f"logs and results: {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
