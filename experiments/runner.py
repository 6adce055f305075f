"""Turn an Experiment into model + system + mesh -> sharding.analyze -> Report."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable

import jax

import sharding
from experiments.config import ConfigError, Experiment
from experiments.frameworks import style
from meshes.calibration import Calibration
from meshes.gpu import GpuSystem
from meshes.reserves import JAX_GPU_MEM_FRACTION, reserved
from meshes.tpu import TpuSystem
from models.inference import build_serve_program
from models.memory import offload_bytes_per_step, serving_memory, training_memory
from models.optimizer import spec_axes
from models.pipeline import output_layer_share
from models.train import build_train_program
from models.transformer import dense_layer_note
from sharding import compiler
from sharding.compute import runs_fused_kernels
from sharding.mesh import CPU_MAX_DEVICES, placement
from sharding.progress import notice, stage
from sharding.report import Report
from sharding.rules import mesh_shape_of
from sharding.units import fmt_bytes

# What `run` asks for the changes that make a step fit: (experiment, calibration) -> lines.
Advisor = Callable[[Experiment, "Calibration | None"], tuple[str, ...]]


class Unfit(ConfigError):
    """The memory model says the step cannot fit in HBM; it was not compiled."""


class TargetRefused(ConfigError):
    """The system's own compiler refused the step for lack of HBM; `reason` is its word."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def run(exp: Experiment, *, backend: str = "cpu",
        calibration: Calibration | None = None, compile_unfit: bool = True,
        max_compile_devices: int = CPU_MAX_DEVICES, advise: Advisor | None = None) -> Report:
    """Compile the experiment's step (fake CPU devices or a deviceless real compiler) and
    estimate it on its system.

    `backend`: "cpu" (XLA:CPU on fake devices, seconds), "tpu" / "gpu" (the system's own
    deviceless compiler), "auto" (its own when installed, else cpu). With `auto`, a
    program the TPU compiler refuses for lack of HBM is compiled on the CPU
    path instead, and the report carries the TPU compiler's verdict. `calibration`: the
    step-time model's fitted efficiencies (meshes/calibration.py); the catalog's by default.
    `compile_unfit=False`: a step the memory model says cannot fit raises `Unfit` before
    compiling (a search prunes with it). On the CPU path a run on more than
    `max_compile_devices` devices is compiled with fewer data-parallel replicas and read as
    the full run (`_extrapolated`). `advise`: called with the experiment (the full run's)
    and the calibration when its step does not fit, it answers the changes that make it fit
    (experiments/fit.py's `advice`: a search that compiles a few candidates); the report
    carries them.
    """
    try:
        resolved = compiler.resolve_backend(backend, exp.system)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    big = exp.system.num_devices > max_compile_devices
    if big and (resolved == "cpu" or (backend == "auto" and resolved == "tpu")):
        # `auto` does not hand a TPU pod past it to libtpu (minutes to hours at that size):
        # the CPU path reads it from fewer replicas; `--backend tpu` compiles it whole.
        return _extrapolated(exp, max_compile_devices, calibration=calibration,
                             compile_unfit=compile_unfit, advise=advise)
    try:
        return _run(exp, backend=backend, calibration=calibration,
                    compile_unfit=compile_unfit, advise=advise)
    except compiler.DoesNotFit as e:
        if backend != "auto":
            raise TargetRefused(f"{e} (compile with --backend cpu to see its collectives "
                                f"anyway, or shard more / rematerialise more)", str(e)) from None
        return _run(exp, backend="cpu", calibration=calibration, advise=advise,
                    warnings=(f"TPU compiler: {e}",))


