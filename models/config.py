"""Model configuration and presets of real models.

Presets are plain functions of no arguments; override fields with `dataclasses.replace`.
Dimensions come from each model's public model card and released config (GPT-3: the paper,
Brown et al. 2020, Table 2.1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from models.program import check_choice, described

MLP_KINDS = ("swiglu", "gelu", "relu")
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_KINDS = ("rope", "learned")
ATTENTION_KINDS = ("flash", "dense", "tiled")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """`[model]`: a decoder-only Transformer (a preset's shape, or every dimension
    given)."""

    name: str = described('the preset\'s name, or "custom"', "custom")
    n_layers: int = described("decoder layers")
    d_model: int = described("width of the residual stream")
    n_heads: int = described("query heads")
    n_kv_heads: int = described("key/value heads (grouped-query attention: divides n_heads)")
    head_dim: int = described("width of each head")
    d_ff: int = described("hidden width of the MLP (of each expert with n_experts > 1)")
    vocab: int = described("vocabulary size (padded to vocab_multiple)")
    mlp: str = described('"swiglu" (gate, up, down) or "gelu" / "relu" (in, out)', "swiglu")
    norm: str = described('"rmsnorm" or "layernorm"', "rmsnorm")
    positions: str = described('"rope", or "learned" (a table of max_seq_len positions)',
                               "rope")
    tie_embeddings: bool = described("the output projection reuses the embedding table",
                                     False)
    max_seq_len: int = described("length of the learned position table", 8192)
    rope_theta: float = described("RoPE's base", 500_000.0)
    n_experts: int = described("routed experts of a mixture of experts (1: a dense MLP)", 1)
    experts_per_token: int = described("experts each token is routed to (top-k)", 1)
    capacity_factor: float = described(
        "expert slots per routing group = ceil(factor x group x k / n_experts); tokens "
        "routed past them are dropped", 1.25)
    dropless: bool = described("every expert has a slot for every token of its group "
                               "(nothing dropped; capacity_factor unused)", False)
    moe_group_size: int = described("tokens routed together (a group never spans "
                                     "sequences)", 4096)
    n_shared_experts: int = described("always-on experts of d_ff each, run for every token "
                                      "(DeepSeek)", 0)
    vocab_multiple: int = described(
        "the embedding is padded to a multiple of this so that it shards evenly, as "
        "Megatron's --make-vocab-size-divisible-by", 128)
    attention: str = described('"flash" (block-wise, scores never in HBM: a fused kernel, as '
                               'every production stack trains), "dense" (scores '
                               'materialised) or "tiled" (flash\'s blocks as the XLA kernels '
                               'they compile to, each tile\'s scores through HBM: what '
                               '`shardscope measure` runs)', "flash")
    fused_qkv: bool = described(
        "one weight for the query, key and value projections (Megatron's linear_qkv: per "
        "kv head, its query heads, key and value), so tensor parallelism gathers the "
        "block's input once and reduces its gradient once; MaxText's name", False)
    fused_mlp: bool = described(
        "one weight for SwiGLU's gate and up projections (Megatron's linear_fc1); "
        "MaxText's name", False)
    kv_lora_rank: int = described(
        "multi-head latent attention (DeepSeek's MLA) when > 0: the width of the compressed "
        "key/value latent each token caches (with qk_rope_dim); keys and values are "
        "projected up from it per head (n_kv_heads = n_heads). 0: grouped-query attention", 0)
    q_lora_rank: int = described("MLA: the rank of the queries' low-rank projection (0: "
                                 "queries projected from the residual stream directly)", 0)
    qk_rope_dim: int = described("MLA: the decoupled RoPE part of each query head and of "
                                 "the one key all heads share (head_dim is the part without "
                                 "RoPE)", 0)
    v_head_dim: int = described("MLA: the width of each value head (0: head_dim)", 0)
    n_dense_layers: int = described("a mixture of experts' first layers that have a dense "
                                    "MLP of dense_d_ff instead (DeepSeek's "
                                    "first_k_dense_replace)", 0)
    dense_d_ff: int = described("hidden width of those dense layers' MLP (0: d_ff)", 0)

    def __post_init__(self):
        for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab",
                  "max_seq_len", "n_experts", "experts_per_token", "vocab_multiple",
                  "moe_group_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model.{f}={v!r} must be a positive integer")
        check_choice("model.mlp", self.mlp, MLP_KINDS)
        check_choice("model.norm", self.norm, NORM_KINDS)
        check_choice("model.positions", self.positions, POSITION_KINDS)
        check_choice("model.attention", self.attention, ATTENTION_KINDS)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads="
                f"{self.n_kv_heads}; grouped-query attention needs n_kv_heads to divide n_heads"
            )
        if self.positions == "rope" and not self.mla and self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")
        for f in ("kv_lora_rank", "q_lora_rank", "qk_rope_dim", "v_head_dim", "n_dense_layers",
                  "dense_d_ff"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"model.{f}={v!r} must be an integer >= 0")
        self._check_latent_attention()
        self._check_dense_layers()
        if (not isinstance(self.n_shared_experts, int) or isinstance(self.n_shared_experts, bool)
                or self.n_shared_experts < 0):
            raise ValueError(f"model.n_shared_experts={self.n_shared_experts!r} must be an "
                             f"integer >= 0")
        if (not isinstance(self.capacity_factor, (int, float))
                or isinstance(self.capacity_factor, bool) or self.capacity_factor <= 0):
            raise ValueError(f"model.capacity_factor={self.capacity_factor!r} must be a number "
                             f"above 0 (e.g. 1.25); for no dropped tokens set "
                             f"model.dropless = true")
        for f in ("dropless", "fused_qkv", "fused_mlp", "tie_embeddings"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"model.{f}={getattr(self, f)!r} must be true or false")
        if self.n_shared_experts and self.n_experts == 1:
            raise ValueError(f"model.n_shared_experts={self.n_shared_experts} needs routed "
                             f"experts (model.n_experts > 1)")
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"model.experts_per_token={self.experts_per_token} exceeds "
                             f"model.n_experts={self.n_experts}")

    def _check_latent_attention(self) -> None:
        if not self.mla:
            for f in ("q_lora_rank", "qk_rope_dim", "v_head_dim"):
                if getattr(self, f):
                    raise ValueError(f"model.{f}={getattr(self, f)} belongs to multi-head latent "
                                     f"attention; set model.kv_lora_rank > 0 (DeepSeek-V3: 512) "
                                     f"or remove it")
            return
        if self.n_kv_heads != self.n_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads}: multi-head latent attention "
                             f"(model.kv_lora_rank={self.kv_lora_rank}) gives every query head "
                             f"its own key and value; set model.n_kv_heads = model.n_heads = "
                             f"{self.n_heads}")
        if self.positions != "rope" or self.qk_rope_dim < 2 or self.qk_rope_dim % 2:
            raise ValueError(f"model.qk_rope_dim={self.qk_rope_dim}: multi-head latent "
                             f"attention needs RoPE (model.positions = 'rope') on an even "
                             f"qk_rope_dim of 2 or more (DeepSeek-V3: 64)")

    def _check_dense_layers(self) -> None:
        if self.n_dense_layers and self.n_experts == 1:
            raise ValueError(f"model.n_dense_layers={self.n_dense_layers} needs a mixture of "
                             f"experts (model.n_experts > 1); set it to 0 for a dense model")
        if self.n_dense_layers >= self.n_layers:
            raise ValueError(f"model.n_dense_layers={self.n_dense_layers} leaves no MoE layer "
                             f"of model.n_layers={self.n_layers}; set model.n_layers above "
                             f"{self.n_dense_layers} or model.n_dense_layers below "
                             f"{self.n_layers}")
        if self.dense_d_ff and not self.n_dense_layers:
            raise ValueError(f"model.dense_d_ff={self.dense_d_ff} is the hidden width of the "
                             f"first dense layers; set model.n_dense_layers too, or remove it")

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek) rather than grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Width of each query and key head: head_dim, plus MLA's RoPE part."""
        return self.head_dim + self.qk_rope_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def attention_head_dim(self) -> float:
        """The mean of the query-key and value head widths: attention's FLOPs per head and
        attended position are 4 x this (scores and weighted values)."""
        return (self.qk_head_dim + self.value_head_dim) / 2

    @property
    def moe_layers(self) -> int:
        """Layers with routed experts (0 for a dense model)."""
        return self.n_layers - self.n_dense_layers if self.n_experts > 1 else 0

    @property
    def dense_layers_d_ff(self) -> int:
        """Hidden width of the dense layers' MLP."""
        return self.dense_d_ff or self.d_ff

    def attention_param_count(self) -> int:
        """One layer's attention parameters (MLA: its projections and their norms)."""
        d, h = self.d_model, self.n_heads
        if not self.mla:
            e = self.head_dim
            return d * e * (h + 2 * self.n_kv_heads) + h * e * d
        qk, c, r, q = self.qk_head_dim, self.kv_lora_rank, self.qk_rope_dim, self.q_lora_rank
        query = d * q + q + q * h * qk if q else d * h * qk  # down, its norm, up
        latent = d * (c + r) + c + c * h * (self.head_dim + self.value_head_dim)
        return query + latent + h * self.value_head_dim * d

    def kv_cache_values_per_token(self) -> int:
        """Values one layer caches per token: keys and values of each kv head, or MLA's
        latent and its RoPE key."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.n_kv_heads * self.head_dim

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_multiple
        return -(-self.vocab // m) * m

    def param_count(self, *, include_embedding: bool = True) -> int:
        """Parameters, counted analytically (the embedding counted once when tied)."""
        d = self.d_model
        mlp_mats = 3 if self.mlp == "swiglu" else 2
        moe = (mlp_mats * d * self.d_ff * (self.n_experts + self.n_shared_experts)
               + d * self.n_experts)  # experts and router
        dense = mlp_mats * d * self.dense_layers_d_ff
        norms = 2 * d * (2 if self.norm == "layernorm" else 1)
        total = (self.n_layers * (self.attention_param_count() + norms)
                 + self.moe_layers * moe + (self.n_layers - self.moe_layers) * dense
                 + d * (2 if self.norm == "layernorm" else 1))
        if include_embedding:
            total += self.padded_vocab * d
            if self.positions == "learned":
                total += self.max_seq_len * d
        if not self.tie_embeddings:
            total += d * self.padded_vocab  # output projection
        return total

    def active_param_count(self, *, include_embedding: bool = False) -> int:
        """Parameters a token's matmuls touch (MoE: only its experts and the shared ones);
        with `include_embedding`, the embedding table too, as model cards count "activated"
        parameters (Qwen3-30B-A3B's 3.3B, DeepSeek-V3's 37B)."""
        mlp_mats = 3 if self.mlp == "swiglu" else 2
        inactive = (self.n_experts - self.experts_per_token) * mlp_mats * self.d_model * self.d_ff
        return (self.param_count(include_embedding=include_embedding)
                - self.moe_layers * inactive)

    def matmul_param_count(self) -> int:
        """Active parameters every token's matmuls multiply by: the active non-embedding
        ones and the output projection, tied to the embedding table or not."""
        tied = self.d_model * self.padded_vocab if self.tie_embeddings else 0
        return self.active_param_count() + tied

    def train_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token, the formula MFU uses (stated in the report):

        6 x (active non-embedding parameters, output projection included, tied or not)
        for the matmuls forward and backward, plus causal attention: 12 x n_layers x
        n_heads x head_dim x seq_len / 2 (scores and weighted values, forward and backward,
        half masked; head_dim is attention_head_dim, MLA's mean of its query-key and value
        widths).
        """
        attn = 12 * self.n_layers * self.n_heads * self.attention_head_dim * seq_len / 2
        return 6 * self.matmul_param_count() + attn


