"""`shardscope diff` (experiments/diff.py): two reports side by side as a CI gate."""

import copy
import json

import pytest

from experiments import cli


@pytest.fixture(scope="module")
def report(tmp_path_factory, cpu_devices):
    path = tmp_path_factory.mktemp("diff") / "main.json"
    assert cli.main(["run", "tiny-h100-dp-tp", "--quiet", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _diff(tmp_path, capsys, old, new, *flags):
    a, b = tmp_path / "old.json", tmp_path / "new.json"
    a.write_text(json.dumps(old))
    b.write_text(json.dumps(new))
    capsys.readouterr()
    code = cli.main(["diff", str(a), str(b), *flags])
    return code, capsys.readouterr().out


def test_identical_reports_pass(tmp_path, capsys, report):
    code, out = _diff(tmp_path, capsys, report, report)
    assert code == 0 and out.splitlines()[-1] == "ok: within the thresholds"
    assert "the same in both" in out


def test_a_new_all_gather_fails_and_is_named(tmp_path, capsys, report):
    new = copy.deepcopy(report)
    gather = {**new["collectives"][0], "kind": "all-gather", "mesh_axes": ["fsdp"],
              "bytes": 4 * 2**20, "count": 3}
    new["collectives"].append(gather)
    code, out = _diff(tmp_path, capsys, report, new, "--json", str(tmp_path / "d.json"))
    assert code == 1
    line = next(ln for ln in out.splitlines() if "all-gather over fsdp" in ln)
    assert "12.58 MB" in line and "FAIL new in this report" in line
    d = json.loads((tmp_path / "d.json").read_text())
    assert not d["ok"] and d["failures"] == ["all-gather over fsdp: new in this report"]
    # A collective that went away is shown, not failed.
    code, out = _diff(tmp_path, capsys, new, report)
    assert code == 0 and "gone" in next(ln for ln in out.splitlines() if "all-gather" in ln)


def test_thresholds_set_the_exit_code(tmp_path, capsys, report):
    new = copy.deepcopy(report)
    new["step_time_s"] *= 1.10
    first = new["collectives"][0]
    first["bytes"] = int(first["bytes"] * 1.10)
    kind = f"{first['kind']} over {','.join(first['mesh_axes'])}"
    code, out = _diff(tmp_path, capsys, report, new)
    assert code == 1
    assert "step time" in out and "FAIL +10.0% (over +5%)" in out
    assert any(kind in ln and "FAIL" in ln for ln in out.splitlines())
    code, _ = _diff(tmp_path, capsys, report, new, "--max-step-increase", "15",
                    "--max-bytes-increase", "20%")
    assert code == 0


def test_what_is_not_a_report_is_one_line(tmp_path, capsys, report):
    (tmp_path / "config.toml").write_text("name = 'x'\n")
    (tmp_path / "other.json").write_text('{"a": 1}')
    good = tmp_path / "good.json"
    good.write_text(json.dumps(report))
    for bad, says in (("missing.json", "no such file"), ("config.toml", "not a JSON report"),
                      ("other.json", "not a shardscope report (no step_time_s")):
        capsys.readouterr()
        assert cli.main(["diff", str(good), str(tmp_path / bad)]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and "run CONFIG --json" in err
