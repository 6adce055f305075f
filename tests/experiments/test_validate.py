"""`shardscope validate`: rows, errors, the summary, and one process per case."""

import json
import math
from pathlib import Path

import pytest

from experiments import cli
from experiments.validate import Row, format_table, percentile, summary
from tests.helpers import TINY, run_cli, write


def row(name, family, measured, estimate, status="ok"):
    return Row(name=name, path=f"{name}.toml", family=family, measured_s=measured,
               status=status, estimate_s=estimate, mfu=None if estimate is None else 0.5)


def test_error_is_relative_to_the_measurement_and_positive_when_too_slow():
    r = row("a", "h100 bf16", 2.0, 2.5)
    assert r.error == pytest.approx(0.25)
    # The run's MFU with our FLOP count: ours (50%) x estimate / measured.
    assert r.measured_mfu == pytest.approx(0.5 * 2.5 / 2.0)
    assert row("b", "h100 bf16", 2.0, None, status="refused").error is None


def test_percentiles_interpolate_between_order_statistics():
    assert percentile([0.1, 0.3, 0.2], 50) == pytest.approx(0.2)
    # p90 of 0.0, 0.1, ..., 1.0: rank 0.9 x 10 = 9 -> 0.9.
    assert percentile([i / 10 for i in range(11)], 90) == pytest.approx(0.9)
    assert math.isnan(percentile([], 50))


