"""The hand-fused kernels of GPU training frameworks, found in the HLO by named scope.

Megatron / NeMo runs on GPUs do not leave their memory-bound work to a compiler: Transformer
Engine and cuDNN run one kernel per block -- RMSNorm / LayerNorm (writing its output already
quantised under FP8 / FP4), the MLP's activation (+ quantise), RoPE, the cast of an operand
to FP8 / FP4, and Megatron's fused cross-entropy. Each reads its inputs once and writes its
outputs once, whatever reductions it does inside (a norm's mean square, a quantise's amax,
a softmax's max and sum), where the first-order fusion model of sharding/traffic.py ends a
kernel at every reduction and reads its input again after it.

A model marks each such block with a named scope below (models/ wraps them); on a GPU
system sharding/traffic.py makes one kernel of the ops of one scope in one pass (forward,
recomputed or backward) of one call, and fuses a quantise into the norm or activation
that feeds it. TPU systems keep the compiler-style fusion: XLA's TPU fusions are what runs
there.
"""

from __future__ import annotations

import functools

from sharding.hlo import _WRAPPER, operation_of

NORM = "fused_norm"
ACTIVATION = "fused_activation"
ROPE = "fused_rope"
CROSS_ENTROPY = "fused_cross_entropy"
QUANTIZE = "fused_quantize"
# A weight's cast to FP8: Transformer Engine casts each weight once per step and keeps the
# FP8 copy for the step's other microbatches (its `is_first_microbatch`), where the compiled
# program casts it again at every use (sharding/gpu_frameworks.py: the share that runs).
QUANTIZE_WEIGHT = "fused_quantize_weight"
SCOPES = frozenset({NORM, ACTIVATION, ROPE, CROSS_ENTROPY, QUANTIZE, QUANTIZE_WEIGHT})
# A GEMM's output scaled by a per-channel vector (an FP8 checkpoint's weight scales, served
# W8A8): the GEMM's epilogue applies it (CUTLASS / cuBLASLt scale vectors), as it applies a
# per-tensor scalar, before a row-parallel layer's all-reduce (where the partitioned
# program may put it after); every op of the scope is the GEMM's (sharding/traffic.py
# `_in_epilogue`).
GEMM_EPILOGUE = "gemm_epilogue"
# Kernels that write their output quantised for the next matmul (Transformer Engine's
# LayerNormLinear and fused activation-cast kernels): a quantise they feed is theirs.
QUANTIZING = frozenset({NORM, ACTIVATION})


@functools.lru_cache(maxsize=65536)
def scope_key(op_name: str) -> tuple[str, str] | None:
    """(the fused scope, the call and pass it belongs to) of an op, or None outside every
    fused scope: `.../transpose(jvp())/.../mlp/fused_norm/mul` -> ("fused_norm",
    "mlp/fused_norm (backward)")."""
    if not op_name:
        return None
    parts = op_name.split("/")
    for i, part in enumerate(parts[:-1]):
        while (m := _WRAPPER.match(part)) is not None:
            part = m.group(1)
        if part in SCOPES:
            return part, operation_of("/".join(parts[:i + 1]) + "/op")
    return None


def scales_per_device(op_name: str) -> bool:
    """A quantise's amax reduction: Transformer Engine's FP8 current scaling scales each
    GPU's own tensor (its amax reduced only over the tensor-parallel group, where sequence
    parallelism gathers the quantised input), where a per-tensor scale in a GSPMD program
    all-reduces the amax over every shard."""
    key = scope_key(op_name)
    return key is not None and key[0] in (QUANTIZE, QUANTIZE_WEIGHT)


def casts_a_weight(op_name: str) -> bool:
    """An FP8 weight's cast (QUANTIZE_WEIGHT)."""
    key = scope_key(op_name)
    return key is not None and key[0] == QUANTIZE_WEIGHT


def fuses(src_key: tuple[str, str] | None, dst_key: tuple[str, str] | None) -> bool:
    """Whether a fused kernel's op `src` and its user `dst` (both in fused scopes, or
    one of them) are one kernel: the same scope call and pass, or a quantise of a norm's or
    activation's output."""
    if src_key is None or dst_key is None:
        return False
    return src_key == dst_key or (dst_key[0] == QUANTIZE and src_key[0] in QUANTIZING)
