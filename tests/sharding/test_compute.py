"""The compute model (sharding/compute.py) against hand calculations."""

import jax
import jax.numpy as jnp
import pytest

import meshes
from meshes.calibration import Calibration
from sharding.compute import compute_cost
from sharding.hlo import parse_hlo
from tests.conftest import DATA

H100 = meshes.get_system("h100:8").chip


def cost_of(fn, *args):
    return compute_cost(parse_hlo(jax.jit(fn).lower(*args).as_text(dialect="hlo")), H100)


def test_single_large_matmul_is_compute_bound():
    a = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
    c = cost_of(lambda a, b: a @ b, a, b)
    flops = 2 * 4096 * 8192 * 2048
    assert c.matmul_flops == flops
    # 989 TFLOP/s bf16 x 0.80 large-matmul efficiency, scaled to this size (4096^3
    # equivalent) by the measured GEMM curve: 1217 / 1290 of the 8192^3 figure. The
    # ~109 MB of operands take less time.
    assert c.matmul_s == pytest.approx(flops / (989e12 * 0.80 * 1217 / 1290))
    assert c.memory_bound_s == 0


def test_skinny_matmul_is_memory_bound():
    a = jax.ShapeDtypeStruct((8, 8192), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
    c = cost_of(lambda a, b: a @ b, a, b)
    io = (8 * 8192 + 8192 * 8192 + 8 * 8192) * 2
    assert c.matmul_s == pytest.approx(io / (3.35e12 * 2.97 / 3.35))


def test_the_model_applies_a_calibration_exactly():
    # One 4096 x 8192 x 2048 bf16 matmul on H100: the catalog rate 989 TFLOP/s x 0.80 x
    # the size curve (1217 / 1290 at 4096^3-equivalent); calibrated, 0.6 instead of 0.80,
    # plus 5 us for the kernel.
    a = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
    module = parse_hlo(jax.jit(lambda a, b: a @ b).lower(a, b).as_text(dialect="hlo"))
    flops = 2 * 4096 * 8192 * 2048
    cal = Calibration(gpu_bf16_matmul_efficiency=0.6, kernel_overhead_s=5e-6)
    plain, fitted = compute_cost(module, H100), compute_cost(module, H100, calibration=cal)
    assert plain.matmul_s == pytest.approx(flops / (989e12 * 0.80 * 1217 / 1290))
    assert fitted.matmul_s == pytest.approx(flops / (989e12 * 0.6 * 1217 / 1290) + 5e-6)
    assert fitted.kernels == 1 and fitted.math_s_by_class == {
        "gpu_bf16": pytest.approx(flops / (989e12 * 0.6 * 1217 / 1290))}


def test_a_chips_own_kernel_overhead_replaces_the_fitted_one():
    # host-cpu measures its own fixed time per kernel (meshes/host.py): the matmul and the
    # two kernels of x / sum(x) each pay it, and the calibration's (fitted on GPU and TPU
    # runs) is neither paid nor counted as kernels for the fit to scale.
    import dataclasses

    a = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    module = parse_hlo(jax.jit(lambda a: (a / jnp.sum(a, axis=-1, keepdims=True)) @ a)
                       .lower(a).as_text(dialect="hlo"))
    cal = Calibration(kernel_overhead_s=5e-6)
    own = dataclasses.replace(H100, kernel_overhead_s=1e-3)
    base, c = compute_cost(module, H100), compute_cost(module, own, calibration=cal)
    assert c.compute_s == pytest.approx(base.compute_s + 3 * 1e-3)
    assert c.kernels == 0 and c.overhead_s == 0
    assert compute_cost(module, H100, calibration=cal).kernels == 3


def test_a_cuda_graph_launch_replaces_the_fitted_time_per_kernel():
    # A serving engine's decode replayed as a CUDA graph (serving.cuda_graphs): the matmul
    # and the two kernels of x / sum(x) each pay the 1.3 us launch measured under CUDA
    # graphs on an H100 in place of the fitted 13.6 us: 3 x 12.3 us less, the same bytes.
    from meshes.chips import CUDA_GRAPH_KERNEL_S
    from sharding.compute import time_work, work
    from sharding.loops import execution_counts

    a = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    module = parse_hlo(jax.jit(lambda a: (a / jnp.sum(a, axis=-1, keepdims=True)) @ a)
                       .lower(a).as_text(dialect="hlo"))
    cal = Calibration(kernel_overhead_s=13.6e-6)
    fitted = compute_cost(module, H100, calibration=cal)
    graphs = compute_cost(None, H100, counts=execution_counts(module), costs=time_work(
        work(module), H100, calibration=cal, kernel_overhead_s=CUDA_GRAPH_KERNEL_S))
    assert fitted.kernels == graphs.kernels == 3
    assert graphs.overhead_s == pytest.approx(3 * 1.3e-6)
    assert graphs.compute_s == pytest.approx(fitted.compute_s - 3 * (13.6e-6 - 1.3e-6))
    assert graphs.hbm_bytes == fitted.hbm_bytes


def test_elementwise_chain_is_one_kernel():
    # exp(x) * 2 + 1 over 256 MiB of f32: one fused kernel reads x once and writes once,
    # whatever the chain's length, at the measured STREAM bandwidth (2.97 TB/s).
    x = jax.ShapeDtypeStruct((64 * 2**20,), jnp.float32)
    c = cost_of(lambda x: jnp.exp(x) * 2 + 1, x)
    nbytes = 64 * 2**20 * 4
    assert c.hbm_bytes == 2 * nbytes
    assert c.memory_bound_s == pytest.approx(2 * nbytes / 2.97e12)


def test_reduction_ends_a_kernel():
    # x / sum(x): one kernel reduces (reads x), another divides (reads x, writes out).
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    c = cost_of(lambda x: x / jnp.sum(x, axis=-1, keepdims=True), x)
    nbytes = 4096 * 4096 * 4
    small = 4096 * 4
    assert c.hbm_bytes == pytest.approx(3 * nbytes + 2 * small)


def test_slices_read_only_what_they_keep():
    x = jax.ShapeDtypeStruct((64, 1024, 1024), jnp.float32)
    c = cost_of(lambda x: x[3] * 2.0, x)
    assert c.hbm_bytes == 2 * 1024 * 1024 * 4


def test_adding_an_update_into_zeros_accumulates_in_place():
    # The gradient of a slice read in a loop: acc + dynamic_update_slice(zeros, u, i). XLA
    # rewrites it to update acc's slice in place, so the kernel reads u and acc's slice and
    # writes the slice: 3 |u|, not the whole accumulator twice.
    acc = jax.ShapeDtypeStruct((64, 1024, 1024), jnp.float32)
    u = jax.ShapeDtypeStruct((1, 1024, 1024), jnp.float32)
    c = cost_of(lambda acc, u, i: acc + jax.lax.dynamic_update_slice(
        jnp.zeros_like(acc), u, (i, 0, 0)), acc, u, 3)
    assert c.hbm_bytes == 3 * 1024 * 1024 * 4 + 4  # and the s32 index


def test_a_transpose_or_a_sum_of_size_one_dimensions_is_a_view():
    # Moving a size-1 dimension (the leading one a vmap adds per device) changes no byte's
    # place: XLA makes it a bitcast, no kernel. A real transpose reads and writes.
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    nbytes = 1024 * 1024 * 4
    assert cost_of(lambda x: jnp.transpose(x[None], (1, 0, 2)), x).hbm_bytes == 0
    assert cost_of(lambda x: x.T, x).hbm_bytes == 2 * nbytes
    # and so is a sum over dimensions of size 1 (a device's one tensor rank's partial
    # sums): XLA's simplifier makes it a reshape
    assert cost_of(lambda x: jnp.sum(x[None], axis=0), x).hbm_bytes == 0
    assert cost_of(lambda x: jnp.sum(x, axis=0), x).hbm_bytes == nbytes + 1024 * 4


def test_matmul_flops_agree_across_compilers():
    # The same 4-layer train step compiled by XLA:CPU (post-SPMD), the TPU compiler (which
    # writes einsums as padded convolutions) and XLA:GPU: the same FLOPs per device.
    from tests.conftest import DATA

    flops = {}
    for name in ("cpu-after-spmd", "tpu-v5e", "gpu-h100"):
        module = parse_hlo((DATA / f"train_step.{name}.hlo").read_text())
        flops[name] = compute_cost(module, H100).matmul_flops
    assert flops["tpu-v5e"] == flops["cpu-after-spmd"] == flops["gpu-h100"]


def test_small_matmuls_run_below_the_large_matmul_rate():
    from meshes.chips import size_factor

    assert size_factor("gpu", 8192) == 1.0
    # below 4096^3 the measured shortfall is a kernel's fixed time (kernel_overhead_s)
    assert size_factor("gpu", 1024) == size_factor("gpu", 4096) == pytest.approx(1217 / 1290)
    assert size_factor("gpu", 16384) == pytest.approx(1377 / 1290)
    assert H100.efficiency_for("bfloat16", 2048) < H100.efficiency_for("bfloat16", 8192)
    # v6e: the tpu-recipes bf16 8192^3 matmul microbenchmark measured 827 of the chip's
    # 920 TFLOP/s (shared/reference/collectives.md, achieved compute on real chips); at
    # 8192 the size curve is 1.
    tpu = meshes.get_system("tpu-v6e:2x4").chip
    assert tpu.efficiency_for("bfloat16", 8192) == pytest.approx(827 / 920)


# A scheduled XLA:GPU module as a real GPU's autotuner leaves it: one GEMM a cuBLAS call
# (its output and workspace a tuple), one a cuBLASLt FP8 call (the scales as operands), a
# batched one with the dimension numbers at the top of the config, as older dumps write it.
_CUBLAS = (DATA / "cublas_gemms.hlo").read_text()


def test_library_gemm_calls_are_matmuls_with_their_flops_and_format():
    # A real GPU's XLA:GPU runs many GEMMs as cuBLAS / cuBLASLt calls: each is a matmul of
    # 2 * M * N * K FLOPs in its operands' format, its workspace not an output.
    from sharding.compute import work

    [w] = [w for w in work(parse_hlo(_CUBLAS)).values() if w.matmuls]
    got = {m.name: (m.flops, m.dtype) for m in w.matmuls}
    assert got == {"gemm": (2 * 4096 * 2048 * 8192, "bfloat16"),
                   "f8": (2 * 4096 * 2048 * 8192, "float8_e4m3fn"),
                   "bmm": (2 * 8 * 512 * 512 * 64, "float32")}
    assert H100.peak_for("float8_e4m3fn") == H100.peak_for("float8") > 1.9 * H100.peak_for(
        "bfloat16")
    gemm = next(m for m in w.matmuls if m.name == "gemm")
    assert gemm.io == (4096 * 8192 + 8192 * 2048 + 4096 * 2048) * 2
    c = compute_cost(parse_hlo(_CUBLAS), H100)
    assert c.matmul_flops == 2 * (2 * 4096 * 2048 * 8192) + 2 * 8 * 512 * 512 * 64
    assert c.memory_bound_s == 0


def test_a_reductions_combiner_is_not_a_kernel_of_its_own():
    # jnp.max / jnp.sum apply a scalar combiner computation (the reduce's `to_apply`) to
    # its elements: it is part of the reduce's kernel, not one more kernel per execution
    # (each paying the fixed per-kernel cost); a `call`'s to_apply is a body that runs.
    from sharding.compute import work

    def f(x):
        return jax.lax.scan(lambda c, r: (c + jnp.max(r) + jnp.sum(r), None), 0.0, x)[0]

    module = parse_hlo(jax.jit(f).lower(jnp.zeros((10, 1024), jnp.float32)).as_text(
        dialect="hlo", debug_info=True))
    combiners = {callee for callee, sites in module.call_sites.items()
                 if all(inst.opcode == "reduce" for _, inst, _ in sites)}
    assert len(combiners) >= 2  # max's and sum's
    works = work(module)
    assert not combiners & set(works)
    body = [w for w in works.values() if any(k.op.startswith("reduce_max")
                                             for k in w.kernels)]
    assert body  # the reduces themselves are still kernels, in the loop's body


def test_a_transposed_weight_feeding_a_matmul_is_read_where_it_lies():
    # One device: the HLO is read before XLA's simplifier, which folds a transpose into
    # the dot that reads it (as a GEMM's transposed-operand flag does); the transpose is
    # no kernel of its own and moves no bytes beyond the matmul's operand.
    import sharding

    system = meshes.get_system("h100:1")
    mesh = sharding.make_mesh(system, {})

    def project(x_BHE, w_HED):
        w_EHD = jnp.transpose(w_HED, (1, 0, 2))  # the einsum's operand order, made real
        return jnp.einsum("beh,ehd->bd", jnp.swapaxes(x_BHE, 1, 2), w_EHD)

    x = jax.ShapeDtypeStruct((8, 64, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 128, 8192), jnp.bfloat16)
    rep = sharding.analyze(project, x, w, mesh=mesh, system=system)
    weight = 64 * 128 * 8192 * 2
    assert rep.compute.hbm_bytes < 1.1 * weight


def test_a_tpu_op_pays_the_chips_time_per_op_on_every_path():
    # A TPU sequences its program's ops itself (meshes/chips.py program_op_s): the matmul
    # and the two kernels of x / sum(x) each pay the chip's time per op, whatever the
    # calibration's fitted kernel_overhead_s, through compute_cost as through analyze; the
    # kernels stay counted (the report names them).
    import dataclasses

    a = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    module = parse_hlo(jax.jit(lambda a: (a / jnp.sum(a, axis=-1, keepdims=True)) @ a)
                       .lower(a).as_text(dialect="hlo"))
    tpu = meshes.get_system("tpu-v6e:2x4").chip
    none = dataclasses.replace(tpu, program_op_s=0.0)
    cal = Calibration(kernel_overhead_s=5e-5)
    base, c = compute_cost(module, none, calibration=cal), compute_cost(module, tpu,
                                                                         calibration=cal)
    assert c.compute_s == pytest.approx(base.compute_s + 3 * tpu.program_op_s)
    assert c.kernels == 3
