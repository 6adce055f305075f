"""A program compiled on a reduced mesh, read as the full mesh's program.

Past what one compile can fake (XLA:CPU: 2048 devices), a run is compiled on a mesh whose
replica axes are shorter: pure data-parallel replicas run the same per-device program
whatever their number (the batch per device, the shards and every buffer are the same), so
the reduced compile's work, loops and collective buffers are the full run's. Only the
replica groups change: a collective across the data axis spans all D replicas instead of
D', and one within a replica repeats for every replica. `expand_plan` rebuilds them on the
full mesh, to be timed on the full system's links. What cannot be rebuilt exactly (a group
that covers part of a shrunk axis, a point-to-point transfer along it, a collective whose
buffer depends on the group size) raises `NotExpandable` with the reason.

With the optimizer sharded over the data-parallel ranks (ZeRO-1, Megatron's distributed
optimizer) the gradients' reduce-scatter and the weights' all-gather also span the data
axis. Their buffer S is the whole gradient or weight shard a replica holds (the
reduce-scatter's input, the all-gather's output): the same on 2 replicas or 128, so the
caller that knows the data axis carries only those (`sized_by_state`) has them rebuilt too.
Only the optimizer's own update, over 1/D' of the state instead of 1/D, is then counted
for the reduced mesh: an overcount of elementwise HBM traffic (read and written once a
step: small beside a step of many tokens per device, but a quarter of the HBM bytes of a
1,024-token step of a 100M-parameter model at D' = 2, D = 16), which the report's
`extrapolated_from` says.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from sharding.collectives import Collective, wire_bytes
from sharding.hlo import GRADIENT_SUM, OPTIMIZER, operation_of
from sharding.plan import Plan

# Kinds whose per-device buffer is the same whatever the group size (S, the nccl-tests
# buffer size of sharding/collectives.py).
_SIZE_FREE = ("all-reduce",)
# ... and with the optimizer's state sharded over the grown axis (ZeRO-1), its
# reduce-scatter's input and all-gather's output: the whole per-replica tensor. Its own:
# those of the step's gradient sum and optimizer update (their named scopes).
_STATE_SHARDING = ("reduce-scatter", "all-gather")
_STATE_SCOPES = {GRADIENT_SUM, OPTIMIZER}


class NotExpandable(ValueError):
    """The reduced program's collectives cannot be rebuilt exactly on the full mesh."""


def expand_plan(plan: Plan, *, small_shape: Sequence[int], full_shape: Sequence[int],
                axis_names: Sequence[str], sized_by_state: bool = False) -> Plan:
    """`plan`, compiled over `small_shape`, as the program over `full_shape` (the same axes;
    only replica axes differ in size). `sized_by_state`: the optimizer is sharded over the
    grown axes, so the reduce-scatters and all-gathers of its gradient sum and update
    (their named scopes) carry the same buffers on any count (the module docstring)."""
    small_shape, full_shape = tuple(small_shape), tuple(full_shape)
    if len(small_shape) != len(full_shape) or len(axis_names) != len(full_shape):
        raise NotExpandable("the reduced and full meshes must have the same axes")
    grown = [i for i, (s, f) in enumerate(zip(small_shape, full_shape)) if s != f]
    for i in grown:
        if full_shape[i] % small_shape[i]:
            raise NotExpandable(f"axis {axis_names[i]}: {small_shape[i]} does not divide "
                                f"{full_shape[i]}")
    collectives = tuple(_expand(c, small_shape, full_shape, axis_names, grown, sized_by_state)
                        for c in plan.collectives)
    return dataclasses.replace(plan, num_partitions=math.prod(full_shape),
                               collectives=collectives)


def _expand(c: Collective, small: tuple[int, ...], full: tuple[int, ...],
            names: Sequence[str], grown: list[int], sized_by_state: bool) -> Collective:
    coords = [np.stack(np.unravel_index(np.asarray(g), small), axis=1) for g in c.groups]
    spans = sorted({i for i in grown for k in coords if (k[:, i] != k[0, i]).any()})
    if c.kind == "collective-permute" and spans:
        raise NotExpandable(f"{_named(c)} moves data along "
                            f"{', '.join(names[i] for i in spans)}, which was shrunk")
    if spans and not _size_free(c, sized_by_state):
        raise NotExpandable(f"{_named(c)} spans {', '.join(names[i] for i in spans)}: "
                            f"its buffer depends on the group size")
    repeat = [i for i in grown if i not in spans]  # axes the group is copied along
    # every combination of indices along the repeated axes: (R, len(repeat))
    shifts = _grid([full[i] for i in repeat])
    along = _grid([full[i] for i in spans])
    groups: list[tuple[int, ...]] = []
    for k in coords:
        if any(k[0, i] != 0 for i in repeat):
            continue  # a copy of the group at index 0 of a repeated axis
        for i in spans:
            if sorted(set(k[:, i].tolist())) != list(range(small[i])):
                raise NotExpandable(f"{_named(c)} covers part of axis {names[i]}")
        if spans:
            rows = np.unique(np.delete(k, spans, axis=1), axis=0)  # the other coordinates
            if len(rows) * math.prod(small[i] for i in spans) != len(k):
                raise NotExpandable(f"{_named(c)}: a group that is not a whole block "
                                    f"of the axes it spans")
            rest = [i for i in range(len(full)) if i not in spans]
            base = np.zeros((len(rows), len(full)), dtype=np.int64)
            base[:, rest] = rows
            # (members, ndim): every other-coordinate row at every index along the spans
            member = np.repeat(base, len(along), axis=0)
            member[:, spans] = np.tile(along, (len(rows), 1))
        else:
            member = k.astype(np.int64)  # a permute keeps its (source, target) order
        # (R, members, ndim): the group at each index of the repeated axes
        points = np.broadcast_to(member, (len(shifts), *member.shape)).copy()
        points[:, :, repeat] = shifts[:, None, :]
        ids = np.ravel_multi_index(tuple(np.moveaxis(points, -1, 0)), full)
        if spans:
            ids = np.sort(ids, axis=1)
        groups.extend(map(tuple, ids.tolist()))
    n = 2 if c.kind == "collective-permute" else len(groups[0])
    return dataclasses.replace(c, groups=tuple(groups), group_size=n,
                               wire_bytes=wire_bytes(c.kind, c.bytes, n))


def _size_free(c: Collective, sized_by_state: bool) -> bool:
    """Whether the collective's buffer is the same whatever its group's size."""
    return c.kind in _SIZE_FREE or (sized_by_state and c.kind in _STATE_SHARDING
                                    and not _STATE_SCOPES.isdisjoint(c.op_name.split("/")))


def _named(c: Collective) -> str:
    """The collective as a refusal names it: its HLO name (with its kind when the name
    lacks it) and the model operation behind it."""
    name = c.name if c.name.startswith(c.kind) else f"{c.kind} {c.name}"
    return f"{name} ({operation_of(c.op_name)})"


def _grid(sizes: Sequence[int]) -> np.ndarray:
    """Every index combination of axes of these sizes, row-major: (prod(sizes), len)."""
    rows = list(itertools.product(*(range(k) for k in sizes)))
    return np.array(rows, dtype=np.int64).reshape(len(rows), len(sizes))
