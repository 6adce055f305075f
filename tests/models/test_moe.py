"""Mixture of experts: routing with capacity, the all-to-alls of expert parallelism, and a
sharded step equal to the unsharded one."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshes
import models
import sharding
from experiments import config as config_mod
from models import hf
from models.moe import capacity, route, routing_group_size
from tests.steps import train_both_ways, train_program


@pytest.mark.parametrize("name, total, active", [
    # Published totals / active parameters (model cards; workloads.md).
    ("mixtral-8x7b", 46.7, 12.9), ("mixtral-8x22b", 141, 39), ("gpt-oss-120b", 116.8, 5.1),
    ("qwen3-235b-a22b", 235, 22), ("deepseek-v3", 671, 37),
])
def test_moe_presets_match_the_model_cards(name, total, active):
    cfg = models.preset(name)
    assert cfg.param_count() / 1e9 == pytest.approx(total, rel=0.01)
    assert cfg.active_param_count() / 1e9 == pytest.approx(active, rel=0.05)


def test_deepseek_v3_preset_is_its_released_config():
    # MLA, 3 dense first layers, 1 shared expert: the model its config.json describes
    # (tests/models/test_hf.py checks that one's counts against the model card).
    fields, _ = hf.load(config_mod.BUNDLED / "hf" / "deepseek-v3.json")
    assert models.preset("deepseek-v3") == models.ModelConfig(**{**fields,
                                                                 "name": "deepseek-v3"})


def test_routing_keeps_first_choices_first_and_drops_beyond_capacity():
    cfg = models.preset("tiny", n_experts=4, experts_per_token=2, capacity_factor=1.0)
    s = 8
    cap = capacity(cfg, s)
    assert cap == math.ceil(1.0 * s * 2 / 4) == 4
    # Every token prefers expert 0, then expert 1: expert 0 takes the first 4 first choices,
    # expert 1 the first 4 second choices; the rest is dropped.
    logits = jnp.tile(jnp.array([4.0, 2.0, 0.0, -1.0]), (1, s, 1))
    weight, expert, slot, kept = route(cfg, logits)
    np.testing.assert_array_equal(expert[0, :, 0], 0)
    np.testing.assert_array_equal(expert[0, :, 1], 1)
    np.testing.assert_array_equal(slot[0, :, 0], np.arange(s))
    np.testing.assert_array_equal(kept[0, :, 0], np.arange(s) < 4)
    np.testing.assert_array_equal(kept[0, :, 1], np.arange(s) < 4)
    np.testing.assert_allclose(weight.sum(-1), 1.0, rtol=1e-6)
    dropless = models.preset("tiny", n_experts=4, experts_per_token=2, dropless=True)
    assert capacity(dropless, s) == s
    assert bool(route(dropless, logits)[3].all())
    assert routing_group_size(cfg, 24) == 24
    assert routing_group_size(dataclasses.replace(dropless, moe_group_size=16), 24) == 12


def _tiny_moe(**kw):
    return models.preset("tiny", n_experts=4, experts_per_token=2, moe_group_size=8, **kw)


@pytest.mark.parametrize("par, routing", [
    ({"data": 2, "expert": 4}, {"capacity_factor": 1.0}),
    ({"expert": 2, "fsdp": 2, "tensor": 2}, {"capacity_factor": 1.25}),
    ({"expert": 4, "tensor": 2}, {"dropless": True}),
    ({"data": 2, "tensor": 4}, {"capacity_factor": 2.0, "n_shared_experts": 1,
                                "n_kv_heads": 4})])
def test_expert_parallel_train_step_matches_unsharded(cpu_devices, par, routing):
    cfg = _tiny_moe(**routing)
    (loss1, p1), (loss2, p2) = train_both_ways(cfg, par, seed=3, token_seed=1, seq_len=16,
                                               global_batch=16, remat="full",
                                               compute="float32")
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-5)
    w1 = np.asarray(p1["blocks"]["mlp"]["w_up"])
    # (f32 sums in another order: the tensor ranks' partial sums; weights are ~0.1)
    np.testing.assert_allclose(np.asarray(p2["blocks"]["mlp"]["w_up"]), w1, rtol=1e-4, atol=1e-5)


def test_all_to_all_bytes_are_tokens_times_top_k_times_d_model(cpu_devices):
    # capacity_factor 1 and a group of 8 tokens: capacity = 8 x 2 / 4 = 4 slots per expert,
    # experts x capacity = 16 = group x top-k, so the dispatch buffer is exactly
    # tokens x top-k x d_model.
    cfg = _tiny_moe(capacity_factor=1.0)
    par = {"data": 2, "expert": 4}
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), par)
    prog = train_program(cfg, mesh, seq_len=32, global_batch=16, remat="full",
                         compute="bfloat16")
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system="h100:8")
    a2a = [c for c in rep.collectives if c.kind == "all-to-all"]
    tokens_per_device = 16 * 32 // 8
    expected = tokens_per_device * cfg.experts_per_token * cfg.d_model * 2  # bf16
    assert a2a and all(c.bytes == expected for c in a2a)
    assert all(c.mesh_axes == ("expert",) and c.group_size == 4 for c in a2a)
    assert all(c.wire_bytes == pytest.approx(expected * 3 / 4) for c in a2a)
    # Per layer: dispatch and combine forward, again when full remat recomputes the layer,
    # and once each in the backward pass.
    assert sum(c.count for c in a2a) == 6 * cfg.n_layers
    assert any("mlp/dispatch" in c.op_name for c in a2a)
    assert any("mlp/combine" in c.op_name for c in a2a)


def test_expert_axis_shards_dense_batch_and_expert_weights(cpu_devices):
    cfg = _tiny_moe()
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 2, "expert": 4})
    prog = train_program(cfg, mesh, seq_len=16, global_batch=16)
    params, _, batch = prog.args
    assert params["blocks"]["mlp"]["w_up"].sharding.spec[:2] == (None, "expert")
    assert params["blocks"]["attn"]["wq"].sharding.spec == jax.sharding.PartitionSpec()
    assert batch["inputs"].sharding.spec[0] == ("data", "expert")


def test_maxtext_expert_ranks_split_the_dense_weights_too(cpu_devices):
    # MaxText's rules: a dense weight's width over fsdp x expert (base.yml: embed over fsdp,
    # context, expert); an expert's weight has `expert` on its experts, its width over fsdp
    # alone (embed_moe).
    cfg = _tiny_moe()
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"fsdp": 2, "expert": 4})
    prog = models.build_train_program(
        cfg, mesh, sharding.rules_preset("maxtext"),
        workload=models.Workload(seq_len=16, global_batch=16),
        precision=models.Precision(params="float32", compute="float32"), train=models.Train())
    params = prog.args[0]
    assert params["blocks"]["mlp"]["w_up"].sharding.spec[:3] == (None, "expert", "fsdp")
    width = jax.sharding.PartitionSpec(None, ("fsdp", "expert"))
    assert params["blocks"]["attn"]["wq"].sharding.spec == width
    assert params["blocks"]["mlp"]["router"].sharding.spec == width
    # so every parameter (each has a d_model dimension of 64) is split 8 ways
    n = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
    assert prog.param_bytes_per_device == 4 * n // 8


def test_minimal_remat_recomputes_the_experts_and_the_memory_model_agrees(cpu_devices):
    # A routed expert's matmuls have the expert as a batch dimension: remat "minimal" keeps
    # the projections and the router's logits but recomputes the experts, dispatch
    # included (6 all-to-alls a layer, as "full"; "none": 4). The memory model counts what
    # the program keeps: per token and layer the input, q, k, v, the attention output
    # projection (bf16) and the router's f32 logits.
    from models.memory import activation_components

    cfg = _tiny_moe(capacity_factor=1.0)
    par = {"data": 2, "expert": 4}
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), par)

    def all_to_alls(remat):
        prog = train_program(cfg, mesh, seq_len=32, global_batch=16, remat=remat,
                             compute="bfloat16")
        rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system="h100:8")
        return sum(c.count for c in rep.collectives if c.kind == "all-to-all")

    assert all_to_alls("minimal") == all_to_alls("full") == 6 * cfg.n_layers
    assert all_to_alls("none") == 4 * cfg.n_layers
    parts = dict(activation_components(
        cfg, micro_batch=16, seq_len=32, remat="minimal", mesh_shape=par,
        precision=models.Precision(params="bfloat16"), rules=sharding.default_rules()))
    tokens = 16 * 32 // 8
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    per_token = 2 * (d + cfg.n_heads * cfg.head_dim + 2 * kv + d) + 4 * cfg.n_experts
    key = f"saved activations (minimal remat, {cfg.n_layers} layers)"
    assert parts[key] == pytest.approx(cfg.n_layers * tokens * per_token)


@pytest.mark.parametrize("weights, compute, shared", [
    ("", "bfloat16", 0), ("int4", "bfloat16", 0), ("float8", "float8", 0), ("", "bfloat16", 1)])
def test_tensor_parallel_experts_sum_the_combined_tokens_once(cpu_devices, weights, compute,
                                                               shared):
    # The experts' down projection is row-parallel under tensor parallelism; serving
    # engines (vLLM's, SGLang's fused MoE) sum its partial sums over the tensor ranks after
    # the router-weighted combine, with the shared expert's: one all-reduce of the tokens'
    # rows (tokens x d_model in bf16) a layer. Summed where the matmul ends, it moved the
    # slot buffer: here 4 experts x 8 slots for 8 tokens, 4x (2 choices x capacity
    # factor 2), and the shared expert had an all-reduce of its own.
    from models.inference import build_serve_program

    cfg = _tiny_moe(capacity_factor=2.0, n_kv_heads=4, n_shared_experts=shared)
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 2, "tensor": 4})
    prog = build_serve_program(
        cfg, mesh, sharding.default_rules(),
        workload=models.Workload(kind="decode", seq_len=64, global_batch=16),
        precision=models.Precision(params="bfloat16", weights=weights, compute=compute))
    assert capacity(cfg, 8) * cfg.n_experts == 4 * 8
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system="h100:8")
    moe = [c for c in rep.collectives if "/mlp/" in c.op_name and c.kind == "all-reduce"
           and c.dtype != "float32"]  # (FP8's per-tensor amax: a scalar)
    tokens = 16 // 2  # a device's: the batch over `data`
    assert moe and all("mlp/combine" in c.op_name and c.mesh_axes == ("tensor",)
                       and c.bytes == tokens * cfg.d_model * 2 for c in moe)
    assert sum(c.count for c in moe) == cfg.n_layers
