"""Experiment configs: TOML files that map 1:1 onto frozen dataclasses.

The [model], [workload], [precision] and [train] tables are models' own dataclasses
(ModelConfig, Workload, Precision, Train), which check their own values; [parallelism] is
`Parallelism` (one field per mesh axis, plus the rule preset); [system] names a catalog
system, parsed once. Cross-table checks live in `validate`.

Every mistake is a `ConfigError` naming the key, the value, the valid choices and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.measured import Measured
from meshes import System, get_system
from meshes.calibration import Calibration, calibration_from_dict, catalog_calibration
from meshes.catalog import OVERRIDES
from meshes.chips import CUDA_GRAPH_KERNEL_S
from meshes.power import Cost
from models import hf
from models.config import PRESETS, RUN_FIELDS, ModelConfig, preset, preset_notes
from models.context import MODES as CONTEXT_MODES
from models.pipeline import SCHEDULES, Pipeline, fewest_microbatches
from models.program import Precision, Train, Workload, described
from sharding.rules import MESH_AXES, RULE_PRESETS, AxisRules, divisors, rules_preset


class ConfigError(ValueError):
    """A mistake in an experiment config."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    """`[parallelism]`: the sizes of the mesh axes (one field per sharding.rules.MESH_AXES;
    their product is the number of devices) and how the step uses them."""

    pipeline: int = described("pipeline stages (the layers split into consecutive stages)",
                              1)
    data: int = described("data-parallel replicas (the batch split, parameters replicated)",
                          1)
    fsdp: int = described("fully sharded data parallelism (the batch split, parameters, "
                          "gradients and optimizer state sharded and gathered per layer)", 1)
    expert: int = described("expert parallelism (a mixture of experts' experts split; the "
                            "batch split too)", 1)
    sequence: int = described("context parallelism (each sequence's positions split)", 1)
    tensor: int = described("tensor parallelism (heads and the MLP's hidden width split)", 1)
    rules: str = described("the rule preset mapping logical axes to these mesh axes: "
                           "\"default\" (Megatron's layout: weights split over fsdp and "
                           "tensor) or \"maxtext\" (as MaxText's base.yml: the residual "
                           "stream's activations split over tensor too, the weights' width "
                           "over fsdp, sequence and expert; what `import maxtext` writes) "
                           "(sharding.rules.RULE_PRESETS)", "default")
    virtual_stages: int = described("interleaved pipeline: model chunks per stage (Megatron's "
                                    "virtual pipeline)", 1)
    pipeline_schedule: str = described('the pipeline\'s schedule: "1f1b" or "gpipe"', "1f1b")
    context_mode: str = described('how attention reaches the other context-parallel ranks: '
                                  '"ring" (K/V passed around) or "allgather"', "ring")
    sequence_parallel: bool = described("Megatron's sequence parallelism: the residual "
                                        "stream split over tensor between its regions", False)
    tp_comm_overlap: bool = described("Transformer Engine's userbuffers (Megatron / NeMo "
                                      "tp_comm_overlap): on GPU systems each sequence-parallel "
                                      "all-gather / reduce-scatter over tensor runs in chunks "
                                      "under the GEMM it feeds or follows", False)
    overlap_p2p_comm: bool = described("Megatron's overlapped pipeline transfers (its and "
                                       "NeMo's default with virtual_stages > 1; "
                                       "--no-overlap-p2p-communication turns it off): on GPU "
                                       "systems an interleaved pipeline's stage-to-stage "
                                       "sends run beside other microbatches' compute, "
                                       "waited for only in the warm-up and flush", True)
    outer: str = described("the mesh axis placed outermost on the machine (its members "
                           "farthest apart: across pods, slices, racks); \"\" keeps the mesh "
                           "axes' order", "")

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes().values())

    def axis_rules(self) -> AxisRules:
        rules = rules_preset(self.rules)
        return rules.with_sequence_parallel() if self.sequence_parallel else rules


@dataclasses.dataclass(frozen=True, kw_only=True)
class Serving:
    """`[serving]`: how a serving engine runs the step (ignored when training)."""

    cuda_graphs: bool = described(
        'GPU systems, workload.kind = "decode": the engine replays the decode step as a CUDA '
        "graph, as vLLM, SGLang and TensorRT-LLM do by default for batches up to their "
        "largest captured size, so each kernel's fixed cost is a launch under CUDA graphs "
        f"({CUDA_GRAPH_KERNEL_S * 1e6:.1f} us, measured on an H100: meshes/chips.py) instead "
        "of the calibration's kernel_overhead_s fitted on training steps; false for an "
        "engine run without them (vLLM "
        "--enforce-eager, SGLang --disable-cuda-graph, a batch above the captured sizes). "
        "Prefill and TPU systems are not affected", True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
    name: str
    model: ModelConfig
    system: System
    parallelism: Parallelism
    workload: Workload
    precision: Precision
    train: Train
    serving: Serving = dataclasses.field(default_factory=Serving)
    measured: Measured | None = None
    cost: Cost = dataclasses.field(default_factory=Cost)
    notes: tuple[str, ...] = ()  # what the model approximates (hf.py, PRESET_NOTES)
    # The model as the [model] table named it, for report headers: the preset or the
    # hf_config, and the fields beside it that change it ("llama3-8b (n_layers 2)").
    model_label: str = ""

    def to_dict(self) -> dict:
        """The config as run, table by table (every default filled in), for --json."""
        tables = {name: dataclasses.asdict(getattr(self, name))
                  for name in ("model", "parallelism", "workload", "precision", "train",
                               "serving")}
        out = {"name": self.name, "system": {"name": self.system.name, **self.system.overrides},
               **tables}
        if self.measured is not None:
            out["measured"] = dataclasses.asdict(self.measured)
        out["cost"] = {k: v for k, v in dataclasses.asdict(self.cost).items() if v is not None}
        return out


_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
_TABLES = {"parallelism": Parallelism, "workload": Workload, "precision": Precision,
           "train": Train, "serving": Serving}
_SECTIONS = {
    "model": {"preset", "hf_config"} | _MODEL_FIELDS,
    "system": {"name", *OVERRIDES},
    **{name: {f.name for f in dataclasses.fields(cls)} for name, cls in _TABLES.items()},
    "measured": {f.name for f in dataclasses.fields(Measured)},
    "cost": {f.name for f in dataclasses.fields(Cost)},
}
_REQUIRED = {"name": None, "model": None, "system": {"name"},
             "workload": {"seq_len", "global_batch"}}


def read_toml(path: str | Path, *, what: str, example: str) -> dict:
    """A TOML file's contents, or a ConfigError naming the file and the fix."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(path)!r} not found; {example}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e}); fix the syntax at that line") from None


