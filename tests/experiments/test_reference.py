"""The config reference comes from the code: a description on every field."""

import dataclasses

import pytest

from experiments import cli, reference
from experiments.config import Parallelism
from sharding.rules import MESH_AXES


def test_parallelism_has_a_field_per_mesh_axis_in_order():
    fields = [f.name for f in dataclasses.fields(Parallelism)]
    assert fields[:len(MESH_AXES)] == list(MESH_AXES)
    assert Parallelism(tensor=4, data=2).sizes() == {**dict.fromkeys(MESH_AXES, 1),
                                                     "tensor": 4, "data": 2}


def test_every_key_has_a_description_and_keys_prints_them(capsys):
    assert reference.missing_descriptions() == []
    assert cli.main(["keys", "train"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[train]") and "train.shard_optimizer_over_data" in out
    assert "train.num_vocab_tiling" in out and "(default 1)" in out


def test_keys_markdown_of_one_table_is_that_table(capsys):
    # `keys parallelism --markdown` printed every table: the table named was ignored
    assert cli.main(["keys", "parallelism", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## `[parallelism]`") and out.count("## `[") == 1
    assert "`parallelism.tensor`" in out and "`model.preset`" not in out


def test_keys_name_the_choices_of_the_named_presets():
    # parallelism.rules and system.fabric pointed at a Python dict for their values
    from meshes.catalog import FABRICS
    from sharding.rules import RULE_PRESETS

    text = reference.text()
    rules = next(ln for ln in text.splitlines() if "parallelism.rules" in ln)
    fabric = next(ln for ln in text.splitlines() if "system.fabric" in ln)
    assert all(f'"{name}"' in rules for name in RULE_PRESETS)
    assert all(f'"{name}"' in fabric for name in FABRICS)


def test_an_unknown_table_is_one_line(capsys):
    assert cli.main(["keys", "modle"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model, system, parallelism" in err


@pytest.mark.parametrize("table", list(reference.TABLES))
def test_each_table_renders_as_markdown(table):
    rows = reference.entries(table)
    assert rows and all(key.startswith(f"{table}.") for key, _, _ in rows)
    assert f"## `[{table}]`" in reference.markdown()
