"""`shardscope measure`: run a config's step for real on the devices present, time it,
profile it, and put the measurement beside the estimate, category by category.

The program is the one `run` compiles (experiments/runner.py: the same mesh, rules and
jitted step), given concrete arguments made on the devices with the same shardings
(`Program.init`: the model's own initial weights, random tokens). `warmup` steps run
untimed, then `steps` timed ones, each waited for. On CPU devices the estimate is for
`host-cpu:N` (meshes/host.py: this host's measured rates shared by the N fake devices);
on accelerators, for the config's own system, which must be the kind present.

Across hosts: `jax.distributed` from `--coordinator/--num-processes/--process-id`, or
from what JAX detects itself (SLURM, Cloud TPU pods); each process holds its local
devices (on CPU, the config's device count split evenly, collectives over gloo) and
process 0 writes the outputs.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import statistics
import sys
import time

from experiments.config import ConfigError, Experiment
from meshes.host import FAMILY as HOST_CPU

DEFAULT_STEPS = 5
DEFAULT_WARMUP = 2
# The profiled steps' compile, by backend: XLA:GPU runs most kernels in command buffers
# (CUDA graphs), whose kernels the profiler reports under the command buffer's call, not
# their instructions (openxla/xprof#3070); the profiled steps run without them so that each
# kernel has its category. The timed steps keep them.
PROFILE_OPTIONS = {"gpu": {"xla_gpu_enable_command_buffer": ""}}


@dataclasses.dataclass(frozen=True)
class Processes:
    """How many processes run the step, and which one this is."""

    count: int = 1
    index: int = 0


def start_processes(exp: Experiment, *, coordinator: str | None = None,
                    num_processes: int | None = None, process_id: int | None = None
                    ) -> Processes:
    """Join the other processes (`jax.distributed.initialize`) when told to, or when the
    environment says this is one process of several; on CPU also ask for this process's
    share of the config's devices. Must run before anything starts a JAX backend."""
    import jax

    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise ConfigError("multi-host measure needs all three of --coordinator HOST:PORT, "
                          "--num-processes N and --process-id I (or none, to let JAX read "
                          "SLURM's or the TPU pod's environment)")
    launched, launcher = (0, "") if any(given) else _launched_processes()
    count = num_processes or 1
    # CPU devices of several processes talk over gloo (no effect on GPU and TPU devices)
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except RuntimeError:
        pass  # the backend is up (one process: nothing to talk to)
    if all(given):
        host, colon, port = coordinator.rpartition(":")
        if not (colon and host and port.isdigit()):
            raise ConfigError(f"--coordinator {coordinator!r} is not HOST:PORT; give process "
                              f"0's address and a free port, e.g. node0:12345")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id {process_id} is outside 0..{num_processes - 1}; "
                              f"give each process its own id below --num-processes")
        _local_cpu_devices(exp, num_processes)
        print(f"process {process_id} of {num_processes}: joining the others at {coordinator} "
              f"(jax.distributed; it waits until all {num_processes} have started)",
              file=sys.stderr, flush=True)
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id)
    elif launched > 1:
        _local_cpu_devices(exp, launched)
        try:
            jax.distributed.initialize()  # JAX reads the launcher's environment itself
        except (ValueError, RuntimeError) as e:  # the variable, without the rest of it
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"{launcher} says this is one of {launched} processes, but JAX could not join "
                f"them ({first}); start it under that launcher (srun, the TPU pod's workers), "
                f"or unset {launcher.split('=')[0]} to measure in one process, or give "
                f"--coordinator HOST:PORT --num-processes N --process-id I") from None
        count = launched
    else:
        _local_cpu_devices(exp, 1)
    return Processes(jax.process_count(), jax.process_index()) if count > 1 else Processes()


