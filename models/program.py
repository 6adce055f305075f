"""What a step is asked to run -- the workload, the precision, the training recipe -- and the
program built from them (training: models/train.py; serving: models/inference.py).

`Workload`, `Precision` and `Train` are the experiment config's [workload], [precision] and
[train] tables, field for field; each checks its own values. Everything else is derived
from them here, once (`Precision.activations`, `Precision.quantized_weights`, ...).
"""

from __future__ import annotations

import dataclasses
import difflib

import jax
import jax.numpy as jnp

from models.quant import STORAGE_DTYPES

WORKLOAD_KINDS = ("train", "prefill", "decode")
PARAM_DTYPES = ("float32", "bfloat16")
# "float8" / "float4": weight matmuls in FP8 / block-scaled FP4 (models/fp8.py), with
# activations in bfloat16 between them.
COMPUTE_DTYPES = ("bfloat16", "float32", "float8", "float4")
LOW_PRECISION_MATMULS = ("float8", "float4")
OPTIMIZERS = ("adamw",)
# Activation checkpointing policy of each decoder layer: what its backward pass finds saved.
# "minimal" saves what models/layers.py tags MATMUL_OUTPUT: the output of every matmul
# without batch dimensions (the projections, the router), which is what jax's
# `dots_with_no_batch_dims_saveable` would save, except that a name survives `jax.vmap`:
# under the data-parallel replicas' and the pipeline stages' vmaps every projection's dot
# gains a batch dimension, and that policy saved none of them ("minimal" ran as "full").
MATMUL_OUTPUT = "matmul_output"
REMAT_POLICIES = {
    "none": None,  # everything saved
    "minimal": jax.checkpoint_policies.save_only_these_names(MATMUL_OUTPUT),  # matmul outputs
    "full": jax.checkpoint_policies.nothing_saveable,  # only the layer's input
    "custom": None,  # the named tensors of Train.save (in HBM) and Train.offload (host)
}
# The tensors a "custom" policy can save or offload, by MaxText's names
# (`remat_policy: custom`): the layer input, the q/k/v projections (qkv_proj: all three),
# the attention output before and after its projection, the MLP's input and output matmuls.
CHECKPOINT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj",
                    "context", "out_proj", "mlpwi", "mlpwo")


# What a layer offloaded whole keeps on the host (train.offload_layers): every name but the
# three projections' alias.
OFFLOAD_ALL = tuple(n for n in CHECKPOINT_NAMES if n != "qkv_proj")


def expand_names(names) -> tuple[str, ...]:
    """`qkv_proj` is the three projections (this model does not fuse them)."""
    out: list[str] = []
    for n in names:
        out += ["query_proj", "key_proj", "value_proj"] if n == "qkv_proj" else [n]
    return tuple(dict.fromkeys(out))


def remat_policy(remat: str, save=(), offload=()):
    """The jax checkpoint policy of a remat setting (None: save everything)."""
    if remat != "custom":
        return REMAT_POLICIES[remat]
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(expand_names(save)),
        names_which_can_be_offloaded=list(expand_names(offload)),
        offload_src="device", offload_dst="pinned_host")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def described(help: str, default=dataclasses.MISSING, **kwargs):
    """A config field with its description: the config reference (`shardscope keys`,
    docs/config.md) is generated from these, so it cannot drift from the code."""
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def check_choice(key: str, value, valid) -> None:
    """A ValueError naming the key, the value and the valid choices."""
    if value not in valid:
        close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{key}={value!r} is not one of {', '.join(map(repr, valid))}{hint}")


