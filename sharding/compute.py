"""Compute cost of an HLO module: FLOPs of matmuls and HBM bytes, per device, per step.

- A dot or convolution does 2 x (output elements) x (contracted elements) FLOPs
  (sharding/flops.py) at the chip's peak for its operand dtype times the chip's measured
  matmul efficiency, scaled by the measured efficiency-against-size curve (small matmuls
  are slower), and moves its operands and output through HBM; its time is the larger of
  the two. Inside a fused kernel (a `fusion`, or the flash-attention scope) its operands
  stream through on-chip memory.
- Everything else is memory-bound: the kernels the target compiler would form and their
  HBM traffic are sharding/traffic.py's (on GPUs, the frameworks' hand-fused kernels where
  the program marks them: sharding/kernel_scopes.py); dequantisation fused into a matmul's
  operand load is sharding/dequant.py's.

Counts apply every enclosing loop's trip count (sharding/loops.py).
"""

from __future__ import annotations

import dataclasses

from meshes import Chip
from meshes.calibration import IDENTITY, Calibration
from meshes.chips import GPU_TARGETS
from sharding import kernel_scopes
from sharding.dataflow import is_matmul, through_views, users_through_views
from sharding.dequant import dequant_read_bytes
from sharding.flops import dot_flops
from sharding.hlo import HloModule, operation_of
from sharding.loops import execution_counts
from sharding.traffic import DECODE_ATTENTION_SCOPE, FUSED_KERNEL_SCOPE, kernels, l2_reuse


@dataclasses.dataclass(frozen=True)
class ComputeCost:
    """Per-device totals for one step."""

    flops: float
    matmul_flops: float
    hbm_bytes: float
    matmul_s: float
    memory_bound_s: float
    flops_by_dtype: dict[str, float]
    # (model operation, "matmul" | "memory") -> {"flops", "bytes", "time_s"} per step
    ops: dict[tuple[str, str], dict[str, float]] = dataclasses.field(default_factory=dict)
    # matmul time of the matmuls that wait on HBM rather than on the math units
    hbm_bound_matmul_s: float = 0.0
    # math time of the math-bound matmuls by calibration rate class ("tpu", "gpu_bf16",
    # "measured"; "/attention" inside the flash-attention kernel), and the kernels run
    # (each pays the calibration's fixed overhead, which the times include)
    math_s_by_class: dict[str, float] = dataclasses.field(default_factory=dict)
    kernels: float = 0.0
    overhead_s: float = 0.0
    # the part of overhead_s paid by math-bound matmuls (the rest: HBM-bound kernels)
    math_overhead_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.memory_bound_s


@dataclasses.dataclass
class ExecutionCost:
    """One execution of one computation: totals and the time of each instruction.

    `times` gives every instruction that occupies the compute stream its seconds: a matmul
    its own; a fused kernel's time goes to its last member (it can start only when all of
    its inputs exist); a `fusion` instruction the larger of its traffic and its matmuls.
    """

    flops: float = 0.0
    matmul_flops: float = 0.0
    hbm_bytes: float = 0.0
    matmul_s: float = 0.0
    memory_bound_s: float = 0.0
    flops_by_dtype: dict[str, float] = dataclasses.field(default_factory=dict)
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    ops: dict[tuple[str, str], dict[str, float]] = dataclasses.field(default_factory=dict)
    hbm_bound_matmul_s: float = 0.0
    math_s_by_class: dict[str, float] = dataclasses.field(default_factory=dict)
    kernels: float = 0.0
    overhead_s: float = 0.0
    math_overhead_s: float = 0.0

    def add_op(self, key: tuple[str, str], flops: float, nbytes: float, t: float) -> None:
        d = self.ops.setdefault(key, {"flops": 0.0, "bytes": 0.0, "time_s": 0.0})
        d["flops"] += flops
        d["bytes"] += nbytes
        d["time_s"] += t


