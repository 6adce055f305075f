"""Device time per category from a `jax.profiler` trace: what a measured step spent on
matmuls, on memory-bound kernels and on each collective kind, beside the estimate's.

`jax.profiler.trace(DIR, create_perfetto_trace=True)` writes the XPlane protobuf and a
Perfetto JSON trace (`DIR/plugins/profile/<run>/<host>.trace.json.gz`). The JSON is read
here (no binary parser): each executed HLO instruction is a complete event ("ph": "X")
whose `args` name its module (`hlo_module`), its instruction (`hlo_op`) and, where the
backend says, its device (`device_ordinal`); GPU and TPU traces put their kernels on one
track per device ("/device:GPU:0", "/device:TPU:0"). Each instruction is put in the
category the estimate times it in, from the executed program's own HLO text:

- a collective (its kind as `sharding/collectives.py` reads it: an all-reduce whose
  users keep a 1/n slice each is the reduce-scatter it stands for, a tuple all-reduce
  of such gradients too);
- `matmul`: a dot or convolution, a fusion that holds one, a library GEMM custom call;
- `memory-bound`: every other kernel;
- control flow (`while`, `conditional`, `call`) is not counted where the instructions it
  runs have their own events. Where they have none -- XLA:GPU runs most of a step's kernels
  in command buffers (CUDA graphs), and the profiler names their kernels by the command
  buffer's call, not by instruction -- its time is `unattributed`: device time measured but
  not placed (experiments/measure.py compiles the profiled steps with command buffers off).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections import defaultdict
from pathlib import Path

from sharding.collectives import extract_collectives
from sharding.dataflow import GEMM_CALL_TARGETS, MATMUL_OPS, is_collective
from sharding.hlo import HloModule, parse_hlo

MATMUL = "matmul"
MEMORY_BOUND = "memory-bound"
UNATTRIBUTED = "unattributed"
_CONTAINERS = frozenset({"while", "conditional", "call", "async-start", "async-done",
                         "parameter", "tuple", "get-tuple-element", "constant", "bitcast"})
# custom-call targets that are GEMMs: cuBLAS / cuBLASLt, oneDNN, XLA:CPU's own
_GEMM_TARGETS = (*GEMM_CALL_TARGETS, "__onednn$matmul", "__onednn$convolution",
                 "__xla_cpu_gemm")
# an async collective's halves: the time is the pair's, its kind the start's
_ASYNC_SUFFIXES = ("-start", "-done", "-update")


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One executed instruction: its module, its name, the device, its seconds."""

    module: str
    op: str
    device: str
    seconds: float


