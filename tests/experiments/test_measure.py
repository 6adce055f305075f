"""`shardscope measure`: the config's step run for real on fake CPU devices, timed, profiled
and estimated as host-cpu:N; its --out through `validate`; two processes over
jax.distributed; the refusal on accelerators of another kind; the host-cpu benchmark's
cache."""

import gzip
import json
import os
import socket
import subprocess
import sys

import pytest

from experiments import config, measure
from experiments.config import ConfigError
from tests.conftest import REPO
from tests.helpers import run_cli

# The bundled tiny config on 4 devices (data 2 x tensor 2), a short sequence.
SMALL = ["--set", "system.name=h100:4", "--set", "parallelism.tensor=2",
         "--set", "workload.seq_len=32", "--set", "workload.global_batch=4"]
CONTRACT_KEYS = {"measured_step_time_s", "estimated_step_time_s", "error", "step_times_s",
                 "loss", "peak_memory_bytes", "categories", "process_count", "devices",
                 "backend"}


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """The host-cpu benchmark's cache in a folder of the tests' own."""
    home = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def measured(cache_home, tmp_path_factory):
    """One measure run of the small config, with a profile, --json and --out."""
    d = tmp_path_factory.mktemp("measure")
    # a calibration of GPU parameters: none scales this host's measured rates
    (d / "gpu-cal.toml").write_text('[parameters]\ngpu_bf16_matmul_efficiency = 0.4\n'
                                '[provenance]\nsummary = "my cluster"\n')
    args = ["measure", "tiny-h100-dp-tp", *SMALL, "--steps", "3", "--warmup", "1",
            "--profile", str(d / "trace"), "--json", str(d / "m.json"),
            "--out", str(d / "run.toml"), "--calibration", str(d / "gpu-cal.toml"), "--quiet"]
    from experiments import cli

    code = cli.main(args)
    assert code == 0
    return d, json.loads((d / "m.json").read_text())


def test_measure_runs_trains_and_estimates_as_host_cpu(measured):
    d, m = measured
    assert CONTRACT_KEYS <= set(m)
    assert m["backend"] == "cpu" and m["devices"] == 4 and m["process_count"] == 1
    # on CPU devices the estimate is for this host; the config asked for an HGX node
    assert m["system"] == "host-cpu:4" and m["config_system"] == "h100:4"
    assert len(m["step_times_s"]) == 3 and all(t > 0 for t in m["step_times_s"])
    assert m["measured_step_time_s"] == sorted(m["step_times_s"])[1]  # the median
    assert m["estimated_step_time_s"] > 0
    # --calibration FILE: the JSON says which calibration its estimate used, as run's does
    assert m["calibration"]["source"].startswith("my cluster") and str(d / "gpu-cal.toml") in \
        m["calibration"]["source"] and m["calibration"]["gpu_bf16_matmul_efficiency"] == 0.4
    assert m["error"] == pytest.approx((m["estimated_step_time_s"] - m["measured_step_time_s"])
                                       / m["measured_step_time_s"])
    # training trains: a fixed batch, AdamW at 3e-4, the loss falls every step
    loss = m["loss"]
    assert len(loss) == 3 and loss[0] > loss[1] > loss[2]
    assert m["peak_memory_bytes"] is None  # XLA:CPU reports no memory stats
    # flash attention runs as XLA's kernels, and is estimated so ("tiled")
    assert m["attention"] == "tiled"
    rows = {c["category"]: c for c in m["categories"]}
    # data 2 x tensor 2: the tensor-parallel matmuls' partial sums and the gradients are
    # all-reduced, so the profile and the estimate both have matmul, memory-bound kernels
    # and all-reduce time
    for cat in ("matmul", "memory-bound", "all-reduce"):
        assert rows[cat]["measured_s"] > 0 and rows[cat]["estimated_s"] > 0, cat
    # the raw trace is kept for TensorBoard / Perfetto
    traces = list((d / "trace").glob("**/*.trace.json.gz"))
    assert traces and json.load(gzip.open(traces[0]))


