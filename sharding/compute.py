"""Compute cost of an HLO module: FLOPs of matmuls and HBM bytes, per device, per step.

- A dot or convolution does 2 x (output elements) x (contracted elements) FLOPs at the
  chip's peak for its operand dtype times the chip's measured matmul efficiency, scaled by
  the measured efficiency-against-size curve (small matmuls are slower), and moves its
  operands and output through HBM; its time is the larger of the two.
- Everything else is memory-bound, and what reaches HBM depends on fusion. The HLO read on
  the CPU path is the module right after SPMD partitioning, before any fusion, and XLA:CPU's
  own fusion decisions are not the TPU's or GPU's; so the model fuses as those compilers
  do, to first order: connected producer-consumer regions of elementwise, convert,
  transpose and data-movement ops form one kernel each; a reduction ends a kernel (its
  consumers start a new one, as XLA's GPU and TPU emitters do); matmuls, collectives and
  loop boundaries are kernel boundaries. A kernel reads each distinct value entering it
  once and writes each value leaving it once. Slices read only what they keep, and
  dynamic-update-slice / scatter write only their update (they work in place).
  Broadcasts, reshapes and bitcasts are views: they cost nothing, and a broadcast's input
  is what is read. Before scheduling (the post-SPMD module) a `copy` is a sharding
  annotation that copy elision removes later: it costs nothing either. A slice of a stacked
  array that only matmuls read (a layer's weights, its KV cache) is read by the matmul.
- Dequantisation in front of a matmul -- a widening `convert` of int8/int4/fp8 storage,
  times a broadcast scale, used only by matmuls -- is fused into the matmul's operand
  load, as XLA:GPU's Triton GEMM fusion and the TPU's operand fusion do: the matmul reads
  the narrow bytes and the scales, and no bf16 copy of the weight reaches HBM.
- Already-fused HLO (TPU/GPU final modules): each `fusion` instruction is a kernel; its
  operands and outputs are its HBM traffic; matmuls inside count their FLOPs.
- Ops under a named scope `flash_attention` (jax.named_scope) stand for a fused attention
  kernel: their matmul FLOPs count, but their intermediates (the S x S scores) stay in
  on-chip memory. The kernel's HBM traffic -- q, k, v in, the output and log-sum-exp out --
  is produced and consumed by ops outside the scope and counted there.

Counts apply every enclosing loop's trip count.
"""

from __future__ import annotations

import dataclasses
import re

from meshes import Chip
from sharding.hlo import (
    DTYPE_NAMES,
    ArrayShape,
    Computation,
    HloModule,
    Instruction,
    operation_of,
)

# Ops that move no data of their own (views, bookkeeping, control).
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "reshape", "broadcast",
    "iota", "partition-id", "replica-id", "after-all", "while", "call", "conditional",
    "opt-barrier", "custom-call", "domain", "add-dependency", "copy-start", "copy-done",
})
_MATMUL = frozenset({"dot", "convolution"})
FUSED_KERNEL_SCOPE = "flash_attention"


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

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.memory_bound_s


def dot_flops(inst: Instruction, comp: Computation) -> tuple[float, str, float]:
    """(FLOPs, matmul dtype, HBM bytes of operands + output) of a dot or convolution."""
    out = inst.shapes
    if not out:
        return 0.0, "float32", 0.0
    out_elems = out[0].num_elements
    lhs = _operand_shape(comp, inst, 0)
    rhs = _operand_shape(comp, inst, 1)
    dtype = DTYPE_NAMES.get(lhs.dtype, lhs.dtype) if lhs else "float32"
    if len(inst.operands) >= 2:
        sources = {_dequant_source_dtype(comp, o) for o in inst.operands[:2]}
        if len(sources) == 1 and (narrow := sources.pop()) in _LOW_PRECISION_MMA:
            dtype = _LOW_PRECISION_MMA[narrow]  # both operands block-scaled narrow floats
    io_bytes = out[0].nbytes
    for i, shape in ((0, lhs), (1, rhs)):
        fused = _dequant_read_bytes(comp, inst.operands[i]) if i < len(inst.operands) else None
        io_bytes += fused if fused is not None else (shape.nbytes if shape else 0)
    if inst.opcode == "dot":
        dims = inst.attr("lhs_contracting_dims")
        contract = 1
        if lhs is not None and dims:
            for d in dims.strip("{}").split(","):
                if d.strip():
                    contract *= lhs.dims[int(d)]
        return 2.0 * out_elems * contract, dtype, io_bytes
    if lhs is None or rhs is None:
        return 0.0, dtype, io_bytes
    return convolution_flops(inst, lhs, rhs, out[0]), dtype, io_bytes


