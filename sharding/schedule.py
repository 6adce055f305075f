"""Step time from a simulated schedule: one compute stream, one stream per link class.

What the hardware overlaps, and how XLA's latency-hiding scheduler arranges it:
- Every collective is asynchronous on TPU and GPU (the CPU path's post-SPMD HLO shows them
  synchronous; the target compilers split them into start/done pairs). A collective starts
  as soon as its inputs exist and its link is free, and runs alongside compute.
- Compute ops share one stream. When the stream is free it takes, among the ops whose
  inputs exist, the first in program order (list scheduling). An op that needs a
  collective's result waits for it: that wait is exposed communication.
- Collectives on different link classes (NVLink and InfiniBand, ICI and DCN) run at the
  same time; two on the same class queue.
- A while loop runs its body `trip count` times. In steady state XLA pipelines a loop's
  trailing collectives (a layer's gradient reduce-scatter) into the next iteration, so one
  iteration costs max(critical path to its last compute op, compute busy time, each link's
  busy time). A call or conditional runs its callee (the longest branch) in place.

The simulation works per computation and memoises, so a scanned stack costs one body.
"""

from __future__ import annotations

import dataclasses
import heapq

from sharding.hlo import Computation, HloModule
from sharding.loops import trip_counts

COMPUTE = "compute"


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Result of simulating one computation once."""

    makespan_s: float
    compute_busy_s: float
    stream_busy_s: dict[str, float]

    def iteration_s(self, core_s: float) -> float:
        return max(core_s, self.compute_busy_s, *self.stream_busy_s.values(), 0.0)


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
    step_s: float
    compute_busy_s: float
    comm_busy_s: dict[str, float]


class Scheduler:
    """Simulates a module given per-instruction compute times and collective times."""

    def __init__(
        self,
        module: HloModule,
        compute_times: dict[str, dict[str, float]],
        comm: dict[tuple[str, str], tuple[float, str]],
    ):
        self.module = module
        self.compute_times = compute_times
        self.comm = comm  # (computation, instruction) -> (seconds, link)
        self._memo: dict[str, tuple[Timeline, float]] = {}
        # Collectives the TPU compiler hides inside fusions (`all-reduce-scatter`): the
        # fusion instruction is then the collective.
        self._fused_comm: dict[str, tuple[float, str]] = {}
        for (comp_name, _), (t, link) in comm.items():
            prev = self._fused_comm.get(comp_name, (0.0, link))
            self._fused_comm[comp_name] = (prev[0] + t, link)

    def run(self) -> ScheduleResult:
        timeline, _ = self._simulate(self.module.entry)
        return ScheduleResult(timeline.makespan_s, timeline.compute_busy_s,
                              dict(timeline.stream_busy_s))

    def _callee_time(self, comp: Computation, inst) -> tuple[float, dict[str, float], float]:
        """(duration, comm busy by stream, compute busy) of a control-flow instruction."""
        op = inst.opcode
        if op == "while":
            body = (inst.attr("body") or "").lstrip("%")
            trip, _ = trip_counts(self.module).get(f"{comp.name}/{inst.name}", (1, ""))
            tl, core = self._simulate(body)
            per_iter = tl.iteration_s(core)
            return (trip * per_iter, {k: trip * v for k, v in tl.stream_busy_s.items()},
                    trip * tl.compute_busy_s)
        callees = [c for role, c in inst.called_computations()
                   if role in ("calls", "to_apply", "branch", "true_computation",
                               "false_computation") and c in self.module.computations]
        if op in ("call", "conditional", "async-start") or (op.endswith("-start") and callees):
            best = (0.0, {}, 0.0)
            for c in callees:
                tl, _ = self._simulate(c)
                if tl.makespan_s >= best[0]:
                    best = (tl.makespan_s, dict(tl.stream_busy_s), tl.compute_busy_s)
            return best
        return 0.0, {}, 0.0

    def _simulate(self, name: str) -> tuple[Timeline, float]:
        """(timeline, core makespan without trailing collectives) of one execution."""
        if name in self._memo:
            return self._memo[name]
        comp = self.module.computations[name]
        kind, dur, stream_busy, compute_busy = self._streams(comp)
        index = {inst.name: i for i, inst in enumerate(comp.instructions)}
        preds = [[index[o] for o in inst.operands if o in index] for inst in comp.instructions]
        finish, succs = _list_schedule(kind, dur, preds)
        core = _core_makespan(kind, finish, succs)
        result = (Timeline(max(finish, default=0.0), compute_busy, stream_busy), core)
        self._memo[name] = result
        return result

    def _streams(self, comp: Computation):
        """Each instruction's stream (COMPUTE, a link class, or "free") and duration, with
        the busy time of every stream. Control flow occupies the compute stream for its
        callee's duration and adds the callee's link busy time."""
        times = self.compute_times.get(comp.name, {})
        kind: list[str] = []
        dur = [0.0] * len(comp.instructions)
        stream_busy: dict[str, float] = {}
        compute_busy = 0.0
        for i, inst in enumerate(comp.instructions):
            c = self.comm.get((comp.name, inst.name))
            if c is None and inst.opcode == "fusion":
                for _, callee in inst.called_computations():
                    c = self._fused_comm.get(callee, c)
            if c is not None:
                kind.append(c[1])
                dur[i] = c[0]
                stream_busy[c[1]] = stream_busy.get(c[1], 0.0) + c[0]
                continue
            d, busy, cbusy = self._callee_time(comp, inst)
            if d > 0:
                kind.append(COMPUTE)
                dur[i] = d
                compute_busy += cbusy
                for k, v in busy.items():
                    stream_busy[k] = stream_busy.get(k, 0.0) + v
                continue
            t = times.get(inst.name, 0.0)
            kind.append(COMPUTE if t > 0 else "free")
            dur[i] = t
            compute_busy += t
        return kind, dur, stream_busy, compute_busy


def _list_schedule(kind: list[str], dur: list[float],
                   preds: list[list[int]]) -> tuple[list[float], list[list[int]]]:
    """Finish time of every instruction: compute ops in program order on one stream as
    their inputs arrive, each link class its own queue, free ops as soon as ready.
    Returns (finish times, successors)."""
    n = len(kind)
    succs, missing = _successors(preds)
    finish = [0.0] * n
    ready_at = [0.0] * n
    stream_free: dict[str, float] = {}
    events: list[tuple[float, int]] = []  # (finish, index) of collectives in flight
    ready: list[int] = []  # compute ops whose inputs exist, by program order
    done = 0

    def start(i: int, t: float) -> None:
        """Hand instruction i, ready at time t, to its stream."""
        if kind[i] == COMPUTE:
            heapq.heappush(ready, i)
        elif kind[i] == "free":
            release(i, t)
        else:
            begin = max(t, stream_free.get(kind[i], 0.0))
            stream_free[kind[i]] = begin + dur[i]
            heapq.heappush(events, (begin + dur[i], i))

    def release(i: int, t: float) -> None:
        nonlocal done
        stack = [(i, t)]
        while stack:
            j, tj = stack.pop()
            finish[j] = tj
            done += 1
            for s in succs[j]:
                ready_at[s] = max(ready_at[s], tj)
                missing[s] -= 1
                if missing[s] == 0:
                    if kind[s] == "free":
                        stack.append((s, ready_at[s]))
                    else:
                        start(s, ready_at[s])

    for i in [i for i in range(n) if missing[i] == 0]:  # before any release changes it
        start(i, 0.0)
    compute_free = 0.0
    while done < n:
        while events and events[0][0] <= compute_free:
            t, j = heapq.heappop(events)
            release(j, t)
        if ready:
            j = heapq.heappop(ready)
            compute_free = max(compute_free, ready_at[j]) + dur[j]
            release(j, compute_free)
        elif events:
            t, j = heapq.heappop(events)
            compute_free = max(compute_free, t)
            release(j, t)
        else:
            break  # unreachable ops (dead code): nothing more can run
    return finish, succs


def _successors(preds: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(successors of each node, how many distinct predecessors each node waits for)."""
    succs: list[list[int]] = [[] for _ in preds]
    missing = [0] * len(preds)
    for i, ps in enumerate(preds):
        for p in set(ps):
            succs[p].append(i)
            missing[i] += 1
    return succs, missing


def _core_makespan(kind: list[str], finish: list[float], succs: list[list[int]]) -> float:
    """Latest finish among compute ops and collectives whose results some compute op needs
    (a trailing collective -- one only the loop carry needs -- is pipelined away)."""
    n = len(kind)
    feeds_compute = [False] * n
    for i in range(n - 1, -1, -1):
        feeds_compute[i] = any(kind[s] == COMPUTE or feeds_compute[s] for s in succs[i])
    core = 0.0
    for i in range(n):
        if kind[i] == COMPUTE or (kind[i] != "free" and feeds_compute[i]):
            core = max(core, finish[i])
    return core
