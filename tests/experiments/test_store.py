"""The search store (experiments/store.py): one row per config, whoever writes it."""

import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from experiments import cli
from tests.conftest import REPO

TINY = "tiny-h100-dp-tp"  # tiny model (4 heads, 4 KV heads, d_model 64), h100:8, batch 16


def test_results_reads_a_store_and_refuses_a_missing_one(tmp_path, capsys):
    code = cli.main(["results", str(tmp_path / "none.sqlite")])
    assert code == 2 and "not found" in capsys.readouterr().err


def test_a_file_or_folder_that_is_no_store_is_one_line_and_left_alone(tmp_path, capsys):
    other = tmp_path / "report.json"
    other.write_text('{"a": 1}')
    for args in (["results", str(other)], ["results", str(tmp_path)],
                 ["search", "tiny-h100-dp-tp", "--store", str(other), "--quiet"]):
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("not a results store" in err or "a folder" in err)
    assert other.read_text() == '{"a": 1}' and sorted(p.name for p in tmp_path.iterdir()) == [
        "report.json"]


@pytest.mark.slow
def test_two_searches_on_one_store_keep_each_row_once(tmp_path):
    # On a 2-GPU node: data 2 or tensor 2, both compiled by both searches at once.
    store = tmp_path / "s.sqlite"
    argv = [sys.executable, "-m", "experiments.cli", "search", TINY, "--set",
            "system.name=h100:2", "--set", "parallelism.tensor=1", "--store", str(store),
            "--axes", "data,tensor",
            "--workers", "1", "--quiet"]
    a = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    b = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    errs = [a.communicate(timeout=600)[1], b.communicate(timeout=600)[1]]
    assert a.returncode == 0 and b.returncode == 0, errs
    rows = sqlite3.connect(store).execute(
        "SELECT config_hash, COUNT(*) FROM results GROUP BY config_hash").fetchall()
    assert len(rows) == 2 and all(n == 1 for _, n in rows)
    assert sqlite3.connect(store).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def _store_with_one_row(path):
    from experiments.store import Result, Store

    with Store(path) as s:
        s.add(Result(config_hash="h", tool_version="t", backend="cpu", search="mine",
                     name="mine-data8", config={"system": {"name": "h100:8"}},
                     parallelism={"data": 8}, varied={}, status="ok", step_time_s=1e-3,
                     tokens_per_s_per_device=1.0, mfu=0.1, memory_per_device_bytes=1e9,
                     fits=True, bottleneck="compute"))


def test_a_row_compiled_again_stays_in_the_search_that_stored_it(tmp_path):
    # A rerun under another name (--retry-errors, --keep-unfit) replaces the row's figures,
    # not its search: `results --search mine` still finds it.
    import dataclasses

    from experiments.store import Store

    path = tmp_path / "s.sqlite"
    _store_with_one_row(path)
    with Store(path) as s:
        (row,) = s.results(search="mine")
        again = dataclasses.replace(row, search="theirs", name="theirs-data8",
                                    step_time_s=2e-3)
        assert s.add(again, replace=True)
        (row,) = s.results(search="mine")
        assert (row.name, row.step_time_s) == ("mine-data8", 2e-3)
        assert s.results(search="theirs") == []


def test_results_reads_another_programs_sqlite_file_without_changing_it(tmp_path, capsys):
    other = tmp_path / "other.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE t (x)")
    db.commit()
    db.close()
    before = other.read_bytes()
    for args in (["results", str(other)],
                 ["search", TINY, "--store", str(other), "--quiet"]):
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not a results store" in err
    assert other.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [
        "other.db"]


def test_results_names_the_searches_a_store_holds(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    _store_with_one_row(store)
    assert cli.main(["results", str(store), "--search", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nope'" in err and "holds 'mine'" in err
    assert cli.main(["results", str(store), "--search", "mine"]) == 0
    assert "mine-data8" in capsys.readouterr().out


def _as_another_user(argv, folder):
    """`argv` run as a user who cannot write `folder`: as nobody (uid 65534, by util-linux's
    setpriv) when this is root (root writes anywhere), else with the folder read-only."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if os.geteuid() == 0:
        os.chmod(folder, 0o755)
        for p in folder.iterdir():
            os.chmod(p, 0o644)
        nobody = [shutil.which("setpriv") or "setpriv", "--reuid=65534", "--regid=65534",
                  "--clear-groups"]
        probe = subprocess.run([*nobody, sys.executable, "-c", "import experiments"],
                               capture_output=True, text=True, timeout=60, env=env)
        if probe.returncode:  # a checkout under a private folder (mktemp -d's is 0700)
            pytest.skip(f"uid 65534 cannot run this checkout's Python ({REPO}): "
                        f"{probe.stderr.strip().splitlines()[-1] if probe.stderr else ''}")
        argv = [*nobody, *argv]
        return subprocess.run(argv, cwd=folder, capture_output=True, text=True,
                              timeout=300, env=env)
    os.chmod(folder, 0o555)
    try:
        return subprocess.run(argv, cwd=folder, capture_output=True, text=True,
                              timeout=300, env=env)
    finally:
        os.chmod(folder, 0o755)


def test_a_store_in_a_folder_one_cannot_write_is_read_and_not_made(tmp_path):
    # A folder the user cannot write (and tmp_path's own is root's alone): `results` and
    # `diff` read the store there, untouched; a search cannot make a new store there and
    # says so in one line.
    folder = Path(tempfile.mkdtemp(prefix="shardscope-ro-"))
    try:
        _store_with_one_row(folder / "s.sqlite")
        for name in os.listdir(folder):  # only the store: no -wal or -shm left
            assert name == "s.sqlite"
        before = (folder / "s.sqlite").read_bytes()
        cli_argv = [sys.executable, "-m", "experiments.cli"]
        p = _as_another_user([*cli_argv, "results", "s.sqlite"], folder)
        assert p.returncode == 0 and "mine-data8" in p.stdout, p.stderr
        p = _as_another_user([*cli_argv, "diff", "s.sqlite", "s.sqlite"], folder)
        assert p.returncode == 0, p.stderr
        p = _as_another_user([*cli_argv, "search", TINY, "--store", "new.sqlite", "--quiet"],
                             folder)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert "cannot write it" in p.stderr and "folder you can write" in p.stderr
        assert sorted(os.listdir(folder)) == ["s.sqlite"]
        assert (folder / "s.sqlite").read_bytes() == before
    finally:
        shutil.rmtree(folder)
