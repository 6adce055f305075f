"""Causal attention: dense (scores materialised) and flash (block-wise, recomputed backward).

Every production stack trains with a fused flash-attention kernel: the S x S scores live in
on-chip memory, never in HBM, and the backward pass recomputes them from the saved
log-sum-exp. `flash_attention` is that algorithm in plain JAX so that XLA compiles (and the
explorer counts) the same FLOPs and residuals:

- queries and keys are split into static blocks, and loops run over the tiles (query
  block i, key block j) with j <= i: the causal half is skipped as a real kernel skips
  masked tiles, and only the diagonal tiles (a loop of their own) are masked;
- the forward pass keeps a running max and sum per query (the online softmax) and saves
  only the output and the log-sum-exp (custom_vjp);
- the backward pass recomputes each tile's probabilities.
Being a loop, one tile's scores exist at a time, as in a kernel's on-chip memory: XLA
cannot schedule every block's scores at once (the TPU compiler held 14 GB of them for a
Llama 3 8B layer at 8192 tokens when the blocks were unrolled).

Its ops run under the named scope `flash_attention`; the cost model treats the
intermediates inside that scope as on-chip (see sharding/traffic.py). Run for real (`shardscope
measure`), XLA compiles the loops into kernels of their own, each tile's scores written to and
read from HBM: under `as_kernels("tiled")` the same ops run under `attention_tiles`, which the
cost model counts as the kernels they are (model.attention = "tiled").

Suffixes (legend in models/__init__.py): B batch, L query positions, S key positions, K kv
heads, G query heads per kv head, E head_dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sharding.traffic import FUSED_KERNEL_SCOPE as FLASH_SCOPE

TILES_SCOPE = "attention_tiles"
_SCOPE = contextvars.ContextVar("flash_scope", default=FLASH_SCOPE)


@contextlib.contextmanager
def as_kernels(kind: str):
    """Flash attention traced inside runs as `kind` says (model.attention): "tiled", the
    XLA kernels its loops compile to (scores through HBM); else a fused kernel."""
    token = _SCOPE.set(TILES_SCOPE if kind == "tiled" else FLASH_SCOPE)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def dense_attention(q_BLKGE, k_BSKE, v_BSKE):
    e = q_BLKGE.shape[-1]
    seq = q_BLKGE.shape[1]
    scores_BKGLS = jnp.einsum("blkge,bske->bkgls", q_BLKGE, k_BSKE) * (e**-0.5)
    causal_LS = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores_BKGLS = jnp.where(causal_LS, scores_BKGLS.astype(jnp.float32), -1e30)
    probs_BKGLS = jax.nn.softmax(scores_BKGLS, axis=-1).astype(q_BLKGE.dtype)
    return jnp.einsum("bkgls,bske->blkge", probs_BKGLS, v_BSKE)


def block_size(seq: int, preferred: int = 512) -> int:
    """Largest divisor of seq not above `preferred` (a whole number of blocks)."""
    for b in range(min(seq, preferred), 0, -1):
        if seq % b == 0:
            return b
    return seq


def _tiles(nq: int, nk: int, causal: bool) -> list[tuple[np.ndarray, bool]]:
    """(query block, key block) of every tile computed, each (tiles, 2), with whether its
    tiles are masked: when causal, the diagonal (masked) and the tiles below it (a kernel
    skips the masked half above); otherwise every pair, unmasked. Two loops rather than one
    whose mask depends on the tile: autodiff's remat would stack that mask per tile."""
    def pairs(ij):
        return np.array(ij, dtype=np.int32).reshape(-1, 2)
    if not causal:
        return [(pairs([(i, j) for i in range(nq) for j in range(nk)]), False)]
    below = pairs([(i, j) for i in range(nq) for j in range(i)])
    return [(pairs([(i, i) for i in range(nq)]), True)] + ([(below, False)] if len(below) else [])


def _tile_scores(q_BLKGE, k_BSKE, i, j, bq: int, bk: int, masked: bool):
    """Scaled f32 scores of query block i against key block j (traced indices), causally
    masked when the tile is on the diagonal."""
    e = q_BLKGE.shape[-1]
    q_blk = lax.dynamic_slice_in_dim(q_BLKGE, i * bq, bq, axis=1)
    k_blk = lax.dynamic_slice_in_dim(k_BSKE, j * bk, bk, axis=1)
    s_BKGLS = jnp.einsum("blkge,bske->bkgls", q_blk, k_blk).astype(jnp.float32) * (e**-0.5)
    if not masked:
        return s_BKGLS
    return jnp.where(jnp.tril(jnp.ones((bq, bk), dtype=bool)), s_BKGLS, -1e30)


