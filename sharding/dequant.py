"""Weight-only dequantisation in front of a matmul, which the target compilers fuse into the
matmul's operand load (XLA:GPU's Triton GEMM fusion, the TPU's operand fusion).

A widening `convert` of int8/int4/fp8 storage, times a broadcast scale, used only by
matmuls: the matmul reads the narrow bytes and the scales, and no wide copy of the weight
reaches HBM. A dot whose two operands are dequantised from the same narrow float is a
block-scaled low-precision MMA and runs at that format's rate.
"""

from __future__ import annotations

from sharding.dataflow import MATMUL_OPS, VIEW_OPS, read_bytes, through_views
from sharding.hlo import Computation

# Storage types that a matmul's operand load widens (weight-only quantisation).
NARROW_TYPES = frozenset({"s8", "u8", "s4", "u4", "f8e4m3fn", "f8e5m2", "f8e4m3", "f4e2m1fn",
                     "f8e8m0fnu"})


# Narrow float types a block-scaled MMA multiplies directly when both operands are in them.
LOW_PRECISION_MMA = {"f4e2m1fn": "float4", "f8e4m3fn": "float8", "f8e5m2": "float8"}


def dequant_ops(comp: Computation) -> frozenset[str]:
    """Instructions that dequantise narrow storage for matmuls only: widening converts from
    a narrow type, multiplies of those by a scale, and the views, converts and slices
    between them and the matmuls."""
    memo = vars(comp)  # computed once per computation, kept with it (like by_name)
    if "dequant_ops" not in memo:
        memo["dequant_ops"] = _find_dequant_ops(comp)
    return memo["dequant_ops"]


def _find_dequant_ops(comp: Computation) -> frozenset[str]:
    by_name = comp.by_name
    chain: set[str] = set()
    for inst in comp.instructions:
        if inst.opcode == "convert" and inst.operands:
            src = by_name.get(inst.operands[0])
            if src is not None and src.shapes and src.shapes[0].dtype in NARROW_TYPES and \
                    inst.shapes and inst.shapes[0].dtype not in NARROW_TYPES:
                chain.add(inst.name)
    if not chain:
        return frozenset()
    grown = True
    while grown:  # grow forward through the scale multiply, converts and views
        grown = False
        for inst in comp.instructions:
            if inst.name in chain or inst.opcode not in ("multiply", "convert", *VIEW_OPS):
                continue
            if any(through_views(comp, o) in chain or o in chain for o in inst.operands):
                chain.add(inst.name)
                grown = True
    changed = True
    while changed:  # keep only what feeds matmuls and nothing else
        changed = False
        for name in list(chain):
            users = comp.users.get(name, [])
            if not users or any(u.name not in chain and u.opcode not in MATMUL_OPS for u in users):
                chain.discard(name)
                changed = True
    # The slice of the stacked narrow array that feeds the chain (through views) is read
    # by the matmul too.
    for name in list(chain):
        inst = by_name[name]
        if inst.opcode != "convert":
            continue
        path, src = [], by_name.get(inst.operands[0])
        while src is not None and src.opcode in VIEW_OPS and src.operands:
            path.append(src)
            src = by_name.get(src.operands[0])
        if src is None or src.opcode not in ("slice", "dynamic-slice"):
            continue
        members = [src, *path]
        if all(all(u.name in chain or u in members for u in comp.users.get(m.name, []))
               for m in members):
            chain.update(m.name for m in members)
    return frozenset(chain)


def dequant_read_bytes(comp: Computation, name: str) -> float | None:
    """HBM bytes a matmul reads for operand `name` when it is a fused dequantisation (the
    narrow storage and its scales), else None."""
    chain = dequant_ops(comp)
    if not chain or through_views(comp, name) not in chain and name not in chain:
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
            total += float(sum(a.hbm_bytes for a in inst.shapes))
        else:
            total += read_bytes(comp, n)
    return total


def dequant_source_dtype(comp: Computation, name: str) -> str | None:
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
            if src is not None and src.shapes and src.shapes[0].dtype in NARROW_TYPES:
                found.append(src.shapes[0])
                continue
            stack.extend(inst.operands)
        elif inst.opcode in ("multiply", "all-gather", "broadcast", *VIEW_OPS):
            stack.extend(inst.operands)
    if not found:
        return None
    return max(found, key=lambda a: a.num_elements).dtype  # the data, not its scales
