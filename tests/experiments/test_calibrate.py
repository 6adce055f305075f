"""`shardscope calibrate` (experiments/calibrate.py): the efficiencies fitted reproducibly,
and the best measured MFU per family."""

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from experiments.calibrate import calibrate, fit, leave_one_out, predict
from meshes.calibration import CATALOG_FILE, IDENTITY, PARAMETERS
from tests.conftest import REPO

TRUE = {"gpu_bf16_matmul_efficiency": 0.6, "tpu_matmul_scale": 0.75,
        "flash_attention_efficiency": 0.7, "tpu_flash_attention_efficiency": 0.4,
        "kernel_overhead_s": 5e-6}


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
    # Runs 0, 3, 6, 9 are GPU bf16; 1, 4, 7, 10 TPU; every run has attention math, on
    # the TPU runs their own kernel's.
    assert result.informed_by["gpu_bf16_matmul_efficiency"] == ["run0", "run3", "run6", "run9"]
    assert result.informed_by["tpu_matmul_scale"] == ["run1", "run4", "run7", "run10"]
    assert result.informed_by["tpu_flash_attention_efficiency"] == result.informed_by[
        "tpu_matmul_scale"]
    assert len(result.informed_by["flash_attention_efficiency"]) == 8
    assert max(abs(e) for e in result.fitted_errors) < 0.01


def test_the_catalog_equals_a_fresh_fit_of_the_validation_set():
    data = json.loads((REPO / "experiments/validation/features.json").read_text())
    values = fit([(c["features"], c["measured_s"]) for c in data["cases"]])
    catalog = tomllib.loads(CATALOG_FILE.read_text())["parameters"]
    assert set(catalog) == set(PARAMETERS)
    for name, value in values.items():
        assert catalog[name] == pytest.approx(value, rel=1e-4, abs=1e-9), name


def test_best_measured_mfu_needs_two_runs_of_a_family():
    from experiments.calibrate import best_mfu
    from experiments.validate import Row

    def r(name, family, mfu_est, est, meas):
        return Row(name=name, path="", family=family, measured_s=meas, status="ok",
                   estimate_s=est, mfu=mfu_est)

    rows = [r("a", "h100 fp8", 0.6, 1.0, 1.2), r("b", "h100 fp8", 0.6, 1.0, 0.8),
            r("c", "tpu-v6e bf16", 0.6, 1.0, 1.5), r("d", "h100 bf16", 0.6, 1.0, 0.5)]
    # Measured MFU with our FLOP count = 0.6 x estimate / measured; a family is a system
    # family and a matmul format (d's bf16 run is no ceiling for FP8 runs, nor alone one).
    assert best_mfu(rows) == {"h100 fp8": (pytest.approx(0.75), "b")}


def test_each_matmul_rate_class_has_its_own_parameter():
    # bf16 on GPUs: a fraction of peak (the book's 0.8 uncalibrated); FP8 / FP4 on GPUs and
    # TPU matmuls: a share of their microbenchmarked GEMM rate; the rates `measure`
    # benchmarked on this machine: none.
    from meshes import get_system
    from meshes.calibration import Calibration
    from meshes.host import HostChip

    cal = Calibration(gpu_bf16_matmul_efficiency=0.4, gpu_low_precision_matmul_scale=0.7,
                      tpu_matmul_scale=0.9)
    h100, v6e = get_system("h100:8").chip, get_system("tpu-v6e:2x4").chip
    host = HostChip(name="host-cpu", tdp_w=None, matmul_efficiency=1.0, hbm_efficiency=1.0,
                    peak_flops_per_s={"float32": 1e11}, hbm_bytes=1e9, hbm_bytes_per_s=1e10,
                    low_precision_efficiency={"float32": 1.0}, source="test")
    factors = {(chip.name, dtype): cal.rate_factor(Calibration.rate_class(chip, dtype))
               for chip, dtype in [(h100, "bfloat16"), (h100, "float8_e4m3fn"),
                                   (v6e, "bfloat16"), (host, "float32")]}
    assert factors == {("h100", "bfloat16"): pytest.approx(0.4 / 0.8),
                       ("h100", "float8_e4m3fn"): 0.7, ("tpu-v6e", "bfloat16"): 0.9,
                       ("host-cpu", "float32"): 1.0}


