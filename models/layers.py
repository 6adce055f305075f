"""Building blocks shared by the dense Transformer and the mixture of experts: parameter
constructors (every one carries `logical_axes`), the weight matmul in the activations'
dtype or FP8 / FP4, and the MLP.

Array-name suffixes: the legend in models/__init__.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding

from models import kernels
from models.config import ModelConfig
from models.fp8 import fp4_einsum, fp8_einsum, fp8_einsum_stored
from models.program import DTYPES, MATMUL_OUTPUT, Precision
from models.quant import QuantArrays, QuantWeight
from sharding import kernel_scopes
from sharding.rules import active_mesh, active_rules, constrain, resolve, use_rules


def new_param(rngs: nnx.Rngs, shape, axes, *, dtype, scale: float | None = None) -> nnx.Param:
    """A parameter drawn from N(0, scale^2); scale 1/sqrt(fan-in) (the first dimension) by
    default."""
    std = scale if scale is not None else shape[0] ** -0.5
    value = jax.random.normal(rngs.params(), shape, dtype) * std
    return nnx.Param(value, logical_axes=axes)


def new_weight(rngs: nnx.Rngs, shape, axes, *, precision: Precision, contract: int = 1,
               expert_dims: int = 0, scale: float | None = None):
    """A matmul weight: a Param in the parameters' dtype, or stored quantised when
    `precision.quantized_weights` says so (serving; models/quant.py). `contract`: how many
    dimensions after the `expert_dims` leading ones the matmul contracts."""
    if scale is None:
        scale = shape[expert_dims] ** -0.5
    if precision.quantized_weights is None:
        return new_param(rngs, shape, axes, dtype=DTYPES[precision.params], scale=scale)
    value = jax.random.normal(rngs.params(), shape, jnp.float32) * scale
    return QuantWeight(value, axes, precision.quantized_weights, contract=contract,
                       expert_dims=expert_dims)


def ones_param(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


def zeros_param(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class Norm(nnx.Module):
    """The model's norm over the residual stream, or with `width`, an RMSNorm over an
    unsharded dimension of that width (MLA's latents)."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, width: int | None = None,
                 stages: int = 0):
        """`stages` > 0: one copy per pipeline stage, a leading `layers` dimension (the
        final norm of a pipelined model: models/pipeline.py), called inside the stages'
        vmap on its own copy."""
        self.kind = cfg.norm if width is None else "rmsnorm"
        shape, axes = ((cfg.d_model,), ("embed",)) if width is None else ((width,), (None,))
        if stages:
            shape, axes = (stages, *shape), ("layers", *axes)
        self.scale = ones_param(shape, axes, param_dtype)
        if self.kind == "layernorm":
            self.bias = zeros_param(shape, axes, param_dtype)

    def __call__(self, x_BLD):
        weights = (self.scale[...],) + ((self.bias[...],) if self.kind == "layernorm" else ())

        def normalize(x, scale_D, bias_D=None):
            return kernels.norm(x, scale_D, bias_D, self.kind)  # one kernel on GPUs

        if weights[0].ndim == 2:  # one copy per context rank (per_context_rank)
            return per_context_rank(normalize, x_BLD, *weights, logical="residual_seq")
        return normalize(x_BLD, *weights)


@jax.named_scope(kernel_scopes.ROPE)  # one kernel on GPUs (Transformer Engine's fused RoPE)
def rope(x_BLHE, positions_BL, theta: float):
    half = x_BLHE.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BLE = positions_BL[..., None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle_BLE)[:, :, None, :], jnp.cos(angle_BLE)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHE.dtype)


def project(spec: str, x, w, *, precision: Precision):
    """A weight matmul: in the activations' dtype, or in FP8 / FP4 (models/fp8.py) when
    `precision.compute` says so.

    `x` is an array, or a sequence-parallel region's input (`tensor_parallel_input`), which
    the projection gathers itself. `w` is the weight's Param (or an array). Low-precision
    recipes quantise after any FSDP
    gather here, so the gather moves the parameter dtype's bytes (Transformer Engine can
    gather FP8 weights instead; that saving is not modelled). A weight with one leading
    dimension more than `spec` gives it is one copy per context-parallel rank
    (`per_context_rank`).
    """
    w_rank = len(spec.split("->")[0].split(",")[1])
    if isinstance(x, SequenceParallelInput):  # (bf16 matmuls only: _reshards)
        w = w[...] if not isinstance(w, jax.Array) else w
        if w.ndim == w_rank:
            return matmul_output(spec, x.project(spec, w))
        x = x.whole()  # one copy of the weight per context-parallel rank
    if isinstance(w, QuantWeight | QuantArrays) and precision.low_precision_matmuls == "float8":
        wq = w.q[...]
        if wq.dtype == jnp.float8_e4m3fn and wq.ndim == w_rank:
            return matmul_output(spec, fp8_einsum_stored(spec, x, wq, w.scale[...]))
    w = w[...] if not isinstance(w, jax.Array) else w
    if w.ndim == w_rank + 1:
        return per_context_rank(
            lambda x_, w_: project(spec, x_, w_, precision=precision), x, w)
    w = w.astype(x.dtype)
    if precision.low_precision_matmuls == "float8":
        return matmul_output(spec, fp8_einsum(spec, x, w))
    if precision.low_precision_matmuls == "float4":
        return matmul_output(spec, fp4_einsum(spec, x, w, _fp4_layouts(spec, x, w)))
    return matmul_output(spec, jnp.einsum(spec, x, w))


