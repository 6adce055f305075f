"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values come from a narrow
latent per token, which is all a KV cache holds.

Per token (DeepSeek-V3: d_model 7168, 128 heads, q_lora 1536, kv_lora 512, head_dim 128 without
RoPE, qk_rope 64, values 128):
- queries: x -> (q_a, RMSNorm) a rank-q_lora vector -> (q_b) per head, head_dim + qk_rope
  wide; the RoPE part rotated;
- the latent: x -> (kv_a) kv_lora + qk_rope values: the first kv_lora normalised (the
  latent c), the last qk_rope one RoPE key shared by every head. These kv_lora + qk_rope
  values (576) are what a layer caches per token;
- training and prefill project the latent up per head (k_b: keys without RoPE, v_b:
  values) and run ordinary attention, every head its own key and value (K = H, G = 1), the
  shared RoPE key joined to each head's;
- decode runs the "absorbed" form: the query is carried into latent space through k_b
  (q_nope k_b^T: kv_lora wide), scored against the cached latents and RoPE keys together,
  the probabilities weigh the cached latents, and v_b brings the result out per head. The
  cache is read once, in its compressed form, as DeepSeek's inference does.

Logical axes: the heads are split as `heads` (tensor parallelism); the two rank dimensions
of the up projections are sharded like `embed` (FSDP), as MaxText shards its q_lora and
kv_lora; the latent activations and the cache are not split by heads (every tensor rank
holds the whole latent).

Suffixes (models/__init__.py): Q the queries' rank, U the latent (kv_lora, or kv_lora +
qk_rope where it carries the RoPE key), W the RoPE part, E a head's width (queries and keys
head_dim + qk_rope, values v_head_dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.attention import as_kernels, dense_attention, flash_attention
from models.config import ModelConfig
from models.context import context_attention, context_axis
from models.layers import (
    Norm,
    new_weight,
    project,
    rope,
    tensor_parallel_input,
    tensor_parallel_output,
)
from models.program import DTYPES, Precision
from sharding.rules import constrain

LATENT = ("batch", "seq", None)


class LatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, precision: Precision):
        d, h, c, r = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_dim
        q, qk, v = cfg.q_lora_rank, cfg.qk_head_dim, cfg.value_head_dim
        param_dtype = DTYPES[precision.params]
        self.cfg, self.precision = cfg, precision
        heads = ("embed", "heads", "head_dim")  # a rank (or d_model) x heads x head width
        if q:
            self.wq_a = new_weight(rngs, (d, q), ("embed", None), precision=precision)
            self.q_norm = Norm(cfg, param_dtype=param_dtype, width=q)
        self.wq_b = new_weight(rngs, (q or d, h, qk), heads, precision=precision)
        self.wkv_a = new_weight(rngs, (d, c + r), ("embed", None), precision=precision)
        self.kv_norm = Norm(cfg, param_dtype=param_dtype, width=c)
        self.wk_b = new_weight(rngs, (c, h, cfg.head_dim), heads, precision=precision)
        self.wv_b = new_weight(rngs, (c, h, v), heads, precision=precision)
        self.wo = new_weight(rngs, (h, v, d), ("heads", "head_dim", "embed"),
                             precision=precision, contract=2, scale=(h * v) ** -0.5)

    def __call__(self, x_BLD, positions_BL, cache=None, context: str | None = None):
        """As models.transformer.Attention, with `cache` = (latents (B, S, U), index) for
        decode; returns (output, (the latents computed here (B, L, U),))."""
        cfg, p = self.cfg, self.precision
        nope, c = cfg.head_dim, cfg.kv_lora_rank
        x_BLD = tensor_parallel_input(x_BLD, p)
        with jax.named_scope("query_proj"):
            xq = x_BLD
            if cfg.q_lora_rank:
                xq = self.q_norm(constrain(project("bld,dq->blq", x_BLD, self.wq_a,
                                                   precision=p), LATENT))
            q_BLHE = project("blq,qhe->blhe", xq, self.wq_b, precision=p)
            q_BLHE = checkpoint_name(
                constrain(q_BLHE, ("batch", "seq", "heads", "head_dim")), "query_proj")
        q_rope_BLHW = rope(q_BLHE[..., nope:], positions_BL, cfg.rope_theta)
        with jax.named_scope("kv_latent_proj"):
            kv_BLU = constrain(project("bld,du->blu", x_BLD, self.wkv_a, precision=p), LATENT)
            latent_BLU = self.kv_norm(kv_BLU[..., :c])
            k_rope_BLW = rope(kv_BLU[:, :, None, c:], positions_BL, cfg.rope_theta)[:, :, 0]
            cached_BLU = constrain(jnp.concatenate([latent_BLU, k_rope_BLW], -1), LATENT)
        if cache is None:
            out_BLHE = self._attend(q_BLHE[..., :nope], q_rope_BLHW, latent_BLU, k_rope_BLW,
                                    context)
        else:
            out_BLHE = self._decode(q_BLHE[..., :nope], q_rope_BLHW, cached_BLU, *cache)
        out_BLHE = checkpoint_name(constrain(out_BLHE, ("batch", "seq", "heads", "head_dim")),
                                   "context")
        with jax.named_scope("out_proj"):
            out_BLD = project("blhe,hed->bld", out_BLHE, self.wo, precision=p)
            out_BLD = checkpoint_name(tensor_parallel_output(out_BLD, p), "out_proj")
            return out_BLD, (cached_BLU,)

    def _attend(self, q_nope_BLHE, q_rope_BLHW, latent_BLU, k_rope_BLW, context):
        """Training and prefill: keys and values projected up per head, then attention."""
        cfg, p = self.cfg, self.precision
        names = ("batch", "seq", "heads", "head_dim")
        with jax.named_scope("key_proj"):
            k_BLHE = project("blu,uhe->blhe", latent_BLU, self.wk_b, precision=p)
            b, seq, h, _ = k_BLHE.shape
            k_rope_BLHW = jnp.broadcast_to(k_rope_BLW[:, :, None], (b, seq, h, cfg.qk_rope_dim))
            k_BLHE = checkpoint_name(
                constrain(jnp.concatenate([k_BLHE, k_rope_BLHW], -1), names), "key_proj")
        with jax.named_scope("value_proj"):
            v_BLHE = checkpoint_name(constrain(
                project("blu,uhe->blhe", latent_BLU, self.wv_b, precision=p), names),
                "value_proj")
        q_BLHE = jnp.concatenate([q_nope_BLHE, q_rope_BLHW], -1)
        q_BLH1E = q_BLHE[:, :, :, None]  # every head its own key: K = H, G = 1
        attend = dense_attention if cfg.attention == "dense" else flash_attention
        with as_kernels(cfg.attention):
            if context is not None:
                out = context_attention(q_BLH1E, k_BLHE, v_BLHE, mode=context,
                                        **context_axis())
            else:
                out = attend(q_BLH1E, k_BLHE, v_BLHE)
        return out[:, :, :, 0]

    def _decode(self, q_nope_B1HE, q_rope_B1HW, new_B1U, cache_BSU, index):
        """One new position over the cached latents, in the absorbed form (module doc)."""
        p, c = self.precision, self.cfg.kv_lora_rank
        scale = self.cfg.qk_head_dim ** -0.5
        with jax.named_scope("kv_cache_attention"):
            q_lat_BHU = project("bqhe,uhe->bhu", q_nope_B1HE, self.wk_b, precision=p)
            q_BHU = jnp.concatenate([q_lat_BHU, q_rope_B1HW[:, 0].astype(q_lat_BHU.dtype)], -1)
            cache_BSU = cache_BSU.astype(q_BHU.dtype)
            s_BHS = jnp.einsum("bhu,bsu->bhs", q_BHU, cache_BSU).astype(jnp.float32) * scale
            s_BHS = jnp.where(jnp.arange(cache_BSU.shape[1]) < index, s_BHS, -1e30)
            s_self_BH = jnp.einsum("bhu,bu->bh", q_BHU,
                                   new_B1U[:, 0].astype(q_BHU.dtype)).astype(jnp.float32) * scale
            m_BH = jnp.maximum(jnp.max(s_BHS, axis=-1), s_self_BH)
            p_BHS, p_self_BH = jnp.exp(s_BHS - m_BH[..., None]), jnp.exp(s_self_BH - m_BH)
            denom_BH = jnp.sum(p_BHS, axis=-1) + p_self_BH
            o_BHU = jnp.einsum("bhs,bsu->bhu", p_BHS.astype(cache_BSU.dtype), cache_BSU[..., :c])
            o_BHU = (o_BHU.astype(jnp.float32) + p_self_BH[..., None]
                     * new_B1U[:, :, :c].astype(jnp.float32)) / denom_BH[..., None]
            out_BHE = project("bhu,uhe->bhe", o_BHU.astype(q_BHU.dtype), self.wv_b, precision=p)
            return out_BHE[:, None]
