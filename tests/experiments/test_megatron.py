"""`shardscope import megatron` (experiments/megatron.py): Megatron-LM's flags and launch
scripts read back as experiments. Config transformations only, nothing compiled."""

import re

import pytest

from experiments import config, frameworks
from tests.helpers import run_cli

TRAINING = [n for n in config.bundled_names() if config.load(n).workload.kind == "train"]

# The shape every hand-written file below shares: 8 layers, Megatron's defaults otherwise.
SHAPE = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --vocab-size 1024 "
         "--seq-length 512")


def _import(tmp_path, capsys, text: str, *args) -> tuple[int, str, str]:
    src, out = tmp_path / "flags.sh", tmp_path / "exp.toml"
    src.write_text(text)
    code, _, err = run_cli(["import", "megatron", str(src), "--out", str(out), "--force",
                            *args], capsys)
    return code, (out.read_text() if code == 0 else ""), err


def _load(tmp_path, capsys, text: str, *args) -> config.Experiment:
    code, _, err = _import(tmp_path, capsys, text, *args)
    assert code == 0, err
    return config.load(tmp_path / "exp.toml")


def _tables(exp: config.Experiment) -> dict:
    """The experiment as run, names aside."""
    out = exp.to_dict()
    del out["name"], out["model"]["name"]
    return out


@pytest.mark.parametrize("name", TRAINING)
def test_megatron_export_then_import_gives_the_experiment_back(name, tmp_path, capsys):
    flags, back = tmp_path / "x.sh", tmp_path / "back.toml"
    code, _, err = run_cli(["export", name, "--to", "megatron", "--out", str(flags)], capsys)
    assert code == 0, err
    # no --system: the export names it in a comment line the import reads
    code, _, err = run_cli(["import", "megatron", str(flags), "--out", str(back)], capsys)
    assert code == 0, err
    assert _tables(config.load(back)) == _tables(config.load(name))


def test_flags_alone_read_as_megatron_runs_them(tmp_path, capsys):
    # Without the export's `# shardscope set:` lines: an FSDP config comes back as Megatron
    # runs it, data-parallel with the distributed optimizer, bf16 weights with an fp32 copy.
    flags = tmp_path / "x.sh"
    code, out, err = run_cli(["export", "llama3-70b-h100-64-fsdp-tp", "--to", "megatron"],
                             capsys)
    assert code == 0, err
    flags.write_text("\n".join(ln for ln in out.splitlines()
                               if not ln.startswith(frameworks.SET_LINE)))
    code, _, err = run_cli(["import", "megatron", str(flags), "--out",
                            str(tmp_path / "b.toml")], capsys)
    assert code == 0, err
    exp = config.load(tmp_path / "b.toml")
    # 64 GPUs / tensor 8: 8 data-parallel ranks
    assert (exp.parallelism.data, exp.parallelism.fsdp, exp.parallelism.tensor) == (8, 1, 8)
    assert exp.train.shard_optimizer_over_data
    assert (exp.precision.params, exp.precision.master_weights) == ("bfloat16", "float32")
    assert exp.model.fused_qkv and exp.model.fused_mlp  # Megatron's linear_qkv, linear_fc1


def test_megatrons_defaults_fill_what_the_flags_leave_out(tmp_path, capsys):
    exp = _load(tmp_path, capsys, SHAPE, "--system", "h100:8")
    m = exp.model
    # arguments.py: GeLU, LayerNorm, learned positions, tied embeddings, ffn 4 x hidden,
    # kv-channels hidden / heads, no GQA, vocab padded to 128
    assert (m.mlp, m.norm, m.positions, m.tie_embeddings) == ("gelu", "layernorm", "learned",
                                                              True)
    assert (m.d_ff, m.head_dim, m.n_kv_heads, m.vocab_multiple) == (1024, 32, 8, 128)
    # 8 GPUs, no model parallelism: 8 data-parallel ranks of micro-batch 1, one microbatch
    assert (exp.parallelism.data, exp.workload.global_batch, exp.workload.microbatches) == \
        (8, 8, 1)
    assert (exp.precision.params, exp.precision.compute) == ("float32", "float32")
    assert (exp.train.remat, exp.train.weight_decay) == ("none", 0.01)
    # SwiGLU's default width: 2/3 of 4 x 256, rounded down to a multiple of 64
    assert _load(tmp_path, capsys, SHAPE + " --swiglu", "--system", "h100:8").model.d_ff == 640


