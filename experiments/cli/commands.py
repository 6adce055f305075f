"""The commands about one config or one thing: run, measure, inspect, export, import,
systems, models, configs."""

from __future__ import annotations

from pathlib import Path

from experiments.cli.output import (
    checked,
    folder,
    format_columns,
    kept,
    progress_sink,
    write_json,
    write_text,
)
from experiments.config import ConfigError


def calibration_of(args):
    """The --calibration file's values, or None for the catalog's."""
    if not getattr(args, "calibration", None):
        return None
    from experiments.config import load_calibration

    return load_calibration(args.calibration)


def calibration_used(calibration, out: dict) -> dict:
    """`out`, a command's JSON, with the calibration its figures above were made with
    (`calibration_of`'s, read once; None: the catalog's, unsaid): print the line that names
    it and add `calibration` (its values and source, Calibration.summary, as `run --json`
    has it)."""
    if calibration is None:
        return out
    print(f"calibration: {calibration.source}")
    return {**out, "calibration": calibration.summary()}


def cmd_run(args) -> int:
    from experiments import config as config_mod
    from experiments import fit, runner
    from experiments.store import tool_version

    exp = config_mod.load(args.config, args.set or [])
    config = {**exp.to_dict(), "backend": args.backend, "tool_version": tool_version()}
    if args.backend == "all":
        return _run_all_backends(args, exp, config)
    with progress_sink(args):
        report = runner.run(exp, backend=args.backend, calibration=calibration_of(args),
                            advise=fit.advice)
    print(report.format_table())
    scale_out = None
    if args.power_budget is not None or args.tokens is not None:
        from meshes.power import replica_chips
        from sharding.text import format_scale_out

        scale_out = report.energy.scale_out(
            power_budget_w=args.power_budget, tokens=args.tokens,
            replica_chips=replica_chips(report.num_devices, exp.parallelism.data,
                                        exp.system.chip.devices_per_chip))
        print("\n".join(format_scale_out(report, scale_out)))
    if args.json:
        write_json(args.json, {**report.to_dict(groups=args.groups), "scale_out": scale_out,
                               **model_params(exp), "config": config})
    if args.html:
        from sharding.html import render_html

        write_text(args.html, render_html(report, chip=exp.system.chip,
                                          compute_dtype=exp.precision.compute))
    return 0


def model_params(exp) -> dict:
    """The model's parameters, all (the embedding counted once when tied) and those a
    token's matmuls touch: its experts, not the embedding table (the output projection
    counted, tied to the table or not), as DeepSeek and OpenAI count "activated"
    parameters and MFU's 6 x N does."""
    return {"model_params": exp.model.param_count(),
            "active_params": exp.model.matmul_param_count()}


def cmd_measure(args) -> int:
    from experiments import config as config_mod
    from experiments import measure

    exp = config_mod.load(args.config, args.set or [])
    kept(args.out, args.force)  # before the run, not after
    for path, flag in ((args.out, "--out"), (args.json, "--json")):
        if path:
            checked(path, flag)  # a missing folder too, before the run
    if args.profile:
        folder(args.profile, "--profile")  # made now: the trace is written after the steps
    procs = measure.start_processes(exp, coordinator=args.coordinator,
                                    num_processes=args.num_processes,
                                    process_id=args.process_id)
    calibration = calibration_of(args)
    with progress_sink(args):
        m = measure.measure(exp, steps=args.steps, warmup=args.warmup,
                            profile_dir=args.profile, calibration=calibration,
                            processes=procs)
    if procs.index != 0:  # the others print their loss; process 0 writes
        print(f"process {procs.index}: loss " + " ".join(f"{x:.4f}" for x in m.loss or ()))
        return 0
    print(m.format())
    data = calibration_used(calibration, m.to_dict())
    if args.out:  # first: the run's record for validate, kept whatever fails after it
        write_text(args.out, measure.to_toml(exp, m), flag="--out")
    if args.json:
        write_json(args.json, data)
    return 0


