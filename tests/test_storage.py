"""Cluster storage (`jetflow.storage`): unset it is `$JETFLOW_HOME` and nothing moves; a mounted path is read in
place; an S3-compatible store (a real moto server on 127.0.0.1) is read through each node's own cache, filled
file by file, atomically, by several processes at once; Ray Tune's storage arguments and a sweep's marker
files go through the same filesystem; a head folder in storage is a head reference."""

from __future__ import annotations

import json
import multiprocessing
import socket
from pathlib import Path

import pytest

from jetflow.errors import HeadNotFoundError, InvalidSettingError
from jetflow.storage import Storage, TuneLocation, storage, storage_env, tune_location

BUCKET = "jetflow-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A real S3-compatible server (moto) on 127.0.0.1 with one bucket; yields its endpoint."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
    yield endpoint, creds
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch, tmp_path):
    endpoint, creds = s3
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JETFLOW_STORAGE", f"s3://{BUCKET}/{tmp_path.name}")
    monkeypatch.setenv("JETFLOW_STORAGE_ENDPOINT", endpoint)
    return storage()


def test_unset_storage_is_jetflow_home_and_nothing_is_copied(monkeypatch, tmp_path):
    monkeypatch.delenv("JETFLOW_STORAGE", raising=False)
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "home"))
    st = storage()
    assert not st.is_object_store and st.root == (tmp_path / "home").resolve()
    assert st.staging("features/abc") == st.local("features/abc") == (tmp_path / "home" / "features" / "abc").resolve()
    assert st.ray_storage() == (str((tmp_path / "home" / "ray_results").resolve()), None)
    assert storage_env() == {}  # nothing to hand a worker: it shares this disk
    st.write_json("data/x/manifest.json", {"a": 1})
    assert json.loads((tmp_path / "home" / "data" / "x" / "manifest.json").read_text()) == {"a": 1}
    assert st.rel(tmp_path / "home" / "data" / "x") == "data/x"
    with pytest.raises(InvalidSettingError, match="not in cluster storage"):
        st.rel(tmp_path / "elsewhere")


def test_storage_uris_are_validated():
    for bad in ("relative/dir", "gs://bucket/x", "s3://", "s3:///prefix"):
        with pytest.raises(InvalidSettingError):
            Storage(bad)
    with pytest.raises(InvalidSettingError, match="storage-relative"):
        Storage("/tmp/x").staging("../escape")


def test_an_object_store_is_read_through_this_nodes_cache_and_written_by_publish(s3_env, tmp_path):
    st = s3_env
    assert st.is_object_store and st.root is None
    staged = st.staging("features/k1")
    assert staged.is_relative_to(tmp_path / "home" / "storage")  # the node's own cache, not the store
    (staged / "sub").mkdir(parents=True)
    (staged / "shard-00000.safetensors").write_bytes(b"a" * 1000)
    (staged / "sub" / "b.txt").write_text("bee")
    (staged / ".hidden.tmp").write_text("a writer's temporary file is never published")
    st.publish("features/k1")
    assert st.files("features/k1") == {"shard-00000.safetensors": 1000, "sub/b.txt": 3}
    assert st.uri_for("features/k1") == f"s3://{BUCKET}/{tmp_path.name}/features/k1"
    path, fs = st.ray_storage()
    assert path == f"{BUCKET}/{tmp_path.name}/ray_results" and fs is st.filesystem


def test_another_node_reads_the_store_into_its_own_cache(s3_env, tmp_path, monkeypatch):
    st = s3_env
    st.write_bytes("features/k2/shard-00000.safetensors", b"s" * 100)
    st.write_bytes("features/k2/features.json", b"{}")
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "node2"))  # another node: its own home, nothing there yet
    other = Storage(st.uri, st.endpoint)
    meta_only = other.local("features/k2", only=("features.json",))
    assert [p.name for p in meta_only.iterdir()] == ["features.json"]  # just what was asked for
    got = other.local("features/k2", required=("shard-00000.safetensors",))
    assert got == meta_only and got.is_relative_to(tmp_path / "node2")
    assert (got / "shard-00000.safetensors").read_bytes() == b"s" * 100
    assert not any(p.name.startswith(".") for p in got.rglob("*"))  # no temporary file left behind
    with pytest.raises(FileNotFoundError, match="features/none"):
        other.local("features/none", required=("features.json",))


