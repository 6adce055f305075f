"""How GPU training frameworks (Megatron, Transformer Engine) run what the compiled program
does differently, applied to GPU systems' estimates by sharding/api.py (TPU systems run the
program as compiled):

- an FP8 scale's amax is reduced over the tensor-parallel group only (TE scales each GPU's
  own tensor), where the GSPMD program all-reduces it over every shard;
- with `gradient_buckets` (the caller's word that the program is such a framework's
  training step: the experiment runner's), a weight gradient smaller than Megatron's
  bucket is summed inside one (its share of a bucket's collective, not a collective's
  latency of its own);
- an FP8 weight is cast once per step in a pipeline, not at every tick;
- with `tp_comm_overlap`, TE's userbuffers run each sequence-parallel all-gather /
  reduce-scatter under the GEMM it feeds or follows (the schedule: sharding/schedule.py);
- with `overlap_grad_reduce` / `overlap_param_gather`, Megatron's DDP and distributed
  optimizer run the step's data-parallel gradient sum and parameter all-gather in chunks
  beside the backward and the next forward, where the program runs them after the last
  loop and after the optimizer (the schedule: sharding/schedule.py `Chunked`);
- with `overlap_p2p_comm` (Megatron's default in its interleaved schedule), a pipeline
  stage's sends and receives run beside its other microbatches' compute, where the
  program's tick waits for them (`overlapped_stage_transfers`);
- a pipeline's output layer and loss run on its last stage for every microbatch beside
  the other stages' layers, where the program runs them after its loop; the last stage's
  padded slots absorb part of them (`output_layer_scale`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from meshes import System
from sharding import kernel_scopes
from sharding.collectives import Collective
from sharding.hlo import GRADIENT_SUM, OPTIMIZER  # the step's scopes (models/train.py)
from sharding.schedule import Chunked

# A pipeline's stage-to-stage transfer (models/pipeline.py).
STAGE_TRANSFER = "stage_transfer"
DATA_PARALLEL = frozenset({"data", "sequence"})  # Megatron's DP x CP group


def collectives_as_run(collectives: list[Collective], system: System,
                       device_ids: Sequence[int], mesh_shape: Sequence[int],
                       axis_names: Sequence[str], bucket_size: int = 0,
                       gradient_buckets: bool = False) -> list[Collective]:
    """The timed collectives with the amax rule applied, and the gradient-bucket rule with
    `gradient_buckets` (`bucket_size`: parameters per gradient bucket, 0 for Megatron's
    default). The bucket rule reads the data-parallel axes by name (DATA_PARALLEL), which
    only a framework's own step promises: a user's function is timed as compiled, whatever
    its axes are called."""
    collectives = _scaled_per_device(collectives, system, device_ids, mesh_shape, axis_names)
    if not gradient_buckets:
        return collectives
    return in_gradient_buckets(collectives, system, device_ids, bucket_size)


def _scaled_per_device(collectives: list[Collective], system: System,
                       device_ids: Sequence[int], mesh_shape: Sequence[int],
                       axis_names: Sequence[str]) -> list[Collective]:
    """On GPUs, the all-reduces of a quantise's amax (kernel_scopes.scales_per_device) over
    more than the tensor axis: Transformer Engine reduces them over the tensor-parallel
    group only, so they are timed over that subgroup (not at all without one); their
    bytes are the program's, as counted."""
    tp = list(axis_names).index("tensor") if mesh_shape and "tensor" in axis_names else None
    out = []
    for c in collectives:
        if c.kind != "all-reduce" or set(c.mesh_axes) <= {"tensor"} \
                or not kernel_scopes.scales_per_device(c.op_name):
            out.append(c)
            continue
        if tp is None or "tensor" not in c.mesh_axes:
            out.append(dataclasses.replace(c, time_s=0.0,
                                           algorithm="per-device scale (not run)"))
            continue
        groups = []
        for g in c.groups:
            coords = np.stack(np.unravel_index(np.asarray(g), tuple(mesh_shape)), axis=1)
            rest = np.delete(coords, tp, axis=1)
            groups.append([device_ids[p] for p, r in zip(g, rest, strict=True)
                           if (r == rest[0]).all()])
        t = system.collective_timing(c.kind, c.bytes, groups)
        out.append(dataclasses.replace(c, link=t.link, time_s=t.time_s,
                                       algorithm=f"{t.algorithm}, over tensor only",
                                       link_share=t.link_share))
    return out


