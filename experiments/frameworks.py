"""`shardscope export`: an experiment's sharding, batch, remat and precision as a training
framework's own settings (MaxText's config keys, Megatron-LM's command-line flags).

What the framework cannot express is said in a `# ...` line, never dropped. The way back
in from MaxText is experiments/importer.py; both share the tables here (the mesh axes'
MaxText names, the ICI / DCN split, the model names).
"""

from __future__ import annotations

import dataclasses

from experiments.config import ConfigError, Experiment
from experiments.reference import toml_value
from models.config import PRESETS
from models.pipeline import Pipeline
from models.program import CHECKPOINT_NAMES, expand_names
from sharding.rules import MESH_AXES

FRAMEWORKS = ("maxtext", "megatron")

# shardscope mesh axis -> MaxText's (its `ici_<name>_parallelism`, `dcn_<name>_parallelism`);
# MaxText's context axis is context parallelism (attention over the split positions).
MAXTEXT_AXES = {"pipeline": "pipeline", "data": "data", "fsdp": "fsdp", "expert": "expert",
                "sequence": "context", "tensor": "tensor"}
# shardscope preset -> MaxText model_name (MaxText/configs/models/<name>.yml)
MAXTEXT_MODELS = {"llama2-7b": "llama2-7b", "llama2-13b": "llama2-13b",
                  "llama2-70b": "llama2-70b", "llama3-8b": "llama3-8b",
                  "llama3-70b": "llama3-70b", "llama3-405b": "llama3-405b",
                  "mixtral-8x7b": "mixtral-8x7b", "mixtral-8x22b": "mixtral-8x22b",
                  "gpt3-175b": "gpt3-175b", "deepseek-v3": "deepseek3-671b",
                  "qwen3-235b-a22b": "qwen3-235b-a22b", "gpt-oss-120b": "gpt-oss-120b"}
# MaxText's model keys -> shardscope's [model] fields; the first seven, the shape, are
# written for every model that is not a MaxText model_name
MAXTEXT_MODEL_KEYS = {
    "base_emb_dim": "d_model", "base_num_query_heads": "n_heads",
    "base_num_kv_heads": "n_kv_heads", "base_mlp_dim": "d_ff",
    "base_num_decoder_layers": "n_layers", "head_dim": "head_dim", "vocab_size": "vocab",
    "num_experts": "n_experts", "num_experts_per_tok": "experts_per_token",
    "shared_experts": "n_shared_experts", "rope_max_timescale": "rope_theta",
    "trainable_position_size": "max_seq_len"}
MAXTEXT_SHAPE_KEYS = tuple(MAXTEXT_MODEL_KEYS)[:7]
MAXTEXT_ACTIVATIONS = {"swiglu": ["silu", "linear"], "gelu": ["gelu"], "relu": ["relu"]}
# shardscope's remat policies that MaxText names alike (custom: its per-tensor keys)
MAXTEXT_REMAT = {"full": "full", "minimal": "minimal"}
SYSTEM_LINE = "# shardscope system: "
# what the Megatron flags cannot say, as `--set` takes it (`import megatron` applies it)
SET_LINE = "# shardscope set: "
MAXTEXT_FUSED = ("fused_qkv", "fused_mlp")  # the same names in MaxText and [model]


def style(exp: Experiment) -> str:
    """How the config is written to run, for fit's ranking: "megatron" for a training run
    on a GPU system with the default rules and no FSDP axis that splits the model (tensor,
    pipeline or context > 1) or sets one of Megatron's own settings (sequence_parallel,
    tp_comm_overlap, the distributed optimizer, overlap_grad_reduce, overlap_param_gather,
    bucket_size); "jax" otherwise (data parallelism alone, MaxText's FSDP or rules, a TPU
    slice, serving).

    Megatron-LM's and NeMo's usual recipes shard the data-parallel replicas only with the
    distributed optimizer (ZeRO-1) and split the model with tensor, pipeline and context
    parallelism. fused_qkv is no sign (MaxText has the same key; `import megatron` writes it
    always), nor is an import's `# Imported from` line (a comment the config does not keep):
    Megatron flags with data parallelism alone and no distributed optimizer read as "jax"."""
    from meshes.gpu import GpuSystem

    par, t = exp.parallelism, exp.train
    if not (isinstance(exp.system, GpuSystem) and exp.workload.kind == "train"
            and par.fsdp == 1 and par.rules == "default"):
        return "jax"
    split = max(par.tensor, par.pipeline, par.sequence) > 1
    own = (par.sequence_parallel or par.tp_comm_overlap or t.shard_optimizer_over_data
           or t.overlap_grad_reduce or t.overlap_param_gather or t.bucket_size > 0)
    return "megatron" if split or own else "jax"


