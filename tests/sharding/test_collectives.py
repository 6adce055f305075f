"""Collectives (sharding/collectives.py) of real compiled programs on 8 fake CPU devices and
of HLO dumps from every compiler, with the expected bytes derived here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshes
import models
import sharding
from sharding.collectives import extract_collectives
from sharding.hlo import parse_hlo
from sharding.loops import trip_counts
from tests.conftest import DATA
from tests.steps import layer_matmul_params, tiny, train_program, train_report

H100 = meshes.get_system("h100:8")
F32 = 4
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


def test_an_all_reduce_sliced_through_a_reshape_is_a_reduce_scatter():
    # The SPMD partitioner's all-reduce + dynamic-slice is a reduce-scatter (XLA's
    # ReduceScatterCreator fuses the pair on GPU and TPU) also when a reshape stands
    # between them (a sum over the tensor ranks inside a pipeline stage's vmap, split over
    # the positions by sequence parallelism); a user that keeps it whole leaves it an
    # all-reduce.
    def module(user):
        return parse_hlo(f"""HloModule m, num_partitions=2

%add (a: bf16[], b: bf16[]) -> bf16[] {{
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}}

ENTRY %main (x: bf16[1,128,64]) -> bf16[] {{
  %x = bf16[1,128,64]{{2,1,0}} parameter(0)
  %ar = bf16[1,128,64]{{2,1,0}} all-reduce(%x), channel_id=1, replica_groups={{{{0,1}}}}, use_global_device_ids=true, to_apply=%add
  %r = bf16[1,1,128,64]{{3,2,1,0}} reshape(%ar)
  %zero = s32[] constant(0)
  {user}
  ROOT %t = bf16[] constant(0)
}}
""")
    sliced = "%half = bf16[1,1,64,64]{3,2,1,0} dynamic-slice(%r, %zero, %zero, %zero, " \
             "%zero), dynamic_slice_sizes={1,1,64,64}"
    whole = "%neg = bf16[1,1,128,64]{3,2,1,0} negate(%r)"
    (rs,), _ = extract_collectives(module(sliced))
    (ar,), _ = extract_collectives(module(whole))
    assert (rs.kind, rs.bytes, rs.wire_bytes) == ("reduce-scatter", 128 * 64 * 2, 64 * 64 * 2)
    assert ar.kind == "all-reduce"


# XLA:CPU's executed module (what `measure --profile` times): the FSDP gradients' all-reduces
# combined into one tuple all-reduce with the loss, each element taken out by a
# get-tuple-element, and each gradient's 1/n slice fused into its user: a dynamic-slice
# inside a fusion, or behind a fusion that only converts it to bf16.
TUPLE_HLO = """HloModule m, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%slice_half (p0: f32[16], p1: s32[]) -> f32[8] {
  %p0 = f32[16]{0} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %ds = f32[8]{0} dynamic-slice(%p0, %p1), dynamic_slice_sizes={8}
}

%wrapped_convert_computation (q0: f32[8,16]) -> bf16[8,16] {
  %q0 = f32[8,16]{1,0} parameter(0)
  ROOT %c = bf16[8,16]{1,0} convert(%q0)
}

%slice_rows (r0: s32[], r1: bf16[8,16]) -> bf16[4,16] {
  %r0 = s32[] parameter(0)
  %r1 = bf16[8,16]{1,0} parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds2 = bf16[4,16]{1,0} dynamic-slice(%r1, %r0, %zero), dynamic_slice_sizes={4,16}
}

