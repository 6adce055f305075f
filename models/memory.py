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
- one layer's working set during its backward pass: every intermediate of the layer and
  its gradient (the "none" set, twice);
- the logits and their gradient, f32 (B x L x V), sharded over the vocab's mesh axes.

Batch dimensions are sharded over data x fsdp x expert, the sequence over `sequence` (context
parallelism), heads and the MLP hidden over tensor; the residual stream is not sharded over
tensor (no Megatron sequence parallelism). Flash attention
keeps no S x S scores; its log-sum-exp (f32, B x H x L) is saved with the output.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from models.config import ModelConfig

_F32 = 4


def _activation_bytes(compute_dtype: str) -> int:
    # FP8 recipes keep activations in bf16 between matmuls.
    if compute_dtype.startswith(("float8", "float4")):
        return 2
    return jnp.dtype(compute_dtype).itemsize


def _batch_ways(mesh_shape: Mapping[str, int]) -> int:
    """Devices a batch is split over: data x fsdp x expert (the default rules)."""
    return (mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
            * mesh_shape.get("expert", 1))


def expert_slots_per_token(cfg: ModelConfig, local_tokens: int) -> float:
    """Expert-buffer rows per token: n_experts x capacity / group size (about
    experts_per_token x capacity_factor); 1 for a dense MLP."""
    if cfg.n_experts == 1:
        return 1.0
    from models.moe import capacity, group_size

    s = group_size(cfg, local_tokens)
    return cfg.n_experts * capacity(cfg, s) / s


def activation_components(
    cfg: ModelConfig,
    *,
    micro_batch: int,
    seq_len: int,
    compute_dtype: str,
    remat: str,
    mesh_shape: Mapping[str, int],
    layers: int | None = None,
) -> list[tuple[str, float]]:
    """(name, bytes per device) of the activation memory of one micro-batch over `layers`
    layers (all of them by default; a pipeline stage's share with pipeline parallelism)."""
    dp = _batch_ways(mesh_shape)
    tp = mesh_shape.get("tensor", 1)
    sp = mesh_shape.get("sequence", 1)
    c = _activation_bytes(compute_dtype)
    tokens = micro_batch // dp * seq_len // sp  # per device
    d, f, e = cfg.d_model, cfg.d_ff / tp, cfg.head_dim
    h, k = cfg.n_heads / tp, cfg.n_kv_heads / tp
    r = expert_slots_per_token(cfg, tokens)
    mlp_in = (2 if cfg.mlp == "swiglu" else 1) * f

    x = d * c
    # MoE: the expert buffers hold r slots per token (dispatched input, hidden, output).
    moe = 2 * r * d * c if cfg.n_experts > 1 else 0
    minimal = x + (h + 2 * k) * e * c + d * c + r * mlp_in * c + d * c + moe
    everything = minimal + 2 * d * c + h * e * c + h * _F32 + r * f * c + 2 * d * c
    per_layer = {"full": x, "minimal": minimal, "none": everything}[remat]
    vocab = cfg.padded_vocab / tp
    layers = cfg.n_layers if layers is None else layers
    return [
        (f"saved activations ({remat} remat, {layers} layers)",
         layers * tokens * per_layer),
        ("one layer's backward working set", 2 * tokens * everything),
        ("logits and their gradient (f32)", 2 * tokens * vocab * _F32),
    ]


def serving_activation_bytes(
    cfg: ModelConfig, *, batch: int, tokens: int, compute_dtype: str,
    mesh_shape: Mapping[str, int],
) -> float:
    """Peak activations of a forward pass with nothing saved for a backward pass: one
    layer's intermediates, and the f32 logits of the last position of each sequence."""
    dp = _batch_ways(mesh_shape)
    tp = mesh_shape.get("tensor", 1)
    c = _activation_bytes(compute_dtype)
    per_device_tokens = batch // dp * tokens // mesh_shape.get("sequence", 1)
    d, f, e = cfg.d_model, cfg.d_ff / tp, cfg.head_dim
    h, k = cfg.n_heads / tp, cfg.n_kv_heads / tp
    r = expert_slots_per_token(cfg, per_device_tokens)
    layer = (4 * d + (2 * h + 2 * k) * e + 3 * r * f + (2 * r * d if r != 1 else 0)) * c
    return per_device_tokens * layer + batch // dp * cfg.padded_vocab / tp * _F32
