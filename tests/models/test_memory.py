"""The memory model (models/memory.py): activations, pipeline stages and host offload,
derived by hand."""

import pytest

import meshes
import models
import sharding
from models.memory import activation_components, training_memory


def test_activation_memory_by_hand():
    from models.memory import activation_components

    cfg = models.preset("llama3-8b")
    # 36 sequences per micro-batch over data 9 x fsdp 1: 4 sequences of 8192 per device.
    parts = dict(activation_components(cfg, micro_batch=36, seq_len=8192,
                                       precision=models.Precision(), remat="full",
                                       mesh_shape={"data": 9, "fsdp": 1, "tensor": 1},
                                       rules=sharding.default_rules()))
    tokens = 4 * 8192
    assert parts["saved activations (full remat, 32 layers)"] == 32 * tokens * 4096 * 2
    # The fused cross-entropy keeps the bf16 logits and their bf16 gradient (its f32 upcast
    # fuses into the reductions): 2 + 2 bytes per logit.
    assert parts["logits and their gradient"] == 2 * tokens * 128256 * 2
    # The TPU compiler fuses the recomputed MLP activation (B x L x d_ff) into the down
    # projection's operand: the layer's backward holds it nowhere.
    fused = dict(activation_components(cfg, micro_batch=36, seq_len=8192,
                                       precision=models.Precision(), remat="full",
                                       mesh_shape={"data": 9, "fsdp": 1, "tensor": 1},
                                       rules=sharding.default_rules(), fuses_matmul_inputs=True))
    key = "one layer's backward working set"
    assert parts[key] - fused[key] == tokens * 14336 * 2
    minimal = dict(activation_components(cfg, micro_batch=36, seq_len=8192,
                                         precision=models.Precision(), remat="minimal",
                                         mesh_shape={"data": 9}, rules=sharding.default_rules()))
    assert minimal["saved activations (minimal remat, 32 layers)"] > \
        4 * parts["saved activations (full remat, 32 layers)"]


def test_low_precision_steps_keep_their_matmul_inputs_quantised():
    # With nothing recomputed a layer keeps the inputs of its matmuls for their weight
    # gradients: the two norms' outputs (d each) and the MLP activation (d_ff), bf16 in a
    # bf16 step, quantised in FP8 (1 byte) and FP4 (half a byte and a 1-byte scale per 32),
    # as Transformer Engine saves them; the attention output (H x head_dim) then once
    # more, quantised, beside the bf16 copy attention's own backward reads.
    cfg = models.preset("llama3-8b")
    key = "saved activations (no remat, 32 layers)"

    def saved(compute):
        return dict(activation_components(
            cfg, micro_batch=1, seq_len=8192, remat="none", mesh_shape={},
            precision=models.Precision(params="bfloat16", compute=compute),
            rules=sharding.default_rules()))[key]

    inputs = 32 * 8192 * (2 * 4096 + 14336)  # per layer and token: norms' outputs, MLP act
    attention_out = 32 * 8192 * 4096
    bf16 = saved("bfloat16")
    assert bf16 - saved("float8") == pytest.approx(inputs * (2 - 1) - attention_out * 1)
    assert bf16 - saved("float4") == pytest.approx(inputs * (2 - 0.5 - 1 / 32)
                                                   - attention_out * (0.5 + 1 / 32))


def test_tensor_parallelism_shards_head_and_mlp_activations_only():
    from models.memory import activation_components

    cfg = models.preset("llama3-8b")
    kw = dict(micro_batch=8, seq_len=4096, precision=models.Precision(), remat="full",
              rules=sharding.default_rules())
    one = dict(activation_components(cfg, mesh_shape={"tensor": 1}, **kw))
    eight = dict(activation_components(cfg, mesh_shape={"tensor": 8}, **kw))
    key = "saved activations (full remat, 32 layers)"
    assert one[key] == eight[key]  # the residual stream is not sharded over tensor
    logits = "logits and their gradient"
    assert eight[logits] == one[logits] / 8


OFFLOAD_NAMES = ["decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj"]


def test_host_offload_moves_the_named_tensors_to_host_memory(tmp_path, capsys, cpu_devices):
    import json

    from tests.helpers import TINY, run_cli, write

    def run(train_toml):
        path = write(tmp_path, TINY + "[train]\n" + train_toml)
        out_json = tmp_path / "r.json"
        code, out, err = run_cli(["run", path, "--json", str(out_json)], capsys)
        assert code == 0, err
        return out, json.loads(out_json.read_text())

    names = json.dumps(OFFLOAD_NAMES)
    _, saved = run(f'remat = "custom"\nsave = {names}\n')
    out, offloaded = run(f'remat = "custom"\noffload = {names}\n')
    _, full = run('remat = "full"\n')
    # tiny: d_model 64, 4 heads / 2 kv heads of 16, 2 layers; 16 sequences of 32 over
    # data 2 x fsdp 4 = 2 sequences, 64 tokens per device; bf16 activations. Per token the
    # named tensors are 64 + 64 + 32 + 32 + 64 values = 256 x 2 bytes.
    named = 2 * 256 * 64 * 2  # bytes per token x tokens x layers
    key = "saved activations (custom remat, 2 layers)"
    assert saved["memory"]["components"][key] == named
    assert offloaded["memory"]["components"][key] == 0
    # A layer's backward pass brings its offloaded tensors back into HBM: one of the two
    # layers' share is there at the peak, in the backward working set.
    work = "one layer's backward working set"
    assert offloaded["memory"]["components"][work] - saved["memory"]["components"][work] \
        == named / 2
    assert saved["memory_per_device_bytes"] - offloaded["memory_per_device_bytes"] == named / 2
    # Out in the forward pass, back in the backward pass, on the H100's PCIe Gen5 link.
    assert offloaded["host_transfer_bytes"] == 2 * named and saved["host_transfer_bytes"] == 0
    assert offloaded["host_transfer_s"] == pytest.approx(2 * named / 64e9)
    assert "host offload" in out
    # Saved or offloaded, the named tensors are not recomputed: the same matmul FLOPs, fewer
    # than full remat's.
    flops = "matmul_flops_per_device"
    assert offloaded[flops] == saved[flops] < full[flops]


