"""Meshes over a system's devices, and the fake CPU device count that backs them."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from meshes import System
from sharding.rules import MESH_AXES

# What XLA:CPU fakes in one process (4096 devices failed here).
CPU_MAX_DEVICES = 2048


def ensure_cpu_devices(n: int) -> None:
    """Ask for `n` fake CPU devices; must run before JAX starts its CPU backend.

    Raises:
        TypeError: `n` is not a whole number.
        ValueError: `n` below 1 or above CPU_MAX_DEVICES, or the backend is already up with
            fewer devices.
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise TypeError(f"ensure_cpu_devices({n!r}): give the number of fake CPU devices as "
                        f"an int, e.g. ensure_cpu_devices(8)")
    if n < 1:  # 0 would leave JAX's CPU backend without devices for the whole process
        raise ValueError(f"ensure_cpu_devices({n}): give at least 1 fake CPU device, e.g. "
                         f"ensure_cpu_devices(8)")
    if n > CPU_MAX_DEVICES:
        raise ValueError(
            f"{n} devices: XLA:CPU handles at most {CPU_MAX_DEVICES} fake devices in one "
            f"process (4096 failed here); compile a smaller slice of the system or with the "
            f"TPU compiler"
        )
    try:
        # never fewer than asked for before (a search worker asks for its largest first)
        asked = max(n, _already_requested(), int(jax.config.jax_num_cpu_devices))
        jax.config.update("jax_num_cpu_devices", asked)
    except RuntimeError:
        pass  # backend already initialised; checked below
    have = len(jax.devices("cpu"))
    if have < n:
        raise ValueError(
            f"need {n} CPU devices but JAX's CPU backend already started with {have}; set "
            f"jax.config.update('jax_num_cpu_devices', {n}) (or XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n}) before JAX starts"
        )


def _already_requested() -> int:
    flags = os.environ.get("XLA_FLAGS", "")
    for f in flags.split():
        if f.startswith("--xla_force_host_platform_device_count="):
            return int(f.split("=", 1)[1])
    return 0


def placement(shape: Sequence[int], names: Sequence[str], outer: str = "") -> np.ndarray:
    """The system device id at each mesh position (an array of `shape`): row-major over the
    axes in mesh order (`tensor` fastest: consecutive ids), or with `outer` moved to the
    front, so that its members are the farthest apart (across pods, slices, racks), the
    other axes keeping their order."""
    shape, names = tuple(shape), tuple(names)
    n = math.prod(shape)
    if not outer or outer not in names or names.index(outer) == 0:
        return np.arange(n).reshape(shape)
    order = [names.index(outer)] + [i for i in range(len(names)) if names[i] != outer]
    ids = np.arange(n).reshape([shape[i] for i in order])
    return ids.transpose(np.argsort(order))


def abstract_mesh(system: System, axis_sizes: Mapping[str, int]) -> AbstractMesh:
    """The mesh's shape and axis names without devices (any size): enough for shardings'
    shard shapes, so for the memory of a step on a system larger than XLA:CPU fakes."""
    names = tuple(a for a in MESH_AXES if a in axis_sizes)
    shape = tuple(int(axis_sizes[a]) for a in names)
    if math.prod(shape) != system.num_devices:
        raise ValueError(f"parallelism sizes {dict(zip(names, shape))} make "
                         f"{math.prod(shape)} devices, but {system.name} has "
                         f"{system.num_devices}")
    return AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def make_mesh(
    system: System, axis_sizes: Mapping[str, int], *, devices=None, outer: str = ""
) -> Mesh:
    """A mesh with axes in MESH_AXES order (`tensor` fastest) over the first devices.

    Device i of the mesh's row-major order is system device id i: `tensor` groups are
    consecutive ids (one tray, one HGX node, one torus row); with `outer`, that axis is
    placed outermost instead (`placement`).

    Args:
        system: the target machine.
        axis_sizes: mesh axis -> size; their product must be the system's device count.
        devices: the JAX devices to use, by system device id; the CPU backend's by default.
        outer: the mesh axis whose members sit farthest apart ("" keeps MESH_AXES order).
    """
    unknown = [a for a in axis_sizes if a not in MESH_AXES]
    if unknown:
        raise ValueError(f"unknown mesh axis {unknown[0]!r}; valid: {', '.join(MESH_AXES)}")
    names = tuple(a for a in MESH_AXES if a in axis_sizes)
    shape = tuple(int(axis_sizes[a]) for a in names)
    n = math.prod(shape)
    if n != system.num_devices:
        sizes = " x ".join(f"{a}={s}" for a, s in zip(names, shape))
        raise ValueError(
            f"parallelism {sizes} = {n} devices, but {system.name} has {system.num_devices}; "
            f"make the product of the axis sizes {system.num_devices}"
        )
    if devices is None:
        ensure_cpu_devices(n)
        devices = sorted(jax.devices("cpu"), key=lambda d: d.id)[:n]
    if len(devices) < n:
        raise ValueError(f"mesh needs {n} devices, {len(devices)} given")
    arr = np.array(devices[:n], dtype=object)[placement(shape, names, outer)]
    return Mesh(arr, names, axis_types=(AxisType.Auto,) * len(names))
