"""Eight fake CPU devices for every test, set before JAX starts a backend.

XLA:CPU compiles without LLVM's expensive optimisation and with its classic fusion
emitters: a tiny step compiles in a tenth of the time (the MLIR fusion emitters alone take
three quarters of it) and runs as well. The report's figures do not change (its HLO is read
before code generation; the buffer assignment's temporaries differ by a few hundred bytes);
sharding/compiler.py compiles the CPU path without LLVM's optimisation anyway. Set in the
environment, so the CLI and the search workers the tests start compile the same way. Not
where the deviceless XLA:GPU compiler is installed (`make test-gpu`): it reads the same
optimisation level.
"""

import importlib.util
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
if importlib.util.find_spec("jax_cuda12_plugin") is None and \
        FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402

# The shardscope pytest plugin (pytest_shardscope.py) finds this count set and keeps it, as it
# keeps any count a session chose before pytest configures (--fake-devices would override it).
jax.config.update("jax_num_cpu_devices", 8)

import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# Each pytest-xdist worker on a core of its own (gw0 on the first, ...), with the processes it
# starts: XLA's thread pools, sized to the machine, otherwise spin against the other
# workers'. Measured on 2 cores (2026-12-03): the suite's CPU time fell from 1,036 s to
# 617 s and its wall time from 571 s to 335 s; a compile alone on one core takes as long.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= len(_cores):
        os.sched_setaffinity(0, {_cores[int(_WORKER[2:]) % len(_cores)]})

# One compile cache for the session (sharding/compile_cache.py): a program that several
# tests compile (the bundled tiny config, a README command a test also runs) is compiled
# once. Set here, in the first process, before pytest-xdist starts its workers and before
# any test starts the CLI or a search worker: all of them share it. Fresh each session.
_OWN_CACHE = "SHARDSCOPE_COMPILE_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["SHARDSCOPE_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="shardscope-test-compiles-")


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):  # the process that made it
        shutil.rmtree(os.environ["SHARDSCOPE_COMPILE_CACHE"], ignore_errors=True)


DATA = pathlib.Path(__file__).parent / "data"
REPO = pathlib.Path(__file__).parent.parent


@pytest.fixture(scope="session")
def cpu_devices():
    devices = jax.devices("cpu")
    assert len(devices) == 8, f"tests need 8 fake CPU devices, got {len(devices)}"
    return devices
