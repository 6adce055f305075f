"""Memory per device of a training step, analytically.

The CPU compiler's buffer assignment is not the target's: it upcasts bf16 activations to
f32 and schedules for a CPU. So the estimate counts what a TPU/GPU step holds at its peak
(the end of the forward pass / start of the backward pass of one micro-batch):

- parameters, optimizer state and the batch: exact, from their shardings;
- gradients: one parameter-sized buffer in the parameter dtype (accumulated across
  micro-batches), sharded like the parameters;
- saved activations, per layer, by remat policy, for one micro-batch:
  - full: the layer input x (B x L x D);
  - minimal (matmul outputs saved): x, q, k, v, the attention output projection, the MLP's
    up/gate outputs and its down projection;
  - none: also the norms, the attention output before projection, the MLP activation and
    the residual sums;
- one layer's working set during its backward pass: what it recomputes, the gradients in
  flight, flash attention's f32 gradient accumulators, and the layer's weights as the FSDP
  all-gather brings them;
- the logits and their gradient (B x L x V), sharded over the vocab's mesh axes, beside the
  unembedding's gathered weights.

Every split comes from the rule table (`AxisRules.ways`): the batch over the mesh axes of
`batch` (data x fsdp x expert by default), the sequence over those of `seq` (context
parallelism), heads, kv heads, the MLP hidden and the vocab over theirs (tensor); the
residual stream is split as `embed` is (not at all by default: no Megatron sequence
parallelism). Flash attention keeps no S x S scores; its log-sum-exp (f32, B x H x L) is
saved with the output. Dense attention (model.attention = "dense") keeps its S x S f32
exponentials and probabilities, and context parallelism each ring step's received keys and
values and partial outputs (`dense_score_bytes_per_token`, `context_step_bytes_per_token`).

The results are `sharding.Memory`, the report's type; the analysis attaches the compiler's
own figure to it for reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp

from models.config import ModelConfig
from models.inference import serving_rules
from models.moe import capacity, routing_group_size
from models.program import OFFLOAD_ALL, Precision, Train, Workload, expand_names
from models.train import TrainProgram
from sharding.report import Memory
from sharding.rules import AxisRules

_F32 = 4
# Bytes per element of a matmul input an FP8 / FP4 step keeps for the weight gradient.
QUANTISED_INPUT_BYTES = {"float8": 1.0, "float4": 0.5 + 1 / 32}


def _activation_bytes(precision: Precision) -> int:
    return jnp.dtype(precision.activations).itemsize


def expert_slots_per_token(cfg: ModelConfig, local_tokens: int) -> float:
    """Expert-buffer rows per token: n_experts x capacity / group size (about
    experts_per_token x capacity_factor); 1 for a dense MLP."""
    if cfg.n_experts == 1:
        return 1.0
    s = routing_group_size(cfg, local_tokens)
    return cfg.n_experts * capacity(cfg, s) / s


def _splits(rules: AxisRules, mesh_shape: Mapping[str, int]) -> dict[str, int]:
    """Ways each logical axis of an activation splits."""
    ways = {a: rules.ways(a, mesh_shape)
            for a in ("batch", "seq", "heads", "kv_heads", "mlp", "vocab", "embed")}
    # Sequence parallelism: the residual stream is split further than the positions of
    # the tensor-parallel regions (those are counted per token of `seq`).
    ways["residual"] = rules.ways("residual_seq", mesh_shape) // ways["seq"]
    return ways


def attention_widths(cfg: ModelConfig, ways: Mapping[str, int]
                     ) -> tuple[float, float, float, float]:
    """Values per token and device of a layer's (queries, keys, values, attention output).
    Multi-head latent attention: every head its own key and value, queries and keys
    head_dim + qk_rope wide, values v_head_dim; its latents (not split by heads) are counted
    with the queries."""
    h, k = cfg.n_heads / ways["heads"], cfg.n_kv_heads / ways["kv_heads"]
    if not cfg.mla:
        e = cfg.head_dim
        return h * e, k * e, k * e, h * e
    latent = cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_dim
    v = h * cfg.value_head_dim
    return h * cfg.qk_head_dim + latent, h * cfg.qk_head_dim, v, v


def dense_score_bytes_per_token(cfg: ModelConfig, *, heads: float, seq_len: int,
                                precision: Precision) -> tuple[float, float]:
    """Dense attention's S x S tensors (model.attention = "dense", models/attention.py
    dense_attention), bytes per query position and device: (what its backward reads, what
    its backward makes). Every query meets all `seq_len` keys (the program masks the causal
    half, it does not skip it), `heads` of them per device. The backward reads the f32
    exponentials (softmax's derivative as JAX takes it) and the probabilities in the
    activations' dtype (the values' matmul operand), and makes the probabilities' gradient
    and the scores' gradient in the activations' dtype. (0, 0) for flash and tiled
    attention, which hold one tile at a time."""
    if cfg.attention != "dense":
        return 0.0, 0.0
    c = _activation_bytes(precision)
    scores = heads * seq_len
    return scores * (_F32 + c), scores * 2 * c


def context_step_bytes_per_token(cfg: ModelConfig, *, ways: Mapping[str, int],
                                 precision: Precision, context_mode: str
                                 ) -> tuple[float, float]:
    """Context parallelism over Y = ways["seq"] ranks (models/context.py), bytes per local
    token and device: (what the Y - 1 steps after a rank's own keep for the backward, all
    of them; the keys' and values' gradient in flight in the backward).

    At each step a rank holds the K and V it received (both zigzag halves; all-gather:
    its slice of the gathered copy, the same bytes) and, for the half of its queries the
    step's second block serves: the selected query half, the two flash blocks' outputs
    (activation dtype) and the three f32 running outputs the merges read, with the blocks'
    two log-sum-exps and the merges' six f32 weights (one a head and query each). Step 0
    is about a plain flash attention's, already counted. In the backward the keys' and
    values' gradient travels back one step at a time (ring) or is summed over every rank's
    copy before its reduce-scatter (all-gather: Y ranks' worth)."""
    y = ways["seq"]
    if y == 1:
        return 0.0, 0.0
    c = _activation_bytes(precision)
    h = cfg.n_heads / ways["heads"]
    _, k, v, o = attention_widths(cfg, ways)
    step = (k + v) * c + o / 2 * (3 * c + 3 * _F32) + h / 2 * 8 * _F32
    return (y - 1) * step, (k + v) * c * (y if context_mode == "allgather" else 1)


def named_bytes_per_token(cfg: ModelConfig, names, *, precision: Precision,
                          mesh_shape: Mapping[str, int], rules: AxisRules,
                          local_tokens: int) -> float:
    """Bytes per token and device of the named checkpoints of one layer
    (models/program.py CHECKPOINT_NAMES; `qkv_proj` is the three projections)."""
    ways = _splits(rules, mesh_shape)
    c = _activation_bytes(precision)
    d, f = cfg.d_model / ways["embed"], cfg.d_ff / ways["mlp"]
    q, k, v, o = attention_widths(cfg, ways)
    r = expert_slots_per_token(cfg, local_tokens)
    dr = d / ways["residual"]  # the residual stream's share
    gates = 2 if cfg.mlp == "swiglu" else 1
    # "mlpwi": the routed experts' gate/up outputs and the shared experts' (one dense MLP
    # of n_shared_experts x d_ff, models/moe.py). "mlpwo": a down projection's output is
    # kept only where the backward reads it: the routed experts', whose router-weighted
    # combine needs it for the weights' gradient; a dense MLP's and the shared experts' are
    # summed into the layer's output, read by nothing (saving the name keeps nothing:
    # XLA's buffer assignment is the same with and without it).
    size = {"decoder_layer_input": dr, "query_proj": q, "key_proj": k,
            "value_proj": v, "context": o, "out_proj": dr,
            "mlpwi": (r + cfg.n_shared_experts) * gates * f if cfg.n_experts > 1
            else gates * f,
            "mlpwo": r * d if cfg.n_experts > 1 else 0.0}
    return sum(size[n] for n in expand_names(names)) * c


def dense_layer_config(cfg: ModelConfig) -> ModelConfig:
    """A MoE model's dense first layers (model.n_dense_layers) as a dense model's layers:
    one MLP of dense_d_ff, no experts."""
    return dataclasses.replace(cfg, n_experts=1, experts_per_token=1, n_shared_experts=0,
                               n_dense_layers=0, dense_d_ff=0, d_ff=cfg.dense_layers_d_ff)


def local_tokens(workload: Workload, rules: AxisRules, mesh_shape: Mapping[str, int],
                 micro_batch: int | None = None) -> int:
    """Tokens of one micro-batch on one device."""
    mb = workload.micro_batch if micro_batch is None else micro_batch
    return mb // rules.ways("batch", mesh_shape) * workload.seq_len // rules.ways(
        "seq", mesh_shape)


