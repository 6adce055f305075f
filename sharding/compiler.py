"""Compilation: which compiler makes the HLO, and what it says while doing so.

Backends:
- `cpu`: XLA:CPU on fake devices; the HLO right after SPMD partitioning is read (it keeps
  the program's dtypes; the final CPU HLO upcasts bf16 dots and collectives to f32, fuses
  as a CPU does and expands scatters into loops); on one device, where no partitioning
  runs, the HLO after the call inliner, the same stage.
- `tpu`: libtpu's deviceless topology (jax.experimental.topologies) gives devices with
  their torus coordinates; XLA's TPU compiler partitions, fuses and schedules the program
  as it would on the pod, and its final HLO (bf16 kept, async collectives, fusions) is read.
- `gpu`: XLA:GPU through the CUDA 12 plugin's deviceless topology: the compiler is told
  what GPU to compile for by a GpuTargetConfig written from the catalog
  (meshes.chips.GPU_TARGETS) and how GPUs are grouped: NVLink domains ("slices"), hosts
  per domain, GPUs per host. Its final HLO (async collectives, fusions, GEMMs) is read.
- `auto`: the real compiler for the system when its extra is installed, else the CPU.

Also here: XLA's C++ log lines captured around each compile (the SPMD partitioner's
warnings reach the report), the target compiler's out-of-memory refusal as `DoesNotFit`,
and the compiler's own memory figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence

import jax

from meshes import GpuSystem, System, TpuSystem
from meshes.chips import GPU_TARGETS
from sharding import compile_cache
from sharding.compiled_memory import TARGET_DUMP_OPTIONS, memory_stats

# libtpu takes a lock file so that one process owns the TPU chips; deviceless compiles own
# no chip, and several must run side by side (two `shardscope run`, `make test` next to
# either, a search's workers). Set before libtpu loads: it is read when the plugin starts.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# XLA log lines worth showing the user, with the words that identify them.
_XLA_WARNINGS = (
    "Involuntary full rematerialization",
    "SPMD will replicate",
)


@contextlib.contextmanager
def capture_stderr():
    """Capture what C++ libraries write to fd 2 (XLA, libtpu), yielding a list that is
    filled with the captured lines on exit."""
    lines: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


_REMAT = re.compile(r"cannot go from sharding (.+?) to (.+?) efficiently for HLO operation "
                    r"%?([\w.\-]+) = (\S+)")


def xla_warnings(lines: Sequence[str]) -> list[str]:
    """XLA's SPMD warnings from captured stderr, one line each, de-duplicated."""
    out: list[str] = []
    for line in lines:
        if not any(w in line for w in _XLA_WARNINGS):
            continue
        m = _REMAT.search(line)
        if m:
            src, dst, op, shape = m.groups()
            what = (f"{op}, XLA's name for an operand of a computation it partitions"
                    if op.startswith("fake_parameter") else op)
            msg = (f"XLA's SPMD partitioner reshards {shape.split('{')[0]} ({what}) the "
                   f"expensive way, an 'involuntary full rematerialization': every device "
                   f"gathers the whole tensor, then keeps its part (from sharding {src} to "
                   f"{dst}); those bytes are among the collectives above")
        else:
            msg = re.sub(r"^.*?\] ", "", line).strip()
        if msg not in out:
            out.append(msg)
    return out


class DoesNotFit(ValueError):
    """The target compiler refused the program: it needs more memory than the device has."""


@dataclasses.dataclass
class Compiled:
    """A compiled program: its HLO text (after SPMD partitioning on the CPU path, else
    the final one), the compiler's memory figures (`memory_stats`: its memory analysis in
    bytes, None where the backend has none), stage timings and XLA's SPMD warnings.
    `compiled` is the jax.stages.Compiled, None when read from the compile cache."""

    hlo_text: str
    compiled: object | None
    timings: dict[str, float]
    warnings: list[str]
    memory_stats: dict[str, int] | None = None
    cached: bool = False


# The CPU path reads the HLO right after SPMD partitioning and XLA:CPU's buffer assignment;
# the code generated for the fake devices is never run. These options skip LLVM's
# expensive optimisation and XLA:CPU's MLIR fusion emitters (its classic ones emit the same
# fusions, faster): the reports are the same but for a few hundred bytes of the buffer
# assignment's temporaries (tests/sharding/test_compiler.py compares them), and the default
# experiment compiles in a third of the time (make bench prints both).
CPU_ANALYSIS_OPTIONS = {"xla_backend_optimization_level": 0,
                        "xla_llvm_disable_expensive_passes": True,
                        "xla_cpu_use_fusion_emitters": False}


