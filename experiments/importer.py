"""`shardscope import maxtext`: a MaxText config (its YAML, with `key=value` overrides as its
train.py takes them) as an experiment config.

Only the keys `shardscope export --to maxtext` writes are read (experiments/frameworks.py);
one with a value shardscope cannot express is refused, naming it. MaxText's own defaults
(its base.yml) stand in for the keys the file leaves out.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Sequence
from pathlib import Path

from experiments import config as config_mod
from experiments.config import ConfigError
from experiments.frameworks import (
    MAXTEXT_ACTIVATIONS,
    MAXTEXT_AXES,
    MAXTEXT_FUSED,
    MAXTEXT_MODEL_KEYS,
    MAXTEXT_MODELS,
    MAXTEXT_SHAPE_KEYS,
    SYSTEM_LINE,
    granules,
    ici_dcn,
)
from meshes import get_system
from models.program import CHECKPOINT_NAMES
from sharding.rules import MESH_AXES, divisors

# MaxText's base.yml defaults of the keys read here (`-1`: the devices left over)
DEFAULTS = {"ici_fsdp_parallelism": -1, "dcn_data_parallelism": -1,
            "per_device_batch_size": 12.0, "max_target_length": 2048,
            "gradient_accumulation_steps": 1, "num_pipeline_microbatches": -1,
            "num_layers_per_pipeline_stage": 1, "remat_policy": "full",
            "weight_dtype": "float32", "dtype": "bfloat16", "quantization": "",
            "shard_optimizer_over_data": False, "num_vocab_tiling": 1, "opt_type": "adamw",
            "capacity_factor": -1.0,  # -1: dropless
            "context_parallel_strategy": "all_gather", "num_pipeline_repeats": -1,
            "pipeline_parallel_layers": -1}
# MaxText's context_parallel_strategy -> parallelism.context_mode
CONTEXT_STRATEGIES = {"all_gather": "allgather", "ring": "ring"}
# The other MaxText keys read here (overrides of them are not typos)
READ_KEYS = ("model_name", "override_model_config", "attention", "attention_type",
             "decoder_block", "mlp_activations", "logits_via_embedding",
             "first_num_dense_layers", "base_moe_mlp_dim", "pipeline_delay_activation_forwarding")
# MaxText's optimizer keys an import writes into [train] (MaxText key -> shardscope's field)
TRAIN_KEYS = {"learning_rate": "learning_rate", "adam_weight_decay": "weight_decay"}
# MaxText mesh axes shardscope has no axis for: they must stay 1
UNSUPPORTED_AXES = ("fsdp_transpose", "tensor_transpose", "tensor_sequence", "autoregressive",
                    "context_autoregressive", "stage")
# MaxText's named remat policies that are a set of saved tensors
NAMED_REMAT = {
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_out_proj": ("out_proj",),
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
    "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
    "save_dot_with_context_except_mlp": ("query_proj", "key_proj", "value_proj", "context",
                                         "out_proj"),
}
REMAT_CHOICES = ("full", "minimal", "custom", *NAMED_REMAT)
PRESET_OF = {v: k for k, v in MAXTEXT_MODELS.items()}
PRESET_OF.update({"llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b",
                  "llama3.1-405b": "llama3-405b"})


def scalar(text: str):
    """A YAML scalar or flow list of the simple kind MaxText configs use."""
    t = text.strip()
    if t.startswith("[") and t.endswith("]"):
        return [scalar(x) for x in t[1:-1].split(",") if x.strip()]
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~", ""):
        return None
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    return t


def parse_yaml(text: str) -> tuple[dict, str]:
    """The top-level `key: value` lines (nested blocks skipped) and the system a
    `# shardscope system: NAME` line names ("" if none). Not yaml.safe_load: YAML 1.1 reads
    3e-6 (MaxText's post_train/rl.yml learning_rate) and the export's 3e-06 as strings,
    where MaxText's own reader, OmegaConf, reads numbers, as this does."""
    out, system, block = {}, "", None  # block: the key whose value is an empty line
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith(SYSTEM_LINE):
            system = line[len(SYSTEM_LINE):].strip()
        item = line.strip()
        if block is not None and (item == "-" or item.startswith("- ")):
            # a block-style list (`key:` then `  - value` lines), e.g. mlp_activations
            out[block] = [*(out[block] or []), scalar(item[1:].split(" #", 1)[0])]
            continue
        if not item or line[0] in " \t-#[]{}'\"":
            continue
        key, colon, value = line.partition(":")
        if not colon or not key.strip():
            raise ConfigError(f"line {number}: {line.strip()[:60]!r} is not `key: value` "
                              f"(a YAML top-level line); fix the file")
        value = value.split(" #", 1)[0]
        out[key.strip()] = scalar(value)
        block = key.strip() if out[key.strip()] is None else None
    return out, system


def read_maxtext(path: str | Path, overrides: list[str] = ()) -> tuple[dict, str]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"MaxText config {str(path)!r} not found; give its YAML, e.g. one "
                          f"written by `shardscope export CONFIG --to maxtext --out X.yml`")
    keys, system = parse_yaml(p.read_text())
    known = {*keys, *read_keys()}
    shape = []  # the model's shape keys among the overrides
    for item in overrides:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"override {item!r}: expected key=value as MaxText's train.py "
                              f"takes them, e.g. ici_fsdp_parallelism=8")
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
        if key not in known and near:
            raise ConfigError(f"override {key}={value}: not a MaxText key shardscope reads; "
                              f"did you mean {near[0]}={value}?")
        keys[key] = scalar(value)
        if key in MAXTEXT_MODEL_KEYS:
            shape.append(key)
    named = keys.get("model_name", "default") != "default"
    if shape and named and not keys.get("override_model_config"):
        # MaxText's pyconfig refuses them too: its model file's values win otherwise
        raise ConfigError(f"override {shape[0]} with model_name={keys['model_name']}: MaxText "
                          f"keeps the model file's value unless override_model_config=true; "
                          f"add it, or drop model_name and give every shape key")
    return keys, system


