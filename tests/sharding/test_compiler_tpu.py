"""The deviceless TPU compiler (libtpu, the `tpu` extra that `make test` installs)."""

import json

import pytest

from meshes import get_system
from sharding import compiler as backends
from tests.helpers import DECODE_70B, TINY, run_cli, run_json, tpu_compiler_refuses, write

pytestmark = pytest.mark.tpu


TPU_TINY = TINY.replace('"h100:8"', '"tpu-v5e:2x4"')


def test_libtpu_is_installed_by_the_project():
    assert backends.tpu_compiler_installed(), f"install it: {backends.TPU_EXTRA}"


def test_tpu_devices_carry_the_catalog_placement():
    system = get_system("tpu-v5e:2x4")
    devices = backends.tpu_devices(system)
    assert len(devices) == 8
    for i, d in enumerate(devices):
        slice_, x, y, core = system.coords(i)
        assert list(d.coords)[:2] == [x, y] and d.core_on_chip == core
        assert backends.system_device_id(system, d) == i


def test_a_v4_chip_is_one_megacore_device_as_in_the_catalog(tmp_path, capsys, cpu_devices):
    # libtpu's default v4 chip config shows each TensorCore as a device: --backend tpu on
    # any v4 system ended in "libtpu's v4:2x2x2 has 16 devices, the catalog's
    # tpu-v4:2x2x2 8".
    system = get_system("tpu-v4:2x2x2")
    devices = backends.tpu_devices(system)
    assert len(devices) == 8
    assert [backends.system_device_id(system, d) for d in devices] == list(range(8))
    v4 = TPU_TINY.replace('"tpu-v5e:2x4"', '"tpu-v4:2x2x2"')
    code, stdout, err = run_cli(["run", write(tmp_path, v4), "--backend", "tpu", "--quiet"],
                                capsys)
    assert code == 0, err
    assert "HLO from the TPU compiler (libtpu, deviceless v4:2x2x2)" in stdout


def test_run_on_the_tpu_compiler_says_so_and_keeps_noise_away(tmp_path, capsys, cpu_devices):
    out = tmp_path / "r.json"
    code, stdout, err = run_cli(["run", write(tmp_path, TPU_TINY), "--backend", "tpu",
                                 "--json", str(out)], capsys)
    assert code == 0, err
    assert "HLO from the TPU compiler (libtpu, deviceless v5e:2x4)" in stdout
    assert err == ""  # libtpu's environment warnings are captured
    d = json.loads(out.read_text())
    assert d["compiler"].startswith("the TPU compiler")
    assert {c["link"] for c in d["collectives"]} == {"ici"}
    # The program's bf16 weights are gathered in bf16 (no CPU-style f32 upcast).
    gathers = [c for c in d["collectives"] if c["kind"] == "all-gather" and len(c["shape"]) >= 2
               and "proj" in c["op_name"]]
    assert gathers and {c["dtype"] for c in gathers} == {"bfloat16"}


def test_auto_picks_the_tpu_compiler_for_tpu_systems(monkeypatch):
    assert backends.resolve_backend("auto", get_system("tpu-v6e:2x4")) == "tpu"
    monkeypatch.setattr(backends, "gpu_compiler_installed", lambda: False)
    assert backends.resolve_backend("auto", get_system("h100:8")) == "cpu"


def test_missing_extra_is_one_line_with_the_install_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(backends, "tpu_compiler_installed", lambda: False)
    code, _, err = run_cli(["run", write(tmp_path, TPU_TINY), "--backend", "tpu"], capsys)
    assert code == 2 and "pip install 'shardscope[tpu]'" in err and err.count("\n") == 1


def test_a_program_the_tpu_compiler_cannot_fit_is_one_line(tmp_path, capsys):
    # 54 GB of temporaries on a 16 GB v5e. (Many short sequences: the compilers take
    # longer over long ones, the TPU compiler three times as long over 8192 positions.)
    big = TPU_TINY.replace('"tiny"', '"llama3-8b"\nn_layers = 4').replace(
        "seq_len = 32", "seq_len = 1024").replace("global_batch = 16", "global_batch = 512")
    code, _, err = run_cli(["run", write(tmp_path, big), "--backend", "tpu"], capsys)
    assert code == 2
    # The notice that an 8B compile takes minutes, then the error: one line each.
    notice, error = err.splitlines()
    assert notice.startswith("shardscope: compiling llama3-8b") and "--backend cpu" in notice
    assert "does not fit" in error and "--backend cpu" in error


