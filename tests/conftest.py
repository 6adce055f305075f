"""Eight fake CPU devices for every test, set before JAX starts a backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
