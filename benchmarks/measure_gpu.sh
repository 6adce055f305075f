#!/usr/bin/env bash
# `shardscope measure` on one GPU, measured beside the estimate: what docs/measure.md's
# H200 figures came from. Run from the repository root on a machine with one NVIDIA GPU and
# JAX with its CUDA plugin installed: OUT=folder bash benchmarks/measure_gpu.sh
# (NAME defaults to h200; set NAME=h100 on an H100).
set -uo pipefail
OUT=${OUT:-measure-gpu}
NAME=${NAME:-h200}
mkdir -p "$OUT"
export PYTHONPATH=$PWD XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/shardscope-cache} PYTHONUNBUFFERED=1
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" 2>&1 | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUT/versions.txt"
run() {  # label, then the measure arguments
  local label=$1; shift
  timeout 240 python3 -m experiments.cli measure "$@" --steps 5 --warmup 2 \
    --profile "/tmp/trace-$label" --json "$OUT/$label.json" --quiet 2>&1 | tee "$OUT/$label.txt"
}
# the tiny model: the whole loop on one GPU in seconds
run tiny tiny-h100-dp-tp --set "system.name=\"$NAME:1\"" --set parallelism.data=1 \
  --set parallelism.tensor=1
# four Llama 3 8B layers, 4 sequences of 4096 tokens, bf16 weights and matmuls
run llama-bf16 tiny-h100-dp-tp --set "system.name=\"$NAME:1\"" --set parallelism.data=1 \
  --set parallelism.tensor=1 --set 'model.preset="llama3-8b"' --set model.n_kv_heads=8 \
  --set model.n_layers=4 --set workload.seq_len=4096 --set workload.global_batch=4 \
  --set 'precision.params="bfloat16"'
# the same in FP8 (per-tensor current scaling)
run llama-fp8 tiny-h100-dp-tp --set "system.name=\"$NAME:1\"" --set parallelism.data=1 \
  --set parallelism.tensor=1 --set 'model.preset="llama3-8b"' --set model.n_kv_heads=8 \
  --set model.n_layers=4 --set workload.seq_len=4096 --set workload.global_batch=4 \
  --set 'precision.params="bfloat16"' --set 'precision.compute="float8"'
