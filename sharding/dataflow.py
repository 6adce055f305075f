"""Dataflow questions about HLO values that the FLOP and HBM-traffic models share: which ops
are views, slices, in-place updates or matmuls, what a value really reads from HBM, and who
uses it (looking through views)."""

from __future__ import annotations

from sharding.hlo import ArrayShape, Computation, HloModule, Instruction

MATMUL_OPS = frozenset({"dot", "convolution"})
# The GEMM libraries a compiler calls in place of a dot, the dimension numbers in the call's
# backend_config: cuBLAS and cuBLASLt (`__cublas$gemm`, `__cublas$lt$matmul`, its `$f8`
# form), which XLA:GPU's autotuner picks on a real GPU wherever they beat its Triton GEMM.
GEMM_CALL_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
VIEW_OPS = frozenset({"reshape", "bitcast"})
SLICE_OPS = frozenset({"slice", "dynamic-slice", "gather"})
IN_PLACE_OPS = frozenset({"dynamic-update-slice", "scatter"})


# Opcode prefixes of every collective form XLA prints: the kinds sharding/collectives.py
# reads, their async `-start` / `-done` halves, send / recv, and forms it does not know yet.
_COLLECTIVE_PREFIXES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective",
                        "ragged-all-to-all", "send", "recv")


def is_collective(opcode: str) -> bool:
    """Whether an HLO opcode moves data between devices (any form, async halves included)."""
    return opcode.startswith(_COLLECTIVE_PREFIXES)


def fused_computation(module: HloModule | None, inst: Instruction) -> Computation | None:
    """The computation a fusion instruction runs (None for anything else, or without the
    module)."""
    if module is None or inst.opcode != "fusion":
        return None
    callee = next((c for role, c in inst.called_computations() if role == "calls"), None)
    return module.computations.get(callee) if callee else None


def is_view(inst, comp: Computation | None = None) -> bool:
    """A reshape or bitcast, or a transpose that only moves dimensions of size 1 (the
    leading dimension a vmap adds, one replica or stage per device): XLA makes it a
    bitcast; so is a reduction over dimensions of size 1 only (a sum over the tensor
    ranks whose partial sums a device holds one of: XLA's algebraic simplifier makes it a
    reshape). Views move no data."""
    if inst.opcode in VIEW_OPS:
        return True
    if inst.opcode not in ("transpose", "reduce") or comp is None or not inst.operands \
            or not inst.shapes:
        return False
    src = comp.by_name.get(inst.operands[0])
    perm = inst.attr("dimensions")
    if src is None or not src.shapes or perm is None:
        return False
    dims = src.shapes[0].dims
    order = [int(d) for d in perm.strip("{}").split(",") if d.strip().isdigit()]
    if inst.opcode == "reduce":
        return len(inst.operands) == 2 and bool(order) and all(
            d < len(dims) and dims[d] == 1 for d in order)
    if sorted(order) != list(range(len(dims))):
        return False  # not a permutation of the operand's dimensions (a damaged dump)
    kept = [d for d in order if dims[d] != 1]
    return kept == sorted(kept)


def through_views(comp: Computation, name: str) -> str:
    inst = comp.by_name.get(name)
    while inst is not None and is_view(inst, comp) and inst.operands:
        name = inst.operands[0]
        inst = comp.by_name.get(name)
    return name


def read_bytes(comp: Computation, name: str) -> float:
    """Bytes actually read from HBM for value `name` (a broadcast reads its small input)."""
    inst = comp.by_name.get(name)
    while inst is not None and (inst.opcode == "broadcast" or is_view(inst, comp)) \
            and inst.operands:
        inst = comp.by_name.get(inst.operands[0])
    if inst is None or inst.opcode in ("constant", "iota"):
        return 0.0
    return float(sum(a.hbm_bytes for a in inst.shapes))


def shapes_of(comp: Computation, name: str) -> list[ArrayShape]:
    inst = comp.by_name.get(name)
    return inst.shapes if inst is not None else []


def views_of(comp: Computation, name: str) -> set[str]:
    """`name` and the views of it (bitcasts, reshapes) its users see."""
    out = {name}
    for u in comp.users.get(name, []):
        if is_view(u, comp):
            out |= views_of(comp, u.name)
    return out


def users_through_views(comp: Computation, name: str) -> list[Instruction]:
    """The users of `name`, looking through bitcasts and reshapes."""
    out = []
    for u in comp.users.get(name, []):
        if is_view(u, comp):
            out.extend(users_through_views(comp, u.name))
        else:
            out.append(u)
    return out


def is_gemm_call(inst: Instruction) -> bool:
    """A custom-call to a GEMM library (GEMM_CALL_TARGETS)."""
    return inst.opcode == "custom-call" and (
        inst.attr("custom_call_target") or "").strip('"').startswith(GEMM_CALL_TARGETS)


def is_matmul(inst: Instruction) -> bool:
    """A dot, a convolution or a library GEMM call."""
    return inst.opcode in MATMUL_OPS or is_gemm_call(inst)


def feeds_only_matmuls(comp: Computation, inst: Instruction) -> bool:
    users = comp.users.get(inst.name, [])
    if not users:
        return False
    for u in users:
        if is_view(u, comp):
            if not feeds_only_matmuls(comp, u):
                return False
        elif not is_matmul(u):
            return False
    return True


def collective_reads_in_place(comp: Computation, inst: Instruction) -> bool:
    """A slice of one leading index of a stacked array (a layer's saved tensor in a layer
    scan) whose every reader is a collective: contiguous, so the collective library sends
    it from where it lies (no copy kernel)."""
    if inst.opcode not in ("slice", "dynamic-slice") or not inst.operands or not inst.shapes:
        return False
    src = comp.by_name.get(inst.operands[0])
    if src is None or not src.shapes:
        return False
    whole, part = src.shapes[0].dims, inst.shapes[0].dims
    if len(whole) != len(part) or not part or part[0] != 1 or list(whole[1:]) != list(part[1:]):
        return False
    users = users_through_views(comp, inst.name)
    return bool(users) and all(is_collective(u.opcode) for u in users)

