"""A TPU step's fixed cost per kernel is the time of one op measured on a TPU
(meshes.chips.TPU_OP_S, a microbenchmark), not the calibration's kernel_overhead_s fitted on
GPU steps; and the estimate against the public TPU decode runs held out in
tests/data/tpu_decode.toml and experiments/published, none of which anything is fitted on."""

import tomllib
from pathlib import Path

import pytest

from experiments import config, runner
from meshes import get_system
from meshes.calibration import catalog_calibration
from meshes.chips import CHIPS, TPU_OP_S

# The tiny model decoding on one TPU7x chip's 2 TensorCores (tensor parallelism 2), 8
# users, 64 cached tokens (Google has no 2-chip v5p slice).
TINY_DECODE = {
    "name": "tiny-tpu-decode", "model": {"preset": "tiny"}, "system": {"name": "tpu7x:1x1x1"},
    "parallelism": {"tensor": 2},
    "workload": {"kind": "decode", "seq_len": 64, "global_batch": 8},
    "precision": {"params": "bfloat16"},
}


def run(raw: dict, **changes):
    """The report of `raw` with tables replaced by `changes` ({"workload": {...}, ...})."""
    return runner.run(config.from_dict({**raw, **changes}))


@pytest.mark.parametrize("kind", ["decode", "train"])
def test_a_tpu_kernel_pays_the_op_time_measured_on_a_tpu_not_the_gpu_fit(cpu_devices, kind):
    # A TPU runs its compiled program's ops itself, in a training step as in decode: each
    # kernel's fixed cost is the 1.6 us measured for one op on TPU7x, not the 13.6 us the
    # calibration fitted on GPU steps (whose kernels a host launches).
    rep = run(TINY_DECODE, workload={**TINY_DECODE["workload"], "kind": kind})
    n = rep.compute.kernels
    assert n > 0
    assert catalog_calibration().kernel_overhead_s > 5 * TPU_OP_S  # the fit: ~13.6 us
    assert TPU_OP_S == 1.6e-6
    assert rep.compute.overhead_s == pytest.approx(n * TPU_OP_S)
    assert rep.program_op_s == TPU_OP_S and rep.to_dict()["program_op_s"] == 1.6e-6
    assert rep.cuda_graph_kernel_s is None
    # the kernels are not the fit's: calibrate sees none, their cost in the rest of compute
    features = rep.calibration_features()
    assert features["kernels"] == 0
    assert features["other_s"] == pytest.approx(
        rep.compute_s - sum(rep.compute.math_s_by_class.values()))


def test_a_tpu_decode_step_says_where_its_cost_per_kernel_comes_from(cpu_devices):
    line = run(TINY_DECODE).time_bottleneck()
    assert "1.6 us" in line and "a TPU op's own time, measured on TPU7x" in line
    assert "fitted on GPU training steps" not in line


def test_only_tpus_sequence_their_own_ops():
    # The figure is a TPU's; a GPU's kernels are launched by a host (the fit, or CUDA
    # graphs' launch when serving), and Trainium, which borrows the TPU's matmul curve, has
    # no public per-op measurement.
    tpus = {name for name in CHIPS if name.startswith("tpu")}
    assert tpus == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu7x"}
    for name, chip in CHIPS.items():
        assert chip.program_op_s == (TPU_OP_S if name in tpus else None), name
        assert ("tpu-recipes" in chip.program_op_source) == (name in tpus), name
    # `shardscope systems` shows the figure with its source where a chip has one
    op = dict(get_system("tpu-v6e:2x4").describe())["op"]
    assert op.startswith("1.6 us fixed time per op") and "TPU7x" in op
    assert "op" not in dict(get_system("h100:8").describe())
    assert "op" not in dict(get_system("trn2:4x4").describe())


LLAMA3_70B_V6E_DECODE = {
    "name": "llama3-70b-v6e-8-decode", "model": {"preset": "llama3-70b"},
    "system": {"name": "tpu-v6e:2x4"}, "parallelism": {"tensor": 8},
    "workload": {"kind": "decode", "seq_len": 1500, "global_batch": 64},
    "precision": {"params": "bfloat16", "compute": "bfloat16"},
}


def test_int8_weights_decode_faster_than_bf16_on_a_tpu(cpu_devices):
    # Llama 3 70B on a v6e-8: int8 weights read 14.1 GB a chip a step where bf16 reads 22.8;
    # dequantising them adds kernels (2,573 against 2,013), which at 13.6 us each made the
    # int8 step the slower one (45.4 ms against 44.2).
    bf16 = runner.run(config.from_dict(LLAMA3_70B_V6E_DECODE))
    int8 = runner.run(config.from_dict({**LLAMA3_70B_V6E_DECODE, "precision": {
        **LLAMA3_70B_V6E_DECODE["precision"], "weights": "int8"}}))
    assert int8.compute.hbm_bytes < 0.7 * bf16.compute.hbm_bytes
    assert int8.compute.kernels > bf16.compute.kernels
    assert int8.step_time_s < 0.85 * bf16.step_time_s


DATA = tomllib.loads((Path(__file__).parents[1] / "data" / "tpu_decode.toml").read_text())
REPO = Path(__file__).parents[2]


def decode_config(p: dict) -> dict:
    """A point's decode step at the run's mean cache length, as an experiment config."""
    return {"name": p["name"], "model": p["model"], "system": {"name": p["system"]},
            "parallelism": {"tensor": p["tp"]},
            "workload": {"kind": "decode", "seq_len": p["input"] + p["output"] // 2,
                         "global_batch": p["concurrency"]},
            "precision": {"params": "bfloat16", "compute": "bfloat16"}}


def _open(p: dict) -> list:
    return [pytest.mark.xfail(strict=True, reason=p["why"])] if p.get("open") else []


@pytest.mark.parametrize("point", [pytest.param(p, id=p["name"], marks=_open(p))
                                   for p in DATA["point"]])
def test_decode_step_within_15_percent_of_published_tpu_engine_runs(cpu_devices, point):
    rep = runner.run(config.from_dict(decode_config(point)))
    assert rep.step_time_s == pytest.approx(point["median_tpot_s"], rel=0.15), point["what"]


@pytest.mark.parametrize("case", [pytest.param(c, id=Path(c["config"]).stem, marks=_open(c))
                                  for c in DATA["published"]])
def test_published_tpu_decode_proxies_within_15_percent(cpu_devices, case):
    exp = config.load(REPO / case["config"])
    assert exp.workload.kind == "decode" and exp.system.chip.program_op_s == TPU_OP_S
    rep = runner.run(exp)
    assert rep.step_time_s == pytest.approx(exp.measured.step_time_s, rel=0.15)


def test_every_held_out_point_names_its_source_and_what_was_measured():
    for p in DATA["point"]:
        assert p["source"].startswith("https://github.com/") and p["what"], p["name"]
        assert not p.get("open") or p.get("why"), p["name"]
    for c in DATA["published"]:
        assert (REPO / c["config"]).is_file(), c["config"]
        assert not c.get("open") or c.get("why"), c["config"]
