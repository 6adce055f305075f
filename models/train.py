"""The training step (loss, value_and_grad, AdamW) and its sharded abstract arguments.

Everything is built with `nnx.eval_shape` / `jax.eval_shape`: a 405B model costs no memory.
Gradient accumulation follows MaxText and Megatron: the global batch is split into
`microbatches` sequential micro-steps whose gradients are summed before one update; each
micro-batch is sharded over the data-parallel axes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import kernels
from models.config import ModelConfig
from models.context import RankCopies, rank_copies
from models.optimizer import (
    apply_gradients,
    init_state,
    make_optimizer,
    state_shardings,
    state_specs,
)
from models.pipeline import Pipeline, on_stages
from models.program import DTYPES, Precision, Program, Train, Workload
from models.transformer import Transformer, logical_axes
from sharding import gpu_frameworks
from sharding.rules import (
    AxisRules,
    active_mesh,
    active_rules,
    mesh_shape_of,
    resolve,
    use_rules,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainProgram(Program):
    """A training step: the parameters, optimizer state and batch it takes."""

    optimizer_bytes_per_device: int
    batch_bytes_per_device: int
    # the gradients, in the dtype they are accumulated and reduced in, sharded like the
    # parameters (the distributed optimizer splits the state, not this buffer: ZeRO-1)
    gradient_bytes_per_device: int = 0
    pipeline: Pipeline | None = None

    @property
    def state_bytes_per_device(self) -> int:
        return (self.param_bytes_per_device + self.optimizer_bytes_per_device
                + self.batch_bytes_per_device)


def make_model(cfg: ModelConfig, precision: Precision, *, remat: str = "none",
               save: tuple[str, ...] = (), offload: tuple[str, ...] = (), seed: int = 0,
               pipeline: Pipeline | None = None, context_mode: str = "ring",
               offload_layers: int = 0) -> Transformer:
    """The model with `precision`'s dtypes; `remat` with its `save` / `offload` names;
    `pipeline`: its stages (models/pipeline.py), None without; `context_mode`: context
    parallelism's exchange (models/context.py)."""
    return Transformer(cfg, rngs=nnx.Rngs(seed), precision=precision, remat=remat, save=save,
                       offload=offload, pipeline=pipeline, context_mode=context_mode,
                       offload_layers=offload_layers)


def loss_fn(model: Transformer, inputs_BL, targets_BL, vocab_tiles: int = 1):
    """Mean next-token cross-entropy. `vocab_tiles` > 1: MaxText's vocabulary tiling, the
    logits and their loss computed tile by tile over the positions, each tile's logits
    recomputed in the backward pass, so that one tile's logits (not the whole batch's) are
    ever held."""
    x_BLD = model.features(inputs_BL)
    targets_BL = model.in_model_order(targets_BL)
    if model.pipeline is not None:
        return _output_stage_loss(model, x_BLD, targets_BL, vocab_tiles)
    return _tiled_loss(model, x_BLD, targets_BL, vocab_tiles)


def _output_stage_loss(model: Transformer, x_PMbLD, targets_BL, vocab_tiles: int):
    """A pipeline's mean loss, as Megatron's last stage computes it: the output layer and
    loss of one microbatch at a time, on the stage that holds the pipeline's output, with
    that stage's copy of the output weights (models/pipeline.py), each microbatch's
    backward right after its forward (`_mean_microbatch_loss`), so that one microbatch's
    logits are held at a time and none is recomputed. Every stage computes its own copy
    at once (SPMD); only the output stage's counts, so that the loss's scalar is the one
    value that crosses the stages."""
    plan = model.pipeline
    m = plan.microbatches
    t_MbL = targets_BL.reshape(-1, m, targets_BL.shape[1]).swapaxes(0, 1)

    def loss_of(x_bLD, weights, t_bL):  # one microbatch's (a function: no array of the
        return _tiled_loss(model, x_bLD, t_bL, vocab_tiles, weights=weights)  # model's)

    def one_stage(x_MbLD, weights, is_output):
        loss = _mean_microbatch_loss(loss_of, x_MbLD, t_MbL, weights)
        return jnp.where(is_output, loss, 0.0)

    return jnp.sum(on_stages(one_stage, x_PMbLD, model.stage_weights(),
                             axis=model.stage_axis(), stages=plan.stages))


