"""`shardscope`: run experiments, inspect HLO dumps, list systems and model presets.

Mistakes in what the user wrote end in one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from pathlib import Path

# Before JAX is imported: compile on fake CPU devices, never probe for accelerators. XLA's
# C++ log lines are captured around each compile (sharding.compiler.capture_stderr) and the
# useful ones shown in the report.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments.config import ConfigError  # noqa: E402
from sharding import progress  # noqa: E402

EXIT_USAGE = 2


def _write_json(path: str, data: dict) -> None:
    out = Path(path)
    if out.parent and not out.parent.exists():
        raise ConfigError(f"--json {path!r}: folder {str(out.parent)!r} does not exist; create "
                          f"it or write elsewhere")
    out.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")


def _write_text(path: str, text: str, flag: str = "--html") -> None:
    out = Path(path)
    if out.parent and not out.parent.exists():
        raise ConfigError(f"{flag} {path!r}: folder {str(out.parent)!r} does not exist; create "
                          f"it or write elsewhere")
    out.write_text(text)


def _jsonable(o):
    if isinstance(o, set | frozenset | tuple):
        return list(o)
    return str(o)


def cmd_run(args) -> int:
    from experiments import config as config_mod
    from experiments import runner

    exp = config_mod.load(args.config, args.set or [])
    from experiments.store import tool_version

    budget_w, tokens = _scale_out_args(args)
    config = {**exp.to_dict(), "backend": args.backend, "tool_version": tool_version()}
    if args.backend == "all":
        return _run_all_backends(args, exp, config)
    with progress.reporting(_progress_sink(args)):
        report = runner.run(exp, backend=args.backend, calibration=_calibration(args))
    print(report.format_table())
    scale_out = None
    if budget_w is not None or tokens is not None:
        from sharding.text import format_scale_out

        scale_out = report.energy.scale_out(power_budget_w=budget_w, tokens=tokens)
        print("\n".join(format_scale_out(report, scale_out)))
    if args.json:
        _write_json(args.json, {**report.to_dict(groups=args.groups), "scale_out": scale_out,
                                "config": config})
        print(f"\nwrote {args.json}")
    if args.html:
        from sharding.html import write_html

        write_html(report, args.html, chip=exp.system.chip,
                   compute_dtype=exp.precision.compute)
        print(f"wrote {args.html}")
    return 0


def _scale_out_args(args) -> tuple[float | None, float | None]:
    """--power-budget in watts and --tokens, checked before anything compiles."""
    from meshes.power import parse_power

    budget = None
    if args.power_budget is not None:
        try:
            budget = parse_power(args.power_budget)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if args.tokens is not None and not args.tokens > 0:
        raise ConfigError(f"--tokens {args.tokens:g}: give the tokens of the whole run, above "
                          f"0 (e.g. 15e12)")
    return budget, args.tokens


def _run_all_backends(args, exp, config) -> int:
    """The step on every compiler that can compile for the system here, side by side."""
    from experiments import runner
    from sharding.compiler import available_backends, own_compiler
    from sharding.text import format_side_by_side

    if args.html:
        raise ConfigError("--html takes one backend; run --backend all without --html, or "
                          "--html with --backend cpu|tpu|gpu")
    backends = available_backends(exp.system)
    reports = []
    with progress.reporting(_progress_sink(args)):
        for b in backends:
            reports.append((b, runner.run(exp, backend=b, calibration=_calibration(args))))
    print(f"{exp.name}  on {reports[0][1].system}: the same step from each compiler\n")
    print(format_side_by_side(reports))
    own = own_compiler(exp.system)
    if len(backends) == 1:
        print(f"\nonly XLA:CPU can compile for {exp.system.name} here"
              + (f"; for its own compiler: {own.install}" if own else ""))
    if args.json:
        _write_json(args.json, {"backends": [{**r.to_dict(groups=args.groups), "backend": b}
                                             for b, r in reports], "config": config})
        print(f"\nwrote {args.json}")
    return 0


def _progress_sink(args):
    """Stage lines with the elapsed time on stderr when it is a terminal and --quiet is not
    given; None otherwise. Written to a copy of the terminal's descriptor: compiles capture
    the process's stderr to keep libtpu's and XLA's noise away."""
    if args.quiet or not sys.stderr.isatty():
        return None
    out = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
    t0 = time.perf_counter()

    def sink(message: str) -> None:
        out.write(f"[{time.perf_counter() - t0:6.1f} s] {message}\n")

    return sink


