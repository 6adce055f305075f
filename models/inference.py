"""Serving programs: prefill (prompts -> KV cache) and decode (one token per sequence over
its KV cache), built abstractly and sharded like the training step.

The KV cache is (layers, batch, seq, kv_heads, head_dim) for keys and for values (with
multi-head latent attention, one (layers, batch, seq, kv_lora + qk_rope) array of latents,
models/mla.py), sharded
over the batch's mesh axes, the kv heads' (tensor) and, for long contexts, its positions
over `sequence` (logical axis `cache_seq`): each device then attends over its share of the
positions and the softmax's max, sum and weighted values are combined across `sequence`
with small all-reduces (split-KV / flash-decoding across devices). A decode step reads
every weight and the whole cache once and writes one new position in place (the cache is
donated).

Weights can be stored in int8, float8 or int4 and the cache in the same types
(models/quant.py); the cache then carries one scale per (position, kv head).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.program import DTYPES, Precision, Program, Workload
from models.quant import SCALE_DTYPE, STORAGE_DTYPES
from models.train import abstract_params, initial_params, per_device_bytes, random_tokens
from sharding.rules import AxisRules, mesh_shape_of, resolve, use_rules

# The cache in the layout an attention kernel reads (vLLM's per-head blocks): batch and kv
# heads lead, so each head's positions x head_dim is one contiguous matrix for its GEMMs.
CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
LATENT_CACHE_AXES = ("layers", "batch", "cache_seq", None)  # MLA (models/mla.py)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeProgram(Program):
    """A prefill or decode step: the weights and the KV cache it reads."""

    cache_bytes_per_device: int


def serve_flops(cfg: ModelConfig, workload: Workload) -> float:
    """Model FLOPs of one serving step: 2 x active parameters per token, plus attention
    (scores and weighted values: 4 x heads x head_dim per attended position). Prefill
    projects only each sequence's last position onto the vocabulary (the next token)."""
    per_token = 2 * cfg.matmul_param_count()
    w = workload
    if w.kind == "prefill":
        head = 2 * cfg.d_model * cfg.padded_vocab
        attn = 4 * cfg.n_layers * cfg.n_heads * cfg.attention_head_dim * w.seq_len / 2
        return ((per_token - head + attn) * w.seq_len + head) * w.global_batch
    attn = 4 * cfg.n_layers * cfg.n_heads * cfg.attention_head_dim * (w.seq_len + 1)
    return (per_token + attn) * w.global_batch


def serving_rules(rules: AxisRules, kind: str) -> AxisRules:
    """The rules a serving step runs under: decode has one new position per sequence, so
    only the cache's positions are split (the residual stream's neither)."""
    if kind == "decode":
        return dataclasses.replace(rules, activations={**rules.activations, "seq": (),
                                                       "residual_seq": ()})
    return rules


def _abstract_cache(cfg: ModelConfig, w: Workload, precision: Precision, mesh: Mesh,
                    rules: AxisRules):
    """(keys and values as sharded ShapeDtypeStructs, their shardings): each (N, B, K, S, E)
    in the cache's dtype, or a (values, per position x kv head scales) pair when quantised."""
    mesh_shape = mesh_shape_of(mesh)
    if cfg.mla:
        return _latent_cache(cfg, w, precision, mesh, rules)
    cache_shape = (cfg.n_layers, w.global_batch, cfg.n_kv_heads, w.seq_len, cfg.head_dim)
    cache_spec = resolve(CACHE_AXES, cache_shape, rules.activations, mesh_shape, what="KV cache")
    one = NamedSharding(mesh, cache_spec)
    quantized = precision.quantized_kv_cache
    if quantized is None:
        one_cache = jax.ShapeDtypeStruct(cache_shape, DTYPES[precision.kv_cache_dtype],
                                         sharding=one)
        return (one_cache, one_cache), (one, one)
    scale_shape = (*cache_shape[:-1], 1)
    scale_spec = resolve(CACHE_AXES, scale_shape, rules.activations, mesh_shape,
                         what="KV cache scales")
    sharding = (one, NamedSharding(mesh, scale_spec))
    one_cache = (jax.ShapeDtypeStruct(cache_shape, STORAGE_DTYPES[quantized], sharding=one),
                 jax.ShapeDtypeStruct(scale_shape, SCALE_DTYPE, sharding=sharding[1]))
    return (one_cache, one_cache), (sharding, sharding)


