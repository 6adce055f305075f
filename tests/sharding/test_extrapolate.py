"""Runs past one compile: compiled with fewer data-parallel replicas, read as the full run."""

import dataclasses
import json
import subprocess
import sys

import pytest

from sharding.collectives import Collective, wire_bytes
from sharding.extrapolate import NotExpandable, expand_plan
from sharding.plan import Plan
from sharding.schedule import Graph
from tests.conftest import REPO

AXES = ("data", "tensor")


def plan_with(*collectives):
    return Plan(num_partitions=4, counts={}, work={}, graph=Graph("main", {}),
                collectives=tuple(collectives), unknown_ops=(), notes=())


def coll(kind, groups, nbytes=1024):
    n = 2 if kind == "collective-permute" else len(groups[0])
    return Collective(kind=kind, name=f"{kind}.1", dtype="bfloat16", shape=(512,),
                      bytes=nbytes, wire_bytes=wire_bytes(kind, nbytes, n), count=3,
                      group_size=n, groups=tuple(map(tuple, groups)), mesh_axes=())


def test_groups_across_the_data_axis_span_every_replica_and_the_others_repeat():
    # data 2 x tensor 2 compiled, data 4 x tensor 2 run (partition = 2 x data + tensor).
    small = plan_with(
        coll("all-reduce", [[0, 2], [1, 3]]),                    # over data: gradients
        coll("all-gather", [[0, 1], [2, 3]]),                    # over tensor
        coll("collective-permute", [[0, 1], [1, 0], [2, 3], [3, 2]]),  # along tensor
    )
    full = expand_plan(small, small_shape=(2, 2), full_shape=(4, 2), axis_names=AXES)
    ar, ag, cp = full.collectives
    assert full.num_partitions == 8
    assert sorted(ar.groups) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert ar.group_size == 4 and ar.bytes == 1024
    assert ar.wire_bytes == pytest.approx(1024 * 2 * 3 / 4)  # the ring of 4, not of 2
    assert sorted(ag.groups) == [(0, 1), (2, 3), (4, 5), (6, 7)] and ag.group_size == 2
    assert sorted(cp.groups) == [(0, 1), (1, 0), (2, 3), (3, 2), (4, 5), (5, 4), (6, 7),
                                 (7, 6)]
    assert (ar.count, ag.count, cp.count) == (3, 3, 3)


@pytest.mark.parametrize("collective, why", [
    (coll("collective-permute", [[0, 2], [2, 0], [1, 3], [3, 1]]), "moves data along data"),
    (coll("all-gather", [[0, 2], [1, 3]]), "depends on the group size"),
    (coll("all-reduce", [[0, 1, 2], [3]]), "not a whole block"),
])
def test_what_cannot_be_rebuilt_exactly_is_refused_with_the_reason(collective, why):
    with pytest.raises(NotExpandable, match=why):
        expand_plan(plan_with(collective), small_shape=(2, 2), full_shape=(4, 2),
                    axis_names=AXES)



@pytest.mark.parametrize("op_name, expandable", [
    ("jit(step)/gradient_sum/reduce_scatter", True),   # the optimizer's gradient shard
    ("jit(step)/optimizer/sharding_constraint", True),  # its bf16 weights gathered back
    ("jit(step)/jvp(embedding)/jit(_take)/gather", False),  # a reshard sized by the replicas
])
def test_with_the_sharded_optimizer_only_its_own_collectives_span_data_by_state(op_name,
                                                                                 expandable):
    # `sized_by_state`: the reduce-scatters and all-gathers across data of the optimizer's
    # gradient sum and update carry the replica's whole shard on any count; another one
    # across data (FSDP with data can make one of the embedding lookup) does not.
    c = dataclasses.replace(coll("all-gather", [[0, 2], [1, 3]]), op_name=op_name)

    def expand():
        return expand_plan(plan_with(c), small_shape=(2, 2), full_shape=(4, 2),
                           axis_names=AXES, sized_by_state=True)

    if expandable:
        assert sorted(expand().collectives[0].groups) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    else:
        with pytest.raises(NotExpandable, match="depends on the group size"):
            expand()