@dataclasses.dataclass(frozen=True)
class MatmulWork:
    """A dot or convolution, as the program has it: its FLOPs, its operands' HLO dtype,
    the HBM bytes it moves when it is a kernel of its own (0 when its operands stream
    through on-chip memory), whether it runs inside the fused attention kernel, and
    whether it pays a kernel's fixed overhead (not inside a fusion, whose kernel pays)."""

    name: str
    flops: float
    dtype: str
    io: float
    attention: bool
    own_kernel: bool
    op: str


@dataclasses.dataclass(frozen=True)
class KernelWork:
    """A memory-bound kernel: its HBM bytes and elements written, timed at its last
    member instruction; `l2`: (working set, bytes) of its traffic that a GPU's L2 cache
    keeps when the working set fits (sharding/traffic.py, l2_reuse)."""

    nbytes: float
    elems: float
    last: str
    op: str
    l2: tuple[tuple[float, float], ...] = ()
    weight_cast: bool = False  # a GPU framework's FP8 weight cast (kernel_scopes)


@dataclasses.dataclass(frozen=True)
class FusionWork:
    """A fusion instruction whose fused computations hold matmuls (its kernel overlaps
    their math with its traffic)."""

    name: str
    callees: tuple[str, ...]
    op: str


@dataclasses.dataclass(frozen=True)
class Work:
    """What one execution of a computation does, before any chip is chosen."""

    matmuls: tuple[MatmulWork, ...] = ()
    kernels: tuple[KernelWork, ...] = ()
    fusions: tuple[FusionWork, ...] = ()
    # The memory-bound kernels where a GPU framework's fused kernels run them
    # (sharding/kernel_scopes.py; an unfused module's); None: `kernels`.
    gpu_kernels: tuple[KernelWork, ...] | None = None

    def timed_names(self) -> set[str]:
        """The instructions that may occupy the compute stream."""
        return ({m.name for m in self.matmuls} | {k.last for k in self.kernels}
                | {k.last for k in self.gpu_kernels or ()} | {f.name for f in self.fusions})

    def kernels_on(self, chip: Chip) -> tuple[KernelWork, ...]:
        """The memory-bound kernels that run on `chip`: the fused kernels' on GPUs."""
        return self.gpu_kernels if self.gpu_kernels is not None and runs_fused_kernels(
            chip) else self.kernels


def runs_fused_kernels(chip: Chip) -> bool:
    """GPUs: their training frameworks' hand-fused kernels (Transformer Engine, cuDNN)
    run the blocks marked in sharding/kernel_scopes.py; TPUs run XLA's fusions."""
    return chip.name in GPU_TARGETS


def work(module: HloModule) -> dict[str, Work]:
    """The matmuls, memory-bound kernels and matmul-holding fusions of every computation
    that runs, in module order: everything `time_work` needs, independent of the chip."""
    fused = {callee for callee, sites in module.call_sites.items()
             if any(inst.opcode == "fusion" for _, inst, _ in sites)}
    # A reduction's combiner (the `to_apply` of reduce, all-reduce, scatter, sort, ...)
    # is part of the instruction that applies it, not work of its own (a `call`'s
    # `to_apply` is a body that runs).
    applied = {callee for callee, sites in module.call_sites.items()
               if sites and all(role == "to_apply" and inst.opcode != "call"
                                for _, inst, role in sites)}
    counts = execution_counts(module)
    out: dict[str, Work] = {}
    for comp in module.computations.values():
        if counts.get(comp.name, 0) == 0 or comp.name in applied:
            continue
        inside_fusion = comp.name in fused
        matmuls = []
        for inst in comp.instructions:
            if is_matmul(inst):
                f, dt, own_io = dot_flops(inst, comp)
                on_chip = inside_fusion or FUSED_KERNEL_SCOPE in inst.op_name
                scoped = (not module.is_scheduled and not inside_fusion
                          and DECODE_ATTENTION_SCOPE in inst.op_name)
                io = 0.0 if on_chip else (_scope_io(inst, comp, DECODE_ATTENTION_SCOPE)
                                          if scoped else own_io)
                # the fused attention kernel's matmuls are one kernel's work: its fixed
                # overhead is not paid per tile
                attention = FUSED_KERNEL_SCOPE in inst.op_name
                matmuls.append(MatmulWork(inst.name, f, dt, io, attention,
                                          not (inside_fusion or attention),
                                          operation_of(inst.op_name)))
        found = [] if inside_fusion else kernels(comp, module, final=module.is_scheduled)
        reuse = l2_reuse(comp, found) if module.is_scheduled else [()] * len(found)
        kerns = tuple(
            KernelWork(nbytes, elems, members[-1].name, operation_of(members[-1].op_name), l2)
            for (nbytes, elems, members), l2 in zip(found, reuse, strict=True))
        gpu = None
        if not (inside_fusion or module.is_scheduled):
            # a compiler's own fusions (a scheduled module) are taken as they are
            gpu = tuple(KernelWork(nbytes, elems, members[-1].name,
                                   operation_of(members[-1].op_name),
                                   weight_cast=kernel_scopes.casts_a_weight(
                                       members[-1].op_name))
                        for nbytes, elems, members in kernels(comp, module, final=False,
                                                              gpu_kernels=True))
        out[comp.name] = Work(tuple(matmuls), kerns, gpu_kernels=gpu)
    for name, w in out.items():
        comp = module.computations[name]
        fusions = tuple(
            FusionWork(inst.name, callees, operation_of(inst.op_name))
            for inst in comp.instructions if inst.opcode == "fusion"
            for callees in [tuple(c for _, c in inst.called_computations() if c in out)]
            if any(out[c].matmuls for c in callees))
        out[name] = dataclasses.replace(w, fusions=fusions)
    return out


