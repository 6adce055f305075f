"""`host-cpu:N`: this machine's CPU as N fake XLA devices, timed from a microbenchmark.

On a machine without accelerators `shardscope measure` runs a config's step on N fake CPU
devices (`jax_num_cpu_devices`), and estimates it on this system so that the whole loop
(estimate, measure, compare, calibrate) is real here. What the fake devices really do:
they are N executors in one process that share the host's cores and memory bus, and a
sharded step synchronises them at every collective. The profiler shows them taking turns:
a device runs its kernels with the host to itself (its matmuls reach the one-device rate)
while the others wait in the next collective, so a step takes about N times one device's
work at the host's rate. Each device's share is therefore the host's rate, measured on one
device with all of its cores, divided by N. A collective between fake devices is memcpy
between buffers of one process: it moves at the host's copy rate, shared the same way.

The rates are measured once per device count (a second or two: `benchmark`) and kept with
the date and the host in `$XDG_CACHE_HOME/shardscope/host-cpu.json`
(`~/.cache/shardscope/` by default); `refresh=True` measures again.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from meshes.chips import Chip
from meshes.interpolate import log_interp
from meshes.links import Link
from meshes.system import CollectiveTiming, System, bus_factor

FAMILY = "host-cpu"
CACHE_NAME = "host-cpu.json"
# The matmuls the benchmark times, as a model's projections are: MATMUL_ROWS tokens times
# a weight of each width (the curve of rate against cube-equivalent size (M*K*N)^(1/3);
# the tiny configs' matmuls are ~100-300), and the copy it times for the memory bandwidth.
MATMUL_ROWS = 2048
MATMUL_WIDTHS = (16, 64, 512)
MATMUL_DTYPES = ("bfloat16", "float32")
COPY_BYTES = 256 * 2**20  # beyond the last-level cache
OVERHEAD_CHAIN = 100
_BENCH_SECONDS = 0.05  # per point: repeats until this long, the fastest repeat kept


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostRates:
    """What the benchmark measured on this host: each of `devices` fake devices' share.

    Attributes:
        matmul_flops_per_s: dtype -> ((size, FLOP/s), ...) for square matmuls.
        memory_bytes_per_s: read + write bytes per second of a large elementwise kernel.
        kernel_overhead_s: fixed time per kernel: a chain of small kernels, per kernel (under
            a microsecond on XLA:CPU, where a GPU's launch is several).
        memory_bytes: the host's RAM.
        devices: the fake devices that share the host (the N of host-cpu:N).
        cores: os.cpu_count().
        host: the host's name; date: when it was measured; jax_version: who ran it.
    """

    matmul_flops_per_s: dict[str, tuple[tuple[int, float], ...]]
    memory_bytes_per_s: float
    kernel_overhead_s: float
    memory_bytes: float
    devices: int
    cores: int
    host: str
    date: str
    jax_version: str

    def peak(self, dtype: str) -> float:
        return max(r for _, r in self.matmul_flops_per_s[dtype])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["matmul_flops_per_s"] = {k: [list(p) for p in v]
                                   for k, v in self.matmul_flops_per_s.items()}
        return d

    @staticmethod
    def from_dict(d: dict) -> HostRates:
        curves = {k: tuple((int(s), float(r)) for s, r in v)
                  for k, v in d["matmul_flops_per_s"].items()}
        return HostRates(**{**d, "matmul_flops_per_s": curves})


def cache_path() -> Path:
    """Where the measured rates are kept: the user's cache folder."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "shardscope" / CACHE_NAME


def read_cache() -> dict:
    """The cache file's contents for this host ({} when it has none)."""
    try:
        d = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) and d.get("host") == socket.gethostname() else {}


def cached_rates(devices: int) -> HostRates | None:
    """This host's rates for `devices` fake devices from the cache, None when it has none."""
    entry = read_cache().get("rates", {}).get(str(devices))
    try:
        return HostRates.from_dict(entry) if entry else None
    except (KeyError, TypeError, ValueError):
        return None


def host_rates(devices: int, *, refresh: bool = False, write_cache: bool = True
               ) -> HostRates:
    """This host's rates per device for `devices` fake devices: cached, or measured now
    (and cached, unless `write_cache` is False: a process that shares the host with others
    at work). Asks JAX for that many CPU devices first when its backend is not up."""
    rates = None if refresh else cached_rates(devices)
    if rates is None:
        rates = benchmark(devices)
        if not write_cache:
            return rates
        cache = read_cache() or {"host": rates.host, "rates": {}}
        cache["rates"][str(devices)] = rates.to_dict()
        try:
            cache_path().parent.mkdir(parents=True, exist_ok=True)
            cache_path().write_text(json.dumps(cache, indent=1) + "\n")
        except OSError:
            pass  # a read-only home: measured again next time
    return rates


