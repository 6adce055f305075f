"""Collectives of a parsed HLO module: kind, bytes, count, groups.

Bytes follow nccl-tests: the buffer size S per device (algorithm bandwidth = S / time), i.e.
the gathered output of an all-gather, the input of a reduce-scatter, the buffer of an
all-reduce or all-to-all, what each device sends in a collective-permute; in the element type
the program asked for (a bf16 reduction that XLA:CPU promoted to f32 still counts 2 bytes).
`wire_bytes` is what one device sends: S (n-1)/n, 2 S (n-1)/n for all-reduce, S for a
permute or broadcast.

Async pairs are counted once, at `-start`. A collective that moves nothing (each replica
group one device, as over a mesh axis of size 1) is not one. An all-reduce inside a TPU
computation named `all-reduce-scatter*` is the TPU compiler's fused reduce-scatter and is
reported as one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from meshes import COLLECTIVE_KINDS, bus_factor
from sharding.dataflow import fused_computation, is_collective, users_through_views, views_of
from sharding.hlo import (
    DTYPE_NAMES,
    ArrayShape,
    HloModule,
    Instruction,
    operation_of,
    parse_shape,
    split_top_level,
)
from sharding.loops import execution_counts
from sharding.replica_groups import mesh_axes_of, parse_replica_groups, parse_source_target_pairs

KINDS = COLLECTIVE_KINDS


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program.

    Attributes:
        kind: HLO op name ("all-gather", ...).
        name: the HLO instruction name.
        dtype: element type the program asked for ("bfloat16", ...).
        shape: shape of the buffer counted in `bytes`.
        bytes: buffer size S per device, nccl-tests sense (see the module docstring).
        wire_bytes: bytes one device sends per execution.
        count: executions per step, with every enclosing loop's trip count applied.
        group_size: devices per replica group (2 for collective-permute pairs).
        groups: replica groups (source/target pairs for collective-permute), partition ids.
        mesh_axes: mesh axes the groups span.
        link: link class that carries it ("nvlink", "infiniband", "ici", "dcn").
        time_s: time of one execution on the system.
        op_name: the JAX operation that caused it (HLO metadata op_name).
        algorithm: the collective algorithm assumed for the time.
        computation: the HLO computation holding the instruction.
        compiled_dtype: the element type in the compiled HLO when it is not the program's
            (XLA:CPU's final HLO promotes 16-bit reductions to f32); "" otherwise.
        link_share: the share of `wire_bytes` that crosses `link` (CollectiveTiming's).
    """

    kind: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    wire_bytes: float
    count: int
    group_size: int
    groups: tuple[tuple[int, ...], ...]
    mesh_axes: tuple[str, ...]
    link: str = ""
    time_s: float = 0.0
    op_name: str = ""
    algorithm: str = ""
    computation: str = ""
    compiled_dtype: str = ""
    link_share: float = 1.0

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count

    @property
    def total_time_s(self) -> float:
        return self.time_s * self.count


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """What one device sends for one execution: S x the nccl-tests bus factor (S for a
    permute or broadcast)."""
    if kind in ("collective-permute", "collective-broadcast"):
        return float(nbytes)
    return nbytes * bus_factor(kind, n)


def _top_level_elements(shape_text: str) -> list[str]:
    if shape_text.startswith("("):
        return split_top_level(shape_text[1:-1])
    return [shape_text]


def _buffer(kind: str, inst: Instruction, async_start: bool, n: int) -> list[ArrayShape]:
    """The arrays making up S for this collective."""
    if async_start:
        elems = _top_level_elements(inst.shape_text)
        if kind == "all-reduce":
            arrays = parse_shape(inst.shape_text)
            # all-reduce-start is the output array, or a tuple (variadic) of outputs
            return arrays
        if kind in ("collective-permute", "collective-broadcast"):
            return parse_shape(elems[1] if len(elems) > 1 else elems[0])
        out = parse_shape(elems[-1])
    else:
        out = inst.shapes
    if kind == "reduce-scatter":
        # S is the input buffer: the scattered output times the group size along the
        # scattered dimension (`dimensions={d}`)
        d = int((inst.attr("dimensions") or "0").strip("{} ") or 0)
        return [ArrayShape(a.dtype, (*a.dims[:d], a.dims[d] * n, *a.dims[d + 1:])
                           if len(a.dims) > d else (n,)) for a in out]
    return out


_NARROW_FLOATS = ("bf16", "f16")


def _program_dtype(comp, inst: Instruction) -> str | None:
    """The 16-bit type a reduction XLA:CPU promoted to f32 had in the program (its reducer
    is then named `*_promoted` and its operand converted up from that type); None when
    not promoted."""
    reducer = inst.attr("to_apply") or ""
    if not reducer.rstrip("}").endswith("_promoted"):
        return None
    for name in inst.operands:
        src = comp.by_name.get(name)
        for operand in (src.operands if src is not None else ()):
            feeder = comp.by_name.get(operand)
            dtypes = {a.dtype for a in feeder.shapes} if feeder is not None else set()
            if len(dtypes) == 1 and (d := dtypes.pop()) in _NARROW_FLOATS:
                return d
    return "bf16"