def _run(exp: Experiment, *, backend: str, calibration: Calibration | None,
         warnings: tuple[str, ...] = (), compile_unfit: bool = True,
         full: Experiment | None = None, advise: Advisor | None = None) -> Report:
    """Compile `exp` and estimate it; `full`: the run it stands for when `exp` is a reduced
    compile of it (its memory and advice are the full run's)."""
    system = exp.system
    t0 = time.perf_counter()
    try:
        compiler.resolve_backend(backend, system)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        # Before anything starts JAX's CPU backend, even on the TPU path: a refused TPU
        # compile falls back to these fake devices.
        sharding.ensure_cpu_devices(system.num_devices)
    except ValueError as e:
        if compiler.resolve_backend(backend, system) == "cpu":
            raise ConfigError(f"system.name={system.name!r}: {e}") from None
    target = compiler.target(backend, system)
    if target.backend != "cpu" and (exp.model.param_count() >= 1e9
                                     or system.num_devices >= 64):
        notice(f"compiling {exp.model.name} for {system.num_devices} devices with "
               f"{target.compiler}: this takes minutes for a model or pod this size (the "
               f"CPU path, --backend cpu, estimates it in seconds)")
    mesh = sharding.make_mesh(system, exp.parallelism.sizes(), devices=target.devices,
                              outer=exp.parallelism.outer)
    step = build_step(exp, mesh)
    memory = step.memory if full is None else memory_of(full)
    need, cap = memory.total_bytes, system.chip.hbm_bytes
    if not compile_unfit and need > cap:
        raise Unfit(f"does not fit: needs {fmt_bytes(need)} of HBM per device, has "
                    f"{fmt_bytes(cap)} (`shardscope fit` finds what makes it fit)")
    advice = ()
    if advise is not None and need > cap:
        stage("searching for the changes that make it fit")
        advice = advise(full or exp, calibration)
    return analyze_step(exp, step, mesh, memory=memory, calibration=calibration,
                        timings={"build_s": time.perf_counter() - t0},
                        warnings=(*warnings, *(full or exp).notes, *step.notes),
                        compiler=target.compiler,
                        # the compilers that could compile the run it stands for
                        compiler_note=_with_compare_hint(target.note, (full or exp).system),
                        fit_advice=advice)


def analyze_step(exp: Experiment, step: Step, mesh, *, memory: sharding.Memory | None = None,
                 calibration: Calibration | None = None, **kwargs) -> Report:
    """Compile the experiment's step on `mesh` and estimate it on `exp.system`; `kwargs`:
    the rest of `sharding.analyze`'s (timings, warnings, compiler, ...)."""
    program = step.program
    return sharding.analyze(
        program.step, *program.args, mesh=mesh, system=exp.system,
        model_flops_per_step=program.model_flops_per_step,
        tokens_per_step=program.tokens_per_step,
        sequences_per_step=exp.workload.global_batch if step.serving else None,
        memory=memory or step.memory, name=exp.name, model=exp.model_label,
        calibration=calibration,
        host_transfer_bytes=step.host_transfer_bytes, pipeline=step.pipeline,
        cost=exp.cost, tp_comm_overlap=exp.parallelism.tp_comm_overlap,
        overlap_grad_reduce=exp.train.overlap_grad_reduce and not step.serving,
        overlap_param_gather=exp.train.overlap_param_gather and not step.serving,
        bucket_size=exp.train.bucket_size, gradient_buckets=not step.serving,
        overlap_p2p_comm=exp.parallelism.overlap_p2p_comm and not step.serving,
        # engines replay decode steps as CUDA graphs; a prefill's kernels are long enough
        # to hide their launches, and a training step pays what the calibration fitted
        cuda_graphs=exp.serving.cuda_graphs and exp.workload.kind == "decode", **kwargs)


def _with_compare_hint(note: str, system) -> str:
    """The compiler note, with how to see the system's own compiler beside XLA:CPU's."""
    if note and len(compiler.available_backends(system)) > 1:
        return f"{note} (--backend all compares them)"
    return note


@dataclasses.dataclass(frozen=True)
class Step:
    """An experiment's step on a mesh: the program, its memory per device (models/memory.py)
    and what the estimate needs besides (the pipeline, the bytes offloaded to host)."""

    program: object
    memory: sharding.Memory
    serving: bool
    mesh_shape: dict
    rules: object
    pipeline: dict | None = None
    host_transfer_bytes: float = 0.0
    notes: tuple[str, ...] = ()  # what the program approximates of the model


