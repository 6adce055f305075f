"""Pipeline schedules (models/pipeline.py): bubble, microbatches in flight, uneven stages, the
stage transfers, and a pipelined step equal to the unsharded one."""

import numpy as np
import pytest

import meshes
import models
import sharding
from models.pipeline import Pipeline
from tests.steps import tiny, train_both_ways, train_program

H100 = meshes.get_system("h100:8")
F32 = 4


@pytest.mark.parametrize("layers, virtual, compute, rel", [
    (3, 1, "bfloat16", 2e-3),   # uneven: 3 layers in 4 slots, the first stage lighter
    (4, 2, "bfloat16", 2e-3),   # interleaved: 2 chunks of 1 layer per stage
    (5, 2, "float32", 1e-5),    # interleaved and uneven: 5 layers in 8 slots, exactly
    # the same with FP8 matmuls: their GEMMs write bf16 (Transformer Engine's), so the
    # tensor-parallel partial sums are rounded to bf16 before they are added, where the
    # unsharded step rounds each output once
    (5, 2, "float8", 5e-3),
])
def test_pipeline_matches_unsharded_in_every_precision(cpu_devices, layers, virtual, compute,
                                                       rel):
    # data 2 x pipeline 2 x tensor 2 on XLA:CPU: the formulation compiles for bf16 and FP8
    # (the manual shard_map it replaces aborted), and computes the same loss and update.
    cfg = models.preset("tiny", n_layers=layers)
    (loss1, p1), (loss2, p2) = train_both_ways(
        cfg, {"data": 2, "pipeline": 2, "tensor": 2}, seed=1, token_seed=0, seq_len=16,
        global_batch=16, microbatches=4, remat="full", compute=compute,
        virtual_stages=virtual)
    assert float(loss2) == pytest.approx(float(loss1), rel=rel)
    # AdamW's first step moves each weight by about lr * sign(gradient): the embedding's
    # update agrees except where a gradient near zero changes sign under rounding (a few
    # percent of the weights in FP8 with or without a pipeline; none in f32).
    lr = models.Train().learning_rate
    diff = np.abs(np.asarray(p2["embed"]) - np.asarray(p1["embed"]))
    flipped = 0.0 if compute == "float32" else 0.05
    assert diff.max() <= 2.01 * lr and np.mean(diff > 0.1 * lr) <= flipped


def test_gpt_style_pipeline_with_tied_embeddings_matches_unsharded(cpu_devices):
    # GPT style: learned positions, LayerNorm (scale and bias), the output projection tied
    # to the embedding table. The output stage's copy of the table both embeds and
    # projects; its copies of the positions' table and the final norm's bias are the ones
    # used; the step equals the unsharded one in f32.
    cfg = models.preset("tiny", n_layers=4, mlp="gelu", norm="layernorm",
                        positions="learned", tie_embeddings=True)
    (loss1, p1), (loss2, p2) = train_both_ways(
        cfg, {"data": 2, "pipeline": 2, "tensor": 2}, seed=1, token_seed=0, seq_len=16,
        global_batch=16, microbatches=4, remat="full", compute="float32")
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-5)
    # AdamW moves each weight by about lr * sign(gradient); a gradient near zero may land
    # elsewhere under a different summation order, nothing moves further than that
    lr = models.Train().learning_rate
    for w2, w1 in ((p2["embed"], p1["embed"]), (p2["pos_embed"], p1["pos_embed"]),
                   (p2["final_norm"]["bias"], p1["final_norm"]["bias"])):
        diff = np.abs(np.asarray(w2) - np.asarray(w1))
        assert diff.max() <= 2.01 * lr and np.mean(diff > 0.1 * lr) <= 0.01


