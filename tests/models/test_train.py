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