def computation_costs(
    module: HloModule, chip: Chip, *, compute_dtype: str | None = None,
    calibration: Calibration = IDENTITY,
) -> dict[str, ExecutionCost]:
    """Cost of one execution of each computation that runs (`calibration`: the fitted
    efficiencies of meshes/calibration.py; none by default)."""
    return time_work(work(module), chip, compute_dtype=compute_dtype, calibration=calibration)


def time_work(
    works: dict[str, Work], chip: Chip, *, compute_dtype: str | None = None,
    calibration: Calibration = IDENTITY, weight_cast_share: float = 1.0,
    stretched: tuple[tuple[str, ...], float] = ((), 1.0),
    kernel_overhead_s: float | None = None,
) -> dict[str, ExecutionCost]:
    """Cost of one execution of each computation on `chip` from its `work(module)`;
    `weight_cast_share`: of the FP8 weight casts the program runs, the share a GPU framework
    runs (it casts once per step what the program casts at every microbatch).
    `stretched`: (named scopes, factor): the time of the ops under those scopes times the
    factor, their FLOPs and bytes as they are (a pipeline's output layer, which a GPU
    framework runs on one stage: sharding/gpu_frameworks.output_layer_scale).
    `kernel_overhead_s`: the fixed time per kernel where the run does not pay the chip's or
    the fit's (a decode step replayed as a CUDA graph: meshes.chips.CUDA_GRAPH_KERNEL_S);
    None: theirs (`_kernel_overhead`: a TPU's measured time per op, else the fit's)."""
    hbm_bw = chip.hbm_bytes_per_s * chip.hbm_efficiency
    target = GPU_TARGETS.get(chip.name)
    l2_bytes = target.l2_bytes if target is not None else 0
    scopes, factor = stretched

    def stretch(op: str) -> float:
        return factor if scopes and op.split(" (")[0].split("/")[0] in scopes else 1.0

    overhead_s = _kernel_overhead(chip, calibration) if kernel_overhead_s is None \
        else kernel_overhead_s
    out: dict[str, ExecutionCost] = {}
    for name, w in works.items():
        c = ExecutionCost()
        for m in w.matmuls:
            _add_matmul(c, m, chip, hbm_bw, compute_dtype, overhead_s, calibration,
                        stretch(m.op))
        for k in w.kernels_on(chip):
            share = weight_cast_share if k.weight_cast else 1.0
            _add_kernel(c, k, hbm_bw, overhead_s, l2_bytes, share,
                        fitted=chip.kernel_overhead_s is None, stretch=stretch(k.op))
        out[name] = c
    _overlap_fused_matmuls(works, out)
    return out


