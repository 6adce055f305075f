"""What every system shares (meshes/system.py): the nccl-tests bus factors."""

import pytest

from meshes import bus_factor


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all-reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all-gather", 4) == pytest.approx(3 / 4)
    assert bus_factor("collective-permute", 2) == 1.0
