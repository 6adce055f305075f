"""The strict logical-axis resolver."""

import pytest
from jax.sharding import PartitionSpec as P

from sharding import AxisRules, default_rules, resolve

MESH = {"data": 2, "fsdp": 4, "tensor": 2}


def test_resolves_params_and_activations():
    r = default_rules()
    assert resolve(("embed", "mlp"), (64, 128), r.params, MESH, what="w") == P("fsdp", "tensor")
    assert resolve(("batch", "seq", "embed"), (16, 8, 64), r.activations, MESH, what="x") == \
        P(("data", "fsdp"))
    assert resolve(("layers", "embed", None), (2, 64, 3), r.params, MESH, what="w") == \
        P(None, "fsdp")


def test_size_one_mesh_axes_are_dropped():
    r = default_rules()
    assert resolve(("embed", "mlp"), (64, 128), r.params, {"fsdp": 1, "tensor": 2},
                   what="w") == P(None, "tensor")


def test_unknown_logical_name_is_an_error():
    with pytest.raises(ValueError, match="logical axis 'hidden' has no rule"):
        resolve(("hidden",), (64,), default_rules().params, MESH, what="w")


def test_indivisible_dimension_names_the_array_and_the_fix():
    with pytest.raises(ValueError, match=r"param w: dimension 'kv_heads' of size 3 is not "
                                         r"divisible by tensor=2.*1, 3"):
        resolve(("embed", "kv_heads"), (64, 3), default_rules().params, MESH, what="param w")


def test_mesh_axis_used_twice_is_an_error():
    table = {"embed": ("fsdp",), "mlp": ("fsdp",)}
    with pytest.raises(ValueError, match="mesh axis 'fsdp' would shard both 'embed' and 'mlp'"):
        resolve(("embed", "mlp"), (64, 128), table, MESH, what="w")


def test_rule_tables_are_checked():
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        AxisRules(params={"embed": ("model",)}, activations={})
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
        AxisRules(params={"hidden": ("fsdp",)}, activations={})
