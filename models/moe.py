"""Mixture-of-experts MLP: a top-k router, experts sharded over the `expert` mesh axis, and
token dispatch and combine as all-to-alls (GShard / Switch / MaxText's "dense" MoE path).

Tokens are routed in groups of up to `moe_group_size` consecutive tokens of the flattened
(batch x sequence) stream; a group never spans the devices the batch is split over, so
dispatch within a group is local (GShard's groups). Training sequences are usually at
least a group long, so a group is part of one sequence and the routing does not depend on
the sharding; in decode (one token per sequence) a group is a device's share of the
batch. In each group every expert has `capacity` slots:

    capacity = ceil(capacity_factor x group_size x experts_per_token / n_experts)

Assignments claim slots in priority order, every token's first choice before any token's
second choice (GShard); an assignment that finds its expert full is dropped (its
contribution is zero and the residual carries the token on). `capacity_factor <= 0` is
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

Shape suffixes: G groups, S tokens in a group, X experts, C capacity, K experts per
token, D d_model, F expert hidden.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import Mlp, mlp_hidden, new_param, new_weight, project
from sharding.rules import active_mesh, active_rules, constrain, mesh_shape_of


def capacity(cfg: ModelConfig, group_size: int) -> int:
    """Slots per expert in a group of `group_size` tokens."""
    if cfg.capacity_factor <= 0:
        return group_size
    c = math.ceil(cfg.capacity_factor * group_size * cfg.experts_per_token / cfg.n_experts)
    return min(max(c, 1), group_size)


def group_size(cfg: ModelConfig, local_tokens: int) -> int:
    """Tokens per routing group: the largest divisor of a device's `local_tokens` that is at
    most `moe_group_size`."""
    s = min(cfg.moe_group_size, local_tokens)
    while local_tokens % s:
        s -= 1
    return s


def _batch_ways() -> int:
    """Devices the batch is split over under the active rules (1 without rules)."""
    mesh, rules = active_mesh(), active_rules()
    if mesh is None:
        return 1
    sizes = mesh_shape_of(mesh)
    return math.prod(sizes.get(a, 1) for a in rules.activations.get("batch", ()))


def route(cfg: ModelConfig, logits_GSX):
    """Top-k routing with capacity: (weights G,S,K; expert G,S,K; slot G,S,K; kept G,S,K).

    Router probabilities are a softmax over experts; the k chosen weights are renormalised
    to sum to one (Mixtral, Qwen3). `slot` is the assignment's place in its expert's buffer.
    """
    g, s, x = logits_GSX.shape
    k = cfg.experts_per_token
    probs_GSX = jax.nn.softmax(logits_GSX.astype(jnp.float32), axis=-1)
    weight_GSK, expert_GSK = jax.lax.top_k(probs_GSX, k)
    weight_GSK = weight_GSK / jnp.sum(weight_GSK, axis=-1, keepdims=True)
    # Priority order: all first choices of the group, then all second choices, ...
    onehot_GKSX = jax.nn.one_hot(jnp.swapaxes(expert_GSK, 1, 2), x, dtype=jnp.int32)
    seen_GKSX = jnp.cumsum(onehot_GKSX.reshape(g, k * s, x), axis=1).reshape(g, k, s, x)
    slot_GSK = jnp.swapaxes(jnp.sum((seen_GKSX - 1) * onehot_GKSX, axis=-1), 1, 2)
    kept_GSK = slot_GSK < capacity(cfg, s)
    return weight_GSK, expert_GSK, slot_GSK, kept_GSK


def _dispatch_indices(expert_GSK, slot_GSK, kept_GSK, n_experts: int, cap: int):
    """For every (group, expert, slot): the token in it, or S (a zero row) when empty."""
    g, s, k = expert_GSK.shape
    token_GSK = jnp.broadcast_to(jnp.arange(s)[None, :, None], (g, s, k))
    slot_GSK = jnp.where(kept_GSK, slot_GSK, cap)  # out of range: dropped by the scatter

    def one_group(expert_SK, slot_SK, token_SK):
        empty_XC = jnp.full((n_experts, cap), s, jnp.int32)
        return empty_XC.at[expert_SK, slot_SK].set(token_SK, mode="drop")

    return jax.vmap(one_group)(expert_GSK, slot_GSK, token_GSK)


class MoeMlp(nnx.Module):
    """Routed experts (and `n_shared_experts` always-on experts, DeepSeek style)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype, lowp: str | None = None,
                 quant: str | None = None):
        d, f, x = cfg.d_model, cfg.d_ff, cfg.n_experts
        self.cfg = cfg
        self.kind = cfg.mlp
        self.lowp = lowp
        self.router = new_param(rngs, (d, x), ("embed", None), param_dtype)
        if cfg.mlp == "swiglu":
            self.w_gate = new_weight(rngs, (x, d, f), ("experts", "embed", "mlp"), param_dtype,
                                  quant, expert_dims=1)
        self.w_up = new_weight(rngs, (x, d, f), ("experts", "embed", "mlp"), param_dtype, quant,
                            expert_dims=1)
        self.w_down = new_weight(rngs, (x, f, d), ("experts", "mlp", "embed"), param_dtype, quant,
                              expert_dims=1)
        if cfg.n_shared_experts:  # the dense MLP is the shared expert
            shared = dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * cfg.d_ff)
            self.shared = Mlp(shared, rngs=rngs, param_dtype=param_dtype, lowp=lowp, quant=quant)

    def __call__(self, x_BLD):
        cfg = self.cfg
        b, seq, d = x_BLD.shape
        s = group_size(cfg, b * seq // _batch_ways())
        g, n_x, cap = b * seq // s, cfg.n_experts, capacity(cfg, s)
        x_GSD = constrain(x_BLD.reshape(g, s, d), ("batch", None, "embed"))
        with jax.named_scope("router"):
            logits_GSX = jnp.einsum("gsd,dx->gsx", x_GSD.astype(jnp.float32),
                                    self.router[...].astype(jnp.float32))
            weight_GSK, expert_GSK, slot_GSK, kept_GSK = route(cfg, logits_GSX)
        with jax.named_scope("dispatch"):
            index_GXC = _dispatch_indices(expert_GSK, slot_GSK, kept_GSK, n_x, cap)
            pad_GSD = jnp.concatenate([x_GSD, jnp.zeros((g, 1, d), x_GSD.dtype)], axis=1)
            x_GXCD = jax.vmap(lambda rows, idx: rows[idx])(pad_GSD, index_GXC)
            x_GXCD = constrain(x_GXCD, ("batch", None, None, "embed"))
            # The all-to-all: groups lose the `expert` sharding, experts gain it.
            x_GXCD = constrain(x_GXCD, ("expert_batch", "experts", None, "embed"))
        with jax.named_scope("experts"):
            h_GXCF = mlp_hidden(self, "gxcd,xdf->gxcf", x_GXCD)
            h_GXCF = constrain(h_GXCF, ("expert_batch", "experts", None, "mlp"))
            y_GXCD = project("gxcf,xfd->gxcd", h_GXCF, self.w_down, lowp=self.lowp)
            y_GXCD = constrain(y_GXCD, ("expert_batch", "experts", None, "embed"))
        with jax.named_scope("combine"):
            y_GXCD = constrain(y_GXCD, ("batch", None, None, "embed"))  # all-to-all back
            flat_GSK = jnp.where(kept_GSK, expert_GSK * cap + slot_GSK, n_x * cap)
            pad_GND = jnp.concatenate([y_GXCD.reshape(g, n_x * cap, d),
                                       jnp.zeros((g, 1, d), y_GXCD.dtype)], axis=1)
            y_GSKD = jax.vmap(lambda rows, idx: rows[idx])(pad_GND, flat_GSK)
            out_GSD = jnp.einsum("gskd,gsk->gsd", y_GSKD.astype(jnp.float32),
                                 weight_GSK).astype(x_BLD.dtype)
            out_BLD = constrain(out_GSD.reshape(b, seq, d), ("batch", "seq", "embed"))
        if cfg.n_shared_experts:
            with jax.named_scope("shared_expert"):
                out_BLD = out_BLD + self.shared(x_BLD)
        return out_BLD
