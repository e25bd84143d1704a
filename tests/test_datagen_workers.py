"""`jobs/datagen.py --workers N` with more workers than Ray has CPUs: the started actors do every shard, the
unplaceable ones wait and are cleaned up — no hang (ActorPool handed shards to actors that never started)."""

from __future__ import annotations

import threading

import pytest

from jetflow.data.regenerate import map_on_started_actors


class Doubler:
    """Stands in for a shard worker: `ready` once placed, `run` answers a job."""

    def ready(self) -> bool:
        return True

    def run(self, job: int) -> tuple[int, int]:
        import os

        return job * 2, os.getpid()


@pytest.fixture
def one_cpu_ray():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_more_workers_than_cpus_finish_every_job_on_the_actors_that_started(one_cpu_ray):
    ray = one_cpu_ray
    actors = [ray.remote(num_cpus=1)(Doubler).remote() for _ in range(3)]  # 1 CPU: two can never start
    results: list = []

    def consume():
        results.extend(map_on_started_actors(actors, lambda a: a.ready.remote(), lambda a, j: a.run.remote(j),
                                             list(range(5))))

    worker = threading.Thread(target=consume, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "hung: jobs were handed to actors that never started"
    assert sorted(r for r, _ in results) == [0, 2, 4, 6, 8]
    assert len({pid for _, pid in results}) == 1  # all on the one actor that got the CPU