def cmd_inspect(args) -> int:
    import sharding

    path = Path(args.hlo)
    if not path.is_file():
        raise ConfigError(f"HLO file {args.hlo!r} not found; give a text dump such as XLA's "
                          f"*after_optimizations.txt")
    mesh_shape, axis_names = (), ()
    if args.mesh:
        pairs = [p.split("=") for p in args.mesh.split(",")]
        if any(len(p) != 2 or not p[1].isdigit() for p in pairs):
            raise ConfigError(f"--mesh {args.mesh!r}: expected name=size,... e.g. "
                              f"--mesh data=2,fsdp=4,tensor=2")
        axis_names = tuple(p[0] for p in pairs)
        mesh_shape = tuple(int(p[1]) for p in pairs)
    report = sharding.analyze_hlo(path.read_text(errors="replace"), system=args.system,
                                  mesh_shape=mesh_shape, axis_names=axis_names, name=path.name)
    print(report.format_table())
    if args.json:
        _write_json(args.json, report.to_dict(groups=args.groups))
        print(f"\nwrote {args.json}")
    return 0


def _calibration(args):
    """The --calibration file's values, or None for the catalog's."""
    if not getattr(args, "calibration", None):
        return None
    from experiments.config import load_calibration

    return load_calibration(args.calibration)


def cmd_validate(args) -> int:
    import time

    from experiments import validate

    _calibration(args)  # a bad file is one line before anything compiles
    t0 = time.perf_counter()
    rows = validate.validate(args.dir, backend=args.backend, workers=args.workers,
                             calibration=args.calibration)
    stats = validate.summary(rows)
    print(validate.format_table(rows, stats))
    for line in validate.timing_lines(rows, time.perf_counter() - t0):
        print(line)
    if args.json:
        _write_json(args.json, {"cases": [r.to_dict() for r in rows], "summary": stats})
        print(f"\nwrote {args.json}")
    return 0


def cmd_calibrate(args) -> int:
    import json as json_mod
    import time

    from experiments import calibrate, validate

    out = Path(args.out)
    if not out.parent.exists():
        raise ConfigError(f"--out {args.out!r}: folder {str(out.parent)!r} does not exist")
    t0 = time.perf_counter()
    rows = validate.validate(args.dir, backend=args.backend, workers=args.workers)
    failed = [r for r in rows if r.status != "ok"]
    for r in failed:
        print(f"skipped {r.name}: {r.status}: {r.message}")
    cases = [(r.name, r.features, r.measured_s) for r in rows if r.status == "ok"]
    if len(cases) < 2:
        raise ConfigError(f"{len(cases)} run(s) compiled; calibrating needs at least 2 runs "
                          f"with a [measured] table")
    result = calibrate.calibrate(cases)
    fitted_on = " ".join(args.dir) if args.dir else "experiments/validation"
    calibrate.write_calibration(result, out, fitted_on=fitted_on,
                                best=calibrate.best_mfu(rows))
    print(calibrate.format_fit(result))
    if args.features:
        Path(args.features).write_text(json_mod.dumps(
            {"fitted_on": fitted_on, "cases": [{"name": n, "features": f, "measured_s": m}
                                               for n, f, m in cases]}, indent=1) + "\n")
        print(f"wrote {args.features}")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


def cmd_search(args) -> int:
    from experiments import config as config_mod
    from experiments import search as search_mod
    from experiments.store import Store

    raw = config_mod.load_raw(args.config, args.set or [])
    exp = config_mod.from_dict(raw)
    axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
    vary = search_mod.parse_vary(args.vary or [])
    _calibration(args)
    with Store(args.store) as store:
        if args.reestimate:
            cal = _calibration(args)
            results = search_mod.reestimate(store, system=args.system, calibration=cal,
                                            search=exp.name)
            how = f"on {args.system}" if args.system else "under the current model"
            print(f"re-estimated {sum(r.status == 'ok' for r in results)} stored programs "
                  f"{how}, no compile\n")
        else:
            with _SearchProgress(args) as sink:
                outcome = search_mod.run_search(
                    raw, num_devices=exp.system.num_devices, axes=axes, vary=vary,
                    store=store, search=exp.name, backend=args.backend,
                    workers=args.workers, keep_unfit=args.keep_unfit, budget=args.budget,
                    time_budget_s=args.time_budget, timeout_s=args.timeout,
                    calibration=args.calibration, on_result=sink, ray_address=args.ray)
            if outcome.interrupted:
                print(f"stopped: {len(outcome.results)} results committed to {args.store}; "
                      f"the same command resumes", file=sys.stderr)
                return 130
            results = store.results(search=exp.name)
            print(f"{exp.name} on {exp.system.label}: {len(results)} configs in "
                  f"{args.store} ({outcome.skipped} already there, {outcome.compiled} "
                  f"compiled now)\n")
    _search_outputs(args, results, exp.name)
    return 0


