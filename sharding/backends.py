"""Which compiler produces the HLO: fake CPU devices, or the real TPU compiler without a TPU.

`tpu`: libtpu's deviceless topology (jax.experimental.topologies) gives devices with
their torus coordinates; XLA's TPU compiler partitions, fuses and schedules the program as
it would on the pod, and its final HLO (bf16 kept, async collectives, fusions) is read.
`cpu`: XLA:CPU on fake devices; the HLO right after SPMD partitioning is read.
`auto`: the TPU compiler for TPU systems when the `tpu` extra is installed, else the CPU.
"""

from __future__ import annotations

import importlib.util

import jax

from meshes import System, TpuSystem

BACKENDS = ("auto", "cpu", "tpu", "gpu")
TPU_EXTRA = "pip install 'shardscope[tpu]'  (libtpu matching jax 0.10.2)"

# System family -> libtpu topology name prefix.
_TPU_TOPOLOGY = {"tpu-v4": "v4", "tpu-v5e": "v5e", "tpu-v5p": "v5p", "tpu-v6e": "v6e",
                 "tpu7x": "tpu7x"}


def tpu_compiler_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def resolve_backend(backend: str, system: System) -> str:
    """The backend that will compile, or a ValueError with the way out."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "tpu" if isinstance(system, TpuSystem) and tpu_compiler_installed() else "cpu"
    if backend == "tpu":
        if not isinstance(system, TpuSystem):
            raise ValueError(f"--backend tpu compiles for TPU systems; {system.name} is not "
                             f"one; use --backend cpu")
        if not tpu_compiler_installed():
            raise ValueError(f"--backend tpu needs libtpu: {TPU_EXTRA}")
    if backend == "gpu":
        raise ValueError("--backend gpu (deviceless XLA:GPU) is not supported yet; use "
                         "--backend cpu")
    return backend


def topology_name(system: TpuSystem) -> str:
    return f"{_TPU_TOPOLOGY[system.family.name]}:{'x'.join(map(str, system.shape))}"


def tpu_devices(system: TpuSystem) -> list:
    """The deviceless TPU devices of `system`, ordered by the system's device ids (so that
    mesh position i is system device i, as on the CPU path)."""
    from jax.experimental import topologies

    from sharding.api import capture_stderr

    with capture_stderr():  # libtpu warns about TPU env vars it does not need here
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=topology_name(system), chip_config_name="default",
            chips_per_host_bounds=(2, 2, 1), num_slices=system.num_slices)
    devices = list(topo.devices)
    if len(devices) != system.num_devices:
        raise ValueError(f"libtpu's {topology_name(system)} has {len(devices)} devices, the "
                         f"catalog's {system.name} {system.num_devices}")
    return sorted(devices, key=lambda d: system_device_id(system, d))


def system_device_id(system: System, device: jax.Device) -> int:
    """The system's id for a JAX device: from torus coordinates on TPU, else its id."""
    if isinstance(system, TpuSystem) and getattr(device, "platform", "") == "tpu":
        coords = list(device.coords) + [0] * (3 - len(device.coords))
        return system.device_id(getattr(device, "slice_index", 0), coords[: len(system.shape)],
                                getattr(device, "core_on_chip", 0))
    return device.id
