"""Systems: chips joined by links, the physical place of every device id, collective timing.

Names follow `<family>:<size>` (design.md): `gb200-nvl72:72`, `h100:64`, `tpu-v5e:16x16`,
`tpu-v6e:16x16*2` (two slices over DCN).

Device id order (the order the fake CPU mesh and the reports use):
- GPUs: rack-major / node-major. An NVL72 rack holds 72 consecutive ids, a compute tray 4;
  an HGX node 8.
- TPUs: slice-major, then z, then y, then x (x fastest), then TensorCore within the chip
  (TPU7x shows 2 devices per chip). This is the order `jax.devices()` reports on a TPU
  slice for the topologies used here; the deviceless compiler's own coords take
  precedence when the issue that compiles for TPUs lands.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import math
import re
from collections.abc import Sequence

from meshes.chips import CHIPS, Chip
from meshes.links import (
    NCCL_BASE_LATENCY_US,
    NCCL_HW_LATENCY_US,
    NCCL_PROTOCOL_BANDWIDTH_SHARE,
    NCCL_PROTOCOLS,
    NCCL_TREE_BANDWIDTH_SHARE,
    GB200_4GPU_RING,
    GB200_72GPU,
    H100_NVLS_ALL_REDUCE,
    H100_RING_BUSBW_CAP,
    TPU_ICI_EFFICIENCY,
    TPU_ICI_HOP_LATENCY_S,
    BusBandwidthCurve,
    Link,
)

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)


@dataclasses.dataclass(frozen=True)
class CollectiveTiming:
    """How long one collective takes and on what.

    Attributes:
        time_s: wall time of one execution.
        link: the link class of the slowest stage ("nvlink", "infiniband", "ici", "dcn").
        algorithm: the algorithm assumed, e.g. "ring", "nvls", "hierarchical ring".
    """

    time_s: float
    link: str
    algorithm: str


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: bytes each device moves per byte of S."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind in ("collective-permute", "collective-broadcast"):
        return 1.0
    return (n - 1) / n


class System(abc.ABC):
    """A machine: `num_devices` devices of one `chip`, with links between them."""

    name: str
    family: str
    chip: Chip
    num_devices: int
    links: dict[str, Link]

    @abc.abstractmethod
    def coords(self, device_id: int) -> tuple[int, ...]:
        """Physical coordinates of a device id (see `coord_names`)."""

    def place(self, device_id: int) -> dict[str, int]:
        """Named physical place of a device, e.g. {"rack": 0, "tray": 3, "gpu": 1}."""
        return dict(zip(self.coord_names, self.coords(device_id), strict=True))

    coord_names: tuple[str, ...] = ()

    def _check_ids(self, ids: Sequence[int]) -> None:
        for i in ids:
            if not 0 <= i < self.num_devices:
                raise ValueError(
                    f"device id {i} is outside system {self.name!r}, which has device ids "
                    f"0..{self.num_devices - 1}; use a system with more devices or fix the "
                    f"replica groups"
                )

    @abc.abstractmethod
    def collective_timing(
        self, kind: str, nbytes: float, groups: Sequence[Sequence[int]]
    ) -> CollectiveTiming:
        """Time, link class and algorithm of one collective over concurrent `groups`."""

    def collective_time_s(
        self, kind: str, nbytes: float, groups: Sequence[Sequence[int]]
    ) -> float:
        """Seconds for one collective of `kind` with buffer `nbytes` (design.md byte
        convention) over replica `groups` of device ids running at the same time."""
        return self.collective_timing(kind, nbytes, groups).time_s

    def describe(self) -> list[tuple[str, str]]:
        """(field, value with source) rows for `shardscope systems`."""
        c = self.chip
        rows = [
            ("devices", f"{self.num_devices} ({c.devices_per_chip} per chip)"),
            ("chip", f"{c.name}: {c.peak_flops_per_s['bfloat16'] / 1e12:.0f} TFLOP/s bf16, "
                     f"{c.hbm_bytes / 1e9:.0f} GB HBM at {c.hbm_bytes_per_s / 1e12:.2f} TB/s "
                     f"[{c.source}]"),
        ]
        for link in self.links.values():
            rows.append((link.name, f"{link.bytes_per_s / 1e9:.1f} GB/s per device per "
                                     f"direction [{link.source}]"))
        return rows


# ---------------------------------------------------------------------------------------
# GPU systems: NVLink domains joined by a rail-optimised scale-out fabric.


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuFamily:
    name: str
    chip: str
    domain_size: int  # GPUs in one NVLink domain (HGX node: 8; NVL72 rack: 72)
    tray_size: int  # GPUs per board/tray, for placement only
    nvlink_bytes_per_s: float
    nvlink_source: str
    nic_bytes_per_s: float
    nic_source: str
    # all-reduce busbw inside a domain; small groups (<= 8) and whole-domain groups differ
    small_group_curve: BusBandwidthCurve
    large_group_curve: BusBandwidthCurve | None
    ring_cap_bytes_per_s: float  # busbw ceiling without in-switch reduction
    has_nvls: bool


_H100_RING = H100_NVLS_ALL_REDUCE.capped(
    H100_RING_BUSBW_CAP, "8x H100 NVLS curve capped at the ring plateau (nccl#1455)"
)

GPU_FAMILIES: dict[str, GpuFamily] = {
    "a100": GpuFamily(
        name="a100", chip="a100", domain_size=8, tray_size=8,
        nvlink_bytes_per_s=300e9, nvlink_source="NVLink3, 12 links (A100 datasheet)",
        nic_bytes_per_s=25e9, nic_source="200 Gb/s HDR per GPU (Megatron-LM, Selene)",
        # No measured A100 table in the reference: the H100 ring curve scaled by the link
        # ratio 300/450. NVLS does not exist on A100.
        small_group_curve=_H100_RING.scaled(300 / 450, "H100 ring curve x 300/450"),
        large_group_curve=None, ring_cap_bytes_per_s=H100_RING_BUSBW_CAP * 300 / 450,
        has_nvls=False,
    ),
    "h100": GpuFamily(
        name="h100", chip="h100", domain_size=8, tray_size=8,
        nvlink_bytes_per_s=450e9, nvlink_source="NVLink4, 18 x 25 GB/s (scaling book gpus.md)",
        nic_bytes_per_s=50e9, nic_source="400 Gb/s CX-7 NDR per GPU (H100 datasheet)",
        small_group_curve=H100_NVLS_ALL_REDUCE, large_group_curve=None,
        ring_cap_bytes_per_s=H100_RING_BUSBW_CAP, has_nvls=True,
    ),
    "h200": GpuFamily(
        name="h200", chip="h200", domain_size=8, tray_size=8,
        nvlink_bytes_per_s=450e9, nvlink_source="NVLink4, 18 x 25 GB/s (H200 datasheet)",
        nic_bytes_per_s=50e9, nic_source="400 Gb/s per GPU (H200 datasheet)",
        small_group_curve=H100_NVLS_ALL_REDUCE, large_group_curve=None,
        ring_cap_bytes_per_s=H100_RING_BUSBW_CAP, has_nvls=True,
    ),
    "b200": GpuFamily(
        name="b200", chip="b200", domain_size=8, tray_size=8,
        nvlink_bytes_per_s=900e9, nvlink_source="NVLink5, 18 x 50 GB/s (scaling book gpus.md)",
        nic_bytes_per_s=50e9, nic_source="400 Gb/s CX-7 per GPU (glennklockwood.com)",
        # Same NVLink5 per-GPU port as GB200: the measured 4-GPU GB200 ring curve.
        small_group_curve=GB200_4GPU_RING, large_group_curve=None,
        ring_cap_bytes_per_s=GB200_4GPU_RING.busbw_bytes_per_s[-1], has_nvls=True,
    ),
    "gb200-nvl72": GpuFamily(
        name="gb200-nvl72", chip="gb200", domain_size=72, tray_size=4,
        nvlink_bytes_per_s=900e9, nvlink_source="NVLink5, 72-GPU domain (GB200 NVL72 datasheet)",
        nic_bytes_per_s=50e9, nic_source="4x CX-7 400G per 4-GPU tray (MLPerf v5.1 system JSON)",
        small_group_curve=GB200_4GPU_RING, large_group_curve=GB200_72GPU,
        ring_cap_bytes_per_s=GB200_4GPU_RING.busbw_bytes_per_s[-1], has_nvls=True,
    ),
    "gb300-nvl72": GpuFamily(
        name="gb300-nvl72", chip="gb300", domain_size=72, tray_size=4,
        nvlink_bytes_per_s=900e9, nvlink_source="NVLink5, 72-GPU domain (GB300 NVL72 datasheet)",
        nic_bytes_per_s=100e9, nic_source="4x CX-8 800G per 4-GPU tray (MLPerf v5.1 system JSON)",
        small_group_curve=GB200_4GPU_RING, large_group_curve=GB200_72GPU,
        ring_cap_bytes_per_s=GB200_4GPU_RING.busbw_bytes_per_s[-1], has_nvls=True,
    ),
}

# The scaling book (gpus.md): across nodes, "in practice" a collective runs at about the
# per-GPU node egress bandwidth. No measured InfiniBand busbw table is in the reference yet,
# so the NIC runs at its nominal rate; the topology issue replaces this with measurements.
NIC_EFFICIENCY = 1.0
# NVLink collective-permute (point to point) at the ring plateau's share of the port rate.
_NVLINK_P2P_EFFICIENCY = H100_RING_BUSBW_CAP / 450e9


class GpuSystem(System):
    """GPUs in NVLink domains of `family.domain_size`, domains joined by one NIC per GPU."""

    def __init__(self, family: GpuFamily, num_devices: int):
        self.family = family
        self.name = f"{family.name}:{num_devices}"
        self.chip = CHIPS[family.chip]
        self.num_devices = num_devices
        domain = "rack" if family.domain_size > 8 else "node"
        self.coord_names = (domain, "tray", "gpu") if family.tray_size < family.domain_size else (
            domain, "gpu")
        self.links = {
            "nvlink": Link(name="nvlink", bytes_per_s=family.nvlink_bytes_per_s,
                           latency_s=0.0, efficiency=_NVLINK_P2P_EFFICIENCY,
                           source=family.nvlink_source),
            "infiniband": Link(name="infiniband", bytes_per_s=family.nic_bytes_per_s,
                               latency_s=0.0, efficiency=NIC_EFFICIENCY,
                               source=family.nic_source),
        }

    def coords(self, device_id: int) -> tuple[int, ...]:
        self._check_ids([device_id])
        f = self.family
        domain, local = divmod(device_id, f.domain_size)
        if len(self.coord_names) == 2:
            return (domain, local)
        return (domain, local // f.tray_size, local % f.tray_size)

    def domain_of(self, device_id: int) -> int:
        return device_id // self.family.domain_size

    def _domain_busbw(self, kind: str, nbytes: float, n: int) -> tuple[float, str]:
        f = self.family
        curve = f.small_group_curve
        if n > 8 and f.large_group_curve is not None and nbytes >= f.large_group_curve.sizes_bytes[0]:
            curve = f.large_group_curve
        busbw = curve(nbytes)
        if kind == "all-reduce" and f.has_nvls:
            return busbw, "nvls" if curve is H100_NVLS_ALL_REDUCE else "ring"
        return min(busbw, f.ring_cap_bytes_per_s), "ring"

    def _in_domain_time(
        self, kind: str, nbytes: float, n: int, *, latency_floor: bool = True
    ) -> tuple[float, str]:
        if n <= 1 or nbytes <= 0:
            return 0.0, "none"
        if kind in ("collective-permute", "collective-broadcast"):
            link = self.links["nvlink"]
            return nbytes / (link.bytes_per_s * link.efficiency), "p2p"
        busbw, algo = self._domain_busbw(kind, nbytes, n)
        t = nbytes * bus_factor(kind, n) / busbw
        # Below the smallest measured size the curve keeps the 1 MB bandwidth; NCCL's LL
        # ring latency is the floor a tiny collective cannot beat.
        steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
        floor = 1e-6 * (NCCL_BASE_LATENCY_US[("ring", "LL")]
                        + steps * NCCL_HW_LATENCY_US["nvlink"][("ring", "LL")])
        if latency_floor and floor > t:
            return floor, "ring (LL, latency-bound)"
        return t, algo

    def collective_timing(self, kind, nbytes, groups):
        if not groups:
            return CollectiveTiming(0.0, "nvlink", "none")
        flat = [i for g in groups for i in g]
        self._check_ids(flat)
        # Every group runs at once; with one NIC and one NVLink port per GPU, groups of the
        # same shape do not share links, so the slowest group sets the time.
        worst = CollectiveTiming(0.0, "nvlink", "none")
        for g in _distinct_shapes(groups, self.domain_of):
            t = self._group_timing(kind, nbytes, g)
            if t.time_s > worst.time_s:
                worst = t
        return worst

    def _group_timing(self, kind: str, nbytes: float, group: Sequence[int]) -> CollectiveTiming:
        n = len(group)
        per_domain: dict[int, int] = {}
        for i in group:
            per_domain[self.domain_of(i)] = per_domain.get(self.domain_of(i), 0) + 1
        d = len(per_domain)
        m = max(per_domain.values())
        if d == 1:
            t, algo = self._in_domain_time(kind, nbytes, n)
            return CollectiveTiming(t, "nvlink", algo)
        nic = self.links["infiniband"]
        nic_bw = nic.bytes_per_s * nic.efficiency
        if kind in ("collective-permute", "collective-broadcast"):
            return CollectiveTiming(nbytes / nic_bw, "infiniband", "p2p")
        if kind == "all-to-all":
            # Each GPU sends (n - m)/n of its buffer to other domains through its own NIC.
            t_out = nbytes * (n - m) / n / nic_bw
            t_in, _ = self._in_domain_time(kind, nbytes * m / n, m)
            return CollectiveTiming(t_out + t_in, "infiniband", "hierarchical all-to-all")
        # Hierarchical as NCCL does: reduce-scatter (or gather) inside the domain, the
        # collective across domains on 1/m of the data per GPU (each GPU on its own rail),
        # then all-gather inside the domain. Ring or tree, LL or Simple: the fastest wins,
        # with NCCL's own latencies.
        inner_kind = "reduce-scatter" if kind in ("all-reduce", "reduce-scatter") else "all-gather"
        # (The inner stages' latency is inside NCCL's whole-collective latency below.)
        t_inner, _ = self._in_domain_time(inner_kind, nbytes, m, latency_floor=False)
        if kind == "all-reduce":
            t_inner *= 2  # reduce-scatter before, all-gather after
        t_outer = (nbytes / m) * bus_factor(kind, d) / nic_bw
        best = None
        algos = ("ring", "tree") if kind == "all-reduce" else ("ring",)
        for algo in algos:
            for proto in NCCL_PROTOCOLS:
                share = NCCL_PROTOCOL_BANDWIDTH_SHARE[(algo, proto)]
                if algo == "tree":
                    share *= NCCL_TREE_BANDWIDTH_SHARE
                t = t_inner + t_outer / share + _nccl_latency_s(kind, algo, proto, n, d, m)
                if best is None or t < best[0]:
                    best = (t, algo, proto)
        t, algo, proto = best
        name = f"hierarchical {algo} ({proto})" if m > 1 else f"{algo} ({proto})"
        return CollectiveTiming(t, "infiniband", name)


def _nccl_latency_s(kind: str, algo: str, proto: str, n: int, nodes: int, ppn: int) -> float:
    """NCCL's latency model (tuning.cc) for n ranks on `nodes` domains of `ppn` GPUs."""
    base = NCCL_BASE_LATENCY_US[(algo, proto)]
    intra = NCCL_HW_LATENCY_US["nvlink"][(algo, proto)] * (1.8 if proto == "LL" else 1.0)
    inter = NCCL_HW_LATENCY_US["net"][(algo, proto)]
    if algo == "tree":
        return 1e-6 * (base + 2 * ((ppn - 1) * intra + math.log2(nodes) * inter))
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    inter_steps = 2 * (nodes - 1) if kind == "all-reduce" else nodes - 1
    return 1e-6 * (base + (steps - inter_steps) * intra + inter_steps * inter)