def offload_bytes_per_step(cfg: ModelConfig, *, workload: Workload, precision: Precision,
                           train: Train, mesh_shape: Mapping[str, int],
                           rules: AxisRules) -> float:
    """Bytes per device and step between HBM and host memory under a "custom" remat policy:
    every offloaded tensor of every layer goes out in the forward pass and comes back in the
    backward pass, for each micro-batch."""
    if not train.offload and not train.offload_layers:
        return 0.0
    tokens = local_tokens(workload, rules, mesh_shape)

    def per_token(names, layer_cfg=cfg):
        return named_bytes_per_token(layer_cfg, names, precision=precision,
                                     mesh_shape=mesh_shape, rules=rules,
                                     local_tokens=tokens) if names else 0.0

    stages = rules.ways("layers", mesh_shape, params=True)
    layers = cfg.n_layers / stages  # this stage's
    # the first offload_layers layers offload every name; the others, train.offload
    moved = (train.offload_layers * per_token(OFFLOAD_ALL)
             + (layers - train.offload_layers) * per_token(train.offload))
    if cfg.n_dense_layers and stages == 1:  # (a pipeline runs them as MoE layers)
        # the first layers are dense: a dense layer's tensors in place of a MoE layer's
        dense, whole = dense_layer_config(cfg), min(cfg.n_dense_layers, train.offload_layers)
        rest = cfg.n_dense_layers - whole
        moved += whole * (per_token(OFFLOAD_ALL, dense) - per_token(OFFLOAD_ALL)) \
            + rest * (per_token(train.offload, dense) - per_token(train.offload))
    return 2 * moved * tokens * workload.microbatches


