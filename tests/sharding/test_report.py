"""The report (sharding/report.py): its keys and JSON, the operations, hops and calibration
it names."""

import dataclasses

import pytest

import meshes
import models
import sharding
from experiments.calibrate import predict
from meshes.calibration import IDENTITY, Calibration
from tests.conftest import REPO
from tests.steps import layer_matmul_params, tiny, train_program, train_report


def test_report_features_reproduce_its_step(cpu_devices):
    # The decomposition the fit uses, evaluated at the calibration the report used, is the
    # report's own step.
    import sharding

    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 2, "fsdp": 4})
    prog = train_program(models.preset("tiny"), mesh, seq_len=32, global_batch=16)
    cal = Calibration(gpu_bf16_matmul_efficiency=0.5, flash_attention_efficiency=0.6,
                      kernel_overhead_s=3e-6)
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system="h100:8", calibration=cal)
    assert predict(rep.calibration_features(), cal.values()) == \
        pytest.approx(rep.step_time_s, rel=1e-9)
    assert rep.to_dict()["calibration"]["kernel_overhead_s"] == 3e-6


def test_an_estimate_above_what_the_chips_matmuls_allow_is_flagged(cpu_devices):
    # "Suspect" compared the estimate with the best MFU a measured run reached on the
    # family and fired on correct estimates of better shardings than any measured (the
    # bundled llama3-70b-v6e-256, 47.1% against 46.0%). The ceiling is now what the model
    # itself allows: the model FLOPs at the fastest rate it times each matmul format at
    # (the microbenchmarked GEMM at its best size, times the calibration), which only a
    # step that counts fewer matmul FLOPs than the model passes.
    import sharding
    from meshes.chips import CHIPS

    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 8})
    prog = train_program(models.preset("tiny"), mesh, seq_len=32, global_batch=16)
    kw = dict(mesh=mesh, system="h100:8")
    cal = Calibration(gpu_bf16_matmul_efficiency=0.5,
                      best_mfu={"h100 bf16": (1e-6, "a bf16 run")})
    rep = sharding.analyze(prog.step, *prog.args, calibration=cal,
                           model_flops_per_step=prog.model_flops_per_step, **kw)
    assert rep.mfu > 1e-6 and rep.suspect_mfu() is None  # above the best measured: fine
    # H100 bf16: 0.5 of peak at 8192^3 (the calibration), 1377/1290 of that at 16384^3
    # (the GEMM size curve's best); the step's few f32 matmuls run at half the bf16 peak.
    bf16, f32 = rep.matmul_flops_by_format["bfloat16"], rep.matmul_flops_by_format["float32"]
    assert bf16 > 0.99
    roof = 0.5 * 1377 / 1290
    assert rep.mfu_ceiling == pytest.approx(1 / (bf16 / roof + f32 / (roof / 2)))
    assert rep.to_dict()["mfu_ceiling"] == rep.mfu_ceiling
    absurd = sharding.analyze(prog.step, *prog.args, calibration=cal,
                              model_flops_per_step=1e18, **kw)
    assert absurd.mfu > absurd.mfu_ceiling
    peak = CHIPS["h100"].peak_for("bfloat16")
    assert (f"is above {rep.mfu_ceiling:.1%}, the most this chip's matmuls allow (model "
            f"FLOPs at the fastest rate the model times them: bf16 "
            f"{roof * peak / 1e12:,.0f} TFLOP/s, f32 ") in absurd.suspect_mfu()
    assert "the best measured on h100 bf16: 0.0% (a bf16 run): suspect" in absurd.suspect_mfu()
    assert "suspect" in absurd.format_table() and absurd.to_dict()["suspect_mfu"]
    # without a measured run of the family: the ceiling alone
    alone = sharding.analyze(prog.step, *prog.args, calibration=IDENTITY,
                             model_flops_per_step=1e18, **kw)
    assert "best measured" not in alone.suspect_mfu()


