"""The sharded train step (models/train.py) computes the same loss and update as an
unsharded one."""

import numpy as np
import pytest

import models
from tests.steps import train_both_ways


# (data 2 x sequence 4, full remat, f32: the first case of test_context.py, which compares
# the update too.)
@pytest.mark.parametrize("par, remat", [({"data": 2, "fsdp": 2, "tensor": 2}, "full"),
                                        ({"fsdp": 8}, "minimal"), ({"data": 8}, "none"),
                                        ({"data": 4, "pipeline": 2}, "full")])
def test_sharded_train_step_matches_unsharded(cpu_devices, par, remat):
    cfg = models.preset("tiny", n_heads=4, n_kv_heads=2)
    (loss1, p1), (loss2, p2) = train_both_ways(cfg, par, seed=1, token_seed=0, seq_len=16,
                                               global_batch=16, microbatches=2, remat=remat,
                                               compute="float32")
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-5)
    np.testing.assert_allclose(np.asarray(p2["embed"]), np.asarray(p1["embed"]), rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize("par", [{"data": 2, "tensor": 4}, {"data": 2, "tensor": 2, "pipeline": 2},
                                 {"tensor": 2, "sequence": 2, "pipeline": 2}])
def test_sequence_parallel_matches_unsharded(cpu_devices, par):
    # Megatron's sequence parallelism (the residual stream split over `tensor`) computes
    # the unsharded loss, with a pipeline and with context parallelism too.
    cfg = models.preset("tiny", n_heads=4, n_kv_heads=4)
    (loss1, _), (loss2, _) = train_both_ways(
        cfg, par, seed=1, token_seed=0, seq_len=32, global_batch=8, microbatches=2,
        remat="full", compute="float32", sequence_parallel=True)
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-5)


@pytest.mark.parametrize("rules", ["default", "maxtext"])
def test_the_embedding_lookup_changes_layout_without_a_full_rematerialization(cpu_devices,
                                                                               rules):
    # The table's width is split over fsdp, the activations' batch over data and fsdp: the
    # lookup's rows, asked for in the activations' layout at once, made XLA's partitioner
    # gather them whole on every device in the backward pass (its "involuntary full
    # rematerialization", which `make run` printed). Pinned first in the table's layout
    # (sharding.rules.constrain_rows), the rows move by an all-to-all over fsdp each way.
    import meshes
    import sharding
    from tests.steps import train_setup

    system = meshes.get_system("h100:8")
    mesh = sharding.make_mesh(system, {"data": 2, "fsdp": 4})
    prog = models.build_train_program(models.preset("tiny"), mesh,
                                      sharding.rules_preset(rules),
                                      **train_setup(seq_len=32, global_batch=16))
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=system)
    assert not [w for w in rep.warnings if "rematerialization" in w], rep.warnings
    embedding = {(c.kind, c.mesh_axes, c.bytes) for c in rep.collectives
                 if "embedding" in (c.op_name or "") and c.dtype == "bfloat16"}
    cfg = models.preset("tiny")
    rows = 16 // 8 * 32 * cfg.d_model * 2  # a device's rows of the lookup, bf16
    # the rows: to the activations' layout and their gradient back, over fsdp; the table's
    # gradient (vocab x d_model/4, bf16) summed over data with its width still split
    assert embedding == {("all-to-all", ("fsdp",), rows),
                         ("all-reduce", ("data",), cfg.vocab * cfg.d_model // 4 * 2)}
