"""The deviceless XLA:GPU compiler (the `gpu` extra: `make test-gpu`).

The target description and the topology are checked everywhere; compiling needs the CUDA
plugin and is marked `gpu` (skipped when the extra is not installed).
"""

import json

import pytest

from meshes import get_system
from sharding import compiler as backends
from tests.helpers import TINY, run_cli, write

needs_plugin = pytest.mark.skipif(not backends.gpu_compiler_installed(),
                                  reason=f"needs the gpu extra: {backends.GPU_EXTRA}")


@pytest.mark.parametrize("system, topology", [
    ("h100:8", "1x1x8"), ("h100:64", "8x1x8"), ("b200:16", "2x1x8"),
    ("gb200-nvl72:72", "1x18x4"), ("gb200-nvl72:288", "4x18x4"), ("gb300-nvl72:72", "1x18x4"),
])
def test_topology_is_nvlink_domains_by_hosts_by_gpus(system, topology):
    assert backends.gpu_topology_name(get_system(system)) == topology


def test_target_config_is_written_from_the_catalog():
    text = backends.gpu_target_config(get_system("h200:8"))
    assert "core_count: 132" in text and "major: 9 minor: 0" in text
    assert f"memory_bandwidth: {int(4.8e12)}" in text
    assert 'device_description_str: "NVIDIA H200"' in text
    assert "major: 10 minor: 0" in backends.gpu_target_config(get_system("gb200-nvl72:72"))


def test_gpu_backend_refuses_tpu_systems_and_missing_extra_in_one_line(tmp_path, capsys,
                                                                        monkeypatch):
    code, _, err = run_cli(["run", write(tmp_path, TINY.replace('"h100:8"', '"tpu-v5e:2x4"')),
                            "--backend", "gpu"], capsys)
    assert code == 2 and "compiles for GPU systems" in err and err.count("\n") == 1
    monkeypatch.setattr(backends, "gpu_compiler_installed", lambda: False)
    code, _, err = run_cli(["run", write(tmp_path, TINY), "--backend", "gpu"], capsys)
    assert code == 2 and "pip install 'shardscope[gpu]'" in err and err.count("\n") == 1
    assert backends.resolve_backend("auto", get_system("h100:8")) == "cpu"


@pytest.mark.gpu
@needs_plugin
def test_gpu_devices_follow_the_system_ids():
    system = get_system("gb200-nvl72:72")
    devices = backends.gpu_devices(system)
    assert [d.id for d in devices] == list(range(72))
    assert backends.resolve_backend("auto", system) == "gpu"


@pytest.mark.gpu
@needs_plugin
def test_run_on_xla_gpu_says_so_agrees_with_cpu_and_keeps_noise_away(tmp_path, capsys,
                                                                    cpu_devices):
    by_kind = {}
    for backend in ("gpu", "cpu"):
        out = tmp_path / f"{backend}.json"
        code, stdout, err = run_cli(["run", write(tmp_path, TINY), "--backend", backend,
                                     "--json", str(out)], capsys)
        assert code == 0, err
        assert err == ""  # CUDA probing and plugin logs are captured
        d = json.loads(out.read_text())
        by_kind[backend] = d["by_kind"]
        if backend == "gpu":
            assert "HLO from XLA:GPU (CUDA plugin, deviceless h100 x 1x1x8)" in stdout
            assert {c["link"] for c in d["collectives"]} == {"nvlink"}
            # The final GPU HLO has async start/done pairs, counted once each.
            assert all(not c["kind"].endswith(("-start", "-done")) for c in d["collectives"])
    # Same partitioner, so the same collectives; XLA:GPU merges a few small gathers.
    assert set(by_kind["gpu"]) == set(by_kind["cpu"])
    for kind, nbytes in by_kind["cpu"].items():
        assert by_kind["gpu"][kind] == pytest.approx(nbytes, rel=0.1), kind


@pytest.mark.gpu
@needs_plugin
def test_gpu_decode_reads_each_weight_and_cache_byte_once(tmp_path, cpu_devices):
    # XLA:GPU copies each layer's weights out of the stacked arrays before its GEMMs (a
    # dynamic-slice fusion); a serving engine's GEMMs read them where they lie, so the
    # copies are not traffic. Before, the 4-layer TP-8 decode below counted 3.07x the bytes
    # it must read (weights but the embedding table, KV cache), then 1.44x while the cache
    # was (N, B, S, K, E) and XLA:GPU transposed the whole K cache for QK^T each step, then
    # 1.25x: XLA:GPU's split-K GEMMs write f32 partial sums that the next kernel adds up,
    # and the attention's scores pass from kernel to kernel. Those stay in the H100's L2
    # when they and what runs in between fit in half of it, and a reduction whose result
    # is only sliced reads only what it keeps: the decode now moves what it must, as on
    # the TPU compiler and XLA:CPU (test_compiler_tpu.py).
    from experiments import config, runner
    from models.memory import serving_activation_bytes
    from tests.helpers import DECODE_70B

    exp = config.load(write(tmp_path, DECODE_70B.replace("tpu-v6e:2x4", "h100:8")))
    rep = runner.run(exp, backend="gpu")
    m = exp.model
    # exact from the shardings (the report's memory is the compiler's figure)
    state = dict(runner.memory_of(exp).components)
    params, cache = state["parameters"], state["KV cache"]
    activations = m.n_layers * serving_activation_bytes(
        m, workload=exp.workload, precision=exp.precision,
        mesh_shape=exp.parallelism.sizes(), rules=exp.parallelism.axis_rules())
    floor = params - m.padded_vocab * m.d_model * 2 / 8 + cache + activations
    assert rep.compute.hbm_bytes == pytest.approx(floor, rel=0.05)
