"""Context parallelism (models/context.py): the sharded step computes the unsharded loss and
moves each rank's keys and values the expected number of times."""

import jax
import numpy as np
import pytest

import meshes
import models
import sharding
from tests.steps import layer_matmul_params, tiny, train_both_ways

H100 = meshes.get_system("h100:8")
F32 = 4


@pytest.mark.parametrize("par, mode, compute, rel, fused", [
    ({"data": 2, "sequence": 4}, "ring", "float32", 1e-5, False),
    ({"data": 2, "sequence": 4}, "allgather", "float32", 1e-5, False),
    ({"sequence": 2, "tensor": 2, "data": 2}, "ring", "bfloat16", 2e-3, True),
    ({"sequence": 2, "pipeline": 2, "data": 2}, "ring", "float8", 2e-3, True),
])
def test_context_parallel_attention_matches_unsharded(cpu_devices, par, mode, compute, rel,
                                                      fused):
    # Zigzag ring (and all-gather) attention over the `sequence` axis computes the loss of
    # the unsharded model, in f32 exactly (and the same update), in bf16 with tensor
    # parallelism and in FP8 inside a pipeline (whose context ranks hold their own copies
    # of the layer weights), with Megatron's fused QKV and gate/up weights.
    cfg = models.preset("tiny", fused_qkv=fused, fused_mlp=fused)
    (loss1, p1), (loss2, p2) = train_both_ways(
        cfg, par, seed=1, token_seed=0, seq_len=32, global_batch=8, microbatches=2,
        remat="full", compute=compute, context_mode=mode)
    assert float(loss2) == pytest.approx(float(loss1), rel=rel)
    if compute == "float32":
        np.testing.assert_allclose(np.asarray(p2["embed"]), np.asarray(p1["embed"]),
                                   rtol=1e-4, atol=1e-6)


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
        # gradients summed over the ranks once each in the backward, each rank keeping
        # its own block: a reduce-scatter of the gathered size (an all-reduce would move
        # twice its bytes), and no all-reduce of them.
        assert per_layer("all-gather") == 2 * 2 * cp * block
        kv_shaped = [c for c in seq if c.shape[-4:] == (
            2, 256 // cp // 2, cfg.n_kv_heads, cfg.head_dim)]
        sums = [c for c in kv_shaped if c.kind == "reduce-scatter"]
        assert {c.bytes for c in sums} == {cp * block}
        assert sum(c.count for c in sums) == 2 * cfg.n_layers
        assert not [c for c in kv_shaped if c.kind == "all-reduce"]
        assert not [c for c in seq if c.kind == "collective-permute"]


def test_pipelined_context_ranks_sum_weight_gradients_once_per_step(cpu_devices):
    # Megatron sums the weight gradients over the context-parallel ranks once per step,
    # with the data-parallel ones. Summed where SPMD puts them, inside the pipeline's loop,
    # they would run at every tick (M V + P - 1 of them). Here every sum over `sequence`
    # runs once, and each of the layers' 9 stacked weights (a SwiGLU RMSNorm layer: 2
    # norms, q, k, v, out, gate, up, down) is summed over data and sequence in one.
    cfg = tiny()
    mesh = sharding.make_mesh(H100, {"data": 2, "sequence": 2, "pipeline": 2})
    prog = models.build_train_program(
        cfg, mesh, sharding.default_rules(),
        workload=models.Workload(seq_len=64, global_batch=8, microbatches=4),
        precision=models.Precision(params="bfloat16", compute="bfloat16"),
        train=models.Train(remat="none"))
    assert prog.pipeline.ticks == 4 + 2 - 1
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    sums = [c for c in rep.collectives
            if c.kind in ("all-reduce", "reduce-scatter") and "sequence" in c.mesh_axes]
    assert sums and {c.count for c in sums} == {1}
    layer_sums = [c for c in sums if c.mesh_axes == ("data", "sequence")
                  and "gradient_sum" in c.op_name]
    assert len(layer_sums) == 9


def test_sequence_parallel_context_ranks_gather_no_activations_over_data(cpu_devices):
    # Megatron's sequence parallelism next to context parallelism, with the distributed
    # optimizer: a projection's weight gradient contracts the gathered (over `tensor`)
    # input with its output's gradient, and is reduce-scattered over data x sequence into
    # the optimizer's split. Left to the SPMD partitioner, the input kept the residual
    # stream's split over sequence x tensor, and the weight gradient's split over `data`
    # (propagated back from the optimizer's) made it all-gather the layers' activations
    # over `data` in the backward pass (295 GB a step for Llama 3 8B on 512 GPUs).
    cfg = tiny()
    mesh = sharding.make_mesh(H100, {"data": 2, "sequence": 2, "tensor": 2})
    prog = models.build_train_program(
        cfg, mesh, sharding.default_rules().with_sequence_parallel(),
        workload=models.Workload(seq_len=64, global_batch=8),
        precision=models.Precision(params="float32", compute="bfloat16"),
        train=models.Train(shard_optimizer_over_data=True))
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    over_data = [c for c in rep.collectives if "data" in c.mesh_axes
                 and c.kind in ("all-gather", "all-to-all")
                 and "optimizer" not in c.op_name]
    assert not over_data, [(c.kind, c.mesh_axes, c.bytes, c.op_name) for c in over_data]
    assert not [c for c in rep.collectives if c.kind == "all-to-all"]
    # each of a layer's 7 matrices' gradients (q, k, v, out, gate, up, down) reduce-scattered
    # once, in the layers' loop, as without sequence parallelism
    layer_scatters = [c for c in rep.collectives if c.kind == "reduce-scatter"
                      and c.mesh_axes == ("data", "sequence") and "/while/body/" in c.op_name]
    assert len(layer_scatters) == 7 and {c.count for c in layer_scatters} == {cfg.n_layers}


@pytest.mark.parametrize("preset, par, weight_axes", [
    # Megatron's layout (default rules): the context ranks hold the weights whole over
    # `sequence`, split over FSDP only.
    ("default", {"fsdp": 2, "sequence": 4}, ("fsdp",)),
    # MaxText's: the weights' width split over every rank that splits the batch or the
    # sequence (base.yml: embed over fsdp, context, expert), gathered at each use.
    ("maxtext", {"fsdp": 2, "sequence": 4}, ("fsdp", "sequence")),
    ("maxtext", {"fsdp": 2, "sequence": 2, "expert": 2}, ("fsdp", "expert", "sequence")),
])
def test_maxtext_context_ranks_hold_and_gather_a_share_of_the_weights(cpu_devices, preset, par,
                                                                     weight_axes):
    cfg = tiny()
    mesh = sharding.make_mesh(H100, par)
    prog = models.build_train_program(
        cfg, mesh, sharding.rules_preset(preset),
        workload=models.Workload(seq_len=64, global_batch=4),
        precision=models.Precision(params="float32", compute="bfloat16"), train=models.Train())
    # Every tiny parameter has a d_model (64) dimension, which the weight axes divide.
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(prog.args[0]))
    ways = int(np.prod([par[a] for a in weight_axes]))
    assert prog.param_bytes_per_device == F32 * n // ways
    # Adam's two f32 moments split like the weights, and its int32 step count
    assert prog.optimizer_bytes_per_device == 2 * F32 * n // ways + 4
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    # A layer's 7 matrices (q, k, v, out, gate, up, down), bf16, gathered whole over the
    # weight axes in the layers' loop: once in the forward pass, once more where the
    # backward pass recomputes them (full remat), in each of the 2 layers.
    layer_bf16 = layer_matmul_params(cfg) * 2
    gathers = [c for c in rep.collectives if c.kind == "all-gather" and c.dtype == "bfloat16"
               and "/while/body/" in c.op_name]
    assert {c.mesh_axes for c in gathers} == {weight_axes}
    assert {c.group_size for c in gathers} == {ways}
    assert sum(c.bytes * c.count for c in gathers) == 2 * cfg.n_layers * layer_bf16
    # their gradients summed and split over the same ranks: a reduce-scatter of the whole
    # weight each (and with weights whole over `sequence`, an all-reduce over it besides)
    scatters = [c for c in rep.collectives if c.kind == "reduce-scatter"
                and c.dtype == "bfloat16" and "/while/body/" in c.op_name]
    assert {c.mesh_axes for c in scatters} == {weight_axes}
    assert sum(c.bytes * c.count for c in scatters) == cfg.n_layers * layer_bf16
    weight_sums = [c for c in rep.collectives if c.kind == "all-reduce"
                   and c.mesh_axes == ("sequence",) and "_proj/" in c.op_name]
    assert bool(weight_sums) == ("sequence" not in weight_axes)


def test_maxtext_context_ranks_accumulate_gradients_of_their_weight_shares(cpu_devices):
    # With several micro-steps the default rules give each context rank a copy of the
    # layer weights (models/context.rank_copies); weights split over the context ranks
    # (MaxText's) have none: the step builds, and its state is the weights' share.
    cfg = tiny()
    par = {"fsdp": 2, "sequence": 4}
    mesh = sharding.make_mesh(H100, par)
    prog = models.build_train_program(
        cfg, mesh, sharding.rules_preset("maxtext"),
        workload=models.Workload(seq_len=64, global_batch=4, microbatches=2),
        precision=models.Precision(params="float32", compute="bfloat16"), train=models.Train())
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(prog.args[0]))
    assert prog.param_bytes_per_device == F32 * n // 8
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    assert "reduce-scatter" in rep.by_kind()
