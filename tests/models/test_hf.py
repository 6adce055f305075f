"""Models from Hugging Face config.json files (models/hf.py, `[model] hf_config`): the
published parameter counts, what is refused and what is noted. Pure Python."""

import json
import math

import pytest

from experiments import config as config_mod
from models import hf
from models.config import ModelConfig

# Published config.json files (experiments/configs/hf/README.md names each one's repository).
HF = config_mod.BUNDLED / "hf"


def model(name: str) -> ModelConfig:
    fields, _ = hf.load(HF / f"{name}.json")
    return ModelConfig(**fields)


@pytest.mark.parametrize("name, total", [
    # Model cards: Meta-Llama-3-8B 8.03B, Mistral-7B-v0.1 7.24B, Qwen2-7B 7.6B, Qwen3-8B
    # 8.2B, Qwen3-30B-A3B 30.5B, Qwen3-235B-A22B 235B, Mixtral-8x7B 46.7B, DeepSeek-V3 671B
    # (without its 14B multi-token-prediction module), gpt-oss-120b 116.83B.
    ("meta-llama-3-8b", 8.03), ("mistral-7b-v0.1", 7.24), ("qwen2-7b", 7.6),
    ("qwen3-8b", 8.2), ("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235),
    ("mixtral-8x7b-v0.1", 46.7), ("deepseek-v3", 671), ("gpt-oss-120b", 116.83),
])
def test_hf_configs_give_the_published_parameter_counts(name, total):
    assert model(name).param_count() / 1e9 == pytest.approx(total, rel=0.01)


def test_hf_configs_give_the_published_active_parameters():
    # Publishers count "activated" parameters two ways. DeepSeek (README_WEIGHTS.md: 36.6B
    # "including 0.9B for the output head") and OpenAI (gpt-oss model card: 5.13B) leave
    # out the embedding table: active_param_count(), what `run --json` reports.
    assert model("deepseek-v3").active_param_count() / 1e9 == pytest.approx(36.6, rel=0.01)
    assert model("gpt-oss-120b").active_param_count() / 1e9 == pytest.approx(5.13, rel=0.01)
    # Qwen and Mistral count it in: Qwen3-235B-A22B 22B, Mixtral-8x7B 12.9B ...
    for name, active in (("qwen3-235b-a22b", 22), ("mixtral-8x7b-v0.1", 12.9)):
        counted = model(name).active_param_count(include_embedding=True) / 1e9
        assert counted == pytest.approx(active, rel=0.01)
    # ... and Qwen3-30B-A3B's "3.3B" is given to two digits (3.35B: truncated).
    counted = model("qwen3-30b-a3b").active_param_count(include_embedding=True) / 1e9
    assert math.floor(counted * 10) / 10 == 3.3


def test_mla_layer_and_its_cache_are_deepseek_v3s():
    cfg = model("deepseek-v3")
    # DeepSeek-V3's published dimensions: d 7168, 128 heads, q_lora 1536, kv_lora 512,
    # qk_nope 128, qk_rope 64, v 128.
    d, h, q, c, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    query = d * q + q + q * h * (nope + rope)  # down, its RMSNorm, up
    latent = d * (c + rope) + c + c * h * (nope + v)  # down (with the RoPE key), norm, up
    assert cfg.attention_param_count() == query + latent + h * v * d == 187_107_328
    # The cache: the 512-wide latent and the 64-wide RoPE key per token and layer, 1152
    # bytes in bf16 (GQA-shaped with these heads it would be 2 x 128 x 192 x 2 = 98 kB).
    assert cfg.kv_cache_values_per_token() == c + rope == 576
    assert (cfg.n_layers, cfg.n_dense_layers, cfg.dense_layers_d_ff, cfg.d_ff,
            cfg.n_shared_experts, cfg.n_experts) == (61, 3, 18432, 2048, 1, 256)


def test_notes_say_what_is_approximated():
    _, notes = hf.load(HF / "mistral-7b-v0.1.json")
    # a window run as full attention overcounts the serving KV cache too, not only FLOPs
    assert any("sliding_window=4096 (every layer)" in n and "full causal attention" in n
               and "KV cache" in n for n in notes)
    # gpt-oss-120b: 18 of its 36 layer_types are sliding_attention
    _, notes = hf.load(HF / "gpt-oss-120b.json")
    assert any("sliding_window=128 (18 layers)" in n for n in notes)
    # its experts' gate/up (2 x 2880) and down (2880) biases and the router's: 128 x 8640
    # + 128 per layer (the 40M parameters between 116.79B here and the card's 116.83B)
    assert any(f"biases ({128 * 8640 + 128:,} parameters per layer)" in n for n in notes)
    _, notes = hf.load(HF / "qwen3-30b-a3b.json")
    assert any("qk-norm" in n for n in notes)
    _, notes = hf.load(HF / "deepseek-v3.json")
    assert any("sigmoid" in n for n in notes) and any("multi-token" in n for n in notes)
    assert hf.load(HF / "meta-llama-3-8b.json")[1] == ()


LLAMA = json.loads((HF / "meta-llama-3-8b.json").read_text())


def test_a_qwen_sliding_window_covers_the_layers_from_max_window_layers():
    # transformers' Qwen2Config: with use_sliding_window, layer i slides when i >=
    # max_window_layers (Qwen2-7B has 28 layers)
    qwen = {**json.loads((HF / "qwen2-7b.json").read_text()), "use_sliding_window": True,
            "sliding_window": 4096}
    notes = hf.translate({**qwen, "max_window_layers": 24})[1]
    assert any("sliding_window=4096 (4 layers)" in n for n in notes)
    notes = hf.translate({**qwen, "max_window_layers": 28})[1]
    assert not any("sliding_window" in n for n in notes)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported; supported: llama, mistral"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh' gates the MLP"),
    ({"rope_scaling": {"rope_type": "longrope"}}, "rope type 'longrope'"),
    ({"num_experts_per_token_typo": 2}, "field num_experts_per_token_typo=2 (model_type "
                                        "'llama') is unknown"),
    ({"layer_types": ["sliding_attention"] * 32}, "layer_types="),
    # malformed values: named, never a traceback
    ({"num_attention_heads": None}, "missing num_attention_heads"),
    ({"intermediate_size": None}, "missing intermediate_size"),
    ({"num_attention_heads": "32"}, "num_attention_heads='32' must be a number"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no' must be true or false"),
    # nested fields of the wrong JSON type: named, not an AttributeError from inside
    ({"rope_scaling": "linear"}, "rope_scaling='linear' must be a JSON object"),
    ({"rope_parameters": 10000}, "rope_parameters=10000 must be a JSON object"),
    ({"quantization_config": "fp8"}, "quantization_config='fp8' must be a JSON object"),
    ({"layer_types": "full_attention"}, "layer_types='full_attention' must be a list"),
])
def test_what_changes_the_math_and_cannot_be_modelled_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf.translate({**LLAMA, **change})


