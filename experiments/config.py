"""Experiment configs: TOML files that map 1:1 onto frozen dataclasses.

Every mistake is a `ConfigError` naming the key, the value, the valid choices and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshes import get_system
from models.config import PRESETS, ModelConfig, preset
from models.transformer import REMAT_POLICIES
from sharding.rules import MESH_AXES, divisors


class ConfigError(ValueError):
    """A mistake in an experiment config."""


WORKLOAD_KINDS = ("train", "prefill", "decode")
PARAM_DTYPES = ("float32", "bfloat16")
COMPUTE_DTYPES = ("bfloat16", "float32", "float8", "float4")
QUANT_DTYPES = ("int8", "float8", "int4")
OPTIMIZERS = ("adamw",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1
    pipeline: int = 1

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes().values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    kind: str = "train"
    seq_len: int
    global_batch: int
    microbatches: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """`weights` and `kv_cache` apply to serving: "int8" | "float8" | "int4" store them
    quantised with scales (models/quant.py); empty means the params / compute dtype."""

    params: str = "float32"
    compute: str = "bfloat16"
    weights: str = ""
    kv_cache: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Train:
    remat: str = "full"
    optimizer: str = "adamw"
    learning_rate: float = 3e-4
    weight_decay: float = 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
    name: str
    model: ModelConfig
    system: str
    parallelism: Parallelism
    workload: Workload
    precision: Precision
    train: Train


_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}
_SECTIONS = {
    "model": {"preset"} | _MODEL_FIELDS,
    "system": {"name"},
    "parallelism": {f.name for f in dataclasses.fields(Parallelism)},
    "workload": {f.name for f in dataclasses.fields(Workload)},
    "precision": {f.name for f in dataclasses.fields(Precision)},
    "train": {f.name for f in dataclasses.fields(Train)},
}
_REQUIRED = {"name": None, "model": None, "system": {"name"},
             "workload": {"seq_len", "global_batch"}}


def load(path: str | Path, overrides: list[str] = ()) -> Experiment:
    """Read a TOML experiment, apply `key=value` overrides, validate."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; give the path of a .toml "
                          f"experiment, e.g. experiments/configs/llama3-8b-nvl72.toml")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e}); fix the syntax at that line") from None
    for item in overrides:
        apply_override(raw, item)
    return from_dict(raw)


def apply_override(raw: dict, item: str) -> None:
    """`section.key=value`; the value is read as TOML (number, bool, "string") or a bare
    string."""
    key, eq, text = item.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set parallelism.fsdp=8")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is not a section")
    node[parts[-1]] = value


def _check_keys(raw: Mapping, where: str, valid: set[str]) -> None:
    for k in raw:
        if k not in valid:
            section = f" in [{where.rstrip('.')}]" if where else ""
            raise ConfigError(f"unknown key '{where}{k}'; valid keys{section}: "
                              f"{', '.join(sorted(valid))}")


def _typed(section: str, raw: Mapping, cls):
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        v = raw[f.name]
        want = {"int": int, "str": str, "float": (int, float), "bool": bool}.get(str(f.type))
        if want is int and (not isinstance(v, int) or isinstance(v, bool)):
            raise ConfigError(f"{section}.{f.name}={v!r} must be an integer")
        if want is int and v < 1:
            raise ConfigError(f"{section}.{f.name}={v} must be at least 1")
        if want is str and not isinstance(v, str):
            raise ConfigError(f"{section}.{f.name}={v!r} must be a string")
        if want == (int, float) and (not isinstance(v, int | float) or isinstance(v, bool)):
            raise ConfigError(f"{section}.{f.name}={v!r} must be a number")
        kwargs[f.name] = v
    try:
        return cls(**kwargs)
    except TypeError as e:
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in kwargs]
        raise ConfigError(f"[{section}] is missing required key(s) "
                          f"{', '.join(f'{section}.{m}' for m in missing)}") from e


def _choice(key: str, value: str, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(repr, valid))}")


def _model(raw: Mapping) -> ModelConfig:
    fields = {k: v for k, v in raw.items() if k != "preset"}
    name = raw.get("preset")
    try:
        if name is not None:
            if name not in PRESETS:
                raise ConfigError(f"model.preset={name!r} is unknown; valid: "
                                  f"{', '.join(PRESETS)} (or give the dimensions explicitly)")
            return preset(name, **fields)
        missing = [k for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim",
                               "d_ff", "vocab") if k not in fields]
        if missing:
            raise ConfigError(f"[model] needs model.preset or explicit "
                              f"{', '.join('model.' + m for m in missing)}")
        return ModelConfig(**fields)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def from_dict(raw: Mapping[str, Any]) -> Experiment:
    _check_keys(raw, "", {"name", *_SECTIONS})
    for key, inner in _REQUIRED.items():
        if key not in raw:
            raise ConfigError(f"missing required key {key!r}"
                              + (f" (a [{key}] section)" if key != "name" else ""))
        if inner:
            for k in inner:
                if k not in raw[key]:
                    raise ConfigError(f"missing required key {key}.{k}")
    for section, valid in _SECTIONS.items():
        if section in raw:
            if not isinstance(raw[section], dict):
                raise ConfigError(f"{section} must be a [{section}] table")
            _check_keys(raw[section], f"{section}.", valid)
    if not isinstance(raw["name"], str):
        raise ConfigError(f"name={raw['name']!r} must be a string")

    model = _model(raw["model"])
    system_name = raw["system"]["name"]
    try:
        system = get_system(system_name)
    except ValueError as e:
        raise ConfigError(f"system.name: {e}") from None
    par = _typed("parallelism", raw.get("parallelism", {}), Parallelism)
    work = _typed("workload", raw["workload"], Workload)
    prec = _typed("precision", raw.get("precision", {}), Precision)
    train = _typed("train", raw.get("train", {}), Train)
    exp = Experiment(name=raw["name"], model=model, system=system.name, parallelism=par,
                     workload=work, precision=prec, train=train)
    validate(exp, system.num_devices)
    return exp


