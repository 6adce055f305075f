"""Assertions and snapshots over a report's collectives (sharding/testing.py), the untimed
report of `analyze` without a system, and source lines from HLO metadata; the pytest plugin
that offers them as fixtures is tested in test_pytest_plugin.py."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from sharding.hlo_source import stack_frames
from sharding.testing import (
    check_snapshot,
    cpu_mesh,
    snapshot,
    snapshot_changes,
    snapshot_text,
)


@pytest.fixture(scope="module")
def report(cpu_devices):
    """A tensor-parallel matmul over data=2 x tensor=4 whose output is summed over `data`
    and whose weight a stray constraint gathers over `tensor`."""
    mesh = cpu_mesh({"data": 2, "tensor": 4})

    def step(x, w):
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
        return jnp.sum(x @ w, axis=0)

    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "tensor")))
    return sharding.analyze(jax.jit(step), x, w, mesh=mesh, system=None)


def test_without_a_system_the_report_counts_and_does_not_time(report):
    assert not report.timed and report.system == ""
    # the gathered weight, 64 x 128 f32; the batch sum over data, 128 f32
    assert sorted((c.kind, c.mesh_axes, c.bytes, c.count) for c in report.collectives) == [
        ("all-gather", ("tensor",), 64 * 128 * 4, 1), ("all-reduce", ("data",), 128 * 4, 1)]
    assert all(c.time_s == 0 and c.link == "" for c in report.collectives)
    # No times, no HBM to fit in: None throughout (not 0.0, True or inf), and strict JSON
    assert (report.step_time_s, report.comm_s, report.compute_s, report.exposed_comm_s,
            report.fits, report.hbm_capacity_bytes) == (None,) * 6
    d = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    for key in ("step_time_s", "step_time_bounds_s", "compute_s", "comm_s", "exposed_comm_s",
                "mfu", "fits", "hbm_capacity_bytes", "slowest_link"):
        assert d[key] is None, key
    assert d["by_kind"] == {"all-gather": 64 * 128 * 4, "all-reduce": 128 * 4}
    assert d["bottleneck"] == "untimed: no system given"
    table = report.format_table()
    assert "untimed: no system given" in table and " us" not in table
    assert table.count("untimed") == 1 + len(report.rows()) + 1 + len(report.by_operation())
    assert sharding.reanalyze(report.inputs, system="h100:8").collectives[0].time_s > 0


def test_limits_by_kind_and_by_kind_over_mesh_axes(report):
    sharding.assert_collectives(report, max_count=2, max_bytes=64 * 128 * 4 + 128 * 4,
                                forbid=["all-to-all", "all-gather over data",
                                        "all-gather over data,tensor"])
    sharding.assert_collectives(report, max_count={"all-reduce over data": 1},
                                max_bytes={"all-gather": 32768, "all-reduce": 512})
    with pytest.raises(AssertionError) as e:
        sharding.assert_collectives(report, max_count=1, forbid="all-gather over tensor",
                                    max_bytes={"all-reduce over data": 511})
    lines = str(e.value).splitlines()
    assert lines[0] == "3 collective limits broken (8 devices):"
    assert lines[1] == "  forbidden all-gather over tensor: 1 found"
    *row, source = lines[2].split()
    assert row == ["all-gather", "over", "tensor", "x1", "32.77", "KB",
                   "jit(step)/sharding_constraint", "at"]
    assert source.endswith(f"sharding/test_testing.py:{_line('P()))')}")  # cwd-relative
    assert lines[3] == "  max_count all collectives: 2 executions, at most 1"
    assert "  max_bytes all-reduce over data: 512 bytes, at most 511" in lines


def _line(text: str) -> int:
    """The line of this file that holds `text` (the stray constraint's)."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "with_sharding" in line)


@pytest.mark.parametrize("kwargs, message", [
    ({"forbid": ["allgather"]}, "unknown collective kind 'allgather' in 'allgather'; valid "
                                "kinds: all-reduce, all-gather, reduce-scatter,"),
    ({"max_count": {"all-reduce over pipe": 1}}, "mesh axis 'pipe' in 'all-reduce over pipe' "
                                                 "is not one of the report's mesh axes (data, "
                                                 "tensor)"),
    ({"max_bytes": {"all-gather": "1 MB"}}, "max_bytes['all-gather'] = '1 MB': give a number"),
    ({"max_count": -1}, "max_count=-1: give a number >= 0, or a dict keyed by kind"),
])
def test_unknown_names_and_limits_are_value_errors(report, kwargs, message):
    with pytest.raises(ValueError) as e:
        sharding.assert_collectives(report, **kwargs)
    assert str(e.value).startswith(message)


def test_snapshots_read_one_collective_a_line_and_diff_by_kind_over_axes(report):
    snap = snapshot(report, test="t.py::test")
    text = snapshot_text(snap)
    assert json.loads(text) == snap
    assert text == """{
  "test": "t.py::test",
  "num_devices": 8,
  "mesh": {"data": 2, "tensor": 4},
  "collectives": {
    "all-gather over tensor": {"count": 1, "bytes": 32768},
    "all-reduce over data": {"count": 1, "bytes": 512}
  }
}
"""
    old = json.loads(text)
    old["mesh"] = {"data": 4, "tensor": 2}
    old["collectives"]["all-to-all over tensor"] = {"count": 2, "bytes": 64}
    old["collectives"]["all-reduce over data"]["count"] = 3
    del old["collectives"]["all-gather over tensor"]
    assert snapshot_changes(old, snap) == [
        ("changed", "mesh", '{"data": 4, "tensor": 2}', '{"data": 2, "tensor": 4}'),
        ("appeared", "all-gather over tensor", "-", "x1 32,768 B"),
        ("changed", "all-reduce over data", "x3 512 B", "x1 512 B"),
        ("vanished", "all-to-all over tensor", "x2 64 B", "-"),
    ]
    assert snapshot_changes(snap, snap) == []


@pytest.mark.parametrize("text, problem", [
    ("[]", "a JSON list, not an object"),
    ('{"test": "t.py::test", "collectives": []}', "its 'collectives' is not an object"),
    ('{"collectives": {"all-reduce over data": {"count": 1}}}',
     "row 'all-reduce over data' is not"),
    ('{"collectives": {"all-reduce over data": 3}}', "row 'all-reduce over data' is not"),
    ("{}", "its 'collectives' is not an object"),
    ("not json", "Expecting value"),
])
def test_a_file_that_is_not_a_snapshot_is_one_line_saying_how_to_rewrite_it(
        report, tmp_path, text, problem):
    path = tmp_path / "snap.json"
    path.write_text(text)
    with pytest.raises(AssertionError) as e:
        check_snapshot(report, path=path, test="t.py::test", update=False)
    message = str(e.value)
    assert message.startswith(f"{path}: not a collectives snapshot (") and problem in message
    assert message.endswith("; --shardscope-update rewrites it") and "\n" not in message
    assert check_snapshot(report, path=path, test="t.py::test", update=True) == "updated"


def test_cpu_mesh_keeps_the_axis_order_and_says_how_to_fake_more(cpu_devices):
    mesh = cpu_mesh({"tensor": 4, "data": 2})
    assert mesh.axis_names == ("tensor", "data")
    assert [d.id for d in mesh.devices.flat] == list(range(8))
    with pytest.raises(ValueError, match=r"^mesh data=4 x tensor=4 needs 16 devices but JAX "
                                         r"has 8 fake CPU devices; use 16$"):
        cpu_mesh({"data": 4, "tensor": 4}, fix="use {n}")
    with pytest.raises(ValueError, match="mesh axis data=0: give a whole number"):
        cpu_mesh({"data": 0})


def test_stack_frames_give_the_innermost_file_and_line():
    text = """HloModule m

FileNames
1 "/src/model.py"
2 "/src/train.py"

FileLocations
1 {file_name_id=2 function_name_id=1 line=40 end_line=40 column=4 end_column=4}
2 {file_name_id=1 function_name_id=2 line=12 end_line=12 column=8 end_column=8}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

ENTRY %main {
  ROOT %p = f32[] parameter(0), metadata={op_name="x" stack_frame_id=2}
}
"""
    assert stack_frames(text) == {1: "/src/train.py:40", 2: "/src/model.py:12"}


def test_max_bytes_is_the_total_per_step_and_max_single_bytes_any_one(report):
    # The all-gather (64 x 128 f32 = 32,768 B) and the all-reduce (128 f32 = 512 B), once
    # each: max_bytes sums what it names (33,280 B for all), max_single_bytes looks at each.
    sharding.assert_collectives(report, max_single_bytes=32768,
                                max_bytes={"all-gather": 32768})
    with pytest.raises(AssertionError, match="max_bytes all collectives: 33,280 bytes"):
        sharding.assert_collectives(report, max_bytes=32768)
    with pytest.raises(AssertionError) as e:
        sharding.assert_collectives(report, max_single_bytes={"all-gather over tensor": 32767,
                                                              "all-reduce": 1024})
    lines = str(e.value).splitlines()
    assert lines[:2] == ["1 collective limit broken (8 devices):",
                         "  max_single_bytes any one all-gather over tensor: 1 over 32,767 "
                         "bytes, the largest 32,768 bytes"]
    assert lines[2].split()[:3] == ["all-gather", "over", "tensor"] and len(lines) == 3
    with pytest.raises(ValueError, match=r"max_single_bytes\['all-gather'\] = -1: give a "):
        sharding.assert_collectives(report, max_single_bytes={"all-gather": -1})


def _user_block(layer, x):
    return layer(x)  # the user's line a Flax layer's gathered weight is reported at


def test_a_limit_broken_inside_flax_names_the_users_line(cpu_devices):
    # The innermost frame of a Flax layer's matmul is flax/nnx/nn/linear.py; the user's
    # own call is further out on the stack the HLO carries: that is the line shown, with
    # the library's it went through.
    from flax import nnx

    mesh = cpu_mesh({"data": 8})
    graphdef, state = nnx.split(nnx.Linear(64, 128, rngs=nnx.Rngs(0)))

    def forward(state, x):
        return _user_block(nnx.merge(graphdef, state), x)

    def arg(a, spec):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(lambda a: arg(a, P("data") if a.ndim == 2 else P()), state)
    x = arg(jax.ShapeDtypeStruct((16, 64), jnp.float32), P("data"))
    report = sharding.analyze(jax.jit(forward), params, x, mesh=mesh, system=None)
    with pytest.raises(AssertionError) as e:  # the kernel, 64 x 128 f32, gathered whole
        sharding.assert_collectives(report, max_bytes={"all-gather": 1024})
    row = str(e.value).splitlines()[2]
    assert f"at tests/sharding/test_testing.py:{_line_of('the user')} (through flax/" in row
    assert "/site-packages/" not in row, row


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "return" in line)