def _search_outputs(args, results, title: str) -> None:
    from experiments import search as search_mod

    print(search_mod.format_results(results, top=args.top))
    if args.json:
        _write_json(args.json, search_mod.to_json(results))
        print(f"\nwrote {args.json}")
    if args.html:
        _write_text(args.html, search_mod.render_html(results, title))
        print(f"wrote {args.html}")


class _SearchProgress:
    """A progress bar on stderr when it is a terminal (rich): done of total, running,
    failed, elapsed and ETA; nothing otherwise or with --quiet."""

    def __init__(self, args):
        self.bar = None
        if args.quiet or not sys.stderr.isatty():
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("search"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[state]}"), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(),
                            console=Console(stderr=True), transient=True)
        self.task = None

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, r, p) -> None:
        if self.bar is None:
            return
        if self.task is None:
            self.task = self.bar.add_task("search", total=p["total"], state="")
        self.bar.update(self.task, completed=p["done"],
                        state=f"{p['running']} running, {p['failed']} failed")


def cmd_results(args) -> int:
    from experiments.store import Store

    if not Path(args.store).is_file():
        raise ConfigError(f"store {args.store!r} not found; `shardscope search CONFIG --store "
                          f"{args.store}` makes one")
    with Store(args.store) as store:
        results = store.results(search=args.search)
    _search_outputs(args, results, args.search or Path(args.store).name)
    return 0


def cmd_compare(args) -> int:
    from experiments import compare as compare_mod
    from experiments import config as config_mod
    raw = config_mod.load_raw(args.config, args.set or [])
    config_mod.from_dict(raw)  # the config itself is valid
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.price_per_device_hour is not None and args.price_per_device_hour <= 0:
        raise ConfigError(f"--price-per-device-hour {args.price_per_device_hour}: give the "
                          f"price you pay per device and hour, above 0")
    budget_w, tokens = _scale_out_args(args)
    search = None
    if args.search:
        axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
        search = {"store": args.store, "axes": axes, "workers": args.workers,
                  "budget": args.budget, "calibration": args.calibration}
    with progress.reporting(_progress_sink(args)):
        entries = compare_mod.compare(raw, systems, calibration=_calibration(args),
                                      price_per_device_hour=args.price_per_device_hour,
                                      search=search)
    entries = compare_mod.with_scale_out(entries, power_budget_w=budget_w, tokens=tokens)
    print(f"{raw['name']}: the same model and workload on {len(systems)} systems\n")
    print(compare_mod.format_compare(entries))
    if args.json:
        _write_json(args.json, {"systems": [e.to_dict() for e in entries]})
        print(f"\nwrote {args.json}")
    if args.html:
        _write_text(args.html, compare_mod.render_html(entries, raw["name"]))
        print(f"wrote {args.html}")
    return 0


def cmd_systems(args) -> int:
    from meshes import get_system, system_names
    from meshes.power import describe as power_of

    for name in system_names():
        s = get_system(name)
        print(name)
        for field, value in [*s.describe(), *power_of(s.family.name, s.chip)]:
            print(f"  {field:<11}{value}")
    print("\nSizes: GPUs by count (NVL72: up to 72, or whole racks); TPUs by torus shape, "
          "'*N' for N slices over DCN.\nA TPU7x chip shows as two JAX devices; "
          "parallelism sizes count devices.")
    from meshes.calibration import PARAMETERS, catalog_calibration

    cal = catalog_calibration()
    print(f"\nCalibration (meshes/calibration.toml): {cal.source}")
    for name, value in cal.values().items():
        print(f"  {name:<28}{value:<10.4g}(uncalibrated {PARAMETERS[name][2]:g}; "
              f"{PARAMETERS[name][3]})")
    return 0


def cmd_models(args) -> int:
    from models import PRESETS

    header = ("preset", "layers", "d_model", "heads", "kv", "d_ff", "vocab", "mlp", "experts",
              "params", "active")
    rows = []
    for name, make in PRESETS.items():
        c = make()
        experts = (f"{c.n_experts} top-{c.experts_per_token}"
                   + (f" +{c.n_shared_experts} shared" if c.n_shared_experts else "")
                   if c.n_experts > 1 else "-")
        rows.append((name, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_ff, c.vocab,
                     c.mlp, experts, f"{c.param_count() / 1e9:.2f}B",
                     f"{c.active_param_count() / 1e9:.2f}B"))
    print(format_columns(header, rows))
    print("\nparams: all parameters with the embedding; active: the non-embedding parameters "
          "a token's matmuls touch (what MFU's 6 x N counts, with attention on top)")
    return 0