def test_no_parameter_scales_the_rates_measured_on_this_host():
    # "host": the rates `measure` benchmarked here, "which no fit scales": a GPU flash
    # attention efficiency of 0.2 took a host-cpu:8 step with flash attention from 83 to
    # 143 ms, and a host run with flash attention informed the GPUs' parameter.
    from experiments.calibrate import informs
    from meshes.calibration import Calibration

    cal = Calibration(flash_attention_efficiency=0.2, tpu_flash_attention_efficiency=0.3)
    assert cal.attention_factor("host") == 1.0
    assert (cal.attention_factor("gpu_bf16"), cal.attention_factor("tpu")) == (0.2, 0.3)
    host = {"math_s": {"host": 1.0, "host/attention": 1.0}, "kernels": 0.0, "other_s": 0.1,
            "exposed_s": 0.0}
    assert not any(informs(host, name) for name in PARAMETERS)
    assert predict(host, cal.values()) == pytest.approx(2.1)


def test_a_parameter_one_run_informs_stays_uncalibrated_and_says_so(tmp_path):
    # One TPU run among GPU ones: a fit would match it exactly whatever else is wrong with
    # it, so the TPU parameters keep their uncalibrated values, are said to be, and are
    # left out of the file (a report on it names them "uncalibrated here").
    from experiments.calibrate import format_fit, write_calibration
    from experiments.config import load_calibration

    cases = [(f"run{i}", f, m) for i, (f, m) in enumerate(synthetic_cases())
             if i % 3 != 1 or i == 1]
    result = calibrate(cases)
    assert result.informed_by["tpu_matmul_scale"] == ["run1"]
    assert result.values["tpu_matmul_scale"] == IDENTITY.values()["tpu_matmul_scale"]
    assert "1 run: too few, uncalibrated" in next(
        line for line in format_fit(result).splitlines() if line.startswith("tpu_matmul"))
    path = tmp_path / "c.toml"
    write_calibration(result, path, fitted_on="runs")
    params = tomllib.loads(path.read_text())["parameters"]
    assert "tpu_matmul_scale" not in params and "gpu_bf16_matmul_efficiency" in params
    assert "uncalibrated here: " in load_calibration(str(path)).source
    # No family of 2 runs: an empty [best_measured_mfu] table dropped every ceiling of the
    # catalog; without one, the catalog's hold (as for a file without the table).
    from meshes.calibration import catalog_calibration

    assert load_calibration(str(path)).best_mfu == catalog_calibration().best_mfu


def test_a_group_of_runs_fits_fewer_parameters_than_it_has_runs(tmp_path):
    # Two TPU runs inform both TPU parameters (each of them by 2 runs): fitted together they
    # matched both runs exactly (0.0%) whatever was wrong with them. In a group of runs
    # the parameters on them share, fewer parameters than runs: the one informed by the
    # fewest runs, then the later in PARAMETERS, stays uncalibrated and is said to.
    from experiments.calibrate import format_fit, free_parameters, write_calibration

    def tpu(matmul_s, attention_s):
        return {"math_s": {"tpu": matmul_s, "tpu/attention": attention_s}, "kernels": 100.0,
                "other_s": 0.1, "exposed_s": 0.05}

    pairs = [(tpu(1.0, 0.2), 1.6), (tpu(2.0, 0.1), 2.5)]
    assert free_parameters(pairs) == ["tpu_matmul_scale"]
    result = calibrate([("a", *pairs[0]), ("b", *pairs[1])])
    assert result.fitted == ["tpu_matmul_scale"]
    assert result.values["tpu_flash_attention_efficiency"] == 1.0
    assert min(abs(e) for e in result.fitted_errors) > 0.01  # one parameter, two runs
    assert "too few for the parameters on them, uncalibrated" in next(
        line for line in format_fit(result).splitlines() if line.startswith("tpu_flash"))
    write_calibration(result, tmp_path / "c.toml", fitted_on="runs")
    assert list(tomllib.loads((tmp_path / "c.toml").read_text())["parameters"]) == [
        "tpu_matmul_scale"]
    # A third run: two parameters on three runs.
    assert free_parameters(pairs + [(tpu(1.5, 0.4), 2.4)]) == [
        "tpu_matmul_scale", "tpu_flash_attention_efficiency"]
    # GPU runs and TPU runs share no parameter: each group is counted on its own runs.
    gpu = {"math_s": {"gpu_bf16": 1.0}, "kernels": 100.0, "other_s": 0.1, "exposed_s": 0.0}
    assert free_parameters(pairs + [(gpu, 1.5), (gpu, 1.6)]) == [
        "gpu_bf16_matmul_efficiency", "tpu_matmul_scale"]


