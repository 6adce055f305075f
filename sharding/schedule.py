"""Step time from a simulated schedule: one compute stream, one stream per link class.

What the hardware overlaps, and how XLA's latency-hiding scheduler arranges it:
- Every collective is asynchronous on TPU and GPU (the CPU path's post-SPMD HLO shows them
  synchronous; the target compilers split them into start/done pairs). A collective starts
  as soon as its inputs exist and its link is free, and runs alongside compute.
- Compute ops share one stream. When the stream is free it takes, among the ops whose
  inputs exist, the first in program order (list scheduling). An op that needs a
  collective's result waits for it: that wait is exposed communication.
- Collectives on different link classes (NVLink and InfiniBand, ICI and DCN) run at the
  same time; two on the same class queue, in program order when they are ready together.
- A while loop runs its body `trip count` times. In steady state XLA pipelines a loop's
  trailing collectives (a layer's gradient reduce-scatter) into the next iteration, so one
  iteration costs max(critical path to its last compute op, compute busy time, each link's
  busy time). A call or conditional runs its callee (the longest branch) in place.
- Transformer Engine's userbuffers (`under_gemms`): an all-gather that feeds a GEMM, or a
  reduce-scatter that follows one, is split into its t chunks and pipelined with the
  GEMM's t parts (chunk k+1 moves while part k multiplies; the first part is local). Of the
  collective only what the GEMM's other t - 1 parts cannot cover is waited for:
  max(0, t_comm - (t - 1)/t x t_gemm). The link is busy for all of it.
- Megatron's overlapped data-parallel communication (`chunked`: overlap_grad_reduce,
  overlap_param_gather): the gradients' sum after the last loop of the step is cut in K
  chunks (buckets, or a pipeline's virtual stages) that become ready one by one over the
  loop's final stretch W (and the next step's parameter all-gather, in chunks the first
  loop needs one by one over its opening stretch). All but one chunk run under that
  stretch, on the link's time the loop's own traffic leaves free (a share f of it); what
  is waited for is T/K + max(0, (K - 1)/K x T - f x W). The link is busy for all of it.
- Megatron's overlapped pipeline transfers (`overlapped`): a stage's send to the next runs
  beside other microbatches' compute; only a share of it (the warm-up's and flush's) is
  waited for. The link is busy for all of it.

The simulation works per computation and memoises, so a scanned stack costs one body.
"""

from __future__ import annotations

import dataclasses
import heapq

from sharding.dataflow import is_collective
from sharding.hlo import HloModule
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


@dataclasses.dataclass(frozen=True)
class Chunked:
    """A data-parallel collective a framework runs in `chunks` alongside a loop of the
    step (the module docstring): `after` the last loop it waits for (the gradients' sum,
    chunks ready as that loop ends), else before the first (the parameters' all-gather,
    chunks needed as it starts, in the next step). `window`: the loop iterations the chunks
    are spread over; None: (K - 1)/K of the loop, or where that loop is the step's only
    one (micro-steps of forward and backward) of one micro-step's backward (the share
    BACKWARD of its time) or forward (the rest)."""

    chunks: int
    after: bool
    window: float | None = None


# A micro-step's backward against its forward and backward: twice the forward's FLOPs
# (4 N D of 6 N D per token), the share of the step the gradients' chunks are ready over.
BACKWARD = 2 / 3


@dataclasses.dataclass(frozen=True)
class Node:
    """An instruction that may take time: a collective, a control-flow instruction, a
    fusion or a timed op. `preds` index the computation's nodes it waits for (through any
    number of instructions that take no time, which the graph leaves out)."""

    name: str
    opcode: str
    callees: tuple[str, ...] = ()  # computations it runs (control flow) or fuses
    trip: int = 1  # a while loop's trip count
    preds: tuple[int, ...] = ()


CONTROL = ("call", "conditional", "async-start")
_CALLEE_ROLES = ("calls", "to_apply", "branch", "true_computation", "false_computation")


@dataclasses.dataclass(frozen=True)
class Graph:
    """What the schedule needs of a module, independent of the system: for the entry and
    every computation control flow runs, its nodes in program order."""

    entry: str
    computations: dict[str, tuple[Node, ...]]


