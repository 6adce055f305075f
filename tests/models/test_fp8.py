"""FP8 and FP4 matmuls (models/fp8.py): the recipe, the block scales, the chip's rate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshes
import models
import sharding
from tests.steps import tiny, train_program


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
    # Every layer projection's forward, input-gradient and weight-gradient matmul runs in
    # FP8: 3 matmuls x 2 x tokens x parameters of the projections (not the attention
    # itself, nor the output layer, which stays bf16 as Megatron-Core's does).
    tokens = 16 * 32 // 8
    proj_params = cfg.param_count(include_embedding=False) - cfg.n_layers * 2 * cfg.d_model \
        - cfg.d_model - cfg.d_model * cfg.padded_vocab
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


def test_fp4_keeps_its_input_quantised_for_the_weight_gradient():
    # Transformer Engine saves a projection's input for the weight gradient as column-wise
    # NVFP4 data (blocks along the tokens, the weight gradient's contraction): half a byte
    # a value and a scale per block, not the bf16 input. The backward's residuals hold
    # nothing of x's size in bf16, and the gradient equals the one from the bf16 input
    # quantised in the backward.
    from models.fp8 import MX_BLOCK, fp4_einsum, quantize_blocks

    x = jax.random.normal(jax.random.key(0), (2, 64, 96), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (96, 128), jnp.bfloat16)
    _, vjp = jax.vjp(lambda x, w: fp4_einsum("bld,df->blf", x, w), x, w)
    saved = {(leaf.shape, str(leaf.dtype)) for leaf in jax.tree_util.tree_leaves(vjp)}
    assert ((2, 64 // MX_BLOCK, MX_BLOCK, 96), "float4_e2m1fn") in saved
    assert ((2, 64 // MX_BLOCK, 1, 96), "float8_e8m0fnu") in saved
    assert ((2, 64, 96), "bfloat16") not in saved
    dy = jax.random.normal(jax.random.key(2), (2, 64, 128), jnp.bfloat16)
    _, dw = vjp(dy)
    want = jnp.einsum("bld,blf->df", quantize_blocks(x, 1), quantize_blocks(dy, 1),
                      preferred_element_type=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)


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
        losses[compute], grads = nnx.jit(nnx.value_and_grad(
            lambda m: models.loss_fn(m, tokens, jnp.roll(tokens, -1, 1))))(m)
        assert np.isfinite(np.asarray(grads.blocks.mlp.w_up[...])).all()
    assert float(losses["float4"]) == pytest.approx(float(losses["bfloat16"]), rel=0.05)


def test_fp4_sequence_parallel_gathers_fp4_values_and_their_scales(cpu_devices):
    # Under sequence parallelism a projection's input, and a row-parallel one's output
    # gradient, are gathered over `tensor`. Transformer Engine gathers them quantised:
    # FP8 one byte a value (the partitioner gathers the e4m3 operand); NVFP4 half a byte
    # and its block's scale (distributed.py's _all_gather_nvfp4), the output gradient in
    # both roundings (row-wise for the input gradient, column-wise for the weight
    # gradient). Per layer: FP8 2 inputs + 2 gradients + 2 inputs again for the weight
    # gradients = 6 gathers of N bytes; FP4 8 of N/2 values and 8 of N/32 scales (blocks
    # of 32), never the bf16 the values stand for (2 N bytes each). The reduce-scatters
    # (a row-parallel projection's output, a column-parallel one's input gradient) sum
    # what the GEMM writes, bf16, as in bf16 runs: 2 N bytes, never f32's 4 N.
    cfg = tiny(head_dim=32, fused_qkv=True, fused_mlp=True)
    system = meshes.get_system("b200:8")
    mesh = sharding.make_mesh(system, {"data": 4, "tensor": 2})
    n = (8 // 4) * 2048 * cfg.d_model  # a block's gathered input, values
    gathered = {}
    for compute in ("float8", "float4"):
        prog = models.build_train_program(
            cfg, mesh, sharding.default_rules().with_sequence_parallel(),
            workload=models.Workload(seq_len=2048, global_batch=8),
            precision=models.Precision(params="bfloat16", compute=compute),
            train=models.Train(remat="none"))
        rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=system)
        layers = [c for c in rep.collectives if c.kind == "all-gather"
                  and c.mesh_axes == ("tensor",) and "_proj" in c.op_name]
        gathered[compute] = {}
        for c in layers:
            key = (c.dtype, c.bytes)
            gathered[compute][key] = gathered[compute].get(key, 0) + c.count
        scattered = {(c.dtype, c.bytes) for c in rep.collectives if c.kind == "reduce-scatter"
                     and c.mesh_axes == ("tensor",) and "_proj" in c.op_name}
        assert scattered == {("bfloat16", 2 * n)}, compute
    per_layer = {k: v / cfg.n_layers for k, v in gathered["float8"].items()}
    assert per_layer == {("float8_e4m3fn", n): 6}
    per_layer = {k: v / cfg.n_layers for k, v in gathered["float4"].items()}
    assert per_layer == {("float4_e2m1fn", n // 2): 8, ("f8e8m0fnu", n // 32): 8}
