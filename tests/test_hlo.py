"""The HLO parser on real compiler output and on generated replica groups."""

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sharding
from sharding.collectives import extract_collectives
from sharding.hlo import HloParseError, parse_hlo, parse_shape
from sharding.loops import trip_counts
from sharding.replica_groups import parse_replica_groups
from tests.conftest import DATA

MESH = ((2, 4, 2), ("data", "fsdp", "tensor"))

# tests/data/collectives.*.hlo: shard_map over mesh (data 2, fsdp 4, tensor 2), per-device
# bf16[32,128,128] = 1 MiB, inside a scan of length 3 (README in shared/reference/hlo):
PER_DEVICE = 32 * 128 * 128 * 2
EXPECTED = {
    # kind: (mesh axes, bytes per execution per the design.md convention)
    "all-reduce": (("tensor",), PER_DEVICE),  # psum over tensor: the buffer
    "all-gather": (("fsdp",), 4 * PER_DEVICE),  # gathered output over 4 devices
    "reduce-scatter": (("fsdp",), 4 * PER_DEVICE),  # its input: the gathered 4 MiB
    "all-to-all": (("data",), PER_DEVICE),  # input buffer
    "collective-permute": (("fsdp",), PER_DEVICE),  # what each device sends
}


@pytest.mark.parametrize("backend", ["cpu-after-spmd", "gpu-h100", "tpu-v5e", "tpu7x"])
def test_collectives_program_on_every_backend(backend):
    module = parse_hlo((DATA / f"collectives.{backend}.hlo").read_text())
    cols, unknown = extract_collectives(module, mesh_shape=MESH[0], axis_names=MESH[1])
    assert unknown == []
    by_kind = {c.kind: c for c in cols}
    assert sorted(by_kind) == sorted(EXPECTED)
    assert len(cols) == 5  # async -start/-done pairs counted once
    for kind, (axes, nbytes) in EXPECTED.items():
        c = by_kind[kind]
        assert c.dtype == "bfloat16", kind
        assert c.bytes == nbytes, kind
        assert c.count == 3, kind  # the scan's trip count
        if backend != "tpu7x":  # TPU7x numbers its 16 devices differently (2 per chip)
            assert c.mesh_axes == axes, kind


def test_cpu_final_hlo_promoted_reductions_count_at_the_programs_dtype():
    # XLA:CPU's final HLO runs the bf16 psum and psum_scatter in f32 (their reducers are
    # `*_promoted`): counted at bf16, as after SPMD partitioning; the warning says so and
    # that the three other f32 collectives (gather, all-to-all, permute) may be promoted too.
    final = parse_hlo((DATA / "collectives.cpu.hlo").read_text())
    cols, _ = extract_collectives(final)
    by_kind = {c.kind: c for c in cols}
    for kind in ("all-reduce", "reduce-scatter"):
        c = by_kind[kind]
        assert (c.dtype, c.compiled_dtype, c.bytes) == \
            ("bfloat16", "float32", EXPECTED[kind][1]), kind
    assert by_kind["all-gather"].dtype == "float32"  # as the dump shows, flagged below
    rep = sharding.analyze_hlo((DATA / "collectives.cpu.hlo").read_text(), system="h100:16")
    (note,) = [w for w in rep.warnings if "promotes 16-bit" in w]
    assert "2 reductions" in note and "other 3 f32 collectives" in note
    clean = sharding.analyze_hlo((DATA / "collectives.cpu-after-spmd.hlo").read_text(),
                                 system="h100:16")
    assert not any("promotes" in w for w in clean.warnings)


def test_train_step_fixture_trip_counts_and_no_unknown_ops():
    module = parse_hlo((DATA / "train_step.cpu-after-spmd.hlo").read_text())
    trips = sorted(n for n, _ in trip_counts(module).values())
    assert trips == [4, 4]  # forward and backward scans over 4 layers
    cols, unknown = extract_collectives(module, mesh_shape=MESH[0], axis_names=MESH[1])
    assert unknown == []
    assert any(c.count == 4 and c.kind == "all-gather" and c.mesh_axes == ("fsdp",) for c in cols)


