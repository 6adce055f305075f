"""The CPU path's compiles (sharding/compiler.py): XLA's warnings reach the report, and the
analysis options change nothing in it."""

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
    # expensive passes. Every figure of the report, the compiler's memory included, is the
    # same with and without them. "Without" is XLA's defaults, named: the tests' own
    # process compiles without those passes already (tests/conftest.py).
    import json

    import sharding.compiler
    from experiments import config, runner

    exp = config.load("tiny-h100-dp-tp")
    xla_defaults = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}
    reports = []
    for options in (xla_defaults, sharding.compiler.CPU_ANALYSIS_OPTIONS):
        monkeypatch.setattr(sharding.compiler, "CPU_ANALYSIS_OPTIONS", options)
        d = runner.run(exp, backend="cpu").to_dict()
        d.pop("timings")
        reports.append(json.dumps(d, sort_keys=True, default=str))
    assert reports[0] == reports[1]
