"""Other device counts run in a subprocess with their own fake CPU device count."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_default_experiment_on_72_fake_devices(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "run", "experiments/configs/llama3-8b-nvl72.toml",
         "--set", "model.n_layers=2", "--set", "workload.seq_len=1024", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert d["num_devices"] == 72
    cols = d["collectives"]
    # FSDP over 8 consecutive GPUs (two trays) inside the rack; data over the 9 groups.
    ag = [c for c in cols if c["kind"] == "all-gather" and c["mesh_axes"] == ["fsdp"]]
    assert ag and all(c["group_size"] == 8 and c["link"] == "nvlink" for c in ag)
    assert all(sorted(g) == list(range(g[0], g[0] + 8)) for c in ag for g in c["groups"])
    assert any(c["mesh_axes"] == ["data"] and c["group_size"] == 9 for c in cols)
    # Gradients: reduce-scattered over fsdp then all-reduced over data, in the program dtype.
    assert d["by_kind"]["reduce-scatter"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("config, stages, microbatches, virtual, placed", [
    ("llama3-405b-gb200-512-tp4-pp8-cp2-fp8", 8, 144, 8, "8 racks x 64 GPUs of 72"),
    ("llama3-405b-h100-1024-tp4-pp8-cp2-fp8", 8, 72, 8, ""),
    ("llama3-70b-h100-64-tp4-pp8-interleaved", 8, 64, 5, ""),
])
def test_published_large_run_configs_run_on_the_default_path(tmp_path, config, stages,
                                                              microbatches, virtual, placed):
    # Megatron / MLPerf shardings (TP x interleaved PP x CP, FP8) on XLA:CPU, as `make`
    # installs it: the report shows the schedule and its bubble, (P-1)/(MV+P-1).
    out = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "run", f"experiments/configs/{config}.toml",
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    assert "bubble" in p.stdout and placed in p.stdout.splitlines()[0]
    d = json.loads(out.read_text())
    pipe = d["pipeline"]
    assert (pipe["stages"], pipe["microbatches"], pipe["virtual_stages"]) == (
        stages, microbatches, virtual)
    assert pipe["bubble"] == pytest.approx((stages - 1) / (microbatches * virtual + stages - 1))
    assert any(c["kind"] == "collective-permute" and c["mesh_axes"] == ["pipeline"]
               for c in d["collectives"])
