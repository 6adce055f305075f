"""Serving (models/inference.py): prefill and decode with a KV cache, correct and
bandwidth-bound."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshes
import models
import sharding
from meshes.calibration import catalog_calibration
from models.inference import build_serve_program
from tests.steps import decode_both_ways

# The bytes model alone: the catalog's efficiencies without its fitted fixed time per kernel
# (which a decode step's thousands of small kernels pay on top; test_compute covers it).
BYTES_ONLY = dataclasses.replace(catalog_calibration(), kernel_overhead_s=0.0)

# The model's passes, each compiled once (the decode index traced) rather than run op by
# op, which compiles every operation on its own.
forward = nnx.jit(lambda model, tokens: model(tokens))
prefill = nnx.jit(lambda model, tokens: model.prefill(tokens))
decode = nnx.jit(lambda model, tokens, cache, index: model.decode(tokens, cache, index))


def test_decode_with_the_cache_matches_the_full_forward_pass(cpu_devices):
    cfg = models.preset("tiny")
    model = models.make_model(cfg, models.Precision(compute="float32"), seed=3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (2, 12)), jnp.int32)
    full_logits = forward(model, tokens)  # (B, L, V)
    # Prefill 8 tokens into a cache of 12 positions, then decode tokens 8..11 one by one.
    _, (k, v) = prefill(model, tokens[:, :8])
    pad = ((0, 0), (0, 0), (0, 0), (0, 4), (0, 0))  # (N, B, K, S, E): 4 more positions
    cache = (jnp.pad(k, pad), jnp.pad(v, pad))
    for i in range(8, 12):
        logits, cache = decode(model, tokens[:, i:i + 1], cache, i)
        np.testing.assert_allclose(logits, full_logits[:, i], atol=2e-4, rtol=2e-4)


def test_sharded_decode_runs_and_agrees(cpu_devices):
    cfg = models.preset("tiny", n_kv_heads=4)
    _, _, (expect_logits, _), (next_tok, _) = decode_both_ways(
        cfg, {"data": 2, "tensor": 4}, batch=4, index=5, seed=1)
    np.testing.assert_array_equal(np.asarray(next_tok), np.argmax(expect_logits, axis=-1))


def test_70b_decode_on_8_gpus_is_hbm_bound(cpu_devices):
    system = meshes.get_system("h200:8")
    mesh = sharding.make_mesh(system, {"tensor": 8})
    cfg = models.preset("llama3-70b")
    prog = build_serve_program(cfg, mesh, sharding.default_rules(),
                               workload=models.Workload(kind="decode", seq_len=8192,
                                                        global_batch=8),
                               precision=models.Precision(params="bfloat16"))
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=system,
                           tokens_per_step=prog.tokens_per_step, calibration=BYTES_ONLY)
    # Every weight and the whole KV cache stream through HBM once per token, at the
    # measured achievable bandwidth (STREAM: 2.97 of 3.35 TB/s on H100, same ratio on H200).
    nbytes = prog.param_bytes_per_device + prog.cache_bytes_per_device
    assert nbytes == pytest.approx(70.55e9 * 2 / 8 + 2 * 80 * 8 * 8192 * 8 * 128 * 2 / 8,
                                   rel=0.01)
    ideal = nbytes / (4.8e12 * 2.97 / 3.35)
    assert rep.compute_s == pytest.approx(ideal, rel=0.05)
    assert rep.bottleneck().startswith("HBM bandwidth")
    # What the step adds on top: two tensor-parallel all-reduces per layer on the critical
    # path, each at NCCL's small-message latency.
    assert rep.step_time_s == pytest.approx(rep.compute_s + rep.comm_s, rel=0.02)
    assert rep.tokens_per_s == pytest.approx(8 / rep.step_time_s)


def test_quantised_weights_and_cache_decode_close_to_full_forward(cpu_devices):
    from models.quant import QuantWeight

    cfg = models.preset("tiny")
    for kind, tol in (("int8", 0.05), ("float8", 0.1), ("int4", 0.5)):
        precision = models.Precision(compute="float32", weights=kind, kv_cache=kind)
        model = models.make_model(cfg, precision, seed=3)
        wq = model.blocks.attn.wq
        assert isinstance(wq, QuantWeight) and wq.q[...].dtype.name.startswith(
            {"int8": "int8", "float8": "float8", "int4": "int4"}[kind])
        assert wq.scale[...].shape == (cfg.n_layers, 1, cfg.n_heads, cfg.head_dim)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (2, 12)), jnp.int32)
        full = forward(model, tokens)  # the same quantised weights, no cache
        _, (k, v) = prefill(model, tokens[:, :8])
        assert k[0].dtype == wq.q[...].dtype and k[1].shape[-1] == 1  # (q, scale)
        pad = ((0, 0), (0, 0), (0, 0), (0, 4), (0, 0))  # (N, B, K, S, E): 4 more positions
        cache = tuple((jnp.pad(c[0], pad), jnp.pad(c[1], pad)) for c in (k, v))
        for i in range(8, 12):
            logits, cache = decode(model, tokens[:, i:i + 1], cache, i)
            err = np.max(np.abs(np.asarray(logits) - np.asarray(full[:, i])))
            assert err < tol * np.max(np.abs(np.asarray(full[:, i]))), (kind, i, err)


def test_kv_cache_sharded_by_sequence_decodes_the_same(cpu_devices):
    cfg = models.preset("tiny", n_kv_heads=2)
    prog, mesh, (expect_logits, expect_cache), (next_tok, new_cache) = decode_both_ways(
        cfg, {"sequence": 4, "tensor": 2}, batch=2, index=9, seed=2)
    assert prog.args[1][0].sharding.spec[2:4] == ("tensor", "sequence")  # (N, B, K, S, E)
    np.testing.assert_array_equal(np.asarray(next_tok), np.argmax(expect_logits, axis=-1))
    np.testing.assert_allclose(np.asarray(new_cache[0]), np.asarray(expect_cache[0]), rtol=1e-4,
                               atol=1e-6)
    # Each device attends over its quarter of the positions; the softmax statistics and the
    # weighted values are combined with small all-reduces over `sequence`.
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system="h100:8")
    over_seq = [c for c in rep.collectives if "sequence" in c.mesh_axes]
    assert over_seq and {c.kind for c in over_seq} == {"all-reduce"}
    per_layer_out = 2 * cfg.n_heads // 2 * cfg.head_dim * 4  # (B, H/tp, E) f32 partial sums
    assert max(c.bytes for c in over_seq) <= per_layer_out


def test_int8_weights_and_cache_halve_70b_decode_bytes(cpu_devices):
    system = meshes.get_system("h200:8")
    mesh = sharding.make_mesh(system, {"tensor": 8})
    cfg = models.preset("llama3-70b")
    reps = {}
    for kind in ("bfloat16", "int8"):
        prog = build_serve_program(cfg, mesh, sharding.default_rules(),
                                   workload=models.Workload(kind="decode", seq_len=8192,
                                                            global_batch=8),
                                   precision=models.Precision(params="bfloat16", weights=kind,
                                                              kv_cache=kind))
        reps[kind] = (prog, sharding.analyze(prog.step, *prog.args, mesh=mesh, system=system,
                                             calibration=BYTES_ONLY))
    prog, rep = reps["int8"]
    # int8 weights (the bf16 embedding table aside) and int8 cache + one bf16 scale per
    # (position, kv head).
    embed = cfg.padded_vocab * cfg.d_model * 2 / 8
    weights = (cfg.param_count() - cfg.padded_vocab * cfg.d_model) / 8
    cache = 2 * 80 * 8 * 8192 * 8 * (128 + 2) / 8
    assert prog.param_bytes_per_device == pytest.approx(embed + weights, rel=0.01)
    assert prog.cache_bytes_per_device == pytest.approx(cache, rel=0.001)
    # The dequantisation is fused into the matmuls: the step streams the narrow bytes. What
    # it adds: the f32 attention scores of the unfused decode attention (~5%).
    nbytes = weights + cache
    ideal = nbytes / (4.8e12 * 2.97 / 3.35)
    assert rep.compute_s == pytest.approx(ideal, rel=0.1)
    # Each layer's two all-reduces of 8 tokens (and the embedding's) are latency-bound at
    # NCCL's LL ring latency on 8 GPUs, 6.6 + 2 x 7 x 0.6 us (tuning.cc), plus two 256-byte
    # all-gathers at 6.6 + 7 x 0.6: about as long as the step's HBM time.
    assert rep.comm_s == pytest.approx(161 * 15e-6 + 2 * 10.8e-6, rel=1e-9)
    bf16_bytes = reps["bfloat16"][1].compute.hbm_bytes
    assert bf16_bytes / rep.compute.hbm_bytes == pytest.approx(2, rel=0.1)
    # int4: two values a byte in memory too (numpy's itemsize for int4 is 1 byte)
    int4 = build_serve_program(cfg, mesh, sharding.default_rules(),
                               workload=models.Workload(kind="decode", seq_len=8192,
                                                        global_batch=8),
                               precision=models.Precision(params="bfloat16", weights="int4",
                                                          kv_cache="int4"))
    assert int4.param_bytes_per_device == pytest.approx(embed + weights / 2, rel=0.02)
    # 8 sequences' GEMMs stream their weights (16 FLOPs a byte in int4, far below the
    # H200's ~200): half the bytes, a faster step, not math-bound at a small GEMM's rate
    rep4 = sharding.analyze(int4.step, *int4.args, mesh=mesh, system=system,
                            calibration=BYTES_ONLY)
    assert rep4.compute.hbm_bound_matmul_s == pytest.approx(rep4.compute.matmul_s)
    assert rep4.compute.matmul_s < 0.7 * rep.compute.matmul_s
    assert int4.cache_bytes_per_device == pytest.approx(
        2 * 80 * 8 * 8192 * 8 * (128 / 2 + 2) / 8, rel=0.001)


def test_tp_decode_time_is_the_weights_and_cache_read_plus_its_all_reduces(tmp_path,
                                                                           cpu_devices):
    # A 4-layer Llama 3 8B slice decoding 32 sequences over a 4096-position cache on 8
    # H100s (TP 8). Each step reads the weights it uses (not the embedding table: only the
    # 32 rows it gathers) and the cache once, at the measured HBM bandwidth; and every
    # layer's two row-parallel matmuls end in an all-reduce of the 32 new positions'
    # activations (plus one for the vocab-sharded embedding lookup) that the next matmul
    # waits for, and the next token is the argmax over vocab-sharded logits (each device's
    # best value and index, 32 x 4 bytes each, all-gathered): those sit in series with the
    # reads.
    from experiments import config, runner

    text = """
