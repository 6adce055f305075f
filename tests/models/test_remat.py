"""Activation checkpointing policies (models/program.py REMAT_POLICIES): what the backward
pass recomputes under each, inside the vmaps a step runs its layers under."""

import pytest

import meshes
import sharding
from tests.steps import tiny, train_program

H100 = meshes.get_system("h100:8")


def matmul_flops(cfg, par, remat, microbatches):
    mesh = sharding.make_mesh(H100, par)
    prog = train_program(cfg, mesh, seq_len=32, global_batch=16, microbatches=microbatches,
                         remat=remat)
    return sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100).compute.matmul_flops


@pytest.mark.parametrize("par, microbatches, ticks_per_microbatch", [
    ({"data": 4, "tensor": 2}, 2, 1),     # the data-parallel replicas' vmap (train.py)
    ({"data": 2, "pipeline": 2, "tensor": 2}, 4, 5 / 4),  # and the pipeline stages' vmap
])
def test_minimal_remat_recomputes_only_attentions_products(cpu_devices, par, microbatches,
                                                            ticks_per_microbatch):
    # "minimal" keeps every projection's output, so its backward recomputes only the two
    # per-head products of attention (scores and context: 2 x 2 b s^2 H E FLOPs a layer on
    # each device's b sequences and H heads), on every pipeline tick (M V + P - 1 of them
    # for M microbatches: 5 for 4). jax's dots_with_no_batch_dims_saveable saved nothing
    # under a vmap (the dots gain its batch dimension): "minimal" recomputed what "full"
    # does.
    cfg = tiny(n_layers=4)
    none, minimal, full = (matmul_flops(cfg, par, r, microbatches)
                           for r in ("none", "minimal", "full"))
    b = 16 // par["data"]
    heads = cfg.n_heads // par["tensor"]
    layers = cfg.n_layers // par.get("pipeline", 1)
    attention = 2 * 2 * b * 32**2 * heads * cfg.head_dim * layers * ticks_per_microbatch
    assert minimal - none == pytest.approx(attention)
    # "full" recomputes the projections the backward reads too (q, k, v, gate, up).
    qkv = cfg.d_model * cfg.head_dim * (cfg.n_heads + 2 * cfg.n_kv_heads)
    gate_up = 2 * cfg.d_model * cfg.d_ff
    tokens = b * 32 * ticks_per_microbatch
    assert full - minimal >= 2 * tokens * (qkv + gate_up) * layers / par["tensor"]
