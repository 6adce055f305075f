"""Experiment configs (experiments/config.py): one clear line for every mistake, and every
bundled config valid."""

import pytest

from experiments.config import load_calibration
from tests.conftest import REPO
from tests.helpers import TINY, run_cli, write

BAD = {
    "unknown key": (TINY.replace("seq_len = 32", "seq_len = 32\nseqlen = 3"),
                    "unknown key 'workload.seqlen'; did you mean 'workload.seq_len'? valid keys "
                    "in [workload]"),
    # A typo of a required key is the typo, not a missing key.
    "typo": (TINY.replace("global_batch", "global_batc"),
             "unknown key 'workload.global_batc'; did you mean 'workload.global_batch'?"),
    # 72 devices: the suggestions divide both d_model = 64 and 72, not just 64; the fix
    # keeps the 72 devices, the data-parallel size taking what fsdp leaves
    "suggest": (TINY.replace('"h100:8"', '"gb200-nvl72:72"').replace(
        "data = 2\nfsdp = 4", "fsdp = 72").replace("global_batch = 16", "global_batch = 72"),
                "parallelism.fsdp=72 does not divide model.d_model=64; choose fsdp = 1, 2, 4 "
                "or 8 (each divides model.d_model=64 and the 72 devices), e.g. fsdp = 8 with "
                "data = 9 (data 9 x fsdp 8 = 72 devices)"),
    # the product named as the axes multiply, and the data-parallel size that makes it (as
    # Megatron derives data = devices / (tensor x pipeline x context)), not a bare total
    "product": (TINY.replace("fsdp = 4", "fsdp = 2"),
                "= 4 devices, but system.name='h100:8' has 8; make the product of the "
                "[parallelism] sizes (pipeline x data x fsdp x expert x sequence x tensor; "
                "sequence is context parallelism) 8, e.g. data = 4 (data 4 x fsdp 2 = 8 "
                "devices)"),
    # a Megatron user's expert ranks are data-parallel ones: 8 x 8 is 64 here, and said so
    "product expert": (TINY.replace("[system]", "n_experts = 8\nexperts_per_token = 2\n[system]")
                       .replace("data = 2\nfsdp = 4", "data = 8\nexpert = 8")
                       .replace("global_batch = 16", "global_batch = 64"),
                       "parallelism data=8 x expert=8 = 64 devices, but system.name='h100:8' "
                       "has 8; make the product of the [parallelism] sizes (pipeline x data x "
                       "fsdp x expert x sequence x tensor; sequence is context parallelism) 8, "
                       "e.g. data = 1 (data 1 x expert 8 = 8 devices); parallelism.expert=8 is "
                       "an axis of its own, not a part of data as Megatron's expert-parallel "
                       "ranks are"),
    # no data size makes 8 of pipeline 3: the size that does not divide, and its choices
    # (4 stages would leave the 2 layers' pipeline a stage without a layer)
    "product pipeline": (TINY.replace("data = 2\nfsdp = 4", "data = 2\npipeline = 3"),
                         "has 8; make the product of the [parallelism] sizes (pipeline x "
                         "data x fsdp x expert x sequence x tensor; sequence is context "
                         "parallelism) 8; pipeline = 3 does not divide the 8 devices: choose "
                         "pipeline = 1 or 2, e.g. pipeline = 2 with data = 4 (pipeline 2 x "
                         "data 4 = 8 devices)"),
    # TPU7x sizes count TensorCores: a MaxText user's 64 chips are 128 devices
    "tpu7x cores": (TINY.replace('"h100:8"', '"tpu7x:4x4x4"').replace("fsdp = 4", "fsdp = 32"),
                    "= 64 devices, but system.name='tpu7x:4x4x4' has 128 (64 chips x 2 "
                    "TensorCores, each a JAX device); make the product"),
    # the choices divide every dimension tensor splits, not only the one that failed
    "indivisible": (TINY.replace("data = 2\nfsdp = 4", "data = 2\ntensor = 4"),
                    "parallelism.tensor=4 does not divide model.n_kv_heads=2; choose tensor = "
                    "1 or 2 (each divides model.n_heads=4, model.n_kv_heads=2, model.d_ff=128, "
                    "the padded vocab=256 and the 8 devices), e.g. tensor = 2 with data = 4 "
                    "(data 4 x tensor 2 = 8 devices)"),
    # tensor = 3 also breaks the device count (2 x 3 = 6 of 8): the heads are the mistake,
    # and they are what the message names (it named the device count)
    "tensor 3": (TINY.replace("data = 2\nfsdp = 4", "data = 2\ntensor = 3"),
                 "parallelism.tensor=3 does not divide model.n_heads=4; choose tensor = 1 or 2 "
                 "(each divides model.n_heads=4, model.n_kv_heads=2"),
    "system": (TINY.replace('"h100:8"', '"h900:8"'),
               "unknown system family 'h900' in 'h900:8'; did you mean h200:8? valid: a100:8"),
    "system type": (TINY.replace('"h100:8"', '8'),
                    "system.name: system name 8 is not a string; give <family>:<size>, e.g."),
    "preset": (TINY.replace('"tiny"', '"llama5"'), "model.preset='llama5' is unknown; valid:"),
    "dtype": (TINY + '[precision]\ncompute = "fp16"\n',
              "precision.compute='fp16' is not one of 'bfloat16'"),
    "missing": (TINY.replace("seq_len = 32\n", ""), "missing required key workload.seq_len; "
                "add seq_len = ... under [workload] (`shardscope keys workload`"),
    "missing name": ("\n".join(ln for ln in TINY.splitlines() if not ln.startswith("name = \"t")),
                     "missing required key 'name'; add name = \"my-experiment\" at the top"),
    "missing table": (TINY.split("[workload]")[0], "missing required key 'workload' (a "
                      "[workload] section); add it (`shardscope keys workload` lists its keys"),
    "syntax": (TINY.replace("[workload]", "[workload"), "not valid TOML"),
    "batch": (TINY.replace("global_batch = 16", "global_batch = 12"),
              "not divisible by parallelism.data x parallelism.fsdp x parallelism.expert = 8 "
              "(they all shard the batch); no number of microbatches keeps the batch: "
              "workload.global_batch=12 is not a multiple of the 8 data-parallel ranks"),
    # the global batch is what the user means: the fix changes the number of microbatches
    # (global_batch = micro-batch x data-parallel x microbatches), not the global batch
    "batch kept": (TINY.replace("global_batch = 16", "global_batch = 16\nmicrobatches = 4"),
                   "the micro-batch of 4 sequences (workload.global_batch=16 / "
                   "workload.microbatches=4) is not divisible by parallelism.data x "
                   "parallelism.fsdp x parallelism.expert = 8 (they all shard the batch); keep "
                   "workload.global_batch=16 and set workload.microbatches to 1 or 2 "
                   "(global_batch = micro-batch per data-parallel rank x 8 data-parallel "
                   "ranks x microbatches, Megatron's num_microbatches), e.g. microbatches = 2"),
    "microbatches": (TINY.replace("global_batch = 16", "global_batch = 16\nmicrobatches = 3"),
                     "workload.microbatches=3 does not divide workload.global_batch=16; keep "
                     "workload.global_batch=16 and set workload.microbatches to 1 or 2"),
    # an interleaved pipeline takes at least one microbatch per stage: 1 is no choice
    "interleaved microbatches": (
        TINY.replace("data = 2\nfsdp = 4", "data = 4\npipeline = 2\nvirtual_stages = 2")
        .replace('preset = "tiny"', 'preset = "tiny"\nn_layers = 4'),
        "interleaved stages (parallelism.virtual_stages=2) need at least as many microbatches "
        "as stages: workload.microbatches=1 < parallelism.pipeline=2; keep "
        "workload.global_batch=16 and set workload.microbatches to 2 or 4"),
    "experts": (TINY.replace("[system]", "n_experts = 4\nexperts_per_token = 2\n[system]")
                .replace("data = 2\nfsdp = 4", "expert = 8"),
                "parallelism.expert=8 does not divide model.n_experts=4; choose expert = 1, 2 "
                "or 4 (each divides model.n_experts=4 and the 8 devices), e.g. expert = 4 "
                "with data = 2"),
    "moe+cp": (TINY.replace("[system]", "n_experts = 4\nexperts_per_token = 2\n[system]")
               .replace("data = 2\nfsdp = 4", "data = 4\nsequence = 2"),
               "parallelism.sequence=2 with a mixture of experts"),
    "fp4 on hopper": (TINY + '[precision]\ncompute = "float4"\n',
                      "precision.compute='float4': h100 has no FP4 tensor cores"),
    "int8 train": (TINY + '[precision]\nweights = "int8"\n',
                   "precision.weights='int8' applies to serving"),
    "type": (TINY.replace("data = 2", 'data = "two"'),
             "parallelism.data='two' must be an integer: write it as a number, e.g. data = 1"),
    "bool": (TINY.replace("fsdp = 4", 'fsdp = 4\nsequence_parallel = "no"'),
             "parallelism.sequence_parallel='no' must be true or false (lower case, as TOML "
             "writes it: sequence_parallel = true)"),
    "choice typo": (TINY + '[train]\nremat = "fulll"\n',
                    "train.remat='fulll' is not one of 'none', 'minimal', 'full', 'custom' "
                    "(did you mean 'full'?)"),
    "serving bool": (TINY + '[serving]\ncuda_graphs = "yes"\n',
                     "serving.cuda_graphs='yes' must be true or false (lower case, as TOML "
                     "writes it: cuda_graphs = true)"),
    "serving key": (TINY + "[serving]\ncuda_graph = false\n",
                    "unknown key 'serving.cuda_graph'; did you mean 'serving.cuda_graphs'? "
                    "valid keys in [serving]: cuda_graphs"),
    "override key": (TINY.replace('name = "h100:8"', 'name = "h100:8"\nnic_gb = 100'),
                     "unknown key 'system.nic_gb'; did you mean 'system.nic_gbps'? valid keys in "
                     "[system]: allreduce_alpha_us, dcn_gbps, fabric, gpus_per_domain, name, "
                     "nic_gbps, nvls, pod_gpus, pod_oversubscription, sharp"),
    "override value": (TINY.replace('name = "h100:8"', 'name = "h100:8"\nsharp = "yes"'),
                       "[system]: system override sharp='yes' must be true or false"),
    "measured": (TINY + "[measured]\nstep_time_s = -1\n",
                 "measured.step_time_s=-1 must be above 0"),
    # TOML's nan and inf are floats: they passed the check and ended a fit after compiling
    "measured nan": (TINY + "[measured]\nstep_time_s = nan\n",
                     "measured.step_time_s=nan must be above 0 and finite"),
    "measured inf": (TINY + "[measured]\nstep_time_s = inf\n",
                     "measured.step_time_s=inf must be above 0 and finite"),
    "measured mfu": (TINY + "[measured]\nstep_time_s = 1\nmfu = -inf\n",
                     "measured.mfu=-inf must be a finite number, 0 or above"),
    # Transformer Engine's userbuffers hide sequence parallelism's collectives; Megatron
    # refuses --tp-comm-overlap without --sequence-parallel
    "tp overlap without sp": (TINY.replace("fsdp = 4", "fsdp = 4\ntp_comm_overlap = true"),
                              "parallelism.tp_comm_overlap=true overlaps sequence "
                              "parallelism's all-gathers and reduce-scatters over tensor"),
    # tiny's 2 layers over 8 stages of one slot: 3 empty before the first layer and 3 after
    # the last (models/pipeline.py pads both ends); uneven stages are fine, idle ones not
    "idle stages": (TINY.replace("data = 2\nfsdp = 4", "pipeline = 8")
                    .replace("global_batch = 16", "global_batch = 16\nmicrobatches = 8"),
                    "parallelism.pipeline=8 x virtual_stages=1 over model.n_layers=2 leaves 6 "
                    "of the 8 stages without a layer; use fewer stages (at most 2) or more "
                    "layers"),
    # 80 layers on 4 stages are 20 a stage; 3 virtual stages round up to chunks of 7, 21
    # slots a stage whose empty one SPMD still runs: 5% more layer work than the model
    # has, a split Megatron-LM refuses (num_layers_per_pipeline_rank % vp_size); the
    # choices divide the 20 layers a stage
    "virtual chunks": (TINY.replace("data = 2\nfsdp = 4", "pipeline = 4\nvirtual_stages = 3\n"
                                    "data = 2").replace("preset = \"tiny\"",
                                                        "preset = \"tiny\"\nn_layers = 80")
                       .replace("global_batch = 16", "global_batch = 16\nmicrobatches = 8"),
                       "parallelism.virtual_stages=3 does not split the 20 layers a stage "
                       "(model.n_layers=80 over parallelism.pipeline=4) into equal chunks: "
                       "chunks of 7 give every stage 21 layer slots, 5% more layer work than "
                       "the model has, and Megatron-LM refuses it; choose virtual_stages 1, 2, "
                       "4, 5, 10, 20"),
    # Megatron's --cp-comm-type names the ring p2p: said, with shardscope's name
    "context mode": (TINY.replace("fsdp = 4", 'fsdp = 4\ncontext_mode = "p2p"'),
                     "parallelism.context_mode='p2p' is not one of ring, allgather; "
                     "Megatron's / MaxText's 'p2p' is 'ring'"),
    "rules": (TINY.replace("fsdp = 4", 'fsdp = 4\nrules = "megatron"'),
              "parallelism.rules='megatron' is not a rule preset; valid: default"),
    # decode writes the token after the cache's seq_len positions: position seq_len
    "learned positions": (TINY.replace("seq_len = 32", 'seq_len = 32\nkind = "decode"')
                          .replace('preset = "tiny"', 'preset = "tiny"\npositions = '
                                   '"learned"\nmax_seq_len = 32'),
                          "workload.seq_len=32 needs 33 positions (the cache and the new "
                          "token), past model.max_seq_len=32 of the learned position table; "
                          "set workload.seq_len <= 31"),
    "dropless sentinel": (TINY.replace('preset = "tiny"', 'preset = "tiny"\nn_experts = 4\n'
                                       'experts_per_token = 2\ncapacity_factor = 0'),
                          "for no dropped tokens set model.dropless = true"),
    # the loss takes every num_vocab_tiling-th position into a tile (models/train.py)
    "vocab tiling": (TINY + "[train]\nnum_vocab_tiling = 3\n",
                     "train.num_vocab_tiling=3 does not divide workload.seq_len=32; choose "
                     "one of 1, 2, 4, 8, 16, 32"),
}