LAUNCH = """#!/bin/bash
# a launch script as Megatron's examples write them
GPUS_PER_NODE=8
NNODES=2
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))
TP=4
export PP=2
DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
)
CHECKPOINT_PATH=$1  # the script's first argument
MODEL_ARGS=(
    --num-layers 8  # eight (a comment in an array)
\t--hidden-size 256
    --num-attention-heads 8
    --group-query-attention --num-query-groups 4
    --swiglu --normalization RMSNorm --position-embedding-type rope
)
torchrun ${DISTRIBUTED_ARGS[@]} $MEGATRON/pretrain_gpt.py \\
    ${MODEL_ARGS[@]} \\
    --tensor-model-parallel-size $TP --pipeline-model-parallel-size ${PP} \\
    --sequence-parallel --use-distributed-optimizer \\
    --micro-batch-size 2 --global-batch-size 64 --seq-length 1024 \\
    --vocab-size 32000 --bf16 --fp8-format hybrid \\
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \\
    --lr 1e-4 --lr-decay-style cosine --train-iters 1000 --data-path $DATA \\
    --save $CHECKPOINT_PATH
echo done
"""


def test_a_launch_script_is_read_with_its_variables(tmp_path, capsys):
    code, text, err = _import(tmp_path, capsys, LAUNCH, "--system", "h100:16")
    assert code == 0, err
    exp = config.load(tmp_path / "exp.toml")
    par = exp.parallelism
    # 16 GPUs / (tensor 4 x pipeline 2): 2 data-parallel ranks
    assert (par.tensor, par.pipeline, par.data, par.sequence_parallel) == (4, 2, 2, True)
    # 64 sequences / (micro-batch 2 x 2 ranks): 16 microbatches
    assert (exp.workload.global_batch, exp.workload.microbatches, exp.workload.seq_len) == \
        (64, 16, 1024)
    assert (exp.model.n_kv_heads, exp.model.mlp, exp.model.norm) == (4, "swiglu", "rmsnorm")
    assert (exp.precision.compute, exp.train.remat, exp.train.learning_rate) == \
        ("float8", "full", 1e-4)
    assert exp.train.shard_optimizer_over_data
    # torchrun's own flags are not Megatron's; the ones Megatron reads but shardscope does
    # not model are said in the file (--data-path's $DATA unresolved, but not read)
    assert "# Megatron flags read but not modelled: --lr-decay-style, --train-iters, " \
           "--data-path, --save" in text
    assert "nproc" not in text


def test_an_unresolved_variable_is_named_with_its_flag(tmp_path, capsys):
    code, _, err = _import(tmp_path, capsys, LAUNCH.replace("TP=4\n", ""), "--system",
                           "h100:16")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--tensor-model-parallel-size $TP: TP is not assigned" in err
    # the override the error suggests
    exp = _load(tmp_path, capsys, LAUNCH.replace("TP=4\n", ""), "--system", "h100:16",
                "tensor-model-parallel-size=2")
    assert (exp.parallelism.tensor, exp.parallelism.data) == (2, 4)


def test_overrides_as_flags_or_key_value(tmp_path, capsys):
    base = SHAPE + " --tensor-model-parallel-size 2 --sequence-parallel"
    for args in (["--tensor-model-parallel-size", "4"], ["tensor_model_parallel_size=4"],
                 ["--tensor-model-parallel-size=4"]):
        exp = _load(tmp_path, capsys, base, "--system", "h100:8", *args)
        assert (exp.parallelism.tensor, exp.parallelism.data) == (4, 2), args
    exp = _load(tmp_path, capsys, base, "--system", "h100:8", "sequence_parallel=false",
                "--bf16")
    assert not exp.parallelism.sequence_parallel and exp.precision.params == "bfloat16"


