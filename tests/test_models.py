"""The Transformer: presets, parameter counts, and a sharded step that computes the same loss
as an unsharded one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshes
import models
import sharding
from tests.steps import train_both_ways, train_program


@pytest.mark.parametrize("name, billions", [
    ("llama2-7b", 6.74), ("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9),
    ("gpt3-175b", 174.6),
])
def test_preset_parameter_counts_match_the_model_cards(name, billions):
    assert models.preset(name).param_count() / 1e9 == pytest.approx(billions, rel=0.01)


def test_analytic_count_equals_the_built_model():
    for cfg in (models.preset("tiny"), models.preset("tiny", mlp="gelu", norm="layernorm",
                                                     positions="learned", tie_embeddings=True)):
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


@pytest.mark.parametrize("par, remat", [({"data": 2, "fsdp": 2, "tensor": 2}, "full"),
                                        ({"fsdp": 8}, "minimal"), ({"data": 8}, "none"),
                                        ({"data": 2, "sequence": 4}, "full"),
                                        ({"data": 4, "pipeline": 2}, "full")])
def test_sharded_train_step_matches_unsharded(cpu_devices, par, remat):
    cfg = models.preset("tiny", n_heads=4, n_kv_heads=2)
    (loss1, p1), (loss2, p2) = train_both_ways(cfg, par, seed=1, token_seed=0, seq_len=16,
                                               global_batch=16, microbatches=2, remat=remat,
                                               compute="float32")
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-5)
    np.testing.assert_allclose(np.asarray(p2["embed"]), np.asarray(p1["embed"]), rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize("par, mode, compute, rel", [
    ({"data": 2, "sequence": 4}, "ring", "float32", 1e-5),
    ({"data": 2, "sequence": 4}, "allgather", "float32", 1e-5),
    ({"sequence": 2, "tensor": 2, "data": 2}, "ring", "bfloat16", 2e-3),
    ({"sequence": 2, "pipeline": 2, "data": 2}, "ring", "float8", 2e-3),
])
def test_context_parallel_attention_matches_unsharded(cpu_devices, par, mode, compute, rel):
    # Zigzag ring (and all-gather) attention over the `sequence` axis computes the loss of
    # the unsharded model, in f32 exactly, in bf16 with tensor parallelism and in FP8
    # inside a pipeline.
    cfg = models.preset("tiny")
    (loss1, _), (loss2, _) = train_both_ways(
        cfg, par, seed=1, token_seed=0, seq_len=32, global_batch=8, microbatches=2,
        remat="full", compute=compute, context_mode=mode)
    assert float(loss2) == pytest.approx(float(loss1), rel=rel)


@pytest.mark.parametrize("layers, virtual, compute, rel", [
    (4, 1, "bfloat16", 2e-3),   # 2 layers per stage
    (3, 1, "bfloat16", 2e-3),   # uneven: 3 layers in 4 slots, the first stage lighter
    (4, 2, "bfloat16", 2e-3),   # interleaved: 2 chunks of 1 layer per stage
    (5, 2, "float32", 1e-5),    # interleaved and uneven: 5 layers in 8 slots, exactly
    (5, 2, "float8", 2e-3),     # the same with FP8 matmuls
])
def test_pipeline_matches_unsharded_in_every_precision(cpu_devices, layers, virtual, compute,
                                                       rel):
    # data 2 x pipeline 2 x tensor 2 on XLA:CPU: the formulation compiles for bf16 and FP8
    # (the manual shard_map it replaces aborted), and computes the same loss and update.
    cfg = models.preset("tiny", n_layers=layers)
    (loss1, p1), (loss2, p2) = train_both_ways(
        cfg, {"data": 2, "pipeline": 2, "tensor": 2}, seed=1, token_seed=0, seq_len=16,
        global_batch=16, microbatches=4, remat="full", compute=compute,
        virtual_stages=virtual)
    assert float(loss2) == pytest.approx(float(loss1), rel=rel)
    # AdamW's first step moves each weight by about lr * sign(gradient): the embedding's
    # update agrees except where a gradient near zero changes sign under rounding (a few
    # percent of the weights in FP8 with or without a pipeline; none in f32).
    lr = models.Train().learning_rate
    diff = np.abs(np.asarray(p2["embed"]) - np.asarray(p1["embed"]))
    flipped = 0.0 if compute == "float32" else 0.05
    assert diff.max() <= 2.01 * lr and np.mean(diff > 0.1 * lr) <= flipped


@pytest.mark.parametrize("par", [{"data": 2, "tensor": 4}, {"data": 2, "tensor": 2, "pipeline": 2},
                                 {"tensor": 2, "sequence": 2, "pipeline": 2}])
def test_sequence_parallel_matches_unsharded(cpu_devices, par):
    # Megatron's sequence parallelism (the residual stream split over `tensor`) computes
    # the unsharded loss, with a pipeline and with context parallelism too.
    cfg = models.preset("tiny", n_heads=4, n_kv_heads=4)
    (loss1, _), (loss2, _) = train_both_ways(
        cfg, par, seed=1, token_seed=0, seq_len=32, global_batch=8, microbatches=2,
        remat="full", compute="float32", sequence_parallel=True)
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-5)


def test_pipeline_in_fp4_matches_unsharded(cpu_devices):
    # Block-scaled FP4 matmuls (32-element blocks along each contraction: head_dim 32,
    # 64 positions) inside an interleaved pipeline with tensor parallelism on XLA:CPU.
    cfg = models.preset("tiny", n_layers=4, head_dim=32)
    (loss1, _), (loss2, _) = train_both_ways(
        cfg, {"data": 2, "pipeline": 2, "tensor": 2}, seed=1, token_seed=0, seq_len=64,
        global_batch=16, microbatches=4, remat="full", compute="float4", virtual_stages=2)
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-2)


def test_flash_attention_matches_dense_values_and_gradients():
    from models.attention import dense_attention, flash_attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 64, 2, 3, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 64, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 64, 2, 8)), jnp.float32)
    do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    np.testing.assert_allclose(flash_attention(q, k, v, block=16), dense_attention(q, k, v),
                               atol=1e-5)
    grads = [jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * do), argnums=(0, 1, 2))(q, k, v)
             for f in (dense_attention, lambda q, k, v: flash_attention(q, k, v, block=16))]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_flash_attention_skips_the_masked_half(cpu_devices):
    # Causal flash over 4 blocks computes 1+2+3+4 = 10 of 16 score tiles; dense computes all.
    from models.attention import dense_attention, flash_attention
    from sharding.compute import compute_cost
    from sharding.hlo import parse_hlo

    q = jax.ShapeDtypeStruct((1, 256, 1, 1, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 256, 1, 64), jnp.float32)
    chip = meshes.get_system("h100:8").chip
    flops = {}
    for name, f in (("dense", dense_attention),
                    ("flash", lambda q, k, v: flash_attention(q, k, v, block=64))):
        text = jax.jit(f).lower(q, k, k).compile().as_text()
        flops[name] = compute_cost(parse_hlo(text), chip).matmul_flops
    assert flops["dense"] == 2 * 2 * 256 * 256 * 64
    assert flops["flash"] == flops["dense"] * 10 / 16


def test_activation_memory_by_hand():
    from models.memory import activation_components

    cfg = models.preset("llama3-8b")
    # 36 sequences per micro-batch over data 9 x fsdp 1: 4 sequences of 8192 per device.
    parts = dict(activation_components(cfg, micro_batch=36, seq_len=8192,
                                       precision=models.Precision(), remat="full",
                                       mesh_shape={"data": 9, "fsdp": 1, "tensor": 1},
                                       rules=sharding.default_rules()))
    tokens = 4 * 8192
    assert parts["saved activations (full remat, 32 layers)"] == 32 * tokens * 4096 * 2
    assert parts["logits and their gradient (f32)"] == 2 * tokens * 128256 * 4
    minimal = dict(activation_components(cfg, micro_batch=36, seq_len=8192,
                                         precision=models.Precision(), remat="minimal",
                                         mesh_shape={"data": 9}, rules=sharding.default_rules()))
    assert minimal["saved activations (minimal remat, 32 layers)"] > \
        4 * parts["saved activations (full remat, 32 layers)"]


def test_tensor_parallelism_shards_head_and_mlp_activations_only():
    from models.memory import activation_components

    cfg = models.preset("llama3-8b")
    kw = dict(micro_batch=8, seq_len=4096, precision=models.Precision(), remat="full",
              rules=sharding.default_rules())
    one = dict(activation_components(cfg, mesh_shape={"tensor": 1}, **kw))
    eight = dict(activation_components(cfg, mesh_shape={"tensor": 8}, **kw))
    key = "saved activations (full remat, 32 layers)"
    assert one[key] == eight[key]  # the residual stream is not sharded over tensor
    logits = "logits and their gradient (f32)"
    assert eight[logits] == one[logits] / 8


def test_fp8_matmuls_follow_the_recipe_and_the_chip_rate(cpu_devices):
    from sharding.compute import compute_cost
    from sharding.hlo import parse_hlo

    cfg = models.preset("tiny")
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 8})
    costs = {}
    for compute in ("bfloat16", "float8"):
        prog = train_program(cfg, mesh, seq_len=32, global_batch=16, compute=compute,
                             remat="none")  # no recomputed forward matmuls
        with jax.set_mesh(mesh):
            text = sharding.compile_to_hlo(prog.step, *prog.args).hlo_text
        costs[compute] = compute_cost(parse_hlo(text), meshes.get_system("h100:8").chip)
    fp8 = costs["float8"].flops_by_dtype.get("float8_e4m3fn", 0)
    # Every projection's forward, input-gradient and weight-gradient matmul runs in FP8:
    # 3 matmuls x 2 x tokens x parameters of the projections (not the attention itself).
    tokens = 16 * 32 // 8
    proj_params = cfg.param_count(include_embedding=False) - cfg.n_layers * 2 * cfg.d_model \
        - cfg.d_model
    assert fp8 == pytest.approx(3 * 2 * tokens * proj_params, rel=0.01)
    assert costs["float8"].matmul_flops == pytest.approx(costs["bfloat16"].matmul_flops,
                                                         rel=0.01)
    chip = meshes.get_system("h100:8").chip
    assert chip.peak_for("float8_e4m3fn") == 1979e12
    assert chip.efficiency_for("float8_e4m3fn") == pytest.approx(1290 / 1979)


def test_fp4_blocks_share_a_power_of_two_scale_and_fit_e2m1():
    from models.fp8 import MX_BLOCK, quantize_blocks, quantize_blocks_raw
    from models.quant import FORMAT_MAX

    x = jax.random.normal(jax.random.key(0), (8, 128), jnp.float32) * 3
    q, scale = quantize_blocks_raw(x, 1)
    assert q.dtype == jnp.float4_e2m1fn and q.shape == (8, 128 // MX_BLOCK, MX_BLOCK)
    assert scale.dtype == jnp.float8_e8m0fnu and scale.shape == (8, 4, 1)
    s = np.asarray(scale.astype(jnp.float32))
    np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)  # powers of two
    assert np.abs(np.asarray(q.astype(jnp.float32))).max() <= FORMAT_MAX["float4"]
    # The rounding error of a block is at most half E2M1's largest step (2) times its scale.
    err = np.abs(np.asarray(quantize_blocks(x, 1)) - np.asarray(x)).reshape(8, 4, 32)
    assert (err <= s + 1e-6).all()


def test_fp4_matmuls_run_at_the_fp4_rate_and_train(cpu_devices):
    from sharding.compute import compute_cost
    from sharding.hlo import parse_hlo

    cfg = models.preset("tiny", head_dim=32)  # FP4 blocks of 32 along every contraction
    system = meshes.get_system("b200:8")
    mesh = sharding.make_mesh(system, {"fsdp": 8})
    flops, losses = {}, {}
    for compute in ("float8", "float4"):
        prog = train_program(cfg, mesh, seq_len=32, global_batch=16, compute=compute,
                             remat="none")
        with jax.set_mesh(mesh):
            text = sharding.compile_to_hlo(prog.step, *prog.args).hlo_text
        flops[compute] = compute_cost(parse_hlo(text), system.chip).flops_by_dtype
    # The same projections, forward and both gradients, now as block-scaled FP4 MMAs.
    assert flops["float4"]["float4"] == pytest.approx(flops["float8"]["float8_e4m3fn"],
                                                      rel=1e-6)
    assert system.chip.peak_for("float4") == 9e15
    # And the step trains: its loss is the bf16 step's, up to FP4 rounding.
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (4, 32)), jnp.int32)
    for compute in ("bfloat16", "float4"):
        m = models.make_model(cfg, models.Precision(compute=compute), seed=0)
        losses[compute], grads = nnx.value_and_grad(
            lambda m: models.loss_fn(m, tokens, jnp.roll(tokens, -1, 1)))(m)
        assert np.isfinite(np.asarray(grads.blocks.mlp.w_up[...])).all()
    assert float(losses["float4"]) == pytest.approx(float(losses["bfloat16"]), rel=0.05)


OFFLOAD_NAMES = ["decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj"]


@pytest.mark.parametrize("train, message", [
    (dict(remat="custom"), "needs train.save or train.offload"),
    (dict(remat="full", offload=["query_proj"]), 'apply to train.remat = "custom"'),
    (dict(remat="custom", offload=["q_proj"]), "train.offload entry='q_proj' is not one of"),
    (dict(remat="custom", save=["qkv_proj"], offload=["key_proj"]), "key_proj cannot be both"),
])
def test_custom_remat_names_are_checked(train, message):
    with pytest.raises(ValueError, match=message):
        models.Train(**train)


def test_host_offload_moves_the_named_tensors_to_host_memory(tmp_path, capsys, cpu_devices):
    import json

    from tests.test_cli import TINY, run_cli, write

    def run(train_toml):
        path = write(tmp_path, TINY + "[train]\n" + train_toml)
        out_json = tmp_path / "r.json"
        code, out, err = run_cli(["run", path, "--json", str(out_json)], capsys)
        assert code == 0, err
        return out, json.loads(out_json.read_text())

    names = json.dumps(OFFLOAD_NAMES)
    _, saved = run(f'remat = "custom"\nsave = {names}\n')
    out, offloaded = run(f'remat = "custom"\noffload = {names}\n')
    _, full = run('remat = "full"\n')
    # tiny: d_model 64, 4 heads / 2 kv heads of 16, 2 layers; 16 sequences of 32 over
    # data 2 x fsdp 4 = 2 sequences, 64 tokens per device; bf16 activations. Per token the
    # named tensors are 64 + 64 + 32 + 32 + 64 values = 256 x 2 bytes.
    named = 2 * 256 * 64 * 2  # bytes per token x tokens x layers
    key = "saved activations (custom remat, 2 layers)"
    assert saved["memory"]["components"][key] == named
    assert offloaded["memory"]["components"][key] == 0
    assert saved["memory_per_device_bytes"] - offloaded["memory_per_device_bytes"] == named
    # Out in the forward pass, back in the backward pass, on the H100's PCIe Gen5 link.
    assert offloaded["host_transfer_bytes"] == 2 * named and saved["host_transfer_bytes"] == 0
    assert offloaded["host_transfer_s"] == pytest.approx(2 * named / 64e9)
    assert "host offload" in out
    # Saved or offloaded, the named tensors are not recomputed: the same matmul FLOPs, fewer
    # than full remat's.
    flops = "matmul_flops_per_device"
    assert offloaded[flops] == saved[flops] < full[flops]
