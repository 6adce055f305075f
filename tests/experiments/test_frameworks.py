"""`shardscope export` / `import maxtext` (experiments/frameworks.py, importer.py): config
transformations only, nothing compiled."""

import dataclasses

import pytest

from experiments import config
from tests.helpers import run_cli

ROUND_TRIPS = [
    # the bundled TPU recipe: FSDP 8 on one v6e slice, custom remat offloading 5 tensors
    "tpu-recipes-v6e-8-llama3-8b",
    # FSDP 8 across the H100 nodes x TP 8 inside each, 8 microbatches
    "llama3-70b-h100-64-fsdp-tp",
    # 4 v5e-256 slices: data 4 over DCN, FSDP 256 over ICI; a shape, not a preset
    "experiments/validation/maxtext-16b-v5e-4x256-dp4-fsdp256.toml",
    # expert parallelism on one v6e-256 slice
    "mixtral-8x7b-v6e-256-ep",
]


def _export(capsys, *args) -> str:
    code, out, err = run_cli(["export", *args], capsys)
    assert code == 0, err
    return out


def _lines(text: str) -> dict[str, str]:
    return dict(ln.split(": ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_maxtext_export_then_import_gives_the_experiment_back(name, tmp_path, capsys):
    yml, back = tmp_path / "x.yml", tmp_path / "back.toml"
    code, _, err = run_cli(["export", name, "--to", "maxtext", "--out", str(yml)], capsys)
    assert code == 0, err
    # no --system: the export names it in a comment line the import reads
    code, _, err = run_cli(["import", "maxtext", str(yml), "--out", str(back)], capsys)
    assert code == 0, err
    a, b = config.load(name), config.load(back)
    assert b.system.name == a.system.name
    assert b.parallelism.sizes() == a.parallelism.sizes()
    assert b.parallelism.outer == a.parallelism.outer
    assert b.workload == a.workload  # seq_len, global batch, microbatches
    assert b.train == a.train  # remat, save / offload names, vocab tiling, optimizer
    assert b.model == a.model
    assert (b.precision.params, b.precision.compute) == (a.precision.params,
                                                         a.precision.compute)


def test_fused_projections_go_out_and_back_under_maxtexts_names(tmp_path, capsys):
    # Megatron's fused QKV and gate/up are MaxText's fused_qkv and fused_mlp
    name = "experiments/validation/llama3-8b-gb300-8-dp8.toml"
    yml, back = tmp_path / "x.yml", tmp_path / "back.toml"
    code, _, err = run_cli(["export", name, "--to", "maxtext", "--out", str(yml)], capsys)
    assert code == 0, err
    keys = _lines(yml.read_text())
    assert (keys["model_name"], keys["fused_qkv"], keys["fused_mlp"]) == ("llama3-8b", "true",
                                                                        "true")
    code, _, err = run_cli(["import", "maxtext", str(yml), "--out", str(back)], capsys)
    assert code == 0, err
    assert config.load(back).model == config.load(name).model


def test_maxtext_export_splits_ici_and_dcn(capsys):
    keys = _lines(_export(capsys, "experiments/validation/maxtext-16b-v5e-4x256-dp4-fsdp256"
                          ".toml", "--to", "maxtext"))
    # 4 slices of 256: data 4 whole over DCN, FSDP 256 inside each slice
    assert (keys["dcn_data_parallelism"], keys["ici_fsdp_parallelism"]) == ("4", "256")
    assert (keys["ici_data_parallelism"], keys["dcn_fsdp_parallelism"]) == ("1", "1")
    # 6144 sequences over 1024 chips, one microbatch
    assert keys["per_device_batch_size"] == "6"
    keys = _lines(_export(capsys, "llama3-70b-h100-64-fsdp-tp", "--to", "maxtext"))
    # 8 HGX nodes: tensor 8 (innermost) fills each node, FSDP 8 crosses them
    assert (keys["ici_tensor_parallelism"], keys["dcn_fsdp_parallelism"]) == ("8", "8")
    # 256 sequences / 8 accumulation steps / 64 GPUs
    assert keys["per_device_batch_size"] == "0.5"
    assert keys["gradient_accumulation_steps"] == "8"
    assert keys["remat_policy"] == "full"
    # With fused q, k, v MaxText checkpoints the fused projection, as qkv_proj.
    keys = _lines(_export(capsys, "llama3-70b-h100-64-tp4-pp8-interleaved", "--to", "maxtext"))
    assert keys["remat_policy"] == "custom" and keys["qkv_proj"] == "device"
    assert not {"query_proj", "key_proj", "value_proj"} & set(keys)


def test_dcn_moves_to_the_outer_axis(tmp_path, capsys):
    # FSDP outermost: the 4 slices split FSDP; data stays in each slice
    name = "experiments/validation/maxtext-16b-v5e-4x256-dp4-fsdp256.toml"
    keys = _lines(_export(capsys, name, "--to", "maxtext", "--set", "parallelism.outer=fsdp"))
    assert (keys["dcn_fsdp_parallelism"], keys["ici_fsdp_parallelism"]) == ("4", "64")
    assert (keys["ici_data_parallelism"], keys["dcn_data_parallelism"]) == ("4", "1")
    yml = tmp_path / "x.yml"
    yml.write_text("\n".join(f"{k}: {v}" for k, v in keys.items()))
    code, _, err = run_cli(["import", "maxtext", str(yml), "--system", "tpu-v5e:16x16*4",
                            "--out", str(tmp_path / "b.toml")], capsys)
    assert code == 0, err
    assert config.load(tmp_path / "b.toml").parallelism.outer == "fsdp"


def test_megatron_export_of_an_interleaved_pipeline(capsys):
    out = _export(capsys, "llama3-70b-h100-64-tp4-pp8-interleaved", "--to", "megatron")
    flags = [ln for ln in out.splitlines() if ln.startswith("--")]
    for flag in (
        "--tensor-model-parallel-size 4",
        "--pipeline-model-parallel-size 8",
        # 80 layers / (8 stages x 5 virtual stages)
        "--num-layers-per-virtual-pipeline-stage 2",
        # 128 sequences / 64 microbatches / data-parallel 2 (= 64 GPUs / (4 x 8))
        "--micro-batch-size 1",
        "--global-batch-size 128",
        "--seq-length 8192",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--bf16", "--fp8-format hybrid", "--grad-reduce-in-bf16",
        "--num-layers 80", "--hidden-size 8192", "--ffn-hidden-size 28672",
        "--num-attention-heads 64", "--group-query-attention", "--num-query-groups 8",
        "--kv-channels 128", "--swiglu",
    ):
        assert flag in flags, flag
    assert not any(f.startswith("--recompute") for f in flags)  # remat none
    assert not any(f.startswith("--context-parallel-size") for f in flags)
    assert "--tp-comm-overlap" not in flags
    # The config overlaps its data-parallel communication as Megatron's recipes do, and
    # its stage transfers as Megatron does by default.
    assert {"--overlap-grad-reduce", "--overlap-param-gather"} <= set(flags)
    assert "--no-overlap-p2p-communication" not in flags
    out = _export(capsys, "llama3-70b-h100-64-tp4-pp8-interleaved", "--to", "megatron",
                  "--set", "parallelism.tp_comm_overlap=true",
                  "--set", "train.overlap_grad_reduce=false",
                  "--set", "train.overlap_param_gather=false",
                  "--set", "parallelism.overlap_p2p_comm=false")
    lines = set(out.splitlines())
    assert {"--tp-comm-overlap", "--no-overlap-p2p-communication"} <= lines
    assert not lines & {"--overlap-grad-reduce", "--overlap-param-gather"}
    assert "data-parallel size 2 = 64 / (tensor 4 x pipeline 8 x context 1)" in out


def test_megatron_says_what_it_cannot_express(capsys):
    out = _export(capsys, "llama3-70b-h100-64-fsdp-tp", "--to", "megatron")
    assert "# parallelism.fsdp=8: FSDP has no Megatron equivalent beyond the distributed " \
           "optimizer" in out
    assert "--recompute-granularity full" in out
    assert "Megatron always fuses QKV (linear_qkv) and gate/up (linear_fc1)" in out
    out = _export(capsys, "tpu-recipes-v6e-8-llama3-8b", "--to", "megatron")
    assert "# train.remat='custom'" in out  # the offloaded names, said not dropped


def test_out_keeps_a_file_unless_force(tmp_path, capsys):
    mine = tmp_path / "mine.yml"
    mine.write_text("precious\n")
    code, _, err = run_cli(["export", "tiny-h100-dp-tp", "--to", "maxtext", "--out",
                            str(mine)], capsys)
    assert code == 2 and "--force" in err and mine.read_text() == "precious\n"
    code, _, err = run_cli(["export", "tiny-h100-dp-tp", "--to", "maxtext", "--out",
                            str(mine), "--force"], capsys)
    assert code == 0, err
    assert "ici_tensor_parallelism" in mine.read_text()


@pytest.mark.parametrize("override,named", [
    ("ici_tensor_transpose_parallelism=2", "ici_tensor_transpose_parallelism=2"),
    ("remat_policy=minimal_offloaded", "remat_policy='minimal_offloaded'"),
    ("quantization=int8", "quantization='int8'"),
    ("ici_fsdp_parallelism=4", "ici_*_parallelism multiply to 4"),
    ("model_name=gemma2-9b", "model_name='gemma2-9b'"),
    ("mlpwi_0=offload", "mlpwi_0='offload'"),
    # a misspelt key or a value of the wrong kind: named, with the fix
    ("per_device_batch_sise=4", "did you mean per_device_batch_size=4?"),
    ("ici_tensr_parallelism=2", "did you mean ici_tensor_parallelism=2?"),
    ("per_device_batch_size=abc", "per_device_batch_size='abc' must be a number"),
    # a model file's shape key changed without override_model_config, as MaxText refuses
    ("base_num_decoder_layers=16", "unless override_model_config=true"),
])
def test_import_refuses_what_shardscope_cannot_express(override, named, tmp_path, capsys):
    yml = tmp_path / "x.yml"
    code, _, err = run_cli(["export", "tpu-recipes-v6e-8-llama3-8b", "--to", "maxtext",
                            "--out", str(yml)], capsys)
    assert code == 0, err
    code, out, err = run_cli(["import", "maxtext", str(yml), override, "--out",
                              str(tmp_path / "b.toml")], capsys)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "b.toml").exists()


def test_a_size_the_leftover_axis_cannot_take_is_named(tmp_path, capsys):
    # ici_fsdp_parallelism is MaxText's -1 (the devices left over): tensor 3 leaves no
    # whole number of the 8, which is the fix to name (not "set one to -1": one is)
    yml = tmp_path / "x.yml"
    yml.write_text("model_name: llama3-8b\nici_tensor_parallelism: 3\n")
    code, _, err = run_cli(["import", "maxtext", str(yml), "--system", "tpu-v6e:2x4",
                            "--out", str(tmp_path / "b.toml")], capsys)
    assert code == 2 and ("ici_*_parallelism other than ici_fsdp_parallelism=-1 multiply to "
                          "3, which does not divide the 8 devices") in err
    assert "1, 2, 4, 8" in err and "set one to -1" not in err


def test_overrides_that_change_nothing_modelled_are_said_in_the_file(tmp_path, capsys):
    yml = tmp_path / "m.yml"
    yml.write_text("model_name: llama3-8b\n")
    code, _, err = run_cli(["import", "maxtext", str(yml), "--system", "tpu-v5e:4x4", "--out",
                            str(tmp_path / "m.toml"), "steps=100", "learning_rate=1e-4",
                            "ici_fsdp_parallelism=16"], capsys)
    assert code == 0, err
    text = (tmp_path / "m.toml").read_text()
    assert "# Overrides that change nothing shardscope models: steps=100\n" in text
    exp = config.load(tmp_path / "m.toml")
    assert exp.parallelism.fsdp == 16
    # the learning rate is read (into [train]): not among the overrides that change nothing
    assert exp.train.learning_rate == 1e-4


@pytest.mark.parametrize("override, meant", [("learnig_rate=1e-4", "learning_rate=1e-4"),
                                             ("adam_weight_decy=0.1", "adam_weight_decay=0.1")])
def test_a_misspelt_optimizer_override_is_refused_with_the_key_meant(tmp_path, capsys,
                                                                      override, meant):
    # The import writes learning_rate and adam_weight_decay into [train], but read_keys()
    # left them out, so a misspelling of either passed as an override that changes nothing.
    yml = tmp_path / "m.yml"
    yml.write_text("model_name: llama3-8b\n")
    code, _, err = run_cli(["import", "maxtext", str(yml), "--system", "tpu-v5e:4x4", "--out",
                            str(tmp_path / "m.toml"), override], capsys)
    assert code == 2 and f"did you mean {meant}?" in err and err.count("\n") == 1


def test_a_learning_rate_in_e_notation_goes_out_and_comes_back(tmp_path, capsys):
    # The export writes Python's 3e-06, MaxText's own configs 3e-6 (post_train/rl.yml): both
    # numbers to MaxText (OmegaConf reads YAML 1.2 floats) and to the import. PyYAML's
    # safe_load (YAML 1.1) reads them as strings, and the import then refused the file.
    yml = tmp_path / "lr.yml"
    code, _, err = run_cli(["export", "tpu-recipes-v6e-8-llama3-8b", "--to", "maxtext",
                            "--set", "train.learning_rate=3e-6", "--out", str(yml)], capsys)
    assert code == 0 and "learning_rate: 3e-06\n" in yml.read_text(), err
    for text in (yml.read_text(), yml.read_text().replace("3e-06", "3e-6")):
        yml.write_text(text)
        code, _, err = run_cli(["import", "maxtext", str(yml), "--out",
                                str(tmp_path / "lr.toml"), "--force"], capsys)
        assert code == 0, err
        assert config.load(tmp_path / "lr.toml").train.learning_rate == 3e-6


def test_a_line_that_is_not_key_value_is_named(tmp_path, capsys):
    yml = tmp_path / "bad.yml"
    yml.write_text("model_name: llama3-8b\nici_fsdp_parallelism 8\n")
    code, _, err = run_cli(["import", "maxtext", str(yml), "--system", "tpu-v5e:4x4",
                            "--out", str(tmp_path / "b.toml")], capsys)
    assert code == 2 and "line 2: 'ici_fsdp_parallelism 8' is not `key: value`" in err
    assert not (tmp_path / "b.toml").exists()


def test_import_help_says_out_is_required(capsys):
    # import writes no stdout (the experiment is named after --out's file): its help must
    # not promise the shared --out's "default: stdout"
    code, out, _ = run_cli(["import", "--help"], capsys)
    assert code == 0 and "--out EXP.toml" in out and "required" in out
    assert "stdout" not in out


@pytest.mark.parametrize("overrides, want", [
    # MaxText's defaults: 32 layers / 2 stages = 16 repeats of one layer, a microbatch per
    # stage (two with the delayed forwarding)
    ([], (16, 2)),
    (["ici_pipeline_parallelism=8", "ici_fsdp_parallelism=1", "override_model_config=true",
      "base_num_decoder_layers=30"], "8 stages do not divide 30 layers"),
    (["pipeline_delay_activation_forwarding=true"], (16, 4)),
    (["num_layers_per_pipeline_stage=4"], (4, 2)),
    (["num_pipeline_repeats=2", "num_layers_per_pipeline_stage=8"], (2, 2)),
    # what MaxText's config check refuses: 2 x 3 does not divide 32, 2 x 4 x 1 != 32
    (["num_layers_per_pipeline_stage=3"], "num_layers_per_pipeline_stage=3 does not divide "
                                          "the 32 pipelined layers"),
    (["num_pipeline_repeats=4"], "num_pipeline_repeats=4 x num_layers_per_pipeline_stage=1"
                                 " = 8 layers, not the 32 pipelined ones"),
    (["num_layers_per_pipeline_stage=0"], "num_layers_per_pipeline_stage=0 must be 1 or more"),
    (["pipeline_parallel_layers=16"], "shardscope pipelines every layer (32)"),
])
def test_import_reads_the_pipeline_as_maxtext_checks_it(overrides, want, tmp_path, capsys):
    yml, toml = tmp_path / "p.yml", tmp_path / "p.toml"
    yml.write_text("model_name: llama2-7b\nici_pipeline_parallelism: 2\n"
                   "ici_fsdp_parallelism: 4\nper_device_batch_size: 2\n")
    code, _, err = run_cli(["import", "maxtext", str(yml), *overrides, "--system", "h100:8",
                            "--out", str(toml)], capsys)
    if isinstance(want, str):
        assert code == 2 and want in err and "Traceback" not in err
        return
    assert code == 0, err
    exp = config.load(toml)
    assert (exp.parallelism.virtual_stages, exp.workload.microbatches) == want


def test_a_block_style_list_is_read(tmp_path, capsys):
    # YAML's block list (`key:` then `- item` lines) is MaxText's flow list written the
    # other way: read as the same list, not as an empty value
    yml = tmp_path / "m.yml"
    yml.write_text("base_emb_dim: 64\nbase_num_query_heads: 4\nbase_num_kv_heads: 2\n"
                   "base_mlp_dim: 128\nbase_num_decoder_layers: 2\nhead_dim: 16\n"
                   "vocab_size: 256\nmlp_activations:\n  # its activation\n  - \"gelu\"\n"
                   "ici_fsdp_parallelism: 8\n")
    code, _, err = run_cli(["import", "maxtext", str(yml), "--system", "h100:8", "--out",
                            str(tmp_path / "m.toml")], capsys)
    assert code == 0, err
    assert config.load(tmp_path / "m.toml").model.mlp == "gelu"


def test_bad_framework_and_missing_system_are_one_line(tmp_path, capsys):
    code, _, err = run_cli(["export", "tiny-h100-dp-tp", "--to", "jax"], capsys)
    assert code == 2 and "maxtext, megatron" in err and "Traceback" not in err
    code, _, err = run_cli(["export", "llama3-70b-decode-h200-8", "--to", "megatron"], capsys)
    assert code == 2 and "workload.kind='decode'" in err
    yml = tmp_path / "x.yml"
    yml.write_text("model_name: llama3-8b\nici_fsdp_parallelism: 8\n")
    code, _, err = run_cli(["import", "maxtext", str(yml), "--out", str(tmp_path / "b.toml")],
                           capsys)
    assert code == 2 and "--system" in err
    code, _, err = run_cli(["import", "maxtext", str(yml), "--system", "tpu-v6e:2x4",
                            "--out", str(tmp_path / "b.toml")], capsys)
    assert code == 0, err
    exp = config.load(tmp_path / "b.toml")
    # MaxText's defaults for what the file leaves out: 12 sequences per device of 2048
    assert (exp.parallelism.fsdp, exp.workload.global_batch, exp.workload.seq_len) == \
        (8, 96, 2048)


@pytest.mark.parametrize("name", [n for n in config.bundled_names()
                                  if config.load(n).workload.kind == "train"])
def test_every_bundled_training_config_exports_or_says_why(name):
    from experiments import frameworks

    exp = config.load(name)
    assert "--tensor-model-parallel-size" in frameworks.export(exp, "megatron")
    try:
        text = frameworks.export(exp, "maxtext")
    except config.ConfigError as e:
        # a mesh axis across slices (nodes) unevenly, or GPUs in part of a domain
        assert "straddles" in str(e) or "not whole NVLink domains" in str(e)
        return
    sizes = _lines(text)
    for axis, maxtext_axis in frameworks.MAXTEXT_AXES.items():
        # each axis is its ICI ways x its DCN ways
        assert int(sizes[f"ici_{maxtext_axis}_parallelism"]) * \
            int(sizes[f"dcn_{maxtext_axis}_parallelism"]) == getattr(exp.parallelism, axis)


def test_import_reads_maxtext_defaults_as_its_base_yml_has_them(tmp_path, capsys):
    # lines as MaxText's base.yml writes them (-1: the devices left over; its base_* shape
    # keys, which a model_name's own file overrides); v5e-256 x 2 slices
    yml = tmp_path / "base.yml"
    yml.write_text("run_name: ''\nmodel_name: llama2-7b  # a comment\nbase_emb_dim: 2048\n"
                   "ici_fsdp_parallelism: -1\ndcn_data_parallelism: -1\n"
                   "logical_axis_rules: [\n  ['activation_batch', ['data', 'fsdp']],\n]\n"
                   "trainable_position_size: -1\nshared_experts: 1\n"
                   "per_device_batch_size: 2.0\nlearning_rate: 3.e-5\n"
                   "remat_policy: 'save_qkv_proj'\n")
    code, _, err = run_cli(["import", "maxtext", str(yml), "--out", str(tmp_path / "b.toml"),
                            "--system", "tpu-v5e:16x16*2"], capsys)
    assert code == 0, err
    exp = config.load(tmp_path / "b.toml")
    assert exp.model == config.preset("llama2-7b")
    # 2 slices over DCN on data, 256 chips per slice on FSDP; 2 sequences x 512 chips
    assert (exp.parallelism.data, exp.parallelism.fsdp, exp.workload.global_batch) == \
        (2, 256, 1024)
    assert (exp.train.remat, exp.train.save) == ("custom", ("query_proj", "key_proj",
                                                            "value_proj"))


def test_moe_routing_goes_out_and_comes_back(tmp_path, capsys):
    # MaxText's default capacity_factor is -1 (dropless), the presets' 1.25 with dropping:
    # a model_name export writes the run's, and a MaxText MoE config without one is
    # dropless (a dense one gets no routing fields).
    code, out, _ = run_cli(["export", "mixtral-8x7b-v6e-256-ep", "--to", "maxtext"], capsys)
    assert code == 0 and "model_name: mixtral-8x7b" in out and "capacity_factor: 1.25" in out
    # a changed shape names MaxText's MoE block (llama2's MLP is dense)
    code, out, _ = run_cli(["export", "mixtral-8x7b-v6e-256-ep", "--to", "maxtext", "--set",
                            "model.n_layers=16"], capsys)
    assert code == 0 and "decoder_block: mixtral" in out and "num_experts: 8" in out
    for text, want in (("model_name: mixtral-8x7b\n", {"dropless": True}),
                       ("model_name: mixtral-8x7b\ncapacity_factor: 2.0\n",
                        {"capacity_factor": 2.0}),
                       ("model_name: llama2-7b\n", {})):
        yml = tmp_path / "m.yml"
        yml.write_text(text)
        out_toml = tmp_path / "m.toml"
        code, _, err = run_cli(["import", "maxtext", str(yml), "--out", str(out_toml),
                                "--system", "tpu-v6e:16x16", "--force"], capsys)
        assert code == 0, err
        model = config.load(out_toml).model
        assert {k: getattr(model, k) for k in want} == want
        assert model.dropless == want.get("dropless", False)


def test_export_says_where_maxtext_splits_weights_that_the_default_rules_do_not(capsys):
    # MaxText splits a weight's width over its expert (and context) ranks too; shardscope's
    # default rules (Megatron's layout) do not, its maxtext preset does.
    note = "does not split the weights' width over expert; MaxText does"
    assert note in _export(capsys, "mixtral-8x7b-v6e-256-ep", "--to", "maxtext")
    assert "weights' width" not in _export(capsys, "mixtral-8x7b-v6e-256-ep", "--to", "maxtext",
                                           "--set", "parallelism.rules=maxtext")


def test_context_parallel_strategy_goes_out_and_comes_back(tmp_path, capsys):
    # MaxText's context_parallel_strategy (its default all_gather) is read on import, and
    # ici_sequence_parallelism, a MaxText key, is an override like any other.
    for mode in ("allgather", "ring"):
        code, out, _ = run_cli(["export", "llama3-8b-nvl72", "--to", "maxtext", "--set",
                                "parallelism.fsdp=4", "--set", "parallelism.sequence=2",
                                "--set", f"parallelism.context_mode={mode}"], capsys)
        assert code == 0
        yml = tmp_path / "cp.yml"
        yml.write_text(out)
        code, _, err = run_cli(["import", "maxtext", str(yml), "--out", str(tmp_path / "c.toml"),
                                "--force"], capsys)
        assert code == 0, err
        assert config.load(tmp_path / "c.toml").parallelism.context_mode == mode
    yml.write_text("model_name: llama3-8b\nici_fsdp_parallelism: 8\n")
    code, _, err = run_cli(["import", "maxtext", str(yml), "--system", "tpu-v5e:4x4", "--out",
                            str(tmp_path / "s.toml"), "--force", "ici_sequence_parallelism=2"],
                           capsys)
    assert code == 0, err
    par = config.load(tmp_path / "s.toml").parallelism
    assert (par.sequence, par.context_mode) == (2, "allgather")


def test_a_systems_overrides_go_out_and_come_back(tmp_path, capsys):
    # 8 racks used 64 GPUs of 72 each (gpus_per_domain): written beside the system's name,
    # read back with it (the import refused 512 GPUs as no whole number of 72-GPU racks).
    # 128 layers: MaxText's pipeline (and so the import) needs a whole number per stage.
    code, out, _ = run_cli(["export", "llama3-405b-gb200-512-tp4-pp8-cp2-fp8", "--to",
                            "maxtext", "--set", "model.n_layers=128"], capsys)
    assert code == 0 and "# shardscope system: gb200-nvl72:512 gpus_per_domain=64" in out
    yml = tmp_path / "x.yml"
    yml.write_text(out)
    code, _, err = run_cli(["import", "maxtext", str(yml), "--out", str(tmp_path / "y.toml")],
                           capsys)
    assert code == 0, err
    got, want = (config.load(p).system for p in (tmp_path / "y.toml",
                                                  "llama3-405b-gb200-512-tp4-pp8-cp2-fp8"))
    assert (got.name, got.overrides) == (want.name, want.overrides) == (
        "gb200-nvl72:512", {"gpus_per_domain": 64})


def test_megatron_pads_experts_to_capacity_as_shardscope_computes_them(capsys):
    # A capacity factor drops tokens past it; shardscope computes every expert's slots
    # (GShard's dense dispatch), which Megatron does only with the padding flag.
    flags = _export(capsys, "mixtral-8x22b-h100-64-ep-fp8", "--to", "megatron").splitlines()
    assert {"--moe-expert-capacity-factor 1.25", "--moe-pad-expert-input-to-capacity"} <= \
        set(flags)
    flags = _export(capsys, "mixtral-8x22b-h100-64-ep-fp8", "--to", "megatron", "--set",
                    "model.dropless=true").splitlines()
    assert not any(f.startswith(("--moe-expert-capacity", "--moe-pad")) for f in flags)


def test_uneven_pipeline_stages_are_said_as_shardscope_lays_them(capsys):
    # 80 layers over 6 stages: 6 x 14 = 84 slots; shardscope leaves 2 empty before the first
    # layer and 2 after the last (models/pipeline.py Pipeline.padding), so the first and
    # last stages hold 12 layers and the 4 others 14 each: 12 + 4 x 14 + 12 = 80.
    six = ["--set", "parallelism.pipeline=6", "--set", "parallelism.virtual_stages=1",
           "--set", "parallelism.data=1", "--set", "parallelism.tensor=8",
           "--set", "system.name=h100:48", "--set", "workload.global_batch=12",
           "--set", "workload.microbatches=12"]
    name = "llama3-70b-h100-64-tp4-pp8-interleaved"
    out = _export(capsys, name, "--to", "megatron", *six)
    assert ("# 80 layers in 84 pipeline slots (shardscope leaves 2 empty before the first "
            "layer and 2 after the last): Megatron: --decoder-first-pipeline-num-layers 12 "
            "--decoder-last-pipeline-num-layers 12") in out.splitlines()
    out = _export(capsys, name, "--to", "maxtext", *six)
    assert "shardscope leaves 2 empty before the first layer and 2 after the last" in out


def test_megatron_export_says_the_systems_overrides(capsys):
    # The system and its [system] overrides are the launch's, not Megatron flags: said in
    # `#` lines (NCCL's environment for NVLS and IB SHARP), not dropped.
    out = _export(capsys, "tiny-h100-dp-tp", "--to", "megatron", "--set", "system.nvls=false",
                  "--set", "system.sharp=true", "--set", "system.gpus_per_domain=4")
    lines = out.splitlines()
    assert "# shardscope system: h100:8 gpus_per_domain=4 nvls=false sharp=true" in lines
    assert any("NCCL_NVLS_ENABLE=0 NCCL_COLLNET_ENABLE=1" in ln for ln in lines)
    assert any(ln.startswith("# system.gpus_per_domain=4") for ln in lines)
    plain = _export(capsys, "tiny-h100-dp-tp", "--to", "megatron").splitlines()
    assert "# shardscope system: h100:8" in plain
    assert not any("NCCL_" in ln or "gpus_per_domain" in ln for ln in plain)


def test_latent_attention_and_dense_layers_export_and_come_back(tmp_path, capsys):
    # DeepSeek-V3's shape from its config.json, 5 layers (not the preset, so every key is
    # written): MaxText's attention_type mla keys and first_num_dense_layers round-trip;
    # Megatron's flags name the same shape.
    hf = config.BUNDLED / "hf" / "deepseek-v3.json"
    toml = tmp_path / "ds.toml"
    toml.write_text(f'name = "ds"\n[model]\nhf_config = "{hf}"\nn_layers = 5\n'
                    f'[system]\nname = "tpu-v5p:2x2x2"\n[parallelism]\nfsdp = 8\n'
                    f'[workload]\nseq_len = 4096\nglobal_batch = 8\n')
    keys = _lines(_export(capsys, str(toml), "--to", "maxtext"))
    assert (keys["attention_type"], keys["kv_lora_rank"], keys["first_num_dense_layers"],
            keys["base_mlp_dim"], keys["base_moe_mlp_dim"]) == ("mla", "512", "3", "18432",
                                                                "2048")
    yml, back = tmp_path / "x.yml", tmp_path / "back.toml"
    assert run_cli(["export", str(toml), "--to", "maxtext", "--out", str(yml)], capsys)[0] == 0
    assert run_cli(["import", "maxtext", str(yml), "--out", str(back)], capsys)[0] == 0
    a, b = config.load(toml).model, config.load(back).model
    assert b == dataclasses.replace(a, name="custom")
    flags = _export(capsys, str(toml), "--to", "megatron")
    for flag in ("--multi-latent-attention", "--q-lora-rank 1536", "--kv-lora-rank 512",
                 "--qk-head-dim 128", "--qk-pos-emb-head-dim 64", "--v-head-dim 128",
                 "--moe-layer-freq '([0]*3+[1]*2)'", "--moe-ffn-hidden-size 2048",
                 "--ffn-hidden-size 18432",
                 # a capacity factor needs the all-to-all dispatcher (TransformerConfig)
                 "--moe-token-dispatcher-type alltoall"):
        assert flag in flags.splitlines()
