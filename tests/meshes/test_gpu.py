"""GPU systems (meshes/gpu.py): placement and NCCL's collectives, on plain Python objects."""

import math

import pytest

from meshes import bus_factor, get_system
from meshes.gpu import net_fixed_latency_s_default

MB = 1e6

# Every collective across the network pays this fixed cost (meshes/gpu.py; tested below).
NET_FIXED = net_fixed_latency_s_default()


def test_nvl72_rack_placement_is_rack_major_with_trays_of_four():
    s = get_system("gb200-nvl72:144")
    assert s.num_devices == 144
    assert s.place(0) == {"rack": 0, "tray": 0, "gpu": 0}
    assert s.place(5) == {"rack": 0, "tray": 1, "gpu": 1}
    assert s.place(71) == {"rack": 0, "tray": 17, "gpu": 3}
    assert s.place(72) == {"rack": 1, "tray": 0, "gpu": 0}


def test_hgx_nodes_of_eight():
    s = get_system("h100:64")
    assert s.place(13) == {"node": 1, "gpu": 5}


def test_in_domain_all_reduce_matches_measured_busbw():
    # 8x H100 NVLS at 1 GB measured 466.4 GB/s busbw: t = S * 2(n-1)/n / busbw.
    s = get_system("h100:8")
    t = s.collective_time_s("all-reduce", 1e9, [list(range(8))])
    assert t == pytest.approx(1e9 * 2 * 7 / 8 / 466.4e9, rel=1e-6)


def test_all_reduce_across_two_racks_is_an_nvls_tree_through_the_nics():
    # 4 GPUs in each of 2 racks, S = 256 MB. On 2 domains the tree sends each byte across
    # once: S over the 4 GPUs' NICs (50 GB/s x the measured per-NIC efficiency), pipelined
    # with the NVLink stage (S x 2 x 7/8 at the 4-GPU GB200 busbw, log-interpolated between
    # 67 MB and 1 GB), the slower of the two. NVLSTree (NVLink SHARP inside each rack, off
    # only on one node: tuning.cc) moves it at Simple's full rate, where the plain tree's
    # LL128 reaches 0.915 of it; its latency is one NVLS step and one tree level each way
    # (tuning.cc, NCCL 2.23-2.28: 25 + 2 x 1 x 14 us).
    from meshes.gpu import NIC_EFFICIENCY

    s = get_system("gb200-nvl72:144")
    S = 256 * MB
    f = math.log(S / 67e6) / math.log(1e9 / 67e6)
    nvlink = 550.7e9 + f * (646.9e9 - 550.7e9)
    bandwidth_s = max(S / (4 * 50e9 * NIC_EFFICIENCY), S * 2 * 7 / 8 / nvlink)
    latency_s = 1e-6 * (25 + 2 * 1 * 14)
    t = s.collective_timing("all-reduce", S, [list(range(0, 4)) + list(range(72, 76))])
    assert t.time_s == pytest.approx(bandwidth_s + latency_s + NET_FIXED, rel=1e-9)
    assert t.link == "infiniband" and t.algorithm == "nvls-tree (Simple)"


def test_book_5_and_6_h100_all_gathers():
    s = get_system("h100:8")
    # 5: bf16[1024, 16384] = 33.5 MB over 8 GPUs. The book's 65-75 us assumes the 450 GB/s
    # link rate; the measured 8x H100 busbw at this size is log-interpolated between 16 MB
    # (234.5 GB/s) and 67 MB (361.8 GB/s), and t = S x 7/8 / busbw.
    S5 = 1024 * 16384 * 2
    f = math.log(S5 / 16e6) / math.log(67e6 / 16e6)
    busbw = 234.5e9 + f * (361.8e9 - 234.5e9)
    t5 = s.collective_time_s("all-gather", S5, [list(range(8))])
    assert t5 == pytest.approx(S5 * 7 / 8 / busbw, rel=1e-9)
    # 6: 536e6 bytes: the book's 1.04 ms theory, ~1.5 ms in practice. An all-gather (no
    # NVLS) runs at the ring plateau, 367 GB/s (NVIDIA/nccl#1455).
    t6 = s.collective_time_s("all-gather", 536e6, [list(range(8))])
    assert t6 == pytest.approx(536e6 * 7 / 8 / 367e9, rel=1e-9)
    assert t6 == pytest.approx(1.5e-3, rel=0.15)


