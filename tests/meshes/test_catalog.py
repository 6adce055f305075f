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
    # Past one 4x4x4 cube a v4/v5p/TPU7x slice is whole cubes (Cloud TPU docs: all <= 4 or
    # all multiples of 4); the message names the nearest slices below and above
    ("tpu-v5p:8x8x7", "larger than one 4x4x4 cube is whole cubes, so every dimension is a "
                      "multiple of 4 .*; 8x8x7 is not; e.g. tpu-v5p:8x8x4 .256 chips. or "
                      "tpu-v5p:8x8x8 .512 chips.$"),
    ("tpu7x:2x8x8", "whole cubes.*e.g. tpu7x:4x4x8 .128 chips. or tpu7x:4x8x8 .256 chips.$"),
    ("tpu-v4:4x4x6", "whole cubes.*e.g. tpu-v4:4x4x4 .64 chips. or tpu-v4:4x4x8"),
    # Below one cube, v4 and v5p come in four shapes (Cloud TPU v5p docs' configurations:
    # 2x2x1, 2x2x2, 2x4x4; v5p-32 and xpk: 2x2x4), TPU7x also as one chip (MaxText's
    # accelerator_to_spec_map: tpu7x-2 = 1x1x1), turned about with a host's 2x2 chips kept
    ("tpu-v5p:1x1x2", "below one 4x4x4 cube of 2x2x1, 2x2x2, 2x2x4, 2x4x4 only.*; 1x1x2 is "
                      "not; e.g. tpu-v5p:2x2x2 .8 chips.$"),
    ("tpu-v5p:2x2x3", "2x2x3 is not; e.g. tpu-v5p:2x2x2 .8 chips. or tpu-v5p:2x2x4 .16 chips.$"),
    ("tpu-v4:1x1x1", "Google provisions tpu-v4 slices below one 4x4x4 cube .*; 1x1x1 is not; "
                     "e.g. tpu-v4:2x2x1 .4 chips.$"),
    ("tpu-v5p:1x2x2", "keeps a host's 2x2 chips in the first two dimensions"),
    ("tpu7x:1x1x4", "tpu7x slices below one 4x4x4 cube of 1x1x1, 2x2x1, 2x2x2, 2x2x4, 2x4x4 "
                    "only"),
    # v5e and v6e come in eight 2D shapes (no custom ones), either way round
    ("tpu-v5e:1x8", "Google provisions tpu-v5e slices of 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, "
                    "16x16 only .*; 1x8 is not; e.g. tpu-v5e:2x4 .8 chips."),
    ("tpu-v6e:12x16", "e.g. tpu-v6e:8x16 .128 chips. or tpu-v6e:16x16 .256 chips.$"),
    # Google's accelerator types: a size with no slice names the nearest and the sizes
    ("v5p-24", "'v5p-24': the number of v5p-N counts TensorCores .2 a chip., and Google has "
               "no tpu-v5p slice of 24; the nearest are v5p-16 and v5p-32 .sizes: v5p-8, "
               "v5p-16, v5p-32, v5p-64, v5p-128, "),
    ("v6e-12", "v6e-N counts chips.*the nearest are v6e-8 and v6e-16 .sizes: v6e-1, v6e-4, "
               "v6e-8, v6e-16, v6e-32, v6e-64, v6e-128, v6e-256.,"),
    ("v5p-1000", "the nearest are v5p-896 and v5p-1024"),
    ("tpu7x-3", "tpu7x-N counts TensorCores .2 a chip."),
    ("v5p-256*0", "'v5p-256\\*0': \\*0 slices"),
    ("v9-8", "needs the form <family>:<size> or a TPU accelerator type"),
])
def test_bad_system_names_say_what_is_valid(name, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")) as e:
        get_system(name)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name, system, chips", [
    # The number counts chips on v5e and v6e; the shape is Google's for the size (Cloud TPU
    # v5e docs' 2D shapes; MaxText accelerator_to_spec_map.py: v6e-256 = v6e:16x16)
    ("v6e-256", "tpu-v6e:16x16", 256),
    ("v6e-8", "tpu-v6e:2x4", 8),
    ("v5litepod-256", "tpu-v5e:16x16", 256),
    ("v5e-128", "tpu-v5e:8x16", 128),
    # It counts TensorCores, 2 a chip, on v4 and v5p; the shape is the most cube-like
    # (Cloud TPU v5p docs: v5p-256 is 2 cubes, 4x4x8; MaxText: v5p-768 = v5:4x8x12,
    # v5p-2048 = v5:8x8x16; Cloud TPU v4 docs: v4-128 = 4x4x4)
    ("v5p-8", "tpu-v5p:2x2x1", 4),
    ("v5p-32", "tpu-v5p:2x2x4", 16),
    ("v5p-256", "tpu-v5p:4x4x8", 128),
    ("v5p-768", "tpu-v5p:4x8x12", 384),
    ("v5p-2048", "tpu-v5p:8x8x16", 1024),
    ("v4-128", "tpu-v4:4x4x4", 64),
    # and on TPU7x, whose chip is two JAX devices (MaxText: tpu7x-256 = tpu7x:4x4x8,
    # tpu7x-9216 = tpu7x:12x16x24, tpu7x-2 = 1x1x1)
    ("tpu7x-256", "tpu7x:4x4x8", 128),
    ("tpu7x-9216", "tpu7x:12x16x24", 4608),
    ("tpu7x-2", "tpu7x:1x1x1", 1),
    # several slices over DCN, as shardscope writes them
    ("v6e-256*2", "tpu-v6e:16x16*2", 512),
])
def test_accelerator_types_are_googles_default_slices(name, system, chips):
    s = get_system(name)
    assert (s.name, s.num_chips) == (system, chips)
    assert s.num_devices == chips * s.chip.devices_per_chip
    # the report's header says the translation
    assert s.placement == f"{name} = {system}, {chips} chip{'s' * (chips != 1)}"
    assert get_system(system).placement == ""


def test_every_slice_google_lists_is_valid():
    # The shapes in Google's tables (Cloud TPU v5p docs' configurations, v5e docs' 2D
    # shapes) and the whole-cube ones MaxText's accelerator_to_spec_map.py lists
    for name in ("tpu-v5p:2x2x1", "tpu-v5p:2x4x4", "tpu-v5p:4x4x28", "tpu-v5p:16x16x24",
                 "tpu-v5p:16x20x28", "tpu7x:4x4x20", "tpu7x:16x24x24", "tpu-v4:8x16x16",
                 "tpu-v5e:1x1", "tpu-v5e:8x16", "tpu-v6e:16x8", "tpu-v6e:4x8",
                 "tpu7x:1x1x1", "tpu7x:2x2x1", "tpu-v4:2x2x4", "tpu-v5p:4x4x2"):
        assert get_system(name).name == name


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