def gathered_weight_bytes(cfg: ModelConfig, *, precision: Precision,
                          mesh_shape: Mapping[str, int], rules: AxisRules
                          ) -> tuple[float, float]:
    """(one layer's weights, the unembedding's) per device as the matmuls read them after
    the FSDP all-gather, in the activations' dtype (the weights are cast, then gathered);
    (0, 0) when the weights are not sharded further than the matmuls use them. Tensor (and
    expert) parallelism keeps its share: only the FSDP ways are gathered."""
    ways = _splits(rules, mesh_shape)
    if rules.ways("embed", mesh_shape, params=True) <= ways["embed"]:
        return 0.0, 0.0
    c = _activation_bytes(precision)
    d, mats = cfg.d_model, 3 if cfg.mlp == "swiglu" else 2
    experts = cfg.n_experts / rules.ways("experts", mesh_shape, params=True)
    # the largest layer's: a MoE layer's experts, or the dense first layers' MLP
    mlp = mats * d * max(cfg.d_ff * experts, cfg.dense_layers_d_ff if cfg.n_dense_layers
                         else 0) / ways["mlp"]
    layer = (cfg.attention_param_count() / ways["heads"] + mlp) * c
    return layer, d * cfg.padded_vocab / ways["vocab"] * c


def activation_components(
    cfg: ModelConfig,
    *,
    micro_batch: int,
    seq_len: int,
    precision: Precision,
    remat: str,
    mesh_shape: Mapping[str, int],
    rules: AxisRules,
    layers: int | None = None,
    save: tuple[str, ...] = (),
    vocab_tiles: int = 1,
    offloaded_layers: int = 0,
    fuses_matmul_inputs: bool = False,
    dense_layers: int = 0,
    offload: tuple[str, ...] = (),
    context_mode: str = "ring",
) -> list[tuple[str, float]]:
    """(name, bytes per device) of the activation memory of one micro-batch over `layers`
    layers (all of them by default; a pipeline stage's share with pipeline parallelism).
    With "custom" remat only the `save` names stay in HBM (offloaded ones are in host
    memory). `fuses_matmul_inputs`: the compiler fuses an elementwise producer into a matmul's
    operand (the TPU compiler's `convolution_maximum_fusion`), so a recomputed MLP activation
    is never held in HBM. `offload`: with "custom" remat, the names moved to host memory
    (the layer input a scan keeps, unless offloaded). `context_mode`: context parallelism's
    exchange ("ring" or "allgather") when `seq` is split (the program's: models/context.py)."""
    ways = _splits(rules, mesh_shape)
    c = _activation_bytes(precision)
    tokens = micro_batch // ways["batch"] * seq_len // ways["seq"]  # per device
    d, f = cfg.d_model / ways["embed"], cfg.d_ff / ways["mlp"]
    h = cfg.n_heads / ways["heads"]
    q, k, v, o = attention_widths(cfg, ways)
    r = expert_slots_per_token(cfg, tokens)  # a MoE layer's (`dense_layers` apart below)
    gates = 2 if cfg.mlp == "swiglu" else 1
    mlp_in = gates * f

    dr = d / ways["residual"]  # the residual stream's share (sequence parallelism)
    x = dr * c
    # MoE: the expert buffers hold r slots per token (dispatched input, hidden, output).
    moe = 2 * r * d * c if cfg.n_experts > 1 else 0
    # What a layer's backward pass needs, per token: the inputs of its two norms (x, x +
    # attention) and of its matmuls (the norms' outputs, the attention output, the MLP's
    # activation), q, k, v after RoPE, the attention output with its f32 log-sum-exp (flash
    # attention's residuals), the MLP's gate and up outputs. Nothing else: a residual sum's
    # gradient needs no input, a matmul's output is no residual of it. FP8 and FP4 matmuls
    # keep their inputs quantised (models/fp8.py, as Transformer Engine does: FP8 1 byte;
    # FP4 half a byte and a 1-byte scale per 32), and the attention output then once more
    # beside its bf16 copy.
    # A MoE layer's shared experts (one dense MLP, n_shared_experts x d_ff wide) keep their
    # gate/up outputs and activation as the routed ones do.
    shared_f = cfg.n_shared_experts * f if cfg.n_experts > 1 else 0.0
    mlp_in_all = (r * f + shared_f) * gates
    # Dense attention keeps its S x S exponentials and probabilities, and two f32 row
    # statistics where flash keeps its log-sum-exp; a context-parallel step keeps what it
    # received and its partial results (neither with context parallelism and dense: its
    # blocks are flash blocks).
    context, context_grad = context_step_bytes_per_token(
        cfg, ways=ways, precision=precision, context_mode=context_mode)
    scores, scores_grad = (0.0, 0.0) if ways["seq"] > 1 else dense_score_bytes_per_token(
        cfg, heads=h, seq_len=seq_len, precision=precision)
    row_stats = h * _F32 * (2 if scores else 1)
    q8 = QUANTISED_INPUT_BYTES.get(precision.low_precision_matmuls, c)
    everything = ((2 * dr + q + k + v + o + mlp_in_all) * c + row_stats + moe
                  + (2 * dr + r * f + shared_f) * q8 + (o * q8 if q8 != c else 0)
                  + scores + context)
    # Saved by "minimal" (models/program.py MATMUL_OUTPUT): every weight matmul's output
    # and the scanned layer's input.
    # A routed expert's matmuls have the expert as a batch dimension, so of a MoE layer's
    # MLP "minimal" keeps the router's f32 logits and the shared experts' outputs; the
    # experts' buffers and the dispatch are recomputed (the program's choice, and
    # MaxText's, whose expert matmuls are no plain dots).
    if cfg.n_experts > 1:
        shared = shared_f * gates
        mlp_saved = cfg.n_experts * _F32 + ((shared + dr) * c if shared else 0)
    else:
        mlp_saved = (r * mlp_in + dr) * c
    minimal = x + (q + k + v) * c + dr * c + mlp_saved
    # the layer scan keeps each layer's input for its backward, named or not, unless it is
    # offloaded (XLA's buffer assignment holds it with save = ["context"] alone)
    kept = save if "decoder_layer_input" in offload else ("decoder_layer_input", *save)
    custom = named_bytes_per_token(cfg, kept, precision=precision, mesh_shape=mesh_shape,
                                   rules=rules, local_tokens=tokens)
    per_layer = {"full": x, "minimal": minimal, "none": everything, "custom": custom}[remat]
    # A layer's backward holds what it recomputes of those (none with nothing to recompute)
    # and its gradients in flight: the MLP's, the largest (its gate's and up's: the hidden's
    # gradient becomes them in place, as the TPU compiler's buffer assignment shows, with 4
    # hidden-sized buffers at the peak), and the layer's input and output gradients.
    # (a layer offloaded whole recomputes all it did not offload)
    recomputed = everything - (0 if offloaded_layers else per_layer) if remat != "none" \
        or offloaded_layers else 0.0
    if fuses_matmul_inputs and q8 == c:
        recomputed -= r * f * c  # the activation, fused into the down projection's operand
    recomputed = max(0.0, recomputed)
    # ... and the attention's f32 gradient accumulators (q's, k's and v's: flash
    # attention's backward adds each tile's share into them), and the layer's weights as
    # the FSDP all-gather brings them
    layer_weights, unembedding = gathered_weight_bytes(cfg, precision=precision,
                                                       mesh_shape=mesh_shape, rules=rules)
    # (dense attention's: its matmuls' outputs, and the S x S gradients it makes; context
    # parallelism's: the keys' and values' gradient passed between steps)
    in_flight = ((r * mlp_in + 2 * dr) * c + (q + k + v) * (c if scores else _F32)
                 + scores_grad + context_grad)
    vocab = cfg.padded_vocab / ways["vocab"]
    layers = cfg.n_layers if layers is None else layers
    tiles = f", one of {vocab_tiles} tiles" if vocab_tiles > 1 else ""
    saved = (layers - dense_layers) * tokens * per_layer
    if dense_layers:  # a MoE model's dense first layers keep a dense layer's tensors
        saved += activation_components(
            dense_layer_config(cfg), micro_batch=micro_batch, seq_len=seq_len,
            precision=precision, remat=remat, mesh_shape=mesh_shape, rules=rules,
            layers=dense_layers, save=save, vocab_tiles=vocab_tiles,
            fuses_matmul_inputs=fuses_matmul_inputs, offload=offload,
            context_mode=context_mode)[0][1]
    return [
        (f"saved activations ({'no' if remat == 'none' else remat} remat, {layers} layers)",
         saved),
        ("one layer's backward working set",
         tokens * (recomputed + in_flight) + layer_weights),
        # the logits as the output projection made them, kept for the loss's backward pass
        # (models/train.py cross_entropy, whose f32 softmax fuses into its reductions), and
        # their gradient, the projection's backward operand, beside its gathered weights
        (f"logits and their gradient{tiles}",
         tokens / vocab_tiles * vocab * 2 * c + unembedding),
    ]