def test_cpu_and_tpu_compilers_move_comparable_bytes(tmp_path, capsys, cpu_devices):
    # The same tiny model and mesh through both compilers. The TPU compiler decomposes
    # reduce-scatters and some all-gathers into collective-permute rings (collective
    # matmul) and re-gathers weights per consumer, so kinds differ; the total stays within
    # the same order. (Per-kind agreement within 10% is not reached yet: see README.)
    totals = {b: sum(run_json(tmp_path, TPU_TINY, capsys, "--backend", b)["by_kind"].values())
              for b in ("cpu", "tpu")}
    assert 0.5 < totals["tpu"] / totals["cpu"] < 4


def test_cpu_and_tpu_agree_per_kind_where_they_emit_the_same_collectives(tmp_path, capsys,
                                                                         cpu_devices):
    # Data parallelism: both compilers reduce the same gradients with all-reduces, so the
    # bytes agree per kind (the TPU's combiner only merges them into fewer, larger ones).
    dp = TPU_TINY.replace("data = 2\nfsdp = 4", "data = 8").replace(
        "[workload]", "[train]\nremat = 'none'\n[workload]")
    by_kind = {b: run_json(tmp_path, dp, capsys, "--backend", b)["by_kind"]
               for b in ("cpu", "tpu")}
    assert set(by_kind["tpu"]) == set(by_kind["cpu"]) == {"all-reduce"}
    assert by_kind["tpu"]["all-reduce"] == pytest.approx(by_kind["cpu"]["all-reduce"], rel=0.1)


def test_auto_falls_back_to_the_cpu_path_when_the_tpu_compiler_refuses(tmp_path, capsys,
                                                                       cpu_devices,
                                                                       monkeypatch):
    # The TPU compiler's refusal is real in the test above; here its answer is given, so
    # that the fallback costs a tiny compile: `auto` compiles on the CPU path instead and
    # the report carries the TPU compiler's verdict.
    tpu_compiler_refuses(monkeypatch)
    code, out, err = run_cli(["run", write(tmp_path, TPU_TINY), "--backend", "auto"], capsys)
    assert code == 0, err
    assert "HLO from XLA:CPU" in out and "TPU compiler: the program does not fit" in out


def test_pipeline_in_bf16_compiles_on_the_tpu_compiler(tmp_path, capsys, cpu_devices):
    text = TPU_TINY.replace("data = 2\nfsdp = 4", "data = 2\npipeline = 2\ntensor = 2").replace(
        "[workload]", "[workload]\nmicrobatches = 4").replace('"tiny"', '"tiny"\nn_kv_heads = 4')
    out = tmp_path / "r.json"
    code, _, err = run_cli(["run", write(tmp_path, text), "--backend", "tpu", "--json",
                            str(out)], capsys)
    assert code == 0, err
    d = json.loads(out.read_text())
    assert any(c["kind"] == "collective-permute" and c["mesh_axes"] == ["pipeline"]
               for c in d["collectives"])