def test_a_step_of_many_small_kernels_names_the_kernel_count(cpu_devices):
    # Where the fixed cost per kernel (the calibration's) outweighs the kernels' own bytes
    # and FLOPs, the bottleneck is the number of kernels, not the HBM bandwidth it would
    # otherwise be read as (a decode step of thousands of small kernels).
    import sharding

    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 8})
    prog = train_program(models.preset("tiny"), mesh, seq_len=32, global_batch=16)
    # the models' training step, its gradient sums in Megatron's buckets as the runner has it
    kw = dict(mesh=mesh, system="h100:8", gradient_buckets=True)
    slow = sharding.analyze(prog.step, *prog.args, calibration=Calibration(
        kernel_overhead_s=5e-5), **kw)
    n = slow.compute.kernels
    assert slow.time_bottleneck().startswith(f"kernel count: {n:,.0f} kernels at 50.0 us")
    # a decode step (one token a sequence) says where the figure it stands on comes from
    assert "fitted on GPU training steps" not in slow.time_bottleneck()
    decode = dataclasses.replace(slow, tokens_per_step=16, sequences_per_step=16)
    assert "fitted on GPU training steps: a serving engine replaying CUDA graphs" in \
        decode.time_bottleneck()
    assert not sharding.analyze(prog.step, *prog.args, calibration=IDENTITY,
                                **kw).time_bottleneck().startswith("kernel count")
    # A fixed cost that counts but does not dominate (30% of the kernels' own time) is said
    # apart, not read as HBM or math time (a long-context decode read "HBM: 100%"). (A
    # longer step, so that its gradients' all-reduce is not what stalls it.)
    prog = train_program(models.preset("tiny"), mesh, seq_len=512, global_batch=64)
    base = sharding.analyze(prog.step, *prog.args, calibration=Calibration(
        kernel_overhead_s=0.0), **kw)
    n = base.compute.kernels
    some = sharding.analyze(prog.step, *prog.args, calibration=Calibration(
        kernel_overhead_s=0.3 * base.compute_s / n), **kw)
    text = some.time_bottleneck()
    assert text.startswith(base.time_bottleneck().split(":")[0])
    assert text.endswith(f"; the {n:,.0f} kernels' fixed cost "
                         f"{some.compute.overhead_s / some.step_time_s:.0%}"), text


def test_report_keys_and_json_contract(cpu_devices):
    rep, prog = train_report(tiny(), {"data": 2, "fsdp": 4})
    d = rep.to_dict()
    for key in ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "compute_s",
                "comm_s", "exposed_comm_s", "memory_per_device_bytes", "hbm_bytes", "fits",
                "collectives", "by_kind", "by_link", "bottleneck", "timings", "slowest_hop",
                "by_operation"):
        assert key in d, key
    fields = {f.name for f in dataclasses.fields(sharding.Collective)}
    assert fields <= set(d["collectives"][0])
    assert d["step_time_s"] == pytest.approx(d["compute_s"] + d["exposed_comm_s"])
    args = dict(rep.memory.components)["arguments"]
    assert args >= prog.state_bytes_per_device


def test_by_operation_names_the_model_operation(cpu_devices):
    rep, _ = train_report(tiny(n_kv_heads=4), {"data": 2, "tensor": 4})
    ops = {(o["operation"], o["kind"]) for o in rep.by_operation()}
    assert ("attention/out_proj (forward)", "all-reduce") in ops
    assert ("mlp/down_proj (forward)", "all-reduce") in ops


