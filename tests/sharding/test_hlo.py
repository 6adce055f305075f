"""The HLO parser (sharding/hlo.py): shapes, and one clear error for anything damaged."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharding.hlo import HloParseError, parse_hlo, parse_shape
from tests.conftest import DATA


@pytest.mark.parametrize("text, dtype, dims, nbytes", [
    ("bf16[32,128,128]{2,1,0:T(8,128)(2,1)S(1)}", "bf16", (32, 128, 128), 32 * 128 * 128 * 2),
    ("f8e4m3fn[16,16]{1,0}", "f8e4m3fn", (16, 16), 256),
    ("s4[3]", "s4", (3,), 2),
    ("f4e2m1fn[8]", "f4e2m1fn", (8,), 4),
    ("pred[]", "pred", (), 1),
])
def test_shapes(text, dtype, dims, nbytes):
    (a,) = parse_shape(text)
    assert (a.dtype, a.dims, a.nbytes) == (dtype, dims, nbytes)


def test_tuple_shape():
    arrays = parse_shape("(bf16[32,128]{1,0}, (f32[4]{0}, u32[]))")
    assert [a.dtype for a in arrays] == ["bf16", "f32", "u32"]


def test_truncated_hlo_names_the_line():
    text = (DATA / "collectives.cpu-after-spmd.hlo").read_text()
    cut = text[: len(text) * 2 // 3]
    cut = cut[: cut.rfind("\n")]
    with pytest.raises(HloParseError, match=r"HLO line \d+"):
        parse_hlo(cut)


def test_corrupted_instruction_names_the_line():
    bad = "HloModule m\n\nENTRY %main (p: f32[2]) -> f32[2] {\n  %p = f32[2] parameter(0)\n" \
          "  ROOT %x = f32[2] add(%p, %p\n}\n"
    with pytest.raises(HloParseError, match="HLO line 5"):
        parse_hlo(bad)


def test_not_hlo_at_all():
    with pytest.raises(HloParseError, match="no HLO computations"):
        parse_hlo("hello world\n")


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=0, max_size=400))
def test_garbage_never_raises_anything_but_a_parse_error(blob):
    text = "HloModule x\n\nENTRY %m () -> f32[] {\n  " + blob.decode("latin-1") + "\n}\n"
    try:
        parse_hlo(text)
    except HloParseError:
        pass


@pytest.mark.parametrize("op_name, operation", [
    ("jit(step)/transpose(jvp())/while/body/closed_call/checkpoint/attention/out_proj/"
     "blhe,hed->bld/dot_general", "attention/out_proj (backward)"),
    ("jit(step)/jvp()/while/body/closed_call/mlp/up_proj/bld,df->blf/dot_general",
     "mlp/up_proj (forward)"),
    ("jit(step)/transpose(jvp())/while/body/closed_call/checkpoint/rematted_computation/"
     "attention/qkv_proj/bld,dke->blke/dot_general", "attention/qkv_proj (recomputed)"),
    ("jit(step)/jvp(embedding)/jit(_take)/gather", "embedding (forward)"),
    ("jit(step)/transpose(jvp(lm_head))/bld,dv->blv/dot_general", "lm_head (backward)"),
    ("jit(coll)/shard_map/while/body/closed_call/psum", "psum (forward)"),
    # JAX's own plumbing outside the model's scopes reads as what it does.
    ("jit(step)/transpose(jvp())/while/body/dynamic_update_index_in_dim",
     "layer scan: stacking per-layer values (backward)"),
    ("jit(step)/while", "loop control (forward)"),
    # a custom VJP's scope inside the same scope reads once; the step's gradient sums end
    # its backward pass and the optimizer is the update
    ("jit(step)/jvp()/while/body/closed_call/attention/fused_norm/fused_norm/convert",
     "attention/fused_norm (forward)"),
    ("jit(step)/gradient_sum/reduce_sum", "gradient_sum (backward)"),
    ("jit(step)/optimizer/mul", "optimizer (update)"),
    ("convert.41", "convert (forward)"),
    # XLA:GPU's combined collectives name their members after a common prefix
    ("jit(step)/jvp()/while/body/closed_call/(attention/q_proj/bsd,dhk->bshk/dot_general:"
     "attention/k_proj/bsd,dhk->bshk/dot_general:mlp/up_proj/bsd,df->bsf/dot_general)",
     "attention/q_proj (forward) + attention/k_proj (forward) + mlp/up_proj (forward)"),
    ("jit(step)/transpose(jvp())/while/body/closed_call/checkpoint/(rematted_computation/"
     "mlp/bsd,df->bsf/dot_general:mlp/bsf,fd->bsd/dot_general:mlp/bsd,df->bsf/dot_general)",
     "mlp (recomputed) + mlp (backward)"),
    ("jit(step)/(jvp(lm_head)/dot_general:transpose(jvp(lm_head))/dot_general)",
     "lm_head (forward) + lm_head (backward)"),
    ("jit(step)/(a/x:a/y)", "a (forward)"),
    ("jit(step)/transpose(jvp(lm_head))/dot_general", "lm_head (backward)"),
    ("", "compiler-made (no op_name)"),
])
def test_operation_of(op_name, operation):
    from sharding.hlo import operation_of

    assert operation_of(op_name) == operation


def test_tuple_element_operands_of_newer_xla_read_as_get_tuple_element():
    # XLA with jax 0.11 prints a tuple's element as an operand `%t#2` in place of a
    # get-tuple-element instruction; each becomes one, nested references too.
    text = """HloModule m

