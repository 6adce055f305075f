"""Every flag of the command line, declared once: parent parsers that the commands share,
and the value types that check what the user typed (a one-line error naming the flag)."""

from __future__ import annotations

import argparse
import math

from sharding.compiler import BACKENDS
from sharding.rules import MESH_AXES

# The backend every command compiles with unless told otherwise: XLA:CPU on fake devices
# (seconds; the calibration was fitted on it). `auto`, `tpu`, `gpu` take the system's own
# deviceless compiler, which takes minutes on a large pod.
DEFAULT_BACKEND = "cpu"


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (`shardscope run: error: ...`), exit 2."""

    commands: tuple[str, ...] = ()  # the subcommands, on the top-level parser

    def error(self, message: str):
        if self.commands and "required: command" in message:
            message = (f"name a command: {', '.join(self.commands)} (`{self.prog} --help` "
                       f"says what each does)")
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 0 or more")
    return value


_POWER_UNITS = {"w": 1.0, "kw": 1e3, "mw": 1e6, "gw": 1e9}


def power(text: str) -> float:
    """"100MW", "250 kW", "1.5e8" (watts) -> watts."""
    t = text.strip().lower().replace(" ", "")
    unit = next((u for u in sorted(_POWER_UNITS, key=len, reverse=True) if t.endswith(u)), "")
    try:
        value = float(t[:len(t) - len(unit)]) * _POWER_UNITS.get(unit, 1.0)
    except ValueError:
        value = float("nan")
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a power like 100MW, 250kW or 1.5e8 "
                                         f"(watts)")
    return value


def tokens(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give the tokens of the whole run, above "
                                         f"0 (e.g. 15e12)")
    return value


def percent(text: str) -> float:
    """A threshold in percent, 0 or more: "5", "2.5", "5%"."""
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage of 0 or more, e.g. 5")
    return value


def names(text: str) -> list[str]:
    """A comma-separated list: "h100:64, b200:64" -> ["h100:64", "b200:64"]."""
    return [s.strip() for s in text.split(",") if s.strip()]


def _parent(*flags: tuple[tuple, dict]) -> Parser:
    p = Parser(add_help=False)
    for args, kwargs in flags:
        p.add_argument(*args, **kwargs)
    return p


def backend_flag(*, every: bool = False) -> Parser:
    """--backend; `every`: also "all" (each compiler that can, side by side)."""
    choices = (*BACKENDS, "all") if every else BACKENDS
    extra = ", or all (each compiler that can compile for the system, side by side)" \
        if every else ""
    return _parent((("--backend",), {
        "default": DEFAULT_BACKEND, "choices": choices,
        "help": f"the compiler: cpu (XLA:CPU on fake devices, seconds; the default), tpu or "
                f"gpu (the system's own deviceless compiler: minutes on a large pod), auto "
                f"(the system's own when installed, else cpu){extra}"}))


def parents(default_axes: tuple[str, ...]) -> dict[str, Parser]:
    """The shared flags, by what they are for (`default_axes`: the mesh axes a search
    spreads the devices over unless told)."""
    return {
        "config": _parent(
            (("config",), {"help": "a TOML experiment, or a bundled config's name "
                                    "(`shardscope configs` lists them)"}),
            (("--set",), {"action": "append", "metavar": "KEY=VALUE",
                          "help": "override a config key, e.g. --set parallelism.fsdp=8 "
                                  "(`shardscope keys` lists them); model.preset=NAME or "
                                  "model.hf_config=PATH replaces the file's model, keeping "
                                  "its run settings (fused_qkv, capacity_factor, ...): the "
                                  "model is that one with them and the --set model.* keys, e.g. "
                                  "--set model.preset=llama3-8b --set model.n_layers=2"})),
        "calibration": _parent((("--calibration",), {
            "metavar": "CAL.toml", "help": "fitted efficiencies from `shardscope calibrate` "
                                           "(default: the catalog's, meshes/calibration.toml)"})),
        "json": _parent((("--json",), {"metavar": "OUT", "help": "write the result as JSON"})),
        "out": _parent(
            (("--out",), {"metavar": "FILE", "help": "write it to FILE (default: stdout); "
                                                     "an existing file is kept unless --force"}),
            (("--force",), {"action": "store_true", "help": "overwrite --out's file"})),
        "html": _parent((("--html",), {"metavar": "OUT", "help": "write an HTML page"})),
        "groups": _parent((("--groups",), {
            "action": "store_true",
            "help": "--json keeps every replica group (default: the first of each)"})),
        "quiet": _parent((("--quiet",), {
            "action": "store_true",
            "help": "no progress on stderr (shown only when it is a terminal)"})),
        "workers": _parent((("--workers",), {
            "type": positive_int, "default": None,
            "help": "compiles at once (default: the core count)"})),
        "scale_out": _parent(
            (("--power-budget",), {"type": power, "metavar": "POWER",
                                   "help": "a facility's power, e.g. 100MW: how many chips "
                                           "it feeds running this step"}),
            (("--tokens",), {"type": tokens, "metavar": "N",
                             "help": "a run's tokens, e.g. 15e12: its time, energy and cost "
                                     "(and within --power-budget)"})),
        "top": _parent((("--top",), {"type": positive_int, "default": 10,
                                     "help": "rows of the ranking shown (default 10)"})),
        "store": _parent((("--store",), {
            "default": "shardscope-results.sqlite", "metavar": "DB",
            "help": "the results store (SQLite; a rerun resumes from it)"})),
        "axes": _parent((("--axes",), {
            "default": ",".join(default_axes),
            "help": f"mesh axes to spread the devices over (default {','.join(default_axes)}; "
                    f"any of {', '.join(MESH_AXES)})"})),
        "budget": _parent((("--budget",), {
            "type": positive_int, "default": None,
            "help": "compile at most N configs (the rest are counted as not tried)"})),
    }