def matmul_output(spec: str, y):
    """`y`, the result of einsum `spec`, tagged for remat "minimal" (models/program.py
    MATMUL_OUTPUT) when the einsum has no batch dimensions (a label in both operands and the
    output): a projection, not attention's per-head products or MoE's per-expert ones."""
    operands, out = spec.split("->")
    a, b = operands.split(",")
    return y if set(a) & set(b) & set(out) else checkpoint_name(y, MATMUL_OUTPUT)


def _fp4_layouts(spec: str, x, w) -> tuple:
    """For an FP4 projection, its input's and its output gradient's (layout, the layout
    its matmuls read it in) when the tensor is the residual stream (`bld`) and sequence
    parallelism splits that stream's positions further than the matmul's (`seq`), else
    None: the FP4 values are gathered (models/fp8.quantize_blocks), not the bf16 they
    stand for. FP8's per-tensor values need no help: the matmul's operand is the e4m3
    array itself, and the partitioner gathers it."""
    if not _sequence_parallel():
        return (None, None)
    inputs, out = spec.split("->")
    x_spec, w_spec = inputs.split(",")
    size = {**dict(zip(w_spec, w.shape)), **dict(zip(x_spec, x.shape))}

    def move(letters: str):
        if letters != "bld":
            return None
        dims = [size[c] for c in letters]
        return tuple(_activation_sharding(names, dims, f"FP4 projection {spec}")
                     for names in (("batch", "residual_seq", "embed"),
                                   ("batch", "seq", "embed")))

    return move(x_spec), move(out)


def tensor_parallel_input(x_BLD, precision: Precision):
    """The residual stream entering a tensor-parallel region (its column-parallel
    projections): under sequence parallelism, a SequenceParallelInput that `project`
    gathers over the mesh axes that split its positions beyond the projections' own `seq`
    split (Megatron's all-gather over `tensor`; again in the backward pass), its gradient
    reduce-scattered back to the residual stream's split; the array itself otherwise.

    Why stated, both ways: a projection's weight gradient contracts its input with its
    output's gradient over the positions, and the two must agree on how the positions
    are split (`seq`; `tensor` splits the heads or the MLP's hidden dimension). Left to
    propagation, one operand keeps the residual stream's finer split over the positions
    in the backward pass, and with the weight gradient's own split over the
    data-parallel axes (the distributed optimizer's state spec, propagated back into
    the layers' loop) the SPMD partitioner all-gathers the operands over `data` and
    splits the weight gradient's output, instead of reducing partial sums. A plain
    constraint would pin the gradient to the gathered layout too (an all-reduce over
    `tensor` where a reduce-scatter does): hence a custom VJP.

    FP8 / FP4 matmuls are not resharded here: Transformer Engine gathers the quantised
    input (one byte a value, or half and its block's scale), which the partitioner does
    for FP8's e4m3 operand and `project` states for FP4's values (`_fp4_layouts`); a
    gather of the bf16 input here would double or quadruple it. (Left: FP8 with context
    parallelism and no pipeline still meets the all-gathers over data.)"""
    if not _reshards(precision):
        return x_BLD
    # Pinned where it is made first (the norm's output, cast from its f32 arithmetic), so
    # that the gather moves the compute dtype: left to propagation, the partitioner
    # gathered before the cast, in f32 (twice Megatron's bytes).
    owned = _activation_sharding(("batch", "residual_seq", "embed"), x_BLD.shape,
                                 "the residual stream")
    gathered = _activation_sharding(("batch", "seq", "embed"), x_BLD.shape,
                                    "sequence-parallel activation")
    return SequenceParallelInput(jax.lax.with_sharding_constraint(x_BLD, owned), owned,
                                 gathered)


