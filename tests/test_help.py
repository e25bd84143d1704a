"""Every entry point's `--help` is its documentation, and answers at once: it imports none of the heavy
libraries (torch, transformers, MLflow, Ray, pyarrow, datasets). Their option classes live in light modules;
the heavy imports happen inside the functions that run the job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "mlflow", "ray", "pyarrow", "datasets")
ENTRY_POINTS = [
    ["jobs/datagen.py"], ["jobs/train.py"], ["jobs/evaluate.py"], ["jobs/promote.py"], ["jobs/register.py"],
    ["sweeps/budget.py"], ["sweeps/arch.py"], ["serve/app.py"],
    ["-m", "jetflow.cli"], ["-m", "jetflow.cli", "generate"], ["-m", "jetflow.cli", "demo"],
    ["-m", "jetflow.cli", "export"], ["-m", "jetflow.cli", "prepare-model"],
]
_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|( *)(\S+)$")


def imports_of(argv: list[str]) -> tuple[subprocess.CompletedProcess, list[tuple[int, str]]]:
    """Run `python -X importtime ARGV --help` as a user runs it → (the process, [(depth, module)] in the order
    Python finished importing them: a module's imports come before it, one level deeper)."""
    out = subprocess.run([sys.executable, "-X", "importtime", *argv, "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    found = [(len(m[1]), m[2]) for line in out.stderr.splitlines() if (m := _IMPORT_LINE.match(line))]
    return out, found


def importer_chain(found: list[tuple[int, str]], i: int) -> list[str]:
    """The module at `found[i]` and the modules that imported it, up to the top level."""
    chain, depth = [found[i][1]], found[i][0]
    for d, name in found[i + 1:]:
        if d < depth:
            if name in chain:  # the outer import of a package's submodule: the package's own line came first
                break
            chain.append(name)
            depth = d
    return chain


@pytest.mark.parametrize("argv", ENTRY_POINTS, ids=[" ".join(a) for a in ENTRY_POINTS])
def test_help_of_every_entry_point_imports_no_heavy_library(argv):
    out, found = imports_of(argv)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout and "--help" in out.stdout
    assert any(name == "jetflow" for _, name in found), "importtime recorded no jetflow import: the check saw nothing"
    heavy = [i for i, (_, name) in enumerate(found) if name.split(".")[0] in HEAVY]
    assert not heavy, f"{' '.join(argv)} --help imports {found[heavy[0]][1].split('.')[0]}: " + " <- ".join(
        importer_chain(found, heavy[0]))


def test_the_import_check_sees_a_heavy_import():
    """The check above can fail: a script whose import chain reaches torch is reported with that chain."""
    out, found = imports_of(["-c", "import jetflow.decode.sampling", "--"])
    heavy = [i for i, (_, name) in enumerate(found) if name.split(".")[0] in HEAVY]
    assert heavy and found[heavy[0]][1].split(".")[0] == "torch"
    assert "jetflow.decode.sampling" in importer_chain(found, heavy[0])
