"""Build, analyze and run tiny steps on the 8 fake CPU devices: reports of the sharded
programs, and a step unsharded and sharded for the equality tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import meshes
import models
import sharding
from models.inference import build_serve_program

H100 = meshes.get_system("h100:8")


def tiny(**kw):
    return models.preset("tiny", **kw)


def train_setup(*, seq_len: int, global_batch: int, microbatches: int = 1,
                params: str = "float32", compute: str = "bfloat16", remat: str = "full"):
    """The workload, precision and training recipe of a test step, as keyword arguments of
    models.build_train_program."""
    return {"workload": models.Workload(seq_len=seq_len, global_batch=global_batch,
                                        microbatches=microbatches),
            "precision": models.Precision(params=params, compute=compute),
            "train": models.Train(remat=remat)}


def train_program(cfg, mesh, **setup):
    """The sharded train step of `cfg` over `mesh` under the default rules."""
    return models.build_train_program(cfg, mesh, sharding.default_rules(), **train_setup(**setup))


def train_report(cfg, par, *, dtype="float32", batch=16, seq=32, remat="full"):
    """The report of `cfg`'s train step over mesh `par` on the H100 node, and the program."""
    mesh = sharding.make_mesh(H100, par)
    prog = train_program(cfg, mesh, seq_len=seq, global_batch=batch, params=dtype,
                         compute=dtype, remat=remat)
    return sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100), prog


def layer_matmul_params(cfg):
    d, e = cfg.d_model, cfg.head_dim
    attn = d * e * (cfg.n_heads + 2 * cfg.n_kv_heads) + cfg.n_heads * e * d
    return attn + 3 * d * cfg.d_ff  # SwiGLU: gate, up, down


def pipeline_layout(params, plan):
    """The unsharded model's parameters in a pipeline's layer slots (models/pipeline.py):
    layer i at stack index plan.layer_order()[i], padded slots zero; the embedding, final
    norm and output weight copied to every stage."""
    if plan is None:
        return params
    order = np.asarray(plan.layer_order())

    def place(stack):
        slots = jnp.zeros((plan.slots, *stack.shape[1:]), stack.dtype)
        return slots.at[order].set(stack)

    def per_stage(w):
        return jnp.broadcast_to(w, (plan.stages, *w.shape))

    ends = {k: jax.tree.map(per_stage, v) for k, v in params.items() if k != "blocks"}
    return {**ends, "blocks": jax.tree.map(place, params["blocks"])}


def output_stage(params, plan):
    """The parameters of the pipeline stage whose embedding, final norm and output weight
    the model uses (models/pipeline.OUTPUT_STAGE); the layer slots as they are."""
    if plan is None:
        return params
    from models.pipeline import OUTPUT_STAGE

    ends = {k: jax.tree.map(lambda w: w[OUTPUT_STAGE], v) for k, v in params.items()
            if k != "blocks"}
    return {**ends, "blocks": params["blocks"]}


@functools.lru_cache(maxsize=None)
def _unsharded_step(cfg, seed: int, token_seed: int, setup: tuple):
    """The initial parameters, the batch, the optimizer and (loss, params) after one train
    step without a mesh. The same for every mesh a test compares with: computed once per
    process."""
    s = train_setup(**dict(setup))
    model = models.make_model(cfg, s["precision"], remat=s["train"].remat, seed=seed)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    tx = models.make_optimizer(s["train"])
    opt = tx.init(params)
    shape = (s["workload"].global_batch, s["workload"].seq_len)
    tokens = jnp.asarray(np.random.default_rng(token_seed).integers(0, cfg.vocab, shape),
                         jnp.int32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    step = models.make_train_step(graphdef, tx, microbatches=s["workload"].microbatches)
    p1, _, loss1 = jax.jit(step)(params, opt, batch)
    # Kept on the host: the sharded step donates the device buffers it is given.
    return jax.tree.map(np.asarray, (params, batch)) + (tx, (loss1, p1))


def train_both_ways(cfg, par, *, seed: int, token_seed: int, virtual_stages: int = 1,
                    context_mode: str = "ring", sequence_parallel: bool = False, **setup):
    """(loss, params) after one train step without a mesh, then over mesh `par`, from the
    same initial parameters and a random batch of global_batch x seq_len tokens. With a
    pipeline, the sharded run's parameters are the same layers in its slots (the embedding
    is compared)."""
    params, batch, tx, unsharded = _unsharded_step(cfg, seed, token_seed,
                                                   tuple(sorted(setup.items())))
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), par)
    rules = sharding.default_rules()
    prog = models.build_train_program(cfg, mesh, rules.with_sequence_parallel()
                                      if sequence_parallel else rules,
                                      virtual_stages=virtual_stages, context_mode=context_mode,
                                      **train_setup(**setup))
    params = pipeline_layout(params, prog.pipeline)
    opt = tx.init(params)
    args = jax.device_put((params, opt, batch), jax.tree.map(lambda a: a.sharding, prog.args))
    p2, _, loss2 = prog.step(*args)
    return unsharded, (loss2, output_stage(p2, prog.pipeline))


def decode_both_ways(cfg, par, *, batch: int, index: int, seed: int):
    """One float32 decode step over a random 16-position cache, by the model itself and by
    the sharded serving program: (program, mesh, (logits, cache) expected, (next token,
    cache) sharded)."""
    mesh = sharding.make_mesh(meshes.get_system("h100:8"), par)
    precision = models.Precision(params="float32", compute="float32")  # f32 cache too
    prog = build_serve_program(cfg, mesh, sharding.default_rules(), precision=precision,
                               workload=models.Workload(kind="decode", seq_len=16,
                                                        global_batch=batch))
    model = models.make_model(cfg, precision, seed=1)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(seed)
    cache = tuple(jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in prog.args[1])
    tok = jnp.asarray(rng.integers(0, cfg.vocab, (batch, 1)), jnp.int32)
    expected = model.decode(tok, cache, index)
    args = jax.device_put((params, cache, tok, jnp.int32(index)),
                          jax.tree.map(lambda a: a.sharding, prog.args))
    return prog, mesh, expected, prog.step(*args)
