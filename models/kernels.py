"""The memory-bound blocks GPU training frameworks run as hand-fused kernels: RMSNorm /
LayerNorm and the SwiGLU activation as Transformer Engine runs them.

Each block runs under its named scope (sharding/kernel_scopes.py), which a GPU system's
estimate reads as one kernel. Built for a GPU (`fused_kernels(True)` while tracing, as the
train step does when the runner asks for it), each is also a custom VJP that keeps for the
backward pass what the fused kernel keeps -- the norm its input and the f32 reciprocal RMS
(LayerNorm: and the mean), the activation its two inputs -- and recomputes the rest inside
the backward kernel; JAX's own differentiation would save the f32 intermediates (the
upcast input, the normalised input, the sigmoid) and read them back. Otherwise (TPU
systems) the blocks are differentiated by JAX, as XLA's TPU fusions run them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from sharding import kernel_scopes

_FUSED = contextvars.ContextVar("fused_kernels", default=False)
CROSS_ENTROPY = kernel_scopes.CROSS_ENTROPY  # the loss's scope (models/train.py)
_EPS = 1e-6


@contextlib.contextmanager
def fused_kernels(on: bool):
    """Trace the blocks as a GPU framework's fused kernels (custom VJPs) when `on`."""
    token = _FUSED.set(on)
    try:
        yield
    finally:
        _FUSED.reset(token)


def norm(x_BLD, scale_D, bias_D, kind: str):
    """RMSNorm (`kind` "rmsnorm") or LayerNorm of the last axis in f32, in x's dtype;
    `bias_D` None without a bias."""
    with jax.named_scope(kernel_scopes.NORM):
        if _FUSED.get():
            return _fused_norm(x_BLD, scale_D, bias_D, kind)
        return _norm_fwd(x_BLD, scale_D, bias_D, kind)[0]


def _norm_fwd(x_BLD, scale_D, bias_D, kind):
    with jax.named_scope(kernel_scopes.NORM):
        x = x_BLD.astype(jnp.float32)
        mean_BL1 = jnp.mean(x, axis=-1, keepdims=True) if kind == "layernorm" else None
        if mean_BL1 is not None:
            x = x - mean_BL1
        rs_BL1 = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + _EPS)
        y = x * rs_BL1 * scale_D.astype(jnp.float32)
        if bias_D is not None:
            y = y + bias_D.astype(jnp.float32)
        return y.astype(x_BLD.dtype), (x_BLD, scale_D, bias_D, mean_BL1, rs_BL1)


def _norm_bwd(kind, residuals, dy_BLD):
    with jax.named_scope(kernel_scopes.NORM):
        x_BLD, scale_D, bias_D, mean_BL1, rs_BL1 = residuals
        x = x_BLD.astype(jnp.float32)
        xhat = (x if mean_BL1 is None else x - mean_BL1) * rs_BL1
        g = dy_BLD.astype(jnp.float32)
        outer = tuple(range(g.ndim - 1))
        dscale = jnp.sum(g * xhat, axis=outer).astype(scale_D.dtype)
        dbias = None if bias_D is None else jnp.sum(g, axis=outer).astype(bias_D.dtype)
        gs = g * scale_D.astype(jnp.float32)
        dxhat = gs - xhat * jnp.mean(gs * xhat, axis=-1, keepdims=True)
        if mean_BL1 is not None:
            dxhat = dxhat - jnp.mean(gs, axis=-1, keepdims=True)
        return (dxhat * rs_BL1).astype(x_BLD.dtype), dscale, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_norm(x_BLD, scale_D, bias_D, kind):
    return _norm_fwd(x_BLD, scale_D, bias_D, kind)[0]


_fused_norm.defvjp(_norm_fwd, _norm_bwd)


def swiglu(gate, up):
    """silu(gate) * up, in their dtype."""
    with jax.named_scope(kernel_scopes.ACTIVATION):
        if _FUSED.get():
            return _fused_swiglu(gate, up)
        return jax.nn.silu(gate) * up


@jax.custom_vjp
def _fused_swiglu(gate, up):
    return _swiglu_fwd(gate, up)[0]


def _swiglu_fwd(gate, up):
    with jax.named_scope(kernel_scopes.ACTIVATION):
        return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_bwd(residuals, dh):
    with jax.named_scope(kernel_scopes.ACTIVATION):
        gate, up = residuals
        g, u, d = (a.astype(jnp.float32) for a in (gate, up, dh))
        sig = jax.nn.sigmoid(g)
        dgate = d * u * sig * (1 + g * (1 - sig))
        return dgate.astype(gate.dtype), (d * g * sig).astype(up.dtype)


_fused_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
