"""`shardscope search`: every valid sharding of a model on a machine, ranked from compiled HLO.

1. Enumerate: every assignment of the system's devices to the mesh axes the user allows
   (ordered factorisations of the device count; the other axes 1), crossed with `--vary`
   values. Each candidate is a full config, checked by the config validator: the invalid
   ones are results with the validator's reason ("refused").
2. Order: the most promising first, by an analytic pre-estimate of the communication each
   sharding needs (`pre_estimate`): it only orders, the ranking is the compiled estimate's.
3. Run: a pool of worker processes (experiments/worker.py), one compile at a time each, so
   that a compiler abort or crash is that config's error and the search goes on. Workers
   prune what the memory model says cannot fit before compiling (unless keep_unfit).
4. Store: each result is committed as it arrives (experiments/store.py); a rerun skips what
   the store has, so a killed search resumes and loses at most the configs in flight.
"""

from __future__ import annotations

import base64
import concurrent.futures
import copy
import dataclasses
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from experiments import config as config_mod
from experiments.config import ConfigError, Experiment, apply_override
from experiments.store import Result, Store, config_hash, tool_version
from sharding.mesh import CPU_MAX_DEVICES
from sharding.rules import MESH_AXES
from sharding.units import fmt_bytes, fmt_s

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


# --- workers ----------------------------------------------------------------------------
class Worker:
    """A worker process for one device count (experiments/worker.py), reused for every
    config of that count until it dies."""

    def __init__(self, devices: int):
        self.devices = devices
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        self.stderr = open(os.devnull, "w")  # noqa: SIM115 -- lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.worker", str(devices)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env,
            start_new_session=True)

    def ask(self, request: dict, timeout_s: float) -> dict:
        """The worker's answer, or an error answer when it died or took too long."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._died()
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive():
            self.kill()
            return {"status": "error", "message": f"did not finish within {timeout_s:.0f} s"}
        if not box or not box[0]:
            return self._died()
        return json.loads(box[0])

    def _died(self) -> dict:
        code = self.proc.wait()
        how = (f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}")
        return {"status": "error", "message": f"the compiler process died ({how}) while "
                                              f"compiling this config"}

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._close_pipes()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # end of input ends the worker
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                f.close()
            except (BrokenPipeError, OSError):
                pass


class Pool:
    """`size` worker slots; each thread keeps its worker for the next config of the same
    device count and replaces it when it died."""

    def __init__(self, size: int):
        self.size = size
        self.local = threading.local()
        self.workers: list[Worker] = []
        self.lock = threading.Lock()

    def ask(self, devices: int, request: dict, timeout_s: float) -> dict:
        w = getattr(self.local, "worker", None)
        if w is None or not w.alive or w.devices != devices:
            if w is not None:
                w.close()
            w = Worker(devices)
            with self.lock:
                self.workers.append(w)
            self.local.worker = w
        return w.ask(request, timeout_s)

    def close(self, *, kill: bool = False) -> None:
        for w in self.workers:
            w.kill() if kill else w.close()


# --- the search -------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    results: list[Result]
    skipped: int  # already in the store
    compiled: int
    interrupted: bool = False


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
               timeout_s: float = 1800.0, calibration: str | None = None,
               on_result: Callable[[Result, dict], None] | None = None,
               ray_address: str | None = None) -> Outcome:
    """Enumerate, order, compile what the store lacks on a worker pool (or as Ray tasks:
    `ray_address` "" for a local instance, else the cluster's address), commit each result
    as it arrives."""
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
    if budget is not None:
        runnable = runnable[:budget]
    t0 = time.perf_counter()
    interrupted = False
    compiled = 0

    def request(c: Candidate) -> dict:
        return {"config": c.raw, "backend": backend, "keep_unfit": keep_unfit,
                "calibration": calibration}

    if ray_address is not None:
        submit, shutdown = _ray_executor(ray_address, timeout_s)
    else:
        submit, shutdown = _pool_executor(workers or os.cpu_count() or 1, timeout_s, t0,
                                          time_budget_s)
    futures: dict = {}
    try:
        for c in runnable:
            # A worker fakes the devices its compile needs: past what XLA:CPU fakes, the
            # runner compiles fewer data-parallel replicas within that limit.
            devices = min(c.exp.system.num_devices, CPU_MAX_DEVICES)
            futures[submit(devices, request(c))] = c
        slots = workers or os.cpu_count() or 1
        left = len(futures)
        progress["running"] = min(slots, left)
        for f in concurrent.futures.as_completed(futures):
            c, answer = futures[f], f.result()
            left -= 1
            progress["running"] = min(slots, left)
            if not answer:  # past the time budget: left for a rerun
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
        shutdown(interrupted)
    return Outcome(results, skipped, compiled, interrupted)


def _pool_executor(size: int, timeout_s: float, t0: float, time_budget_s: float | None):
    """(submit, shutdown) over local worker processes: submit(devices, request) -> a
    future of the worker's answer ({} once past the time budget)."""
    pool = Pool(size)
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=size)

    def one(devices: int, req: dict) -> dict:
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            return {}
        return pool.ask(devices, req, timeout_s)

    def shutdown(interrupted: bool) -> None:
        if interrupted:  # kill first: the threads waiting on their workers then return
            pool.close(kill=True)
        executor.shutdown(wait=not interrupted, cancel_futures=True)
        if not interrupted:
            pool.close()

    return (lambda devices, req: executor.submit(one, devices, req)), shutdown


