"""The overlap model: async collectives hide behind independent compute, not dependent."""

import jax
import jax.numpy as jnp
import pytest
from jax import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshes
import sharding
from meshes.calibration import IDENTITY

H100 = meshes.get_system("h100:8")


def program(dependent: bool):
    mesh = sharding.make_mesh(H100, {"tensor": 8})

    def body(x, w):
        y = jax.lax.psum(x, "tensor")  # 32 MiB all-reduce over NVLink
        src = (y[:4096, :4096] if dependent else w)
        z = src @ w  # 2 x 4096^3 FLOPs, with or without waiting for the all-reduce
        return y, z

    f = shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False)
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    # At the uncalibrated matmul rate, so that the all-reduce outlasts the matmul (the
    # premise of the test), whatever the catalog's fit.
    return sharding.analyze(f, x, w, mesh=mesh, system=H100, calibration=IDENTITY)


def test_independent_compute_hides_the_collective(cpu_devices):
    free, chained = program(False), program(True)
    (c,) = free.collectives
    assert c.kind == "all-reduce" and c.bytes == 4096 * 4096 * 2
    comm, matmul, copies = free.comm_s, free.compute.matmul_s, free.compute.memory_bound_s
    assert comm > matmul > 0 and copies >= 0
    # Memory-bound work around the all-reduce (copies of x in and y out, where the program
    # has them) depends on / feeds it and stays on its path.
    # Independent: the matmul runs during the all-reduce and costs nothing extra.
    assert free.step_time_s == pytest.approx(comm + copies, rel=1e-6)
    # Dependent: the matmul waits for the all-reduce; everything adds up.
    assert chained.step_time_s == pytest.approx(comm + matmul + copies, rel=1e-6)
    assert free.step_time_s < chained.step_time_s
    assert free.exposed_comm_s < chained.exposed_comm_s


def test_report_says_how_time_was_found(cpu_devices):
    rep = program(False)
    assert "simulated overlap" in rep.format_table()
    lo, hi = rep.step_time_bounds_s
    assert lo <= rep.step_time_s <= hi


def test_collectives_ready_together_queue_in_program_order():
    from sharding.schedule import COMPUTE, _list_schedule

    # 0: a parameter; 1: a view of it; 2: all-gather A of the view; 3: all-gather B of the
    # parameter (both on ICI, ready at 0); 4, 5: matmuls needing A and B.
    kind = ["free", "free", "ici", "ici", COMPUTE, COMPUTE]
    dur = [0.0, 0.0, 1.0, 1.0, 5.0, 5.0]
    preds = [[], [0], [1], [0], [2], [3]]
    finish, _ = _list_schedule(kind, dur, preds)
    assert finish[2] == 1.0 and finish[3] == 2.0  # A first: it comes first in the program
    assert finish[4] == 6.0 and finish[5] == 11.0


def test_userbuffers_hide_a_tp_collective_under_the_gemm_it_feeds_or_follows():
    # All-gather (10 s) -> GEMM (8 s) -> reduce-scatter (10 s), over a tensor group of 4.
    # Without userbuffers each waits in full: 28 s. With them, of each collective only what
    # the GEMM's other 3 of 4 parts cannot cover is waited for: 10 - 8 x 3/4 = 4 s each.
    from sharding.schedule import Graph, Node, Scheduler

    nodes = (Node("ag", "all-gather"), Node("gemm", "dot", preds=(0,)),
             Node("rs", "reduce-scatter", preds=(1,)), Node("use", "add", preds=(2,)))
    graph = Graph("main", {"main": nodes})
    times = {"main": {"gemm": 8.0, "use": 1e-9}}
    comm = {("main", "ag"): (10.0, "nvlink"), ("main", "rs"): (10.0, "nvlink")}
    plain = Scheduler(graph, times, comm).run()
    overlapped = Scheduler(graph, times, comm,
                           under_gemms={("main", "ag"): 4, ("main", "rs"): 4}).run()
    assert plain.step_s == pytest.approx(28.0)
    assert overlapped.step_s == pytest.approx(4.0 + 8.0 + 4.0)
    assert overlapped.comm_busy_s == plain.comm_busy_s == {"nvlink": 20.0}  # all of it sent
    # A collective the GEMM fully covers waits for nothing.
    short = {("main", "ag"): (2.0, "nvlink"), ("main", "rs"): (2.0, "nvlink")}
    hidden = Scheduler(graph, times, short,
                       under_gemms={("main", "ag"): 4, ("main", "rs"): 4}).run()
    assert hidden.step_s == pytest.approx(8.0)
    # Only a GEMM covers it: next to other compute the collective waits in full.
    none = Scheduler(graph, times, comm, under_gemms={("main", "ag"): 4, ("main", "rs"): 4},
                     gemms={"main": set()}).run()
    assert none.step_s == pytest.approx(28.0)


