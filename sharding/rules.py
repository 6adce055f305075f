"""Logical axis names, the rule tables that map them to mesh axes, and a strict resolver.

Models name every dimension with a logical axis (`batch`, `embed`, `heads`, ...). A rule
table maps each logical name to a tuple of mesh axes, written once. The resolver turns
(logical names, shape) into a PartitionSpec and refuses to guess: an unknown name, a mesh
axis used twice in one spec, or a dimension its mesh axes do not divide is an error with
the fix, never a silent replication.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The logical vocabulary (the shape-suffix legend of model code is in models/__init__.py).
LOGICAL_AXES = (
    "batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "experts",
    "expert_batch",  # the batch of tokens dispatched to experts (not sharded over `expert`)
    "cache_seq",  # the positions of a KV cache
    "residual_seq",  # the positions of the residual stream between tensor-parallel regions
)

# Mesh axes in the order devices are laid out: the last varies fastest, so `tensor` groups
# are consecutive device ids (inside one tray / NVLink domain / torus row).
MESH_AXES = ("pipeline", "data", "fsdp", "expert", "sequence", "tensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AxisRules:
    """Logical axis -> mesh axes, separately for parameters and activations."""

    params: Mapping[str, tuple[str, ...]]
    activations: Mapping[str, tuple[str, ...]]

    def __post_init__(self):
        for table_name, table in (("params", self.params), ("activations", self.activations)):
            for logical, mesh_axes in table.items():
                if logical not in LOGICAL_AXES:
                    raise ValueError(
                        f"rules.{table_name}: unknown logical axis {logical!r}; valid: "
                        f"{', '.join(LOGICAL_AXES)}"
                    )
                for m in mesh_axes:
                    if m not in MESH_AXES:
                        raise ValueError(
                            f"rules.{table_name}[{logical!r}]: unknown mesh axis {m!r}; valid: "
                            f"{', '.join(MESH_AXES)}"
                        )

    def mesh_axes(self, logical: str, *, params: bool = False) -> tuple[str, ...]:
        """The mesh axes that shard `logical` (in the activations' table, or the
        parameters')."""
        table = self.params if params else self.activations
        if logical not in table:
            raise ValueError(f"logical axis {logical!r} has no rule in the "
                             f"{'params' if params else 'activations'} table; known: "
                             f"{', '.join(sorted(table))}")
        return tuple(table[logical])

    def without(self, mesh_axes: Sequence[str]) -> AxisRules:
        """These rules with `mesh_axes` taken out of every activation's mapping (inside a
        vmap whose spmd_axis_name already places the mapped dimension on them)."""
        drop = set(mesh_axes)
        return dataclasses.replace(self, activations={
            k: tuple(a for a in v if a not in drop) for k, v in self.activations.items()})

    def with_sequence_parallel(self) -> AxisRules:
        """Megatron's sequence parallelism: the residual stream (norms, residual adds, the
        pipeline's stage-to-stage transfers) split over `tensor` along its positions, so
        a tensor-parallel region starts with an all-gather and ends with a reduce-scatter
        instead of an all-reduce."""
        seq = self.activations["residual_seq"]
        return dataclasses.replace(self, activations={
            **self.activations,
            "residual_seq": (*seq, *(a for a in self.activations["heads"] if a not in seq))})

    def with_batch_over(self, mesh_axis: str) -> AxisRules:
        """These rules with the activations' batch also split over `mesh_axis`, outermost
        (a pipeline's output handed to the loss split over its stages)."""
        batch = self.activations["batch"]
        return dataclasses.replace(self, activations={
            **self.activations,
            "batch": (mesh_axis, *(a for a in batch if a != mesh_axis))})

    def split_axes(self, logical: str, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
        """The mesh axes of size > 1 that split the activations' `logical` dimension."""
        return tuple(a for a in self.mesh_axes(logical) if mesh_shape.get(a, 1) > 1)

    def ways(self, logical: str, mesh_shape: Mapping[str, int], *,
             params: bool = False) -> int:
        """How many ways `logical` splits on a mesh of `mesh_shape` (mesh axis -> size;
        axes the mesh lacks count as 1): the one question every user of the rules asks
        (memory per device, batch divisibility, pipeline stages)."""
        return math.prod(mesh_shape.get(m, 1) for m in self.mesh_axes(logical, params=params))


def default_rules() -> AxisRules:
    """FSDP shards the `embed` dimension of weights; tensor parallelism (Megatron) shards
    heads and the MLP hidden dimension; data and FSDP both shard the batch; context
    parallelism shards the sequence of every activation (attention then gathers keys and
    values over `sequence`, as Megatron's all-gather context parallelism does). Expert
    parallelism shards the experts' weights, and the batch of every dense layer, over
    `expert` (as MaxText does); the MoE dispatch moves that sharding from the tokens to the
    experts with an all-to-all (models/moe.py)."""
    return AxisRules(
        params={
            "embed": ("fsdp",),
            "heads": ("tensor",),
            "kv_heads": ("tensor",),
            "mlp": ("tensor",),
            "vocab": ("tensor",),
            "head_dim": (),
            "layers": ("pipeline",),  # stage s holds consecutive layers
            "experts": ("expert",),
        },
        activations={
            "batch": ("data", "fsdp", "expert"),
            "expert_batch": ("data", "fsdp"),
            "cache_seq": ("sequence",),
            "seq": ("sequence",),
            "residual_seq": ("sequence",),
            "embed": (),
            "heads": ("tensor",),
            "kv_heads": ("tensor",),
            "head_dim": (),
            "mlp": ("tensor",),
            "vocab": ("tensor",),
            "layers": (),
            "experts": ("expert",),
        },
    )


def maxtext_rules() -> AxisRules:
    """The default rules with MaxText's activation sharding: the residual stream's width
    split over `tensor` too (its base.yml: `['activation_embed', 'tensor']`), so that
    tensor parallelism gathers a layer's input before its projections and reduce-scatters
    their outputs, and a rank keeps 1/tensor of each saved activation."""
    rules = default_rules()
    return dataclasses.replace(rules, activations={**rules.activations, "embed": ("tensor",)})


# Rule presets a config can name (`[parallelism] rules = "default"`).
RULE_PRESETS = {"default": default_rules, "maxtext": maxtext_rules}


def rules_preset(name: str) -> AxisRules:
    """The rule table of a preset, by name."""
    if name not in RULE_PRESETS:
        raise ValueError(f"parallelism.rules={name!r} is not a rule preset; valid: "
                         f"{', '.join(RULE_PRESETS)}")
    return RULE_PRESETS[name]()


def resolve(
    names: Sequence[str | None],
    shape: Sequence[int],
    table: Mapping[str, tuple[str, ...]],
    mesh_shape: Mapping[str, int],
    *,
    what: str,
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry logical `names`.

    Args:
        names: one logical name (or None for "never sharded") per dimension.
        shape: the array's global shape.
        table: logical name -> mesh axes.
        mesh_shape: mesh axis -> size.
        what: the array's path, for error messages.

    Raises:
        ValueError: unknown name, mesh axis used twice, or a dimension not divisible.
    """
    if len(names) != len(shape):
        raise ValueError(f"{what}: {len(names)} logical names {tuple(names)} for a "
                         f"{len(shape)}-d array of shape {tuple(shape)}")
    used: dict[str, str] = {}
    spec = []
    for name, dim in zip(names, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(
                f"{what}: logical axis {name!r} has no rule; known: {', '.join(sorted(table))}. "
                f"Add it to the rule table"
            )
        # Mesh axes of size 1, or absent from this mesh, shard nothing.
        mesh_axes = tuple(m for m in table[name] if mesh_shape.get(m, 1) > 1)
        for m in mesh_axes:
            if m in used:
                raise ValueError(
                    f"{what}: mesh axis {m!r} would shard both {used[m]!r} and {name!r}; "
                    f"change the rule of one of them"
                )
            used[m] = name
        ways = math.prod(mesh_shape[m] for m in mesh_axes)
        if dim % ways:
            sizes = " x ".join(f"{m}={mesh_shape[m]}" for m in mesh_axes)
            raise ValueError(
                f"{what}: dimension {name!r} of size {dim} is not divisible by {sizes} "
                f"(= {ways}); choose mesh sizes that divide {dim}: {divisors(dim)}"
            )
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def divisors(n: int, limit: int = 12) -> str:
    """The first divisors of n, for error messages that offer valid choices."""
    ds = [d for d in range(1, min(n, 4096) + 1) if n % d == 0]
    return ", ".join(map(str, ds[:limit])) + (", ..." if len(ds) > limit else "")


# ------------------------------------------------------------------------------------
# Activation constraints inside model code.

_ACTIVE: contextvars.ContextVar[tuple[AxisRules, Mesh] | None] = contextvars.ContextVar(
    "shardscope_rules", default=None
)


@contextlib.contextmanager
def use_rules(rules: AxisRules, mesh: Mesh):
    """Make `constrain` shard activations over `mesh` with `rules` while tracing."""
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh of the rules in force (inside `use_rules`), else None."""
    active = _ACTIVE.get()
    return None if active is None else active[1]


def active_rules() -> AxisRules | None:
    active = _ACTIVE.get()
    return None if active is None else active[0]


@contextlib.contextmanager
def no_rules():
    """Turn activation constraints off (inside a shard_map whose manual axes the rules'
    NamedShardings cannot name); sharding there propagates from the inputs."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def mesh_shape_of(mesh) -> dict[str, int]:
    """Mesh axis -> size, of a Mesh or an AbstractMesh."""
    return dict(mesh.shape)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's sharding by logical names; without active rules, return x.

    Without rules there is no mesh to shard over (an unsharded run), so doing nothing is the
    only correct behaviour; with rules the constraint is always applied, on every backend.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    spec = resolve(names, x.shape, rules.activations, mesh_shape_of(mesh),
                   what=f"activation {tuple(names)}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