def cmd_configs(args) -> int:
    from experiments.config import BUNDLED, bundled_names, read_toml

    rows = []
    for name in bundled_names():
        raw = read_toml(BUNDLED / f"{name}.toml", what="config file", example="")
        first = _first_sentence(BUNDLED / f"{name}.toml")
        rows.append((name, raw.get("system", {}).get("name", "?"),
                     raw.get("workload", {}).get("kind", "train"), first))
    print(format_columns(("config", "system", "kind", "what it is"), rows))
    print("\nRun one by name: shardscope run llama3-8b-nvl72 (files in experiments/configs/)")
    return 0


def _first_sentence(path: Path, width: int = 72) -> str:
    """The first sentence of a config's leading comment, shortened at a word."""
    lines = []
    for ln in path.read_text().splitlines():
        if not ln.startswith("#"):
            break
        lines.append(ln.lstrip("#").strip())
    text = " ".join(lines)
    text = text.split(". ")[0].rstrip(".")
    if len(text) > width:
        text = text[:width].rsplit(" ", 1)[0] + " ..."
    return text


def format_columns(header, rows) -> str:
    """A plain table: each column as wide as its widest cell, text left, numbers right."""
    cells = [tuple(map(str, header)), *(tuple(map(str, r)) for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(isinstance(r[i], int | float) for r in rows) for i in range(len(header))]
    numeric = [n or all(str(r[i])[:1].isdigit() for r in rows) and i > 0
               for i, n in enumerate(numeric)]

    def line(r):
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(r, widths, numeric, strict=True)).rstrip()
    return "\n".join([line(cells[0]), *(line(r) for r in cells[1:])])


