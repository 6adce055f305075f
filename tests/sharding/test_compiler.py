"""The CPU path's compiles (sharding/compiler.py): XLA's warnings reach the report, and the
analysis options change nothing in it."""

import pytest

from tests.steps import tiny, train_report


def test_spmd_rematerialization_warnings_reach_the_report(cpu_devices):
    # The embedding gradient's scatter-add wants its updates sharded like the table's
    # `embed` dim (fsdp) while they arrive sharded by batch over data x fsdp: XLA's SPMD
    # partitioner replicates them and says so on stderr. The report carries it instead.
    rep, _ = train_report(tiny(), {"data": 2, "fsdp": 4})
    assert any("involuntary full rematerialization" in w for w in rep.warnings)
    assert "involuntary" in rep.format_table()
    clean, _ = train_report(tiny(), {"data": 8})
    assert clean.warnings == ()


def test_skipping_llvm_optimisation_leaves_the_report_unchanged(cpu_devices, monkeypatch):
    # The CPU path never runs the code it compiles: CPU_ANALYSIS_OPTIONS skip LLVM's
    # expensive passes and the MLIR fusion emitters. Every figure of the report is the same
    # with and without them, but for the buffer assignment's temporaries (a few hundred
    # bytes). "Without" is XLA's defaults, named: the tests' own process compiles without
    # them already (tests/conftest.py).
    import sharding.compiler
    from experiments import config, runner

    exp = config.load("tiny-h100-dp-tp")
    xla_defaults = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
                    "xla_cpu_use_fusion_emitters": True}
    reports = []
    for options in (xla_defaults, sharding.compiler.CPU_ANALYSIS_OPTIONS):
        monkeypatch.setattr(sharding.compiler, "CPU_ANALYSIS_OPTIONS", options)
        d = runner.run(exp, backend="cpu").to_dict()
        d.pop("timings")
        reports.append(d)
    compiler = [r["memory"].pop("compiler_bytes") for r in reports]
    assert compiler[0] == pytest.approx(compiler[1], abs=1024)
    assert reports[0] == reports[1]


def test_one_device_reads_the_module_before_xla_cpus_own_passes(cpu_devices):
    # One device runs no SPMD partitioning: the module after the call inliner is read.
    # XLA:CPU's final module would have its scatter expanded into a loop over the 512
    # tokens (a kernel per token and step: 0.66 s of a 4-layer Llama 3 8B step on one
    # H200) and a jitted callee's ops without its caller's scope (flash attention's tiles
    # counted as HBM traffic).
    import jax
    import jax.numpy as jnp

    from sharding.compiler import compile_to_hlo
    from sharding.hlo import parse_hlo

    def grad_of_lookup(table, ids):
        def loss(t):
            with jax.named_scope("outer"):
                rows = jax.jit(lambda t, i: jnp.take(t, i, axis=0))(t, ids)
            return jnp.sum(rows ** 2)
        return jax.grad(loss)(table)

    table = jax.ShapeDtypeStruct((1000, 64), jnp.float32)
    ids = jax.ShapeDtypeStruct((512,), jnp.int32)
    text = compile_to_hlo(grad_of_lookup, table, ids, devices=jax.devices()[:1]).hlo_text
    insts = [i for c in parse_hlo(text).computations.values() for i in c.instructions]
    assert [i.opcode for i in insts].count("scatter") == 1
    assert not any(i.opcode in ("while", "fusion") for i in insts)
    assert all("outer" in i.op_name and "/jit(<lambda>)/" in i.op_name
               for i in insts if i.opcode in ("gather", "scatter"))


@pytest.mark.parametrize("system, backend, choices", [
    ("trn2:4x4", "tpu", "choose 'cpu'$"),  # no deviceless Neuron compiler; XLA:GPU is not one
    ("trn2:4x4", "gpu", "choose 'cpu'$"),
    ("h100:8", "tpu", "choose 'cpu' or 'gpu'$"),
    ("tpu-v5e:2x4", "gpu", "choose 'cpu' or 'tpu'$"),
])
def test_a_backend_for_another_kind_of_system_names_only_the_ones_that_build_it(
        system, backend, choices):
    from meshes import get_system
    from sharding.compiler import resolve_backend

    with pytest.raises(ValueError, match=choices):
        resolve_backend(backend, get_system(system))
