"""Topology logic on plain Python objects, no JAX."""

import pytest

from meshes import bus_factor, get_system

MB = 1e6


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


def test_tpu_coords_x_fastest_and_tpu7x_two_devices_per_chip():
    s = get_system("tpu-v5e:4x4")
    assert s.num_devices == 16
    assert s.coords(5) == (0, 1, 1, 0)  # slice 0, x=1, y=1, core 0
    t = get_system("tpu7x:4x4x4")
    assert t.num_devices == 128
    assert t.coords(3) == (0, 1, 0, 0, 1)  # chip 1 (x=1), second TensorCore
    multi = get_system("tpu-v6e:16x16*2")
    assert multi.num_devices == 512 and multi.coords(256)[0] == 1


def test_wraparound_rules():
    assert get_system("tpu-v5e:16x16").wraps == (True, True)
    assert get_system("tpu-v5e:8x16").wraps == (False, True)
    assert get_system("tpu-v5p:4x4x4").wraps == (True, True, True)
    assert get_system("tpu-v5p:2x2x4").wraps == (False, False, False)


@pytest.mark.parametrize("name, fragment", [
    ("h100", "<family>:<size>"),
    ("dgx:8", "unknown system family 'dgx'"),
    ("gb200-nvl72:100", "whole number of 72-GPU NVLink domains"),
    ("tpu-v5e:4x4x4", "2D"),
    ("tpu-v5e:32x32", "exceeds the largest"),
])
def test_bad_system_names_say_what_is_valid(name, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")) as e:
        get_system(name)
    assert "\n" not in str(e.value)


def test_device_ids_outside_the_system_are_an_error():
    s = get_system("h100:8")
    with pytest.raises(ValueError, match="device id 8 is outside"):
        s.collective_time_s("all-reduce", MB, [[0, 8]])


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all-reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all-gather", 4) == pytest.approx(3 / 4)
    assert bus_factor("collective-permute", 2) == 1.0


def test_in_domain_all_reduce_matches_measured_busbw():
    # 8x H100 NVLS at 1 GB measured 466.4 GB/s busbw: t = S * 2(n-1)/n / busbw.
    s = get_system("h100:8")
    t = s.collective_time_s("all-reduce", 1e9, [list(range(8))])
    assert t == pytest.approx(1e9 * 2 * 7 / 8 / 466.4e9, rel=1e-6)


def test_all_reduce_spanning_racks_is_slower_than_inside_one():
    s = get_system("gb200-nvl72:144")
    inside = s.collective_time_s("all-reduce", 256 * MB, [list(range(0, 8))])
    across = s.collective_time_s("all-reduce", 256 * MB, [list(range(0, 4)) + list(range(72, 76))])
    assert across > 2 * inside
    assert s.collective_timing("all-reduce", 256 * MB, [[0, 72]]).link == "infiniband"


def test_tpu_axis_without_wraparound_is_about_twice_as_slow():
    big = 64 * MB
    wrapped = get_system("tpu-v5e:16x16").collective_time_s("all-gather", big, [list(range(16))])
    # Same 16-chip ring on the y axis of an 8x16 slice has wraparound; x of 8 does not.
    s = get_system("tpu-v5e:8x16")
    open_line = s.collective_time_s("all-gather", big, [list(range(8))])
    # 8 chips on an open line vs 16 on a ring: (7/8) / (15/16) of the bytes, half the bandwidth.
    assert open_line / wrapped == pytest.approx(2 * (7 / 8) / (15 / 16), rel=0.02)


def test_strided_group_on_torus_pays_for_hops():
    s = get_system("tpu-v5e:16x16")
    # Four neighbours on an open stretch of the x ring vs four chips 4 apart: the strided
    # ring crosses 4 links per logical step and shares each with 3 other groups.
    contiguous = s.collective_time_s("all-gather", 64 * MB, [[0, 1, 2, 3]])
    strided = s.collective_time_s("all-gather", 64 * MB, [[0, 4, 8, 12]])
    assert strided == pytest.approx(2 * contiguous, rel=0.05)


def test_scaling_book_q2_all_gather_over_one_and_two_axes():
    # v4 4x4x4 (wraps), B=1024, D=4096 bf16. AG over X of [B_X, D_Y]: V = B*D*2/4 bytes;
    # book: T = V / W_bidi = 23 us; we keep the exact (n-1)/n = 3/4 of it.
    s = get_system("tpu-v4:4x4x4")
    v = 1024 * 4096 * 2 / 4
    t = s.collective_time_s("all-gather", v, [[0, 1, 2, 3]])
    assert t == pytest.approx(v * 3 / 4 / (9e10 * 0.95) + 2e-6, rel=0.01)
    xy = [x + 4 * y for y in range(4) for x in range(4)]
    t2 = s.collective_time_s("all-gather", 4 * v, [xy])
    assert t2 == pytest.approx(4 * v * 15 / 16 / (2 * 9e10 * 0.95) + 2e-6, rel=0.01)


# --- The scaling book's worked examples (shared/reference/collectives.md) ----------------
# Tolerance: 15% of the book's figure unless said. The model is not fitted to these.


def test_book_1_all_gather_over_an_axis_without_wraparound():
    # v5e mesh {X: 8, Y: 4}, all-gather over Y of bf16[E_Y, F], E=2048, F=8192. Y has 4 chips
    # and no wraparound: a one-way line. Book: 560 us one-way theory, 680 us measured.
    s = get_system("tpu-v5e:8x4")
    group = [0 + 8 * y for y in range(4)]  # x=0, y=0..3 (ids are x-fastest)
    t = s.collective_time_s("all-gather", 2048 * 8192 * 2, [group])
    assert t == pytest.approx(560e-6, rel=0.15)
    assert t == pytest.approx(680e-6, rel=0.15)


def test_book_2_all_reduce_over_z():
    # v4p 4x4x4, [B_X, D_Y] with B=1024, D=4096 bf16 all-reduced over Z: ~11.6 us.
    s = get_system("tpu-v4:4x4x4")
    group = [16 * z for z in range(4)]
    t = s.collective_time_s("all-reduce", 1024 * 4096 * 2 / 16, [group])
    assert t == pytest.approx(11.6e-6, rel=0.15)


def test_book_3_tiny_all_gather_is_latency_bound():
    s = get_system("tpu-v4:4x4x4")
    t = s.collective_time_s("all-gather", 128 * 2, [[0, 1, 2, 3]])
    assert t == pytest.approx(2e-6, rel=0.15)


def test_book_4_point_to_point_across_the_slice():
    # send bf16[8,128,8192] from (0,0) to (3,3) on v5e 4x4 (no wraparound): two disjoint
    # routes of 6 hops: ~188 us + 6 us.
    s = get_system("tpu-v5e:4x4")
    t = s.collective_time_s("collective-permute", 8 * 128 * 8192 * 2, [[0, 15]])
    assert t == pytest.approx(194e-6, rel=0.15)


def test_book_5_and_6_h100_all_gathers():
    s = get_system("h100:8")
    # 5: bf16[1024, 16384] = 33.5 MB over 8 GPUs: book ~65-75 us at the 450 GB/s link rate;
    # the measured curves at this size reach ~300 GB/s of busbw, not 450, so we land above
    # the book's theory, and within 1.5x of its 75 us.
    t5 = s.collective_time_s("all-gather", 1024 * 16384 * 2, [list(range(8))])
    assert 65e-6 < t5 < 1.5 * 75e-6
    # 6: 536e6 bytes: 1.04 ms in theory, ~1.5 ms in practice.
    t6 = s.collective_time_s("all-gather", 536e6, [list(range(8))])
    assert t6 == pytest.approx(1.5e-3, rel=0.15)
    assert t6 > 1.04e-3


# --- Published nccl-tests bus bandwidth (collectives.md), sizes >= 16 MB, within 15% -----


def busbw(system, kind, nbytes, group):
    t = system.collective_time_s(kind, nbytes, [group])
    return nbytes * bus_factor(kind, len(group)) / t


@pytest.mark.parametrize("nbytes, measured", [(16e6, 234.5e9), (67e6, 361.8e9),
                                              (268e6, 423.4e9), (1e9, 466.4e9), (8e9, 478.9e9)])
def test_h100_nvls_all_reduce_table(nbytes, measured):
    assert busbw(get_system("h100:8"), "all-reduce", nbytes, list(range(8))) == \
        pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("nbytes, measured", [(16e6, 331.1e9), (67e6, 550.7e9), (1e9, 646.9e9),
                                              (8e9, 679.6e9)])
def test_gb200_four_gpus_in_a_rack(nbytes, measured):
    assert busbw(get_system("gb200-nvl72:72"), "all-reduce", nbytes, [0, 1, 2, 3]) == \
        pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("mib, measured", [(512, 586.1e9), (1024, 681.2e9), (2048, 757.8e9),
                                           (4096, 839.2e9), (8192, 834.6e9)])
def test_gb200_full_rack(mib, measured):
    assert busbw(get_system("gb200-nvl72:72"), "all-reduce", mib * 2**20, list(range(72))) == \
        pytest.approx(measured, rel=0.15)


def test_small_collectives_choose_latency_optimal_algorithms():
    s = get_system("h100:64")
    small = s.collective_timing("all-reduce", 64e3, [list(range(64))])
    large = s.collective_timing("all-reduce", 4e9, [list(range(64))])
    assert "tree" in small.algorithm and "LL" in small.algorithm
    assert "Simple" in large.algorithm
    tiny = s.collective_timing("all-reduce", 1e3, [list(range(8))])
    assert tiny.algorithm.startswith("ring (LL") and tiny.time_s > 5e-6
