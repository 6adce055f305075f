"""Causal attention: dense (scores materialised) and flash (block-wise, recomputed backward).

Every production stack trains with a fused flash-attention kernel: the S x S scores live in
on-chip memory, never in HBM, and the backward pass recomputes them from the saved
log-sum-exp. `flash_attention` is that algorithm in plain JAX so that XLA compiles (and the
explorer counts) the same FLOPs and residuals:

- queries are split into static blocks; block i attends only to keys [0, (i+1) * block),
  so the causal half is skipped as a real kernel skips masked tiles;
- the forward pass saves only the output and the log-sum-exp (custom_vjp);
- the backward pass recomputes each block's probabilities.

Its ops run under the named scope `flash_attention`; the cost model treats the
intermediates inside that scope as on-chip (see sharding/traffic.py).

Suffixes (legend in models/__init__.py): B batch, L query positions, S key positions, K kv
heads, G query heads per kv head, E head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sharding.traffic import FUSED_KERNEL_SCOPE as FLASH_SCOPE


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


def _block_scores(q_BLKGE, k_BSKE, i: int, bq: int, causal: bool = True):
    """Scaled f32 scores of query block i: causally masked against keys [0, (i+1) bq), or
    against every key when not `causal`."""
    e = q_BLKGE.shape[-1]
    end = (i + 1) * bq if causal else k_BSKE.shape[1]
    q_blk = q_BLKGE[:, i * bq:(i + 1) * bq]
    s_BKGLS = jnp.einsum("blkge,bske->bkgls", q_blk, k_BSKE[:, :end]).astype(jnp.float32)
    s_BKGLS = s_BKGLS * (e**-0.5)
    if not causal:
        return s_BKGLS
    rows = jnp.arange(bq)[:, None] + i * bq
    cols = jnp.arange(end)[None, :]
    return jnp.where(cols <= rows, s_BKGLS, -1e30)


def _key_end(i: int, bq: int, seq_k: int, causal: bool) -> int:
    return (i + 1) * bq if causal else seq_k


def _forward(q_BLKGE, k_BSKE, v_BSKE, bq: int, causal: bool = True):
    nq = q_BLKGE.shape[1] // bq
    outs, lses = [], []
    for i in range(nq):
        end = _key_end(i, bq, k_BSKE.shape[1], causal)
        s_BKGLS = _block_scores(q_BLKGE, k_BSKE, i, bq, causal)
        m_BKGL = jnp.max(s_BKGLS, axis=-1)
        p_BKGLS = jnp.exp(s_BKGLS - m_BKGL[..., None])
        l_BKGL = jnp.sum(p_BKGLS, axis=-1)
        o_BLKGE = jnp.einsum("bkgls,bske->blkge", p_BKGLS.astype(v_BSKE.dtype),
                             v_BSKE[:, :end]).astype(jnp.float32)
        o_BLKGE = o_BLKGE / jnp.moveaxis(l_BKGL, 3, 1)[..., None]
        outs.append(o_BLKGE.astype(q_BLKGE.dtype))
        lses.append(m_BKGL + jnp.log(l_BKGL))
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=-1)


def _backward(q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL, do_BLKGE, dlse_BKGL, bq: int,
              causal: bool):
    """Gradients of (o, lse) = attention(q, k, v), recomputing each block's probabilities.
    With p = softmax(s): ds = p (dp - delta + dlse), delta = rowsum(do * o)."""
    e = q_BLKGE.shape[-1]
    scale = e**-0.5
    nq = q_BLKGE.shape[1] // bq
    delta_BKGL = jnp.einsum("blkge,blkge->bkgl", do_BLKGE.astype(jnp.float32),
                            o_BLKGE.astype(jnp.float32)) - dlse_BKGL
    dq_blocks = []
    dk_BSKE = jnp.zeros(k_BSKE.shape, jnp.float32)
    dv_BSKE = jnp.zeros(v_BSKE.shape, jnp.float32)
    for i in range(nq):
        lo = i * bq
        end = _key_end(i, bq, k_BSKE.shape[1], causal)
        s_BKGLS = _block_scores(q_BLKGE, k_BSKE, i, bq, causal)
        p_BKGLS = jnp.exp(s_BKGLS - lse_BKGL[..., lo:lo + bq, None])
        do_blk = do_BLKGE[:, lo:lo + bq]
        dv_blk = jnp.einsum("bkgls,blkge->bske", p_BKGLS.astype(do_blk.dtype), do_blk)
        dp_BKGLS = jnp.einsum("blkge,bske->bkgls", do_blk, v_BSKE[:, :end]).astype(jnp.float32)
        ds_BKGLS = (p_BKGLS * (dp_BKGLS - delta_BKGL[..., lo:lo + bq, None]) * scale)
        ds_BKGLS = ds_BKGLS.astype(q_BLKGE.dtype)
        dq_blocks.append(jnp.einsum("bkgls,bske->blkge", ds_BKGLS, k_BSKE[:, :end]))
        dk_blk = jnp.einsum("bkgls,blkge->bske", ds_BKGLS, q_BLKGE[:, lo:lo + bq])
        dk_BSKE = dk_BSKE.at[:, :end].add(dk_blk.astype(jnp.float32))
        dv_BSKE = dv_BSKE.at[:, :end].add(dv_blk.astype(jnp.float32))
    dq_BLKGE = jnp.concatenate(dq_blocks, axis=1).astype(q_BLKGE.dtype)
    return dq_BLKGE, dk_BSKE.astype(k_BSKE.dtype), dv_BSKE.astype(v_BSKE.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BLKGE, k_BSKE, v_BSKE, bq):
    return _forward(q_BLKGE, k_BSKE, v_BSKE, bq)[0]


def _flash_fwd(q_BLKGE, k_BSKE, v_BSKE, bq):
    o_BLKGE, lse_BKGL = _forward(q_BLKGE, k_BSKE, v_BSKE, bq)
    return o_BLKGE, (q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL)


def _flash_bwd(bq, residuals, do_BLKGE):
    q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL = residuals
    return _backward(q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL, do_BLKGE,
                     jnp.zeros_like(lse_BKGL), bq, True)


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash_lse(q_BLKGE, k_BSKE, v_BSKE, bq, causal):
    return _forward(q_BLKGE, k_BSKE, v_BSKE, bq, causal)


def _flash_lse_fwd(q_BLKGE, k_BSKE, v_BSKE, bq, causal):
    o_BLKGE, lse_BKGL = _forward(q_BLKGE, k_BSKE, v_BSKE, bq, causal)
    return (o_BLKGE, lse_BKGL), (q_BLKGE, k_BSKE, v_BSKE, o_BLKGE, lse_BKGL)


def _flash_lse_bwd(bq, causal, residuals, cotangents):
    do_BLKGE, dlse_BKGL = cotangents
    return _backward(*residuals, do_BLKGE, dlse_BKGL, bq, causal)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def flash_block(q_BLKGE, k_BSKE, v_BSKE, *, causal: bool, block: int = 512):
    """One block of a larger attention (context parallelism): (output, log-sum-exp (B, K,
    G, L) in f32) of q against k, v -- causal when they are the same positions, full when
    every key precedes every query -- for combining with other blocks' results."""
    bq = block_size(q_BLKGE.shape[1], block)
    with jax.named_scope(FLASH_SCOPE):
        return _flash_lse(q_BLKGE, k_BSKE, v_BSKE, bq, causal)


def flash_attention(q_BLKGE, k_BSKE, v_BSKE, *, block: int = 512):
    """Causal attention, block-wise with a recomputing backward pass (see module doc)."""
    bq = block_size(q_BLKGE.shape[1], block)
    with jax.named_scope(FLASH_SCOPE):
        return _flash(q_BLKGE, k_BSKE, v_BSKE, bq)