def _launched_processes() -> tuple[int, str]:
    """How many processes a launcher started, from the environment JAX also reads: a SLURM
    job's tasks, a Cloud TPU pod's workers, JAX_NUM_PROCESSES; and the variable that says
    so, as `NAME=value` (for the error when JAX cannot join them). (1, "") otherwise."""
    env = os.environ
    hosts = env.get("TPU_WORKER_HOSTNAMES")
    for name, count in (("JAX_NUM_PROCESSES", env.get("JAX_NUM_PROCESSES")),
                        ("SLURM_NTASKS", env.get("SLURM_NTASKS")),
                        ("TPU_WORKER_HOSTNAMES", str(len(hosts.split(","))) if hosts else None)):
        if count and count.isdigit() and int(count) > 1:
            return int(count), f"{name}={env[name]}"
    return 1, ""


def _local_cpu_devices(exp: Experiment, processes: int) -> None:
    """This process's share of the config's devices as fake CPU devices (unused where
    accelerators are present)."""
    import jax

    n = exp.system.num_devices
    if n % processes:
        raise ConfigError(f"system.name={exp.system.name!r} has {n} devices, which "
                          f"{processes} processes cannot share evenly; run a number of "
                          f"processes that divides {n}")
    try:
        if n // processes > int(jax.config.jax_num_cpu_devices):
            jax.config.update("jax_num_cpu_devices", n // processes)
    except RuntimeError:
        pass  # started already (a test's JAX): the device check in `measure` says if short


def present_kind() -> tuple[str, str]:
    """("cpu" | "gpu" | "tpu", the device kind in words) of the devices JAX sees."""
    import jax

    from sharding.compiler import backend_of

    d = jax.devices()[0]
    return backend_of(d), getattr(d, "device_kind", d.platform)


def system_for(exp: Experiment, kind: str, device_kind: str = "", *, cache: bool = True):
    """The system the measured run is estimated on: `host-cpu:N` on CPU devices (N: the
    config's device count; `cache=False`: a benchmark it needs is not kept); on
    accelerators the config's own, which must be that kind."""
    from meshes import GpuSystem, TpuSystem, get_system
    from meshes.host import HostCpuSystem, host_rates

    if kind == "cpu":
        n = exp.system.num_devices
        return get_system(f"{HOST_CPU}:{n}") if cache else \
            HostCpuSystem(n, host_rates(n, write_cache=False))
    want = ("tpu" if isinstance(exp.system, TpuSystem)
            else "gpu" if isinstance(exp.system, GpuSystem) else "cpu")
    if want != kind:
        raise ConfigError(
            f"system.name={exp.system.name!r} is a {want.upper()} system but the devices "
            f"here are {kind.upper()}s ({device_kind or kind}); run measure where its "
            f"{want.upper()}s are, or give the config a {kind.upper()} system of "
            f"{exp.system.num_devices} devices (--set system.name=...; `shardscope "
            f"systems` lists them)")
    return exp.system


def measure(exp: Experiment, *, steps: int = DEFAULT_STEPS, warmup: int = DEFAULT_WARMUP,
            profile_dir: str | None = None, calibration=None, seed: int = 0,
            processes: Processes = Processes(), estimate: bool = True):
    """Run `exp`'s step on the devices present and (on process 0, unless `estimate` is
    False) estimate it: a Measurement."""
    import jax

    import sharding
    from experiments import runner
    from sharding.compiler import compiler_name

    kind, device_kind = present_kind()
    # On CPU devices process 0 first: its system may benchmark the host (an empty cache),
    # which the others must not do at the same time (each would time a share of its cores,
    # and write that to the cache); they wait in `_agreed`, then read its figures. On
    # accelerators every process checks the config's system before `_agreed`, so that a
    # wrong kind stops all of them (one refusing alone left the others waiting there).
    system = system_for(exp, kind, device_kind) \
        if kind != "cpu" or processes.index == 0 else None
    profiled = _agreed(processes, steps=steps, warmup=warmup, profile=profile_dir is not None)
    if system is None:
        system = system_for(exp, kind, device_kind, cache=False)
    run = dataclasses.replace(exp, system=system, model=as_run(exp.model))
    n = system.num_devices
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) < n:
        raise ConfigError(f"system.name={exp.system.name!r} needs {n} devices and "
                          f"{len(devices)} {kind.upper()} devices are here; change the "
                          f"parallelism sizes to {len(devices)} devices in all")
    mesh = sharding.make_mesh(system, exp.parallelism.sizes(), devices=devices[:n],
                              outer=exp.parallelism.outer)
    step = runner.build_step(run, mesh)
    program = step.program
    compiled = program.step.lower(*program.args).compile()
    args = program.init(seed)
    args, _ = _steps(compiled, args, warmup, step.serving)
    args, timed = _steps(compiled, args, steps, step.serving)
    trace = None
    if profiled:  # on every process: the steps' collectives need all of them
        traced = compiled if kind not in PROFILE_OPTIONS else program.step.lower(
            *program.args).compile(compiler_options=PROFILE_OPTIONS[kind])
        if processes.index == 0:
            with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
                args, _ = _steps(traced, args, steps, step.serving)
            trace = _profile(profile_dir, traced.as_text(), steps)
        else:  # the others run the steps with it, and write nothing
            args, _ = _steps(traced, args, steps, step.serving)
    report = None
    if processes.index == 0 and estimate:
        report = runner.analyze_step(run, step, mesh, calibration=calibration,
                                     compiler=compiler_name(kind, system))
    return Measurement(
        name=exp.name, asked_system=exp.system.name, system=system.name, backend=kind,
        device_kind=device_kind, backend_version=_backend_version(devices[0]),
        devices=n, process_count=processes.count,
        step_times_s=tuple(t for t, _ in timed),
        loss=None if step.serving else tuple(loss for _, loss in timed),
        peak_memory_bytes=_peak_memory(devices[:n]), estimate=report, profile=trace,
        profile_dir=profile_dir or "", attention=run.model.attention,
        asked_attention=exp.model.attention, host=socket.gethostname(),
        date=datetime.date.today().isoformat(), jax_version=jax.__version__)


