"""The commands over many configs: validate, calibrate, search, results, compare."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from experiments.cli.commands import calibration_of, calibration_used
from experiments.cli.output import (
    SearchProgress,
    checked,
    kept,
    progress_sink,
    write_json,
    write_text,
)
from experiments.config import MODEL_SOURCES, ConfigError
from sharding.units import counted


def cmd_validate(args) -> int:
    from experiments import validate
    from meshes.calibration import catalog_calibration

    calibration = calibration_of(args)  # a bad file is one line before anything compiles
    if args.json:  # and --json (it was checked after every run had compiled)
        checked(args.json, "--json")
        if Path(args.json).resolve() in _runs_given(args.dir):
            raise ConfigError(f"--json {args.json!r} is one of the runs validated; write the "
                              f"rows elsewhere, e.g. validate.json")
    t0 = time.perf_counter()
    rows = validate.validate(args.dir, backend=args.backend, workers=args.workers,
                             calibration=calibration)
    stats = validate.summary(rows)
    print(validate.format_table(rows, stats))
    # the catalog's too: validate says what the estimates it judges ran with
    data = calibration_used(calibration or catalog_calibration(),
                            {"cases": [r.to_dict() for r in rows], "summary": stats})
    for line in validate.timing_lines(rows, time.perf_counter() - t0):
        print(line)
    if args.json:
        write_json(args.json, data)
    bad = validate.unfit(rows)
    if bad:  # every run here ran: a "does not fit" is the memory model's error
        print(f"\n{len(bad)} published runs read 'does not fit' although they ran: "
              f"{', '.join(r.name for r in bad)}", file=sys.stderr)
        return 1
    return 0


def cmd_calibrate(args) -> int:
    import json

    from experiments import calibrate, validate

    # before the runs are compiled: a missing folder, or a file the user has (a fitted
    # calibration is minutes of work, and meshes/calibration.toml the catalog's own)
    out = checked(args.out, "--out")
    kept(args.out, args.force)
    if args.features:
        checked(args.features, "--features")
        kept(args.features, args.force, "--features")
    _outputs_apart(args)
    if len(_runs_given(args.dir)) == 1:
        raise ConfigError(f"one run given ({args.dir[0]}); calibrating needs at least "
                          f"{calibrate.MIN_RUNS} runs with a [measured] table (a parameter "
                          f"one run informs would match it exactly)")  # before compiling
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
    if not any(result.informed_by.values()):
        raise ConfigError(
            f"none of the {len(cases)} runs informs a calibration parameter (GPU bf16 "
            f"matmuls, TPU matmuls, flash attention, the time per kernel): host-cpu runs are "
            f"timed at this host's own measured rates, with nothing to fit; calibrate on "
            f"runs measured on GPUs or TPUs")
    if not result.fitted:  # a file of no parameters would run everything uncalibrated
        informed = "; ".join(f"{p}: {', '.join(runs)}" for p, runs in
                             result.informed_by.items() if runs)
        raise ConfigError(
            f"no parameter is fitted on these {len(cases)} runs: each needs "
            f"{calibrate.MIN_RUNS} runs or more that inform it, and fewer parameters than "
            f"runs on them ({informed}); add runs of the same kind (system and matmul "
            f"format); {out} was not written")
    for line in calibrate.unexplained(cases):
        print(f"note: {line}", file=sys.stderr)
    fitted_on = " ".join(args.dir) if args.dir else "experiments/validation"
    calibrate.write_calibration(result, out, fitted_on=fitted_on,
                                best=calibrate.best_mfu(rows))
    print(calibrate.format_fit(result))
    if args.features:
        checked(args.features, "--features").write_text(json.dumps(
            {"fitted_on": fitted_on, "cases": [{"name": n, "features": f, "measured_s": m}
                                               for n, f, m in cases]}, indent=1) + "\n")
        print(f"wrote {args.features}")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


def _runs_given(paths) -> set[Path]:
    """The run files validate and calibrate read from `paths` (the bundled set when none)
    that exist: validate.find_cases's, which says the others are missing."""
    from experiments import validate

    given = [d for d in paths or [validate.VALIDATION_DIR] if Path(d).exists()]
    return {p.resolve() for p in validate.find_cases(given)} if given else set()


def _outputs_apart(args) -> None:
    """calibrate's --out and --features are two files, and neither is one of its runs nor
    (--out) a .toml in a folder of them, which the next validate of it would read as a
    run: a one-line error before anything compiles."""
    from experiments.validate import VALIDATION_DIR

    runs = _runs_given(args.dir)
    folders = {Path(d).resolve() for d in args.dir or [VALIDATION_DIR] if Path(d).is_dir()}
    out = Path(args.out).resolve()
    if args.features and Path(args.features).resolve() == out:
        raise ConfigError(f"--out and --features are both {args.out!r}: the step "
                          f"decompositions would overwrite the calibration; give --features "
                          f"its own file, e.g. features.json")
    for flag, path in (("--out", args.out), ("--features", args.features)):
        if path and Path(path).resolve() in runs:
            raise ConfigError(f"{flag} {path!r} is one of the runs calibrated; write it "
                              f"elsewhere")
    if out.suffix == ".toml" and out.parent in folders:
        raise ConfigError(f"--out {args.out!r} is in {str(Path(args.out).parent)!r}, a folder "
                          f"of runs calibrated: validate and calibrate of that folder would "
                          f"read it as a run; write it elsewhere, e.g. my-cluster.toml")


