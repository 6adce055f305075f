"""The Python API (sharding/api.py): analyze any function, re-time a stored plan, read any HLO
dump or get one clear error."""

import dataclasses
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshes
import sharding
from meshes.calibration import IDENTITY
from tests.conftest import DATA, REPO
from tests.sharding.test_schedule import program

H100 = meshes.get_system("h100:8")


def test_python_api_writes_nothing_to_stderr(tmp_path):
    # libtpu is installed for deviceless compiles; on a machine without TPU chips, starting
    # JAX must not start the TPU runtime (a page of warnings about TPU environment vars).
    script = tmp_path / "api.py"
    script.write_text(API_EXAMPLE)
    p = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    assert float(p.stdout.split()[-1]) > 0


API_EXAMPLE = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import sharding
sharding.ensure_cpu_devices(8)
mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu"))
x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
rep = sharding.analyze(jax.jit(lambda x, w: jnp.sum(x @ w)), x, w, mesh=mesh, system="h100:8")
print(rep.step_time_s)
"""

def _mutate(text: str, data) -> str:
    """One damage of the kinds a hand-edited or cut dump has: a line cut short, a character
    flipped, a line dropped, numbers in replica groups or pairs changed."""
    lines = text.splitlines()
    i = data.draw(st.integers(0, len(lines) - 1))
    kind = data.draw(st.sampled_from(["cut", "flip", "drop", "groups"]))
    if kind == "cut":
        lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])))]
    elif kind == "flip" and lines[i]:
        j = data.draw(st.integers(0, len(lines[i]) - 1))
        lines[i] = lines[i][:j] + data.draw(st.sampled_from("{}[](),=%0179x")) + lines[i][j + 1:]
    elif kind == "drop":
        del lines[i]
    else:
        rows = [n for n, ln in enumerate(lines) if "replica_groups=" in ln
                or "source_target_pairs=" in ln]
        if rows:
            n = data.draw(st.sampled_from(rows))
            new = data.draw(st.sampled_from(["0", "1", "15", "16", "99", "4096"]))
            lines[n] = re.sub(r"(groups=\{\{|pairs=\{\{)\d+", rf"\g<1>{new}", lines[n])
    return "\n".join(lines)


FUZZ_FIXTURES = {"collectives.cpu.hlo": "h100:16", "collectives.gpu-h100.hlo": "h100:16",
                 "collectives.tpu-v5e.hlo": "tpu-v5e:4x4", "collectives.tpu7x.hlo": "tpu7x:2x2x2",
                 "train_step.cpu-after-spmd.hlo": "h100:16",
                 "train_step.gpu-h100.hlo": "h100:16", "train_step.tpu-v5e.hlo": "tpu-v5e:4x4"}


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(FUZZ_FIXTURES)), st.data())
def test_damaged_dumps_analyse_or_get_one_clear_error(fixture, data):
    # Every mutation of a real dump either analyses or raises a ValueError (the CLI's one
    # line), never an IndexError or KeyError from deep inside (a replica group naming a
    # device the program lacks used to end in an IndexError).
    text = (DATA / fixture).read_text()
    for _ in range(data.draw(st.integers(1, 3))):
        text = _mutate(text, data)
    try:
        sharding.analyze_hlo(text, system=FUZZ_FIXTURES[fixture])
    except ValueError as e:
        assert str(e).strip() and "\n" not in str(e).strip()


def test_a_replica_group_naming_a_missing_device_is_one_error():
    text = (DATA / "collectives.gpu-h100.hlo").read_text()
    bad = re.sub(r"replica_groups=\{\{0,", "replica_groups={{99,", text, count=1)
    with pytest.raises(ValueError, match="name partition 99, but the program runs on 16"):
        sharding.analyze_hlo(bad, system="h100:16")


WINDOWED = """HloModule w, num_partitions=4, is_scheduled=true

%fused_add (a: f32[1024,1024], b: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %b = f32[1024,1024]{1,0} parameter(1)
  ROOT %s = f32[1024,1024]{1,0} add(%a, %b)
}