def test_measure_out_round_trips_through_validate(measured):
    from experiments.validate import validate

    d, m = measured
    exp = config.load(d / "run.toml")
    assert exp.system.name == "host-cpu:4" and exp.model.attention == "tiled"
    assert exp.measured.evidence == "shardscope measure"
    assert exp.measured.host == socket.gethostname() and exp.measured.date
    assert exp.measured.jax_version and exp.measured.backend.startswith("cpu")
    [row] = validate([d / "run.toml"], workers=1)
    assert row.status == "ok", row.message
    assert row.measured_s == pytest.approx(m["measured_step_time_s"], rel=1e-5)
    # the same program on the same host's cached rates: validate's estimate is measure's
    assert row.estimate_s == pytest.approx(m["estimated_step_time_s"], rel=1e-6)


def test_host_cpu_benchmark_is_cached_and_dated(measured, cache_home, monkeypatch, capsys):
    from meshes import get_system, host

    cached = json.loads((cache_home / "shardscope" / "host-cpu.json").read_text())
    assert cached["host"] == socket.gethostname()
    rates = cached["rates"]["4"]
    assert rates["date"] and rates["devices"] == 4 and rates["memory_bytes_per_s"] > 0
    assert 0 < rates["kernel_overhead_s"] < 1e-3
    assert set(rates["matmul_flops_per_s"]) == {"bfloat16", "float32"}

    def fail(devices):
        raise AssertionError("benchmarked again instead of reading the cache")

    monkeypatch.setattr(host, "benchmark", fail)
    s = get_system("host-cpu:4")
    assert s.chip.peak_flops_per_s["float32"] == max(r for _, r in
                                                    rates["matmul_flops_per_s"]["float32"])
    assert rates["date"] in dict(s.describe())["device"]
    # its own measured per-kernel time, not the fit's (fitted on GPU and TPU runs)
    assert s.chip.kernel_overhead_s == rates["kernel_overhead_s"]
    # `shardscope systems` shows the cached figures, dated
    code, out, _ = run_cli(["systems"], capsys)
    assert code == 0 and "host-cpu:N" in out
    assert "4 fake CPU devices" in out and f"on {rates['date']}" in out


def test_accelerators_of_another_kind_are_refused():
    exp = config.load("tiny-h100-dp-tp")
    with pytest.raises(ConfigError) as e:
        measure.system_for(exp, "tpu", "TPU v6 lite")
    msg = str(e.value)
    assert "\n" not in msg and "h100:8" in msg and "GPU" in msg and "TPU v6 lite" in msg
    assert measure.system_for(exp, "gpu", "NVIDIA H100") is exp.system