def _agreed(processes: Processes, *, steps: int, warmup: int, profile: bool) -> bool:
    """Whether the profiled steps run. Every process must run the same steps, profiled ones
    included (each step's collectives wait for all of them), so the processes compare
    their --steps and --warmup (an error on every one of them when they differ) and follow
    process 0's --profile: it takes the trace; the others run the steps untraced."""
    if processes.count == 1:
        return profile
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.array([steps, warmup, int(profile)], dtype=np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [process, 3]
    first = every[0]
    for i, (s, w, _) in enumerate(every.tolist()):
        if (s, w) != (first[0], first[1]):
            raise ConfigError(f"process {i} runs --steps {s} --warmup {w}, process 0 --steps "
                              f"{first[0]} --warmup {first[1]}: every process runs the same "
                              f"steps (their collectives need all of them); give every "
                              f"process the same --steps and --warmup")
    if profile and not first[2]:
        print(f"process {processes.index}: --profile is process 0's to give (it takes the "
              f"trace); process 0 has none, so no step is profiled", file=sys.stderr)
    return bool(first[2])


def as_run(model):
    """The model as the devices run it: flash attention's blocks are the XLA kernels they
    compile to, each tile's scores through HBM ("tiled"), not a fused kernel."""
    return dataclasses.replace(model, attention="tiled") if model.attention == "flash" \
        else model


def _steps(compiled, args, k: int, serving: bool):
    """Run `k` steps, each waited for: (the arguments of the next, [(seconds, loss)])."""
    import jax

    out = []
    for i in range(k):
        t0 = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        dt = time.perf_counter() - t0
        if not serving:  # train: (params, opt_state, loss); both states donated
            params, opt_state, loss = result
            args = (params, opt_state, args[2])
            out.append((dt, float(loss)))
        elif len(args) == 4:  # decode: the cache donated, the next position
            args = (args[0], result[1], args[2], _position(args[3], i + 1))
            out.append((dt, None))
        else:
            out.append((dt, None))
    return args, out


def _position(index, i: int):
    import jax
    import jax.numpy as jnp

    return jax.device_put(jnp.int32(i), index.sharding)


def _peak_memory(devices) -> float | None:
    """The largest peak bytes in use of the local devices, where the backend says."""
    peaks = []
    import jax

    for d in devices:
        if d.process_index != jax.process_index():
            continue
        try:
            stats = d.memory_stats() or {}
        except (NotImplementedError, RuntimeError):
            stats = {}
        if "peak_bytes_in_use" in stats:
            peaks.append(float(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def _backend_version(device) -> str:
    """The runtime's own version (CUDA's, libtpu's), or jaxlib's for the CPU's."""
    import jaxlib

    try:
        version = str(device.client.platform_version).strip()
    except AttributeError:
        version = ""
    return version if version and version != device.platform else \
        f"jaxlib {jaxlib.__version__}"


def _profile(directory: str, hlo_text: str, steps: int):
    from sharding.profile import profile_by_category, read_events, trace_file

    return profile_by_category(read_events(trace_file(directory)), hlo_text, steps=steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurement:
    """A measured run and its estimate (`estimate`: the Report, None on processes other
    than 0; `profile`: device time per category, with --profile)."""

    name: str
    asked_system: str
    system: str
    backend: str
    device_kind: str
    backend_version: str
    devices: int
    process_count: int
    step_times_s: tuple[float, ...]
    loss: tuple[float, ...] | None
    peak_memory_bytes: float | None
    estimate: object
    profile: object
    profile_dir: str
    attention: str = "flash"  # model.attention as run (as_run), and as the config asked
    asked_attention: str = "flash"
    host: str
    date: str
    jax_version: str

    @property
    def measured_step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def estimated_step_time_s(self) -> float | None:
        return None if self.estimate is None else self.estimate.step_time_s

    @property
    def error(self) -> float | None:
        """(estimate - measured) / measured, as `validate` has it."""
        est = self.estimated_step_time_s
        return None if est is None else (est - self.measured_step_time_s) / \
            self.measured_step_time_s

    @property
    def turns(self) -> int:
        """The fake devices taking turns on the host (host-cpu:N): the estimate shares the
        host's rate between them, each one's trace holds its own kernels at the full rate
        and the others' turns inside its collectives. 1 on accelerators."""
        return self.devices if self.system.startswith(f"{HOST_CPU}:") else 1

    def categories(self) -> list[dict]:
        """matmul, memory-bound and each collective kind: measured (with --profile) and
        estimated seconds per step per device."""
        est: dict[str, float] = {}
        if self.estimate is not None:
            # each device's own kernels, as its trace holds them: at the host's full rate
            turns = self.turns
            est = {"matmul": self.estimate.compute.matmul_s / turns,
                   "memory-bound": self.estimate.compute.memory_bound_s / turns}
            for c in self.estimate.collectives:
                est[c.kind] = est.get(c.kind, 0.0) + c.total_time_s
        got = dict(self.profile.seconds) if self.profile is not None else {}
        names = ["matmul", "memory-bound", *sorted((set(est) | set(got))
                                                   - {"matmul", "memory-bound"})]
        return [{"category": k, "measured_s": got.get(k) if self.profile else None,
                 "estimated_s": est.get(k)} for k in names]

    def to_dict(self) -> dict:
        return {"name": self.name, "measured_step_time_s": self.measured_step_time_s,
                "estimated_step_time_s": self.estimated_step_time_s, "error": self.error,
                "step_times_s": list(self.step_times_s),
                "loss": list(self.loss) if self.loss is not None else None,
                "peak_memory_bytes": self.peak_memory_bytes,
                "categories": self.categories(), "process_count": self.process_count,
                "devices": self.devices, "backend": self.backend,
                "device_kind": self.device_kind, "backend_version": self.backend_version,
                "system": self.system, "config_system": self.asked_system,
                "host": self.host, "date": self.date, "jax_version": self.jax_version,
                "profile_dir": self.profile_dir or None, "attention": self.attention}

    def format(self) -> str:
        """The terminal report: the step measured and estimated, the loss, the memory, and
        the table by category."""
        from experiments.cli.output import format_columns
        from sharding.profile import UNATTRIBUTED
        from sharding.units import fmt_bytes, fmt_s

        kind = f" ({self.device_kind})" if self.device_kind != self.backend else ""
        on = (f"{self.devices} {self.backend.upper()} device{'s' * (self.devices != 1)}{kind}"
              + (f" in {self.process_count} processes" if self.process_count > 1 else ""))
        asked = f" (the config asks for {self.asked_system})" \
            if self.asked_system != self.system else ""
        ts = self.step_times_s
        lines = [f"{self.name}: measured on {on}, estimated as {self.system}{asked}",
                 f"step         measured {fmt_s(self.measured_step_time_s)} (median of "
                 f"{len(ts)}; {fmt_s(min(ts))} to {fmt_s(max(ts))})"
                 + (f", estimated {fmt_s(self.estimated_step_time_s)} ({self.error:+.1%})"
                    if self.estimate is not None else "")]
        if self.attention != self.asked_attention:
            lines.append(f'attention    estimated as model.attention = "{self.attention}", not '
                         f'the config\'s "{self.asked_attention}": here flash attention runs '
                         f"as separate XLA kernels that write each tile's scores to memory; "
                         f"`run` assumes one fused kernel that keeps them on chip")
        if self.loss:
            lines.append("loss         " + " ".join(f"{x:.4f}" for x in self.loss))
        lines.append("peak memory  " + (fmt_bytes(self.peak_memory_bytes)
                                        if self.peak_memory_bytes is not None else
                                        f"not reported by the {self.backend.upper()} backend"))
        rows = []
        for c in self.categories():
            m, e = c["measured_s"], c["estimated_s"]
            err = f"{(e - m) / m:+.0%}" if m and e is not None else "-"
            rows.append((c["category"], fmt_s(m) if m is not None else "-",
                         fmt_s(e) if e is not None else "-", err))
        lines += ["", "per step and device:",
                  format_columns(("category", "measured", "estimated", "error"), rows)]
        if self.profile is None:
            lines.append("(measured by category with --profile DIR)")
        else:
            lines.append(f"(device time from the trace in {self.profile_dir}: "
                         f"{self.profile.events} events on {self.profile.devices} devices)")
            if self.turns > 1:
                lines.append(f"(the {self.turns} CPU devices take turns on this host's cores: "
                             f"matmul and memory-bound estimated at the host's full rate, as "
                             f"each device's trace holds them; the others' turns show in its "
                             f"collectives)")
            if UNATTRIBUTED in self.profile.seconds:
                lines.append("(unattributed: kernels the trace names only by the command "
                             "buffer or call that ran them)")
        return "\n".join(lines)


def to_toml(exp: Experiment, m: Measurement) -> str:
    """The config as measured, with its `[measured]` table, for `validate` and
    `calibrate`: its system is the one it was estimated on (host-cpu:N on CPU)."""
    from experiments.importer import _toml_value

    raw = exp.to_dict()
    # the config's [system] overrides (nic_gbps, ...) describe its own system: kept when
    # that is the one measured, dropped on host-cpu:N (which takes none: its rates are
    # this host's), and the file says which were dropped
    own = {k: v for k, v in raw["system"].items() if k != "name"}
    dropped = sorted(own) if m.system != m.asked_system else []
    raw["system"] = {"name": m.system, **({} if dropped else own)}
    raw["model"] = {**raw["model"], "attention": m.attention}
    measured = {"step_time_s": float(f"{m.measured_step_time_s:.6g}"),
                "source": f"shardscope measure on {m.host}, median of "
                          f"{len(m.step_times_s)} steps",
                "evidence": "shardscope measure", "host": m.host, "date": m.date,
                "jax_version": m.jax_version,
                "backend": m.backend if m.device_kind == m.backend
                else f"{m.backend} {m.device_kind}",
                "backend_version": m.backend_version}
    lines = [f"# Measured by `shardscope measure` on {m.host} on {m.date}: {m.devices} "
             f"{m.backend.upper()} devices ({m.device_kind}), processes: {m.process_count}.",
             f"# The config asked for {m.asked_system}"
             + (f" with {', '.join(f'{k} = {_toml_value(own[k])}' for k in dropped)}: left "
                f"out here ({m.system} takes no [system] overrides)." if dropped else "."),
             f"name = {_toml_value(raw['name'])}"]
    for table in ("model", "system", "parallelism", "workload", "precision", "train"):
        lines += ["", f"[{table}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in raw[table].items()
                  if v not in ([], None, ())]
    lines += ["", "[measured]", *(f"{k} = {_toml_value(v)}" for k, v in measured.items())]
    return "\n".join(lines) + "\n"