def _groups(kind: str, inst: Instruction, num_partitions: int) -> list[list[int]]:
    if kind == "collective-permute":
        return parse_source_target_pairs(inst.attr("source_target_pairs"))
    groups = parse_replica_groups(inst.attr("replica_groups"), num_partitions,
                                  inst.attr("device_ids"))
    return groups or [list(range(num_partitions))]


def _only_sliced(comp, inst: Instruction, n: int, module=None) -> bool:
    """An all-reduce whose every user keeps 1/n of it with a dynamic-slice (of the value
    itself or a reshape of it).

    That is a reduce-scatter: the SPMD partitioner emits all-reduce + dynamic-slice and
    XLA's ReduceScatterCreator fuses them on TPU and GPU (the TPU compiler keeps them in a
    computation named `all-reduce-scatter`); XLA:CPU never does, so its post-partitioning
    HLO shows the pair. S (the input buffer) is the all-reduce's buffer either way.

    XLA:CPU's executed module (what `measure --profile` reads) combines several into one
    tuple all-reduce, each element taken out by a get-tuple-element, and fuses the slices
    (`_keeps_1_of_n`): the tuple is a reduce-scatter when the elements so kept hold most of
    its bytes (the gradients beside a scalar loss their all-reduce carries along).
    """
    if n <= 1:
        return False
    arrays = inst.shapes
    if len(arrays) == 1:
        return _keeps_1_of_n(module, comp, inst.name, arrays[0].num_elements, n)
    kept = 0
    for u in comp.users.get(inst.name, []):
        index = u.attr("index")
        if u.opcode != "get-tuple-element" or index is None or int(index) >= len(arrays):
            return False
        a = arrays[int(index)]
        kept += a.nbytes if _keeps_1_of_n(module, comp, u.name, a.num_elements, n) else 0
    return 2 * kept > sum(a.nbytes for a in arrays)


def _keeps_1_of_n(module, comp, name: str, whole: int, n: int, depth: int = 0) -> bool:
    """Every use of `name` (an array of `whole` elements) keeps 1/n of it: a dynamic-slice
    of that size, through views and element-wise converts (XLA:CPU's `wrapped_convert`
    fusions too), or the parameter of a fusion (with `module`) that is used so inside it."""
    users = users_through_views(comp, name)
    if not users or depth > 4:
        return False
    for u in users:
        if u.opcode == "dynamic-slice":
            ok = len(u.shapes) == 1 and u.shapes[0].num_elements * n == whole
        elif u.opcode == "convert" or _converts_only(module, u):
            ok = _keeps_1_of_n(module, comp, u.name, whole, n, depth + 1)
        elif (fused := fused_computation(module, u)) is not None:
            names = views_of(comp, name)
            params = {p.operands[0]: p.name for p in fused.instructions
                      if p.opcode == "parameter" and p.operands}
            ok = all(_keeps_1_of_n(module, fused, params.get(str(i), ""), whole, n,
                                   depth + 1)
                     for i, o in enumerate(u.operands) if o in names)
        else:
            ok = False
        if not ok:
            return False
    return True


def _converts_only(module, inst: Instruction) -> bool:
    """A fusion of one operand that only converts it (and views it): element for element."""
    fused = fused_computation(module, inst)
    return fused is not None and len(inst.operands) == 1 and all(
        i.opcode in ("parameter", "convert", "bitcast", "reshape") for i in fused.instructions)


def _folded_all_reduces(comp) -> set[str]:
    """All-reduces whose only user is another all-reduce of their result: XLA's
    AllReduceFolder makes the pair one all-reduce over the union of their groups (the SPMD
    partitioner sums a gradient over `sequence`, then over `data`; the GPU and TPU
    compilers run one all-reduce over both). XLA:CPU's post-partitioning HLO has the pair."""
    folded = set()
    for inst in comp.instructions:
        if inst.opcode != "all-reduce" or len(inst.operands) != 1:
            continue
        src = comp.by_name.get(inst.operands[0])
        if (src is not None and src.opcode == "all-reduce"
                and [u.name for u in comp.users.get(src.name, [])] == [inst.name]
                and src.attr("to_apply") is not None and inst.shapes == src.shapes):
            folded.add(src.name)
    return folded


