"""`shardscope search`: the enumeration, the worker pool, the store that loses nothing."""

import fcntl
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from experiments import cli, search
from experiments.config import load
from experiments.store import Store
from tests.conftest import REPO
from tests.helpers import CHROMIUM, filled_store, needs_browser, sync_playwright

TINY = "tiny-h100-dp-tp"  # tiny model (4 heads, 4 KV heads, d_model 64), h100:8, batch 16


def test_factorisations_of_eight_over_three_axes():
    # 8 = 2^3: an ordered triple splits three 2s over three axes, C(5, 2) = 10 ways.
    got = search.factorisations(8, 3)
    assert len(got) == 10 and len(set(got)) == 10
    assert all(a * b * c == 8 for a, b, c in got)


def test_enumeration_is_every_sharding_minus_what_the_model_cannot_split():
    exp = load(TINY)
    raw = {**exp.to_dict(), "system": {"name": "h100:8"}}
    cands = search.enumerate_candidates(raw, 8, ("data", "fsdp", "tensor"),
                                        [("train.remat", ["full", "none"])])
    # By hand: (data, fsdp, tensor) with product 8; tensor shards the 4 heads and 4 KV
    # heads, so tensor = 8 cannot; fsdp shards d_model = 64 and the batch of 16 is split
    # over data x fsdp <= 8 ways, both always divisible. Each twice (two remat policies).
    expected = {(d, f, t) for d in (1, 2, 4, 8) for f in (1, 2, 4, 8) for t in (1, 2, 4, 8)
                if d * f * t == 8 and 4 % t == 0}
    valid = {(c.sizes["data"], c.sizes["fsdp"], c.sizes["tensor"]) for c in cands if c.exp}
    assert valid == expected and len(expected) == 9
    assert len(cands) == 20 and sum(c.exp is not None for c in cands) == 18
    (bad, _) = [c for c in cands if c.exp is None]
    assert bad.sizes == {"data": 1, "fsdp": 1, "tensor": 8}
    assert "parallelism.tensor=8 does not divide model.n_heads=4" in bad.reason
    assert len({c.key for c in cands}) == 20  # each config once
    assert {c.varied["train.remat"] for c in cands} == {"full", "none"}


def _search(tmp_path, store, *extra, env=None):
    return subprocess.run(
        [sys.executable, "-m", "experiments.cli", "search", TINY, "--store", str(store),
         "--axes", "data,tensor", "--quiet", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, **(env or {})})


def _search_here(store, *extra):
    """The same search in this process (its compiles are in worker processes all the same):
    no interpreter to start."""
    return cli.main(["search", TINY, "--store", str(store), "--axes", "data,tensor",
                     "--quiet", *extra])


