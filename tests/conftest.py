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

jax.config.update("jax_num_cpu_devices", 8)

import pathlib  # noqa: E402

import pytest  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"
REPO = pathlib.Path(__file__).parent.parent


@pytest.fixture(scope="session")
def cpu_devices():
    devices = jax.devices("cpu")
    assert len(devices) == 8, f"tests need 8 fake CPU devices, got {len(devices)}"
    return devices