def _store(path: str, *, read_only: bool = False):
    from experiments.store import Store

    if not Path(path).parent.exists():
        raise ConfigError(f"--store {path!r}: folder {str(Path(path).parent)!r} does not "
                          f"exist; create it or store elsewhere")
    return Store(path, read_only=read_only)


def _outputs_checked(args) -> None:
    """--json, --html (and --out) name files that can be written, before anything compiles."""
    for flag in ("json", "html", "out"):
        if getattr(args, flag, None):
            checked(getattr(args, flag), f"--{flag}")


def cmd_search(args) -> int:
    from experiments import config as config_mod
    from experiments import search as search_mod

    raw = config_mod.load_raw(args.config, args.set or [])
    exp = config_mod.from_dict(raw)
    axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
    search_mod.check_axes(axes)
    vary = search_mod.parse_vary(args.vary or [])
    if any(k in MODEL_SOURCES for k, _ in vary):  # each config's model from the command line
        raw = config_mod.load_raw(args.config, args.set or [], varied=[k for k, _ in vary])
    search_mod.check_vary(raw, vary)
    calibration = calibration_of(args)
    if args.system and not args.reestimate:
        raise ConfigError(f"--system {args.system}: only with --reestimate (re-time the stored "
                          f"programs on it); to search on {args.system}, use --set "
                          f"system.name={args.system}")
    if not args.reestimate and "system.name" not in dict(vary):
        # a backend that cannot build the system refuses every config alike: say it once
        from sharding.compiler import resolve_backend

        try:
            resolve_backend(args.backend, exp.system)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if args.export:  # the flag's mistake before anything compiles
        from experiments import frameworks

        frameworks.check(exp, args.export, flag="search --export")
        kept(args.out, args.force)
    elif args.out:
        raise ConfigError("search --out writes the best config's settings: give --export "
                          "maxtext|megatron with it, or leave --out out")
    _outputs_checked(args)
    not_tried = 0
    with _store(args.store) as store:
        if args.reestimate:
            if args.system:
                from meshes import get_system

                get_system(args.system)  # a typo is one line, before anything is read
            search_mod.stored_searches(
                store, exp.name, "search --reestimate:",
                fix="re-times a search by its config's name (--set name=NAME for another)")
            results = search_mod.reestimate(store, system=args.system,
                                            calibration=calibration, search=exp.name)
            how = f"on {args.system}" if args.system else "under the current model"
            print(f"re-estimated {sum(r.status == 'ok' for r in results)} stored programs "
                  f"{how}, no compile (kept in {args.store}: `shardscope results "
                  f"{args.store}{' --system ' + args.system if args.system else ''}`)")
            too_big = sum(search_mod.unfit(r.status, r.message) for r in results)
            if args.system and too_big:
                were = "s did not fit on the store's system and were" if too_big > 1 else \
                    " did not fit on the store's system and was"
                print(f"{too_big} config{were} never compiled; with {args.system}'s HBM "
                      f"they may: `shardscope search {args.config} --set "
                      f"system.name={args.system}` tries them")
            print()
            title = f"{exp.name} re-timed {how}"
        else:
            with SearchProgress(args) as sink:
                outcome = search_mod.run_search(
                    raw, num_devices=exp.system.num_devices, axes=axes, vary=vary,
                    store=store, search=exp.name, backend=args.backend,
                    workers=args.workers, keep_unfit=args.keep_unfit, budget=args.budget,
                    time_budget_s=args.time_budget, timeout_s=args.timeout,
                    calibration=calibration, on_result=sink, ray_address=args.ray,
                    retry_errors=args.retry_errors)
            if outcome.interrupted:
                print(f"stopped: {len(outcome.results)} results committed to {args.store}; "
                      f"the same command resumes", file=sys.stderr)
                return 130
            results = outcome.rows
            print(f"{exp.name} on {exp.system.label}: {counted(len(results), 'config')} in "
                  f"{args.store} ({_how_found(outcome)})")
            print(f"model: {_searched_model(exp, vary)}\n")
            title = exp.name
            not_tried = outcome.untried
    _ranking_outputs(args, results, title, not_tried, calibration=calibration)
    if args.export:
        _export_best(args, results)
    return 0


def _searched_model(exp, vary) -> str:
    """The model a search runs, and the model keys it varies (each config's name says
    its values)."""
    varied = [k for k, _ in vary if k.startswith("model.")]
    if any(k in MODEL_SOURCES for k in varied):
        return f"varied ({', '.join(varied)})"
    return exp.model_label + (f"; varied: {', '.join(varied)}" if varied else "")