def cmd_fit(args) -> int:
    from experiments import config as config_mod
    from experiments import fit

    exp = config_mod.load(args.config, args.set or [])
    calibration = calibration_of(args)
    with progress_sink(args):
        verdict = fit.fit(exp, backend=args.backend, calibration=calibration,
                          limit=args.top, compile=not args.no_compile)
    print(verdict.format())
    data = calibration_used(calibration, verdict.to_dict())
    if args.json:
        write_json(args.json, data)
    return 0


def _run_all_backends(args, exp, config) -> int:
    """The step on every compiler that can compile for the system here, side by side."""
    from experiments import fit, runner
    from sharding.compiler import available_backends, own_compiler
    from sharding.text import format_side_by_side

    if args.html:
        raise ConfigError("--html takes one backend; run --backend all without --html, or "
                          "--html with --backend cpu|tpu|gpu")
    if args.power_budget is not None or args.tokens is not None:  # were dropped unsaid
        raise ConfigError("--power-budget and --tokens take one backend; run --backend all "
                          "without them, or with --backend cpu|tpu|gpu")
    backends = available_backends(exp.system)
    reports, calibration = [], calibration_of(args)
    with progress_sink(args):
        for b in backends:
            reports.append((b, runner.run(exp, backend=b, calibration=calibration,
                                          advise=fit.advice)))
    print(f"{exp.name}  on {reports[0][1].system}: the same step from each compiler")
    print(f"model: {exp.model_label}\n")
    print(format_side_by_side(reports))
    own = own_compiler(exp.system)
    if len(backends) == 1:
        why = own.refusal(exp.system) if own else ""
        print(f"\nonly XLA:CPU can compile for {exp.system.name} here"
              + (f": {why}" if why else f"; for its own compiler: {own.install}" if own else ""))
    if args.json:
        write_json(args.json, {"backends": [{**r.to_dict(groups=args.groups), "backend": b}
                                            for b, r in reports], **model_params(exp),
                               "config": config})
    return 0


def cmd_inspect(args) -> int:
    import sharding

    path = Path(args.hlo)
    if path.is_dir():
        raise ConfigError(_dump_folder(args.hlo, path))
    if not path.is_file():
        raise ConfigError(f"HLO file {args.hlo!r} not found; give a text dump such as XLA's "
                          f"*after_optimizations.txt (or a .gz of one)")
    axis_names, mesh_shape = _mesh_flag(args.mesh) if args.mesh else ((), ())
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip: a compressed dump reads as its text
        import gzip

        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ConfigError(f"HLO file {args.hlo!r} is a damaged gzip file ({e}); "
                              f"give the dump's text or an intact .gz of it") from None
    try:
        module = sharding.parse_hlo(raw.decode(errors="replace"))
    except sharding.HloParseError as e:  # which file, and what to give instead
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"HLO file {args.hlo!r}: {first}; give a whole HLO text dump such "
                          f"as XLA's *after_optimizations.txt (or a .gz of one)") from None
    devices = 1
    for s in mesh_shape:
        devices *= s
    if mesh_shape and devices != module.num_partitions:
        raise ConfigError(f"--mesh {args.mesh} has {devices} devices but the program runs on "
                          f"{module.num_partitions} (num_partitions); give sizes whose "
                          f"product is {module.num_partitions}")
    from meshes import get_system

    report = sharding.analyze_module(module, system=get_system(args.system),
                                     mesh_shape=mesh_shape, axis_names=axis_names,
                                     compiler="HLO text", name=path.name)
    print(report.format_table())
    if args.json:
        write_json(args.json, report.to_dict(groups=args.groups))
    return 0