def read_keys() -> set[str]:
    """The MaxText keys an import reads (every other one changes nothing here)."""
    return {*DEFAULTS, *MAXTEXT_MODEL_KEYS, *MAXTEXT_FUSED, *CHECKPOINT_NAMES, *READ_KEYS,
            *TRAIN_KEYS,
            *(f"{level}_{name}_parallelism" for level in ("ici", "dcn")
              for name in (*MAXTEXT_AXES.values(), *UNSUPPORTED_AXES, "sequence"))}


def _int(keys: dict, key: str) -> int:
    v = keys.get(key, DEFAULTS.get(key, 1))
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"{key}={v!r} must be a whole number (-1: the devices left over)")
    return v


def _resolve(ways: dict[str, int], total: int, level: str) -> dict[str, int]:
    """`-1` (at most one) is what the others leave of `total`."""
    what = "devices per slice (node)" if level == "ici" else "slices (nodes)"
    auto = [a for a, v in ways.items() if v == -1]
    known = math.prod(v for v in ways.values() if v != -1)
    bad = [a for a, v in ways.items() if v < 1 and v != -1]
    if bad:
        key = f"{level}_{MAXTEXT_AXES[bad[0]]}_parallelism"
        raise ConfigError(f"{key}={ways[bad[0]]} must be a size of 1 or more, or -1 (the "
                          f"{what} left over)")
    if len(auto) > 1:
        raise ConfigError(f"{', '.join(f'{level}_{MAXTEXT_AXES[a]}_parallelism' for a in auto)}"
                          f" are all -1; keep at most one -1 per {level}_*")
    if auto and total % known:
        key = f"{level}_{MAXTEXT_AXES[auto[0]]}_parallelism"
        raise ConfigError(f"{level}_*_parallelism other than {key}=-1 multiply to {known}, "
                          f"which does not divide the {total} {what}; make their product "
                          f"one of {divisors(total)}")
    if not auto and known != total:
        raise ConfigError(f"{level}_*_parallelism multiply to {known}, but the system has "
                          f"{total} {what}; make their product {total} or set one to -1")
    if auto:
        ways[auto[0]] = total // known
    return ways