def _add_matmul(c: ExecutionCost, m: MatmulWork, chip: Chip, hbm_bw: float,
                compute_dtype: str | None, overhead_s: float, calibration: Calibration,
                stretch: float = 1.0) -> None:
    """A dot or convolution: the larger of its math at the measured rate for its size and
    its operand traffic, plus the fixed per-kernel overhead (`overhead_s`) when it is a
    kernel of its own (not inside a fusion, whose kernel pays it); `stretch`: its time (not
    its FLOPs or bytes) times this (`time_work`)."""
    f, io = m.flops, m.io
    dt = compute_dtype or m.dtype
    size = (f / 2) ** (1 / 3) if f > 0 else None  # cube-equivalent M = N = K
    rate_class = Calibration.rate_class(chip, dt)
    if m.attention:
        # A fused flash-attention kernel is not a GEMM of its tiles' size: it runs at its
        # own fraction of the large-GEMM rate (the calibration's), not down the size curve.
        rate = chip.peak_for(dt) * chip.efficiency_for(dt) * calibration.rate_factor(
            rate_class) * calibration.attention_factor(rate_class)
        rate_class += "/attention"
    else:
        rate = chip.peak_for(dt) * chip.efficiency_for(dt, size) * calibration.rate_factor(
            rate_class)
    t_math = (f / rate if f > 0 else 0.0) * stretch
    overhead = (overhead_s if m.own_kernel else 0.0) * stretch
    t = max(t_math, io / hbm_bw * stretch) + overhead
    if chip.kernel_overhead_s is None:
        c.kernels += m.own_kernel * stretch
        c.overhead_s += overhead
    if io / hbm_bw * stretch > t_math:
        c.hbm_bound_matmul_s += t
    else:
        c.math_s_by_class[rate_class] = c.math_s_by_class.get(rate_class, 0.0) + t_math
        if chip.kernel_overhead_s is None:
            c.math_overhead_s += overhead
    c.flops += f
    c.matmul_flops += f
    c.flops_by_dtype[dt] = c.flops_by_dtype.get(dt, 0.0) + f
    c.hbm_bytes += io
    c.matmul_s += t
    c.times[m.name] = t
    c.add_op((m.op, "matmul"), f, io, t)


def _kernel_overhead(chip: Chip, calibration: Calibration) -> float:
    """Fixed time per kernel: the chip's own measured figure (host-cpu), a chip's measured
    time per op of a program it sequences itself (a TPU's), else the fit's."""
    if chip.kernel_overhead_s is not None:
        return chip.kernel_overhead_s
    if chip.program_op_s is not None:
        return chip.program_op_s
    return calibration.kernel_overhead_s


def _add_kernel(c: ExecutionCost, k: KernelWork, hbm_bw: float, overhead_s: float,
                l2_bytes: float = 0, share: float = 1.0, fitted: bool = True,
                stretch: float = 1.0) -> None:
    """A memory-bound kernel: its traffic at the measured HBM bandwidth plus the fixed
    per-kernel overhead, timed at its last member (it can start only when all of its
    inputs exist). What the chip's L2 cache keeps (half of it, the rest holding what else
    runs) is not HBM traffic. `share`: the fraction of its executions that run (a weight
    cast a framework does once per step). `fitted`: the overhead is the calibration's
    (counted as kernels for its fit), not a measured one of the chip's. `stretch`: its
    time (not its bytes) times this (`time_work`)."""
    kept = sum(b for ws, b in k.l2 if ws <= l2_bytes / 2)
    nbytes = max(0.0, k.nbytes - kept) * share
    overhead_s *= share * stretch
    t = nbytes / hbm_bw * stretch + overhead_s
    if fitted:
        c.kernels += share * stretch
        c.overhead_s += overhead_s
    c.hbm_bytes += nbytes
    c.memory_bound_s += t
    c.flops += k.elems  # ~1 FLOP per element written
    c.times[k.last] = c.times.get(k.last, 0.0) + t
    c.add_op((k.op, "memory"), k.elems, nbytes, t)


