"""Turn an Experiment into model + system + mesh -> sharding.analyze -> Report."""

from __future__ import annotations

import dataclasses
import time

from experiments.config import ConfigError, Experiment
from meshes import get_system
from sharding.report import Memory, Report

def run(exp: Experiment, *, backend: str = "auto") -> Report:
    """Compile the experiment's step (fake CPU devices or the deviceless TPU compiler) and
    estimate it on its system.

    With `auto`, a program the TPU compiler refuses for lack of HBM is compiled on the CPU
    path instead, and the report carries the TPU compiler's verdict.
    """
    from sharding.compiler import DoesNotFit

    try:
        return _run(exp, backend=backend)
    except DoesNotFit as e:
        if backend != "auto":
            raise ConfigError(str(e)) from None
        report = _run(exp, backend="cpu")
        return dataclasses.replace(
            report, warnings=(f"TPU compiler: {e}",) + report.warnings)


def _run(exp: Experiment, *, backend: str) -> Report:
    system = get_system(exp.system)

    # Imported here so that the fake device count is set before JAX starts its backend.
    import sharding
    from sharding import compiler as backends

    try:
        backend = backends.resolve_backend(backend, system)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t0 = time.perf_counter()
    devices, compiler = None, None
    try:
        # Before anything starts JAX's CPU backend, even on the TPU path: a refused TPU
        # compile falls back to these fake devices.
        sharding.ensure_cpu_devices(system.num_devices)
    except ValueError as e:
        if backend == "cpu":
            raise ConfigError(f"system.name={exp.system!r}: {e}") from None
    if backend == "cpu" and exp.parallelism.pipeline > 1 and exp.precision.compute != "float32":
        # XLA:CPU aborts the whole process (a CHECK failure, "Invalid binary instruction
        # opcode copy") on bf16 collectives inside the pipeline's partially manual shard_map.
        raise ConfigError(
            f"parallelism.pipeline={exp.parallelism.pipeline} with precision.compute="
            f"{exp.precision.compute!r} does not compile on XLA:CPU (it aborts on bf16 "
            f"collectives inside the pipeline); use --backend tpu on a TPU system, or "
            f"precision.compute = 'float32' (collectives then count f32 bytes)")
    if backend == "tpu":
        devices = backends.tpu_devices(system)
        compiler = f"the TPU compiler (libtpu, deviceless {backends.topology_name(system)})"
    elif backend == "gpu":
        devices = backends.gpu_devices(system)
        compiler = (f"XLA:GPU (CUDA plugin, deviceless {system.chip.name} x "
                    f"{backends.gpu_topology_name(system)})")
    mesh = sharding.make_mesh(system, exp.parallelism.sizes(), devices=devices)
    rules = sharding.default_rules()
    serving = exp.workload.kind != "train"
    try:
        program = (_serve_program(exp, mesh, rules) if serving
                   else _train_program(exp, mesh, rules))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    build_s = time.perf_counter() - t0
    report = sharding.analyze(
        program.step, *program.args, mesh=mesh, system=system,
        model_flops_per_step=program.model_flops_per_step,
        tokens_per_step=program.tokens_per_step, name=exp.name, compiler=compiler,
    )
    report.timings["build_s"] = build_s
    if serving:
        return dataclasses.replace(
            report, sequences_per_step=exp.workload.global_batch,
            memory=_serving_memory(exp, program, report.memory, mesh))
    return dataclasses.replace(report, memory=_training_memory(exp, program, report.memory,
                                                               mesh))


def _train_program(exp, mesh, rules):
    from models import TrainSettings, build_train_program

    settings = TrainSettings(
        seq_len=exp.workload.seq_len,
        global_batch=exp.workload.global_batch,
        microbatches=exp.workload.microbatches,
        param_dtype=exp.precision.params,
        compute_dtype=exp.precision.compute,
        remat=exp.train.remat,
        learning_rate=exp.train.learning_rate,
        weight_decay=exp.train.weight_decay,
    )
    return build_train_program(exp.model, settings, mesh, rules)


def cache_dtype(precision) -> str:
    """The KV cache's storage: precision.kv_cache, else the activations' dtype."""
    if precision.kv_cache:
        return precision.kv_cache
    return "bfloat16" if precision.compute.startswith("float8") else precision.compute


def _serve_program(exp, mesh, rules):
    from models.inference import ServeSettings, build_serve_program

    settings = ServeSettings(kind=exp.workload.kind, seq_len=exp.workload.seq_len,
                             batch=exp.workload.global_batch, param_dtype=exp.precision.params,
                             compute_dtype=exp.precision.compute,
                             cache_dtype=cache_dtype(exp.precision),
                             weight_dtype=exp.precision.weights
                             if exp.precision.weights not in ("", "bfloat16") else None)
    return build_serve_program(exp.model, settings, mesh, rules)


def _serving_memory(exp: Experiment, program, compiled: Memory, mesh) -> Memory:
    """Weights and KV cache exactly from their shardings; one layer's activations."""
    from models.memory import serving_activation_bytes
    from sharding.rules import mesh_shape_of

    w = exp.workload
    tokens = w.seq_len if w.kind == "prefill" else 1
    components = (
        ("parameters", float(program.param_bytes_per_device)),
        ("KV cache", float(program.cache_bytes_per_device)),
        ("one layer's activations and the logits",
         serving_activation_bytes(exp.model, batch=w.global_batch, tokens=tokens,
                                  compute_dtype=exp.precision.compute,
                                  mesh_shape=mesh_shape_of(mesh))),
    )
    return Memory(components=components,
                  source="weights and KV cache exact from shardings; activations analytic",
                  compiler_bytes=compiled.total_bytes or None,
                  compiler_source=compiled.source)


def _training_memory(exp: Experiment, program, compiled: Memory, mesh) -> Memory:
    """Analytic memory of the training step (models/memory.py) with exact state."""
    from models.memory import activation_components
    from sharding.rules import mesh_shape_of

    w = exp.workload
    stages = exp.parallelism.pipeline
    components = [
        ("parameters", float(program.param_bytes_per_device)),
        ("optimizer state", float(program.optimizer_bytes_per_device)),
        ("gradients", float(program.param_bytes_per_device)),
        ("batch", float(program.batch_bytes_per_device)),
        # A GPipe stage holds every microbatch's activations for its own layers.
        *activation_components(exp.model, micro_batch=w.global_batch // w.microbatches
                               if stages == 1 else w.global_batch,
                               seq_len=w.seq_len, compute_dtype=exp.precision.compute,
                               remat=exp.train.remat, mesh_shape=mesh_shape_of(mesh),
                               layers=exp.model.n_layers // stages),
    ]
    return Memory(components=tuple(components),
                  source="state exact from shardings; activations analytic "
                         "(models/memory.py)",
                  compiler_bytes=compiled.total_bytes or None,
                  compiler_source=compiled.source)
