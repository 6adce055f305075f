#!/usr/bin/env bash
# `shardscope measure` on one GPU, measured beside the estimate: what docs/measure.md's
# H200 figures came from. Run from the repository root on a machine with one NVIDIA GPU and
# JAX with its CUDA plugin installed: OUT=folder bash benchmarks/measure_gpu.sh
# (NAME defaults to h200; set NAME=h100 on an H100). Writes OUT/measure-gpu.tgz: each run's
# report (.txt) and JSON, the GPU's matmul and copy rates (rates.txt), the optimised HLO of
# the bf16 and FP8 steps as XLA:GPU compiled them (hlo/) and the tiny model's profiler trace (trace/).
set -uo pipefail
OUT=${OUT:-measure-gpu}
NAME=${NAME:-h200}
WORK=$(mktemp -d)
mkdir -p "$OUT" "$WORK/hlo" "$WORK/trace"
export PYTHONPATH=$PWD XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/shardscope-cache} PYTHONUNBUFFERED=1
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" 2>&1 | tee "$WORK/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$WORK/versions.txt"
run() {  # label, then the measure arguments
  local label=$1; shift
  local t0=$SECONDS
  timeout 150 python3 -m experiments.cli measure "$@" --steps 5 --warmup 2 \
    --profile "/tmp/trace-$label" --json "$WORK/$label.json" --quiet 2>&1 | tee "$WORK/$label.txt"
  echo "($label: $((SECONDS - t0)) s)" | tee -a "$WORK/$label.txt"
}
LLAMA=(--set "system.name=\"$NAME:1\"" --set parallelism.data=1 --set parallelism.tensor=1
       --set 'model.preset="llama3-8b"' --set model.n_kv_heads=8 --set model.n_layers=4
       --set workload.seq_len=4096 --set workload.global_batch=4 --set 'precision.params="bfloat16"')
# the tiny model: the whole loop on one GPU in seconds
run tiny tiny-h100-dp-tp --set "system.name=\"$NAME:1\"" --set parallelism.data=1 \
  --set parallelism.tensor=1
# four Llama 3 8B layers, 4 sequences of 4096 tokens, bf16 weights and matmuls; the
# optimised HLO kept (the timed program's and the profiled one's; the FP8 one's too)
XLA_FLAGS="--xla_dump_to=$WORK/dump --xla_dump_hlo_module_re=sharded_step" \
  run llama-bf16 tiny-h100-dp-tp "${LLAMA[@]}" --set 'name="llama3-8b-4layers-bf16"'
# the same in FP8 (per-tensor current scaling)
XLA_FLAGS="--xla_dump_to=$WORK/dump-fp8 --xla_dump_hlo_module_re=sharded_step" \
  run llama-fp8 tiny-h100-dp-tp "${LLAMA[@]}" --set 'precision.compute="float8"' \
  --set 'name="llama3-8b-4layers-fp8"'
# the ceilings: GEMM rates at the layer's shapes (bf16, FP8) and a large copy
timeout 150 python3 benchmarks/gpu_rates.py 2>&1 | tee "$WORK/rates.txt"
for d in dump dump-fp8; do
  for f in "$WORK/$d"/*after_optimizations.txt; do
    [ -e "$f" ] && gzip -c "$f" > "$WORK/hlo/$d.$(basename "$f").gz"
  done
done
rm -rf "$WORK/dump" "$WORK/dump-fp8"
(cd /tmp/trace-tiny 2>/dev/null && find . -name '*.trace.json.gz' -exec cp {} "$WORK/trace/" \;)
tar czf "$OUT/measure-gpu.tgz" -C "$WORK" .
ls -la "$OUT"
