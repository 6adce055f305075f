"""`shardscope compare`: one config on several systems, one compile per device count."""

import json

import pytest

from experiments import cli
from tests.helpers import CHROMIUM, filled_store, needs_browser, sync_playwright, write
from tests.helpers import TINY as TINY_TOML

TINY = "tiny-h100-dp-tp"  # data 2 x tensor 4 on h100:8


def test_compare_retimes_one_compile_and_matches_a_fresh_one(tmp_path, capsys, cpu_devices,
                                                               monkeypatch):
    import sharding.api

    compiles = []
    real = sharding.api.compile_to_hlo
    monkeypatch.setattr(sharding.api, "compile_to_hlo",
                        lambda *a, **k: compiles.append(1) or real(*a, **k))
    out = tmp_path / "c.json"
    code = cli.main(["compare", TINY, "--systems", "h100:8,b200:8,a100:7", "--quiet",
                     "--price-per-device-hour", "2.0", "--power-budget", "1MW", "--tokens",
                     "1e9", "--json", str(out)])
    assert code == 0
    assert compiles == [1]  # b200:8 re-timed from the h100:8 compile; a100:7 refused
    report = json.loads(out.read_text())
    assert report["model"] == "tiny (n_kv_heads 4)"  # the file's preset, and its change
    systems = {s["system"]: s for s in report["systems"]}
    for s in systems.values():
        for key in ("system", "parallelism", "step_time_s", "tokens_per_s", "mfu",
                    "bottleneck", "fits", "power_w", "joules_per_token",
                    "usd_per_million_tokens"):
            assert key in s
    # Neither data (2) nor fsdp (4) rescales to 7 devices with tensor 1 and 16 sequences.
    assert systems["a100:7"]["status"] == "refused"
    assert "7" in systems["a100:7"]["message"]
    b200 = systems["b200:8"]
    assert b200["retimed_from"] == "h100:8"
    # "fits" read against each chip's HBM per device (nvidia-smi's 183359 MiB on a B200,
    # 81559 MiB on an H100), beside the memory it needs
    assert b200["hbm_capacity_bytes"] == 183359 * 2**20
    assert systems["h100:8"]["hbm_capacity_bytes"] == 81559 * 2**20
    assert b200["memory_per_device_bytes"] < b200["hbm_capacity_bytes"] and b200["fits"]
    # Power: 8 B200s from 15% of their 1000 W TDP (waiting) to all of it (busy), the DGX
    # B200's other 6.3 kW of its 14.3 kW rating at the 61% an H100 node's rest draws under
    # training (8.4 kW peak of 10.2 rated, 8 x 700 W GPUs), times PUE 1.56; energy per
    # token = power / tokens per second; cost = $2 per device-hour x 8 devices over the
    # tokens of an hour, per million.
    busy = b200["power"]["busy"]
    rest = (14300 - 8 * 1000) * (8400 - 8 * 700) / (10200 - 8 * 700)
    assert b200["power_w"] == pytest.approx((8 * 1000 * (0.15 + 0.85 * busy) + rest) * 1.56)
    assert b200["joules_per_token"] == pytest.approx(b200["power_w"] / b200["tokens_per_s"])
    assert b200["usd_per_million_tokens"] == pytest.approx(
        2.0 * 8 / 3600 / b200["tokens_per_s"] * 1e6)
    # What a 1 MW building feeds, and a run of 1e9 tokens on the 8 B200s and in it.
    plan = b200["scale_out"]
    # whole data-parallel replicas of 4 B200s (tensor 4), each half the 8's power
    assert plan["chips_within_budget"] == int(1e6 // (b200["power_w"] / 2)) * 4
    assert plan["run"]["time_s"] == pytest.approx(1e9 / b200["tokens_per_s"])
    assert plan["run_within_budget"]["time_s"] == pytest.approx(
        1e9 / (b200["tokens_per_s"] / 8 * plan["chips_within_budget"]))
    # The re-timed column equals compiling for the B200 node.
    fresh = tmp_path / "fresh.json"
    assert cli.main(["run", TINY, "--set", "system.name=b200:8", "--quiet", "--json",
                     str(fresh)]) == 0
    assert b200["step_time_s"] == pytest.approx(json.loads(fresh.read_text())["step_time_s"],
                                                rel=1e-9)
    text = capsys.readouterr().out
    assert "re-timed from h100:8" in text and "power (facility)" in text
    hbm = next(line for line in text.splitlines() if line.startswith("HBM/device"))
    assert hbm.split()[1:5] == ["85.52", "GB", "192.27", "GB"]  # h100:8, b200:8
    assert "on 3 systems\nmodel: tiny (n_kv_heads 4)\n" in text
    assert "chips in 1 MW" in text and "1e+09 tokens in 1 MW" in text


def test_compare_needs_systems(capsys):
    assert cli.main(["compare", TINY, "--systems", ","]) == 2
    assert "--systems: give at least one system" in capsys.readouterr().err


def test_sharding_fits_each_systems_device_count():
    from experiments.compare import fit_to_devices

    # FSDP takes the ratio (256 TPU7x chips are 512 devices); tensor stays.
    raw = {"parallelism": {"fsdp": 32, "tensor": 8}}
    assert fit_to_devices(raw, 512) == "fsdp 32 -> 64 for its 512 devices"
    assert raw["parallelism"] == {"fsdp": 64, "tensor": 8}
    raw = {"parallelism": {"data": 2, "tensor": 4}}  # no FSDP: data does
    assert fit_to_devices(raw, 4) == "data 2 -> 1 for its 4 devices"
    raw = {"parallelism": {"data": 2, "tensor": 4}}  # not a multiple: data still rescales
    assert fit_to_devices(raw, 12) == "data 2 -> 3 for its 12 devices"
    raw = {"parallelism": {"data": 2, "tensor": 4}}  # no whole data-parallel degree
    assert fit_to_devices(raw, 6) == "" and raw["parallelism"]["data"] == 2
    # 256 sequences do not split 512 ways: the TensorCore pair goes to tensor instead.
    raw = {"parallelism": {"fsdp": 256}, "workload": {"global_batch": 256}}
    assert fit_to_devices(raw, 512) == "tensor 1 -> 2 for its 512 devices"


def test_compare_with_search_picks_each_systems_fastest(tmp_path, capsys, cpu_devices):
    # Two devices each (data 2 or tensor 2; one TPU7x chip is 2 TensorCores): two
    # compiles per search.
    out = tmp_path / "c.json"
    args = ["compare", TINY, "--systems", "h100:2,tpu7x:1x1x1", "--search", "--axes",
            "data,tensor", "--store", str(tmp_path / "s.sqlite"), "--workers", "1",
            "--quiet", "--json", str(out)]
    assert cli.main(args) == 0
    from experiments import ranking
    from experiments.store import Store

    with Store(tmp_path / "s.sqlite") as store:
        for system in ("h100:2", "tpu7x:1x1x1"):
            ranked = ranking.ranking(store.results(search=f"compare {TINY} on {system}"))
            entry = next(s for s in json.loads(out.read_text())["systems"]
                         if s["system"] == system)
            # the search's fastest, run again in full: the same sharding and step time
            assert entry["parallelism"] == {a: s for a, s in ranked[0].parallelism.items()
                                            if s > 1}
            assert entry["step_time_s"] == pytest.approx(ranked[0].step_time_s, rel=1e-9)
            assert entry["note"].startswith("searched:")
        before = len(store.results())
    # a rerun searches nothing again (the store has every result) and re-times the winners
    assert cli.main(args) == 0
    with Store(tmp_path / "s.sqlite") as store:
        assert len(store.results()) == before
    # (the TPU's program is its own: a GPU system's saves what Transformer Engine's fused
    # kernels save, so it is compiled, not re-timed from the H100's)
    assert json.loads(out.read_text())["systems"][1]["retimed_from"] is None


@needs_browser
def test_compare_page_in_a_headless_browser(tmp_path, capsys, cpu_devices):
    # The tiny config on three 8-device systems (compiled once, re-timed on the others);
    # the TPU has no public power figure or price, so its per-MW and USD bars are left out
    # and said; the B200 has no public price either.
    page_path = tmp_path / "compare.html"
    assert cli.main(["compare", write(tmp_path, TINY_TOML), "--systems",
                     "h100:8,b200:8,tpu-v5e:2x4", "--quiet", "--html", str(page_path)]) == 0
    capsys.readouterr()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(page_path.as_uri())
        charts = page.evaluate("""() => Array.from(document.querySelectorAll('svg.bars')).map(
          svg => ({cls: svg.getAttribute('class'),
                   bars: Array.from(svg.querySelectorAll('rect.bar')).map(r => ({
                     w: r.width.baseVal.value, best: r.classList.contains('best'),
                     label: r.querySelector('title').textContent})),
                   missing: svg.nextElementSibling && svg.nextElementSibling.tagName === 'P'
                            ? svg.nextElementSibling.innerText : ''}))""")
        table = page.inner_text("pre.table")
        browser.close()
    by = {c["cls"].split()[1]: c for c in charts}
    assert set(by) == {"step", "tokens", "mfu", "per-mw", "usd"}
    for name in ("step", "tokens", "mfu"):
        bars = by[name]["bars"]
        assert len(bars) == 3 and sum(b["best"] for b in bars) == 1
        assert all(b["w"] > 0 for b in bars)
    # Lower is better for the step: the best bar is the shortest; higher for tokens/s.
    step, tokens = by["step"]["bars"], by["tokens"]["bars"]
    assert min(step, key=lambda b: b["w"])["best"]
    assert max(tokens, key=lambda b: b["w"])["best"]
    assert len(by["per-mw"]["bars"]) == 2 and "tpu-v5e:2x4" in by["per-mw"]["missing"]
    assert len(by["usd"]["bars"]) == 1 and "b200:8, tpu-v5e:2x4" in by["usd"]["missing"]
    assert "step time" in table and "b200:8" in table


def test_a_system_whose_step_does_not_fit_is_never_the_best_bar(cpu_devices):
    # The faster system does not fit (its HBM made tiny here): its bars are drawn grey and
    # labelled, and the best of each figure is the fastest system that fits.
    import dataclasses
    import re

    from experiments import config, runner
    from experiments.compare import Entry
    from experiments.pages import compare_page

    reps = {s: runner.run(config.load(TINY, [f"system.name='{s}'"])) for s in ("h100:8",
                                                                              "b200:8")}
    fast, slow = sorted(reps, key=lambda s: reps[s].step_time_s)
    unfit = dataclasses.replace(reps[fast], hbm_capacity_bytes=1.0)
    assert not unfit.fits and reps[slow].fits
    page = compare_page([Entry(fast, "ok", report=unfit), Entry(slow, "ok", report=reps[slow])])
    best = re.findall(r'<rect class="bar best"[^>]*><title>(.+?): ', page)
    assert best and set(best) == {slow}
    assert f"{fast} (no fit)" in page


def test_compare_search_ranks_the_shardings_another_search_stored(tmp_path):
    # The shardings of the tiny config on h100:8, stored by a search under its own name:
    # compare's search of the same config is those same programs, and finds its best
    # among them (nothing compiles: every candidate is in the store).
    from experiments import compare as compare_mod
    from experiments.config import load_raw

    raw = load_raw(TINY)
    store = tmp_path / "s.sqlite"
    filled_store(store, raw, ("data", "fsdp", "tensor"), label=TINY)
    config, note, why = compare_mod._searched(
        raw, "h100:8", 8, {"store": str(store), "workers": 1}, None, None)
    assert why == "" and config is not None, why
    assert "fastest of 9 that fit" in note  # 10 shardings, tensor 8 refused


@pytest.mark.parametrize("flag", ["--json", "--html"])
def test_compare_refuses_an_output_it_cannot_write_before_compiling(tmp_path, capsys,
                                                                    monkeypatch, flag):
    from experiments import compare as compare_mod

    monkeypatch.setattr(compare_mod, "compare", lambda *a, **k: pytest.fail("compiled"))
    out = tmp_path / "nodir" / "c.out"
    assert cli.main(["compare", TINY, "--systems", "h100:8", "--quiet", flag, str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag} " in err and "does not exist" in err


@pytest.mark.parametrize("price", ["nan", "inf", "0"])
def test_a_price_that_is_not_a_positive_number_is_one_line(price, capsys):
    # nan reached [cost] and was refused under the wrong name (cost.usd_per_chip_hour);
    # inf priced every system at "$inf" per million tokens.
    assert cli.main(["compare", TINY, "--systems", "h100:8", "--quiet",
                     "--price-per-device-hour", price]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--price-per-device-hour {float(price)}" in err and "above 0" in err
    assert "\n" not in err


def test_compare_names_the_systems_whose_power_counts_chips_only(capsys, cpu_devices):
    # The footer says power is chips, hosts, NICs and switches: a GB300 rack has no public
    # rating of the rest, so its column is its chips alone, and the table says so.
    assert cli.main(["compare", TINY, "--systems", "gb200-nvl72:8,gb300-nvl72:8",
                     "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "power of gb300-nvl72:8: chips only (no public rating" in out
    assert "power of gb200-nvl72:8" not in out


def test_compare_fit_and_search_say_which_calibration_they_used(tmp_path, capsys,
                                                               cpu_devices, monkeypatch):
    # --calibration FILE changes every step time of compare, fit and search; only `run`
    # said which calibration its figures were made with. A line names the file, and
    # --json carries it as `run --json` does. The file is read once a command (compare
    # read it three times: for its compiles, its search and its JSON).
    from experiments import config

    reads = []
    real = config.load_calibration
    monkeypatch.setattr(config, "load_calibration", lambda p: reads.append(p) or real(p))
    cal = tmp_path / "mine.toml"
    cal.write_text('[parameters]\ngpu_bf16_matmul_efficiency = 0.4\n'
                   '[provenance]\nsummary = "my cluster, 3 runs"\n')
    out = tmp_path / "c.json"
    for command in (["compare", TINY, "--systems", "h100:8"], ["fit", TINY, "--no-compile"]):
        reads.clear()
        assert cli.main([*command, "--quiet", "--calibration", str(cal), "--json",
                         str(out)]) == 0
        assert reads == [str(cal)], command
        line = next(ln for ln in capsys.readouterr().out.splitlines()
                    if ln.startswith("calibration: "))
        assert "my cluster, 3 runs" in line and str(cal) in line
        used = json.loads(out.read_text())["calibration"]
        assert used["gpu_bf16_matmul_efficiency"] == 0.4 and used["source"] in line


def test_the_configs_chip_price_prices_its_own_chip_only(tmp_path, cpu_devices):
    # `[cost] usd_per_chip_hour = 2` is what the config's H100s cost: it priced the B200 and
    # the TPU v6e at $2 too. Now the B200 has no price (none public) and the v6e its
    # catalog's $2.70; each column's $ per million tokens = price x 8 chips / tokens an hour.
    out = tmp_path / "c.json"
    assert cli.main(["compare", TINY, "--systems", "h100:8,b200:8,tpu-v6e:2x4", "--quiet",
                     "--set", "cost.usd_per_chip_hour=2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny (n_kv_heads 4)"  # the file's preset, and its change
    systems = {s["system"]: s for s in report["systems"]}
    for name, price in (("h100:8", 2.0), ("tpu-v6e:2x4", 2.70)):
        s = systems[name]
        assert s["usd_per_million_tokens"] == pytest.approx(
            price * 8 / 3600 / s["tokens_per_s"] * 1e6)
    assert systems["b200:8"]["usd_per_million_tokens"] is None
    assert "usd_per_chip_hour prices its h100: not applied" in systems["b200:8"]["note"]


def test_compare_says_a_torus_links_figure_is_one_links(capsys, cpu_devices):
    # The row read "nvlink 450, infiniband 50 | ici 45": an H100's NVLink figure is the
    # GPU's whole bandwidth, a v5e's ICI figure one of its chip's four links (180 GB/s one
    # way in all), and TPU7x's DCN figure one chip's, two devices'.
    code = cli.main(["compare", TINY, "--systems", "h100:8,tpu-v5e:2x4,tpu7x:1x1x1*4",
                     "--quiet"])
    assert code == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines()
               if ln.startswith("links GB/s per device"))
    assert row.split()[4:] == ["nvlink", "450,", "infiniband", "50", "ici", "45/link",
                               "ici", "90/link,", "dcn", "12/chip"]


def test_compare_says_which_systems_were_read_from_fewer_replicas(cpu_devices):
    # A system past one compile is compiled with fewer data-parallel replicas (here 2 of 4,
    # on 4 devices) and read as the full run: its column and its JSON say so.
    from experiments import config, runner
    from experiments.compare import Entry, format_compare

    exp = config.load(TINY, ["parallelism.data=4", "parallelism.tensor=2"])
    read = Entry("h100:8", "ok", report=runner.run(exp, max_compile_devices=4))
    whole = Entry("h100:8", "ok", report=runner.run(exp))
    compiled = next(ln for ln in format_compare([read, whole]).splitlines()
                    if ln.startswith("compiled"))
    assert compiled.split()[1:] == ["extrapolated", "yes"], compiled
    assert read.to_dict()["extrapolated_from"].startswith("compiled on 4 devices (2 of the 4")
    assert whole.to_dict()["extrapolated_from"] is None
