"""The pytest plugin (pytest_shardscope.py), as a user meets it: pytest in a subprocess over
a small test file of their own, a tensor-parallel matmul into which a stray sharding
constraint brings the classic regression (the weight matrix gathered over `tensor`).

Each run starts JAX (seconds): one test file holds many checks, and each test asserts on
their outcomes one by one.
"""

import json

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = '''
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sharding

STRAY = {stray}


def program(mesh, *, stray):
    def step(x, w):
        if stray:
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))  # STRAY LINE
        return jnp.tanh(x @ w)
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "tensor")))
    return jax.jit(step), x, w


def test_fake_devices_and_meshes(fake_mesh):
    assert len(jax.devices("cpu")) == 8
    mesh = fake_mesh(data=2, tensor=4)
    assert mesh.axis_names == ("data", "tensor") and mesh.devices.shape == (2, 4)
    assert fake_mesh(tensor=4, data=2).axis_names == ("tensor", "data")
    with pytest.raises(ValueError, match="needs 16 devices but JAX has 8 .*--fake-devices 16"):
        fake_mesh(data=4, tensor=4)


def test_untimed_report(fake_mesh, collectives):
    mesh = fake_mesh(data=2, tensor=4)
    report = collectives(*program(mesh, stray=True), mesh=mesh)
    assert not report.timed and report.step_time_s is None
    # w's tensor shards gathered: 64 x 128 f32 per device
    assert [(c.kind, c.mesh_axes, c.bytes) for c in report.collectives] == [
        ("all-gather", ("tensor",), 64 * 128 * 4)]


def test_no_weight_gather(fake_mesh, collectives):
    mesh = fake_mesh(data=2, tensor=4)
    report = collectives(*program(mesh, stray=STRAY), mesh=mesh)
    sharding.assert_collectives(report, forbid=["all-gather over tensor"])


def test_step_snapshot(fake_mesh, collectives, collectives_snapshot):
    mesh = fake_mesh(data=2, tensor=4)
    collectives_snapshot(collectives(*program(mesh, stray=STRAY), mesh=mesh))


def test_unchanged_snapshot(fake_mesh, collectives, collectives_snapshot):
    mesh = fake_mesh(data=2, tensor=4)
    collectives_snapshot(collectives(*program(mesh, stray=True), mesh=mesh))
'''


def outcomes(result) -> dict[str, str]:
    """Test name -> passed / failed, from the run's report lines (-rA)."""
    out = {}
    for line in result.outlines:
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            out[rest.split("::")[1].split(" ")[0]] = word.lower()
    return out


def test_fixtures_assertions_and_snapshots(pytester):
    pytester.makepyfile(test_user=USER_TESTS.format(stray=False))
    snapshots = pytester.path / "__snapshots__"

    first = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider", timeout=300)
    assert outcomes(first) == dict.fromkeys(
        ["test_fake_devices_and_meshes", "test_untimed_report", "test_no_weight_gather",
         "test_step_snapshot", "test_unchanged_snapshot"], "passed"), first.stdout.str()
    # Absent snapshots are written, the test passes and the summary says so.
    first.stdout.fnmatch_lines(["*written *__snapshots__/test_step_snapshot.json (review it*"])
    written = json.loads((snapshots / "test_step_snapshot.json").read_text())
    assert written == {"test": "test_user.py::test_step_snapshot", "num_devices": 8,
                       "mesh": {"data": 2, "tensor": 4}, "collectives": {}}
    # one collective a line, the gather: 64 x 128 f32 per device
    assert '\n    "all-gather over tensor": {"count": 1, "bytes": 32768}\n' in \
        (snapshots / "test_unchanged_snapshot.json").read_text()

    # The regression: a stray constraint gathers the weight matrix.
    pytester.makepyfile(test_user=USER_TESTS.format(stray=True))
    second = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider", timeout=300)
    assert outcomes(second) == {
        "test_fake_devices_and_meshes": "passed", "test_untimed_report": "passed",
        "test_no_weight_gather": "failed", "test_step_snapshot": "failed",
        "test_unchanged_snapshot": "passed"}, second.stdout.str()
    written_lines = (pytester.path / "test_user.py").read_text().splitlines()
    stray_line = next(i for i, line in enumerate(written_lines, 1) if "STRAY LINE" in line)
    second.stdout.fnmatch_lines([
        "*1 collective limit broken (8 devices):",
        "*forbidden all-gather over tensor: 1 found",
        f"*all-gather over tensor  x1 * 32.77 KB  jit(step)/sharding_constraint  "
        f"at test_user.py:{stray_line}",
    ])
    second.stdout.fnmatch_lines([
        "*collectives differ from test_step_snapshot.json (--shardscope-update rewrites it*",
        "*appeared  all-gather over tensor  -  ->  x1 32,768 B",
    ])
    assert json.loads((snapshots / "test_step_snapshot.json").read_text()) == written

    third = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider",
                                          "--shardscope-update", "-k", "snapshot", timeout=300)
    assert outcomes(third) == {"test_step_snapshot": "passed",
                               "test_unchanged_snapshot": "passed"}, third.stdout.str()
    third.stdout.fnmatch_lines(["*updated *__snapshots__/test_step_snapshot.json*"])
    assert "test_unchanged_snapshot.json" not in third.stdout.str()  # the same: left alone
    assert json.loads((snapshots / "test_step_snapshot.json").read_text())["collectives"] == {
        "all-gather over tensor": {"count": 1, "bytes": 32768}}


