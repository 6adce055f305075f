"""Run a step unsharded and sharded on the 8 fake CPU devices, for the equality tests."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import meshes
import models
import sharding
from models.inference import ServeSettings, build_serve_program


def train_both_ways(cfg, settings, par, *, seed: int, token_seed: int):
    """(loss, params) after one train step without a mesh, then over mesh `par`, from the
    same initial parameters and a random batch of settings.global_batch x seq_len tokens."""
    model = models.make_model(cfg, settings, seed=seed)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    tx = models.make_optimizer(settings)
    opt = tx.init(params)
    shape = (settings.global_batch, settings.seq_len)
    tokens = jnp.asarray(np.random.default_rng(token_seed).integers(0, cfg.vocab, shape),
                         jnp.int32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    p1, _, loss1 = jax.jit(models.make_train_step(graphdef, tx, settings))(params, opt, batch)

    mesh = sharding.make_mesh(meshes.get_system("h100:8"), par)
    prog = models.build_train_program(cfg, settings, mesh, sharding.default_rules())
    args = jax.device_put((params, opt, batch), jax.tree.map(lambda a: a.sharding, prog.args))
    p2, _, loss2 = prog.step(*args)
    return (loss1, p1), (loss2, p2)


def decode_both_ways(cfg, par, *, batch: int, index: int, seed: int):
    """One float32 decode step over a random 16-position cache, by the model itself and by
    the sharded serving program: (program, mesh, (logits, cache) expected, (next token,
    cache) sharded)."""
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), par)
    s = ServeSettings(kind="decode", seq_len=16, batch=batch, param_dtype="float32",
                      compute_dtype="float32", cache_dtype="float32")
    prog = build_serve_program(cfg, s, mesh, sharding.default_rules())
    model = models.make_model(cfg, models.TrainSettings(seq_len=16, global_batch=batch,
                                                        compute_dtype="float32"), seed=1)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(seed)
    cache = tuple(jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in prog.args[1])
    tok = jnp.asarray(rng.integers(0, cfg.vocab, (batch, 1)), jnp.int32)
    expected = model.decode(tok, cache, index)
    args = jax.device_put((params, cache, tok, jnp.int32(index)),
                          jax.tree.map(lambda a: a.sharding, prog.args))
    return prog, mesh, expected, prog.step(*args)