def test_leave_one_out_needs_three_runs_as_the_docs_say(tmp_path):
    # Two runs: each refit has one run and fits nothing, so its "leave-one-out error" was
    # the uncalibrated one (50.6% printed and written into the file's summary, where
    # validate and the docs say leave-one-out needs 3 runs).
    from experiments.calibrate import format_fit, write_calibration

    two = [(f"run{i}", f, m) for i, (f, m) in enumerate(synthetic_cases()) if i in (0, 3)]
    result = calibrate(two)
    assert result.fitted and result.loo_errors == []
    assert "leave-one-out: - (it needs 3 runs or more)" in format_fit(result)
    write_calibration(result, tmp_path / "c.toml", fitted_on="runs")
    written = tomllib.loads((tmp_path / "c.toml").read_text())["provenance"]
    assert "leave-one-out - (it needs 3 runs or more)" in written["summary"]
    assert np.isnan(written["loo_median_abs_error"])
    three = [(f"run{i}", f, m) for i, (f, m) in enumerate(synthetic_cases()) if i in (0, 3, 6)]
    assert len(calibrate(three).loo_errors) == 3


def test_calibrate_keeps_an_existing_file_unless_forced(tmp_path, monkeypatch, capsys):
    # A fitted calibration (or meshes/calibration.toml, the catalog's) is kept, as measure,
    # search and emit keep theirs: refused before any run compiles; --force rewrites it.
    from experiments import validate
    from experiments.validate import Row
    from tests.helpers import run_cli

    rows = [Row(name=f"run{i}", path="", family="h100 bf16", measured_s=m, status="ok",
                features=f) for i, (f, m) in enumerate(synthetic_cases())]
    monkeypatch.setattr(validate, "validate", lambda *a, **k: rows)
    out, features = tmp_path / "cal.toml", tmp_path / "features.json"
    for existing, flag in ((out, "--out"), (features, "--features")):
        existing.write_text("mine\n")
        code, _, err = run_cli(["calibrate", "runs", "--out", str(out), "--features",
                                str(features)], capsys)
        assert code == 2 and err.count("\n") == 1
        assert f"{flag} {str(existing)!r} exists" in err and "--force" in err
        assert existing.read_text() == "mine\n"
        existing.unlink()
    out.write_text("mine\n")
    features.write_text("mine\n")
    code, _, err = run_cli(["calibrate", "runs", "--out", str(out), "--features",
                            str(features), "--force"], capsys)
    assert code == 0, err
    assert "[parameters]" in out.read_text() and json.loads(features.read_text())["cases"]