def test_processes_a_launcher_started_are_read_from_its_environment(monkeypatch):
    for key in ("JAX_NUM_PROCESSES", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(key, raising=False)
    assert measure._launched_processes() == (1, "")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")  # a single-host TPU VM
    assert measure._launched_processes() == (1, "")
    hosts = "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5"
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", hosts)
    assert measure._launched_processes() == (4, f"TPU_WORKER_HOSTNAMES={hosts}")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert measure._launched_processes() == (2, "SLURM_NTASKS=2")


def test_a_launcher_variable_outside_its_launcher_is_named(monkeypatch, capsys):
    # SLURM_NTASKS=2 left in a shell outside srun: JAX finds no coordinator. The error
    # names the variable that made measure think so, and the ways out, before any compile.
    import jax

    for key in ("JAX_NUM_PROCESSES", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")

    def initialize(*args, **kwargs):  # what jax.distributed says without a coordinator
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    code, out, err = run_cli(["measure", "tiny-h100-dp-tp"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "SLURM_NTASKS=2" in err and "unset SLURM_NTASKS" in err and "--coordinator" in err
    assert "coordinator_address should be defined" in err and "measured" not in out


def test_measure_flag_mistakes_are_one_line(tmp_path, capsys):
    out = tmp_path / "run.toml"
    out.write_text("mine\n")
    code, _, err = run_cli(["measure", "tiny-h100-dp-tp", "--out", str(out)], capsys)
    assert code == 2 and "--force" in err and err.count("\n") == 1
    assert out.read_text() == "mine\n"  # a user's file is kept
    code, _, err = run_cli(["measure", "tiny-h100-dp-tp", "--coordinator", "h:1"], capsys)
    assert code == 2 and "--num-processes" in err and err.count("\n") == 1
    code, _, err = run_cli(["measure", "tiny-h100-dp-tp", "--coordinator", "nocolon",
                            "--num-processes", "2", "--process-id", "0"], capsys)
    assert code == 2 and "HOST:PORT" in err and err.count("\n") == 1
    # a missing folder, or a file where --profile wants a folder, is said before the run
    code, out_, err = run_cli(["measure", "tiny-h100-dp-tp", "--out",
                               str(tmp_path / "no" / "run.toml")], capsys)
    assert code == 2 and "does not exist" in err and "measured" not in out_
    code, out_, err = run_cli(["measure", "tiny-h100-dp-tp", "--profile", str(out)], capsys)
    assert code == 2 and "takes a folder" in err and "measured" not in out_
    # a folder where --json wants a file, a trace folder under a file or where none can be
    # made: said before the run too, in one line, not after it (or as a traceback)
    for flags, says in ((["--json", str(tmp_path)], "is a folder"),
                        (["--profile", str(out / "sub")], "cannot make the folder"),
                        (["--profile", "/proc/no-such-folder"], "cannot make the folder")):
        code, out_, err = run_cli(["measure", "tiny-h100-dp-tp", *flags], capsys)
        assert code == 2 and says in err and err.count("\n") == 1, err
        assert "measured" not in out_


def test_calibrating_on_host_cpu_runs_alone_is_refused(measured, capsys):
    # host-cpu runs are timed at the host's measured rates: no parameter of the fit
    # applies to them, and a file of uncalibrated defaults would be worse than the catalog's
    d, _ = measured
    (d / "again.toml").write_text((d / "run.toml").read_text().replace(
        'name = "tiny-h100-dp-tp"', 'name = "again"', 1))  # each run its own name
    code, _, err = run_cli(["calibrate", str(d / "run.toml"), str(d / "again.toml"),
                            "--out", str(d / "cal.toml")], capsys)
    assert code == 2 and "informs a calibration parameter" in err and err.count("\n") == 1
    assert not (d / "cal.toml").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(tmp_path, flags: list[list[str]], **env) -> list[tuple[int, str, str]]:
    """`measure` of the small config in two processes on localhost (two CPU devices each,
    collectives over gloo), process i with flags[i]: (exit code, stdout, stderr) each."""
    coordinator = f"localhost:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **env}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "measure", "tiny-h100-dp-tp", *SMALL,
         "--quiet", "--coordinator", coordinator, "--num-processes", "2", "--process-id",
         str(i), *flags[i]],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:  # one stuck in a collective the other never joins: a failure, not a hang
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


@pytest.mark.slow
def test_two_processes_give_the_loss_of_one_and_profile_together(measured, tmp_path):
    """Two processes: the same loss as the four devices of one process. Only process 0 is
    given --profile; the other runs the profiled steps too (their collectives need both).
    The host's rates are benchmarked by process 0 alone, into an empty cache."""
    _, one = measured
    steps = ["--steps", "3", "--warmup", "1"]
    cache = tmp_path / "cache"
    outs = _two_processes(tmp_path, [[*steps, "--json", str(tmp_path / "m.json"), "--profile",
                                      str(tmp_path / "trace")], steps],
                          XDG_CACHE_HOME=str(cache))
    for code, _, err in outs:
        assert code == 0, err[-2000:]
    two = json.loads((tmp_path / "m.json").read_text())
    assert two["process_count"] == 2 and two["devices"] == 4
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    rows = {c["category"]: c for c in two["categories"]}
    assert rows["matmul"]["measured_s"] > 0 and rows["all-reduce"]["measured_s"] > 0
    assert list((tmp_path / "trace").glob("**/*.trace.json.gz"))
    cached = json.loads((cache / "shardscope" / "host-cpu.json").read_text())
    assert cached["rates"]["4"]["devices"] == 4
    # process 1 prints its loss and writes nothing
    assert "process 1: loss" in outs[1][1]


@pytest.mark.slow
def test_processes_that_would_run_different_steps_all_refuse(tmp_path, cache_home):
    # --steps 2 on one and 1 on the other would leave process 0 waiting in a collective
    # forever: both say why, in one line, before any step runs
    outs = _two_processes(tmp_path, [["--steps", "2", "--warmup", "0"],
                                     ["--steps", "1", "--warmup", "0"]])
    for code, out, err in outs:
        assert code == 2 and "process 1 runs --steps 1 --warmup 0" in err, err[-2000:]
        assert "give every process the same --steps and --warmup" in err
        assert "loss" not in out


def test_a_process_beside_others_does_not_cache_the_host_benchmark(tmp_path, monkeypatch):
    # processes other than 0 benchmark only where their host has no figure (another host
    # than process 0's), at the same time as the others there: kept out of the cache
    from meshes import host

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def benchmark(devices):
        calls.append(devices)
        return host.HostRates(matmul_flops_per_s={"float32": ((64, 1e10),)},
                              memory_bytes_per_s=1e10, kernel_overhead_s=1e-6,
                              memory_bytes=2**30, devices=devices, cores=2,
                              host=socket.gethostname(),
                              date="2026-12-04", jax_version="0")

    monkeypatch.setattr(host, "benchmark", benchmark)
    exp = config.load("tiny-h100-dp-tp", SMALL[1::2])
    system = measure.system_for(exp, "cpu", cache=False)
    assert system.name == "host-cpu:4" and calls == [4]
    assert not host.cache_path().exists()
    measure.system_for(exp, "cpu")  # process 0 (or one process alone) keeps its figure
    assert calls == [4, 4] and host.cached_rates(4).devices == 4


def test_the_profiled_gpu_compile_turns_command_buffers_off_with_an_option_xla_takes():
    # XLA checks a compile option's name and value on every backend (an unknown enum value
    # is refused), so the GPU option is proven valid here; the timed steps keep the default.
    import jax
    import jax.numpy as jnp

    from experiments.measure import PROFILE_OPTIONS

    assert PROFILE_OPTIONS["gpu"] == {"xla_gpu_enable_command_buffer": ""}
    lowered = jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4)))
    assert lowered.compile(compiler_options=PROFILE_OPTIONS["gpu"])(jnp.ones((4, 4)))[0, 0] == 4
    with pytest.raises(Exception, match="not a valid enum value"):
        lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": "NO_SUCH"})


