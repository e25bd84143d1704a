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


class DiesOnce(Doubler):
    """Stands in for a shard worker whose node is lost while it answers job 3 (the first time only)."""

    def __init__(self, marker: str):
        self.marker = marker

    def run(self, job: int) -> tuple[int, int]:
        import os

        if job == 3 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)  # the actor's process dies mid-job: the driver gets a RayActorError
        return super().run(job)


def test_a_job_whose_actor_dies_goes_to_another_actor_and_every_job_finishes(tmp_path):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actors = [ray.remote(num_cpus=1)(DiesOnce).remote(str(tmp_path / "died")) for _ in range(2)]
        results = list(map_on_started_actors(actors, lambda a: a.ready.remote(), lambda a, j: a.run.remote(j),
                                             list(range(6))))
        assert (tmp_path / "died").exists()
        assert sorted(r for r, _ in results) == [0, 2, 4, 6, 8, 10]  # each job answered once, job 3 by the survivor
        # every actor lost with jobs left: the error is raised, not a hang
        (tmp_path / "died").unlink()
        lone = [ray.remote(num_cpus=1)(DiesOnce).remote(str(tmp_path / "died"))]
        with pytest.raises(ray.exceptions.RayActorError):
            list(map_on_started_actors(lone, lambda a: a.ready.remote(), lambda a, j: a.run.remote(j), [1, 3, 5]))
    finally:
        ray.shutdown()
