"""GPU systems: NVLink domains (an HGX node of 8, an NVL72 rack) joined by a rail-optimised
scale-out fabric, one NIC per GPU.

Device ids are domain-major: an NVL72 rack holds 72 consecutive ids, a compute tray 4; an
HGX node 8. Collectives inside a domain run at the measured nccl-tests bus bandwidth;
across domains hierarchically, as NCCL does, with NCCL's own latency model (tuning.cc).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from meshes.chips import CHIPS
from meshes.fabric import tree_network_load
from meshes.links import (
    GB200_4GPU_RING,
    GB200_72GPU,
    H100_NVLS_ALL_REDUCE,
    H100_NVLS_PEAK_BY_GPUS,
    H100_RING_BUSBW_CAP,
    NCCL_BASE_LATENCY_US,
    NCCL_COLLNET_LATENCY_US,
    NCCL_HW_LATENCY_US,
    NCCL_NET_OVERHEAD_US,
    NCCL_NVLS_LATENCY_US,
    NCCL_NVLS_TREE_LATENCY_US,
    NCCL_PROTOCOL_BANDWIDTH_SHARE,
    NCCL_PROTOCOLS,
    SCALE_OUT_ALPHA_POINTS,
    SCALE_OUT_RING_POINTS,
    BusBandwidthCurve,
    Link,
    fixed_latency_from,
    nccl_ll_max_bus_bytes_per_s,
    nic_efficiency_from,
)
from meshes.system import CollectiveTiming, System, bus_factor


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

    @property
    def nvlink_p2p_efficiency(self) -> float:
        """A point-to-point transfer over NVLink (collective-permute) reaches what a ring
        reaches per port: a ring step is one such transfer to the next GPU, and the ring's
        measured bus-bandwidth plateau is its achieved per-port rate."""
        return self.ring_cap_bytes_per_s / self.nvlink_bytes_per_s


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

# Per-NIC achieved / line rate, from the measured multi-node ring points (links.py): 0.915.
NIC_EFFICIENCY = nic_efficiency_from(SCALE_OUT_RING_POINTS)


@functools.cache
def net_fixed_latency_s_default() -> float:
    """The fixed cost of a collective across the scale-out network, beyond NCCL's per-step
    constants: fitted so that the tiniest all-reduce on H100-class nodes matches the
    measured ones (links.SCALE_OUT_ALPHA_POINTS; 15 us, within 14% of both)."""
    def model_s(nodes: int, per_node: int) -> float:
        s = GpuSystem(GPU_FAMILIES["h100"], nodes * per_node, net_fixed_latency_s=0.0)
        return s.collective_time_s("all-reduce", 8, [list(range(nodes * per_node))])

    return fixed_latency_from(model_s, SCALE_OUT_ALPHA_POINTS)


class GpuSystem(System):
    """GPUs in NVLink domains, domains joined by one NIC per GPU.

    Args:
        family: the catalog row.
        num_devices: GPUs in the job, any count: they fill NVLink domains in order, the
            last one possibly in part.
        nic_bytes_per_s: scale-out bandwidth per GPU, where the cluster's differs from the
            catalog's (e.g. GCP A3: 4 x 200 Gb/s per 8 GPUs).
        sharp: in-network reduction on the scale-out fabric (InfiniBand SHARP, NCCL's
            CollNet): an all-reduce across domains sends each byte to the switch once and
            receives the result once.
        nvls: NVLink SHARP (NCCL's NVLS and NVLSTree) where the NVSwitches have it; False
            as a job with NCCL_NVLS_ENABLE=0 runs (rings and trees only).
        gpus_per_domain: GPUs of each NVLink domain the job uses (MLPerf GB200 runs use 64
            of each NVL72 rack); the family's domain size by default.
        net_fixed_latency_s: the fixed cost of every collective across domains (NCCL's
            proxy, NIC doorbells, completion); fitted on measured InfiniBand clusters by
            default (`net_fixed_latency_s_default()`); a cluster's own from its smallest 2-node
            all-reduce (`allreduce_alpha_us`).
        pod_gpus, pod_oversubscription: the scale-out fabric as pods of `pod_gpus` GPUs
            under one non-blocking tier, joined by a spine whose uplinks carry
            1/oversubscription of the pod's NIC bandwidth (Meta's 24K H100 clusters: pods
            of 3,072, 7:1); one non-blocking fabric by default.
    """

    def __init__(self, family: GpuFamily, num_devices: int, *,
                 nic_bytes_per_s: float | None = None, sharp: bool = False,
                 nvls: bool = True,
                 gpus_per_domain: int | None = None, overrides: dict | None = None,
                 net_fixed_latency_s: float | None = None, pod_gpus: int | None = None,
                 pod_oversubscription: float = 1.0):
        self.family = family
        self.name = f"{family.name}:{num_devices}"
        self.chip = CHIPS[family.chip]
        self.num_devices = num_devices
        self.domain_size = gpus_per_domain or family.domain_size
        self.sharp = sharp
        self.nvls = nvls and family.has_nvls
        self.net_fixed_s = (net_fixed_latency_s_default() if net_fixed_latency_s is None
                            else net_fixed_latency_s)
        self.pod_gpus = pod_gpus
        self.pod_oversubscription = pod_oversubscription
        self.overrides = dict(overrides or {})
        domain = "rack" if family.domain_size > 8 else "node"
        self.coord_names = (domain, "tray", "gpu") if family.tray_size < self.domain_size else (
            domain, "gpu")
        nic_source = family.nic_source if nic_bytes_per_s is None else "config override"
        self.links = {
            "nvlink": Link(name="nvlink", bytes_per_s=family.nvlink_bytes_per_s,
                           latency_s=0.0, efficiency=family.nvlink_p2p_efficiency,
                           source=family.nvlink_source),
            "infiniband": Link(name="infiniband",
                               bytes_per_s=nic_bytes_per_s or family.nic_bytes_per_s,
                               latency_s=0.0, efficiency=NIC_EFFICIENCY, source=nic_source),
        }

    @property
    def placement(self) -> str:
        full, rest = divmod(self.num_devices, self.domain_size)
        kind = self.coord_names[0]
        if full == 0 or (not rest and self.domain_size == self.family.domain_size):
            return ""
        of = f" of {self.family.domain_size}" if self.domain_size < self.family.domain_size else ""
        text = f"{full} {kind}{'s' if full > 1 else ''} x {self.domain_size} GPUs{of}"
        return text + (f" + 1 {kind} x {rest} GPUs" if rest else "")

    def coords(self, device_id: int) -> tuple[int, ...]:
        self._check_ids([device_id])
        domain, local = divmod(device_id, self.domain_size)
        if len(self.coord_names) == 2:
            return (domain, local)
        return (domain, local // self.family.tray_size, local % self.family.tray_size)

    def domain_of(self, device_id: int) -> int:
        return device_id // self.domain_size

    def _domain_busbw(self, kind: str, nbytes: float, n: int) -> tuple[float, str]:
        f = self.family
        curve = f.small_group_curve
        large = f.large_group_curve
        if n > 8 and large is not None and nbytes >= large.sizes_bytes[0]:
            curve = large
        busbw = curve(nbytes)
        ring = min(busbw, f.ring_cap_bytes_per_s)
        if kind != "all-reduce" or not self.nvls:
            # the curves of NVLS systems were measured with it (NCCL's default): without it
            # an all-reduce runs at the ring's plateau
            return ring, "ring"
        if curve is H100_NVLS_ALL_REDUCE:
            # the 8-GPU NVLS curve scaled to the group's GPUs, or the ring where it is faster
            nvls = busbw * H100_NVLS_PEAK_BY_GPUS[min(n, 8)] / H100_NVLS_PEAK_BY_GPUS[8]
            return (nvls, "nvls") if nvls >= ring else (ring, "ring")
        return busbw, "ring"  # GB200 / GB300: measured rings, and the rack's NVLS curve

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
        # Below the smallest measured size the curve keeps the 1 MB bandwidth; NCCL's
        # latency is the floor a tiny collective cannot beat: its LL ring's, or an
        # all-reduce's NVLS step where the switches reduce (flat in the GPU count: a
        # 72-GPU ring's 142 steps cost more).
        steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
        floor = 1e-6 * (NCCL_BASE_LATENCY_US[("ring", "LL")]
                        + steps * NCCL_HW_LATENCY_US["nvlink"][("ring", "LL")])
        floor_algo = "ring (LL, latency-bound)"
        if kind == "all-reduce" and self.nvls and n > 2 \
                and NCCL_NVLS_LATENCY_US * 1e-6 < floor:
            floor, floor_algo = NCCL_NVLS_LATENCY_US * 1e-6, "nvls (latency-bound)"
        if latency_floor and floor > t:
            return floor, floor_algo
        return t, algo

    def collective_timing(self, kind, nbytes, groups):
        if not groups:
            return CollectiveTiming(0.0, "nvlink", "none")
        flat = [i for g in groups for i in g]
        self._check_ids(flat)
        # Every group runs at once; with one NIC and one NVLink port per GPU, groups of the
        # same shape do not share links, so the slowest group sets the time.
        share = self._spine_share(kind, groups)
        worst = CollectiveTiming(0.0, "nvlink", "none")
        for g in _distinct_shapes(groups, self.domain_of):
            t = self._group_timing(kind, nbytes, g, nic_share=share)
            if t.time_s > worst.time_s:
                worst = t
        if worst.link == "infiniband" and share < 1:
            worst = dataclasses.replace(
                worst, algorithm=f"{worst.algorithm} across pods, {1 / share:.2f}x slower on "
                                 f"the {self.pod_oversubscription:g}:1 spine")
        elif worst.link == "infiniband" and self._crosses_pods(groups):
            worst = dataclasses.replace(
                worst, algorithm=f"{worst.algorithm} across pods (the spine is not "
                                 f"oversubscribed for it)")
        return worst

    def _crosses_pods(self, groups) -> bool:
        pod = self.pod_gpus
        return bool(pod) and any(len({i // pod for i in g}) > 1 for g in groups)

    def _spine_share(self, kind: str, groups) -> float:
        """The share of its NIC rate a GPU gets when the collective's groups cross pods
        (the non-blocking fabric under one spine tier) whose uplinks are oversubscribed:
        every pod sends what its members' groups need outside it at once, through
        `pod_gpus / oversubscription` NICs' worth of uplink. A ring or tree leaves a pod
        once per channel (one per NIC of each of its nodes the group uses); an all-to-all
        sends each member's (n - k)/n across, k of its group in the pod; a send / receive
        pair (a pipeline's stage transfer) or a broadcast moves its whole buffer through
        each member's NIC. 1 when nothing is oversubscribed or nothing crosses."""
        if not self.pod_gpus or self.pod_oversubscription <= 1:
            return 1.0
        pod = self.pod_gpus
        load: dict[int, float] = {}  # pod -> uplink demand, in NICs at full rate
        if kind == "collective-permute":  # (source, target) pairs; links are full duplex
            sends: dict[int, int] = {}
            receives: dict[int, int] = {}
            for src, dst, *_ in groups:
                if src // pod != dst // pod:
                    sends[src // pod] = sends.get(src // pod, 0) + 1
                    receives[dst // pod] = receives.get(dst // pod, 0) + 1
            load = {p: max(sends.get(p, 0), receives.get(p, 0)) for p in {*sends, *receives}}
        for g in groups if kind != "collective-permute" else ():
            in_pod: dict[int, int] = {}
            for i in g:
                in_pod[i // pod] = in_pod.get(i // pod, 0) + 1
            if len(in_pod) < 2:
                continue
            if kind == "all-to-all":
                for p, k in in_pod.items():
                    load[p] = load.get(p, 0.0) + k * (len(g) - k) / len(g)
            elif kind == "collective-broadcast":
                for p, k in in_pod.items():
                    load[p] = load.get(p, 0.0) + k
            else:
                per_domain: dict[int, int] = {}
                for i in g:
                    per_domain[self.domain_of(i)] = per_domain.get(self.domain_of(i), 0) + 1
                channels = min(per_domain.values())
                for p in in_pod:
                    load[p] = load.get(p, 0.0) + channels
        if not load:
            return 1.0
        uplink = pod / self.pod_oversubscription
        return min(1.0, uplink / max(load.values()))

    def _group_timing(self, kind: str, nbytes: float, group: Sequence[int], *,
                      nic_share: float = 1.0) -> CollectiveTiming:
        n = len(group)
        per_domain: dict[int, int] = {}
        for i in group:
            per_domain[self.domain_of(i)] = per_domain.get(self.domain_of(i), 0) + 1
        d = len(per_domain)
        # The scale-out stage runs at the domain with the fewest of the group's GPUs (its
        # NICs carry the rings); the NVLink stage at the one with the most.
        m = min(per_domain.values())
        m_most = max(per_domain.values())
        if d == 1:
            t, algo = self._in_domain_time(kind, nbytes, n)
            return CollectiveTiming(t, "nvlink", algo)
        nic = self.links["infiniband"]
        nic_bw = nic.bytes_per_s * nic.efficiency * nic_share
        if kind in ("collective-permute", "collective-broadcast"):
            return CollectiveTiming(nbytes / nic_bw + self.net_fixed_s, "infiniband", "p2p")
        if kind == "all-to-all":
            # Each GPU sends (n - m)/n of its buffer to other domains through its own NIC.
            t_out = nbytes * (n - m) / n / nic_bw
            t_in, _ = self._in_domain_time(kind, nbytes * m_most / n, m_most)
            return CollectiveTiming(t_out + t_in + self.net_fixed_s, "infiniband",
                                    "hierarchical all-to-all",
                                    link_share=(n - m) / (n - 1))
        # Across domains NCCL runs flat rings, one channel per NIC, each laid through every
        # domain with one hop out of it: every rank moves S x bus factor, at the slower of
        # the NVLink ring inside a domain and the domain's NICs (m per domain used by the
        # group): busbw = m x NIC (NVIDIA/nccl-tests #309: 4 nodes x 8 NICs measure 366
        # GB/s), or the NVLink ring's per-port rate where m NICs carry more (32 of a GB200
        # rack's: 1.46 TB/s against NVLink's 0.68). That rate is the ring's plateau, not a
        # measured curve's value at S: the curve's small sizes hold its own few steps'
        # latency, and NCCL's latency for this ring's n - 1 steps is added below.
        # A tree reduces inside the domain first and sends what NCCL's double binary tree
        # loads the busiest domain's NICs with (meshes/fabric.py: S on 2 domains, 1.5 S on
        # 3, 2 S from 4 on), against the ring's 2(n - 1)/n S: it beats the ring's bandwidth
        # on 2 and 3 domains only. LL, LL128 or Simple, with NCCL's own latencies and its
        # LL ceiling across nodes: the fastest wins.
        nvlink_bw = self._domain_busbw(kind, nbytes, m_most)[0] if m_most > 1 else math.inf
        nvlink_ring_bw = self.family.ring_cap_bytes_per_s if m_most > 1 else math.inf
        ring_bw = min(nvlink_ring_bw, m * nic_bw)
        t_ring = nbytes * bus_factor(kind, n) / ring_bw
        t_tree = max(nbytes * tree_network_load(d) / (m * nic_bw),
                     nbytes * bus_factor(kind, n) / nvlink_bw)
        ll_max = nccl_ll_max_bus_bytes_per_s(d)
        best = None
        algos = ("ring", "tree") if kind == "all-reduce" else ("ring",)
        for algo in algos:
            for proto in NCCL_PROTOCOLS:
                share = NCCL_PROTOCOL_BANDWIDTH_SHARE[(algo, proto)]
                t_bw = t_ring if algo == "ring" else t_tree
                t_bw /= share
                if proto == "LL":
                    # busbw no more than NCCL's ceiling (the tree's bus is 2 S per rank)
                    bus = bus_factor(kind, n) if algo == "ring" else 2.0
                    t_bw = max(t_bw, nbytes * bus / ll_max)
                t = t_bw + _nccl_latency_s(kind, algo, proto, n, d, m)
                if best is None or t < best[0]:
                    best = (t, algo, proto)
        if kind == "all-reduce" and self.nvls and m_most > 1:
            # NVLSTree: NVLink SHARP reduces inside each domain, then every GPU runs a
            # double binary tree over its rail across domains, loading the NICs as the
            # tree does (2 S per domain from 4 domains on, what a ring moves); its latency
            # grows with the tree's depth, log2(domains), not with the ring's 2(n - 1)
            # steps: what a flat ring of thousands of GPUs cannot pipeline away (248 x 8
            # H200: ~350 GB/s measured at 512 MiB, nccl-tests #283).
            t = t_tree + _nvls_tree_latency_s(d)
            if t < best[0]:
                best = (t, "nvls-tree", "Simple")
        if kind == "all-reduce" and self.sharp:
            # In-network reduction: each GPU's 1/m share goes up once and comes back
            # reduced once (full duplex), pipelined with the NVLink stage: bus factor 1
            # through the NICs instead of the ring's ~2, which halves the traffic.
            t_sharp = max(nbytes / (m * nic_bw), nbytes * 2 * (m - 1) / m / nvlink_bw)
            t = t_sharp + _collnet_latency_s(m)
            if t < best[0]:
                best = (t, "sharp", "Simple")
        t, algo, proto = best
        name = f"{algo} ({proto})"
        # What each GPU's NIC sends of its wire bytes: a ring's channels leave each domain
        # once, through its m NICs; a tree's and NVLSTree's load and SHARP's one pass are
        # the domain's, shared by its m NICs likewise
        wire = nbytes * bus_factor(kind, n)
        network = {"ring": wire, "sharp": nbytes}.get(algo, nbytes * tree_network_load(d))
        return CollectiveTiming(t + self.net_fixed_s, "infiniband", name,
                                link_share=network / m / wire)


def _nccl_latency_s(kind: str, algo: str, proto: str, n: int, nodes: int, ppn: int) -> float:
    """NCCL's latency model (tuning.cc) for n ranks on `nodes` > 1 domains of `ppn` GPUs:
    a ring's steps inside a domain at no less than the network proxy's overhead, its
    steps between domains at the network's; a tree's levels (all-reduce only). One GPU a
    domain exposes the network's latency whole: NCCL then charges the tree's."""
    base = NCCL_BASE_LATENCY_US[(algo, proto)]
    intra = NCCL_HW_LATENCY_US["nvlink"][(algo, proto)]
    inter = NCCL_HW_LATENCY_US["net"][("tree" if ppn == 1 else algo, proto)]
    if algo == "tree":
        return 1e-6 * (base + 2 * ((ppn - 1) * intra + _log2i(nodes) * inter))
    intra = max(intra, NCCL_NET_OVERHEAD_US * (3 if proto == "Simple" else 1))
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    inter_steps = 2 * (nodes - 1) if kind == "all-reduce" else nodes - 1
    return 1e-6 * (base + (steps - inter_steps) * intra + inter_steps * inter)


def _log2i(n: int) -> int:
    """floor(log2(n)), as NCCL's log2i."""
    return n.bit_length() - 1


def _nvls_tree_latency_s(nodes: int) -> float:
    """NCCL's NVLSTree latency (tuning.cc): one NVLS step plus the tree's depth across
    `nodes` domains, up and down."""
    lat = NCCL_NVLS_TREE_LATENCY_US
    return 1e-6 * (lat["nvlink"] + 2 * _log2i(nodes) * lat["net"])


def _collnet_latency_s(ppn: int) -> float:
    """NCCL's CollNet Direct latency (tuning.cc): one NVLink step each way and the local
    ranks' serialisation, and one network hop to the switch that reduces."""
    lat = NCCL_COLLNET_LATENCY_US
    local = ppn - 1
    return 1e-6 * (2 * (min(1, local) * lat["nvlink"] + local * lat["per_local_rank"])
                   + lat["net"])


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