def _measurement(exp, **fields) -> measure.Measurement:
    """A Measurement of `exp` on 4 CPU devices without running it (no estimate)."""
    values = dict(name=exp.name, asked_system=exp.system.name, system="host-cpu:4",
                  backend="cpu", device_kind="cpu", backend_version="jaxlib 0", devices=4,
                  process_count=1, step_times_s=(0.02, 0.01, 0.03), loss=None,
                  peak_memory_bytes=None, estimate=None, profile=None, profile_dir="",
                  host=socket.gethostname(), date="2026-12-04", jax_version="0")
    return measure.Measurement(**{**values, **fields})


def test_out_drops_system_overrides_host_cpu_does_not_take(tmp_path):
    # a config for its own cluster (400 Gb/s NICs), measured on this host's CPU devices:
    # host-cpu:4 takes no overrides, so the written file leaves nic_gbps out and says so
    raw = config.load_raw("tiny-h100-dp-tp", SMALL[1::2])
    raw["system"]["nic_gbps"] = 400
    exp = config.from_dict(raw)
    text = measure.to_toml(exp, _measurement(exp))
    (tmp_path / "run.toml").write_text(text)
    back = config.load(tmp_path / "run.toml")
    assert back.system.name == "host-cpu:4" and back.measured.step_time_s == 0.02
    assert "nic_gbps" in text.split("\nname = ")[0]  # only in the header's comment
    # measured on the config's own system (an accelerator), its overrides are kept
    same = measure.to_toml(exp, _measurement(exp, system="h100:4", backend="gpu",
                                             device_kind="NVIDIA H100"))
    assert "nic_gbps = 400" in same


def test_out_is_written_first_and_kept_when_json_fails(tmp_path, monkeypatch, capsys):
    # --out is the run's record (for validate and calibrate): written before --json, so a
    # --json that cannot be written after the run (its folder gone meanwhile) loses nothing
    exp = config.load("tiny-h100-dp-tp", SMALL[1::2])
    gone = tmp_path / "gone"
    gone.mkdir()

    def run(*args, **kwargs):
        gone.rmdir()
        return _measurement(exp)

    monkeypatch.setattr(measure, "measure", run)
    code, out, err = run_cli(["measure", "tiny-h100-dp-tp", *SMALL, "--out",
                              str(tmp_path / "run.toml"), "--json", str(gone / "m.json")],
                             capsys)
    assert code == 2 and err.count("\n") == 1 and "m.json" in err
    assert config.load(tmp_path / "run.toml").measured.step_time_s == 0.02
