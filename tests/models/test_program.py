"""The training recipe (models/program.py): custom remat names are checked."""

import pytest

import models


@pytest.mark.parametrize("train, message", [
    (dict(remat="custom"), "needs train.save or train.offload"),
    (dict(remat="full", offload=["query_proj"]), 'apply to train.remat = "custom"'),
    (dict(remat="custom", offload=["q_proj"]), "train.offload entry='q_proj' is not one of"),
    (dict(remat="custom", save=["qkv_proj"], offload=["key_proj"]), "key_proj cannot be both"),
])
def test_custom_remat_names_are_checked(train, message):
    with pytest.raises(ValueError, match=message):
        models.Train(**train)
