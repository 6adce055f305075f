"""Pipeline schedules: bubble, microbatches in flight, uneven stages, and the memory they
hold, derived by hand for small P, M, V."""

import pytest

import meshes
import models
import sharding
from models.memory import activation_components, training_memory
from models.pipeline import Pipeline


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
    assert "126 layers in 128 slots" in Pipeline(stages=8, microbatches=8,
                                                   layers=126).describe()


def test_interleaving_needs_microbatches_and_1f1b():
    with pytest.raises(ValueError, match="workload.microbatches=2 < parallelism.pipeline=4"):
        Pipeline(stages=4, microbatches=2, layers=8, virtual=2)
    with pytest.raises(ValueError, match="pipeline_schedule"):
        Pipeline(stages=2, microbatches=2, layers=8, virtual=2, schedule="gpipe")


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