_COMPARE = """
import json, sys
from experiments import config, runner
from experiments.config import ConfigError
import sharding
sharding.ensure_cpu_devices(2048)

def key(r):
    return sorted((c.kind, c.mesh_axes, c.bytes, c.count, c.group_size,
                   sorted(map(sorted, c.groups))) for c in r.collectives)

def pair(exp, **kw):
    small = runner.run(exp, max_compile_devices=16, **kw)
    direct = runner.run(exp, **kw)
    return {"same": key(small) == key(direct), "from": small.extrapolated_from,
            "direct_from": direct.extrapolated_from,
            "step": [small.step_time_s, direct.step_time_s],
            "mfu": [small.mfu, direct.mfu],
            "memory": [small.memory_per_device_bytes, direct.memory_per_device_bytes],
            "tokens": [small.tokens_per_s, direct.tokens_per_s],
            "kinds": sorted({(c.kind, ",".join(c.mesh_axes)) for c in direct.collectives})}

out = {}
# (The 256-GPU runs below compile the same program at 32 replicas.)
exp = config.load("tiny-h100-dp-tp", ["system.name=h100:2048", "parallelism.data=256",
    "parallelism.tensor=4", "parallelism.pipeline=2", "workload.global_batch=512",
    "workload.microbatches=2"])
out[2048] = pair(exp)
# TPU pods, TPU7x (two devices a chip) and Trainium2 on the CPU path: the reduced run is
# a smaller slice of the family; the full one is timed on the full torus and DCN. (The
# two-slice v5e pod covers the one-slice one: the same reduced slice, the same torus.)
for system, data in (("tpu-v5e:16x16*2", 128), ("tpu7x:4x4x8", 64), ("trn2:4x4*16", 64)):
    exp = config.load("tiny-h100-dp-tp", [f"system.name={system}", f"parallelism.data={data}",
        "parallelism.tensor=4", f"workload.global_batch={2 * data}"])
    out[system] = pair(exp, backend="cpu")
# Data parallelism placed outermost (across slices), as Llama 3 and MaxText place it:
# which collectives cross DCN, and the extrapolation keeps the placement.
for outer in ([], ["parallelism.outer=data"]):
    exp = config.load("tiny-h100-dp-tp", ["system.name=tpu-v5e:4x4*2", "parallelism.data=4",
        "parallelism.pipeline=2", "parallelism.tensor=4", "workload.global_batch=16",
        "workload.microbatches=2", *outer])
    r = runner.run(exp, backend="cpu")
    out["outer=" + "".join(outer)] = sorted({(c.kind, ",".join(c.mesh_axes), c.link)
                                             for c in r.collectives})
exp = config.load("tiny-h100-dp-tp", ["system.name=h100:256", "parallelism.data=32",
    "parallelism.pipeline=2", "parallelism.tensor=4", "workload.global_batch=64",
    "workload.microbatches=2", "parallelism.outer=data"])
out["h100 outer=data"] = pair(exp)
# The distributed optimizer (ZeRO-1 over data): its gradient reduce-scatter and bf16 weight
# all-gather span the data axis, their buffers the replica's whole shard on any count.
exp = config.load("tiny-h100-dp-tp", ["system.name=h100:256", "parallelism.data=64",
    "parallelism.tensor=4", "workload.global_batch=128", "precision.params=bfloat16",
    "precision.master_weights=float32", "train.shard_optimizer_over_data=true"])
out["zero"] = pair(exp)
# FSDP with data: the embedding lookup's resharding depends on the replica count.
exp = config.load("tiny-h100-dp-tp", ["system.name=h100:64", "parallelism.data=4",
    "parallelism.fsdp=4", "parallelism.tensor=4", "workload.global_batch=16"])
try:
    runner.run(exp, max_compile_devices=32)
    out["fsdp"] = ""
except ConfigError as e:
    out["fsdp"] = str(e)
print(json.dumps(out))
"""