# Each [model] field, once: what the model IS (its shape, what a preset or a config.json
# defines) or how it is RUN (a kernel, a fused weight, MoE routing capacity, vocabulary
# padding: the experiment's choice for whatever model it runs). A preset or hf_config named
# on the command line replaces the file's shape fields and keeps its run settings
# (experiments/config.py load_raw); tests/models/test_config.py checks that every field is
# in exactly one.
SHAPE_FIELDS = (
    "name", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab", "mlp",
    "norm", "positions", "tie_embeddings", "max_seq_len", "rope_theta", "n_experts",
    "experts_per_token", "n_shared_experts", "kv_lora_rank", "q_lora_rank", "qk_rope_dim",
    "v_head_dim", "n_dense_layers", "dense_d_ff")
RUN_FIELDS = ("attention", "fused_qkv", "fused_mlp", "capacity_factor", "dropless",
              "moe_group_size", "vocab_multiple")


def _llama(name: str, **shape) -> ModelConfig:
    """A Llama-family shape: SwiGLU, RMSNorm, RoPE, head_dim 128."""
    return ModelConfig(name=name, head_dim=128, **shape)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": lambda: ModelConfig(
        name="tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
        vocab=256, max_seq_len=512),
    "llama2-7b": lambda: _llama(
        "llama2-7b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008,
        vocab=32000, rope_theta=10_000.0),
    "llama2-13b": lambda: _llama(
        "llama2-13b", n_layers=40, d_model=5120, n_heads=40, n_kv_heads=40, d_ff=13824,
        vocab=32000, rope_theta=10_000.0),
    "llama2-70b": lambda: _llama(
        "llama2-70b", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
        vocab=32000, rope_theta=10_000.0),
    "llama3-8b": lambda: _llama(
        "llama3-8b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
        vocab=128256, rope_theta=500_000.0),
    "llama3-70b": lambda: _llama(
        "llama3-70b", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
        vocab=128256, rope_theta=500_000.0),
    "llama3-405b": lambda: _llama(
        "llama3-405b", n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248,
        vocab=128256, rope_theta=500_000.0),
    "gpt3-175b": lambda: ModelConfig(
        name="gpt3-175b", n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, head_dim=128,
        d_ff=49152, vocab=50257, mlp="gelu", norm="layernorm", positions="learned",
        tie_embeddings=True, max_seq_len=2048),
    # Mixture of experts (d_ff is each expert's hidden size). Routing is top-k softmax with
    # capacity factor 1.25 by default (models/moe.py); set dropless = true for no dropped
    # tokens.
    "mixtral-8x7b": lambda: ModelConfig(
        name="mixtral-8x7b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
        head_dim=128, d_ff=14336, vocab=32000, n_experts=8, experts_per_token=2,
        rope_theta=1e6),
    "mixtral-8x22b": lambda: ModelConfig(
        name="mixtral-8x22b", n_layers=56, d_model=6144, n_heads=48, n_kv_heads=8,
        head_dim=128, d_ff=16384, vocab=32768, n_experts=8, experts_per_token=2,
        rope_theta=1e6),
    # gpt-oss alternates sliding-window (128 tokens) and full attention layers; every layer
    # is modelled with full causal attention here (the projections and bytes are the same,
    # the sliding layers' attention FLOPs are overcounted at long sequences).
    "gpt-oss-120b": lambda: ModelConfig(
        name="gpt-oss-120b", n_layers=36, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64,
        d_ff=2880, vocab=201088, n_experts=128, experts_per_token=4, rope_theta=150_000.0),
    "qwen3-235b-a22b": lambda: ModelConfig(
        name="qwen3-235b-a22b", n_layers=94, d_model=4096, n_heads=64, n_kv_heads=4,
        head_dim=128, d_ff=1536, vocab=151936, n_experts=128, experts_per_token=8,
        rope_theta=1e6),
    # DeepSeek-V3 as released (without its multi-token-prediction module): multi-head latent
    # attention (queries through a rank-1536 projection, keys and values from a 512-wide
    # latent that is what the KV cache holds, with one 64-wide RoPE key: 576 values per
    # token per layer), 3 dense first layers (d_ff 18432), then 58 MoE layers of 256
    # routed experts (top-8) and 1 shared expert of 2048. Its sigmoid, group-limited
    # routing is modelled as softmax top-k (models/moe.py): the same dispatch bytes.
    "deepseek-v3": lambda: ModelConfig(
        name="deepseek-v3", n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128,
        head_dim=128, d_ff=2048, vocab=129280, n_experts=256, experts_per_token=8,
        rope_theta=10_000.0, n_shared_experts=1, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_dim=64, v_head_dim=128, n_dense_layers=3, dense_d_ff=18432),
}