name = "small-decode"
[model]
preset = "llama3-8b"
n_layers = 4
[system]
name = "h100:8"
[parallelism]
tensor = 8
[workload]
kind = "decode"
seq_len = 4096
global_batch = 32
[precision]
params = "bfloat16"
compute = "bfloat16"
[serving]
cuda_graphs = false  # the bytes alone: nor a CUDA graph's launch per kernel
"""
    path = tmp_path / "d.toml"
    path.write_text(text)
    exp = config.load(path)
    rep = runner.run(exp, calibration=BYTES_ONLY)
    m, system = exp.model, exp.system
    chip = system.chip
    embedding_table = m.padded_vocab * m.d_model * 2 / 8
    cache = 2 * m.n_layers * 32 * 4096 * (m.n_kv_heads // 8) * m.head_dim * 2
    reads = dict(rep.memory.components)["parameters"] - embedding_table + cache
    t_reads = reads / (chip.hbm_bytes_per_s * chip.hbm_efficiency)
    group = [list(range(8))]
    activations = 32 * m.d_model * 2  # bf16 (batch, 1, d_model)
    t_all_reduce = system.collective_time_s("all-reduce", activations, group)
    t_embedding = system.collective_time_s("all-reduce", activations, group)
    t_argmax = 2 * system.collective_time_s("all-gather", 8 * 32 * 4, group)
    expected = t_reads + 2 * m.n_layers * t_all_reduce + t_embedding + t_argmax
    assert rep.step_time_s == pytest.approx(expected, rel=0.05)
    assert rep.time_per_output_token_s == rep.step_time_s
    assert rep.tokens_per_s == pytest.approx(32 / rep.step_time_s)


def test_fp8_weights_reach_fp8_matmuls_as_stored(cpu_devices):
    # An FP8 checkpoint served with FP8 matmuls (weights = compute = "float8"): the stored
    # e4m3 values go to the GEMM and their per-channel scales to its output, so the step
    # reads each weight once, in one byte, as with bf16 matmuls over the same weights
    # (requantising the dequantised weight read it in bf16 and wrote it again: 4.5x the
    # bytes on 70B), and decodes what the bf16 matmuls do, within FP8's rounding.
    system = meshes.get_system("h100:8")
    mesh = sharding.make_mesh(system, {"tensor": 8})
    cfg = models.preset("llama3-8b")
    hbm, params, kernels = {}, {}, {}
    for compute in ("bfloat16", "float8"):
        prog = build_serve_program(cfg, mesh, sharding.default_rules(),
                                   workload=models.Workload(kind="decode", seq_len=1024,
                                                            global_batch=8),
                                   precision=models.Precision(params="bfloat16",
                                                              weights="float8",
                                                              compute=compute))
        rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=system,
                               calibration=BYTES_ONLY)
        hbm[compute], params[compute] = rep.compute.hbm_bytes, prog.param_bytes_per_device
        kernels[compute] = rep.compute.kernels
    assert params["float8"] == params["bfloat16"]
    assert hbm["float8"] == pytest.approx(hbm["bfloat16"], rel=0.05)
    # FP8 matmuls over a bf16 checkpoint: quantised once, at load, as engines do (not
    # before every token: 2.8x the bytes on 70B), so the same program as an FP8 checkpoint
    bf16_checkpoint = build_serve_program(
        cfg, mesh, sharding.default_rules(),
        workload=models.Workload(kind="decode", seq_len=1024, global_batch=8),
        precision=models.Precision(params="bfloat16", compute="float8"))
    assert bf16_checkpoint.param_bytes_per_device == params["float8"]
    # The scales are the GEMMs' epilogues (no kernel of their own); what FP8 adds is the
    # activations' per-tensor quantise of the two row-parallel inputs (out_proj, down_proj),
    # split by its amax all-reduce (known limits): at most 3 kernels a layer.
    assert kernels["float8"] - kernels["bfloat16"] <= 3 * cfg.n_layers

    tiny = models.preset("tiny")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, tiny.vocab, (2, 8)), jnp.int32)
    out = {}
    for compute in ("bfloat16", "float8"):
        model = models.make_model(tiny, models.Precision(params="bfloat16", weights="float8",
                                                         compute=compute), seed=3)
        out[compute] = np.asarray(forward(model, tokens), np.float32)
    err = np.max(np.abs(out["float8"] - out["bfloat16"]))
    assert err < 0.1 * np.max(np.abs(out["bfloat16"]))


@pytest.mark.parametrize("tied", [False, True])
def test_serving_model_flops_are_the_programs_matmuls(cpu_devices, tied):
    # Prefill projects each sequence's last position onto the vocabulary (2 x d x V once a
    # sequence, not at every position: 6% of Llama 3 8B's prefill FLOPs at 32K), and a
    # tied output projection is a matmul like an untied one. Against the compiled
    # program's matmuls, attention aside (its flash tiles compute the masked half too
    # at this length).
    from models.inference import serve_flops

    system = meshes.get_system("h100:8")
    mesh = sharding.make_mesh(system, {"data": 8})
    cfg = models.preset("tiny", tie_embeddings=tied)
    for kind in ("prefill", "decode"):
        w = models.Workload(kind=kind, seq_len=256, global_batch=8)
        prog = build_serve_program(cfg, mesh, sharding.default_rules(), workload=w,
                                   precision=models.Precision(params="bfloat16"))
        rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=system)
        matmuls = 8 * sum(d["flops"] for (op, k), d in rep.compute.ops.items()
                          if k == "matmul" and "flash_attention" not in op
                          and "attention (" not in op)
        attended = w.seq_len / 2 if kind == "prefill" else w.seq_len + 1
        positions = w.seq_len if kind == "prefill" else 1
        attention = (4 * cfg.n_layers * cfg.n_heads * cfg.attention_head_dim * attended
                     * positions * w.global_batch)
        assert matmuls == pytest.approx(serve_flops(cfg, w) - attention, rel=0.01), kind