def busbw(system, kind, nbytes, group):
    t = system.collective_time_s(kind, nbytes, [group])
    return nbytes * bus_factor(kind, len(group)) / t


@pytest.mark.parametrize("nbytes, measured", [(16e6, 234.5e9), (67e6, 361.8e9),
                                              (268e6, 423.4e9), (1e9, 466.4e9), (8e9, 478.9e9)])
def test_h100_nvls_all_reduce_table(nbytes, measured):
    assert busbw(get_system("h100:8"), "all-reduce", nbytes, list(range(8))) == \
        pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("nbytes, measured", [(16e6, 331.1e9), (67e6, 550.7e9), (1e9, 646.9e9),
                                              (8e9, 679.6e9)])
def test_gb200_four_gpus_in_a_rack(nbytes, measured):
    assert busbw(get_system("gb200-nvl72:72"), "all-reduce", nbytes, [0, 1, 2, 3]) == \
        pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("mib, measured", [(512, 586.1e9), (1024, 681.2e9), (2048, 757.8e9),
                                           (4096, 839.2e9), (8192, 834.6e9)])
def test_gb200_full_rack(mib, measured):
    assert busbw(get_system("gb200-nvl72:72"), "all-reduce", mib * 2**20, list(range(72))) == \
        pytest.approx(measured, rel=1e-9)


def test_busbw_between_measured_sizes_is_log_linear():
    # Half-way in log(size) between the measured 1 GB (466.4 GB/s) and 8 GB (478.9 GB/s):
    # sqrt(8) GB sits at their mean.
    S = math.sqrt(8) * 1e9
    assert busbw(get_system("h100:8"), "all-reduce", S, list(range(8))) == \
        pytest.approx((466.4e9 + 478.9e9) / 2, rel=1e-9)


def test_small_collectives_choose_latency_optimal_algorithms():
    s = get_system("h100:64")
    small = s.collective_timing("all-reduce", 64e3, [list(range(64))])
    large = s.collective_timing("all-reduce", 4e9, [list(range(64))])
    assert "tree" in small.algorithm and "LL" in small.algorithm
    assert "Simple" in large.algorithm
    # A 1 KB all-reduce inside a node is NCCL's LL ring latency: base 6.6 us plus
    # 2 x (8 - 1) steps of 0.6 us on NVLink (tuning.cc), under NVLS's 25 us step.
    tiny = s.collective_timing("all-reduce", 1e3, [list(range(8))])
    assert tiny.algorithm.startswith("ring (LL")
    assert tiny.time_s == pytest.approx(1e-6 * (6.6 + 2 * 7 * 0.6), rel=1e-9)
    # 72 GPUs of one rack: the ring's 142 steps (92 us) lose to the switches' reduction.
    rack = get_system("gb200-nvl72:72").collective_timing("all-reduce", 1e3, [list(range(72))])
    assert (rack.algorithm, rack.time_s) == ("nvls (latency-bound)", pytest.approx(25e-6))


def test_nic_override_sets_the_scale_out_bandwidth():
    # One GPU in each of 2 HGX nodes, all-gather of 1 GB: no NVLink stage, S x 1/2 over the
    # NIC at its measured efficiency, plus NCCL's Simple ring latency for 2 ranks on 2 nodes
    # (base 8.4 us, one network step: one GPU a node exposes it whole, 14 us, the tree's).
    # GCP A3: 4 x 200 Gb/s per 8 GPUs = 100 Gb/s = 12.5 GB/s per GPU.
    from meshes.gpu import NIC_EFFICIENCY

    S = 1e9
    default = get_system("h100:16").collective_time_s("all-gather", S, [[0, 8]])
    a3 = get_system("h100:16", nic_gbps=100).collective_time_s("all-gather", S, [[0, 8]])
    assert default == pytest.approx(S / 2 / (50e9 * NIC_EFFICIENCY) + 22.4e-6 + NET_FIXED,
                                    rel=1e-9)
    assert a3 == pytest.approx(S / 2 / (12.5e9 * NIC_EFFICIENCY) + 22.4e-6 + NET_FIXED,
                               rel=1e-9)