def test_fit_refuses_what_run_refuses(tmp_path, capsys):
    # `fit --no-compile` sizes the config with the memory model alone, which never traces
    # the loss: the divisibility check has to be the config's, or fit gave a verdict
    text, message = BAD["vocab tiling"]
    code, out, err = run_cli(["fit", write(tmp_path, text), "--no-compile"], capsys)
    assert code == 2 and message in err and err.count("\n") == 1 and not out


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_one_clear_line(tmp_path, capsys, case):
    text, message = BAD[case]
    code, out, err = run_cli(["run", write(tmp_path, text)], capsys)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_missing_file_and_bad_override(tmp_path, capsys):
    code, _, err = run_cli(["run", str(tmp_path / "nope.toml")], capsys)
    assert code == 2 and "not found" in err
    code, _, err = run_cli(["run", write(tmp_path, TINY), "--set", "parallelism"], capsys)
    assert code == 2 and "expected key=value" in err
    # Python's spelling of false is not TOML's: refused, not read as a true string
    code, _, err = run_cli(["run", write(tmp_path, TINY), "--set",
                            "parallelism.tp_comm_overlap=False"], capsys)
    assert code == 2 and "parallelism.tp_comm_overlap='False' must be true or false" in err
    code, _, err = run_cli(["run", write(tmp_path, TINY), "--set", "serving.cuda_graphs=1"],
                           capsys)
    assert code == 2 and err.count("\n") == 1
    assert "serving.cuda_graphs=1 must be true or false" in err