@pytest.mark.slow
def test_extrapolated_runs_equal_direct_compiles_up_to_2048_devices():
    # Data x tensor x pipeline on 256 (data outermost; the distributed optimizer) and 2048
    # H100s: compiled with 2 replicas (16 devices) and read as the full run, against the
    # full run compiled directly: the same collectives (kind, mesh axes, bytes, count, every
    # replica group) and the same step. (2048 is the largest a process compiles directly;
    # 512 and 1024 were the same program with 64 and 128 replicas.)
    p = subprocess.run([sys.executable, "-c", _COMPARE], cwd=REPO, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for n, r in (("2048", out["2048"]), ("256", out["h100 outer=data"])):
        assert r["same"], n
        assert r["from"].startswith(f"compiled on 16 devices (2 of the {int(n) // 8} ")
        assert r["direct_from"] == ""
        for k in ("step", "mfu", "memory", "tokens"):
            assert r[k][0] == pytest.approx(r[k][1], rel=0.01), (n, k)
    for system, reduced in (("tpu-v5e:16x16*2", "tpu-v5e:2x4"),
                            ("tpu7x:4x4x8", "tpu7x:2x2x1"), ("trn2:4x4*16", "trn2:4x2")):
        r = out[system]
        assert r["same"], system
        assert r["from"].startswith(f"compiled on {reduced}, 8 devices (2 of the "), system
        for k in ("step", "mfu", "memory", "tokens"):
            assert r[k][0] == pytest.approx(r[k][1], rel=0.01), (system, k)
    assert "cannot be read as it exactly" in out["fsdp"] and "\n" not in out["fsdp"]
    # By default pipeline is outermost: its transfers cross the two slices over DCN and the
    # gradient all-reduce stays on ICI; with data outermost it is the other way round.
    default, data_out = out["outer="], out["outer=parallelism.outer=data"]
    assert ["all-reduce", "data", "ici"] in default
    assert any(k == "collective-permute" and "pipeline" in a and link == "dcn"
               for k, a, link in default)
    assert ["all-reduce", "data", "dcn"] in data_out
    assert not any(k == "collective-permute" and link == "dcn" for k, _, link in data_out)
    r = out["zero"]
    assert r["same"] and ["reduce-scatter", "data"] in r["kinds"] and \
        ["all-gather", "data"] in r["kinds"]
    # The reduced compile updates 1/2 of the optimizer state where the full run updates
    # 1/64: a little more elementwise work, the same memory (the model's, of the full run).
    assert r["step"][0] == pytest.approx(r["step"][1], rel=0.05)
    assert r["memory"][0] == r["memory"][1]


@pytest.mark.slow
def test_the_llama3_paper_layout_on_16384_h100s_runs_and_says_how(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "experiments.cli", "run",
                        "llama3-405b-h100-16384-tp8-pp16-dp128", "--quiet", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "extrapolated: compiled on 256 devices (2 of the 128 data-parallel" in p.stdout
    d = json.loads(out.read_text())
    assert d["num_devices"] == 16384 and d["extrapolated_from"]
    # The gradient all-reduce spans all 128 replicas: one GPU of each, across 128 nodes.
    grads = [c for c in d["collectives"] if c["mesh_axes"] == ["data"]]
    assert grads and all(c["group_size"] == 128 and c["group_count"] == 128 for c in grads)
    assert all(c["link"] == "infiniband" for c in grads)


@pytest.mark.slow
def test_a_search_past_2048_devices_compiles_each_sharding_from_fewer_replicas(tmp_path,
                                                                               capsys):
    # 4096 H100s, data x tensor: every sharding that splits is compiled in a worker that
    # fakes at most 2048 devices (the runner compiles 2 replicas) and re-timed from its
    # stored plan without compiling. (The search itself runs here: it compiles nothing.)
    from experiments import cli
    from experiments.store import Store

    store = tmp_path / "s.sqlite"
    args = ["search", "tiny-h100-dp-tp", "--set", "system.name=h100:4096", "--set",
            "parallelism.data=1024", "--set", "workload.global_batch=8192", "--axes",
            "data,tensor", "--store", str(store), "--workers", "1", "--quiet"]
    assert cli.main(args) == 0
    with Store(store) as s:
        ok = [r for r in s.results() if r.status == "ok"]
    assert len(ok) == 3  # tensor 1, 2, 4 (the tiny model has 4 heads)
    assert all(r.report["num_devices"] == 4096 and r.report["extrapolated_from"] for r in ok)
    capsys.readouterr()
    assert cli.main(args + ["--reestimate", "--system", "b200:4096"]) == 0
    assert "3 estimated" in capsys.readouterr().out


def _reduced(sets, cpu_devices):
    # 8 devices run as 2 data-parallel replicas compiled on 4 (max_compile_devices=4)
    from experiments import config, runner

    exp = config.load("tiny-h100-dp-tp", ["parallelism.data=4", "parallelism.tensor=2",
                                          *sets])
    return runner.run(exp, max_compile_devices=4)


def test_a_reduced_tpu_compile_runs_on_a_slice_google_provisions():
    # The reduced run's slice was the first shape with its chips, one Google does not
    # provision (tpu7x:1x1x4, tpu-v5p:1x2x4, tpu-v4:1x2x4); now a listed sub-cube slice
    # (TPU7x: 2 devices a chip, v4 / v5p: 1).
    from experiments.runner import _reduced_system_name
    from meshes import get_system

    for system, devices, reduced in (("tpu7x:4x4x8", 8, "tpu7x:2x2x1"),
                                     ("tpu7x:4x4x8", 2, "tpu7x:1x1x1"),
                                     ("tpu-v5p:8x8x8", 8, "tpu-v5p:2x2x2"),
                                     ("tpu-v4:4x4x4", 8, "tpu-v4:2x2x2")):
        name = _reduced_system_name(get_system(system), devices)
        assert name == reduced and get_system(name).num_devices == devices, system


def test_a_reduced_run_retimed_on_another_system_names_that_system(cpu_devices):
    # `compare` and `search --reestimate` re-time a stored program on another system of the
    # same size: the report says where it was timed, not where it was first timed.
    import sharding

    report = _reduced([], cpu_devices)
    assert report.extrapolated_from.endswith("timed on h100:8")
    again = sharding.reanalyze(report.inputs, system="b200:8")
    assert "h100" not in again.extrapolated_from, again.extrapolated_from
    assert again.extrapolated_from.endswith("timed on b200:8")
    assert sharding.reanalyze(again.inputs, system="h100:8").extrapolated_from == \
        report.extrapolated_from


def test_a_reduced_run_offers_only_the_full_systems_compilers(cpu_devices, monkeypatch):
    # With libtpu here, one v5e slice compiles on the TPU compiler, two slices over DCN do
    # not (sharding/compiler.py, tpu_refusal): the full run's note must not offer
    # `--backend all` because the reduced compile's one slice could have used it.
    from sharding import compiler

    monkeypatch.setattr(compiler, "tpu_compiler_installed", lambda: True)
    report = _reduced(["system.name=tpu-v5e:2x2*2"], cpu_devices)
    assert report.extrapolated_from.startswith("compiled on tpu-v5e:2x2, 4 devices")
    assert report.compiler_note.startswith("not the TPU compiler")
    assert "--backend all" not in report.compiler_note


@pytest.mark.parametrize("sets, why", [
    # 7 replicas of 4 devices: 2, 3 or 4 of them would compile, but none divides 7
    (["system.name=h100:28", "parallelism.data=7", "workload.global_batch=14"],
     "the replicas compiled must divide parallelism.data = 7, and none from 2 to 4 (the "
     "most that fit in 16 devices) does; choose a data size with a small divisor (6 or 8)"),
    # 2 replicas of 16 devices: even 2 of them are past 16
    (["system.name=h100:32", "parallelism.data=2", "parallelism.pipeline=4",
      "model.n_layers=4", "workload.global_batch=8", "workload.microbatches=4"],
     "parallelism.data = 2 leaves 16 devices per data-parallel replica; put more of the "
     "devices on data"),
])
def test_a_run_too_large_even_for_the_reduced_compile_says_why(sets, why):
    from experiments import config, runner
    from experiments.config import ConfigError

    exp = config.load("tiny-h100-dp-tp", [*sets, "parallelism.tensor=4"])
    with pytest.raises(ConfigError) as e:
        runner.run(exp, max_compile_devices=16)
    assert why in str(e.value)


def test_a_reduced_run_with_the_distributed_optimizer_says_what_it_overcounts(cpu_devices):
    # With the optimizer sharded over data, the compiled 2 replicas each update 1/2 of the
    # optimizer state where the run's 4 update 1/4 (twice the share): the program is not
    # the same there, and the report must not say it is.
    report = _reduced(["precision.params=bfloat16", "precision.master_weights=float32",
                       "train.shard_optimizer_over_data=true"], cpu_devices)
    assert "each device's program is the same)" not in report.extrapolated_from
    assert "but for the distributed optimizer's update, of 2 times the share of its state " \
        "a device of the run updates: its HBM traffic" in report.extrapolated_from
    assert "each device's program is the same)" in _reduced([], cpu_devices).extrapolated_from



def test_a_refusal_names_the_collective_once_and_its_operation():
    c = dataclasses.replace(coll("all-gather", [[0, 2], [1, 3]]), name="all-gather.21",
                            op_name="jit(sharded_step)/jvp(embedding)/jit(_take)/gather")
    with pytest.raises(NotExpandable) as e:
        expand_plan(plan_with(c), small_shape=(2, 2), full_shape=(4, 2), axis_names=AXES)
    assert str(e.value).startswith("all-gather.21 (embedding (forward)) spans data: ")


def test_a_program_that_changes_with_the_replica_count_is_refused_with_the_way_out(
        cpu_devices, monkeypatch):
    # FSDP with data: the embedding lookup's resharding spans data with buffers sized by
    # the replica count (the slow test above compiles one); the refusal says what to change.
    from experiments.config import ConfigError
    from sharding import extrapolate

    def refuse(plan, **kw):
        raise NotExpandable("all-gather.21 (embedding (forward)) spans data: its buffer "
                            "depends on the group size")

    monkeypatch.setattr(extrapolate, "expand_plan", refuse)
    with pytest.raises(ConfigError) as e:
        _reduced(["parallelism.fsdp=2", "parallelism.tensor=1"], cpu_devices)
    assert str(e.value).endswith(
        "depends on the group size; the program changes with the number of data-parallel "
        "replicas (FSDP with data parallelism reshards by it): put the fsdp devices on data, "
        "tensor or pipeline")


def test_a_reduced_run_keeps_the_full_systems_network_overrides_out_of_its_compile(
        cpu_devices):
    # Two v5e slices over a 50 Gb/s DCN, compiled on one slice: the DCN override is the
    # full system's (one slice has no DCN to override) and times the full run as it does
    # the direct compile.
    from experiments import config, runner

    sets = ["system.name=tpu-v5e:2x2*2", "system.dcn_gbps=50"]
    report = _reduced(sets, cpu_devices)
    assert report.extrapolated_from.startswith("compiled on tpu-v5e:2x2, 4 devices")
    assert report.system == "tpu-v5e:2x2*2 [dcn_gbps=50]"
    direct = runner.run(config.load("tiny-h100-dp-tp", ["parallelism.data=4",
                                                        "parallelism.tensor=2", *sets]))
    assert any(c.link == "dcn" for c in direct.collectives)
    assert report.step_time_s == pytest.approx(direct.step_time_s, rel=1e-9)


def test_a_sharded_optimizer_splitting_its_state_otherwise_on_fewer_replicas_is_not_read_so(
        cpu_devices):
    # The distributed optimizer splits a state over data on a dimension the replicas divide
    # and keeps it whole where none does (models/optimizer.py): the norms' (2 layers, 66)
    # split on 2 replicas, whole on 4 and 8. 2 replicas are another program (a
    # reduce-scatter where 8 all-reduce); 4 are the run's.
    from experiments import config, runner
    from experiments.config import ConfigError

    zero = ["precision.params=bfloat16", "precision.master_weights=float32",
            "train.shard_optimizer_over_data=true", "parallelism.tensor=1"]
    exp = config.load("tiny-h100-dp-tp", ["parallelism.data=8", "model.d_model=66", *zero])
    read, direct = runner.run(exp, max_compile_devices=4), runner.run(exp)

    def key(r):
        return sorted((c.kind, c.mesh_axes, c.bytes, c.count, sorted(map(sorted, c.groups)))
                      for c in r.collectives)

    assert read.extrapolated_from.startswith("compiled on 4 devices (4 of the 8 ")
    assert key(read) == key(direct)
    # d_model 68: the key projections' (2 layers, 68, 4, 16) split on the 68 on 2 and 4 replicas,
    # on the 16 on 8: no fewer replicas will do
    exp = config.load("tiny-h100-dp-tp", ["parallelism.data=8", "model.d_model=68", *zero])
    with pytest.raises(ConfigError, match=r"program is another: .*\['attn'\]\['wk'\] is "
                       r"split P\(None, 'data', None, None\) on 2 replicas, "
                       r"P\(None, None, None, 'data'\) on 8; the distributed optimizer"):
        runner.run(exp, max_compile_devices=4)


def test_the_distributed_optimizers_state_is_found_by_its_name_not_its_position(
        cpu_devices, monkeypatch):
    # The note read the optimizer state as the step's second argument ("[1]"): a step that
    # takes (batch, params, opt_state) had its parameters read as the state, split over
    # tensor only, and the update's overcount went unsaid.
    from experiments import config, runner

    exp = config.load("tiny-h100-dp-tp", [
        "parallelism.data=4", "parallelism.tensor=2", "precision.params=bfloat16",
        "precision.master_weights=float32", "train.shard_optimizer_over_data=true"])
    overcount = "but for the distributed optimizer's update, of 2 times the share"
    assert overcount in runner._same_program(exp, 2, runner._argument_specs(exp))
    build = runner._abstract_step

    def reordered(e):
        step = build(e)
        program = step.program
        order = [program.arg_names.index(n) for n in ("batch", "params", "opt_state")]
        return dataclasses.replace(step, program=dataclasses.replace(
            program, args=tuple(program.args[i] for i in order),
            arg_names=tuple(program.arg_names[i] for i in order)))

    monkeypatch.setattr(runner, "_abstract_step", reordered)
    assert overcount in runner._same_program(exp, 2, runner._argument_specs(exp))