def convolution_flops(inst: Instruction, lhs: ArrayShape, rhs: ArrayShape,
                      out: ArrayShape) -> float:
    """FLOPs of an HLO convolution, counting only window positions that land on real input
    (not padding or dilation holes), as XLA's HloCostAnalysis does. The TPU compiler writes
    many einsums as convolutions whose padded windows are mostly empty."""
    labels = inst.attr("dim_labels") or ""
    m = re.match(r"([^_]+)_([^-]+)->(.+)", labels)
    if not m:
        return 2.0 * out.num_elements
    lhs_l, rhs_l, out_l = m.groups()
    window = _window(inst.attr("window") or "")
    spatial = sorted({ch for ch in lhs_l if ch.isdigit()})
    positions = 1
    for k, ch in enumerate(spatial):
        size_in = lhs.dims[lhs_l.index(ch)]
        size_out = out.dims[out_l.index(ch)]
        w = window.get("size", [1] * len(spatial))[k]
        stride = window.get("stride", [1] * len(spatial))[k]
        lhs_dil = window.get("lhs_dilate", [1] * len(spatial))[k]
        rhs_dil = window.get("rhs_dilate", [1] * len(spatial))[k]
        pad_lo = window.get("pad_lo", [0] * len(spatial))[k]
        valid = 0
        for o in range(size_out):
            for j in range(w):
                pos = o * stride + j * rhs_dil - pad_lo
                if pos >= 0 and pos % lhs_dil == 0 and pos // lhs_dil < size_in:
                    valid += 1
        positions *= valid
    in_features = lhs.dims[lhs_l.index("f")]
    out_features = rhs.dims[rhs_l.index("o")]
    batch = lhs.dims[lhs_l.index("b")]
    fgc = int(inst.attr("feature_group_count") or 1)
    bgc = int(inst.attr("batch_group_count") or 1)
    return 2.0 * (in_features / fgc) * out_features * (batch / bgc) * positions


def _window(text: str) -> dict[str, list[int]]:
    """`size=1x4 pad=0_0x3_3 stride=1x3 lhs_dilate=2x4` -> lists per spatial dim."""
    out: dict[str, list[int]] = {}
    for part in text.strip("{}").split():
        key, _, value = part.partition("=")
        if key == "pad":
            pads = [p.split("_") for p in value.split("x")]
            out["pad_lo"] = [int(p[0]) for p in pads]
        elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
            out[key] = [int(v) for v in value.split("x")]
    return out


def _operand_shape(comp: Computation, inst: Instruction, i: int) -> ArrayShape | None:
    if i >= len(inst.operands):
        return None
    src = comp.by_name.get(inst.operands[i])
    if src is None:
        return None
    shapes = src.shapes
    return shapes[0] if len(shapes) == 1 else None


@dataclasses.dataclass
class ComputationCost:
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

    def add_op(self, key: tuple[str, str], flops: float, nbytes: float, t: float) -> None:
        d = self.ops.setdefault(key, {"flops": 0.0, "bytes": 0.0, "time_s": 0.0})
        d["flops"] += flops
        d["bytes"] += nbytes
        d["time_s"] += t