def _scope_io(inst, comp, scope: str) -> float:
    """HBM bytes of a matmul inside a fused kernel's scope: the operands made outside the
    scope (the KV cache, the query) and its output if used outside; what stays inside the
    scope stays on chip."""
    def outside(name: str) -> bool:
        src = comp.by_name.get(through_views(comp, name))
        return src is None or scope not in src.op_name

    io = 0.0
    for o in inst.operands[:2]:
        if o in comp.by_name and outside(o):
            io += float(sum(a.hbm_bytes for a in comp.by_name[o].shapes))
        elif (fused := dequant_read_bytes(comp, o)) is not None:
            io += fused  # a quantised cache, dequantised as the kernel reads it
    if inst.is_root or any(scope not in u.op_name
                           for u in users_through_views(comp, inst.name)):
        io += float(sum(a.hbm_bytes for a in inst.shapes))
    return io


def _overlap_fused_matmuls(works: dict[str, Work], out: dict[str, ExecutionCost]) -> None:
    """A fusion instruction runs its fused matmuls and its traffic as one kernel: the
    matmul streams its operands, so the kernel takes the larger of its matmul time (counted
    in the fused computation) and its traffic, not the sum."""
    for name, w in works.items():
        c = out[name]
        for fu in w.fusions:
            inner = sum(out[callee].matmul_s for callee in fu.callees)
            if inner <= 0:
                continue
            traffic = c.times.get(fu.name, 0.0)
            overlap = min(traffic, inner)
            c.memory_bound_s -= overlap
            key = (fu.op, "memory")
            if key in c.ops:
                c.ops[key]["time_s"] -= overlap
            c.times[fu.name] = max(traffic, inner)


def compute_cost(
    module: HloModule, chip: Chip, *, compute_dtype: str | None = None,
    calibration: Calibration = IDENTITY, costs: dict[str, ExecutionCost] | None = None,
    counts: dict[str, int] | None = None,
) -> ComputeCost:
    """FLOPs, HBM bytes and time of every computation, weighted by execution count.

    Args:
        module: the parsed per-device (post-SPMD) program.
        chip: the device that runs it.
        compute_dtype: if set ("float8", "float4"), matmuls are timed at that dtype's peak
            regardless of their HLO operand type (used when the program is traced in bf16
            but the run uses low-precision matmul kernels).
        calibration: the fitted efficiencies (meshes/calibration.py); none by default.
        costs: `computation_costs(...)` when already computed.
        counts: `execution_counts(module)` when already known (`module` may then be None).
    """
    if costs is None:
        costs = computation_costs(module, chip, compute_dtype=compute_dtype,
                                  calibration=calibration)
    counts = execution_counts(module) if counts is None else counts
    total = ExecutionCost()
    for name, c in costs.items():
        n = counts[name]
        total.flops += n * c.flops
        total.matmul_flops += n * c.matmul_flops
        total.hbm_bytes += n * c.hbm_bytes
        total.matmul_s += n * c.matmul_s
        total.memory_bound_s += n * c.memory_bound_s
        total.hbm_bound_matmul_s += n * c.hbm_bound_matmul_s
        total.kernels += n * c.kernels
        total.overhead_s += n * c.overhead_s
        total.math_overhead_s += n * c.math_overhead_s
        for dt, f in c.flops_by_dtype.items():
            total.flops_by_dtype[dt] = total.flops_by_dtype.get(dt, 0.0) + n * f
        for key, t in c.math_s_by_class.items():
            total.math_s_by_class[key] = total.math_s_by_class.get(key, 0.0) + n * t
        for key, d in c.ops.items():
            total.add_op(key, n * d["flops"], n * d["bytes"], n * d["time_s"])
    return ComputeCost(total.flops, total.matmul_flops, total.hbm_bytes, total.matmul_s,
                       total.memory_bound_s, total.flops_by_dtype, total.ops,
                       total.hbm_bound_matmul_s, total.math_s_by_class, total.kernels,
                       total.overhead_s, total.math_overhead_s)
