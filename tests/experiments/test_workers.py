"""Compile workers (experiments/workers.py): each slot of a pool on a core of its own."""

import os
import time

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
