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
from experiments.store import Result, Store, calibration_key, config_hash, tool_version
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
    """`--vary table.key=v1,v2` -> [(key, [v1, v2])]; a key or a value given twice is
    refused (it would try the same configs twice)."""
    out: list[tuple[str, list[str]]] = []
    for item in items:
        key, eq, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not eq or "." not in key or not vals:
            raise ConfigError(f"--vary {item!r}: expected table.key=v1,v2,... e.g. --vary "
                              f"train.remat=full,minimal")
        key = key.strip()
        if key in (k for k, _ in out):
            raise ConfigError(f"--vary {key}: given twice; give every value in one --vary, "
                              f"e.g. --vary {key}={','.join(vals)},...")
        twice = next((v for i, v in enumerate(vals) if v in vals[:i]), None)
        if twice is not None:
            raise ConfigError(f"--vary {item!r}: {twice} given twice; give each value once")
        out.append((key, vals))
    return out


def check_vary(raw: dict, vary: Sequence[tuple[str, list[str]]]) -> None:
    """Every --vary key is a config key and every value one it can take, before anything
    is tried (else each config would be stored as refused, for good): each combination
    of the values is checked key by key and table by table, as --set's are; a value wrong
    in every combination is the user's mistake. What depends on the sharding (a size
    that does not divide) stays a refusal of those configs."""
    if not vary:
        return
    keys = [k for k, _ in vary]
    errors: dict[tuple[str, str], str] = {}
    valid: set[tuple[str, str]] = set()
    for values in itertools.product(*(v for _, v in vary)):
        r = copy.deepcopy(raw)
        try:
            for k, v in zip(keys, values, strict=True):
                apply_override(r, f"{k}={v}")
            config_mod.unchecked(r)
        except ConfigError as e:
            message = str(e).splitlines()[0].removeprefix("--set ")
            # the value the message names (its key), else every value of the combination
            named = [kv for kv in zip(keys, values, strict=True) if kv[0] in message]
            for kv in named or zip(keys, values, strict=True):
                errors.setdefault(kv, message)
            continue
        valid.update(zip(keys, values, strict=True))
    for k, values in vary:
        bad = [v for v in values if (k, v) not in valid and (k, v) in errors]
        if bad:  # every value wrong: the key is, or the table it names
            drop = f"; fix or drop {bad[0]!r}" if len(bad) < len(values) else ""
            raise ConfigError(f"--vary {k}={','.join(values)}: {errors[(k, bad[0])]}{drop}")


def check_axes(axes: Sequence[str]) -> None:
    """--axes: mesh axes, each once."""
    bad = [a for a in axes if a not in MESH_AXES]
    if bad or not axes:
        raise ConfigError(f"--axes {','.join(axes)!r}: {bad[0] if bad else 'none given'} is "
                          f"not a mesh axis; choose from {', '.join(MESH_AXES)}")
    twice = next((a for i, a in enumerate(axes) if a in axes[:i]), None)
    if twice is not None:
        once = ",".join(dict.fromkeys(axes))
        raise ConfigError(f"--axes {','.join(axes)!r}: {twice} given twice; give each mesh "
                          f"axis once, e.g. --axes {once}")


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
    check_axes(axes)
    check_vary(raw, vary)
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
    results: list[Result]  # committed by this run
    skipped: int  # already in the store, used as stored (or re-estimated: `retimed`)
    compiled: int
    interrupted: bool = False
    untried: int = 0  # left out by the budget (or started past the time budget)
    # This search's candidates as the store has them, whoever stored them first, each
    # under this search's name: what its ranking is of.
    rows: list[Result] = dataclasses.field(default_factory=list)
    retimed: int = 0  # stored figures re-estimated under this run's calibration, no compile
    retried: int = 0  # stored errors (--retry-errors) and unfit refusals (--keep-unfit) redone


def result_of(c: Candidate, answer: dict, *, search: str, backend: str,
              calibration: str = "") -> Result:
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
        timings={**rep.get("timings", {}), "wall_s": answer.get("wall_s", 0.0)},
        calibration=calibration if answer["status"] == "ok" else "")


def unfit(status: str, message: str) -> bool:
    """Whether a stored row is a config refused as too large, not compiled."""
    return status == "refused" and (message.startswith("does not fit")
                                    or message.startswith("the program does not fit"))


def redone(stored: tuple[str, str], *, keep_unfit: bool, retry_errors: bool) -> bool:
    """Whether a rerun compiles a stored row again rather than reuse it: a failure (an
    error, a timeout) with `retry_errors`, a "does not fit" refusal with `keep_unfit`."""
    status, message = stored
    return (retry_errors and status == "error") or (keep_unfit and unfit(status, message))


def own_rows(store: Store, candidates: Sequence[Candidate], *, search: str,
             backend: str) -> list[Result]:
    """The search's candidates as stored for this tool version and backend (rows are kept
    by config hash: another search, under another name, may have stored them first),
    each under this search's name."""
    names = {c.key: c.name for c in candidates}
    rows = store.results(tool_version=tool_version(), backend=backend, keys=names)
    return [dataclasses.replace(r, name=names[r.config_hash], search=search,
                                config={**r.config, "name": names[r.config_hash]})
            for r in rows]