def parallelism(keys: dict, system) -> dict:
    """[parallelism] from ici_* x dcn_*, with `outer` where the DCN axis is not the
    outermost of shardscope's order."""
    for name in UNSUPPORTED_AXES:
        for level in ("ici", "dcn"):
            if _int(keys, f"{level}_{name}_parallelism") != 1:
                raise ConfigError(f"{level}_{name}_parallelism="
                                  f"{keys[f'{level}_{name}_parallelism']}: shardscope has no "
                                  f"{name} axis; valid axes: "
                                  f"{', '.join(MAXTEXT_AXES.values())}; set it to 1")
    count, what = granules(system)
    per = system.num_devices // count
    split = {}
    for level, total in (("ici", per), ("dcn", count)):
        ways = {a: _int(keys, f"{level}_{MAXTEXT_AXES[a]}_parallelism") for a in MESH_AXES}
        seq = _int(keys, f"{level}_sequence_parallelism")
        if seq != 1 and ways["sequence"] != 1:
            raise ConfigError(f"{level}_sequence_parallelism={seq} and {level}_context_"
                              f"parallelism={ways['sequence']}: shardscope has one context-"
                              f"parallel axis; set one of them to 1")
        ways["sequence"] = ways["sequence"] if seq == 1 else seq
        split[level] = _resolve(ways, total, level)
    sizes = {a: split["ici"][a] * split["dcn"][a] for a in MESH_AXES}
    want = {a: (split["ici"][a], split["dcn"][a]) for a in MESH_AXES}
    dcn_axes = [a for a in MESH_AXES if split["dcn"][a] > 1]
    for outer in ("", *dcn_axes):
        if ici_dcn(sizes, outer, count, what) == want:
            out = {a: s for a, s in sizes.items() if s > 1}
            return {**out, **({"outer": outer} if outer else {}), "rules": "maxtext"}
    raise ConfigError(f"dcn_*_parallelism over {', '.join(dcn_axes)} with their ici_* parts: "
                      f"shardscope places one axis outermost (parallelism.outer); put the "
                      f"{what}s on one axis, or on axes whose ici_*_parallelism is 1")


def _remat(keys: dict) -> dict:
    policy = keys.get("remat_policy", DEFAULTS["remat_policy"])
    if policy not in REMAT_CHOICES:
        raise ConfigError(f"remat_policy={policy!r} has no shardscope equivalent; valid: "
                          f"{', '.join(REMAT_CHOICES)}")
    if policy in ("full", "minimal"):
        return {"remat": policy}
    if policy in NAMED_REMAT:
        return {"remat": "custom", "save": list(NAMED_REMAT[policy])}
    save, offload = [], []
    for name in CHECKPOINT_NAMES:
        where = keys.get(name, "remat")
        if where not in ("remat", "device", "offload"):
            raise ConfigError(f"{name}={where!r}: valid: remat, device, offload")
        {"device": save, "offload": offload, "remat": []}[where].append(name)
    for name in ("mlpwi_0", "mlpwi_1"):
        if keys.get(name, "remat") != "remat":
            raise ConfigError(f"{name}={keys[name]!r}: shardscope saves the MLP's input "
                              f"matmuls together; use mlpwi: {keys[name]} instead")
    return {"remat": "custom", "save": save, "offload": offload}


def _precision(keys: dict) -> dict:
    params, dtype = keys.get("weight_dtype", "float32"), keys.get("dtype", "bfloat16")
    quant = keys.get("quantization") or ""
    for key, v, valid in (("weight_dtype", params, ("float32", "bfloat16")),
                          ("dtype", dtype, ("bfloat16", "float32")),
                          ("quantization", quant, ("", "fp8"))):
        if v not in valid:
            raise ConfigError(f"{key}={v!r} has no shardscope training equivalent; valid: "
                              f"{', '.join(repr(x) for x in valid)}")
    return {"params": params, "compute": "float8" if quant == "fp8" else dtype}