def test_sharp_halves_the_all_reduce_traffic_across_many_nodes():
    # One GPU in each of 8 nodes, 4 GB all-reduce: a ring sends 2 x 7/8 of S through each
    # NIC; in-network reduction sends S up and receives S down once (full duplex), plus
    # NCCL's CollNet Direct latency (one GPU a node: one network hop, 31 us).
    from meshes.gpu import NIC_EFFICIENCY

    S, group, nic = 4e9, list(range(0, 64, 8)), 50e9 * NIC_EFFICIENCY
    ring = get_system("h100:64").collective_timing("all-reduce", S, [group])
    sharp = get_system("h100:64", sharp=True).collective_timing("all-reduce", S, [group])
    ring_latency = 1e-6 * (8.4 + 14 * 14.0)  # 2 x 7 network steps of a Simple ring
    assert ring.time_s == pytest.approx(S * 2 * 7 / 8 / nic + ring_latency + NET_FIXED,
                                        rel=1e-9)
    assert sharp.time_s == pytest.approx(S / nic + 31e-6 + NET_FIXED, rel=1e-9)
    assert sharp.algorithm.startswith("sharp")
    # Other kinds are untouched by SHARP here.
    ag = [get_system("h100:64", sharp=s).collective_time_s("all-gather", S, [group])
          for s in (False, True)]
    assert ag[0] == ag[1]


def test_gpus_per_domain_places_a_job_on_part_of_each_rack():
    # MLPerf GB200 runs: 256 GPUs as 4 NVLink domains of 64 (not a multiple of 72).
    s = get_system("gb200-nvl72:256", gpus_per_domain=64)
    assert s.placement == "4 racks x 64 GPUs of 72"
    assert s.place(63) == {"rack": 0, "tray": 15, "gpu": 3}
    assert s.place(64) == {"rack": 1, "tray": 0, "gpu": 0}
    assert s.collective_timing("all-gather", 64 * MB, [list(range(64))]).link == "nvlink"
    assert s.collective_timing("all-gather", 64 * MB, [[63, 64]]).link == "infiniband"
    assert s.label == "gb200-nvl72:256 [gpus_per_domain=64]"


def test_any_gpu_count_fills_domains_in_order_the_last_in_part():
    # 256 GPUs without an override: 3 full racks and 40 GPUs of a fourth.
    s = get_system("gb200-nvl72:256")
    assert s.placement == "3 racks x 72 GPUs + 1 rack x 40 GPUs"
    assert s.place(255) == {"rack": 3, "tray": 9, "gpu": 3}  # local GPU 39
    assert get_system("gb200-nvl72:144").placement == ""  # whole racks: nothing to say
    # 12 H100s: a node of 8 and one of 4. A ring over all 12 leaves the partial node through
    # its 4 NICs, so it runs at 4 NICs' pace: as fast as 2 nodes of 4 (within NCCL's
    # latency for 4 more ranks), no faster than S through 4 NICs (the tree sends each byte
    # across once), slower than 2 full nodes.
    S = 1e9
    partial = get_system("h100:12").collective_timing("all-reduce", S, [list(range(12))])
    fours = get_system("h100:8", gpus_per_domain=4).collective_timing(
        "all-reduce", S, [list(range(8))])
    eights = get_system("h100:16").collective_timing("all-reduce", S, [list(range(16))])
    assert get_system("h100:12").placement == "1 node x 8 GPUs + 1 node x 4 GPUs"
    assert partial.time_s == pytest.approx(fours.time_s, rel=0.01)
    nic = get_system("h100:12").links["infiniband"]
    assert partial.time_s >= S / (4 * nic.bytes_per_s * nic.efficiency) > eights.time_s


def test_nic_efficiency_is_the_median_of_the_measured_ring_points():
    from meshes.gpu import NIC_EFFICIENCY

    # 365.84 / (8 x 50), 350 / (8 x 50), 190 / (4 x 50): the median is 0.9146.
    assert NIC_EFFICIENCY == pytest.approx(365.84 / 400, rel=1e-9)