def run_search(exp_raw: dict, *, num_devices: int, axes: Sequence[str],
               vary: Sequence[tuple[str, list[str]]], store: Store, search: str,
               backend: str = "cpu", workers: int | None = None, keep_unfit: bool = False,
               budget: int | None = None, time_budget_s: float | None = None,
               timeout_s: float = 1800.0, calibration: Calibration | None = None,
               on_result: Callable[[Result, dict], None] | None = None,
               ray_address: str | None = None, retry_errors: bool = False) -> Outcome:
    """Enumerate, order, compile what the store lacks on a worker pool (or as Ray tasks:
    `ray_address` "" for a local instance, else the cluster's address), commit each result
    as it arrives. `budget`: compile at most that many (the rest are `untried`).

    A rerun reuses what the store has for this tool version and backend, except: stored
    figures made under another calibration than `calibration` are re-estimated under it
    (no compile); with `keep_unfit`, configs stored as "does not fit" are compiled; with
    `retry_errors`, stored failures (errors, timeouts) are compiled again."""
    candidates = enumerate_candidates(exp_raw, num_devices, axes, vary)
    version = tool_version()
    cal = calibration_key(calibration)
    stored = store.stored(version, backend)
    redo = {c.key for c in candidates if c.key in stored and redone(
        stored[c.key], keep_unfit=keep_unfit, retry_errors=retry_errors)}
    todo = [c for c in candidates if c.key not in stored or c.key in redo]
    skipped = len(candidates) - len(todo)
    retimed = _retime_stored(store, [c for c in candidates if c.key not in redo and
                                     stored.get(c.key, ("",))[0] == "ok"],
                             backend=backend, calibration=calibration)
    results: list[Result] = []
    progress = {"done": 0, "running": 0, "failed": 0, "total": len(todo)}

    def commit(c: Candidate, r: Result) -> None:
        if store.add(r, replace=c.key in redo):
            results.append(r)

    for c in [c for c in todo if c.exp is None]:  # the validator's refusals: no compile
        r = result_of(c, {"status": "refused", "message": c.reason}, search=search,
                      backend=backend)
        commit(c, r)
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
            r = result_of(c, answer, search=search, backend=backend, calibration=cal)
            compiled += answer["status"] == "ok"
            commit(c, r)
            progress["done"] += 1
            progress["failed"] += r.status == "error"
            if on_result:
                on_result(r, progress)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if shutdown is not None:
            shutdown(interrupted)
    return Outcome(results, skipped, compiled, interrupted, untried,
                   rows=own_rows(store, candidates, search=search, backend=backend),
                   retimed=retimed, retried=len(redo))


def _retime_stored(store: Store, candidates: Sequence[Candidate], *, backend: str,
                   calibration: Calibration | None) -> int:
    """Re-estimate the candidates' stored programs whose figures were made under another
    calibration than this run's (no compile); how many were."""
    want = calibration_key(calibration)
    rows = [r for r in store.results(tool_version=tool_version(), backend=backend,
                                     keys={c.key for c in candidates}, with_plan=True)
            if r.status == "ok" and r.calibration != want]
    systems: dict[tuple, object] = {}
    n = 0
    for r in rows:
        new = _retimed(store, r, system=None, calibration=calibration, systems=systems)
        if new is not None:
            store.update_estimate(new)
            n += 1
    return n


def stored_searches(store: Store, search: str, flag: str, fix: str = "") -> None:
    """A search name the store has rows of; else the one-line error naming those it has
    (`fix`: what else to say)."""
    names = store.searches()
    if search not in names:
        held = ", ".join(repr(n) for n in names) or "none (it is empty)"
        raise ConfigError(f"{flag} {search!r}: {store.path} holds no search of that name; "
                          f"it holds {held}" + (f"; {flag.split(':')[0]} {fix}" if fix else ""))


def reestimate(store: Store, *, system: str | None = None,
               calibration: Calibration | None = None,
               search: str | None = None) -> list[Result]:
    """Re-time every stored compiled program under the current model (or `calibration`),
    on its own system or on `system` (same device count), without compiling: from the
    program as read when it was compiled (sharding/plan.py), or from its HLO when the
    store's plan is of an older format. The store keeps them: its rows updated in place on
    their own system, or as re-estimates on `system` (`Store.results(system=...)`)."""
    out = []
    systems: dict[tuple, object] = {}
    for r in store.results(search=search, with_plan=True):
        new = _retimed(store, r, system=system, calibration=calibration, systems=systems)
        if new is None:
            out.append(r)
        elif system is None:
            store.update_estimate(new)
            out.append(new)
        else:
            store.add_estimate(new, system)
            out.append(new)
    return out


def _retimed(store: Store, r: Result, *, system: str | None,
             calibration: Calibration | None, systems: dict) -> Result | None:
    """A stored compiled program re-timed on its own system (or `system`) under
    `calibration`; None when the row has no program to re-time."""
    import sharding
    from meshes import get_system
    from sharding.analysis import AnalysisInputs
    from sharding.compute import runs_fused_kernels
    from sharding.plan import Plan

    if r.status != "ok" or r.inputs is None:
        return None
    plan = Plan.from_bytes(r.plan)
    hlo = "" if plan is not None else store.hlo(r)
    if plan is None and not hlo:
        return None
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
    return dataclasses.replace(
        r, step_time_s=d["step_time_s"], tokens_per_s_per_device=d[
            "tokens_per_s_per_device"], mfu=d["mfu"],
        memory_per_device_bytes=d["memory_per_device_bytes"], fits=d["fits"],
        bottleneck=d["bottleneck"], report=d, inputs=rep.inputs.to_dict(), hlo_text="",
        plan=r.plan if plan is not None else rep.inputs.plan.to_bytes(),
        retimed_on=system or "", calibration=calibration_key(calibration))