def _distinct_shapes(groups, key):
    """One representative group per distinct placement pattern (count per domain)."""
    seen = {}
    for g in groups:
        counts: dict[int, int] = {}
        for i in g:
            counts[key(i)] = counts.get(key(i), 0) + 1
        sig = (len(g), tuple(sorted(counts.values())))
        seen.setdefault(sig, g)
    return list(seen.values())


# ---------------------------------------------------------------------------------------
# TPU systems: chips on a 2D/3D torus (ICI), slices joined over DCN.


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuFamily:
    name: str
    chip: str
    ndim: int
    max_shape: tuple[int, ...]
    wrap_rule: str  # "cube": wraps every axis once a multiple of 4x4x4; "16": axis of 16
    ici_bytes_per_s: float  # one link, one direction
    dcn_bytes_per_s_per_chip: float
    source: str


TPU_FAMILIES: dict[str, TpuFamily] = {
    "tpu-v4": TpuFamily(name="tpu-v4", chip="tpu-v4", ndim=3, max_shape=(16, 16, 16),
                        wrap_rule="cube", ici_bytes_per_s=4.5e10, dcn_bytes_per_s_per_chip=6.25e9,
                        source="scaling book tpus.md"),
    "tpu-v5e": TpuFamily(name="tpu-v5e", chip="tpu-v5e", ndim=2, max_shape=(16, 16),
                         wrap_rule="16", ici_bytes_per_s=4.5e10, dcn_bytes_per_s_per_chip=3.125e9,
                         source="scaling book tpus.md"),
    "tpu-v5p": TpuFamily(name="tpu-v5p", chip="tpu-v5p", ndim=3, max_shape=(16, 20, 28),
                         wrap_rule="cube", ici_bytes_per_s=9.0e10, dcn_bytes_per_s_per_chip=6.25e9,
                         source="scaling book tpus.md"),
    "tpu-v6e": TpuFamily(name="tpu-v6e", chip="tpu-v6e", ndim=2, max_shape=(16, 16),
                         wrap_rule="16", ici_bytes_per_s=9.0e10, dcn_bytes_per_s_per_chip=1.25e10,
                         source="scaling book tpus.md"),
    "tpu7x": TpuFamily(name="tpu7x", chip="tpu7x", ndim=3, max_shape=(16, 24, 24),
                       wrap_rule="cube", ici_bytes_per_s=9.0e10, dcn_bytes_per_s_per_chip=1.25e10,
                       source="scaling book tpus.md; MaxText accelerator_to_spec_map.py"),
}