def test_summary_overall_and_per_family_counts_only_cases_that_ran():
    rows = [row("a", "h100 bf16", 1.0, 1.1), row("b", "h100 bf16", 1.0, 0.7),
            row("c", "tpu-v6e bf16", 2.0, 3.0), row("d", "tpu-v6e bf16", 2.0, None, "error")]
    s = summary(rows)
    assert s["overall"]["cases"] == 4 and s["overall"]["ran"] == 3
    assert s["overall"]["median_abs_error"] == pytest.approx(0.3)  # of 0.1, 0.3, 0.5
    assert s["families"]["h100 bf16"]["median_abs_error"] == pytest.approx(0.2)
    assert s["families"]["tpu-v6e bf16"]["ran"] == 1
    # No leave-one-out under 3 runs, and a family none of whose runs ran: null, as JSON
    # has it (NaN is not JSON), "-" in the table.
    assert s["overall"]["loo_median_abs_error"] is None
    s = summary(rows + [row("e", "b200 bf16", 1.0, None, "error")])
    assert s["families"]["b200 bf16"]["median_abs_error"] is None
    json.loads(json.dumps(s), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    line = next(ln for ln in format_table(rows, s).splitlines() if "b200 bf16" in ln)
    assert "0 ran   median     -   p90     -" in line


MEASURED = '\n[measured]\nstep_time_s = 0.5\nsource = "test"\nevidence = "MEASURED-LOG"\n'


@pytest.mark.slow
def test_validate_runs_each_case_in_its_own_process(tmp_path, capsys, cpu_devices):
    cases = tmp_path / "cases"
    cases.mkdir()
    write(cases, TINY + MEASURED, "tiny.toml")
    # A case the runner refuses (more fake CPU devices than XLA:CPU takes, and FSDP with
    # data parallelism, which is not read from fewer replicas) is a row; the run goes on.
    refused = TINY.replace("data = 2\nfsdp = 4", "data = 64\nfsdp = 64").replace(
        "h100:8", "tpu-v5e:16x16*16").replace("global_batch = 16", "global_batch = 4096"
                                              ).replace('name = "t"', 'name = "refused"')
    write(cases, refused + MEASURED, "refused.toml")
    out_json = tmp_path / "v.json"
    code, out, err = run_cli(["validate", str(cases), "--workers", "2", "--json",
                              str(out_json)], capsys)
    assert code == 0, err
    d = json.loads(out_json.read_text())
    by_name = {c["name"]: c for c in d["cases"]}
    ok = by_name["t"] if "t" in by_name else next(c for c in d["cases"] if c["status"] == "ok")
    assert ok["status"] == "ok" and ok["error"] == pytest.approx((ok["estimate_s"] - 0.5) / 0.5)
    bad = next(c for c in d["cases"] if c["status"] != "ok")
    assert bad["status"] == "refused" and "tpu-v5e:16x16*16" in bad["message"]
    assert d["summary"]["overall"] == {**d["summary"]["overall"], "cases": 2, "ran": 1}
    assert "median |error|" in out and "after compile" in out
    # The same config through `shardscope run`: the same estimate.
    code, out, _ = run_cli(["run", str(cases / "tiny.toml"), "--json", str(tmp_path / "r.json")],
                           capsys)
    assert json.loads((tmp_path / "r.json").read_text())["step_time_s"] == \
        pytest.approx(ok["estimate_s"], rel=1e-9)


def test_validate_needs_measured_tables(tmp_path, capsys):
    cases = tmp_path / "cases"
    cases.mkdir()
    write(cases, TINY, "plain.toml")
    code, _, err = run_cli(["validate", str(cases)], capsys)
    assert code == 2 and "no [measured] table" in err and err.count("\n") == 1
    code, _, err = run_cli(["validate", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "not found" in err


@pytest.mark.parametrize("measured, says", [
    ("step_time_s = 0.002\nsource = 'a log'\nstep_tme = 1", "step_tme"),
    ("step_time_s = 0\nsource = 'a log'", "step_time_s"),
])
def test_a_bad_file_in_a_folder_of_runs_is_named(tmp_path, capsys, measured, says):
    # one mistake among many runs: the error names the key and the file that holds it
    cases = tmp_path / "cases"
    cases.mkdir()
    write(cases, f"{TINY}\n[measured]\nstep_time_s = 0.002\nsource = 'a log'\n", "good.toml")
    bad = write(cases, f"{TINY}\n[measured]\n{measured}\n", "bad.toml")
    code, _, err = run_cli(["validate", str(cases)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert says in err and bad in err and "good.toml" not in err


def test_two_runs_of_one_name_are_refused_before_compiling(tmp_path, capsys):
    # A run's name keys its leave-one-out estimate and a calibration's provenance: two
    # runs named alike got each other's leave-one-out error. Named, both files, no compile.
    cases = tmp_path / "cases"
    cases.mkdir()
    first = write(cases, TINY + MEASURED, "a.toml")
    second = write(cases, TINY.replace("data = 2\nfsdp = 4", "fsdp = 8") + MEASURED, "b.toml")
    for command in ("validate", "calibrate"):
        args = [command, str(cases)] + (["--out", str(tmp_path / "c.toml")]
                                        if command == "calibrate" else [])
        code, _, err = run_cli(args, capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert first in err and second in err and "'t'" in err
    assert not (tmp_path / "c.toml").exists()
    # The same file named twice (its folder and itself) is one run, not a clash.
    from experiments.validate import find_cases

    assert find_cases([str(cases), first]) == [cases / "a.toml", cases / "b.toml"]


def test_validate_reads_each_run_once(tmp_path, monkeypatch):
    # load_case read each TOML twice (its check for a calibration file, then the config)
    # and validate a third time (what it sends its worker): once, and the worker gets
    # what was read, the hf_config path made the TOML's.
    from concurrent.futures import Future

    from experiments import config, validate, workers

    cases = tmp_path / "cases"
    cases.mkdir()
    run = write(cases, TINY + MEASURED, "a.toml")
    reads, sent = [], []
    real = config.read_toml
    monkeypatch.setattr(config, "read_toml",
                        lambda p, **k: reads.append(str(p)) or real(p, **k))

    def submit(devices, request):
        sent.append(request["config"])
        answer = Future()
        answer.set_result({"status": "refused", "message": "not compiled here"})
        return answer

    monkeypatch.setattr(workers, "executor", lambda **k: (submit, lambda _: None, 1))
    rows = validate.validate(cases, workers=1)
    assert reads == [run]
    assert [r.status for r in rows] == ["refused"] and sent[0]["measured"]["step_time_s"]


def test_validate_says_which_calibration_its_estimates_used(tmp_path, capsys, monkeypatch):
    # `--calibration FILE` changes every estimate; neither the table nor the JSON said
    # which calibration they were made with (the catalog's or the file's). Both do, and a
    # report's calibration line names the file, whatever its summary says.
    from experiments import validate

    rows = [row("a", "h100 bf16", 1.0, 1.1)]
    monkeypatch.setattr(validate, "validate", lambda *a, **k: rows)
    cal = tmp_path / "mine.toml"
    cal.write_text('[parameters]\ngpu_bf16_matmul_efficiency = 0.4\n'
                   '[provenance]\nsummary = "my cluster, 3 runs"\n')
    out_json = tmp_path / "v.json"
    code, out, err = run_cli(["validate", "runs", "--calibration", str(cal), "--json",
                              str(out_json)], capsys)
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("calibration: "))
    assert "my cluster, 3 runs" in line and line.endswith(f"file {cal}")
    used = json.loads(out_json.read_text())["calibration"]
    assert used["gpu_bf16_matmul_efficiency"] == 0.4 and used["source"] in line
    code, out, _ = run_cli(["validate", "runs", "--json", str(out_json)], capsys)
    catalog = json.loads(out_json.read_text())["calibration"]
    assert catalog["source"].startswith("fitted on") and catalog["source"] in out


def test_validate_checks_its_json_before_compiling(tmp_path, capsys, monkeypatch):
    # --json into a missing folder failed after every run had compiled (minutes on the
    # bundled set), and --json over one of the runs replaced that run's config.
    from experiments import validate

    monkeypatch.setattr(validate, "validate", lambda *a, **k: pytest.fail("compiled"))
    cases = tmp_path / "cases"
    cases.mkdir()
    run = write(cases, TINY + MEASURED, "a.toml")
    for out, says in ((str(tmp_path / "nowhere" / "v.json"), "does not exist"),
                      (run, "is one of the runs validated")):
        code, _, err = run_cli(["validate", str(cases), "--json", out], capsys)
        assert code == 2 and err.count("\n") == 1 and says in err, err
    assert "[measured]" in Path(run).read_text()


def test_bundled_validation_set_loads_and_names_its_sources():
    from experiments import config
    from experiments.validate import VALIDATION_DIR, find_cases

    for path in find_cases(VALIDATION_DIR):
        exp = config.load(path)
        assert exp.measured is not None and exp.measured.source and exp.measured.evidence, path
        assert exp.measured.evidence.startswith(("MEASURED-LOG", "MEASURED-TABLE")), path


def test_cli_has_validate():
    assert "validate" in cli.build_parser().format_help()
