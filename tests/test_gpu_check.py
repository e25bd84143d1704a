"""benchmarks/gpu_check.py runs the same code tiny on CPU (`--device cpu --quick`), so the GPU check is known to
work before a GPU is found: every part reports, fp32 and bf16 decoding are lossless, the projection is computed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One OpenMP thread, as each pytest-xdist worker has: two threads on a core the other worker keeps busy wait on
# each other at every parallel region (make test's wall time, not what these check).
ENV = {"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_gpu_check_runs_quick_on_cpu_and_reports_every_part(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                             "--graphs-backend", "aot_eager", "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check")
    for dtype in ("fp32", "bf16"):
        parts = report["lossless"][dtype]
        assert isinstance(parts, dict), parts
        assert all(v["divergent"] == 0 for k, v in parts.items() if isinstance(v, dict)), parts
    assert parts["engine_b8_vs_ar"]["identical"] + parts["engine_b8_vs_ar"]["tie_flips"] == parts["prompts"]
    for budget in (8, 32):  # the compiled step core's engine, too
        row = report["lossless"]["fp32"][f"compiled_engine_b{budget}_vs_ar"]
        assert row["divergent"] == 0 and row["identical"] + row["tie_flips"] == parts["prompts"]
    for shape in ("smollm2-135m", "qwen3-8b"):
        costs = report["costs"][shape]
        assert isinstance(costs, dict), costs
        assert costs["t_ms"]["1"] > 0 and set(costs["head_forward_ms"]) == {"1", "2", "5"}
        assert costs["ar_step_ms"] > 0 and costs["bandwidth_floor_ms"] > 0
        anatomy = costs["anatomy"]
        assert anatomy["steps"] == 3 and anatomy["nodes"] == 16
        # medians over the steps: each phase's is at most the step's (it is in every step), but medians do not
        # add up, so their sum may exceed the step's median on a busy machine
        assert anatomy["step_ms"] >= max(anatomy["draft_ms"], anatomy["verify_ms"]) and anatomy["draft_ms"] > 0 \
            and anatomy["verify_ms"] > 0
    assert {"MATH-500", "MT-Bench", "HumanEval"} <= set(report["projection"])
    assert report["compile"]["static_cache_eager_ms"] > 0
    jetspec = report["jetspec"]  # quick: at the scaled-down run's largest tree (16), the same code as at 128
    assert jetspec["budget"] == 16
    for name, (tau, _) in {"MT-Bench": (4.88, 545), "HumanEval": (6.92, 867)}.items():
        assert jetspec[name]["projected_tokens_per_s"] == pytest.approx(tau * 1000 / jetspec["step_ms"])
    assert jetspec["biggest_gap"] == max(jetspec["gaps_ms"], key=jetspec["gaps_ms"].get)
    assert report["commit"] is None  # --commit not given
    core = report["stepcore"]  # the step core beside the eager engine, a plain step and a 16-node tree
    assert core["backend"] == "aot_eager" and set(core) >= {"off_n1", "compile_n1", "off_n16", "compile_n16"}
    assert all(core[k]["step_ms"] > 0 for k in ("off_n1", "compile_n1", "off_n16", "compile_n16"))
    assert core["compile_n16"]["compile_s"] > 0 and "compile_s" not in core["off_n16"]
    assert "## f. The step core" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_gpu_profile_runs_quick_on_cpu_and_labels_every_engine_phase(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_profile.py"), "--device", "cpu", "--quick",
                             "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                            env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert set(report["cases"]) == {"engine-b1-n16", "engine-b1-plain", "target-step"}
    tree = report["cases"]["engine-b1-n16"]
    assert {"draft/head+topk", "draft/head+topk/head_forward", "draft/build_tree", "verify/forward",
            "verify/accept_walk", "commit"} <= set(tree["phases"])
    phases = tree["phases"]
    assert 0 < phases["draft/head+topk/head_forward"]["host_ms"] <= phases["draft/head+topk"]["host_ms"]
    assert phases["verify/forward"]["calls"] == 1.0  # one target forward per step, the labels counted per step
    assert tree["aten_ops"] > report["cases"]["engine-b1-plain"]["aten_ops"] > 0
    assert (tmp_path / "profile-target-step.txt").read_text().strip()
