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
