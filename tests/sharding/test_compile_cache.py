"""The compile cache (sharding/compile_cache.py): the same program on the same devices is
read back, anything that changes the compiler's output is compiled anew, a damaged entry is
compiled again."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import compile_cache
from sharding.compiler import compile_to_hlo


def _program(devices, width=64):
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "tensor"))
    x = jax.ShapeDtypeStruct((8, width), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((width, width), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "tensor")))
    return (lambda a, b: jnp.sum(a @ b)), x, w, mesh


def test_the_same_program_is_read_back_and_a_changed_one_compiled(tmp_path, monkeypatch,
                                                                  cpu_devices):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    fn, x, w, mesh = _program(cpu_devices)
    first = compile_to_hlo(fn, x, w, devices=mesh.devices.flat)
    again = compile_to_hlo(fn, x, w, devices=mesh.devices.flat)
    assert not first.cached and again.cached and again.compiled is None
    assert (again.hlo_text, again.memory_stats, again.warnings) == \
        (first.hlo_text, first.memory_stats, first.warnings)
    assert "all-reduce" in again.hlo_text and again.memory_stats["argument"] > 0
    assert len(list(tmp_path.glob("*.json.gz"))) == 1
    # Another shape, another device order, another option: each compiled.
    fn2, x2, w2, _ = _program(cpu_devices, width=128)
    assert not compile_to_hlo(fn2, x2, w2, devices=mesh.devices.flat).cached
    assert not compile_to_hlo(fn, x, w, devices=mesh.devices.flat[::-1]).cached
    assert not compile_to_hlo(fn, x, w, devices=mesh.devices.flat, fast_cpu=False).cached
    assert len(list(tmp_path.glob("*.json.gz"))) == 4
    # The same ops under another named scope: the op names the analysis reads differ
    # (flash attention's scope, "tiled" under measure), so it is another program.
    def under(scope):
        def step(a, b):
            with jax.named_scope(scope):
                return fn(a, b)
        return step
    assert not compile_to_hlo(under("flash_attention"), x, w, devices=mesh.devices.flat).cached
    other = compile_to_hlo(under("attention_tiles"), x, w, devices=mesh.devices.flat)
    assert not other.cached and "attention_tiles" in other.hlo_text


def test_a_damaged_entry_is_compiled_again_and_no_folder_no_cache(tmp_path, monkeypatch,
                                                                   cpu_devices):
    fn, x, w, mesh = _program(cpu_devices)
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    assert not compile_to_hlo(fn, x, w, devices=mesh.devices.flat).cached
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "cache"))
    good = compile_to_hlo(fn, x, w, devices=mesh.devices.flat)
    (entry,) = (tmp_path / "cache").glob("*.json.gz")
    entry.write_bytes(entry.read_bytes()[:100])  # cut short, as by a full disk
    again = compile_to_hlo(fn, x, w, devices=mesh.devices.flat)
    assert not again.cached and again.hlo_text == good.hlo_text
    assert compile_to_hlo(fn, x, w, devices=mesh.devices.flat).cached  # rewritten whole
    # Without the devices (a caller that does not say what it compiles for): no cache.
    assert not compile_to_hlo(fn, x, w).cached
