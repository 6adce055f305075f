"""Flax NNX Transformers with logical axis names, their train and serving steps, presets.

Rooms:
- `config.py`: ModelConfig (the shape of a model) and the presets of real models.
- `program.py`: what a step is asked to run (Workload, Precision, Train: the config's
  [workload], [precision] and [train] tables) and the Program base.
- `layers.py`: parameter constructors, the weight matmul (bf16, FP8, FP4), the MLP.
- `attention.py`: dense and flash attention; `mla.py`: multi-head latent attention
  (DeepSeek); `moe.py`: the mixture-of-experts MLP; `transformer.py`: the decoder (blocks,
  scanned layers, prefill and decode).
- `hf.py`: a model from a Hugging Face config.json.
- `pipeline.py`: pipeline parallelism (1F1B, interleaved, GPipe; uneven stages) over the
  mesh axis of the `layers` dimension; `context.py`: context-parallel (ring / all-gather)
  attention over the axis that splits the sequence.
- `fp8.py`: FP8 and block-scaled FP4 matmuls; `quant.py`: quantised weights and KV cache.
- `train.py`: the train step (loss with vocabulary tiling, gradient accumulation,
  per-replica gradients) and its sharded arguments; `optimizer.py`: master weights, the
  gradients' dtype and the distributed optimizer; `inference.py`: prefill and decode with
  a KV cache.
- `memory.py`: memory per device, analytically, as the report's `sharding.Memory`.

Model code names logical axes only, never mesh axes (sharding/rules.py maps them).

Array names carry their shape as a suffix, one letter one meaning everywhere:

    B batch                 L query positions (the sequence)   S key/value (cache) positions
    D d_model               H query heads                      K kv heads
    G query heads per kv    E head_dim                         F MLP hidden
    V vocab                 N layers                           X experts
    R routing groups        T tokens in a routing group        A a token's expert choices
    C expert capacity       M microbatches                     P pipeline stages
    Y context-parallel ranks  Z the two zigzag halves of a rank's positions
    Q, U, W multi-head latent attention's query rank, latent and RoPE part (models/mla.py)

A lower-case letter is part of the dimension of its capital (b: one microbatch's batch);
a digit is a dimension of that size (B1: one position per sequence).
"""

from models.config import PRESETS, ModelConfig, preset
from models.optimizer import make_optimizer
from models.program import REMAT_POLICIES, Precision, Program, Train, Workload
from models.train import (
    TrainProgram,
    build_train_program,
    loss_fn,
    make_model,
    make_train_step,
    per_device_bytes,
)
from models.transformer import Transformer, logical_axes

__all__ = [
    "PRESETS",
    "REMAT_POLICIES",
    "ModelConfig",
    "Precision",
    "Program",
    "Train",
    "TrainProgram",
    "Transformer",
    "Workload",
    "build_train_program",
    "logical_axes",
    "loss_fn",
    "make_model",
    "make_optimizer",
    "make_train_step",
    "per_device_bytes",
    "preset",
]