def granules(exp_system) -> tuple[int, str]:
    """How many ICI domains MaxText's DCN axes join, and what they are: a TPU system's
    slices; a GPU system's nodes (its NVLink domains)."""
    slices = getattr(exp_system, "num_slices", None)
    if slices is not None:
        return slices, "slice"
    domain = getattr(exp_system, "domain_size", exp_system.num_devices)
    if exp_system.num_devices <= domain:
        return 1, "node"
    if exp_system.num_devices % domain:
        raise ConfigError(f"system.name={exp_system.name!r}: {exp_system.num_devices} GPUs are "
                          f"not whole NVLink domains of {domain}, so MaxText's dcn_* (across "
                          f"nodes) cannot be split; use a multiple of {domain} GPUs")
    return exp_system.num_devices // domain, "node"


def placement_order(outer: str) -> list[str]:
    """The mesh axes from outermost (farthest apart) in, as sharding/mesh.py places them."""
    if not outer:
        return list(MESH_AXES)
    return [outer, *(a for a in MESH_AXES if a != outer)]


def ici_dcn(sizes: dict[str, int], outer: str, n_granules: int, what: str = "slice"
            ) -> dict[str, tuple[int, int]]:
    """Each mesh axis as (ICI, DCN) ways: the outermost axes cross the `n_granules` slices
    (nodes), the major part of an axis first, as sharding.mesh.placement lays devices."""
    left, out = n_granules, {}
    for a in placement_order(outer):
        size = sizes[a]
        if left == 1 or size == 1:
            out[a] = (size, 1)
        elif size % left == 0:
            out[a], left = (size // left, left), 1
        elif left % size == 0:
            out[a], left = (1, size), left // size
        else:
            raise ConfigError(f"parallelism.{a}={size} straddles the {n_granules} {what}s "
                              f"unevenly: MaxText's dcn_{MAXTEXT_AXES[a]}_parallelism must be "
                              f"whole {what}s; make the outer axes' sizes multiples or "
                              f"divisors of {n_granules}")
    return out


def system_line(exp: Experiment) -> str:
    """The `# shardscope system:` comment: the system and its [system] overrides, which an
    import reads back."""
    return f"{SYSTEM_LINE}{exp.system.name}" + "".join(
        f" {k}={toml_value(v)}" for k, v in sorted(exp.system.overrides.items()))


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _chunk(exp: Experiment) -> int:
    """Consecutive layers in each pipeline stage's chunk (shardscope rounds up)."""
    par = exp.parallelism
    return -(-exp.model.n_layers // (par.pipeline * par.virtual_stages))


def _padding(exp: Experiment) -> tuple[int, int]:
    """Empty layer slots before the first layer and after the last (models/pipeline.py)."""
    par = exp.parallelism
    return Pipeline(stages=par.pipeline, microbatches=exp.workload.microbatches,
                    layers=exp.model.n_layers, virtual=par.virtual_stages,
                    schedule=par.pipeline_schedule).padding


def _uneven(exp: Experiment, how: str) -> list[str]:
    front, back = _padding(exp)
    if not front + back:
        return []
    slots = exp.model.n_layers + front + back
    return [f"# {exp.model.n_layers} layers in {slots} pipeline slots (shardscope leaves "
            f"{front} empty before the first layer and {back} after the last): {how}"]


def check(exp: Experiment, to: str, flag: str = "export --to") -> None:
    """What `export` refuses whatever the sharding: a framework it does not know, a config
    that is not a training run (`search --export` asks before it compiles anything)."""
    if to not in FRAMEWORKS:
        raise ConfigError(f"{flag} {to!r} is not a framework shardscope exports to; choose "
                          f"one of {', '.join(FRAMEWORKS)}")
    if exp.workload.kind != "train":
        raise ConfigError(f"{flag} {to} writes a training run's settings; workload.kind="
                          f"{exp.workload.kind!r}: use a config with kind = \"train\"")


def export(exp: Experiment, to: str) -> str:
    """The framework's own settings for the config, one per line (comments: `# ...`)."""
    check(exp, to)
    lines = maxtext(exp) if to == "maxtext" else megatron(exp)
    return "\n".join(lines) + "\n"


# ---- MaxText ------------------------------------------------------------------------------

def maxtext(exp: Experiment) -> list[str]:
    """YAML `key: value` lines, as overrides of MaxText's base.yml for its train.py."""
    par, w, n = exp.parallelism, exp.workload, exp.system.num_devices
    count, what = granules(exp.system)
    where = (f"{count} {what}s of {n // count} joined by dcn_*" if count > 1
             else f"one {what}: dcn_* all 1")
    lines = [f"# MaxText settings of {exp.name} (shardscope export; {n} devices, {where})",
             system_line(exp)]
    if count > 1 and what == "slice":
        lines.append(f"# MaxText counts the {count} slices from the devices (train_compile.py: "
                     f"compile_topology_num_slices={count})")
    lines += _maxtext_model(exp)
    split = ici_dcn(par.sizes(), par.outer, count, what)
    for level, i in (("ici", 0), ("dcn", 1)):
        for a in MESH_AXES:
            lines.append(f"{level}_{MAXTEXT_AXES[a]}_parallelism: {split[a][i]}")
    if par.sequence > 1:
        strategy = "all_gather" if par.context_mode == "allgather" else "ring"
        lines.append(f"context_parallel_strategy: {strategy}")
    pipelined = par.pipeline > 1
    per_device = w.global_batch / n if pipelined else w.micro_batch / n
    lines += [f"per_device_batch_size: {_number(per_device)}",
              f"max_target_length: {w.seq_len}",
              f"gradient_accumulation_steps: {1 if pipelined else w.microbatches}"]
    if pipelined:
        lines += [f"num_pipeline_microbatches: {w.microbatches}",
                  f"num_layers_per_pipeline_stage: {_chunk(exp)}",
                  *_uneven(exp, "MaxText needs num_layers = stages x this x repeats"),
                  f"# parallelism.pipeline_schedule={par.pipeline_schedule!r}: MaxText runs "
                  f"its own circular pipeline schedule (no key chooses 1F1B or GPipe)"]
    lines += _maxtext_remat(exp)
    lines += _maxtext_precision(exp)
    t = exp.train
    lines += [f"shard_optimizer_over_data: {str(t.shard_optimizer_over_data).lower()}",
              f"num_vocab_tiling: {t.num_vocab_tiling}",
              f"opt_type: {t.optimizer}",
              f"learning_rate: {t.learning_rate}",
              f"adam_weight_decay: {t.weight_decay}"]
    if t.offload_layers:
        lines.append(f"# train.offload_layers={t.offload_layers} (the first layers' "
                     f"activations on the host): no MaxText key; remat_policy applies to "
                     f"every layer")
    if par.tensor > 1 and par.rules != "maxtext":
        lines.append(f"# parallelism.rules={par.rules!r} keeps the residual stream whole "
                     f"over tensor; MaxText splits it (activation_embed over tensor: "
                     f"rules = \"maxtext\" in shardscope)")
    whole = [a for a in ("sequence", "expert") if getattr(par, a) > 1]
    if whole and par.rules != "maxtext":
        lines.append(f"# parallelism.rules={par.rules!r} does not split the weights' width "
                     f"over {' and '.join(whole)}; MaxText does (its embed rule: fsdp, "
                     f"context, expert; rules = \"maxtext\" in shardscope)")
    if par.sequence_parallel:
        lines.append("# parallelism.sequence_parallel (Megatron's): MaxText's "
                     "activation_embed over tensor splits the residual stream instead")
    if par.tp_comm_overlap:
        lines.append("# parallelism.tp_comm_overlap (Transformer Engine's userbuffers): no "
                     "MaxText key")
    if par.pipeline > 1 and par.virtual_stages > 1 and par.overlap_p2p_comm:
        lines.append("# parallelism.overlap_p2p_comm (Megatron's): no MaxText key; its "
                     "pipeline waits for each stage transfer (pipeline_delay_activation_"
                     "forwarding delays it a tick instead)")
    if t.overlap_grad_reduce or t.overlap_param_gather or t.bucket_size:
        lines.append("# train.overlap_grad_reduce / overlap_param_gather / bucket_size "
                     "(Megatron's DDP): no MaxText key; XLA schedules the data-parallel "
                     "collectives itself")
    return lines


def _maxtext_model(exp: Experiment) -> list[str]:
    m = exp.model
    # MaxText's names of the fused projections (its defaults: separate weights)
    fused = [f"{k}: true" for k in MAXTEXT_FUSED if getattr(m, k)]
    unfused = dataclasses.replace(m, **dict.fromkeys(MAXTEXT_FUSED, False))
    # routing is not the model file's (MaxText's default capacity_factor, -1, is dropless):
    # written whenever the model has experts
    routing = [f"capacity_factor: {-1 if m.dropless else _number(m.capacity_factor)}"] \
        if m.n_experts > 1 else []
    if m.name in MAXTEXT_MODELS and unfused == dataclasses.replace(
            PRESETS[m.name](), capacity_factor=m.capacity_factor, dropless=m.dropless):
        return [f"model_name: {MAXTEXT_MODELS[m.name]}", *fused, *routing]
    # (base_mlp_dim: the dense layers' MLP; a MoE model's experts' is d_ff, below)
    lines = [f"{key}: {m.dense_layers_d_ff if key == 'base_mlp_dim' else getattr(m, field)}"
             for key, field in MAXTEXT_MODEL_KEYS.items() if key in MAXTEXT_SHAPE_KEYS]
    lines += ["mlp_activations: [" + ", ".join(f'"{a}"' for a in MAXTEXT_ACTIVATIONS[m.mlp])
             + "]",
             f"logits_via_embedding: {str(m.tie_embeddings).lower()}"]
    if m.norm == "rmsnorm" and m.positions == "rope":
        # MaxText's block with the layer's MLP and attention: llama2's are dense
        block = "deepseek" if m.mla else "mixtral" if m.n_experts > 1 else "llama2"
        lines += [f"decoder_block: {block}", f"rope_max_timescale: {_number(m.rope_theta)}"]
    elif m.norm == "layernorm" and m.positions == "learned":
        lines += ["decoder_block: gpt3", f"trainable_position_size: {m.max_seq_len}"]
    else:
        lines.append(f"# model.norm={m.norm!r} with model.positions={m.positions!r}: no "
                     f"MaxText decoder_block has both")
    if m.n_experts > 1:
        lines += [f"num_experts: {m.n_experts}", f"num_experts_per_tok: {m.experts_per_token}",
                  *routing]
        if m.n_shared_experts:
            lines.append(f"shared_experts: {m.n_shared_experts}")
        if m.n_dense_layers:
            lines += [f"first_num_dense_layers: {m.n_dense_layers}",
                      f"base_moe_mlp_dim: {m.d_ff}"]
        lines.append(f"# model.moe_group_size={m.moe_group_size}: shardscope's routing "
                     f"groups, no MaxText key")
    if m.mla:
        lines += ["attention_type: mla", f"q_lora_rank: {m.q_lora_rank}",
                  f"kv_lora_rank: {m.kv_lora_rank}", f"qk_nope_head_dim: {m.head_dim}",
                  f"qk_rope_head_dim: {m.qk_rope_dim}", f"v_head_dim: {m.value_head_dim}"]
    if m.attention == "dense":
        lines.append("attention: dot_product")
    lines += fused
    if m.vocab_multiple != 128:
        lines.append(f"# model.vocab_multiple={m.vocab_multiple}: no MaxText key")
    return lines


def _maxtext_remat(exp: Experiment) -> list[str]:
    t = exp.train
    if t.remat in MAXTEXT_REMAT:
        return [f"remat_policy: {MAXTEXT_REMAT[t.remat]}"]

    def names(given) -> tuple[str, ...]:
        # MaxText's fused projection is checkpointed whole, as qkv_proj
        out = expand_names(given)
        if exp.model.fused_qkv:
            out = tuple(dict.fromkeys("qkv_proj" if n in ("query_proj", "key_proj",
                                                           "value_proj") else n for n in out))
        return out

    if t.remat == "none":
        return ["# train.remat='none' (everything saved): MaxText always rematerialises "
                "within a layer; the nearest is custom with every tensor kept on device",
                "remat_policy: custom",
                *(f"{name}: device" for name in names(CHECKPOINT_NAMES))]
    where = {**dict.fromkeys(names(t.save), "device"),
             **dict.fromkeys(names(t.offload), "offload")}
    return ["remat_policy: custom", *(f"{name}: {where[name]}" for name in where)]


def _maxtext_precision(exp: Experiment) -> list[str]:
    p = exp.precision
    lines = [f"weight_dtype: {p.params}", f"dtype: {p.activations}"]
    if p.compute == "float8":
        lines.append("quantization: fp8")
    elif p.compute == "float4":
        lines.append("# precision.compute='float4' (block-scaled FP4 matmuls): no MaxText "
                     "quantization mode; dtype bfloat16 above")
    if p.master_weights:
        lines.append(f"# precision.master_weights={p.master_weights!r} (an fp32 copy of the "
                     f"bfloat16 weights in the optimizer): no MaxText key of its own")
    if p.gradient_dtype != "float32":
        lines.append(f"# precision.grad_reduce={p.grad_reduce!r}: MaxText reduces gradients "
                     f"in weight_dtype; no key of its own")
    return lines


# ---- Megatron-LM --------------------------------------------------------------------------

def megatron(exp: Experiment) -> list[str]:
    """pretrain_gpt.py's flags, one per line."""
    par, w, m = exp.parallelism, exp.workload, exp.model
    n = exp.system.num_devices
    dp = n // (par.tensor * par.pipeline * par.sequence)
    lines = [f"# Megatron-LM flags of {exp.name} (shardscope export; {n} devices: data-parallel "
             f"size {dp} = {n} / (tensor {par.tensor} x pipeline {par.pipeline} x context "
             f"{par.sequence}), implied)",
             *([f"# system.name={exp.system.name!r} is not a GPU system: Megatron-LM runs "
                f"on GPUs; these flags are the same split on as many"]
               if not hasattr(exp.system, "domain_size") else []),
             system_line(exp), *_megatron_launch(exp),
             f"--tensor-model-parallel-size {par.tensor}",
             f"--pipeline-model-parallel-size {par.pipeline}"]
    if par.virtual_stages > 1:
        lines.append(f"--num-layers-per-virtual-pipeline-stage {_chunk(exp)}")
        if not par.overlap_p2p_comm:
            lines.append("--no-overlap-p2p-communication")
    if par.pipeline > 1:
        lines += _uneven(exp, _megatron_uneven(exp)) + _megatron_uneven_flags(exp)
    if par.pipeline > 1 and par.pipeline_schedule != "1f1b":
        lines.append(f"# parallelism.pipeline_schedule={par.pipeline_schedule!r}: Megatron "
                     f"runs 1F1B (no GPipe schedule)")
    if par.sequence > 1:
        comm = "all_gather" if par.context_mode == "allgather" else "p2p"
        lines += [f"--context-parallel-size {par.sequence}", f"--cp-comm-type {comm}"]
    if par.expert > 1:
        lines.append(f"--expert-model-parallel-size {par.expert}")
    if par.sequence_parallel:
        lines.append("--sequence-parallel")
    if par.tp_comm_overlap:
        lines.append("--tp-comm-overlap")
    if exp.train.shard_optimizer_over_data or par.fsdp > 1:
        lines.append("--use-distributed-optimizer")
    if exp.train.overlap_grad_reduce:
        lines.append("--overlap-grad-reduce")
    if exp.train.overlap_param_gather:
        lines.append("--overlap-param-gather")
    if exp.train.bucket_size:
        lines.append(f"--ddp-bucket-size {exp.train.bucket_size}")
    if par.fsdp > 1:
        lines.append(f"# parallelism.fsdp={par.fsdp}: FSDP has no Megatron equivalent beyond "
                     f"the distributed optimizer (its ranks count in the data-parallel size; "
                     f"parameters and gradients stay whole on each)")
    if par.rules != "default":
        lines.append(f"# parallelism.rules={par.rules!r}: Megatron shards by its own layers "
                     f"(--sequence-parallel is its residual-stream split)")
    micro = w.micro_batch / dp
    lines += [f"--micro-batch-size {_number(micro)}", f"--global-batch-size {w.global_batch}",
              f"--seq-length {w.seq_len}", f"--max-position-embeddings "
              f"{max(w.seq_len, m.max_seq_len) if m.positions == 'learned' else w.seq_len}"]
    if not float(micro).is_integer():
        lines.append(f"# the micro-batch of {w.micro_batch} sequences does not split over "
                     f"the {dp} data-parallel ranks: Megatron needs a whole number each")
    lines += _megatron_remat(exp) + _megatron_precision(exp) + _megatron_model(exp)
    if exp.train.num_vocab_tiling > 1:
        lines.append(f"# train.num_vocab_tiling={exp.train.num_vocab_tiling}: no Megatron "
                     f"flag (its fused cross-entropy keeps the whole logits)")
    lines += [f"--lr {exp.train.learning_rate}", f"--weight-decay {exp.train.weight_decay}",
              "--optimizer adam"]
    return lines + _megatron_set_lines(exp)


def _megatron_set_lines(exp: Experiment) -> list[str]:
    """`# shardscope set: table.key=value` lines, which `import megatron` applies, for what
    the flags above cannot say: each where the config differs from what they mean."""
    par, t, p, m = exp.parallelism, exp.train, exp.precision, exp.model
    bf16 = p.activations == "bfloat16"
    default = {f.name: f.default for f in dataclasses.fields(m)}
    # (key, the config's value, what Megatron's flags mean), FSDP first: it takes its ranks
    # from the data-parallel ones the flags give
    kept = [("parallelism.fsdp", par.fsdp, 1),
            # --use-distributed-optimizer is written for FSDP too
            ("train.shard_optimizer_over_data", t.shard_optimizer_over_data,
             t.shard_optimizer_over_data or par.fsdp > 1),
            ("parallelism.rules", par.rules, "default"),
            ("parallelism.pipeline_schedule", par.pipeline_schedule, "1f1b"),
            ("parallelism.outer", par.outer, ""),
            # --bf16: bf16 weights with an fp32 copy; without it fp32 weights
            ("precision.params", p.params, "bfloat16" if bf16 else "float32"),
            ("precision.master_weights", p.master_weights, "float32" if bf16 else ""),
            ("train.offload_layers", t.offload_layers, 0),
            ("train.num_vocab_tiling", t.num_vocab_tiling, 1),
            # Megatron fuses q, k, v (linear_qkv) and SwiGLU's gate and up (linear_fc1)
            ("model.fused_qkv", m.fused_qkv, True),
            ("model.fused_mlp", m.fused_mlp, m.mlp == "swiglu"),
            ("model.mlp", m.mlp, "gelu" if m.mlp == "relu" else m.mlp),
            ("model.attention", m.attention, "flash" if m.attention == "tiled" else m.attention),
            # what the model's other settings leave unused: the import keeps the defaults
            ("model.max_seq_len", m.max_seq_len,
             default["max_seq_len"] if m.positions == "rope" else m.max_seq_len),
            ("model.rope_theta", m.rope_theta,
             default["rope_theta"] if m.positions == "learned" else m.rope_theta),
            ("model.moe_group_size", m.moe_group_size, default["moe_group_size"]),
            ("model.capacity_factor", m.capacity_factor,
             default["capacity_factor"] if m.dropless or m.n_experts == 1
             else m.capacity_factor)]
    if m.n_experts == 1:
        kept += [(f"model.{k}", getattr(m, k), default[k])
                 for k in ("experts_per_token", "dropless")]
    if t.remat == "custom":  # no Megatron flag names tensors
        kept += [("train.remat", "custom", ""), ("train.save", list(t.save), []),
                 ("train.offload", list(t.offload), [])]
    lines = [f"{SET_LINE}{key}={toml_value(value)}" for key, value, means in kept
             if value != means]
    return ["# no Megatron flag says these; `shardscope import megatron` reads them back:",
            *lines] if lines else []


def _megatron_uneven(exp: Experiment) -> str:
    """Megatron's flags for shardscope's uneven stages, said in the comment above them."""
    flags = _megatron_uneven_flags(exp)
    if flags:
        return f"Megatron: {' '.join(flags)}"
    par = exp.parallelism
    refused = Pipeline(stages=par.pipeline, microbatches=max(exp.workload.microbatches,
                                                             par.pipeline),
                       layers=exp.model.n_layers, virtual=par.virtual_stages).megatron_refuses()
    if refused:
        return refused
    return ("Megatron's --decoder-first-pipeline-num-layers and "
            "--decoder-last-pipeline-num-layers split them otherwise")


def _megatron_uneven_flags(exp: Experiment) -> list[str]:
    """Megatron's flags for shardscope's uneven stages, where they can say it: the first and
    last stage's layers (no virtual stages), or the embedding and the loss counted as a
    layer each (the padding one slot at each end, or one before the first layer)."""
    (front, back), chunk = _padding(exp), _chunk(exp)
    if not front + back:
        return []
    if exp.parallelism.virtual_stages == 1 and max(front, back) < chunk:
        return [f"--decoder-first-pipeline-num-layers {chunk - front}",
                f"--decoder-last-pipeline-num-layers {chunk - back}"]
    if (front, back) in ((1, 1), (1, 0)):
        return ["--account-for-embedding-in-pipeline-split",
                *(["--account-for-loss-in-pipeline-split"] if back else [])]
    return []


def _megatron_launch(exp: Experiment) -> list[str]:
    """The [system] overrides that are the launch's settings, not Megatron flags: NCCL's
    environment and where the job's ranks sit."""
    o, env = exp.system.overrides, []
    if "nvls" in o:  # NVLink SHARP in NCCL's all-reduces
        env.append(f"NCCL_NVLS_ENABLE={int(o['nvls'])}")
    if "sharp" in o:  # IB SHARP: NCCL's CollNet (the SHARP plugin)
        env.append(f"NCCL_COLLNET_ENABLE={int(o['sharp'])}")
    out = [f"# launch with {' '.join(env)} (NCCL's environment, no Megatron flag)"] \
        if env else []
    if "gpus_per_domain" in o:
        out.append(f"# system.gpus_per_domain={o['gpus_per_domain']}: the job's ranks on "
                   f"{o['gpus_per_domain']} GPUs of each NVLink domain (the launcher's "
                   f"placement, no Megatron flag)")
    return out


def _megatron_remat(exp: Experiment) -> list[str]:
    t = exp.train
    lines = {"none": [],
             "full": ["--recompute-granularity full", "--recompute-method uniform",
                      "--recompute-num-layers 1"],
             "minimal": ["--recompute-granularity selective",
                         "# train.remat='minimal' keeps the matmul outputs; Megatron's "
                         "selective recomputes the attention core"],
             "custom": [f"# train.remat='custom' (save {', '.join(t.save) or '-'}; offload "
                        f"{', '.join(t.offload) or '-'}): no Megatron flag names tensors"]}
    out = lines[t.remat]
    if t.offload_layers:
        out.append(f"# train.offload_layers={t.offload_layers}: Megatron-core's "
                   f"TransformerConfig.cpu_offloading_num_layers (no pretrain_gpt.py flag)")
    return out


def _megatron_precision(exp: Experiment) -> list[str]:
    p, out = exp.precision, []
    if p.activations == "bfloat16":
        out.append("--bf16")
        if p.params == "float32":
            out.append("# precision.params='float32': Megatron --bf16 keeps bf16 weights and "
                       "their fp32 copy in the optimizer (shardscope: params bfloat16, "
                       "master_weights float32)")
        elif not p.master_weights:
            out.append("# precision.master_weights='': Megatron --bf16 always keeps an fp32 "
                       "copy in the optimizer")
    if p.compute == "float8":
        out.append("--fp8-format hybrid")
    elif p.compute == "float4":
        out += ["--fp4-format e2m1", "# precision.compute='float4': Megatron-core's NVFP4 "
                "recipe (recent versions)"]
    if p.gradient_dtype == "bfloat16":
        out.append("--grad-reduce-in-bf16")
    return out


def _megatron_model(exp: Experiment) -> list[str]:
    m = exp.model
    out = [f"--num-layers {m.n_layers}", f"--hidden-size {m.d_model}",
           f"--ffn-hidden-size {m.dense_layers_d_ff}", f"--num-attention-heads {m.n_heads}",
           f"--kv-channels {m.head_dim}"]
    if m.n_kv_heads != m.n_heads:
        out += ["--group-query-attention", f"--num-query-groups {m.n_kv_heads}"]
    out += [f"--vocab-size {m.vocab}", f"--make-vocab-size-divisible-by {m.vocab_multiple}",
            "--disable-bias-linear"]
    out += {"swiglu": ["--swiglu"], "gelu": [],
            "relu": ["# model.mlp='relu': Megatron's MLP is GeLU unless --swiglu "
                     "(--squared-relu is another function)"]}[m.mlp]
    out.append("--normalization " + ("RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"))
    if m.positions == "rope":
        out += ["--position-embedding-type rope", f"--rotary-base {_number(m.rope_theta)}"]
    else:
        out.append("--position-embedding-type learned_absolute")
    if not m.tie_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    if m.n_experts > 1:
        # the all-to-all dispatcher (expert parallelism's; Megatron's TransformerConfig
        # refuses a capacity factor with any other)
        out += [f"--num-experts {m.n_experts}", f"--moe-router-topk {m.experts_per_token}",
                "--moe-token-dispatcher-type alltoall"]
        if not m.dropless:  # every expert's slots computed, full or not, as shardscope's
            out += [f"--moe-expert-capacity-factor {_number(m.capacity_factor)}",
                    "--moe-pad-expert-input-to-capacity"]
        if m.n_shared_experts:
            out.append(f"--moe-shared-expert-intermediate-size "
                       f"{m.n_shared_experts * m.d_ff}")
        if m.n_dense_layers:  # --ffn-hidden-size is then the dense layers'
            out += [f"--moe-layer-freq '([0]*{m.n_dense_layers}+[1]*{m.moe_layers})'",
                    f"--moe-ffn-hidden-size {m.d_ff}"]
        out.append(f"# model.moe_group_size={m.moe_group_size}: Megatron routes each "
                   f"micro-batch's tokens together (no group size)")
    if m.mla:
        out += ["--multi-latent-attention",
                *([f"--q-lora-rank {m.q_lora_rank}"] if m.q_lora_rank else []),
                f"--kv-lora-rank {m.kv_lora_rank}", f"--qk-head-dim {m.head_dim}",
                f"--qk-pos-emb-head-dim {m.qk_rope_dim}", f"--v-head-dim {m.value_head_dim}"]
    if m.attention == "dense":
        out.append("--attention-backend unfused")
    if not m.fused_qkv or (m.mlp == "swiglu" and not m.fused_mlp):
        out.append("# model.fused_qkv / fused_mlp = false: Megatron always fuses QKV "
                   "(linear_qkv) and gate/up (linear_fc1)")
    return out