def test_analyze_hlo_maps_groups_and_times_them():
    rep = sharding.analyze_hlo((DATA / "collectives.tpu-v5e.hlo").read_text(),
                               system="tpu-v5e:4x4", mesh_shape=MESH[0], axis_names=MESH[1])
    assert rep.by_kind()["all-gather"] == 3 * 4 * PER_DEVICE
    assert all(c.link == "ici" and c.time_s > 0 for c in rep.collectives)


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


def test_replica_group_forms():
    assert parse_replica_groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert parse_replica_groups("{}", 4) == [[0, 1, 2, 3]]
    assert parse_replica_groups("[2,2]<=[4]") == [[0, 1], [2, 3]]
    assert parse_replica_groups("[2,2]<=[2,2]T(1,0)") == [[0, 2], [1, 3]]
    # XLA's mesh-axes form: mesh (a=2, b=2), groups over b -> rows of the iota mesh.
    assert parse_replica_groups("mesh['a'=2,'b'=2] {'b'}") == [[0, 1], [2, 3]]
    assert parse_replica_groups("mesh['a'=2,'b'=2] {'a'}") == [[0, 2], [1, 3]]
    assert parse_replica_groups("mesh['a'=1,'b'=4]", None, "([2,2]T(1,0)) {'b'}") == [[0, 2, 1, 3]]


@st.composite
def iota_case(draw):
    dims = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    perm = draw(st.permutations(range(len(dims))))
    n = math.prod(dims)
    group = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    return dims, list(perm), n // group, group


@settings(max_examples=200, deadline=None)
@given(iota_case())
def test_iota_groups_partition_the_devices(case):
    dims, perm, g, s = case
    text = f"[{g},{s}]<=[{','.join(map(str, dims))}]T({','.join(map(str, perm))})"
    groups = parse_replica_groups(text)
    assert len(groups) == g and all(len(x) == s for x in groups)
    assert sorted(i for x in groups for i in x) == list(range(g * s))
    expected = np.arange(g * s).reshape(dims).transpose(perm).reshape(g, s).tolist()
    assert groups == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4095), min_size=1, max_size=6), min_size=1, max_size=6))
def test_explicit_groups_round_trip(groups):
    text = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"
    assert parse_replica_groups(text) == groups


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_mesh_axes_groups_vary_only_along_their_axes(sizes, data):
    names = [f"axis_{i}" for i in range(len(sizes))]
    chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    text = "mesh[" + ",".join(f"'{n}'={s}" for n, s in zip(names, sizes)) + "] {" + \
        ",".join(f"'{c}'" for c in chosen) + "}"
    groups = parse_replica_groups(text)
    assert sorted(i for g in groups for i in g) == list(range(math.prod(sizes)))
    for g in groups:
        coords = np.stack(np.unravel_index(g, sizes), axis=1)
        fixed = [i for i, n in enumerate(names) if n not in chosen]
        assert (coords[:, fixed] == coords[0, fixed]).all()


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=0, max_size=400))
def test_garbage_never_raises_anything_but_a_parse_error(blob):
    text = "HloModule x\n\nENTRY %m () -> f32[] {\n  " + blob.decode("latin-1") + "\n}\n"
    try:
        parse_hlo(text)
    except HloParseError:
        pass


def _mutate(text: str, data) -> str:
    """One damage of the kinds a hand-edited or cut dump has: a line cut short, a character
    flipped, a line dropped, numbers in replica groups or pairs changed."""
    lines = text.splitlines()
    i = data.draw(st.integers(0, len(lines) - 1))
    kind = data.draw(st.sampled_from(["cut", "flip", "drop", "groups"]))
    if kind == "cut":
        lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])))]
    elif kind == "flip" and lines[i]:
        j = data.draw(st.integers(0, len(lines[i]) - 1))
        lines[i] = lines[i][:j] + data.draw(st.sampled_from("{}[](),=%0179x")) + lines[i][j + 1:]
    elif kind == "drop":
        del lines[i]
    else:
        rows = [n for n, ln in enumerate(lines) if "replica_groups=" in ln
                or "source_target_pairs=" in ln]
        if rows:
            n = data.draw(st.sampled_from(rows))
            new = data.draw(st.sampled_from(["0", "1", "15", "16", "99", "4096"]))
            lines[n] = re.sub(r"(groups=\{\{|pairs=\{\{)\d+", rf"\g<1>{new}", lines[n])
    return "\n".join(lines)


