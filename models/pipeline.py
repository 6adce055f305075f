"""Pipeline parallelism over the mesh axis that shards the `layers` dimension (the
`pipeline` axis under the default rules), as a circular pipeline in plain SPMD.

The formulation is MaxText's and praxis's, not a manual `shard_map` (XLA:CPU aborts on bf16
collectives inside a partially manual one): every stage's activation is one slice of a
stacked (P, b, L, D) state sharded over the stage axis; each tick all stages run their layers
at once (`jax.vmap` with `spmd_axis_name`, so every device runs only its own stage), then the
states move one stage on with `jnp.roll` over the stage dimension, which the SPMD partitioner
turns into a collective-permute. It compiles on every backend and for every precision.

Layout (`Pipeline`): the N layers fill P x V x c slots, c = ceil(N / (P V)). Stage p holds V
chunks of c consecutive layers; chunk v of stage p is the (v P + p)-th chunk of the model
(Megatron's interleaved virtual stages; V = 1 is the plain pipeline). Slots beyond N are
padding that passes its input through: the first stage takes ceil(pad/2) of them, the last
the rest (where Megatron puts the embedding and the loss: 126 layers + 2 = 128 on 8 stages).
The layer stack is stored stage-major, so the `layers` sharding gives each stage its chunks
without moving a byte.

Schedule of the compiled program: a microbatch m passes through the model V times, each pass
one chunk per stage; stage p at tick t works on item t - p (item i: microbatch i mod M of
pass i // M), so M V + P - 1 ticks, each of c layers, run the step -- the bubble is
(P - 1) / (M V) of the useful work, and it is in the compiled FLOPs. What a pass's last stage
produces goes back to stage 0 with the same roll and waits in a buffer of M microbatches
until its next pass (hence M >= P with V > 1, as Megatron asks). The backward is the
transpose: the rolls run the other way. The order in which a real 1F1B schedule interleaves
forward and backward does not change this time, only the activations it holds
(`Pipeline.in_flight`, used by models/memory.py).

The ends of the model, as Megatron places them on its first and last stage: the embedding
table, the final norm and the output weight have a leading stage dimension sharded like the
layers (one copy per stage, each device holding what it would hold of a replicated one),
and `on_stages` runs them on every stage at once with its own copy. Only the output stage's
copies (OUTPUT_STAGE: where the last stage's roll hands the model's output) are read:
the embedding feeds the pipeline there, and the output layer and loss run there for every
microbatch (models/train.py), so their gradients stay on that stage. Nothing of them
crosses the stage axis but the loss's scalar; parameters replicated over the stages would
have had their gradients, and the pipeline's input gradient, summed over the stages
(all-reduces of the embedding's output and of the output weight that Megatron does not
run). Megatron's first and last stage are two stages; here both ends are one, which
changes no time (each end runs on one stage for every microbatch) and leaves out the
tied-embedding gradient's all-reduce between Megatron's first and last stage.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.gpu_frameworks import STAGE_TRANSFER

SCHEDULES = ("1f1b", "gpipe")


def fewest_microbatches(stages: int, virtual: int) -> int:
    """The fewest microbatches a pipeline of `stages` with `virtual` chunks a stage takes:
    an interleaved one (virtual > 1) needs one a stage (Megatron's rule), a plain one 1."""
    return stages if stages > 1 and virtual > 1 else 1


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """P `stages` x V `virtual` chunks per stage over `layers` layers, `microbatches` M,
    `schedule` "1f1b" (Megatron's; interleaved when V > 1) or "gpipe"."""

    stages: int
    microbatches: int
    layers: int
    virtual: int = 1
    schedule: str = "1f1b"

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"parallelism.pipeline_schedule={self.schedule!r} is not one of "
                             f"{SCHEDULES}")
        if self.microbatches < fewest_microbatches(self.stages, self.virtual):
            raise ValueError(
                f"interleaved stages (parallelism.virtual_stages={self.virtual}) need at least "
                f"as many microbatches as stages: workload.microbatches={self.microbatches} < "
                f"parallelism.pipeline={self.stages}; raise workload.microbatches to at least "
                f"{self.stages}, a number that divides workload.global_batch")
        if self.virtual > 1 and self.schedule == "gpipe":
            raise ValueError("parallelism.virtual_stages > 1 is interleaved 1F1B; set "
                             "parallelism.pipeline_schedule = '1f1b'")

    @property
    def chunk(self) -> int:
        """c: layer slots per chunk (per stage per pass)."""
        return -(-self.layers // (self.stages * self.virtual))

    @property
    def slots(self) -> int:
        return self.stages * self.virtual * self.chunk

    @property
    def slots_per_stage(self) -> int:
        return self.virtual * self.chunk

    @property
    def padding(self) -> tuple[int, int]:
        """Empty slots at the start (first stage) and the end (last stage) of the model."""
        pad = self.slots - self.layers
        return pad - pad // 2, pad // 2

    @property
    def ticks(self) -> int:
        return self.microbatches * self.virtual + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle share of a stage's time: (P - 1) / (M V + P - 1) of the step's ticks."""
        return (self.stages - 1) / self.ticks

    @property
    def bubble_over_ideal(self) -> float:
        """Megatron's figure: idle time over the useful time, (P - 1) / (M V)."""
        return (self.stages - 1) / (self.microbatches * self.virtual)

    @property
    def in_flight(self) -> float:
        """Microbatches whose activations (over one stage's layers) the busiest stage holds
        at the peak: all M for GPipe; P for 1F1B (min with M); with V chunks, Megatron's
        interleaved schedule holds P (1 + (P - 1) / (P V)) (Korthikanti et al. 2022, sec. 4.2)."""
        p, m, v = self.stages, self.microbatches, self.virtual
        if self.schedule == "gpipe":
            return float(m)
        if v == 1:
            return float(min(p, m))
        return min(p * (1 + (p - 1) / (p * v)), float(m))

    @property
    def stage_layers(self) -> int:
        """The layers of the busiest stage of an even split, ceil(N / P): what the busiest
        stage of any framework's layout runs."""
        return -(-self.layers // self.stages)

    @property
    def padded_work(self) -> float:
        """The layer slots every stage runs (padded ones too: SPMD) over `stage_layers`: 1
        where the padding only lightens the first and last stage; above 1 where chunks
        rounded up make every stage run empty slots (80 layers on 8 x 3 chunks of 4: 12
        slots a stage for 10 layers)."""
        return self.slots_per_stage / self.stage_layers

    def megatron_refuses(self) -> str:
        """Why Megatron-LM refuses these virtual stages without an explicit
        --pipeline-model-parallel-layout ("" where it runs them): each stage's layers,
        counting the embedding and the loss as a layer each where its
        account_for_embedding / account_for_loss_in_pipeline_split flags do, must split
        into V equal chunks (transformer_block.get_num_layers_to_build:
        num_layers_per_pipeline_rank % vp_size == 0), or with uneven first and last stages
        (--decoder-first/last-pipeline-num-layers) each stage's count must."""
        p, v, n = self.stages, self.virtual, self.layers
        if v == 1:
            return ""
        if any((n + a) % p == 0 and (n + a) // p % v == 0 for a in (0, 1, 2)):
            return ""
        front, back = self.padding
        if p > 2 and front % v == 0 and back % v == 0:
            return ""
        return (f"Megatron-LM refuses --num-virtual-stages-per-pipeline-rank {v} here: "
                f"{n} layers on {p} stages do not split into {v} equal chunks a stage, "
                f"even counting the embedding and the loss as layers (it runs this split "
                f"only with --pipeline-model-parallel-layout)")

    def notes(self) -> tuple[str, ...]:
        """What the report says of this layout beside its figures (`megatron_refuses`)."""
        why = self.megatron_refuses()
        if not why:
            return ()
        front, back = self.padding
        return (f"{why}; shardscope pads {front + back} empty slots ({front} before the "
                f"first layer, {back} after the last), which leave the busiest stages' "
                f"{self.stage_layers} layers as they are",)

    def virtual_choices(self) -> list[int]:
        """The virtual stages V > 1 that run no more slots a stage than `stage_layers`."""
        return [v for v in range(2, self.stage_layers + 1)
                if dataclasses.replace(self, virtual=v, microbatches=max(
                    self.microbatches, self.stages)).padded_work == 1]

    def logical_slot(self, stage: int, chunk: int, j: int) -> int:
        return (chunk * self.stages + stage) * self.chunk + j

    def stack_index(self, stage: int, chunk: int, j: int) -> int:
        return (stage * self.virtual + chunk) * self.chunk + j

    def valid_mask(self):
        """(P, V, c) booleans: which slots hold a real layer."""
        front, _ = self.padding
        return [[[front <= self.logical_slot(s, v, j) < front + self.layers
                  for j in range(self.chunk)] for v in range(self.virtual)]
                for s in range(self.stages)]

    def layer_order(self) -> list[int]:
        """The stack indices of the real layers in the order the model applies them."""
        order = sorted((self.logical_slot(s, v, j), self.stack_index(s, v, j))
                       for s in range(self.stages) for v in range(self.virtual)
                       for j in range(self.chunk))
        front, _ = self.padding
        return [k for slot, k in order if front <= slot < front + self.layers]

    def summary(self) -> dict:
        """The plan as the report shows it (`--json`'s `pipeline`)."""
        return {"stages": self.stages, "microbatches": self.microbatches,
                "virtual_stages": self.virtual, "schedule": self.schedule,
                "layers": self.layers, "slots": self.slots, "padding": list(self.padding),
                "ticks": self.ticks, "bubble": self.bubble,
                "bubble_over_ideal": self.bubble_over_ideal, "in_flight": self.in_flight,
                "description": self.describe()}

    def describe(self) -> str:
        kind = ("GPipe" if self.schedule == "gpipe" else
                f"interleaved 1F1B, {self.virtual} virtual stages" if self.virtual > 1
                else "1F1B")
        uneven = ""
        if self.slots > self.layers:
            empty = [self.slots_per_stage - sum(map(sum, stage)) for stage in self.valid_mask()]
            lighter = ", ".join(f"stage {s} by {k}" for s, k in enumerate(empty) if k)
            uneven = f"; {self.layers} layers in {self.slots} slots, lighter: {lighter}"
        return (f"{self.stages} stages x {self.microbatches} microbatches ({kind}); bubble "
                f"{self.bubble:.1%} of the step ((P-1)/(MV) = {self.bubble_over_ideal:.1%} "
                f"of the ideal){uneven}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def shift_stages(x, axis: int = 0):
    """Every slice along `axis` (a sharded stage or rank dimension) to the next, the last
    one's to the first: a roll, one collective-permute. Its transpose is the roll back, one
    permute the other way (autodiff's transpose of a roll is two one-way permutes)."""
    return jnp.roll(x, 1, axis=axis)


shift_stages.defvjp(lambda x, axis: (jnp.roll(x, 1, axis=axis), None),
                    lambda axis, _, g: (jnp.roll(g, -1, axis=axis),))


def run_pipeline(run_chunk: Callable, layers, x_PBLD, positions_BL, *, plan: Pipeline, mesh,
                 axis: str, batch_axes: tuple[str, ...] = (), seq_axes: tuple[str, ...] = ()):
    """The layers as `plan`'s circular pipeline over mesh axis `axis`.

    `layers`: the stacked layer state (leading dimension `plan.slots`, stage-major, sharded
    over `axis`). `x_PBLD`: the pipeline's input, one copy per stage (`on_stages`): only
    stage 0's is read, so its gradient stays on stage 0 (an input replicated over the
    stages would have its gradient summed over them: an all-reduce of the whole batch's
    activations that Megatron, whose first stage alone embeds, does not run).
    `run_chunk(x_bLD, chunk_layers, valid_c, positions_bL)` runs one chunk's c layers,
    skipping the padded ones. `batch_axes`, `seq_axes`: the mesh axes of each microbatch's
    batch and positions (the residual stream's: with sequence parallelism the stages pass
    each other 1/TP of the activations).
    Returns (P, M, b, L, D): stage 0's slice holds microbatch m's output at m (microbatch
    m is rows m, M + m, 2M + m, ... of the batch), where the last stage's roll put it; the
    other stages' slices are not the model's output (`output_stage`).
    Suffixes: P stages, M microbatches, b one microbatch's batch (models/__init__.py)."""
    _, b, seq, d = x_PBLD.shape
    stages, m, v, c = plan.stages, plan.microbatches, plan.virtual, plan.chunk
    if b % m:
        raise ValueError(f"batch {b} is not divisible by {m} pipeline microbatches")
    batch_axes = tuple(a for a in batch_axes if dict(mesh.shape).get(a, 1) > 1) or None
    seq_axes = tuple(a for a in seq_axes if dict(mesh.shape).get(a, 1) > 1) or None

    def pin(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    # Microbatch k is rows k, M + k, 2M + k, ... of the batch: each device's microbatches
    # come from its own rows (a split of the major dimension would move rows between
    # data-parallel devices).
    xs_PMbLD = pin(x_PBLD.reshape(stages, b // m, m, seq, d).swapaxes(1, 2), axis, None,
                   batch_axes, seq_axes)
    # Training positions are 0..L-1 for every sequence: rebuilt per microbatch rather than
    # sliced out of the batch-sharded array (which would move them between data shards).
    pos_bL = jnp.broadcast_to(positions_BL[0], (b // m, seq))
    # The stage dimension over `axis`; the weights' own dimensions keep their sharding
    # (tensor, FSDP; context ranks' copies): a constraint naming only the stage axis would
    # gather them.
    chunks = jax.tree.map(
        lambda w: pin(w.reshape(stages, v, c, *w.shape[1:]), axis, None, None,
                      *[P.UNCONSTRAINED] * (w.ndim - 1)), layers)
    valid_PVc = jnp.asarray(plan.valid_mask())
    stage_P = jnp.arange(stages)
    is_first_P111 = (stage_P == 0)[:, None, None, None]

    def stage_work(x_bLD, stage_chunks, valid_Vc, chunk_index):
        if v == 1:  # one chunk per stage: nothing to choose
            pick = lambda w: w[0]  # noqa: E731
        else:
            pick = lambda w: jax.lax.dynamic_index_in_dim(w, chunk_index, 0,  # noqa: E731
                                                          keepdims=False)
        return run_chunk(x_bLD, jax.tree.map(pick, stage_chunks), pick(valid_Vc), pos_bL)

    all_stages = jax.vmap(stage_work, spmd_axis_name=axis)

    def tick(carry, t):
        state_PbLD, buffer_PMbLD = carry
        chunk_P = jnp.clip((t - stage_P) // m, 0, v - 1)
        y_PbLD = pin(all_stages(state_PbLD, chunks, valid_PVc, chunk_P), axis, batch_axes,
                     seq_axes)
        # Stage p's output moves to stage p + 1; the last stage's to stage 0, which keeps it
        # (item t - P + 1: microbatch (t - P + 1) mod M) for that microbatch's next pass and,
        # after the last pass, as the pipeline's output. Before the first item arrives, the
        # slot still holds a microbatch's input.
        with jax.named_scope(STAGE_TRANSFER):  # Megatron overlaps it (gpu_frameworks.py)
            moved_PbLD = pin(shift_stages(y_PbLD), axis, batch_axes, seq_axes)
        slot = (t - stages + 1) % m
        buffer_PMbLD = buffer_PMbLD.at[:, slot].set(
            jnp.where(t >= stages - 1, moved_PbLD, buffer_PMbLD[:, slot]))
        state_PbLD = jnp.where(is_first_P111, buffer_PMbLD[:, (t + 1) % m], moved_PbLD)
        return (pin(state_PbLD, axis, batch_axes, seq_axes), buffer_PMbLD), None

    # The buffer starts with the microbatches' inputs at stage 0, from stage 0's own copy
    # of the input: a select on each stage's own data, no collective either way.
    buffer_PMbLD = pin(jnp.where(is_first_P111[..., None], xs_PMbLD,
                                 jnp.zeros((), x_PBLD.dtype)), axis, None, batch_axes, seq_axes)
    (_, buffer_PMbLD), _ = jax.lax.scan(tick, (buffer_PMbLD[:, 0], buffer_PMbLD),
                                        jnp.arange(plan.ticks))
    return pin(buffer_PMbLD, axis, None, batch_axes, seq_axes)


# The stage whose slice of the pipeline's result holds the model's output (run_pipeline):
# the last stage's final roll hands it there. Megatron's output layer and loss run on the
# last stage; one stage or the other, they run on one stage for every microbatch, which is
# what the step's time and the collectives depend on.
OUTPUT_STAGE = 0


def on_stages(fn: Callable, *args_P, axis: str, stages: int):
    """`fn(*args)` on every stage at once, each with its own slice of `args_P` (arrays or
    trees with a leading stage dimension sharded over mesh axis `axis`) and a last
    argument saying whether it is the stage that holds the pipeline's input and output:
    a vmap with `spmd_axis_name`, so every device runs only its own stage and nothing
    moves between the stages."""
    is_ends_P = jnp.arange(stages) == OUTPUT_STAGE
    return jax.vmap(fn, spmd_axis_name=axis)(*args_P, is_ends_P)


def output_layer_share(cfg, plan: Pipeline, seq_len: int) -> float:
    """Of the output layer and loss (final norm, output projection, cross-entropy), the
    share that lengthens a Megatron pipeline's step beyond its busiest stage's layers:
    Megatron runs them on the last stage for every microbatch beside the other stages'
    layers, where this program runs them for every microbatch after the loop (on one stage
    for the model; every stage computes its own copy at once). The last stage's padded
    slots (`padding`, what Megatron's account_for_loss_in_pipeline_split leaves it) absorb
    them first:
    max(0, 1 - padded x layer / output layer), per token, in training FLOPs (6 x
    parameters, plus a layer's causal attention). 1 without padding; 0 when the padding
    covers them (Llama 3.1 405B's: one layer for a 2.1B-parameter output layer)."""
    pad = plan.padding[1]
    if pad == 0:
        return 1.0
    output = 6 * cfg.d_model * cfg.padded_vocab
    layers = 6 * (cfg.matmul_param_count() - cfg.d_model * cfg.padded_vocab) / cfg.n_layers \
        + 12 * cfg.n_heads * cfg.attention_head_dim * seq_len / 2
    return max(0.0, 1.0 - pad * layers / output)