def test_every_shipped_config_is_valid():
    from experiments import config

    paths = sorted((REPO / "experiments" / "configs").glob("*.toml"))
    assert len(paths) >= 5
    for p in paths:
        exp = config.load(p)
        assert exp.name == p.stem, f"{p.name}: name should match the file name"


@pytest.mark.parametrize("text, fragment", [
    ("[parameters]\nmatmul = 0.5\n", "unknown calibration parameter 'matmul'"),
    ("[parameters]\ntpu_matmul_scale = 3.0\n", "cal.toml: calibration tpu_matmul_scale=3.0"),
    # the values at the top, or under a misspelled table: refused, not read as uncalibrated
    ("tpu_matmul_scale = 0.8\n", "unknown table or key 'tpu_matmul_scale'"),
    ("[parameter]\ntpu_matmul_scale = 0.8\n", "unknown table or key 'parameter'"),
    ("[provenance]\nsummary = \"x\"\n", "no \\[parameters\\] table"),
    ("parameters = 3\n", "no \\[parameters\\] table"),
    ("[parameters]\n[best_measured_mfu]\n\"tpu-v6e\" = 0.5\n",
     "best_measured_mfu\\] tpu-v6e = 0.5: write each family as"),
    # a ceiling of 0 (or nan) flagged every estimate of the family "suspect"
    ("[parameters]\n[best_measured_mfu]\n\"h100 bf16\" = { mfu = 0, run = \"r\" }\n",
     "h100 bf16 mfu = 0: a measured MFU is a fraction above 0"),
    ("[parameters]\n[best_measured_mfu]\n\"h100 bf16\" = { mfu = nan, run = \"r\" }\n",
     "h100 bf16 mfu = nan: a measured MFU"),
])
def test_bad_calibration_files_are_one_line(tmp_path, text, fragment):
    p = tmp_path / "cal.toml"
    p.write_text(text)
    with pytest.raises(ValueError, match=fragment) as e:
        load_calibration(p)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not found"):
        load_calibration(tmp_path / "missing.toml")