@pytest.fixture(scope="session")
def whole(tmp_path_factory):
    """One uninterrupted search of the four data x tensor configs, shared by the tests that
    compare against it (each copies the file when it writes): made once per run, by the
    first xdist worker that asks, under a lock."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's, shared by its workers
    store, done = root / "whole.sqlite", root / "whole.done"
    with open(root / "whole.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            assert _search_here(store, "--workers", "1") == 0
            done.touch()
    return store


def _rows(store):
    with Store(store) as s:
        return {r.config_hash: (r.name, r.status, r.step_time_s) for r in s.results()}


@pytest.mark.slow
def test_a_killed_search_resumes_with_every_row_once(tmp_path, capsys, whole):
    expected = _rows(whole)
    assert len(expected) == 4  # data x tensor: 8x1, 4x2, 2x4; 1x8 refused

    killed = tmp_path / "killed.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "search", TINY, "--store", str(killed),
         "--axes", "data,tensor", "--workers", "1", "--quiet"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    # Kill it once it has committed some but not all: at its first row, the refusal it
    # stores before it starts a compile (after the second, the two compiles left can
    # finish before a busy machine's poll notices).
    while time.time() < deadline:
        time.sleep(0.2)
        if killed.exists():
            try:
                n = sqlite3.connect(killed).execute("SELECT COUNT(*) FROM results").fetchone()[0]
            except sqlite3.OperationalError:
                continue
            if n >= 1:
                break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = _rows(killed)
    assert 1 <= len(partial) < 4
    assert _search_here(killed, "--workers", "1") == 0
    assert "already there" in capsys.readouterr().out
    resumed = _rows(killed)
    assert resumed == expected  # none lost, none twice (the key is the primary key)
    assert sqlite3.connect(killed).execute("SELECT COUNT(*) FROM results").fetchone()[0] == 4


def test_export_writes_the_best_config_as_the_frameworks_settings(tmp_path, capsys, whole):
    store = tmp_path / "s.sqlite"
    shutil.copy(whole, store)  # every config already there: nothing compiles
    out = _export_search(store, capsys, "--json", str(tmp_path / "s.json"))
    assert out.splitlines()[1] == "model: tiny (n_kv_heads 4)"  # the header names it
    best = json.loads((tmp_path / "s.json").read_text())["best"]
    assert best["name"] == "tiny-h100-dp-tp-data8"  # (in `whole`'s ranking, fastest)
    yml = tmp_path / "best.yml"
    out = _export_search(store, capsys, "--export", "maxtext", "--out", str(yml))
    assert f"wrote {yml}" in out
    assert "# shardscope search: the best of 4 configs, tiny-h100-dp-tp-data8" in \
        yml.read_text()
    assert cli.main(["import", "maxtext", str(yml), "--out", str(tmp_path / "b.toml")]) == 0
    back = load(tmp_path / "b.toml")
    assert back.parallelism.sizes() == {**dict.fromkeys(back.parallelism.sizes(), 1),
                                        **best["parallelism"]}
    out = _export_search(store, capsys, "--export", "megatron")
    flags = out.split("as megatron's settings:\n", 1)[1]
    assert "--tensor-model-parallel-size 1" in flags and "--micro-batch-size 2" in flags
    # 16 sequences over data 8: 2 per GPU; no tensor parallelism in the best


def _export_search(store, capsys, *extra):
    capsys.readouterr()
    code = cli.main(["search", TINY, "--store", str(store), "--axes", "data,tensor",
                     "--quiet", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_diff_of_two_search_stores(tmp_path, capsys, whole):
    # The same search twice: every config matched by its hash, nothing moved.
    capsys.readouterr()
    assert cli.main(["diff", str(whole), str(whole)]) == 0
    assert "4 configs in both, 0 only in old, 0 only in new" in capsys.readouterr().out
    # The change's search gathers a weight in one config: that config fails the gate.
    new = tmp_path / "new.sqlite"
    shutil.copy(whole, new)
    with sqlite3.connect(new) as db:
        (report,) = db.execute("SELECT report FROM results WHERE name = "
                               "'tiny-h100-dp-tp-data4-tensor2'").fetchone()
        report = json.loads(report)
        report["collectives"].append({**report["collectives"][0], "kind": "all-gather",
                                      "mesh_axes": ["tensor"]})
        db.execute("UPDATE results SET report = ? WHERE name = "
                   "'tiny-h100-dp-tp-data4-tensor2'", (json.dumps(report),))
    assert cli.main(["diff", str(whole), str(new), "--json", str(tmp_path / "d.json")]) == 1
    d = json.loads((tmp_path / "d.json").read_text())
    assert [(r["config"], r["what"]) for r in d["regressions"]] == \
        [("tiny-h100-dp-tp-data4-tensor2", "all-gather over tensor")]


def test_export_mistakes_are_one_line_before_any_compile(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    (tmp_path / "mine.yml").write_text("keep: me\n")
    for extra, says in ((["--export", "keras"], "search --export 'keras' is not a framework "
                                                "shardscope exports to; choose one of "
                                                "maxtext, megatron"),
                        (["--out", "x.yml"], "give --export maxtext|megatron with it"),
                        (["--export", "maxtext", "--out", str(tmp_path / "mine.yml")],
                         "exists; choose another name or add --force"),
                        (["--export", "megatron", "--set", "workload.kind=prefill"],
                         "writes a training run's settings; workload.kind='prefill'")):
        capsys.readouterr()
        assert cli.main(["search", TINY, "--store", str(store), *extra]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    assert not store.exists() and (tmp_path / "mine.yml").read_text() == "keep: me\n"


@pytest.mark.slow
def test_a_compiler_abort_is_that_configs_error_and_the_search_goes_on(tmp_path,
                                                                       monkeypatch):
    store = tmp_path / "s.sqlite"
    out = tmp_path / "s.json"
    monkeypatch.setenv("SHARDSCOPE_FAULT", "abort:data4-tensor2")  # the workers read it
    assert _search_here(store, "--workers", "1", "--json", str(out)) == 0
    d = json.loads(out.read_text())
    by_name = {r["name"]: r for r in d["results"]}
    crashed = by_name["tiny-h100-dp-tp-data4-tensor2"]
    assert crashed["status"] == "error" and "SIGABRT" in crashed["message"]
    assert by_name["tiny-h100-dp-tp-data8"]["status"] == "ok"
    assert by_name["tiny-h100-dp-tp-data2-tensor4"]["status"] == "ok"
    assert d["best"]["status"] == "ok" and d["best"]["step_time_s"] > 0


@pytest.mark.slow
def test_reestimate_on_another_system_matches_a_fresh_compile_without_compiling(
        tmp_path, capsys, cpu_devices, monkeypatch, whole):

    store = tmp_path / "s.sqlite"
    shutil.copy(whole, store)
    import sharding.api

    compiles, parses = [], []
    real, real_parse = sharding.api.compile_to_hlo, sharding.api.parse_hlo
    monkeypatch.setattr(sharding.api, "compile_to_hlo",
                        lambda *a, **k: compiles.append(1) or real(*a, **k))
    monkeypatch.setattr(sharding.api, "parse_hlo",
                        lambda *a, **k: parses.append(1) or real_parse(*a, **k))
    out = tmp_path / "b200.json"
    assert cli.main(["search", TINY, "--store", str(store), "--axes", "data,tensor",
                     "--reestimate", "--system", "b200:8", "--json", str(out)]) == 0
    assert compiles == [] and parses == []  # timed from the stored plans, HLO not read
    got = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    # A store written before plans were kept: the plan column is added on opening and the
    # programs are read from their HLO instead, to the same estimates.
    old = tmp_path / "old.sqlite"
    shutil.copy(whole, old)
    with sqlite3.connect(old) as db:
        db.execute("ALTER TABLE results DROP COLUMN plan")
    out_old = tmp_path / "b200-old.json"
    assert cli.main(["search", TINY, "--store", str(old), "--axes", "data,tensor",
                     "--reestimate", "--system", "b200:8", "--json", str(out_old)]) == 0
    assert compiles == [] and parses
    again = {r["name"]: r["step_time_s"] for r in json.loads(out_old.read_text())["results"]}
    assert again == {name: r["step_time_s"] for name, r in got.items()}
    # A fresh compile of one of them on the B200 node: the same estimate.
    assert cli.main(["run", TINY, "--set", "system.name=b200:8", "--quiet", "--json",
                     str(tmp_path / "fresh.json")]) == 0
    assert compiles == [1]
    fresh = json.loads((tmp_path / "fresh.json").read_text())
    mine = got["tiny-h100-dp-tp-data2-tensor4"]
    assert mine["step_time_s"] == pytest.approx(fresh["step_time_s"], rel=1e-9)
    assert mine["mfu"] == pytest.approx(fresh["mfu"], rel=1e-9)
    assert mine["memory_per_device_bytes"] == pytest.approx(fresh["memory_per_device_bytes"])
    # Not on a TPU: the stored programs are a GPU's (what its fused kernels save)
    capsys.readouterr()
    assert cli.main(["search", TINY, "--store", str(store), "--reestimate", "--system",
                     "tpu-v5e:2x4"]) == 2
    err = capsys.readouterr().err
    assert "compiled for h100:8" in err and err.count("\n") == 1
    # A config too big for the store's system was never compiled: said, with the search
    # that tries it on the other system's HBM.
    import dataclasses

    from experiments.store import Store

    with Store(store) as s:
        s.add(dataclasses.replace(_result("big", 1.0, 1e12, status="refused"),
                                  config_hash="big", search=TINY,
                                  message="does not fit: needs 1 TB of HBM per device"))
    assert cli.main(["search", TINY, "--store", str(store), "--reestimate", "--system",
                     "b200:8", "--quiet"]) == 0
    assert ("1 config did not fit on the store's system and was never compiled; with "
            f"b200:8's HBM they may: `shardscope search {TINY} --set system.name=b200:8`"
            ) in capsys.readouterr().out


def test_a_retimed_program_carries_its_new_systems_runtime_reserve(cpu_devices):
    # Compiled on a v5e slice (its runtime keeps 0.25 GiB), re-timed on a v6e one: the
    # memory verdict counts what the v6e's runtime keeps, as a fresh run there does.
    import sharding
    from experiments import runner
    from meshes import get_system
    from meshes.reserves import runtime_reserve

    rep = runner.run(load(TINY, ["system.name='tpu-v5e:2x4'"]))
    again = sharding.reanalyze(rep.inputs, system="tpu-v6e:2x4")
    v6e = runtime_reserve(get_system("tpu-v6e:2x4"), 2)
    assert dict(again.memory.reserved) == {r.what: r.bytes for r in v6e}
    fresh = runner.run(load(TINY, ["system.name='tpu-v6e:2x4'"]))
    assert again.memory_per_device_bytes == pytest.approx(fresh.memory_per_device_bytes)


@pytest.mark.slow
def test_the_ray_path_gives_the_pools_results(tmp_path, whole):
    pytest.importorskip("ray")  # the ray extra, which `make test` installs
    pool, on_ray = whole, tmp_path / "ray.sqlite"
    p = _search(tmp_path, on_ray, "--ray", env={"RAY_ADDRESS": ""})  # a real local instance
    assert p.returncode == 0, p.stderr
    assert _rows(on_ray) == _rows(pool) and len(_rows(pool)) == 4


@pytest.mark.slow
def test_a_terminal_gets_a_progress_bar_and_a_pipe_does_not(tmp_path, capfd):
    # On a 2-GPU node: data 2 or tensor 2, two compiles, on two workers at once.
    import pty

    args = ["search", TINY, "--set", "system.name=h100:2", "--set", "parallelism.tensor=1",
            "--axes", "data,tensor"]
    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "experiments.cli", *args, "--store",
                          str(tmp_path / "tty.sqlite"), "--workers", "2"], cwd=REPO,
                         stdin=follower, stdout=subprocess.DEVNULL, stderr=follower,
                         env={**os.environ, "COLUMNS": "160"})
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    assert p.wait() == 0
    err = seen.decode(errors="replace")
    assert "search" in err and "running, 0 failed" in err and "ETA" in err and "2/2" in err
    # Not a terminal: here, stderr is pytest's capture, at both the sys and the fd level.
    assert cli.main([*args, "--store", str(tmp_path / "pipe.sqlite"), "--workers", "1"]) == 0
    assert capfd.readouterr().err == ""


def _wait_rows(store, n, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        time.sleep(0.2)
        if store.exists():
            try:
                if sqlite3.connect(store).execute(
                        "SELECT COUNT(*) FROM results").fetchone()[0] >= n:
                    return True
            except sqlite3.OperationalError:
                pass
    return False


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_the_rerun_completes(tmp_path):
    store = tmp_path / "s.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "search", TINY, "--store", str(store),
         "--axes", "data,tensor", "--workers", "1", "--quiet"], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _wait_rows(store, 1)  # the refusal, stored before any compile starts
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "the same command resumes" in err and "Traceback" not in err
    assert _search_here(store, "--workers", "1") == 0 and len(_rows(store)) == 4


def _result(name, step, mem, fits=True, status="ok"):
    from experiments.store import Result

    return Result(config_hash=name, tool_version="t", backend="cpu", search="s", name=name,
                  config={}, parallelism={}, varied={}, status=status,
                  message="" if status == "ok" else "refused: why",
                  step_time_s=step if status == "ok" else None,
                  tokens_per_s_per_device=1.0, mfu=0.4,
                  memory_per_device_bytes=mem if status == "ok" else None, fits=fits,
                  bottleneck="compute")


@needs_browser
def test_search_page_in_a_headless_browser(tmp_path):
    # Five configs that ran: a (1 s, 40 GB), b (2 s, 20 GB), c (3 s, 10 GB) are the front;
    # d (2.5 s, 30 GB) is beaten by b on both; e does not fit. One refused.
    from experiments import pages, ranking

    results = [_result("a", 1.0, 40e9), _result("b", 2.0, 20e9), _result("c", 3.0, 10e9),
               _result("d", 2.5, 30e9), _result("e", 0.5, 90e9, fits=False),
               _result("f", 0, 0, status="refused")]
    assert [r.name for r in ranking.pareto(results)] == ["e", "a", "b", "c"]
    page_path = tmp_path / "search.html"
    page_path.write_text(pages.search_page(results, "t"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(page_path.as_uri())
        g = page.evaluate("""() => {
          const svg = document.querySelector('svg.pareto');
          const f = svg.querySelector('rect').getBBox();
          return {
            points: Array.from(svg.querySelectorAll('circle.config')).map(c => ({
              x: c.cx.baseVal.value, y: c.cy.baseVal.value, front: c.classList.contains(
                'on-front'), hollow: c.getAttribute('fill') === 'none'})),
            front: svg.querySelector('polyline.front').points.length,
            frame: [f.x, f.y, f.width, f.height],
            ranking: Array.from(document.querySelectorAll('table.ranking tr')).length - 1,
            others: document.querySelector('table.others').innerText};
        }""")
        browser.close()
    assert len(g["points"]) == 5 and g["front"] == 4
    assert sum(p["front"] for p in g["points"]) == 4
    assert sum(p["hollow"] for p in g["points"]) == 1
    x, y, w, h = g["frame"]
    assert all(x <= p["x"] <= x + w and y <= p["y"] <= y + h for p in g["points"])
    # Step time grows upwards, memory to the right: c (3 s, 10 GB) is above and left of
    # a (1 s, 40 GB).
    a, _, c = sorted((p for p in g["points"] if p["front"] and not p["hollow"]),
                     key=lambda p: p["x"], reverse=True)
    assert c["y"] < a["y"] and c["x"] < a["x"]
    assert g["ranking"] == 4 and "refused: why" in g["others"] and "does not fit" in g["others"]


# ---- what a search ranks, and what a rerun reuses ---------------------------------------

def _tiny_raw(**system):
    from experiments.config import load_raw

    raw = load_raw(TINY)
    raw["system"] = {**raw["system"], **system}
    return raw


def test_a_search_ranks_its_own_configs_stored_under_another_name(tmp_path, capsys):
    # The same shardings under another name are the same programs (the name is not in the
    # config hash): stored by the first search, they are the renamed search's ranking,
    # each under the renamed search's name.
    store, out = tmp_path / "s.sqlite", tmp_path / "s.json"
    filled_store(store, _tiny_raw(), label=TINY)
    assert _search_here(store, "--set", "name=renamed", "--json", str(out)) == 0
    assert "4 configs in" in capsys.readouterr().out
    got = json.loads(out.read_text())
    assert len(got["results"]) == 4  # data x tensor: 8x1, 4x2, 2x4, 1x8 (refused)
    # the first that validates (1x8 is refused) was made fastest
    assert got["best"]["name"] == "renamed-data2-tensor4"


def test_a_search_ranks_only_its_system_and_backend(tmp_path, capsys):
    # One store, the same search name on h100:8 (faster, made up) and on a100:8: the
    # a100 search's ranking is its own four configs, and its best an a100 one.
    store, out = tmp_path / "s.sqlite", tmp_path / "s.json"
    filled_store(store, _tiny_raw(), label=TINY, step=1e-4)
    a100 = filled_store(store, _tiny_raw(name="a100:8"), label=TINY, step=1e-3)
    assert _search_here(store, "--set", "system.name=a100:8", "--json", str(out)) == 0
    got = json.loads(out.read_text())
    assert {r["name"] for r in got["results"]} == {c.name for c in a100}
    assert got["best"]["step_time_s"] >= 1e-3
    # `results` ranks each search apart, and says so.
    capsys.readouterr()
    assert cli.main(["results", str(store), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 searches, each ranked apart" in text
    assert f"{TINY} on h100:8 (cpu): 4 configs" in text
    assert f"{TINY} on a100:8 (cpu): 4 configs" in text
    got = json.loads(out.read_text())["searches"]
    assert [(g["system"], len(g["results"])) for g in got] == [("h100:8", 4), ("a100:8", 4)]
    assert got[0]["best"]["step_time_s"] < 1e-3 <= got[1]["best"]["step_time_s"]
    # --html draws one search: refused, naming them, before writing anything.
    html = tmp_path / "s.html"
    assert cli.main(["results", str(store), "--html", str(html)]) == 2
    assert "on a100:8" in capsys.readouterr().err and not html.exists()


def test_a_rerun_retries_failures_and_unfit_configs_only_when_asked(tmp_path, capsys,
                                                                   monkeypatch):
    # data 8 stored as failed, data 4 x tensor 2 as "does not fit": a plain rerun reuses
    # both; --retry-errors sends the failure to the compiler again, --keep-unfit the other.
    from experiments import workers

    sent = []

    def executor(**kwargs):
        def submit(devices, req):
            sent.append(req["config"]["name"])
            f = concurrent.futures.Future()
            f.set_result({"status": "error", "message": "made up"})
            return f
        return submit, lambda interrupted: None, 1

    import concurrent.futures

    monkeypatch.setattr(workers, "executor", executor)
    store = tmp_path / "s.sqlite"
    filled_store(store, _tiny_raw(), label=TINY, errors=("data8",), unfit=("data4-tensor2",))
    assert _search_here(store) == 0 and sent == []
    assert _search_here(store, "--retry-errors") == 0
    assert sent == [f"{TINY}-data8"]
    assert "1 stored failures or unfit configs tried again" in capsys.readouterr().out
    sent.clear()
    assert _search_here(store, "--keep-unfit") == 0
    assert sent == [f"{TINY}-data4-tensor2"]
    rows = {r.name: r.status for r in Store(store).results()}
    assert rows[f"{TINY}-data4-tensor2"] == "error"  # the new answer replaced the old


def test_a_rerun_re_estimates_stored_programs_under_its_calibration(tmp_path, capsys,
                                                                   whole):
    # The stored programs were estimated under the catalog's calibration: a rerun with
    # another re-times them (no compile) and shows those figures, and says so; a rerun
    # with the same calibration again re-times nothing.
    store = tmp_path / "s.sqlite"
    shutil.copy(whole, store)
    cal = tmp_path / "cal.toml"
    cal.write_text("[parameters]\nkernel_overhead_s = 4e-5\n")  # the catalog: 1.2e-5
    before = {n: step for n, _, step in _rows(store).values() if step}
    out = tmp_path / "s.json"
    assert _search_here(store, "--calibration", str(cal), "--json", str(out)) == 0
    text = capsys.readouterr().out
    assert "3 of them re-estimated under this calibration, no compile" in text
    assert "0 compiled now" in text
    after = {r["name"]: r["step_time_s"] for r in json.loads(out.read_text())["results"]
             if r["step_time_s"]}
    assert after.keys() == before.keys() and all(after[n] > before[n] for n in before)
    assert _search_here(store, "--calibration", str(cal)) == 0
    assert "re-estimated" not in capsys.readouterr().out


def test_rows_made_under_an_older_catalog_fit_are_re_estimated(tmp_path, capsys, whole):
    # A refit of meshes/calibration.toml changes the catalog's calibration without a new
    # tool version: rows stored under another catalog fit (here: the "" older stores
    # wrote for the catalog's) are re-timed by a rerun that takes the catalog's.
    store = tmp_path / "s.sqlite"
    shutil.copy(whole, store)
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM results WHERE calibration LIKE "
                          "'%kernel_overhead_s%'").fetchone()[0] == 3
        db.execute("UPDATE results SET calibration = ''")
    assert _search_here(store) == 0
    assert "3 of them re-estimated under this calibration, no compile" in \
        capsys.readouterr().out
    assert _search_here(store) == 0
    assert "re-estimated" not in capsys.readouterr().out


@pytest.mark.parametrize("argv,says", [
    (["--vary", "train.bogus=1,2"], "unknown key 'train.bogus'"),
    (["--vary", "train.remat=full,bogus"], "fix or drop 'bogus'"),
    (["--vary", "train.remat=full", "--vary", "train.remat=none"], "given twice"),
    # the bad key is named, not the good one varied beside it
    (["--vary", "train.remat=full,minimal", "--vary", "workload.kind=bogus"],
     "--vary workload.kind=bogus: workload.kind='bogus'"),
    (["--axes", "data,data"], "data given twice"),
    (["--system", "a100:8"], "only with --reestimate"),
    # every config refused alike, exit 0, was how a wrong backend showed
    (["--backend", "tpu"], "backend 'tpu' compiles for TPU systems; h100:8 is not one"),
    (["--json", "nodir/s.json"], "nodir' does not exist"),
    (["--html", "nodir/s.html"], "nodir' does not exist"),
])
def test_search_mistakes_are_one_line_before_the_store_is_made(tmp_path, capsys, argv, says):
    store = tmp_path / "s.sqlite"
    argv = [a.replace("nodir", str(tmp_path / "nodir")) for a in argv]
    assert cli.main(["search", TINY, "--store", str(store), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
    assert not store.exists()


def test_reestimate_of_a_search_the_store_lacks_names_those_it_holds(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    filled_store(store, _tiny_raw(), label=TINY)
    assert cli.main(["search", TINY, "--set", "name=other", "--store", str(store),
                     "--reestimate", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"holds '{TINY}'" in err and "'other'" in err