CLASHING_IDS = """
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P


@pytest.mark.parametrize("spec", ["a/b", "a_b"])
def test_mm(fake_mesh, collectives, collectives_snapshot, spec):
    mesh = fake_mesh(data=2, tensor=4)
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    collectives_snapshot(collectives(jnp.tanh, x, mesh=mesh))
"""


def test_two_tests_whose_snapshot_names_clash_are_told_apart(pytester):
    # Ids "a/b" and "a_b" both sanitise to __snapshots__/test_mm[a_b].json: the file
    # records the real id, so the second test fails instead of passing against the first's
    # snapshot, in the session that wrote it (also when rewriting) and in a later one.
    pytester.makepyfile(test_clash=CLASHING_IDS)
    clash = "*__snapshots__/test_mm[[]a_b[]].json is the snapshot of both " \
            "test_clash.py::test_mm[[]a/b[]] and test_clash.py::test_mm[[]a_b[]]*"
    for flags in ((), ("--shardscope-update",)):
        run = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider", *flags,
                                            timeout=300)
        assert outcomes(run) == {"test_mm[a/b]": "passed", "test_mm[a_b]": "failed"}, \
            run.stdout.str()
        run.stdout.fnmatch_lines([clash])
    stored = json.loads((pytester.path / "__snapshots__" / "test_mm[a_b].json").read_text())
    assert stored["test"] == "test_clash.py::test_mm[a/b]"
    alone = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider",
                                          "test_clash.py::test_mm[a_b]", timeout=300)
    assert outcomes(alone) == {"test_mm[a_b]": "failed"}, alone.stdout.str()
    alone.stdout.fnmatch_lines(["*is the snapshot of test_clash.py::test_mm[[]a/b[]], not of "
                                "test_clash.py::test_mm[[]a_b[]]*"])


def test_fake_devices_option_beats_the_ini(pytester):
    pytester.makeini("[pytest]\nshardscope_fake_devices = 2\n")
    pytester.makepyfile(test_count="""
        import jax
        import pytest

        def test_four_devices(fake_mesh):
            assert len(jax.devices("cpu")) == 4
            with pytest.raises(ValueError, match="--fake-devices 8 "):
                fake_mesh(data=2, tensor=4)

        def test_eight_devices(fake_mesh):
            fake_mesh(data=2, tensor=4)
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fake-devices", "4",
                                           timeout=300)
    result.assert_outcomes(passed=1, failed=1)
    # A mesh larger than faked: the test's line and the error, not the fixture's source
    result.stdout.fnmatch_lines([">*fake_mesh(data=2, tensor=4)",
                                 "E*ValueError: mesh data=2 x tensor=4 needs 8 devices but "
                                 "JAX has 4 fake CPU devices; run pytest with --fake-devices 8*"])
    assert "def make(" not in result.stdout.str() and "cpu_mesh(" not in result.stdout.str()


def test_a_conftest_that_started_jax_is_one_clear_error(pytester):
    pytester.makeini("[pytest]\nshardscope_fake_devices = 2\n")
    pytester.makeconftest("import jax\njax.devices()\n")
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.startswith("ERROR:")]
    assert errors == [
        "ERROR: shardscope: JAX's CPU backend already started with 1 device, so it cannot fake "
        "2 (ini shardscope_fake_devices); start JAX in a test or fixture, not while "
        "conftest.py is imported, or run with --fake-devices 1"], result.stderr.str()


def test_a_project_module_that_shadows_shardscopes_package_is_one_clear_error(pytester):
    # The wheel installs `sharding` and `meshes` as top-level packages: a project's own
    # sharding.py on sys.path first (pythonpath = ".") made the fixtures fail deep in an
    # import ("No module named 'sharding.testing'; 'sharding' is not a package"). A project's
    # own models/ does not matter: the fixtures do not import shardscope's models.
    pytester.makeini("[pytest]\npythonpath = .\n")
    pytester.makepyfile(sharding="PLAN = 'mine'\n")
    pytester.mkpydir("models")
    pytester.makepyfile(test_mine="""
        def test_mesh(fake_mesh):
            assert fake_mesh(data=2, tensor=4).devices.size == 8
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "ModuleNotFoundError" not in out and "is not a package" not in out, out
    (line,) = [ln for ln in result.outlines if ln.startswith("shardscope: ")]
    assert line == (
        f"shardscope: `import sharding` finds {pytester.path / 'sharding.py'}, not "
        f"shardscope's top-level sharding package; rename your sharding.py, or keep "
        f"{pytester.path} off sys.path (drop \".\" from pytest's pythonpath; no test files in "
        f"it, or --import-mode=importlib; `pytest`, not `python -m pytest`)")

    # renamed, the same project (its models/ still there) runs
    (pytester.path / "sharding.py").rename(pytester.path / "my_sharding.py")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=1)
