"""What `jetflow.cluster` hands workers, decided without a cluster: the tracking URI as another node reaches it
(a loopback host becomes the driver node's address on the route to the GCS), and a single-node Ray that
changes nothing (its workers share this machine's loopback and disk). The multi-node cases run on a real
cluster in tests/test_cluster_jobs.py."""

from __future__ import annotations

import pytest

from jetflow.cluster import handed_tracking_uri, init_ray, is_multi_node, worker_tracking_uri


def test_a_loopback_tracking_uri_becomes_the_drivers_address_towards_the_cluster():
    # the GCS at this machine's own non-loopback address: the route there starts from this machine's address
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.77", 9))  # a documentation address: no packet is sent
        here = s.getsockname()[0]
    if here.startswith("127."):
        pytest.skip("this machine has no non-loopback route")
    assert worker_tracking_uri("http://127.0.0.1:5000", "192.0.2.77:6379") == f"http://{here}:5000"
    assert worker_tracking_uri("https://localhost/mlflow", "192.0.2.77:6379") == f"https://{here}/mlflow"


@pytest.mark.parametrize("uri, gcs", [
    ("http://10.0.0.5:5000", "192.0.2.77:6379"),        # already an address other nodes reach
    ("http://127.0.0.1:5000", None),                    # no cluster joined
    ("http://127.0.0.1:5000", "127.0.0.1:6379"),        # a cluster on this machine's loopback: same machine
    ("sqlite:////tmp/x/mlflow.db", "192.0.2.77:6379"),  # not a server (refused on a multi-node cluster)
    ("databricks", "192.0.2.77:6379"),
])
def test_other_tracking_uris_are_handed_over_unchanged(uri, gcs):
    assert worker_tracking_uri(uri, gcs) == uri


def test_a_single_node_ray_hands_the_workers_the_drivers_own_settings(monkeypatch, tmp_path):
    import ray

    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    monkeypatch.delenv("JETFLOW_STORAGE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init_ray(None, need_tracking=False, num_cpus=1)  # no server at that URI: what is handed, not whether it answers
    try:
        assert not is_multi_node()  # one node with CPUs: no storage needed, no file store refused
        assert handed_tracking_uri() == "http://127.0.0.1:5999"  # its workers share this loopback

        @ray.remote(num_cpus=1)
        def seen():
            import os

            return os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("JETFLOW_HOME")

        assert ray.get(seen.remote()) == ("http://127.0.0.1:5999", str(tmp_path))
    finally:
        ray.shutdown()


def test_a_later_ray_is_handed_its_own_drivers_uri_not_an_earlier_ones(monkeypatch, tmp_path):
    """`handed_tracking_uri` follows the current connection and environment: nothing stays behind from an earlier
    `init_ray` (a test's, a notebook's)."""
    import ray

    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("JETFLOW_STORAGE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5998")
    init_ray(None, need_tracking=False, num_cpus=1)  # no server at that URI (see above)
    ray.shutdown()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert handed_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