def _model(keys: dict) -> dict:
    name = keys.get("model_name", "default")
    shape = _shape(keys) if name == "default" or keys.get("override_model_config") else {}
    experts = shape.get("n_experts") or (
        config_mod.preset(PRESET_OF[name]).n_experts if name in PRESET_OF else 1)
    if experts > 1:  # MaxText's default capacity_factor, -1, routes every token (dropless)
        factor = keys.get("capacity_factor", DEFAULTS["capacity_factor"])
        if factor == -1:
            shape["dropless"] = True
        else:
            shape["capacity_factor"] = factor
    if keys.get("attention") == "dot_product":
        shape["attention"] = "dense"
    shape.update({k: True for k in MAXTEXT_FUSED if keys.get(k) is True})
    if name != "default":
        if name not in PRESET_OF:
            raise ConfigError(f"model_name={name!r} is not a model shardscope knows; valid: "
                              f"{', '.join(sorted(PRESET_OF))}; or give base_emb_dim, "
                              f"base_num_query_heads, ... for its shape")
        return {"preset": PRESET_OF[name], **shape}
    missing = [k for k in MAXTEXT_SHAPE_KEYS if k not in keys]
    if missing:
        raise ConfigError(f"no model_name and no {', '.join(missing)}: give a MaxText "
                          f"model_name ({', '.join(sorted(PRESET_OF))}) or every shape key")
    return shape


def _shape(keys: dict) -> dict:
    """The shape keys; with a model_name, MaxText's model file sets them (base.yml's values
    are overridden) unless override_model_config."""
    shape = {MAXTEXT_MODEL_KEYS[k]: keys[k] for k in MAXTEXT_MODEL_KEYS if k in keys}
    if shape.get("max_seq_len", 1) < 1:  # base.yml's -1: no learned table
        del shape["max_seq_len"]
    if shape.get("n_experts", 1) <= 1:
        shape.pop("n_shared_experts", None)
    if "mlp_activations" in keys:
        acts = {tuple(v): k for k, v in MAXTEXT_ACTIVATIONS.items()}
        got = tuple(keys["mlp_activations"] or ())
        if got not in acts:
            raise ConfigError(f"mlp_activations={list(got)}: valid: "
                              f"{', '.join(str(v) for v in MAXTEXT_ACTIVATIONS.values())}")
        shape["mlp"] = acts[got]
    shape.update(_latent_attention(keys))
    if keys.get("first_num_dense_layers"):  # base_mlp_dim is then theirs, the experts' apart
        if not isinstance(keys.get("base_moe_mlp_dim"), int):
            raise ConfigError("first_num_dense_layers needs base_moe_mlp_dim (the experts' "
                              "hidden width; base_mlp_dim is the dense layers')")
        shape.update(n_dense_layers=keys["first_num_dense_layers"],
                     dense_d_ff=shape.get("d_ff"), d_ff=keys["base_moe_mlp_dim"])
    if keys.get("logits_via_embedding") is not None:
        shape["tie_embeddings"] = bool(keys["logits_via_embedding"])
    block = keys.get("decoder_block")
    if block == "gpt3":
        shape.update(norm="layernorm", positions="learned")
    elif block not in (None, "llama2", "mistral", "mixtral", "deepseek"):
        raise ConfigError(f"decoder_block={block!r}: shardscope's blocks are llama2, "
                          f"mistral, mixtral and deepseek (RMSNorm, RoPE; their MLP and "
                          f"attention from num_experts and attention_type) and gpt3 "
                          f"(LayerNorm, learned positions)")
    return shape


