"""The command line: reports, JSON, and one clear line for every mistake."""

import json
import subprocess
import sys

import pytest

from experiments import cli
from tests.conftest import DATA, REPO

TINY = """
name = "t"
[model]
preset = "tiny"
[system]
name = "h100:8"
[parallelism]
data = 2
fsdp = 4
[workload]
seq_len = 32
global_batch = 16
"""


def write(tmp_path, text, name="exp.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def run_cli(args, capsys):
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_system_overrides_reach_the_report(tmp_path, capsys, cpu_devices):
    # data 2 x fsdp 4 on 8 H100s used as 2 NVLink domains of 4 (gpus_per_domain): the
    # data-parallel all-reduces cross the scale-out fabric and take longer with GCP A3's
    # 100 Gb/s per GPU than with the catalog's 400G NICs (the exact times are derived in
    # tests/test_meshes.py); the FSDP collectives inside a domain are untouched, and the
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
                                          "outer": ""}
    assert d["config"]["model"]["n_layers"] == 2 and d["config"]["train"]["remat"] == "full"
    assert d["compiler"].startswith("XLA:CPU")
    assert d["config"]["backend"] == "auto" and d["config"]["tool_version"] == "0.1.0"


def test_set_overrides_a_key(tmp_path, capsys, cpu_devices):
    code, out, _ = run_cli(["run", write(tmp_path, TINY), "--set", "parallelism.data=8",
                            "--set", "parallelism.fsdp=1"], capsys)
    assert code == 0
    assert "reduce-scatter" not in out and "all-reduce" in out


