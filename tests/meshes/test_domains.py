"""Collectives whose group spans several NVLink domains with many GPUs in each (MLPerf's
GB200 runs: 8 racks x 64 GPUs, data x context parallel groups of 256 with 32 per rack),
timed as NCCL runs them: one ring per channel laid through every domain with one hop out of
it, NCCL's latency for the ring's n - 1 steps, its protocol choice and LL ceiling."""

import pytest

from meshes import get_system
from meshes.gpu import NIC_EFFICIENCY, net_fixed_latency_s_default

NET_FIXED = net_fixed_latency_s_default()
GB200_RING = 679.6e9  # 4x GB200 ring busbw at 8 GB: NVLink5's per-port ring rate (links.py)


def mlperf_gb200(nic_gbps=None):
    """512 GB200 as 8 racks x 64 (gpus_per_domain = 64), with groups of every other GPU:
    tensor parallelism 2 innermost, data x context over the rest: 2 groups of 256, 32 GPUs
    of each in every rack."""
    extra = {} if nic_gbps is None else {"nic_gbps": nic_gbps}
    s = get_system("gb200-nvl72:512", gpus_per_domain=64, **extra)
    return s, [list(range(t, 512, 2)) for t in range(2)]


def ring_latency_s(proto: str, n: int, nodes: int) -> float:
    """NCCL's ring latency for a reduce-scatter or all-gather (tuning.cc, NCCL 2.23-2.28):
    base, n - nodes NVLink steps (no less than the net overhead, 1 us, 3 for Simple, once
    the ring leaves its node), nodes - 1 network steps (the tree's network latency when
    there is one GPU a node: NCCL's "latencies fully exposed")."""
    base = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}[proto]
    nvlink = {"LL": max(0.6, 1.0), "LL128": 1.9, "Simple": max(3.4, 3.0)}[proto]
    net = {"LL": 2.7, "LL128": 4.0, "Simple": 14.0} if n > nodes else {
        "LL": 5.0, "LL128": 8.5, "Simple": 14.0}
    return 1e-6 * (base + (n - nodes) * nvlink + (nodes - 1) * net[proto])


@pytest.mark.parametrize("kind", ["reduce-scatter", "all-gather"])
def test_a_ring_over_eight_racks_of_32_is_bound_by_nvlink_not_by_a_nic(kind):
    # The ring leaves each rack once per channel, and 32 NICs per rack carry the channels:
    # 32 x 45.7 GB/s = 1.46 TB/s, beyond NVLink's ring rate (680 GB/s per GPU). So every
    # GPU moves S x 255/256 at the NVLink ring's rate (LL128: 0.92 of it), plus NCCL's
    # latency for 255 steps, 7 of them across racks.
    s, groups = mlperf_gb200()
    S, n = 147e6, 256
    t = s.collective_timing(kind, S, groups)
    assert t.algorithm == "ring (LL128)" and t.link == "infiniband"
    bandwidth_s = S * (n - 1) / n / (GB200_RING * 0.92)
    assert t.time_s == pytest.approx(
        bandwidth_s + ring_latency_s("LL128", n, 8) + NET_FIXED, rel=1e-9)
    # Not the NICs: twice their rate changes nothing, and the time is a fraction of what
    # one NIC would take for the ring's bytes.
    faster_nics, _ = mlperf_gb200(nic_gbps=800)
    assert faster_nics.collective_time_s(kind, S, groups) == pytest.approx(t.time_s, rel=1e-12)
    one_nic_s = S * (n - 1) / n / (50e9 * NIC_EFFICIENCY)
    assert t.time_s < one_nic_s / 3


def test_the_ring_runs_at_nvlinks_plateau_with_its_own_latency_added_once():
    # At 16 MB the measured 4-GPU curve reads 331 GB/s: its own 6 steps' latency. A ring
    # of 256 pays NCCL's latency for its 255 steps instead, on top of the plateau rate.
    s, groups = mlperf_gb200()
    S, n = 16e6, 256
    t = s.collective_timing("reduce-scatter", S, groups)
    assert t.time_s == pytest.approx(S * (n - 1) / n / (GB200_RING * 0.92)
                                     + ring_latency_s("LL128", n, 8) + NET_FIXED, rel=1e-9)