def _latent_attention(keys: dict) -> dict:
    """MaxText's multi-head latent attention keys (attention_type: mla) as shardscope's."""
    kind = keys.get("attention_type", "global")
    if kind == "global":
        return {}
    if kind != "mla":
        raise ConfigError(f"attention_type={kind!r}: shardscope models 'global' (grouped-query) "
                          f"and 'mla' (multi-head latent) attention")
    fields = {"kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank",
              "qk_nope_head_dim": "head_dim", "qk_rope_head_dim": "qk_rope_dim",
              "v_head_dim": "v_head_dim"}
    missing = [k for k in fields if not isinstance(keys.get(k), int)]
    if missing:
        raise ConfigError(f"attention_type='mla' needs {', '.join(missing)} as whole numbers")
    return {field: keys[k] for k, field in fields.items()}


def _repeats(keys: dict, model: dict, stages: int) -> int:
    """The circular pipeline's repeats (parallelism.virtual_stages), refused where MaxText's
    config check refuses them: stages x repeats x num_layers_per_pipeline_stage must be the
    pipelined layers (a DeepSeek block's MoE layers, its dense first ones apart)."""
    base = config_mod.preset(model["preset"]) if "preset" in model else None
    layers = model.get("n_layers") or base.n_layers
    dense = model.get("n_dense_layers", base.n_dense_layers if base else 0)
    piped = layers - dense
    if _int(keys, "pipeline_parallel_layers") not in (-1, piped):
        raise ConfigError(f"pipeline_parallel_layers={keys['pipeline_parallel_layers']}: "
                          f"shardscope pipelines every layer ({piped}); set it to -1")
    per_stage, repeats = (_int(keys, "num_layers_per_pipeline_stage"),
                          _int(keys, "num_pipeline_repeats"))
    if per_stage < 1:
        raise ConfigError(f"num_layers_per_pipeline_stage={per_stage} must be 1 or more")
    fits = ", ".join(str(d) for d in range(1, piped + 1) if piped % (stages * d) == 0)
    how = (f"(MaxText refuses it too); set num_layers_per_pipeline_stage to one of {fits} "
           f"and num_pipeline_repeats=-1" if fits else
           f"(MaxText refuses it too): {stages} stages do not divide {piped} layers; choose "
           f"a pipeline size that does")
    if repeats == -1:
        if piped % (stages * per_stage):
            raise ConfigError(f"{stages} pipeline stages x num_layers_per_pipeline_stage="
                              f"{per_stage} does not divide the {piped} pipelined layers {how}")
        repeats = piped // (stages * per_stage)
    if stages * repeats * per_stage != piped:
        raise ConfigError(f"{stages} pipeline stages x num_pipeline_repeats={repeats} x "
                          f"num_layers_per_pipeline_stage={per_stage} = "
                          f"{stages * repeats * per_stage} layers, not the {piped} pipelined "
                          f"ones {how}")
    # shardscope pipelines the dense first layers too (docs/limits.md): their slots added
    return -(-layers // (stages * per_stage)) if dense else repeats


def system_of(text: str):
    """The system and its [system] overrides from `--system` or an export's `# shardscope
    system:` line: a name and the overrides written beside it ("NAME key=value ...")."""
    system_name, *pairs = text.split()
    overrides = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f"system {system_name!r}: {pair!r} is not key=value (a system "
                              f"override, e.g. gpus_per_domain=64)")
        overrides[key] = scalar(value)
    try:
        return get_system(system_name, **overrides), overrides
    except ValueError as e:
        raise ConfigError(f"--system: {e}") from None


