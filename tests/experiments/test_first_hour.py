"""The first hour of a new user: each friction found trying the tool, fixed and held."""

import json

import pytest

from experiments import cli

TINY = "tiny-h100-dp-tp"  # data 2 x tensor 4 on h100:8, 16 sequences of 128 tokens


def test_every_command_compiles_with_the_same_default_backend():
    parser = cli.build_parser()
    defaults = {cmd: parser.parse_args([cmd, *extra]).backend for cmd, extra in (
        ("run", [TINY]), ("search", [TINY]), ("validate", []),
        ("calibrate", ["--out", "c.toml"]))}
    assert set(defaults.values()) == {"cpu"}, defaults
    # compare re-times one XLA:CPU compile per device count: the same path
    from pathlib import Path

    from experiments import compare
    assert 'backend="cpu"' in Path(compare.__file__).read_text()


def test_a_compile_that_takes_minutes_says_so_first_with_the_quick_way(monkeypatch, capsys):
    import sharding

    def stop(*a, **k):
        raise ValueError("stopped before compiling")

    monkeypatch.setattr(sharding, "analyze", stop)
    # an 8B model on the TPU compiler: its notice is the first line, before any compile
    code = cli.main(["run", "tpu-recipes-v6e-8-llama3-8b", "--backend", "tpu"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and err[-1].endswith("stopped before compiling")
    assert "takes minutes" in err[0] and "--backend cpu" in err[0] and "seconds" in err[0]
    # the CPU path says nothing of the kind, and --quiet silences the notice
    code = cli.main(["run", "tpu-recipes-v6e-8-llama3-8b", "--backend", "tpu", "--quiet"])
    assert capsys.readouterr().err.count("\n") == 1


def test_compare_fits_a_rack_sharding_to_nodes_of_another_count():
    from experiments import config
    from experiments.compare import fit_to_devices

    # llama3-8b-nvl72: data 9 x fsdp 8 over 72 GPUs, 4 sequences each. 64 is not a multiple
    # of 72 nor the reverse: fsdp keeps its 8 ways, data takes 64 / 8 = 8, and the batch
    # keeps 4 sequences per batch shard: 4 x 64 = 256.
    for system in ("h100:64", "b200:64"):
        raw = config.load_raw("llama3-8b-nvl72")
        raw["system"] = {"name": system}
        note = fit_to_devices(raw, 64)
        assert raw["parallelism"] == {"data": 8, "fsdp": 8}
        assert raw["workload"]["global_batch"] == 256 and "global_batch 288 -> 256" in note
        assert config.from_dict(raw).system.num_devices == 64  # valid there


def test_a_misspelt_system_is_refused_before_anything_compiles(monkeypatch, capsys):
    from experiments import runner

    compiled = []
    monkeypatch.setattr(runner, "run", lambda *a, **k: compiled.append(1))
    code = cli.main(["compare", TINY, "--systems", "h100:8,h1000:8", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and compiled == [] and err.count("\n") == 1
    assert "'h1000:8'" in err and "unknown system family" in err


@pytest.mark.parametrize("args", [["search", TINY, "--workers", "0"],
                                  ["search", TINY, "--budget", "-1"],
                                  ["validate", "--workers", "none"]])
def test_counts_below_one_are_refused_in_one_line(args, capsys):
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "at least 1" in err


def test_a_tpu_slice_libtpu_refuses_is_refused_at_the_config():
    from meshes import get_system

    with pytest.raises(ValueError, match="hosts of 2x2 chips.*3x3 is not"):
        get_system("tpu-v5e:3x3")
    # nor one Google does not provision (v5e's eight 2D shapes; whole 4x4x4 cubes past one)
    for refused in ("tpu-v5e:1x8", "tpu-v5p:8x8x7"):
        with pytest.raises(ValueError, match=f"{refused.split(':')[1]} is not; e.g."):
            get_system(refused)
    for ok in ("tpu-v5e:2x4", "tpu-v5e:4x2", "tpu7x:4x2x2", "tpu-v6e:16x16*2"):
        assert get_system(ok).name == ok


def test_a_tpu_accelerator_type_is_read_and_the_report_says_its_slice(capsys):
    # MaxText's and GKE's device types: v5litepod-16 is 16 v5e chips, Google's 4x4
    from tests.conftest import DATA

    code = cli.main(["inspect", str(DATA / "collectives.tpu-v5e.hlo"), "--system",
                     "v5litepod-16", "--mesh", "data=2,fsdp=4,tensor=2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[0].startswith(
        "collectives.tpu-v5e.hlo  on tpu-v5e:4x4 (16 devices: v5litepod-16 = tpu-v5e:4x4, "
        "16 chips)")
    # a size Google has no slice of: one line, the nearest sizes
    assert cli.main(["inspect", str(DATA / "collectives.tpu-v5e.hlo"), "--system",
                     "v5p-24"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the nearest are v5p-16 and v5p-32" in err


def test_systems_says_which_figures_are_a_chips_and_which_a_devices(capsys):
    assert cli.main(["systems"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("\ntpu7x:"):].split("\n\n")[0].split("\ntrn2")[0]
    # a TPU7x chip is two JAX devices of 1150 TFLOP/s and 96 GiB (103 GB) each
    assert "chip       tpu7x: 2300 TFLOP/s bf16, 206 GB HBM" in block
    assert "device     1150 TFLOP/s bf16, 103 GB HBM" in block
    h100 = out[out.index("\nh100:"):].split("\n\n")[0]
    assert "device " not in h100.split("\n", 3)[2]  # one device per chip: no device row


def test_each_projection_is_its_own_row_in_the_gathered_dtype(tmp_path, capsys, cpu_devices):
    # FSDP over 8 gathers every weight; gate and up are the same (d_model, d_ff) shape as
    # down transposed, so each gathers the same bf16 bytes and none reads as f32.
    out = tmp_path / "r.json"
    assert cli.main(["run", TINY, "--set", "parallelism.data=1", "--set",
                     "parallelism.tensor=1", "--set", "parallelism.fsdp=8", "--quiet",
                     "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    forward = {o["operation"]: o["bytes"] for o in d["by_operation"]
               if o["kind"] == "all-gather" and o["operation"].endswith("(forward)")}
    gate, up, down = (forward[f"mlp/{p}_proj (forward)"] for p in ("gate", "up", "down"))
    assert gate == up == down > 0
    assert {"attention/query_proj (forward)", "attention/key_proj (forward)",
            "attention/value_proj (forward)"} <= set(forward)
    gathers = [c for c in d["collectives"] if c["kind"] == "all-gather" and "_proj" in
               c["op_name"]]
    assert gathers and {c["dtype"] for c in gathers} == {"bfloat16"}


def test_xlas_rematerialization_warning_says_what_it_is():
    from sharding.compiler import xla_warnings

    raw = ("W1203 11:54:07.099898 31097 spmd_partitioner.cc:656] [SPMD] Involuntary full "
           "rematerialization. The compiler cannot go from sharding {devices=[72,1,1]<=[72]} "
           "to {devices=[1,1,8,9]<=[9,8]T(1,0) last_tile_dim_replicate} efficiently for HLO "
           "operation %fake_parameter.2 = f32[4,1024,4096]{2,1,0} parameter(2), sharding="
           "{devices=[72,1,1]<=[72]}. As the last resort, SPMD will replicate the tensor")
    (msg,) = xla_warnings([raw])
    assert "f32[4,1024,4096]" in msg and "operand of a computation it partitions" in msg
    assert "gathers the whole tensor" in msg and "involuntary full rematerialization" in msg


@pytest.mark.slow
def test_a_budget_counts_the_untried_and_results_name_their_system(tmp_path, capsys):
    store = str(tmp_path / "s.sqlite")
    base = ["search", TINY, "--axes", "data,tensor", "--store", store, "--workers", "1",
            "--quiet"]
    # data x tensor over 8 devices: 4 configs (8x1 does not split the kv heads... whatever
    # the validator refuses is a row too); one compile, the rest counted as not tried
    assert cli.main([*base, "--budget", "1"]) == 0
    out = capsys.readouterr().out
    assert "not tried (the budget" in out.splitlines()[0]
    untried = out.splitlines()[0].split(", ")[-1].split()[0]
    # the closing count says so too, beside the configs that ran
    assert any(" configs: " in ln and ln.endswith(f", {untried} not tried (the budget)")
               for ln in out.splitlines()), out
    assert cli.main(["results", store]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("on h100:8 (as compiled): "
                                                             f"{out.split(': ')[1].split()[0]} "
                                                             "configs")
    # re-estimates on another system are kept per system, and results shows them
    assert cli.main([*base, "--reestimate", "--system", "b200:8"]) == 0
    capsys.readouterr()
    assert cli.main(["results", store, "--system", "b200:8", "--json",
                     str(tmp_path / "b.json")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("re-timed on b200:8: 1 config")
    assert cli.main(["results", store, "--system", "h200:8"]) == 2


def test_no_command_names_the_commands_and_version_says_it(capsys):
    from experiments import cli

    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardscope: error: name a command: run, fit, ") and \
        "--help" in err and err.count("\n") == 1
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("shardscope ")