FUZZ_FIXTURES = {"collectives.cpu.hlo": "h100:16", "collectives.gpu-h100.hlo": "h100:16",
                 "collectives.tpu-v5e.hlo": "tpu-v5e:4x4", "collectives.tpu7x.hlo": "tpu7x:2x2x2",
                 "train_step.cpu-after-spmd.hlo": "h100:16",
                 "train_step.gpu-h100.hlo": "h100:16", "train_step.tpu-v5e.hlo": "tpu-v5e:4x4"}


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(FUZZ_FIXTURES)), st.data())
def test_damaged_dumps_analyse_or_get_one_clear_error(fixture, data):
    # Every mutation of a real dump either analyses or raises a ValueError (the CLI's one
    # line), never an IndexError or KeyError from deep inside (a replica group naming a
    # device the program lacks used to end in an IndexError).
    text = (DATA / fixture).read_text()
    for _ in range(data.draw(st.integers(1, 3))):
        text = _mutate(text, data)
    try:
        sharding.analyze_hlo(text, system=FUZZ_FIXTURES[fixture])
    except ValueError as e:
        assert str(e).strip() and "\n" not in str(e).strip()


def test_a_replica_group_naming_a_missing_device_is_one_error():
    text = (DATA / "collectives.gpu-h100.hlo").read_text()
    bad = re.sub(r"replica_groups=\{\{0,", "replica_groups={{99,", text, count=1)
    with pytest.raises(ValueError, match="name partition 99, but the program runs on 16"):
        sharding.analyze_hlo(bad, system="h100:16")


def test_operands_after_index_comments_are_read():
    # Long operand lists carry `/*index=5*/%name`: the name is the operand.
    (inst,) = [i for c in parse_hlo(RARE.replace("(%cb, %o, %off, %sz, %off, %sz)",
                                                 "(%cb, %o, %off, %sz, /*index=4*/%off, %sz)"))
               .computations.values() for i in c.instructions if i.name == "r"]
    assert inst.operands == ["cb", "o", "off", "sz", "off", "sz"]


RARE = """HloModule rare, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: bf16[16,8], o: bf16[64,8], off: s64[4], sz: s64[4]) -> bf16[64,8] {
  %p = bf16[16,8]{1,0} parameter(0)
  %o = bf16[64,8]{1,0} parameter(1)
  %off = s64[4]{0} parameter(2)
  %sz = s64[4]{0} parameter(3)
  %cb = bf16[16,8]{1,0} collective-broadcast(%p), replica_groups={{0,1,2,3}}, metadata={op_name="bcast"}
  %r = bf16[64,8]{1,0} ragged-all-to-all(%cb, %o, %off, %sz, %off, %sz), replica_groups={{0,1,2,3}}
  %t = (bf16[16,8]{1,0}, bf16[16,8]{1,0}) all-to-all(%p, %p), replica_groups={{0,1},{2,3}}
  %w = bf16[16,8]{1,0} collective-frobnicate(%p), replica_groups={{0,1,2,3}}
  ROOT %x = bf16[64,8]{1,0} copy(%r)
}
"""


def test_rare_collectives_and_unknown_ops_are_reported():
    cols, unknown = extract_collectives(parse_hlo(RARE))
    got = {c.kind: c for c in cols}
    assert got["collective-broadcast"].bytes == 16 * 8 * 2
    assert got["collective-broadcast"].op_name == "bcast"
    assert got["ragged-all-to-all"].bytes == 64 * 8 * 2
    assert got["all-to-all"].bytes == 2 * 16 * 8 * 2  # tuple form: both buffers
    assert got["all-to-all"].group_size == 2
    assert len(unknown) == 1 and "collective-frobnicate" in unknown[0]


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
    ("convert.41", "convert (forward)"),
    ("", "compiler-made (no op_name)"),
])
def test_operation_of(op_name, operation):
    from sharding.hlo import operation_of

    assert operation_of(op_name) == operation