def build_step(exp: Experiment, mesh, *, quiet: bool = False) -> Step:
    """The experiment's train or serve program on `mesh` (a Mesh, or an AbstractMesh for
    its memory alone), with its memory model."""
    rules = exp.parallelism.axis_rules()
    mesh_shape = mesh_shape_of(mesh)
    if not quiet:
        stage(f"building the {exp.workload.kind} step of {exp.model.name} on "
              f"{exp.system.label}")
    try:
        if exp.workload.kind != "train":
            program = build_serve_program(exp.model, mesh, rules, workload=exp.workload,
                                          precision=exp.precision)
            memory = serving_memory(exp.model, program, workload=exp.workload,
                                    precision=exp.precision, mesh_shape=mesh_shape, rules=rules)
            return Step(program, with_reserve(memory, exp), True, mesh_shape, rules)
        program = build_train_program(exp.model, mesh, rules, workload=exp.workload,
                                      precision=exp.precision, train=exp.train,
                                      virtual_stages=exp.parallelism.virtual_stages,
                                      pipeline_schedule=exp.parallelism.pipeline_schedule,
                                      context_mode=exp.parallelism.context_mode,
                                      fused_kernels=runs_fused_kernels(exp.system.chip))
        # the TPU compiler fuses elementwise producers into matmul operands
        memory = training_memory(exp.model, program, workload=exp.workload,
                                 precision=exp.precision, train=exp.train,
                                 mesh_shape=mesh_shape, rules=rules,
                                 fuses_matmul_inputs=compiler.is_tpu(exp.system),
                                 context_mode=exp.parallelism.context_mode)
        host = offload_bytes_per_step(exp.model, workload=exp.workload, precision=exp.precision,
                                      train=exp.train, mesh_shape=mesh_shape, rules=rules)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pipeline = None if program.pipeline is None else {
        **program.pipeline.summary(),
        "output_layer_share": output_layer_share(exp.model, program.pipeline,
                                                 exp.workload.seq_len)}
    # why Megatron-LM refuses these virtual stages: said of a Megatron-style run only
    megatron = program.pipeline is not None and style(exp) == "megatron"
    return Step(program, with_reserve(memory, exp), False, mesh_shape, rules, pipeline, host,
                (*dense_layer_note(exp.model, program.pipeline is not None),
                 *(program.pipeline.notes() if megatron else ())))


def with_reserve(memory: sharding.Memory, exp: Experiment) -> sharding.Memory:
    """The program's memory with what the runtime keeps on the device beside it
    (meshes/reserves.py), and on GPUs the share of HBM JAX must be let to take."""
    reserves = reserved(exp.system, sum(s > 1 for s in exp.parallelism.sizes().values()))
    notes = ()
    share = memory.program_bytes / exp.system.chip.hbm_bytes
    if isinstance(exp.system, GpuSystem) and JAX_GPU_MEM_FRACTION < share < 0.99:
        notes = (f"on JAX the program needs {share:.0%} of HBM, more than the "
                 f"{JAX_GPU_MEM_FRACTION:.0%} JAX preallocates by default: run with "
                 f"XLA_PYTHON_CLIENT_MEM_FRACTION={min(0.99, share + 0.005):.2f} or more",)
    return dataclasses.replace(
        memory, reserved=reserves,
        source=memory.source + ("; runtime reserve (meshes/reserves.py)" if reserves else ""),
        notes=(*memory.notes, *notes))


def memory_of(exp: Experiment) -> sharding.Memory:
    """The memory model's figure for the experiment's step on its full mesh (abstract: any
    device count), with the runtime reserve; nothing is compiled."""
    return _abstract_step(exp).memory


def _abstract_step(exp: Experiment) -> Step:
    """The experiment's step on an abstract mesh of its sizes (any device count)."""
    from sharding.mesh import abstract_mesh, ensure_cpu_devices

    try:  # building the program starts JAX's CPU backend: with the devices a compile needs
        ensure_cpu_devices(min(exp.system.num_devices, CPU_MAX_DEVICES))
    except ValueError:
        pass  # started smaller already (a test, a notebook): a compile will say so
    mesh = abstract_mesh(exp.system, exp.parallelism.sizes())
    return build_step(exp, mesh, quiet=True)


