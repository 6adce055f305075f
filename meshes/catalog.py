"""System names: `<family>:<size>` (design.md) -> a System.

`gb200-nvl72:72`, `h100:64`, `tpu-v5e:16x16`, `tpu-v6e:16x16*2` (two slices over DCN). The
families are the tables of `meshes/gpu.py` and `meshes/tpu.py`; adding a row there adds a
name here.
"""

from __future__ import annotations

import re

from meshes.gpu import GPU_FAMILIES, GpuFamily, GpuSystem
from meshes.system import System
from meshes.tpu import TPU_FAMILIES, TpuFamily, TpuSystem

_TOPOLOGY = re.compile(r"^(\d+(?:x\d+)*)(?:\*(\d+))?$")


def system_names() -> list[str]:
    """One example name per family (GPU: one NVLink domain; TPU: the family's example
    slice), for error messages and `shardscope systems`."""
    gpus = [f"{f.name}:{f.domain_size}" for f in GPU_FAMILIES.values()]
    tpus = [f"{f.name}:{'x'.join(map(str, f.example_shape))}" for f in TPU_FAMILIES.values()]
    return gpus + tpus


def get_system(name: str) -> System:
    """Parse `<family>:<size>` into a System.

    Raises:
        ValueError: unknown family or a size the family cannot have.
    """
    family, sep, size = name.partition(":")
    valid = ", ".join(system_names())
    if not sep or not size:
        raise ValueError(f"system {name!r} needs the form <family>:<size>; e.g. {valid}")
    if family in GPU_FAMILIES:
        return _gpu_system(GPU_FAMILIES[family], name, size)
    if family in TPU_FAMILIES:
        return _tpu_system(TPU_FAMILIES[family], name, size)
    raise ValueError(f"unknown system family {family!r} in {name!r}; valid: {valid}")


def _gpu_system(f: GpuFamily, name: str, size: str) -> GpuSystem:
    if not size.isdigit() or int(size) < 1:
        raise ValueError(f"system {name!r}: size {size!r} must be a GPU count, e.g. {f.name}:"
                         f"{f.domain_size}")
    n = int(size)
    if n > f.domain_size and n % f.domain_size:
        raise ValueError(
            f"system {name!r}: {n} GPUs is not a whole number of {f.domain_size}-GPU NVLink "
            f"domains; use at most {f.domain_size} or a multiple of {f.domain_size}"
        )
    return GpuSystem(f, n)


def _tpu_system(f: TpuFamily, name: str, size: str) -> TpuSystem:
    m = _TOPOLOGY.match(size)
    example = "x".join(["4"] * f.ndim)
    if not m:
        raise ValueError(f"system {name!r}: size {size!r} must be a torus shape like "
                         f"{f.name}:{example} (optionally *SLICES)")
    shape = tuple(int(s) for s in m.group(1).split("x"))
    slices = int(m.group(2) or 1)
    if len(shape) != f.ndim:
        raise ValueError(f"system {name!r}: {f.name} slices are {f.ndim}D; give {f.ndim} "
                         f"dimensions like {f.name}:{example}")
    if any(s < 1 for s in shape) or any(s > mx for s, mx in zip(shape, f.max_shape)) or slices < 1:
        raise ValueError(f"system {name!r}: shape {size} exceeds the largest {f.name} slice "
                         f"{'x'.join(map(str, f.max_shape))} or is empty")
    return TpuSystem(f, shape, slices)