def _losses_and_grads(loss_of, x_MbLD, t_MbL, weights):
    """(the mean of `loss_of(x_bLD, weights, t_bL)` over the microbatches, its gradients
    with respect to x_MbLD and to `weights`, one stage's output weights): a scan whose
    step runs one microbatch's output layer and loss forward and backward.

    Where context parallelism splits the positions, each rank runs its own positions
    with its own copy of the weights (`_per_position_rank`), so that the weights'
    gradients and the loss stay partial sums per rank through the scan and are summed
    over the ranks once, at its end (summed at every microbatch, the output weight's
    gradient would cross the ranks M times; Megatron sums it once per step)."""
    m = x_MbLD.shape[0]
    ranks, pin, losses_of = _per_position_rank(loss_of)
    weights_Y = jax.tree.map(lambda w: pin(jnp.broadcast_to(w, (ranks, *w.shape))), weights)

    def one(carry, xs):
        loss_Y, dw_Y = carry
        x_bLD, t_bL = xs
        (_, losses_Y), (dx_bLD, dw) = jax.value_and_grad(losses_of, argnums=(0, 1),
                                                         has_aux=True)(x_bLD, weights_Y, t_bL)
        dw_Y = jax.tree.map(lambda s, g: s + g.astype(s.dtype), dw_Y, dw)
        return (loss_Y + losses_Y, dw_Y), dx_bLD

    # the weights' gradients summed in f32 over the microbatches (Megatron's main_grad)
    zeros = jax.tree.map(lambda w: pin(jnp.zeros(w.shape, jnp.float32)), weights_Y)
    (loss_Y, dw_Y), dx_MbLD = jax.lax.scan(one, (jnp.zeros((ranks,), jnp.float32), zeros),
                                           (x_MbLD, t_MbL))
    n = m * ranks  # each rank's loss is the mean over its own positions
    dw = jax.tree.map(lambda s, w: (jnp.sum(s, axis=0) / n).astype(w.dtype), dw_Y, weights)
    return jnp.sum(loss_Y) / n, dx_MbLD / n, dw


