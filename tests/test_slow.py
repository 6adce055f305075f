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
