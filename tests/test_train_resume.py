"""Resuming a Ray Train training from its checkpoints in storage (`jetflow.train.ray_train`): which checkpoint
is this training's, which MLflow run it continues, and that a checkpoint cut short never loads. (The whole path —
a node killed mid-training, every rank resuming from the same step in the same run — is in
tests/test_cluster_faults.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from jetflow.train.ray_train import RESUME_MARKER, stored_resume, stored_state, train_hash
from jetflow.train.trainer import STATE


def _step_checkpoint(folder: Path, step: int, marker: dict | str | None) -> Path:
    folder.mkdir(parents=True)
    torch.save({"step": step, "head": {}, "optimizer": {}, "scheduler": {}}, folder / STATE)
    if marker is not None:
        (folder / RESUME_MARKER).write_text(marker if isinstance(marker, str) else json.dumps(marker))
    return folder


def test_the_driver_continues_the_run_of_the_furthest_whole_checkpoint_of_this_training(tmp_path):
    run = tmp_path / "ray" / "train-smoke"
    mine, other = "a" * 16, "b" * 16
    _step_checkpoint(run / "checkpoint_2026-12-05_01", 2, {"step": 2, "train_hash": mine, "mlflow_run_id": "r1"})
    # the run's final report: the head folder, holding its step checkpoints
    _step_checkpoint(run / "checkpoint_2026-12-05_02" / "checkpoints" / "step-0000004", 4,
                     {"step": 4, "train_hash": mine, "mlflow_run_id": "r1"})
    # an upload cut short (its marker half written), and another training's checkpoint under the same name
    _step_checkpoint(run / "checkpoint_2026-12-05_03", 6, '{"step": 6, "train_ha')
    _step_checkpoint(run / "checkpoint_2026-12-05_04", 8, {"step": 8, "train_hash": other, "mlflow_run_id": "r2"})
    (run / "checkpoint_2026-12-05_05").mkdir()  # nothing uploaded yet
    found = stored_resume("train-smoke", tmp_path / "ray", mine)
    assert found == {"step": 4, "train_hash": mine, "mlflow_run_id": "r1"}
    assert stored_resume("train-smoke", tmp_path / "ray", other)["mlflow_run_id"] == "r2"
    assert stored_resume("train-smoke", tmp_path / "ray", "c" * 16) is None
    assert stored_resume("train-none", tmp_path / "ray", mine) is None


def test_a_worker_loads_only_a_whole_checkpoint_of_its_own_training(tmp_path):
    from ray.train import Checkpoint

    mine = "a" * 16
    whole = _step_checkpoint(tmp_path / "whole", 3, {"step": 3, "train_hash": mine, "mlflow_run_id": "r1"})
    assert stored_state(Checkpoint.from_directory(str(whole)), mine)["step"] == 3
    assert stored_state(Checkpoint.from_directory(str(whole)), "b" * 16) is None  # another training's
    assert stored_state(None, mine) is None
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / RESUME_MARKER).write_text(json.dumps({"step": 5, "train_hash": mine}))  # no state file: not whole
    assert stored_state(Checkpoint.from_directory(str(torn)), mine) is None


def test_a_trainings_identity_is_its_settings_target_and_data_not_where_it_writes():
    base = {"train": {"lr": 1e-3, "name": "smoke"}, "model": "smollm2-135m", "features_rel": "features/x"}
    same = train_hash({**base, "out": "/a", "use_gpu": True})
    assert same == train_hash({**base, "out_home_rel": "heads/smoke", "use_gpu": False})
    assert same != train_hash({**base, "features_rel": "features/y"})
    assert same != train_hash({**base, "train": {"lr": 2e-3, "name": "smoke"}})