def weight_cast_share(pipeline: dict | None) -> float:
    """Of a pipeline's FP8 weight casts, the share Transformer Engine runs: the program casts
    a stage's chunk at every tick (M V + P - 1 of them), TE each of its V chunks once per
    step, keeping the FP8 copy for the other microbatches (GPU systems only:
    compute.time_work applies it to the weight-cast kernels GPUs run)."""
    if not pipeline or not pipeline.get("ticks"):
        return 1.0
    return min(1.0, pipeline["virtual_stages"] / pipeline["ticks"])


def under_gemms(collectives: list[Collective]) -> dict[tuple[str, str], int]:
    """Transformer Engine's userbuffers: each all-gather or reduce-scatter over `tensor`
    alone (sequence parallelism's) runs in chunks under the GEMM it feeds or follows;
    (computation, instruction) -> the tensor-parallel size (its chunk count)."""
    return {(c.computation, c.name): c.group_size for c in collectives
            if c.kind in ("all-gather", "reduce-scatter") and c.mesh_axes == ("tensor",)
            and c.group_size > 1}


# Megatron's DDP gathers gradients into buckets of at least this many parameters, more for
# wider data-parallel groups (DistributedDataParallelConfig.bucket_size: max(40M, 1M x dp
# size), "so that collectives do not become latency-bound").
BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK = 40_000_000, 1_000_000


def bucket_bytes(c: Collective, bucket_size: int = 0) -> int:
    """Bytes of one gradient bucket for `c`'s group: `bucket_size` parameters (Megatron's
    --ddp-bucket-size), or its default for that many ranks."""
    params = bucket_size or max(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * c.group_size)
    return params * jnp.dtype(c.dtype).itemsize


def in_gradient_buckets(collectives: list[Collective], system: System,
                         device_ids: Sequence[int], bucket_size: int = 0) -> list[Collective]:
    """On GPUs, a weight gradient's sum over the data-parallel ranks (data, and sequence as
    Megatron's DP x CP group) smaller than a bucket rides in one: the step's small sums
    over one group fill ceil(their bytes / bucket) buckets, each one collective (its
    latency paid once), and each sum takes its bytes' share of their time, not a
    collective's latency of its own."""
    def bucketed(c: Collective) -> bool:
        return (c.kind in ("reduce-scatter", "all-reduce") and bool(c.mesh_axes)
                and set(c.mesh_axes) <= DATA_PARALLEL and "transpose(" in c.op_name
                and not kernel_scopes.scales_per_device(c.op_name)
                and c.bytes < bucket_bytes(c, bucket_size))

    def key(c: Collective):
        return (c.kind, bucket_bytes(c, bucket_size),
                tuple(tuple(device_ids[p] for p in g) for g in c.groups))

    filled: dict[tuple, float] = {}  # the bytes a step's buckets carry, per group
    for c in collectives:
        if bucketed(c):
            filled[key(c)] = filled.get(key(c), 0.0) + c.bytes * c.count
    timing = {}
    for k, nbytes in filled.items():
        kind, bucket, groups = k
        n = math.ceil(nbytes / bucket)
        timing[k] = (n, system.collective_timing(kind, nbytes / n, [list(g) for g in groups]))
    out = []
    for c in collectives:
        if not bucketed(c):
            out.append(c)
            continue
        n, t = timing[key(c)]
        out.append(dataclasses.replace(c, time_s=n * t.time_s * c.bytes / filled[key(c)],
                                       algorithm=f"{t.algorithm}, in buckets",
                                       link_share=t.link_share))
    return out


def _in_scope(c: Collective, scope: str) -> bool:
    return scope in c.op_name.split("/")[:-1]


