"""Replica groups in every form XLA prints them, and the mesh axes they span.

- explicit `{{0,1},{2,3}}`; an empty `{}` means one group of all devices;
- iota `[G,S]<=[dims]T(perm)`;
- mesh axes `mesh['axis_0'=8,'axis_1'=2] {'axis_1'}` with optional `device_ids`;
- `source_target_pairs={{0,1},{1,2}}` of a collective-permute.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from sharding.hlo import HloParseError


def parse_replica_groups(
    text: str | None, num_devices: int | None = None, device_ids: str | None = None
) -> list[list[int]]:
    """Replica groups in any of XLA's printed forms.

    - explicit `{{0,1},{2,3}}`; an empty `{}` means one group of all devices;
    - iota `[G,S]<=[dims]T(perm)`;
    - mesh axes `mesh['axis_0'=8,'axis_1'=2] {'axis_1'}`, optionally with
      `device_ids=([dims]T(perm)) {...}` giving the device at each mesh position (iota
      order when absent): one group per combination of the other axes.
    """
    if text is None:
        return []
    text = text.strip()
    if text.startswith("mesh["):
        return _mesh_axes_groups(text, device_ids)
    if text.startswith("["):
        return _iota_groups(text)
    if not text.startswith("{"):
        raise HloParseError(f"cannot read replica groups {text!r}")
    inner = text[1:-1].strip()
    if not inner:
        return [list(range(num_devices))] if num_devices else []
    groups = []
    for g in re.findall(r"\{([^{}]*)\}", inner):
        groups.append([int(x) for x in g.split(",") if x.strip()])
    return groups


_MESH_AXIS = re.compile(r"'([^']+)'\s*=\s*(\d+)")
_SUB_AXIS = re.compile(r"^('[^']+'):\((\d+)\)(\d+)$")


def _mesh_axes_groups(text: str, device_ids: str | None) -> list[list[int]]:
    close = text.index("]")
    axes = _MESH_AXIS.findall(text[5:close])
    if not axes:
        raise HloParseError(f"cannot read mesh replica groups {text!r}")
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    rest = (text[close + 1:] + " " + (device_ids or "")).strip()
    m = re.search(r"\{([^{}]*)\}\s*$", rest)
    if not m:
        raise HloParseError(f"mesh replica groups {text!r} name no reduction axes {{...}}")
    grouped = []
    for entry in (a.strip() for a in m.group(1).split(",") if a.strip()):
        sub = _SUB_AXIS.match(entry)
        a = (sub.group(1) if sub else entry).strip("'")
        if a not in names:
            raise HloParseError(f"mesh replica groups: axis {a!r} not in {names}")
        if sub:  # a sub-axis `'a':(pre)size`: the axis seen as [pre, size, the rest]
            i, pre, size = names.index(a), int(sub.group(2)), int(sub.group(3))
            rest, bad = divmod(sizes[i], pre * size)
            if bad or not rest:
                raise HloParseError(f"mesh replica groups: sub-axis {entry!r} does not divide "
                                    f"{a!r} of size {sizes[i]}")
            names[i:i + 1] = [f"{a}<", f"{a}:{pre}", f"{a}>"]
            sizes[i:i + 1] = [pre, size, rest]
            a = f"{a}:{pre}"
        grouped.append(a)
    total = math.prod(sizes)
    devices = np.arange(total)
    if device_ids:
        dm = re.match(r"\(?\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\)?", device_ids.strip())
        if not dm:
            raise HloParseError(f"cannot read device_ids {device_ids!r}")
        dims = [int(x) for x in dm.group(1).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if dm.group(2):
            ids = ids.transpose([int(x) for x in dm.group(2).split(",")])
        devices = ids.reshape(-1)
        if devices.size != total:
            raise HloParseError(f"device_ids {device_ids!r} has {devices.size} ids for a mesh of "
                                f"{total}")
    arr = devices.reshape(sizes)
    keep = [i for i, a in enumerate(names) if a not in grouped]
    moved = [names.index(a) for a in grouped]
    arr = arr.transpose(keep + moved)
    group_size = math.prod(sizes[i] for i in moved)
    return arr.reshape(-1, group_size).tolist()


_IOTA = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")


def _iota_groups(text: str) -> list[list[int]]:
    m = _IOTA.match(text.replace(" ", ""))
    if not m:
        raise HloParseError(f"cannot read iota replica groups {text!r}")
    out_shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        perm = [int(x) for x in m.group(3).split(",")]
        if sorted(perm) != list(range(len(dims))):
            raise HloParseError(f"transpose {perm} is not a permutation of {len(dims)} dims")
        ids = ids.transpose(perm)
    if math.prod(out_shape) != ids.size:
        raise HloParseError(f"iota groups {text!r}: {out_shape} does not hold {ids.size} ids")
    ids = ids.reshape(out_shape)
    if ids.ndim == 1:
        ids = ids.reshape(1, -1)
    return ids.reshape(ids.shape[0], -1).tolist()


def parse_source_target_pairs(text: str | None) -> list[list[int]]:
    if not text:
        return []
    return [[int(a), int(b)] for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", text)]


def mesh_axes_of(
    groups: Sequence[Sequence[int]],
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
) -> tuple[str, ...]:
    """Mesh axes along which the members of each group differ (partition ids are the
    row-major positions in the mesh's device array)."""
    if not groups or not axis_names:
        return ()
    size = int(np.prod(mesh_shape))
    varying = np.zeros(len(mesh_shape), dtype=bool)
    for g in groups:
        ids = np.asarray(g)
        if ids.size == 0 or ids.max() >= size:
            return ()
        coords = np.stack(np.unravel_index(ids, tuple(mesh_shape)), axis=1)
        varying |= (coords != coords[0]).any(axis=0)
    return tuple(a for a, v in zip(axis_names, varying) if v)
