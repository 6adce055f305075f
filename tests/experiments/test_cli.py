"""The command line (experiments/cli.py): reports, JSON, the catalog listings, progress."""

import argparse
import json
import math
import subprocess
import sys

import pytest

import models
from experiments import cli
from experiments.cli.flags import power as parse_power
from tests.conftest import DATA, REPO
from tests.helpers import TINY, run_cli, write


def test_system_overrides_reach_the_report(tmp_path, capsys, cpu_devices):
    # data 2 x fsdp 4 on 8 H100s used as 2 NVLink domains of 4 (gpus_per_domain): the
    # data-parallel all-reduces cross the scale-out fabric and take longer with GCP A3's
    # 100 Gb/s per GPU than with the catalog's 400G NICs (the exact times are derived in
    # tests/meshes/test_gpu.py); the FSDP collectives inside a domain are untouched, and the
    # report names the overrides.
    wide = TINY.replace('preset = "tiny"', 'preset = "tiny"\nd_model = 1024\nd_ff = 4096\n'
                        'n_heads = 8\nn_kv_heads = 8\nhead_dim = 128')
    reports = {}
    for extra in ("", "\nnic_gbps = 100"):
        path = write(tmp_path, wide.replace('name = "h100:8"',
                                            f'name = "h100:8"\ngpus_per_domain = 4{extra}'))
        out_json = tmp_path / "r.json"
        code, out, err = run_cli(["run", path, "--json", str(out_json)], capsys)
        assert code == 0, err
        reports[extra] = (out, json.loads(out_json.read_text()))
    slow_out, slow = reports["\nnic_gbps = 100"]
    fast = reports[""][1]
    label = "h100:8 [gpus_per_domain=4, nic_gbps=100]"
    assert label in slow_out and slow["system"] == label
    assert slow["by_link"]["nvlink"] == fast["by_link"]["nvlink"]
    assert slow["by_link"]["infiniband"]["bytes"] == fast["by_link"]["infiniband"]["bytes"]
    assert slow["by_link"]["infiniband"]["time_s"] > 1.5 * fast["by_link"]["infiniband"]["time_s"]


def test_run_prints_report_and_writes_json(tmp_path, capsys, cpu_devices):
    out_json = tmp_path / "r.json"
    code, out, err = run_cli(["run", write(tmp_path, TINY), "--json", str(out_json)], capsys)
    assert code == 0, err
    assert "all-gather" in out and "fsdp" in out and "bottleneck" in out
    d = json.loads(out_json.read_text())
    assert d["fits"] is True and d["by_kind"]["all-gather"] > 0
    assert set(d["timings"]) >= {"lower_s", "compile_s", "parse_s", "estimate_s"}
    # The config it ran, defaults filled in, and the compiler that made the HLO.
    assert d["config"]["system"] == {"name": "h100:8"}
    assert d["config"]["parallelism"] == {"pipeline": 1, "data": 2, "fsdp": 4, "expert": 1,
                                          "sequence": 1, "tensor": 1, "rules": "default",
                                          "virtual_stages": 1, "pipeline_schedule": "1f1b",
                                          "context_mode": "ring", "sequence_parallel": False,
                                          "tp_comm_overlap": False, "overlap_p2p_comm": True,
                                          "outer": ""}
    assert d["config"]["model"]["n_layers"] == 2 and d["config"]["train"]["remat"] == "full"
    # the model's parameters: the tiny preset's, all of them and those a token touches
    tiny = models.preset("tiny")
    assert (d["model_params"], d["active_params"]) == (tiny.param_count(),
                                                       tiny.active_param_count())
    assert d["compiler"].startswith("XLA:CPU")
    assert d["config"]["backend"] == "cpu" and d["config"]["tool_version"] == "0.1.0"


def test_active_params_count_a_tied_output_projection():
    from types import SimpleNamespace

    from experiments.cli.commands import model_params

    # tiny, tied: 2 layers of attention 64 x 16 x (4 + 2 x 2) + 4 x 16 x 64, SwiGLU
    # 3 x 64 x 128 and 2 norms of 64; the final norm; the 256 x 64 table, which the output
    # projection multiplies by: every parameter but none twice is a matmul's (as
    # Llama-3.2-1B's 1.24B, tie_word_embeddings true).
    layer = 64 * 16 * 8 + 4 * 16 * 64 + 3 * 64 * 128 + 2 * 64
    total = 2 * layer + 64 + 256 * 64
    tied = SimpleNamespace(model=models.preset("tiny", tie_embeddings=True))
    assert model_params(tied) == {"model_params": total, "active_params": total}