def validate(exp: Experiment, num_devices: int) -> None:
    """Cross-field checks, each naming the keys involved and a fix."""
    w, p, m, par = exp.workload, exp.precision, exp.model, exp.parallelism
    _choice("workload.kind", w.kind, WORKLOAD_KINDS)
    _choice("precision.params", p.params, PARAM_DTYPES)
    _choice("precision.compute", p.compute, COMPUTE_DTYPES)
    _choice("train.remat", exp.train.remat, REMAT_POLICIES)
    _choice("train.optimizer", exp.train.optimizer, OPTIMIZERS)
    for key in ("weights", "kv_cache"):
        v = getattr(p, key)
        if not v:
            continue
        _choice(f"precision.{key}", v, QUANT_DTYPES + ("bfloat16",))
        if w.kind == "train":
            raise ConfigError(f"precision.{key}={v!r} applies to serving (workload.kind = "
                              f"'prefill' or 'decode'); remove it to train")
    if w.kind != "train" and w.microbatches != 1:
        raise ConfigError(f"workload.microbatches={w.microbatches} applies to training only; "
                          f"remove it for workload.kind={w.kind!r}")
    if p.compute == "float4":
        chip = get_system(exp.system).chip
        if "float4" not in chip.peak_flops_per_s:
            raise ConfigError(f"precision.compute='float4': {chip.name} has no FP4 tensor "
                              f"cores (system.name={exp.system!r}); use 'float8' or a "
                              f"Blackwell system (b200, gb200-nvl72, gb300-nvl72)")
    if par.expert > 1 and m.n_experts > 1:
        _divides("parallelism.expert", par.expert, "model.n_experts", m.n_experts)
    if m.n_experts > 1 and par.sequence > 1:
        raise ConfigError(f"parallelism.sequence={par.sequence} with a mixture of experts "
                          f"(model.n_experts={m.n_experts}) is not supported: routing groups are "
                          f"cut from each device's tokens; use sequence = 1 and shard the batch "
                          f"with data, fsdp or expert")
    if par.num_devices != num_devices:
        sizes = " x ".join(f"{a}={s}" for a, s in par.sizes().items() if s > 1) or "1"
        raise ConfigError(
            f"parallelism {sizes} = {par.num_devices} devices, but system.name={exp.system!r} "
            f"has {num_devices}; make the product of the [parallelism] sizes {num_devices}"
        )
    _divides("parallelism.tensor", par.tensor, "model.n_heads", m.n_heads)
    _divides("parallelism.tensor", par.tensor, "model.n_kv_heads", m.n_kv_heads)
    _divides("parallelism.tensor", par.tensor, "model.d_ff", m.d_ff)
    _divides("parallelism.tensor", par.tensor, "the padded vocab", m.padded_vocab)
    _divides("parallelism.fsdp", par.fsdp, "model.d_model", m.d_model)
    if w.global_batch % w.microbatches:
        raise ConfigError(f"workload.microbatches={w.microbatches} does not divide "
                          f"workload.global_batch={w.global_batch}; choose one of "
                          f"{divisors(w.global_batch)}")
    micro = w.global_batch // w.microbatches
    dp = par.data * par.fsdp * par.expert
    if micro % dp:
        raise ConfigError(
            f"the micro-batch of {micro} sequences (workload.global_batch={w.global_batch} / "
            f"workload.microbatches={w.microbatches}) is not divisible by parallelism.data x "
            f"parallelism.fsdp x parallelism.expert = {dp} (they all shard the batch); make "
            f"global_batch a multiple of {dp * w.microbatches}"
        )
    if par.pipeline > 1:
        if w.kind != "train":
            raise ConfigError(f"parallelism.pipeline={par.pipeline} applies to training; "
                              f"serve with pipeline = 1")
        _divides("parallelism.pipeline", par.pipeline, "model.n_layers", m.n_layers)
    if w.seq_len % par.sequence:
        raise ConfigError(f"parallelism.sequence={par.sequence} does not divide "
                          f"workload.seq_len={w.seq_len}; choose one of {divisors(w.seq_len)}")
    if m.positions == "learned" and w.seq_len > m.max_seq_len:
        raise ConfigError(f"workload.seq_len={w.seq_len} exceeds model.max_seq_len="
                          f"{m.max_seq_len} of the learned position table")


def _divides(key: str, ways: int, what: str, size: int) -> None:
    if size % ways:
        raise ConfigError(f"{key}={ways} does not divide {what}={size}; choose one of "
                          f"{divisors(size)}")
