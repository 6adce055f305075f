"""The training step (loss, value_and_grad, AdamW) and its sharded abstract arguments.

Everything is built with `nnx.eval_shape` / `jax.eval_shape`: a 405B model costs no memory.
Gradient accumulation follows MaxText and Megatron: the global batch is split into
`microbatches` sequential micro-steps whose gradients are summed before one update; each
micro-batch is sharded over the data-parallel axes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.transformer import Transformer, logical_axes
from sharding.rules import AxisRules, mesh_shape_of, resolve, use_rules

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSettings:
    seq_len: int
    global_batch: int
    microbatches: int = 1
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    remat: str = "full"
    learning_rate: float = 3e-4
    weight_decay: float = 0.1

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """A jitted train step and abstract, sharded arguments to lower it with."""

    step: object  # jax.jit-wrapped
    args: tuple
    param_count: int
    model_flops_per_step: float
    tokens_per_step: int
    param_bytes_per_device: int
    optimizer_bytes_per_device: int
    batch_bytes_per_device: int

    @property
    def state_bytes_per_device(self) -> int:
        return (self.param_bytes_per_device + self.optimizer_bytes_per_device
                + self.batch_bytes_per_device)


def make_model(cfg: ModelConfig, settings: TrainSettings, *, seed: int = 0,
               pipeline_stages: int = 1, quant: str | None = None,
               kv_quant: str | None = None) -> Transformer:
    """compute_dtype "float8" / "float4": FP8 / FP4 weight matmuls with bf16 activations.
    With pipeline stages, `settings.microbatches` are the pipeline's microbatches.
    `quant`, `kv_quant`: quantised weights and KV cache for serving (models/quant.py)."""
    lowp = settings.compute_dtype if settings.compute_dtype in ("float8", "float4") else None
    compute = jnp.bfloat16 if lowp else DTYPES[settings.compute_dtype]
    return Transformer(cfg, rngs=nnx.Rngs(seed), param_dtype=DTYPES[settings.param_dtype],
                       compute_dtype=compute, remat=settings.remat, lowp=lowp,
                       pipeline=(pipeline_stages, settings.microbatches), quant=quant,
                       kv_quant=kv_quant)


def loss_fn(model: Transformer, inputs_BL, targets_BL):
    logits_BLV = model(inputs_BL)
    with jax.named_scope("loss"):
        logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
        nll_BL = -jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
        return jnp.mean(nll_BL)


def make_optimizer(settings: TrainSettings) -> optax.GradientTransformation:
    return optax.adamw(settings.learning_rate, weight_decay=settings.weight_decay)


def make_train_step(graphdef, tx, settings: TrainSettings, rules=None, mesh=None, *,
                    accumulate: bool = True):
    """step(params, opt_state, batch) -> (params, opt_state, loss); params a pure dict.

    `accumulate=False`: the microbatches are the pipeline's, not gradient accumulation."""

    def grads_of(params, inputs_BL, targets_BL):
        return jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p), inputs_BL, targets_BL))(params)

    def step(params, opt_state, batch):
        inputs_BL, targets_BL = batch["inputs"], batch["targets"]
        k = settings.microbatches if accumulate else 1
        if k == 1:
            loss, grads = grads_of(params, inputs_BL, targets_BL)
        else:
            b = inputs_BL.shape[0] // k
            # (k, b, L): the micro-batch index leads, so each micro-batch stays sharded
            # over the data-parallel axes like a full batch of b.
            micro = jax.tree.map(lambda a: a.reshape(k, b, *a.shape[1:]), (inputs_BL, targets_BL))

            def add_microbatch(carry, mb):
                loss_sum, grad_sum = carry
                loss, grads = grads_of(params, *mb)
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            (loss, grads), _ = jax.lax.scan(add_microbatch, (jnp.zeros((), jnp.float32), zeros), micro)
            loss, grads = loss / k, jax.tree.map(lambda g: g / k, grads)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    if rules is None:
        return step

    def sharded_step(params, opt_state, batch):
        with use_rules(rules, mesh):
            return step(params, opt_state, batch)

    return sharded_step


