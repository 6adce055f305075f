"""`shardscope import nemo`: a NeMo 1.x training config (`megatron_gpt_config.yaml`: its
`trainer:` and `model:` keys, with Hydra overrides such as
`model.tensor_model_parallel_size=8`) as an experiment config.

NeMo hands these keys to Megatron-core, so each is read as the Megatron-LM flag it stands
for and translated by experiments/megatron.py (the same defaults, checks and refusals; an
error names NeMo's key). What NeMo says apart from Megatron's flags is read here: the
device count (trainer.num_nodes x trainer.devices, checked against --system), the precision
(trainer.precision; megatron_amp_O2 keeps bf16 weights with an fp32 copy, without it the
weights stay fp32 under bf16 autocast), the optimizer's name and CPU offloading.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from experiments import config as config_mod
from experiments import megatron
from experiments.config import ConfigError
from experiments.importer import system_of, to_toml

# model.<key> -> the Megatron flag it is (its value as is; null: not given)
FLAGS = {
    "tensor_model_parallel_size": "tensor-model-parallel-size",
    "pipeline_model_parallel_size": "pipeline-model-parallel-size",
    "virtual_pipeline_model_parallel_size": "virtual-pipeline-model-parallel-size",
    "context_parallel_size": "context-parallel-size",
    "cp_comm_type": "cp-comm-type",
    "expert_model_parallel_size": "expert-model-parallel-size",
    "expert_tensor_parallel_size": "expert-tensor-parallel-size",
    "micro_batch_size": "micro-batch-size", "global_batch_size": "global-batch-size",
    "encoder_seq_length": "seq-length", "max_position_embeddings": "max-position-embeddings",
    "num_layers": "num-layers", "hidden_size": "hidden-size",
    "ffn_hidden_size": "ffn-hidden-size", "num_attention_heads": "num-attention-heads",
    "kv_channels": "kv-channels", "make_vocab_size_divisible_by":
        "make-vocab-size-divisible-by",
    "rotary_base": "rotary-base", "num_moe_experts": "num-experts",
    "moe_router_topk": "moe-router-topk", "moe_ffn_hidden_size": "moe-ffn-hidden-size",
    "moe_shared_expert_intermediate_size": "moe-shared-expert-intermediate-size",
    "moe_layer_freq": "moe-layer-freq",
    "moe_expert_capacity_factor": "moe-expert-capacity-factor",
    "activations_checkpoint_granularity": "recompute-granularity",
    "activations_checkpoint_method": "recompute-method",
    "activations_checkpoint_num_layers": "recompute-num-layers",
    "rampup_batch_size": "rampup-batch-size",
    # not Megatron's: shardscope's way to give what NeMo's tokenizer holds
    "vocab_size": "vocab-size",
}
# model.<key>: true -> the Megatron switch
SWITCHES = {"sequence_parallel": "sequence-parallel", "ub_tp_comm_overlap": "tp-comm-overlap",
            "moe_pad_expert_input_to_capacity": "moe-pad-expert-input-to-capacity"}
# model.<key> -> {its value: the Megatron flags it is}
CHOICES = {
    "activation": {"gelu": [], "swiglu": ["--swiglu"], "fast-swiglu": ["--swiglu"]},
    "normalization": {"layernorm": ["--normalization", "LayerNorm"],
                      "layernorm1p": ["--normalization", "LayerNorm"],
                      "rmsnorm": ["--normalization", "RMSNorm"]},
    "position_embedding_type": {"learned_absolute": [],
                                "rope": ["--position-embedding-type", "rope"]},
    "share_embeddings_and_output_weights": {True: [],
                                            False: ["--untie-embeddings-and-output-weights"]},
    "bias": {True: [], False: ["--disable-bias-linear"]},
    "overlap_p2p_comm": {True: [], False: ["--no-overlap-p2p-communication"]},
}
# trainer.precision -> bf16 or not (PyTorch Lightning's names)
PRECISIONS = {"bf16": True, "bf16-mixed": True, "32": False, "32-true": False}
# model.optim.name: Megatron's Adam, with the distributed optimizer or not
OPTIMIZERS = {"fused_adam": False, "adam": False, "adamw": False,
              "distributed_fused_adam": True, "mcore_distributed_optim": True}
_REF = re.compile(r"\$\{(\.*)([\w.]+)\}")
# NeMo's own model keys one letter or word from a key read here (not misspellings)
NEAR_READ = frozenset({"decoder_seq_length", "ub_tp_comm_overlap_cfg"})


def _scalar(text: str):
    import yaml  # PyYAML, flax's own dependency

    return yaml.safe_load(text) if text.strip() else None


def read_nemo(path: str | Path, overrides: list[str]) -> dict:
    """The config's tables with Hydra-style overrides (`model.key=value`, `+model.key=value`)
    applied and `${...}` interpolations resolved."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"NeMo config {str(path)!r} not found; give its YAML, e.g. NeMo's "
                          f"examples/nlp/language_modeling/conf/megatron_gpt_config.yaml")
    try:
        cfg = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ConfigError(f"{path}: not valid YAML{line}; fix the syntax there") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise ConfigError(f"{path}: no `model:` table; give a NeMo training config (its "
                          f"`trainer:` and `model:` keys, as megatron_gpt_config.yaml)")
    for item in overrides:
        key, eq, value = item.partition("=")
        parts = key.strip().lstrip("+").split(".")
        if not eq or len(parts) < 2 or parts[0] not in ("model", "trainer"):
            raise ConfigError(f"override {item!r}: expected model.KEY=VALUE or "
                              f"trainer.KEY=VALUE as NeMo's Hydra command line takes them, "
                              f"e.g. model.tensor_model_parallel_size=8")
        node = cfg
        for i, part in enumerate(parts[:-1], 1):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                table = ".".join(parts[:i])
                raise ConfigError(f"override {item!r}: {table} is {node!r} in the config, "
                                  f"not a table of keys; override {table} itself")
        node[parts[-1]] = _scalar(value)
    return _resolved(cfg, cfg, [])


