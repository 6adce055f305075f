"""`analyze` any JAX function on a mesh; `analyze_hlo` any HLO dump.

On the CPU backend the HLO read is the module right after SPMD partitioning: it has the
program's dtypes (the final CPU HLO upcasts bf16 collectives and dots to f32, which would
double their bytes) and every collective the partitioner placed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh

from meshes import System, get_system
from sharding.collectives import Collective, extract_collectives
from sharding.compute import computation_costs, compute_cost
from sharding.schedule import Scheduler
from sharding.hlo import HloModule, parse_hlo
from sharding.report import Memory, Report

# XLA log lines worth showing the user, with the words that identify them.
_XLA_WARNINGS = (
    "Involuntary full rematerialization",
    "SPMD will replicate",
)


@contextlib.contextmanager
def capture_stderr():
    """Capture what C++ libraries write to fd 2 (XLA, libtpu), yielding a list that is
    filled with the captured lines on exit."""
    lines: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


_REMAT = re.compile(r"cannot go from sharding (.+?) to (.+?) efficiently for HLO operation "
                    r"%?([\w.\-]+) = (\S+)")


def xla_warnings(lines: Sequence[str]) -> list[str]:
    """XLA's SPMD warnings from captured stderr, one line each, de-duplicated."""
    out: list[str] = []
    for line in lines:
        if not any(w in line for w in _XLA_WARNINGS):
            continue
        m = _REMAT.search(line)
        if m:
            src, dst, op, shape = m.groups()
            msg = (f"involuntary full rematerialization of {op} {shape.split('{')[0]}: XLA "
                   f"replicates it to go from sharding {src} to {dst}")
        else:
            msg = re.sub(r"^.*?\] ", "", line).strip()
        if msg not in out:
            out.append(msg)
    return out


class DoesNotFit(ValueError):
    """The target compiler refused the program: it needs more memory than the device has."""


@dataclasses.dataclass
class Compiled:
    hlo_text: str
    compiled: object  # jax.stages.Compiled
    compiler: str
    timings: dict[str, float]
    warnings: list[str]


def compile_to_hlo(fn: Callable, *args, final_hlo: bool = False, **kwargs) -> Compiled:
    """Lower and compile; keep the post-SPMD HLO (or the final one), timings and XLA's SPMD
    warnings."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="shardscope-dump-") as dump, capture_stderr() as err:
        t0 = time.perf_counter()
        lowered = jitted.lower(*args, **kwargs)
        t1 = time.perf_counter()
        options = {} if final_hlo else {"xla_dump_to": dump,
                                         "xla_dump_hlo_pass_re": "spmd-partitioning"}
        try:
            compiled = lowered.compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as e:
            first = str(e).strip().splitlines()[0]
            if "RESOURCE_EXHAUSTED" in first:
                raise DoesNotFit(f"the program does not fit: {first.split(': ', 1)[-1]} "
                                 f"(compile with --backend cpu to see its collectives "
                                 f"anyway, or shard more / rematerialise more)") from None
            raise
        t2 = time.perf_counter()
        timings["lower_s"] = t1 - t0
        timings["compile_s"] = t2 - t1
        files = sorted(glob.glob(os.path.join(dump, "*after_spmd-partitioning*.txt")))
        if final_hlo:
            text = compiled.as_text()
            compiler = "the final optimised HLO"
        elif files:
            with open(files[-1]) as f:
                text = f.read()
            compiler = "XLA:CPU (after SPMD partitioning)"
        else:
            text = compiled.as_text()
            compiler = "final optimised HLO"
    return Compiled(text, compiled, compiler, timings, xla_warnings(err))


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
        out.append(dataclasses.replace(c, link=t.link, time_s=t.time_s, algorithm=t.algorithm))
    return out


_COMPILER_REMAT = re.compile(r"\.remat\d*$")


def _remat_note(module) -> tuple[str, ...]:
    """The target compiler's own rematerialisation (XLA:GPU's HLO rematerialisation pass
    names its copies `*.remat`, `*.remat2`, ...): it recomputes when the program would not
    fit in HBM otherwise, and the extra work is in the estimate."""
    names = [i for comp in module.computations.values() for i in comp.instructions
             if i.opcode in ("fusion", "dot", "custom-call") and _COMPILER_REMAT.search(i.name)]
    if not names:
        return ()
    return (f"the compiler rematerialised {len(names)} kernels (recomputed to fit in HBM; "
            f"e.g. {names[0].name}): their work is in the estimate; more remat or sharding in "
            f"the config would control it",)


def analyze_module(
    module: HloModule,
    *,
    system: System,
    mesh_shape: Sequence[int] = (),
    axis_names: Sequence[str] = (),
    device_ids: Sequence[int] | None = None,
    compiler: str = "",
    memory: Memory | None = None,
    compute_dtype: str | None = None,
    model_flops_per_step: float | None = None,
    tokens_per_step: float | None = None,
    timings: dict[str, float] | None = None,
    warnings: Sequence[str] = (),
    name: str = "",
) -> Report:
    """Report for a parsed per-device module on `system`."""
    timings = dict(timings or {})
    t0 = time.perf_counter()
    collectives, unknown = extract_collectives(module, mesh_shape=mesh_shape,
                                               axis_names=axis_names)
    n = module.num_partitions
    if n > system.num_devices:
        raise ValueError(f"the program runs on {n} devices but {system.name} has "
                         f"{system.num_devices}; pick a system with at least {n} devices")
    ids = list(device_ids) if device_ids is not None else list(range(n))
    collectives = _time_collectives(collectives, system, ids)
    cost = compute_cost(module, system.chip, compute_dtype=compute_dtype)
    per_comp = computation_costs(module, system.chip, compute_dtype=compute_dtype)
    schedule = Scheduler(
        module,
        {name: c.times for name, c in per_comp.items()},
        {(c.computation, c.name): (c.time_s, c.link) for c in collectives},
    ).run()
    timings["estimate_s"] = time.perf_counter() - t0
    dtype = compute_dtype or "bfloat16"
    return Report(
        name=name,
        system=system.name,
        num_devices=n,
        compiler=compiler,
        collectives=collectives,
        compute=cost,
        memory=memory or Memory(components=(), source="unknown (HLO text only)"),
        hbm_capacity_bytes=system.chip.hbm_bytes,
        peak_flops_per_device=system.chip.peak_for(dtype),
        model_flops_per_step=model_flops_per_step,
        tokens_per_step=tokens_per_step,
        timings=timings,
        warnings=tuple(warnings) + tuple(module.notes) + _remat_note(module),
        unknown_ops=tuple(unknown),
        scheduled_step_s=schedule.step_s,
    )


def compiled_memory(compiled, *, on_cpu: bool = True) -> Memory:
    """Memory per device from the compiler's buffer assignment (arguments, outputs that do
    not alias them, temporaries). On XLA:CPU the temporaries are an upper bound for a bf16
    program: the CPU upcasts bf16 to f32."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 -- backends without it raise assorted errors
        ma = None
    if ma is None:
        return Memory(components=(), source="no compiler memory analysis")
    return Memory(
        components=(
            ("arguments", float(ma.argument_size_in_bytes)),
            ("outputs not aliasing arguments",
             float(max(0, ma.output_size_in_bytes - ma.alias_size_in_bytes))),
            ("temporaries", float(ma.temp_size_in_bytes)),
        ),
        source="XLA:CPU buffer assignment (bf16 temporaries upcast to f32: an upper bound)"
        if on_cpu else "the target compiler's buffer assignment",
    )