ENTRY %main (p: (f32[2], (s32[], f32[4]))) -> f32[4] {
  %p = (f32[2]{0}, (s32[], f32[4]{0})) parameter(0)
  %a = f32[4]{0} negate(%p#1#1)
  ROOT %b = f32[4]{0} add(%a, %p#1#1)
}
"""
    comp = parse_hlo(text).computations["main"]
    assert [(i.name, i.opcode, i.operands, i.shape_text) for i in comp.instructions[:3]] == [
        ("p", "parameter", ["0"], "(f32[2]{0}, (s32[], f32[4]{0}))"),
        ("p#1", "get-tuple-element", ["p"], "(s32[], f32[4]{0})"),
        ("p#1#1", "get-tuple-element", ["p#1"], "f32[4]{0}")]
    assert comp.by_name["p#1#1"].attr("index") == "1"
    with pytest.raises(HloParseError, match=r"%p#3, an element %p does not have"):
        parse_hlo(text.replace("%p#1#1)", "%p#3)", 1))


def test_a_real_h200_module_its_matmul_flops_derived():
    # XLA:GPU's optimised module of four Llama 3 8B layers (bf16, 4 x 4096 tokens, full
    # remat) as `shardscope measure` compiled it on an H200 (benchmarks/measure_gpu.sh,
    # jax 0.11.2): tuple-element operands, cuBLAS GEMM calls, command-buffer-era fusions.
    import gzip

    from sharding.compute import work
    from sharding.loops import execution_counts

    module = parse_hlo(gzip.decompress(
        (DATA / "llama3-8b-4layers.gpu-h200.hlo.gz").read_bytes()).decode())
    counts = execution_counts(module)
    flops = sum(m.flops * counts.get(name, 0)
                for name, w in work(module).items() for m in w.matmuls)
    tokens, layers, d, kv, ffn, vocab = 4 * 4096, 4, 4096, 1024, 14336, 128256
    layer = d * d * 2 + d * kv * 2 + 3 * d * ffn  # q, o; k, v; gate, up, down
    # forward, recomputed forward and backward's two GEMMs, less the recomputed down
    # projection (the backward needs its input, not its output: XLA drops it)
    weights = 2 * tokens * (4 * layers * layer - layers * d * ffn)
    head = 2 * tokens * 3 * d * vocab  # forward, two backward GEMMs (not rematerialised)
    # flash attention: 36 of the 8 x 8 tiles of 512 (the causal half and the diagonal),
    # two GEMMs of 2 x 512 x 512 x 128 per head and sequence forward, twice (the remat), and
    # five in the backward (the recomputed scores, dV, dP, dQ, dK)
    tile = 2 * 512 * 512 * 128 * 4 * 32
    attention = layers * 36 * tile * (2 + 2 + 5)
    assert flops == weights + head + attention


REPLICAS = """HloModule ddp_step, entry_computation_layout={(f32[1024]{0})->f32[1024]{0}}, \
replica_count=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %ar = f32[1024]{0} all-reduce(%p0), channel_id=1, replica_groups={}, to_apply=%add
}
"""


def test_a_replica_mode_dump_runs_on_its_replicas():
    # PyTorch/XLA DDP and older pmap dumps have replica_count=8 and no num_partitions: 8
    # devices, the empty replica groups all 8 of them, the all-reduce of 1024 f32 timed on
    # the 8 H100s as any all-reduce over them.
    import meshes
    import sharding

    assert parse_hlo(REPLICAS).num_partitions == 8
    rep = sharding.analyze_hlo(REPLICAS, system="h100:8")
    (c,) = rep.collectives
    assert (rep.num_devices, c.group_size, c.bytes) == (8, 8, 1024 * 4)
    h100 = meshes.get_system("h100:8")
    assert c.time_s == h100.collective_timing("all-reduce", 4096, [list(range(8))]).time_s > 0
    both = REPLICAS.replace("replica_count=8", "replica_count=2, num_partitions=4")
    with pytest.raises(HloParseError, match=r"runs 2 replicas of 4 partitions .*dump the "
                                            r"program with SPMD partitioning alone"):
        parse_hlo(both)
