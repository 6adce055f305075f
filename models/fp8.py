"""FP8 matmuls as an FP8 training recipe runs them (Transformer Engine style, current
scaling): each operand is scaled per tensor into e4m3's range, multiplied in FP8 with f32
accumulation, and rescaled. The backward pass quantises the incoming gradient the same way
and runs both gradient matmuls in FP8 too, so the compiled program has FP8 operands for all
three matmuls of every projection (the byte counts and the FP8 peak rate follow).

Gradients use e4m3 like the activations; recipes often use e5m2 for them, which moves the
same bytes at the same rate (one byte per element), so the cost is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0


def quantize(x):
    """(x in e4m3 scaled to the format's range, the scale that restores it)."""
    scale = jnp.maximum(jnp.max(jnp.abs(x)).astype(jnp.float32), 1e-12) / E4M3_MAX
    return (x.astype(jnp.float32) / scale).astype(E4M3), scale


def _transposed(spec: str) -> tuple[str, str]:
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    return f"{out},{w}->{x}", f"{x},{out}->{w}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec: str, x, w):
    """`jnp.einsum(spec, x, w)` with FP8 operands; every index must appear in exactly two
    of the three operands (true of projections)."""
    return _fwd(spec, x, w)[0]


def _fwd(spec, x, w):
    xq, sx = quantize(x)
    wq, sw = quantize(w)
    y = jnp.einsum(spec, xq, wq, preferred_element_type=jnp.float32) * (sx * sw)
    # Empty arrays carry the input dtypes through the residuals.
    return y.astype(x.dtype), (xq, sx, wq, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _bwd(spec, residuals, dy):
    xq, sx, wq, sw, x_dtype, w_dtype = residuals
    dyq, sdy = quantize(dy)
    dx_spec, dw_spec = _transposed(spec)
    dx = jnp.einsum(dx_spec, dyq, wq, preferred_element_type=jnp.float32) * (sdy * sw)
    dw = jnp.einsum(dw_spec, xq, dyq, preferred_element_type=jnp.float32) * (sx * sdy)
    return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


fp8_einsum.defvjp(_fwd, _bwd)
