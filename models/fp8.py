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
from jax.sharding import NamedSharding, PartitionSpec

from models.quant import FORMAT_MAX, quantize
from sharding import kernel_scopes


def _per_tensor_e4m3(x, scope: str = kernel_scopes.QUANTIZE):
    """(x in e4m3 scaled per tensor to the format's range, the f32 scale that restores it),
    in one cast kernel on GPUs (sharding/kernel_scopes.py; a weight's under its own scope)."""
    with jax.named_scope(scope):
        return quantize(x, "float8", scale_dtype=jnp.float32)


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
    xq, sx = _per_tensor_e4m3(x)
    wq, sw = _per_tensor_e4m3(w, kernel_scopes.QUANTIZE_WEIGHT)
    # Transformer Engine's FP8 GEMM accumulates in f32 and writes the activations' dtype:
    # a partial sum over a split contraction (a row-parallel projection's) is reduced in
    # it, not in f32 (a reduce-scatter of half the bytes).
    y = jnp.einsum(spec, xq, wq, preferred_element_type=x.dtype) * (sx * sw).astype(x.dtype)
    # Empty arrays carry the input dtypes through the residuals.
    return y, (xq, sx, wq, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _bwd(spec, residuals, dy):
    xq, sx, wq, sw, x_dtype, w_dtype = residuals
    dyq, sdy = _per_tensor_e4m3(dy)
    dx_spec, dw_spec = _transposed(spec)
    dx = jnp.einsum(dx_spec, dyq, wq, preferred_element_type=x_dtype.dtype) * (
        sdy * sw).astype(x_dtype.dtype)  # written in the activations' dtype, as forward
    # The weight gradient leaves the GEMM in the weight's dtype (Transformer Engine's wgrad
    # GEMM writes bf16 for bf16 weights): a partial sum over sharded tokens is then reduced
    # in that dtype, not in f32 (grad_reduce = "bfloat16" recipes).
    dw = jnp.einsum(dw_spec, xq, dyq, preferred_element_type=w_dtype.dtype) * (
        sx * sdy).astype(w_dtype.dtype)
    return dx.astype(x_dtype.dtype), dw


fp8_einsum.defvjp(_fwd, _bwd)


def fp8_einsum_stored(spec: str, x, wq, w_scale):
    """Serving with FP8 weights (`precision.weights = "float8"`) and FP8 matmuls: the stored
    e4m3 values go to the GEMM as they are and their per-output-channel scales apply to its
    output (W8A8, as FP8 checkpoints are served), where dequantising and requantising the
    weight would read it in bf16 and write it again every step. `w_scale` has the weight's
    shape with the contracted dimensions 1 (models/quant.QuantWeight). The activations are
    quantised per tensor, as in training. No gradient: serving only."""
    xq, sx = _per_tensor_e4m3(x)
    y = jnp.einsum(spec, xq, wq, preferred_element_type=x.dtype)
    inputs, out = spec.split("->")
    w_labels = inputs.split(",")[1]
    kept = [label for label in w_labels if label in out]
    # the scales laid out as the output: contracted dimensions dropped, the rest in the
    # output's order, its other dimensions 1
    scale = jnp.squeeze(w_scale, [i for i, label in enumerate(w_labels) if label not in out])
    scale = jnp.transpose(scale, [kept.index(label) for label in out if label in kept])
    scale = jnp.expand_dims(scale, [i for i, label in enumerate(out) if label not in kept])
    # Each op on the GEMM's output, as its epilogue applies them (the vector and the scalar
    # as they are, no kernel of their own to combine them).
    with jax.named_scope(kernel_scopes.GEMM_EPILOGUE):
        return (y.astype(jnp.float32) * scale.astype(jnp.float32) * sx).astype(x.dtype)


# FP4 (E2M1) with block scaling, as Blackwell's block-scaled tensor-core MMA runs it
# (OCP MX: MXFP4 = 32 elements sharing one power-of-two E8M0 scale). Each operand is split
# into blocks of 32 along a contracted dimension; every block is scaled so that its
# largest magnitude fits E2M1's range (6.0) and rounded to E2M1. The matmul multiplies the
# E2M1 values with their block scales applied (the MMA does this in the tensor core); in the
# HLO that is a convert-from-f4 x scale in front of the dot, which sharding/compute.py
# counts as one FP4 matmul reading FP4 bytes. Gradients are quantised the same way and both
# gradient matmuls run in FP4 too (NVFP4 training recipes do; they add stochastic rounding
# and random Hadamard transforms of the gradients, which change accuracy, not cost).
E2M1 = jnp.float4_e2m1fn
E8M0 = jnp.float8_e8m0fnu
MX_BLOCK = 32


def quantize_blocks_raw(x, axis: int):
    """(E2M1 values, E8M0 scales): x split into blocks of 32 along `axis` (a new axis of
    32 after it), each block scaled by a power of two that fits its largest magnitude."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % MX_BLOCK:
        raise ValueError(f"FP4 block scaling needs the contracted dimension ({n}) to be a "
                         f"multiple of {MX_BLOCK}")
    shape = (*x.shape[:axis], n // MX_BLOCK, MX_BLOCK, *x.shape[axis + 1:])
    blocks = x.astype(jnp.float32).reshape(shape)
    amax = jnp.max(jnp.abs(blocks), axis=axis + 1, keepdims=True)
    exponent = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / FORMAT_MAX["float4"]))
    scale = jnp.exp2(exponent).astype(E8M0)
    return (blocks / scale.astype(jnp.float32)).astype(E2M1), scale


def quantize_blocks(x, axis: int, move: tuple[NamedSharding, NamedSharding] | None = None):
    """x rounded to block-scaled E2M1 and given back in x.dtype (the operand the dot
    reads: the tensor core applies the block scales); the rounding is one cast kernel on
    GPUs (sharding/kernel_scopes.py).

    `move`: (where x is, where the matmul reads it), when they differ (sequence
    parallelism's gathered positions): the E2M1 values and their scales are rounded where
    x is and moved, not x widened back first, as Transformer Engine all-gathers NVFP4
    data (distributed.py's _all_gather_nvfp4: half a byte a value, and its block's
    scale)."""
    with jax.named_scope(kernel_scopes.QUANTIZE):
        q, scale = quantize_blocks_raw(x, axis)
    return dequantize_blocks(q, scale, axis, x.dtype, move)


def dequantize_blocks(q, scale, axis: int, dtype,
                      move: tuple[NamedSharding, NamedSharding] | None = None):
    """The operand a dot reads from `quantize_blocks_raw(x, axis)`'s values and scales, in
    `dtype` and x's shape, the values and scales moved as `quantize_blocks` says."""
    ndim = q.ndim - 1
    axis = axis % ndim
    if move is not None:
        for sharding in move:
            spec = (*sharding.spec, *(None,) * (ndim - len(sharding.spec)))
            blocked = NamedSharding(sharding.mesh, PartitionSpec(
                *spec[:axis + 1], None, *spec[axis + 1:]))  # a block's 32 values: unsplit
            q = jax.lax.with_sharding_constraint(q, blocked)
            scale = jax.lax.with_sharding_constraint(scale, blocked)
    shape = (*q.shape[:axis], q.shape[axis] * q.shape[axis + 1], *q.shape[axis + 2:])
    return (q.astype(dtype) * scale.astype(dtype)).reshape(shape)


def _block_axis(spec: str, operand: int, shape) -> int:
    """An operand's block axis: the last dimension the einsum contracts whose size the
    block divides (else the last contracted one, which then raises)."""
    inputs, out = spec.split("->")
    a, b = inputs.split(",")
    mine, other = (a, b) if operand == 0 else (b, a)
    axes = [i for i, c in enumerate(mine) if c in other and c not in out]
    fits = [i for i in axes if shape[i] % MX_BLOCK == 0]
    return (fits or axes)[-1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def fp4_einsum(spec: str, x, w, layouts: tuple = (None, None)):
    """`jnp.einsum(spec, x, w)` with both operands in block-scaled FP4. `layouts`: for x
    and for the output's gradient, (where it is, where the matmuls read it) when they
    differ (`quantize_blocks`; resolved in the forward pass, for both), else None."""
    return _fp4_fwd(spec, x, w, layouts)[0]


def _fp4_fwd(spec, x, w, layouts):
    xq = quantize_blocks(x, _block_axis(spec, 0, x.shape), layouts[0])
    wq = quantize_blocks(w, _block_axis(spec, 1, w.shape))
    y = jnp.einsum(spec, xq, wq, preferred_element_type=x.dtype)  # as FP8's (`_fwd`)
    # The weight gradient's input is kept quantised, in blocks along its own contraction
    # (the tokens): Transformer Engine saves its column-wise NVFP4 data, half a byte a value
    # and its block's scale, not the bf16 input (and gathers it under sequence
    # parallelism in the backward, as here).
    with jax.named_scope(kernel_scopes.QUANTIZE):
        x_cols = quantize_blocks_raw(x, _block_axis(_transposed(spec)[1], 0, x.shape))
    return y, (x_cols, w, jnp.zeros((0, *x.shape), x.dtype))  # (x's shape and dtype)


def _fp4_bwd(spec, layouts, residuals, dy):
    (x_values, x_scales), w, x_like = residuals
    x_shape, x_dtype = x_like.shape[1:], x_like.dtype
    x_layout, dy_layout = layouts
    dx_spec, dw_spec = _transposed(spec)
    dy = dy.astype(x_dtype)
    # The output's gradient in two roundings, blocks along each matmul's own contraction
    # (Transformer Engine's row-wise and column-wise NVFP4 data, both gathered).
    dx = jnp.einsum(dx_spec, quantize_blocks(dy, _block_axis(dx_spec, 0, dy.shape), dy_layout),
                    quantize_blocks(w, _block_axis(dx_spec, 1, w.shape)),
                    preferred_element_type=x_dtype)
    x_axis = _block_axis(dw_spec, 0, x_shape)
    dw = jnp.einsum(dw_spec, dequantize_blocks(x_values, x_scales, x_axis, x_dtype, x_layout),
                    quantize_blocks(dy, _block_axis(dw_spec, 1, dy.shape), dy_layout),
                    preferred_element_type=w.dtype)  # reduced in the weight's dtype (FP8's)
    return dx.astype(x_dtype), dw


fp4_einsum.defvjp(_fp4_fwd, _fp4_bwd)
