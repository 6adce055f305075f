"""Mixture-of-experts MLP: a top-k router, experts sharded over the `expert` mesh axis, and
token dispatch and combine as all-to-alls (GShard / Switch / MaxText's "dense" MoE path).

Tokens are routed in routing groups of up to `moe_group_size` consecutive tokens of the
flattened (batch x sequence) stream; a group never spans the devices the batch is split over, so
dispatch within a group is local (GShard's groups). Training sequences are usually at
least a group long, so a group is part of one sequence and the routing does not depend on
the sharding; in decode (one token per sequence) a group is a device's share of the
batch. In each group every expert has `capacity` slots:

    capacity = ceil(capacity_factor x group_size x experts_per_token / n_experts)

Assignments claim slots in priority order, every token's first choice before any token's
second choice (GShard); an assignment that finds its expert full is dropped (its
contribution is zero and the residual carries the token on). `dropless = true` is
the dropless variant: every expert gets a slot for every token of the group, so nothing is
dropped, at the price of computing empty slots (static shapes cannot size each expert's
buffer to its load; grouped-GEMM kernels such as MegaBlocks or megablox do, and are not
modelled).

Dispatch is a gather into a (groups, experts, capacity, d_model) buffer, combine is a
gather back and the router-weighted sum over the k choices: index work, no matmul FLOPs,
as in Megatron's "drop and pad" dispatcher. The buffer's groups are sharded like the batch
(which includes the `expert` mesh axis, as in MaxText); moving the `expert` sharding from
the groups to the experts is an all-to-all, and so is the way back. Per MoE layer and
device the dispatch all-to-all moves local groups x experts x capacity x d_model elements,
i.e. tokens x experts_per_token x capacity_factor x d_model.

Shape suffixes (legend in models/__init__.py): R routing groups, T tokens in a group, X
experts, C capacity, A a token's expert choices (experts_per_token), D d_model, F expert
hidden.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.fp8 import MX_BLOCK
from models.layers import (
    Mlp,
    matmul_output,
    mlp_hidden,
    new_param,
    new_weight,
    project,
)
from models.program import DTYPES, Precision
from models.quant import split_weight
from sharding.rules import active_mesh, active_rules, constrain, mesh_shape_of


def capacity(cfg: ModelConfig, group_size: int) -> int:
    """Slots per expert in a group of `group_size` tokens."""
    if cfg.dropless:
        return group_size
    c = math.ceil(cfg.capacity_factor * group_size * cfg.experts_per_token / cfg.n_experts)
    return min(max(c, 1), group_size)


def routing_group_size(cfg: ModelConfig, local_tokens: int) -> int:
    """Tokens per routing group: the largest divisor of a device's `local_tokens` that is at
    most `moe_group_size`."""
    s = min(cfg.moe_group_size, local_tokens)
    while local_tokens % s:
        s -= 1
    return s


def _batch_ways() -> int:
    """Devices the batch is split over under the active rules (1 without rules)."""
    mesh, rules = active_mesh(), active_rules()
    return 1 if mesh is None else rules.ways("batch", mesh_shape_of(mesh))


def _top_k(x_RTX, k: int):
    """`jax.lax.top_k` over the last axis (the first index on ties) as k rounds of argmax:
    a reduction, which XLA's SPMD partitioner splits along any other dimension. Its TopK
    sort is not split along a vmapped dimension: inside the pipeline's vmap over stages
    (models/pipeline.py) every stage's router logits were gathered over `pipeline`."""
    values, indices = [], []
    for _ in range(k):
        i_RT = jnp.argmax(x_RTX, axis=-1)
        values.append(jnp.take_along_axis(x_RTX, i_RT[..., None], axis=-1)[..., 0])
        indices.append(i_RT)
        x_RTX = jnp.where(jax.nn.one_hot(i_RT, x_RTX.shape[-1], dtype=bool), -jnp.inf, x_RTX)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def route(cfg: ModelConfig, logits_RTX):
    """Top-k routing with capacity: (weights G,S,K; expert G,S,K; slot G,S,K; kept G,S,K).

    Router probabilities are a softmax over experts; the k chosen weights are renormalised
    to sum to one (Mixtral, Qwen3). `slot` is the assignment's place in its expert's buffer.
    """
    g, s, x = logits_RTX.shape
    k = cfg.experts_per_token
    probs_RTX = jax.nn.softmax(logits_RTX.astype(jnp.float32), axis=-1)
    weight_RTA, expert_RTA = _top_k(probs_RTX, k)
    weight_RTA = weight_RTA / jnp.sum(weight_RTA, axis=-1, keepdims=True)
    # Priority order: all first choices of the group, then all second choices, ...
    onehot_RATX = jax.nn.one_hot(jnp.swapaxes(expert_RTA, 1, 2), x, dtype=jnp.int32)
    seen_RATX = jnp.cumsum(onehot_RATX.reshape(g, k * s, x), axis=1).reshape(g, k, s, x)
    slot_RTA = jnp.swapaxes(jnp.sum((seen_RATX - 1) * onehot_RATX, axis=-1), 1, 2)
    kept_RTA = slot_RTA < capacity(cfg, s)
    return weight_RTA, expert_RTA, slot_RTA, kept_RTA


