"""Model presets (models/config.py): parameter counts and bad fields."""

import jax
import pytest
from flax import nnx

import models


@pytest.mark.parametrize("name, billions", [
    ("llama2-7b", 6.74), ("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9),
    ("gpt3-175b", 174.6),
])
def test_preset_parameter_counts_match_the_model_cards(name, billions):
    assert models.preset(name).param_count() / 1e9 == pytest.approx(billions, rel=0.01)


def test_analytic_count_equals_the_built_model():
    mla = models.preset("tiny", n_kv_heads=4, n_experts=4, experts_per_token=2,
                        n_shared_experts=1, n_dense_layers=1, dense_d_ff=96, kv_lora_rank=32,
                        q_lora_rank=24, qk_rope_dim=8, v_head_dim=12, n_layers=3)
    for cfg in (models.preset("tiny"), models.preset("tiny", mlp="gelu", norm="layernorm",
                                                     positions="learned", tie_embeddings=True),
                mla, models.preset("tiny", n_kv_heads=4, kv_lora_rank=32, qk_rope_dim=8)):
        model = nnx.eval_shape(lambda cfg=cfg: models.make_model(cfg, models.Precision()))
        state = nnx.state(model, nnx.Param)
        assert sum(x.size for x in jax.tree.leaves(state)) == cfg.param_count()


def test_abstract_405b_costs_no_memory():
    cfg = models.preset("llama3-405b")
    model = nnx.eval_shape(lambda: models.make_model(cfg, models.Precision()))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def test_preset_overrides_and_bad_fields():
    assert models.preset("llama3-8b", n_layers=2).n_layers == 2
    with pytest.raises(ValueError, match="model.preset='llama9'"):
        models.preset("llama9")
    with pytest.raises(ValueError, match="model.n_heads=6 is not a multiple of model.n_kv_heads=4"):
        models.ModelConfig(n_layers=1, d_model=8, n_heads=6, n_kv_heads=4, head_dim=2, d_ff=8,
                           vocab=8)


@pytest.mark.parametrize("fields, message", [
    ({"kv_lora_rank": 32, "qk_rope_dim": 8}, "model.n_kv_heads=2: multi-head latent attention"),
    ({"n_kv_heads": 4, "kv_lora_rank": 32}, "model.qk_rope_dim=0: multi-head latent"),
    ({"q_lora_rank": 16}, "model.q_lora_rank=16 belongs to multi-head latent attention"),
    ({"n_dense_layers": 1}, "model.n_dense_layers=1 needs a mixture of experts"),
    # a MoE model cut to fewer layers than its dense prefix: the fix is a count, not removal
    ({"n_experts": 4, "n_dense_layers": 2}, "model.n_dense_layers=2 leaves no MoE layer of "
                                            "model.n_layers=2; set model.n_layers above 2 or "
                                            "model.n_dense_layers below 2"),
    ({"n_experts": 4, "dense_d_ff": 64}, "model.dense_d_ff=64 is the hidden width of the first"),
])
def test_latent_attention_and_dense_layer_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        models.preset("tiny", **fields)


@pytest.mark.parametrize("name, hf_name", [
    ("gpt-oss-120b", "gpt-oss-120b"), ("qwen3-235b-a22b", "qwen3-235b-a22b"),
    ("deepseek-v3", "deepseek-v3"),
])
def test_a_preset_notes_what_its_published_config_json_would(name, hf_name):
    # The run's warnings list what a preset leaves out of the published model, as they do
    # for the model's own config.json (experiments/configs/hf): the sliding windows of 18 of
    # gpt-oss-120b's layers (its KV cache overcounted in serving), qwen3's qk-norm,
    # DeepSeek-V3's multi-token prediction.
    from experiments import config as config_mod
    from models import hf

    _, hf_notes = hf.load(config_mod.BUNDLED / "hf" / f"{hf_name}.json")
    exp = config_mod.from_dict({"name": "x", "model": {"preset": name},
                                "system": {"name": "h100:8"}, "parallelism": {"fsdp": 8},
                                "workload": {"seq_len": 64, "global_batch": 8}})
    for key in ("sliding_window=", "qk-norm", "multi-token", "routing", "sinks"):
        assert (any(key in n for n in exp.notes) == any(key in n for n in hf_notes)), key
    sliding = [n for n in hf_notes if n.startswith("sliding_window=")]
    assert all(n in exp.notes for n in sliding)


def test_every_model_field_is_either_shape_or_run_setting():
    # a preset or hf_config on the command line replaces the file's shape fields and keeps
    # its run settings (experiments/config.py load_raw): a new field must say which it is
    import dataclasses

    from models.config import RUN_FIELDS, SHAPE_FIELDS, ModelConfig

    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    assert not set(SHAPE_FIELDS) & set(RUN_FIELDS)
    assert sorted(SHAPE_FIELDS + RUN_FIELDS) == sorted(fields)
    assert len(set(SHAPE_FIELDS + RUN_FIELDS)) == len(SHAPE_FIELDS + RUN_FIELDS)