BAD = {
    "unknown key": (TINY.replace("seq_len = 32", "seq_len = 32\nseqlen = 3"),
                    "unknown key 'workload.seqlen'; did you mean 'workload.seq_len'? valid keys "
                    "in [workload]"),
    # A typo of a required key is the typo, not a missing key.
    "typo": (TINY.replace("global_batch", "global_batc"),
             "unknown key 'workload.global_batc'; did you mean 'workload.global_batch'?"),
    # 72 devices: the suggestions divide both d_model = 64 and 72, not just 64.
    "suggest": (TINY.replace('"h100:8"', '"gb200-nvl72:72"').replace(
        "data = 2\nfsdp = 4", "fsdp = 72").replace("global_batch = 16", "global_batch = 72"),
                "parallelism.fsdp=72 does not divide model.d_model=64; make its ways one that "
                "divides both 64 and the 72 devices: 1, 2, 4, 8"),
    "product": (TINY.replace("fsdp = 4", "fsdp = 2"),
                "= 4 devices, but system.name='h100:8' has 8"),
    "indivisible": (TINY.replace("data = 2\nfsdp = 4", "data = 2\ntensor = 4"),
                    "parallelism.tensor=4 does not divide model.n_kv_heads=2; make its ways one "
                    "that divides both 2 and the 8 devices: 1, 2"),
    "system": (TINY.replace('"h100:8"', '"h900:8"'),
               "unknown system family 'h900' in 'h900:8'; valid: a100:8"),
    "preset": (TINY.replace('"tiny"', '"llama5"'), "model.preset='llama5' is unknown; valid:"),
    "dtype": (TINY + '[precision]\ncompute = "fp16"\n',
              "precision.compute='fp16' is not one of 'bfloat16'"),
    "missing": (TINY.replace("seq_len = 32\n", ""), "missing required key workload.seq_len"),
    "syntax": (TINY.replace("[workload]", "[workload"), "not valid TOML"),
    "batch": (TINY.replace("global_batch = 16", "global_batch = 12"),
              "not divisible by parallelism.data x parallelism.fsdp x parallelism.expert = 8"),
    "experts": (TINY.replace("[system]", "n_experts = 4\nexperts_per_token = 2\n[system]")
                .replace("data = 2\nfsdp = 4", "expert = 8"),
                "parallelism.expert=8 does not divide model.n_experts=4; make its ways one "
                "that divides both 4 and the 8 devices: 1, 2, 4"),
    "moe+cp": (TINY.replace("[system]", "n_experts = 4\nexperts_per_token = 2\n[system]")
               .replace("data = 2\nfsdp = 4", "data = 4\nsequence = 2"),
               "parallelism.sequence=2 with a mixture of experts"),
    "fp4 on hopper": (TINY + '[precision]\ncompute = "float4"\n',
                      "precision.compute='float4': h100 has no FP4 tensor cores"),
    "int8 train": (TINY + '[precision]\nweights = "int8"\n',
                   "precision.weights='int8' applies to serving"),
    "type": (TINY.replace("data = 2", 'data = "two"'), "parallelism.data='two' must be an integer"),
    "override key": (TINY.replace('name = "h100:8"', 'name = "h100:8"\nnic_gb = 100'),
                     "unknown key 'system.nic_gb'; did you mean 'system.nic_gbps'? valid keys in "
                     "[system]: allreduce_alpha_us, dcn_gbps, fabric, gpus_per_domain, name, "
                     "nic_gbps, pod_gpus, pod_oversubscription, sharp"),
    "override value": (TINY.replace('name = "h100:8"', 'name = "h100:8"\nsharp = "yes"'),
                       "[system]: system override sharp='yes' must be true or false"),
    "measured": (TINY + "[measured]\nstep_time_s = -1\n",
                 "measured.step_time_s=-1 must be above 0"),
    "rules": (TINY.replace("fsdp = 4", 'fsdp = 4\nrules = "megatron"'),
              "parallelism.rules='megatron' is not a rule preset; valid: default"),
    "dropless sentinel": (TINY.replace('preset = "tiny"', 'preset = "tiny"\nn_experts = 4\n'
                                       'experts_per_token = 2\ncapacity_factor = 0'),
                          "for no dropped tokens set model.dropless = true"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_one_clear_line(tmp_path, capsys, case):
    text, message = BAD[case]
    code, out, err = run_cli(["run", write(tmp_path, text)], capsys)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_missing_file_and_bad_override(tmp_path, capsys):
    code, _, err = run_cli(["run", str(tmp_path / "nope.toml")], capsys)
    assert code == 2 and "not found" in err
    code, _, err = run_cli(["run", write(tmp_path, TINY), "--set", "parallelism"], capsys)
    assert code == 2 and "expected key=value" in err


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


def test_inspect_truncated_dump_is_one_line(tmp_path, capsys):
    text = (DATA / "collectives.gpu-h100.hlo").read_text()
    bad = write(tmp_path, text[: len(text) // 2], "bad.hlo")
    code, _, err = run_cli(["inspect", bad, "--system", "h100:16"], capsys)
    assert code == 2 and "HLO line" in err and err.count("\n") == 1


def test_systems_and_models_list_the_catalog(capsys):
    code, out, _ = run_cli(["systems"], capsys)
    assert code == 0 and "gb200-nvl72:72" in out and "tpu7x" in out and "nvlink" in out
    # each system's power and price figures with their sources, or that none is public
    assert "700 W TDP per chip [NVIDIA H100 SXM datasheet" in out
    assert "$4.916 per chip-hour [p5.48xlarge" in out
    assert out.count("power      no public figure") == 5  # v5e, v5p, v6e, trn2, trn2u
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


def test_bundled_configs_run_by_name(capsys, cpu_devices):
    code, out, _ = run_cli(["configs"], capsys)
    assert code == 0 and "tiny-h100-dp-tp" in out and "llama3-8b-nvl72" in out
    code, out, err = run_cli(["run", "tiny-h100-dp-tp", "--quiet"], capsys)
    assert code == 0, err
    assert out.startswith("tiny-h100-dp-tp  on h100:8")
    code, _, err = run_cli(["run", "tiny-h100-dp"], capsys)
    assert code == 2 and "did you mean 'tiny-h100-dp-tp'?" in err


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


def test_python_api_writes_nothing_to_stderr(tmp_path):
    # libtpu is installed for deviceless compiles; on a machine without TPU chips, starting
    # JAX must not start the TPU runtime (a page of warnings about TPU environment vars).
    script = tmp_path / "api.py"
    script.write_text(API_EXAMPLE)
    p = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    assert float(p.stdout.split()[-1]) > 0


API_EXAMPLE = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import sharding
sharding.ensure_cpu_devices(8)
mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu"))
x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
rep = sharding.analyze(jax.jit(lambda x, w: jnp.sum(x @ w)), x, w, mesh=mesh, system="h100:8")
print(rep.step_time_s)
"""


def test_every_shipped_config_is_valid():
    from experiments import config

    paths = sorted((REPO / "experiments" / "configs").glob("*.toml"))
    assert len(paths) >= 5
    for p in paths:
        exp = config.load(p)
        assert exp.name == p.stem, f"{p.name}: name should match the file name"


def test_a_model_too_big_for_its_devices_does_not_fit(tmp_path, capsys, cpu_devices):
    # Llama 2 7B in pure data parallelism on 8 H100s: every GPU holds the whole model in f32,
    # its AdamW moments and gradients: 16 bytes x 6.7e9 parameters = 108 GB > 80 GB.
    text = TINY.replace('"tiny"', '"llama2-7b"\nn_layers = 32').replace(
        "data = 2\nfsdp = 4", "data = 8").replace("seq_len = 32", "seq_len = 256").replace(
        "global_batch = 16", "global_batch = 8")
    out_json = tmp_path / "r.json"
    code, out, err = run_cli(["run", write(tmp_path, text), "--json", str(out_json)], capsys)
    assert code == 0, err
    d = json.loads(out_json.read_text())
    parts = d["memory"]["components"]
    assert parts["parameters"] == pytest.approx(4 * 6.74e9, rel=0.01)
    assert parts["optimizer state"] == pytest.approx(8 * 6.74e9, rel=0.01)
    assert d["fits"] is False and "DOES NOT FIT" in out


def test_html_report_is_one_file_with_its_plots(tmp_path, capsys, cpu_devices):
    out = tmp_path / "r.html"
    code, _, err = run_cli(["run", write(tmp_path, TINY), "--html", str(out)], capsys)
    assert code == 0, err
    page = out.read_text()
    assert page.count("<svg") == 3  # step breakdown, bytes per link, roofline
    assert "Roofline" in page and "<circle" in page and "polyline" in page
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")


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
        assert any(c["kind"] == "collective-permute" and c["mesh_axes"] == ["pipeline"]
                   and c["dtype"] == "bfloat16" for c in d["collectives"])
    # Interleaved: 2 virtual stages halve the bubble's share: 1 / (4 x 2 + 1).
    code, out, err = run_cli(["run", write(tmp_path, text.replace(
        "pipeline = 2", "pipeline = 2\nvirtual_stages = 2")), "--backend", "cpu"], capsys)
    assert code == 0, err
    assert ("(interleaved 1F1B, 2 virtual stages); bubble 11.1% of the step ((P-1)/(MV) = "
            "12.5%") in out
    code, _, err = run_cli(["run", write(tmp_path, text.replace(
        "pipeline = 2", "pipeline = 2\nvirtual_stages = 2").replace(
        "microbatches = 4", "microbatches = 1"))], capsys)
    assert code == 2 and "parallelism.virtual_stages=2" in err and err.count("\n") == 1


def test_progress_goes_to_a_terminal_only_and_quiet_silences_it(tmp_path):
    # Stage lines with the elapsed time on stderr when it is a terminal (a pty here);
    # nothing when it is not, nothing with --quiet; the report itself is unchanged.
    import os
    import pty
    import subprocess
    import sys

    from tests.conftest import REPO

    config = write(tmp_path, TINY)

    def run(*extra, tty: bool):
        cmd = [sys.executable, "-m", "experiments.cli", "run", config, *extra]
        if not tty:
            p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
            return p.returncode, p.stdout, p.stderr
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
    assert "XLA:CPU (fake devices) for 8 devices" in err
    code, out_quiet, err = run("--quiet", tty=True)
    assert code == 0 and "] " not in err
    code, out_pipe, err = run(tty=False)
    assert code == 0 and err == "" and out_pipe == out_quiet == out_tty


NO_FIT = """
name = "8b-on-8"
[model]
preset = "llama3-8b"
n_layers = 8
[system]
name = "h100:8"
[parallelism]
data = 8
[workload]
seq_len = 8192
global_batch = 16
[train]
remat = "none"
"""


def test_a_step_that_does_not_fit_says_so_first_and_what_would_fit(tmp_path, capsys,
                                                                      cpu_devices):
    # f32 parameters, gradients and Adam state of 8 Llama 3 8B layers replicated on every
    # GPU plus no-remat activations: 88 GB on an 80 GB H100.
    import re

    path = write(tmp_path, NO_FIT)
    out_json = tmp_path / "r.json"
    code, out, _ = run_cli(["run", path, "--json", str(out_json)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[1].startswith("DOES NOT FIT: needs ") and "has 80.00 GB" in lines[1]
    assert "-- if it fit" in next(line for line in lines if line.startswith("step time"))
    assert "bottleneck     HBM capacity: needs" in out
    d = json.loads(out_json.read_text())
    assert not d["fits"] and d["bottleneck"].startswith("HBM capacity")
    advice = d["fit_advice"]
    assert advice[0].startswith("train.remat = 'full'")
    fsdp = re.search(r"parallelism.fsdp = (\d+), data = (\d+) \(about ([\d.]+) GB", advice[1])
    assert fsdp
    # Each fix, applied, fits; the FSDP one at about the size it said.
    for fix in (["--set", "train.remat=full"],
                ["--set", f"parallelism.fsdp={fsdp[1]}", "--set", f"parallelism.data={fsdp[2]}"]):
        code, _, err = run_cli(["run", path, *fix, "--json", str(out_json)], capsys)
        assert code == 0, err
        d = json.loads(out_json.read_text())
        assert d["fits"] and not d["fit_advice"]
    assert d["memory_per_device_bytes"] == pytest.approx(float(fsdp[3]) * 1e9, rel=0.1)


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