def _how_found(outcome) -> str:
    """Where a search's results came from: the store (as stored, or re-estimated under
    this run's calibration), compiles now (retries included), the budget's leftovers."""
    parts = [f"{outcome.skipped} already there"]
    if outcome.retimed:
        parts.append(f"{outcome.retimed} of them re-estimated under this calibration, no "
                     f"compile")
    parts.append(f"{outcome.compiled} compiled now")
    if outcome.retried:
        parts.append(f"{outcome.retried} stored failures or unfit configs tried again")
    if outcome.untried:
        parts.append(f"{outcome.untried} not tried (the budget; the same command with a "
                     f"larger --budget goes on)")
    return ", ".join(parts)


def _export_best(args, results) -> None:
    """The fastest config that fits as the framework's settings (`search --export`)."""
    from experiments import config as config_mod
    from experiments import frameworks, ranking
    from experiments.cli.commands import emit

    ranked = ranking.ranking(results)
    if not ranked:
        raise ConfigError(f"search --export {args.export}: no config ran and fit, so none is "
                          f"the best; allow more mesh axes (--axes) or more memory savings "
                          f"(--vary train.remat=full)")
    best = ranked[0]
    config = dict(best.config)
    if best.retimed_on:  # re-estimated on another system: the run is on that one
        config["system"] = {"name": best.retimed_on}
    text = frameworks.export(config_mod.from_dict(config), args.export)
    if not args.out:
        print(f"\nthe best, {best.name}, as {args.export}'s settings:")
    emit(f"# shardscope search: the best of {len(results)} configs, {best.name}\n{text}", args)


def _ranking_outputs(args, results, title: str, untried: int = 0, *,
                     calibration=None) -> None:
    from experiments import ranking

    print(ranking.format_results(results, top=args.top, untried=untried))
    data = calibration_used(calibration, ranking.to_json(results))
    if args.json:
        write_json(args.json, data)
    if args.html:
        from experiments import pages

        write_text(args.html, pages.search_page(results, title))


def cmd_results(args) -> int:
    from experiments import ranking
    from experiments import search as search_mod

    if not Path(args.store).exists():
        raise ConfigError(f"store {args.store!r} not found; `shardscope search CONFIG --store "
                          f"{args.store}` makes one")
    _outputs_checked(args)
    with _store(args.store, read_only=True) as store:  # read, never written
        if args.search:
            search_mod.stored_searches(store, args.search, "--search")
        results = store.results(search=args.search, system=args.system)
    if args.system and not results:
        raise ConfigError(f"--system {args.system}: {args.store} has no re-estimates on it; "
                          f"`shardscope search CONFIG --store {args.store} --reestimate "
                          f"--system {args.system}` makes them")
    where = f"re-timed on {args.system}" if args.system else "as compiled"
    groups = ranking.searches(results)
    if len(groups) <= 1:
        what = args.search or Path(args.store).name
        systems = sorted({r.system for r in results})
        on = f"on {', '.join(systems) or 'no system'} ({where})" if not args.system else where
        print(f"{what} {on}: {counted(len(results), 'config')}\n")
        _ranking_outputs(args, results, what)
        return 0
    if args.html:
        raise ConfigError(f"--html draws one search; {args.store} holds {len(groups)}: "
                          f"{'; '.join(g.label for g in groups)}; give --search NAME")
    print(f"{args.store}: {len(groups)} searches, each ranked apart ({where})")
    for g in groups:
        print(f"\n{g.label}: {counted(len(g.results), 'config')}\n")
        print(ranking.format_results(g.results, top=args.top))
    if args.json:
        write_json(args.json, {"searches": [g.to_json() for g in groups]})
    return 0


def cmd_compare(args) -> int:
    from experiments import compare as compare_mod
    from experiments import config as config_mod

    raw = config_mod.load_raw(args.config, args.set or [])
    exp = config_mod.from_dict(raw)  # the config itself is valid
    price = args.price_per_device_hour
    if price is not None and not 0 < price < math.inf:  # nan and inf too
        raise ConfigError(f"--price-per-device-hour {args.price_per_device_hour}: give the "
                          f"price you pay per device and hour, above 0")
    _outputs_checked(args)  # before the compiles
    calibration = calibration_of(args)
    search = None
    if args.search:
        axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
        search = {"store": args.store, "axes": axes, "workers": args.workers,
                  "budget": args.budget, "calibration": calibration}
    with progress_sink(args):
        entries = compare_mod.compare(raw, args.systems, calibration=calibration,
                                      price_per_device_hour=args.price_per_device_hour,
                                      search=search)
    entries = compare_mod.with_scale_out(entries, power_budget_w=args.power_budget,
                                         tokens=args.tokens)
    print(f"{raw['name']}: the same model and workload on {len(args.systems)} systems")
    print(f"model: {exp.model_label}\n")
    print(compare_mod.format_compare(entries))
    data = calibration_used(calibration, {"model": exp.model_label,
                                          "systems": [e.to_dict() for e in entries]})
    if args.json:
        write_json(args.json, data)
    if args.html:
        from experiments import pages

        write_text(args.html, pages.compare_page(entries, raw["name"]))
    return 0