def _resolved(node, root: dict, path: list[str]):
    """`${model.x}` (from the root) and `${.x}` (beside the key) replaced by their values;
    one that names nothing stays as written (an error only if a key read holds it)."""
    if isinstance(node, dict):
        return {k: _resolved(v, root, [*path, str(k)]) for k, v in node.items()}
    if not isinstance(node, str) or not (m := _REF.fullmatch(node.strip())):
        return node
    dots, name = m.groups()
    base = root if not dots else _at(root, path[:len(path) - len(dots)])
    value = _at(base, name.split(".")) if isinstance(base, dict) else None
    return node if value is None else _resolved(value, root, path)


def _at(node, parts: list[str]):
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _flag_words(model: dict, used: set[str]) -> list[str]:
    """The Megatron flags `model:`'s keys stand for."""
    words = []
    for key, flag in FLAGS.items():
        v = model.get(key)
        used.add(key)
        if v is not None:
            if isinstance(v, str) and _REF.search(v):
                raise ConfigError(f"model.{key}={v}: the interpolation names no key of the "
                                  f"config; give the value, e.g. model.{key}=4")
            words += [f"--{flag}", *(str(x) for x in (v if isinstance(v, list) else [v]))]
    for key, flag in SWITCHES.items():
        used.add(key)
        if model.get(key):
            words.append(f"--{flag}")
    for key, choices in CHOICES.items():
        used.add(key)
        if key in model and model[key] is not None:
            if isinstance(model[key], list | dict) or model[key] not in choices:
                raise ConfigError(f"model.{key}={model[key]!r} has no shardscope equivalent; "
                                  f"valid: {', '.join(map(str, choices))}")
            words += choices[model[key]]
    groups = model.get("num_query_groups")
    used.add("num_query_groups")
    if groups and groups != model.get("num_attention_heads"):
        words += ["--group-query-attention", "--num-query-groups", str(groups)]
    return words


def _precision_words(cfg: dict, used: set[str]) -> list[str]:
    model, trainer = cfg["model"], cfg.get("trainer") or {}
    precision = str(trainer.get("precision", 32))
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={precision}: shardscope trains in bf16 or fp32 "
                          f"(no fp16 with loss scaling); valid: {', '.join(PRECISIONS)}")
    used.update(("fp8", "fp8_hybrid", "fp8_e4m3"))
    words = ["--bf16"] if PRECISIONS[precision] else []
    if model.get("fp8"):
        words += ["--fp8-format", "hybrid" if model.get("fp8_hybrid") else "e4m3"]
    return words


def _optimizer_words(model: dict, used: set[str]) -> list[str]:
    used.add("optim")
    optim = model.get("optim") or {}
    name = optim.get("name", "fused_adam")
    if name not in OPTIMIZERS:
        raise ConfigError(f"model.optim.name={name!r}: shardscope models Adam(W); valid: "
                          f"{', '.join(OPTIMIZERS)}")
    words = ["--use-distributed-optimizer"] if OPTIMIZERS[name] else []
    for key, flag in (("overlap_grad_sync", "overlap-grad-reduce"),
                      ("overlap_param_sync", "overlap-param-gather")):
        if optim.get(key) and OPTIMIZERS[name]:
            words.append(f"--{flag}")
    if str(optim.get("grad_sync_dtype", "")).startswith("bf16"):
        words.append("--grad-reduce-in-bf16")
    for key, flag in (("lr", "lr"), ("weight_decay", "weight-decay")):
        if optim.get(key) is not None:
            words += [f"--{flag}", str(optim[key])]
    return words


