"""`shardscope fit`: the memory verdict, and the changes that make a step fit, checked."""

import json

import pytest

from experiments import cli, fit, runner
from experiments import config as config_mod
from tests.helpers import tpu_compiler_refuses

# One attention head (tensor parallelism cannot split it) and a wide MLP: the backward
# working set of 128 sequences of 1024 tokens per GPU is what does not fit, and only fewer
# sequences at a time (gradient accumulation) shrink it: the state is small, the layer
# inputs are already offloaded, and moving data ways to FSDP shrinks only the state.
ONLY_MICROBATCHES = """
name = "only-microbatches"
[model]
n_layers = 2
d_model = 1024
n_heads = 1
n_kv_heads = 1
head_dim = 128
d_ff = 65536
vocab = 1024
[system]
name = "h100:8"
[parallelism]
data = 8
[workload]
seq_len = 1024
global_batch = 1024
[train]
remat = "custom"
offload = ["decoder_layer_input"]
"""


def test_fit_finds_gradient_accumulation_and_the_change_compiles_and_fits(tmp_path, capsys,
                                                                         cpu_devices):
    path = tmp_path / "c.toml"
    path.write_text(ONLY_MICROBATCHES)
    out = tmp_path / "fit.json"
    assert cli.main(["fit", str(path), "--top", "1", "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert not d["fits"] and d["memory_per_device_bytes"] > d["hbm_capacity_bytes"]
    assert text.splitlines()[0].startswith("only-microbatches on h100:8: DOES NOT FIT")
    parts = {p["part"]: p["bytes"] for p in d["breakdown"]}
    assert max(parts, key=parts.get) == "one layer's backward working set"
    (best,) = d["suggestions"]
    assert list(best["changes"]) == ["workload.microbatches"] and best["fits"]
    assert best["step_time_s"] > 0 and "workload.microbatches = " in text
    # the suggestion, applied, compiles and fits, with the memory fit said
    exp = fit._changed(config_mod.load(path), best["changes"])
    report = runner.run(exp)
    assert report.fits and report.memory_per_device_bytes == pytest.approx(
        best["memory_per_device_bytes"])


def test_a_step_that_fits_gets_no_suggestions(tmp_path, capsys):
    assert cli.main(["fit", "tiny-h100-dp-tp", "--quiet", "--json",
                     str(tmp_path / "f.json")]) == 0
    d = json.loads((tmp_path / "f.json").read_text())
    assert d["fits"] and d["suggestions"] == []
    assert {"part", "bytes"} == set(d["breakdown"][0])
    # the runtime's reserve is part of the verdict, with its source
    assert any(p["part"].startswith("CUDA context") for p in d["breakdown"])


def test_the_search_combines_changes_when_no_single_one_is_enough():
    # 128 sequences of 8192 tokens of Llama 3 8B on 8 data-parallel GPUs: no single change
    # the search tries fits; a pair does, and every suggestion fits by the memory model.
    exp = config_mod.load("tiny-h100-dp-tp", [
        "model.preset='llama3-8b'", "model.n_kv_heads=8", "parallelism.data=8",
        "parallelism.tensor=1", "workload.seq_len=8192", "workload.global_batch=128"])
    cap = exp.system.chip.hbm_bytes
    singles = [c for c in fit.candidates(exp) if fit._changed(exp, c) is not None]
    assert singles and all(fit.memory_of(fit._changed(exp, c)).total_bytes > cap
                           for c in singles)
    found = fit.search(exp, compile=False, limit=3)
    assert found and all(len(s.changes) >= 2 and s.fits and
                         s.memory_per_device_bytes <= cap for s in found)
    assert all(fit.memory_of(fit._changed(exp, s.changes)).total_bytes <= cap for s in found)
    # The same without remat (5.4x the HBM): the fitting pairs come after many that do not,
    # and the search said "no change is enough" once it had sized 60 candidates.
    bigger = config_mod.load("tiny-h100-dp-tp", [
        "model.preset='llama3-8b'", "model.n_kv_heads=8", "parallelism.data=8",
        "parallelism.tensor=1", "workload.seq_len=8192", "workload.global_batch=64",
        "train.remat='none'"])
    found = fit.search(bigger, compile=False, limit=3)
    assert found and all(fit.memory_of(fit._changed(bigger, s.changes)).total_bytes <= cap
                         for s in found)


def test_a_large_data_axis_can_move_whole_to_fsdp():
    # Llama 3 70B over 32 data-parallel H100s: only sharding the weights and optimizer
    # state over (nearly) all 32 fits; moving 2, 4 or 8 of the ways is not enough, and the
    # search used to try no more than those.
    exp = config_mod.load("tiny-h100-dp-tp", [
        "model.preset='llama3-70b'", "model.n_kv_heads=8", "system.name='h100:32'",
        "parallelism.data=32", "parallelism.tensor=1", "workload.seq_len=4096",
        "workload.global_batch=32"])
    found = fit.search(exp, compile=False, limit=3)
    assert {"parallelism.data": 1, "parallelism.fsdp": 32} in [s.changes for s in found]
    assert all(s.memory_per_device_bytes <= exp.system.chip.hbm_bytes for s in found)


@pytest.mark.tpu
@pytest.mark.parametrize("backend", ["tpu", "auto"])
def test_a_step_the_tpu_compiler_refuses_is_a_verdict_not_an_error(tmp_path, capsys,
                                                                   cpu_devices, monkeypatch,
                                                                   backend):
    # The TPU compiler's out-of-memory refusal, given here so that it costs a tiny compile
    # (tests/sharding/test_compiler_tpu.py has it for real). `fit --backend tpu` ended in
    # "error: the program does not fit: ... (compile with --backend cpu ...)", exit 2,
    # without the verdict or the changes `fit` exists for; `--backend auto` fell back to
    # the CPU path and said "fits" from the memory model, the TPU compiler's refusal lost.
    tpu_compiler_refuses(monkeypatch)
    path = tmp_path / "t.toml"
    path.write_text(config_mod.resolve("tiny-h100-dp-tp").read_text().replace(
        '"h100:8"', '"tpu-v5e:2x4"'))
    out = tmp_path / "f.json"
    code = cli.main(["fit", str(path), "--backend", backend, "--quiet", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    d = json.loads(out.read_text())
    assert not d["fits"] and "DOES NOT FIT" in text.splitlines()[0]
    assert any(n.startswith("the TPU compiler (libtpu, deviceless v5e:2x4) refused it: the "
                            "program does not fit") for n in d["notes"])


def test_auto_hands_a_gpu_run_past_one_compile_to_the_gpu_compiler_as_run_does(monkeypatch):
    # `run --backend auto` compiles a GPU run whole with XLA:GPU (only a TPU pod is read
    # from fewer replicas): `fit` read every run past 2048 devices from the memory model.
    from types import SimpleNamespace

    from sharding import compiler

    exp = config_mod.load("llama3-405b-h100-16384-tp8-pp16-dp128")
    monkeypatch.setattr(compiler, "resolve_backend", lambda backend, system: "gpu")
    used = []

    def compiled(exp, *, backend, calibration):
        used.append(backend)
        return SimpleNamespace(memory=fit.memory_of(exp))

    monkeypatch.setattr(runner, "run", compiled)
    fit.fit(exp, backend="auto", compile=False)
    assert used == ["gpu"]
