"""A decoder-only Transformer in Flax NNX: Llama style (GQA, RoPE, RMSNorm, SwiGLU) and
GPT style (learned positions, LayerNorm, GELU/ReLU MLP, tied embeddings).

Every parameter carries `logical_axes` metadata and key activations are pinned with
`sharding.constrain`; the model never names a mesh axis. Layers are stacked (leading
`layers` dimension) and run under `jax.lax.scan`.

Array-name suffixes: the legend in models/__init__.py.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.attention import as_kernels, dense_attention, flash_attention
from models.config import ModelConfig
from models.context import context_attention, context_axis, zigzag_order
from models.layers import (
    Mlp,
    Norm,
    new_param,
    new_weight,
    project,
    rope,
    tensor_parallel_input,
    tensor_parallel_output,
)
from models.mla import LatentAttention
from models.moe import MoeMlp
from models.pipeline import Pipeline, run_pipeline
from models.program import DTYPES, OFFLOAD_ALL, REMAT_POLICIES, Precision, remat_policy
from models.quant import dequantize, quantize
from sharding.rules import active_mesh, active_rules, constrain, use_rules


def checkpointed(fn, remat: str, save=(), offload=()):
    """`fn` under the activation-checkpointing policy `remat` (REMAT_POLICIES; "custom":
    the named tensors of `save` kept, of `offload` moved to host memory)."""
    policy = remat_policy(remat, save, offload)
    return fn if policy is None else jax.checkpoint(fn, policy=policy)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, precision: Precision):
        d, h, k, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.precision = precision
        if cfg.fused_qkv:
            # Megatron's layout: per kv head, its G query heads, then its key and value.
            self.wqkv = new_weight(rngs, (d, k, h // k + 2, e),
                                   ("embed", "kv_heads", None, "head_dim"), precision=precision)
        else:
            self.wq = new_weight(rngs, (d, h, e), ("embed", "heads", "head_dim"),
                                 precision=precision)
            self.wk = new_weight(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"),
                                 precision=precision)
            self.wv = new_weight(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"),
                                 precision=precision)
        self.wo = new_weight(rngs, (h, e, d), ("heads", "head_dim", "embed"), precision=precision,
                             contract=2, scale=(h * e) ** -0.5)

    def __call__(self, x_BLD, positions_BL, cache=None, context: str | None = None):
        """Attention over the sequence (training, prefill) or, with `cache` = (k_BKSE,
        v_BKSE, index), one new position per sequence over its KV cache (decode).
        `context`: the context-parallel mode (models/context.py) when the positions are
        split over a mesh axis in zigzag order; None otherwise.

        Returns (output, (k, v)): the keys and values computed here (the whole sequence's
        for prefill, the new position's for decode), as (B, L, K, E).
        """
        cfg = self.cfg
        q_BLHE, k_BLKE, v_BLKE = self._qkv(x_BLD)
        if cfg.positions == "rope":
            q_BLHE = rope(q_BLHE, positions_BL, cfg.rope_theta)
            k_BLKE = rope(k_BLKE, positions_BL, cfg.rope_theta)
        b, seq, h, e = q_BLHE.shape
        kv = cfg.n_kv_heads
        q_BLKGE = q_BLHE.reshape(b, seq, kv, h // kv, e)
        if context is not None:
            with as_kernels(cfg.attention):
                out_BLKGE = context_attention(q_BLKGE, k_BLKE, v_BLKE, mode=context,
                                              **context_axis())
        elif cache is None:
            attend = dense_attention if cfg.attention == "dense" else flash_attention
            with as_kernels(cfg.attention):
                out_BLKGE = attend(q_BLKGE, k_BLKE, v_BLKE)
        else:
            out_BLKGE = decode_attention(q_BLKGE, k_BLKE, v_BLKE, *cache)
        out_BLHE = constrain(out_BLKGE.reshape(b, seq, h, e), ("batch", "seq", "heads", "head_dim"))
        out_BLHE = checkpoint_name(out_BLHE, "context")
        with jax.named_scope("out_proj"):
            out_BLD = project("blhe,hed->bld", out_BLHE, self.wo, precision=self.precision)
            out_BLD = checkpoint_name(tensor_parallel_output(out_BLD, self.precision), "out_proj")
            return out_BLD, (k_BLKE, v_BLKE)


    def _qkv(self, x_BLD):
        """The query, key and value projections: one weight each, or one fused weight."""
        x_BLD = tensor_parallel_input(x_BLD, self.precision)
        b, seq, _ = x_BLD.shape
        h, kv, e = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        if self.cfg.fused_qkv:
            with jax.named_scope("qkv_proj"):
                qkv_BLKCE = constrain(project("bld,dkce->blkce", x_BLD, self.wqkv,
                                              precision=self.precision),
                                      ("batch", "seq", "kv_heads", None, "head_dim"))
            g = h // kv
            projections = (qkv_BLKCE[..., :g, :].reshape(b, seq, h, e),
                           qkv_BLKCE[..., g, :], qkv_BLKCE[..., g + 1, :])
        else:
            # One named scope per projection (MaxText's names), so that a report's row per
            # model operation is one weight.
            projections = []
            for name, spec, w in (("query_proj", "bld,dhe->blhe", self.wq),
                                  ("key_proj", "bld,dke->blke", self.wk),
                                  ("value_proj", "bld,dke->blke", self.wv)):
                with jax.named_scope(name):
                    projections.append(project(spec, x_BLD, w, precision=self.precision))
        names = (("query_proj", "heads"), ("key_proj", "kv_heads"), ("value_proj", "kv_heads"))
        return tuple(checkpoint_name(constrain(p, ("batch", "seq", heads, "head_dim")), name)
                     for p, (name, heads) in zip(projections, names))


def context_ranks() -> int:
    """Ways the active rules split the positions (1 without rules)."""
    mesh, rules = active_mesh(), active_rules()
    if mesh is None:
        return 1
    return rules.ways("seq", dict(mesh.shape))


def _write_cache(cache_NBKSE, new_NBK1E, index, quantized: str | None):
    """Write one position into the cache in place (quantising it first if the cache is)."""
    start = (0, 0, 0, index, 0)
    if quantized is None:
        return jax.lax.dynamic_update_slice(cache_NBKSE, new_NBK1E.astype(cache_NBKSE.dtype),
                                            start)
    q_NBK1E, scale_NBK11 = quantize(new_NBK1E, quantized, (-1,))
    return (jax.lax.dynamic_update_slice(cache_NBKSE[0], q_NBK1E, start),
            jax.lax.dynamic_update_slice(cache_NBKSE[1], scale_NBK11, start))


def decode_attention(q_B1KGE, k_B1KE, v_B1KE, k_BKSE, v_BKSE, index):
    """One query per sequence over cache positions [0, index) plus itself.

    The cache is read once and not written here: the caller writes the new keys and values
    into it in place, so a decode step moves (weights + cache) bytes, as serving does. A
    quantised cache ((q, scale) pairs) is dequantised as it is read.
    """
    e = q_B1KGE.shape[-1]
    scale = e**-0.5
    with jax.named_scope("kv_cache_attention"):
        if isinstance(k_BKSE, tuple):
            k_BKSE = dequantize(*k_BKSE, q_B1KGE.dtype)
            v_BKSE = dequantize(*v_BKSE, q_B1KGE.dtype)
        s_BKGS = jnp.einsum("bqkge,bkse->bkgs", q_B1KGE, k_BKSE).astype(jnp.float32) * scale
        valid_S = jnp.arange(k_BKSE.shape[2]) < index
        s_BKGS = jnp.where(valid_S, s_BKGS, -1e30)
        s_self_BKG = jnp.einsum("bqkge,bqke->bkg", q_B1KGE, k_B1KE).astype(jnp.float32) * scale
        m_BKG = jnp.maximum(jnp.max(s_BKGS, axis=-1), s_self_BKG)
        p_BKGS = jnp.exp(s_BKGS - m_BKG[..., None])
        p_self_BKG = jnp.exp(s_self_BKG - m_BKG)
        denom_BKG = jnp.sum(p_BKGS, axis=-1) + p_self_BKG
        out_BKGE = jnp.einsum("bkgs,bkse->bkge", p_BKGS.astype(v_BKSE.dtype), v_BKSE)
        out_BKGE = out_BKGE.astype(jnp.float32) + p_self_BKG[..., None] * \
            v_B1KE[:, 0, :, None, :].astype(jnp.float32)
        out_BKGE = out_BKGE / denom_BKG[..., None]
        return out_BKGE[:, None].astype(q_B1KGE.dtype)


class Block(nnx.Module):
    """A decoder layer: attention (grouped-query, or MLA with model.kv_lora_rank) and an
    MLP (routed experts, or with `dense` the dense MLP of the first layers)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, precision: Precision,
                 dense: bool = False):
        param_dtype = DTYPES[precision.params]
        self.attn_norm = Norm(cfg, param_dtype=param_dtype)
        attention = LatentAttention if cfg.mla else Attention
        self.attn = attention(cfg, rngs=rngs, precision=precision)
        self.mlp_norm = Norm(cfg, param_dtype=param_dtype)
        if dense or cfg.n_experts == 1:
            self.mlp = Mlp(dataclasses.replace(cfg, d_ff=cfg.dense_layers_d_ff), rngs=rngs,
                           precision=precision)
        else:
            self.mlp = MoeMlp(cfg, rngs=rngs, precision=precision)

    def __call__(self, x_BLD, positions_BL, cache=None, context: str | None = None):
        x_BLD = checkpoint_name(x_BLD, "decoder_layer_input")
        with jax.named_scope("attention"):
            attn_BLD, kv = self.attn(self.attn_norm(x_BLD), positions_BL, cache, context)
            x_BLD = x_BLD + attn_BLD
        with jax.named_scope("mlp"):
            return x_BLD + self.mlp(self.mlp_norm(x_BLD)), kv


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, precision: Precision, n: int,
                    dense: bool = False) -> Block:
    """`n` layers, every parameter with a leading `layers` dimension."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
        return Block(cfg, rngs=rngs, precision=precision, dense=dense)

    return make_blocks(rngs)


def dense_layer_note(cfg: ModelConfig, pipelined: bool) -> tuple[str, ...]:
    """What a pipelined model makes of the dense first layers (none unpipelined)."""
    if not (pipelined and cfg.n_dense_layers):
        return ()
    return (f"model.n_dense_layers={cfg.n_dense_layers}: a pipeline's stages need alike "
            f"layers, so the first {cfg.n_dense_layers} are modelled as MoE layers "
            f"(d_ff {cfg.d_ff} x {cfg.n_experts} experts, not a dense {cfg.dense_layers_d_ff}); "
            f"the parameter counts are the real model's",)


class Transformer(nnx.Module):
    """Token ids (B, L) -> logits (B, L, V) in float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, precision: Precision,
                 remat: str = "none", save: tuple[str, ...] = (),
                 offload: tuple[str, ...] = (), pipeline: Pipeline | None = None,
                 context_mode: str = "ring", offload_layers: int = 0):
        """`precision`: parameter, activation and matmul dtypes, quantised weights and KV
        cache (models/program.py). `remat`: each layer's checkpointing policy (with
        "custom", the checkpoint names to `save` in HBM and to `offload` to host memory).
        `pipeline`: the stages, microbatches and layer slots of a pipeline over the mesh axis
        the rules give the `layers` dimension (models/pipeline.py); None runs the layers
        directly. `context_mode`: how attention reaches the other positions when the rules
        split the sequence in training (models/context.py: "ring" or "allgather")."""
        if remat not in REMAT_POLICIES:
            raise ValueError(f"train.remat={remat!r} is not one of {tuple(REMAT_POLICIES)}")
        self.cfg = cfg
        self.precision = precision
        self.compute_dtype = DTYPES[precision.activations]
        self.remat = remat
        self.save, self.offload = tuple(save), tuple(offload)
        self.pipeline = pipeline
        self.context_mode = context_mode
        if offload_layers and (pipeline is not None or offload_layers >= cfg.n_layers):
            raise ValueError(f"train.offload_layers={offload_layers} needs fewer layers than "
                             f"model.n_layers={cfg.n_layers} and no pipeline")
        self.offload_layers = offload_layers
        param_dtype = DTYPES[precision.params]
        v, d = cfg.padded_vocab, cfg.d_model
        self.embed = new_param(rngs, (v, d), ("vocab", "embed"), dtype=param_dtype, scale=1.0)
        if cfg.positions == "learned":
            self.pos_embed = new_param(rngs, (cfg.max_seq_len, d), (None, "embed"),
                                       dtype=param_dtype, scale=0.02)

        # MoE models' dense first layers are a stack of their own before the rest; a
        # pipeline needs every slot alike, so there they are MoE layers (dense_layer_note)
        dense = cfg.n_dense_layers if pipeline is None else 0
        slots = cfg.n_layers - dense if pipeline is None else pipeline.slots
        if dense:
            self.dense_blocks = _stacked_blocks(cfg, rngs, precision, dense, dense=True)
        self.blocks = _stacked_blocks(cfg, rngs, precision, slots)
        self.final_norm = Norm(cfg, param_dtype=param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = new_weight(rngs, (d, v), ("embed", "vocab"), precision=precision)

    def __call__(self, tokens_BL):
        """Training forward: logits for every position, in `in_model_order` (the zigzag
        order of context parallelism when the rules split the sequence)."""
        return self.head(self.features(tokens_BL))

    def features(self, tokens_BL):
        """The last layer's output for every position (before the final norm and the
        output projection), in `in_model_order`; with a pipeline that hands its output to
        the loss split over its stages, the sequences microbatch-major (`in_output_order`)."""
        b, seq = tokens_BL.shape
        ranks = context_ranks()
        order = jnp.arange(seq) if ranks == 1 else jnp.asarray(zigzag_order(seq, ranks))
        tokens_BL = self.in_model_order(tokens_BL)
        positions_BL = jnp.broadcast_to(order, (b, seq))
        context = self.context_mode if ranks > 1 else None
        x_BLD, _ = self._layers(self._embed(tokens_BL, positions_BL, whole_table=True),
                                positions_BL, context=context)
        return x_BLD

    def in_model_order(self, x_BL):
        """Per-position values (tokens, targets) in the order training runs its positions:
        as given, or zigzag over the context-parallel ranks (models/context.py)."""
        ranks = context_ranks()
        if ranks == 1:
            return x_BL
        return constrain(x_BL[:, zigzag_order(x_BL.shape[1], ranks)], ("batch", "seq"))

    def in_output_order(self, x_BL):
        """Per-sequence values (targets) in the order `features` returns the sequences: as
        given, or microbatch-major where a pipeline hands its output to the loss split over
        its stages (models/pipeline.py)."""
        p = self.pipeline
        if p is None or not p.output_over_stages:
            return x_BL
        m = p.microbatches
        return x_BL.reshape(-1, m, *x_BL.shape[1:]).swapaxes(0, 1).reshape(x_BL.shape)

    @contextlib.contextmanager
    def loss_rules(self):
        """The rules the loss runs under: with a pipeline handing its output split over the
        stages, the batch split over them too (each stage's share of the logits on that
        stage, as Megatron's last stage computes only its own microbatches')."""
        p, rules, mesh = self.pipeline, active_rules(), active_mesh()
        if p is None or not p.output_over_stages or rules is None:
            yield
            return
        (axis,) = rules.mesh_axes("layers", params=True)
        with use_rules(rules.with_batch_over(axis), mesh):
            yield

    def prefill(self, tokens_BL):
        """Process prompts: (logits of the last position (B, V), the KV cache: (N, B, K, L,
        E) keys and values, or MLA's (N, B, L, U) latents as a 1-tuple)."""
        b, seq = tokens_BL.shape
        positions_BL = jnp.broadcast_to(jnp.arange(seq), (b, seq))
        x_BLD, kv = self._layers(self._embed(tokens_BL, positions_BL), positions_BL)
        logits_BV = self.head(x_BLD[:, -1:])[:, 0]
        if self.cfg.mla:
            return logits_BV, kv
        k_NBKLE, v_NBKLE = (jnp.swapaxes(a, 2, 3) for a in kv)  # cache layout
        quantized = self.precision.quantized_kv_cache
        if quantized is not None:
            with jax.named_scope("kv_cache_quantize"):
                k_NBKLE = quantize(k_NBKLE, quantized, (-1,))
                v_NBKLE = quantize(v_NBKLE, quantized, (-1,))
        return logits_BV, (k_NBKLE, v_NBKLE)

    def decode(self, tokens_B1, cache, index):
        """One new token per sequence at position `index` over a KV cache as prefill makes
        it (each array a (q, scale) pair when the cache is quantised): (logits (B, V), cache
        with the new position written)."""
        b = tokens_B1.shape[0]
        positions_B1 = jnp.full((b, 1), index)
        x_BLD, new = self._layers(self._embed(tokens_B1, positions_B1), positions_B1,
                                  (*cache, index))
        with jax.named_scope("kv_cache_write"):  # in place: only the new position is written
            if self.cfg.mla:
                (latent_NBSU,), (new_NB1U,) = cache, new
                cache = (jax.lax.dynamic_update_slice(
                    latent_NBSU, new_NB1U.astype(latent_NBSU.dtype), (0, 0, index, 0)),)
            else:
                quantized = self.precision.quantized_kv_cache
                cache = tuple(_write_cache(c_NBKSE, jnp.swapaxes(n_NB1KE, 2, 3), index,
                                           quantized) for c_NBKSE, n_NB1KE in zip(cache, new))
        return self.head(x_BLD)[:, 0], cache

    def _embed(self, tokens_BL, positions_BL, *, whole_table: bool = False):
        """The tokens' rows of the table (and learned positions'), in the compute dtype.
        `whole_table` (training): f32 master weights are cast whole before the lookup, as
        MaxText's Embed and Megatron's bf16 model copy do, so that an FSDP gather of the
        table and its gradient's reduction move 2-byte values (the other weights are cast
        before their matmuls the same way); serving casts the rows it reads."""
        cfg, dt = self.cfg, self.compute_dtype
        with jax.named_scope("embedding"):
            table_VD = self.embed[...]
            if whole_table and table_VD.dtype.itemsize > jnp.dtype(dt).itemsize:
                table_VD = table_VD.astype(dt)
            x_BLD = jnp.take(table_VD, tokens_BL, axis=0).astype(dt)
            if cfg.positions == "learned":
                x_BLD = x_BLD + jnp.take(self.pos_embed[...], positions_BL, axis=0).astype(dt)
            return constrain(x_BLD, ("batch", "residual_seq", "embed"))

    def _layers(self, x_BLD, positions_BL, cache=None, context: str | None = None):
        """Run the stacked layers under lax.scan (the dense first layers' stack, then the
        rest); `cache`: the per-layer cache arrays and the index. Returns (x, the per-layer
        cache entries computed, stacked)."""
        if self.pipeline is not None:
            if cache is not None:
                raise ValueError("pipeline parallelism serves no KV cache; use pipeline = 1")
            graphdef, layers = nnx.split(self.blocks)
            return self._pipelined(graphdef, layers, x_BLD, positions_BL, context), None
        per_layer = None if cache is None else cache[:-1]
        stacks = [self.blocks] if not hasattr(self, "dense_blocks") else [self.dense_blocks,
                                                                          self.blocks]
        start, outputs = 0, []
        for blocks in stacks:
            graphdef, layers = nnx.split(blocks)
            n = jax.tree.leaves(layers)[0].shape[0]

            def layer(x_BLD, xs, graphdef=graphdef):
                layer_state, layer_cache = xs
                if layer_cache is not None:
                    layer_cache = (*layer_cache, cache[-1])
                y_BLD, kv = nnx.merge(graphdef, layer_state)(x_BLD, positions_BL, layer_cache,
                                                             context)
                return constrain(y_BLD, ("batch", "residual_seq", "embed")), kv

            def part(tree, lo, hi, base=start):
                return None if tree is None else jax.tree.map(lambda a: a[lo - base:hi - base],
                                                              tree)
            # Megatron's CPU offloading of the first N layers: their saved tensors on the
            # host, the other layers as `remat` says.
            off = min(max(self.offload_layers - start, 0), n) if cache is None else 0
            if off:
                offloaded = checkpointed(layer, "custom", (), OFFLOAD_ALL)
                x_BLD, _ = jax.lax.scan(offloaded, x_BLD, (part(layers, start, start + off),
                                                           None))
            if off < n:
                kept = checkpointed(layer, self.remat, self.save, self.offload)
                x_BLD, kv = jax.lax.scan(kept, x_BLD, (part(layers, start + off, start + n),
                                                       part(per_layer, start + off, start + n,
                                                            base=0)))
                outputs.append(kv)
            start += n
        if len(outputs) == 1:
            return x_BLD, outputs[0]
        return x_BLD, jax.tree.map(lambda *a: jnp.concatenate(a), *outputs)

    def _pipelined(self, graphdef, layers, x_BLD, positions_BL, context):
        """The layers as a pipeline over the mesh axis that shards `layers`."""
        def slot(h, layer_state, pos):
            return nnx.merge(graphdef, layer_state)(h, pos, None, context)[0]

        slot = checkpointed(slot, self.remat, self.save, self.offload)

        def run_chunk(x, chunk_layers, valid_c, pos):
            def one(h, xs):  # a padded slot passes its input through
                layer_state, valid = xs
                return jnp.where(valid, slot(h, layer_state, pos), h), None
            return jax.lax.scan(one, x, (chunk_layers, valid_c))[0]

        mesh, rules = active_mesh(), active_rules()
        if mesh is None:
            raise ValueError("pipeline parallelism needs sharding rules with a mesh "
                             "(sharding.use_rules)")
        axes = rules.mesh_axes("layers", params=True)
        if len(axes) != 1:
            raise ValueError(f"pipeline parallelism needs the rule of 'layers' to name one mesh "
                             f"axis; it names {axes}")
        return run_pipeline(run_chunk, layers, x_BLD, positions_BL, plan=self.pipeline,
                            mesh=mesh, axis=axes[0], batch_axes=rules.mesh_axes("batch"),
                            seq_axes=rules.mesh_axes("residual_seq"))

    def head(self, x_BLD):
        """Logits (B, L, V) in float32 of the last layer's output."""
        return self.logits(x_BLD).astype(jnp.float32)

    def logits(self, x_BLD):
        """Logits (B, L, V) of the last layer's output, in the matmul's output dtype (the
        activations'): what a training loss reads (models/train.py)."""
        cfg = self.cfg
        with jax.named_scope("lm_head"):
            # The output layer stays in the activations' dtype under FP8 / FP4 recipes:
            # Megatron-Core's output_layer is a plain ColumnParallelLinear, outside
            # Transformer Engine's FP8 / FP4 autocast.
            head = dataclasses.replace(self.precision, compute=self.precision.activations)
            x_BLD = tensor_parallel_input(self.final_norm(x_BLD), head)  # vocab over tensor
            head_DV = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
            logits_BLV = project("bld,dv->blv", x_BLD, head_DV, precision=head)
            return constrain(logits_BLV, ("batch", "seq", "vocab"))


def logical_axes(state: nnx.State) -> dict:
    """Nested dict of logical axis names, parallel to `state`'s pure dict.

    Parameters under `blocks` (and `dense_blocks`) are stacked by `nnx.vmap` and gain the
    `layers` axis first.
    """
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        axes = tuple(var.get_metadata()["logical_axes"])
        if path and path[0] in ("blocks", "dense_blocks"):
            axes = ("layers", *axes)
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = axes
    return out
