"""`[serving] cuda_graphs`: a GPU decode step replayed as a CUDA graph pays a kernel launch
per kernel (meshes.chips.CUDA_GRAPH_KERNEL_S, a microbenchmark), not the fixed time fitted
on training steps; and the estimate against the public decode runs held out in
tests/data/serving_decode.toml, none of which anything is fitted on."""

import tomllib
from pathlib import Path

import pytest

from experiments import config, runner
from meshes.calibration import catalog_calibration
from meshes.chips import CUDA_GRAPH_KERNEL_S

# The tiny model decoding on 2 H100s (tensor parallelism 2), 8 users with 64 cached tokens.
TINY_DECODE = {
    "name": "tiny-decode", "model": {"preset": "tiny"}, "system": {"name": "h100:2"},
    "parallelism": {"tensor": 2},
    "workload": {"kind": "decode", "seq_len": 64, "global_batch": 8},
    "precision": {"params": "bfloat16"},
}


def run(raw: dict, **changes):
    """The report of `raw` with tables updated by `changes` ({"serving": {...}, ...})."""
    return runner.run(config.from_dict({**raw, **changes}))


def test_cuda_graphs_replace_the_fitted_time_per_kernel_by_the_launch(cpu_devices):
    fit = catalog_calibration().kernel_overhead_s  # 13.6 us, fitted on training steps
    on = run(TINY_DECODE)  # the default: engines replay decode as CUDA graphs
    off = run(TINY_DECODE, serving={"cuda_graphs": False})
    n = off.compute.kernels
    assert n > 0 and on.compute.kernels == pytest.approx(n)  # the same program
    # each kernel pays the fit without CUDA graphs and the 1.3 us launch with them; its
    # bytes and FLOPs take the same time either way
    assert off.compute.overhead_s == pytest.approx(n * fit)
    assert on.compute.overhead_s == pytest.approx(n * 1.3e-6)
    assert on.compute_s == pytest.approx(off.compute_s - n * (fit - 1.3e-6))
    assert on.cuda_graph_kernel_s == CUDA_GRAPH_KERNEL_S == 1.3e-6
    assert off.cuda_graph_kernel_s is None
    # the bottleneck line says which cost the decode step stands on
    assert "launches under CUDA graphs" in on.time_bottleneck()
    assert "1.3 us each" in on.time_bottleneck() or "1.3 us fixed cost" in on.time_bottleneck()
    assert "launches under CUDA graphs" not in off.time_bottleneck()
    assert "fitted on GPU training steps" in off.time_bottleneck()
    assert on.to_dict()["cuda_graph_kernel_s"] == 1.3e-6
    assert off.to_dict()["cuda_graph_kernel_s"] is None


@pytest.mark.parametrize("changes", [
    {"workload": {"kind": "prefill", "seq_len": 64, "global_batch": 8}},  # engines: decode
    {"workload": {"kind": "train", "seq_len": 64, "global_batch": 8}},
    {"system": {"name": "tpu7x:1x1x1"}},  # no CUDA on a TPU (2 devices, one chip)
], ids=["prefill", "train", "tpu"])
def test_cuda_graphs_touch_only_a_gpu_decode_step(cpu_devices, changes):
    on = run(TINY_DECODE, **changes)
    off = run(TINY_DECODE, **changes, serving={"cuda_graphs": False})
    assert on.compute.kernels > 0
    assert on.compute_s == pytest.approx(off.compute_s)
    assert on.cuda_graph_kernel_s is None
    assert "launches under CUDA graphs" not in on.time_bottleneck()


POINTS = tomllib.loads(
    (Path(__file__).parents[1] / "data" / "serving_decode.toml").read_text())["point"]
PRECISION = {"fp8": {"params": "bfloat16", "compute": "float8", "weights": "float8",
                     "kv_cache": "float8"},
             "fp16": {"params": "bfloat16", "compute": "bfloat16"}}


def decode_config(p: dict) -> dict:
    """A point's decode step at the run's mean cache length, as an experiment config."""
    return {"name": p["name"], "model": p["model"], "system": {"name": p["system"]},
            "parallelism": {"tensor": p["tp"]},
            "workload": {"kind": "decode", "seq_len": p["input"] + p["output"] // 2,
                         "global_batch": p["batch"]},
            "precision": PRECISION[p["precision"]]}


@pytest.mark.parametrize("point", [
    pytest.param(p, id=p["name"], marks=[pytest.mark.xfail(strict=True, reason=p["why"])]
                 if p.get("open") else []) for p in POINTS])
def test_decode_step_within_15_percent_of_published_engine_runs(cpu_devices, point):
    measured_s = point["batch"] / (point["tok_s_per_gpu"] * point["tp"])
    rep = runner.run(config.from_dict(decode_config(point)))
    assert rep.step_time_s == pytest.approx(measured_s, rel=0.15), point["what"]


def test_every_held_out_point_names_its_source_and_what_was_measured():
    for p in POINTS:
        assert p["source"].startswith("https://github.com/") and p["what"], p["name"]
        assert p["precision"] in PRECISION, p["name"]
        assert not p.get("open") or p.get("why"), p["name"]


def test_a_fit_on_a_decode_step_under_cuda_graphs_leaves_its_launches_alone(cpu_devices):
    # `shardscope calibrate` on a user's measured decode runs: the launches under CUDA
    # graphs are a microbenchmark's, not kernel_overhead_s's, so that run's step must not
    # move with the fitted time per kernel (it would steer the fit to explain it).
    from experiments.calibrate import predict

    on, off = run(TINY_DECODE), run(TINY_DECODE, serving={"cuda_graphs": False})
    values = catalog_calibration().values()
    for rep in (on, off):  # the decomposition adds up to the estimate at the fit's values
        assert predict(rep.calibration_features(), values) == pytest.approx(rep.step_time_s)
    never, slow = {**values, "kernel_overhead_s": 0.0}, {**values, "kernel_overhead_s": 5e-5}
    f = on.calibration_features()
    assert f["kernels"] == 0 and predict(f, never) == pytest.approx(predict(f, slow))
    g = off.calibration_features()
    assert predict(g, slow) - predict(g, never) == pytest.approx(g["kernels"] * 5e-5)
