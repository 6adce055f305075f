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