def _mesh_flag(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`--mesh data=2, tensor=4`: the axis names and sizes, spaces around them dropped."""
    pairs = [[x.strip() for x in p.split("=")] for p in text.split(",")]
    if any(len(p) != 2 or not p[0] or not p[1].isdigit() for p in pairs):
        raise ConfigError(f"--mesh {text!r}: expected name=size,... e.g. "
                          f"--mesh data=2,fsdp=4,tensor=2")
    names = [p[0] for p in pairs]
    twice = next((a for a in names if names.count(a) > 1), None)
    if twice is not None:
        raise ConfigError(f"--mesh {text!r}: axis {twice!r} is given twice; name each mesh "
                          f"axis once, e.g. --mesh data=2,tensor=4")
    return tuple(names), tuple(int(p[1]) for p in pairs)


# The modules of an --xla_dump_to folder that inspect reads: after SPMD partitioning (the
# program's dtypes) and the final one.
_DUMP_FILES = ("*after_spmd-partitioning*.txt", "*after_optimizations.txt")


def _dump_folder(given: str, path: Path) -> str:
    """Why a folder is not a dump, and which of its files are (an --xla_dump_to folder)."""
    found = [f for pattern in _DUMP_FILES for f in sorted(path.glob(pattern))]
    if not found:
        return (f"HLO file {given!r} is a folder with no {' or '.join(_DUMP_FILES)} in it; "
                f"give a text dump such as XLA's *after_optimizations.txt (or a .gz of one)")
    shown = ", ".join(str(f) for f in found[:4]) + (
        f" and {len(found) - 4} more" if len(found) > 4 else "")
    return (f"HLO file {given!r} is a folder (an --xla_dump_to dump?); give one of its HLO "
            f"texts, after SPMD partitioning (the program's dtypes) or the final one: {shown}")


def cmd_systems(args) -> int:
    from meshes import get_system, system_names
    from meshes.calibration import PARAMETERS, catalog_calibration
    from meshes.power import describe as power_of

    def show(s) -> None:
        print(s.name)
        for field, value in [*s.describe(), *power_of(s.family.name, s.chip)]:
            print(f"  {field:<11}{value}")

    if args.name:  # one system, any size: `systems h100:64`, `systems tpu-v5p:8x8x8*2`
        show(get_system(args.name))
        return 0
    for name in system_names():
        show(get_system(name))
    print(_host_cpu_lines())
    # The example is the catalog's own placement, so the line cannot drift from it.
    print(f"\nSizes: GPUs by any count, the last NVLink domain partly filled "
          f"(gb200-nvl72:256 is {get_system('gb200-nvl72:256').placement}; [system] "
          f"gpus_per_domain sets a domain's size); TPUs and Trainium2 by torus shape, '*N' "
          f"for N slices over DCN (Trainium2: N instances over EFA); host-cpu:N by device count.\n"
          f"A TPU7x chip shows as two JAX devices; parallelism sizes count devices.")
    cal = catalog_calibration()
    print(f"\nCalibration (meshes/calibration.toml): {cal.source}")
    width = max(map(len, PARAMETERS)) + 2
    for name, value in cal.values().items():
        print(f"  {name:<{width}}{value:<10.4g}(uncalibrated {PARAMETERS[name][2]:g}; "
              f"{PARAMETERS[name][3]})")
    return 0


def _host_cpu_lines() -> str:
    """host-cpu:N, with the figures this host's cache holds (nothing is measured here)."""
    from meshes.host import HostCpuSystem, cache_path, cached_rates, read_cache

    counts = sorted(int(n) for n in read_cache().get("rates", {}))
    lines = ["host-cpu:N"]
    for n in counts:
        rates = cached_rates(n)
        if rates is not None:
            lines += [f"  {f:<11}{v}" for f, v in HostCpuSystem(n, rates).describe()]
    if not counts:
        lines.append(f"  {'device':<11}this host's CPU as N fake devices; its rates are "
                     f"measured on first use (shardscope measure, or run on host-cpu:N) and "
                     f"kept in {cache_path()}")
    return "\n".join(lines)


def cmd_models(args) -> int:
    from models import PRESETS

    header = ("preset", "layers", "d_model", "heads", "kv", "d_ff", "vocab", "mlp",
              "attention", "kv_cache", "experts", "params", "active")
    rows = []
    for name, make in PRESETS.items():
        c = make()
        experts = (f"{c.n_experts} top-{c.experts_per_token}"
                   + (f" +{c.n_shared_experts} shared" if c.n_shared_experts else "")
                   + (f", first {c.n_dense_layers} dense {c.dense_layers_d_ff}"
                      if c.n_dense_layers else "")
                   if c.n_experts > 1 else "-")
        attention = (f"mla {c.kv_lora_rank}+{c.qk_rope_dim}" if c.mla else
                     "mha" if c.n_kv_heads == c.n_heads else "gqa")
        rows.append((name, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_ff, c.vocab,
                     c.mlp, attention, f"{2 * c.kv_cache_values_per_token():,} B", experts,
                     f"{c.param_count() / 1e9:.2f}B", f"{c.matmul_param_count() / 1e9:.2f}B"))
    print(format_columns(header, rows))
    print("\nparams: all parameters with the embedding; active: the parameters a token's "
          "matmuls touch, the output projection but not the embedding lookup, tied or not "
          "(what MFU's 6 x N counts, with attention on top); kv_cache: bytes per token and "
          "layer in bf16 (an 8-bit cache: half, and its scales)")
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


def cmd_keys(args) -> int:
    from experiments import reference

    if args.table and args.table not in reference.TABLES:
        raise ConfigError(f"keys {args.table!r}: not a config table; choose one of "
                          f"{', '.join(reference.TABLES)}")
    print(reference.markdown(args.table) if args.markdown else reference.text(args.table))
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


def cmd_diff(args) -> int:
    from experiments import diff as diff_mod

    thresholds = {"max_step_increase": args.max_step_increase,
                  "max_bytes_increase": args.max_bytes_increase,
                  "max_memory_increase": args.max_memory_increase}
    stores = [diff_mod.is_store(p) for p in (args.old, args.new)]
    if stores[0] != stores[1]:
        report, store = (args.new, args.old) if stores[0] else (args.old, args.new)
        raise ConfigError(f"diff {args.old} {args.new}: {store} is a results store and "
                          f"{report} is not; give two run --json reports or two stores "
                          f"(`shardscope search CONFIG --store DB`)")
    if all(stores):
        d = diff_mod.diff_stores(diff_mod.load_store(args.old),
                                 diff_mod.load_store(args.new), **thresholds)
        print(diff_mod.format_store_diff(d, args.old, args.new))
    else:
        d = diff_mod.diff(diff_mod.load(args.old), diff_mod.load(args.new), **thresholds)
        print(diff_mod.format_diff(d, args.old, args.new))
    if args.json:
        write_json(args.json, d.to_dict())
    return 0 if d.ok else 1


def emit(text: str, args) -> None:
    """To stdout, or to --out; a file already there (a user's) is kept unless --force."""
    if not args.out:
        print(text, end="")
        return
    kept(args.out, args.force)
    write_text(args.out, text, flag="--out")


def cmd_export(args) -> int:
    from experiments import config as config_mod
    from experiments import frameworks

    if args.to not in frameworks.FRAMEWORKS:  # before loading: the flag's mistake first
        raise ConfigError(f"--to {args.to!r} is not a framework shardscope exports to; "
                          f"choose one of {', '.join(frameworks.FRAMEWORKS)}")
    exp = config_mod.load(args.config, args.set or [])
    emit(frameworks.export(exp, args.to), args)
    return 0


def cmd_import(args) -> int:
    from experiments import importer, megatron, nemo

    readers = {"maxtext": importer.import_maxtext, "megatron": megatron.import_megatron,
               "nemo": nemo.import_nemo}
    if args.framework not in readers:
        raise ConfigError(f"import {args.framework!r}: shardscope imports {', '.join(readers)} "
                          f"configs; choose one of them")
    if not args.out:
        raise ConfigError("import needs --out EXP.toml (the experiment config to write; its "
                          "name is the file's)")
    kept(args.out, args.force)  # before reading: the file the user has, whatever the input
    emit(readers[args.framework](args.source, args.overrides, args.system, args.out), args)
    return 0