def test_tpu_fused_all_reduce_scatter_is_one_reduce_scatter():
    # The TPU compiler hides a reduce-scatter in a fusion calling a computation named
    # `all-reduce-scatter*` (all-reduce + dynamic-slice). Here: the gradient of a bf16
    # [512, 2048] MLP weight, 1024 columns per tensor shard, reduce-scattered over fsdp (4)
    # in each of the 4 scanned layers. S is the input buffer: 512 x 1024 x 2 bytes.
    module = parse_hlo((DATA / "train_step.tpu-v5e.hlo").read_text())
    cols, unknown = extract_collectives(module, mesh_shape=MESH[0], axis_names=MESH[1])
    assert unknown == []
    (fused,) = [c for c in cols if c.computation.startswith("all-reduce-scatter")]
    assert (fused.kind, fused.bytes, fused.count, fused.mesh_axes) == \
        ("reduce-scatter", 512 * 1024 * 2, 4, ("fsdp",))
    assert fused.wire_bytes == pytest.approx(512 * 1024 * 2 * 3 / 4)
    assert "dot_general" in fused.op_name  # attributed through the fusion that calls it
    # Async pairs in the GPU module are counted once, at -start.
    gpu = parse_hlo((DATA / "train_step.gpu-h100.hlo").read_text())
    gcols, _ = extract_collectives(gpu)
    starts = sum(1 for comp in gpu.computations.values() for i in comp.instructions
                 if i.opcode.endswith("-start") and i.opcode[:-6] in
                 ("all-gather", "all-reduce", "reduce-scatter", "collective-permute",
                  "all-to-all"))
    assert starts > 0 and len(gcols) >= starts


WINDOWED = """HloModule w, num_partitions=4, is_scheduled=true

%fused_add (a: f32[1024,1024], b: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %b = f32[1024,1024]{1,0} parameter(1)
  ROOT %s = f32[1024,1024]{1,0} add(%a, %b)
}

%windowed_dot_general_body_ag (p: (f32[1024,1024], s32[])) -> (f32[1024,1024], s32[]) {
  %p = (f32[1024,1024]{1,0}, s32[]) parameter(0)
  %acc = f32[1024,1024]{1,0} get-tuple-element(%p), index=0
  %i = s32[] get-tuple-element(%p), index=1
  %sum = f32[1024,1024]{1,0} fusion(%acc, %acc), kind=kLoop, calls=%fused_add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (f32[1024,1024]{1,0}, s32[]) tuple(%sum, %next)
}

%windowed_dot_general_cond_ag (p: (f32[1024,1024], s32[])) -> pred[] {
  %p = (f32[1024,1024]{1,0}, s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=1
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[1024,1024]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (f32[1024,1024]{1,0}, s32[]) tuple(%x, %zero)
  %w = (f32[1024,1024]{1,0}, s32[]) while(%init), condition=%windowed_dot_general_cond_ag, body=%windowed_dot_general_body_ag, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[1024,1024]{1,0} get-tuple-element(%w), index=0
}
"""


def test_windowed_einsum_loops_are_named_with_their_traffic():
    # A TPU-style windowed-einsum loop of 4 steps, each adding into a 4 MiB f32 accumulator
    # (read once, written once: 8 MiB, plus the 8-byte counter): 4 x 8.39 MB = 33.55 MB per
    # step, which XLA:CPU's gathered matmul does not have; the report says so.
    rep = sharding.analyze_hlo(WINDOWED, system="tpu-v5e:2x2")
    (note,) = [w for w in rep.warnings if "windowed-einsum" in w]
    assert "1 windowed-einsum loops" in note
    assert f"{4 * (2 * 4 * 2**20 + 8) / 1e6:.2f} MB of HBM traffic" in note
    plain = sharding.analyze_hlo(WINDOWED.replace("windowed_dot_general_", "loop_"),
                                 system="tpu-v5e:2x2")
    assert not any("windowed" in w for w in plain.warnings)