def _best_time(fn, *args, chain: bool = False) -> float:
    """The fastest of repeated calls (for at least _BENCH_SECONDS); `chain`: each call takes
    the previous call's output (a function of one argument that donates it)."""
    out = fn(*args).block_until_ready()  # compiled and warm
    best, spent = float("inf"), 0.0
    while spent < _BENCH_SECONDS:
        args = (out,) if chain else args
        t0 = time.perf_counter()
        out = fn(*args).block_until_ready()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def benchmark(devices: int) -> HostRates:
    """Time XLA:CPU's matmuls (bf16 and f32, as the CPU runs them) and a large copy on one
    device with all of the host's cores (about a second), each rate divided by `devices`:
    the share of each of that many fake devices taking turns on the host."""
    import jax
    import jax.numpy as jnp

    try:
        if devices > int(jax.config.jax_num_cpu_devices):
            jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:
        pass  # the backend is up already: its device count is what it is
    # this process's own (with jax.distributed, jax.devices() holds the others' too)
    device = jax.local_devices(backend="cpu")[0]

    def array(shape, dtype):
        return jax.device_put(jnp.ones(shape, dtype), device)

    curves = {}
    for dtype in MATMUL_DTYPES:
        points = []
        for n in MATMUL_WIDTHS:
            t = _best_time(jax.jit(lambda x, w: x @ w), array((MATMUL_ROWS, n), dtype),
                           array((n, n), dtype))
            flops = 2 * MATMUL_ROWS * n * n
            points.append((round((flops / 2) ** (1 / 3)), flops / t / devices))
        curves[dtype] = tuple(points)
    # in place (the input donated): a kernel's streaming rate. A fresh output buffer per
    # call would time the kernel's page faults on it (1 to 7 GB/s from one run to the
    # next on a VM, where the same kernel in place streams at 50)
    scale = jax.jit(lambda v: v * 1.5, donate_argnums=0)
    t = _best_time(scale, array((COPY_BYTES // 4,), jnp.float32), chain=True)
    # a chain of small kernels, two a link as the cost model counts them (a reduction, then
    # the elementwise kernel that takes it), on data too small to take time of its own
    def chain(x):
        for _ in range(OVERHEAD_CHAIN):
            x = x * 1.5 + jnp.max(x)
        return x
    overhead = _best_time(jax.jit(chain), array((256,), jnp.float32)) / (2 * OVERHEAD_CHAIN)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * 2**30
    return HostRates(matmul_flops_per_s=curves,
                     memory_bytes_per_s=2 * COPY_BYTES / t / devices,
                     kernel_overhead_s=overhead * devices,
                     memory_bytes=float(ram), devices=devices, cores=os.cpu_count() or 1,
                     host=socket.gethostname(), date=datetime.date.today().isoformat(),
                     jax_version=jax.__version__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostChip(Chip):
    """One fake device's share of the host: peak = the benchmark's best rate, and the
    measured curve of rate against matmul size in place of a GPU's or TPU's."""

    size_points: dict[str, tuple[tuple[int, float], ...]] = dataclasses.field(
        default_factory=dict)
    rates_measured_here: bool = True

    def efficiency_for(self, dtype: str, size: float | None = None) -> float:
        curve = self.size_points.get(dtype) or self.size_points.get("float32")
        if size is None or not curve:
            return 1.0
        sizes, rates = zip(*curve)
        return log_interp(sizes, rates, size) / max(rates)


@dataclasses.dataclass(frozen=True)
class HostFamily:
    name: str = FAMILY


class HostCpuSystem(System):
    """N fake CPU devices of this host sharing its cores, memory and copy bandwidth."""

    coord_names = ("device",)

    def __init__(self, num_devices: int, rates: HostRates):
        n = num_devices
        self.name = f"{FAMILY}:{n}"
        self.family = HostFamily()
        self.num_devices = n
        self.rates = rates
        source = (f"measured on {rates.host} on {rates.date}, one device's rate / {n} "
                  f"(jax {rates.jax_version}, {rates.cores} cores; {cache_path()})")
        self.chip = HostChip(
            name=FAMILY, tdp_w=None, matmul_efficiency=1.0, hbm_efficiency=1.0,
            peak_flops_per_s={d: rates.peak(d) for d in rates.matmul_flops_per_s},
            # the measured rates are achieved ones: the calibration's GPU and TPU
            # efficiencies do not apply to them (rate class "host")
            low_precision_efficiency={d: 1.0 for d in rates.matmul_flops_per_s},
            hbm_bytes=rates.memory_bytes / n, hbm_bytes_per_s=rates.memory_bytes_per_s,
            kernel_overhead_s=rates.kernel_overhead_s,
            size_points=rates.matmul_flops_per_s, source=source)
        self.links = {"memcpy": Link(
            name="memcpy", bytes_per_s=rates.memory_bytes_per_s, latency_s=0.0,
            efficiency=1.0, source=f"the host's copy rate / {n} (memcpy between the fake "
                                   f"devices' buffers); {source}")}

    def coords(self, device_id: int) -> tuple[int, ...]:
        return (device_id,)

    def _check_ids(self, ids: Sequence[int]) -> None:
        """Any id: in several processes (jax.distributed) JAX numbers a process's CPU
        devices from 2048 x its index, and every one of them is one of the host's."""

    def collective_timing(self, kind: str, nbytes: float, groups: Sequence[Sequence[int]]
                          ) -> CollectiveTiming:
        """Every device copies its bus-factor share of the buffer at the same time, each
        at its share of the host's copy rate."""
        n = max((len(g) for g in groups), default=1)
        link = self.links["memcpy"]
        return CollectiveTiming(bus_factor(kind, n) * nbytes / link.bytes_per_s, "memcpy",
                                "memcpy")

    def describe(self) -> list[tuple[str, str]]:
        r = self.rates
        rates = ", ".join(f"{r.peak(d) / 1e9:.1f} GFLOP/s {d}" for d in r.matmul_flops_per_s)
        return [("devices", f"{self.num_devices} fake CPU devices sharing {r.cores} cores "
                            f"({platform.machine()})"),
                ("device", f"{rates}, memory {r.memory_bytes_per_s / 1e9:.2f} GB/s, "
                           f"{r.kernel_overhead_s * 1e9:.0f} ns per kernel "
                           f"[{self.chip.source}]")]


def host_system(size: str, name: str) -> HostCpuSystem:
    """`host-cpu:N` with this host's rates (measured now when none are cached)."""
    if not size.isdigit() or int(size) < 1:
        raise ValueError(f"system {name!r}: size {size!r} must be a count of fake CPU "
                         f"devices, e.g. {FAMILY}:8")
    return HostCpuSystem(int(size), host_rates(int(size)))
