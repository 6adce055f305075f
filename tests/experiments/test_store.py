"""The search store (experiments/store.py): one row per config, whoever writes it."""

import sqlite3
import subprocess
import sys

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