def training_memory(cfg: ModelConfig, program: TrainProgram, *, workload: Workload,
                    precision: Precision, train: Train, mesh_shape: Mapping[str, int],
                    rules: AxisRules, fuses_matmul_inputs: bool = False,
                    context_mode: str = "ring") -> Memory:
    """Memory per device of a training step: exact state, analytic activations
    (`fuses_matmul_inputs`, `context_mode`: see activation_components)."""
    plan = program.pipeline
    if plan is None:
        # the first offload_layers layers keep nothing in HBM (models/transformer.py)
        activations = activation_components(
            cfg, micro_batch=workload.micro_batch, seq_len=workload.seq_len,
            precision=precision, remat=train.remat, mesh_shape=mesh_shape, rules=rules,
            save=train.save, vocab_tiles=train.num_vocab_tiling,
            layers=cfg.n_layers - train.offload_layers,
            offloaded_layers=train.offload_layers, fuses_matmul_inputs=fuses_matmul_inputs,
            # the offloaded layers are the first ones, the dense ones first among them (a
            # pipeline's program runs its dense layers as MoE ones: models/transformer.py)
            dense_layers=max(0, cfg.n_dense_layers - train.offload_layers),
            offload=train.offload, context_mode=context_mode)
    else:
        # A stage holds the activations of its own layer slots for the microbatches its
        # schedule keeps in flight (models/pipeline.py: Pipeline.in_flight).
        saved, *rest = activation_components(
            cfg, micro_batch=workload.micro_batch, seq_len=workload.seq_len,
            precision=precision, remat=train.remat, mesh_shape=mesh_shape, rules=rules,
            layers=plan.slots_per_stage, save=train.save, vocab_tiles=train.num_vocab_tiling,
            fuses_matmul_inputs=fuses_matmul_inputs, offload=train.offload,
            context_mode=context_mode)
        activations = [(f"{saved[0][:-1]}, {plan.in_flight:g} microbatches in flight)",
                        saved[1] * plan.in_flight), *rest]
    # The loss's logits live at the end of the forward pass, a layer's backward working set
    # after they are freed: the peak holds the larger of the two beside what persists.
    saved, working, logits = activations
    peak, other = (working, logits) if working[1] >= logits[1] else (logits, working)
    components = [
        ("parameters", float(program.param_bytes_per_device)),
        ("optimizer state", float(program.optimizer_bytes_per_device)),
        ("gradients", float(program.gradient_bytes_per_device)),
        ("batch", float(program.batch_bytes_per_device)),
        saved, peak,
    ]
    return Memory(components=tuple(components),
                  source="state exact from shardings; activations analytic (models/memory.py)",
                  notes=(f"not at the peak: {other[0]}, {other[1] / 1e9:.2f} GB (live at "
                         f"another time than the {peak[0]})",))


