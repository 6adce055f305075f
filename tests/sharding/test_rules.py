"""The strict logical-axis resolver."""

import flax.linen as nn
import pytest
from jax.sharding import PartitionSpec as P

from sharding import AxisRules, default_rules, resolve
from sharding.rules import maxtext_rules

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


# Every axis that splits a weight in one of the rule sets, of size > 1.
WIDE = {"fsdp": 2, "sequence": 2, "expert": 2, "tensor": 2}


def test_default_rules_keep_weights_whole_over_sequence_and_expert():
    # Megatron's layout: a weight is split over FSDP (and tensor) only; the context- and
    # expert-parallel ranks of a dense weight hold it whole (the distributed optimizer
    # splits its state over them instead: models/optimizer.py).
    r = default_rules()
    assert resolve(("embed", "mlp"), (64, 128), r.params, WIDE, what="w") == P("fsdp", "tensor")
    assert resolve(("experts", "embed", "mlp"), (4, 64, 128), r.params, WIDE, what="w") == \
        P("expert", "fsdp", "tensor")


def test_maxtext_splits_weights_over_every_batch_and_sequence_rank():
    r = maxtext_rules()

    def spec(names, shape):
        return resolve(names, shape, r.params, WIDE, what="w", yields=r.params_yield)

    width = ("fsdp", "sequence", "expert")
    assert spec(("embed", "mlp"), (64, 128)) == P(width, "tensor")
    assert spec(("heads", "head_dim", "embed"), (4, 16, 64)) == P("tensor", None, width)
    assert spec(("vocab", "embed"), (256, 64)) == P("tensor", width)
    assert spec(("embed",), (64,)) == P(width)
    # an expert's weight: `expert` splits the experts, so the width yields it
    assert spec(("experts", "embed", "mlp"), (4, 64, 128)) == \
        P("expert", ("fsdp", "sequence"), "tensor")
    assert spec(("experts", "mlp", "embed"), (4, 128, 64)) == \
        P("expert", "tensor", ("fsdp", "sequence"))


# MaxText's rules for the weights shardscope's models have, in their order (flax resolves
# by it): AI-Hypercomputer/maxtext src/maxtext/configs/base.yml at commit
# e591f30cbbf217ed67ef71263ec0538239f9c3b8, `logical_axis_rules`.
MAXTEXT_RULES = [
    ("vocab", ("tensor", "tensor_sequence", "autoregressive")),
    ("embed_vocab", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")),
    ("heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("q_heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("kv_heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("kv", ()),
    ("exp", "expert"),
    ("mlp_moe", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("embed_moe", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses")),
    ("embed_moe", ("fsdp", "context", "context_usp_ulysses")),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("embed", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")),
    ("embed", ("fsdp", "context", "context_usp_ulysses", "expert")),
]
# MaxText's mesh axes that shardscope has (`context` is `sequence`); its others are size 1
# in any config shardscope takes (experiments/importer.py refuses them).
MAXTEXT_AXES = {"fsdp": "fsdp", "context": "sequence", "expert": "expert", "tensor": "tensor"}


@pytest.mark.parametrize("ours, theirs, shape", [
    (("embed", "mlp"), ("embed", "mlp"), (64, 128)),
    (("mlp", "embed"), ("mlp", "embed"), (128, 64)),
    (("embed", "heads", "head_dim"), ("embed", "q_heads", "kv"), (64, 4, 16)),
    (("embed", "kv_heads", "head_dim"), ("embed", "kv_heads", "kv"), (64, 2, 16)),
    (("heads", "head_dim", "embed"), ("heads", "kv", "embed"), (4, 16, 64)),
    (("vocab", "embed"), ("vocab", "embed_vocab"), (256, 64)),
    (("embed", "vocab"), ("embed_vocab", "vocab"), (64, 256)),
    (("embed", None), ("embed", None), (64, 4)),  # a MoE router
    (("experts", "embed", "mlp"), ("exp", "embed_moe", "mlp_moe"), (4, 64, 128)),
    (("experts", "mlp", "embed"), ("exp", "mlp_moe", "embed_moe"), (4, 128, 64)),
])
def test_maxtext_rules_split_each_weight_as_maxtext_does(ours, theirs, shape):
    # flax's resolver (MaxText's) on MaxText's own rule list, its mesh axes renamed to
    # shardscope's and those shardscope lacks taken out, gives the same PartitionSpec.
    def ours_only(entry):
        axes = (entry,) if isinstance(entry, str) else entry or ()
        kept = tuple(MAXTEXT_AXES[a] for a in axes if a in MAXTEXT_AXES)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    flax_spec = nn.logical_to_mesh_axes(theirs, rules=MAXTEXT_RULES)
    expected = [ours_only(e) for e in flax_spec]
    while expected and expected[-1] is None:
        expected.pop()
    r = maxtext_rules()
    assert resolve(ours, shape, r.params, WIDE, what="w", yields=r.params_yield) == \
        P(*expected)


def test_a_yielding_axis_takes_what_the_others_leave_and_nothing_else_changes():
    table = {"embed": ("fsdp", "tensor"), "mlp": ("fsdp",), "heads": ("fsdp",)}
    # whatever the order of the dimensions, `mlp` keeps its rule and `embed` the rest
    assert resolve(("embed", "mlp"), (64, 128), table, MESH, what="w", yields=("embed",)) == \
        P("tensor", "fsdp")
    assert resolve(("mlp", "embed"), (128, 64), table, MESH, what="w", yields=("embed",)) == \
        P("fsdp", "tensor")
    # two dimensions that do not yield still may not share a mesh axis
    with pytest.raises(ValueError, match="mesh axis 'fsdp' would shard both 'mlp' and 'heads'"):
        resolve(("mlp", "heads"), (128, 4), table, MESH, what="w", yields=("embed",))
    # what it keeps must still divide its dimension
    with pytest.raises(ValueError, match="dimension 'embed' of size 3 is not divisible by "
                                         "tensor=2"):
        resolve(("embed", "mlp"), (3, 128), table, MESH, what="w", yields=("embed",))


def test_a_yielding_axis_needs_a_parameter_rule():
    with pytest.raises(ValueError, match=r"rules.params_yield: 'embed' has no rule in the "
                                         r"params table; known: mlp"):
        AxisRules(params={"mlp": ("tensor",)}, activations={}, params_yield=("embed",))
