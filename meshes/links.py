"""Link classes and the measured bandwidth curves that time collectives on them.

A collective's achieved bus bandwidth depends on its size: small buffers are latency-bound,
large ones approach the link rate. Where a published nccl-tests table exists (each curve's
`source` names it), the curve *is* that table, interpolated in log(size); nothing is fitted
to end-to-end step times.
"""

from __future__ import annotations

import dataclasses

from meshes.interpolate import log_interp


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """A class of physical link, as seen by one device.

    Attributes:
        name: "nvlink", "infiniband", "ici", "dcn".
        bytes_per_s: nominal bandwidth per device, one direction.
        latency_s: time per algorithm step (per hop on a torus).
        efficiency: achieved / nominal on large transfers where no measured curve applies.
        source: where the numbers come from.
    """

    name: str
    bytes_per_s: float
    latency_s: float
    efficiency: float
    source: str


@dataclasses.dataclass(frozen=True)
class BusBandwidthCurve:
    """Measured bus bandwidth (nccl-tests definition) against buffer size S in bytes."""

    sizes_bytes: tuple[float, ...]
    busbw_bytes_per_s: tuple[float, ...]
    source: str

    def __call__(self, nbytes: float) -> float:
        """Bus bandwidth at `nbytes`, log-linear between points, clamped at both ends.

        Below the smallest measured size the bandwidth of the smallest size is used, so time
        keeps falling with size; the latency floor is added by the caller.
        """
        return log_interp(self.sizes_bytes, self.busbw_bytes_per_s, nbytes)

    def scaled(self, factor: float, source: str) -> BusBandwidthCurve:
        return BusBandwidthCurve(
            self.sizes_bytes, tuple(b * factor for b in self.busbw_bytes_per_s), source
        )

    def capped(self, cap_bytes_per_s: float, source: str) -> BusBandwidthCurve:
        return BusBandwidthCurve(
            self.sizes_bytes, tuple(min(b, cap_bytes_per_s) for b in self.busbw_bytes_per_s), source
        )


_GB = 1e9
_MiB = 2**20

# 8x H100, Azure ND H100 v5, NCCL 2.18.5, NVLS all-reduce, in-place busbw.
H100_NVLS_ALL_REDUCE = BusBandwidthCurve(
    (1e6, 16e6, 67e6, 268e6, 1e9, 8e9),
    (43.7e9, 234.5e9, 361.8e9, 423.4e9, 466.4e9, 478.9e9),
    "nccl-tests all-reduce, 8x H100 NVLS, Azure ND H100 v5 "
    "(Azure/AI-benchmarking-guide, Azure_Results/ND_H100_v5_results.md)",
)
# Ring (no NVLS) on the same node class levels off at 365-370 GB/s (NVIDIA/nccl#1455,
# nccl-tests#212): all-gather, reduce-scatter and non-NVLS all-reduce use this cap.
H100_RING_BUSBW_CAP = 367e9
# NVLS all-reduce peak busbw by the number of GPUs of one H100 / H200 node in the group
# (NVIDIA/nccl#1455, nccl-tests#212): the 8-GPU curve above reaches 480; fewer GPUs drive
# fewer of the switches' ports, and 2 to 4 reach the ring's plateau.
H100_NVLS_PEAK_BY_GPUS = {2: 370e9, 3: 370e9, 4: 370e9, 5: 420e9, 6: 440e9, 7: 460e9, 8: 480e9}
# 4x GB200 in one NVL72 domain, Azure ND GB200 v6, NCCL 2.25.1, ring all-reduce.
GB200_4GPU_RING = BusBandwidthCurve(
    (1e6, 16e6, 67e6, 1e9, 8e9),
    (80.5e9, 331.1e9, 550.7e9, 646.9e9, 679.6e9),
    "nccl-tests all-reduce, 4x GB200 ring, Azure ND GB200 v6 "
    "(Azure/AI-benchmarking-guide, Azure_Results/ND_GB200_v6_results.md)",
)
# One full GB200 NVL72 rack, 72 GPUs, NCCL 2.26.2, out-of-place busbw.
GB200_72GPU = BusBandwidthCurve(
    (512 * _MiB, 1024 * _MiB, 2048 * _MiB, 4096 * _MiB, 8192 * _MiB),
    (586.1e9, 681.2e9, 757.8e9, 839.2e9, 834.6e9),
    "nccl-tests all-reduce, 72x GB200 NVL72 rack, NCCL 2.26.2 "
    "(coreweave/nccl-tests PR #43, 2025-02-20)",
)

# Ring all-reduce bus bandwidth measured across 3 or more nodes, user runs in public NCCL
# threads (each point names its issue): NCCL runs flat rings, one channel per NIC, so busbw =
# NICs per node x the per-NIC rate.
# (nodes, NICs per node, NIC line rate B/s, measured busbw B/s, source.)
SCALE_OUT_RING_POINTS = (
    (4, 8, 50e9, 365.84e9, "NVIDIA/nccl-tests #309: 4 nodes x 8 GPUs, one 400G NIC per GPU"),
    (248, 8, 50e9, 350e9, "NVIDIA/nccl-tests #283: 248 nodes x 8 H200, 8 HCAs, 512 MiB"),
    (5, 4, 50e9, 190e9, "NVIDIA/nccl #1368: 5 nodes x 8 H100, 4 x 400G RoCE per node"),
)