def compile_to_hlo(fn: Callable, *args, final_hlo: bool = False, fast_cpu: bool = True,
                   devices: Sequence = (), **kwargs) -> Compiled:
    """Lower and compile; keep the post-SPMD HLO (or the final one), the compiler's memory
    figures, timings and XLA's SPMD warnings. `fast_cpu`: on the CPU path, skip LLVM's
    expensive optimisation (CPU_ANALYSIS_OPTIONS), which nothing here reads. `devices`: the
    devices compiled for (the mesh's, in order); given, the compile cache
    (sharding/compile_cache.py, when SHARDSCOPE_COMPILE_CACHE is set) may answer instead."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="shardscope-dump-") as dump, capture_stderr() as err:
        t0 = time.perf_counter()
        lowered = jitted.lower(*args, **kwargs)
        t1 = time.perf_counter()
        timings["lower_s"] = t1 - t0
        devices = list(devices)
        # one device: no SPMD partitioning runs; the module after the call inliner is the
        # same stage (calls inlined, their op_names whole; XLA:CPU's fusions and scatter
        # expansion still to come)
        stage = "call-inliner" if len(devices) == 1 else "spmd-partitioning"
        options = {"xla_dump_to": dump, **TARGET_DUMP_OPTIONS} if final_hlo else {
            "xla_dump_to": dump, "xla_dump_hlo_pass_re": stage,
            **(CPU_ANALYSIS_OPTIONS if fast_cpu else {})}
        name = compile_cache.key(lowered.as_text(debug_info=True), options, devices, final_hlo) \
            if devices and compile_cache.folder() else ""
        entry = compile_cache.load(name) if name else None
        if entry is not None:
            timings["compile_s"] = time.perf_counter() - t1
            return Compiled(entry["hlo_text"], None, timings, entry["warnings"],
                            entry["memory"], cached=True)
        try:
            compiled = lowered.compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as e:
            first = str(e).strip().splitlines()[0]
            if "RESOURCE_EXHAUSTED" in first:
                raise DoesNotFit(f"the program does not fit: "
                                 f"{first.split(': ', 1)[-1]}") from None
            raise
        timings["compile_s"] = time.perf_counter() - t1
        files = sorted(glob.glob(os.path.join(dump, f"*after_{stage}*.txt")))
        if files and not final_hlo:
            with open(files[-1] if stage == "spmd-partitioning" else files[0]) as f:
                text = f.read()
        else:
            text = compiled.as_text()
        stats = memory_stats(compiled, dump if final_hlo else "")
    out = Compiled(text, compiled, timings, xla_warnings(err), stats)
    if name:
        compile_cache.store(name, {"hlo_text": out.hlo_text, "memory": out.memory_stats,
                                   "warnings": out.warnings})
    return out


BACKENDS = ("auto", "cpu", "tpu", "gpu")
TPU_EXTRA = "pip install 'shardscope[tpu]'  (libtpu matching jax 0.10.2)"
GPU_EXTRA = "pip install 'shardscope[gpu]'  (the CUDA 12 plugin, several GB; make test-gpu)"

# System family -> libtpu topology name prefix.
_TPU_TOPOLOGY = {"tpu-v4": "v4", "tpu-v5e": "v5e", "tpu-v5p": "v5p", "tpu-v6e": "v6e",
                 "tpu7x": "tpu7x"}
# libtpu's "default" v4 chip shows its two TensorCores as two devices; the catalog's v4 is
# a megacore chip, one device (reference/hardware.md), as v5p's default already is.
_TPU_CHIP_CONFIG = {"tpu-v4": "megacore"}


def tpu_compiler_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def gpu_compiler_installed() -> bool:
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


def is_tpu(system: System) -> bool:
    """A system the TPU compiler builds for (a torus family whose compiler is libtpu)."""
    return isinstance(system, TpuSystem) and system.family.compiler == "tpu"


def _is_gpu(system: System) -> bool:
    return isinstance(system, GpuSystem)


def tpu_refusal(system: System) -> str:
    """Why the TPU compiler's program cannot be read for `system` ("" when it can): libtpu
    builds several slices as one program per slice, its DCN collectives as host transfers
    (send/recv to the megascale runtime) whose bytes and groups the HLO reader does not
    take."""
    if not isinstance(system, TpuSystem) or system.num_slices == 1:
        return ""
    one = system.name.split("*")[0]
    return (f"the TPU compiler builds {system.name} as one program per slice, its DCN "
            f"collectives as host transfers that shardscope does not read; use --backend cpu "
            f"for all {system.num_slices} slices, or --backend tpu on one slice ({one})")


@dataclasses.dataclass(frozen=True)
class RealCompiler:
    """A deviceless compiler for a kind of system: which systems it builds for, whether its
    extra is installed, how to install it, its name in words, and its devices."""

    label: str
    builds_for: Callable[[System], bool]
    installed: Callable[[], bool]
    package: str
    install: str
    name: Callable[[System | None], str]
    devices: Callable[[System], list]
    # Why it cannot compile a system it builds for ("" when it can).
    refusal: Callable[[System], str] = lambda s: ""

    def compiles(self, system: System) -> bool:
        """Whether it builds for `system`, is installed and does not refuse it."""
        return self.builds_for(system) and self.installed() and not self.refusal(system)


# backend -> its compiler (the CPU path, on fake devices, is the default and not listed).
# `installed` looks the check up when called, so that a test can pretend an extra is absent.
REAL_COMPILERS: dict[str, RealCompiler] = {
    "tpu": RealCompiler(
        "the TPU compiler", is_tpu, lambda: tpu_compiler_installed(), "libtpu", TPU_EXTRA,
        lambda s: "the TPU compiler (libtpu, deviceless"
                  + (f" {topology_name(s)})" if isinstance(s, TpuSystem) else ")"),
        lambda s: tpu_devices(s), tpu_refusal),
    "gpu": RealCompiler(
        "XLA:GPU", _is_gpu, lambda: gpu_compiler_installed(), "the CUDA plugin", GPU_EXTRA,
        lambda s: "XLA:GPU (CUDA plugin, deviceless"
                  + (f" {s.chip.name} x {gpu_topology_name(s)})" if isinstance(s, GpuSystem)
                     else ")"),
        lambda s: gpu_devices(s)),
}
CPU_COMPILER = "XLA:CPU (after SPMD partitioning)"


def resolve_backend(backend: str, system: System) -> str:
    """The backend that will compile, or a ValueError with the way out."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return next((name for name, c in REAL_COMPILERS.items() if c.compiles(system)),
                    "cpu")
    real = REAL_COMPILERS.get(backend)
    if real is not None:
        if not real.builds_for(system):
            # the CPU path, and the compilers that build for this system (none for trn2)
            others = ["cpu", *(b for b, c in REAL_COMPILERS.items() if c.builds_for(system))]
            raise ValueError(f"backend {backend!r} compiles for {backend.upper()} systems; "
                             f"{system.name} is not one; choose "
                             f"{' or '.join(map(repr, others))}")
        if real.refusal(system):
            raise ValueError(f"backend {backend!r}: {real.refusal(system)}")
        if not real.installed():
            raise ValueError(f"backend {backend!r} needs {real.package}: {real.install}")
    return backend


