"""Compute cost of an HLO module: FLOPs of matmuls and HBM bytes, per device, per step.

First-order model (the estimate issue refines it):
- A dot or convolution does 2 x (output elements) x (contracted elements) FLOPs at the
  chip's peak for its operand dtype times the chip's measured matmul efficiency, and moves
  its operands and output through HBM; its time is the larger of the two.
- Other ops are memory-bound. XLA fuses single-use elementwise chains, so a value reaches
  HBM only when fusion cannot keep it in registers: when it feeds a matmul, a collective,
  a loop boundary (tuple), or more than one consumer. Each such value is written once and
  read by each consumer. This stands in for the target compiler's fusion decisions, which
  the CPU compiler does not share.

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
from sharding.hlo import DTYPE_NAMES, ArrayShape, Computation, HloModule, Instruction

# Ops that move no data of their own (views, bookkeeping, control).
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "reshape", "broadcast",
    "iota", "partition-id", "replica-id", "after-all", "while", "call", "conditional",
    "opt-barrier", "custom-call", "domain", "add-dependency", "copy-start", "copy-done",
})
_MATMUL = frozenset({"dot", "convolution"})
FUSED_KERNEL_SCOPE = "flash_attention"
_MATERIALIZE_CONSUMERS = frozenset({"dot", "convolution", "tuple", "while", "call",
                                    "conditional", "fusion"})


@dataclasses.dataclass(frozen=True)
class ComputeCost:
    """Per-device totals for one step."""

    flops: float
    matmul_flops: float
    hbm_bytes: float
    matmul_s: float
    memory_bound_s: float
    flops_by_dtype: dict[str, float]

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
    io_bytes = out[0].nbytes + (lhs.nbytes if lhs else 0) + (rhs.nbytes if rhs else 0)
    if inst.opcode == "dot":
        dims = inst.attr("lhs_contracting_dims")
        contract = 1
        if lhs is not None and dims:
            for d in dims.strip("{}").split(","):
                if d.strip():
                    contract *= lhs.dims[int(d)]
        return 2.0 * out_elems * contract, dtype, io_bytes
    # convolution: each output element sums over kernel elements / output features.
    if rhs is None:
        return 0.0, dtype, io_bytes
    labels = inst.attr("dim_labels") or ""
    m = re.search(r"_([0-9a-z]+)->", labels)
    kernel_out = 1
    if m and "o" in m.group(1):
        kernel_out = rhs.dims[m.group(1).index("o")]
    # The kernel already holds input_features / feature_group_count per output feature.
    per_out = rhs.num_elements / max(kernel_out, 1)
    return 2.0 * out_elems * per_out, dtype, io_bytes


def _operand_shape(comp: Computation, inst: Instruction, i: int) -> ArrayShape | None:
    if i >= len(inst.operands):
        return None
    src = comp.by_name.get(inst.operands[i])
    if src is None:
        return None
    shapes = src.shapes
    return shapes[0] if len(shapes) == 1 else None


def compute_cost(module: HloModule, chip: Chip, *, compute_dtype: str | None = None) -> ComputeCost:
    """FLOPs, HBM bytes and time of every computation, weighted by execution count.

    Args:
        module: the parsed per-device (post-SPMD) program.
        chip: the device that runs it.
        compute_dtype: if set ("float8", "float4"), matmuls are timed at that dtype's peak
            regardless of their HLO operand type (used when the program is traced in bf16
            but the run uses low-precision matmul kernels).
    """
    counts = module.execution_counts
    hbm_bw = chip.hbm_bytes_per_s * chip.hbm_efficiency
    flops = matmul_flops = hbm = matmul_s = mem_s = 0.0
    by_dtype: dict[str, float] = {}
    fused = {callee for callee, sites in module.call_sites.items()
             if any(inst.opcode == "fusion" for _, inst, _ in sites)}
    for comp in module.computations.values():
        n = counts.get(comp.name, 0)
        if n == 0:
            continue
        consumers = comp.users
        for inst in comp.instructions:
            op = inst.opcode
            if op in _MATMUL:
                f, dt, io = dot_flops(inst, comp)
                if FUSED_KERNEL_SCOPE in inst.op_name:
                    io = 0  # operands stream through on-chip memory inside the kernel
                dt = compute_dtype or dt
                peak = chip.peak_for(dt) * chip.matmul_efficiency
                flops += n * f
                matmul_flops += n * f
                by_dtype[dt] = by_dtype.get(dt, 0.0) + n * f
                hbm += n * io
                matmul_s += n * max(f / peak, io / hbm_bw)
                continue
            if comp.name in fused or op in _FREE or op.endswith("-done"):
                continue
            if FUSED_KERNEL_SCOPE in inst.attr_text and FUSED_KERNEL_SCOPE in inst.op_name:
                continue
            out = inst.shapes
            if not out:
                continue
            uses = [u.opcode for u in consumers.get(inst.name, [])]
            if inst.is_root or len(uses) != 1 or uses[0] in _MATERIALIZE_CONSUMERS \
                    or op == "fusion" or _is_collective(uses[0]):
                nbytes = sum(a.nbytes for a in out) * (1 + max(len(uses), 1))
                hbm += n * nbytes
                mem_s += n * nbytes / hbm_bw
            flops += n * sum(a.num_elements for a in out)  # ~1 FLOP per element
    return ComputeCost(flops, matmul_flops, hbm, matmul_s, mem_s, by_dtype)


def _is_collective(op: str) -> bool:
    return op.startswith(("all-", "reduce-scatter", "collective-"))


def matmul_time_s(flops: float, dtype: str, chip: Chip) -> float:
    """Seconds for `flops` of large matmuls in `dtype` on `chip`."""
    return flops / (chip.peak_for(dtype) * chip.matmul_efficiency)


def hbm_time_s(nbytes: float, chip: Chip) -> float:
    return nbytes / (chip.hbm_bytes_per_s * chip.hbm_efficiency)


