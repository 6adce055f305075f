"""Megatron's fused projections (`[model] fused_qkv`, `fused_mlp`): the same function as
separate weights, and one tensor-parallel reduction of a block's input gradient instead of
one per projection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import sharding
from tests.steps import H100, tiny


def test_fused_weights_compute_what_separate_ones_do():
    # The separate model's weights laid out as Megatron's fused ones (per kv head: its G
    # query heads, its key, its value; gate then up) give the same logits.
    precision = models.Precision(params="float32", compute="float32")
    cfg = tiny()
    sep = models.make_model(cfg, precision, seed=3)
    fused = models.make_model(tiny(fused_qkv=True, fused_mlp=True), precision, seed=4)
    h, kv, e, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    a, m = sep.blocks.attn, sep.blocks.mlp
    layers = cfg.n_layers
    q = a.wq[...].reshape(layers, d, kv, h // kv, e)
    fused.blocks.attn.wqkv[...] = jnp.concatenate(
        [q, a.wk[...][:, :, :, None], a.wv[...][:, :, :, None]], axis=3)
    fused.blocks.mlp.w_gate_up[...] = jnp.stack([m.w_gate[...], m.w_up[...]], axis=2)
    fused.blocks.attn.wo[...] = a.wo[...]
    fused.blocks.mlp.w_down[...] = m.w_down[...]
    fused.embed[...] = sep.embed[...]
    fused.lm_head[...] = sep.lm_head[...]
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab)
    np.testing.assert_allclose(np.asarray(fused(tokens)), np.asarray(sep(tokens)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused, per_layer", [(False, 3 + 2), (True, 1 + 1)])
def test_fused_projections_reduce_a_blocks_input_gradient_once(cpu_devices, fused, per_layer):
    # Sequence parallelism gathers a block's input before its projections and
    # reduce-scatters the input's gradient back. Separate q, k, v (and gate, up) weights
    # reduce-scatter one gradient per projection, 3 + 2 per layer; the fused weights one
    # per block, as Megatron's linear_qkv and linear_fc1 do. Each is the gathered input's
    # size. (Long sequences: with activations much larger than the weights, XLA gathers
    # the activations, as at real sizes.)
    cfg = tiny(fused_qkv=fused, fused_mlp=fused)
    mesh = sharding.make_mesh(H100, {"data": 4, "tensor": 2})
    prog = models.build_train_program(
        cfg, mesh, sharding.default_rules().with_sequence_parallel(),
        workload=models.Workload(seq_len=2048, global_batch=8),
        precision=models.Precision(params="bfloat16", compute="bfloat16"),
        train=models.Train(remat="none"))
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    block_input = (8 // 4) * 2048 * cfg.d_model * 2  # a block's gathered input, bf16
    grads = [c for c in rep.collectives
             if c.kind == "reduce-scatter" and c.mesh_axes == ("tensor",)
             and "_proj" in c.op_name and not any(o in c.op_name for o in ("out_", "down_"))]
    assert {c.bytes for c in grads} == {block_input}
    assert sum(c.count for c in grads) == per_layer * cfg.n_layers
    weights = [c for c in rep.collectives if c.kind == "all-gather" and "_proj" in c.op_name
               and c.bytes != block_input]
    assert not weights  # the projections' activations move, never their weights


def test_fused_qkv_needs_whole_kv_heads_per_tensor_rank():
    with pytest.raises(ValueError, match="kv_heads"):
        mesh = sharding.make_mesh(H100, {"tensor": 4, "data": 2})
        models.build_train_program(
            tiny(fused_qkv=True), mesh, sharding.default_rules(),
            workload=models.Workload(seq_len=32, global_batch=4),
            precision=models.Precision(), train=models.Train())
