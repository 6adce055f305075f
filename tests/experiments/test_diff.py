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


def test_json_lists_regressions_and_changes(tmp_path, capsys, report):
    new = copy.deepcopy(report)
    new["step_time_s"] *= 1.02  # moved, within the 5% threshold
    new["collectives"].append({**new["collectives"][0], "kind": "all-gather",
                               "mesh_axes": ["fsdp"]})
    code, _ = _diff(tmp_path, capsys, report, new, "--json", str(tmp_path / "d.json"))
    d = json.loads((tmp_path / "d.json").read_text())
    assert code == 1
    assert [r["what"] for r in d["regressions"]] == ["all-gather over fsdp"]
    assert {c["what"] for c in d["changes"]} == {"step time", "all-gather over fsdp"}


# --- two results stores (search --store) -------------------------------------------------

def _store(path, rows):
    """A results store of (name, status, report) rows, as a search writes them."""
    from experiments.store import Result, Store

    with Store(path) as s:
        for i, (name, status, rep) in enumerate(rows):
            s.add(Result(config_hash=f"hash-{name}", tool_version="t", backend="cpu",
                         search="tiny", name=name, config={}, parallelism={}, varied={},
                         status=status, message="" if rep else "does not fit: 90 GB",
                         step_time_s=rep and rep["step_time_s"], report=rep, created=i + 1.0))
    return str(path)


def test_identical_stores_pass_and_a_gained_all_gather_fails(tmp_path, capsys, report):
    rows = [("tiny-data8", "ok", report), ("tiny-data4-tensor2", "ok", report),
            ("tiny-tensor8", "refused", None)]
    old = _store(tmp_path / "old.sqlite", rows)
    same = _store(tmp_path / "same.sqlite", rows)
    capsys.readouterr()
    assert cli.main(["diff", old, same]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("3 configs in both, 0 only in old, 0 only in new")
    assert "tiny-data8: the same" in out and "tiny-tensor8: refused in both" in out
    assert out[-1] == "ok: within the thresholds"

    gathered = copy.deepcopy(report)
    gathered["collectives"].append({**report["collectives"][0], "kind": "all-gather",
                                    "mesh_axes": ["fsdp"], "bytes": 2**20, "count": 2})
    new = _store(tmp_path / "new.sqlite", [("tiny-data8", "ok", report),
                                           ("tiny-data4-tensor2", "ok", gathered),
                                           ("tiny-data2-tensor4", "ok", report)])
    assert cli.main(["diff", old, new, "--json", str(tmp_path / "d.json")]) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "all-gather over fsdp" in ln)
    assert "2.10 MB" in line and "FAIL new in this report" in line  # 1 MiB x 2 per step
    assert "only in old: tiny-tensor8" in out and "only in new: tiny-data2-tensor4" in out
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["failures"] == ["tiny-data4-tensor2: all-gather over fsdp: new in this report"]
    assert [(r["config"], r["what"]) for r in d["regressions"]] == \
        [("tiny-data4-tensor2", "all-gather over fsdp")]
    assert d["only_in_new"] == ["tiny-data2-tensor4"]


def test_a_config_that_stops_running_fails_and_names_match_across_hashes(tmp_path, capsys,
                                                                          report):
    old = _store(tmp_path / "old.sqlite", [("tiny-data8", "ok", report)])
    # The change added a config key (every hash differs): matched by name; now pruned.
    new = tmp_path / "new.sqlite"
    _store(new, [("tiny-data8", "refused", None)])
    import sqlite3

    with sqlite3.connect(new) as db:
        db.execute("UPDATE results SET config_hash = 'another'")
    capsys.readouterr()
    assert cli.main(["diff", old, str(new)]) == 1
    out = capsys.readouterr().out
    assert "tiny-data8: ok -> refused  FAIL ran in OLD, refused in NEW: does not fit" in out
    assert cli.main(["diff", str(new), old]) == 0  # it runs again: a change, not a failure
    assert "tiny-data8: refused -> ok" in capsys.readouterr().out


def test_a_store_and_a_report_or_another_sqlite_file_are_one_line(tmp_path, capsys, report):
    import sqlite3

    store = _store(tmp_path / "s.sqlite", [("tiny-data8", "ok", report)])
    (tmp_path / "r.json").write_text(json.dumps(report))
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (a)")
    before = other.read_bytes()
    for args, says in (([store, str(tmp_path / "r.json")], "give two run --json reports "
                                                           "or two stores"),
                       ([store, str(other)], "not a results store (no results table)")):
        capsys.readouterr()
        assert cli.main(["diff", *args]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1
    assert other.read_bytes() == before  # read, never written


def test_growth_from_a_tiny_base_is_shown_in_bytes_and_the_thresholds_are_named(
        tmp_path, capsys, report):
    # A 4-byte scalar all-reduce that became 1.32 MB printed "+32972800.0% FAIL (over +0%)":
    # a percentage of 4 B says nothing, and the +0% (collective bytes, exact counts) read
    # as a different default from the step's and memory's +5%.
    scalar = {**report["collectives"][0], "kind": "all-reduce", "mesh_axes": ["fsdp"],
              "bytes": 4, "count": 1}
    old = copy.deepcopy(report)
    old["collectives"].append(scalar)
    new = copy.deepcopy(report)
    new["collectives"].append({**scalar, "bytes": 1_318_912})  # 1.32 MB
    code, out = _diff(tmp_path, capsys, old, new, "--json", str(tmp_path / "d.json"))
    assert code == 1
    line = next(ln for ln in out.splitlines() if "all-reduce over fsdp" in ln)
    assert "+1.32 MB (from 4 B)" in line and "FAIL +1.32 MB from 4 B (over +0%)" in line
    assert "%" not in line.replace("+0%", "")
    assert "FAIL: 1 over the thresholds (step +5%, memory +5%, collective bytes +0%" in out
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["thresholds"] == {"max_step_increase": 5.0, "max_memory_increase": 5.0,
                               "max_bytes_increase": 0.0}
    # Growth within ten times its base is still a percentage.
    new["collectives"][-1]["bytes"] = 6
    code, out = _diff(tmp_path, capsys, old, new)
    assert "+50.0%" in next(ln for ln in out.splitlines() if "all-reduce over fsdp" in ln)