def test_moe_layers_that_are_not_a_dense_prefix_are_refused():
    qwen = json.loads((HF / "qwen3-30b-a3b.json").read_text())
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        hf.translate({**qwen, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[5\]"):
        hf.translate({**qwen, "mlp_only_layers": [5]})
    with pytest.raises(ValueError, match="mlp_only_layers=3 must be a list"):
        hf.translate({**qwen, "mlp_only_layers": 3})
    fields, _ = hf.translate({**qwen, "mlp_only_layers": [0, 1]})
    assert (fields["n_dense_layers"], fields["dense_d_ff"]) == (2, 6144)


TOML = """
name = "hf"
[model]
hf_config = "{path}"
n_layers = 2
[system]
name = "h100:8"
[parallelism]
fsdp = 8
[workload]
seq_len = 64
global_batch = 8
"""


def test_hf_config_is_read_relative_to_the_toml_and_keys_beside_it_override(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((HF / "qwen3-30b-a3b.json").read_text())
    toml = tmp_path / "exp.toml"
    toml.write_text(TOML.format(path="m/config.json"))
    exp = config_mod.load(toml)
    assert exp.model == ModelConfig(**{**hf.load(HF / "qwen3-30b-a3b.json")[0],
                                       "name": "config", "n_layers": 2})
    assert any("qk-norm" in n for n in exp.notes)


@pytest.mark.parametrize("model_table, message", [
    ('hf_config = "missing.json"', "model.hf_config='.*missing.json' not found"),
    ('hf_config = "hf/qwen3-8b.json"\npreset = "tiny"',
     "model.preset='tiny' and model.hf_config=.* are both given"),
    ('hf_config = "hf/qwen3-8b.json"\nn_kv_heads = 3',
     "model.n_heads=32 is not a multiple of model.n_kv_heads=3"),
])
def test_bad_hf_config_is_a_config_error(tmp_path, model_table, message):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "qwen3-8b.json").write_text((HF / "qwen3-8b.json").read_text())
    toml = tmp_path / "exp.toml"
    toml.write_text(TOML.replace('hf_config = "{path}"', model_table))
    with pytest.raises(config_mod.ConfigError, match=message):
        config_mod.load(toml)