def _check_count(key: str, value, minimum: int, what: str) -> None:
    """A ValueError naming the key and value unless it is a whole number >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{key}={value!r} must be {what}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """`[workload]`: what one step runs."""

    kind: str = described('"train", "prefill" (a forward pass over the prompt) or "decode" '
                          '(one new token per sequence with a KV cache)', "train")
    seq_len: int = described("tokens per sequence (prefill: the prompt; decode: the tokens "
                             "already in the KV cache)")
    global_batch: int = described("sequences per step (per optimizer step when training)")
    microbatches: int = described("gradient-accumulation steps per optimizer step, run one "
                                  "after another (also the pipeline's microbatches)", 1)

    def __post_init__(self):
        check_choice("workload.kind", self.kind, WORKLOAD_KINDS)
        if self.kind != "train" and self.microbatches != 1:
            raise ValueError(f"workload.microbatches={self.microbatches} applies to training "
                             f"only; remove it for workload.kind={self.kind!r}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens processed per step: every position when training or prefilling, one new
        token per sequence when decoding."""
        return self.global_batch * (1 if self.kind == "decode" else self.seq_len)

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.microbatches


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """`[precision]`: the dtypes of the parameters, the matmuls and (serving) the stored
    weights and KV cache."""

    params: str = described('the parameters\' dtype: "float32" or "bfloat16"', "float32")
    compute: str = described('the matmuls\' format: "bfloat16", "float32", "float8" (FP8 '
                             'weight matmuls, activations bf16 between them) or "float4" '
                             '(block-scaled FP4, Blackwell)', "bfloat16")
    weights: str = described('serving: store the weight matrices quantised with scales, '
                             '"int8", "float8" or "int4" ("" or "bfloat16": the parameters\' '
                             'dtype; "float8" where compute = "float8": quantised once at '
                             'load, as serving engines do)', "")
    kv_cache: str = described('serving: store the KV cache quantised, "int8", "float8" or '
                              '"int4" ("": the activations\' dtype)', "")
    master_weights: str = described(
        'training: "float32" keeps an fp32 master copy of bfloat16 parameters in the '
        'optimizer, which updates it and casts it back (Megatron --bf16, MaxText '
        'weight_dtype bfloat16 with an fp32 copy); "" updates the parameters themselves',
        "")
    grad_reduce: str = described(
        'training: the dtype gradients are accumulated over microbatches and summed over the '
        'data-parallel ranks in, "float32" (Megatron\'s main_grad, its default) or '
        '"bfloat16"; a step with one microbatch, no pipeline and no data-parallel axis '
        'that leaves the parameters whole (FSDP alone) is JAX\'s own, whose partitioner '
        'sums each gradient where it finds it (bf16 out of bf16 matmuls, as MaxText\'s '
        'FSDP does), whatever the parameters\' dtype', "float32")

    def __post_init__(self):
        check_choice("precision.params", self.params, PARAM_DTYPES)
        check_choice("precision.compute", self.compute, COMPUTE_DTYPES)
        if self.weights:
            check_choice("precision.weights", self.weights, (*STORAGE_DTYPES, "bfloat16"))
        if self.kv_cache:
            check_choice("precision.kv_cache", self.kv_cache, (*STORAGE_DTYPES, "bfloat16"))
        check_choice("precision.master_weights", self.master_weights, ("", "float32"))
        check_choice("precision.grad_reduce", self.grad_reduce, ("float32", "bfloat16"))
        if self.master_weights and self.params != "bfloat16":
            raise ValueError(f"precision.master_weights={self.master_weights!r} keeps an fp32 "
                             f"copy of bfloat16 parameters; precision.params="
                             f"{self.params!r} is already its own master: set params = "
                             f"\"bfloat16\" or master_weights = \"\"")

    @property
    def gradient_dtype(self) -> str:
        """What gradients are accumulated and reduced in: `grad_reduce`, never narrower than
        the parameters."""
        return "float32" if self.params == "float32" else self.grad_reduce

    @property
    def low_precision_matmuls(self) -> str | None:
        """"float8" | "float4" when the weight matmuls run in that format, else None."""
        return self.compute if self.compute in LOW_PRECISION_MATMULS else None

    @property
    def activations(self) -> str:
        """The activations' dtype: bf16 between low-precision matmuls, else `compute`."""
        return "bfloat16" if self.low_precision_matmuls else self.compute

    @property
    def quantized_weights(self) -> str | None:
        """The quantised storage of the weight matrices, or None."""
        return self.weights if self.weights in STORAGE_DTYPES else None

    @property
    def quantized_kv_cache(self) -> str | None:
        """The quantised storage of the KV cache, or None."""
        return self.kv_cache if self.kv_cache in STORAGE_DTYPES else None

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's storage: `kv_cache`, else the activations' dtype."""
        return self.kv_cache or self.activations


@dataclasses.dataclass(frozen=True, kw_only=True)
class Train:
    """`[train]`: the training recipe (ignored when serving)."""

    remat: str = described('what each decoder layer keeps for its backward pass: "full" '
                           '(only its input), "minimal" (matmul outputs), "none" '
                           '(everything), "custom" (the names in save / offload)', "full")
    save: tuple[str, ...] = described('with remat = "custom": tensors kept in HBM, by '
                                      'MaxText\'s names: ' + ", ".join(CHECKPOINT_NAMES), ())
    offload: tuple[str, ...] = described('with remat = "custom": tensors moved to host memory '
                                         'between the forward and backward pass (same names)',
                                         ())
    shard_optimizer_over_data: bool = described(
        "the optimizer state and master weights sharded over the data-parallel (and "
        "context-parallel) ranks, MaxText's name for Megatron's distributed optimizer "
        "(ZeRO-1): gradients reduce-scattered to each rank's shard, the updated parameters "
        "all-gathered", False)
    overlap_grad_reduce: bool = described(
        "Megatron's overlap_grad_reduce (NeMo 1: overlap_grad_sync): on GPU systems the "
        "step's data-parallel gradient sum runs in chunks (buckets; a pipeline's virtual "
        "stages) as the backward produces them, one chunk left exposed", False)
    overlap_param_gather: bool = described(
        "Megatron's overlap_param_gather (NeMo 1: overlap_param_sync), with "
        "shard_optimizer_over_data: on GPU systems the updated parameters' all-gather runs "
        "in chunks under the next step's forward, one chunk left exposed", False)
    bucket_size: int = described(
        "parameters per data-parallel gradient bucket on GPU systems (Megatron's "
        "--ddp-bucket-size); 0: Megatron's default, max(40M, 1M x data-parallel ranks)", 0)
    num_vocab_tiling: int = described(
        "the loss computed over this many tiles of the tokens (MaxText's vocabulary "
        "tiling): one tile's logits and their gradient live at a time, recomputed in the "
        "backward pass", 1)
    offload_layers: int = described(
        "the first N layers' saved activations moved to host memory between the forward and "
        "backward pass (every checkpoint name offloaded, the rest recomputed), Megatron's "
        "cpu_offloading_num_layers; the other layers keep `remat`", 0)
    optimizer: str = described('"adamw"', "adamw")
    learning_rate: float = described("AdamW's learning rate", 3e-4)
    weight_decay: float = described("AdamW's weight decay", 0.1)

    def __post_init__(self):
        check_choice("train.remat", self.remat, tuple(REMAT_POLICIES))
        check_choice("train.optimizer", self.optimizer, OPTIMIZERS)
        for key in ("shard_optimizer_over_data", "overlap_grad_reduce", "overlap_param_gather"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"train.{key}={getattr(self, key)!r} must be true or false")
        if self.overlap_param_gather and not self.shard_optimizer_over_data:
            raise ValueError("train.overlap_param_gather=true overlaps the distributed "
                             "optimizer's all-gather: set train.shard_optimizer_over_data=true "
                             "too, or overlap_param_gather=false (Megatron asks the same)")
        _check_count("train.bucket_size", self.bucket_size, 0,
                     "a whole number of parameters (0: Megatron's default)")
        _check_count("train.num_vocab_tiling", self.num_vocab_tiling, 1,
                     "a whole number of at least 1 (1: the whole logits at once)")
        for key in ("save", "offload"):
            names = getattr(self, key)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"train.{key}={names!r} must be a list of names, e.g. "
                                 f'["decoder_layer_input", "query_proj"]')
            object.__setattr__(self, key, tuple(names))
            for n in names:
                check_choice(f"train.{key} entry", n, CHECKPOINT_NAMES)
        if self.remat == "custom" and not (self.save or self.offload):
            raise ValueError('train.remat="custom" needs train.save or train.offload (names of '
                             f"tensors to keep or move to host; valid: "
                             f"{', '.join(CHECKPOINT_NAMES)})")
        if self.remat != "custom" and (self.save or self.offload):
            raise ValueError(f'train.save and train.offload apply to train.remat = "custom"; '
                             f"train.remat={self.remat!r}")
        _check_count("train.offload_layers", self.offload_layers, 0,
                     "a whole number of layers, 0 or more")
        both = set(expand_names(self.save)) & set(expand_names(self.offload))
        if both:
            raise ValueError(f"{', '.join(sorted(both))} cannot be both saved and offloaded; "
                             f"keep each name in one of train.save, train.offload")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    """A jitted step and abstract, sharded arguments to lower it with (nothing allocated),
    with what the estimate needs to know about it."""

    step: object  # jax.jit-wrapped
    args: tuple
    # what each of `args` is, in the step's order ("params", "opt_state", "batch"): a
    # reader finds an argument by its name, not by where this step happens to take it
    arg_names: tuple[str, ...]
    param_count: int
    model_flops_per_step: float
    tokens_per_step: int
    param_bytes_per_device: int
    # seed -> concrete arguments like `args` (the model's own initial weights, random
    # tokens), each with its sharding, built on the devices (`shardscope measure`)
    init: object = None

    def __post_init__(self):
        assert len(self.arg_names) == len(self.args), (self.arg_names, len(self.args))