def test_protocol_by_size_follows_ncclS_model_across_eight_racks():
    # t = latency + bytes / bandwidth for each protocol (tuning.cc); the fastest wins.
    # LL: the cheapest steps, but NCCL caps LL across more than 2 nodes at 20.4 GB/s busbw
    # (llMaxBws). LL128: 0.92 of the ring's rate, 1.9 us per NVLink step. Simple: all of
    # it, 3.4 us per step. Over 255 steps the latencies part LL and LL128 at ~6 MB and
    # LL128 and Simple at ~3 GB: a 147 MB gradient bucket is LL128, not Simple.
    s, groups = mlperf_gb200()
    n, b = 256, 255 / 256
    lat = {p: ring_latency_s(p, n, 8) for p in ("LL", "LL128", "Simple")}
    inv_bw = {"LL": 1 / 20.4e9, "LL128": 1 / (0.92 * GB200_RING), "Simple": 1 / GB200_RING}
    ll_ll128 = (lat["LL128"] - lat["LL"]) / (b * (inv_bw["LL"] - inv_bw["LL128"]))
    ll128_simple = (lat["Simple"] - lat["LL128"]) / (b * (inv_bw["LL128"] - inv_bw["Simple"]))
    assert 4e6 < ll_ll128 < 8e6 and 2e9 < ll128_simple < 5e9

    def proto(nbytes):
        return s.collective_timing("reduce-scatter", nbytes, groups).algorithm

    assert proto(1e3) == proto(0.95 * ll_ll128) == "ring (LL)"
    assert proto(1.05 * ll_ll128) == proto(147e6) == proto(0.95 * ll128_simple) == "ring (LL128)"
    assert proto(1.05 * ll128_simple) == "ring (Simple)"


@pytest.mark.parametrize("nodes, cap", [(2, 39.0e9), (8, 20.4e9)])
def test_ll_across_domains_stays_under_ncclS_ceiling(nodes, cap):
    # One GPU per node, 256 KB: small enough that LL wins, and its bandwidth term is the
    # lower of half the NIC's (0.5 x 45.7 GB/s) and NCCL's ceiling for that many nodes.
    s = get_system(f"h100:{8 * nodes}")
    group = list(range(0, 8 * nodes, 8))
    S = 256e3
    t = s.collective_timing("all-gather", S, [group])
    assert t.algorithm == "ring (LL)"
    lat = ring_latency_s("LL", nodes, nodes)
    assert t.time_s == pytest.approx(S * (nodes - 1) / nodes / min(cap, 25e9 * NIC_EFFICIENCY)
                                     + lat + NET_FIXED, rel=1e-9)


@pytest.mark.parametrize("racks, per_rack", [(8, 64), (8, 72)])
def test_all_reduce_over_eight_racks_is_bound_by_nvlink_not_by_the_nics(racks, per_rack):
    # Every other GPU of 8 racks (32 or 36 in each), 1 GB: whatever NCCL picks (a ring, or
    # NVLSTree's 2 S through each rack's 32+ NICs), the NVLink stage is the slower one:
    # NICs twice as fast change nothing, and no algorithm beats S x 2(n - 1)/n at the
    # best all-reduce busbw measured inside a rack (839 GB/s, 72 GPUs).
    S = 1e9
    extra = {} if per_rack == 72 else {"gpus_per_domain": per_rack}
    n_all = racks * per_rack
    groups = [list(range(t, n_all, 2)) for t in range(2)]
    s = get_system(f"gb200-nvl72:{n_all}", **extra)
    fast = get_system(f"gb200-nvl72:{n_all}", nic_gbps=800, **extra)
    t = s.collective_time_s("all-reduce", S, groups)
    assert fast.collective_time_s("all-reduce", S, groups) == pytest.approx(t, rel=1e-12)
    n = n_all // 2
    assert t > S * 2 * (n - 1) / n / 839.2e9