def _devices(trainer: dict) -> int | None:
    nodes, devices = trainer.get("num_nodes", 1), trainer.get("devices", 1)
    if all(isinstance(v, int) and v > 0 for v in (nodes, devices)):
        return nodes * devices
    return None  # "auto", -1: what the launcher finds


def _nemo_names(message: str) -> str:
    """A Megatron flag in an error or a note as the NeMo key that gave it (the longest flag
    first: --num-layers is the start of others)."""
    names = {f"--{flag}": f"model.{key}" for key, flag in FLAGS.items()}
    names.update({"no --disable-bias-linear": "model.bias=true",
                  **{f"--{flag}": f"model.{key}" for key, flag in SWITCHES.items()}})
    for flag in sorted(names, key=len, reverse=True):
        message = message.replace(flag, names[flag])
    return message


def experiment(path: str | Path, overrides: list[str], system: str | None, name: str
               ) -> tuple[dict, list[str]]:
    """The checked experiment tables of a NeMo config, and the notes for its TOML."""
    cfg = read_nemo(path, overrides)
    model, trainer = cfg["model"], cfg.get("trainer") or {}
    n = _devices(trainer)
    if not system:
        example = f"h100:{n}" if n else "h100:64"
        raise ConfigError(f"{path}: a NeMo config counts GPUs (trainer.num_nodes x "
                          f"trainer.devices) but does not say which; give --system NAME "
                          f"(e.g. --system {example}; `shardscope systems` lists them)")
    machine, _ = system_of(system)
    if n and n != machine.num_devices:
        raise ConfigError(f"trainer.num_nodes x trainer.devices = {n} GPUs, but --system "
                          f"{system} has {machine.num_devices}; give a system of {n} or "
                          f"override trainer.num_nodes / trainer.devices")
    if model.get("vocab_size") is None:
        raise ConfigError("NeMo takes the vocabulary from model.tokenizer, which shardscope "
                          "does not read; give its size as an override, +model.vocab_size=N "
                          "(e.g. 32000, Llama 2's)")
    used: set[str] = set()
    words = [*_flag_words(model, used), *_precision_words(cfg, used),
             *_optimizer_words(model, used)]
    try:
        raw, flags = megatron.translate(megatron.parse_flags(words, str(path)), system, name)
    except ConfigError as e:
        raise ConfigError(_nemo_names(str(e))) from None
    if PRECISIONS[str(trainer.get("precision", 32))] and not model.get("megatron_amp_O2"):
        # O1: fp32 weights, the matmuls under bf16 autocast
        raw["precision"].update(params="float32")
        raw["precision"].pop("master_weights", None)
    used.update(("megatron_amp_O2", "cpu_offloading", "cpu_offloading_num_layers"))
    if model.get("cpu_offloading"):
        raw["train"]["offload_layers"] = model.get("cpu_offloading_num_layers") or 0
    config_mod.from_dict(raw)  # its checks, naming the config's keys
    notes = [_nemo_names(note) for note in flags.notes]
    _misspelt_overrides(overrides, used)
    unread = [f"model.{k}" for k in model if k not in used]
    if unread:
        notes.append("NeMo keys read but not modelled: " + ", ".join(unread))
    return raw, notes


def _misspelt_overrides(overrides: list[str], used: set[str]) -> None:
    """Refuses a command-line override of a model key not read that is one letter from a
    key read (the config file's own keys are NeMo's many others, listed as not modelled)."""
    for item in overrides:
        key = item.partition("=")[0].strip().lstrip("+")
        table, _, name = key.partition(".")
        if table != "model" or "." in name or name in used or name in NEAR_READ:
            continue
        near = difflib.get_close_matches(name, used, n=1, cutoff=0.85)
        if near:
            raise ConfigError(f"override {item!r}: model.{name} is not a NeMo key shardscope "
                              f"reads; did you mean model.{near[0]}?")


def import_nemo(path: str, overrides: list[str], system: str | None, out: str) -> str:
    """The experiment TOML of a NeMo config on `system`."""
    raw, notes = experiment(path, overrides, system, Path(out).stem)
    return to_toml(raw, Path(path).name, what="the NeMo config", framework="nemo",
                   notes=notes)