@pytest.mark.parametrize("extra, named", [
    ("--fp16", "--fp16: shardscope trains in bf16 or fp32"),
    ("--cp-comm-type a2a --context-parallel-size 2", "--cp-comm-type a2a: shardscope models "
                                                     "p2p"),
    ("--global-batch-size 12", "--global-batch-size 12 is not a multiple of "
                               "--micro-batch-size 1 x the data-parallel size 8"),
    ("--num-experts 4 --expert-model-parallel-size 3", "--expert-model-parallel-size 3 does "
                                                       "not divide the data-parallel size 8"),
    ("--num-experts 4 --expert-model-parallel-size 3", "choose one of 1, 2, 4, 8"),
    ("--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1",
     "--expert-tensor-parallel-size 1"),
    ("--tensor-model-paralel-size 2", "did you mean --tensor-model-parallel-size?"),
    ("--micro-batch-size two", "--micro-batch-size two: must be a whole number"),
    ("--micro-batch-size 0", "--micro-batch-size 0: must be at least 1, e.g. "
                             "--micro-batch-size 1"),
    ("--lr nan", "--lr nan: must be a finite number, e.g. --lr"),
    # an example a run would use, not --lr 1.0 or --max-position-embeddings 1
    ("--lr fast", "--lr fast: must be a finite number, e.g. --lr 0.0003"),
    ("--max-position-embeddings 0", "--max-position-embeddings 0: must be at least 1, e.g. "
                                    "--max-position-embeddings 4096"),
    ("--normalization BatchNorm", "--normalization BatchNorm: valid: LayerNorm, RMSNorm"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 1",
     "--recompute-method block --recompute-num-layers 1: shardscope recomputes every layer"),
    ("--recompute-granularity full", "needs --recompute-method uniform or block"),
    ("--num-experts 4 --moe-layer-freq '([1]*4+[0]*4)'", "shardscope's dense layers are the "
                                                         "first ones"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
     "--num-layers = 8 layers do not split evenly over --pipeline-model-parallel-size 2 x "
     "--num-layers-per-virtual-pipeline-stage 3"),
    # the choices of the flag that broke it, the others kept
    ("--pipeline-model-parallel-size 3", "= 3 does not divide the 8 devices of h100:8 "
                                         "(Megatron refuses it too); make the product a "
                                         "divisor of 8 (the data-parallel size is the rest: "
                                         "8 / product), e.g. --pipeline-model-parallel-size 2 "
                                         "or 4"),
    ("--num-layers-per-virtual-pipeline-stage 2", "--num-layers-per-virtual-pipeline-stage 2: "
                                                  "virtual stages need pipeline stages"),
    ("--virtual-pipeline-model-parallel-size 2", "add --pipeline-model-parallel-size 2 or more"),
    ("--optimizer sgd", "--optimizer sgd: shardscope models Adam"),
    ("--bf16 extra", "--bf16 is a switch and takes no value"),
])
def test_bad_flags_are_one_line_naming_the_flag_and_the_fix(extra, named, tmp_path, capsys):
    code, _, err = _import(tmp_path, capsys, f"{SHAPE} {extra}", "--system", "h100:8")
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("given, named", [
    ("--num-layers eighty", "--num-layers eighty: must be a whole number, e.g. --num-layers 32"),
    ("--hidden-size 0", "--hidden-size 0: must be at least 1, e.g. --hidden-size 4096"),
    ("--vocab-size 50k", "--vocab-size 50k: must be a whole number, e.g. --vocab-size 50257"),
])
def test_a_bad_shape_flag_shows_a_value_a_model_has(given, named, tmp_path, capsys):
    # "e.g. --num-layers 1": valid, but no model's; the example is the one a missing flag's
    # message gives
    flag = given.split()[0]
    text = re.sub(rf"{flag} \S+", given, SHAPE)
    code, _, err = _import(tmp_path, capsys, text, "--system", "h100:8")
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "exp.toml").exists()


def test_no_system_no_flags_and_a_stray_word(tmp_path, capsys):
    code, _, err = _import(tmp_path, capsys, SHAPE)
    assert code == 2 and "give --system NAME" in err
    code, _, err = _import(tmp_path, capsys, "# nothing\n", "--system", "h100:8")
    assert code == 2 and "no Megatron flags" in err
    code, _, err = _import(tmp_path, capsys, SHAPE.replace("--vocab-size 1024", ""),
                           "--system", "h100:8")
    assert code == 2 and "Megatron takes it from the tokenizer" in err
    code, _, err = _import(tmp_path, capsys, "tensor 4\n" + SHAPE, "--system", "h100:8")
    assert code == 2 and "'tensor' is not a Megatron flag" in err
    code, _, err = run_cli(["import", "megatron", str(tmp_path / "none.sh"), "--out",
                            str(tmp_path / "b.toml"), "--system", "h100:8"], capsys)
    assert code == 2 and "not found" in err


def test_out_is_kept_unless_force(tmp_path, capsys):
    (tmp_path / "flags.sh").write_text(SHAPE)
    mine = tmp_path / "mine.toml"
    mine.write_text("precious\n")
    args = ["import", "megatron", str(tmp_path / "flags.sh"), "--system", "h100:8", "--out",
            str(mine)]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--force" in err and mine.read_text() == "precious\n"
    code, _, err = run_cli([*args, "--force"], capsys)
    assert code == 0, err
    assert config.load(mine).parallelism.data == 8