def schedule_graph(module: HloModule, keep: dict[str, set[str]]) -> Graph:
    """The module's schedule graph; `keep[computation]`: the instructions that may take
    time there (matmuls, kernels' last members, collectives), besides fusions, control
    flow and collective opcodes, which are always kept."""
    trips = trip_counts(module)
    comps: dict[str, tuple[Node, ...]] = {}
    todo = [module.entry]
    while todo:
        name = todo.pop()
        if name in comps:
            continue
        comp = module.computations[name]
        timed = keep.get(name, set())
        nodes, index, reach = [], {}, {}  # reach: left-out name -> the nodes it waits for
        for inst in comp.instructions:
            preds: set[int] = set()
            for o in inst.operands:
                if o in index:
                    preds.add(index[o])
                elif o in reach:
                    preds |= reach[o]
            op = inst.opcode
            if op == "while":
                body = (inst.attr("body") or "").lstrip("%")
                trip, _ = trips.get(f"{name}/{inst.name}", (1, ""))
                callees, kept = (body,) if body in module.computations else (), True
            else:
                callees = tuple(c for role, c in inst.called_computations()
                                if (role in _CALLEE_ROLES or op == "fusion")
                                and c in module.computations)
                trip = 1
                kept = (op == "fusion" or is_collective(op) or inst.name in timed
                        or (callees and (op in CONTROL or op.endswith("-start"))))
            if not kept:
                reach[inst.name] = frozenset(preds)
                continue
            index[inst.name] = len(nodes)
            nodes.append(Node(inst.name, op, callees, trip, tuple(sorted(preds))))
            if op == "while" or (op != "fusion" and callees
                                 and (op in CONTROL or op.endswith("-start"))):
                todo.extend(callees)
        comps[name] = tuple(nodes)
    return Graph(module.entry, comps)


