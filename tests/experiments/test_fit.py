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
    # the line and the JSON say what the change does to the micro-batch: 1024 sequences over
    # 8 ranks are 128 a rank in one microbatch, 128 / k in each of k
    k = best["changes"]["workload.microbatches"]
    assert best["microbatches"] == [1, k] and best["micro_batch_per_rank"] == [128, 128 // k]
    assert (f"micro-batch 128 -> {128 // k} sequences per data-parallel rank, microbatches "
            f"1 -> {k}, global batch 1024 kept") in text
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


# MaxText's rules make a GPU config a JAX-style one (frameworks.style), searched with FSDP
# among its first changes; with tensor = 1 they change nothing else.
MAXTEXT_STYLE = "parallelism.rules='maxtext'"


def test_the_search_combines_changes_when_no_single_one_is_enough():
    # 128 sequences of 8192 tokens of Llama 3 8B on 8 data-parallel GPUs: no single change
    # the search tries fits; a pair does, and every suggestion fits by the memory model.
    exp = config_mod.load("tiny-h100-dp-tp", [
        "model.preset='llama3-8b'", "model.n_kv_heads=8", "parallelism.data=8",
        "parallelism.tensor=1", "workload.seq_len=8192", "workload.global_batch=128",
        MAXTEXT_STYLE])
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
        "train.remat='none'", MAXTEXT_STYLE])
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
        "workload.global_batch=32", MAXTEXT_STYLE])
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


# Llama 3 8B, 64 sequences of 8192 tokens on 8 data-parallel H100s without FSDP, its
# gradient sum overlapped in buckets (Megatron's --overlap-grad-reduce): a config as
# Megatron-LM runs one (the README's `fit` example).
MEGATRON_8B = ["model.preset='llama3-8b'", "model.n_kv_heads=8", "parallelism.data=8",
               "parallelism.tensor=1", "workload.seq_len=8192", "workload.global_batch=64",
               "train.overlap_grad_reduce=true"]


def test_data_parallelism_alone_on_gpus_is_ranked_as_jax_runs_it():
    # The same run without Megatron's overlapped gradient sum: nothing in it says Megatron
    # (a plain JAX data-parallel run), so FSDP is ranked by its step time like any change and the
    # verdict says nothing of Megatron (it was ranked last, "as Megatron-LM runs it").
    exp = config_mod.load("tiny-h100-dp-tp", MEGATRON_8B[:-1])
    verdict = fit.fit(exp, compile=False, limit=4)
    assert verdict.style == "jax" and not verdict.fits
    assert not any("Megatron" in s.describe() for s in verdict.suggestions)
    assert "Megatron" not in verdict.format()
    # with one of Megatron's own settings, or a model-parallel axis, it is Megatron's
    for extra in (MEGATRON_8B[-1:], ["train.shard_optimizer_over_data=true"],
                  ["parallelism.data=4", "parallelism.tensor=2"]):
        megatron = config_mod.load("tiny-h100-dp-tp", [*MEGATRON_8B[:-1], *extra])
        assert fit.style(megatron) == "megatron", extra


def test_a_serving_config_on_gpus_gets_no_megatron_wording():
    # vLLM-style decode of Llama 3 70B, 2 replicas of tensor 4 on one H200 node, its cache
    # grown past HBM: Megatron-LM trains, it does not serve, so the ways moved from data
    # are not "as Megatron-LM runs it" (they were, it being a GPU config without FSDP).
    exp = config_mod.load("llama3-70b-decode-h200-8", [
        "parallelism.data=2", "parallelism.tensor=4", "workload.global_batch=352"])
    verdict = fit.fit(exp, compile=False)
    assert verdict.style == "jax" and not verdict.fits and verdict.suggestions
    assert "Megatron" not in verdict.format()


