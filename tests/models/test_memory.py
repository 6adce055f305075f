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
    # (8 x the capacity factor) and the shared expert's 2 x 2048 gate/up, a dense one
    # 2 x 18432 (its down projection's output is summed into the layer output and read by
    # nothing: not kept); both keep the layer input (7168), which the layer scan holds.
    # Offloading the names moves their bytes, out and back.
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
    moe = slots * (2 * 2048 + 7168) + 2 * 2048
    dense = 2 * 18432
    layer_input = 7168
    assert saved(1) == pytest.approx(tokens * 2 * (3 * moe + dense + 4 * layer_input),
                                     rel=0.01)
    assert saved(1) - saved(3) == pytest.approx(2 * tokens * 2 * (moe - dense), rel=0.01)

    def offloaded(n_dense):
        cfg = models.preset("deepseek-v3", n_layers=4, n_dense_layers=n_dense)
        return offload_bytes_per_step(
            cfg, workload=models.Workload(seq_len=8192, global_batch=8),
            precision=precision, train=models.Train(remat="custom", offload=("mlpwi", "mlpwo")),
            mesh_shape=mesh, rules=rules)
    assert offloaded(1) - offloaded(3) == pytest.approx(2 * 2 * tokens * 2 * (moe - dense),
                                                        rel=0.01)


# The reviewer's small config, compiled per layer against XLA:CPU's buffer assignment:
# d_model 256, 8 heads of 32, d_ff 512 (SwiGLU), f32, one sequence of 2048 per device.
SMALL = dict(d_model=256, n_heads=8, n_kv_heads=8, head_dim=32, d_ff=512, vocab=512,
             max_seq_len=8192, n_layers=4)
F32 = models.Precision(params="float32", compute="float32")
SAVED_NONE = "saved activations (no remat, 4 layers)"
WORK = "one layer's backward working set"


def _small(remat="none", mesh=None, seq_len=2048, micro_batch=8, **cfg):
    return dict(activation_components(
        models.preset("tiny", **{**SMALL, **cfg}), micro_batch=micro_batch, seq_len=seq_len,
        precision=F32, remat=remat, mesh_shape=mesh or {"data": 8},
        rules=sharding.default_rules(),
        save=("mlpwi", "mlpwo") if remat == "custom" else ()))


def test_dense_attention_keeps_its_scores():
    # Dense attention's backward reads the f32 exponentials and the probabilities (f32 here),
    # B x H x L x S each: 8 x 2048 values a token, 8 bytes each, where flash keeps one f32
    # log-sum-exp a head (dense: two f32 row statistics). XLA:CPU: 308.4 MB a layer against
    # flash's 42.0; the model had 39.9 for both.
    tokens, scores = 2048, 8 * 2048
    flash, dense = _small(), _small(attention="dense")
    assert dense[SAVED_NONE] - flash[SAVED_NONE] == 4 * tokens * (scores * 8 + 8 * 4)
    # its backward makes the probabilities' and the scores' gradients (4 bytes each) and no
    # f32 accumulators (q, k, v: 3 x 256 values, 4 bytes in f32 either way)
    assert dense[WORK] - flash[WORK] == tokens * scores * 2 * 4
    # full remat recomputes the pair: 4 score tensors in the layer's backward (XLA:CPU:
    # 635.0 MB at 4 layers against flash's 122.6 + 4 x 134 MB)
    full_flash, full_dense = _small("full"), _small("full", attention="dense")
    assert full_dense[WORK] - full_flash[WORK] == tokens * (scores * 16 + 8 * 4)


def test_shared_experts_keep_their_activations():
    # 8 experts, 2 a token, and 2 shared experts: one dense MLP of 2 x 512. With nothing
    # recomputed it keeps its gate and up outputs and their product (3 x 1024 values a
    # token, f32); XLA:CPU: 154.5 MB a layer, the model had 125.9 (now 151.1).
    moe = dict(n_experts=8, experts_per_token=2)
    tokens, shared = 2048, 2 * 512
    plain, with_shared = _small(**moe), _small(n_shared_experts=2, **moe)
    assert with_shared[SAVED_NONE] - plain[SAVED_NONE] == 4 * tokens * 3 * shared * 4
    # "custom" saving mlpwi keeps the shared gate/up outputs too (2 x 1024); mlpwo the
    # routed experts' output alone (the shared one is summed into the layer output, read by
    # nothing); the layer scan keeps every layer's input (256 values) whatever is named:
    # XLA:CPU 112.24 MB a layer, the model had 93.4, now 112.24.
    key = "saved activations (custom remat, 4 layers)"
    plain, with_shared = (_small("custom", **moe),
                          _small("custom", n_shared_experts=2, **moe))
    assert with_shared[key] - plain[key] == 4 * tokens * 2 * shared * 4
    r = 8 * 640 / 2048  # expert slots a token: 8 experts x 640 capacity / 2048 tokens
    assert plain[key] == 4 * tokens * (256 + r * (2 * 512 + 256)) * 4


def test_context_parallel_steps_keep_what_they_received():
    # CP4 over 8192 positions, 2048 on a device as without it. Each of the 3 steps after a
    # rank's own keeps the K and V it received (2 x 256 values a local token), and for the
    # 1024 queries of its second block: the selected query half, the two blocks' outputs
    # and the three f32 running outputs of the merges (6 x 256 values a query), the two
    # log-sum-exps and six merge weights (8 x 8 heads a query), all f32 here: 5248 bytes
    # a local token. XLA:CPU: 75.7 MB a layer against 42.0 without (ring and all-gather
    # alike; 2 kv heads: 61.5), the model had 39.9 (now 72.2).
    step = (256 + 256) * 4 + 256 / 2 * 6 * 4 + 8 / 2 * 8 * 4
    base = _small()
    cp4 = _small(mesh={"data": 2, "sequence": 4}, seq_len=8192, micro_batch=2)
    assert cp4[SAVED_NONE] - base[SAVED_NONE] == 4 * 2048 * 3 * step
    # the keys' and values' gradient in flight: one step's (ring) or all 4 ranks' copies
    # before their reduce-scatter (all-gather)
    ring = _small("full", mesh={"data": 2, "sequence": 4}, seq_len=8192, micro_batch=2)
    assert ring[WORK] - _small("full")[WORK] == 2048 * (3 * step + 512 * 4)
    gathered = dict(activation_components(
        models.preset("tiny", **SMALL), micro_batch=2, seq_len=8192, precision=F32,
        remat="full", mesh_shape={"data": 2, "sequence": 4}, rules=sharding.default_rules(),
        context_mode="allgather"))
    assert gathered[WORK] - ring[WORK] == 2048 * 3 * 512 * 4