@pytest.mark.parametrize("system, overrides, nodes, nbytes, measured, what", [
    ("h100:32", {}, 4, 1e9, 365.84e9, "4 x 8, one NIC per GPU: ring (nccl-tests #309)"),
    ("h100:16", {}, 2, 8e9, 470e9, "2 x 8: tree/NVLSTree past the NICs (nccl-tests #309)"),
    ("h200:1984", {}, 248, 512 * 2**20, 350e9, "248 x 8 H200, NVLSTree (nccl-tests #283)"),
    ("h100:40", {"nic_gbps": 200}, 5, 1e9, 190e9, "5 x 8, 4 x 400G RoCE per node (nccl #1368)"),
    ("a100:32", {}, 4, 1e9, 192e9, "DGX-A100, 8 x 200G IB (nccl #812)"),
    ("h100:32", {}, 4, 1e9, 320e9, "8 x 400G RoCE, more than 2 nodes (nccl #1221)"),
    ("h100:32", {}, 4, 8e9, 396e9, "8 x 400G ring, maintainers' ceiling (nccl-tests #319)"),
    ("h100:16", {"nic_gbps": 200}, 2, 8 * 2**30, 338.82e9, "A3 Mega 2 x 8, 8 GiB"),
    ("h100:16", {"nic_gbps": 200}, 2, 4 * 2**30, 330.58e9, "A3 Mega 2 x 8, 4 GiB"),
    ("h100:16", {"nic_gbps": 200}, 2, 2 * 2**30, 318.40e9, "A3 Mega 2 x 8, 2 GiB"),
])
def test_measured_multi_node_all_reduce(system, overrides, nodes, nbytes, measured, what):
    s = get_system(system, **overrides)
    group = list(range(s.num_devices))
    assert busbw(s, "all-reduce", nbytes, group) == pytest.approx(measured, rel=0.15), what


def test_large_rings_use_rings_and_two_nodes_use_trees():
    big = 4e9
    assert get_system("h100:32").collective_timing("all-reduce", big, [list(range(32))]
                                                   ).algorithm.startswith("ring")
    assert get_system("h100:16").collective_timing("all-reduce", big, [list(range(16))]
                                                   ).algorithm.startswith("nvls-tree")
    # 5 nodes with 4 NICs each: the plain tree (measured ~150 GB/s) is not better than the
    # ring (~190) and is not chosen; NVLSTree's 2 S through each node's NICs ties with the
    # ring's 2 x 39/40 S (its shorter latency makes up the 2.5%), at the ring's busbw.
    s = get_system("h100:40", nic_gbps=200)
    t = s.collective_timing("all-reduce", 1e9, [list(range(40))])
    assert not t.algorithm.startswith("tree")
    assert 1e9 * 2 * 39 / 40 / t.time_s == pytest.approx(190e9, rel=0.1)


def test_thousands_of_gpus_reduce_over_nvls_trees_not_rings():
    # 248 nodes x 8 H200, 512 MiB: a flat ring pays 2(n-1) = 3966 dependent steps of NCCL's
    # per-step latency (> 10 ms); NVLSTree sends what the double binary tree loads a node's
    # NICs with (2 S: an inner node of one tree, a leaf of the other), plus one NVLS step
    # (25 us) and 2 x floor(log2 248) = 14 tree levels of 14 us each.
    from meshes.gpu import NIC_EFFICIENCY

    S, n = 512 * 2**20, 1984
    s = get_system(f"h200:{n}")
    t = s.collective_timing("all-reduce", S, [list(range(n))])
    tree_s = S * 2 / (8 * 50e9 * NIC_EFFICIENCY)
    assert t.algorithm == "nvls-tree (Simple)"
    assert t.time_s == pytest.approx(tree_s + 1e-6 * (25 + 14 * 14) + NET_FIXED, rel=1e-9)
    # A100s have no NVLink SHARP: no NVLSTree, whatever the size.
    a100 = get_system("a100:1984").collective_timing("all-reduce", S, [list(range(n))])
    assert not a100.algorithm.startswith("nvls")
    # 4 nodes at 4 GB: the ring's latency is small beside its bytes, and the ring wins.
    assert get_system("h100:32").collective_timing("all-reduce", 4e9, [list(range(32))]
                                                   ).algorithm.startswith("ring")


