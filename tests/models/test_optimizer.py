"""Mixed precision, the distributed optimizer and vocabulary tiling, as frameworks run them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshes
import models
import sharding
from models.optimizer import init_state

CFG = models.preset("tiny")  # every dimension a multiple of 8


def program(par, *, precision, train=None, seq_len=32, global_batch=16, microbatches=1):
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), par)
    return mesh, models.build_train_program(
        CFG, mesh, sharding.default_rules(), precision=precision,
        train=train or models.Train(),
        workload=models.Workload(seq_len=seq_len, global_batch=global_batch,
                                 microbatches=microbatches))


def n_params(prog) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(prog.args[0]))


@pytest.mark.parametrize("reduce, grad_bytes", [("float32", 4), ("bfloat16", 2)])
def test_megatron_bytes_per_parameter(cpu_devices, reduce, grad_bytes):
    # Megatron's --bf16 with the distributed optimizer over 8 data-parallel ranks: bf16
    # weights (2 bytes), gradients in the reduce dtype (4 bytes in fp32, Megatron's
    # main_grad; 2 in bf16), and the fp32 master copy with Adam's two moments (12 bytes)
    # split 8 ways: 2 + 4 + 12/8 bytes per parameter.
    precision = models.Precision(params="bfloat16", master_weights="float32",
                                 grad_reduce=reduce)
    _, prog = program({"data": 8}, precision=precision,
                      train=models.Train(shard_optimizer_over_data=True))
    n = n_params(prog)
    assert prog.param_bytes_per_device == 2 * n
    assert prog.gradient_bytes_per_device == grad_bytes * n
    counts = 2 * 4  # Adam's step count (int32) and its schedule's, replicated
    assert prog.optimizer_bytes_per_device == pytest.approx(12 * n / 8 + counts, abs=16)
    # without the distributed optimizer the state is whole on every rank
    _, whole = program({"data": 8}, precision=precision)
    assert whole.optimizer_bytes_per_device == pytest.approx(12 * n + counts, abs=16)


@pytest.mark.parametrize("reduce, microbatches, grad_bytes", [
    ("float32", 1, 4),
    # bf16 gradients summed once per step after two microbatches (the replicas' own
    # gradients, models/train.py): reduced in bf16, not widened to f32 by the sum
    ("bfloat16", 2, 2),
])
def test_the_distributed_optimizer_reduce_scatters_and_gathers(cpu_devices, reduce,
                                                               microbatches, grad_bytes):
    # One reduce-scatter of the gradients over data in grad_reduce's dtype (4 or 2 bytes per
    # parameter, the input buffer) and one all-gather of the bf16 weights (2 bytes, the
    # output buffer); no all-reduce of gradients.
    precision = models.Precision(params="bfloat16", master_weights="float32",
                                 grad_reduce=reduce)
    mesh, prog = program({"data": 8}, precision=precision, microbatches=microbatches,
                         train=models.Train(shard_optimizer_over_data=True))
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system="h100:8")
    n = n_params(prog)
    kinds = rep.by_kind()
    assert kinds["reduce-scatter"] == pytest.approx(grad_bytes * n, rel=1e-6)
    assert kinds["all-gather"] == pytest.approx(2 * n, rel=1e-6)
    assert kinds.get("all-reduce", 0) < 64  # the loss only
    assert all(c.mesh_axes == ("data",) for c in rep.collectives)


def test_bf16_master_weights_train_like_the_unsharded_step(cpu_devices):
    precision = models.Precision(params="bfloat16", master_weights="float32")
    train = models.Train(shard_optimizer_over_data=True)
    model = models.make_model(CFG, precision, remat=train.remat, seed=0)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    tx = models.make_optimizer(train)
    opt = init_state(tx, params, precision)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab, (16, 32)), jnp.int32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    step = models.make_train_step(graphdef, tx, precision=precision)
    p1, o1, loss1 = jax.jit(step)(params, opt, batch)
    _, prog = program({"data": 2, "fsdp": 4}, precision=precision, train=train)
    args = jax.device_put((params, opt, batch), jax.tree.map(lambda a: a.sharding, prog.args))
    p2, o2, loss2 = prog.step(*args)
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-4)
    assert jax.tree.leaves(p2)[0].dtype == jnp.bfloat16
    # Adam's first step moves each weight by about the learning rate whatever its gradient's
    # size, so a gradient near 0 that bf16 rounds to the other sign moves the other way: at
    # most 2 x lr apart there, and nearly every weight the same.
    lr = train.learning_rate
    for a, b in zip(jax.tree.leaves(o1["master"]), jax.tree.leaves(o2["master"]), strict=True):
        diff = np.abs(np.asarray(a) - np.asarray(b))
        assert diff.max() <= 2.05 * lr and (diff > 1e-5).mean() < 0.03


def test_vocab_tiling_is_the_same_loss_and_gradient():
    model = models.make_model(CFG, models.Precision(compute="float32"), seed=0)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab, (2, 32)), jnp.int32)
    targets = jnp.roll(tokens, -1, 1)
    out = {k: nnx.value_and_grad(lambda m, k=k: models.loss_fn(m, tokens, targets, k))(model)
           for k in (1, 4)}
    assert float(out[4][0]) == pytest.approx(float(out[1][0]), rel=1e-6)
    g1, g4 = (np.asarray(out[k][1].lm_head[...]) for k in (1, 4))
    np.testing.assert_allclose(g4, g1, rtol=1e-5, atol=1e-7)


def test_vocab_tiling_keeps_one_tiles_logits(cpu_devices):
    # A vocabulary of 32,768 over 16 x 512 positions on 8 FSDP ranks: each device's f32
    # logits are 2 x 512 x 32768 x 4 = 134 MB. Tiled 8 ways the compiled program holds one
    # tile's, so XLA:CPU's own buffers shrink by most of the logits and their gradient, and
    # the memory model keeps one tile's.
    cfg = models.preset("tiny", vocab=32768)
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"fsdp": 8})
    temps, model_logits = {}, {}
    for tiles in (1, 8):
        prog = models.build_train_program(
            cfg, mesh, sharding.default_rules(), precision=models.Precision(),
            train=models.Train(num_vocab_tiling=tiles),
            workload=models.Workload(seq_len=512, global_batch=16))
        with jax.set_mesh(mesh):
            c = sharding.compile_to_hlo(prog.step, *prog.args)
        temps[tiles] = c.compiled.memory_analysis().temp_size_in_bytes
        from models.memory import training_memory
        m = training_memory(cfg, prog, workload=models.Workload(seq_len=512, global_batch=16),
                            precision=models.Precision(),
                            train=models.Train(num_vocab_tiling=tiles),
                            mesh_shape=dict(mesh.shape), rules=sharding.default_rules())
        model_logits[tiles] = next(b for w, b in m.components if w.startswith("logits"))
    logits = 2 * 512 * 32768 * 4
    assert temps[1] - temps[8] > 0.5 * logits
    # beside the logits, the unembedding as FSDP gathers it (32768 x d_model, bf16): untiled
    unembedding = 32768 * cfg.d_model * 2
    assert model_logits[8] - unembedding == pytest.approx((model_logits[1] - unembedding) / 8)