def test_a_megatron_style_config_gets_megatrons_changes_before_fsdp():
    # fit led with data = 1, fsdp = 8: Megatron has no FSDP beyond its distributed
    # optimizer in its usual recipes. Tensor parallelism fits too, and moving data ways to
    # it keeps each rank's micro-batch (Megatron keeps --micro-batch-size; its number of
    # microbatches, global batch / (micro-batch x data-parallel), grows), said in the line.
    exp = config_mod.load("tiny-h100-dp-tp", MEGATRON_8B)
    verdict = fit.fit(exp, compile=False, limit=4)
    d = json.loads(json.dumps(verdict.to_dict()))
    assert d["style"] == "megatron" and not d["fits"]
    found = verdict.suggestions
    first = found[0].changes
    assert "parallelism.fsdp" not in first and first["parallelism.tensor"] > 1
    foreign = [bool(fit._foreign(s.changes, exp)) for s in found]
    assert foreign == sorted(foreign)  # what Megatron runs, then what it does not
    for s, sd in zip(found, d["suggestions"]):
        if "parallelism.tensor" in s.changes:  # 8 sequences a rank, before and after
            ways = 8 // s.changes["parallelism.data"]
            assert s.changes["workload.microbatches"] == ways
            assert sd["microbatches"] == [1, ways] and sd["micro_batch_per_rank"] == [8, 8]
            assert (f"microbatches 1 -> {ways}, micro-batch kept at 8 sequences per "
                    f"data-parallel rank, global batch 64 kept") in s.describe()
        if "parallelism.fsdp" in s.changes:
            assert "FSDP: past the distributed optimizer (ZeRO-1)" in s.describe()
    assert "as Megatron-LM runs it: tensor, pipeline, context parallelism before FSDP" in (
        verdict.format())


def test_megatron_style_splits_a_model_over_tensor_and_pipeline_before_fsdp():
    # Llama 3 70B over 32 data-parallel H100s, Megatron-style (its overlapped gradient
    # sum): no single change Megatron runs fits, and fit offered FSDP alone; Megatron's way
    # is tensor 8 (the 8 KV heads) x pipeline 4, the number of microbatches grown to keep
    # one sequence a rank.
    exp = config_mod.load("tiny-h100-dp-tp", [
        "model.preset='llama3-70b'", "model.n_kv_heads=8", "system.name='h100:32'",
        "parallelism.data=32", "parallelism.tensor=1", "workload.seq_len=4096",
        "workload.global_batch=32", "train.overlap_grad_reduce=true"])
    found = fit.search(exp, compile=False, limit=6)
    tp_pp = {"parallelism.data": 1, "parallelism.tensor": 8, "parallelism.pipeline": 4,
             "workload.microbatches": 32}
    changes = [s.changes for s in found]
    assert tp_pp in changes
    fsdp = [i for i, c in enumerate(changes) if "parallelism.fsdp" in c]
    assert fsdp and changes.index(tp_pp) < min(fsdp)
    assert all(s.memory_per_device_bytes <= exp.system.chip.hbm_bytes for s in found)


def test_a_jax_style_move_says_the_micro_batch_it_grows():
    # MaxText-style (its rules): data ways moved to tensor keep the number of microbatches,
    # so each data-parallel rank's micro-batch doubles; the line says so, not silently.
    exp = config_mod.load("tiny-h100-dp-tp", [*MEGATRON_8B, MAXTEXT_STYLE])
    move = {"parallelism.data": 4, "parallelism.tensor": 2}
    assert move in fit.candidates(exp)
    s = fit._suggestion(exp, move, fit.memory_of(fit._changed(exp, move)).total_bytes)
    assert s.microbatches == (1, 1) and s.micro_batch_per_rank == (8, 16)
    assert ("micro-batch 8 -> 16 sequences per data-parallel rank, microbatches kept at 1, "
            "global batch 64 kept") in s.describe()
    assert json.loads(json.dumps(s.to_dict()))["micro_batch_per_rank"] == [8, 16]


def test_an_imported_maxtext_context_parallel_run_splits_its_state_over_the_context_ranks(
        tmp_path, capsys):
    # A tpu-recipes-style MaxText run: FSDP takes what context parallelism leaves of the
    # slice. MaxText splits the weights' width over fsdp x context (base.yml's `embed`
    # rule), so each device holds 1/16 of the f32 weights, gradients and Adam moments, not
    # the 1/8 FSDP alone would give (what read a tpu7x CP-8 recipe as DOES NOT FIT).
    yml = tmp_path / "cp.yml"
    yml.write_text("model_name: llama3-8b\nici_fsdp_parallelism: -1\n"
                   "ici_context_parallelism: 2\nmax_target_length: 8192\n")
    toml, out = tmp_path / "cp.toml", tmp_path / "fit.json"
    assert cli.main(["import", "maxtext", str(yml), "--system", "tpu-v5e:4x4", "--out",
                     str(toml), "--quiet"]) == 0
    assert cli.main(["fit", str(toml), "--no-compile", "--quiet", "--json", str(out)]) == 0
    capsys.readouterr()
    parts = {p["part"]: p["bytes"] for p in json.loads(out.read_text())["breakdown"]}
    n = config_mod.load(toml).model.param_count()
    assert parts["parameters"] == parts["gradients"] == 4 * n / (8 * 2)
    assert parts["optimizer state"] == 2 * 4 * n / (8 * 2) + 4  # + Adam's int32 step count