def sliding_window_note(window: int, layers: str) -> str:
    """What running a sliding-window attention as full causal attention overcounts."""
    return (f"sliding_window={window} ({layers}): modelled with full causal attention (the "
            f"same up to {window} tokens; beyond it those layers' attention FLOPs are "
            f"overcounted, and in serving their KV cache: its memory and the bytes each decode "
            f"step reads are seq_len positions per layer, not {window})")


QK_NORM_NOTE = ("qwen3's per-head RMSNorm of q and k (qk-norm) is not modelled (2 x head_dim "
                "parameters per layer, an elementwise pass)")
MTP_NOTE = ("the multi-token-prediction module is not modelled (the main model's step)")

# What a preset leaves out of the published model, listed among the run's warnings as a
# Hugging Face config's approximations are (models/hf.py words them the same way).
PRESET_NOTES: dict[str, tuple[str, ...]] = {
    # GPT-3 (Brown et al. 2020, section 2.1): GPT-2's layers, with biases in every
    # projection (q, k, v 3 x 12288, out 12288, MLP 49152 + 12288: 110,592 per layer), and
    # "alternating dense and locally banded sparse attention patterns".
    "gpt3-175b": ("GPT-3's biases (110,592 parameters per layer, an add each) are not "
                  "modelled, and its alternating locally banded sparse attention layers run "
                  "as dense causal attention (as Megatron's GPT-3 runs them)",),
    # gpt-oss model card (OpenAI, 2025) and openai/gpt-oss-120b's config.json (bundled:
    # experiments/configs/hf): layer_types alternate sliding (window 128) and full
    # attention; sinks; biases in q, k, v, o, the experts and the router (40M parameters:
    # 116.83B published, 116.79B here).
    "gpt-oss-120b": (
        sliding_window_note(128, "18 layers"),
        "gpt-oss's attention sinks (a learned logit per head), its clamped SwiGLU and its "
        "biases (q, k, v, o, the experts' and the router's: 40M parameters) are modelled as "
        "plain softmax attention and SwiGLU without biases"),
    "qwen3-235b-a22b": (QK_NORM_NOTE,),
    "deepseek-v3": ("DeepSeek's routing (sigmoid scores, group-limited top-8, "
                    "routed_scaling_factor 2.5) is modelled as softmax top-k over every expert "
                    "(models/moe.py): the same experts per token, dispatch and combine bytes",
                    MTP_NOTE),
}


def preset_notes(name: str) -> tuple[str, ...]:
    """What the preset `name` leaves out of the published model (empty: nothing known)."""
    return PRESET_NOTES.get(name, ())


def preset(name: str, /, **overrides) -> ModelConfig:
    """A preset, with explicit fields overriding it."""
    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r} is unknown; valid: {', '.join(PRESETS)}")
    cfg = PRESETS[name]()
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