@pytest.mark.parametrize("backend", ["tpu", "cpu"])
def test_decode_reads_each_weight_and_cache_byte_once(tmp_path, cpu_devices, backend):
    # A 4-layer Llama 3 70B slice, TP 8, 64 sequences over a 2048-position cache. A decode
    # step reads every weight once (the embedding table only for the rows it gathers), the
    # KV cache once, and moves its small activations. The TPU compiler nests each layer's
    # weight slice inside the matmul's fusion (it was counted as the whole stacked array:
    # 4x here, 60x on 80 layers); the CPU path's unfused decode attention is one kernel.
    from experiments import config, runner
    from models.memory import serving_activation_bytes

    exp = config.load(write(tmp_path, DECODE_70B))
    rep = runner.run(exp, backend=backend)
    m, d, v = exp.model, exp.model.d_model, exp.model.padded_vocab
    state = dict(runner.memory_of(exp).components)  # exact from the shardings
    params = state["parameters"]
    embedding_table = v * d * 2 / 8  # vocab-sharded over TP 8, bf16
    cache = 2 * 4 * 64 * 2048 * (m.n_kv_heads // 8) * m.head_dim * 2
    assert state["KV cache"] == cache
    activations = m.n_layers * serving_activation_bytes(
        m, workload=exp.workload, precision=exp.precision,
        mesh_shape=exp.parallelism.sizes(), rules=exp.parallelism.axis_rules())
    floor = params - embedding_table + cache + activations
    assert rep.compute.hbm_bytes == pytest.approx(floor, rel=0.05)


def test_backend_all_puts_the_compilers_side_by_side(tmp_path, capsys, cpu_devices):
    out = tmp_path / "all.json"
    code, stdout, err = run_cli(["run", write(tmp_path, TPU_TINY), "--backend", "all",
                                 "--quiet", "--json", str(out)], capsys)
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0] == "t  on tpu-v5e:2x4: the same step from each compiler"
    assert lines[1] == "model: tiny"  # the preset, nothing beside it
    assert lines[3].split() == ["cpu", "tpu"]
    assert lines[4].split()[:3] == ["compiler", "XLA:CPU", "the"]
    assert any(ln.startswith("difference: the ") for ln in lines)
    d = json.loads(out.read_text())
    assert [b["backend"] for b in d["backends"]] == ["cpu", "tpu"]
    cpu, tpu = d["backends"]
    assert cpu["compiler_note"].startswith("not the TPU compiler") and tpu["compiler_note"] == ""
    # The same step: the model's FLOPs are the same; both gather FSDP weights over fsdp.
    assert cpu["model_flops_per_step"] == tpu["model_flops_per_step"]
    for r in (cpu, tpu):
        assert any(c["kind"] == "all-gather" and c["mesh_axes"] == ["fsdp"]
                   for c in r["collectives"])


def test_the_cpu_path_for_a_tpu_system_says_it_is_not_the_tpu_compiler(tmp_path, capsys,
                                                                        cpu_devices):
    code, stdout, _ = run_cli(["run", write(tmp_path, TPU_TINY), "--backend", "cpu",
                               "--quiet"], capsys)
    assert code == 0
    second = stdout.splitlines()[1]
    assert second.startswith("HLO compiler: not the TPU compiler: XLA:CPU's partitioning is "
                             "the same, but its fusions")
    assert second.endswith("(--backend all compares them)")


@pytest.mark.slow
def test_a_search_on_the_tpu_compiler_runs_its_workers_side_by_side(tmp_path, capsys):
    # Two worker processes, each loading libtpu for its deviceless compiles at the same
    # time: two processes that load libtpu at once used to collide on its lock file
    # ("Internal error when accessing libtpu multi-process lockfile"); deviceless compiles
    # own no chip, so every config that splits is compiled by the TPU compiler, and stored
    # under that backend.
    from experiments.store import Store

    store = tmp_path / "s.sqlite"
    code, out, err = run_cli(["search", write(tmp_path, TPU_TINY), "--backend", "tpu",
                              "--axes", "data,tensor", "--workers", "2", "--store",
                              str(store), "--quiet"], capsys)
    assert code == 0, err
    with Store(store) as s:
        rows = s.results()
    ok = [r for r in rows if r.status == "ok"]
    assert len(ok) >= 2 and {r.status for r in rows} == {"ok", "refused"}, \
        [(r.name, r.status, r.message) for r in rows]
    assert {r.backend for r in rows} == {"tpu"}
    assert all("TPU compiler" in r.report["compiler"] for r in ok)


def test_a_multi_slice_system_is_left_to_the_cpu_path_in_one_line(tmp_path, capsys,
                                                                   cpu_devices):
    # libtpu builds tpu-v5e:2x2*2 as one 4-device program per slice, its DCN collectives
    # as host transfers (send/recv to the megascale runtime) that the reader does not take:
    # `--backend tpu` used to end in "the mesh ... has 8 devices but the program runs on
    # 4 (num_partitions); give sizes whose product is 4", which no [parallelism] can do.
    system = get_system("tpu-v5e:2x2*2")
    assert backends.resolve_backend("auto", system) == "cpu"
    assert backends.available_backends(system) == ["cpu"]
    two = TPU_TINY.replace('"tpu-v5e:2x4"', '"tpu-v5e:2x2*2"')
    code, _, err = run_cli(["run", write(tmp_path, two), "--backend", "tpu"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "one program per slice" in err and "--backend cpu" in err and "(tpu-v5e:2x2)" in err
    code, stdout, err = run_cli(["run", write(tmp_path, two), "--backend", "all", "--quiet"],
                                capsys)
    assert code == 0, err
    assert stdout.splitlines()[3].split() == ["cpu"]
    assert "one program per slice" in stdout
