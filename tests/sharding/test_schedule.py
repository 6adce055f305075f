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
    assert comm > matmul > 0 and copies > 0
    # The copies of x in and y out depend on / feed the all-reduce and stay on its path.
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