def test_any_model_field_overrides_a_preset_its_name_too():
    from experiments import config

    exp = config.load("tiny-h100-dp-tp", ['model.preset="llama3-8b"', 'model.name="my-8b"',
                                          "model.n_layers=2"])
    assert (exp.model.name, exp.model.n_layers, exp.model.d_model) == ("my-8b", 2, 4096)


def test_a_calibration_file_without_ceilings_keeps_the_catalogs(tmp_path):
    from meshes.calibration import catalog_calibration

    p = tmp_path / "cal.toml"
    p.write_text("[parameters]\ntpu_matmul_scale = 0.8\n")
    cal = load_calibration(p)
    assert cal.tpu_matmul_scale == 0.8 and cal.best_mfu == catalog_calibration().best_mfu
    p.write_text('[parameters]\n[best_measured_mfu]\n"h100" = { mfu = 0.5, run = "mine" }\n')
    assert load_calibration(p).best_mfu == {"h100": (0.5, "mine")}


def test_a_preset_on_the_command_line_replaces_the_files_model_table():
    # tiny-h100-dp-tp.toml gives preset = "tiny" with n_kv_heads = 4 (tensor = 4 needs it);
    # --set model.preset=llama3-8b asks for Llama 3 8B, not Llama 3 8B with tiny's 4 KV heads
    from experiments import config
    from models.config import preset

    exp = config.load("tiny-h100-dp-tp", ["model.preset=llama3-8b",
                                          "parallelism.data=8", "parallelism.tensor=1"])
    assert exp.model == preset("llama3-8b") and exp.model_label == "llama3-8b"
    # the file's own model is labelled with the field it changes
    assert config.load("tiny-h100-dp-tp").model_label == "tiny (n_kv_heads 4)"