def computation_costs(
    module: HloModule, chip: Chip, *, compute_dtype: str | None = None
) -> dict[str, ComputationCost]:
    """Cost of one execution of each computation that runs."""
    hbm_bw = chip.hbm_bytes_per_s * chip.hbm_efficiency
    fused = {callee for callee, sites in module.call_sites.items()
             if any(inst.opcode == "fusion" for _, inst, _ in sites)}
    out: dict[str, ComputationCost] = {}
    for comp in module.computations.values():
        if module.execution_counts.get(comp.name, 0) == 0:
            continue
        c = ComputationCost()
        inside_fusion = comp.name in fused
        for inst in comp.instructions:
            if inst.opcode not in _MATMUL:
                continue
            f, dt, io = dot_flops(inst, comp)
            if inside_fusion or FUSED_KERNEL_SCOPE in inst.op_name:
                io = 0  # operands stream through on-chip memory inside the kernel
            dt = compute_dtype or dt
            size = (f / 2) ** (1 / 3) if f > 0 else None  # cube-equivalent M = N = K
            t_math = f / (chip.peak_for(dt) * chip.efficiency_for(dt, size)) if f > 0 else 0.0
            t = max(t_math, io / hbm_bw)
            if io / hbm_bw > t_math:
                c.hbm_bound_matmul_s += t
            c.flops += f
            c.matmul_flops += f
            c.flops_by_dtype[dt] = c.flops_by_dtype.get(dt, 0.0) + f
            c.hbm_bytes += io
            c.matmul_s += t
            c.times[inst.name] = t
            c.add_op((operation_of(inst.op_name), "matmul"), f, io, t)
        if not inside_fusion:
            for kernel_bytes, kernel_elems, members in _kernels(comp, module,
                                                                final=module.is_scheduled):
                t = kernel_bytes / hbm_bw
                c.hbm_bytes += kernel_bytes
                c.memory_bound_s += t
                c.flops += kernel_elems  # ~1 FLOP per element written
                last = members[-1].name
                c.times[last] = c.times.get(last, 0.0) + t
                c.add_op((operation_of(members[-1].op_name), "memory"), kernel_elems,
                         kernel_bytes, t)
        out[comp.name] = c
    # A fusion instruction runs its fused matmuls and its traffic as one kernel.
    for comp in module.computations.values():
        c = out.get(comp.name)
        if c is None:
            continue
        for inst in comp.instructions:
            if inst.opcode != "fusion":
                continue
            inner = sum(out[callee].matmul_s for _, callee in inst.called_computations()
                        if callee in out)
            if inner <= 0:
                continue
            # The fused matmul streams its operands: the kernel takes the larger of its
            # matmul time (counted in the fused computation) and its traffic, not the sum.
            traffic = c.times.get(inst.name, 0.0)
            overlap = min(traffic, inner)
            c.memory_bound_s -= overlap
            key = (operation_of(inst.op_name), "memory")
            if key in c.ops:
                c.ops[key]["time_s"] -= overlap
            c.times[inst.name] = max(traffic, inner)
    return out


def compute_cost(
    module: HloModule, chip: Chip, *, compute_dtype: str | None = None
) -> ComputeCost:
    """FLOPs, HBM bytes and time of every computation, weighted by execution count.

    Args:
        module: the parsed per-device (post-SPMD) program.
        chip: the device that runs it.
        compute_dtype: if set ("float8", "float4"), matmuls are timed at that dtype's peak
            regardless of their HLO operand type (used when the program is traced in bf16
            but the run uses low-precision matmul kernels).
    """
    counts = module.execution_counts
    total = ComputationCost()
    for name, c in computation_costs(module, chip, compute_dtype=compute_dtype).items():
        n = counts[name]
        total.flops += n * c.flops
        total.matmul_flops += n * c.matmul_flops
        total.hbm_bytes += n * c.hbm_bytes
        total.matmul_s += n * c.matmul_s
        total.memory_bound_s += n * c.memory_bound_s
        total.hbm_bound_matmul_s += n * c.hbm_bound_matmul_s
        for dt, f in c.flops_by_dtype.items():
            total.flops_by_dtype[dt] = total.flops_by_dtype.get(dt, 0.0) + n * f
        for key, d in c.ops.items():
            total.add_op(key, n * d["flops"], n * d["bytes"], n * d["time_s"])
    return ComputeCost(total.flops, total.matmul_flops, total.hbm_bytes, total.matmul_s,
                       total.memory_bound_s, total.flops_by_dtype, total.ops,
                       total.hbm_bound_matmul_s)