@pytest.mark.parametrize("flags, want", [
    # 126 layers on 8 stages as shardscope lays them: one empty slot at each end, so the
    # first and last stages hold 15 and the six others 16 (15 + 6 x 16 + 15 = 126)
    ("--decoder-first-pipeline-num-layers 15 --decoder-last-pipeline-num-layers 15", 1),
    # the same with the embedding and the loss counted as a layer: 128 slots / 8 stages; with
    # 2 layers per virtual stage, 128 / (8 x 2) = 8 virtual stages
    ("--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 1),
    ("--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
     "--num-layers-per-virtual-pipeline-stage 2", 8),
    # a layout that is not shardscope's: named, with shardscope's as the fix
    ("--decoder-first-pipeline-num-layers 14 --decoder-last-pipeline-num-layers 16",
     "use --decoder-first-pipeline-num-layers 15 --decoder-last-pipeline-num-layers 15"),
    ("", "126 layers do not split evenly over --pipeline-model-parallel-size 8"),
])
def test_uneven_pipeline_stages_read_as_shardscope_lays_them(flags, want, tmp_path, capsys):
    text = ("--num-layers 126 --hidden-size 256 --num-attention-heads 8 --vocab-size 1024 "
            "--seq-length 512 --pipeline-model-parallel-size 8 --global-batch-size 16 " + flags)
    code, _, err = _import(tmp_path, capsys, text, "--system", "h100:16")
    if isinstance(want, str):
        assert code == 2 and want in err, err
        return
    assert code == 0, err
    exp = config.load(tmp_path / "exp.toml")
    assert (exp.parallelism.pipeline, exp.parallelism.virtual_stages) == (8, want)


def test_experts_dense_layers_and_capacity(tmp_path, capsys):
    text = (SHAPE + " --ffn-hidden-size 1024 --num-experts 8 --moe-router-topk 2 "
            "--moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 256 "
            "--moe-layer-freq '([0]*2+[1]*6)' --expert-model-parallel-size 4 "
            "--moe-expert-capacity-factor 1.5")
    code, toml, err = _import(tmp_path, capsys, text, "--system", "h100:8")
    assert code == 0, err
    m, par = config.load(tmp_path / "exp.toml").model, config.load(tmp_path / "exp.toml"
                                                                     ).parallelism
    # two shared experts of 128; the first two layers dense, 1024 wide
    assert (m.n_experts, m.experts_per_token, m.d_ff, m.n_shared_experts) == (8, 2, 128, 2)
    assert (m.n_dense_layers, m.dense_d_ff, m.capacity_factor, m.dropless) == (2, 1024, 1.5,
                                                                               False)
    # 8 data-parallel GPUs: expert 4 x data 2
    assert (par.expert, par.data) == (4, 2)
    # without the padding flag Megatron computes only the tokens an expert gets
    assert "without --moe-pad-expert-input-to-capacity" in toml
    code, _, err = _import(tmp_path, capsys, SHAPE + " --num-experts 8", "--system", "h100:8")
    assert code == 0, err
    assert config.load(tmp_path / "exp.toml").model.dropless  # Megatron's default


def test_context_parallel_modes(tmp_path, capsys):
    for comm, mode in (("p2p", "ring"), ("all_gather", "allgather")):
        exp = _load(tmp_path, capsys, SHAPE + f" --context-parallel-size 2 --cp-comm-type {comm}",
                    "--system", "h100:8")
        assert (exp.parallelism.sequence, exp.parallelism.context_mode, exp.parallelism.data) \
            == (2, mode, 4)


@pytest.mark.parametrize("typo, meant", [
    # flags read through a helper or a loop, not only by a call that names them
    ("--sequence-paralel", "--sequence-parallel"), ("--tp-comm-overlapp", "--tp-comm-overlap"),
    ("--fp8-recipee delayed", "--fp8-recipe"), ("--num-attention-head 8", "--num-attention-heads"),
    ("--recompute-activation", "--recompute-activations"),  # an older name, read as its new one
])
def test_a_misspelt_flag_is_refused_not_dropped(typo, meant, tmp_path, capsys):
    code, _, err = _import(tmp_path, capsys, f"{SHAPE} --bf16 {typo}", "--system", "h100:8")
    assert code == 2 and f"did you mean {meant}?" in err, err


def test_megatrons_own_flags_near_one_read_are_noted_not_misspellings(tmp_path, capsys):
    # --decoder-seq-length is one word from --encoder-seq-length: Megatron's (T5's), noted
    code, text, err = _import(tmp_path, capsys, SHAPE + " --decoder-seq-length 128",
                              "--system", "h100:8")
    assert code == 0, err
    assert "read but not modelled: --decoder-seq-length" in text


def test_the_training_program_s_flags_are_read_and_unknown_variables_said(tmp_path, capsys):
    # a tool run before the training program is not it; $EXTRA_ARGS, which the script does
    # not assign, is said in the file rather than dropped
    script = ("python tools/preprocess_data.py --tensor-model-parallel-size 8\n"
              f"torchrun pretrain_gpt.py {SHAPE} --tensor-model-parallel-size 2 --bf16 "
              f"$EXTRA_ARGS\n")
    code, text, err = _import(tmp_path, capsys, script, "--system", "h100:8")
    assert code == 0, err
    assert config.load(tmp_path / "exp.toml").parallelism.tensor == 2
    assert "# $EXTRA_ARGS after --bf16: not assigned in the file" in text


def test_fsdp_set_line_holds_when_the_flags_change(tmp_path, capsys):
    # The export's `parallelism.fsdp=8` takes 8 of the data-parallel ranks the flags give:
    # tensor 4 instead of 8 on 64 GPUs leaves 16, so FSDP 8 x data 2.
    flags = tmp_path / "x.sh"
    code, _, err = run_cli(["export", "llama3-70b-h100-64-fsdp-tp", "--to", "megatron",
                            "--out", str(flags)], capsys)
    assert code == 0, err
    assert f"{frameworks.SET_LINE}parallelism.fsdp=8" in flags.read_text().splitlines()
    code, _, err = run_cli(["import", "megatron", str(flags), "--tensor-model-parallel-size",
                            "4", "--out", str(tmp_path / "b.toml")], capsys)
    assert code == 0, err
    par = config.load(tmp_path / "b.toml").parallelism
    assert (par.tensor, par.fsdp, par.data) == (4, 8, 2)
    # tensor 16 leaves 4 data-parallel ranks, fewer than the line's 8: said, with the fix
    code, _, err = run_cli(["import", "megatron", str(flags), "--tensor-model-parallel-size",
                            "16", "--out", str(tmp_path / "c.toml")], capsys)
    assert code == 2 and "8 FSDP ranks do not divide the data-parallel size 4" in err
    assert "edit or delete the line" in err


def test_an_unknown_framework_names_the_ones_imported(tmp_path, capsys):
    code, _, err = run_cli(["import", "jax", str(tmp_path / "x"), "--out",
                            str(tmp_path / "b.toml")], capsys)
    assert code == 2 and "maxtext, megatron, nemo" in err and "Traceback" not in err


def test_the_export_sets_only_what_no_flag_says(capsys):
    # Megatron's own run (TP 4 x PP 8, bf16 with an fp32 copy, fused projections): the flags
    # say it all
    code, out, _ = run_cli(["export", "llama3-70b-h100-64-tp4-pp8-interleaved", "--to",
                            "megatron"], capsys)
    assert code == 0 and frameworks.SET_LINE not in out
    # the TPU recipe: FSDP 8, fp32 weights, custom remat offloading five tensors, separate
    # q/k/v and gate/up weights
    code, out, _ = run_cli(["export", "tpu-recipes-v6e-8-llama3-8b", "--to", "megatron"],
                           capsys)
    sets = [ln[len(frameworks.SET_LINE):] for ln in out.splitlines()
            if ln.startswith(frameworks.SET_LINE)]
    assert sets == ["parallelism.fsdp=8", "train.shard_optimizer_over_data=false",
                    'precision.params="float32"', 'precision.master_weights=""',
                    "model.fused_qkv=false", "model.fused_mlp=false", 'train.remat="custom"',
                    'train.offload=["decoder_layer_input", "query_proj", '
                    '"key_proj", "value_proj", "out_proj"]']


def test_a_bracket_in_a_comment_does_not_open_an_array(tmp_path, capsys):
    # The array's lines are joined while its brackets are open: one in a comment kept
    # MODEL_ARGS open over the torchrun line, and its flags were lost.
    script = LAUNCH.replace("# eight (a comment in an array)", "# eight :( or (8")
    code, _, err = _import(tmp_path, capsys, script, "--system", "h100:16")
    assert code == 0, err
    par = config.load(tmp_path / "exp.toml").parallelism
    assert (par.tensor, par.pipeline) == (4, 2)
