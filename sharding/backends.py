"""Which compiler produces the HLO: fake CPU devices, or the real TPU compiler without a TPU.

`tpu`: libtpu's deviceless topology (jax.experimental.topologies) gives devices with
their torus coordinates; XLA's TPU compiler partitions, fuses and schedules the program as
it would on the pod, and its final HLO (bf16 kept, async collectives, fusions) is read.
`cpu`: XLA:CPU on fake devices; the HLO right after SPMD partitioning is read.
`gpu`: XLA:GPU through the CUDA 12 plugin's deviceless topology: no GPU is needed, the
compiler is told what GPU to compile for by a GpuTargetConfig written from the catalog
(meshes.chips.GPU_TARGETS) and how GPUs are grouped: NVLink domains ("slices"), hosts per
domain, GPUs per host. Its final HLO (async collectives, fusions, cuBLAS/Triton GEMMs) is
read.
`auto`: the real compiler for the system when its extra is installed, else the CPU.
"""

from __future__ import annotations

import importlib.util

import jax

from meshes import GpuSystem, System, TpuSystem

BACKENDS = ("auto", "cpu", "tpu", "gpu")
TPU_EXTRA = "pip install 'shardscope[tpu]'  (libtpu matching jax 0.10.2)"
GPU_EXTRA = "pip install 'shardscope[gpu]'  (the CUDA 12 plugin, several GB; make test-gpu)"

# System family -> libtpu topology name prefix.
_TPU_TOPOLOGY = {"tpu-v4": "v4", "tpu-v5e": "v5e", "tpu-v5p": "v5p", "tpu-v6e": "v6e",
                 "tpu7x": "tpu7x"}


def tpu_compiler_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def gpu_compiler_installed() -> bool:
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


def resolve_backend(backend: str, system: System) -> str:
    """The backend that will compile, or a ValueError with the way out."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    # backend -> (the systems it compiles for, is its extra installed, what to install,
    # the other backends)
    compilers = {"tpu": (TpuSystem, tpu_compiler_installed, f"libtpu: {TPU_EXTRA}", "cpu"),
                 "gpu": (GpuSystem, gpu_compiler_installed, f"the CUDA plugin: {GPU_EXTRA}",
                         "cpu or tpu")}
    if backend == "auto":
        return next((name for name, (kind, installed, _, _) in compilers.items()
                     if isinstance(system, kind) and installed()), "cpu")
    if backend in compilers:
        kind, installed, extra, others = compilers[backend]
        if not isinstance(system, kind):
            raise ValueError(f"--backend {backend} compiles for {backend.upper()} systems; "
                             f"{system.name} is not one; use --backend {others}")
        if not installed():
            raise ValueError(f"--backend {backend} needs {extra}")
    return backend


def gpu_target_config(system: GpuSystem) -> str:
    """The GpuTargetConfig text proto for the system's GPU, from the catalog."""
    from meshes.chips import GPU_TARGETS

    chip, t = system.chip, GPU_TARGETS[system.chip.name]
    major, minor = t.compute_capability
    return "\n".join([
        "gpu_device_info {",
        "  threads_per_block_limit: 1024",
        "  threads_per_warp: 32",
        "  shared_memory_per_block: 49152",
        f"  shared_memory_per_core: {t.shared_memory_per_sm}",
        "  threads_per_core_limit: 2048",
        f"  core_count: {t.sm_count}",
        "  fpus_per_core: 128",
        "  block_dim_limit_x: 2147483647",
        "  block_dim_limit_y: 65535",
        "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {int(chip.hbm_bytes_per_s)}",
        f"  l2_cache_size: {t.l2_bytes}",
        f"  clock_rate_ghz: {t.clock_ghz}",
        f"  device_memory_size: {int(chip.hbm_bytes)}",
        f"  shared_memory_per_block_optin: {t.shared_memory_per_block_optin}",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        "  registers_per_core_limit: 65536",
        "  registers_per_block_limit: 65536",
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info { major: 9 minor: 8 patch: 0 }",
        f'device_description_str: "{t.description}"',
    ]) + "\n"


def gpu_topology_name(system: GpuSystem) -> str:
    """"<NVLink domains>x<hosts per domain>x<GPUs per host>", XLA's GpuTopology."""
    f = system.family
    per_domain = min(system.num_devices, f.domain_size)
    per_host = min(per_domain, f.tray_size)
    return f"{system.num_devices // per_domain}x{per_domain // per_host}x{per_host}"


def gpu_devices(system: GpuSystem) -> list:
    """Compile-only XLA:GPU devices for the system, in its device-id order."""
    import os

    from jax._src import xla_bridge

    from sharding.api import capture_stderr

    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
    with capture_stderr():  # the plugin probes for CUDA devices and logs that none exist
        topo = xla_bridge.make_pjrt_topology("cuda", "shardscope",
                                             topology=gpu_topology_name(system),
                                             target_config=gpu_target_config(system))
        devices = list(topo._make_compile_only_devices())
    if len(devices) != system.num_devices:
        raise ValueError(f"XLA:GPU's {gpu_topology_name(system)} has {len(devices)} devices, "
                         f"the catalog's {system.name} {system.num_devices}")
    return sorted(devices, key=lambda d: d.id)


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