def test_pipeline_in_fp4_matches_unsharded(cpu_devices):
    # Block-scaled FP4 matmuls (32-element blocks along each contraction: head_dim 32,
    # 64 positions) inside an interleaved pipeline with tensor parallelism on XLA:CPU.
    cfg = models.preset("tiny", n_layers=4, head_dim=32)
    (loss1, _), (loss2, _) = train_both_ways(
        cfg, {"data": 2, "pipeline": 2, "tensor": 2}, seed=1, token_seed=0, seq_len=64,
        global_batch=16, microbatches=4, remat="full", compute="float4", virtual_stages=2)
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-2)


@pytest.mark.parametrize("p, m, v, ticks", [(4, 8, 1, 11), (4, 8, 2, 19), (2, 4, 3, 13)])
def test_bubble_is_p_minus_1_over_m_v(p, m, v, ticks):
    plan = Pipeline(stages=p, microbatches=m, layers=p * v * 2, virtual=v)
    # Every stage works M V items of c layers, one per tick, and waits P - 1 ticks.
    assert plan.ticks == ticks == m * v + p - 1
    assert plan.bubble == pytest.approx((p - 1) / ticks)
    assert plan.bubble_over_ideal == pytest.approx((p - 1) / (m * v))


def test_microbatches_in_flight_per_schedule():
    # GPipe runs all M forwards before any backward: M microbatches' activations.
    assert Pipeline(stages=4, microbatches=8, layers=8, schedule="gpipe").in_flight == 8
    # 1F1B: the first stage starts its first backward after P forwards, then alternates.
    assert Pipeline(stages=4, microbatches=8, layers=8).in_flight == 4
    assert Pipeline(stages=4, microbatches=2, layers=8).in_flight == 2
    # Interleaved, V = 2: P (1 + (P - 1) / (P V)) = 4 (1 + 3/8) = 5.5 microbatches' worth
    # of a stage's layers (Korthikanti et al. 2022).
    assert Pipeline(stages=4, microbatches=8, layers=8, virtual=2).in_flight == 5.5


def test_uneven_stages_pad_the_first_and_last_stage():
    # Llama 3.1 405B: 126 layers on 8 stages are 16 slots per stage, the first and the last
    # stage one layer lighter (Megatron's embedding and loss stages).
    plan = Pipeline(stages=8, microbatches=8, layers=126)
    assert (plan.chunk, plan.slots, plan.padding) == (16, 128, (1, 1))
    valid = plan.valid_mask()
    per_stage = [sum(sum(c) for c in stage) for stage in valid]
    assert per_stage == [15] + [16] * 6 + [15]
    assert plan.layer_order() == list(range(1, 127))
    # Interleaved: chunk v of stage p is model chunk v P + p.
    plan = Pipeline(stages=2, microbatches=2, layers=4, virtual=2)
    assert plan.layer_order() == [0, 2, 1, 3]
    assert "126 layers in 128 slots, lighter: stage 0 by 1, stage 7 by 1" in Pipeline(
        stages=8, microbatches=8, layers=126).describe()
    # Interleaved, 80 layers on 8 x 3 chunks of 4: the 16 empty slots are the first chunks
    # of stages 0 and 1 and the last of stages 6 and 7, not 8 on the first stage.
    plan = Pipeline(stages=8, microbatches=16, layers=80, virtual=3)
    assert [sum(sum(c) for c in stage) for stage in plan.valid_mask()] == \
        [8, 8, 12, 12, 12, 12, 8, 8]
    assert plan.describe().endswith(
        "80 layers in 96 slots, lighter: stage 0 by 4, stage 1 by 4, stage 6 by 4, stage 7 by 4")


def test_the_last_stage_s_padding_absorbs_the_output_layer_first():
    # Megatron runs the output layer and loss on the last stage. With no padded slot there
    # they add in full; Llama 3.1 405B's padded layer (3.2B parameters and its attention)
    # outweighs its 2.1B-parameter output layer; a small layer absorbs only its share.
    from models.pipeline import output_layer_share

    llama = models.preset("llama3-405b")
    assert output_layer_share(llama, Pipeline(stages=8, microbatches=8, layers=128), 8192) \
        == 1.0
    assert output_layer_share(llama, Pipeline(stages=8, microbatches=8, layers=126), 8192) \
        == 0.0
    cfg = tiny(n_layers=6, vocab=8192)  # 8 slots on 4 stages, the first and last padded
    plan = Pipeline(stages=4, microbatches=4, layers=6)
    assert plan.padding == (1, 1)
    layer = 6 * (cfg.active_param_count() - cfg.d_model * cfg.padded_vocab) / 6 \
        + 12 * cfg.n_heads * cfg.attention_head_dim * 64 / 2
    output = 6 * cfg.d_model * cfg.padded_vocab
    assert 0 < layer < output
    assert output_layer_share(cfg, plan, 64) == pytest.approx(1 - layer / output)


