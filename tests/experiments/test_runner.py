"""The runner (experiments/runner.py): the published configs on the default path, other
device counts in a subprocess with their own fake CPU device count, and what would fit."""

import json
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO
from tests.helpers import TINY, run_cli, write


def test_a_model_too_big_for_its_devices_does_not_fit(cpu_devices):
    # Llama 2 7B in pure data parallelism on 8 H100s: every GPU holds the whole model in f32,
    # its AdamW moments and gradients: 16 bytes x 6.7e9 parameters = 108 GB > 80 GB.
    from experiments import config, runner

    text = TINY.replace('"tiny"', '"llama2-7b"\nn_layers = 32').replace(
        "data = 2\nfsdp = 4", "data = 8").replace("seq_len = 32", "seq_len = 256").replace(
        "global_batch = 16", "global_batch = 8")
    report = runner.run(config.from_dict(tomllib.loads(text)))
    d = report.to_dict()
    parts = d["memory"]["components"]
    assert parts["parameters"] == pytest.approx(4 * 6.74e9, rel=0.01)
    assert parts["optimizer state"] == pytest.approx(8 * 6.74e9, rel=0.01)
    assert d["fits"] is False and "DOES NOT FIT" in report.format_table()
    assert d["fit_advice"] == []  # runner.run searches for changes only when asked


NO_FIT = """
name = "8b-on-8"
[model]
preset = "llama3-8b"
n_layers = 16
[system]
name = "h100:8"
[parallelism]
data = 8
[workload]
seq_len = 1024
global_batch = 64
[train]
remat = "none"
"""