# The smallest all-reduce across nodes, measured (public NCCL issues, named per point): what
# NCCL's per-step constants leave out is a fixed cost per collective across the network
# (proxy thread, NIC doorbells, completion), fitted on these (meshes/gpu.py).
# (nodes, GPUs per node, measured seconds, source.)
SCALE_OUT_ALPHA_POINTS = (
    (2, 8, 47e-6, "NVIDIA/nccl #1244: 2 nodes x 8 H20, 16 CX-7 NDR IB, 46-48 us"),
    (16, 8, 62e-6, "NVIDIA/nccl #1469: 16 nodes x 8 H100, in-place, 62 us"),
)


def fixed_latency_from(model_s, points=SCALE_OUT_ALPHA_POINTS) -> float:
    """The fixed cost b >= 0 that makes `model_s(nodes, per_node) + b` closest to the
    measured points, in the worst relative error (a convex function of b: ternary search)."""
    def worst(b: float) -> float:
        return max(abs((model_s(n, ppn) + b) / y - 1) for n, ppn, y, _ in points)

    lo, hi = 0.0, max(y for _, _, y, _ in points)
    for _ in range(100):
        a, c = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if worst(a) <= worst(c):
            hi = c
        else:
            lo = a
    return (lo + hi) / 2


def nic_efficiency_from(points=SCALE_OUT_RING_POINTS) -> float:
    """Achieved / line rate per NIC: the median over the measured ring points."""
    ratios = sorted(busbw / (nics * rate) for _, nics, rate, busbw, _ in points)
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


# TPU ICI: the scaling book says an all-gather on v5e reaches ~95% of the 4.5e10 B/s link
# rate by ~10 MB; that is the only measured ICI efficiency in the reference.
TPU_ICI_EFFICIENCY = 0.95
# ICI hop latency (scaling book tpus.md).
TPU_ICI_HOP_LATENCY_S = 1e-6


# NCCL's own latency model (src/graph/tuning.cc `baseLat` and `hwLat`, microseconds; the
# same in NCCL 2.23 to 2.28, the releases of the published runs): a base cost per algorithm
# and protocol plus a cost per ring step or tree level on each hardware class. LL ("low
# latency") trades bandwidth (1/2 on a ring, 1/3.8 on a tree) for latency; Simple runs at
# full bandwidth. NCCL picks the fastest for each size.
NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_BASE_LATENCY_US = {("ring", "LL"): 6.6, ("ring", "LL128"): 14.0, ("ring", "Simple"): 8.4,
                        ("tree", "LL"): 6.8, ("tree", "LL128"): 14.0, ("tree", "Simple"): 8.4}
NCCL_HW_LATENCY_US = {
    "nvlink": {("ring", "LL"): 0.6, ("ring", "LL128"): 1.9, ("ring", "Simple"): 3.4,
               ("tree", "LL"): 0.6, ("tree", "LL128"): 1.25, ("tree", "Simple"): 4.0},
    "net": {("ring", "LL"): 2.7, ("ring", "LL128"): 4.0, ("ring", "Simple"): 14.0,
            ("tree", "LL"): 5.0, ("tree", "LL128"): 8.5, ("tree", "Simple"): 14.0},
}
# A ring across nodes launches every step through the network proxy: each of its steps
# inside a node costs at least NCCL's net overhead (`getNetOverhead`: 1 us on Intel and Arm
# hosts, 2 on AMD; three times that for Simple), `intraLat = max(intraLat, netOverhead)`.
NCCL_NET_OVERHEAD_US = 1.0
# NVLS (NVLink SHARP inside one NVLink domain) and NVLSTree (NVLS inside each domain, a tree
# across them), Simple only, no base latency: hwLat NVLink 25 for both; network 14 for
# NVLSTree's levels.
NCCL_NVLS_LATENCY_US = 25.0
NCCL_NVLS_TREE_LATENCY_US = {"nvlink": 25.0, "net": 14.0}
# CollNet Direct (SHARP in the network switches): NVLink 3.7, network 31, and 0.4 us of
# "arity serialization" for each local rank beyond the first:
# 2 (min(1, ppn - 1) nvlink + (ppn - 1) 0.4) + net.
NCCL_COLLNET_LATENCY_US = {"nvlink": 3.7, "net": 31.0, "per_local_rank": 0.4}
# Share of the Simple protocol's bus bandwidth each protocol reaches (tuning.cc; ring LL:
# half since NCCL 2.21, `busBw * .5`, a quarter across nodes before: LL's 8-byte stores
# carry 4 bytes of data and a 4-byte flag).
NCCL_PROTOCOL_BANDWIDTH_SHARE = {("ring", "LL"): 1 / 2, ("ring", "LL128"): 0.92,
                                 ("ring", "Simple"): 1.0, ("tree", "LL"): 1 / 3.8,
                                 ("tree", "LL128"): 0.915, ("tree", "Simple"): 1.0}
# LL's bus bandwidth ceiling across nodes, B/s, whatever the links (tuning.cc `llMaxBws`,
# the Intel / Arm host row, NCCL 2.18-2.30: 39.0 GB/s on 2 nodes, 20.4 on more; "for
# multi-node, we look at CPU type"): NCCL's own model of LL through the network, applied
# to its ring and tree LL (`busBw = std::min(llMaxBw, ...)`). By node count: 2, 3 or more.
NCCL_LL_MAX_BUS_BYTES_PER_S = {2: 39.0e9, 3: 20.4e9}


def nccl_ll_max_bus_bytes_per_s(nodes: int) -> float:
    """NCCL's LL ceiling for a collective over `nodes` > 1 nodes (NVLink domains)."""
    return NCCL_LL_MAX_BUS_BYTES_PER_S[2 if nodes <= 2 else 3]