def _is_collective(op: str) -> bool:
    return op.startswith(("all-", "reduce-scatter", "collective-", "ragged-all-to-all"))


_VIEWS = frozenset({"reshape", "bitcast"})
_SLICES = frozenset({"slice", "dynamic-slice", "gather"})
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
_REDUCTIONS = frozenset({"reduce", "reduce-window"})


# Storage types that a matmul's operand load widens (weight-only quantisation).
_NARROW = frozenset({"s8", "u8", "s4", "u4", "f8e4m3fn", "f8e5m2", "f8e4m3", "f4e2m1fn",
                     "f8e8m0fnu"})
# Narrow float types a block-scaled MMA multiplies directly when both operands are in them.
_LOW_PRECISION_MMA = {"f4e2m1fn": "float4", "f8e4m3fn": "float8", "f8e5m2": "float8"}


def _dequant_ops(comp: Computation) -> frozenset[str]:
    """Instructions that dequantise narrow storage for matmuls only: widening converts from
    a narrow type, multiplies of those by a scale, and the views, converts and slices
    between them and the matmuls."""
    memo = vars(comp)  # computed once per computation, kept with it (like by_name)
    if "_dequant_ops" not in memo:
        memo["_dequant_ops"] = _find_dequant_ops(comp)
    return memo["_dequant_ops"]


def _find_dequant_ops(comp: Computation) -> frozenset[str]:
    by_name = comp.by_name
    chain: set[str] = set()
    for inst in comp.instructions:
        if inst.opcode == "convert" and inst.operands:
            src = by_name.get(inst.operands[0])
            if src is not None and src.shapes and src.shapes[0].dtype in _NARROW and \
                    inst.shapes and inst.shapes[0].dtype not in _NARROW:
                chain.add(inst.name)
    if not chain:
        return frozenset()
    grown = True
    while grown:  # grow forward through the scale multiply, converts and views
        grown = False
        for inst in comp.instructions:
            if inst.name in chain or inst.opcode not in ("multiply", "convert", *_VIEWS):
                continue
            if any(_through_views(comp, o) in chain or o in chain for o in inst.operands):
                chain.add(inst.name)
                grown = True
    changed = True
    while changed:  # keep only what feeds matmuls and nothing else
        changed = False
        for name in list(chain):
            users = comp.users.get(name, [])
            if not users or any(u.name not in chain and u.opcode not in _MATMUL for u in users):
                chain.discard(name)
                changed = True
    # The slice of the stacked narrow array that feeds the chain (through views) is read
    # by the matmul too.
    for name in list(chain):
        inst = by_name[name]
        if inst.opcode != "convert":
            continue
        path, src = [], by_name.get(inst.operands[0])
        while src is not None and src.opcode in _VIEWS and src.operands:
            path.append(src)
            src = by_name.get(src.operands[0])
        if src is None or src.opcode not in ("slice", "dynamic-slice"):
            continue
        members = [src, *path]
        if all(all(u.name in chain or u in members for u in comp.users.get(m.name, []))
               for m in members):
            chain.update(m.name for m in members)
    return frozenset(chain)


def _dequant_read_bytes(comp: Computation, name: str) -> float | None:
    """HBM bytes a matmul reads for operand `name` when it is a fused dequantisation (the
    narrow storage and its scales), else None."""
    chain = _dequant_ops(comp)
    if not chain or _through_views(comp, name) not in chain and name not in chain:
        return None
    total, seen, stack = 0.0, set(), [name]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        inst = comp.by_name.get(n)
        if inst is None:
            continue
        if n in chain and inst.opcode not in ("slice", "dynamic-slice"):
            stack.extend(inst.operands)
        elif n in chain:  # the slice of the stacked array: only its part is read
            total += float(sum(a.nbytes for a in inst.shapes))
        else:
            total += _read_bytes(comp, n)
    return total


