"""Collectives of real compiled programs on 8 fake CPU devices, with the expected bytes
derived here from the model's shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshes
import models
import sharding
from tests.steps import train_program

H100 = meshes.get_system("h100:8")
F32 = 4


def tiny(**kw):
    return models.preset("tiny", **kw)


def train_report(cfg, par, *, dtype="float32", batch=16, seq=32, remat="full"):
    mesh = sharding.make_mesh(H100, par)
    prog = train_program(cfg, mesh, seq_len=seq, global_batch=batch, params=dtype,
                         compute=dtype, remat=remat)
    return sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100), prog


def layer_matmul_params(cfg):
    d, e = cfg.d_model, cfg.head_dim
    attn = d * e * (cfg.n_heads + 2 * cfg.n_kv_heads) + cfg.n_heads * e * d
    return attn + 3 * d * cfg.d_ff  # SwiGLU: gate, up, down


def test_pure_data_parallelism_all_reduces_exactly_the_gradients(cpu_devices):
    cfg = tiny()
    rep, _ = train_report(cfg, {"data": 8})
    kinds = {c.kind for c in rep.collectives}
    assert kinds == {"all-reduce"}
    assert all(c.mesh_axes == ("data",) for c in rep.collectives)
    # Every f32 gradient is all-reduced once per step; the only other all-reduce is the
    # 4-byte scalar loss mean.
    grads = F32 * cfg.param_count()
    total = rep.by_kind()["all-reduce"]
    assert total == grads + F32
    assert rep.collectives[0].link == "nvlink"


def test_fsdp_gathers_parameters_and_reduce_scatters_gradients(cpu_devices):
    cfg = tiny()
    rep, _ = train_report(cfg, {"fsdp": 8})
    in_loop = [c for c in rep.collectives if c.count == cfg.n_layers]
    # Each layer's matmul weights are gathered twice: in the forward pass and again when
    # full remat recomputes the forward inside the backward pass.
    gathered = sum(c.bytes * c.count for c in in_loop
                   if c.kind == "all-gather" and len(c.shape) >= 2)
    assert gathered == 2 * cfg.n_layers * F32 * layer_matmul_params(cfg)
    # Gradients are reduce-scattered over fsdp: all parameters but the embedding table, whose
    # gradient is a scatter-add the partitioner keeps shard-local behind an all-to-all.
    embedding = F32 * cfg.padded_vocab * cfg.d_model
    assert rep.by_kind()["reduce-scatter"] == F32 * cfg.param_count() - embedding
    assert all(c.mesh_axes == ("fsdp",) for c in rep.collectives)


def test_tensor_parallel_layers_all_reduce_activations(cpu_devices):
    # Forward only, so that each all-reduce is one of Megatron's two per layer.
    cfg = tiny(n_heads=8, n_kv_heads=8, n_layers=3)
    mesh = sharding.make_mesh(H100, {"data": 2, "tensor": 4})
    rules = sharding.default_rules()
    model = nnx.eval_shape(lambda: models.make_model(cfg, models.Precision()))
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    shard = models.train.param_shardings(models.logical_axes(state), params, rules, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          params, shard)
    tokens = jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=NamedSharding(mesh, P("data")))

    def forward(p, t):
        with sharding.use_rules(rules, mesh):
            return nnx.merge(graphdef, p)(t)

    rep = sharding.analyze(forward, params, tokens, mesh=mesh, system=H100)
    layer_ars = [c for c in rep.collectives
                 if c.kind == "all-reduce" and c.mesh_axes == ("tensor",) and c.count == 3]
    # Attention output and MLP output: batch/data x seq x d_model bf16 activations each.
    per_ar = (8 // 2) * 32 * cfg.d_model * 2
    assert sorted(c.bytes for c in layer_ars) == [per_ar, per_ar]
    assert all(c.dtype == "bfloat16" and c.shape == (4, 32, cfg.d_model) for c in layer_ars)


def test_scanned_layers_multiply_per_layer_collectives(cpu_devices):
    two, _ = train_report(tiny(n_layers=2), {"fsdp": 8})
    four, _ = train_report(tiny(n_layers=4), {"fsdp": 8})
    loop2 = sum(c.total_bytes for c in two.collectives if c.count == 2)
    loop4 = sum(c.total_bytes for c in four.collectives if c.count == 4)
    assert loop4 == 2 * loop2
    assert {c.count for c in four.collectives} == {1, 4}


def test_analyze_plain_shard_map_function(cpu_devices):
    mesh = sharding.make_mesh(H100, {"data": 2, "fsdp": 2, "tensor": 2})

    def body(x):  # per device [16, 64, 32] bf16
        def step(c, _):
            c = jax.lax.psum(c, "tensor") * 0.5
            g = jax.lax.all_gather(c, "fsdp", axis=0, tiled=True)
            c = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=0, tiled=True)
            c = jax.lax.all_to_all(c, "data", 1, 1, tiled=True)
            c = jax.lax.ppermute(c, "fsdp", [(0, 1), (1, 0)])
            return c, None

        def outer(c, _):
            return jax.lax.scan(step, c, None, length=3)[0], None

        return jax.lax.scan(outer, x, None, length=2)[0]

    f = shard_map(body, mesh=mesh, in_specs=P("data", "fsdp", "tensor"),
                  out_specs=P("data", "fsdp", "tensor"), check_vma=False)
    x = jax.ShapeDtypeStruct((32, 128, 64), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("data", "fsdp", "tensor")))
    rep = sharding.analyze(f, x, mesh=mesh, system=H100)
    local = 16 * 64 * 32 * 2  # bytes of the per-device block
    expect = {  # kind: (bytes per execution, mesh axes); nested scans: 2 x 3 = 6 runs
        "all-reduce": (local, ("tensor",)),
        "all-gather": (2 * local, ("fsdp",)),
        "reduce-scatter": (2 * local, ("fsdp",)),
        "all-to-all": (local, ("data",)),
        "collective-permute": (local, ("fsdp",)),
    }
    got = {c.kind: c for c in rep.collectives}
    assert set(got) == set(expect)
    for kind, (nbytes, axes) in expect.items():
        assert (got[kind].bytes, got[kind].mesh_axes, got[kind].count) == (nbytes, axes, 6), kind
    assert got["all-reduce"].wire_bytes == pytest.approx(local)  # 2 * S * (2-1)/2


def test_mesh_axes_follow_a_permuted_device_order(cpu_devices):
    devs = np.array(cpu_devices)[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devs, ("data", "tensor"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def f(x):
        return shard_map(lambda b: jax.lax.psum(b, "tensor"), mesh=mesh,
                         in_specs=P("data", "tensor"), out_specs=P("data"), check_vma=False)(x)

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32,
                             sharding=NamedSharding(mesh, P("data", "tensor")))
    rep = sharding.analyze(f, x, mesh=mesh, system=H100)
    (c,) = rep.collectives
    assert c.mesh_axes == ("tensor",)
    # Partition ids are mesh positions; the links are found from the devices behind them.
    assert sorted(sorted(mesh.devices.flat[p].id for p in g) for g in c.groups) == \
        [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_report_keys_and_json_contract(cpu_devices):
    rep, prog = train_report(tiny(), {"data": 2, "fsdp": 4})
    d = rep.to_dict()
    for key in ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "compute_s",
                "comm_s", "exposed_comm_s", "memory_per_device_bytes", "hbm_bytes", "fits",
                "collectives", "by_kind", "by_link", "bottleneck", "timings", "slowest_hop",
                "by_operation"):
        assert key in d, key
    fields = {f.name for f in dataclasses.fields(sharding.Collective)}
    assert fields <= set(d["collectives"][0])
    assert d["step_time_s"] == pytest.approx(d["compute_s"] + d["exposed_comm_s"])
    args = dict(rep.memory.components)["arguments"]
    assert args >= prog.state_bytes_per_device


def test_spmd_rematerialization_warnings_reach_the_report(cpu_devices):
    # The embedding gradient's scatter-add wants its updates sharded like the table's
    # `embed` dim (fsdp) while they arrive sharded by batch over data x fsdp: XLA's SPMD
    # partitioner replicates them and says so on stderr. The report carries it instead.
    rep, _ = train_report(tiny(), {"data": 2, "fsdp": 4})
    assert any("involuntary full rematerialization" in w for w in rep.warnings)
    assert "involuntary" in rep.format_table()
    clean, _ = train_report(tiny(), {"data": 8})
    assert clean.warnings == ()


def test_conditional_branches_are_counted_and_the_assumption_reported(cpu_devices):
    mesh = sharding.make_mesh(H100, {"data": 8})

    def body(x, flag):
        return jax.lax.cond(flag[0] > 0, lambda v: jax.lax.psum(v, "data"), lambda v: v * 2, x)

    f = shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"),
                  check_vma=False)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    flag = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    rep = sharding.analyze(f, x, flag, mesh=mesh, system=H100)
    (c,) = rep.collectives
    assert (c.kind, c.bytes, c.count) == ("all-reduce", 8 * 128 * 4, 1)
    assert any("conditional" in w and "upper bound" in w for w in rep.warnings)


def test_by_operation_names_the_model_operation(cpu_devices):
    rep, _ = train_report(tiny(n_kv_heads=4), {"data": 2, "tensor": 4})
    ops = {(o["operation"], o["kind"]) for o in rep.by_operation()}
    assert ("attention/out_proj (forward)", "all-reduce") in ops
    assert ("mlp/down_proj (forward)", "all-reduce") in ops


def test_report_shows_link_algorithm_and_slowest_hop_across_nodes():
    import subprocess
    import sys

    from tests.conftest import REPO

    # 16 GPUs in two HGX nodes: FSDP 16 spans InfiniBand, which must be named the slowest hop.
    code = """