def test_a_step_that_does_not_fit_says_so_first_and_what_would_fit(tmp_path, capsys,
                                                                      cpu_devices):
    # f32 parameters, gradients and Adam state of 16 Llama 3 8B layers replicated on every
    # GPU (73 GB) plus no-remat activations of 8 sequences of 1024: past an H100's 85.5 GB
    # (81559 MiB).
    # `run` prints the verdict first and the changes experiments/fit.py's search compiled.
    import re

    path = write(tmp_path, NO_FIT)
    out_json = tmp_path / "r.json"
    code, out, _ = run_cli(["run", path, "--json", str(out_json)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[1].startswith("DOES NOT FIT: needs ") and "has 85.52 GB" in lines[1]
    assert "-- if it fit" in next(line for line in lines if line.startswith("step time"))
    assert "bottleneck     HBM capacity: needs" in out
    d = json.loads(out_json.read_text())
    assert not d["fits"] and d["bottleneck"].startswith("HBM capacity")
    # "train.remat = "full" (75.3 GB per device, step 1.2 s)": the fastest change first.
    first = re.fullmatch(r"(.*) \(([\d.]+) GB per device, step [\d.]+ s\)", d["fit_advice"][0])
    assert first, d["fit_advice"]
    sets = [a for kv in first[1].split(", ")
            for a in ("--set", kv.replace(" = ", "=").replace('"', ""))]
    code, _, err = run_cli(["run", path, *sets, "--json", str(out_json)], capsys)
    assert code == 0, err
    d = json.loads(out_json.read_text())
    assert d["fits"] and not d["fit_advice"]
    assert d["memory_per_device_bytes"] == pytest.approx(float(first[2]) * 1e9, rel=0.01)


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
    # (llama3-405b-h100-1024-tp4-pp8-cp2-fp8 is the same model and sharding as the first,
    # the same program builder and schedule on an HGX system; 72 microbatches.)
    ("llama3-405b-gb200-512-tp4-pp8-cp2-fp8", 8, 144, 8, "8 racks x 64 GPUs of 72"),
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


def test_tp_comm_overlap_hides_sequence_parallel_collectives_on_a_gpu(cpu_devices):
    # Megatron / NeMo's tp_comm_overlap (Transformer Engine's userbuffers): the same program,
    # its all-gathers and reduce-scatters over tensor partly under their GEMMs, on a GPU.
    # (Without the fitted time per kernel, which would bury this tiny model's collectives.)
    import dataclasses

    from experiments import config, runner
    from meshes.calibration import catalog_calibration

    cal = dataclasses.replace(catalog_calibration(), kernel_overhead_s=0.0)
    over = ["parallelism.data=2", "parallelism.fsdp=1", "parallelism.tensor=4",
            "parallelism.sequence_parallel=true", "model.n_layers=2"]
    plain = runner.run(config.load("tiny-h100-dp-tp", over), calibration=cal)
    exp = config.load("tiny-h100-dp-tp", [*over, "parallelism.tp_comm_overlap=true"])
    hidden = runner.run(exp, calibration=cal)
    assert exp.parallelism.tp_comm_overlap
    assert {(c.kind, c.mesh_axes) for c in plain.collectives} >= {
        ("all-gather", ("tensor",)), ("reduce-scatter", ("tensor",))}
    assert hidden.comm_s == pytest.approx(plain.comm_s)  # the same bytes on the same links
    # (this tiny step is bound by its link's busy time, which the overlap does not shorten)
    assert hidden.scheduled_step_s < plain.scheduled_step_s
    assert hidden.step_time_s <= plain.step_time_s


def test_megatron_overlaps_the_distributed_optimizers_collectives_on_a_gpu(cpu_devices):
    # overlap_grad_reduce / overlap_param_gather: the same program and bytes; on a GPU its
    # gradient reduce-scatter and parameter all-gather over data run a virtual stage's
    # chunk at a time beside the pipeline's loops (sharding/gpu_frameworks.py), so only one
    # of the V chunks is waited for; a TPU system runs the program as compiled.
    import dataclasses

    from experiments import config, runner
    from meshes.calibration import catalog_calibration

    cal = dataclasses.replace(catalog_calibration(), kernel_overhead_s=0.0)
    over = ["parallelism.data=2", "parallelism.tensor=1", "parallelism.pipeline=4",
            "parallelism.virtual_stages=2", "model.n_layers=8", "workload.microbatches=4",
            "train.shard_optimizer_over_data=true"]
    on = ["train.overlap_grad_reduce=true", "train.overlap_param_gather=true"]
    for system, shorter in (("h100:8", True), ("tpu-v5e:2x4", False)):
        plain = runner.run(config.load("tiny-h100-dp-tp", [*over, f"system.name={system}"]),
                           calibration=cal)
        both = runner.run(config.load("tiny-h100-dp-tp",
                                      [*over, *on, f"system.name={system}"]), calibration=cal)
        dp = [(c.kind, c.bytes) for c in plain.collectives if c.mesh_axes == ("data",)]
        assert {k for k, _ in dp} >= {"reduce-scatter", "all-gather"}
        assert dp == [(c.kind, c.bytes) for c in both.collectives if c.mesh_axes == ("data",)]
        assert both.comm_s == pytest.approx(plain.comm_s)
        if shorter:
            assert both.scheduled_step_s < plain.scheduled_step_s
        else:
            assert both.scheduled_step_s == pytest.approx(plain.scheduled_step_s)


def test_megatron_overlaps_an_interleaved_pipelines_stage_transfers_on_a_gpu(cpu_devices):
    # overlap_p2p_comm (Megatron's and NeMo's default with virtual stages): the same
    # program and bytes; on a GPU the stage-to-stage permutes are waited for only in the
    # warm-up and flush; `false` (--no-overlap-p2p-communication) waits at every tick; a
    # TPU system runs the program as compiled.
    import dataclasses

    from experiments import config, runner
    from meshes.calibration import catalog_calibration

    cal = dataclasses.replace(catalog_calibration(), kernel_overhead_s=0.0)
    over = ["parallelism.data=2", "parallelism.tensor=1", "parallelism.pipeline=4",
            "parallelism.virtual_stages=2", "model.n_layers=8", "workload.microbatches=8",
            "workload.seq_len=512"]
    for system, shorter in (("h100:8", True), ("tpu-v5e:2x4", False)):
        on = config.load("tiny-h100-dp-tp", [*over, f"system.name={system}"])
        assert on.parallelism.overlap_p2p_comm  # the default
        hidden = runner.run(on, calibration=cal)
        plain = runner.run(config.load("tiny-h100-dp-tp", [
            *over, f"system.name={system}", "parallelism.overlap_p2p_comm=false"]),
            calibration=cal)
        transfers = [c for c in hidden.collectives if "stage_transfer" in c.op_name]
        assert {c.kind for c in transfers} == {"collective-permute"}
        assert hidden.comm_s == pytest.approx(plain.comm_s)
        if shorter:
            assert hidden.scheduled_step_s < plain.scheduled_step_s
            # the report says so: (P - 1) 2 + (V - 1) P of M V chunks = 10 / 16
            assert "stage transfers beside compute, 62% waited for" in \
                hidden.format_table()
            assert "stage transfers" not in plain.format_table()
        else:
            assert hidden.scheduled_step_s == pytest.approx(plain.scheduled_step_s)
            assert "as Megatron runs it" not in hidden.format_table()


def test_a_pipelines_output_layer_runs_on_its_last_stage_on_a_gpu(cpu_devices):
    # The program runs the output layer and loss after the pipeline's loop, for every
    # microbatch on one stage, as Megatron's last stage does; there its padded slot (6
    # layers in 8 slots on 4 stages: one before the first layer, one after the last, where
    # account_for_loss_in_pipeline_split leaves the loss) absorbs a layer's worth of them,
    # so on a GPU only the share past it counts; a TPU system runs the program as compiled.
    import dataclasses

    import sharding
    from experiments import config, runner
    from meshes import get_system
    from meshes.calibration import catalog_calibration
    from sharding.gpu_frameworks import OUTPUT_SCOPES

    cal = dataclasses.replace(catalog_calibration(), kernel_overhead_s=0.0)
    over = ["parallelism.data=2", "parallelism.tensor=1", "parallelism.pipeline=4",
            "model.n_layers=6", "model.vocab=16384", "workload.microbatches=4",
            "workload.seq_len=64"]

    def output_s(rep):
        return sum(v["time_s"] for (op, _), v in rep.compute.ops.items()
                   if op.split(" (")[0].split("/")[0] in OUTPUT_SCOPES)

    for system in ("h100:8", "tpu-v5e:2x4"):
        rep = runner.run(config.load("tiny-h100-dp-tp", [*over, f"system.name={system}"]),
                         calibration=cal)
        share = rep.pipeline["output_layer_share"]
        assert 0 < share < 1
        scale = share if system == "h100:8" else 1.0
        # the same program estimated as if no stage waited for another
        alone = sharding.estimate(
            dataclasses.replace(rep.inputs, pipeline={**rep.pipeline, "stages": 1}),
            system=get_system(system), calibration=cal)
        assert output_s(rep) == pytest.approx(scale * output_s(alone), rel=1e-6)
        assert rep.compute.matmul_flops == alone.compute.matmul_flops
        assert rep.compute_s - alone.compute_s == pytest.approx(
            (scale - 1) * output_s(alone), rel=1e-6, abs=1e-12)


def test_overlap_param_gather_needs_the_distributed_optimizer():
    from experiments import config

    with pytest.raises(ValueError, match="shard_optimizer_over_data=true"):
        config.load("tiny-h100-dp-tp", ["train.overlap_param_gather=true"])
    with pytest.raises(ValueError, match=r"train.bucket_size=-1 must be at least 0"):
        config.load("tiny-h100-dp-tp", ["train.bucket_size=-1"])


def test_megatrons_refusal_of_virtual_stages_is_said_of_a_megatron_style_run_only():
    # 5 layers on 4 stages of 2 chunks: no count of 5, 6 or 7 layers splits into 4 stages
    # of 2 equal chunks, so Megatron-LM refuses the layout (models/pipeline.py); a GPU
    # config that splits the model is run as Megatron runs it and is told, a TPU slice runs
    # MaxText's pipeline and is not (the note was said of every pipelined run).
    from experiments import config, runner

    over = ["parallelism.data=2", "parallelism.tensor=1", "parallelism.pipeline=4",
            "parallelism.virtual_stages=2", "model.n_layers=5", "workload.microbatches=8"]
    for system, said in (("h100:8", True), ("tpu-v5e:2x4", False)):
        step = runner._abstract_step(config.load("tiny-h100-dp-tp",
                                                 [*over, f"system.name='{system}'"]))
        assert any(n.startswith("Megatron-LM refuses") for n in step.notes) == said, system