@dataclasses.dataclass(frozen=True)
class SequenceParallelInput:
    """A tensor-parallel region's input under sequence parallelism: the positions this
    device owns (`local`, in the residual stream's layout `owned`), which each projection
    reading it gathers to `gathered` -- in the forward pass, and again in the backward
    pass for its weight gradient, as Megatron's column-parallel linear does (it keeps its
    own positions, not the gathered input: the memory model counts that). The
    projections' gathers of one input are the same all-gather (XLA's CSE makes them one).
    `whole()` is the gathered input as an array, for what is not a plain projection."""

    local: jax.Array
    owned: NamedSharding
    gathered: NamedSharding

    @property
    def shape(self):
        return self.local.shape

    @property
    def ndim(self):
        return self.local.ndim

    @property
    def dtype(self):
        return self.local.dtype

    def whole(self):
        return _reshard(self.local, self.gathered, self.owned)

    def project(self, spec: str, w):
        """`einsum(spec, gathered input, w)`; the input's gradient reduce-scattered back to
        the owned positions, the weight's from the input gathered again."""
        return _gathered_einsum(spec, self.gathered, self.owned, self.local, w)


def _gathered_einsum(spec, gathered, owned, local, w):
    inputs, out = spec.split("->")
    x_spec, w_spec = inputs.split(",")

    @jax.custom_vjp
    def matmul(local, w):
        return jnp.einsum(spec, jax.lax.with_sharding_constraint(local, gathered),
                          w.astype(local.dtype))

    def matmul_fwd(local, w):
        return matmul(local, w), (local, w)

    def matmul_bwd(residuals, dy):
        local, w = residuals
        whole = jax.lax.with_sharding_constraint(local, gathered)  # gathered again
        dx = jnp.einsum(f"{out},{w_spec}->{x_spec}", dy, w.astype(dy.dtype))
        # the weight gradient GEMM writes the weight's dtype (Megatron's wgrad into its
        # f32 main_grad), not the activations' and a cast after it
        dw = jnp.einsum(f"{x_spec},{out}->{w_spec}", whole, dy, preferred_element_type=w.dtype)
        return jax.lax.with_sharding_constraint(dx, owned), dw

    matmul.defvjp(matmul_fwd, matmul_bwd)
    return matmul(local, w)


def tensor_parallel_output(out_BLD, precision: Precision):
    """A tensor-parallel region's output (its row-parallel projection's) returned to the
    residual stream: reduce-scattered to its split over the positions, its gradient
    all-gathered over the axes that split them beyond `seq` (Megatron's sequence
    parallelism), the layout the projection's weight gradient needs
    (`tensor_parallel_input`). Without sequence parallelism: the residual stream's
    constraint, as for FP8 / FP4 matmuls (`tensor_parallel_input`)."""
    if not _reshards(precision):
        return constrain(out_BLD, ("batch", "residual_seq", "embed"))
    return _reshard(out_BLD, ("batch", "residual_seq", "embed"), ("batch", "seq", "embed"))


def _reshards(precision: Precision) -> bool:
    """Whether a tensor-parallel region states its layouts (`tensor_parallel_input`): bf16
    matmuls under rules that split the residual stream's positions further than a
    projection's (`seq`), Megatron's sequence parallelism."""
    return not precision.low_precision_matmuls and _sequence_parallel()


def _sequence_parallel() -> bool:
    """Whether the rules in force split the residual stream's positions further than a
    projection's (`seq`): Megatron's sequence parallelism."""
    mesh, rules = active_mesh(), active_rules()
    if rules is None:
        return False
    shape = dict(mesh.shape)
    return rules.split_axes("residual_seq", shape) != rules.split_axes("seq", shape)


def _activation_sharding(names, shape, what: str) -> NamedSharding:
    """The sharding of an activation of `shape` with logical `names` under the rules in
    force."""
    mesh, rules = active_mesh(), active_rules()
    return NamedSharding(mesh, resolve(names, shape, rules.activations, dict(mesh.shape),
                                       what=what))


def _reshard(x_BLD, forward, backward):
    """x constrained to `forward`, its gradient to `backward` (shardings, or logical names
    resolved here, under the rules in force for the forward pass -- inside a vmap,
    `rules.without(...)` -- for both)."""
    fwd_sharding, bwd_sharding = (
        names if isinstance(names, NamedSharding) else _activation_sharding(
            names, x_BLD.shape, f"sequence-parallel activation {names}")
        for names in (forward, backward))

    @jax.custom_vjp
    def reshard(x):
        return jax.lax.with_sharding_constraint(x, fwd_sharding)

    def reshard_fwd(x):
        return reshard(x), None

    def reshard_bwd(_, g):
        return (jax.lax.with_sharding_constraint(g, bwd_sharding),)

    reshard.defvjp(reshard_fwd, reshard_bwd)
    return reshard(x_BLD)


