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
    v = jnp.asarray(rng.normal(size=(2, 64, 2, 8)), jnp.float32)
    do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
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
