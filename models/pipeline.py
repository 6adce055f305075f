"""GPipe pipeline parallelism over the mesh axis that shards the `layers` dimension (the
`pipeline` axis under the default rules).

The layer stack is sharded over that axis, so stage s holds layers
[s * n/S, (s+1) * n/S). The batch is split into M microbatches. For M + S - 1 ticks every
stage runs its layers on the microbatch it holds, then passes the result to the next stage
with a collective-permute (the stage-to-stage transfer of microbatch x seq x d_model
activations). Stage 0 feeds a new microbatch each tick; the last stage's outputs are
taken from it for the loss (XLA moves them to every stage).

Stages compute on every tick, bubble ticks included (their inputs are zeros), as MaxText's
GPipe implementation does: the (S - 1) / M bubble is in the compiled program's FLOPs, so the
estimate includes it. The backward pass is the transpose: permutes in the other direction.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def gpipe(run_stage: Callable, layers, x_BLD, positions_BL, *, stages: int, microbatches: int,
          mesh, axis: str, batch_axes: tuple[str, ...] = ()):
    """Run `run_stage(x, local_layers, positions)` as an S-stage, M-microbatch GPipe.

    `axis`: the mesh axis of the stages. `batch_axes`: the mesh axes that shard each
    microbatch's batch (data parallelism goes on inside every stage). Suffixes: M
    microbatches, b one microbatch's batch (legend in models/__init__.py)."""
    b, seq, d = x_BLD.shape
    m = microbatches
    if b % m:
        raise ValueError(f"batch {b} is not divisible by {m} pipeline microbatches")
    x_MbLD = x_BLD.reshape(m, b // m, seq, d)
    batch_axes = tuple(a for a in batch_axes if dict(mesh.shape).get(a, 1) > 1)
    if batch_axes:
        x_MbLD = jax.lax.with_sharding_constraint(
            x_MbLD, jax.sharding.NamedSharding(mesh, P(None, batch_axes)))
    # Training positions are 0..L-1 for every sequence: rebuilt per microbatch rather than
    # sliced out of the batch-sharded array (which would move them between data shards).
    pos_bL = jnp.broadcast_to(positions_BL[0], (b // m, seq))

    def pipeline(local_layers, xs_MbLD, pos):
        s = jax.lax.axis_index(axis)
        state_bLD = jnp.zeros_like(xs_MbLD[0])
        outs_MbLD = jnp.zeros_like(xs_MbLD)
        for t in range(m + stages - 1):
            feed = xs_MbLD[min(t, m - 1)] if t < m else jnp.zeros_like(state_bLD)
            y_bLD = run_stage(jnp.where(s == 0, feed, state_bLD), local_layers, pos)
            if t >= stages - 1:
                outs_MbLD = outs_MbLD.at[t - (stages - 1)].set(
                    jnp.where(s == stages - 1, y_bLD, jnp.zeros_like(y_bLD)))
            if t < m + stages - 2:
                state_bLD = jax.lax.ppermute(
                    y_bLD, axis, [(i, (i + 1) % stages) for i in range(stages)])
        return outs_MbLD[None]

    # Each stage returns its outputs; the last stage's are taken outside the shard_map, so
    # XLA moves them from the last stage to the others. (A bf16 psum over the stages here
    # aborts XLA:CPU: "Invalid binary instruction opcode copy".)
    run = jax.shard_map(pipeline, mesh=mesh, in_specs=(P(axis), P(), P()),
                        out_specs=P(axis), axis_names={axis}, check_vma=False)
    return run(layers, x_MbLD, pos_bL)[stages - 1].reshape(b, seq, d)