def compile_in_worker(devices: int, req: dict, timeout_s: float) -> dict:
    """One config in a fresh worker process (a Ray task: a crash stays in that process)."""
    w = Worker(devices)
    try:
        return w.ask(req, timeout_s)
    finally:
        w.close()


def _ray_executor(address: str, timeout_s: float):
    """(submit, shutdown) over Ray: one task per config, its device count and backend in
    the task's runtime environment; the driver gets each answer as a future."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'shardscope[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    task = ray.remote(num_cpus=1, max_retries=0)(compile_in_worker)

    def submit(devices: int, req: dict):
        env = {"JAX_PLATFORMS": "cpu", "SHARDSCOPE_DEVICES": str(devices),
               "SHARDSCOPE_BACKEND": req["backend"]}
        fault = os.environ.get("SHARDSCOPE_FAULT")
        if fault:
            env["SHARDSCOPE_FAULT"] = fault
        return task.options(runtime_env={"env_vars": env}).remote(devices, req,
                                                                   timeout_s).future()

    def shutdown(interrupted: bool) -> None:
        if started:
            ray.shutdown()

    return submit, shutdown


# --- reading a store --------------------------------------------------------------------
def ranking(results: Sequence[Result]) -> list[Result]:
    """Those that ran and fit, fastest first."""
    ok = [r for r in results if r.status == "ok" and r.step_time_s and r.fits is not False]
    return sorted(ok, key=lambda r: r.step_time_s)


def pareto(results: Sequence[Result]) -> list[Result]:
    """The configs no other beats on both step time and memory per device."""
    ok = [r for r in results if r.status == "ok" and r.step_time_s]
    front, best_mem = [], math.inf
    for r in sorted(ok, key=lambda r: (r.step_time_s, r.memory_per_device_bytes)):
        if r.memory_per_device_bytes < best_mem:
            front.append(r)
            best_mem = r.memory_per_device_bytes
    return front


def why_not(r: Result, best: Result | None) -> str:
    if r.status != "ok":
        return f"{r.status}: {r.message}"
    if r.fits is False:
        return f"does not fit ({fmt_bytes(r.memory_per_device_bytes)} per device)"
    if best is not None and r.step_time_s:
        return f"{r.step_time_s / best.step_time_s - 1:+.0%} slower than the best"
    return ""


def format_results(results: Sequence[Result], top: int = 10) -> str:
    ranked = ranking(results)
    best = ranked[0] if ranked else None
    w = max([len("config"), *(len(r.name) for r in ranked[:top])]) + 2
    head = (f"{'rank':>4}  {'config':<{w}}{'step':>11}{'tok/s/dev':>11}{'MFU':>7}"
            f"{'memory/dev':>12}  bottleneck")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(ranked[:top], 1):
        lines.append(f"{i:>4}  {r.name:<{w}}{fmt_s(r.step_time_s):>11}"
                     f"{r.tokens_per_s_per_device or 0:>11,.0f}{(r.mfu or 0):>7.1%}"
                     f"{fmt_bytes(r.memory_per_device_bytes):>12}  "
                     f"{r.bottleneck.split(';')[0]}")
    if not ranked:
        lines.append("(no config ran and fit)")
    others = [r for r in results if r not in ranked[:top]]
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "refused", "error")}
    lines.append("")
    lines.append(f"{len(results)} configs: {counts['ok']} estimated ({len(ranked)} fit), "
                 f"{counts['refused']} refused, {counts['error']} failed")
    front = pareto(results)
    if front:
        lines.append("pareto front (none is both faster and smaller):")
        fw = max(len(r.name) for r in front) + 2
        lines += [f"  {r.name:<{fw}}{fmt_s(r.step_time_s):>11}"
                  f"{fmt_bytes(r.memory_per_device_bytes):>12}" for r in front]
    if others:
        lines.append("why the others lost:")
        for r in others[:20]:
            lines.append(f"  {r.name}: {why_not(r, best)}")
        if len(others) > 20:
            lines.append(f"  ... and {len(others) - 20} more (--json has them all)")
    return "\n".join(lines)


def to_json(results: Sequence[Result]) -> dict:
    ranked = ranking(results)
    return {"results": [r.summary() for r in results],
            "best": ranked[0].summary() if ranked else None,
            "pareto": [r.name for r in pareto(results)]}


def reestimate(store: Store, *, system: str | None = None, calibration=None,
               search: str | None = None) -> list[Result]:
    """Re-time every stored compiled program under the current model (or `calibration`),
    on its own system or on `system` (same device count), without compiling: from the
    program as read when it was compiled (sharding/plan.py), or from its HLO when the
    store's plan is of an older format. The store's rows are updated when no other system
    is asked for."""
    import sharding
    from meshes import get_system
    from sharding.analysis import AnalysisInputs
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
        # the same placement on any system of that size: mesh position -> system device id
        rep = sharding.reanalyze(inputs, system=systems[key], calibration=calibration)
        d = rep.to_dict(groups=False)
        new = dataclasses.replace(
            r, step_time_s=d["step_time_s"], tokens_per_s_per_device=d[
                "tokens_per_s_per_device"], mfu=d["mfu"],
            memory_per_device_bytes=d["memory_per_device_bytes"], fits=d["fits"],
            bottleneck=d["bottleneck"], report=d, inputs=rep.inputs.to_dict(), hlo_text="",
            plan=r.plan if plan is not None else rep.inputs.plan.to_bytes())
        if system is None:
            store.update_estimate(new)
        out.append(new)
    return out


def render_html(results: Sequence[Result], title: str = "search") -> str:
    """One page: the Pareto scatter of step time against memory per device (every config
    that ran; the front joined; those that do not fit hollow) and the ranking."""
    import html as h

    ok = [r for r in results if r.status == "ok" and r.step_time_s and
          r.memory_per_device_bytes]
    front = pareto(results)
    ranked = ranking(results)
    width, height, left, right, top, bottom = 760, 420, 80, 30, 30, 50
    svg = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" '
           f'font-family="sans-serif" font-size="11" class="pareto">',
           f'<rect x="{left}" y="{top}" width="{width - left - right}" '
           f'height="{height - top - bottom}" fill="none" stroke="#ccc"/>']
    if ok:
        xs = [r.memory_per_device_bytes for r in ok]
        ys = [r.step_time_s for r in ok]
        x_lo, x_hi = min(xs) / 1.2, max(xs) * 1.2
        y_lo, y_hi = min(ys) / 1.2, max(ys) * 1.2

        def px(x):
            return left + (width - left - right) * math.log(x / x_lo) / math.log(x_hi / x_lo)

        def py(y):
            return height - bottom - (height - top - bottom) * math.log(y / y_lo) / \
                math.log(y_hi / y_lo)

        for frac in (0.0, 0.25, 0.5, 0.75, 1.0):  # ticks, log-spaced
            xv = x_lo * (x_hi / x_lo) ** frac
            yv = y_lo * (y_hi / y_lo) ** frac
            svg.append(f'<text x="{px(xv):.1f}" y="{height - bottom + 16}" '
                       f'text-anchor="middle" class="xtick">{fmt_bytes(xv)}</text>'
                       f'<text x="{left - 6}" y="{py(yv) + 4:.1f}" text-anchor="end" '
                       f'class="ytick">{fmt_s(yv)}</text>')
        svg.append(f'<text x="{width / 2:.0f}" y="{height - 10}" text-anchor="middle">memory '
                   f'per device (log)</text><text x="{left}" y="{top - 10}">step time (log); '
                   f'the Pareto front joined</text>')
        pts = " ".join(f"{px(r.memory_per_device_bytes):.1f},{py(r.step_time_s):.1f}"
                       for r in sorted(front, key=lambda r: r.memory_per_device_bytes))
        svg.append(f'<polyline class="front" fill="none" stroke="#e45756" '
                   f'stroke-width="1.5" points="{pts}"/>')
        for r in ok:
            fill = "#4c78a8" if r.fits is not False else "none"
            svg.append(f'<circle class="config{" on-front" if r in front else ""}" '
                       f'cx="{px(r.memory_per_device_bytes):.1f}" cy="{py(r.step_time_s):.1f}" '
                       f'r="5" fill="{fill}" stroke="#4c78a8"><title>{h.escape(r.name)}: '
                       f'{fmt_s(r.step_time_s)}, {fmt_bytes(r.memory_per_device_bytes)}'
                       f'{"" if r.fits is not False else " (does not fit)"}</title></circle>')
            if r in front:  # the front's configs by their sharding
                short = r.name.removeprefix(f"{title}-")
                svg.append(f'<text x="{px(r.memory_per_device_bytes) + 7:.1f}" '
                           f'y="{py(r.step_time_s) - 7:.1f}" class="label">'
                           f'{h.escape(short)}</text>')
    svg.append("</svg>")
    rows = "".join(
        f"<tr><td>{i}</td><td>{h.escape(r.name)}</td><td>{fmt_s(r.step_time_s)}</td>"
        f"<td>{(r.tokens_per_s_per_device or 0):,.0f}</td><td>{(r.mfu or 0):.1%}</td>"
        f"<td>{fmt_bytes(r.memory_per_device_bytes)}</td>"
        f"<td>{h.escape(r.bottleneck)}</td></tr>" for i, r in enumerate(ranked, 1))
    lost = "".join(f"<tr><td>{h.escape(r.name)}</td><td>{h.escape(why_not(r, ranked[0] if ranked else None))}</td></tr>"  # noqa: E501
                   for r in results if r not in ranked)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>shardscope search: {h.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}</style></head><body>
<h1>Search: {h.escape(title)}</h1>
<p>{len(results)} configs; {len(ok)} estimated, {len(ranked)} fit. Hover a point for its
config.</p>
{''.join(svg)}
<h2>Ranking (those that fit, fastest first)</h2>
<table class="ranking"><tr><th>rank</th><th>config</th><th>step</th><th>tokens/s per device</th>
<th>MFU</th><th>memory/device</th><th>bottleneck</th></tr>{rows}</table>
<h2>The others</h2><table class="others"><tr><th>config</th><th>why</th></tr>{lost}</table>
</body></html>
"""
