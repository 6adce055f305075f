"""Will it fit: what would make a training step that does not fit in HBM fit.

From the memory model (models/memory.py): full remat (only each layer's input kept), the
data-parallel ways moved to FSDP (the parameters, gradients and optimizer state sharded k
more ways; the batch per device unchanged), or both; else how far off it is.
"""

from __future__ import annotations

import dataclasses

from models.memory import training_memory
from sharding.units import fmt_bytes


def fit_advice(exp, step, par=None) -> tuple[str, ...]:
    """What would make the experiment's training `step` (experiments.runner.Step) fit in
    HBM (() when it fits); `par`: the parallelism to advise on (the full run's when `exp`
    is a reduced compile of it)."""
    cap = exp.system.chip.hbm_bytes
    memory = step.memory
    need = memory.total_bytes
    if need <= cap:
        return ()
    parts = dict(memory.components)
    state = parts["parameters"] + parts["gradients"] + parts["optimizer state"]
    rest = need - state
    full = need
    if exp.train.remat != "full":
        full = training_memory(exp.model, step.program, workload=exp.workload,
                               precision=exp.precision,
                               train=dataclasses.replace(exp.train, remat="full", save=(),
                                                         offload=()),
                               mesh_shape=step.mesh_shape, rules=step.rules).total_bytes
    par = par or exp.parallelism
    ways = [k for k in range(2, par.data + 1)
            if par.data % k == 0 and exp.model.d_model % (par.fsdp * k) == 0]

    def fsdp_fix(other: float, also: str = "") -> str | None:
        """The fewest data ways moved to FSDP with which the state fits beside `other`."""
        k = next((k for k in ways if state / k + other <= cap), None)
        return None if k is None else (
            f"parallelism.fsdp = {par.fsdp * k}, data = {par.data // k}{also} "
            f"(about {fmt_bytes(state / k + other)} per device)")

    out = []
    if full <= cap:
        out.append(f"train.remat = 'full' ({fmt_bytes(full)} per device)")
    if fix := fsdp_fix(rest):
        out.append(fix)
    elif not out and (fix := fsdp_fix(full - state, " and train.remat = 'full'")):
        out.append(fix)
    if not out:
        out.append(f"no remat or data-to-FSDP change is enough ({need / cap:.1f}x the HBM, "
                   f"{fmt_bytes(state)} of it parameters, gradients and optimizer state): "
                   f"shard over more devices (fsdp, tensor, pipeline) or offload")
    return tuple(out)