def _step_with_loops(rs_s: float, ag_s: float):
    """A step as the SPMD program runs it: the forward loop (10 x 1 s), the backward loop
    (10 x 2 s, each iteration also sending 0.5 s over the fabric), the gradients'
    reduce-scatter, the optimizer (1 s), the parameters' all-gather."""
    from sharding.schedule import Graph, Node

    nodes = (Node("fwd", "while", ("fbody",), trip=10),
             Node("bwd", "while", ("bbody",), trip=10, preds=(0,)),
             Node("rs", "reduce-scatter", preds=(1,)), Node("opt", "add", preds=(2,)),
             Node("ag", "all-gather", preds=(3,)))
    graph = Graph("main", {"main": nodes, "fbody": (Node("f", "dot"),),
                           "bbody": (Node("b", "dot"), Node("p", "collective-permute"))})
    times = {"fbody": {"f": 1.0}, "bbody": {"b": 2.0}, "main": {"opt": 1.0}}
    comm = {("main", "rs"): (rs_s, "ib"), ("main", "ag"): (ag_s, "ib"),
            ("bbody", "p"): (0.5, "ib")}
    return graph, times, comm


def test_megatron_overlaps_the_data_parallel_sum_and_gather_in_chunks():
    # Megatron's overlap_grad_reduce / overlap_param_gather: of T in K chunks, T/K is waited
    # for, plus what the loop's window W cannot hide on the link time its own traffic
    # leaves free (a share f): T/K + max(0, (K - 1)/K T - f W).
    from sharding.schedule import Chunked, Scheduler

    graph, times, comm = _step_with_loops(8.0, 8.0)
    plain = Scheduler(graph, times, comm).run()
    assert plain.step_s == pytest.approx(10 + 20 + 8 + 1 + 8)
    # Window of 6 iterations: 12 s of the backward (a quarter of it on the fabric, f =
    # 3/4: 9 s free) hides the other 6 s of the sum; 6 s of the forward (f = 1) the
    # gather's: 2 s each waited for.
    wide = {("main", "rs"): Chunked(4, True, 6.0), ("main", "ag"): Chunked(4, False, 6.0)}
    hidden = Scheduler(graph, times, comm, chunked=wide).run()
    assert hidden.step_s == pytest.approx(10 + 20 + 2 + 1 + 2)
    assert hidden.comm_busy_s == plain.comm_busy_s == {"ib": 5.0 + 16.0}  # all of it sent
    # Window of 2 iterations: 4 s x 3/4 = 3 s free behind the backward, 2 s behind the
    # forward: 2 + (6 - 3) and 2 + (6 - 2) waited for.
    narrow = {("main", "rs"): Chunked(4, True, 2.0), ("main", "ag"): Chunked(4, False, 2.0)}
    assert Scheduler(graph, times, comm, chunked=narrow).run().step_s == pytest.approx(
        10 + 20 + 5 + 1 + 6)
    # One chunk: nothing to overlap.
    one = {("main", "rs"): Chunked(1, True, 6.0)}
    assert Scheduler(graph, times, comm, chunked=one).run().step_s == pytest.approx(
        plain.step_s)


def test_chunks_of_a_micro_step_loop_hide_under_its_last_backward():
    # Gradient accumulation, one loop of micro-steps (forward and backward, 3 s each): the
    # buckets are ready over the last micro-step's backward, 2/3 of it; with 3 chunks, the
    # window is (K - 1)/K of that: 2/3 x 2 s.
    from sharding.schedule import BACKWARD, Chunked, Graph, Node, Scheduler

    nodes = (Node("micro", "while", ("body",), trip=4), Node("rs", "reduce-scatter", preds=(0,)))
    graph = Graph("main", {"main": nodes, "body": (Node("fb", "dot"),)})
    times = {"body": {"fb": 3.0}}
    comm = {("main", "rs"): (6.0, "ib")}
    rep = Scheduler(graph, times, comm, chunked={("main", "rs"): Chunked(3, True)}).run()
    window = 2 / 3 * 3.0 * BACKWARD
    assert rep.step_s == pytest.approx(12.0 + 2.0 + (4.0 - window))


def test_an_overlapped_stage_transfer_waits_for_its_share_only():
    # A pipeline tick: the stage's layers (1 s), then the transfer to the next stage
    # (0.5 s), which the next tick's input selects. Waited for, each tick is 1.5 s; beside
    # other microbatches' compute (Megatron's overlap_p2p_comm), only its warm-up share
    # (0.1 here): 1.05 s. The link carries all of it either way.
    from sharding.schedule import Graph, Node, Scheduler

    body = (Node("layers", "dot"), Node("send", "collective-permute", preds=(0,)),
            Node("select", "select", preds=(1,)))
    graph = Graph("main", {"main": (Node("ticks", "while", ("tick",), trip=10),),
                           "tick": body})
    times = {"tick": {"layers": 1.0, "select": 1e-9}}
    comm = {("tick", "send"): (0.5, "ib")}
    plain = Scheduler(graph, times, comm).run()
    hidden = Scheduler(graph, times, comm, overlapped={("tick", "send"): 0.1}).run()
    assert plain.step_s == pytest.approx(15.0)
    assert hidden.step_s == pytest.approx(10.5)
    assert hidden.comm_busy_s == plain.comm_busy_s == {"ib": 5.0}
    # A transfer longer than the tick's compute is paced by the link, not hidden.
    slow = {("tick", "send"): (2.0, "ib")}
    assert Scheduler(graph, times, slow, overlapped={("tick", "send"): 0.1}).run().step_s \
        == pytest.approx(20.0)
