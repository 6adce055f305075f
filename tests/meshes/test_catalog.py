"""The system catalog (meshes/catalog.py): names and overrides, and what is valid."""

import pytest

from meshes import get_system

MB = 1e6


@pytest.mark.parametrize("name, fragment", [
    ("h100", "<family>:<size>"),
    ("dgx:8", "unknown system family 'dgx' in 'dgx:8'; valid: a100:8"),
    ("b20O:8", "unknown system family 'b20O' in 'b20O:8'; did you mean b200:8\\? valid:"),
    # the rack's chip is gb200, the HGX node's b200: a family the name begins comes first
    ("gb200:128", "did you mean gb200-nvl72:128\\?"),
    ("tpu7:64", "did you mean tpu7x:64\\?"),
    ("tpu-v5e:4x4x4", "2D"),
    ("tpu-v5e:32x32", "the largest tpu-v5e slice is 16x16"),
    # MaxText's "4 slices of 256" written as a shape: the message names the *N form
    ("tpu-v5e:4x256", "the largest tpu-v5e slice is 16x16 .more chips are slices over "
                      "DCN, \\*N.; 4x256 is not; e.g. tpu-v5e:16x16\\*4 .4 slices over DCN"),
    # a zero dimension is not a wrong dimension count; a zero slice count is not the shape's
    ("tpu-v5e:0x4", "each dimension of a tpu-v5e slice is at least 1; 0x4 is not"),
    ("tpu-v5e:2x4*0", "\\*0 slices; give at least one, e.g. tpu-v5e:2x4\\*2"),
])
def test_bad_system_names_say_what_is_valid(name, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")) as e:
        get_system(name)
    assert "\n" not in str(e.value)


def test_device_ids_outside_the_system_are_an_error():
    s = get_system("h100:8")
    with pytest.raises(ValueError, match="device id 8 is outside"):
        s.collective_time_s("all-reduce", MB, [[0, 8]])


@pytest.mark.parametrize("name, overrides, fragment", [
    ("h100:8", {"nic_gb": 100}, "unknown system override 'nic_gb'; valid: nic_gbps, sharp"),
    ("tpu-v5e:4x4*2", {"sharp": True}, "applies to GPU systems"),
    ("h100:8", {"dcn_gbps": 100}, "applies to TPU systems"),
    ("h100:8", {"nic_gbps": -1}, "must be a positive float"),
    ("gb200-nvl72:72", {"gpus_per_domain": 96}, "exceeds the 72 GPUs"),
    ("tpu-v5e:4x4", {"dcn_gbps": 100}, "one slice"),
    # a pod is whole nodes, and a spine tapers (below 1 it was read as non-blocking)
    ("h100:64", {"pod_gpus": 12}, "pod_gpus=12 is not whole NVLink domains of 8 GPUs"),
    ("gb200-nvl72:512", {"pod_gpus": 128, "gpus_per_domain": 64}, None),
    ("h100:64", {"pod_oversubscription": 0.5}, "pod_oversubscription=0.5 must be a finite"),
    ("h100:64", {"pod_oversubscription": float("nan")}, "pod_oversubscription=nan must be"),
    ("h100:64", {"pod_oversubscription": float("inf")}, "pod_oversubscription=inf must be"),
])
def test_bad_overrides_say_what_is_valid(name, overrides, fragment):
    if fragment is None:  # valid: 2 racks of 64 used GPUs in each pod
        get_system(name, **overrides)
        return
    with pytest.raises(ValueError, match=fragment) as e:
        get_system(name, **overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("chip, mib", [("a100", 81920), ("h100", 81559), ("h200", 143771),
                                       ("b200", 183359), ("gb200", 189471),
                                       ("gb300", 284208)])
def test_gpu_hbm_is_what_the_driver_reports(chip, mib):
    # one convention for every GPU: nvidia-smi's memory.total, in MiB (sources in
    # meshes/chips.py); H200's "141GB" read as 141e9 bytes was 9.75e9 bytes short
    from meshes.chips import CHIPS

    assert CHIPS[chip].hbm_bytes == mib * 2**20


def test_systems_says_what_each_hbm_figure_is():
    # A user read "86 GB" for an H100 whose datasheet says 80GB: the figure is the driver's
    # total, 81559 MiB = 79.65 GiB (2^30 bytes) = 85.52 GB (1e9 bytes); `shardscope
    # systems` says so, with its source, and every chip's figure says what it is.
    from meshes import get_system
    from meshes.chips import CHIPS

    assert all(c.hbm_source for c in CHIPS.values())
    rows = dict(get_system("h100:8").describe())
    assert rows["hbm"].startswith("81,559 MiB = 79.65 GiB = 85.52 GB per device: "
                                  "nvidia-smi's memory.total on an H100 80GB HBM3")
    # a TPU's is XLA's, in GiB; a TPU7x device is one TensorCore, half the chip's
    assert dict(get_system("tpu7x:2x2x1").describe())["hbm"].startswith(
        "98,304 MiB = 96.00 GiB = 103.08 GB per device: half the chip's 192 GiB")