def test_multi_node_all_to_all_runs_at_one_nic_per_gpu():
    # 2 nodes x 8, 1 GB per GPU: half of it leaves the node through the GPU's own NIC
    # (all-to-all cannot aggregate NICs, nccl-tests #267); the other half stays on NVLink.
    from meshes.gpu import NIC_EFFICIENCY

    s = get_system("h100:16")
    t = s.collective_time_s("all-to-all", 1e9, [list(range(16))])
    assert t >= 1e9 * 8 / 16 / (50e9 * NIC_EFFICIENCY)
    assert t == pytest.approx(1e9 * 8 / 16 / (50e9 * NIC_EFFICIENCY), rel=0.15)


def test_the_fixed_cost_across_the_network_fits_the_smallest_measured_all_reduces():
    # NCCL's per-step constants give a 2-node all-reduce of 8 B ~28 us, where InfiniBand
    # clusters measure 46-48 (nccl #1244) and 16 nodes 62 (nccl #1469): one fixed cost per
    # collective across the network, fitted on both, brings each within 15%.
    from meshes.gpu import net_fixed_latency_s_default

    fixed = net_fixed_latency_s_default()
    assert 5e-6 < fixed < 30e-6
    for n, measured in ((16, 47e-6), (128, 62e-6)):
        t = get_system(f"h100:{n}").collective_time_s("all-reduce", 8, [list(range(n))])
        assert t == pytest.approx(measured, rel=0.15)
        bare = get_system(f"h100:{n}")
        bare.net_fixed_s = 0.0
        assert t - bare.collective_time_s("all-reduce", 8, [list(range(n))]) == \
            pytest.approx(fixed, rel=1e-9)
    # Inside one node: no network, no fixed cost.
    assert get_system("h100:8").collective_time_s("all-reduce", 8, [list(range(8))]) < 20e-6


def test_a_clusters_own_alpha_sets_its_fixed_cost():
    # GCP A3 Mega (TCPXO, 8 x 200G per VM): 123 us in place for the smallest all-reduce on
    # 2 VMs; from it the 1 MiB point (203 us measured) lands within 15%; large messages are
    # bandwidth-bound and unchanged.
    a3 = get_system("h100:16", nic_gbps=200, allreduce_alpha_us=123)
    ib = get_system("h100:16", nic_gbps=200)
    group = [list(range(16))]
    assert a3.collective_time_s("all-reduce", 8, group) == pytest.approx(123e-6, rel=1e-6)
    assert a3.collective_time_s("all-reduce", 2**20, group) == pytest.approx(203.2e-6, rel=0.15)
    big = 8 * 2**30
    assert a3.collective_time_s("all-reduce", big, group) == pytest.approx(
        ib.collective_time_s("all-reduce", big, group), rel=0.01)
    with pytest.raises(ValueError, match="applies to GPU systems"):
        get_system("tpu-v5e:4x4", allreduce_alpha_us=50)


def test_a_collective_crossing_the_spine_pays_its_oversubscription():
    # 4 pods of 64 H100s (8 nodes each), 4:1 above the pods. An all-to-all over all 256
    # GPUs: each GPU sends 3/4 of its buffer to other pods, the pod's 64 GPUs at once
    # through 64/4 = 16 NICs' worth of uplink: each gets 16 / (64 x 3/4) = 1/3 of its NIC.
    from meshes.gpu import NIC_EFFICIENCY

    S, n = 1e9, 256
    flat = get_system(f"h100:{n}")
    tiered = get_system(f"h100:{n}", pod_gpus=64, pod_oversubscription=4)
    everyone = [list(range(n))]
    nic = 50e9 * NIC_EFFICIENCY
    t = tiered.collective_timing("all-to-all", S, everyone)
    # What leaves the node (248/256 of the buffer) goes through the NIC; the rest stays
    # on NVLink, unchanged by the spine.
    out_flat = S * 248 / 256 / nic
    nvlink = flat.collective_time_s("all-to-all", S, everyone) - out_flat - NET_FIXED
    assert 0 < nvlink < out_flat / 10
    assert t.time_s == pytest.approx(3 * out_flat + nvlink + NET_FIXED, rel=1e-9)
    assert "3.00x slower on the 4:1 spine" in t.algorithm
    # Data-parallel rings with one GPU per node (8 groups of 32, one per position in a
    # node): each ring leaves each pod once per channel, 8 rings per pod on 16 NICs of
    # uplink: the spine is not the bottleneck, the rings run at full rate.
    rings = [list(range(k, n, 8)) for k in range(8)]
    assert tiered.collective_time_s("all-reduce", S, rings) == pytest.approx(
        flat.collective_time_s("all-reduce", S, rings), rel=1e-12)
    assert "across pods (the spine is not oversubscribed for it)" in tiered.collective_timing(
        "all-reduce", S, rings).algorithm
    # Pods of 2 nodes (16 GPUs) under a 4:1 spine: the same 8 rings leave each pod 8
    # times, on 4 NICs' worth of uplink: half the NIC rate, twice the ring's bytes time.
    small = get_system(f"h100:{n}", pod_gpus=16, pod_oversubscription=4)
    slow = small.collective_timing("all-reduce", S, rings)
    assert "2.00x slower on the 4:1 spine" in slow.algorithm
    base = flat.collective_time_s("all-reduce", S, rings)
    assert 1.8 * base < slow.time_s < 2 * base
    # Inside one pod nothing changes.
    pod = [list(range(64))]
    assert tiered.collective_time_s("all-to-all", S, pod) == flat.collective_time_s(
        "all-to-all", S, pod)


