"""Multi-head latent attention (models/mla.py) and a MoE model's dense first layers: a
sharded train step equal to the unsharded one, the latent cache (its bytes, its decode)."""

import dataclasses

import jax
import numpy as np
import pytest

import meshes
import models
import sharding
from models.inference import build_serve_program
from tests.steps import decode_both_ways, train_both_ways

# DeepSeek-V3's layout at tiny size: the queries through a rank-24 projection, a 32-wide
# latent with an 8-wide RoPE key, values 12 wide (head_dim 16 without RoPE: queries and keys
# 24), one dense first layer of d_ff 96 before a MoE layer with a shared expert.
MLA = models.preset("tiny", n_layers=2, n_kv_heads=4, kv_lora_rank=32, q_lora_rank=24,
                    qk_rope_dim=8, v_head_dim=12, n_experts=4, experts_per_token=2,
                    n_shared_experts=1, n_dense_layers=1, dense_d_ff=96, dropless=True)


def test_mla_train_step_with_heads_over_tensor_matches_unsharded(cpu_devices):
    # The attention alone (a dense MLP compiles in a third of a MoE layer's time; the dense
    # first layers' stack runs in the decode test below), dense attention for the same
    # reason (flash attention's narrower values: tests/models/test_attention.py).
    cfg = dataclasses.replace(MLA, n_experts=1, experts_per_token=1, n_shared_experts=0,
                              n_dense_layers=0, dense_d_ff=0, attention="dense")
    (loss1, p1), (loss2, p2) = train_both_ways(cfg, {"fsdp": 2, "tensor": 4}, seed=3,
                                               token_seed=1, seq_len=16, global_batch=8,
                                               remat="full", compute="float32")
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-5)
    for name in ("wq_a", "wq_b", "wkv_a", "wk_b", "wv_b", "wo"):
        np.testing.assert_allclose(np.asarray(p2["blocks"]["attn"][name]),
                                   np.asarray(p1["blocks"]["attn"][name]), rtol=1e-4, atol=1e-6)
    # The up projections' heads are split over tensor, their rank over fsdp (as embed).
    spec = p2["blocks"]["attn"]["wk_b"].sharding.spec
    assert tuple(spec)[:3] == (None, "fsdp", "tensor")


def test_sharded_decode_reads_the_latent_cache_and_agrees(cpu_devices):
    prog, _, (expect_logits, expect_cache), (next_tok, cache) = decode_both_ways(
        MLA, {"data": 2, "tensor": 4}, batch=4, index=5, seed=1)
    np.testing.assert_array_equal(np.asarray(next_tok), np.argmax(expect_logits, axis=-1))
    np.testing.assert_allclose(np.asarray(cache[0]), np.asarray(expect_cache[0]), atol=1e-5)
    # One array of latents, (layers, batch, positions, kv_lora + qk_rope), the batch split
    # over data, the latent whole on every tensor rank.
    (latent,) = prog.args[1]
    assert latent.shape == (2, 4, 16, 40)
    assert tuple(latent.sharding.spec) == (None, "data")  # the rest whole


def test_deepseek_v3_cache_is_576_values_per_token_and_layer(cpu_devices):
    # Abstract (nothing compiled): DeepSeek-V3 decoding 8 sequences of 4096 positions with
    # the batch over 8 devices holds 61 layers x 4096 x 576 values in bf16 per sequence.
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 8})
    prog = build_serve_program(models.preset("deepseek-v3"), mesh, sharding.default_rules(),
                               workload=models.Workload(kind="decode", seq_len=4096,
                                                        global_batch=8),
                               precision=models.Precision(params="bfloat16"))
    assert prog.cache_bytes_per_device == 61 * 4096 * (512 + 64) * 2
    assert jax.tree.leaves(prog.args[1])[0].dtype == np.dtype("bfloat16")


def test_a_pipeline_models_the_dense_first_layers_as_moe_layers_and_says_so():
    from flax import nnx

    from models.pipeline import Pipeline
    from models.transformer import dense_layer_note

    cfg = dataclasses.replace(MLA, n_layers=4)
    plan = Pipeline(stages=2, microbatches=2, layers=4)
    model = nnx.eval_shape(lambda: models.make_model(cfg, models.Precision(), pipeline=plan))
    assert not hasattr(model, "dense_blocks")  # every slot alike, a MoE layer
    assert model.blocks.mlp.w_up.shape[:2] == (4, 4)  # (slots, experts, ...)
    (note,) = dense_layer_note(cfg, pipelined=True)
    assert "model.n_dense_layers=1" in note and "modelled as MoE layers" in note
    assert dense_layer_note(cfg, pipelined=False) == ()
    unpipelined = nnx.eval_shape(lambda: models.make_model(cfg, models.Precision()))
    assert unpipelined.dense_blocks.mlp.w_up.shape == (1, 64, 96)  # (layers, d, dense_d_ff)
