"""`analyze` any JAX function on a mesh; `analyze_hlo` any HLO dump.

Without a system, `analyze` reads the collectives' bytes and counts and times nothing
(`untimed`): what a test of the user's own sharding asserts on (sharding/testing.py).

Orchestration only: compile (sharding/compiler.py), parse (sharding/hlo.py), count the
collectives (sharding/collectives.py) and time them on the system's links (meshes/), cost
the compute (sharding/compute.py), simulate the schedule (sharding/schedule.py), and build
the Report once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh

from meshes import System, get_system
from meshes.calibration import Calibration, catalog_calibration
from meshes.catalog import system_of_size
from meshes.chips import CUDA_GRAPH_KERNEL_S
from meshes.power import Cost
from meshes.power import estimate as estimate_energy
from sharding import gpu_frameworks
from sharding.analysis import AnalysisInputs
from sharding.collectives import Collective
from sharding.compiled_memory import compiled_memory
from sharding.compiler import (
    backend_of,
    compile_to_hlo,
    compiler_name,
    system_device_id,
)
from sharding.compute import ComputeCost, compute_cost, runs_fused_kernels, time_work
from sharding.hlo import HloModule, parse_hlo
from sharding.plan import Plan, build_plan
from sharding.progress import stage
from sharding.report import Memory, Report, host_transfer_time, step_time
from sharding.schedule import Scheduler
from sharding.units import fmt_bytes, fmt_s


def _time_collectives(
    collectives: list[Collective], system: System, device_ids: Sequence[int]
) -> list[Collective]:
    """Attach link, algorithm and time: partition ids -> system device ids -> links."""
    out = []
    cache: dict[tuple, object] = {}
    for c in collectives:
        groups = tuple(tuple(device_ids[p] for p in g) for g in c.groups)
        key = (c.kind, c.bytes, groups)
        if key not in cache:
            cache[key] = system.collective_timing(c.kind, c.bytes, [list(g) for g in groups])
        t = cache[key]
        out.append(dataclasses.replace(c, link=t.link, time_s=t.time_s, algorithm=t.algorithm,
                                       link_share=t.link_share))
    return out


def _system_of(system: str | System | None) -> System | None:
    """A system given by name, as itself, or None (untimed); one line for anything else."""
    if system is None or isinstance(system, System):
        return system
    if isinstance(system, str):
        return get_system(system)
    raise TypeError(f"system={system!r}: give a system name like 'h100:8' (`shardscope "
                    f"systems` lists them), a meshes.System, or None for the collectives' "
                    f"bytes and counts without times")


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r} is not a jax.sharding.Mesh; build one over the "
                        f"devices, e.g. jax.make_mesh((2, 4), ('data', 'tensor')), or "
                        f"sharding.make_mesh(system, {{'data': 2, 'tensor': 4}})")


def _check_mesh_size(mesh: Mesh, system: System | None) -> None:
    """The mesh is the whole system: a program over fewer devices than the system has
    would be timed and reported as the system's (as the CLI refuses a config whose
    parallelism does not make up its system)."""
    n = mesh.devices.size
    if system is None or n == system.num_devices:
        return
    m = system.num_devices
    other = system_of_size(system, n)
    size = f"a system of {n} devices" + (f", e.g. {other!r}," if other else "")
    raise ValueError(f"the mesh has {n} devices ({' x '.join(map(str, mesh.devices.shape))}) "
                     f"but system {system.name!r} has {m}; analyze on {size} or on a mesh of "
                     f"{m} devices")


def _check_mesh_axes(mesh_shape: Sequence[int], axis_names: Sequence[str]) -> None:
    """One distinct, non-empty name per mesh axis (the groups' axes are read by them)."""
    shape, names = tuple(mesh_shape), tuple(axis_names)
    if len(shape) != len(names):
        raise ValueError(f"mesh_shape={shape} has {len(shape)} axes but axis_names={names} "
                         f"names {len(names)}; give one name per axis, e.g. "
                         f"mesh_shape=(2, 4), axis_names=('data', 'tensor')")
    bad = next((i for i, a in enumerate(names) if not isinstance(a, str) or not a.strip()
                or names.count(a) > 1), None)
    if bad is not None:
        raise ValueError(f"axis_names={names}: {names[bad]!r} is not a distinct mesh axis name; "
                         f"name each axis once, e.g. axis_names=('data', 'tensor')")


def _check_group_ids(collectives: list[Collective], n: int) -> None:
    """Every replica group names partitions the program has (a damaged dump may not)."""
    for c in collectives:
        bad = next((p for g in c.groups for p in g if not 0 <= p < n), None)
        if bad is not None:
            raise ValueError(f"{c.kind} {c.name}: its replica groups name partition {bad}, "
                             f"but the program runs on {n} (0..{n - 1}); the dump is damaged "
                             f"or its num_partitions is wrong")


def _promotion_note(collectives: list[Collective]) -> tuple[str, ...]:
    """XLA:CPU's final HLO promotes 16-bit collectives to f32: its reductions say so (their
    reducers are named *_promoted) and are counted at the program's type; its other f32
    collectives cannot be told from real f32 ones, and the warning says how many."""
    promoted = [c for c in collectives if c.compiled_dtype]
    if not promoted:
        return ()
    unsure = sum(1 for c in collectives if not c.compiled_dtype and c.dtype == "float32")
    rest = (f"; its other {unsure} f32 collectives may be promoted too and are counted as "
            f"f32 (up to twice the program's bytes)" if unsure else "")
    return (f"XLA:CPU's final HLO promotes 16-bit collectives to f32: {len(promoted)} "
            f"reductions (reducers named *_promoted) counted at the program's "
            f"{promoted[0].dtype}{rest}; the HLO after SPMD partitioning keeps the program's "
            f"types (XLA_FLAGS=--xla_dump_hlo_pass_re=spmd-partitioning)",)


def _windowed_einsum_note(counts: dict[str, int], per_comp) -> tuple[str, ...]:
    """The TPU (and GPU) SPMD partitioner can turn a matmul with a sharded operand into a
    windowed-einsum loop (a collective matmul: each step multiplies the chunk at hand while
    the next arrives). Over a sharded contracting dimension each step adds a full-size
    partial product into an accumulator in HBM: traffic XLA:CPU's program, which gathers
    the operand once, does not have. Said, with its size, where it happens."""
    bodies = [name for name in per_comp if "windowed_dot_general_body" in name]
    if not bodies:
        return ()
    nbytes = sum(per_comp[b].hbm_bytes * counts.get(b, 0) for b in bodies)
    mem_s = sum(per_comp[b].memory_bound_s * counts.get(b, 0) for b in bodies)
    return (f"the compiler made {len(bodies)} windowed-einsum loops (collective matmuls): "
            f"{fmt_bytes(nbytes)} of HBM traffic and {fmt_s(mem_s)} of memory-bound "
            f"kernels per step, mostly partial products accumulated in HBM; XLA:CPU gathers "
            f"the operand instead, so the CPU path does not see this cost",)


def verdict_memory(model: Memory | None, compiled: Memory, *, real_compiler: bool) -> Memory:
    """The memory a report judges fitting by. The target's own compiler (deviceless TPU or
    GPU) knows its buffers: its assignment is the verdict, with the runtime's reserve from
    the caller's model, and the model's figure noted. XLA:CPU's upcasts bf16 temporaries to
    f32: the caller's model is the verdict, with XLA:CPU's figure for reference."""
    if model is None:
        return compiled
    if real_compiler and compiled.known:
        return dataclasses.replace(
            compiled, reserved=model.reserved, compiler_bytes=compiled.program_bytes,
            compiler_source=compiled.source, notes=(
                *compiled.notes, *model.notes,
                f"the memory model's figure: {fmt_bytes(model.total_bytes)} "
                f"({model.source})"))
    return dataclasses.replace(model, compiler_bytes=compiled.program_bytes or None,
                               compiler_source=compiled.source)


def _plan_of(inputs: AnalysisInputs) -> Plan:
    """The record's read program, read from its HLO text when it has none."""
    if inputs.plan is not None:
        return inputs.plan
    return build_plan(parse_hlo(inputs.hlo_text), mesh_shape=inputs.mesh_shape,
                      axis_names=inputs.axis_names)


def estimate(inputs: AnalysisInputs, *, system: System,
             calibration: Calibration | None = None, cost: Cost | None = None) -> Report:
    """The Report of `inputs` timed on `system`, built once: the collectives placed on its
    links, the compute at its chip's rates (`calibration`: the fitted efficiencies, the
    catalog's by default), the overlap simulated, and the step's power, energy and cost
    (`cost`: prices and PUE, the catalog's by default)."""
    calibration = catalog_calibration() if calibration is None else calibration
    timings = dict(inputs.timings)
    t0 = time.perf_counter()
    plan = _plan_of(inputs)
    if inputs.plan is None:
        timings["read_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
    n = plan.num_partitions
    if n > system.num_devices:
        raise ValueError(f"the program runs on {n} devices but {system.name} has "
                         f"{system.num_devices}; pick a system with at least {n} devices")
    if inputs.mesh_shape and math.prod(inputs.mesh_shape) != n:
        shape = ",".join(f"{a}={s}" for a, s in zip(inputs.axis_names, inputs.mesh_shape,
                                                      strict=False))
        raise ValueError(f"the mesh {shape} has {math.prod(inputs.mesh_shape)} devices but "
                         f"the program runs on {n} (num_partitions); give sizes whose "
                         f"product is {n}")
    ids = list(inputs.device_ids) or list(range(n))
    collectives = list(plan.collectives)
    _check_group_ids(collectives, len(ids))
    collectives = _time_collectives(collectives, system, ids)
    gpu = runs_fused_kernels(system.chip)
    if gpu:
        collectives = gpu_frameworks.collectives_as_run(collectives, system, ids,
                                                        inputs.mesh_shape, inputs.axis_names,
                                                        inputs.bucket_size,
                                                        inputs.gradient_buckets)
    output_scale = gpu_frameworks.output_layer_scale(inputs.pipeline) if gpu else 1.0
    overlapped = gpu_frameworks.overlapped_stage_transfers(collectives, inputs.pipeline) \
        if gpu and inputs.overlap_p2p_comm else {}
    # a GPU step replayed as a CUDA graph pays a launch per kernel, not the training fit's
    graph_kernel_s = CUDA_GRAPH_KERNEL_S if gpu and inputs.cuda_graphs else None
    # (a TPU sequences its compiled program's ops itself, training or serving: each op pays
    # the time measured for one on the chip, not the fit on GPU steps: time_work's default)
    per_comp = time_work(plan.work, system.chip, compute_dtype=inputs.compute_dtype,
                         calibration=calibration,
                         weight_cast_share=gpu_frameworks.weight_cast_share(inputs.pipeline),
                         stretched=(gpu_frameworks.OUTPUT_SCOPES, output_scale),
                         kernel_overhead_s=graph_kernel_s)
    step_cost = compute_cost(None, system.chip, costs=per_comp, counts=plan.counts)
    warnings = (*inputs.warnings, *_promotion_note(collectives),
                *_windowed_einsum_note(plan.counts, per_comp), *plan.notes)
    schedule = Scheduler(
        plan.graph,
        {name: c.times for name, c in per_comp.items()},
        {(c.computation, c.name): (c.time_s, c.link) for c in collectives},
        under_gemms=gpu_frameworks.under_gemms(collectives)
        if gpu and inputs.tp_comm_overlap else {},
        chunked=gpu_frameworks.data_parallel_overlap(
            collectives, pipeline=inputs.pipeline, grad_reduce=inputs.overlap_grad_reduce,
            param_gather=inputs.overlap_param_gather,
            bucket_size=inputs.bucket_size) if gpu else {},
        overlapped=overlapped,
        gemms={name: {m.name for m in w.matmuls} | {f.name for f in w.fusions}
               for name, w in plan.work.items()},
    ).run()
    timings["estimate_s"] = time.perf_counter() - t0
    family = getattr(system.family, "name", "")
    tokens, devices = inputs.tokens_per_step, n
    step_s = step_time(schedule.step_s, step_cost.compute_s, collectives,
                       host_transfer_time(inputs.host_transfer_bytes,
                                          system.chip.host_bytes_per_s))
    return Report(
        name=inputs.name,
        model=inputs.model,
        system=system.label,
        num_devices=n,
        compiler=inputs.compiler,
        compiler_note=inputs.compiler_note,
        extrapolated_from=_timed_on(inputs.extrapolated_from, system),
        collectives=collectives,
        compute=step_cost,
        memory=inputs.memory or Memory(components=(), source="HLO text only"),
        hbm_capacity_bytes=system.chip.hbm_bytes,
        peak_flops_per_device=system.chip.peak_for(inputs.compute_dtype or "bfloat16"),
        peak_flops_by_dtype={dt: system.chip.peak_for(dt)
                             for dt in (*step_cost.flops_by_dtype, "bfloat16")},
        matmul_roof_by_dtype={dt: calibration.best_matmul_rate(system.chip, dt)
                              for dt in (*step_cost.flops_by_dtype, "bfloat16")},
        model_flops_per_step=inputs.model_flops_per_step,
        tokens_per_step=tokens,
        sequences_per_step=inputs.sequences_per_step,
        timings=timings,
        warnings=warnings,
        unknown_ops=plan.unknown_ops,
        scheduled_step_s=schedule.step_s,
        calibration=calibration,
        cuda_graph_kernel_s=graph_kernel_s,
        program_op_s=system.chip.program_op_s,
        system_family=family,
        host_transfer_bytes=inputs.host_transfer_bytes,
        host_bytes_per_s=system.chip.host_bytes_per_s,
        pipeline=None if inputs.pipeline is None else {
            **inputs.pipeline, "as_run": gpu_frameworks.pipeline_as_run(
                output_scale, next(iter(overlapped.values()), None))},
        placement=system.placement,
        fit_advice=inputs.fit_advice,
        # a pipeline's bubble ticks compute on padding in the program; the chips wait
        energy=estimate_energy(family=family, chip=system.chip, num_devices=devices,
                               step_s=step_s, compute_s=step_cost.compute_s * (
                                   1 - (inputs.pipeline or {}).get("bubble", 0.0)),
                               tokens_per_step=tokens, cost=cost),
        inputs=dataclasses.replace(inputs, plan=plan, device_ids=tuple(ids)),
    )


def _timed_on(extrapolated_from: str, system: System) -> str:
    """How the program was compiled, and the system this estimate times it on (a stored
    program re-timed on another system names that one)."""
    if not extrapolated_from:
        return ""
    # a record stored before the system was added here carries the one it was first timed on
    compiled = extrapolated_from.split(" and timed on ")[0]
    return f"{compiled} and timed on {system.label}"


def untimed(inputs: AnalysisInputs) -> Report:
    """The Report of `inputs` on no system: its collectives' bytes, counts and mesh axes,
    the compiler's memory figure, and no times (no links, no compute rates, no HBM to fit
    in, so no step time, MFU or verdict)."""
    plan = _plan_of(inputs)
    _check_group_ids(list(plan.collectives), plan.num_partitions)
    nothing = ComputeCost(flops=0.0, matmul_flops=0.0, hbm_bytes=0.0, matmul_s=0.0,
                          memory_bound_s=0.0, flops_by_dtype={})
    return Report(
        name=inputs.name, model=inputs.model, system="", num_devices=plan.num_partitions,
        compiler=inputs.compiler,
        compiler_note=inputs.compiler_note, extrapolated_from=inputs.extrapolated_from,
        collectives=list(plan.collectives), compute=nothing,
        memory=inputs.memory or Memory(components=(), source="HLO text only"),
        hbm_capacity_bytes=None, peak_flops_per_device=0.0,
        timings=dict(inputs.timings), unknown_ops=plan.unknown_ops,
        warnings=(*inputs.warnings, *_promotion_note(list(plan.collectives)), *plan.notes),
        inputs=dataclasses.replace(inputs, plan=plan),
    )


def reanalyze(inputs: AnalysisInputs, *, system: str | System | None = None,
              calibration: Calibration | None = None, device_ids: Sequence[int] | None = None,
              cost: Cost | None = None) -> Report:
    """The report of a program compiled earlier, re-timed under the current model (or
    `calibration`), on its own system's device placement or on `system` (the same device
    count; its devices in mesh order unless `device_ids`; `cost`: prices and PUE). No
    compile."""
    if system is None:
        raise ValueError("reanalyze needs the system to time the program on")
    system = _system_of(system)
    n = math.prod(inputs.mesh_shape)
    if system.num_devices != n:
        raise ValueError(f"{system.name} has {system.num_devices} devices; the stored program "
                         f"runs on {n}: re-time it on a system of the same size")
    if device_ids is not None:
        inputs = dataclasses.replace(inputs, device_ids=tuple(device_ids))
    if inputs.memory is not None and inputs.memory.reserved:
        # what the runtime keeps beside the program is the new system's (CUDA context and
        # NCCL buffers on a GPU, the TPU runtime's reserve), not the compiled one's
        from meshes.reserves import reserved

        inputs = dataclasses.replace(inputs, memory=dataclasses.replace(
            inputs.memory, reserved=reserved(system, sum(s > 1 for s in inputs.mesh_shape))))
    return estimate(dataclasses.replace(inputs, timings={}), system=system,
                    calibration=calibration, cost=cost)


def analyze_module(module: HloModule, *, system: System | None, mesh_shape: Sequence[int] = (),
                   axis_names: Sequence[str] = (), **kwargs) -> Report:
    """Report for a parsed per-device module on `system` (None: untimed): `analyze_plan` of
    its plan."""
    _check_mesh_axes(mesh_shape, axis_names)
    t0 = time.perf_counter()
    plan = build_plan(module, mesh_shape=mesh_shape, axis_names=axis_names)
    timings = dict(kwargs.pop("timings", None) or {})
    timings["read_s"] = time.perf_counter() - t0
    return analyze_plan(plan, system=system, mesh_shape=mesh_shape, axis_names=axis_names,
                        timings=timings, **kwargs)


def analyze_plan(plan: Plan, *, system: System | None, calibration: Calibration | None = None,
                 cost: Cost | None = None, device_ids: Sequence[int] | None = None,
                 memory: Memory | None = None, **fields) -> Report:
    """Report for a read per-device program (sharding/plan.py) on `system` (None:
    `untimed`): `estimate` of the record of `plan` with the other `AnalysisInputs` fields
    given by keyword (mesh_shape, axis_names, compiler, compute_dtype, model_flops_per_step,
    ...)."""
    inputs = AnalysisInputs(plan=plan, memory=memory, device_ids=tuple(device_ids or ()),
                            **fields)
    if system is None:
        return untimed(inputs)
    return estimate(inputs, system=system, calibration=calibration, cost=cost)


def analyze(
    fn: Callable,
    *args,
    mesh: Mesh,
    system: str | System | None,
    compute_dtype: str | None = None,
    model_flops_per_step: float | None = None,
    tokens_per_step: float | None = None,
    sequences_per_step: float | None = None,
    memory: Memory | None = None,
    timings: dict[str, float] | None = None,
    warnings: Sequence[str] = (),
    name: str = "",
    model: str = "",
    compiler: str | None = None,
    compiler_note: str = "",
    calibration: Calibration | None = None,
    host_transfer_bytes: float = 0.0,
    pipeline: dict | None = None,
    fit_advice: Sequence[str] = (),
    cost: Cost | None = None,
    tp_comm_overlap: bool = False,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    bucket_size: int = 0,
    overlap_p2p_comm: bool = False,
    gradient_buckets: bool = False,
    cuda_graphs: bool = False,
) -> Report:
    """Compile `fn(*args)` over `mesh` and report its collectives, time and memory.

    Args:
        fn: any callable or `jax.jit` object; `shard_map` inside is fine.
        *args: concrete arrays or `jax.ShapeDtypeStruct`s with shardings; nothing is
            allocated.
        mesh: the mesh the program is sharded over (device i of its row-major order is
            system device id `mesh.devices.flat[i].id`).
        system: a system name like "gb200-nvl72:72" or a `meshes.System`; None: no
            system, so the collectives' bytes, counts and mesh axes and no times (`untimed`).
        compute_dtype: time matmuls at this dtype's peak (e.g. "float8").
        model_flops_per_step: for MFU; HLO matmul FLOPs are used when absent.
        tokens_per_step: for tokens/s.
        sequences_per_step: for tokens/s per user (serving).
        memory: memory per device worked out by the caller (e.g. analytically from the
            model); the compiler's own figure is attached to it for reference. Without it
            the report shows the compiler's figure.
        timings: stages the caller timed (e.g. building the program), shown with ours.
        warnings: the caller's own, shown before the compiler's.
        name: the step's name, first on the report's header (an experiment's name).
        model: the model the step runs, in words, on a header line of its own
            ("llama3-8b (n_layers 2)"); "" for none.
        compiler: the compiler's name on the report; by default named from the mesh's
            devices and the system (sharding.compiler.compiler_name). TPU and GPU devices
            are compiled for and read from their final HLO, CPU devices from the HLO after
            SPMD partitioning.
        compiler_note: why that compiler may not be the system's own.
        calibration: the step-time model's fitted efficiencies (meshes/calibration.py);
            the catalog's by default.
        host_transfer_bytes: activations offloaded to host memory and back, per device and
            step (XLA:CPU elides the host copies, so the caller counts them).
        pipeline: the pipeline schedule the program runs (models.Pipeline.summary()),
            shown with its bubble.
        fit_advice: what would make a step that does not fit in HBM fit (the caller's
            memory model), shown under the verdict.
        cost: prices and PUE for the step's energy and cost (meshes.power.Cost); the
            catalog's defaults when absent.
        tp_comm_overlap: on GPU systems, the all-gathers and reduce-scatters over `tensor`
            run in chunks under the GEMM they feed or follow (Transformer Engine's
            userbuffers; sharding/schedule.py).
        overlap_grad_reduce, overlap_param_gather: on GPU systems, the step's
            data-parallel gradient sum and the updated parameters' all-gather run in
            chunks beside the backward and the next forward (Megatron's DDP config;
            sharding/gpu_frameworks.py).
        bucket_size: on GPU systems, parameters per gradient bucket (Megatron's
            --ddp-bucket-size); 0: Megatron's default, max(40M, 1M x data-parallel ranks).
        overlap_p2p_comm: on GPU systems, an interleaved pipeline's stage transfers run
            beside other microbatches' compute but in its warm-up and flush
            (sharding/gpu_frameworks.py). Off here, the program as compiled; on in an
            experiment config by default, as Megatron runs interleaved pipelines.
        gradient_buckets: on GPU systems, the program is a Megatron-style training step:
            a weight gradient's sum over `data` (and `sequence`, Megatron's DP x CP group)
            smaller than a gradient bucket rides in one (its bytes' share of the bucket's
            collective; sharding/gpu_frameworks.py). Off here, the collectives as compiled
            whatever the mesh axes are called; the experiment runner sets it for a training
            step.
        cuda_graphs: on GPU systems, the step is replayed as a CUDA graph, as serving
            engines (vLLM, SGLang, TensorRT-LLM) run decode: each kernel's fixed time is a
            launch under CUDA graphs (meshes.chips.CUDA_GRAPH_KERNEL_S, a microbenchmark),
            not the calibration's kernel_overhead_s fitted on training steps. Off here; the
            experiment runner sets it for a decode step with `serving.cuda_graphs`.
    """
    system = _system_of(system)
    _check_mesh(mesh)
    _check_mesh_size(mesh, system)
    backend = backend_of(mesh.devices.flat[0])
    compiler = compiler or compiler_name(backend, system)
    stage(f"lowering and compiling with {compiler.split(' (')[0]} for {mesh.devices.size} "
          f"devices")
    with jax.set_mesh(mesh):
        c = compile_to_hlo(fn, *args, final_hlo=backend != "cpu", devices=mesh.devices.flat)
    stage("reading the HLO and estimating")
    t0 = time.perf_counter()
    module = parse_hlo(c.hlo_text)
    c.timings["parse_s"] = time.perf_counter() - t0
    compiled = verdict_memory(memory, compiled_memory(c.memory_stats, on_cpu=backend == "cpu"),
                              real_compiler=backend != "cpu")
    t0 = time.perf_counter()
    plan = build_plan(module, mesh_shape=mesh.devices.shape, axis_names=mesh.axis_names)
    c.timings["read_s"] = time.perf_counter() - t0
    inputs = AnalysisInputs(
        hlo_text=c.hlo_text, plan=plan, mesh_shape=tuple(mesh.devices.shape),
        axis_names=tuple(mesh.axis_names),
        device_ids=tuple(system_device_id(system, d) for d in mesh.devices.flat),
        compiler=compiler, compiler_note=compiler_note, memory=compiled,
        compute_dtype=compute_dtype, model_flops_per_step=model_flops_per_step,
        tokens_per_step=tokens_per_step, sequences_per_step=sequences_per_step,
        warnings=(*warnings, *c.warnings), name=name, model=model,
        host_transfer_bytes=host_transfer_bytes, pipeline=pipeline,
        fit_advice=tuple(fit_advice), timings={**(timings or {}), **c.timings},
        tp_comm_overlap=tp_comm_overlap, overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather, bucket_size=bucket_size,
        overlap_p2p_comm=overlap_p2p_comm, gradient_buckets=gradient_buckets,
        cuda_graphs=cuda_graphs)
    if system is None:
        return untimed(inputs)
    return estimate(inputs, system=system, calibration=calibration, cost=cost)


def analyze_hlo(
    hlo_text: str,
    *,
    system: str | System | None,
    mesh_shape: Sequence[int] = (),
    axis_names: Sequence[str] = (),
    name: str = "",
    calibration: Calibration | None = None,
) -> Report:
    """Report for any HLO dump; give the mesh shape and axis names to map groups to axes.
    `system`: a name, a `meshes.System`, or None for the collectives' bytes and counts
    without times (`untimed`), as `analyze`."""
    system = _system_of(system)
    t0 = time.perf_counter()
    module = parse_hlo(hlo_text)
    timings = {"parse_s": time.perf_counter() - t0}
    return analyze_module(module, system=system, mesh_shape=mesh_shape, axis_names=axis_names,
                          compiler="HLO text", timings=timings, name=name,
                          calibration=calibration)
