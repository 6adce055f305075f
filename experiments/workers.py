"""Compiles in processes of their own, for search and validate alike.

A worker (experiments/worker.py) is one process that starts JAX once with the fake CPU
devices of one device count and compiles configs one at a time; a compiler that aborts or
crashes takes only that process, and the config's answer is its error. `Pool` keeps a worker
per thread for the next config of the same count; `executor` submits requests to a pool of
them, or as Ray tasks (a local instance or a cluster), and returns futures of the answers.

A request: `{"config": the config's tables, "backend": ..., "keep_unfit": bool,
"calibration": Calibration.to_dict() or null}`; an answer: `{"status": "ok" | "refused" |
"error", "message", "report" (Report.to_dict(groups=False)), "features"
(Report.calibration_features()), "inputs", "hlo", "plan" (base64), "wall_s"}`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

from sharding.mesh import CPU_MAX_DEVICES

# The core a worker process keeps to (experiments/worker.py), set by its Pool.
CORE_ENV = "SHARDSCOPE_WORKER_CORE"


def devices_for(num_devices: int) -> int:
    """The fake devices a worker starts with for a run on `num_devices`: past what XLA:CPU
    fakes, the runner compiles fewer data-parallel replicas within that limit."""
    return min(num_devices, CPU_MAX_DEVICES)


class Worker:
    """A worker process for one device count (experiments/worker.py), reused for every
    config of that count until it dies."""

    def __init__(self, devices: int, core: int | None = None):
        self.devices = devices
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        if core is not None:
            env[CORE_ENV] = str(core)
        self.stderr = open(os.devnull, "w")  # noqa: SIM115 -- lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.worker", str(devices)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env,
            start_new_session=True)

    def ask(self, request: dict, timeout_s: float) -> dict:
        """The worker's answer, or an error answer when it died or took too long."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._died()
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive():
            self.kill()
            return {"status": "error", "message": f"did not finish within {timeout_s:.0f} s"}
        if not box or not box[0]:
            return self._died()
        return json.loads(box[0])

    def _died(self) -> dict:
        code = self.proc.wait()
        how = (f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}")
        return {"status": "error", "message": f"the compiler process died ({how}) while "
                                              f"compiling this config"}

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._close_pipes()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # end of input ends the worker
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                f.close()
            except (BrokenPipeError, OSError):
                pass


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


class Pool:
    """`size` worker slots; each thread keeps its worker for the next config of the same
    device count and replaces it when it died. With no more slots than cores, each slot's
    worker runs on a core of its own: XLA's thread pools, sized to the machine, otherwise
    spin against each other (four validation cases, 2 workers on 2 cores: 13% less CPU
    time and 9% less wall time pinned)."""

    def __init__(self, size: int):
        self.size = size
        self.local = threading.local()
        self.workers: list[Worker] = []
        self.lock = threading.Lock()
        self.slots = itertools.count()
        cores = _cores()
        self.cores = cores if 1 < size <= len(cores) else []

    def ask(self, devices: int, request: dict, timeout_s: float) -> dict:
        if not hasattr(self.local, "slot"):
            with self.lock:
                self.local.slot = next(self.slots)
        w = getattr(self.local, "worker", None)
        if w is None or not w.alive or w.devices != devices:
            if w is not None:
                w.close()
            w = Worker(devices, self.cores[self.local.slot % len(self.cores)]
                       if self.cores else None)
            with self.lock:
                self.workers.append(w)
            self.local.worker = w
        return w.ask(request, timeout_s)

    def close(self, *, kill: bool = False) -> None:
        for w in self.workers:
            w.kill() if kill else w.close()


def _pool_executor(size: int, timeout_s: float, t0: float, time_budget_s: float | None):
    """(submit, shutdown) over local worker processes: submit(devices, request) -> a
    future of the worker's answer ({} once past the time budget)."""
    pool = Pool(size)
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=size)

    def one(devices: int, req: dict) -> dict:
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            return {}
        return pool.ask(devices, req, timeout_s)

    def shutdown(interrupted: bool) -> None:
        if interrupted:  # kill first: the threads waiting on their workers then return
            pool.close(kill=True)
        executor.shutdown(wait=not interrupted, cancel_futures=True)
        if not interrupted:
            pool.close()

    return (lambda devices, req: executor.submit(one, devices, req)), shutdown


def compile_in_worker(devices: int, req: dict, timeout_s: float) -> dict:
    """One config in a fresh worker process (a Ray task: a crash stays in that process)."""
    w = Worker(devices)
    try:
        return w.ask(req, timeout_s)
    finally:
        w.close()


def _ray_executor(address: str, timeout_s: float, slots: int | None, t0: float,
                  time_budget_s: float | None):
    """(submit, shutdown, slots) over Ray: one task per config, its device count and
    backend in the task's runtime environment. At most `slots` tasks are in flight
    (default: the cluster's CPUs), each started by a thread of the driver that waits for
    its answer, so that, as the pool's, a config not started past the time budget answers
    {} and is left for a rerun."""
    try:
        import ray
    except ImportError:
        raise ValueError("Ray is not installed: pip install 'shardscope[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    if slots is None:
        slots = max(1, int(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(num_cpus=1, max_retries=0)(compile_in_worker)
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=slots)

    def one(devices: int, req: dict) -> dict:
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            return {}
        env = {"JAX_PLATFORMS": "cpu", "SHARDSCOPE_DEVICES": str(devices),
               "SHARDSCOPE_BACKEND": req["backend"]}
        fault = os.environ.get("SHARDSCOPE_FAULT")
        if fault:
            env["SHARDSCOPE_FAULT"] = fault
        ref = task.options(runtime_env={"env_vars": env}).remote(devices, req, timeout_s)
        return ray.get(ref)

    def shutdown(interrupted: bool) -> None:
        executor.shutdown(wait=not interrupted, cancel_futures=True)
        if started:
            ray.shutdown()  # ends the tasks still running (an interrupted search)

    return (lambda devices, req: executor.submit(one, devices, req)), shutdown, slots


def executor(*, workers: int | None, timeout_s: float = 1800.0,
             time_budget_s: float | None = None, ray_address: str | None = None):
    """(submit, shutdown, slots): submit(devices, request) -> a future of the answer ({}
    for a request started past `time_budget_s`); shutdown(interrupted); slots: how many
    run at once (`workers`; default the core count here, or the Ray cluster's CPUs).
    Local worker processes, or Ray tasks (`ray_address` "" for a local instance, else the
    cluster's address)."""
    t0 = time.perf_counter()
    if ray_address is not None:
        return _ray_executor(ray_address, timeout_s, workers, t0, time_budget_s)
    slots = workers or os.cpu_count() or 1
    submit, shutdown = _pool_executor(slots, timeout_s, t0, time_budget_s)
    return submit, shutdown, slots