def to_experiment(keys: dict, system_name: str, name: str) -> dict:
    """The experiment's tables (as a TOML file holds them), checked by the config loader."""
    system, overrides = system_of(system_name)
    par = parallelism(keys, system)
    if par.get("sequence", 1) > 1:
        strategy = keys.get("context_parallel_strategy", DEFAULTS["context_parallel_strategy"])
        if strategy not in CONTEXT_STRATEGIES:
            raise ConfigError(f"context_parallel_strategy={strategy!r}: valid: "
                              f"{', '.join(CONTEXT_STRATEGIES)}")
        par["context_mode"] = CONTEXT_STRATEGIES[strategy]
    micro, ga = _int(keys, "num_pipeline_microbatches"), _int(keys, "gradient_accumulation_steps")
    pipelined = par.get("pipeline", 1) > 1
    if pipelined and micro == -1:  # MaxText's default: a microbatch per stage (two if delayed)
        micro = par["pipeline"] * (2 if keys.get("pipeline_delay_activation_forwarding") else 1)
    if pipelined and micro != -1 and ga > 1:
        raise ConfigError(f"gradient_accumulation_steps={ga} with num_pipeline_microbatches="
                          f"{micro}: shardscope's microbatches are both; set "
                          f"gradient_accumulation_steps=1")
    microbatches = micro if pipelined else ga
    per_device = keys.get("per_device_batch_size", DEFAULTS["per_device_batch_size"])
    if isinstance(per_device, bool) or not isinstance(per_device, int | float):
        raise ConfigError(f"per_device_batch_size={per_device!r} must be a number of sequences, "
                          f"e.g. per_device_batch_size=4")
    batch = per_device * system.num_devices * (1 if pipelined else ga)
    if not float(batch).is_integer() or batch < 1:
        raise ConfigError(f"per_device_batch_size={per_device} x {system.num_devices} devices "
                          f"is {batch:g} sequences; make it a whole number")
    model = _model(keys)
    if pipelined:
        par["virtual_stages"] = _repeats(keys, model, par["pipeline"])
    raw = {"name": name, "model": model, "system": {"name": system.name, **overrides},
           "parallelism": par,
           "workload": {"seq_len": _int(keys, "max_target_length"),
                        "global_batch": int(batch), "microbatches": microbatches},
           "precision": _precision(keys),
           "train": {**_remat(keys), "num_vocab_tiling": _int(keys, "num_vocab_tiling"),
                     "shard_optimizer_over_data": bool(keys.get("shard_optimizer_over_data"))}}
    if keys.get("opt_type", "adamw") != "adamw":
        raise ConfigError(f"opt_type={keys['opt_type']!r}: shardscope models adamw; set "
                          f"opt_type=adamw")
    for key, field in TRAIN_KEYS.items():
        if key in keys:
            raw["train"][field] = keys[key]
    config_mod.from_dict(raw)  # its checks, naming the config's keys
    return raw


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return json.dumps(v)  # TOML's basic strings escape as JSON's do
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(raw: dict, source: str, ignored: Sequence[str] = (), *,
            what: str = "the MaxText config", framework: str = "maxtext",
            notes: Sequence[str] = ()) -> str:
    """The experiment as a TOML file, headed by where it came from and `notes` (`#` lines)."""
    lines = [f"# Imported from {what} {source} (shardscope import {framework})."]
    if ignored:
        lines.append(f"# Overrides that change nothing shardscope models: {', '.join(ignored)}")
    lines += [f"# {note}" for note in notes]
    lines.append(f"name = {_toml_value(raw['name'])}")
    for table in ("model", "system", "parallelism", "workload", "precision", "train"):
        lines += ["", f"[{table}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in raw[table].items()
                  if v not in ([], None)]
    return "\n".join(lines) + "\n"


def import_maxtext(path: str, overrides: list[str], system: str | None, out: str) -> str:
    """The experiment TOML of a MaxText config; `system` unless the file names one."""
    keys, named = read_maxtext(path, overrides)
    system = system or named
    if not system:
        raise ConfigError(f"{path}: a MaxText config does not say which machine it runs on; "
                          f"give --system NAME (e.g. --system tpu-v5e:16x16*4; "
                          f"`shardscope systems` lists them)")
    raw = to_experiment(keys, system, Path(out).stem)
    read = read_keys()
    ignored = [o for o in overrides if o.partition("=")[0].strip() not in read]
    return to_toml(raw, Path(path).name, ignored)