def test_interleaving_needs_microbatches_and_1f1b():
    with pytest.raises(ValueError, match="workload.microbatches=2 < parallelism.pipeline=4"):
        Pipeline(stages=4, microbatches=2, layers=8, virtual=2)
    with pytest.raises(ValueError, match="pipeline_schedule"):
        Pipeline(stages=2, microbatches=2, layers=8, virtual=2, schedule="gpipe")


def test_pipeline_stages_pass_microbatch_activations_to_their_neighbours(cpu_devices):
    cfg = tiny(n_layers=4)
    mesh = sharding.make_mesh(H100, {"data": 2, "pipeline": 4})
    prog = train_program(cfg, mesh, seq_len=16, global_batch=16, microbatches=4,
                         compute="float32")
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    permutes = [c for c in rep.collectives if c.kind == "collective-permute"]
    assert permutes and all(c.mesh_axes == ("pipeline",) for c in permutes)
    # Each tick moves every stage's microbatch (16 / 4 sequences over data 2, x seq 16 x
    # d_model 64, f32) one stage on: M + S - 1 = 7 ticks forward, and back in the backward.
    per_transfer = (16 // 4 // 2) * 16 * cfg.d_model * F32
    assert {c.bytes for c in permutes} == {per_transfer}
    assert sum(c.count for c in permutes) == 2 * (4 + 4 - 1)
    # Mesh axes run (pipeline, data): a partition id's stage is id // 2; a transfer goes to
    # the next stage (the last stage's to the first) within one data replica.
    for c in permutes:
        assert all((b // 2 - a // 2) % 4 in (1, 3) and a % 2 == b % 2 for a, b in c.groups)
    # Nothing else crosses the stages but the loss (one f32), as in Megatron: stage 0
    # embeds from its own copy of the table, and the output layer and loss run there, with
    # its own copies of the final norm and output weight, where the last stage's roll
    # hands the output; no gradient of the embedding, of the pipeline's input or of the
    # output weight is summed over the stages (the program used to run all-reduces of the
    # input's gradient (4 microbatches) and of the output weight's, and an all-to-all of
    # the output each way).
    over_stages = [c for c in rep.collectives if "pipeline" in c.mesh_axes
                   and c.kind != "collective-permute"]
    assert [(c.kind, c.bytes * c.count) for c in over_stages] == [("all-reduce", F32)]
    # The embedding's and the output weight's gradients are summed over the data-parallel
    # replicas only, each stage's copy on its own (vocab 256 x d_model 64, f32), as
    # Megatron's DDP sums them over its data-parallel group.
    table = cfg.vocab * cfg.d_model * F32
    assert sorted(c.bytes for c in rep.collectives if c.mesh_axes == ("data",)
                  and c.bytes == table) == [table, table]
    # The output layer runs for all 4 microbatches of a replica's 8 sequences on the one
    # stage (every stage computes its copy: SPMD), as Megatron's last stage does: the
    # projection's forward 2 x 8 x 16 positions x d_model x vocab, its backward twice that.
    head = 2 * (16 // 2) * 16 * cfg.d_model * cfg.vocab
    assert rep.compute.ops[("lm_head (forward)", "matmul")]["flops"] == head
    assert rep.compute.ops[("lm_head (backward)", "matmul")]["flops"] == 2 * head
    # The bubble is in the program: each stage runs its one layer on all 7 ticks: down_proj's
    # forward matmul (2 b L F D) 7 times, its two backward matmuls 7 times each (remat does
    # not recompute it: no backward needs its output).
    down = 2 * (16 // 4 // 2) * 16 * cfg.d_ff * cfg.d_model
    ops = rep.compute.ops
    assert ops[("mlp/down_proj (forward)", "matmul")]["flops"] == 7 * down
    assert ops[("mlp/down_proj (backward)", "matmul")]["flops"] == 2 * 7 * down


def test_sequence_parallel_splits_the_stage_transfers_over_tensor(cpu_devices):
    # With Megatron's sequence parallelism a stage passes on 1/TP of the activations: a
    # microbatch of 16 / 4 sequences x 16 positions x d_model 64 f32, split over tensor 2.
    cfg = tiny(n_layers=4)
    mesh = sharding.make_mesh(H100, {"pipeline": 4, "tensor": 2})
    rules = sharding.default_rules().with_sequence_parallel()
    prog = models.build_train_program(
        cfg, mesh, rules, workload=models.Workload(seq_len=16, global_batch=16, microbatches=4),
        precision=models.Precision(params="float32", compute="float32"), train=models.Train())
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    ticks = [c for c in rep.collectives if c.kind == "collective-permute"
             and c.mesh_axes == ("pipeline",)]
    assert {c.bytes for c in ticks} == {(16 // 4) * 16 * cfg.d_model * F32 // 2}
    assert sum(c.count for c in ticks) == 2 * (4 + 4 - 1)
    # the tensor-parallel regions start with an all-gather and end with a reduce-scatter
    kinds = {c.kind for c in rep.collectives if c.mesh_axes == ("tensor",)}
    assert {"all-gather", "reduce-scatter"} <= kinds


def test_an_interleaved_pipeline_short_of_microbatches_says_how_many():
    # the Python API's own check (a config gets experiments/config.py's, with the choices)
    with pytest.raises(ValueError, match="raise workload.microbatches to at least 4, a "
                                         "number that divides workload.global_batch"):
        Pipeline(stages=4, microbatches=2, layers=8, virtual=2)


def test_virtual_stages_megatron_refuses_are_said():
    # Megatron-LM's chunks split each stage's layers evenly (get_num_layers_to_build:
    # num_layers_per_pipeline_rank % vp_size == 0), the embedding and the loss counted as
    # a layer each with its account_for_*_in_pipeline_split flags.
    # Llama 3.1 405B: 126 + 2 = 128 layers, 16 a stage, 8 chunks of 2: it runs.
    assert Pipeline(stages=8, microbatches=8, layers=126, virtual=8).notes() == ()
    # Llama 2 70B: 20 layers a stage in 20 chunks of 1.
    assert Pipeline(stages=4, microbatches=8, layers=80, virtual=20).notes() == ()
    # DeepSeek-V3's 61 layers on 4 x 4 chunks: 61, 62, 63 do not split into 4 stages of
    # 4 chunks; shardscope's 64 slots leave 2 empty before the first layer and 1 after
    # the last, on the first and last stage, as Megatron's pipeline layout can lay them:
    # the busiest stages run 16 layers either way (noted, not refused).
    plan = Pipeline(stages=4, microbatches=8, layers=61, virtual=4)
    assert plan.padded_work == 1
    (note,) = plan.notes()
    assert note.startswith("Megatron-LM refuses --num-virtual-stages-per-pipeline-rank 4 "
                           "here: 61 layers on 4 stages do not split into 4 equal chunks")
    assert "shardscope pads 3 empty slots (2 before the first layer, 1 after the last)" \
        in note
    # 20 layers a stage in 3 chunks: chunks of 7 give every stage 21 slots (refused by
    # the config's check); the choices that split 20 evenly.
    plan = Pipeline(stages=4, microbatches=8, layers=80, virtual=3)
    assert plan.padded_work == pytest.approx(21 / 20)
    assert plan.virtual_choices() == [2, 4, 5, 10, 20]
