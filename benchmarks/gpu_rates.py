"""The two ceilings of the GPU present, measured through JAX as a step uses them: the matmul
rate of the GEMM shapes four Llama 3 8B layers run (4 x 4096 tokens), in bf16 and FP8, and
a large device-to-device copy (bytes read + written). Run by benchmarks/measure_gpu.sh; the
matmul rates set the measured step beside the catalog's peak x fitted efficiency.

Random inputs (never zeros), several input sets rotated (beyond the L2), warm-up first, the
median of timed repeats, blocking on each result.
"""
from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp

TOKENS = 4 * 4096
# (name, m, k, n): the layer's GEMMs, forward (the backward's are the same sizes transposed)
SHAPES = (("qkv", TOKENS, 4096, 6144), ("out", TOKENS, 4096, 4096),
          ("gate_up", TOKENS, 4096, 28672), ("down", TOKENS, 14336, 4096),
          ("square", 8192, 8192, 8192))
SETS = 3
REPEATS = 10


def _median_time(fn, inputs) -> float:
    for args in inputs:
        fn(*args).block_until_ready()
    times = []
    for i in range(REPEATS):
        args = inputs[i % len(inputs)]
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rates(dtype) -> list[tuple[str, float]]:
    key = jax.random.key(0)
    fp8 = dtype == jnp.float8_e4m3fn
    rows = []
    for name, m, k, n in SHAPES:
        inputs = []
        for _ in range(SETS):
            key, ka, kb = jax.random.split(key, 3)
            a = jax.random.normal(ka, (m, k), jnp.bfloat16).astype(dtype)
            b = jax.random.normal(kb, (k, n), jnp.bfloat16).astype(dtype)
            inputs.append((a, b))
        if fp8:  # a scaled FP8 GEMM as XLA:GPU matches it to cuBLASLt (unit scales)
            fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
        else:
            fn = jax.jit(lambda a, b: a @ b)
        t = _median_time(fn, inputs)
        rows.append((name, 2 * m * k * n / t))
        del inputs
    return rows


def copy_rate() -> float:
    n = 2 * 2**30 // 4  # 2 GiB of f32
    key = jax.random.key(1)
    inputs = [(jax.random.normal(k, (n,), jnp.float32),) for k in jax.random.split(key, 2)]
    t = _median_time(jax.jit(lambda v: v * 1.5), inputs)
    return 2 * n * 4 / t


def main() -> None:
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__)
    print(f"copy  {copy_rate() / 1e12:.2f} TB/s (read + write, 2 GiB f32)")
    for label, dtype in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        try:
            rows = matmul_rates(dtype)
        except Exception as e:  # noqa: BLE001 -- an FP8 GEMM the backend refuses: say so
            print(f"{label}: failed: {str(e).splitlines()[0]}")
            continue
        for name, rate in rows:
            print(f"{label:5} {name:8} {rate / 1e12:7.1f} TFLOP/s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