def data_parallel_overlap(collectives: list[Collective], *, pipeline: dict | None,
                          grad_reduce: bool, param_gather: bool, bucket_size: int = 0
                          ) -> dict[tuple[str, str], Chunked]:
    """Megatron's overlapped data-parallel communication (DistributedDataParallelConfig
    `overlap_grad_reduce`, `overlap_param_gather`): the step's gradient sum over the
    data-parallel ranks (a reduce-scatter under the distributed optimizer, else an
    all-reduce) and the updated parameters' all-gather, in chunks beside the loops.

    The chunks: with an interleaved pipeline, one per virtual stage ("the granularity of
    DP communication becomes the Transformer layers per virtual pipeline stage", NeMo's
    communication-overlap guide), ready one by one over the last (V - 1) P ticks of the
    backward (each stage's chunks finish P microbatches apart in the interleaved 1F1B
    cool-down) and needed one by one over the first (V - 1) P ticks of the next forward;
    otherwise Megatron's gradient buckets (`bucket_bytes`), over the last
    microbatch's pass through the layers (sharding/schedule.py `Chunked`)."""
    grads = [c for c in collectives if grad_reduce and c.mesh_axes
             and set(c.mesh_axes) <= DATA_PARALLEL and _in_scope(c, GRADIENT_SUM)
             and c.kind in ("reduce-scatter", "all-reduce")]
    params = [c for c in collectives if param_gather and c.mesh_axes
              and set(c.mesh_axes) <= DATA_PARALLEL and _in_scope(c, OPTIMIZER)
              and c.kind == "all-gather"]
    if not grads and not params:
        return {}
    v = (pipeline or {}).get("virtual_stages", 1)
    if pipeline and v > 1:
        chunks, window = v, float((v - 1) * pipeline["stages"])
    else:
        ref = grads or params
        chunks = max(1, int(sum(c.total_bytes for c in ref) // bucket_bytes(ref[0], bucket_size)))
        window = (chunks - 1) / chunks if pipeline else None
    return {**{(c.computation, c.name): Chunked(chunks, True, window) for c in grads},
            **{(c.computation, c.name): Chunked(chunks, False, window) for c in params}}


def overlapped_stage_transfers(collectives: list[Collective], pipeline: dict | None
                               ) -> dict[tuple[str, str], float]:
    """Megatron's overlapped pipeline communication (`overlap_p2p_comm`, on by default in
    its interleaved schedule; NeMo and Megatron-Bridge set it whenever virtual stages > 1):
    in the steady 1F1B state a stage posts its sends and receives and runs the other
    direction's microbatch while they move, so they wait on nothing; in the warm-up and
    the flush (forward-only, backward-only: `overlap_p2p_comm_warmup_flush` is off by
    default) each transfer is waited for. (computation, instruction) of each stage
    transfer -> the share of its time the compute waits for: the warm-up's share of a
    stage's M V chunks, (P - 1) 2 + (V - 1) P of them on the first stage (Megatron's
    num_warmup_microbatches, microbatch groups of P), the flush's the same."""
    if not pipeline or pipeline.get("virtual_stages", 1) <= 1:
        return {}
    p, v, m = pipeline["stages"], pipeline["virtual_stages"], pipeline["microbatches"]
    share = min(1.0, ((p - 1) * 2 + (v - 1) * p) / (m * v))
    return {(c.computation, c.name): share for c in collectives
            if c.kind == "collective-permute" and _in_scope(c, STAGE_TRANSFER)}


# The named scopes of the output layer (final norm, output projection) and the loss
# (models/transformer.py, models/train.py).
OUTPUT_SCOPES = ("lm_head", "loss")


def output_layer_scale(pipeline: dict | None) -> float:
    """The share of a pipeline's output layer and loss that lengthens its step: the
    program runs them for all M microbatches on one stage after its loop (models/train.py),
    as Megatron's last stage runs them for all M, but there its padded slots (one layer
    fewer than the others: account_for_loss_in_pipeline_split) absorb them first
    (models.pipeline.output_layer_share). 1 without a pipeline (GPU systems only:
    sharding/compute.time_work applies it to the ops under OUTPUT_SCOPES)."""
    if not pipeline or pipeline.get("stages", 1) <= 1 or "output_layer_share" not in pipeline:
        return 1.0
    return pipeline["output_layer_share"]


def pipeline_as_run(output_scale: float, transfers_waited: float | None) -> str:
    """What a report's pipeline line says of the rules above ("" where none applied)."""
    said = []
    if transfers_waited is not None:
        said.append(f"stage transfers beside compute, {transfers_waited:.0%} waited for "
                    f"(warm-up, flush: overlap_p2p_comm)")
    if output_scale == 0.0:
        said.append("output layer and loss in the last stage's padded slots (off the "
                    "critical path)")
    elif output_scale != 1.0:
        said.append(f"output layer and loss on the last stage, {output_scale:.0%} of them "
                    f"past its padded slots")
    return "; ".join(said)