class Scheduler:
    """Simulates a module's schedule graph given per-instruction compute times and
    collective times."""

    def __init__(
        self,
        graph: Graph,
        compute_times: dict[str, dict[str, float]],
        comm: dict[tuple[str, str], tuple[float, str]],
        under_gemms: dict[tuple[str, str], int] | None = None,
        gemms: dict[str, set[str]] | None = None,
        chunked: dict[tuple[str, str], Chunked] | None = None,
        overlapped: dict[tuple[str, str], float] | None = None,
    ):
        self.graph = graph
        self.compute_times = compute_times
        self.comm = comm  # (computation, instruction) -> (seconds, link)
        self.under_gemms = under_gemms or {}  # (computation, instruction) -> chunks
        self.gemms = gemms  # computation -> its matmuls (None: every compute op counts)
        self.chunked = chunked or {}  # (computation, instruction) -> how it overlaps
        self.overlapped = overlapped or {}  # (computation, instruction) -> share waited for
        self._memo: dict[str, tuple[Timeline, float]] = {}
        # Collectives the TPU compiler hides inside fusions (`all-reduce-scatter`): the
        # fusion instruction is then the collective.
        self._fused_comm: dict[str, tuple[float, str]] = {}
        for (comp_name, _), (t, link) in comm.items():
            prev = self._fused_comm.get(comp_name, (0.0, link))
            self._fused_comm[comp_name] = (prev[0] + t, link)

    def run(self) -> ScheduleResult:
        timeline, _ = self._simulate(self.graph.entry)
        return ScheduleResult(timeline.makespan_s, timeline.compute_busy_s,
                              dict(timeline.stream_busy_s))

    def _callee_time(self, node: Node) -> tuple[float, dict[str, float], float]:
        """(duration, comm busy by stream, compute busy) of a control-flow instruction."""
        op = node.opcode
        if op == "while":
            if not node.callees:
                return 0.0, {}, 0.0
            tl, core = self._simulate(node.callees[0])
            per_iter = tl.iteration_s(core)
            trip = node.trip
            return (trip * per_iter, {k: trip * v for k, v in tl.stream_busy_s.items()},
                    trip * tl.compute_busy_s)
        if op == "fusion" or not node.callees or not (op in CONTROL or op.endswith("-start")):
            return 0.0, {}, 0.0
        best = (0.0, {}, 0.0)
        for c in node.callees:
            tl, _ = self._simulate(c)
            if tl.makespan_s >= best[0]:
                best = (tl.makespan_s, dict(tl.stream_busy_s), tl.compute_busy_s)
        return best

    def _simulate(self, name: str) -> tuple[Timeline, float]:
        """(timeline, core makespan without trailing collectives) of one execution."""
        if name in self._memo:
            return self._memo[name]
        nodes = self.graph.computations[name]
        kind, dur, stream_busy, compute_busy = self._streams(name, nodes)
        finish, succs = _list_schedule(kind, dur, [n.preds for n in nodes])
        core = _core_makespan(kind, finish, succs)
        result = (Timeline(max(finish, default=0.0), compute_busy, stream_busy), core)
        self._memo[name] = result
        return result

    def _streams(self, name: str, nodes: tuple[Node, ...]):
        """Each node's stream (COMPUTE, a link class, or "free") and duration, with the
        busy time of every stream. Control flow occupies the compute stream for its
        callee's duration and adds the callee's link busy time."""
        times = self.compute_times.get(name, {})
        kind: list[str] = []
        dur = [0.0] * len(nodes)
        stream_busy: dict[str, float] = {}
        loop_busy: dict[int, dict[str, float]] = {}  # a loop's link busy time
        compute_busy = 0.0
        for i, node in enumerate(nodes):
            c = self.comm.get((name, node.name))
            if c is None and node.opcode == "fusion":
                for callee in node.callees:
                    c = self._fused_comm.get(callee, c)
            if c is not None:
                kind.append(c[1])
                dur[i] = c[0]
                stream_busy[c[1]] = stream_busy.get(c[1], 0.0) + c[0]
                continue
            d, busy, cbusy = self._callee_time(node)
            if d > 0:
                kind.append(COMPUTE)
                dur[i] = d
                loop_busy[i] = busy
                compute_busy += cbusy
                for k, v in busy.items():
                    stream_busy[k] = stream_busy.get(k, 0.0) + v
                continue
            t = times.get(node.name, 0.0)
            kind.append(COMPUTE if t > 0 else "free")
            dur[i] = t
            compute_busy += t
        if self.under_gemms:
            self._pipeline_with_gemms(name, nodes, kind, dur)
        if self.chunked:
            self._overlap_chunks(name, nodes, kind, dur, loop_busy)
        for i, node in enumerate(nodes):
            dur[i] *= self.overlapped.get((name, node.name), 1.0)
        return kind, dur, stream_busy, compute_busy

    def _overlap_chunks(self, name: str, nodes: tuple[Node, ...], kind: list[str],
                        dur: list[float], loop_busy: dict[int, dict[str, float]]) -> None:
        """Shorten the chunked collectives to what their loop cannot hide (the module
        docstring), those on one link beside one loop together."""
        groups: dict[tuple, list[int]] = {}
        for i, node in enumerate(nodes):
            how = self.chunked.get((name, node.name))
            if how is None or how.chunks <= 1 or dur[i] <= 0:
                continue
            loops = sorted(j for j in _ancestors(nodes, i)
                           if nodes[j].opcode == "while" and j in loop_busy)
            if loops:
                loop = loops[-1] if how.after else loops[0]
                groups.setdefault((loop, kind[i], how, len(loops) == 1), []).append(i)
        for (loop, link, how, only), members in groups.items():
            k, total = how.chunks, sum(dur[i] for i in members)
            iteration = dur[loop] / max(nodes[loop].trip, 1)
            if how.window is not None:
                window = how.window * iteration
            elif only:
                window = (k - 1) / k * iteration * (BACKWARD if how.after else 1 - BACKWARD)
            else:
                window = (k - 1) / k * dur[loop]
            free = max(0.0, 1.0 - loop_busy[loop].get(link, 0.0) / dur[loop])
            waited = total / k + max(0.0, total * (k - 1) / k - free * window)
            for i in members:
                dur[i] *= waited / total

    def _pipeline_with_gemms(self, name: str, nodes: tuple[Node, ...], kind: list[str],
                             dur: list[float]) -> None:
        """Shorten each userbuffers collective to what its GEMM cannot cover (the module
        docstring): an all-gather's compute consumers, a reduce-scatter's producers."""
        consumers, _ = _successors([n.preds for n in nodes])
        mine = None if self.gemms is None else self.gemms.get(name, set())
        for i, node in enumerate(nodes):
            t = self.under_gemms.get((name, node.name))
            if t is None:
                continue
            near = consumers[i] if "all-gather" in node.opcode else node.preds
            gemm = sum(dur[j] for j in near
                       if kind[j] == COMPUTE and (mine is None or nodes[j].name in mine))
            dur[i] = max(0.0, dur[i] - gemm * (t - 1) / t)


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
        now_ready = []
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
                        now_ready.append(s)
        for s in sorted(now_ready):  # collectives ready together queue in program order
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


def _ancestors(nodes: tuple[Node, ...], i: int) -> set[int]:
    """The nodes node i waits for, directly or through others."""
    seen: set[int] = set()
    todo = list(nodes[i].preds)
    while todo:
        j = todo.pop()
        if j not in seen:
            seen.add(j)
            todo.extend(nodes[j].preds)
    return seen


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