def serving_activation_bytes(cfg: ModelConfig, *, workload: Workload, precision: Precision,
                             mesh_shape: Mapping[str, int], rules: AxisRules) -> float:
    """Peak activations of a forward pass with nothing saved for a backward pass: one
    layer's intermediates, and the f32 logits of the last position of each sequence."""
    ways = _splits(serving_rules(rules, workload.kind), mesh_shape)
    c = _activation_bytes(precision)
    tokens = workload.seq_len if workload.kind == "prefill" else 1
    local_batch = workload.global_batch // ways["batch"]
    per_device_tokens = local_batch * tokens // ways["seq"]
    d, f = cfg.d_model / ways["embed"], cfg.d_ff / ways["mlp"]
    r = expert_slots_per_token(cfg, per_device_tokens)
    layer = (4 * d + sum(attention_widths(cfg, ways)) + 3 * r * f
             + (2 * r * d if r != 1 else 0)) * c
    if workload.kind == "prefill" and cfg.attention == "dense":
        # dense attention's S x S tensors at once: the scores as the matmul writes them,
        # their f32 exponentials and the probabilities, every query against all seq_len
        # keys (a decode step's one query reads its cache: kv_cache_attention)
        layer += cfg.n_heads / ways["heads"] * workload.seq_len * (2 * c + _F32)
    return per_device_tokens * layer + local_batch * cfg.padded_vocab / ways["vocab"] * _F32


def serving_memory(cfg: ModelConfig, program, *, workload: Workload, precision: Precision,
                   mesh_shape: Mapping[str, int], rules: AxisRules) -> Memory:
    """Weights and KV cache exactly from their shardings; one layer's activations."""
    activations = serving_activation_bytes(cfg, workload=workload, precision=precision,
                                           mesh_shape=mesh_shape, rules=rules)
    return Memory(components=(
        ("parameters", float(program.param_bytes_per_device)),
        ("KV cache", float(program.cache_bytes_per_device)),
        ("one layer's activations and the logits", activations),
    ), source="weights and KV cache exact from shardings; activations analytic")