def load_calibration(path: str | Path) -> Calibration:
    """A calibration file written by `shardscope calibrate` (meshes/calibration.py)."""
    raw = read_toml(path, what="calibration file",
                    example=f"write one with `shardscope calibrate DIR --out {Path(path).name}`")
    try:
        cal = calibration_from_dict(raw, str(path))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if "best_measured_mfu" not in raw:  # the catalog's ceilings still hold
        cal = dataclasses.replace(cal, best_mfu=catalog_calibration().best_mfu)
    if str(path) not in cal.source:  # the line a report prints names the file it used
        cal = dataclasses.replace(cal, source=f"{cal.source}; file {path}")
    return cal


BUNDLED = Path(__file__).parent / "configs"


def bundled_names() -> list[str]:
    """The bundled experiment configs, by name (experiments/configs/NAME.toml)."""
    return sorted(p.stem for p in BUNDLED.glob("*.toml"))


def resolve(path: str | Path) -> Path:
    """A config path, or the name of a bundled config (with or without .toml)."""
    p = Path(path)
    if p.is_file():
        return p
    bundled = BUNDLED / (p.name if p.suffix == ".toml" else f"{p.name}.toml")
    if p.parent == Path(".") and bundled.is_file():
        return bundled
    close = difflib.get_close_matches(p.stem, bundled_names(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"config file {str(path)!r} not found; {hint}give the path of a .toml "
                      f"experiment or a bundled name (`shardscope configs` lists them), e.g. "
                      f"llama3-8b-nvl72")


def load(path: str | Path, overrides: list[str] = ()) -> Experiment:
    """Read a TOML experiment (a path or a bundled config's name), apply `key=value`
    overrides, validate."""
    return from_dict(load_raw(path, overrides))


# The [model] keys that name a model. One of them on the command line replaces the file's
# model: its [model] table keeps only its run settings (models/config.py RUN_FIELDS).
MODEL_SOURCES = ("model.preset", "model.hf_config")


def load_raw(path: str | Path, overrides: list[str] = (), *,
             varied: list[str] = ()) -> dict:
    """A config's tables as written (a path or a bundled name), with `key=value`
    overrides applied, not yet validated (a search varies them).

    When an override sets model.preset or model.hf_config, the model is that one with the
    file's run settings (models/config.py RUN_FIELDS: fused_qkv, capacity_factor, ...) and
    the command line's other model.* keys, in any order: the file's shape fields (tiny's
    n_kv_heads = 4) and its preset or hf_config described its own model, not the new one
    (MaxText's model_name, too, sets its keys over the file's), while how it runs the model
    is the experiment's. `varied`: the keys a search sets per config (--vary), which count
    as the command line's."""
    toml = resolve(path)
    raw = read_toml(toml, what="config file", example="give the path of a .toml "
                    "experiment, e.g. experiments/configs/llama3-8b-nvl72.toml")
    hf.relative_to(raw.get("model"), toml.parent)  # hf_config: a path from the TOML
    keys = [item.partition("=")[0].strip() for item in overrides] + list(varied)
    if any(k in MODEL_SOURCES for k in keys):
        model = raw.get("model")
        raw["model"] = ({k: v for k, v in model.items() if k in RUN_FIELDS}
                        if isinstance(model, dict) else {})
    for item in overrides:
        apply_override(raw, item)
    return raw


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
            close = difflib.get_close_matches(str(k), sorted(valid), n=1)
            hint = f"did you mean '{where}{close[0]}'? " if close else ""
            raise ConfigError(f"unknown key '{where}{k}'; {hint}valid keys{section}: "
                              f"{', '.join(sorted(valid))}")


_TYPES = {"int": int, "str": str, "float": (int, float), "float | None": (int, float),
          "bool": bool}


def _check_type(key: str, v, want, minimum: int = 1) -> None:
    if want is int and (not isinstance(v, int) or isinstance(v, bool)):
        raise ConfigError(f"{key}={v!r} must be an integer: write it as a number, e.g. "
                          f"{key.rsplit('.', 1)[-1]} = {max(minimum, 1)}")
    if want is int and v < minimum:
        raise ConfigError(f"{key}={v} must be at least {minimum}")
    if want is str and not isinstance(v, str):
        raise ConfigError(f"{key}={v!r} must be a string")
    if want == (int, float) and (not isinstance(v, int | float) or isinstance(v, bool)):
        raise ConfigError(f"{key}={v!r} must be a number")
    if want is bool and not isinstance(v, bool):
        raise ConfigError(f"{key}={v!r} must be true or false (lower case, as TOML writes "
                          f"it: {key.rsplit('.', 1)[-1]} = true)")


def _typed(section: str, raw: Mapping, cls):
    """The table as `cls`, each value type-checked; the class checks its own choices."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            # counts are at least 1, but those whose default is 0 (0: none of it)
            _check_type(f"{section}.{f.name}", raw[f.name], _TYPES.get(str(f.type)),
                        minimum=0 if f.default == 0 else 1)
            kwargs[f.name] = raw[f.name]
    try:
        return cls(**kwargs)
    except TypeError as e:
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in kwargs]
        raise ConfigError(f"[{section}] is missing required key(s) "
                          f"{', '.join(f'{section}.{m}' for m in missing)}") from e
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _model(raw: Mapping) -> tuple[ModelConfig, tuple[str, ...], str]:
    """The [model] table's model, what it approximates of a Hugging Face config, and its
    label (`model_label`)."""
    fields = {k: v for k, v in raw.items() if k not in ("preset", "hf_config")}
    name = raw.get("preset")
    try:
        if "hf_config" in raw:
            base, notes = hf.load(raw["hf_config"], preset=name)
            model = ModelConfig(**{**base, **fields})
            defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
            changed = [k for k in fields if getattr(model, k) != base.get(k, defaults[k])]
            return model, notes, _model_label(f"hf_config {Path(raw['hf_config']).name}",
                                             model, changed)
        if name is not None:
            if name not in PRESETS:
                raise ConfigError(f"model.preset={name!r} is unknown; valid: "
                                  f"{', '.join(PRESETS)} (or give the dimensions explicitly)")
            model, base = preset(name, **fields), PRESETS[name]()
            changed = [k for k in fields if getattr(model, k) != getattr(base, k)]
            return model, preset_notes(name), _model_label(name, model, changed)
        missing = [k for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim",
                               "d_ff", "vocab") if k not in fields]
        if missing:
            raise ConfigError(f"[model] needs model.preset, model.hf_config or explicit "
                              f"{', '.join('model.' + m for m in missing)}")
        model = ModelConfig(**fields)
        return model, (), f"{model.name} (every dimension given in [model])"
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def _model_label(base: str, model: ModelConfig, changed: list[str]) -> str:
    """"llama3-8b (n_layers 2, fused_qkv true)": the model a preset or hf_config names,
    with the fields given beside it that change it, valued as TOML writes them."""
    if not changed:
        return base
    values = {k: getattr(model, k) for k in changed}
    text = ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in values.items())
    return f"{base} ({text})"


def _check_structure(raw: Mapping[str, Any]) -> None:
    """Known tables and keys, required keys present."""
    _check_keys(raw, "", {"name", *_SECTIONS})
    for section, valid in _SECTIONS.items():
        if section in raw:
            if not isinstance(raw[section], dict):
                raise ConfigError(f"{section} must be a [{section}] table")
            _check_keys(raw[section], f"{section}.", valid)
    for key, inner in _REQUIRED.items():
        if key not in raw:
            raise ConfigError(
                f"missing required key {key!r}; add name = \"my-experiment\" at the top of "
                f"the file (the name reports and results stores show)" if key == "name" else
                f"missing required key {key!r} (a [{key}] section); add it (`shardscope keys "
                f"{key}` lists its keys, e.g. the bundled llama3-8b-nvl72.toml)")
        for k in inner or ():
            if k not in raw[key]:
                raise ConfigError(f"missing required key {key}.{k}; add {k} = ... under "
                                  f"[{key}] (`shardscope keys {key}` says what it means)")
    if not isinstance(raw["name"], str):
        raise ConfigError(f"name={raw['name']!r} must be a string")


def from_dict(raw: Mapping[str, Any]) -> Experiment:
    exp = unchecked(raw)
    validate(exp)
    return exp


def rebuilt(exp: Experiment, raw: Mapping[str, Any]) -> Experiment:
    """`exp` again from its tables as run (`exp.to_dict()` with keys of other tables than
    [model] changed), checked again. Those tables give every dimension and name no preset,
    so the model's label and notes are `exp`'s: the one place an experiment is rebuilt so
    (fit's changes, the runner's fewer replicas)."""
    new = from_dict(raw)
    assert new.model == exp.model, "rebuilt() keeps the model; load a config to change it"
    return dataclasses.replace(new, model_label=exp.model_label, notes=exp.notes)


def unchecked(raw: Mapping[str, Any]) -> Experiment:
    """The experiment with each key and each table's values checked, but not the checks
    across tables (`validate`): what a value can be wrong in on its own, whatever the
    sharding (a search checks its --vary values with it before trying any sharding)."""
    _check_structure(raw)
    model, notes, label = _model(raw["model"])
    overrides = {k: v for k, v in raw["system"].items() if k != "name"}
    try:
        system = get_system(raw["system"]["name"], **overrides)
    except (ValueError, TypeError) as e:  # TypeError: a name that is not a string
        raise ConfigError(f"{'[system]' if overrides else 'system.name'}: {e}") from None
    tables = {name: _typed(name, raw.get(name, {}), cls) for name, cls in _TABLES.items()}
    if tables["parallelism"].rules not in RULE_PRESETS:
        raise ConfigError(f"parallelism.rules={tables['parallelism'].rules!r} is not a rule "
                          f"preset; valid: {', '.join(RULE_PRESETS)}")
    measured = _typed("measured", raw["measured"], Measured) if "measured" in raw else None
    cost = _typed("cost", raw.get("cost", {}), Cost)
    return Experiment(name=raw["name"], model=model, system=system, measured=measured,
                      cost=cost, notes=notes, model_label=label, **tables)


def validate(exp: Experiment) -> None:
    """Cross-table checks, each naming the keys involved and a fix."""
    _check_precision(exp)
    # a size that splits no head evenly is named before the device count it also breaks
    # (tensor = 3 on 128 GPUs: the heads are the mistake, the product its consequence)
    _check_model_splits(exp)
    _check_devices(exp)
    _check_batch(exp)
    _check_strategies(exp)


def _check_precision(exp: Experiment) -> None:
    p, w = exp.precision, exp.workload
    for key in ("weights", "kv_cache"):
        v = getattr(p, key)
        if v and w.kind == "train":
            raise ConfigError(f"precision.{key}={v!r} applies to serving (workload.kind = "
                              f"'prefill' or 'decode'); remove it to train")
    chip = exp.system.chip
    if p.compute == "float4" and "float4" not in chip.peak_flops_per_s:
        raise ConfigError(f"precision.compute='float4': {chip.name} has no FP4 tensor cores "
                          f"(system.name={exp.system.name!r}); use 'float8' or a Blackwell "
                          f"system (b200, gb200-nvl72, gb300-nvl72)")


def _check_devices(exp: Experiment) -> None:
    par, n = exp.parallelism, exp.system.num_devices
    if par.num_devices != n:
        sizes = " x ".join(f"{a}={s}" for a, s in par.sizes().items() if s > 1) or "1"
        k = exp.system.chip.devices_per_chip
        # TPU7x: sizes count TensorCores, not the chips its slice names are made of
        cores = f" ({n // k} chips x {k} TensorCores, each a JAX device)" if k > 1 else ""
        # Megatron counts its expert ranks among the data-parallel ones; here they multiply
        expert = (f"; parallelism.expert={par.expert} is an axis of its own, not a part of "
                  f"data as Megatron's expert-parallel ranks are" if par.expert > 1 else "")
        raise ConfigError(
            f"parallelism {sizes} = {par.num_devices} devices, but system.name="
            f"{exp.system.name!r} has {n}{cores}; make the product of the [parallelism] "
            f"sizes ({' x '.join(MESH_AXES)}; sequence is context parallelism) {n}"
            f"{_keeping_devices(par.sizes(), n) or _no_replica_size(exp, n)}{expert}"
        )


def _replica_axis(sizes: Mapping[str, int], changed: str = "") -> str:
    """The axis whose size the devices left over set, as Megatron derives its data-parallel
    size (devices / (tensor x pipeline x context)): fsdp where the config shards the
    replicas that way, else data."""
    fsdp = sizes.get("fsdp", 1) > 1 and sizes.get("data", 1) == 1
    axis = "fsdp" if fsdp else "data"
    return ("fsdp" if axis == "data" else "data") if axis == changed else axis


def _keeping_devices(sizes: Mapping[str, int], n: int, changed: str = "") -> str:
    """", e.g. data = 4 (pipeline 8 x data 4 x tensor 4 = 128 devices)": the replica axis
    resized so that the sizes multiply to the `n` devices, the other sizes kept (what a
    Megatron user means: the model-parallel sizes, with the data-parallel size derived)."""
    axis = _replica_axis(sizes, changed)
    rest = math.prod(s for a, s in sizes.items() if a != axis)
    if n % rest:
        return ""
    new = {**sizes, axis: n // rest}
    product = " x ".join(f"{a} {s}" for a, s in new.items() if s > 1 or a == axis)
    head = f"{changed} = {sizes[changed]} with " if changed else ""
    return f", e.g. {head}{axis} = {n // rest} ({product} = {n} devices)"


def _no_replica_size(exp: Experiment, n: int) -> str:
    """Why no replica size makes the product `n`, and the way out: the size that does not
    divide the devices, its choices, and the replica size that goes with one."""
    sizes, virtual = exp.parallelism.sizes(), exp.parallelism.virtual_stages
    axis = _replica_axis(sizes)
    others = {a: s for a, s in sizes.items() if a != axis and s > 1}
    bad = [a for a, s in others.items() if n % s] or list(others)
    a = max(bad, key=lambda a: others[a])
    rest = math.prod(s for b, s in others.items() if b != a)
    # pipeline stages that would hold no layer are no choice (_check_idle_stages)
    valid = [v for v in range(1, n + 1) if n % (v * rest) == 0 and not (
        a == "pipeline" and v > 1 and _idle_stages(v, virtual, exp.model.n_layers))]
    if not valid:
        return (f"; the sizes other than {axis} multiply to {math.prod(others.values())}, "
                f"which does not divide {n}: choose ones whose product divides {n} "
                f"({divisors(n)})")
    pick = _nearest(valid, sizes[a])
    why = (f"{a} = {sizes[a]} does not divide the {n} devices" if n % sizes[a] else
           f"the sizes other than {axis} multiply to {math.prod(others.values())}, which "
           f"does not divide {n}")
    return (f"; {why}: choose {a} = {_or_list(valid[-12:])}"
            f"{_keeping_devices({**sizes, a: pick}, n, changed=a)}")


def _or_list(values: Sequence[int]) -> str:
    """"1, 2, 4 or 8"."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _nearest(values: Sequence[int], given: int) -> int:
    """The value closest to `given` by ratio (3 -> 4 of 1, 2, 4, 8), the larger on a tie."""
    return min(values, key=lambda v: (abs(math.log(v / given)), -v))


def _check_split(rules: AxisRules, sizes: Mapping[str, int], dims, index: int,
                 devices: int) -> None:
    """The mesh axes the rules give dimension `dims[index]` must divide its size. `dims`:
    (logical, size, what, params) of every dimension the model splits, so that the choices
    offered for one mesh axis divide every dimension it splits (tensor: the heads, the KV
    heads, the MLP and the vocab), and the `devices`."""
    logical, size, what, params = dims[index]
    axes = [a for a in rules.mesh_axes(logical, params=params) if sizes.get(a, 1) > 1]
    ways = math.prod(sizes[a] for a in axes)
    if not size % ways:
        return
    keys = " x ".join(f"parallelism.{a}={sizes[a]}" for a in axes)
    split, valid = [], []  # (size, what, the other axes' ways) of each dimension it splits
    if len(axes) == 1:
        (axis,) = axes
        for lg, sz, wh, pr in dims:
            on = rules.mesh_axes(lg, params=pr)
            if sz and axis in on:
                split.append((sz, wh, math.prod(sizes.get(a, 1) for a in on if a != axis)))
        valid = [v for v in range(1, devices + 1) if devices % v == 0
                 and all(sz % (v * other) == 0 for sz, _, other in split)]
    if not valid:  # several axes, or another one already splits a dimension unevenly
        fitting = [d for d in range(1, math.gcd(size, devices) + 1)
                   if size % d == 0 and devices % d == 0]
        what_ways = "its ways" if len(axes) == 1 else "their product"
        raise ConfigError(f"{keys} does not divide {what}={size}; make {what_ways} one that "
                          f"divides both {size} and the {devices} devices: "
                          f"{', '.join(map(str, fitting[-12:]))}")
    named = ", ".join(f"{wh}={sz}" for sz, wh, _ in split)
    pick = _nearest(valid, sizes[axis])
    keep = _keeping_devices({**sizes, axis: pick}, devices, changed=axis)
    raise ConfigError(f"{keys} does not divide {what}={size}; choose {axis} = "
                      f"{_or_list(valid[-12:])} (each divides {named} and the {devices} "
                      f"devices){keep or f', e.g. {axis} = {pick}'}")


def _check_model_splits(exp: Experiment) -> None:
    m, rules, sizes = exp.model, exp.parallelism.axis_rules(), exp.parallelism.sizes()
    dims = (
        ("experts", m.n_experts if m.n_experts > 1 else 0, "model.n_experts", True),
        ("heads", m.n_heads, "model.n_heads", False),
        ("kv_heads", m.n_kv_heads, "model.n_kv_heads", False),
        ("mlp", m.d_ff, "model.d_ff", False),
        ("vocab", m.padded_vocab, "the padded vocab", False),
        ("embed", m.d_model, "model.d_model", True),
        ("seq", exp.workload.seq_len, "workload.seq_len", False),
    )
    for i, (_, size, _, _) in enumerate(dims):
        if size:
            _check_split(rules, sizes, dims, i, exp.system.num_devices)
    # decode writes the token after seq_len cached positions: position seq_len
    new_token = int(exp.workload.kind == "decode")
    positions = exp.workload.seq_len + new_token
    if m.positions == "learned" and positions > m.max_seq_len:
        why = " (the cache and the new token)" if new_token else ""
        raise ConfigError(f"workload.seq_len={exp.workload.seq_len} needs {positions} positions"
                          f"{why}, past model.max_seq_len={m.max_seq_len} of the learned "
                          f"position table; set workload.seq_len <= "
                          f"{m.max_seq_len - new_token}")


def _check_batch(exp: Experiment) -> None:
    w = exp.workload
    dp, keys, at_least = _batch_split(exp)

    def fix() -> str:
        return _microbatch_fix(w.global_batch, w.microbatches, dp, keys, at_least)

    if w.global_batch % w.microbatches:
        raise ConfigError(f"workload.microbatches={w.microbatches} does not divide "
                          f"workload.global_batch={w.global_batch}; {fix()}")
    if w.micro_batch % dp:
        raise ConfigError(
            f"the micro-batch of {w.micro_batch} sequences (workload.global_batch="
            f"{w.global_batch} / workload.microbatches={w.microbatches}) is not divisible by "
            f"{keys} = {dp} (they all shard the batch); {fix()}"
        )
    tiles = exp.train.num_vocab_tiling
    if w.kind == "train" and w.seq_len % tiles:
        # the loss takes every tiles-th position into a tile (models/train.py _tiled_loss)
        raise ConfigError(f"train.num_vocab_tiling={tiles} does not divide "
                          f"workload.seq_len={w.seq_len}; choose one of "
                          f"{divisors(w.seq_len)}")


def _batch_split(exp: Experiment) -> tuple[int, str, int]:
    """The data-parallel ranks (every mesh axis that shards the batch), their keys, and the
    fewest microbatches the pipeline takes (an interleaved one: one per stage)."""
    par, rules, sizes = exp.parallelism, exp.parallelism.axis_rules(), exp.parallelism.sizes()
    keys = " x ".join(f"parallelism.{a}" for a in rules.mesh_axes("batch"))
    stages = rules.ways("layers", sizes, params=True)
    return rules.ways("batch", sizes), keys, fewest_microbatches(stages, par.virtual_stages)


def _microbatch_choices(global_batch: int, data_parallel: int) -> list[int]:
    """The numbers of microbatches that keep `global_batch` with a whole micro-batch on
    each of the `data_parallel` ranks: global_batch = micro-batch per rank x data_parallel
    x microbatches (Megatron's num_microbatches)."""
    if global_batch % data_parallel:
        return []
    per_step = global_batch // data_parallel
    return [m for m in range(1, per_step + 1) if per_step % m == 0]


def _microbatch_fix(global_batch: int, microbatches: int, dp: int, keys: str,
                    at_least: int = 1) -> str:
    """The way out of a batch that does not split: the global batch kept and the number of
    microbatches changed (what the user meant is the batch per optimizer step), or, when
    no count can keep it, the nearest global batches that split."""
    counts = [m for m in _microbatch_choices(global_batch, dp) if m >= at_least]
    if counts:
        pick = next((m for m in counts if m >= microbatches), counts[-1])
        per_rank = global_batch // (dp * pick)
        return (f"keep workload.global_batch={global_batch} and set workload.microbatches "
                f"to {_or_list(counts[-12:])} (global_batch = micro-batch per data-parallel "
                f"rank x {dp} data-parallel ranks x microbatches, Megatron's "
                f"num_microbatches), e.g. microbatches = {pick} ({per_rank} "
                f"sequence{'s' if per_rank > 1 else ''} per rank)")
    step = dp * at_least  # the smallest global batch that splits: one sequence per rank
    below, above = global_batch // step * step, (global_batch // step + 1) * step
    near = f"{below} or {above}" if below else f"{above}"
    why = (f"workload.global_batch={global_batch} is not a multiple of the {dp} data-"
           f"parallel ranks ({keys})" if global_batch % dp else
           f"none of at least {at_least} (one per pipeline stage) leaves a whole micro-batch "
           f"per rank")
    ranks = f"the {dp} data-parallel ranks" + (f" x {at_least} microbatches" if at_least > 1
                                               else "")
    return (f"no number of microbatches keeps the batch: {why}; make global_batch a "
            f"multiple of {step} ({ranks}), e.g. {near}, or shard the batch fewer ways (a "
            f"data-parallel size that divides {global_batch}: {divisors(global_batch)})")


def _check_strategies(exp: Experiment) -> None:
    m, par, w = exp.model, exp.parallelism, exp.workload
    rules, sizes = par.axis_rules(), par.sizes()
    if m.n_experts > 1 and rules.ways("seq", sizes) > 1:
        raise ConfigError(f"parallelism.sequence={par.sequence} with a mixture of experts "
                          f"(model.n_experts={m.n_experts}) is not supported: routing groups are "
                          f"cut from each device's tokens; use sequence = 1 and shard the batch "
                          f"with data, fsdp or expert")
    if par.outer and par.outer not in MESH_AXES:
        raise ConfigError(f"parallelism.outer={par.outer!r} is not a mesh axis; valid: "
                          f"{', '.join(MESH_AXES)} (or leave it out: {MESH_AXES[0]} outermost)")
    if par.tp_comm_overlap and not par.sequence_parallel:
        # Megatron asserts the same: userbuffers overlap sequence parallelism's collectives
        raise ConfigError("parallelism.tp_comm_overlap=true overlaps sequence parallelism's "
                          "all-gathers and reduce-scatters over tensor with their GEMMs; "
                          "set parallelism.sequence_parallel = true too (Megatron asks the "
                          "same), or tp_comm_overlap = false")
    if par.context_mode not in CONTEXT_MODES:
        # the frameworks' names: Megatron's --cp-comm-type, MaxText's context_parallel_strategy
        theirs = {"p2p": "ring", "all_gather": "allgather", "all-gather": "allgather"}
        hint = (f"; Megatron's / MaxText's {par.context_mode!r} is {theirs[par.context_mode]!r}"
                if par.context_mode in theirs else
                "; Megatron's a2a (Ulysses) and a2a+p2p are not modelled"
                if par.context_mode.startswith("a2a") else "")
        raise ConfigError(f"parallelism.context_mode={par.context_mode!r} is not one of "
                          f"{', '.join(CONTEXT_MODES)}{hint}")
    if rules.ways("seq", sizes) > 1 and w.kind == "train":
        ranks = rules.ways("seq", sizes)
        if w.seq_len % (2 * ranks):
            raise ConfigError(f"workload.seq_len={w.seq_len} must split into 2 x "
                              f"parallelism.sequence={ranks} equal chunks (context parallelism "
                              f"balances the causal work over zigzag chunk pairs); use a "
                              f"multiple of {2 * ranks}")
    if par.virtual_stages < 1:
        raise ConfigError(f"parallelism.virtual_stages={par.virtual_stages} must be 1 or more")
    stages = rules.ways("layers", sizes, params=True)
    if stages > 1:
        if w.kind != "train":
            raise ConfigError(f"parallelism.pipeline={stages} applies to training; serve with "
                              f"pipeline = 1")
        if par.pipeline_schedule not in SCHEDULES:
            raise ConfigError(f"parallelism.pipeline_schedule={par.pipeline_schedule!r} is not "
                              f"one of {', '.join(SCHEDULES)}")
        if w.microbatches < fewest_microbatches(stages, par.virtual_stages):
            dp, keys, at_least = _batch_split(exp)
            raise ConfigError(
                f"interleaved stages (parallelism.virtual_stages={par.virtual_stages}) need at "
                f"least as many microbatches as stages: workload.microbatches="
                f"{w.microbatches} < parallelism.pipeline={stages}; "
                f"{_microbatch_fix(w.global_batch, w.microbatches, dp, keys, at_least)}")
        try:
            plan = Pipeline(stages=stages, microbatches=w.microbatches, layers=m.n_layers,
                            virtual=par.virtual_stages, schedule=par.pipeline_schedule)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check_idle_stages(stages, par.virtual_stages, m.n_layers)
        _check_virtual_chunks(plan)
    elif par.virtual_stages != 1:
        raise ConfigError(f"parallelism.virtual_stages={par.virtual_stages} needs pipeline "
                          f"stages; set parallelism.pipeline > 1 or virtual_stages = 1")


def _check_virtual_chunks(plan: Pipeline) -> None:
    """Virtual stages whose chunks, rounded up, give every stage more layer slots than its
    layers (80 layers on 4 stages of 3 chunks of 7: 21 slots for 20 layers) would time
    empty slots as layers (SPMD runs a padded slot's layer and drops it); Megatron-LM
    refuses them (its chunks must split a stage's layers evenly:
    Pipeline.megatron_refuses)."""
    if plan.padded_work <= 1:
        return
    choices = ", ".join(map(str, [1, *plan.virtual_choices()]))
    per = plan.layers / plan.stages
    raise ConfigError(
        f"parallelism.virtual_stages={plan.virtual} does not split the "
        f"{per:g} layers a stage (model.n_layers={plan.layers} over parallelism.pipeline="
        f"{plan.stages}) into equal chunks: chunks of {plan.chunk} give every stage "
        f"{plan.slots_per_stage} layer slots, {plan.padded_work - 1:.0%} more layer work "
        f"than the model has, and Megatron-LM refuses it; choose virtual_stages "
        f"{choices}")


def _idle_stages(stages: int, virtual: int, layers: int) -> int:
    """Pipeline stages that hold no layer at all: models/pipeline.py pads before the first
    layer and after the last, which may leave whole stages empty."""
    plan = Pipeline(stages=stages, microbatches=stages, layers=layers, virtual=virtual)
    return sum(not any(map(any, chunks)) for chunks in plan.valid_mask())


def _check_idle_stages(stages: int, virtual: int, layers: int) -> None:
    """Uneven stages are fine (126 layers in 128 slots); a stage with no layer at all is a
    pipeline no framework runs (Megatron and MaxText refuse it)."""
    idle = _idle_stages(stages, virtual, layers)
    if idle:
        fits = [p for p in range(2, stages) if not _idle_stages(p, virtual, layers)]
        raise ConfigError(f"parallelism.pipeline={stages} x virtual_stages={virtual} over "
                          f"model.n_layers={layers} leaves {idle} of the {stages} stages "
                          f"without a layer; use fewer stages"
                          + (f" (at most {fits[-1]})" if fits else "") + " or more layers")