def _extrapolated(exp: Experiment, limit: int, *, calibration: Calibration | None,
                  compile_unfit: bool, advise: Advisor | None = None) -> Report:
    """A run past what XLA:CPU compiles: the same run on fewer data-parallel replicas (each
    device's program is then the same: its batch, its shards, every buffer), compiled, and
    read as the full run -- the replica groups rebuilt on the full mesh
    (sharding/extrapolate.py) and timed on the full system's links; FLOPs and tokens per
    step scaled by the replicas left out."""
    from sharding.extrapolate import NotExpandable, expand_plan

    system, par = exp.system, exp.parallelism
    n, data = system.num_devices, par.data
    per_replica = n // data
    gb = exp.workload.global_batch
    fit = [d for d in range(min(2, data), data)
           if data % d == 0 and per_replica * d <= limit and (gb * d) % data == 0
           and _reduced_system_name(system, per_replica * d) is not None]
    if not fit:
        raise ConfigError(f"system.name={system.name!r}: {n} devices is past the {limit} "
                          f"XLA:CPU compiles in one process, and extrapolating from fewer "
                          f"replicas needs them: {_no_reduced_run(exp, limit)}")
    # the fewest replicas whose program is the run's: every argument split alike (the
    # distributed optimizer splits a state on a dimension the replicas divide, and keeps it
    # whole where none does: 5 replicas of Llama 3 70B split its layers' state, 3125 not)
    specs = _argument_specs(exp)
    first = None
    for replicas in fit:
        small_exp = _with_replicas(exp, replicas, per_replica)
        differs = _first_difference(_argument_specs(small_exp), specs)
        if not differs:
            break
        first = first or (replicas, differs)
    else:
        (d, (path, small_spec, full_spec)) = first
        raise ConfigError(f"system.name={system.name!r}: {n} devices is past the {limit} "
                          f"XLA:CPU compiles, and on the fewer replicas that compile the "
                          f"program is another: {path} is split {small_spec} on {d} replicas, "
                          f"{full_spec} on {data}; {_what_splits(exp)}")
    small = _run(small_exp, backend="cpu", calibration=calibration,
                 compile_unfit=compile_unfit, full=exp, advise=advise)
    inputs = small.inputs
    full_shape = tuple(par.sizes()[a] for a in inputs.axis_names)
    try:
        plan = expand_plan(inputs.plan, small_shape=inputs.mesh_shape, full_shape=full_shape,
                           axis_names=inputs.axis_names,
                           sized_by_state=exp.train.shard_optimizer_over_data)
    except NotExpandable as e:
        raise ConfigError(f"system.name={system.name!r}: {n} devices is past the {limit} "
                          f"XLA:CPU compiles, and the run compiled on {small_exp.system.name} "
                          f"cannot be read as it exactly: {e}; the program changes with "
                          f"the number of data-parallel replicas{_what_changes(par)}") from None
    scale = data // replicas
    ids = tuple(map(int, placement(full_shape, inputs.axis_names, par.outer).flat))
    full = dataclasses.replace(
        inputs, plan=plan, mesh_shape=full_shape, device_ids=ids, name=exp.name,
        model_flops_per_step=_scaled(inputs.model_flops_per_step, scale),
        tokens_per_step=_scaled(inputs.tokens_per_step, scale),
        sequences_per_step=_scaled(inputs.sequences_per_step, scale),
        extrapolated_from=(f"compiled on {_on(small_exp.system, system)}"
                           f"{per_replica * replicas} devices ({replicas} of the "
                           f"{data} data-parallel replicas; "
                           f"{_same_program(exp, replicas, specs)}), "
                           f"the replica groups rebuilt for {n}"))
    return sharding.estimate(full, system=system, calibration=calibration, cost=exp.cost)


def _with_replicas(exp: Experiment, replicas: int, per_replica: int) -> Experiment:
    """`exp` on `replicas` of its data-parallel replicas, the batch of each the same."""
    from experiments import config as config_mod

    raw = exp.to_dict()
    # the network overrides are the full system's, which times the program: the compile
    # needs the chip and the device count (a slice of a multi-slice pod has no DCN)
    raw["system"] = {"name": _reduced_system_name(exp.system, per_replica * replicas)}
    raw["parallelism"]["data"] = replicas
    raw["workload"]["global_batch"] = \
        exp.workload.global_batch * replicas // exp.parallelism.data
    return config_mod.rebuilt(exp, raw)


def _argument_specs(exp: Experiment) -> dict[tuple[str, str], object]:
    """The PartitionSpec of each array of the experiment's step (abstract: no compile), by
    (the argument's name, e.g. "opt_state"; the array's path in it)."""
    program = _abstract_step(exp).program
    return {(name, jax.tree_util.keystr(path)):
            getattr(getattr(leaf, "sharding", None), "spec", None)
            for name, arg in zip(program.arg_names, program.args, strict=True)
            for path, leaf in jax.tree_util.tree_leaves_with_path(arg)}


def _first_difference(small: dict, full: dict) -> tuple[str, object, object] | None:
    """(array, its spec on the reduced mesh, on the full one) of the first that differs."""
    return next((("".join(k), small.get(k), full[k]) for k in full
                 if small.get(k) != full[k]), None)


