"""The config reference, generated from the descriptions on the config dataclasses' fields
(`models.program.described`): `shardscope keys` prints it and docs/config.md is written
from it (a test checks they agree), so neither can drift from the code."""

from __future__ import annotations

import dataclasses

from experiments.config import Measured, Parallelism
from meshes.catalog import OVERRIDES
from meshes.power import Cost
from models.config import ModelConfig
from models.program import Precision, Train, Workload

# table -> (its dataclass, what the table is for); [system] is the catalog's.
TABLES = {
    "model": (ModelConfig, "the model: `preset = NAME` (`shardscope models` lists them) "
                           "and any field below to change it, or every dimension given"),
    "system": (None, "the machine: `name = \"<family>:<size>\"` (`shardscope systems` lists "
                     "them) and overrides of its real network"),
    "parallelism": (Parallelism, ""),
    "workload": (Workload, ""),
    "precision": (Precision, ""),
    "train": (Train, ""),
    "cost": (Cost, ""),
    "measured": (Measured, "validation configs only"),
}


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING:
        return "required"
    v = f.default
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, tuple):
        return "[]"
    return "unset" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def entries(table: str) -> list[tuple[str, str, str]]:
    """(key, default, description) of every key of a table."""
    cls, _ = TABLES[table]
    if cls is None:
        return [("system.name", "required", "a catalog system, e.g. \"gb200-nvl72:72\", "
                                            "\"h100:64\", \"tpu-v6e:16x16\"")] + [
            (f"system.{k}", "the system's", f"{help} ({kind.upper()} systems)")
            for k, (kind, _, help) in OVERRIDES.items()]
    out = [(f"{table}.preset", "none", "a preset's name")] if table == "model" else []
    for f in dataclasses.fields(cls):
        if table == "model" and f.name == "name":
            continue
        out.append((f"{table}.{f.name}", _default(f), f.metadata.get("help", "")))
    return out


def missing_descriptions() -> list[str]:
    """Keys without a description (a test keeps this empty)."""
    return [key for table in TABLES for key, _, help in entries(table) if not help]


def markdown() -> str:
    """docs/config.md's text."""
    lines = ["# Config reference", "",
             "An experiment is a TOML file of these tables (`shardscope configs` lists the "
             "bundled ones). Any key can be overridden on the command line with "
             "`--set table.key=value`. Generated from the code by `shardscope keys "
             "--markdown` (`make docs`).", ""]
    for table, (_, what) in TABLES.items():
        lines += [f"## `[{table}]`", ""]
        if what:
            lines += [what[0].upper() + what[1:] + ".", ""]
        lines += [f"- `{key}` ({default}): {help}" for key, default, help in entries(table)]
        lines.append("")
    return "\n".join(lines)


def text(only: str | None = None) -> str:
    """The terminal reference: every key (of one table), its default and meaning."""
    lines = []
    for table in [only] if only else TABLES:
        rows = entries(table)
        width = max(len(k) for k, _, _ in rows) + 2
        lines.append(f"[{table}]" + (f"  {TABLES[table][1]}" if TABLES[table][1] else ""))
        lines += [f"  {key:<{width}}{help} (default {default})" for key, default, help in rows]
        lines.append("")
    return "\n".join(lines).rstrip()
