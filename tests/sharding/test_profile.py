"""sharding/profile.py: a Perfetto JSON trace's HLO events summed by the estimate's
categories (no JAX: a hand-written trace and program)."""

import gzip
import json

import pytest

from sharding.profile import profile_by_category, read_events, trace_file
from tests.conftest import DATA

# A matmul in a fusion, an all-reduce whose users keep a half each (the reduce-scatter the
# estimate reads), an elementwise kernel, a while loop around another add.
HLO = """HloModule jit_step, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_dot (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (b: f32[8,8]) -> f32[8,8] {
  %b = f32[8,8]{1,0} parameter(0)
  ROOT %add.2 = f32[8,8]{1,0} add(%b, %b)
}

%cond (c: f32[8,8]) -> pred[] {
  %c = f32[8,8]{1,0} parameter(0)
  ROOT %t = pred[] constant(false)
}

ENTRY %main (a: f32[8,8], w: f32[8,8]) -> f32[4,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %mm = f32[8,8]{1,0} fusion(%a, %w), kind=kCustom, calls=%fused_dot
  %loop = f32[8,8]{1,0} while(%mm), condition=%cond, body=%body
  %ar = f32[8,8]{1,0} all-reduce(%loop), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %zero = s32[] constant(0)
  %half = f32[4,8]{1,0} dynamic-slice(%ar, %zero, %zero), dynamic_slice_sizes={4,8}
  ROOT %neg = f32[4,8]{1,0} negate(%half)
}
"""


def _event(op, device, us, module="jit_step"):
    return {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": us, "name": op,
            "args": {"hlo_module": module, "hlo_op": op, "device_ordinal": device}}


def test_trace_events_are_summed_by_category_per_step_and_device(tmp_path):
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    for step in range(2):
        for dev in ("0", "1"):
            events += [_event("mm", dev, 30), _event("loop", dev, 50), _event("add.2", dev, 40),
                       _event("ar", dev, 20), _event("half", dev, 4), _event("neg", dev, 6),
                       _event("mm", dev, 999, module="other")]
    events.append({**_event("neg", "0", 7), "name": "end: neg"})  # a marker, no time
    path = tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert trace_file(tmp_path) == path
    prof = profile_by_category(read_events(path), HLO, steps=2)
    assert prof.devices == 2
    # per step and device: the fusion's 30 us is matmul; the loop's 50 us is its body's 40
    # plus control, and only the body's add counts; add 40 + slice 4 + negate 6 are kernels;
    # the all-reduce kept in halves is a reduce-scatter
    assert prof.seconds == pytest.approx({"matmul": 30e-6, "memory-bound": 50e-6,
                                          "reduce-scatter": 20e-6})
    assert prof.unmatched == ()


def test_a_trace_without_the_program_says_so(tmp_path):
    with pytest.raises(ValueError, match="create_perfetto_trace"):
        trace_file(tmp_path)
    with pytest.raises(ValueError, match="jit_step"):
        profile_by_category([], HLO, steps=1)


# XLA:GPU's shape of a step: most kernels inside a command buffer (a CUDA graph) called from
# the entry, a cuBLAS GEMM outside it.
GPU_HLO = (DATA / "gpu_command_buffer.hlo").read_text()


def test_kernels_run_in_a_command_buffer_are_unattributed_not_lost():
    # Under a command buffer the profiler names the kernels by the call: their time is
    # counted, as unattributed; without one (each kernel named) it is placed, and the call,
    # whose kernels have their own events, is not counted twice.
    graph = [_event("gemm", "0", 30), _event("call", "0", 70)]
    prof = profile_by_category([read(e) for e in graph], GPU_HLO, steps=1)
    assert prof.seconds == pytest.approx({"matmul": 30e-6, "unattributed": 70e-6})
    named = graph + [_event("loop_neg_fusion", "0", 20), _event("loop_neg_fusion.1", "0", 25)]
    prof = profile_by_category([read(e) for e in named], GPU_HLO, steps=1)
    assert prof.seconds == pytest.approx({"matmul": 30e-6, "memory-bound": 45e-6})
    # a profiler that names the event by the command buffer computation
    prof = profile_by_category([read(_event("command_buffer", "0", 70))], GPU_HLO, steps=1)
    assert prof.seconds == pytest.approx({"unattributed": 70e-6})


def read(event):
    from sharding.profile import OpEvent

    a = event["args"]
    return OpEvent(a["hlo_module"], a["hlo_op"], a["device_ordinal"], event["dur"] * 1e-6)