@pytest.mark.parametrize("name, new, kept, label", [
    ("nemo-llama2-7b-fp8-h100-8", "llama2-13b", {"fused_qkv": True, "fused_mlp": True},
     "llama2-13b (fused_qkv true, fused_mlp true)"),
    ("llama3-70b-gb200-100k-tp4-pp8", "llama3-405b", {"fused_qkv": True, "fused_mlp": True},
     "llama3-405b (fused_qkv true, fused_mlp true)"),
    ("deepseek-v3-v5p-512-ep", "qwen3-235b-a22b", {"capacity_factor": 1.0},
     "qwen3-235b-a22b (capacity_factor 1.0)"),
])
def test_a_preset_on_the_command_line_keeps_the_files_run_settings(name, new, kept, label):
    # the file's fused weights and capacity factor say how it runs a model, not which:
    # --set model.preset=NEW is NEW's shape run as the file runs its own (before: the
    # whole [model] table was left out, fused_qkv/fused_mlp true -> false, capacity_factor
    # 1.0 -> 1.25, and the header named the bare preset)
    from experiments import config
    from models.config import preset

    raw = config.load_raw(name, [f"model.preset={new}"])
    assert raw["model"] == {"preset": new, **kept}
    exp = config.unchecked(raw)  # the model alone: a mesh the new model fits is not the point
    assert exp.model == preset(new, **kept) and exp.model_label == label


