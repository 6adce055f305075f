"""Attention (models/attention.py): flash attention against dense attention."""

import jax
import jax.numpy as jnp
import numpy as np

import meshes


def test_flash_attention_matches_dense_values_and_gradients():
    from models.attention import dense_attention, flash_attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 64, 2, 3, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 64, 2, 8)), jnp.float32)
    # values narrower than queries and keys, as multi-head latent attention's (models/mla.py)
    v = jnp.asarray(rng.normal(size=(2, 64, 2, 6)), jnp.float32)
    do = jnp.asarray(rng.normal(size=(*q.shape[:-1], 6)), jnp.float32)
    # Each compiled once (jax.jit) rather than run op by op.
    flash = jax.jit(lambda q, k, v: flash_attention(q, k, v, block=16))
    np.testing.assert_allclose(flash(q, k, v), jax.jit(dense_attention)(q, k, v), atol=1e-5)
    grads = [jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * do),
                              argnums=(0, 1, 2)))(q, k, v)
             for f in (dense_attention, flash)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_flash_attention_skips_the_masked_half(cpu_devices):
    # Causal flash over 4 blocks computes 1+2+3+4 = 10 of 16 score tiles; dense computes all.
    from models.attention import dense_attention, flash_attention
    from sharding.compute import compute_cost
    from sharding.hlo import parse_hlo

    q = jax.ShapeDtypeStruct((1, 256, 1, 1, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 256, 1, 64), jnp.float32)
    chip = meshes.get_system("h100:8").chip
    flops = {}
    for name, f in (("dense", dense_attention),
                    ("flash", lambda q, k, v: flash_attention(q, k, v, block=64))):
        text = jax.jit(f).lower(q, k, k).compile().as_text()
        flops[name] = compute_cost(parse_hlo(text), chip).matmul_flops
    assert flops["dense"] == 2 * 2 * 256 * 256 * 64
    assert flops["flash"] == flops["dense"] * 10 / 16


def test_flash_attention_holds_one_tiles_scores_at_a_time(cpu_devices):
    # A loop over 128 x 128 tiles of a 1024-position sequence: no array of the forward or
    # backward pass is larger than one tile's scores (the accumulators, L x H x E, are
    # smaller here). Unrolled query blocks made a whole row of key blocks per query block
    # (128 x 1024), and XLA could keep every block's at once (issue: will it fit).
    from models.attention import flash_attention
    from sharding.hlo import parse_hlo

    b, seq, kv, g, e = 1, 1024, 2, 2, 8
    q = jax.ShapeDtypeStruct((b, seq, kv, g, e), jnp.float32)
    k = jax.ShapeDtypeStruct((b, seq, kv, e), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, block=128))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).as_text(dialect="hlo")
    largest = max(s.num_elements for comp in parse_hlo(text).computations.values()
                  for inst in comp.instructions for s in inst.shapes)
    assert largest == b * kv * g * 128 * 128


def test_tiled_attention_counts_each_tiles_scores_through_hbm(cpu_devices):
    # model.attention = "tiled" (what `shardscope measure` runs): the same blocks and FLOPs
    # as flash, but its tiles are the kernels XLA compiles them to: each tile's scores
    # (B x K x G x 512 x 512 f32, 32 MiB here: beyond half an H100's L2) are written by the QK^T
    # matmul and read by the softmax's kernels, at least once each, where a fused kernel
    # keeps them on chip. Compiled only: nothing of this size is allocated.
    from models.attention import as_kernels, flash_attention
    from sharding.compute import compute_cost
    from sharding.hlo import parse_hlo

    b, seq, kv, g, e = 4, 1024, 2, 4, 64
    q = jax.ShapeDtypeStruct((b, seq, kv, g, e), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, seq, kv, e), jnp.bfloat16)
    chip = meshes.get_system("h100:8").chip
    cost = {}
    for kind in ("flash", "tiled"):
        def f(q, k, v, kind=kind):
            with as_kernels(kind):
                return flash_attention(q, k, v, block=512)
        cost[kind] = compute_cost(parse_hlo(jax.jit(f).lower(q, k, k).compile().as_text()),
                                  chip)
    assert cost["tiled"].matmul_flops == cost["flash"].matmul_flops
    tiles, scores = 3, b * kv * g * 512 * 512 * 4  # the causal half of 2 x 2 blocks
    assert cost["tiled"].hbm_bytes >= cost["flash"].hbm_bytes + tiles * scores * 2
