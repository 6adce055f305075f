"""Context parallelism: causal attention over a sequence split across a mesh axis (the
`sequence` axis under the default rules), as Megatron / Transformer Engine run it.

Load balance (zigzag): the sequence is cut into 2Y chunks of l = L / 2Y positions and
context rank i holds chunks i and 2Y - 1 - i, so every rank has the same share of the
causal work. The model puts its tokens in that order once, at the embedding
(`zigzag_order`), and the loss compares against targets in the same order.

Each rank's queries (two halves a, b) meet every rank's keys and values (halves a', b')
in Y steps. Step 0 is its own: a x a' and b x b' causal, b x a' full. At step r it holds
rank j = (i - r) mod Y's: b x a' is always needed; the other needed block is a x a' when
j < i and b x b' when j > i -- one full l x l block either way, so every rank does the same
work at every step (SPMD: the two cases are selected, not branched). Blocks combine by
their log-sum-exp (online softmax).

Where the other ranks' keys and values come from (`[parallelism] context_mode`):
- "ring": passed one rank on at each step with a collective-permute (K and V, Y - 1 steps;
  their gradients travel back the same way), overlapping the block computation;
- "allgather": gathered once per layer (their gradients reduce-scattered back).

Like the pipeline (models/pipeline.py) this is plain SPMD -- a vmap over the context ranks
with `spmd_axis_name`, and rolls over the rank dimension -- so XLA compiles one fused
exchange per step instead of splitting the attention into per-block collectives.

Suffixes (models/__init__.py): Y context-parallel ranks, Z the two zigzag halves, l one
chunk's positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from models.attention import flash_block
from models.pipeline import shift_stages
from sharding.rules import active_mesh, active_rules, mesh_shape_of, resolve

MODES = ("ring", "allgather")


@dataclasses.dataclass(frozen=True)
class RankCopies:
    """A layer weight held as one copy per rank of mesh `axes` (`ranks` of them; 1: none):
    models/layers.per_context_rank uses such copies."""

    axes: tuple[str, ...] = ()
    ranks: int = 1


def rank_copies(cfg, rules, mesh_shape):
    """path -> RankCopies of each parameter of a dense model whose positions are split
    (context parallelism), else None.

    The context-parallel ranks' weight gradients are partial sums. Summed where SPMD
    puts them, at every use of a weight, a step with several microbatches or pipeline
    ticks sums them every time; Megatron sums them once per step, with the data-parallel
    ones (one reduce-scatter over data x context for its distributed optimizer). With a
    copy of each layer weight per rank, made where the step makes the data-parallel
    replicas' (models/train.py), they are summed there, once. A norm's vector works on
    the residual stream, which sequence parallelism splits over `tensor` too. (A mixture
    of experts' weights meet regrouped tokens: no copies.) Weights split over the
    context-parallel ranks themselves (MaxText's rules) have no copies either: like FSDP's,
    they are gathered at each use and their gradients reduce-scattered there."""
    seq_axes = set(rules.split_axes("seq", mesh_shape))
    weight_axes = {a for axes in rules.params.values() for a in axes}
    if cfg.n_experts > 1 or not seq_axes or seq_axes & weight_axes:
        return None

    def of(path) -> RankCopies:
        keys = [str(getattr(k, "key", k)) for k in path]
        if keys[0] != "blocks":
            return RankCopies()
        logical = "residual_seq" if any("norm" in k for k in keys) else "seq"
        return RankCopies(rules.split_axes(logical, mesh_shape), rules.ways(logical, mesh_shape))

    return of


def zigzag_order(seq: int, ranks: int) -> np.ndarray:
    """The positions in the order the ranks hold them: rank i has chunks i and 2Y-1-i."""
    chunk = seq // (2 * ranks)
    parts = []
    for i in range(ranks):
        parts += [np.arange(i * chunk, (i + 1) * chunk),
                  np.arange((2 * ranks - 1 - i) * chunk, (2 * ranks - i) * chunk)]
    return np.concatenate(parts)


def _merge(o1_BlKGE, lse1_BKGl, o2_BlKGE, lse2_BKGl):
    """Two partial attention results over disjoint keys, combined by their log-sum-exp."""
    lse_BKGl = jnp.logaddexp(lse1_BKGl, lse2_BKGl)

    def weight(lse_BKGl_part):
        return jnp.moveaxis(jnp.exp(lse_BKGl_part - lse_BKGl), 3, 1)[..., None]

    o_BlKGE = (o1_BlKGE.astype(jnp.float32) * weight(lse1_BKGl)
               + o2_BlKGE.astype(jnp.float32) * weight(lse2_BKGl))
    return o_BlKGE, lse_BKGl


def _rank_attention(q_BZlKGE, rank, kv_steps, ranks: int):
    """One rank's attention over all `ranks` ranks' keys and values: `kv_steps[r]` gives
    the (k, v) halves (B, Z, l, K, E) it holds at step r."""
    qa, qb = q_BZlKGE[:, 0], q_BZlKGE[:, 1]
    k_BZlKE, v_BZlKE = kv_steps[0]
    o_a, l_a = flash_block(qa, k_BZlKE[:, 0], v_BZlKE[:, 0], causal=True)
    o_b, l_b = _merge(*flash_block(qb, k_BZlKE[:, 0], v_BZlKE[:, 0], causal=False),
                      *flash_block(qb, k_BZlKE[:, 1], v_BZlKE[:, 1], causal=True))
    for r in range(1, ranks):
        k_BZlKE, v_BZlKE = kv_steps[r]
        before = (rank - r) % ranks < rank  # the keys' rank j precedes this one
        o_b, l_b = _merge(o_b, l_b, *flash_block(qb, k_BZlKE[:, 0], v_BZlKE[:, 0],
                                                 causal=False))
        half = jnp.where(before, 0, 1)
        q_sel = jnp.where(before, qa, qb)
        o2, l2 = flash_block(q_sel, jnp.take(k_BZlKE, half, axis=1),
                             jnp.take(v_BZlKE, half, axis=1), causal=False)
        merged_a, merged_b = _merge(o_a, l_a, o2, l2), _merge(o_b, l_b, o2, l2)
        o_a, l_a = (jnp.where(before, m, o) for m, o in zip(merged_a, (o_a, l_a)))
        o_b, l_b = (jnp.where(before, o, m) for m, o in zip(merged_b, (o_b, l_b)))
    return jnp.stack([o_a, o_b], axis=1).astype(q_BZlKGE.dtype)


class _Gathered:
    """Step r's keys and values of a rank, from the gathered (all ranks') arrays."""

    def __init__(self, k_BYZlKE, v_BYZlKE, rank, ranks):
        self.k, self.v, self.rank, self.ranks = k_BYZlKE, v_BYZlKE, rank, ranks

    def __getitem__(self, r):
        j = (self.rank - r) % self.ranks
        return (jax.lax.dynamic_index_in_dim(self.k, j, 1, keepdims=False),
                jax.lax.dynamic_index_in_dim(self.v, j, 1, keepdims=False))


def context_axis() -> dict:
    """The mesh, rules and the one mesh axis that split the positions (context_attention's
    keywords)."""
    mesh, rules = active_mesh(), active_rules()
    axes = rules.split_axes("seq", dict(mesh.shape))
    if len(axes) != 1:
        raise ValueError(f"context parallelism needs the rule of 'seq' to name one mesh axis "
                         f"of size > 1; it names {axes}")
    return {"mesh": mesh, "rules": rules, "axis": axes[0]}


def context_attention(q_BLKGE, k_BLKE, v_BLKE, *, mode: str, mesh, rules, axis: str):
    """Causal attention of zigzag-ordered q, k, v whose positions are split over mesh axis
    `axis` (see the module doc); returns (B, L, K, G, E) in the same order and sharding."""
    if mode not in MODES:
        raise ValueError(f"parallelism.context_mode={mode!r} is not one of {MODES}")
    ranks = mesh_shape_of(mesh)[axis]
    b, seq, kv, g, e = q_BLKGE.shape
    chunk = seq // (2 * ranks)
    shape = dict(mesh.shape)

    def pin(x, names):
        spec = resolve(names, x.shape, rules.activations, shape, what=f"context {names}")
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    q_BYZlKGE = pin(q_BLKGE.reshape(b, ranks, 2, chunk, kv, g, e),
                    ("batch", "seq", None, None, "kv_heads", None, None))
    kv_names = ("batch", "seq", None, None, "kv_heads", None)
    k_BYZlKE = pin(k_BLKE.reshape(b, ranks, 2, chunk, kv, e), kv_names)
    v_BYZlKE = pin(v_BLKE.reshape(b, ranks, 2, chunk, kv, v_BLKE.shape[-1]), kv_names)
    rank_Y = jnp.arange(ranks)
    if mode == "ring":
        steps = [(k_BYZlKE, v_BYZlKE)]
        for _ in range(1, ranks):
            k_prev, v_prev = steps[-1]
            steps.append((pin(shift_stages(k_prev, 1), kv_names),
                          pin(shift_stages(v_prev, 1), kv_names)))
        out = jax.vmap(lambda q, i, st: _rank_attention(q, i, st, ranks), in_axes=(1, 0, 1),
                       out_axes=1, spmd_axis_name=axis)(q_BYZlKGE, rank_Y, steps)
    else:
        # Gathered once, then one copy per rank (each device keeps its own), so that the
        # gradients of all steps add up on the device and are summed over the ranks once.
        gathered = ("batch", None, None, None, "kv_heads", None)
        per_rank = ("seq", "batch", None, None, None, "kv_heads", None)

        @jax.custom_vjp
        def each_rank(x_BYZlKE):
            x_BYZlKE = pin(x_BYZlKE, gathered)
            return pin(jnp.broadcast_to(x_BYZlKE[None], (ranks, *x_BYZlKE.shape)), per_rank)

        def each_rank_bwd(_, dx_RBYZlKE):
            # The ranks' gradients of the gathered keys (values) summed straight into each
            # rank's own part: a reduce-scatter, as Llama 3's all-gather context
            # parallelism reduces them. Summed whole, then sliced (the transpose of the
            # gather's sharding), it was an all-reduce: twice the bytes. In the gradient's
            # dtype (jnp.sum would widen bf16).
            dx_BYZlKE = jax.lax.reduce(dx_RBYZlKE, jnp.zeros((), dx_RBYZlKE.dtype),
                                       jax.lax.add, (0,))
            return (pin(dx_BYZlKE, kv_names),)

        each_rank.defvjp(lambda x: (each_rank(x), None), each_rank_bwd)

        k_all, v_all = each_rank(k_BYZlKE), each_rank(v_BYZlKE)
        out = jax.vmap(lambda q, i, k, v: _rank_attention(q, i, _Gathered(k, v, i, ranks),
                                                          ranks),
                       in_axes=(1, 0, 0, 0), out_axes=1, spmd_axis_name=axis)(
            q_BYZlKGE, rank_Y, k_all, v_all)
    out = pin(out, ("batch", "seq", None, None, "kv_heads", None, None))
    return out.reshape(b, seq, kv, g, v_BLKE.shape[-1])