def test_calibrate_writes_no_file_that_fits_nothing(tmp_path, monkeypatch, capsys):
    # One GPU run and one TPU run: no parameter has two runs. The file it wrote had an empty
    # [parameters] table, and `--calibration` with it ran every family uncalibrated (the
    # catalog's fitted values gone) under a summary saying "fitted on 2 measured runs".
    from experiments import validate
    from experiments.validate import Row
    from tests.helpers import run_cli

    cases = synthetic_cases()
    rows = [Row(name=f"run{i}", path="", family="f", measured_s=cases[i][1], status="ok",
                features=cases[i][0]) for i in (0, 1)]  # run0 GPU bf16, run1 TPU
    monkeypatch.setattr(validate, "validate", lambda *a, **k: rows)
    out = tmp_path / "cal.toml"
    code, _, err = run_cli(["calibrate", "runs", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "no parameter is fitted on these 2 runs" in err and "tpu_matmul_scale: run1" in err
    assert not out.exists()


def test_calibrate_writes_neither_file_over_its_runs_nor_the_other(tmp_path, monkeypatch,
                                                                    capsys):
    # --out and --features on one path: the decompositions overwrote the calibration just
    # written. --out over a run (with --force): the run's [measured] config was lost. --out
    # into the folder of runs: the next `validate` of that folder read the file as a run
    # ("unknown key 'parameters'"). Each a line before any run compiles.
    from experiments import validate
    from tests.helpers import TINY, run_cli, write

    monkeypatch.setattr(validate, "validate", lambda *a, **k: pytest.fail("compiled"))
    runs = tmp_path / "runs"
    runs.mkdir()
    run = write(runs, TINY + "[measured]\nstep_time_s = 0.5\n", "a.toml")
    same = str(tmp_path / "cal.toml")
    for args, says in (
            (["--out", same, "--features", same], "--out and --features are both"),
            (["--out", run, "--force"], "is one of the runs calibrated"),
            (["--out", str(runs / "cal.toml")], "a folder of runs calibrated")):
        code, _, err = run_cli(["calibrate", str(runs), *args], capsys)
        assert code == 2 and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "cal.toml").exists() and "[measured]" in Path(run).read_text()
    # without a folder calibrate reads the bundled set: --out into it is refused alike
    code, _, err = run_cli(["calibrate", "--out", str(validate.VALIDATION_DIR / "cal.toml")],
                           capsys)
    assert code == 2 and "a folder of runs calibrated" in err, err
    # One already there reads as what it is, with the way out.
    monkeypatch.undo()
    (runs / "cal.toml").write_text("[parameters]\ngpu_bf16_matmul_efficiency = 0.5\n")
    code, _, err = run_cli(["validate", str(runs)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "cal.toml is a calibration file" in err and "move it out" in err


def test_a_run_no_physical_parameters_explain_is_named():
    # A step of 1e9 s (or one in ms written as s) was fitted without a word: it pulled
    # gpu_bf16_matmul_efficiency to its bound and the other runs' error from 3% to 12%.
    from experiments.calibrate import step_range, unexplained

    cases = [(f"run{i}", f, m) for i, (f, m) in enumerate(synthetic_cases())]
    assert unexplained(cases) == []  # made with parameters inside their bounds
    features, measured = cases[0][1], cases[0][2]
    fast, slow = step_range(features)
    # the fastest: every rate at its upper bound (GPU bf16 0.95 of peak, against the
    # book's 0.8), no time per kernel
    assert fast == pytest.approx(predict(features, {**IDENTITY.values(),
                                                    "gpu_bf16_matmul_efficiency": 0.95,
                                                    "gpu_low_precision_matmul_scale": 1.1,
                                                    "tpu_matmul_scale": 1.1}))
    assert fast < measured < slow
    lines = unexplained([("slow", features, 1e9), ("fast", features, fast * 0.9),
                         ("ok", features, measured)])
    assert [line.split(":")[0] for line in lines] == ["slow", "fast"]
    assert "step_time_s" in lines[0]
    # A run no parameter moves (timed at this host's own measured rates) pulls nothing.
    host = {"math_s": {"host": 1.0}, "kernels": 0.0, "other_s": 0.1, "exposed_s": 0.0}
    assert unexplained([("host", host, 5.0)]) == []


def test_the_file_reads_back_whatever_its_runs_and_folders_are_named(tmp_path):
    # A run named 'run "1" \\x' or a folder C:\\runs was written between bare quotes: a
    # file that --calibration could not read ("not valid TOML").
    from experiments.calibrate import best_mfu, write_calibration
    from experiments.config import load_calibration
    from experiments.validate import Row

    names = [f'run "{i}" \\x' for i in range(12)]
    result = calibrate([(n, f, m) for n, (f, m) in zip(names, synthetic_cases())])
    rows = [Row(name=n, path="", family='h100 "bf16"', measured_s=1.0, status="ok",
                estimate_s=1.0, mfu=0.4) for n in names[:2]]
    path = tmp_path / "c.toml"
    write_calibration(result, path, fitted_on='my "runs" C:\\runs',
                      best=best_mfu(rows))
    raw = tomllib.loads(path.read_text())
    assert raw["provenance"]["runs"] == names
    assert raw["provenance"]["fitted_on"] == 'my "runs" C:\\runs'
    assert raw["best_measured_mfu"] == {'h100 "bf16"': {"mfu": 0.4, "run": names[0]}}
    assert 'C:\\runs' in load_calibration(path).source


def test_one_run_is_refused_before_it_compiles(tmp_path, monkeypatch, capsys):
    # It compiled the run, then said "1 run(s) compiled; calibrating needs at least 2".
    from experiments import validate
    from tests.helpers import TINY, run_cli, write

    monkeypatch.setattr(validate, "validate", lambda *a, **k: pytest.fail("compiled"))
    (tmp_path / "runs").mkdir()
    run = write(tmp_path / "runs", TINY + "[measured]\nstep_time_s = 0.5\n", "a.toml")
    for given in (run, str(tmp_path / "runs")):
        code, _, err = run_cli(["calibrate", given, "--out", str(tmp_path / "c.toml")], capsys)
        assert code == 2 and err.count("\n") == 1 and "needs at least 2 runs" in err, err