def _what_splits(exp: Experiment) -> str:
    """The way out of a program whose arguments split otherwise on fewer replicas."""
    if exp.train.shard_optimizer_over_data:
        return ("the distributed optimizer splits a state over data on a dimension the "
                "replicas divide; choose a parallelism.data whose smaller divisors split the "
                "states as it does (a power of two), or train.shard_optimizer_over_data = false")
    return "choose a parallelism.data whose smaller divisors split the arguments as it does"


def _what_changes(par) -> str:
    """What makes a program depend on its replica count, and the way out, where known."""
    if par.fsdp > 1:
        return (" (FSDP with data parallelism reshards by it): put the fsdp devices on data, "
                "tensor or pipeline")
    return ": shard it another way, or on a TPU system compile it whole (--backend tpu)"


def _same_program(exp: Experiment, replicas: int,
                  specs: dict[tuple[str, str], object]) -> str:
    """What of a device's program the reduced compile holds as the full run's; `specs`:
    its arrays' PartitionSpecs by (argument name, path), as `_argument_specs` gives them."""
    split = any("data" in spec_axes(spec) for (arg, _), spec in specs.items()
                if arg == "opt_state")
    if not (exp.train.shard_optimizer_over_data and exp.workload.kind == "train" and split):
        return "each device's program is the same"
    # a state split over data (and the other batch axes) is split `replicas` ways on the
    # reduced mesh, `data` ways on the full one: elementwise kernels, read and written once
    # a step (sharding/extrapolate.py)
    return (f"each device's program is the same but for the distributed optimizer's update, "
            f"of {exp.parallelism.data // replicas} times the share of its state a device of "
            f"the run updates: its HBM traffic, and the compiler's memory figure, are the "
            f"reduced run's")


def _no_reduced_run(exp: Experiment, limit: int) -> str:
    """Why no fewer data-parallel replicas of `exp` compile within `limit` devices."""
    system, data = exp.system, exp.parallelism.data
    per_replica = system.num_devices // data
    small = [d for d in range(2, data) if per_replica * d <= limit]
    if small and not any(data % d == 0 for d in small):
        near = [d for d in range(data - 1, data + 2) if any(d % k == 0 for k in small)]
        return (f"the replicas compiled must divide parallelism.data = {data}, and none "
                f"from 2 to {small[-1]} (the most that fit in {limit} devices) does; choose "
                f"a data size with a small divisor ({' or '.join(map(str, near))})")
    return (f"parallelism.data = {data} leaves {per_replica} devices per data-parallel "
            f"replica; put more of the devices on data (at most {limit} devices per "
            f"compiled slice, the batch divisible"
            + (", whole chips of a slice shape the family has)" if isinstance(
                system, TpuSystem) else ")"))


def _on(small, full) -> str:
    """The reduced system's name where it is not simply fewer GPUs of the family."""
    return f"{small.name}, " if isinstance(full, TpuSystem) else ""


def _reduced_system_name(system, devices: int) -> str | None:
    """A system of the same family with `devices` devices, to compile the reduced run on
    (only its device count and chip matter there: the full system times it). GPUs: any
    count. TPU-like tori: fewer slices of the same shape, or one slice with its slowest
    dimension shortened (the device ids' outermost), or any shape the family allows; None
    when none has that many devices."""
    family = system.family.name
    if not isinstance(system, TpuSystem):
        return f"{family}:{devices}"
    chips, rest = divmod(devices, system.chip.devices_per_chip)
    if rest:
        return None
    shape, per_slice = system.shape, math.prod(system.shape)
    def name(dims, slices=1):
        return f"{family}:{'x'.join(map(str, dims))}" + (f"*{slices}" if slices > 1 else "")
    if chips % per_slice == 0:
        return name(shape, chips // per_slice)
    inner = math.prod(shape[:-1])
    shorter = (*shape[:-1], chips // inner)
    if chips % inner == 0 and chips // inner <= shape[-1] and \
            system.family.shape_error(shorter) is None:
        return name(shorter)
    for dims in itertools.product(*(range(1, m + 1) for m in system.family.max_shape)):
        if math.prod(dims) == chips and system.family.shape_error(dims) is None:
            return name(dims)
    return None


def _scaled(x: float | None, k: int) -> float | None:
    return None if x is None else x * k


