"""The calibrated efficiencies: applied exactly by the model, fitted reproducibly."""

import json
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshes
from experiments.calibrate import calibrate, fit, leave_one_out, predict
from experiments.config import load_calibration
from meshes.calibration import CATALOG_FILE, IDENTITY, PARAMETERS, Calibration
from sharding.compute import compute_cost
from sharding.hlo import parse_hlo
from tests.conftest import REPO

H100 = meshes.get_system("h100:8").chip
TRUE = {"gpu_bf16_matmul_efficiency": 0.6, "tpu_matmul_scale": 0.75,
        "flash_attention_efficiency": 0.7, "kernel_overhead_s": 5e-6}


def synthetic_cases(n: int = 12, seed: int = 0):
    """Runs with a spread of GPU bf16, TPU, measured-rate and attention math, kernels,
    memory-bound time and exposed communication, and their steps under TRUE."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        vendor = ("gpu_bf16", "tpu", "measured")[i % 3]
        math_s = {vendor: float(rng.uniform(0.5, 5)),
                  f"{vendor}/attention": float(rng.uniform(0.05, 1.5))}
        if i % 4 == 0:
            math_s["measured"] = math_s.get("measured", 0) + float(rng.uniform(0.1, 1))
        features = {"math_s": math_s, "kernels": float(rng.integers(2_000, 200_000)),
                    "other_s": float(rng.uniform(0.1, 1)), "exposed_s": float(rng.uniform(0, .3))}
        cases.append((features, predict(features, {**IDENTITY.values(), **TRUE})))
    return cases


def test_fit_recovers_known_parameters_within_two_percent():
    values = fit(synthetic_cases())
    for name, true in TRUE.items():
        assert values[name] == pytest.approx(true, rel=0.02), name


def test_leave_one_out_of_consistent_runs_predicts_each():
    cases = synthetic_cases()
    for (_, measured), estimate in zip(cases, leave_one_out(cases)):
        assert estimate == pytest.approx(measured, rel=0.02)


def test_calibrate_lists_what_informs_each_parameter():
    cases = [(f"run{i}", f, m) for i, (f, m) in enumerate(synthetic_cases())]
    result = calibrate(cases)
    # Runs 0, 3, 6, 9 are GPU bf16; 1, 4, 7, 10 TPU; every run has attention math.
    assert result.informed_by["gpu_bf16_matmul_efficiency"] == ["run0", "run3", "run6", "run9"]
    assert result.informed_by["tpu_matmul_scale"] == ["run1", "run4", "run7", "run10"]
    assert len(result.informed_by["flash_attention_efficiency"]) == 12
    assert max(abs(e) for e in result.fitted_errors) < 0.01


def test_the_catalog_equals_a_fresh_fit_of_the_validation_set():
    data = json.loads((REPO / "experiments/validation/features.json").read_text())
    values = fit([(c["features"], c["measured_s"]) for c in data["cases"]])
    catalog = tomllib.loads(CATALOG_FILE.read_text())["parameters"]
    assert set(catalog) == set(PARAMETERS)
    for name, value in values.items():
        assert catalog[name] == pytest.approx(value, rel=1e-4, abs=1e-9), name


def test_the_model_applies_a_calibration_exactly():
    # One 4096 x 8192 x 2048 bf16 matmul on H100: the catalog rate 989 TFLOP/s x 0.80 x
    # the size curve (1217 / 1290 at 4096^3-equivalent); calibrated, 0.6 instead of 0.80,
    # plus 5 us for the kernel.
    a = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
    module = parse_hlo(jax.jit(lambda a, b: a @ b).lower(a, b).as_text(dialect="hlo"))
    flops = 2 * 4096 * 8192 * 2048
    cal = Calibration(gpu_bf16_matmul_efficiency=0.6, kernel_overhead_s=5e-6)
    plain, fitted = compute_cost(module, H100), compute_cost(module, H100, calibration=cal)
    assert plain.matmul_s == pytest.approx(flops / (989e12 * 0.80 * 1217 / 1290))
    assert fitted.matmul_s == pytest.approx(flops / (989e12 * 0.6 * 1217 / 1290) + 5e-6)
    assert fitted.kernels == 1 and fitted.math_s_by_class == {
        "gpu_bf16": pytest.approx(flops / (989e12 * 0.6 * 1217 / 1290))}


def test_report_features_reproduce_its_step(cpu_devices):
    # The decomposition the fit uses, evaluated at the calibration the report used, is the
    # report's own step.
    import models
    import sharding
    from tests.steps import train_program

    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 2, "fsdp": 4})
    prog = train_program(models.preset("tiny"), mesh, seq_len=32, global_batch=16)
    cal = Calibration(gpu_bf16_matmul_efficiency=0.5, flash_attention_efficiency=0.6,
                      kernel_overhead_s=3e-6)
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system="h100:8", calibration=cal)
    assert predict(rep.calibration_features(), cal.values()) == \
        pytest.approx(rep.step_time_s, rel=1e-9)
    assert rep.to_dict()["calibration"]["kernel_overhead_s"] == 3e-6


@pytest.mark.parametrize("text, fragment", [
    ("[parameters]\nmatmul = 0.5\n", "unknown calibration parameter 'matmul'"),
    ("[parameters]\ntpu_matmul_scale = 3.0\n", "tpu_matmul_scale=3.0"),
])
def test_bad_calibration_files_are_one_line(tmp_path, text, fragment):
    p = tmp_path / "cal.toml"
    p.write_text(text)
    with pytest.raises(ValueError, match=fragment) as e:
        load_calibration(p)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not found"):
        load_calibration(tmp_path / "missing.toml")


def test_best_measured_mfu_needs_two_runs_of_a_family():
    from experiments.calibrate import best_mfu
    from experiments.validate import Row

    def r(name, family, mfu_est, est, meas):
        return Row(name=name, path="", family=family, measured_s=meas, status="ok",
                   estimate_s=est, mfu=mfu_est)

    rows = [r("a", "h100 bf16", 0.6, 1.0, 1.2), r("b", "h100 fp8", 0.6, 1.0, 0.8),
            r("c", "tpu-v6e bf16", 0.6, 1.0, 1.5)]
    # Measured MFU with our FLOP count = 0.6 x estimate / measured.
    assert best_mfu(rows) == {"h100": (pytest.approx(0.75), "b")}


def test_an_estimate_above_the_best_measured_mfu_is_flagged(cpu_devices):
    import models
    import sharding
    from tests.steps import train_program

    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 8})
    prog = train_program(models.preset("tiny"), mesh, seq_len=32, global_batch=16)
    kw = dict(mesh=mesh, system="h100:8", model_flops_per_step=1e18)  # an absurd MFU
    low = Calibration(best_mfu={"h100": (0.5, "some run")})
    rep = sharding.analyze(prog.step, *prog.args, calibration=low, **kw)
    assert rep.mfu > 0.5
    assert "above the best measured on h100 (50.0%, some run)" in rep.suspect_mfu()
    assert "suspect" in rep.format_table() and rep.to_dict()["suspect_mfu"]
    assert sharding.analyze(prog.step, *prog.args, calibration=IDENTITY, **kw).suspect_mfu() \
        is None


def test_run_takes_a_calibration_file(tmp_path, capsys, cpu_devices):
    from tests.test_cli import TINY, run_cli, write

    config = write(tmp_path, TINY)
    code, _, err = run_cli(["run", config, "--calibration", str(tmp_path / "none.toml")], capsys)
    assert code == 2 and "calibration file" in err and err.count("\n") == 1
    cal = tmp_path / "mine.toml"
    cal.write_text('[parameters]\ngpu_bf16_matmul_efficiency = 0.4\n'
                   '[provenance]\nsummary = "my cluster, 3 runs"\n')
    code, out, _ = run_cli(["run", config, "--calibration", str(cal)], capsys)
    assert code == 0 and "calibration    my cluster, 3 runs" in out
