"""The fused blocks' custom VJPs (models/kernels.py) differentiate as JAX does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import kernels


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_the_fused_norm_has_jaxs_gradients(kind):
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (4, 8, 64), jnp.float32)
    scale = 1 + 0.1 * jax.random.normal(ks[1], (64,))
    bias = 0.1 * jax.random.normal(ks[2], (64,)) if kind == "layernorm" else None
    dy = jax.random.normal(ks[3], x.shape)

    def vjp(fused):
        with kernels.fused_kernels(fused):
            y, back = jax.vjp(lambda x, s, b: kernels.norm(x, s, b, kind), x, scale, bias)
        return y, back(dy)

    (y, grads), (y_ref, grads_ref) = vjp(True), vjp(False)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)


def test_the_fused_swiglu_has_jaxs_gradients():
    ks = jax.random.split(jax.random.key(1), 3)
    gate, up, dh = (jax.random.normal(k, (16, 128)) for k in ks)

    def vjp(fused):
        with kernels.fused_kernels(fused):
            h, back = jax.vjp(kernels.swiglu, gate, up)
        return h, back(dh)

    (h, grads), (h_ref, grads_ref) = vjp(True), vjp(False)
    np.testing.assert_allclose(h, h_ref, rtol=1e-6)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)
