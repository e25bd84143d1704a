"""One config surface: every entry point takes a tree setting through `TreeSpec`, so an invalid budget gets
the same message everywhere, before anything is loaded; lists are comma-separated everywhere."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from jetflow.target import TargetModel

ROOT = Path(__file__).resolve().parents[1]
MESSAGE = "budget must be an integer in 1..4096 (tree nodes per round, the root counted; 1 = plain decoding), got 0"


def _script_main(path: str):
    return runpy.run_path(str(ROOT / path), run_name="entry_point_under_test")["main"]


def _cli_main():
    from jetflow.cli import main

    return main


ENTRY_POINTS = {  # name → (main(argv) loader, argv with a zero budget)
    "jetflow generate": (_cli_main, ["generate", "--head", "random", "--budget", "0", "hi"]),
    "jetflow demo": (_cli_main, ["demo", "--budget", "0"]),
    "jobs/evaluate.py": (lambda: _script_main("jobs/evaluate.py"), ["--head", "random", "--budgets", "8,0"]),
    "jobs/train.py": (lambda: _script_main("jobs/train.py"), ["--preset", "smoke", "--eval-budget", "0"]),
    "sweeps/budget.py": (lambda: _script_main("sweeps/budget.py"), ["--budgets", "0,4"]),
    "serve/app.py": (lambda: _script_main("serve/app.py"), ["--head", "random", "--budget", "0"]),
}


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("an invalid budget must be refused before the target loads")

    monkeypatch.setattr(TargetModel, "load", refuse)


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_every_entry_point_rejects_an_invalid_budget_with_the_same_message(name, capsys, nothing_loads):
    loader, argv = ENTRY_POINTS[name]
    code = loader()(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (name, err)
    assert err and err[-1].endswith(MESSAGE), (name, err)


def test_the_budget_ceiling_is_written_once():
    """`git grep 4096` in the library finds the ceiling in one place: the TreeSpec module."""
    hits = [p for p in (ROOT / "platform" / "jetflow").rglob("*.py") if "4096" in p.read_text()]
    assert [p.relative_to(ROOT).as_posix() for p in hits] == ["platform/jetflow/tree/spec.py"]