ENTRY %main (w: f32[8,16], b: f32[16], loss: f32[], i: s32[]) -> (bf16[4,16], f32[8], f32[]) {
  %w = f32[8,16]{1,0} parameter(0)
  %b = f32[16]{0} parameter(1)
  %loss = f32[] parameter(2)
  %i = s32[] parameter(3)
  %ar = (f32[8,16]{1,0}, f32[16]{0}, f32[]) all-reduce(%w, %b, %loss), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  %g0 = f32[8,16]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[16]{0} get-tuple-element(%ar), index=1
  %g2 = f32[] get-tuple-element(%ar), index=2
  %wrapped_convert = bf16[8,16]{1,0} fusion(%g0), kind=kLoop, calls=%wrapped_convert_computation
  %rows = bf16[4,16]{1,0} fusion(%i, %wrapped_convert), kind=kLoop, calls=%slice_rows
  %half = f32[8]{0} fusion(%g1, %i), kind=kLoop, calls=%slice_half
  %mean = f32[] negate(%g2)
  ROOT %t = (bf16[4,16]{1,0}, f32[8]{0}, f32[]) tuple(%rows, %half, %mean)
}
"""


def test_a_tuple_all_reduce_whose_gradients_are_kept_in_halves_is_a_reduce_scatter():
    from sharding.profile import categories_of

    (rs,), _ = extract_collectives(parse_hlo(TUPLE_HLO))
    # the weight's 8 x 16 and the bias's 16 f32 are each kept in halves (through the convert
    # and inside the fusions); the scalar loss rides along whole, 4 of the 580 bytes
    assert (rs.kind, rs.bytes, rs.group_size) == ("reduce-scatter", (8 * 16 + 16 + 1) * 4, 2)
    # the profile files the executed instruction under the estimate's kind
    assert categories_of(parse_hlo(TUPLE_HLO))["ar"] == "reduce-scatter"
    # a user that keeps the weight whole: most of the bytes are all-reduced, and so is it
    whole = TUPLE_HLO.replace("%rows = bf16[4,16]{1,0} fusion(%i, %wrapped_convert), "
                              "kind=kLoop, calls=%slice_rows",
                              "%rows = bf16[8,16]{1,0} negate(%wrapped_convert)")
    (ar,), _ = extract_collectives(parse_hlo(whole))
    assert ar.kind == "all-reduce"


def test_pure_data_parallelism_all_reduces_exactly_the_gradients(cpu_devices):
    cfg = tiny()
    rep, _ = train_report(cfg, {"data": 8})
    kinds = {c.kind for c in rep.collectives}
    assert kinds == {"all-reduce"}
    assert all(c.mesh_axes == ("data",) for c in rep.collectives)
    # Every f32 gradient is all-reduced once per step; the only other all-reduce is the
    # 4-byte scalar loss mean.
    grads = F32 * cfg.param_count()
    total = rep.by_kind()["all-reduce"]
    assert total == grads + F32
    assert rep.collectives[0].link == "nvlink"


def test_fsdp_gathers_parameters_and_reduce_scatters_gradients(cpu_devices):
    cfg = tiny()
    rep, _ = train_report(cfg, {"fsdp": 8})
    in_loop = [c for c in rep.collectives if c.count == cfg.n_layers]
    # Each layer's matmul weights are gathered twice: in the forward pass and again when
    # full remat recomputes the forward inside the backward pass.
    gathered = sum(c.bytes * c.count for c in in_loop
                   if c.kind == "all-gather" and len(c.shape) >= 2)
    assert gathered == 2 * cfg.n_layers * F32 * layer_matmul_params(cfg)
    # Gradients are reduce-scattered over fsdp: all parameters but the embedding table, whose
    # gradient is a scatter-add the partitioner keeps shard-local behind an all-to-all.
    embedding = F32 * cfg.padded_vocab * cfg.d_model
    assert rep.by_kind()["reduce-scatter"] == F32 * cfg.param_count() - embedding
    assert all(c.mesh_axes == ("fsdp",) for c in rep.collectives)


def test_f32_master_weights_gather_and_reduce_the_embedding_in_bf16(cpu_devices):
    # f32 parameters, bf16 compute, data 2 x fsdp 4: the table is looked up in bf16, as
    # every weight is used, so its FSDP collectives and its gradient's sum over data move
    # 2-byte values (the lookup's gradient was summed in f32 over data, and Llama 3 8B's
    # table gathered in f32 over fsdp: twice the bytes of the other weights' collectives).
    cfg = tiny(tie_embeddings=False)
    mesh = sharding.make_mesh(H100, {"data": 2, "fsdp": 4})
    prog = train_program(cfg, mesh, seq_len=32, global_batch=8, params="float32",
                         compute="bfloat16")
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    table = [c for c in rep.collectives if c.shape and c.shape[0] == cfg.padded_vocab]
    assert {c.mesh_axes for c in table} == {("fsdp",), ("data",)}
    assert all(c.dtype == "bfloat16" and c.bytes == 2 * np.prod(c.shape) for c in table), \
        [(c.kind, c.mesh_axes, c.dtype) for c in table]


def test_sequence_parallel_gathers_the_norm_output_in_the_compute_dtype(cpu_devices):
    # Megatron's sequence parallelism gathers each block's normalised input in bf16; the
    # norm computes in f32 and casts, and the partitioner gathered before the cast (twice
    # the bytes on every gather of a bf16 run).
    cfg = tiny()
    mesh = sharding.make_mesh(H100, {"data": 4, "tensor": 2})
    prog = models.build_train_program(
        cfg, mesh, sharding.default_rules().with_sequence_parallel(),
        workload=models.Workload(seq_len=32, global_batch=8),
        precision=models.Precision(params="bfloat16", compute="bfloat16"), train=models.Train())
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    gathers = [c for c in rep.collectives  # (the token ids' gather aside)
               if c.kind == "all-gather" and c.mesh_axes == ("tensor",) and len(c.shape) >= 3
               and c.dtype != "int32"]
    assert gathers and {c.dtype for c in gathers} == {"bfloat16"}, \
        sorted({(c.dtype, c.op_name.rsplit("/", 2)[-2]) for c in gathers})


def test_tensor_parallel_layers_all_reduce_activations(cpu_devices):
    # Forward only, so that each all-reduce is one of Megatron's two per layer.
    cfg = tiny(n_heads=8, n_kv_heads=8, n_layers=3)
    mesh = sharding.make_mesh(H100, {"data": 2, "tensor": 4})
    rules = sharding.default_rules()
    model = nnx.eval_shape(lambda: models.make_model(cfg, models.Precision()))
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    shard = models.train.param_shardings(models.logical_axes(state), params, rules, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          params, shard)
    tokens = jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=NamedSharding(mesh, P("data")))

    def forward(p, t):
        with sharding.use_rules(rules, mesh):
            return nnx.merge(graphdef, p)(t)

    rep = sharding.analyze(forward, params, tokens, mesh=mesh, system=H100)
    layer_ars = [c for c in rep.collectives
                 if c.kind == "all-reduce" and c.mesh_axes == ("tensor",) and c.count == 3]
    # Attention output and MLP output: batch/data x seq x d_model bf16 activations each.
    per_ar = (8 // 2) * 32 * cfg.d_model * 2
    assert sorted(c.bytes for c in layer_ars) == [per_ar, per_ar]
    assert all(c.dtype == "bfloat16" and c.shape == (4, 32, cfg.d_model) for c in layer_ars)


def test_scanned_layers_multiply_per_layer_collectives(cpu_devices):
    two, _ = train_report(tiny(n_layers=2), {"fsdp": 8})
    four, _ = train_report(tiny(n_layers=4), {"fsdp": 8})
    loop2 = sum(c.total_bytes for c in two.collectives if c.count == 2)
    loop4 = sum(c.total_bytes for c in four.collectives if c.count == 4)
    assert loop4 == 2 * loop2
    assert {c.count for c in four.collectives} == {1, 4}


def test_mesh_axes_follow_a_permuted_device_order(cpu_devices):
    devs = np.array(cpu_devices)[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devs, ("data", "tensor"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def f(x):
        return shard_map(lambda b: jax.lax.psum(b, "tensor"), mesh=mesh,
                         in_specs=P("data", "tensor"), out_specs=P("data"), check_vma=False)(x)

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32,
                             sharding=NamedSharding(mesh, P("data", "tensor")))
    rep = sharding.analyze(f, x, mesh=mesh, system=H100)
    (c,) = rep.collectives
    assert c.mesh_axes == ("tensor",)
    # Partition ids are mesh positions; the links are found from the devices behind them.
    assert sorted(sorted(mesh.devices.flat[p].id for p in g) for g in c.groups) == \
        [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_conditional_branches_are_counted_and_the_assumption_reported(cpu_devices):
    mesh = sharding.make_mesh(H100, {"data": 8})

    def body(x, flag):
        return jax.lax.cond(flag[0] > 0, lambda v: jax.lax.psum(v, "data"), lambda v: v * 2, x)

    f = shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"),
                  check_vma=False)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    flag = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    rep = sharding.analyze(f, x, flag, mesh=mesh, system=H100)
    (c,) = rep.collectives
    assert (c.kind, c.bytes, c.count) == ("all-reduce", 8 * 128 * 4, 1)
    assert any("conditional" in w and "upper bound" in w for w in rep.warnings)


@pytest.mark.parametrize("par, microbatches", [({"data": 8}, 4), ({"data": 4, "pipeline": 2}, 4)])
def test_data_parallel_gradients_are_summed_once_per_step(cpu_devices, par, microbatches):
    # Megatron's DDP sums the gradients over the data-parallel replicas once per step, not
    # at every micro-step or pipeline tick: each parameter's f32 gradient crosses `data`
    # once -- all-reduces over `data` of exactly the parameters' bytes, each run once.
    cfg = tiny(n_layers=2)
    mesh = sharding.make_mesh(H100, par)
    prog = train_program(cfg, mesh, seq_len=16, global_batch=32, microbatches=microbatches,
                         compute="float32")
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    # (Besides them only the scalar loss of each micro-step is summed over `data`.)
    over_data = [c for c in rep.collectives if c.mesh_axes == ("data",)]
    sums = [c for c in over_data if c.shape]
    assert sums and all(c.kind == "all-reduce" and c.count == 1 for c in sums)
    assert sum(c.bytes for c in sums) == prog.param_bytes_per_device
    assert all(c.bytes == 4 for c in over_data if not c.shape)


def test_a_gradient_summed_over_two_axes_is_one_all_reduce(cpu_devices):
    # The SPMD partitioner sums a weight gradient over `sequence` and then over `data`;
    # XLA's AllReduceFolder (GPU, TPU) makes the pair one all-reduce over both, as
    # Megatron's DP x CP group does: one ring over all 8 devices instead of two.
    cfg = tiny(n_layers=2)
    mesh = sharding.make_mesh(H100, {"data": 2, "sequence": 4})
    prog = train_program(cfg, mesh, seq_len=64, global_batch=4, compute="float32")
    rep = sharding.analyze(prog.step, *prog.args, mesh=mesh, system=H100)
    grads = [c for c in rep.collectives if c.kind == "all-reduce" and c.shape
             and "sequence" in c.mesh_axes]
    assert grads and all(c.mesh_axes == ("data", "sequence") and c.group_size == 8
                         for c in grads)
    # every parameter's f32 gradient, once
    assert sum(c.bytes * c.count for c in grads) == prog.param_bytes_per_device


def test_a_collective_over_a_size_1_mesh_axis_is_not_counted(cpu_devices):
    # pmean and all_gather over `data` of size 1 group each device with itself: nothing
    # moves (XLA's simplifiers remove them), so only the psum over `tensor` is counted.
    mesh = jax.make_mesh((1, 8), ("data", "tensor"), devices=cpu_devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def body(x):
        x = jax.lax.pmean(x, "data")
        x = jax.lax.all_gather(x, "data", tiled=True)
        return jax.lax.psum(x, "tensor")

    f = shard_map(body, mesh=mesh, in_specs=P("data", "tensor"), out_specs=P("data", "tensor"),
                  check_vma=False)
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32,
                             sharding=NamedSharding(mesh, P("data", "tensor")))
    rep = sharding.analyze(f, x, mesh=mesh, system=None)
    # the psum's buffer: 256 x (1024 / 8) f32 per device
    assert [(c.kind, c.mesh_axes, c.bytes) for c in rep.collectives] == [
        ("all-reduce", ("tensor",), 256 * 128 * F32)]
    sharding.assert_collectives(rep, max_count={"all-reduce over data": 0,
                                                "all-gather": 0})


ONE_MEMBER = """HloModule one, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  %ar = f32[16]{0} all-reduce(%p), replica_groups={{0},{1},{2},{3}}, to_apply=%add
  %self = f32[16]{0} collective-permute(%ar), source_target_pairs={{0,0},{1,1},{2,2},{3,3}}
  ROOT %ring = f32[16]{0} collective-permute(%self), source_target_pairs={{0,1},{1,0},{2,2},{3,3}}
}
"""


def test_one_member_groups_and_self_sends_move_nothing():
    cols, unknown = extract_collectives(parse_hlo(ONE_MEMBER))
    # only the permute in which devices 0 and 1 swap their 16 f32
    assert [(c.name, c.bytes) for c in cols] == [("ring", 16 * F32)] and not unknown


def test_a_reduce_scatter_over_its_second_dimension_has_its_input_shape(cpu_devices):
    # psum_scatter of a (128, 256) f32 per device over 4 devices along dimension 1: the
    # input buffer (the bytes' shape) is (128, 256), each device keeping (128, 64).
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), devices=cpu_devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def body(x):
        return jax.lax.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True)

    f = shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data", "tensor"),
                  check_vma=False)
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    (c,) = sharding.analyze(f, x, mesh=mesh, system=None).collectives
    assert (c.kind, c.mesh_axes, c.shape, c.bytes) == (
        "reduce-scatter", ("tensor",), (128, 256), 128 * 256 * F32)


# One slice's program of a multi-slice TPU run (libtpu, v5e 2x4 x 2 slices): the gather
# across slices is a host transfer to the DCN runtime, not an all-gather op.
MULTI_SLICE = """HloModule m, num_partitions=8

ENTRY %main (p: f32[16,16]) -> f32[16,16] {
  %p = f32[16,16]{1,0} parameter(0)
  %after-all = token[] after-all()
  %send = (f32[16,16]{1,0}, u32[], token[]) send(%p, %after-all), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_GATHER"}
  %recv = (f32[32,16]{1,0}, u32[], token[]) recv(%after-all), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_GATHER"}
  %send-done = token[] send-done(%send), channel_id=3, is_host_transfer=true
  ROOT %r = f32[16,16]{1,0} negate(%p)
}
"""


def test_a_transfer_across_tpu_slices_says_what_it_is_and_that_it_is_not_counted():
    # `inspect` of such a dump listed "send (line 6)" and "recv (line 7)" as unrecognised,
    # without saying that they are the DCN collectives the report leaves out.
    cols, unknown = extract_collectives(parse_hlo(MULTI_SLICE))
    assert cols == []
    send, recv = unknown
    assert send.startswith("main/send: send (line 6): an all-gather across TPU slices over "
                           "DCN") and "not among the collectives, nor in the step time" in send
    assert recv.startswith("main/recv: recv (line 7): the receiving half of a DCN transfer")
