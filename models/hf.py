"""A model from its Hugging Face `config.json` (`[model] hf_config = "config.json"`).

Pure Python, no `transformers`: each supported `model_type` names which of its fields become
which `ModelConfig` field. Every other field is one of three kinds, and a field of none of
them is refused by name (shardscope cannot tell whether it changes the model):
- cosmetic (token ids, dtypes, initialisation, dropout, loss coefficients): ignored;
- approximated (a sliding window, qk-norm, biases, DeepSeek's routing function, RoPE
  scaling): the model runs without it, and the run's report says so in a note;
- not representable (a gated GELU MLP, MoE layers interleaved with dense ones, an unknown
  RoPE scaling): refused with the field, its value and what shardscope can model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from models.config import MTP_NOTE, QK_NORM_NOTE, sliding_window_note

# Fields that change neither the shapes nor the step's work.
COSMETIC = frozenset({
    "_name_or_path", "architectures", "auto_map", "torch_dtype", "dtype",
    "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "use_cache", "rms_norm_eps", "attention_dropout", "hidden_dropout",
    "pretraining_tp", "max_position_embeddings", "output_router_logits",
    "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "ep_size", "router_jitter_noise",
    "initial_context_length", "max_window_layers", "tokenizer_class", "model_type",
    "use_sliding_window",
})
# hf field -> ModelConfig field, for every supported model_type.
COMMON = {"num_hidden_layers": "n_layers", "hidden_size": "d_model",
          "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
          "head_dim": "head_dim", "intermediate_size": "d_ff", "vocab_size": "vocab",
          "rope_theta": "rope_theta", "tie_word_embeddings": "tie_embeddings"}
MOE = {
    "mixtral": {"num_local_experts": "n_experts", "num_experts_per_tok": "experts_per_token"},
    "gpt_oss": {"num_local_experts": "n_experts", "num_experts_per_tok": "experts_per_token"},
    "qwen3_moe": {"num_experts": "n_experts", "num_experts_per_tok": "experts_per_token",
                  "moe_intermediate_size": "d_ff"},
    "deepseek_v3": {"n_routed_experts": "n_experts", "num_experts_per_tok": "experts_per_token",
                    "moe_intermediate_size": "d_ff", "n_shared_experts": "n_shared_experts",
                    "first_k_dense_replace": "n_dense_layers", "kv_lora_rank": "kv_lora_rank",
                    "q_lora_rank": "q_lora_rank", "qk_nope_head_dim": "head_dim",
                    "qk_rope_head_dim": "qk_rope_dim", "v_head_dim": "v_head_dim"},
}
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3",
               "gpt_oss")
ROPE_SCALINGS = ("default", "linear", "dynamic", "llama3", "yarn")
_DEEPSEEK_ROUTING = ("scoring_func", "topk_method", "n_group", "topk_group",
                     "routed_scaling_factor", "norm_topk_prob")


def relative_to(model_table, folder: Path) -> None:
    """A [model] table's hf_config made a path from `folder` (the TOML file's) in place."""
    if isinstance(model_table, dict) and isinstance(model_table.get("hf_config"), str):
        model_table["hf_config"] = str(folder / model_table["hf_config"])


def load(path: str | Path, *, preset: str | None = None) -> tuple[dict, tuple[str, ...]]:
    """(ModelConfig fields, notes on what is approximated) of a config.json file; the
    model is named after the file. `preset`: the [model] table's, which must be None."""
    if preset is not None:
        raise ValueError(f"model.preset={preset!r} and model.hf_config={str(path)!r} are both "
                         f"given; keep one of them")
    if not isinstance(path, str | Path):
        raise ValueError(f"model.hf_config={path!r} must be a string: the path of a "
                         f"config.json")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"model.hf_config={str(path)!r} not found; give the path of a Hugging "
                         f"Face config.json: in the TOML file relative to its folder, with "
                         f"--set relative to the working directory")
    try:
        config = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model.hf_config={str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"model.hf_config={str(path)!r} must hold a JSON object")
    fields, notes = translate(config, where=f"model.hf_config={p.name!r}")
    return {"name": p.stem, **fields}, notes


