"""`shardscope search`: every valid sharding of a model on a machine, ranked from compiled HLO.

1. Enumerate: every assignment of the system's devices to the mesh axes the user allows
   (ordered factorisations of the device count; the other axes 1), crossed with `--vary`
   values. Each candidate is a full config, checked by the config validator: the invalid
   ones are results with the validator's reason ("refused").
2. Order: the most promising first, by an analytic pre-estimate of the communication each
   sharding needs (`pre_estimate`): it only orders, the ranking is the compiled estimate's.
3. Run: a pool of worker processes (experiments/workers.py, shared with validate), one
   compile at a time each, so that a compiler abort or crash is that config's error and
   the search goes on. Workers prune what the memory model says cannot fit before
   compiling (unless keep_unfit).
4. Store: each result is committed as it arrives (experiments/store.py); a rerun skips what
   the store has, so a killed search resumes and loses at most the configs in flight.

Reading the results (ranking, Pareto front, the table): experiments/ranking.py; the HTML
page: experiments/pages.py.
"""

from __future__ import annotations

import base64
import concurrent.futures
import copy
import dataclasses
import itertools
import json
from collections.abc import Callable, Sequence

from experiments import config as config_mod
from experiments import workers as workers_mod
from experiments.config import ConfigError, Experiment, apply_override
from experiments.ranking import pareto, ranking  # noqa: F401 -- where tests looked for them
from experiments.store import Result, Store, config_hash, tool_version
from meshes.calibration import Calibration
from sharding.rules import MESH_AXES

# The mesh axes a search spreads the devices over unless told: the batch's (data, FSDP)
# and tensor parallelism.
DEFAULT_AXES = ("data", "fsdp", "tensor")


