"""A decoder-only Transformer in Flax NNX: Llama style (GQA, RoPE, RMSNorm, SwiGLU) and
GPT style (learned positions, LayerNorm, GELU/ReLU MLP, tied embeddings).

Every parameter carries `logical_axes` metadata and key activations are pinned with
`sharding.constrain`; the model never names a mesh axis. Layers are stacked (leading
`layers` dimension) and run under `jax.lax.scan`.

Array-name suffixes: B batch, L sequence, D d_model, H query heads, K kv heads, G query
heads per kv head, E head_dim, F mlp hidden, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import dense_attention, flash_attention
from models.config import ModelConfig
from sharding.rules import constrain

REMAT_POLICIES = ("none", "minimal", "full")


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None) -> nnx.Param:
    fan_in = shape[0] if scale is None else None
    std = scale if scale is not None else fan_in**-0.5
    value = jax.random.normal(rngs.params(), shape, dtype) * std
    return nnx.Param(value, logical_axes=axes)


def _ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


def _zeros(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class Norm(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype):
        self.kind = cfg.norm
        self.scale = _ones((cfg.d_model,), ("embed",), param_dtype)
        if cfg.norm == "layernorm":
            self.bias = _zeros((cfg.d_model,), ("embed",), param_dtype)

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


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype):
        d, h, k, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.wq = _param(rngs, (d, h, e), ("embed", "heads", "head_dim"), param_dtype)
        self.wk = _param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.wv = _param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.wo = _param(rngs, (h, e, d), ("heads", "head_dim", "embed"), param_dtype,
                         scale=(h * e) ** -0.5)

    def __call__(self, x_BLD, positions_BL):
        cfg, dt = self.cfg, x_BLD.dtype
        with jax.named_scope("qkv_proj"):
            q_BLHE = jnp.einsum("bld,dhe->blhe", x_BLD, self.wq[...].astype(dt))
            k_BLKE = jnp.einsum("bld,dke->blke", x_BLD, self.wk[...].astype(dt))
            v_BLKE = jnp.einsum("bld,dke->blke", x_BLD, self.wv[...].astype(dt))
            q_BLHE = constrain(q_BLHE, ("batch", "seq", "heads", "head_dim"))
            k_BLKE = constrain(k_BLKE, ("batch", "seq", "kv_heads", "head_dim"))
            v_BLKE = constrain(v_BLKE, ("batch", "seq", "kv_heads", "head_dim"))
        if cfg.positions == "rope":
            q_BLHE = rope(q_BLHE, positions_BL, cfg.rope_theta)
            k_BLKE = rope(k_BLKE, positions_BL, cfg.rope_theta)
        b, seq, h, e = q_BLHE.shape
        kv = cfg.n_kv_heads
        q_BLKGE = q_BLHE.reshape(b, seq, kv, h // kv, e)
        attend = flash_attention if cfg.attention == "flash" else dense_attention
        out_BLKGE = attend(q_BLKGE, k_BLKE, v_BLKE)
        out_BLHE = constrain(out_BLKGE.reshape(b, seq, h, e), ("batch", "seq", "heads", "head_dim"))
        with jax.named_scope("out_proj"):
            out_BLD = jnp.einsum("blhe,hed->bld", out_BLHE, self.wo[...].astype(dt))
            return constrain(out_BLD, ("batch", "seq", "embed"))


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype):
        d, f = cfg.d_model, cfg.d_ff
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), param_dtype)
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), param_dtype)

    def __call__(self, x_BLD):
        dt = x_BLD.dtype
        with jax.named_scope("up_proj"):
            up_BLF = jnp.einsum("bld,df->blf", x_BLD, self.w_up[...].astype(dt))
            if self.kind == "swiglu":
                gate_BLF = jnp.einsum("bld,df->blf", x_BLD, self.w_gate[...].astype(dt))
                h_BLF = jax.nn.silu(gate_BLF) * up_BLF
            elif self.kind == "gelu":
                h_BLF = jax.nn.gelu(up_BLF)
            else:
                h_BLF = jax.nn.relu(up_BLF)
            h_BLF = constrain(h_BLF, ("batch", "seq", "mlp"))
        with jax.named_scope("down_proj"):
            out_BLD = jnp.einsum("blf,fd->bld", h_BLF, self.w_down[...].astype(dt))
            return constrain(out_BLD, ("batch", "seq", "embed"))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype):
        self.attn_norm = Norm(cfg, param_dtype=param_dtype)
        self.attn = Attention(cfg, rngs=rngs, param_dtype=param_dtype)
        self.mlp_norm = Norm(cfg, param_dtype=param_dtype)
        self.mlp = Mlp(cfg, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x_BLD, positions_BL):
        with jax.named_scope("attention"):
            x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), positions_BL)
        with jax.named_scope("mlp"):
            return x_BLD + self.mlp(self.mlp_norm(x_BLD))


class Transformer(nnx.Module):
    """Token ids (B, L) -> logits (B, L, V) in float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 compute_dtype=jnp.bfloat16, remat: str = "full"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"train.remat={remat!r} is not one of {REMAT_POLICIES}")
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.remat = remat
        v, d = cfg.padded_vocab, cfg.d_model
        self.embed = _param(rngs, (v, d), ("vocab", "embed"), param_dtype, scale=1.0)
        if cfg.positions == "learned":
            self.pos_embed = _param(rngs, (cfg.max_seq_len, d), (None, "embed"), param_dtype,
                                    scale=0.02)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, rngs=rngs, param_dtype=param_dtype)

        self.blocks = make_blocks(rngs)  # every parameter gains a leading `layers` dim
        self.final_norm = Norm(cfg, param_dtype=param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (d, v), ("embed", "vocab"), param_dtype)

    def __call__(self, tokens_BL):
        cfg, dt = self.cfg, self.compute_dtype
        b, seq = tokens_BL.shape
        positions_BL = jnp.broadcast_to(jnp.arange(seq), (b, seq))
        with jax.named_scope("embedding"):
            x_BLD = jnp.take(self.embed[...], tokens_BL, axis=0).astype(dt)
            if cfg.positions == "learned":
                x_BLD = x_BLD + self.pos_embed[...][:seq].astype(dt)
            x_BLD = constrain(x_BLD, ("batch", "seq", "embed"))

        graphdef, layers = nnx.split(self.blocks)

        def layer(x_BLD, layer_state):
            y_BLD = nnx.merge(graphdef, layer_state)(x_BLD, positions_BL)
            return constrain(y_BLD, ("batch", "seq", "embed")), None

        if self.remat == "full":
            layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
        elif self.remat == "minimal":
            # Keep the weight matmuls' outputs; recompute the cheap elementwise work.
            layer = jax.checkpoint(
                layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        x_BLD, _ = jax.lax.scan(layer, x_BLD, layers)

        with jax.named_scope("lm_head"):
            x_BLD = self.final_norm(x_BLD)
            head_DV = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
            logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, head_DV.astype(dt))
            return constrain(logits_BLV, ("batch", "seq", "vocab")).astype(jnp.float32)


def logical_axes(state: nnx.State) -> dict:
    """Nested dict of logical axis names, parallel to `state`'s pure dict.

    Parameters under `blocks` are stacked by `nnx.vmap` and gain the `layers` axis first.
    """
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        axes = tuple(var.get_metadata()["logical_axes"])
        if path and path[0] == "blocks":
            axes = ("layers", *axes)
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = axes
    return out