def _dequant_source_dtype(comp: Computation, name: str) -> str | None:
    """The narrow element type operand `name` was dequantised from (walking back through
    views, the scale multiply, widening converts and gathers of the dequantised value),
    taking the values' type, not the block scales'; None for a plain operand. Both operands
    of a dot from the same narrow float make it a block-scaled low-precision MMA."""
    found, seen, stack = [], set(), [name]
    while stack:
        n = stack.pop()
        inst = comp.by_name.get(n)
        if n in seen or inst is None:
            continue
        seen.add(n)
        if inst.opcode == "convert":
            src = comp.by_name.get(inst.operands[0])
            if src is not None and src.shapes and src.shapes[0].dtype in _NARROW:
                found.append(src.shapes[0])
                continue
            stack.extend(inst.operands)
        elif inst.opcode in ("multiply", "all-gather", "broadcast", *_VIEWS):
            stack.extend(inst.operands)
    if not found:
        return None
    return max(found, key=lambda a: a.num_elements).dtype  # the data, not its scales


def _is_memory_op(inst: Instruction, comp: Computation | None = None) -> bool:
    op = inst.opcode
    if op in _FREE or op in _MATMUL or _is_collective(op) or op.endswith(("-start", "-done")):
        return False
    if comp is not None and inst.name in _dequant_ops(comp):
        return False  # fused into the matmul's operand load
    if op in ("slice", "dynamic-slice") and comp is not None and _feeds_only_matmuls(comp, inst):
        # A layer's weights (or KV cache) sliced out of the stacked array by the loop index
        # are read by the matmul from where they lie: the matmul's operand bytes count them.
        return False
    if FUSED_KERNEL_SCOPE in inst.op_name:
        return False
    return True


def _kernels(
    comp: Computation, module: HloModule | None = None, *, final: bool = True
) -> list[tuple[float, float, list[Instruction]]]:
    """(HBM bytes, elements written, member instructions) of each fused kernel the target
    compiler would form."""
    by_name = comp.by_name
    members = [i for i in comp.instructions if _is_memory_op(i, comp)
               and (final or i.opcode != "copy")]
    if not members:
        return []
    is_member = {i.name for i in members}
    parent = {name: name for name in is_member}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for inst in members:
        if inst.opcode == "fusion":
            continue  # a compiler-made kernel stays on its own
        for o in inst.operands:
            src = by_name.get(_through_views(comp, o))
            if src is None or src.name not in is_member or src.opcode == "fusion":
                continue
            if src.opcode in _REDUCTIONS:
                continue  # a reduction ends its kernel; its consumers start another
            a, b = find(src.name), find(inst.name)
            if a != b:
                parent[a] = b

    regions: dict[str, list[Instruction]] = {}
    for inst in members:
        regions.setdefault(find(inst.name), []).append(inst)
    return [(*_kernel_traffic(comp, region, module), region) for region in regions.values()]


def _feeds_only_matmuls(comp: Computation, inst: Instruction) -> bool:
    users = comp.users.get(inst.name, [])
    if not users:
        return False
    for u in users:
        if u.opcode in _VIEWS:
            if not _feeds_only_matmuls(comp, u):
                return False
        elif u.opcode not in _MATMUL:
            return False
    return True


def _through_views(comp: Computation, name: str) -> str:
    inst = comp.by_name.get(name)
    while inst is not None and inst.opcode in _VIEWS and inst.operands:
        name = inst.operands[0]
        inst = comp.by_name.get(name)
    return name


def _read_bytes(comp: Computation, name: str) -> float:
    """Bytes actually read from HBM for value `name` (a broadcast reads its small input)."""
    inst = comp.by_name.get(name)
    while inst is not None and inst.opcode in (_VIEWS | {"broadcast"}) and inst.operands:
        inst = comp.by_name.get(inst.operands[0])
    if inst is None or inst.opcode in ("constant", "iota"):
        return 0.0
    return float(sum(a.nbytes for a in inst.shapes))