def available_backends(system: System) -> list[str]:
    """The backends that can compile for `system` here: XLA:CPU always, and the system's
    own compiler when its extra is installed."""
    return ["cpu", *(name for name, c in REAL_COMPILERS.items() if c.compiles(system))]


def own_compiler(system: System) -> RealCompiler | None:
    """The system's own deviceless compiler, installed or not (None: it has none)."""
    return next((c for c in REAL_COMPILERS.values() if c.builds_for(system)), None)


def target_compiler_note(backend: str, system: System) -> str:
    """Why an XLA:CPU estimate of a TPU or GPU system may differ from the target compiler's
    ("" when the target compiler made the HLO)."""
    if isinstance(system, TpuSystem) and not system.family.compiler and backend == "cpu":
        return ("no deviceless compiler for this chip is here (the Neuron compiler needs "
                "Neuron devices): XLA:CPU's program, whose partitioning is XLA's, with "
                "kernels and fusions modelled as for other chips")
    own = own_compiler(system)
    if backend != "cpu" or own is None:
        return ""
    how = "" if own.installed() else f" (to compare: {own.install})"
    return (f"not {own.label}: XLA:CPU's partitioning is the same, but its fusions, layouts "
            f"and memory-bound kernels are not, so compute time and HBM traffic may differ"
            f"{how}")


def backend_of(device) -> str:
    """The backend a JAX device compiles with: "cpu", "tpu" or "gpu"."""
    platform = getattr(device, "platform", "cpu")
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def compiler_name(backend: str, system: System | None = None) -> str:
    """The compiler that makes a backend's HLO, in words, as reports show it: the one
    place it is named."""
    real = REAL_COMPILERS.get(backend)
    return CPU_COMPILER if real is None else real.name(system)


@dataclasses.dataclass(frozen=True)
class Target:
    """What compiles a system's program: the backend, the devices it compiles for (None:
    fake CPU devices), the compiler's name and why it may not be the system's own."""

    backend: str
    devices: list | None
    compiler: str
    note: str = ""


def target(backend: str, system: System) -> Target:
    """The compiler for `system` on `backend` ("auto" resolved), or a ValueError with the
    way out."""
    resolved = resolve_backend(backend, system)
    real = REAL_COMPILERS.get(resolved)
    return Target(resolved, None if real is None else real.devices(system),
                  compiler_name(resolved, system), target_compiler_note(resolved, system))


def gpu_target_config(system: GpuSystem) -> str:
    """The GpuTargetConfig text proto for the system's GPU, from the catalog."""
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
    per_domain = min(system.num_devices, system.domain_size)
    per_host = min(per_domain, f.tray_size)
    return f"{system.num_devices // per_domain}x{per_domain // per_host}x{per_host}"


def gpu_devices(system: GpuSystem) -> list:
    """Compile-only XLA:GPU devices for the system, in its device-id order."""
    from jax._src import xla_bridge

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

    # A host holds 2 x 2 x 1 chips; a slice smaller than that (a single chip, 1x2) is one
    # host of its own size.
    dims = [*system.shape, 1, 1, 1][:3]
    per_host = tuple(min(h, d) for h, d in zip((2, 2, 1), dims))
    with capture_stderr():  # libtpu warns about TPU env vars it does not need here
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=topology_name(system),
            chip_config_name=_TPU_CHIP_CONFIG.get(system.family.name, "default"),
            chips_per_host_bounds=per_host, num_slices=system.num_slices)
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