import jax
jax.config.update("jax_num_cpu_devices", 16)
import meshes, models, sharding
s = meshes.get_system("h100:16")
mesh = sharding.make_mesh(s, {"fsdp": 16})
prog = models.build_train_program(models.preset("tiny"), mesh, sharding.default_rules(),
    workload=models.Workload(seq_len=32, global_batch=16), precision=models.Precision(),
    train=models.Train())
rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=s)
print(rep.slowest_hop())
print(sorted({(c.link, bool(c.algorithm)) for c in rep.collectives}))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    hop, links = p.stdout.strip().splitlines()
    assert hop.startswith("infiniband at")
    assert links == "[('infiniband', True)]"


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_context_parallelism_exchanges_keys_and_values_once_per_step(cpu_devices, mode):
    cfg = tiny()
    cp = 4
    mesh = sharding.make_mesh(H100, {"data": 2, "sequence": cp})
    prog = models.build_train_program(
        cfg, mesh, sharding.default_rules(), context_mode=mode,
        workload=models.Workload(seq_len=256, global_batch=4),
        precision=models.Precision(params="float32", compute="float32"), train=models.Train())
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    # (Over `sequence` besides: the weight gradients' sums and the int32 tokens' gather.)
    seq = [c for c in rep.collectives if c.mesh_axes == ("sequence",) and c.dtype == "float32"]
    # One rank's K (or V) block: batch 4 / data 2 x 256 / cp positions x kv heads 2 x
    # head_dim 16, f32.
    block = 2 * (256 // cp) * cfg.n_kv_heads * cfg.head_dim * F32
    per_layer = lambda kind: sum(c.count * c.bytes for c in seq if c.kind == kind) / cfg.n_layers  # noqa: E731
    if mode == "ring":
        # K and V move one rank on at each of cp - 1 steps: 2 (cp - 1) blocks per layer in
        # the forward pass, as many in full remat's recomputed forward and, their
        # gradients, in the backward pass.
        permutes = [c for c in seq if c.kind == "collective-permute"]
        assert {c.bytes for c in permutes} == {block}
        assert per_layer("collective-permute") == 3 * 2 * (cp - 1) * block
        assert not [c for c in seq if c.kind == "all-gather"]
    else:
        # K and V gathered whole once per forward (and recomputed forward); their
        # gradients summed over the ranks once each in the backward.
        assert per_layer("all-gather") == 2 * 2 * cp * block
        sums = [c for c in seq if c.kind == "all-reduce" and c.shape[-4:] == (
            2, 256 // cp // 2, cfg.n_kv_heads, cfg.head_dim)]
        assert {c.bytes for c in sums} == {cp * block}
        assert sum(c.count for c in sums) == 2 * cfg.n_layers
        assert not [c for c in seq if c.kind == "collective-permute"]


def test_pipeline_stages_pass_microbatch_activations_to_their_neighbours(cpu_devices):
    cfg = tiny(n_layers=4)
    mesh = sharding.make_mesh(H100, {"data": 2, "pipeline": 4})
    prog = train_program(cfg, mesh, seq_len=16, global_batch=16, microbatches=4,
                         compute="float32")
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    permutes = [c for c in rep.collectives if c.kind == "collective-permute"]
    assert permutes and all(c.mesh_axes == ("pipeline",) for c in permutes)
    # Each tick moves every stage's microbatch (16 / 4 sequences over data 2, x seq 16 x
    # d_model 64, f32) one stage on: M + S - 1 = 7 ticks forward, and back in the backward.
    per_transfer = (16 // 4 // 2) * 16 * cfg.d_model * F32
    assert {c.bytes for c in permutes} == {per_transfer}
    assert sum(c.count for c in permutes) == 2 * (4 + 4 - 1)
    # Mesh axes run (pipeline, data): a partition id's stage is id // 2; a transfer goes to
    # the next stage (the last stage's to the first) within one data replica.
    for c in permutes:
        assert all((b // 2 - a // 2) % 4 in (1, 3) and a % 2 == b % 2 for a, b in c.groups)
    # The pipeline's input meets the stage axis once (its gradient summed over the stages)
    # and its output leaves it once: one all-reduce of the M microbatches each way.
    stage_sums = [c for c in rep.collectives if c.kind == "all-reduce"
                  and c.mesh_axes == ("pipeline",)]
    assert sorted(c.bytes * c.count for c in stage_sums) == [4 * per_transfer] * 2
    # The bubble is in the program: each stage runs its one layer on all 7 ticks: down_proj's
    # forward matmul (2 b L F D) 7 times, its two backward matmuls 7 times each (remat does
    # not recompute it: no backward needs its output).
    down = 2 * (16 // 4 // 2) * 16 * cfg.d_ff * cfg.d_model
    ops = rep.compute.ops
    assert ops[("mlp/down_proj (forward)", "matmul")]["flops"] == 7 * down
    assert ops[("mlp/down_proj (backward)", "matmul")]["flops"] == 2 * 7 * down


@pytest.mark.parametrize("par, microbatches", [({"data": 8}, 4), ({"data": 4, "pipeline": 2}, 4)])
def test_data_parallel_gradients_are_summed_once_per_step(cpu_devices, par, microbatches):
    # Megatron's DDP sums the gradients over the data-parallel replicas once per step, not
    # at every micro-step or pipeline tick: each parameter's f32 gradient crosses `data`
    # once -- all-reduces over `data` of exactly the parameters' bytes, each run once.
    cfg = tiny(n_layers=2)
    mesh = sharding.make_mesh(H100, par)
    prog = train_program(cfg, mesh, seq_len=16, global_batch=32, microbatches=microbatches,
                         compute="float32")
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    # (Besides them only the scalar loss of each micro-step is summed over `data`.)
    over_data = [c for c in rep.collectives if c.mesh_axes == ("data",)]
    sums = [c for c in over_data if c.shape]
    assert sums and all(c.kind == "all-reduce" and c.count == 1 for c in sums)
    assert sum(c.bytes for c in sums) == prog.param_bytes_per_device
    assert all(c.bytes == 4 for c in over_data if not c.shape)


def test_a_gradient_summed_over_two_axes_is_one_all_reduce(cpu_devices):
    # The SPMD partitioner sums a weight gradient over `sequence` and then over `data`;
    # XLA's AllReduceFolder (GPU, TPU) makes the pair one all-reduce over both, as
    # Megatron's DP x CP group does: one ring over all 8 devices instead of two.
    cfg = tiny(n_layers=2)
    mesh = sharding.make_mesh(H100, {"data": 2, "sequence": 4})
    prog = train_program(cfg, mesh, seq_len=64, global_batch=4, compute="float32")
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    grads = [c for c in rep.collectives if c.kind == "all-reduce" and c.shape
             and "sequence" in c.mesh_axes]
    assert grads and all(c.mesh_axes == ("data", "sequence") and c.group_size == 8
                         for c in grads)
    # every parameter's f32 gradient, once
    assert sum(c.bytes * c.count for c in grads) == prog.param_bytes_per_device


def test_sequence_parallel_splits_the_stage_transfers_over_tensor(cpu_devices):
    # With Megatron's sequence parallelism a stage passes on 1/TP of the activations: a
    # microbatch of 16 / 4 sequences x 16 positions x d_model 64 f32, split over tensor 2.
    cfg = tiny(n_layers=4)
    mesh = sharding.make_mesh(H100, {"pipeline": 4, "tensor": 2})
    rules = sharding.default_rules().with_sequence_parallel()
    prog = models.build_train_program(
        cfg, mesh, rules, workload=models.Workload(seq_len=16, global_batch=16, microbatches=4),
        precision=models.Precision(params="float32", compute="float32"), train=models.Train())
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    ticks = [c for c in rep.collectives if c.kind == "collective-permute"
             and c.mesh_axes == ("pipeline",)]
    assert {c.bytes for c in ticks} == {(16 // 4) * 16 * cfg.d_model * F32 // 2}
    assert sum(c.count for c in ticks) == 2 * (4 + 4 - 1)
    # the tensor-parallel regions start with an all-gather and end with a reduce-scatter
    kinds = {c.kind for c in rep.collectives if c.mesh_axes == ("tensor",)}
    assert {"all-gather", "reduce-scatter"} <= kinds


def test_skipping_llvm_optimisation_leaves_the_report_unchanged(cpu_devices, monkeypatch):
    # The CPU path never runs the code it compiles: CPU_ANALYSIS_OPTIONS skip LLVM's
    # expensive passes. Every figure of the report, the compiler's memory included, is the
    # same with and without them. "Without" is XLA's defaults, named: the tests' own
    # process compiles without those passes already (tests/conftest.py).
    import json

    import sharding.compiler
    from experiments import config, runner

    exp = config.load("tiny-h100-dp-tp")
    xla_defaults = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}
    reports = []
    for options in (xla_defaults, sharding.compiler.CPU_ANALYSIS_OPTIONS):
        monkeypatch.setattr(sharding.compiler, "CPU_ANALYSIS_OPTIONS", options)
        d = runner.run(exp, backend="cpu").to_dict()
        d.pop("timings")
        reports.append(json.dumps(d, sort_keys=True, default=str))
    assert reports[0] == reports[1]