def _merge_groups(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """The groups of two all-reduces run one after the other: the connected devices."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for g in (*a, *b):
        for d in g[1:]:
            parent[find(d)] = find(g[0])
        find(g[0])
    merged: dict[int, list[int]] = {}
    for d in sorted(parent):
        merged.setdefault(find(d), []).append(d)
    return sorted(merged.values())


def _moves_nothing(kind: str, groups: list[list[int]]) -> bool:
    """A collective whose every replica group has one member (over a mesh axis of size 1),
    or a permute that sends each device's buffer to itself: no device receives anything
    from another (XLA's simplifiers remove such all-reduces and all-gathers; the CPU
    backend's post-partitioning HLO still has them)."""
    if kind == "collective-permute":
        return all(src == dst for src, dst in groups)
    return all(len(g) <= 1 for g in groups)


def _caller_op_name(module: HloModule, comp_name: str) -> str:
    """A collective the compiler moved into a fusion often loses its metadata; the fusion
    that calls it keeps the model operation."""
    for _, inst, _ in module.call_sites.get(comp_name, []):
        if inst.op_name:
            return inst.op_name
    return ""


def _reader_op_name(comp, inst: Instruction) -> str:
    """A collective the partitioner put on a layer scan's read of a saved value (the
    gather of a slice, not of the slice's reshaped value: it carries the read's metadata)
    is the model operation its readers belong to."""
    if not operation_of(inst.op_name).startswith("layer scan:"):
        return ""
    for user in users_through_views(comp, inst.name):
        if user.op_name and not operation_of(user.op_name).startswith("layer scan:"):
            return user.op_name
    return ""


_DCN_TRANSFER = re.compile(r'_xla_megascale_transfer_type="(\w+)"')


def _not_understood(comp_name: str, inst: Instruction) -> str:
    """What an op that looks like a collective but is not read is, in one line. A
    multi-slice TPU program is one slice's: its collectives across slices are host
    transfers to the DCN runtime (a send and a recv each, the send said)."""
    where = f"{comp_name}/{inst.name}: {inst.opcode} (line {inst.line})"
    dcn = _DCN_TRANSFER.search(inst.attr_text)
    if not dcn:
        return where
    if inst.opcode != "send":
        return f"{where}: the receiving half of a DCN transfer across TPU slices (its send says)"
    kind = dcn.group(1).lower().replace("_", "-")
    return (f"{where}: {'an' if kind[0] in 'aeiou' else 'a'} {kind} across TPU slices over "
            f"DCN, run by the multi-slice runtime as a host transfer: not among the "
            f"collectives, nor in the step time (this is one slice's program)")


def extract_collectives(
    module: HloModule,
    *,
    mesh_shape: Sequence[int] = (),
    axis_names: Sequence[str] = (),
) -> tuple[list[Collective], list[str]]:
    """All collectives of `module`, and a list of ops that look like collectives but are
    not understood (reported, never dropped silently)."""
    counts = execution_counts(module)
    out: list[Collective] = []
    unknown: list[str] = []
    for comp in module.computations.values():
        count = counts.get(comp.name, 0)
        if count == 0:
            continue
        folded = _folded_all_reduces(comp)
        for inst in comp.instructions:
            op = inst.opcode
            if op.endswith("-done") or op.endswith("-update") or inst.name in folded:
                continue
            async_start = op.endswith("-start")
            kind = op[: -len("-start")] if async_start else op
            if kind not in KINDS:
                if is_collective(op):
                    unknown.append(_not_understood(comp.name, inst))
                continue
            groups = _groups(kind, inst, module.num_partitions)
            inner = inst
            while kind == "all-reduce" and inner.operands and inner.operands[0] in folded:
                inner = comp.by_name[inner.operands[0]]
                groups = _merge_groups(groups, _groups(kind, inner, module.num_partitions))
            if _moves_nothing(kind, groups):
                continue
            n = 2 if kind == "collective-permute" else (len(groups[0]) if groups else 1)
            reported_kind = kind
            if kind == "all-reduce" and (comp.name.startswith("all-reduce-scatter")
                                         or _only_sliced(comp, inst, n, module)):
                reported_kind = "reduce-scatter"
            arrays = _buffer(kind, inst, async_start, n)
            compiled_dtype = ""
            if (program := _program_dtype(comp, inst)) is not None:
                compiled_dtype = "float32"
                arrays = [ArrayShape(program, a.dims) if a.dtype == "f32" else a
                          for a in arrays]
            nbytes = sum(a.nbytes for a in arrays)
            first = arrays[0] if arrays else ArrayShape("f32", ())
            out.append(
                Collective(
                    kind=reported_kind,
                    name=inst.name,
                    dtype=DTYPE_NAMES.get(first.dtype, first.dtype),
                    shape=first.dims,
                    bytes=nbytes,
                    wire_bytes=wire_bytes(reported_kind, nbytes, n),
                    count=count,
                    group_size=n,
                    groups=tuple(tuple(g) for g in groups),
                    mesh_axes=mesh_axes_of(groups, mesh_shape, axis_names),
                    op_name=_reader_op_name(comp, inst) or inst.op_name
                    or _caller_op_name(module, comp.name),
                    computation=comp.name,
                    compiled_dtype=compiled_dtype,
                )
            )
    return out, unknown


def collective_dict(c: Collective, groups: bool = True) -> dict:
    """A collective's fields, JSON-ready (the report's `collectives`); `groups=False`
    keeps the first replica group only."""
    # Its fields are plain values but for the tuples below (asdict would deep-copy every
    # replica group first: most of the time of a report with thousands of devices).
    d = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    d["shape"] = list(c.shape)
    d["mesh_axes"] = list(c.mesh_axes)
    # Groups can be thousands of ids: all of them for tools that map placement, or the
    # first with the count.
    d["groups"] = [list(g) for g in (c.groups if groups else c.groups[:1])]
    d["group_count"] = len(c.groups)
    return d
