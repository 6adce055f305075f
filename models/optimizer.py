"""The optimizer side of a training step, as frameworks run it.

- Master weights (Megatron `--bf16`): the model computes with bfloat16 parameters; the
  optimizer keeps an fp32 copy, updates it and casts it back (`Precision.master_weights`).
- Gradients accumulated and summed over the data-parallel ranks in `Precision.grad_reduce`
  (fp32: Megatron's main_grad), never narrower than the parameters.
- The distributed optimizer (`Train.shard_optimizer_over_data`; ZeRO-1): the optimizer
  state and master weights split over the ranks that hold the same parameters (the batch's
  and the sequence's mesh axes a parameter is not already split over), written as
  shardings: the gradient pinned to the state's sharding is a reduce-scatter, the updated
  parameters pinned back to theirs an all-gather. XLA places both.

State layout: with master weights `{"master": fp32 params, "adam": optax state}`, without
the optax state alone (what `tx.init(params)` gives).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.program import DTYPES, Precision, Train
from sharding.rules import AxisRules


def make_optimizer(train: Train) -> optax.GradientTransformation:
    return optax.adamw(train.learning_rate, weight_decay=train.weight_decay)


def zero_axes(rules: AxisRules, mesh_shape) -> tuple[str, ...]:
    """The mesh axes whose ranks hold the same parameters: those that split the batch or
    the sequence (data, fsdp, expert, sequence by default), of size > 1. A parameter
    already split over one of them (fsdp) is not split over it again."""
    axes = [*rules.mesh_axes("batch"), *rules.mesh_axes("seq")]
    return tuple(a for a in dict.fromkeys(axes) if mesh_shape.get(a, 1) > 1)


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec: PartitionSpec | None) -> set[str]:
    """The mesh axes a PartitionSpec (or None: replicated) splits over."""
    return {a for e in spec or () for a in _axes_of(e)}


def sharded_over(spec: PartitionSpec, shape, extra: tuple[str, ...], mesh_shape
                 ) -> PartitionSpec:
    """`spec` further split over the `extra` mesh axes it does not use, on the dimension
    that takes them (the largest one whose size they divide with its own axes); `spec`
    itself when none does (a tiny vector stays whole)."""
    used = spec_axes(spec)
    extra = tuple(a for a in extra if a not in used)
    if not extra:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    ways = 1
    for a in extra:
        ways *= mesh_shape[a]

    def split(i: int) -> int:
        n = 1
        for a in _axes_of(entries[i]):
            n *= mesh_shape[a]
        return n

    fits = [i for i in range(len(shape)) if shape[i] % (split(i) * ways) == 0]
    if not fits:
        return spec
    i = max(fits, key=lambda i: shape[i] // split(i))
    entries[i] = (*_axes_of(entries[i]), *extra)
    return PartitionSpec(*entries)


def state_specs(param_specs, params, rules: AxisRules, mesh_shape, train: Train):
    """The PartitionSpec of each parameter's optimizer state (and master copy): the
    parameter's own, or with the distributed optimizer split over the data-parallel ranks
    too."""
    if not train.shard_optimizer_over_data:
        return param_specs
    extra = zero_axes(rules, mesh_shape)
    return jax.tree.map(lambda spec, p: sharded_over(spec, p.shape, extra, mesh_shape),
                        param_specs, params)


def init_state(tx, params, precision: Precision):
    """The optimizer state of `params` (abstract or concrete)."""
    if not precision.master_weights:
        return tx.init(params)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return {"master": master, "adam": tx.init(master)}


def state_shardings(tx, opt_abstract, state_shard, mesh: Mesh, precision: Precision):
    """NamedShardings of the optimizer state: each parameter-shaped leaf like its
    parameter's state spec, the rest (step counts) replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    if not precision.master_weights:
        return optax.tree_map_params(tx, lambda _, s: s, opt_abstract, state_shard,
                                     transform_non_params=lambda _: replicated)
    adam = optax.tree_map_params(tx, lambda _, s: s, opt_abstract["adam"], state_shard,
                                 transform_non_params=lambda _: replicated)
    return {"master": state_shard, "adam": adam}


def apply_gradients(tx, params, opt_state, grads, *, precision: Precision, pin=None,
                    param_specs=None, state_specs=None):
    """(new params, new optimizer state) from gradients already reduced over the
    data-parallel ranks (in the state's sharding when it is split). `pin(x, spec)`: a
    sharding constraint (None without a mesh)."""
    def to(tree, specs):
        return tree if pin is None or specs is None else jax.tree.map(pin, tree, specs)

    if precision.master_weights:
        master = opt_state["master"]
        updates, adam = tx.update(grads, opt_state["adam"], master)
        master = optax.apply_updates(master, updates)
        dtype = DTYPES[precision.params]
        # cast on the rank's own share, then gathered: the all-gather moves bf16 (as
        # Megatron gathers the model's parameters), not the fp32 master
        new = to(to(jax.tree.map(lambda m: m.astype(dtype), master), state_specs),
                 param_specs)
        return new, {"master": master, "adam": adam}
    mine = to(params, state_specs)  # this rank's share (no communication)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, mine)
    updates, opt_state = tx.update(grads, opt_state, mine)
    return to(optax.apply_updates(mine, updates), param_specs), opt_state