def _dispatch_indices(expert_RTA, slot_RTA, kept_RTA, n_experts: int, cap: int):
    """For every (group, expert, slot): the token in it, or S (a zero row) when empty."""
    g, s, k = expert_RTA.shape
    token_RTA = jnp.broadcast_to(jnp.arange(s)[None, :, None], (g, s, k))
    slot_RTA = jnp.where(kept_RTA, slot_RTA, cap)  # out of range: dropped by the scatter

    def one_group(expert_TA, slot_TA, token_TA):
        empty_XC = jnp.full((n_experts, cap), s, jnp.int32)
        return empty_XC.at[expert_TA, slot_TA].set(token_TA, mode="drop")

    return jax.vmap(one_group)(expert_RTA, slot_RTA, token_RTA)


def hidden_split(f: int, precision: Precision) -> int:
    """The ways tensor parallelism splits the experts' hidden dimension (F), when the
    weights and the activations split it over the same mesh axes and into whole pieces
    (FP4: whole blocks of 32); else 1."""
    mesh, rules = active_mesh(), active_rules()
    if mesh is None:
        return 1
    shape = mesh_shape_of(mesh)
    axes = rules.split_axes("mlp", shape)
    if not axes or axes != tuple(a for a in rules.mesh_axes("mlp", params=True)
                                 if shape.get(a, 1) > 1):
        return 1
    t = math.prod(shape[a] for a in axes)
    block = MX_BLOCK if precision.low_precision_matmuls == "float4" else 1
    return t if f % (t * block) == 0 else 1


def _choices(y_RXCD, flat_RTA):
    """Every token's k expert outputs gathered from the slots (an empty or dropped choice
    reads a zero row)."""
    g, n_x, cap, d = y_RXCD.shape
    slot_rows = jnp.concatenate([y_RXCD.reshape(g, n_x * cap, d),
                                 jnp.zeros((g, 1, d), y_RXCD.dtype)], axis=1)
    return jax.vmap(lambda rows, idx: rows[idx])(slot_rows, flat_RTA)