def _add_scale_out_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--power-budget", metavar="POWER",
                   help=f"a facility's power, e.g. 100MW: how many chips of {what} it feeds "
                        f"running this step")
    p.add_argument("--tokens", type=float, metavar="N",
                   help=f"a run's tokens, e.g. 15e12: its time, energy and cost on {what} "
                        f"(and within --power-budget)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardscope", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="compile and estimate an experiment config")
    r.add_argument("config")
    r.add_argument("--backend", default="auto", choices=("auto", "cpu", "tpu", "gpu", "all"),
                   help="auto (the system's own compiler when installed, else cpu), cpu, "
                        "tpu, gpu, or all (each that can compile for the system, side by "
                        "side)")
    r.add_argument("--json", metavar="OUT")
    r.add_argument("--groups", action="store_true",
                   help="--json keeps every replica group (default: the first of each)")
    r.add_argument("--html", metavar="OUT")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallelism.fsdp=8")
    r.add_argument("--calibration", metavar="CAL.toml",
                   help="fitted efficiencies from `shardscope calibrate` (default: the "
                        "catalog's, meshes/calibration.toml)")
    _add_scale_out_args(r, "this system")
    r.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (shown only when it is a terminal)")
    r.set_defaults(fn=cmd_run)
    i = sub.add_parser("inspect", help="collectives and estimate of any HLO text dump")
    i.add_argument("hlo")
    i.add_argument("--system", required=True)
    i.add_argument("--mesh", help="mesh axes of the program, e.g. data=2,fsdp=4,tensor=2")
    i.add_argument("--json", metavar="OUT")
    i.add_argument("--groups", action="store_true",
                   help="--json keeps every replica group (default: the first of each)")
    i.set_defaults(fn=cmd_inspect)
    v = sub.add_parser("validate", help="run configs with a [measured] table and compare")
    v.add_argument("dir", nargs="*", default=None,
                   help="folders or .toml files of configs with [measured] tables (default: "
                        "the bundled validation set, experiments/validation)")
    v.add_argument("--backend", default="cpu", help="cpu (default), auto, tpu or gpu")
    v.add_argument("--workers", type=int, default=None,
                   help="cases compiled at once (default: the core count)")
    v.add_argument("--json", metavar="OUT")
    v.add_argument("--calibration", metavar="CAL.toml",
                   help="fitted efficiencies (default: the catalog's)")
    v.set_defaults(fn=cmd_validate)
    c = sub.add_parser("calibrate", help="fit the step-time model's efficiencies on measured "
                                         "runs")
    c.add_argument("dir", nargs="*", default=None,
                   help="folders or .toml files of configs with [measured] tables (default: "
                        "experiments/validation)")
    c.add_argument("--out", required=True, metavar="CAL.toml")
    c.add_argument("--features", metavar="OUT.json",
                   help="also write each run's step decomposition (what the fit used)")
    c.add_argument("--backend", default="cpu")
    c.add_argument("--workers", type=int, default=None)
    c.set_defaults(fn=cmd_calibrate)
    se = sub.add_parser("search", help="every sharding of a config's model on its system, "
                                       "compiled and ranked")
    se.add_argument("config")
    se.add_argument("--axes", default="data,fsdp,tensor",
                    help="mesh axes to spread the devices over (default data,fsdp,tensor; "
                         "any of data, fsdp, tensor, sequence, expert, pipeline)")
    se.add_argument("--vary", action="append", metavar="KEY=V1,V2",
                    help="also try these values of a key, e.g. train.remat=full,minimal")
    se.add_argument("--set", action="append", metavar="KEY=VALUE")
    se.add_argument("--store", default="shardscope-results.sqlite", metavar="DB",
                    help="the results store (SQLite; a rerun resumes from it)")
    se.add_argument("--workers", type=int, default=None,
                    help="compiles at once (default: the core count)")
    se.add_argument("--backend", default="cpu", choices=("cpu", "tpu", "gpu", "auto"))
    se.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                    help="run each compile as a Ray task: a local Ray instance, or the "
                         "cluster at ADDRESS (e.g. ray://head:10001); the ray extra")
    se.add_argument("--keep-unfit", action="store_true",
                    help="compile configs the memory model says cannot fit")
    se.add_argument("--budget", type=int, default=None, help="compile at most N configs")
    se.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="start no compile after S seconds")
    se.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                    help="per-config compile limit")
    se.add_argument("--reestimate", action="store_true",
                    help="re-time the stored programs without compiling")
    se.add_argument("--system", help="with --reestimate: time them on this system (same "
                                     "device count)")
    se.add_argument("--calibration", metavar="CAL.toml")
    se.add_argument("--top", type=int, default=10)
    se.add_argument("--json", metavar="OUT")
    se.add_argument("--html", metavar="OUT", help="the Pareto scatter and the ranking")
    se.add_argument("--quiet", action="store_true")
    se.set_defaults(fn=cmd_search)
    rs = sub.add_parser("results", help="the ranking in a search's results store")
    rs.add_argument("store")
    rs.add_argument("--search", help="one search of the store (its config's name)")
    rs.add_argument("--top", type=int, default=10)
    rs.add_argument("--json", metavar="OUT")
    rs.add_argument("--html", metavar="OUT", help="the Pareto scatter and the ranking")
    rs.set_defaults(fn=cmd_results)
    cp = sub.add_parser("compare", help="one config on several systems, side by side")
    cp.add_argument("config")
    cp.add_argument("--systems", required=True, metavar="A,B,C",
                    help="systems to compare, e.g. h100:64,b200:64,gb200-nvl72:64")
    cp.add_argument("--set", action="append", metavar="KEY=VALUE")
    cp.add_argument("--price-per-device-hour", type=float, default=None, metavar="USD",
                    help="what a device-hour costs you, for $ per million tokens")
    _add_scale_out_args(cp, "each system")
    cp.add_argument("--search", action="store_true",
                    help="each system with the fastest sharding that fits from a search on it "
                         "(instead of the config's)")
    cp.add_argument("--axes", default="data,fsdp,tensor",
                    help="with --search: the mesh axes to split the devices over")
    cp.add_argument("--store", default="shardscope-results.sqlite", metavar="DB",
                    help="with --search: the results store (a rerun compiles nothing new)")
    cp.add_argument("--workers", type=int, default=None, help="with --search: compile workers")
    cp.add_argument("--budget", type=int, default=None,
                    help="with --search: compile at most N configs per system")
    cp.add_argument("--calibration", metavar="CAL.toml")
    cp.add_argument("--json", metavar="OUT")
    cp.add_argument("--html", metavar="OUT", help="bar charts of every figure and the table")
    cp.add_argument("--quiet", action="store_true")
    cp.set_defaults(fn=cmd_compare)
    sub.add_parser("systems", help="the system catalog").set_defaults(fn=cmd_systems)
    sub.add_parser("models", help="the model presets").set_defaults(fn=cmd_models)
    sub.add_parser("configs", help="the bundled experiment configs (run them by name)"
                   ).set_defaults(fn=cmd_configs)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, tomllib.TOMLDecodeError) as e:
        print(f"shardscope: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:
        # Parse errors in HLO, unknown systems and other bad input: one line, no traceback.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"shardscope: error: {first}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except OSError as e:
        print(f"shardscope: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