@pytest.mark.parametrize("schedule, virtual, in_flight", [("gpipe", 1, 8), ("1f1b", 1, 4),
                                                          ("1f1b", 2, 5.5)])
def test_stage_memory_holds_its_slots_for_the_microbatches_in_flight(cpu_devices, schedule,
                                                                      virtual, in_flight):
    cfg = models.preset("tiny", n_layers=7)
    mesh = sharding.make_mesh(meshes.get_system("h100:8"),
                              {"data": 2, "pipeline": 4})
    rules = sharding.default_rules()
    kw = dict(workload=models.Workload(seq_len=16, global_batch=16, microbatches=8),
              precision=models.Precision(), train=models.Train(remat="full"))
    prog = models.build_train_program(cfg, mesh, rules, virtual_stages=virtual,
                                      pipeline_schedule=schedule, **kw)
    mem = dict(training_memory(cfg, prog, mesh_shape=dict(mesh.shape), rules=rules,
                               **kw).components)
    # 7 layers in 8 slots on 4 stages, 2 per stage (1 per chunk with V = 2); one
    # microbatch is 16 / 8 sequences over data 2 per device.
    one = dict(activation_components(cfg, micro_batch=2, seq_len=16,
                                     precision=models.Precision(), remat="full",
                                     mesh_shape=dict(mesh.shape), rules=rules, layers=2))
    saved = one["saved activations (full remat, 2 layers)"]
    key = f"saved activations (full remat, 2 layers, {in_flight:g} microbatches in flight)"
    assert mem[key] == pytest.approx(in_flight * saved)


def test_sequence_parallel_divides_the_residual_stream_by_tp():
    # Full remat keeps each layer's input: d_model x 2 bytes per token, and with sequence
    # parallelism 1/TP of it on each tensor-parallel rank (Korthikanti et al. 2022).
    cfg = models.preset("llama3-8b")
    kw = dict(micro_batch=8, seq_len=4096, precision=models.Precision(), remat="full",
              mesh_shape={"tensor": 4})
    key = "saved activations (full remat, 32 layers)"
    plain = dict(activation_components(cfg, rules=sharding.default_rules(), **kw))[key]
    sp = dict(activation_components(
        cfg, rules=sharding.default_rules().with_sequence_parallel(), **kw))[key]
    assert plain == 32 * 8 * 4096 * 4096 * 2
    assert sp == plain / 4


def test_a_moe_models_dense_first_layers_keep_a_dense_layers_tensors():
    # DeepSeek-V3's first layers have a dense MLP (dense_d_ff 18432) where the others have
    # 256 experts, 8 a token, of d_ff 2048 and a shared expert: without a pipeline (whose
    # program runs them as MoE layers) each dense layer keeps a dense layer's MLP
    # tensors. Saving the MLP's input and output matmuls ("custom"): a MoE layer keeps
    # 2 x 2048 gate/up and 7168 down-projection values for each of a token's expert rows
    # (8 x the capacity factor), a dense one 2 x 18432 and 7168. Offloading them moves
    # those bytes, out and back.
    from models.memory import offload_bytes_per_step

    rules, mesh = sharding.default_rules(), {"data": 8}
    precision = models.Precision(params="bfloat16")
    tokens = 8192

    def saved(n_dense):
        cfg = models.preset("deepseek-v3", n_layers=4, n_dense_layers=n_dense)
        return dict(activation_components(
            cfg, micro_batch=8, seq_len=8192, remat="custom", save=("mlpwi", "mlpwo"),
            mesh_shape=mesh, precision=precision, rules=rules,
            dense_layers=n_dense))["saved activations (custom remat, 4 layers)"]

    slots = 8 * models.preset("deepseek-v3").capacity_factor  # expert rows a token
    moe = slots * (2 * 2048 + 7168)
    dense = 2 * 18432 + 7168
    assert saved(1) == pytest.approx(tokens * 2 * (3 * moe + dense), rel=0.01)
    assert saved(1) - saved(3) == pytest.approx(2 * tokens * 2 * (moe - dense), rel=0.01)

    def offloaded(n_dense):
        cfg = models.preset("deepseek-v3", n_layers=4, n_dense_layers=n_dense)
        return offload_bytes_per_step(
            cfg, workload=models.Workload(seq_len=8192, global_batch=8),
            precision=precision, train=models.Train(remat="custom", offload=("mlpwi", "mlpwo")),
            mesh_shape=mesh, rules=rules)
    assert offloaded(1) - offloaded(3) == pytest.approx(2 * 2 * tokens * 2 * (moe - dense),
                                                        rel=0.01)