class MoeMlp(nnx.Module):
    """Routed experts (and `n_shared_experts` always-on experts, DeepSeek style)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, precision: Precision):
        d, f, x = cfg.d_model, cfg.d_ff, cfg.n_experts
        self.cfg = cfg
        self.kind = cfg.mlp
        self.precision = precision
        self.router = new_param(rngs, (d, x), ("embed", None), dtype=DTYPES[precision.params])
        if cfg.mlp == "swiglu":
            self.w_gate = new_weight(rngs, (x, d, f), ("experts", "embed", "mlp"),
                                     precision=precision, expert_dims=1)
        self.w_up = new_weight(rngs, (x, d, f), ("experts", "embed", "mlp"), precision=precision,
                               expert_dims=1)
        self.w_down = new_weight(rngs, (x, f, d), ("experts", "mlp", "embed"),
                                 precision=precision, expert_dims=1)
        if cfg.n_shared_experts:  # the dense MLP is the shared expert
            shared = dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * cfg.d_ff)
            self.shared = Mlp(shared, rngs=rngs, precision=precision)

    def __call__(self, x_BLD):
        cfg = self.cfg
        b, seq, d = x_BLD.shape
        s = routing_group_size(cfg, b * seq // _batch_ways())
        g, n_x, cap = b * seq // s, cfg.n_experts, capacity(cfg, s)
        x_RTD = constrain(x_BLD.reshape(g, s, d), ("batch", None, "embed"))
        with jax.named_scope("router"):
            # f32 logits from the activations' dtype, accumulated in f32 (as a GEMM with an
            # f32 output does): casting the weight to f32 wrote an f32 copy of it every step
            # (DeepSeek-V3's 58 routers: 0.7 GB a decode step)
            logits_RTX = matmul_output("gsd,dx->gsx", jnp.einsum(
                "gsd,dx->gsx", x_RTD, self.router[...].astype(x_RTD.dtype),
                preferred_element_type=jnp.float32))
            weight_RTA, expert_RTA, slot_RTA, kept_RTA = route(cfg, logits_RTX)
        with jax.named_scope("dispatch"):
            index_RXC = _dispatch_indices(expert_RTA, slot_RTA, kept_RTA, n_x, cap)
            pad_RTD = jnp.concatenate([x_RTD, jnp.zeros((g, 1, d), x_RTD.dtype)], axis=1)
            x_RXCD = jax.vmap(lambda rows, idx: rows[idx])(pad_RTD, index_RXC)
            x_RXCD = constrain(x_RXCD, ("batch", None, None, "embed"))
            # The all-to-all: groups lose the `expert` sharding, experts gain it.
            x_RXCD = constrain(x_RXCD, ("expert_batch", "experts", None, "embed"))
        with jax.named_scope("experts"):
            h_RXCF = mlp_hidden(self, "gxcd,xdf->gxcf", x_RXCD)
            h_RXCF = constrain(h_RXCF, ("expert_batch", "experts", None, "mlp"))
            t = hidden_split(h_RXCF.shape[-1], self.precision)
            if t > 1:
                y_YRXCD = self._down_partial_sums(h_RXCF, t)
            else:
                # Laid out before it is named: the layer scan stacks what a policy saves in
                # the layout it is named in, and a stack left to the partitioner was
                # resharded whole (every layer's) at each backward iteration.
                y_RXCD = constrain(
                    project("gxcf,xfd->gxcd", h_RXCF, self.w_down, precision=self.precision),
                    ("expert_batch", "experts", None, "embed"))
                y_RXCD = checkpoint_name(y_RXCD, "mlpwo")
        with jax.named_scope("combine"):
            flat_RTA = jnp.where(kept_RTA, expert_RTA * cap + slot_RTA, n_x * cap)
            if t == 1:
                y_RXCD = constrain(y_RXCD, ("batch", None, None, "embed"))  # all-to-all back
                out_RTD = jnp.einsum("gskd,gsk->gsd", _choices(y_RXCD, flat_RTA).astype(
                    jnp.float32), weight_RTA).astype(x_BLD.dtype)
            else:
                # all-to-all back, each tensor rank's partial sums on their own
                y_YRXCD = constrain(y_YRXCD, ("mlp", "batch", None, None, "embed"))
                y_YRTAD = jax.vmap(_choices, in_axes=(0, None))(y_YRXCD, flat_RTA)
                out_YRTD = constrain(
                    jnp.einsum("ygskd,gsk->ygsd", y_YRTAD.astype(jnp.float32),
                               weight_RTA).astype(x_BLD.dtype),
                    ("mlp", "batch", None, "embed"))
        if t > 1:
            if cfg.n_shared_experts:
                with jax.named_scope("shared_expert"):
                    out_YRTD = out_YRTD + self._shared_partial_sums(x_BLD, t).reshape(
                        out_YRTD.shape)
            with jax.named_scope("combine"):
                # the tensor ranks' one sum of the combined tokens and the shared expert's
                # (an all-reduce, or a reduce-scatter under sequence parallelism, as the
                # engines run it), in the activations' dtype
                out_RTD = jnp.sum(out_YRTD, axis=0, dtype=x_BLD.dtype)
        out_BLD = constrain(out_RTD.reshape(b, seq, d), ("batch", "residual_seq", "embed"))
        if cfg.n_shared_experts and t == 1:
            with jax.named_scope("shared_expert"):
                out_BLD = out_BLD + self.shared(x_BLD)
        return out_BLD

    def _down_partial_sums(self, h_RXCF, t: int):
        """The experts' down projection under tensor parallelism, as the t partial sums
        each rank holds of it (Y: the tensor ranks; the hidden dimension F split as
        (Y, F / Y), Y a batch dimension of the matmul, so that nothing sums them here).

        Left to the partitioner, the row-parallel matmul's partial sums are reduced where
        the matmul ends: an all-reduce of the slot buffer, experts_per_token x
        capacity_factor times the tokens. Serving engines (vLLM's and SGLang's fused MoE)
        reduce after the router-weighted combine, the tokens' own rows; the combine is
        linear, so it runs on each rank's partial sums and one sum over Y follows.
        (Megatron's all-to-all dispatcher with expert tensor parallelism reduce-scatters
        the experts' outputs before the combine instead: docs/limits.md.)"""
        g, n_x, cap, f = h_RXCF.shape
        h_RXCYF = constrain(h_RXCF.reshape(g, n_x, cap, t, f // t),
                            ("expert_batch", "experts", None, "mlp", None))
        w_XYFD = split_weight(self.w_down, 1, t)
        y_YRXCD = constrain(
            project("gxcyf,xyfd->ygxcd", h_RXCYF, w_XYFD, precision=self.precision),
            ("mlp", "expert_batch", "experts", None, "embed"))
        return checkpoint_name(y_YRXCD, "mlpwo")

    def _shared_partial_sums(self, x_BLD, t: int):
        """The shared expert (a dense MLP) as the t partial sums of its row-parallel down
        projection, added to the routed experts' before their one sum over the tensor
        ranks (vLLM's and SGLang's DeepSeek MoE reduce them together)."""
        mlp = self.shared
        h_BLF = mlp.hidden(x_BLD)
        b, seq, f = h_BLF.shape
        h_BLYF = constrain(h_BLF.reshape(b, seq, t, f // t), ("batch", "seq", "mlp", None))
        w_YFD = split_weight(mlp.w_down, 0, t)
        with jax.named_scope("down_proj"):
            y_YBLD = constrain(
                project("blyf,yfd->ybld", h_BLYF, w_YFD, precision=mlp.precision),
                ("mlp", "batch", "seq", "embed"))
            return checkpoint_name(y_YBLD, "mlpwo")