def _fill(args) -> str:
    uri, endpoint, home = args
    import os

    os.environ["JETFLOW_HOME"] = home
    folder = Storage(uri, endpoint).local("data/big")
    return (folder / "blob.bin").read_bytes().hex()[:16]


def test_several_processes_fill_one_nodes_cache_at_once(s3_env, tmp_path, monkeypatch):
    st = s3_env
    blob = bytes(range(256)) * 40_000  # 10 MB: the downloads overlap
    st.write_bytes("data/big/blob.bin", blob)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        heads = pool.map(_fill, [(st.uri, st.endpoint, str(tmp_path / "shared-node"))] * 3)
    assert heads == [blob.hex()[:16]] * 3
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "shared-node"))
    folder = Storage(st.uri, st.endpoint).staging("data/big")  # where the three processes wrote, no download
    assert (folder / "blob.bin").read_bytes() == blob
    assert [p.name for p in folder.iterdir()] == ["blob.bin"]  # three writers, one file, no leftovers


def test_tune_location_keeps_a_sweeps_marker_beside_tunes_state_in_the_store(s3_env, tmp_path):
    loc = tune_location("budget-sweep")
    assert loc.filesystem is s3_env.filesystem and loc.path.endswith("/ray_results/budget-sweep")
    assert loc.read_json("mlflow_parent_run.json") is None
    loc.write_json("mlflow_parent_run.json", {"run_id": "abc"})
    assert loc.read_json("mlflow_parent_run.json") == {"run_id": "abc"}
    assert not loc.can_restore()  # no Tune state yet
    local = tune_location("x", override=str(tmp_path / "tune"))
    assert local == TuneLocation(str((tmp_path / "tune").resolve()), None, "x")
    local.write_json("m.json", {"k": 1})
    assert json.loads((tmp_path / "tune" / "x" / "m.json").read_text()) == {"k": 1}


def test_a_head_folder_in_the_store_is_a_head_reference_resolved_on_this_node(s3_env, tmp_path):
    from jetflow.head import HeadRef

    st = s3_env
    st.write_json("ray_results/train-x/checkpoint_000000/config.json", {"fake": True})
    st.write_bytes("ray_results/train-x/checkpoint_000000/model.safetensors", b"weights")
    st.write_bytes("ray_results/train-x/checkpoint_000000/checkpoints/step-0000001/trainer_state.pt", b"optimizer")
    uri = st.uri_for("ray_results/train-x/checkpoint_000000")
    ref = HeadRef.parse(uri)
    assert ref.kind == "storage" and ref.portable() is ref
    folder = ref.resolve()
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    assert not (folder / "checkpoints").exists()  # the optimizer states stay in the store
    with pytest.raises(HeadNotFoundError, match="no head at"):
        HeadRef.parse(st.uri_for("ray_results/none")).resolve()
    with pytest.raises(HeadNotFoundError, match="not in this node's cluster storage"):
        HeadRef.parse("s3://other-bucket/heads/x").resolve()


def test_a_folder_only_this_node_has_is_no_reference_for_other_nodes(monkeypatch, tmp_path):
    from jetflow.head import HeadRef

    monkeypatch.setenv("JETFLOW_STORAGE", str(tmp_path / "mnt"))
    (tmp_path / "mnt" / "heads" / "h").mkdir(parents=True)
    assert HeadRef.parse(str(tmp_path / "mnt" / "heads" / "h")).portable().kind == "local"  # a shared mount
    with pytest.raises(InvalidSettingError, match="register it"):
        HeadRef.parse(str(tmp_path / "home-only" / "h")).portable()
    assert HeadRef.parse("models:/m@champion").portable().kind == "registry"
