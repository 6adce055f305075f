"""`shardscope compare`: one config on several systems, one compile per device count."""

import json

import pytest

from experiments import cli

TINY = "tiny-h100-dp-tp"  # data 2 x tensor 4 on h100:8


def test_compare_retimes_one_compile_and_matches_a_fresh_one(tmp_path, capsys, cpu_devices,
                                                               monkeypatch):
    import sharding.api

    compiles = []
    real = sharding.api.compile_to_hlo
    monkeypatch.setattr(sharding.api, "compile_to_hlo",
                        lambda *a, **k: compiles.append(1) or real(*a, **k))
    out = tmp_path / "c.json"
    code = cli.main(["compare", TINY, "--systems", "h100:8,b200:8,a100:16", "--quiet",
                     "--price-per-device-hour", "2.0", "--json", str(out)])
    assert code == 0
    assert compiles == [1]  # b200:8 re-timed from the h100:8 compile; a100:16 refused
    systems = {s["system"]: s for s in json.loads(out.read_text())["systems"]}
    for s in systems.values():
        for key in ("system", "parallelism", "step_time_s", "tokens_per_s", "mfu",
                    "bottleneck", "fits", "power_w", "joules_per_token",
                    "usd_per_million_tokens"):
            assert key in s
    assert systems["a100:16"]["status"] == "refused"
    assert "has 16" in systems["a100:16"]["message"]
    b200 = systems["b200:8"]
    assert b200["retimed_from"] == "h100:8"
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
    # The re-timed column equals compiling for the B200 node.
    fresh = tmp_path / "fresh.json"
    assert cli.main(["run", TINY, "--set", "system.name=b200:8", "--quiet", "--json",
                     str(fresh)]) == 0
    assert b200["step_time_s"] == pytest.approx(json.loads(fresh.read_text())["step_time_s"],
                                                rel=1e-9)
    text = capsys.readouterr().out
    assert "re-timed from h100:8" in text and "power (facility)" in text


def test_compare_needs_systems(capsys):
    assert cli.main(["compare", TINY, "--systems", ","]) == 2
    assert "--systems: give at least one system" in capsys.readouterr().err