def test_set_overrides_a_key(tmp_path, capsys, cpu_devices):
    code, out, _ = run_cli(["run", write(tmp_path, TINY), "--set", "parallelism.data=8",
                            "--set", "parallelism.fsdp=1"], capsys)
    assert code == 0
    assert "reduce-scatter" not in out and "all-reduce" in out


def test_bad_config_in_a_real_process_has_no_traceback(tmp_path):
    cfg = write(tmp_path, TINY.replace('"h100:8"', '"h100:7x"'))
    p = subprocess.run([sys.executable, "-m", "experiments.cli", "run", cfg], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.startswith("shardscope: error: system.name:")
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def test_inspect_any_hlo_dump(capsys):
    code, out, err = run_cli(["inspect", str(DATA / "collectives.gpu-h100.hlo"), "--system",
                              "h100:16", "--mesh", "data=2,fsdp=4,tensor=2"], capsys)
    assert code == 0, err
    assert "collective-permute" in out and "tensor" in out


def test_inspect_mesh_spaces_are_dropped_and_bad_names_refused(tmp_path, capsys):
    hlo = str(DATA / "collectives.gpu-h100.hlo")
    out_json = tmp_path / "i.json"
    code, _, err = run_cli(["inspect", hlo, "--system", "h100:16", "--mesh",
                            "data=2, fsdp = 4,tensor=2", "--json", str(out_json)], capsys)
    assert code == 0, err
    axes = {a for c in json.loads(out_json.read_text())["collectives"] for a in c["mesh_axes"]}
    assert axes == {"data", "fsdp", "tensor"}
    for mesh, message in [
            ("tensor=2,tensor=8", "--mesh 'tensor=2,tensor=8': axis 'tensor' is given twice; "
                                  "name each mesh axis once, e.g. --mesh data=2,tensor=4"),
            ("=2,tensor=8", "--mesh '=2,tensor=8': expected name=size,... e.g. --mesh")]:
        code, _, err = run_cli(["inspect", hlo, "--system", "h100:16", "--mesh", mesh], capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, err


def test_inspect_of_a_dump_folder_names_the_files_to_give(tmp_path, capsys):
    # An --xla_dump_to folder: the module after SPMD partitioning and the final one are
    # named (not the buffer assignment beside them), in one line.
    dump = tmp_path / "dump"
    dump.mkdir()
    names = ["m.0001.spmd-partitioner.after_spmd-partitioning.before_x.txt",
             "m.cpu_after_optimizations.txt", "m.cpu_after_optimizations-buffer-assignment.txt",
             "m.ir-no-opt.ll"]
    for name in names:
        (dump / name).write_text("")
    code, _, err = run_cli(["inspect", str(dump), "--system", "h100:8"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"HLO file {str(dump)!r} is a folder (an --xla_dump_to dump?); give one of its " \
           f"HLO texts, after SPMD partitioning (the program's dtypes) or the final one: " \
           f"{dump / names[0]}, {dump / names[1]}\n" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(["inspect", str(empty), "--system", "h100:8"], capsys)
    assert code == 2 and "is a folder with no *after_spmd-partitioning*.txt or " \
                         "*after_optimizations.txt in it" in err


def test_inspect_reads_a_gzipped_dump_and_names_a_damaged_one(tmp_path, capsys):
    code, out, err = run_cli(["inspect", str(DATA / "llama3-8b-4layers.gpu-h200.hlo.gz"),
                              "--system", "h200:1"], capsys)
    assert code == 0, err
    assert "169.4 TFLOP" in out
    gz = (DATA / "llama3-8b-4layers.gpu-h200.hlo.gz").read_bytes()
    bad = tmp_path / "bad.hlo.gz"
    bad.write_bytes(gz[: len(gz) // 2])
    code, _, err = run_cli(["inspect", str(bad), "--system", "h200:1"], capsys)
    assert code == 2 and "damaged gzip" in err and err.count("\n") == 1


def test_inspect_truncated_dump_is_one_line(tmp_path, capsys):
    text = (DATA / "collectives.gpu-h100.hlo").read_text()
    bad = write(tmp_path, text[: len(text) // 2], "bad.hlo")
    code, _, err = run_cli(["inspect", bad, "--system", "h100:16"], capsys)
    assert code == 2 and "HLO line" in err and err.count("\n") == 1
    assert "'" + bad + "'" in err and "after_optimizations" in err  # the file, and the fix


def test_inspect_of_a_file_that_is_not_hlo_names_it_and_the_fix(tmp_path, capsys):
    notes = write(tmp_path, "hello\nworld\n", "notes.txt")
    code, _, err = run_cli(["inspect", notes, "--system", "h100:8"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "notes.txt" in err and "no HLO computations" in err and "after_optimizations" in err


def test_systems_and_models_list_the_catalog(capsys):
    code, out, _ = run_cli(["systems"], capsys)
    assert code == 0 and "gb200-nvl72:72" in out and "tpu7x" in out and "nvlink" in out
    # each system's power and price figures with their sources, or that none is public
    assert "700 W TDP per chip [NVIDIA H100 SXM datasheet" in out
    assert "$4.916 per chip-hour [p5.48xlarge" in out
    assert out.count("power      no public figure") == 5  # v5e, v5p, v6e, trn2, trn2u
    # the sizes it takes: any GPU count (a partial last NVLink domain), not "whole racks"
    assert "gb200-nvl72:256 is 3 racks x 72 GPUs + 1 rack x 40 GPUs" in out
    assert "whole racks" not in out
    # one system at the size asked, its links and power as the catalog lists them
    code, one, _ = run_cli(["systems", "h100:64"], capsys)
    assert code == 0 and one.splitlines()[0] == "h100:64" and "64 (1 per chip)" in one
    assert "infiniband" in one and "Calibration" not in one
    code, out, _ = run_cli(["models"], capsys)
    assert code == 0 and "llama3-405b" in out
    lines = out.splitlines()
    header = lines[0].split()
    assert header[-3:] == ["experts", "params", "active"]
    # Columns line up: every row's parameter count ends where the header's "params" does.
    end = lines[0].index("params") + len("params")
    rows = [ln for ln in lines[1:] if ln and not ln.startswith("params:")]
    assert all(ln[end - 1] == "B" for ln in rows), rows
    mixtral = next(ln for ln in rows if ln.startswith("mixtral-8x7b "))
    assert "8 top-2" in mixtral and mixtral.split()[-1] == "12.75B"
    # GPT-3 ties its output projection to the embedding table: a token's matmuls touch it
    # all the same. 96 layers x (12 x 12288^2 + 4 x 12288 norm weights and biases) + the
    # final norm's 2 x 12288 + the 50257-token table padded to 50304, x 12288.
    # The KV cache per token and layer in bf16: Llama 3 8B's 8 kv heads of 128, keys and
    # values, 2 x 8 x 128 x 2 bytes; DeepSeek-V3's MLA latent of 512 and RoPE key of 64
    # (its paper, section 2.1.1), 576 x 2 bytes, where its 128 "kv" heads would be 64 KiB.
    llama = next(ln for ln in rows if ln.startswith("llama3-8b "))
    assert " gqa " in llama and f" {2 * 8 * 128 * 2:,} B " in llama
    deepseek = next(ln for ln in rows if ln.startswith("deepseek-v3 "))
    assert " mla 512+64 " in deepseek and f" {576 * 2:,} B " in deepseek
    assert "256 top-8 +1 shared, first 3 dense 18432" in deepseek
    gpt3 = next(ln for ln in rows if ln.startswith("gpt3-175b "))
    active = 96 * (12 * 12288**2 + 4 * 12288) + 2 * 12288 + 50304 * 12288
    assert gpt3.split()[-1] == f"{active / 1e9:.2f}B" == "174.57B"


def test_bundled_configs_run_by_name(capsys, cpu_devices):
    code, out, _ = run_cli(["configs"], capsys)
    assert code == 0 and "tiny-h100-dp-tp" in out and "llama3-8b-nvl72" in out
    code, out, err = run_cli(["run", "tiny-h100-dp-tp", "--quiet"], capsys)
    assert code == 0, err
    assert out.startswith("tiny-h100-dp-tp  on h100:8")
    code, _, err = run_cli(["run", "tiny-h100-dp"], capsys)
    assert code == 2 and "did you mean 'tiny-h100-dp-tp'?" in err


def test_run_takes_a_calibration_file(tmp_path, capsys, cpu_devices):
    config = write(tmp_path, TINY)
    code, _, err = run_cli(["run", config, "--calibration", str(tmp_path / "none.toml")], capsys)
    assert code == 2 and "calibration file" in err and err.count("\n") == 1
    cal = tmp_path / "mine.toml"
    cal.write_text('[parameters]\ngpu_bf16_matmul_efficiency = 0.4\n'
                   '[provenance]\nsummary = "my cluster, 3 runs"\n')
    code, out, _ = run_cli(["run", config, "--calibration", str(cal)], capsys)
    # the parameters the file leaves out are named (they run uncalibrated)
    assert code == 0 and "calibration    my cluster, 3 runs; uncalibrated here: " \
        "gpu_low_precision_matmul_scale, tpu_matmul_scale, flash_attention_efficiency" in out


def test_inspect_a_bare_dump_has_no_memory_verdict_and_checks_the_mesh(tmp_path, capsys):
    hlo = str(DATA / "collectives.cpu-after-spmd.hlo")
    out_json = tmp_path / "i.json"
    code, out, err = run_cli(["inspect", hlo, "--system", "h100:16", "--json",
                              str(out_json)], capsys)
    assert code == 0, err
    assert "memory/device  unknown (HLO text only" in out and "no verdict" in out
    assert "fits" not in out.split("memory/device")[1].splitlines()[0]
    d = json.loads(out_json.read_text())
    assert d["fits"] is None
    # Groups: the first of each unless --groups.
    assert all(len(c["groups"]) == 1 and c["group_count"] >= 1 for c in d["collectives"])
    code, _, err = run_cli(["inspect", hlo, "--system", "h100:16", "--mesh", "data=2,fsdp=4"],
                           capsys)
    assert code == 2 and err.count("\n") == 1
    assert "--mesh data=2,fsdp=4 has 8 devices but the program runs on 16" in err
    code, out, _ = run_cli(["inspect", str(DATA / "collectives.cpu.hlo"), "--system",
                            "h100:16"], capsys)
    assert code == 0 and "warning        XLA:CPU's final HLO promotes 16-bit" in out


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_serving_workloads_run_from_a_config(tmp_path, capsys, cpu_devices, kind):
    text = TINY.replace("[workload]", f'[workload]\nkind = "{kind}"')
    out = tmp_path / "r.json"
    code, stdout, err = run_cli(["run", write(tmp_path, text), "--json", str(out)], capsys)
    assert code == 0, err
    d = json.loads(out.read_text())
    assert "KV cache" in d["memory"]["components"]
    assert d["tokens_per_s_per_user"] == pytest.approx(
        d["tokens_per_s"] / 16)  # 16 sequences in the batch
    assert "per user" in stdout


def test_pipeline_in_bf16_and_fp8_runs_on_the_cpu_compiler_and_shows_the_bubble(
        tmp_path, capsys, cpu_devices):
    text = TINY.replace("data = 2\nfsdp = 4", "data = 4\npipeline = 2").replace(
        "[workload]", "[workload]\nmicrobatches = 4")
    for compute in ("bfloat16", "float8"):
        out_json = tmp_path / f"{compute}.json"
        code, out, err = run_cli(["run", write(tmp_path, text + f'[precision]\ncompute = '
                                               f'"{compute}"\n'), "--backend", "cpu",
                                  "--json", str(out_json)], capsys)
        assert code == 0, err
        # 2 stages, 4 microbatches: (P - 1) / (M + P - 1) = 1/5 of the ticks idle.
        assert ("2 stages x 4 microbatches (1F1B); bubble 20.0% of the step ((P-1)/(MV) = "
                "25.0%") in out
        d = json.loads(out_json.read_text())
        assert d["pipeline"]["bubble"] == pytest.approx(1 / 5)
        assert d["pipeline"]["bubble_s"] == pytest.approx(d["compute_s"] / 5)
        # the chips wait through the bubble (the program computes on padding there)
        assert d["power"]["busy"] == pytest.approx(
            min(1.0, d["compute_s"] * 4 / 5 / d["step_time_s"]))
        assert any(c["kind"] == "collective-permute" and c["mesh_axes"] == ["pipeline"]
                   and c["dtype"] == "bfloat16" for c in d["collectives"])
    # Interleaved: 2 virtual stages halve the bubble's share: 1 / (4 x 2 + 1) (4 layers: 2
    # chunks of 1 a stage; tiny's 2 would leave every stage an empty chunk, refused).
    code, out, err = run_cli(["run", write(tmp_path, text.replace(
        "pipeline = 2", "pipeline = 2\nvirtual_stages = 2").replace(
        'preset = "tiny"', 'preset = "tiny"\nn_layers = 4')), "--backend", "cpu"], capsys)
    assert code == 0, err
    assert ("(interleaved 1F1B, 2 virtual stages); bubble 11.1% of the step ((P-1)/(MV) = "
            "12.5%") in out
    code, _, err = run_cli(["run", write(tmp_path, text.replace(
        "pipeline = 2", "pipeline = 2\nvirtual_stages = 2").replace(
        "microbatches = 4", "microbatches = 1"))], capsys)
    assert code == 2 and "parallelism.virtual_stages=2" in err and err.count("\n") == 1


def test_progress_goes_to_a_terminal_only_and_quiet_silences_it(tmp_path, capfd):
    # Stage lines with the elapsed time on stderr when it is a terminal (a pty here);
    # nothing when it is not, nothing with --quiet; the report itself is unchanged.
    import os
    import pty
    import subprocess
    import sys

    from tests.conftest import REPO

    config = write(tmp_path, TINY)

    def run(*extra, tty: bool):
        if not tty:  # here: stderr is pytest's capture, at both the sys and the fd level
            code = cli.main(["run", config, *extra])
            out, err = capfd.readouterr()
            return code, out, err
        cmd = [sys.executable, "-m", "experiments.cli", "run", config, *extra]
        leader, follower = pty.openpty()
        p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=follower, text=True,
                           timeout=300)
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        os.close(leader)
        return p.returncode, p.stdout, b"".join(chunks).decode()

    code, out_tty, err = run(tty=True)
    assert code == 0
    stages = [line for line in err.splitlines() if line.startswith("[")]
    assert [s.split("] ", 1)[1].split(" ")[0] for s in stages] == ["building", "lowering",
                                                                   "reading"]
    assert "lowering and compiling with XLA:CPU for 8 devices" in err
    code, out_quiet, err = run("--quiet", tty=True)
    assert code == 0 and "] " not in err
    code, out_pipe, err = run(tty=False)
    assert code == 0 and err == "" and out_pipe == out_quiet == out_tty


def test_a_gpu_system_on_the_cpu_path_says_how_to_get_its_compiler(tmp_path, capsys,
                                                                  cpu_devices):
    from sharding.compiler import gpu_compiler_installed

    code, stdout, _ = run_cli(["run", write(tmp_path, TINY), "--quiet"], capsys)
    assert code == 0
    second = stdout.splitlines()[1]
    if gpu_compiler_installed():  # make test-gpu's environment
        assert second == "" or "XLA:GPU" not in second
    else:
        assert second.startswith("HLO compiler: not XLA:GPU:")
        assert "to compare: pip install" in second


def test_power_budget_and_run_length(tmp_path, capsys, cpu_devices):
    out = tmp_path / "r.json"
    assert cli.main(["run", "tiny-h100-dp-tp", "--quiet", "--power-budget", "1 MW",
                     "--tokens", "1e9", "--set", "cost.pue=1.2", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    p = d["power"]
    assert d["power_w"] == pytest.approx(p["it_power_w"] * 1.2)
    assert d["energy_per_step_j"] == pytest.approx(d["power_w"] * d["step_time_s"])
    s = d["scale_out"]
    # whole data-parallel replicas (data 2 x tensor 4: 4 GPUs, half the run's power each)
    assert s["chips_within_budget"] == math.floor(1e6 / (d["power_w"] / 2)) * 4
    assert s["run"]["time_s"] == pytest.approx(1e9 / d["tokens_per_s"])
    assert s["run"]["usd"] == pytest.approx(4.916 * 8 * s["run"]["time_s"] / 3600)
    within = s["run_within_budget"]
    assert within["time_s"] == pytest.approx(1e9 / (d["tokens_per_s"] / 8
                                                    * s["chips_within_budget"]))
    text = capsys.readouterr().out
    assert "power budget   1 MW feeds" in text and "PUE 1.2" in text


def test_bad_power_input_is_one_line(capsys):
    assert cli.main(["run", "tiny-h100-dp-tp", "--power-budget", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--power-budget: 'lots'" in err and "100MW" in err and "\n" not in err
    assert cli.main(["run", "tiny-h100-dp-tp", "--set", "cost.pue=0.9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cost.pue=0.9 must be a finite number of at least 1" in err and "\n" not in err
    assert parse_power("250kW") == 250e3 and parse_power("1.5e8") == 1.5e8
    with pytest.raises(argparse.ArgumentTypeError, match="100MW"):
        parse_power("-3 MW")


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.commands, "cmd_systems", interrupted)
    assert cli.main(["systems"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "shardscope: interrupted"


def test_every_command_takes_quiet():
    # a script passes --quiet to every command it runs; none refuses it
    p = cli.build_parser()
    [sub] = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    assert sub.choices and all(any("--quiet" in a.option_strings for a in c._actions)
                               for c in sub.choices.values())


def test_out_says_what_each_command_writes():
    # measure's --out writes a [measured] config; the shared --out of export and import
    # writes their output (measure's help had replaced theirs)
    p = cli.build_parser()
    [sub] = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]

    def out_help(name):
        return next(a.help for a in sub.choices[name]._actions if "--out" in a.option_strings)

    assert "[measured]" in out_help("measure")
    assert "[measured]" not in out_help("export") and "[measured]" not in out_help("import")


@pytest.mark.parametrize("flag", [["--power-budget", "1MW"], ["--tokens", "1e9"]])
def test_backend_all_refuses_the_scale_out_flags(flag, capsys):
    # Its side-by-side table has no power rows and the flags were dropped without a word;
    # refused before any compile, as --html is.
    assert cli.main(["run", "tiny-h100-dp-tp", "--quiet", "--backend", "all", *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert "--power-budget and --tokens take one backend" in err and "\n" not in err


def test_every_argument_of_every_command_says_what_it_is():
    # `shardscope COMMAND --help` is the reference a user reads first: no bare positional
    # or flag (inspect's HLO and --system, results' STORE had none)
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"{name} {a.option_strings or a.dest}" for name, sub in commands.choices.items()
            for a in sub._actions if not a.help]
    assert not bare


def test_run_and_fit_headers_name_the_model_and_its_changes(tmp_path, capsys, cpu_devices):
    # A preset given with --set, and a field given beside it: the header's last line (run)
    # or second (fit) and the JSON's `model` say which model ran (before: only the
    # experiment's name)
    path, out_json = write(tmp_path, TINY), tmp_path / "r.json"
    code, out, err = run_cli(["run", path, "--set", "model.n_layers=1", "--set",
                              "model.preset=tiny", "--quiet", "--json", str(out_json)], capsys)
    assert code == 0, err
    assert out.split("\n\n")[0].splitlines()[-1] == "model: tiny (n_layers 1)"
    assert json.loads(out_json.read_text())["model"] == "tiny (n_layers 1)"
    code, out, err = run_cli(["fit", path, "--set", "model.preset=llama3-8b", "--no-compile",
                              "--quiet", "--json", str(out_json)], capsys)
    assert code == 0, err
    assert out.splitlines()[1] == "model: llama3-8b"
    assert json.loads(out_json.read_text())["model"] == "llama3-8b"
    # the file's run settings kept under the new preset are named too (before: they were
    # dropped, and the line said "model: llama2-13b")
    code, out, err = run_cli(["fit", "nemo-llama2-7b-fp8-h100-8", "--set",
                              "model.preset=llama2-13b", "--no-compile", "--quiet"], capsys)
    assert code == 0, err
    assert out.splitlines()[1] == "model: llama2-13b (fused_qkv true, fused_mlp true)"