def test_an_hf_config_on_the_command_line_keeps_the_files_run_settings_too():
    from experiments import config

    hf_json = str(REPO / "experiments/configs/hf/qwen3-235b-a22b.json")
    exp = config.unchecked(config.load_raw("deepseek-v3-v5p-512-ep",
                                           [f'model.hf_config="{hf_json}"']))
    assert exp.model.capacity_factor == 1.0 and exp.model.kv_lora_rank == 0
    assert exp.model_label == "hf_config qwen3-235b-a22b.json (capacity_factor 1.0)"


def test_an_experiment_rebuilt_from_its_tables_keeps_its_models_label_and_notes():
    # fit's changes and the runner's fewer replicas rebuild the experiment from its tables
    # as run, which name no preset: the model is the same, and so are its label and the
    # preset's notes (before: the notes were dropped)
    from experiments import config, fit

    exp = config.load("deepseek-v3-v5p-512-ep")
    assert exp.notes and exp.model_label == "deepseek-v3 (capacity_factor 1.0)"
    new = fit._changed(exp, {"train.remat": "none"})
    assert new.train.remat == "none"
    assert (new.model_label, new.notes) == (exp.model_label, exp.notes)


@pytest.mark.parametrize("order", ["set first", "preset first"])
def test_model_keys_given_on_the_command_line_stay_with_the_new_preset(order):
    from experiments import config

    sets = ["model.n_layers=2", "model.preset=llama3-8b", "model.n_kv_heads=8"]
    if order == "preset first":
        sets = sets[1:2] + sets[:1] + sets[2:]
    exp = config.load("tiny-h100-dp-tp", [*sets, "parallelism.data=8", "parallelism.tensor=1"])
    assert (exp.model.n_layers, exp.model.n_kv_heads, exp.model.d_model) == (2, 8, 4096)
    # n_kv_heads = 8 is the preset's own: not a change, so not in the label
    assert exp.model_label == "llama3-8b (n_layers 2)"


def test_an_hf_config_on_the_command_line_replaces_the_files_preset():
    # before: "model.preset='tiny' and model.hf_config=... are both given", from the file's
    # preset the user never meant to keep
    from experiments import config

    hf_json = str(REPO / "experiments/configs/hf/deepseek-v3.json")
    exp = config.load("tiny-h100-dp-tp", [f'model.hf_config="{hf_json}"', "model.n_layers=4",
                                          "parallelism.data=8", "parallelism.tensor=1"])
    assert exp.model.n_layers == 4 and exp.model.kv_lora_rank == 512
    assert exp.model_label == "hf_config deepseek-v3.json (n_layers 4)"


def test_a_searched_preset_replaces_the_files_model_table_too():
    # search --vary model.preset=...: each config's model is the preset with the command
    # line's model keys, as with --set
    from experiments import config, search

    raw = config.load_raw("tiny-h100-dp-tp", ["model.n_layers=2"], varied=["model.preset"])
    cands = search.enumerate_candidates(raw, 8, ("data",), [("model.preset",
                                                             ["tiny", "llama3-8b"])])
    models = {c.varied["model.preset"]: c.exp.model for c in cands}
    assert models["tiny"].n_kv_heads == 2 and models["llama3-8b"].n_kv_heads == 8
    assert models["tiny"].n_layers == models["llama3-8b"].n_layers == 2
