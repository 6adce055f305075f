"""Building blocks shared by the dense Transformer and the mixture of experts: parameter
constructors (every one carries `logical_axes`), the weight matmul in the activations'
dtype or FP8 / FP4, and the MLP.

Array-name suffixes: the legend in models/__init__.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.fp8 import fp4_einsum, fp8_einsum
from models.program import DTYPES, Precision
from models.quant import QuantWeight
from sharding.rules import constrain


def new_param(rngs: nnx.Rngs, shape, axes, *, dtype, scale: float | None = None) -> nnx.Param:
    """A parameter drawn from N(0, scale^2); scale 1/sqrt(fan-in) (the first dimension) by
    default."""
    std = scale if scale is not None else shape[0] ** -0.5
    value = jax.random.normal(rngs.params(), shape, dtype) * std
    return nnx.Param(value, logical_axes=axes)


def new_weight(rngs: nnx.Rngs, shape, axes, *, precision: Precision, contract: int = 1,
               expert_dims: int = 0, scale: float | None = None):
    """A matmul weight: a Param in the parameters' dtype, or stored quantised when
    `precision.quantized_weights` says so (serving; models/quant.py). `contract`: how many
    dimensions after the `expert_dims` leading ones the matmul contracts."""
    if scale is None:
        scale = shape[expert_dims] ** -0.5
    if precision.quantized_weights is None:
        return new_param(rngs, shape, axes, dtype=DTYPES[precision.params], scale=scale)
    value = jax.random.normal(rngs.params(), shape, jnp.float32) * scale
    return QuantWeight(value, axes, precision.quantized_weights, contract=contract,
                       expert_dims=expert_dims)


def ones_param(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


def zeros_param(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class Norm(nnx.Module):
    """The model's norm over the residual stream, or with `width`, an RMSNorm over an
    unsharded dimension of that width (MLA's latents)."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, width: int | None = None):
        self.kind = cfg.norm if width is None else "rmsnorm"
        shape, axes = ((cfg.d_model,), ("embed",)) if width is None else ((width,), (None,))
        self.scale = ones_param(shape, axes, param_dtype)
        if self.kind == "layernorm":
            self.bias = zeros_param(shape, axes, param_dtype)

    def __call__(self, x_BLD):
        x = x_BLD.astype(jnp.float32)
        if self.kind == "layernorm":
            x = x - jnp.mean(x, axis=-1, keepdims=True)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        y = y * self.scale[...].astype(jnp.float32)
        if self.kind == "layernorm":
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x_BLD.dtype)


def rope(x_BLHE, positions_BL, theta: float):
    half = x_BLHE.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BLE = positions_BL[..., None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle_BLE)[:, :, None, :], jnp.cos(angle_BLE)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHE.dtype)


def project(spec: str, x, w, *, precision: Precision):
    """A weight matmul: in the activations' dtype, or in FP8 / FP4 (models/fp8.py) when
    `precision.compute` says so.

    `w` is the weight's Param (or an array). Low-precision recipes quantise after any FSDP
    gather here, so the gather moves the parameter dtype's bytes (Transformer Engine can
    gather FP8 weights instead; that saving is not modelled).
    """
    w = (w[...] if not isinstance(w, jax.Array) else w).astype(x.dtype)
    if precision.low_precision_matmuls == "float8":
        return fp8_einsum(spec, x, w)
    if precision.low_precision_matmuls == "float4":
        return fp4_einsum(spec, x, w)
    return jnp.einsum(spec, x, w)


def mlp_hidden(mlp, spec: str, x):
    """The MLP's hidden activation: silu(x W_gate) * x W_up (SwiGLU), gelu or relu of x W_up;
    `mlp` holds the weights (w_up, w_gate), `kind` and `precision`."""
    # Each projection under its own name, so that a report's row per model operation is
    # one weight (the gate and up matmuls under one name read as one matrix of twice the
    # bytes, as if it were gathered in f32).
    with jax.named_scope("up_proj"):
        up = checkpoint_name(project(spec, x, mlp.w_up, precision=mlp.precision), "mlpwi")
    if mlp.kind == "swiglu":
        with jax.named_scope("gate_proj"):
            gate = checkpoint_name(project(spec, x, mlp.w_gate, precision=mlp.precision),
                                   "mlpwi")
        return jax.nn.silu(gate) * up
    return jax.nn.gelu(up) if mlp.kind == "gelu" else jax.nn.relu(up)


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, precision: Precision):
        d, f = cfg.d_model, cfg.d_ff
        self.kind = cfg.mlp
        self.precision = precision
        if cfg.mlp == "swiglu":
            self.w_gate = new_weight(rngs, (d, f), ("embed", "mlp"), precision=precision)
        self.w_up = new_weight(rngs, (d, f), ("embed", "mlp"), precision=precision)
        self.w_down = new_weight(rngs, (f, d), ("mlp", "embed"), precision=precision)

    def __call__(self, x_BLD):
        h_BLF = constrain(mlp_hidden(self, "bld,df->blf", x_BLD), ("batch", "seq", "mlp"))
        with jax.named_scope("down_proj"):
            out_BLD = project("blf,fd->bld", h_BLF, self.w_down, precision=self.precision)
            return checkpoint_name(constrain(out_BLD, ("batch", "residual_seq", "embed")), "mlpwo")