def _latent_cache(cfg: ModelConfig, w: Workload, precision: Precision, mesh: Mesh,
                  rules: AxisRules):
    """MLA's cache: each layer's latents and RoPE keys (N, B, S, kv_lora + qk_rope), a
    1-tuple, in the cache's dtype; not split over heads (every tensor rank holds it)."""
    if precision.quantized_kv_cache is not None:
        raise ValueError(f"precision.kv_cache={precision.kv_cache!r}: a quantised cache of "
                         f"multi-head latent attention's latents is not modelled; leave "
                         f"precision.kv_cache unset for model.kv_lora_rank="
                         f"{cfg.kv_lora_rank}")
    shape = (cfg.n_layers, w.global_batch, w.seq_len, cfg.kv_cache_values_per_token())
    spec = resolve(LATENT_CACHE_AXES, shape, rules.activations, mesh_shape_of(mesh),
                   what="MLA latent cache")
    one = NamedSharding(mesh, spec)
    return (jax.ShapeDtypeStruct(shape, DTYPES[precision.kv_cache_dtype], sharding=one),), (one,)


def build_serve_program(cfg: ModelConfig, mesh: Mesh, rules: AxisRules, *, workload: Workload,
                        precision: Precision) -> ServeProgram:
    """The jitted prefill or decode step over abstract, sharded weights and KV cache."""
    w = workload
    if w.kind not in ("prefill", "decode"):
        raise ValueError(f"workload.kind={w.kind!r} is not a serving workload")
    mesh_shape = mesh_shape_of(mesh)
    rules = serving_rules(rules, w.kind)
    if precision.compute == "float8" and precision.quantized_weights is None:
        # FP8 matmuls over a bf16 checkpoint: engines quantise the weights once, at load
        # (vLLM's and TensorRT-LLM's dynamic FP8), not before every token's matmuls
        precision = dataclasses.replace(precision, weights="float8")
    graphdef, params, p_shard = abstract_params(cfg, precision, mesh, rules)
    cache, cache_sharding = _abstract_cache(cfg, w, precision, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    tokens_len = w.seq_len if w.kind == "prefill" else 1
    tok_spec = resolve(("batch", "seq"), (w.global_batch, tokens_len), rules.activations,
                       mesh_shape, what="token batch")
    tok_sharding = NamedSharding(mesh, tok_spec)
    tokens = jax.ShapeDtypeStruct((w.global_batch, tokens_len), jnp.int32, sharding=tok_sharding)
    out_tokens = NamedSharding(mesh, PartitionSpec(*tok_spec[:1]))

    if w.kind == "prefill":
        def prefill(p, t):
            with use_rules(rules, mesh):
                logits_BV, kv = nnx.merge(graphdef, p).prefill(t)
                return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), kv

        step = jax.jit(prefill, in_shardings=(p_shard, tok_sharding),
                       out_shardings=(out_tokens, cache_sharding))
        args, arg_names = (params, tokens), ("params", "tokens")
    else:
        def decode(p, kv, t, index):
            with use_rules(rules, mesh):
                logits_BV, kv = nnx.merge(graphdef, p).decode(t, kv, index)
                return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), kv

        step = jax.jit(decode, in_shardings=(p_shard, cache_sharding, tok_sharding, replicated),
                       out_shardings=(out_tokens, cache_sharding),
                       donate_argnums=(1,))
        index = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        args, arg_names = (params, cache, tokens, index), ("params", "cache", "tokens", "index")
    def init(seed: int = 0):
        """Concrete arguments like `args`: the model's initial weights, a zero cache, random
        tokens, position 0."""
        p = initial_params(cfg, precision, p_shard, seed=seed)
        t = random_tokens(seed + 1, tokens.shape, cfg.vocab, tok_sharding)
        if w.kind == "prefill":
            return p, t
        zeros = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), cache),
                        out_shardings=cache_sharding)()
        return p, zeros, t, jax.device_put(jnp.int32(0), replicated)

    return ServeProgram(
        init=init, step=step, args=args, arg_names=arg_names, param_count=cfg.param_count(),
        model_flops_per_step=serve_flops(cfg, w),
        tokens_per_step=w.tokens_per_step,
        param_bytes_per_device=per_device_bytes(params),
        cache_bytes_per_device=per_device_bytes(cache),
    )