# --- enumeration ------------------------------------------------------------------------
def factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered k-tuple of positive integers whose product is n."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0
            for rest in factorisations(n // d, k - 1)]


def parse_vary(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`--vary table.key=v1,v2` -> [(key, [v1, v2])]."""
    out = []
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or "." not in key or not values:
            raise ConfigError(f"--vary {item!r}: expected table.key=v1,v2,... e.g. --vary "
                              f"train.remat=full,minimal")
        out.append((key.strip(), [v.strip() for v in values.split(",") if v.strip()]))
    return out


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One config of the search: its name, tables, the mesh sizes and varied values, and
    either the validated experiment or the validator's reason."""

    name: str
    raw: dict
    sizes: dict[str, int]
    varied: dict[str, str]
    exp: Experiment | None
    reason: str = ""

    @property
    def config(self) -> dict:
        return self.exp.to_dict() if self.exp is not None else self.raw

    @property
    def key(self) -> str:
        return config_hash(self.config)


def enumerate_candidates(raw: dict, num_devices: int, axes: Sequence[str],
                         vary: Sequence[tuple[str, list[str]]] = ()) -> list[Candidate]:
    """Every assignment of `num_devices` to `axes` (the other mesh axes 1) crossed with the
    varied values, each validated."""
    bad = [a for a in axes if a not in MESH_AXES]
    if bad or not axes:
        raise ConfigError(f"--axes {','.join(axes)!r}: {bad[0] if bad else 'none given'} is "
                          f"not a mesh axis; choose from {', '.join(MESH_AXES)}")
    out = []
    keys = [k for k, _ in vary]
    for sizes in factorisations(num_devices, len(axes)):
        for values in itertools.product(*(v for _, v in vary)):
            r = copy.deepcopy(raw)
            par = {k: v for k, v in r.get("parallelism", {}).items() if k not in MESH_AXES}
            par.update({a: s for a, s in zip(axes, sizes, strict=True)})
            r["parallelism"] = par
            for k, v in zip(keys, values, strict=True):
                apply_override(r, f"{k}={v}")
            shape = "-".join(f"{a}{s}" for a, s in zip(axes, sizes, strict=True) if s > 1)
            name = "-".join([raw["name"], shape or "single",
                             *(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, values,
                                                                          strict=True))])
            r["name"] = name
            try:
                exp, reason = config_mod.from_dict(r), ""
            except ConfigError as e:
                exp, reason = None, str(e).splitlines()[0]
            out.append(Candidate(name, r, dict(zip(axes, sizes, strict=True)),
                                 dict(zip(keys, values, strict=True)), exp, reason))
    return out


def pre_estimate(exp: Experiment) -> float:
    """Bytes each device moves per step, from closed forms (JAX scaling book): FSDP gathers
    the bf16 weights twice and reduce-scatters their gradients once; data parallelism
    all-reduces the gradients of its shard; tensor parallelism all-reduces each layer's
    activations four times; context parallelism passes K/V around. Only for ordering the
    compiles (the ranking is the compiled estimate's)."""
    m, w, par = exp.model, exp.workload, exp.parallelism
    params = m.param_count()
    fsdp, data, tensor, seq = par.fsdp, par.data * par.expert, par.tensor, par.sequence
    shard = params / (tensor * par.pipeline)
    tokens = w.global_batch * w.seq_len / (data * fsdp * seq) if w.kind == "train" else \
        w.global_batch * (w.seq_len if w.kind == "prefill" else 1) / (data * fsdp * seq)
    ring = (lambda n: (n - 1) / n)  # noqa: E731
    moved = 3 * 2 * shard * ring(fsdp)
    moved += 2 * 4 * shard / fsdp * ring(data)
    moved += 4 * 2 * tokens * m.d_model * 2 * m.n_layers * ring(tensor)
    moved += 2 * tokens * m.n_kv_heads * m.head_dim * 2 * m.n_layers * (seq - 1)
    return moved


# --- the search -------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    results: list[Result]
    skipped: int  # already in the store
    compiled: int
    interrupted: bool = False
    untried: int = 0  # left out by the budget (or started past the time budget)


def result_of(c: Candidate, answer: dict, *, search: str, backend: str) -> Result:
    rep = answer.get("report") or {}
    return Result(
        config_hash=c.key, tool_version=tool_version(), backend=backend, search=search,
        name=c.name, config=c.config, parallelism=c.sizes, varied=c.varied,
        status=answer["status"], message=answer.get("message", ""),
        step_time_s=rep.get("step_time_s"),
        tokens_per_s_per_device=rep.get("tokens_per_s_per_device"), mfu=rep.get("mfu"),
        memory_per_device_bytes=rep.get("memory_per_device_bytes"), fits=rep.get("fits"),
        bottleneck=rep.get("bottleneck", ""), report=rep or None,
        inputs=answer.get("inputs"), hlo_text=answer.get("hlo", ""),
        plan=base64.b64decode(answer.get("plan", "")),
        timings={**rep.get("timings", {}), "wall_s": answer.get("wall_s", 0.0)})


def run_search(exp_raw: dict, *, num_devices: int, axes: Sequence[str],
               vary: Sequence[tuple[str, list[str]]], store: Store, search: str,
               backend: str = "cpu", workers: int | None = None, keep_unfit: bool = False,
               budget: int | None = None, time_budget_s: float | None = None,
               timeout_s: float = 1800.0, calibration: Calibration | None = None,
               on_result: Callable[[Result, dict], None] | None = None,
               ray_address: str | None = None) -> Outcome:
    """Enumerate, order, compile what the store lacks on a worker pool (or as Ray tasks:
    `ray_address` "" for a local instance, else the cluster's address), commit each result
    as it arrives. `budget`: compile at most that many (the rest are `untried`)."""
    candidates = enumerate_candidates(exp_raw, num_devices, axes, vary)
    version = tool_version()
    done = store.done(version, backend)
    todo = [c for c in candidates if c.key not in done]
    skipped = len(candidates) - len(todo)
    results: list[Result] = []
    progress = {"done": 0, "running": 0, "failed": 0, "total": len(todo)}
    for c in [c for c in todo if c.exp is None]:  # the validator's refusals: no compile
        r = result_of(c, {"status": "refused", "message": c.reason}, search=search,
                      backend=backend)
        if store.add(r):
            results.append(r)
        progress["done"] += 1
        if on_result:
            on_result(r, progress)
    runnable = sorted((c for c in todo if c.exp is not None),
                      key=lambda c: pre_estimate(c.exp))
    untried = 0
    if budget is not None:
        untried = max(0, len(runnable) - budget)
        runnable = runnable[:budget]
        progress["total"] -= untried
    request = {"backend": backend, "keep_unfit": keep_unfit,
               "calibration": calibration.to_dict() if calibration else None}
    interrupted = False
    compiled = 0
    futures: dict = {}
    shutdown = None
    try:  # Ctrl-C while the pool starts is an interrupted search too
        submit, shutdown, slots = workers_mod.executor(
            workers=workers, timeout_s=timeout_s, time_budget_s=time_budget_s,
            ray_address=ray_address)
        for c in runnable:
            devices = workers_mod.devices_for(c.exp.system.num_devices)
            futures[submit(devices, {**request, "config": c.raw})] = c
        left = len(futures)
        progress["running"] = min(slots, left)
        for f in concurrent.futures.as_completed(futures):
            c, answer = futures[f], f.result()
            left -= 1
            progress["running"] = min(slots, left)
            if not answer:  # past the time budget: left for a rerun
                untried += 1
                continue
            r = result_of(c, answer, search=search, backend=backend)
            compiled += answer["status"] == "ok"
            if store.add(r):
                results.append(r)
            progress["done"] += 1
            progress["failed"] += r.status == "error"
            if on_result:
                on_result(r, progress)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if shutdown is not None:
            shutdown(interrupted)
    return Outcome(results, skipped, compiled, interrupted, untried)


def reestimate(store: Store, *, system: str | None = None,
               calibration: Calibration | None = None,
               search: str | None = None) -> list[Result]:
    """Re-time every stored compiled program under the current model (or `calibration`),
    on its own system or on `system` (same device count), without compiling: from the
    program as read when it was compiled (sharding/plan.py), or from its HLO when the
    store's plan is of an older format. The store keeps them: its rows updated in place on
    their own system, or as re-estimates on `system` (`Store.results(system=...)`)."""
    import sharding
    from meshes import get_system
    from sharding.analysis import AnalysisInputs
    from sharding.compute import runs_fused_kernels
    from sharding.plan import Plan

    out = []
    systems: dict[tuple, object] = {}
    for r in store.results(search=search, with_plan=True):
        if r.status != "ok" or r.inputs is None:
            out.append(r)
            continue
        plan = Plan.from_bytes(r.plan)
        hlo = "" if plan is not None else store.hlo(r)
        if plan is None and not hlo:
            out.append(r)
            continue
        inputs = AnalysisInputs.from_dict(r.inputs, hlo, plan)
        target = system or r.config["system"]["name"]
        overrides = {k: v for k, v in r.config["system"].items() if k != "name"}
        key = (target, json.dumps({} if system else overrides, sort_keys=True))
        if key not in systems:
            systems[key] = get_system(target, **({} if system else overrides))
            own = get_system(r.config["system"]["name"], **overrides)
            if runs_fused_kernels(systems[key].chip) != runs_fused_kernels(own.chip):
                raise ValueError(
                    f"--system {target}: the store's programs were compiled for {own.name}, "
                    f"and a GPU's program saves and fuses what its frameworks' kernels do, "
                    f"another chip's what XLA does; re-time on a system of {own.name}'s kind, "
                    f"or search on {target} itself (`shardscope compare` compiles each kind)")
        # the same placement on any system of that size: mesh position -> system device id
        rep = sharding.reanalyze(inputs, system=systems[key], calibration=calibration)
        d = rep.to_dict(groups=False)
        new = dataclasses.replace(
            r, step_time_s=d["step_time_s"], tokens_per_s_per_device=d[
                "tokens_per_s_per_device"], mfu=d["mfu"],
            memory_per_device_bytes=d["memory_per_device_bytes"], fits=d["fits"],
            bottleneck=d["bottleneck"], report=d, inputs=rep.inputs.to_dict(), hlo_text="",
            plan=r.plan if plan is not None else rep.inputs.plan.to_bytes(),
            retimed_on=system or "")
        if system is None:
            store.update_estimate(new)
        else:
            store.add_estimate(new, system)
        out.append(new)
    return out
