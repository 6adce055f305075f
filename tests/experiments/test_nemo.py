"""`shardscope import nemo` (experiments/nemo.py): a NeMo 1.x training config read as the
Megatron flags its keys stand for. Config transformations only, nothing compiled."""

import pytest

from experiments import config
from tests.helpers import run_cli

# NeMo's Llama 2 7B pretraining on one node of 8 H100s in FP8, as the bundled
# nemo-llama2-7b-fp8-h100-8 config has it (NeMo-Framework-Launcher's llama2_7b.yaml: TP 1,
# PP 1, micro-batch 1, 128 sequences of 4096, the distributed optimizer overlapped), with
# the keys megatron_gpt_config.yaml spells them, `${...}` interpolations included.
LLAMA2_7B = """\
trainer:
  devices: 8
  num_nodes: 1
  precision: bf16
model:
  micro_batch_size: 1
  global_batch_size: 128
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 1
  virtual_pipeline_model_parallel_size: null
  encoder_seq_length: 4096
  max_position_embeddings: ${.encoder_seq_length}
  num_layers: 32
  hidden_size: 4096
  ffn_hidden_size: 11008
  num_attention_heads: 32
  num_query_groups: 32  # every head its own key and value
  kv_channels: null
  init_method_std: 0.01
  normalization: rmsnorm
  bias: false
  activation: fast-swiglu
  position_embedding_type: rope
  rotary_base: 10000
  share_embeddings_and_output_weights: false
  make_vocab_size_divisible_by: 128
  megatron_amp_O2: true
  activations_checkpoint_granularity: null
  sequence_parallel: false
  fp8: true
  fp8_hybrid: true
  tokenizer:
    library: sentencepiece
    model: /data/tokenizer.model
  optim:
    name: distributed_fused_adam
    lr: 3.0e-4
    weight_decay: 0.1
    overlap_grad_sync: true
    overlap_param_sync: true
    grad_sync_dtype: bf16
    betas:
    - 0.9
    - 0.95
"""


def _import(tmp_path, capsys, text: str, *args) -> tuple[int, str, str]:
    src, out = tmp_path / "nemo.yaml", tmp_path / "exp.toml"
    src.write_text(text)
    code, _, err = run_cli(["import", "nemo", str(src), "--out", str(out), "--force", *args],
                           capsys)
    return code, (out.read_text() if code == 0 else ""), err


def test_nemos_llama2_recipe_is_the_bundled_config(tmp_path, capsys):
    # the tokenizer holds the vocabulary: given as model.vocab_size (Llama 2's 32000)
    code, text, err = _import(tmp_path, capsys, LLAMA2_7B, "--system", "h100:8",
                              "model.vocab_size=32000")
    assert code == 0, err
    got, want = (config.load(p).to_dict() for p in (tmp_path / "exp.toml",
                                                    "nemo-llama2-7b-fp8-h100-8"))
    for table in ("parallelism", "workload", "precision", "train"):
        assert got[table] == want[table], table
    model = config.preset("llama2-7b")
    for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                  "vocab", "mlp", "norm", "positions", "tie_embeddings", "rope_theta"):
        assert got["model"][field] == getattr(model, field), field
    assert "NeMo keys read but not modelled: model.init_method_std, model.tokenizer" in text


def test_o1_keeps_fp32_weights_and_the_keys_name_nemos(tmp_path, capsys):
    # without megatron_amp_O2 NeMo keeps fp32 weights and runs the matmuls under bf16
    # autocast; Hydra overrides change keys, `+` adds one
    code, _, err = _import(tmp_path, capsys, LLAMA2_7B.replace("megatron_amp_O2: true",
                                                               "megatron_amp_O2: false"),
                           "--system", "h100:16", "model.vocab_size=32000",
                           "trainer.num_nodes=2", "model.tensor_model_parallel_size=2",
                           "+model.activations_checkpoint_granularity=full",
                           "+model.activations_checkpoint_method=uniform",
                           "+model.activations_checkpoint_num_layers=1")
    assert code == 0, err
    exp = config.load(tmp_path / "exp.toml")
    assert (exp.precision.params, exp.precision.master_weights, exp.precision.compute) == \
        ("float32", "", "float8")
    # 16 GPUs / tensor 2: 8 data-parallel ranks
    assert (exp.parallelism.tensor, exp.parallelism.data, exp.train.remat) == (2, 8, "full")


@pytest.mark.parametrize("args, named", [
    (["model.tensor_model_parallel_size=3"], "model.tensor_model_parallel_size 3 x "
                                             "model.pipeline_model_parallel_size 1"),
    (["trainer.precision=16"], "trainer.precision=16: shardscope trains in bf16 or fp32"),
    (["model.activation=squared-relu"], "model.activation='squared-relu' has no shardscope "
                                        "equivalent"),
    (["model.optim.name=sgd"], "model.optim.name='sgd'"),
    (["model.rampup_batch_size=[16, 16, 1000]"], "model.rampup_batch_size: shardscope "
                                                 "models one global batch"),
    ([], "give its size as an override, +model.vocab_size=N"),
    (["tensor_model_parallel_size=2"], "expected model.KEY=VALUE"),
    # a misspelt override was listed among the keys not modelled, its setting dropped
    (["model.sequence_paralel=true"], "did you mean model.sequence_parallel?"),
    (["+model.num_moe_expert=8"], "did you mean model.num_moe_experts?"),
    # a value of the wrong kind, a key under a value: one line, not a TypeError
    (["model.activation=[gelu]"], "model.activation=['gelu'] has no shardscope equivalent"),
    (["model.bias.x=1"], "override 'model.bias.x=1': model.bias is False in the config"),
])
def test_bad_keys_are_one_line_naming_nemos_key(args, named, tmp_path, capsys):
    extra = [] if "vocab_size" in named else ["model.vocab_size=32000"]
    code, _, err = _import(tmp_path, capsys, LLAMA2_7B, "--system", "h100:8", *extra, *args)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_the_device_count_and_the_system_must_agree(tmp_path, capsys):
    code, _, err = _import(tmp_path, capsys, LLAMA2_7B, "model.vocab_size=32000")
    assert code == 2 and "give --system NAME (e.g. --system h100:8" in err
    code, _, err = _import(tmp_path, capsys, LLAMA2_7B, "--system", "h100:64",
                           "model.vocab_size=32000")
    assert code == 2 and "trainer.num_nodes x trainer.devices = 8 GPUs, but --system " \
                         "h100:64 has 64" in err
    code, _, err = _import(tmp_path, capsys, "trainer: {}\n", "--system", "h100:8")
    assert code == 2 and "no `model:` table" in err