def _at(x, start, size: int, axis: int):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _add_at(acc, update, start, axis: int):
    """acc with `update` added to its slice at `start` along `axis` (in place in a loop)."""
    return lax.dynamic_update_slice_in_dim(
        acc, _at(acc, start, update.shape[axis], axis) + update.astype(acc.dtype), start, axis)


def _forward(q_BLKGE, k_BSKE, v_BSKE, bq: int, bk: int, causal: bool = True):
    """(output, f32 log-sum-exp (B, K, G, L)), one tile at a time with the online softmax:
    a loop over the tiles, so that one tile's scores exist at a time."""
    b, seq, kh, g, e = q_BLKGE.shape
    # the output has the values' head width (MLA's is narrower than its queries' and keys')
    o_BLKGE = jnp.zeros((b, seq, kh, g, v_BSKE.shape[-1]), jnp.float32)
    m_BKGL = jnp.full((b, kh, g, seq), -1e30, jnp.float32)
    l_BKGL = jnp.zeros((b, kh, g, seq), jnp.float32)

    def tile(masked, carry, ij):
        o_BLKGE, m_BKGL, l_BKGL = carry
        i, j = ij[0], ij[1]
        s_BKGLS = _tile_scores(q_BLKGE, k_BSKE, i, j, bq, bk, masked)
        m_blk, l_blk = _at(m_BKGL, i * bq, bq, 3), _at(l_BKGL, i * bq, bq, 3)
        m_new = jnp.maximum(m_blk, jnp.max(s_BKGLS, axis=-1))
        p_BKGLS = jnp.exp(s_BKGLS - m_new[..., None])
        alpha_BKGL = jnp.exp(m_blk - m_new)
        pv_BLKGE = jnp.einsum("bkgls,bske->blkge", p_BKGLS.astype(v_BSKE.dtype),
                              _at(v_BSKE, j * bk, bk, 1)).astype(jnp.float32)
        o_blk = _at(o_BLKGE, i * bq, bq, 1) * jnp.moveaxis(alpha_BKGL, 3, 1)[..., None]
        o_BLKGE = lax.dynamic_update_slice_in_dim(o_BLKGE, o_blk + pv_BLKGE, i * bq, 1)
        m_BKGL = lax.dynamic_update_slice_in_dim(m_BKGL, m_new, i * bq, 3)
        l_BKGL = lax.dynamic_update_slice_in_dim(
            l_BKGL, l_blk * alpha_BKGL + jnp.sum(p_BKGLS, axis=-1), i * bq, 3)
        return (o_BLKGE, m_BKGL, l_BKGL), None

    carry = (o_BLKGE, m_BKGL, l_BKGL)
    for tiles, masked in _tiles(seq // bq, k_BSKE.shape[1] // bk, causal):
        carry, _ = lax.scan(functools.partial(tile, masked), carry, tiles)
    o_BLKGE, m_BKGL, l_BKGL = carry
    o_BLKGE = o_BLKGE / jnp.moveaxis(l_BKGL, 3, 1)[..., None]
    return o_BLKGE.astype(v_BSKE.dtype), m_BKGL + jnp.log(l_BKGL)


def _backward(q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL, do_BLKGE, dlse_BKGL, bq: int,
              bk: int, causal: bool):
    """Gradients of (o, lse) = attention(q, k, v), recomputing each tile's probabilities.
    With p = softmax(s): ds = p (dp - delta + dlse), delta = rowsum(do * o)."""
    scale = q_BLKGE.shape[-1]**-0.5
    delta_BKGL = jnp.einsum("blkge,blkge->bkgl", do_BLKGE.astype(jnp.float32),
                            o_BLKGE.astype(jnp.float32)) - dlse_BKGL
    grads = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q_BLKGE, k_BSKE, v_BSKE))

    def tile(masked, carry, ij):
        dq_BLKGE, dk_BSKE, dv_BSKE = carry
        i, j = ij[0], ij[1]
        s_BKGLS = _tile_scores(q_BLKGE, k_BSKE, i, j, bq, bk, masked)
        p_BKGLS = jnp.exp(s_BKGLS - _at(lse_BKGL, i * bq, bq, 3)[..., None])
        do_blk, q_blk = _at(do_BLKGE, i * bq, bq, 1), _at(q_BLKGE, i * bq, bq, 1)
        k_blk, v_blk = _at(k_BSKE, j * bk, bk, 1), _at(v_BSKE, j * bk, bk, 1)
        dv_blk = jnp.einsum("bkgls,blkge->bske", p_BKGLS.astype(do_blk.dtype), do_blk)
        dp_BKGLS = jnp.einsum("blkge,bske->bkgls", do_blk, v_blk).astype(jnp.float32)
        ds_BKGLS = p_BKGLS * (dp_BKGLS - _at(delta_BKGL, i * bq, bq, 3)[..., None]) * scale
        ds_BKGLS = ds_BKGLS.astype(q_BLKGE.dtype)
        dq_BLKGE = _add_at(dq_BLKGE, jnp.einsum("bkgls,bske->blkge", ds_BKGLS, k_blk),
                           i * bq, 1)
        dk_BSKE = _add_at(dk_BSKE, jnp.einsum("bkgls,blkge->bske", ds_BKGLS, q_blk),
                          j * bk, 1)
        dv_BSKE = _add_at(dv_BSKE, dv_blk, j * bk, 1)
        return (dq_BLKGE, dk_BSKE, dv_BSKE), None

    for tiles, masked in _tiles(q_BLKGE.shape[1] // bq, k_BSKE.shape[1] // bk, causal):
        grads, _ = lax.scan(functools.partial(tile, masked), grads, tiles)
    dq, dk, dv = grads
    return dq.astype(q_BLKGE.dtype), dk.astype(k_BSKE.dtype), dv.astype(v_BSKE.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BLKGE, k_BSKE, v_BSKE, bq):
    return _forward(q_BLKGE, k_BSKE, v_BSKE, bq, bq)[0]


def _flash_fwd(q_BLKGE, k_BSKE, v_BSKE, bq):
    o_BLKGE, lse_BKGL = _forward(q_BLKGE, k_BSKE, v_BSKE, bq, bq)
    return o_BLKGE, (q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL)


def _flash_bwd(bq, residuals, do_BLKGE):
    q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL = residuals
    return _backward(q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL, do_BLKGE,
                     jnp.zeros_like(lse_BKGL), bq, bq, True)


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _flash_lse(q_BLKGE, k_BSKE, v_BSKE, bq, bk, causal):
    return _forward(q_BLKGE, k_BSKE, v_BSKE, bq, bk, causal)


def _flash_lse_fwd(q_BLKGE, k_BSKE, v_BSKE, bq, bk, causal):
    o_BLKGE, lse_BKGL = _forward(q_BLKGE, k_BSKE, v_BSKE, bq, bk, causal)
    return (o_BLKGE, lse_BKGL), (q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL)


def _flash_lse_bwd(bq, bk, causal, residuals, cotangents):
    do_BLKGE, dlse_BKGL = cotangents
    return _backward(*residuals, do_BLKGE, dlse_BKGL, bq, bk, causal)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def flash_block(q_BLKGE, k_BSKE, v_BSKE, *, causal: bool, block: int = 512):
    """One block of a larger attention (context parallelism): (output, log-sum-exp (B, K,
    G, L) in f32) of q against k, v -- causal when they are the same positions, full when
    every key precedes every query -- for combining with other blocks' results."""
    bq, bk = block_size(q_BLKGE.shape[1], block), block_size(k_BSKE.shape[1], block)
    if causal and (q_BLKGE.shape[1] != k_BSKE.shape[1]):
        raise ValueError(f"causal attention needs as many queries as keys, got "
                         f"{q_BLKGE.shape[1]} and {k_BSKE.shape[1]}")
    with jax.named_scope(_SCOPE.get()):
        return _flash_lse(q_BLKGE, k_BSKE, v_BSKE, bq, bk, causal)


def flash_attention(q_BLKGE, k_BSKE, v_BSKE, *, block: int = 512):
    """Causal attention, block-wise with a recomputing backward pass (see module doc)."""
    bq = block_size(q_BLKGE.shape[1], block)
    with jax.named_scope(_SCOPE.get()):
        return _flash(q_BLKGE, k_BSKE, v_BSKE, bq)