def per_context_rank(fn, x_BL, *weights_Y, logical: str = "seq"):
    """`fn(x, *weights)` run by each rank that holds a block of the positions (the mesh
    axes of size > 1 that split the activations' `logical` dimension: "seq" for a
    projection's input, "residual_seq" for the residual stream, which sequence parallelism
    splits over `tensor` too), on its own positions with its own copy of the
    weights (leading dimension Y, sharded over those axes).

    The point is the backward: a weight's gradient stays per rank (no sum over the ranks)
    until the copies are summed where they were made: with the data-parallel replicas'
    gradients, once per step (models/context.rank_copies), instead of at every micro-step
    or pipeline tick. Suffix Y: the ranks."""
    mesh, rules = active_mesh(), active_rules()
    shape = dict(mesh.shape)
    axes, ranks = rules.split_axes(logical, shape), rules.ways(logical, shape)
    b, seq = x_BL.shape[:2]
    x_BYl = x_BL.reshape(b, ranks, seq // ranks, *x_BL.shape[2:])

    def per_rank(*args):  # inside the vmap its axes place the ranks, not the rules
        with use_rules(rules.without(axes), mesh):
            return fn(*args)

    out_BYl = jax.vmap(per_rank, in_axes=(1,) + (0,) * len(weights_Y), out_axes=1,
                       spmd_axis_name=axes)(x_BYl, *weights_Y)
    return out_BYl.reshape(b, seq, *out_BYl.shape[3:])


def mlp_hidden(mlp, spec: str, x):
    """The MLP's hidden activation: silu(x W_gate) * x W_up (SwiGLU), gelu or relu of x W_up;
    `mlp` holds the weights (w_up, w_gate), `kind` and `precision`."""
    # Each projection under its own name, so that a report's row per model operation is
    # one weight (the gate and up matmuls under one name read as one matrix of twice the
    # bytes, as if it were gathered in f32).
    if getattr(mlp, "w_gate_up", None) is not None:  # fused (Megatron's linear_fc1)
        inputs, out = spec.split("->")
        x_spec, w_spec = inputs.split(",")
        fused = f"{x_spec},{w_spec[:-1]}j{w_spec[-1]}->{out[:-1]}j{out[-1]}"
        with jax.named_scope("gate_up_proj"):
            gate_up = project(fused, x, mlp.w_gate_up, precision=mlp.precision)
            if x.ndim == 3:  # a dense MLP's (B, L, D): its output split over `mlp` like up's
                gate_up = constrain(gate_up, ("batch", "seq", None, "mlp"))
            gate_up = checkpoint_name(gate_up, "mlpwi")
        return kernels.swiglu(gate_up[..., 0, :], gate_up[..., 1, :])  # one kernel on GPUs
    with jax.named_scope("up_proj"):
        up = checkpoint_name(project(spec, x, mlp.w_up, precision=mlp.precision), "mlpwi")
    if mlp.kind == "swiglu":
        with jax.named_scope("gate_proj"):
            gate = checkpoint_name(project(spec, x, mlp.w_gate, precision=mlp.precision),
                                   "mlpwi")
        return kernels.swiglu(gate, up)  # one kernel on GPUs
    with jax.named_scope(kernel_scopes.ACTIVATION):
        return jax.nn.gelu(up) if mlp.kind == "gelu" else jax.nn.relu(up)


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, precision: Precision):
        d, f = cfg.d_model, cfg.d_ff
        self.kind = cfg.mlp
        self.precision = precision
        if cfg.mlp == "swiglu" and cfg.fused_mlp:
            self.w_gate_up = new_weight(rngs, (d, 2, f), ("embed", None, "mlp"),
                                        precision=precision)
        else:
            if cfg.mlp == "swiglu":
                self.w_gate = new_weight(rngs, (d, f), ("embed", "mlp"), precision=precision)
            self.w_up = new_weight(rngs, (d, f), ("embed", "mlp"), precision=precision)
        self.w_down = new_weight(rngs, (f, d), ("mlp", "embed"), precision=precision)

    def hidden(self, x_BLD):
        """The hidden activation, from the residual stream entering the tensor-parallel
        region (gathered under sequence parallelism)."""
        x_BLD = tensor_parallel_input(x_BLD, self.precision)
        return constrain(mlp_hidden(self, "bld,df->blf", x_BLD), ("batch", "seq", "mlp"))

    def __call__(self, x_BLD):
        h_BLF = self.hidden(x_BLD)
        with jax.named_scope("down_proj"):
            out_BLD = project("blf,fd->bld", h_BLF, self.w_down, precision=self.precision)
            return checkpoint_name(tensor_parallel_output(out_BLD, self.precision), "mlpwo")