%windowed_dot_general_body_ag (p: (f32[1024,1024], s32[])) -> (f32[1024,1024], s32[]) {
  %p = (f32[1024,1024]{1,0}, s32[]) parameter(0)
  %acc = f32[1024,1024]{1,0} get-tuple-element(%p), index=0
  %i = s32[] get-tuple-element(%p), index=1
  %sum = f32[1024,1024]{1,0} fusion(%acc, %acc), kind=kLoop, calls=%fused_add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (f32[1024,1024]{1,0}, s32[]) tuple(%sum, %next)
}

%windowed_dot_general_cond_ag (p: (f32[1024,1024], s32[])) -> pred[] {
  %p = (f32[1024,1024]{1,0}, s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=1
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[1024,1024]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (f32[1024,1024]{1,0}, s32[]) tuple(%x, %zero)
  %w = (f32[1024,1024]{1,0}, s32[]) while(%init), condition=%windowed_dot_general_cond_ag, body=%windowed_dot_general_body_ag, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[1024,1024]{1,0} get-tuple-element(%w), index=0
}
"""


def test_windowed_einsum_loops_are_named_with_their_traffic():
    # A TPU-style windowed-einsum loop of 4 steps, each adding into a 4 MiB f32 accumulator
    # (read once, written once: 8 MiB, plus the 8-byte counter): 4 x 8.39 MB = 33.55 MB per
    # step, which XLA:CPU's gathered matmul does not have; the report says so.
    rep = sharding.analyze_hlo(WINDOWED, system="tpu-v5e:2x2")
    (note,) = [w for w in rep.warnings if "windowed-einsum" in w]
    assert "1 windowed-einsum loops" in note
    assert f"{4 * (2 * 4 * 2**20 + 8) / 1e6:.2f} MB of HBM traffic" in note
    plain = sharding.analyze_hlo(WINDOWED.replace("windowed_dot_general_", "loop_"),
                                 system="tpu-v5e:2x2")
    assert not any("windowed" in w for w in plain.warnings)


def test_a_plan_keeps_only_what_takes_time_and_retimes_to_the_same_report(cpu_devices):

    from sharding.plan import Plan

    rep = program(False)
    plan = rep.inputs.plan
    module = sharding.parse_hlo(rep.inputs.hlo_text)
    instructions = sum(len(c.instructions) for c in module.computations.values())
    nodes = sum(len(n) for n in plan.graph.computations.values())
    assert 0 < nodes < instructions
    stored = Plan.from_bytes(plan.to_bytes())
    again = sharding.reanalyze(dataclasses.replace(rep.inputs, plan=stored, hlo_text=""),
                               system=H100, calibration=IDENTITY)
    assert again.step_time_s == rep.step_time_s
    assert again.compute.hbm_bytes == rep.compute.hbm_bytes
    # Another format (an older shardscope) or damage: no plan, read the HLO again.
    assert Plan.from_bytes(dataclasses.replace(plan, format=0).to_bytes()) is None
    assert Plan.from_bytes(b"not a plan") is None


def test_analyze_plain_shard_map_function(cpu_devices):
    mesh = sharding.make_mesh(H100, {"data": 2, "fsdp": 2, "tensor": 2})

    def body(x):  # per device [16, 64, 32] bf16
        def step(c, _):
            c = jax.lax.psum(c, "tensor") * 0.5
            g = jax.lax.all_gather(c, "fsdp", axis=0, tiled=True)
            c = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=0, tiled=True)
            c = jax.lax.all_to_all(c, "data", 1, 1, tiled=True)
            c = jax.lax.ppermute(c, "fsdp", [(0, 1), (1, 0)])
            return c, None

        def outer(c, _):
            return jax.lax.scan(step, c, None, length=3)[0], None

        return jax.lax.scan(outer, x, None, length=2)[0]

    f = shard_map(body, mesh=mesh, in_specs=P("data", "fsdp", "tensor"),
                  out_specs=P("data", "fsdp", "tensor"), check_vma=False)
    x = jax.ShapeDtypeStruct((32, 128, 64), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("data", "fsdp", "tensor")))
    rep = sharding.analyze(f, x, mesh=mesh, system=H100)
    local = 16 * 64 * 32 * 2  # bytes of the per-device block
    expect = {  # kind: (bytes per execution, mesh axes); nested scans: 2 x 3 = 6 runs
        "all-reduce": (local, ("tensor",)),
        "all-gather": (2 * local, ("fsdp",)),
        "reduce-scatter": (2 * local, ("fsdp",)),
        "all-to-all": (local, ("data",)),
        "collective-permute": (local, ("fsdp",)),
    }
    got = {c.kind: c for c in rep.collectives}
    assert set(got) == set(expect)
    for kind, (nbytes, axes) in expect.items():
        assert (got[kind].bytes, got[kind].mesh_axes, got[kind].count) == (nbytes, axes, 6), kind
    assert got["all-reduce"].wire_bytes == pytest.approx(local)  # 2 * S * (2-1)/2


def test_a_gpu_estimate_does_not_depend_on_what_the_mesh_axes_are_called(cpu_devices):
    # A data-parallel training step of two small weights on 8 H100s: its gradient sums over
    # the data axis are timed as the program runs them whether that axis is called "data"
    # or "dp" (Megatron's gradient buckets are a framework's behaviour, applied only where
    # the caller says the program is one: gradient_buckets=True, as the experiment runner).
    def step_report(data_axis, **kwargs):
        mesh = jax.make_mesh((2, 4), (data_axis, "tensor"), devices=cpu_devices,
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        w = {"up": jax.ShapeDtypeStruct((256, 512), jnp.bfloat16,
                                        sharding=NamedSharding(mesh, P(None, "tensor"))),
             "down": jax.ShapeDtypeStruct((512, 256), jnp.bfloat16,
                                          sharding=NamedSharding(mesh, P("tensor")))}
        x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P(data_axis)))

        def loss(w, x):
            return jnp.sum((jax.nn.gelu(x @ w["up"]) @ w["down"]).astype(jnp.float32) ** 2)

        return sharding.analyze(jax.grad(loss), w, x, mesh=mesh, system=H100, **kwargs)

    data, dp = step_report("data"), step_report("dp")
    sums = [c for c in data.collectives if c.mesh_axes == ("data",)]
    assert len(sums) == 2  # one gradient sum per weight
    assert [c.time_s for c in data.collectives] == [c.time_s for c in dp.collectives]
    assert data.step_time_s == dp.step_time_s
    bucketed = step_report("data", gradient_buckets=True)
    assert all(c.algorithm.endswith("in buckets") for c in bucketed.collectives
               if c.mesh_axes == ("data",))
    assert sum(c.time_s for c in bucketed.collectives if c.mesh_axes == ("data",)) < \
        sum(c.time_s for c in sums)


def _bad_input_cases():
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), devices=jax.devices("cpu"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    text = (DATA / "collectives.gpu-h100.hlo").read_text()
    untimed = sharding.analyze(jnp.tanh, x, mesh=mesh, system=None)
    return {
        "mesh=None": (lambda: sharding.analyze(jnp.tanh, x, mesh=None, system=H100),
                      TypeError, "mesh=None is not a jax.sharding.Mesh; build one"),
        "mesh dict": (lambda: sharding.analyze(jnp.tanh, x, mesh={"data": 2}, system=H100),
                      TypeError, "mesh={'data': 2} is not a jax.sharding.Mesh"),
        "mesh text": (lambda: sharding.analyze(jnp.tanh, x, mesh="data=2,tensor=4",
                                               system=H100),
                      TypeError, "mesh='data=2,tensor=4' is not a jax.sharding.Mesh"),
        # a system of other than the mesh's devices would be reported as the mesh's
        "system of 64": (lambda: sharding.analyze(jnp.tanh, x, mesh=mesh,
                                                  system="tpu-v5p:4x4x4"), ValueError,
                         "the mesh has 8 devices (2 x 4) but system 'tpu-v5p:4x4x4' has 64; "
                         "analyze on a system of 8 devices, e.g. 'tpu-v5p:2x2x2', or on a "
                         "mesh of 64 devices"),
        "system of 4": (lambda: sharding.analyze(jnp.tanh, x, mesh=mesh,
                                                 system=meshes.get_system("h100:4")),
                        ValueError, "the mesh has 8 devices (2 x 4) but system 'h100:4' has "
                                    "4; analyze on a system of 8 devices, e.g. 'h100:8',"),
        "system int": (lambda: sharding.analyze_hlo(text, system=16), TypeError,
                       "system=16: give a system name like 'h100:8'"),
        "hlo bytes": (lambda: sharding.analyze_hlo(text.encode(), system="h100:16"),
                      TypeError, "the HLO text is of type bytes, not str; give the dump's"),
        "system name None": (lambda: meshes.get_system(None), TypeError,
                             "system name None is not a string; give <family>:<size>, e.g."),
        "0 devices": (lambda: sharding.ensure_cpu_devices(0), ValueError,
                      "ensure_cpu_devices(0): give at least 1 fake CPU device"),
        "-2 devices": (lambda: sharding.ensure_cpu_devices(-2), ValueError,
                       "ensure_cpu_devices(-2): give at least 1"),
        "'8' devices": (lambda: sharding.ensure_cpu_devices("8"), TypeError,
                        "ensure_cpu_devices('8'): give the number of fake CPU devices as an "
                        "int"),
        "forbid 3": (lambda: sharding.assert_collectives(untimed, forbid=3), TypeError,
                     "forbid=3: give a kind or kind over mesh axes, or a list of them"),
    }


def test_bad_arguments_are_one_line_naming_them_and_the_fix(cpu_devices):
    for case, (call, error, message) in _bad_input_cases().items():
        with pytest.raises(error) as e:
            call()
        assert str(e.value).startswith(message), case
        assert "\n" not in str(e.value), case
    assert len(jax.devices("cpu")) == 8


@pytest.mark.parametrize("shape, names, message", [
    ((2, 4), ("data",), "mesh_shape=(2, 4) has 2 axes but axis_names=('data',) names 1; give "
                        "one name per axis"),
    ((2, 8), ("data", "data"), "axis_names=('data', 'data'): 'data' is not a distinct mesh "
                               "axis name"),
    ((2, 8), ("", "tensor"), "axis_names=('', 'tensor'): '' is not a distinct mesh axis"),
    ((2, 8), (None, "tensor"), "axis_names=(None, 'tensor'): None is not a distinct mesh"),
])
def test_a_dumps_mesh_names_each_axis_once(shape, names, message):
    text = (DATA / "collectives.gpu-h100.hlo").read_text()
    with pytest.raises(ValueError) as e:
        sharding.analyze_hlo(text, system="h100:16", mesh_shape=shape, axis_names=names)
    assert str(e.value).startswith(message)


def test_a_dump_without_a_system_is_its_collectives_untimed():
    # As analyze without a system: bytes, counts and mesh axes, no times and no verdict.
    text = (DATA / "collectives.gpu-h100.hlo").read_text()
    rep = sharding.analyze_hlo(text, system=None, mesh_shape=(2, 4, 2),
                               axis_names=("data", "fsdp", "tensor"))
    timed = sharding.analyze_hlo(text, system="h100:16", mesh_shape=(2, 4, 2),
                                 axis_names=("data", "fsdp", "tensor"))
    assert not rep.timed and rep.step_time_s is None and rep.fits is None
    # the fixture's five kinds, each once in a scan of 3 (tests/sharding/test_collectives.py)
    assert rep.by_kind() == timed.by_kind() and [c.count for c in rep.collectives] == [3] * 5
    assert {c.mesh_axes for c in rep.collectives} == {("data",), ("fsdp",), ("tensor",)}
    assert timed.fits is None  # a bare dump: no memory figures, no verdict
    sharding.assert_collectives(rep, forbid=None)  # None forbids nothing, as max_count=None