def param_shardings(axes_tree, abstract_params, rules: AxisRules, mesh: Mesh):
    """NamedSharding per parameter; errors name the parameter path."""
    mesh_shape = mesh_shape_of(mesh)

    def one(path, names, leaf):
        what = "param " + "/".join(str(getattr(k, "key", k)) for k in path)
        return NamedSharding(mesh, resolve(names, leaf.shape, rules.params, mesh_shape, what=what))

    return jax.tree_util.tree_map_with_path(
        one, axes_tree, abstract_params, is_leaf=lambda x: isinstance(x, tuple))


def abstract_params(cfg: ModelConfig, settings: TrainSettings, mesh: Mesh, rules: AxisRules,
                    *, pipeline_stages: int = 1, quant: str | None = None,
                    kv_quant: str | None = None):
    """(graphdef, params as sharded ShapeDtypeStructs, their NamedShardings); no memory."""
    abstract_model = nnx.eval_shape(
        lambda: make_model(cfg, settings, pipeline_stages=pipeline_stages, quant=quant,
                           kv_quant=kv_quant))
    graphdef, state = nnx.split(abstract_model, nnx.Param)
    params = nnx.to_pure_dict(state)
    shardings = param_shardings(logical_axes(state), params, rules, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          params, shardings)
    return graphdef, params, shardings


def per_device_bytes(tree) -> int:
    """Bytes each device holds for a tree of sharded ShapeDtypeStructs."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def build_train_program(
    cfg: ModelConfig, settings: TrainSettings, mesh: Mesh, rules: AxisRules
) -> TrainProgram:
    """Abstract sharded params, optimizer state and batch, and the jitted train step."""
    mesh_shape = mesh_shape_of(mesh)
    k = settings.microbatches
    if settings.global_batch % k:
        raise ValueError(
            f"workload.global_batch={settings.global_batch} is not divisible by "
            f"workload.microbatches={k}; choose a number of microbatches that divides it"
        )
    stages = mesh_shape.get("pipeline", 1)
    if cfg.n_layers % stages:
        raise ValueError(f"parallelism.pipeline={stages} does not divide model.n_layers="
                         f"{cfg.n_layers}; each stage holds the same number of layers")
    graphdef, params, p_shard = abstract_params(cfg, settings, mesh, rules,
                                                pipeline_stages=stages)

    tx = make_optimizer(settings)
    opt_abstract = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shard = optax.tree_map_params(
        tx, lambda _, s: s, opt_abstract, p_shard, transform_non_params=lambda _: replicated)
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             opt_abstract, opt_shard)

    micro = settings.global_batch // k
    resolve(("batch", "seq"), (micro, settings.seq_len), rules.activations, mesh_shape,
            what=f"micro-batch of {micro} sequences (global_batch / microbatches)")
    batch_spec = resolve(("batch", "seq"), (settings.global_batch, settings.seq_len),
                         rules.activations, mesh_shape, what="batch")
    batch_sharding = NamedSharding(mesh, batch_spec)
    tokens = jax.ShapeDtypeStruct((settings.global_batch, settings.seq_len), jnp.int32,
                                  sharding=batch_sharding)
    batch = {"inputs": tokens, "targets": tokens}

    step = jax.jit(
        make_train_step(graphdef, tx, settings, rules, mesh, accumulate=stages == 1),
        in_shardings=(p_shard, opt_shard, {"inputs": batch_sharding, "targets": batch_sharding}),
        out_shardings=(p_shard, opt_shard, replicated),
        donate_argnums=(0, 1),
    )
    return TrainProgram(
        step=step,
        args=(params, opt_state, batch),
        param_count=cfg.param_count(),
        model_flops_per_step=cfg.train_flops_per_token(settings.seq_len) * settings.tokens_per_step,
        tokens_per_step=settings.tokens_per_step,
        param_bytes_per_device=per_device_bytes(params),
        optimizer_bytes_per_device=per_device_bytes(opt_state),
        batch_bytes_per_device=per_device_bytes(batch),
    )