def analyze(
    fn: Callable,
    *args,
    mesh: Mesh,
    system: str | System,
    compute_dtype: str | None = None,
    model_flops_per_step: float | None = None,
    tokens_per_step: float | None = None,
    name: str = "",
    compiler: str | None = None,
) -> Report:
    """Compile `fn(*args)` over `mesh` and report its collectives, time and memory.

    Args:
        fn: any callable or `jax.jit` object; `shard_map` inside is fine.
        *args: concrete arrays or `jax.ShapeDtypeStruct`s with shardings; nothing is
            allocated.
        mesh: the mesh the program is sharded over (device i of its row-major order is
            system device id `mesh.devices.flat[i].id`).
        system: a system name like "gb200-nvl72:72" or a `meshes.System`.
        compute_dtype: time matmuls at this dtype's peak (e.g. "float8").
        model_flops_per_step: for MFU; HLO matmul FLOPs are used when absent.
        tokens_per_step: for tokens/s.
        compiler: a name for the compiler, e.g. "TPU compiler (deviceless v6e:2x4)"; TPU
            and GPU devices are compiled for and read from their final HLO, CPU devices
            from the HLO after SPMD partitioning.
    """
    from sharding.backends import system_device_id

    system = get_system(system) if isinstance(system, str) else system
    on_cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
    with jax.set_mesh(mesh):
        c = compile_to_hlo(fn, *args, final_hlo=not on_cpu)
    if compiler:
        c.compiler = compiler
    t0 = time.perf_counter()
    module = parse_hlo(c.hlo_text)
    c.timings["parse_s"] = time.perf_counter() - t0
    device_ids = [system_device_id(system, d) for d in mesh.devices.flat]
    return analyze_module(
        module,
        system=system,
        mesh_shape=mesh.devices.shape,
        axis_names=mesh.axis_names,
        device_ids=device_ids,
        compiler=c.compiler,
        memory=compiled_memory(c.compiled, on_cpu=on_cpu),
        compute_dtype=compute_dtype,
        model_flops_per_step=model_flops_per_step,
        tokens_per_step=tokens_per_step,
        timings=c.timings,
        warnings=c.warnings,
        name=name,
    )


def analyze_hlo(
    hlo_text: str,
    *,
    system: str | System,
    mesh_shape: Sequence[int] = (),
    axis_names: Sequence[str] = (),
    name: str = "",
) -> Report:
    """Report for any HLO dump; give the mesh shape and axis names to map groups to axes."""
    system = get_system(system) if isinstance(system, str) else system
    t0 = time.perf_counter()
    module = parse_hlo(hlo_text)
    timings = {"parse_s": time.perf_counter() - t0}
    return analyze_module(module, system=system, mesh_shape=mesh_shape, axis_names=axis_names,
                          compiler="HLO text", timings=timings, name=name)
