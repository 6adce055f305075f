"""shardscope's pytest plugin: fake CPU devices for the session, and fixtures that compile
a test's own sharded functions and check their collectives. Installing shardscope
registers it (entry point `pytest11`, name `shardscope`; `-p no:shardscope` turns it off).

    def test_no_weight_gather(fake_mesh, collectives, collectives_snapshot):
        mesh = fake_mesh(data=2, tensor=4)
        report = collectives(step, x, w, mesh=mesh)        # bytes and counts, no times
        sharding.assert_collectives(report, forbid=["all-gather over tensor"])
        collectives_snapshot(report)                       # __snapshots__/<test>.json

`--fake-devices N` (ini `shardscope_fake_devices`) fakes N CPU devices before JAX starts a
backend. Without either, a count the session already chose stands (a conftest's
`jax_num_cpu_devices`, JAX_NUM_CPU_DEVICES, XLA_FLAGS' device count), else 8. A backend
started before pytest configured (a conftest that ran JAX) with another count is a usage
error: the devices cannot change after it starts.

The plugin sits outside the `sharding` package, whose import starts JAX: it imports neither
JAX nor shardscope until a test asks for a fixture, so a session that does not use it is
not slowed, and a conftest or test module that sets JAX's environment (JAX_PLATFORMS,
JAX_ENABLE_X64) before importing JAX keeps its effect.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import sys

import pytest

DEFAULT_FAKE_DEVICES = 8
_COUNT_FLAG = "--xla_force_host_platform_device_count"
_STATE = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardscope", "shardscope: collectives of sharded JAX programs")
    group.addoption("--fake-devices", type=int, default=None, metavar="N",
                    help=f"fake N CPU devices for JAX (default: ini shardscope_fake_devices, "
                         f"else {DEFAULT_FAKE_DEVICES})")
    group.addoption("--shardscope-update", action="store_true", default=False,
                    help="rewrite the collectives snapshots (__snapshots__/<test>.json) "
                         "instead of comparing with them")
    parser.addini("shardscope_fake_devices", default="",
                  help=f"fake CPU devices for JAX (default {DEFAULT_FAKE_DEVICES})")


def _asked(config: pytest.Config) -> tuple[int | None, str]:
    """The device count the user gave, and where; (None, "") when none was given."""
    n = config.getoption("fake_devices")
    if n is not None:
        where = "--fake-devices"
    else:
        raw = str(config.getini("shardscope_fake_devices") or "").strip()
        if not raw:
            return None, ""
        if not raw.isdigit():
            raise pytest.UsageError(f"ini shardscope_fake_devices = {raw!r} is not a device "
                                    f"count; give a whole number, e.g. {DEFAULT_FAKE_DEVICES}")
        n, where = int(raw), "ini shardscope_fake_devices"
    if n < 1:
        raise pytest.UsageError(f"{where} {n}: give at least 1 fake CPU device")
    return n, where


def _flag_count(flags: str) -> int | None:
    m = re.search(rf"{_COUNT_FLAG}=(\d+)", flags)
    return int(m.group(1)) if m else None


def _chosen() -> int | None:
    """The count the session chose before the plugin, if any (JAX's own precedence)."""
    jax = sys.modules.get("jax")
    if jax is not None and int(jax.config.jax_num_cpu_devices) >= 0:
        return int(jax.config.jax_num_cpu_devices)
    env = os.environ.get("JAX_NUM_CPU_DEVICES", "") if jax is None else ""
    if env.strip().isdigit():
        return int(env)
    return _flag_count(os.environ.get("XLA_FLAGS", ""))


def _started_with() -> int | None:
    """The CPU devices JAX's backends started with, or None when they have not started
    (JAX not imported counts as not started) or have no CPU backend."""
    if "jax" not in sys.modules:
        return None
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        return None
    try:
        return len(jax.devices("cpu"))
    except RuntimeError:  # JAX_PLATFORMS without cpu: nothing to fake
        return None


def _ask(n: int) -> dict:
    """Fake `n` CPU devices before JAX starts; returns the environment to restore."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.config.update("jax_num_cpu_devices", n)
        return {}
    saved = {k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    flags = re.sub(rf"\s*{_COUNT_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()
    if "JAX_NUM_CPU_DEVICES" in os.environ:  # read at JAX's import, over the flag
        os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    return saved


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    asked, where = _asked(config)
    chosen = _chosen()
    count = asked if asked is not None else chosen or DEFAULT_FAKE_DEVICES
    where = where or ("the session's own setting" if chosen else "the default")
    have = _started_with()
    if have is not None and have != count:
        devices = f"{have} device{'s' * (have != 1)}"
        raise pytest.UsageError(
            f"shardscope: JAX's CPU backend already started with {devices}, so it cannot fake "
            f"{count} ({where}); start JAX in a test or fixture, not while conftest.py is "
            f"imported, or run with --fake-devices {have}")
    restore = {} if have is not None or count == chosen else _ask(count)
    config.stash[_STATE] = {"count": count, "restore": restore}
    config.pluginmanager.register(_SnapshotNotes(), "shardscope-snapshot-notes")


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    for key, value in (state or {}).get("restore", {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# The packages the fixtures import (`sharding` imports `meshes`); `models` and `experiments`
# are shardscope's too, but the plugin does not import them.
_IMPORTED = ("sharding", "meshes")


def _check_not_shadowed() -> None:
    """Fail in one line when `import sharding` (or `meshes`) would find a module of the
    user's project instead of shardscope's package: the wheel installs them as top-level
    packages, and a project's own `sharding.py` or `meshes/` on sys.path before them hides
    them ("'sharding' is not a package"): pytest's `pythonpath = ["."]`, the folder of a
    test file in the default import mode, the working folder under `python -m pytest`."""
    here = pathlib.Path(__file__).resolve().parent
    for name in _IMPORTED:
        ours = here / name / "__init__.py"
        if not ours.is_file():  # not installed beside the plugin: nothing to compare with
            continue
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None) if module is not None else \
            getattr(importlib.util.find_spec(name), "origin", None)
        if not origin or pathlib.Path(origin).resolve() == ours:
            continue
        found = pathlib.Path(origin)
        theirs = found.parent if found.name == "__init__.py" else found
        label = f"{theirs.name}/" if theirs is not found else theirs.name
        pytest.fail(f"shardscope: `import {name}` finds {theirs}, not shardscope's top-level "
                    f"{name} package; rename your {label}, or keep {theirs.parent} off "
                    f"sys.path (drop \".\" from pytest's pythonpath; no test files in it, or "
                    f"--import-mode=importlib; `pytest`, not `python -m pytest`)",
                    pytrace=False)


@pytest.fixture
def fake_mesh():
    """A factory: `fake_mesh(data=2, tensor=4)` is a `jax.sharding.Mesh` over the first
    fake CPU devices with those axis names, in that order."""
    _check_not_shadowed()
    from sharding.testing import cpu_mesh

    def make(**axis_sizes: int):
        __tracebackhide__ = True  # the test's line and the error, not this fixture's source
        return cpu_mesh(axis_sizes, fix="run pytest with --fake-devices {n} (or ini "
                                        "shardscope_fake_devices = {n})")

    return make


@pytest.fixture
def collectives():
    """A factory: `collectives(fn, *args, mesh=mesh, system=None)` compiles `fn(*args)` over
    `mesh` and gives the `sharding.Report`; without a system, the collectives' bytes and
    counts and no times. Other keywords go to `sharding.analyze`."""
    _check_not_shadowed()
    from sharding.api import analyze

    def compile_and_read(fn, *args, mesh, system=None, **kwargs):
        return analyze(fn, *args, mesh=mesh, system=system, **kwargs)

    return compile_and_read


@pytest.fixture
def collectives_snapshot(request: pytest.FixtureRequest):
    """`collectives_snapshot(report)` compares the report's collectives (kind over mesh axes:
    executions and bytes per step) and mesh with `__snapshots__/<test name>.json` beside the
    test file: written when absent (the session's summary names it), rewritten with
    `--shardscope-update`, an AssertionError listing the differences otherwise. A second
    call in one test uses `<test name>.2.json`, or give `name=`."""
    _check_not_shadowed()
    from sharding.testing import check_snapshot

    update = request.config.getoption("shardscope_update")
    test = ".".join(request.node.nodeid.split("::")[1:])
    # snapshot file -> the test that wrote or checked it this session: two whose names
    # sanitise to one file clash even where the file's own record cannot tell (rewriting)
    owners = request.config.stash[_STATE].setdefault("snapshots", {})
    calls = []

    def check(report, *, name: str = "") -> None:
        __tracebackhide__ = True
        calls.append(name)
        raw = name or (test if len(calls) == 1 else f"{test}.{len(calls)}")
        stem = re.sub(r"[^\w.\-\[\]]", "_", raw)
        path = request.path.parent / "__snapshots__" / f"{stem}.json"
        # the file records the real name, not its sanitised stem ("a/b" and "a_b" share one
        # file, and the check that a file is this test's must tell them apart)
        owner = f"{request.path.name}::{raw}"
        other = owners.setdefault(path, owner)
        if other != owner:
            raise AssertionError(f"{path} is the snapshot of both {other} and {owner}: their "
                                 f"names map to one file; pass name= to one")
        status = check_snapshot(report, path=path, test=owner, update=update)
        if status != "same":
            here = request.config.invocation_params.dir
            shown = path.relative_to(here) if path.is_relative_to(here) else path
            request.node.user_properties.append(("shardscope_snapshot", f"{status} {shown}"))

    return check


class _SnapshotNotes:
    """The snapshots a session wrote, for its summary. They ride on the test reports, so
    that pytest-xdist's workers' reach the summary too."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.notes += [v for k, v in report.user_properties if k == "shardscope_snapshot"]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.notes:
            terminalreporter.section("shardscope collectives snapshots")
            for note in self.notes:
                terminalreporter.write_line(f"{note} (review it and commit it with the test)")