def _per_position_rank(loss_of):
    """(Y: the ranks that split the positions (context parallelism; 1 without), a pin of
    a leading Y dimension over their mesh axes, `losses_of(x_bLD, weights_Y, t_bL)`: the
    sum over the ranks of `loss_of` on each rank's own positions with its own copy of
    the weights, and the (Y,) losses), as models/layers.per_context_rank runs a layer."""
    mesh, rules = active_mesh(), active_rules()
    shape = dict(mesh.shape) if mesh is not None else {}
    axes = rules.split_axes("seq", shape) if rules is not None else ()
    ranks = rules.ways("seq", shape) if axes else 1
    if ranks == 1:
        def whole(x_bLD, weights_Y, t_bL):
            loss = loss_of(x_bLD, jax.tree.map(lambda w: w[0], weights_Y), t_bL)
            return loss, loss[None]
        return 1, lambda x: x, whole

    def pin(x_Y):
        spec = PartitionSpec(axes, *[PartitionSpec.UNCONSTRAINED] * (x_Y.ndim - 1))
        return jax.lax.with_sharding_constraint(x_Y, NamedSharding(mesh, spec))

    def one_rank(x_blD, weights, t_bl):  # inside the vmap its axes place the ranks
        with use_rules(rules.without(axes), mesh):
            return loss_of(x_blD, weights, t_bl)

    def per_rank(x_bLD, weights_Y, t_bL):
        b, seq = t_bL.shape
        x_bYlD = x_bLD.reshape(b, ranks, seq // ranks, x_bLD.shape[-1])
        t_bYl = t_bL.reshape(b, ranks, seq // ranks)
        losses_Y = jax.vmap(one_rank, in_axes=(1, 0, 1), spmd_axis_name=axes)(
            x_bYlD, weights_Y, t_bYl)
        return jnp.sum(losses_Y), losses_Y

    return ranks, pin, per_rank


def _mean_microbatch_loss(loss_of, x_MbLD, t_MbL, weights):
    """The mean loss of the microbatches (`_losses_and_grads`); its gradients are made in
    the forward pass, one microbatch at a time, and scaled in the backward."""
    return _losses_and_grads(loss_of, x_MbLD, t_MbL, weights)[0]


def _mean_microbatch_loss_fwd(loss_of, x_MbLD, t_MbL, weights):
    loss, dx_MbLD, dw = _losses_and_grads(loss_of, x_MbLD, t_MbL, weights)
    return loss, (dx_MbLD, dw)


def _mean_microbatch_loss_bwd(loss_of, residuals, g):
    dx_MbLD, dw = residuals
    return (dx_MbLD * g.astype(dx_MbLD.dtype), None,
            jax.tree.map(lambda d: d * g.astype(d.dtype), dw))


_mean_microbatch_loss = jax.custom_vjp(_mean_microbatch_loss, nondiff_argnums=(0,))
_mean_microbatch_loss.defvjp(_mean_microbatch_loss_fwd, _mean_microbatch_loss_bwd)


def _tiled_loss(model: Transformer, x_BLD, targets_BL, vocab_tiles: int, weights=None):
    """The mean loss of the layers' output, whole or in `vocab_tiles` tiles (loss_fn);
    `weights`: a pipeline stage's output weights (Transformer.logits)."""
    if vocab_tiles == 1:
        return _mean_nll(model.logits(x_BLD, weights), targets_BL)
    b, seq, d = x_BLD.shape
    if seq % vocab_tiles:
        raise ValueError(f"train.num_vocab_tiling={vocab_tiles} does not divide "
                         f"workload.seq_len={seq}; choose a divisor of it")
    # Tile j takes every vocab_tiles-th position from j: the positions' own split over the
    # devices (context parallelism) stays as it is.
    x_TBlD = jnp.moveaxis(x_BLD.reshape(b, seq // vocab_tiles, vocab_tiles, d), 2, 0)
    t_TBl = jnp.moveaxis(targets_BL.reshape(b, seq // vocab_tiles, vocab_tiles), 2, 0)

    @jax.checkpoint
    def tile_loss(x_BlD, t_Bl):
        return _mean_nll(model.logits(x_BlD, weights), t_Bl)

    def add_tile(total, xs):
        return total + tile_loss(*xs), None

    total, _ = jax.lax.scan(add_tile, jnp.zeros((), jnp.float32), (x_TBlD, t_TBl))
    return total / vocab_tiles


def _mean_nll(logits_BLV, targets_BL):
    """Mean cross-entropy of logits in the activations' dtype, computed in f32."""
    with jax.named_scope("loss"):
        return jnp.mean(cross_entropy(logits_BLV, targets_BL))


@jax.custom_vjp
def cross_entropy(logits_BLV, targets_BL):
    """-log softmax(logits)[target] per position, in f32, as fused cross-entropy kernels
    (Transformer Engine's, XLA's fusion of MaxText's loss) compute it: the backward pass
    keeps only the logits as they came (bf16) and each position's f32 log-sum-exp, and
    recomputes the softmax from them, so no f32 copy of the logits outlives the loss."""
    return _cross_entropy_fwd(logits_BLV, targets_BL)[0]


@jax.named_scope(kernels.CROSS_ENTROPY)  # one kernel on GPUs (Megatron's)
def _cross_entropy_fwd(logits_BLV, targets_BL):
    # The f32 upcast feeds the reductions alone, so that it fuses into them instead of
    # becoming an f32 copy of the logits; the target's logit is picked in bf16.
    lse_BL = jax.nn.logsumexp(logits_BLV.astype(jnp.float32), axis=-1)
    target_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return lse_BL - target_BL.astype(jnp.float32), (logits_BLV, lse_BL, targets_BL)


@jax.named_scope(kernels.CROSS_ENTROPY)
def _cross_entropy_bwd(residuals, g_BL):
    logits_BLV, lse_BL, targets_BL = residuals
    p_BLV = jnp.exp(logits_BLV.astype(jnp.float32) - lse_BL[..., None])
    onehot_BLV = jax.nn.one_hot(targets_BL, logits_BLV.shape[-1], dtype=jnp.float32)
    d_BLV = (p_BLV - onehot_BLV) * g_BL[..., None]
    return d_BLV.astype(logits_BLV.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def make_train_step(graphdef, tx, *, microbatches: int = 1, rules: AxisRules | None = None,
                    mesh: Mesh | None = None, replicas: tuple[str, ...] = (),
                    param_specs=None, precision: Precision | None = None,
                    state_specs=None, vocab_tiles: int = 1, copies=None,
                    fused_kernels: bool = False):
    """step(params, opt_state, batch) -> (params, opt_state, loss); params a pure dict.

    `microbatches` > 1: gradient accumulation over that many sequential micro-steps (with
    pipeline parallelism the microbatches are the pipeline's instead: pass 1).
    `replicas`: data-parallel mesh axes over which the gradients are summed once per step
    (Megatron's DDP) rather than at every micro-step or pipeline tick: each replica keeps
    its own gradient until then (`_replica_grads`); needs the rules, the mesh and the
    parameters' PartitionSpecs (`param_specs`). `precision`: master weights and the
    gradients' dtype (models/optimizer.py); `state_specs`: the optimizer state's
    PartitionSpecs when the distributed optimizer splits it further than the parameters.
    `vocab_tiles`: the loss's vocabulary tiling (`loss_fn`). `copies`: path -> RankCopies
    of the layer weights the context-parallel ranks each hold (models/context.rank_copies),
    summed with the replicas' gradients. `fused_kernels`: see models/kernels.py."""
    precision = precision or Precision()
    grad_dtype = DTYPES[precision.gradient_dtype]
    reduced_specs = state_specs if state_specs is not None else param_specs

    def pin(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def grads_of(params, inputs_BL, targets_BL):
        return jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p), inputs_BL, targets_BL,
                              vocab_tiles))(params)

    def step(params, opt_state, batch):
        inputs_BL, targets_BL = batch["inputs"], batch["targets"]
        k = microbatches
        if replicas or copies:
            loss, grads = _replica_grads(graphdef, params, inputs_BL, targets_BL, k=k,
                                         rules=rules, mesh=mesh, replicas=replicas,
                                         param_specs=param_specs, grad_dtype=grad_dtype,
                                         out_specs=reduced_specs, vocab_tiles=vocab_tiles,
                                         copies=copies)
        elif k == 1:
            loss, grads = grads_of(params, inputs_BL, targets_BL)
            grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
        else:
            b = inputs_BL.shape[0] // k
            # (k, b, L): the micro-batch index leads, so each micro-batch stays sharded
            # over the data-parallel axes like a full batch of b.
            micro = jax.tree.map(lambda a: a.reshape(k, b, *a.shape[1:]), (inputs_BL, targets_BL))

            def add_microbatch(carry, mb):
                loss_sum, grad_sum = carry
                loss, grads = grads_of(params, *mb)
                grads = jax.tree.map(lambda s, g: s + g.astype(grad_dtype), grad_sum, grads)
                return (loss_sum + loss, grads), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, grad_dtype), params)
            init = (jnp.zeros((), jnp.float32), zeros)
            (loss, grads), _ = jax.lax.scan(add_microbatch, init, micro)
            loss, grads = loss / k, jax.tree.map(lambda g: g / k, grads)
        if mesh is not None and reduced_specs is not None:
            grads = jax.tree.map(pin, grads, reduced_specs)  # a reduce-scatter when split
        with jax.named_scope(gpu_frameworks.OPTIMIZER):
            params, opt_state = apply_gradients(
                tx, params, opt_state, grads, precision=precision,
                pin=pin if mesh is not None else None, param_specs=param_specs,
                state_specs=state_specs)
            return params, opt_state, loss

    if rules is None and not fused_kernels:
        return step

    def sharded_step(params, opt_state, batch):
        in_force = contextlib.nullcontext() if rules is None else use_rules(rules, mesh)
        with kernels.fused_kernels(fused_kernels), in_force:
            return step(params, opt_state, batch)

    return sharded_step


def _replica_grads(graphdef, params, inputs_BL, targets_BL, *, k: int, rules: AxisRules,
                   mesh: Mesh, replicas: tuple[str, ...], param_specs, grad_dtype=jnp.float32,
                   out_specs=None, vocab_tiles: int = 1, copies=None):
    """(loss, gradients) with the data-parallel sum deferred to the end of the step.

    Under SPMD a gradient that a micro-step adds to a replicated accumulator is summed over
    the replicas at once, every micro-step (every pipeline tick); a framework's DDP sums it
    once per step. Here every replica gets its own copy of the parameters along a leading
    dimension R sharded over `replicas` (no memory: each device holds the copy it would
    anyway) and runs the model on its own rows under `jax.vmap(spmd_axis_name=replicas)`;
    the gradients with respect to the copies stay per replica through every micro-step
    (in `grad_dtype`), and one sum over R ends the step: an all-reduce, or a reduce-scatter
    where `out_specs` split the result over the replicas (the distributed optimizer).
    `copies` (path -> RankCopies): the layer weights the context-parallel ranks each hold
    a copy of (dimension Y after the layers'), summed with R in the same sum.
    Suffix R: the replicas."""
    r = math.prod(dict(mesh.shape)[a] for a in replicas)
    inner = rules.without(replicas)

    def pin(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def per_replica(p, inputs_bL, targets_bL):
        with use_rules(inner, mesh):
            return loss_fn(nnx.merge(graphdef, p), inputs_bL, targets_bL, vocab_tiles)

    def mean_loss(params_R, inputs_RbL, targets_RbL):
        losses_R = jax.vmap(per_replica, spmd_axis_name=replicas or None)(
            params_R, inputs_RbL, targets_RbL)
        return jnp.mean(losses_R)

    copy_of = jax.tree_util.tree_map_with_path(
        lambda path, _: copies(path) if copies else RankCopies(), params)

    def replicated(x, spec, copy, dtype=None):
        spec = (*spec, *(None,) * (x.ndim - len(spec)))
        if copy.ranks > 1:  # (layers, Y, ...)
            x = jnp.broadcast_to(x[:, None], (x.shape[0], copy.ranks, *x.shape[1:]))
            spec = (spec[0], copy.axes, *spec[1:])
        x_R = jnp.broadcast_to(x[None], (r, *x.shape))
        return pin(x_R if dtype is None else x_R.astype(dtype),
                   PartitionSpec(replicas or None, *spec))

    params_R = jax.tree.map(replicated, params, param_specs, copy_of)
    # Rows stay on their devices: replica i's rows are the i-th block of the batch, and a
    # micro-batch takes every k-th of a replica's rows.
    split = lambda a: a.reshape(r, a.shape[0] // r, *a.shape[1:])  # noqa: E731
    data = (split(inputs_BL), split(targets_BL))
    if k == 1:
        loss, grads_R = jax.value_and_grad(mean_loss)(params_R, *data)
    else:
        micro = jax.tree.map(
            lambda a: jnp.moveaxis(a.reshape(r, a.shape[1] // k, k, *a.shape[2:]), 2, 0), data)

        def add_microbatch(carry, mb):
            loss_sum, grad_sum = carry
            loss, grads = jax.value_and_grad(mean_loss)(params_R, *mb)
            grads = jax.tree.map(lambda s, g: s + g.astype(grad_dtype), grad_sum, grads)
            return (loss_sum + loss, grads), None

        zeros = jax.tree.map(
            lambda p, spec, copy: replicated(jnp.zeros(p.shape), spec, copy, grad_dtype),
            params, param_specs, copy_of)
        (loss, grads_R), _ = jax.lax.scan(add_microbatch, (jnp.zeros((), jnp.float32), zeros),
                                          micro)
        loss, grads_R = loss / k, jax.tree.map(lambda g: g / k, grads_R)
    with jax.named_scope(gpu_frameworks.GRADIENT_SUM):
        grads = jax.tree.map(
            lambda g, spec, copy: pin(_sum_in(g, grad_dtype, (0, 2) if copy.ranks > 1 else (0,)),
                                      spec),
            grads_R, out_specs if out_specs is not None else param_specs, copy_of)
    return loss, grads


def _sum_in(x, dtype, axes: tuple[int, ...]):
    """x summed over `axes` in `dtype`: a bf16 sum stays bf16 (Megatron's grad_reduce_in_fp32
    = False reduces bf16), where jnp.sum widens bf16 to f32 and the collective with it."""
    x = x.astype(dtype)
    return jax.lax.reduce(x, jnp.zeros((), dtype), jax.lax.add, axes)


def replica_axes(rules: AxisRules, mesh_shape) -> tuple[str, ...]:
    """The data-parallel mesh axes a step can keep per-replica gradients over: those that
    shard the batch (a leading run of its rule, so a replica's rows are one block) and no
    parameter."""
    param_axes = {a for axes in rules.params.values() for a in axes}
    out = []
    for a in rules.mesh_axes("batch"):
        if a in param_axes:
            break
        if mesh_shape.get(a, 1) > 1:
            out.append(a)
    return tuple(out)


def param_shardings(axes_tree, abstract_params, rules: AxisRules, mesh: Mesh):
    """NamedSharding per parameter; errors name the parameter path."""
    mesh_shape = mesh_shape_of(mesh)

    def one(path, names, leaf):
        what = "param " + "/".join(str(getattr(k, "key", k)) for k in path)
        return NamedSharding(mesh, resolve(names, leaf.shape, rules.params, mesh_shape,
                                           what=what, yields=rules.params_yield))

    return jax.tree_util.tree_map_with_path(
        one, axes_tree, abstract_params, is_leaf=lambda x: isinstance(x, tuple))


def abstract_params(cfg: ModelConfig, precision: Precision, mesh: Mesh, rules: AxisRules,
                    **model_kw):
    """(graphdef, params as sharded ShapeDtypeStructs, their NamedShardings); no memory.
    `model_kw`: `make_model`'s remat, save, offload, pipeline, context_mode,
    offload_layers."""
    abstract_model = nnx.eval_shape(lambda: make_model(cfg, precision, **model_kw))
    graphdef, state = nnx.split(abstract_model, nnx.Param)
    params = nnx.to_pure_dict(state)
    shardings = param_shardings(logical_axes(state), params, rules, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          params, shardings)
    return graphdef, params, shardings


def initial_params(cfg: ModelConfig, precision: Precision, shardings, *, seed: int = 0,
                   **model_kw):
    """The model's own initial weights (`make_model` with `seed`), made on the devices
    that `shardings` place them on (no host copy of the whole model)."""
    def init():
        return nnx.to_pure_dict(nnx.split(make_model(cfg, precision, seed=seed, **model_kw),
                                          nnx.Param)[1])

    return jax.jit(init, out_shardings=shardings)()


def random_tokens(seed: int, shape, vocab: int, sharding):
    """Random token ids in [0, vocab), made on their devices."""
    return jax.jit(lambda: jax.random.randint(jax.random.key(seed), shape, 0, vocab,
                                              jnp.int32), out_shardings=sharding)()


def per_device_bytes(tree) -> int:
    """Bytes each device holds for a tree of sharded ShapeDtypeStructs (sub-byte types
    packed: int4 and FP4 values two to a byte, where numpy's itemsize says 1)."""
    bits = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        bits += math.prod(shard) * jax.dtypes.itemsize_bits(leaf.dtype)
    return math.ceil(bits / 8)


def pipeline_plan(cfg: ModelConfig, mesh_shape, rules: AxisRules, *, workload: Workload,
                  virtual_stages: int = 1, schedule: str = "1f1b") -> Pipeline | None:
    """The pipeline the rules' `layers` split makes (None without one): its microbatches
    are the workload's."""
    stages = rules.ways("layers", mesh_shape, params=True)
    if stages == 1:
        return None
    return Pipeline(stages=stages, microbatches=workload.microbatches, layers=cfg.n_layers,
                    virtual=virtual_stages, schedule=schedule)


def build_train_program(cfg: ModelConfig, mesh: Mesh, rules: AxisRules, *, workload: Workload,
                        precision: Precision, train: Train, virtual_stages: int = 1,
                        pipeline_schedule: str = "1f1b", context_mode: str = "ring",
                        fused_kernels: bool = False) -> TrainProgram:
    """Abstract sharded params, optimizer state and batch, and the jitted train step.
    With pipeline stages, `virtual_stages` chunks per stage and the schedule
    (models/pipeline.py); with the sequence split, the context-parallel exchange
    (models/context.py); `fused_kernels`: GPU frameworks' fused kernels (models/kernels.py)."""
    mesh_shape = mesh_shape_of(mesh)
    k = workload.microbatches
    if workload.global_batch % k:
        raise ValueError(
            f"workload.global_batch={workload.global_batch} is not divisible by "
            f"workload.microbatches={k}; choose a number of microbatches that divides it"
        )
    # With pipeline stages, the microbatches are the pipeline's (models/pipeline.py).
    pipeline = pipeline_plan(cfg, mesh_shape, rules, workload=workload,
                             virtual_stages=virtual_stages, schedule=pipeline_schedule)
    model_kw = dict(remat=train.remat, save=train.save, offload=train.offload,
                    pipeline=pipeline, context_mode=context_mode,
                    offload_layers=train.offload_layers)
    graphdef, params, p_shard = abstract_params(cfg, precision, mesh, rules, **model_kw)

    # Gradients summed over the data-parallel replicas once per step when the step has
    # several micro-steps or pipeline ticks (one micro-step sums once anyway), or when they
    # are summed in a wider dtype than the parameters' (Megatron's fp32 main_grad).
    wider = precision.gradient_dtype != precision.params
    several = pipeline or k > 1 or wider
    replicas = replica_axes(rules, mesh_shape) if several else ()
    copies = rank_copies(cfg, rules, mesh_shape) if several else None
    tx = make_optimizer(train)
    param_specs = jax.tree.map(lambda s: s.spec, p_shard)
    specs = state_specs(param_specs, params, rules, mesh_shape, train)
    opt_abstract = jax.eval_shape(lambda p: init_state(tx, p, precision), params)
    opt_shard = state_shardings(tx, opt_abstract,
                                jax.tree.map(lambda s: NamedSharding(mesh, s), specs), mesh,
                                precision)
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             opt_abstract, opt_shard)
    replicated = NamedSharding(mesh, PartitionSpec())

    resolve(("batch", "seq"), (workload.micro_batch, workload.seq_len), rules.activations,
            mesh_shape, what=f"micro-batch of {workload.micro_batch} sequences "
                             f"(global_batch / microbatches)")
    batch_spec = resolve(("batch", "seq"), (workload.global_batch, workload.seq_len),
                         rules.activations, mesh_shape, what="batch")
    batch_sharding = NamedSharding(mesh, batch_spec)
    tokens = jax.ShapeDtypeStruct((workload.global_batch, workload.seq_len), jnp.int32,
                                  sharding=batch_sharding)
    batch = {"inputs": tokens, "targets": tokens}

    step = jax.jit(
        make_train_step(graphdef, tx, microbatches=1 if pipeline else k, rules=rules,
                        mesh=mesh, replicas=replicas, param_specs=param_specs,
                        precision=precision, vocab_tiles=train.num_vocab_tiling,
                        state_specs=specs if train.shard_optimizer_over_data else None,
                        copies=copies, fused_kernels=fused_kernels),
        in_shardings=(p_shard, opt_shard, {"inputs": batch_sharding, "targets": batch_sharding}),
        out_shardings=(p_shard, opt_shard, replicated),
        donate_argnums=(0, 1),
    )
    def init(seed: int = 0):
        """(params, optimizer state, a batch whose targets are its inputs shifted by one
        position), concrete and sharded like `args`."""
        p = initial_params(cfg, precision, p_shard, seed=seed, **model_kw)
        o = jax.jit(lambda p: init_state(tx, p, precision), out_shardings=opt_shard)(p)
        b, seq = workload.global_batch, workload.seq_len

        def batch():
            t_BL = jax.random.randint(jax.random.key(seed + 1), (b, seq + 1), 0, cfg.vocab,
                                      jnp.int32)
            return {"inputs": t_BL[:, :-1], "targets": t_BL[:, 1:]}

        shardings = {"inputs": batch_sharding, "targets": batch_sharding}
        return p, o, jax.jit(batch, out_shardings=shardings)()

    tokens_per_step = workload.tokens_per_step
    return TrainProgram(
        init=init,
        pipeline=pipeline,
        step=step,
        args=(params, opt_state, batch),
        arg_names=("params", "opt_state", "batch"),
        param_count=cfg.param_count(),
        model_flops_per_step=cfg.train_flops_per_token(workload.seq_len) * tokens_per_step,
        tokens_per_step=tokens_per_step,
        param_bytes_per_device=per_device_bytes(params),
        optimizer_bytes_per_device=per_device_bytes(opt_state),
        batch_bytes_per_device=per_device_bytes(batch),
        gradient_bytes_per_device=per_device_bytes(jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape, DTYPES[precision.gradient_dtype],
                                           sharding=p.sharding), params)),
    )
