"""Quantised storage for serving: weights and KV cache in int8, float8 (e4m3) or int4.

Weight-only quantisation as serving stacks run it (TensorRT-LLM W8A16/W4A16, AQT, vLLM):
each weight matrix is stored in the narrow type with one scale per output channel (the
scale spans the contracted dimensions); at use the matmul's operand is `q x scale` in the
activations' dtype. The target compilers fuse that dequantisation into the matmul's
operand load (XLA:GPU's Triton GEMM fusion, the TPU's operand fusion), so a decode step
reads the narrow bytes; sharding/compute.py counts it that way.

The KV cache stores keys and values in the narrow type with one scale per (position, kv
head) -- 2 bytes per head_dim values -- written when a position is produced and applied
when attention reads the cache.

The token embedding stays in the parameter dtype: a lookup reads only the rows of the
batch's tokens, so its storage costs memory but almost no bandwidth.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

STORAGE_DTYPES = {
    "int8": jnp.int8,
    "float8": jnp.float8_e4m3fn,
    "int4": jnp.int4,
}
# The largest magnitude each format holds: symmetric int8 and int4 (127, 7); FP8 e4m3 448
# and FP4 e2m1 6.0 (OCP 8-bit floating point and microscaling format specifications).
FORMAT_MAX = {"int8": 127.0, "float8": 448.0, "int4": 7.0, "float4": 6.0}
SCALE_DTYPE = jnp.bfloat16


def quantize(x, kind: str, axes: tuple[int, ...] | None = None, *, scale_dtype=SCALE_DTYPE):
    """(x in `kind` storage, its scale) with x ~ q x scale: one scale per slice over `axes`
    (kept as size-1 dimensions), or one scalar scale for the whole tensor when `axes` is
    None (FP8 training's per-tensor scaling). Integers are rounded to nearest."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=axes is not None)
    scale = jnp.maximum(amax, 1e-12) / FORMAT_MAX[kind]
    q = x.astype(jnp.float32) / scale
    if kind.startswith("int"):
        q = jnp.round(q)
    return q.astype(STORAGE_DTYPES[kind]), scale.astype(scale_dtype)


def dequantize(q, scale, dtype):
    return q.astype(dtype) * scale.astype(dtype)


class QuantWeight(nnx.Module):
    """A weight stored as (q, scale); `w[...]` gives it back in bfloat16, like a Param.

    `contract`: how many leading dimensions the weight's matmul contracts (the scale
    spans them); `expert_dims` leading dimensions (stacked experts) come before them.
    """

    def __init__(self, value, axes, kind: str, *, contract: int = 1, expert_dims: int = 0):
        reduce = tuple(range(expert_dims, expert_dims + contract))
        q, scale = quantize(value, kind, reduce)
        scale_axes = tuple(None if i in reduce else a for i, a in enumerate(axes))
        self.q = nnx.Param(q, logical_axes=axes)
        self.scale = nnx.Param(scale, logical_axes=scale_axes)

    def __getitem__(self, index):
        return dequantize(self.q[index], self.scale[index], jnp.bfloat16)

    def split(self, dim: int, parts: int) -> QuantArrays:
        """The weight with dimension `dim` split into (parts, size / parts), its scale
        alongside (a dimension the scale spans, of size 1, splits into (1, 1))."""
        return QuantArrays(split_dim(self.q[...], dim, parts),
                           split_dim(self.scale[...], dim, parts))


@dataclasses.dataclass(frozen=True)
class QuantArrays:
    """A QuantWeight's (q, scale) as arrays (`QuantWeight.split`); `w[...]` dequantises."""

    q: jax.Array
    scale: jax.Array

    def __getitem__(self, index):
        return dequantize(self.q[index], self.scale[index], jnp.bfloat16)


def split_dim(x, dim: int, parts: int):
    """x with dimension `dim` split into (parts, size / parts); a size-1 dimension (where a
    scale spans it) into (1, 1)."""
    n = x.shape[dim]
    pieces = (1, 1) if n == 1 else (parts, n // parts)
    return x.reshape(*x.shape[:dim], *pieces, *x.shape[dim + 1:])


def split_weight(w, dim: int, parts: int):
    """A weight (a Param or a QuantWeight) with dimension `dim` split into (parts,
    size / parts): an array, or a QuantArrays."""
    return w.split(dim, parts) if isinstance(w, QuantWeight) else split_dim(w[...], dim, parts)

