"""`shardscope`: run experiments, inspect HLO dumps, list systems and model presets.

Mistakes in what the user wrote end in one line on stderr and exit status 2.

Rooms: `flags.py` declares every flag once (parent parsers and value types);
`commands.py` the commands about one config (run, fit, inspect, export, import, systems,
models, configs, keys); `studies.py` those over many (validate, calibrate, search, results,
compare); `output.py` files, tables and progress.
"""

from __future__ import annotations

import glob
import os
import sys
import tomllib

# Before JAX is imported: compile on fake CPU devices, never probe for accelerators. XLA's
# C++ log lines are captured around each compile (sharding.compiler.capture_stderr) and the
# useful ones shown in the report.
# `measure` runs on the devices present: where a GPU or TPU is attached, JAX looks for it
# (unless JAX_PLATFORMS says otherwise).
_ACCELERATOR_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
if next((a for a in sys.argv[1:] if not a.startswith("-")), "") != "measure" or \
        not any(glob.glob(p) for p in _ACCELERATOR_FILES):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments.cli import commands, studies  # noqa: E402
from experiments.cli.flags import (  # noqa: E402
    Parser,
    backend_flag,
    names,
    non_negative_int,
    parents,
    percent,
    positive_int,
)
from experiments.config import ConfigError  # noqa: E402
from meshes.calibration import PARAMETERS  # noqa: E402

EXIT_USAGE = 2