def test_a_single_source_line_in_a_library_is_said_to_be_the_librarys():
    from sharding.hlo import parse_hlo
    from sharding.hlo_source import library_of, source_of, user_stack_frames

    meta = ('metadata={op_name="jit(f)/linear/dot_general" source_file='
            '"/venv/lib/python3.11/site-packages/flax/nnx/nn/linear.py" source_line=422}')
    module = parse_hlo(f"HloModule m\n\nENTRY %main {{\n  ROOT %p = f32[] parameter(0), "
                       f"{meta}\n}}\n")
    inst = module.computations[next(iter(module.computations))].by_name["p"]
    assert source_of(inst, {}) == ("flax/nnx/nn/linear.py:422 (flax's code, not yours: the "
                                   "op name's path says which of your calls made it)")
    assert library_of("/srv/me/project/model.py") == ""
    assert library_of("/src/jax/jax/_src/numpy/lax_numpy.py") == "jax"
    # A stack of library frames only: the innermost, said to be the library's.
    text = """HloModule m

FileNames
1 "/venv/lib/python3.11/site-packages/flax/nnx/nn/linear.py"

FileLocations
1 {file_name_id=1 function_name_id=1 line=422 end_line=422 column=4 end_column=4}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
"""
    assert user_stack_frames(text)[1].startswith("flax/nnx/nn/linear.py:422 (flax's code")