def translate(config: Mapping, *, where: str = "hf_config") -> tuple[dict, tuple[str, ...]]:
    """(ModelConfig fields, notes) of a Hugging Face config's dict; a ValueError naming
    the field for what the model cannot represent."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type={kind!r} is not supported; supported: "
                         f"{', '.join(MODEL_TYPES)} (or give the [model] dimensions "
                         f"explicitly)")
    t = _Translation(config, kind, where)
    t.common()
    t.moe()
    t.attention()
    t.approximations()
    t.check_all_read()
    return t.fields, tuple(t.notes)


class _Translation:
    """One config being read: the fields found, the notes, the keys consumed."""

    def __init__(self, config: Mapping, kind: str, where: str):
        self.config, self.kind, self.where = config, kind, where
        self.fields: dict = {}
        self.notes: list[str] = []
        self.read = set(COSMETIC)

    def get(self, key: str, default=None):
        self.read.add(key)
        value = self.config.get(key)
        return default if value is None else value

    def table(self, key: str) -> Mapping | None:
        """A field that holds a JSON object (rope_scaling, quantization_config), or None."""
        value = self.get(key)
        if value is not None and not isinstance(value, Mapping):
            self.refuse(key, "must be a JSON object ({...}) or null; fix the config.json")
        return value

    def refuse(self, key: str, why: str):
        raise ValueError(f"{self.where}: {key}={self.config.get(key)!r} {why}")

    def common(self) -> None:
        for key, field in (*COMMON.items(), *MOE.get(self.kind, {}).items()):
            value = self.get(key)
            if value is not None:
                flag = field == "tie_embeddings"
                if (not isinstance(value, bool) if flag else
                        isinstance(value, bool) or not isinstance(value, int | float)):
                    self.refuse(key, "must be " + ("true or false" if flag else
                                                   "a number (e.g. 4096, not a string)")
                                + "; fix the config.json")
                self.fields[field] = value
        f = self.fields
        # the MLP's width: intermediate_size, or the experts' own where the kind has one
        width = next((k for k, v in MOE.get(self.kind, {}).items() if v == "d_ff"),
                     "intermediate_size")
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                               "vocab_size", width) if self.config.get(k) is None]
        if missing:
            raise ValueError(f"{self.where}: missing {', '.join(missing)} (a {self.kind} "
                             f"config.json has them)")
        f.setdefault("n_kv_heads", f["n_heads"])
        f.setdefault("head_dim", f["d_model"] // f["n_heads"])
        f.setdefault("tie_embeddings", False)
        f["rope_theta"] = float(f.get("rope_theta", 10_000.0))
        act = self.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            self.refuse("hidden_act", f"gates the MLP with {act}, which shardscope does not "
                        f"model; its MLPs are swiglu (silu-gated), gelu and relu (ungated)")
        self.rope_scaling()

    def rope_scaling(self) -> None:
        params = self.table("rope_parameters")  # newer transformers: theta and scaling in one
        if params:
            self.fields["rope_theta"] = float(params.get("rope_theta", self.fields["rope_theta"]))
        for key, scaling in (("rope_scaling", self.table("rope_scaling")),
                             ("rope_parameters", params)):
            if not scaling:
                continue
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ROPE_SCALINGS:
                self.refuse(key, f"has rope type {kind!r}, which shardscope does not know; "
                            f"known: {', '.join(ROPE_SCALINGS)} (remove it to model plain "
                            f"RoPE)")
            if kind != "default":
                self.notes.append(f"{key} {kind!r} rescales RoPE's frequencies"
                                  + (" and the attention's softmax scale" if kind == "yarn"
                                     else "")
                                  + ": modelled as plain RoPE (the same FLOPs and bytes)")

    def moe(self) -> None:
        f = self.fields
        if self.kind == "gpt_oss":
            top_k = self.get("experts_per_token")
            if top_k is not None and top_k != f.get("experts_per_token", top_k):
                self.refuse("experts_per_token", f"disagrees with num_experts_per_tok="
                            f"{f['experts_per_token']}")
            f.setdefault("experts_per_token", top_k or 1)
        if self.kind == "qwen3_moe":
            self._qwen3_moe_layers()
        if self.kind == "deepseek_v3":
            if self.get("moe_layer_freq", 1) != 1:
                self.refuse("moe_layer_freq", "(MoE every few layers) is not modelled: after "
                            "its first_k_dense_replace dense layers every layer is MoE")
            if f.get("n_dense_layers"):  # intermediate_size is theirs, the experts' is d_ff
                f["dense_d_ff"] = self.config["intermediate_size"]
            routing = {k: self.get(k) for k in _DEEPSEEK_ROUTING if k in self.config}
            if routing:
                self.notes.append(
                    "DeepSeek's routing (" + ", ".join(f"{k}={v}" for k, v in routing.items())
                    + ") is modelled as softmax top-k over every expert (models/moe.py): the "
                    "same experts per token, dispatch and combine bytes")
            mtp = self.get("num_nextn_predict_layers", 0)
            if mtp:
                self.notes.append(f"num_nextn_predict_layers={mtp}: {MTP_NOTE}")
        if self.kind in ("mixtral", "qwen3_moe") and not self.get("norm_topk_prob", True):
            self.notes.append("norm_topk_prob=false: the chosen experts' weights are "
                              "renormalised here (the same work)")

    def _qwen3_moe_layers(self) -> None:
        f = self.fields
        dense = self.get("mlp_only_layers", [])
        if not isinstance(dense, list):
            self.refuse("mlp_only_layers", "must be a list of layer indices (e.g. [0, 1]); fix "
                        "the config.json")
        if self.get("decoder_sparse_step", 1) != 1:
            self.refuse("decoder_sparse_step", "(MoE every few layers) is not modelled; "
                        "shardscope's dense layers come first (model.n_dense_layers)")
        if dense != list(range(len(dense))):
            self.refuse("mlp_only_layers", "is not modelled: dense layers must be the first "
                        "ones (model.n_dense_layers)")
        if dense:
            f["n_dense_layers"], f["dense_d_ff"] = len(dense), self.config["intermediate_size"]

    def attention(self) -> None:
        f = self.fields
        if self.kind == "deepseek_v3":
            f["n_kv_heads"] = f["n_heads"]  # MLA: keys and values per query head
            self.read.add("head_dim")  # transformers writes qk_rope_head_dim there
        bias = self.get("attention_bias", self.kind == "qwen2")
        if bias:
            d, e, h, k = f["d_model"], f["head_dim"], f["n_heads"], f["n_kv_heads"]
            qkv = (h + 2 * k) * e
            n = qkv if self.kind == "qwen2" else qkv + d
            what = "q, k and v" if self.kind == "qwen2" else "q, k, v and o"
            self.notes.append(f"the biases of the {what} projections are not modelled ({n:,} "
                              f"parameters per layer, an add each)")
        if self.get("mlp_bias", False):
            self.notes.append("mlp_bias: the MLP's biases are not modelled (an add each)")
        if self.kind in ("qwen3", "qwen3_moe"):
            self.notes.append(QK_NORM_NOTE)
        if self.kind == "gpt_oss":
            # its experts' gate/up (2 x d_ff) and down (d_model) biases, and the router's
            x, ff = f.get("n_experts", 1), f["d_ff"]
            n = x * (2 * ff + f["d_model"]) + x
            self.notes.append("gpt-oss's attention sinks (a learned logit per head), its "
                              f"clamped SwiGLU (swiglu_limit={self.get('swiglu_limit')}) and "
                              f"its experts' and router's biases ({n:,} parameters per layer) "
                              "are modelled as plain softmax attention and SwiGLU without "
                              "biases")

    def approximations(self) -> None:
        self.sliding_window()
        quant = self.table("quantization_config")
        if quant:
            self.notes.append(f"the checkpoint's {quant.get('quant_method', '?')} storage "
                              f"(quantization_config) is not the run's: [precision] decides "
                              f"the dtypes")

    def sliding_window(self) -> None:
        """A note for the layers with a sliding window (all of them when no layer_types)."""
        window = self.get("sliding_window")
        types = self.get("layer_types")
        if types is not None and not isinstance(types, list):
            self.refuse("layer_types", "must be a list with one entry per layer (e.g. "
                        "[\"full_attention\", ...]); fix the config.json")
        used = window and (self.kind in ("mistral", "gpt_oss")
                           or self.config.get("use_sliding_window"))
        if not used:
            if types and any(t != "full_attention" for t in types):
                self.refuse("layer_types", "has layers other than full attention without a "
                            "sliding_window")
            return
        layers = self.fields["n_layers"]
        if types is None and self.kind in ("qwen2", "qwen3", "qwen3_moe"):
            # transformers' Qwen configs slide from layer max_window_layers on
            first = self.config.get("max_window_layers") or 0
            if not isinstance(first, int) or isinstance(first, bool):
                self.refuse("max_window_layers", "must be a layer count; fix the config.json")
            types = ["sliding_attention"] * max(layers - first, 0)
        sliding = layers if types is None else sum(t == "sliding_attention" for t in types)
        if sliding:
            self.notes.append(sliding_window_note(
                window, "every layer" if sliding == layers else f"{sliding} layers"))

    def check_all_read(self) -> None:
        unknown = sorted(k for k in self.config if k not in self.read)
        if unknown:
            raise ValueError(f"{self.where}: field {unknown[0]}={self.config[unknown[0]]!r} "
                             f"(model_type {self.kind!r}) is unknown to shardscope, which "
                             f"cannot tell whether it changes the model; remove it from the "
                             f"file if it does not, or give the [model] dimensions explicitly")