def build_parser() -> Parser:
    from experiments import diff as diff_mod
    from experiments.search import DEFAULT_AXES
    from experiments.store import tool_version

    f = parents(DEFAULT_AXES)
    p = Parser(prog="shardscope", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"shardscope {tool_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    def command(name: str, help: str, fn, *shared: str, backend: str = "",
                **kwargs) -> Parser:
        # every command takes --quiet (a script passes it to all): no progress lines
        flags = [f[s] for s in (*shared, *(() if "quiet" in shared else ("quiet",)))]
        if backend:
            flags.append(backend_flag(every=backend == "every"))
        c = sub.add_parser(name, help=help, parents=flags, **kwargs)
        c.set_defaults(fn=fn)
        return c

    command("run", "compile and estimate an experiment config", commands.cmd_run,
            "config", "json", "groups", "html", "calibration", "scale_out", "quiet",
            backend="every")
    ft = command("fit", "will it fit: the memory verdict and the changes that make it fit",
                 commands.cmd_fit, "config", "json", "calibration", "quiet", backend="one")
    ft.add_argument("--top", type=positive_int, default=3,
                    help="changes shown, each compiled and estimated (default 3)")
    ft.add_argument("--no-compile", action="store_true",
                    help="size the changes with the memory model only (no compile, no step "
                         "time)")
    me = command("measure", "run the config's step on the devices present, timed and "
                 "profiled, beside its estimate", commands.cmd_measure, "config", "json",
                 "calibration", "quiet")
    # its own --out (the shared one's help is every other command's: a parent's actions
    # are shared, so changing its help changed theirs)
    me.add_argument("--out", metavar="FILE", help="write the config with a [measured] table "
                    "to FILE, for validate and calibrate; an existing file is kept unless "
                    "--force")
    me.add_argument("--force", action="store_true", help="overwrite --out's file")
    me.add_argument("--steps", type=positive_int, default=5, help="timed steps (default 5)")
    me.add_argument("--warmup", type=non_negative_int, default=2,
                    help="untimed steps first (default 2)")
    me.add_argument("--profile", metavar="DIR",
                    help="take a jax.profiler trace of --steps more steps into DIR (kept for "
                         "TensorBoard / Perfetto) and measure device time by category; with "
                         "several processes, process 0's (all of them run the steps)")
    me.add_argument("--coordinator", metavar="HOST:PORT",
                    help="multi-host: process 0's address (jax.distributed)")
    me.add_argument("--num-processes", type=positive_int, metavar="N",
                    help="multi-host: the processes in all")
    me.add_argument("--process-id", type=non_negative_int, metavar="I",
                    help="multi-host: this process's index, 0 to N-1")
    i = command("inspect", "collectives and estimate of any HLO text dump",
                commands.cmd_inspect, "json", "groups")
    i.add_argument("hlo", help="an HLO text dump, e.g. XLA's *after_optimizations.txt or "
                               "*after_spmd-partitioning*.txt (or a .gz of one)")
    i.add_argument("--system", required=True,
                   help="the system to time it on, e.g. h100:8 or tpu-v5e:4x4 (`shardscope "
                        "systems` lists them)")
    i.add_argument("--mesh", help="mesh axes of the program, e.g. data=2,fsdp=4,tensor=2")

    for name, help, fn in (
            ("validate", "run configs with a [measured] table and compare",
             studies.cmd_validate),
            ("calibrate", "fit the step-time model's efficiencies on measured runs",
             studies.cmd_calibrate)):
        shared = ("workers", "json", "calibration") if name == "validate" else ("workers",)
        v = command(name, help, fn, *shared, backend="one")
        v.add_argument("dir", nargs="*", default=None,
                       help="folders or .toml files of configs with [measured] tables "
                            "(default: the bundled validation set, experiments/validation)")
    c = sub.choices["calibrate"]
    c.description = (
        "Fit the step-time model's efficiencies (" + ", ".join(PARAMETERS) + ") on runs "
        "with a [measured] table, each parameter on the runs it informs (the others keep "
        "their uncalibrated value); with 3 runs or more, also each run's leave-one-out "
        "error. Use the file with --calibration on run, fit, validate, search, compare and "
        "measure.")
    c.add_argument("--out", required=True, metavar="CAL.toml",
                   help="the calibration file to write ([parameters], [provenance], "
                        "[best_measured_mfu]); an existing file is kept unless --force")
    c.add_argument("--features", metavar="OUT.json",
                   help="also write each run's step decomposition (what the fit used)")
    c.add_argument("--force", action="store_true",
                   help="overwrite the files of --out and --features")

    se = command("search", "every sharding of a config's model on its system, compiled and "
                 "ranked", studies.cmd_search, "config", "axes", "store", "workers", "budget",
                 "calibration", "top", "json", "html", "out", "quiet", backend="one")
    se.add_argument("--vary", action="append", metavar="KEY=V1,V2",
                    help="also try these values of a key, e.g. train.remat=full,minimal; "
                         "model.preset values each replace the file's model (its run "
                         "settings kept), as with --set")
    se.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                    help="run each compile as a Ray task: a local Ray instance, or the "
                         "cluster at ADDRESS (e.g. ray://head:10001); the ray extra")
    se.add_argument("--keep-unfit", action="store_true",
                    help="compile configs the memory model says cannot fit (on a rerun, "
                         "also those stored as 'does not fit')")
    se.add_argument("--retry-errors", action="store_true",
                    help="compile again the configs stored as failed (errors, timeouts); a "
                         "rerun otherwise keeps every stored result")
    se.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="start no compile after S seconds")
    se.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                    help="per-config compile limit")
    se.add_argument("--reestimate", action="store_true",
                    help="re-time the stored programs without compiling")
    se.add_argument("--system", help="with --reestimate: time them on this system (same "
                                     "device count); kept in the store per system")
    se.add_argument("--export", metavar="FRAMEWORK",
                    help="also print the best config as maxtext's config keys or megatron's "
                         "flags (as `export --to`; --out writes them to a file)")

    rs = command("results", "the ranking in a search's results store", studies.cmd_results,
                 "top", "json", "html", "quiet")
    rs.add_argument("store", help="a results store that `shardscope search --store` wrote")
    rs.add_argument("--search", help="one search of the store (its config's name)")
    rs.add_argument("--system", help="the re-estimates kept for this system (search "
                                     "--reestimate --system); default: as compiled")

    cp = command("compare", "one config on several systems, side by side",
                 studies.cmd_compare, "config", "scale_out", "axes", "store", "workers",
                 "budget", "calibration", "json", "html", "quiet")
    cp.add_argument("--systems", required=True, type=names, metavar="A,B,C",
                    help="systems to compare, e.g. h100:64,b200:64,gb200-nvl72:64")
    cp.add_argument("--price-per-device-hour", type=float, default=None, metavar="USD",
                    help="what a device-hour costs you, for $ per million tokens")
    cp.add_argument("--search", action="store_true",
                    help="each system with the fastest sharding that fits from a search on it "
                         "(instead of the config's; --axes, --store, --workers, --budget "
                         "shape the search)")

    df = command("diff", "two run --json reports (or two search stores) side by side: exit "
                 "1 when NEW adds communication or slows the step past the thresholds",
                 commands.cmd_diff, "json")
    df.add_argument("old", help="the report (or results store) to compare with, e.g. the "
                                "main branch's")
    df.add_argument("new", help="the report (or results store) of the change")
    for what, default, help in (
            ("step", diff_mod.MAX_STEP_INCREASE, "step time"),
            ("bytes", diff_mod.MAX_BYTES_INCREASE,
             "bytes per step of any collective kind over its mesh axes (counted exactly, "
             "so any growth fails by default; a new one fails at any threshold)"),
            ("memory", diff_mod.MAX_MEMORY_INCREASE, "memory per device")):
        df.add_argument(f"--max-{what}-increase", type=percent, default=default,
                        metavar="PCT", help=f"the most the {help} may grow, in percent "
                                            f"(default {default:g})")

    ex = command("export", "the config's sharding, batch, remat and precision as a "
                 "framework's own settings", commands.cmd_export, "config", "out")
    ex.add_argument("--to", required=True, metavar="FRAMEWORK",
                    help="maxtext (its config keys) or megatron (its command-line flags)")
    im = command("import", "a framework's config as an experiment config",
                 commands.cmd_import)
    # its own --out: required (the experiment is named after the file), not stdout
    im.add_argument("--out", metavar="EXP.toml", help="the experiment config to write "
                    "(required; its name is the file's); an existing file is kept unless "
                    "--force")
    im.add_argument("--force", action="store_true", help="overwrite --out's file")
    im.add_argument("framework", metavar="FRAMEWORK", help="maxtext, megatron or nemo")
    im.add_argument("source", metavar="CONFIG", help="the framework's config file: MaxText's "
                    "YAML; Megatron-LM's flags (one or several per line) or launch script; "
                    "NeMo 1's YAML (megatron_gpt_config.yaml's trainer: and model:)")
    im.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="overrides as the framework's command line takes them, e.g. "
                         "ici_fsdp_parallelism=8, model.tensor_model_parallel_size=8 "
                         "(NeMo); Megatron's also as flags, e.g. "
                         "--tensor-model-parallel-size 8")
    im.add_argument("--system", help="the system it runs on, e.g. tpu-v5e:16x16*4 (unless "
                                     "the file names one: `shardscope export` writes it)")

    sy = command("systems", "the system catalog", commands.cmd_systems)
    sy.add_argument("name", nargs="?", help="one system, e.g. h100:64 or tpu-v5p:8x8x8 "
                                            "(default: every family, with the calibration)")
    command("models", "the model presets", commands.cmd_models)
    command("configs", "the bundled experiment configs (run them by name)",
            commands.cmd_configs)
    k = command("keys", "every config key: its table, default and meaning",
                commands.cmd_keys)
    k.add_argument("table", nargs="?", help="one table (model, system, parallelism, ...)")
    k.add_argument("--markdown", action="store_true", help="as docs/config.md")
    p.commands = tuple(sub.choices)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # import's KEY=VALUE overrides may follow its flags, as MaxText's command line has
        # them; Megatron's are flags (`--flag value`) too
        if extra and args.command == "import" and (
                args.framework == "megatron"
                or all("=" in x and not x.startswith("-") for x in extra)):
            args.overrides += extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # --help (0) or a flag argparse refused (2, its line printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
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
    except KeyboardInterrupt:  # Ctrl-C outside a command's own handling: no traceback
        print("shardscope: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except OSError as e:
        print(f"shardscope: error: {e}", file=sys.stderr)
        return EXIT_USAGE