class TpuSystem(System):
    """`num_slices` TPU slices of torus `shape`, joined over DCN."""

    def __init__(self, family: TpuFamily, shape: tuple[int, ...], num_slices: int):
        self.family = family
        self.shape = shape
        self.num_slices = num_slices
        self.chip = CHIPS[family.chip]
        dims = "x".join(str(s) for s in shape)
        self.name = f"{family.name}:{dims}" + (f"*{num_slices}" if num_slices > 1 else "")
        self.num_chips = math.prod(shape) * num_slices
        self.num_devices = self.num_chips * self.chip.devices_per_chip
        self.wraps = tuple(self._axis_wraps(a) for a in range(len(shape)))
        axes = "xyz"[: len(shape)]
        self.coord_names = ("slice", *axes, "core")
        wrap_txt = ", ".join(f"{a}:{'wrap' if w else 'no wrap'}" for a, w in zip(axes, self.wraps))
        self.links = {
            "ici": Link(name="ici", bytes_per_s=family.ici_bytes_per_s,
                        latency_s=TPU_ICI_HOP_LATENCY_S, efficiency=TPU_ICI_EFFICIENCY,
                        source=f"{family.source}; per link ({wrap_txt})"),
        }
        if num_slices > 1:
            self.links["dcn"] = Link(name="dcn", bytes_per_s=family.dcn_bytes_per_s_per_chip,
                                     latency_s=0.0, efficiency=1.0, source=family.source)

    def _axis_wraps(self, axis: int) -> bool:
        if self.family.wrap_rule == "16":
            return self.shape[axis] == 16
        # v4/v5p/TPU7x: every axis wraps once the slice is whole 4x4x4 cubes.
        return all(s % 4 == 0 for s in self.shape)

    def coords(self, device_id: int) -> tuple[int, ...]:
        """(slice, x, y[, z], core) of a device id; x is fastest after the core."""
        self._check_ids([device_id])
        chip, core = divmod(device_id, self.chip.devices_per_chip)
        per_slice = math.prod(self.shape)
        slice_, local = divmod(chip, per_slice)
        xyz = []
        for s in self.shape:
            local, c = divmod(local, s)
            xyz.append(c)
        return (slice_, *xyz, core)

    def device_id(self, slice_index: int, xyz, core: int = 0) -> int:
        """Inverse of `coords`: the id of the device at torus position `xyz`."""
        chip = 0
        for c, s in zip(reversed(list(xyz)), reversed(self.shape)):
            chip = chip * s + c
        chip += slice_index * math.prod(self.shape)
        return chip * self.chip.devices_per_chip + core

    def collective_timing(self, kind, nbytes, groups):
        if not groups:
            return CollectiveTiming(0.0, "ici", "none")
        self._check_ids([i for g in groups for i in g])
        if kind == "collective-permute":
            return self._permute_timing(nbytes, groups)
        worst = CollectiveTiming(0.0, "ici", "none")
        for g in groups[:1] if _uniform(groups) else groups:
            t = self._group_timing(kind, nbytes, g, concurrent=len(groups))
            if t.time_s > worst.time_s:
                worst = t
        return worst

    def _group_timing(self, kind, nbytes, group, concurrent):
        n = len(group)
        if n <= 1 or nbytes <= 0:
            return CollectiveTiming(0.0, "ici", "none")
        coords = [self.coords(i) for i in group]
        slices = {c[0] for c in coords}
        if len(slices) > 1:
            m = n // len(slices)
            dcn = self.links["dcn"]
            in_slice = self._ici_time(kind, nbytes, [c for c in coords if c[0] == coords[0][0]])
            t_dcn = (nbytes / max(m, 1)) * bus_factor(kind, len(slices)) / dcn.bytes_per_s
            return CollectiveTiming(in_slice[0] * (2 if kind == "all-reduce" else 1) + t_dcn,
                                    "dcn", "hierarchical")
        t, algo = self._ici_time(kind, nbytes, coords)
        return CollectiveTiming(t, "ici", algo)

    def _ici_time(self, kind: str, nbytes: float, coords) -> tuple[float, str]:
        """Ring collective over the torus axes the group spans."""
        n = len(coords)
        if n <= 1:
            return 0.0, "none"
        chips = {c[1:-1] for c in coords}
        cores_per_chip = n // len(chips)
        link = self.links["ici"]
        bw_total = 0.0
        latency_steps = 0.0
        axes_used = []
        for a in range(len(self.shape)):
            vals = sorted({c[a] for c in chips})
            if len(vals) <= 1:
                continue
            extent = len(vals)
            stride = _stride(vals)
            full_ring = self.wraps[a] and extent * stride == self.shape[a]
            # Both directions of a wrapped ring carry data; an open line gets one way's worth.
            directions = 2 if full_ring else 1
            bw_total += directions * link.bytes_per_s * link.efficiency / stride
            latency_steps = max(latency_steps, (extent / 2 if full_ring else extent - 1) * stride)
            axes_used.append(("xyz"[a], full_ring, stride))
        if bw_total == 0.0:
            return 0.0, "on-chip"
        # Data the chip must send: the per-device factor times the TensorCores on the chip.
        if kind == "all-to-all":
            per_chip = nbytes * cores_per_chip * len(chips) / 4 * (2 if not axes_used[0][1] else 1)
            algo = "all-to-all over bisection"
        else:
            per_chip = nbytes * cores_per_chip * bus_factor(kind, len(chips))
            algo = "bidirectional ring" if all(r for _, r, _ in axes_used) else "ring (no wrap)"
            if kind == "all-reduce":
                latency_steps *= 2
        if len(axes_used) > 1:
            algo = f"{len(axes_used)}-axis torus " + algo
        return latency_steps * link.latency_s + per_chip / bw_total, algo

    def _torus_delta(self, a: int, src: int, dst: int) -> int:
        d = dst - src
        if self.wraps[a]:
            size = self.shape[a]
            d = (d + size // 2) % size - size // 2
        return d

    def _permute_timing(self, nbytes, pairs_as_groups) -> CollectiveTiming:
        """Route every pair dimension-order over the torus; the busiest link sets the time."""
        link = self.links["ici"]
        load: dict[tuple, float] = {}
        max_hops = 0
        cross_slice = False
        for pair in pairs_as_groups:
            src, dst = self.coords(pair[0]), self.coords(pair[1])
            if src[0] != dst[0]:
                cross_slice = True
                continue
            deltas = [self._torus_delta(a, src[1 + a], dst[1 + a]) for a in range(len(self.shape))]
            moving = [a for a, d in enumerate(deltas) if d]
            max_hops = max(max_hops, sum(abs(d) for d in deltas))
            if not moving:
                continue
            # One route per starting axis (rotations of the axis order): the data splits
            # evenly over them, as the scaling book's tpus.md example assumes.
            for r in range(len(moving)):
                order = moving[r:] + moving[:r]
                pos = list(src[1:-1])
                for a in order:
                    step = 1 if deltas[a] > 0 else -1
                    for _ in range(abs(deltas[a])):
                        key = (src[0], a, tuple(pos), step)
                        load[key] = load.get(key, 0.0) + nbytes / len(moving)
                        pos[a] = (pos[a] + step) % self.shape[a]
        t = 0.0
        if load:
            t = max(load.values()) / (link.bytes_per_s * link.efficiency)
            t += max_hops * link.latency_s
        if cross_slice:
            t = max(t, nbytes / self.links["dcn"].bytes_per_s)
            return CollectiveTiming(t, "dcn", "p2p")
        return CollectiveTiming(t, "ici", "p2p (dimension-order routes)")


def _stride(vals: list[int]) -> int:
    gaps = {b - a for a, b in itertools.pairwise(vals)}
    return min(gaps) if gaps else 1


def _uniform(groups) -> bool:
    return len({len(g) for g in groups}) == 1


# ---------------------------------------------------------------------------------------
# Names.

_TOPOLOGY = re.compile(r"^(\d+(?:x\d+)*)(?:\*(\d+))?$")


def system_names() -> list[str]:
    """Families with an example size each, for error messages and `shardscope systems`."""
    examples = {
        "a100": "a100:8", "h100": "h100:64", "h200": "h200:8", "b200": "b200:8",
        "gb200-nvl72": "gb200-nvl72:72", "gb300-nvl72": "gb300-nvl72:72",
        "tpu-v4": "tpu-v4:4x4x4", "tpu-v5e": "tpu-v5e:16x16", "tpu-v5p": "tpu-v5p:8x8x8",
        "tpu-v6e": "tpu-v6e:16x16", "tpu7x": "tpu7x:4x4x4",
    }
    return list(examples.values())


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