def test_a_published_fabric_sets_its_pods():
    s = get_system("h100:24576", fabric="meta-24k")
    assert (s.pod_gpus, s.pod_oversubscription) == (3072, 7.0)
    with pytest.raises(ValueError, match="valid: meta-24k, dgx-superpod-b200"):
        get_system("h100:64", fabric="meta")
    # NVIDIA's SuperPODs are non-blocking at every tier: crossing the spine is named, not
    # slowed.
    sp = get_system("b200:4096", fabric="dgx-superpod-b200")
    rings = [list(range(k, 4096, 8)) for k in range(8)]
    t = sp.collective_timing("all-reduce", 1e9, rings)
    assert t.time_s == get_system("b200:4096").collective_time_s("all-reduce", 1e9, rings)
    assert "across pods" in t.algorithm


def test_nvls_off_runs_rings_and_trees_only():
    # NCCL_NVLS_ENABLE=0 (`nvls = false`): an 8-GPU H100 all-reduce runs at the ring's
    # plateau (367 GB/s), not NVLS's 479 at 8 GB, and across nodes there is no NVLSTree.
    S = 8e9
    on = get_system("h100:8").collective_timing("all-reduce", S, [list(range(8))])
    off = get_system("h100:8", nvls=False).collective_timing("all-reduce", S, [list(range(8))])
    assert on.algorithm == "nvls" and off.algorithm == "ring"
    assert off.time_s == pytest.approx(S * 2 * 7 / 8 / 367e9, rel=1e-9)
    two = get_system("h100:16", nvls=False).collective_timing("all-reduce", S, [list(range(16))])
    assert "nvls" not in two.algorithm
    assert get_system("h100:16", nvls=False).label.endswith("[nvls=False]")


def test_link_share_is_what_each_gpus_nic_sends_of_its_wire_bytes():
    # A flat ring's channels leave each node once, through its 8 NICs: 1/8 of what a GPU
    # sends crosses its NIC; an all-to-all sends the other nodes' (n - m)/n of its buffer,
    # of (n - 1)/n in all; a double binary tree's 2 S a node over 4+ nodes, shared by 8.
    s = get_system("h100:32")
    everyone = [list(range(32))]
    ring = s.collective_timing("all-gather", 8e9, everyone)
    assert ring.algorithm.startswith("ring") and ring.link_share == pytest.approx(1 / 8)
    a2a = s.collective_timing("all-to-all", 8e9, everyone)
    assert a2a.link_share == pytest.approx((32 - 8) / 31)
    tree = get_system("h100:64").collective_timing("all-reduce", 8e6, [list(range(64))])
    assert tree.algorithm.startswith("tree")
    assert tree.link_share == pytest.approx(2 / 8 / (2 * 63 / 64))
    inside = s.collective_timing("all-reduce", 8e9, [list(range(8))])
    assert inside.link == "nvlink" and inside.link_share == 1.0
