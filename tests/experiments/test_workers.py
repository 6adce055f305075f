"""Compile workers (experiments/workers.py): each slot of a pool on a core of its own."""

import os
import sys
import threading
import time
import types

import pytest

from experiments import workers

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="no CPU affinity on this platform")


def test_a_worker_keeps_to_the_core_its_pool_gives_it():
    w = workers.Worker(2, core=0)
    try:
        deadline = time.monotonic() + 20
        while os.sched_getaffinity(w.proc.pid) != {0} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.sched_getaffinity(w.proc.pid) == {0}
    finally:
        w.close()


def test_a_pool_pins_its_slots_only_when_each_can_have_a_core(monkeypatch):
    monkeypatch.setattr(workers, "_cores", lambda: [0, 1, 2, 3])
    assert workers.Pool(2).cores == [0, 1, 2, 3]
    assert workers.Pool(4).cores == [0, 1, 2, 3]
    assert workers.Pool(8).cores == []  # more slots than cores: the OS shares them out
    assert workers.Pool(1).cores == []  # one worker has nothing to spin against


class _FakeRay:
    """What the Ray path uses of `ray`, on threads: a task starts at `.remote()` (as Ray's
    do) and ends when `get` has waited a little for it; counts the tasks in flight."""

    def __init__(self, cpus: int):
        self.cpus, self.started, self.running, self.peak = cpus, 0, 0, 0
        self.lock = threading.Lock()

    def is_initialized(self):
        return False

    def init(self, **kwargs):
        pass

    def shutdown(self):
        pass

    def cluster_resources(self):
        return {"CPU": float(self.cpus)}

    def remote(self, **options):  # ray.remote(...)(fn): the task
        return lambda fn: self

    def options(self, **options):  # task.options(...): the task, started by its .remote
        return types.SimpleNamespace(remote=self._start)

    def _start(self, devices, req, timeout_s):
        with self.lock:
            self.started += 1
            self.running += 1
            self.peak = max(self.peak, self.running)
        return req["id"]

    def get(self, ref):
        time.sleep(0.05)
        with self.lock:
            self.running -= 1
        return {"status": "ok", "id": ref}


@pytest.mark.parametrize("workers_,cpus,peak", [(2, 16, 2), (None, 3, 3)])
def test_ray_keeps_at_most_the_workers_or_the_clusters_cpus_in_flight(monkeypatch, workers_,
                                                                      cpus, peak):
    fake = _FakeRay(cpus)
    monkeypatch.setitem(sys.modules, "ray", fake)
    submit, shutdown, slots = workers.executor(workers=workers_, ray_address="")
    futures = [submit(2, {"backend": "cpu", "id": i}) for i in range(9)]
    answers = [f.result(timeout=60) for f in futures]
    shutdown(False)
    assert slots == peak and fake.peak == peak and fake.started == 9
    assert [a["id"] for a in answers] == list(range(9))


def test_ray_starts_nothing_past_the_time_budget(monkeypatch):
    fake = _FakeRay(4)
    monkeypatch.setitem(sys.modules, "ray", fake)
    submit, shutdown, _ = workers.executor(workers=2, ray_address="", time_budget_s=0.0)
    answers = [submit(2, {"backend": "cpu", "id": i}).result(timeout=60) for i in range(4)]
    shutdown(False)
    assert answers == [{}] * 4 and fake.started == 0  # left for a rerun, as the pool's
