"""GPU frameworks' fused kernels (sharding/kernel_scopes.py) against hand counts: on a GPU
the ops of one fused scope are one kernel that reads its inputs and writes its outputs
once; a TPU keeps the compiler-style fusion, which ends a kernel at each reduction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshes
from models import kernels
from models.fp8 import _per_tensor_e4m3
from sharding.compiler import compile_to_hlo
from sharding.compute import compute_cost
from sharding.hlo import parse_hlo

H100 = meshes.get_system("h100:8").chip
V5E = meshes.get_system("tpu-v5e:2x2").chip
T, D = 4096, 2048  # tokens, model width
X = jax.ShapeDtypeStruct((T, D), jnp.bfloat16)
SCALE = jax.ShapeDtypeStruct((D,), jnp.float32)


def memory_bound(fn, *args, chip):
    """(HBM bytes, kernels) of the memory-bound kernels of fn's program on `chip`: as
    lowered, or after SPMD partitioning (as the CPU path reads it) when it is sharded."""
    sharded = any(getattr(a, "sharding", None) is not None for a in args)
    text = compile_to_hlo(fn, *args).hlo_text if sharded else \
        jax.jit(fn).lower(*args).as_text(dialect="hlo", debug_info=True)
    c = compute_cost(parse_hlo(text), chip)
    matmuls = [d for (_, kind), d in c.ops.items() if kind == "matmul"]
    return c.hbm_bytes - sum(d["bytes"] for d in matmuls), c.kernels - len(matmuls)


def hbm_bytes(fn, *args, chip):
    return memory_bound(fn, *args, chip=chip)[0]


# The per-token f32 statistic (a norm's reciprocal RMS, a quantise's amax) reaches the
# elementwise ops through a broadcast, which the model counts as written and read back:
# 2 x 4 bytes per token (0.2% of a norm's bytes at this width).
STAT = 2 * T * 4


def test_a_norm_is_one_kernel_on_a_gpu_and_two_on_a_tpu():
    def rms_norm(x, scale):
        return kernels.norm(x, scale, None, "rmsnorm")

    x, scale = T * D * 2, D * 4  # bf16 input, f32 scale
    # Transformer Engine's RMSNorm: reads x and the scale, writes y (bf16) once (the
    # reduction's combiner is part of it, not a kernel of its own).
    assert memory_bound(rms_norm, X, SCALE, chip=H100) == (
        pytest.approx(x + scale + x + STAT), 1)
    # The compiler-style fusion: the reduction's kernel also reads x, scales and writes y,
    # but the per-token statistic is a kernel of its own between (written, read, written).
    assert memory_bound(rms_norm, X, SCALE, chip=V5E) == (
        pytest.approx(x + scale + x + STAT + 2 * T * 4), 2)


def test_a_quantise_of_a_norms_output_is_the_norms_kernel_on_a_gpu():
    def norm_fp8(x, scale):
        return _per_tensor_e4m3(kernels.norm(x, scale, None, "rmsnorm"))

    # Transformer Engine's LayerNormLinear: the norm writes its output in FP8 (1 byte per
    # element) and the f32 scale; no bf16 copy of it, no second pass for the amax.
    assert hbm_bytes(norm_fp8, X, SCALE, chip=H100) == pytest.approx(
        T * D * 2 + D * 4 + T * D * 1 + STAT, abs=64)  # and a few scalars


def test_an_fp8_gemms_output_scale_and_cast_are_its_epilogue_on_a_gpu():
    a = jax.ShapeDtypeStruct((T, D), jnp.float8_e4m3fn)
    b = jax.ShapeDtypeStruct((D, D), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((), jnp.float32)

    def gemm(a, b, s):
        return (jnp.dot(a, b, preferred_element_type=jnp.float32) * s).astype(jnp.bfloat16)

    # cuBLASLt scales the f32 accumulator and writes bf16: no kernel of its own on a GPU;
    # on a TPU-style count, a pass reads the f32 result and writes the bf16 one.
    assert hbm_bytes(gemm, a, b, s, chip=H100) == 0
    assert hbm_bytes(gemm, a, b, s, chip=V5E) == pytest.approx(T * D * 4 + 4 + T * D * 2)


def test_a_scan_stacking_a_matmuls_output_moves_no_bytes_of_its_own_on_a_gpu(cpu_devices):
    mesh = Mesh(np.array(cpu_devices[:8]), ("data",))  # tokens split 8 ways: T / 8 each
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((D, D), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def layers(x, w):
        def layer(h, _):
            h = h @ w
            return h, h  # each layer's output stacked (what a backward pass reads)
        return jax.lax.scan(layer, x, None, length=4)[1]

    h = T // 8 * D * 2  # one layer's output per device, bf16
    # A GPU framework keeps the tensor its GEMM wrote; a compiler-style count copies it
    # into the stack: reads it and writes it, per layer.
    assert hbm_bytes(layers, x, w, chip=H100) < 1e3
    assert hbm_bytes(layers, x, w, chip=V5E) == pytest.approx(4 * 2 * h, rel=1e-3)


def test_a_stage_s_weights_handed_to_its_layer_loop_are_not_copied_on_a_gpu(cpu_devices):
    # A pipeline tick slices its stage's stacked layer weights and hands them to the loop
    # over its layers. A GPU framework passes the tensor; XLA copies the slice into the
    # loop's buffer (read and written once per tick).
    mesh = Mesh(np.array(cpu_devices[:8]), ("data",))
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((2, 4, 256, D), jnp.bfloat16,  # 2 stages x 4 layers
                             sharding=NamedSharding(mesh, P()))

    def ticks(x, w):
        def tick(h, i):
            stage_w = jax.lax.dynamic_index_in_dim(w, i, keepdims=False)
            def layer(h, w_l):  # a cheap layer: its weights' column sums scale h
                return h * jnp.sum(w_l, axis=0).astype(h.dtype), None
            return jax.lax.scan(layer, h, stage_w)[0], None
        return jax.lax.scan(tick, x, jnp.arange(2))[0]

    stage = 4 * 256 * D * 2  # one stage's weights, bf16
    gpu, tpu = hbm_bytes(ticks, x, w, chip=H100), hbm_bytes(ticks, x, w, chip=V5E)
    assert tpu - gpu == pytest.approx(2 * 2 * stage, rel=0.01)  # 2 ticks, read + write


def test_a_stage_s_weights_indexed_under_vmap_are_not_copied_on_a_gpu(cpu_devices):
    # The same, with the index vmapped over the pipeline's stage dimension (one stage per
    # device), as models/pipeline.py runs it: XLA makes the slice a gather of one slice.
    mesh = Mesh(np.array(cpu_devices[:8]), ("data",))
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((1, 2, 4, 256, D), jnp.bfloat16,  # 1 stage x 2 chunks x 4
                             sharding=NamedSharding(mesh, P()))

    def ticks(x, w):
        def tick(h, i):
            index = jax.vmap(lambda w_s, j: jax.lax.dynamic_index_in_dim(w_s, j, keepdims=False))
            stage_w = index(w, jnp.full((1,), i))[0]
            def layer(h, w_l):
                return h * jnp.sum(w_l, axis=0).astype(h.dtype), None
            return jax.lax.scan(layer, h, stage_w)[0], None
        return jax.lax.scan(tick, x, jnp.arange(2))[0]

    text = compile_to_hlo(ticks, x, w).hlo_text
    assert "gather(" in text
    stage = 4 * 256 * D * 2
    gpu, tpu = hbm_bytes(ticks, x, w, chip=H100), hbm_bytes(ticks, x, w, chip=V5E)
    assert tpu - gpu == pytest.approx(2 * 2 * stage, rel=0.01)


def test_an_fp8_scales_amax_is_reduced_over_the_tensor_group_only_on_a_gpu(cpu_devices):
    # Per-tensor FP8 scales of an activation split over data x tensor and of one split
    # over data: the program all-reduces each amax over every shard. Transformer Engine
    # scales each GPU's own tensor, reducing the amax over the tensor group only: on a GPU
    # the first is timed over its tensor pair, the second not at all; a TPU runs both.
    from meshes import get_system
    from sharding.api import analyze_module

    mesh = Mesh(np.array(cpu_devices).reshape(4, 2), ("data", "tensor"))
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("data", "tensor")))
    y = jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    text = compile_to_hlo(lambda x, y: (_per_tensor_e4m3(x), _per_tensor_e4m3(y)),
                          x, y).hlo_text

    def amaxes(system):
        rep = analyze_module(parse_hlo(text), system=get_system(system), mesh_shape=(4, 2),
                             axis_names=("data", "tensor"))
        return {c.mesh_axes: c for c in rep.collectives if c.kind == "all-reduce"}

    gpu, tpu = amaxes("h100:8"), amaxes("tpu-v5e:4x2")
    assert set(gpu) == set(tpu) == {("data", "tensor"), ("data",)}
    assert all(c.bytes == 4 for c in gpu.values())  # the program's bytes, as counted
    pair = get_system("h100:8").collective_timing("all-reduce", 4, [[0, 1], [2, 3]])
    assert gpu["data", "tensor"].time_s == pytest.approx(pair.time_s)
    assert gpu["data", "tensor"].algorithm.endswith("over tensor only")
    assert gpu["data",].time_s == 0 and "not run" in gpu["data",].algorithm
    assert all(c.time_s > 0 for c in tpu.values())


def test_small_weight_gradients_share_a_megatron_bucket_on_a_gpu(cpu_devices):
    # The gradients of two weights replicated over data are summed over data: on a TPU each
    # as its own all-reduce; on a GPU, as Megatron sums them, in buckets of max(40M, 1M x
    # dp) parameters: both fit one, one all-reduce of their bytes (its latency paid once),
    # each taking its bytes' share of its time.
    from meshes import get_system
    from sharding.api import analyze_module

    mesh = Mesh(np.array(cpu_devices).reshape(4, 2), ("data", "tensor"))
    w1 = jax.ShapeDtypeStruct((D, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    w2 = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

    def loss(w1, w2, x):
        return jnp.sum(((x @ w1) @ w2).astype(jnp.float32) ** 2)

    text = compile_to_hlo(jax.grad(loss, argnums=(0, 1)), w1, w2, x).hlo_text

    def grad_sums(system, gradient_buckets=True):
        rep = analyze_module(parse_hlo(text), system=get_system(system), mesh_shape=(4, 2),
                             axis_names=("data", "tensor"), gradient_buckets=gradient_buckets)
        return [c for c in rep.collectives if c.mesh_axes == ("data",)]

    gpu, tpu = grad_sums("h100:8"), grad_sums("tpu-v5e:4x2")
    assert sorted(c.bytes for c in gpu) == sorted(c.bytes for c in tpu) == [256 * 128 * 2,
                                                                          D * 256 * 2]
    h100 = get_system("h100:8")
    total = sum(c.bytes for c in gpu)
    one = h100.collective_timing("all-reduce", total, [list(g) for g in gpu[0].groups])
    for c in gpu:
        assert c.time_s == pytest.approx(one.time_s * c.bytes / total)
        assert c.algorithm.endswith("in buckets")
    assert not any(c.algorithm.endswith("in buckets") for c in tpu)
    alone = sum(h100.collective_timing("all-reduce", c.bytes, [list(g) for g in c.groups]
                                       ).time_s for c in gpu)
    assert sum(c.time_s for c in gpu) == pytest.approx(one.time_s) and one.time_s < alone
    # Only where the caller says the program is such a framework's step (the experiment
    # runner): otherwise each sum is the collective the program runs, timed alone.
    plain = grad_sums("h100:8", gradient_buckets=False)
    assert sum(c.time_s for c in plain) == pytest.approx(alone)
    assert not any(c.algorithm.endswith("in buckets") for c in plain)


def test_an_fp8_weight_cast_runs_once_per_step_in_a_gpu_pipeline():
    # The program casts a weight to FP8 at every use; Transformer Engine once per step,
    # keeping the copy for the other microbatches: in a pipeline of M V + P - 1 ticks, V of
    # them. The cast is a kernel of its own scope, scaled by that share on a GPU only.
    from models.fp8 import fp8_einsum
    from sharding.compute import time_work, work
    from sharding.gpu_frameworks import weight_cast_share as _weight_cast_share

    w = jax.ShapeDtypeStruct((D, 8192), jnp.bfloat16)
    text = jax.jit(lambda x, w: fp8_einsum("td,df->tf", x, w)).lower(X, w).as_text(
        dialect="hlo", debug_info=True)
    works = work(parse_hlo(text))
    casts = [k for wk in works.values() for k in wk.gpu_kernels or () if k.weight_cast]
    cast_bytes = sum(k.nbytes for k in casts)
    assert cast_bytes >= D * 8192 * (2 + 1)  # reads bf16 (amax, then cast), writes e4m3

    def memory_s(chip, share):
        costs = time_work(works, chip, weight_cast_share=share)
        return sum(c.memory_bound_s for c in costs.values())

    cast_s = cast_bytes / (H100.hbm_bytes_per_s * H100.hbm_efficiency)
    assert memory_s(H100, 1.0) - memory_s(H100, 0.25) == pytest.approx(0.75 * cast_s)
    assert memory_s(V5E, 0.25) == memory_s(V5E, 1.0)
    # P 4 x V 2 x M 8: 19 ticks, 2 casts of each chunk's weights a step
    assert _weight_cast_share({"virtual_stages": 2, "ticks": 8 * 2 + 4 - 1}) == 2 / 19
    assert _weight_cast_share(None) == 1.0


def test_the_data_parallel_overlap_chunks_by_virtual_stage_or_by_bucket():
    # Megatron's overlap_grad_reduce / overlap_param_gather: with an interleaved pipeline one
    # chunk per virtual stage, spread over (V - 1) P ticks; otherwise one per gradient
    # bucket (1.6 G bf16 parameters over 8 ranks: 40 buckets of 40M).
    from sharding.collectives import Collective
    from sharding.gpu_frameworks import BUCKET_PARAMS, data_parallel_overlap
    from sharding.schedule import Chunked

    def coll(kind, name, scope, axes=("data",), nbytes=3_200_000_000):
        return Collective(kind=kind, name=name, dtype="bfloat16", shape=(nbytes // 2,),
                          bytes=nbytes, wire_bytes=0.0, count=1, group_size=8, groups=(),
                          mesh_axes=axes, op_name=f"jit(step)/{scope}/op", computation="main")

    rs, ag = (coll("reduce-scatter", "rs", "gradient_sum"),
              coll("all-gather", "ag", "optimizer"))
    others = [coll("reduce-scatter", "tp", "gradient_sum", ("tensor",)),
              coll("all-gather", "mlp", "mlp")]
    pipe = {"stages": 4, "virtual_stages": 3, "ticks": 4 * 3 * 8 + 3}
    got = data_parallel_overlap([rs, ag, *others], pipeline=pipe, grad_reduce=True,
                                param_gather=True)
    assert got == {("main", "rs"): Chunked(3, True, 8.0), ("main", "ag"): Chunked(3, False, 8.0)}
    got = data_parallel_overlap([rs, ag, *others], pipeline=None, grad_reduce=True,
                                param_gather=False)
    assert got == {("main", "rs"): Chunked(3_200_000_000 // (BUCKET_PARAMS * 2), True, None)}
    assert data_parallel_overlap([rs, ag], pipeline=None, grad_reduce=False,
                                 param_gather=False) == {}
    # The run's own bucket size (Megatron's --ddp-bucket-size): 400M parameters, 4 chunks.
    got = data_parallel_overlap([rs], pipeline=None, grad_reduce=True, param_gather=False,
                                bucket_size=400_000_000)
    assert got == {("main", "rs"): Chunked(4, True, None)}


def test_megatron_waits_for_stage_transfers_only_in_the_warm_up_and_flush():
    # overlap_p2p_comm: of an interleaved pipeline's stage transfers, the share a stage's
    # warm-up (and flush) holds of its M V chunks: (P - 1) 2 + (V - 1) P on the first stage
    # (Megatron's num_warmup_microbatches). Other permutes (context parallelism's ring) and
    # a plain pipeline (Megatron's batched, blocking p2p) are left as they run.
    from sharding.collectives import Collective
    from sharding.gpu_frameworks import overlapped_stage_transfers

    def permute(name, scope):
        return Collective(kind="collective-permute", name=name, dtype="bfloat16",
                          shape=(1024,), bytes=2048, wire_bytes=2048.0, count=100,
                          group_size=2, groups=(), mesh_axes=("pipeline",),
                          op_name=f"jit(step)/while/body/{scope}/concatenate",
                          computation="body")

    transfers = [permute("fwd", "stage_transfer"), permute("ring", "attention")]
    pipe = {"stages": 8, "virtual_stages": 8, "microbatches": 144}
    assert overlapped_stage_transfers(transfers, pipe) == {
        ("body", "fwd"): pytest.approx((7 * 2 + 7 * 8) / (144 * 8))}
    # few microbatches: the warm-up is all of it
    assert overlapped_stage_transfers(transfers, {**pipe, "microbatches": 8}) == {
        ("body", "fwd"): 1.0}
    assert overlapped_stage_transfers(transfers, {**pipe, "virtual_stages": 1}) == {}
    assert overlapped_stage_transfers(transfers, None) == {}


@pytest.mark.parametrize("pipeline", [True, False])
def test_weight_gradient_accumulation_is_the_gemm_s_epilogue_on_a_gpu(cpu_devices, pipeline):
    # Across a pipeline's ticks (or gradient accumulation's micro-steps) the program adds
    # each layer weight's gradient, as the layers' loop returns it, into a loop-carried sum:
    # a memory-bound kernel per weight and tick, as XLA runs it (a TPU). Megatron's
    # weight-gradient GEMM accumulates into main_grad in its epilogue
    # (gradient_accumulation_fusion): on a GPU none is a kernel of its own.
    import meshes as _meshes
    import sharding
    from sharding.compute import execution_counts, work
    from tests.steps import tiny, train_program

    h100 = _meshes.get_system("h100:8")
    axes = {"data": 2, "pipeline": 4} if pipeline else {"data": 8}
    mesh = sharding.make_mesh(h100, axes)
    prog = train_program(tiny(n_layers=8), mesh, seq_len=16, global_batch=32,
                         microbatches=4, compute="float32")
    with jax.set_mesh(mesh):
        module = parse_hlo(compile_to_hlo(prog.step, *prog.args).hlo_text)
    counts = execution_counts(module)
    per_tick = 7 if pipeline else 4  # M + P - 1 ticks, or the micro-steps
    # the layer weights' gradient sums: 9 per layer group (q, k, v, out, gate, up, down and
    # two norms), each its own kernel in the loop on a TPU...
    works = {c: w for c, w in work(module).items() if counts[c] == per_tick}
    weights = {"add_any", "add"}

    def sums(kernels):
        return [k for k in kernels if k.op.split(" ")[0] in weights and k.nbytes >= 1536]

    tpu = [k for w in works.values() for k in sums(w.kernels)]
    gpu = [k.last for w in works.values() for k in sums(w.gpu_kernels or ())]
    assert len(tpu) >= 9
    # ... none on a GPU: what is left is at most the output layer's and the embedding's,
    # whose gradients do not come out of the layers' loop
    assert set(gpu) <= {k.last for k in tpu} and len(tpu) - len(gpu) >= 9
    assert len(gpu) <= 2