def trace_file(directory: str | Path) -> Path:
    """The newest Perfetto JSON trace under `directory`, or a ValueError saying what
    writes one."""
    found = sorted(Path(directory).glob("**/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ValueError(f"no *.trace.json.gz under {str(directory)!r}; take the trace with "
                         f"jax.profiler.trace(DIR, create_perfetto_trace=True)")
    return found[-1]


def read_events(path: str | Path) -> list[OpEvent]:
    """The executed HLO instructions of a Perfetto JSON trace."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    tracks = {e["pid"]: e.get("args", {}).get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    out = []
    for e in events:
        args = e.get("args") or {}
        op = args.get("hlo_op")
        if e.get("ph") != "X" or not op or str(e.get("name", "")).startswith("end: "):
            continue
        device = args.get("device_ordinal", tracks.get(e.get("pid"), ""))
        out.append(OpEvent(args.get("hlo_module", ""), op, str(device),
                           float(e.get("dur", 0.0)) * 1e-6))
    return out


def categories_of(module: HloModule) -> dict[str, str]:
    """Instruction name -> category for every instruction of an executed program."""
    collectives, _ = extract_collectives(module)
    kinds = {c.name: c.kind for c in collectives}
    out: dict[str, str] = {}
    for comp in module.computations.values():
        for inst in comp.instructions:
            if inst.opcode in _CONTAINERS:
                continue
            out[inst.name] = _category(module, inst, kinds)
    return out


def _category(module: HloModule, inst, kinds: dict[str, str]) -> str:
    if is_collective(inst.opcode):
        base = inst.opcode
        for suffix in _ASYNC_SUFFIXES:
            base = base.removesuffix(suffix)
        return kinds.get(inst.name, base)
    if inst.opcode in MATMUL_OPS:
        return MATMUL
    if inst.opcode == "custom-call":
        target = inst.attr("custom_call_target") or ""
        return MATMUL if target.strip('"').startswith(_GEMM_TARGETS) else MEMORY_BOUND
    if inst.opcode == "fusion" and _holds_matmul(module, inst):
        return MATMUL
    return MEMORY_BOUND


def _holds_matmul(module: HloModule, inst, depth: int = 0) -> bool:
    for _, name in inst.called_computations():
        comp = module.computations.get(name)
        if comp is None or depth > 4:
            continue
        for i in comp.instructions:
            if i.opcode in MATMUL_OPS or (i.opcode == "fusion"
                                          and _holds_matmul(module, i, depth + 1)):
                return True
    return False


@dataclasses.dataclass(frozen=True)
class Profile:
    """Seconds per step per device by category, and what was read."""

    seconds: dict[str, float]
    devices: int
    events: int
    unmatched: tuple[str, ...] = ()

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def profile_by_category(events: list[OpEvent], hlo_text: str, *, steps: int,
                        module_name: str | None = None) -> Profile:
    """Device time of the program `hlo_text` (the executed, compiled one) in `events`, per
    step and per device (the mean over the devices that ran it), by category."""
    module = parse_hlo(hlo_text)
    name = module_name or module.name
    cats = categories_of(module)
    mine = [e for e in events if e.module == name]
    seen = {e.op for e in mine}
    containers = _containers(module)
    total: dict[str, float] = defaultdict(float)
    devices, unmatched, n = set(), set(), 0
    for e in mine:
        cat = cats.get(e.op)
        if cat is None:
            inner = containers.get(e.op)
            if inner is None:
                unmatched.add(e.op)
                continue
            if not inner or inner & seen:
                continue  # what it runs has events of its own
            cat = UNATTRIBUTED  # its kernels ran without their instructions' names
        total[cat] += e.seconds
        devices.add(e.device)
        n += 1
    if not n:
        raise ValueError(f"the trace holds no instruction of {name!r}; was it taken around "
                         f"the steps that ran it?")
    per = steps * len(devices)
    return Profile({k: v / per for k, v in sorted(total.items())}, len(devices), n,
                   tuple(sorted(unmatched)))


def _containers(module: HloModule) -> dict[str, frozenset[str]]:
    """Control-flow instruction (and called computation) name -> the names of every
    instruction it runs, through nested control flow (empty for a container that runs
    nothing: a parameter, a tuple)."""
    memo: dict[str, frozenset[str]] = {}

    def runs(comp_name: str, depth: int = 0) -> frozenset[str]:
        if comp_name not in memo:
            comp = module.computations.get(comp_name)
            names: set[str] = set()
            for i in comp.instructions if comp is not None and depth < 16 else ():
                names.add(i.name)
                if i.opcode in _CONTAINERS:
                    for _, callee in i.called_computations():
                        names |= runs(callee, depth + 1)
            memo[comp_name] = frozenset(names)
        return memo[comp_name]

    out: dict[str, frozenset[str]] = {}
    for comp in module.computations.values():
        for inst in comp.instructions:
            if inst.opcode in _CONTAINERS:
                callees = [c for _, c in inst.called_computations()]
                inner = frozenset().union(*(runs(c) for c in callees))
                out[inst.name] = inner
                for c in callees:  # a profiler may name the event by the computation
                    out.setdefault(c, inner)
    return out
