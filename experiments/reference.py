"""The config reference, generated from the descriptions on the config dataclasses' fields
(`models.program.described`): `shardscope keys` prints it and docs/config.md is written
from it (a test checks they agree), so neither can drift from the code."""

from __future__ import annotations

import dataclasses
import re

from experiments.config import Parallelism, Serving
from experiments.measured import Measured
from meshes.catalog import OVERRIDES
from meshes.power import Cost
from models.config import RUN_FIELDS, ModelConfig
from models.program import Precision, Train, Workload

# table -> (its dataclass, what the table is for); [system] is the catalog's.
TABLES = {
    "model": (ModelConfig, "the model: `preset = NAME` (`shardscope models` lists them) "
                           "or `hf_config = \"config.json\"` ([from Hugging Face]"
                           "(#models-from-hugging-face)) and any key below to change it, or "
                           "every dimension given"),
    "system": (None, "the machine: `name` (`shardscope systems` lists them) and where a "
                     "cluster differs from the catalog's: [real cluster networks]"
                     "(scale.md#real-cluster-networks)"),
    "parallelism": (Parallelism, "the mesh: the sizes of its axes (their product is the "
                                 "number of devices) and how the step uses them"),
    "workload": (Workload, "what one step runs"),
    "precision": (Precision, "the dtypes of the parameters, the matmuls and what serving "
                             "stores"),
    "train": (Train, "the training recipe (ignored when serving)"),
    "serving": (Serving, "how a serving engine runs a decode step (ignored when "
                         "training)"),
    "cost": (Cost, "prices and the facility, for energy and cost: [power, energy and cost]"
                   "(power.md)"),
    "measured": (Measured, "a measured step, in the configs `validate` and `calibrate` "
                           "read: a published run ([validation](validation.md)) or one "
                           "`shardscope measure --out` wrote ([measure](measure.md))"),
}


def toml_value(v) -> str:
    """A value as a config file writes it: "text", true, [1, 2], 3e-04 as 0.0003."""
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING:
        return "required"
    return "unset" if f.default is None else toml_value(f.default)


def entries(table: str) -> list[tuple[str, str, str]]:
    """(key, default, description) of every key of a table."""
    cls, _ = TABLES[table]
    if cls is None:
        name = ("a catalog system, e.g. \"gb200-nvl72:72\", \"h100:64\", \"tpu-v6e:16x16\", "
                "or Google's TPU type, \"v5p-256\" (docs/config.md, System names)")
        return [("system.name", "required", name)] + [
            (f"system.{k}", "the system's", f"{help} ({kind.upper()} systems)")
            for k, (kind, _, help) in OVERRIDES.items()]
    out = [(f"{table}.preset", "none", "a preset's name; with --set it replaces the file's "
            "model (the model is the preset, the file's run settings and the command line's "
            "model.* keys)"),
           (f"{table}.hf_config", "none", "a Hugging Face config.json, the path from this TOML "
            "file's folder (with --set: from the working directory, and it replaces the "
            "file's model as a preset does) (llama, mistral, qwen2, qwen3, qwen3_moe, "
            "mixtral, deepseek_v3, gpt_oss); keys beside it override it")] \
        if table == "model" else []
    for f in dataclasses.fields(cls):
        default = _default(f)
        if table == "model" and default == "required":
            default = "required without a preset"
        help = f.metadata.get("help", "")
        if table == "model" and f.name in RUN_FIELDS:
            help += " (a run setting: kept when --set names another model)"
        out.append((f"{table}.{f.name}", default, help))
    return out


def missing_descriptions() -> list[str]:
    """Keys without a description (a test keeps this empty)."""
    return [key for table in TABLES for key, _, help in entries(table) if not help]


def markdown(only: str | None = None) -> str:
    """The tables of docs/config.md (`shardscope keys --markdown`), or one of them."""
    lines = []
    for table in [only] if only else TABLES:
        what = TABLES[table][1]
        lines += [f"## `[{table}]`", "", what[0].upper() + what[1:] + ".", "",
                  "| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{key}` | {default} | {help.replace('|', '/')} |"
                  for key, default, help in entries(table)]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def text(only: str | None = None) -> str:
    """The terminal reference: every key (of one table), its default and meaning."""
    lines = []
    for table in [only] if only else TABLES:
        rows = entries(table)
        width = max(len(k) for k, _, _ in rows) + 2
        what = re.sub(r"\[([^]]+)\]\([^)]+\)", r"\1", TABLES[table][1])  # links: words
        lines.append(f"[{table}]  {what}")
        lines += [f"  {key:<{width}}{help} (default {default})" for key, default, help in rows]
        lines.append("")
    return "\n".join(lines).rstrip()