def test_report_shows_link_algorithm_and_slowest_hop_across_nodes():
    import subprocess
    import sys


    # 16 GPUs in two HGX nodes: FSDP 16 spans InfiniBand, which must be named the slowest hop.
    code = """
import jax
jax.config.update("jax_num_cpu_devices", 16)
import meshes, models, sharding
s = meshes.get_system("h100:16")
mesh = sharding.make_mesh(s, {"fsdp": 16})
prog = models.build_train_program(models.preset("tiny"), mesh, sharding.default_rules(),
    workload=models.Workload(seq_len=32, global_batch=16), precision=models.Precision(),
    train=models.Train())
rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=s)
print(rep.slowest_hop())
print(sorted({(c.link, bool(c.algorithm)) for c in rep.collectives}))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    hop, links = p.stdout.strip().splitlines()
    assert hop.startswith("infiniband at")
    assert links == "[('infiniband', True)]"


def test_the_memory_lines_add_up_to_the_total():
    # The report shows 6 lines: past that, the rest is one line with their names.
    from sharding.report import Memory

    m = Memory(components=tuple((f"c{i}", float(10 - i)) for i in range(7)), source="s",
               reserved=(("CUDA context", 0.5),))
    lines = m.largest(6)
    assert len(lines) == 6 and sum(b for _, b in lines) == m.total_bytes
    assert lines[-1] == ("3 more: c5, c6, CUDA context", 5.0 + 4.0 + 0.5)
    assert Memory(components=(("a", 1.0),), source="s").largest(6) == [("a", 1.0)]


def test_an_nvfp4_steps_mfu_uses_the_peak_of_each_matmuls_format(cpu_devices):
    # NVFP4 runs the projections (forward and both gradients) in FP4 and keeps attention
    # in bf16: its MFU against the formats' peaks weighs each format's share of the matmul
    # FLOPs by the catalog's peak for it; against bf16, everything at the bf16 peak.
    system = meshes.get_system("gb200-nvl72:8")
    cfg = tiny(head_dim=32)  # FP4 blocks of 32 along every contraction
    mesh = sharding.make_mesh(system, {"data": 8})
    prog = train_program(cfg, mesh, seq_len=32, global_batch=16, compute="float4",
                         remat="none")
    fp4 = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=system,
                           model_flops_per_step=prog.model_flops_per_step)
    peak = system.chip.peak_flops_per_s
    flops = prog.model_flops_per_step
    # 2 sequences of 32 tokens per device; 3 matmuls (forward, both gradients) of 2 FLOPs
    # per weight per token, for every layer's projections (the output layer stays bf16)
    tokens = 16 * 32 / 8
    projections = 3 * 2 * tokens * cfg.n_layers * layer_matmul_params(cfg)
    assert fp4.compute.flops_by_dtype["float4"] == pytest.approx(projections)
    shares = fp4.matmul_flops_by_format
    assert shares["float4"] == pytest.approx(projections / fp4.compute.matmul_flops)
    assert shares["bfloat16"] > 0.1  # flash attention and the output layer stay in bf16
    rest = {d: s for d, s in shares.items() if d != "float4"}  # bf16 and a little f32
    device_s = fp4.step_time_s * system.num_devices
    assert fp4.mfu_format == pytest.approx(flops / device_s * (
        shares["float4"] / peak["float4"] + sum(s / system.chip.peak_for(d)
                                                for d, s in rest.items())))
    assert fp4.mfu_bf16 == pytest.approx(flops / (device_s * peak["bfloat16"]))
    assert fp4.mfu == pytest.approx(fp4.mfu_bf16)  # `mfu` keeps its bf16 denominator
    d = fp4.to_dict()
    assert (d["mfu_bf16"], d["mfu_format"]) == (fp4.mfu_bf16, fp4.mfu_format)
    assert "of the bf16 peak" in fp4.format_table()


def test_an_nvls_all_reduce_sends_each_devices_buffer_once(cpu_devices):
    # NVLink SHARP sums in the switch: each GPU sends its buffer once, not a ring's
    # 2(n - 1)/n of it; the slowest hop's rate per device is the buffer over the time.
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    system = meshes.get_system("h100:8")
    mesh = sharding.make_mesh(system, {"data": 8})
    x = jax.ShapeDtypeStruct((8, 4096, 8192), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("data")))
    rep = sharding.analyze(lambda x: jnp.sum(x, axis=0), x, mesh=mesh, system=system)
    [c] = rep.collectives
    assert c.kind == "all-reduce" and c.algorithm == "nvls"
    rate = float(re.search(r"at ([\d.]+) GB/s", rep.slowest_hop())[1]) * 1e9
    assert rate == pytest.approx(c.bytes / c.time_s, rel=0.01)


def test_power_line_says_what_it_counts():
    # Worked from the catalog: a GB200 rack counts its chips and the rest of the rack; a
    # GB300 rack has no public rating, so its chips alone (8 x 1400 W busy = 11.2 kW): said,
    # or it reads below the GB200's 8 x 1200 W + its share of the rack. TPU7x: the pod's
    # ~10 MW over 9,216 chips, hosts and network in it, not "chips".
    from meshes import CHIPS
    from meshes.power import estimate
    from sharding.text import _power_lines

    def line(family, chip, n):
        e = estimate(family=family, chip=CHIPS[chip], num_devices=n, step_s=1.0,
                     compute_s=1.0, tokens_per_step=1.0)
        return _power_lines(e)[0]

    assert "hosts/NICs/switches" in line("gb200-nvl72", "gb200", 8)
    gb300 = line("gb300-nvl72", "gb300", 8)
    assert "chips 11.2 kW" in gb300 and "hosts, NICs and switches not counted" in gb300
    tpu7x = line("tpu7x", "tpu7x", 8)  # 4 chips x 10 MW / 9216 = 4.34 kW
    assert "the pod's published draw per chip (chips, hosts, network) 4.34 kW" in tpu7x
    assert "not counted" not in tpu7x


def test_a_budget_below_one_copy_of_the_step_says_so():
    # 8 H100s busy draw 13.1 kW at the facility (tests/meshes/test_power.py), a replica of
    # 4 of them 6.55 kW: 5 kW feeds none, said as such rather than "feeds 3 chips".
    import types

    from meshes import CHIPS
    from meshes.power import estimate
    from sharding.text import format_scale_out

    e = estimate(family="h100", chip=CHIPS["h100"], num_devices=8, step_s=1.0,
                 compute_s=1.0, tokens_per_step=1e4)
    lines = format_scale_out(types.SimpleNamespace(energy=e, fits=True),
                             e.scale_out(power_budget_w=5e3, replica_chips=4))
    assert lines == ["power budget   5 kW feeds no data-parallel replica of this step: one, "
                     "4 chips, draws 6.55 kW at the facility"]


def test_cost_line_with_the_power_billed_apart():
    # 8 H100s busy: 13,104 W at the facility (PUE 1.56), 1,638 W a chip; at $0.08 per kWh
    # that is $0.131 per chip-hour on top of the $2 of the chip: said in the line.
    import types

    from meshes import CHIPS
    from meshes.power import Cost, estimate
    from sharding.text import _energy_lines

    def cost_line(family, chip, cost):
        e = estimate(family=family, chip=CHIPS[chip], num_devices=8, step_s=1.0,
                     compute_s=1.0, tokens_per_step=1e4, cost=cost)
        return [x for x in _energy_lines(types.SimpleNamespace(energy=e, fits=True))
                if x.startswith("cost")]

    [line] = cost_line("h100", "h100", Cost(usd_per_chip_hour=2.0, usd_per_kwh=0.08))
    per_hour = 8 * (2.0 + 0.08 * 13104 / 8 / 1e3)
    assert line.startswith(f"cost           ${per_hour / 3600 / 1e4 * 1e6:,.4g} per million")
    assert "power billed apart at $0.08 per kWh, $0.131 per chip-hour" in line
    # TPU v6e has a price but no power figure: with the power billed apart the cost is
    # unknown, said, where no cost line was printed at all.
    [line] = cost_line("tpu-v6e", "tpu-v6e", Cost(usd_per_kwh=0.08))
    assert line.startswith("cost           unknown: [cost] usd_per_kwh bills the power apart")


def test_power_cost_and_runs_of_a_step_that_does_not_fit_are_marked():
    # Step time and MFU carry "-- if it fit" when memory does not fit; the power, energy,
    # cost and run lines are figures of that same step and carried nothing.
    import types

    from meshes import CHIPS
    from meshes.power import estimate
    from sharding.text import _energy_lines, format_scale_out

    e = estimate(family="h100", chip=CHIPS["h100"], num_devices=8, step_s=1.0,
                 compute_s=1.0, tokens_per_step=1e4)
    plan = e.scale_out(power_budget_w=1e6, tokens=1e9)
    for fits in (False, True, None):
        r = types.SimpleNamespace(energy=e, fits=fits)
        lines = _energy_lines(r) + format_scale_out(r, plan)
        assert len(lines) == 6  # power, energy, cost, budget, two runs
        marked = [line.endswith("  -- if it fit") for line in lines]
        assert marked == [fits is False] * 6


def test_a_step_without_tokens_is_priced_per_step():
    # An HLO dump (`inspect`) has no tokens per step: 16 H100s at $4.916 per chip-hour for
    # a 2 s step cost 4.916 x 16 x 2 / 3600 = $0.0437; the cost line was left out instead.
    import types

    from meshes import CHIPS
    from meshes.power import estimate
    from sharding.text import _energy_lines

    e = estimate(family="h100", chip=CHIPS["h100"], num_devices=16, step_s=2.0,
                 compute_s=2.0, tokens_per_step=None)
    assert e.usd_per_step == pytest.approx(4.916 * 16 * 2 / 3600)
    assert e.to_dict()["usd_per_step"] == e.usd_per_step
    [line] = [x for x in _energy_lines(types.SimpleNamespace(energy=e, fits=True))
              if x.startswith("cost")]
    assert line.startswith("cost           $0.0437 per step  ($4.916 per chip-hour")


_ALL_REDUCE_1GIB_OVER_16 = """HloModule m, num_partitions=16

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p: f32[268435456]) -> f32[268435456] {
  %p = f32[268435456] parameter(0)
  ROOT %ar = f32[268435456] all-reduce(f32[268435456] %p), channel_id=1, """ \
    """replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}, use_global_device_ids=true, """ \
    """to_apply=%add
}
"""


def test_the_slowest_hop_counts_what_crosses_the_link_not_the_nvlink_hops():
    # 1 GiB all-reduced over two HGX nodes: each GPU sends 2 (15/16) GiB, but the NVLSTree
    # sends S a node across (1/15 of it through each GPU's NIC): the rate read 459 GB/s
    # "sent per device" over a 50 GB/s NIC.
    r = sharding.analyze_hlo(_ALL_REDUCE_1GIB_OVER_16, system="h100:16")
    (c,) = r.collectives
    assert c.link == "infiniband" and c.link_share == pytest.approx(1 / 15)
    ib = r.by_link()["infiniband"]
    assert ib["wire_bytes"] == pytest.approx(2**30 / 8)
    assert c.wire_bytes / c.time_s > 50e9 > ib["wire_bytes"] / ib["time_s"] > 0.5 * 45.75e9
    assert r.slowest_hop().startswith("infiniband at ")


def test_one_device_is_singular():
    from sharding.text import format_report

    one = _ALL_REDUCE_1GIB_OVER_16.replace("num_partitions=16", "num_partitions=1").replace(
        "{{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}", "{{0}}")
    text = format_report(sharding.analyze_hlo(one, system="h100:1"))
    assert "on h100:1 (1 device)," in text.splitlines()[0]


def test_a_compute_bound_step_says_what_its_matmul_rate_is(cpu_devices):
    # A fitted bf16 rate is not the GEMM's: it carries the fitted runs' framework costs, so
    # the bottleneck line says the fraction and where it comes from (a new user read "the
    # chip's math rate" as the datasheet's).
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import sharding

    mesh = sharding.make_mesh(meshes.get_system("h100:8"), {"data": 8})
    x = jax.ShapeDtypeStruct((8 * 4096, 8192), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("data", None)))
    w = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    fitted = Calibration(gpu_bf16_matmul_efficiency=0.5, source="fitted on some runs")
    rep = sharding.analyze(lambda a, b: a @ b, x, w, mesh=mesh, system="h100:8",
                           calibration=fitted)
    assert rep.time_bottleneck().startswith(
        "compute: matmuls are ") and ("of the step, at 50% of the bf16 peak, fitted on some "
                                      "runs: their frameworks' costs included") in \
        rep.time_bottleneck(), rep.time_bottleneck()
    # uncalibrated: the book's figure, said as such; FP8 and TPU rates name their benchmark
    assert IDENTITY.rate_phrase("gpu_bf16") == \
        "80% of the bf16 peak, the scaling book's figure (uncalibrated)"
    assert fitted.rate_phrase("measured").startswith("100% of the cuBLASLt FP8 / FP4 GEMM")
    assert fitted.rate_phrase("tpu").startswith("100% of the TPU's microbenchmarked GEMM")