def _kernel_traffic(
    comp: Computation, region: list[Instruction], module: HloModule | None = None
) -> tuple[float, float]:
    inside = {i.name for i in region}
    read: dict[str, float] = {}
    written = 0.0
    elems = 0.0
    for inst in region:
        out_bytes = float(sum(a.nbytes for a in inst.shapes))
        elems += sum(a.num_elements for a in inst.shapes)
        fused_reads, fused_write = _fusion_io(module, inst) if inst.opcode == "fusion" \
            else ({}, None)
        if fused_write is not None:
            out_bytes = fused_write
        for k, o in enumerate(inst.operands):
            if o in inside or _through_views(comp, o) in inside:
                continue
            if k in fused_reads:
                read[f"{o}@{inst.name}"] = fused_reads[k]
            elif inst.opcode in _SLICES and k == 0:
                read[f"{o}@{inst.name}"] = out_bytes  # only the kept part is read
            elif inst.opcode in _IN_PLACE and k == 0:
                continue  # updated in place: the untouched part is neither read nor written
            elif o not in read:
                read[o] = _read_bytes(comp, o)
        users = comp.users.get(inst.name, [])
        leaves = inst.is_root or any(_leaves_region(comp, u, inside) for u in users)
        if leaves:
            if inst.opcode in _IN_PLACE and len(inst.operands) > 1:
                update = inst.operands[-1 if inst.opcode == "scatter" else 1]
                written += float(sum(a.nbytes for a in _shapes_of(comp, update)))
            else:
                written += out_bytes
    return sum(read.values()) + written, elems


def _fusion_io(module: HloModule | None, inst: Instruction) -> tuple[dict[int, float], float | None]:
    """What a compiler-made fusion really moves: an operand the fused computation only
    slices is read for the slices' size (a layer's weights out of the stacked array), an
    operand it only updates in place is not read, and a dynamic-update-slice root writes
    only its update."""
    if module is None:
        return {}, None
    callee = next((c for role, c in inst.called_computations() if role == "calls"), None)
    fused = module.computations.get(callee) if callee else None
    if fused is None:
        return {}, None
    reads: dict[int, float] = {}
    for p in fused.instructions:
        if p.opcode != "parameter":
            continue
        users = _users_through_views(fused, p.name)
        if users and all(u.opcode in _SLICES and _through_views(fused, u.operands[0]) == p.name
                         for u in users):
            reads[int(p.operands[0])] = float(sum(a.nbytes for u in users for a in u.shapes))
        elif users and all(u.opcode in _IN_PLACE and
                           _through_views(fused, u.operands[0]) == p.name for u in users):
            reads[int(p.operands[0])] = 0.0
    write = None
    root = fused.root
    if root is not None and root.opcode in _IN_PLACE and len(root.operands) > 1:
        update = root.operands[-1 if root.opcode == "scatter" else 1]
        write = float(sum(a.nbytes for a in _shapes_of(fused, update)))
    return reads, write


def _users_through_views(comp: Computation, name: str) -> list[Instruction]:
    """The users of `name`, looking through bitcasts and reshapes."""
    out = []
    for u in comp.users.get(name, []):
        if u.opcode in _VIEWS:
            out.extend(_users_through_views(comp, u.name))
        else:
            out.append(u)
    return out


def _leaves_region(comp: Computation, user: Instruction, inside: set[str]) -> bool:
    """Whether a value used by `user` must be written to HBM (a view passes it on)."""
    if user.name in inside:
        return False
    if user.opcode in _VIEWS:
        return user.is_root or any(_leaves_region(comp, u, inside)
                                   for u in comp.users.get(user.name, []))
    return True


def _shapes_of(comp: Computation, name: str) -> list[ArrayShape]:
    inst = comp.by_name.get(name)
    return inst.shapes if inst is not None else []
