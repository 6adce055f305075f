"""The explorer's core, for any JAX function: logical axis rules, meshes, compilation, the
HLO parser, collective accounting, the step-time and memory estimate, the report.

    rep = sharding.analyze(fn, *args, mesh=mesh, system="gb200-nvl72:72")
    rep = sharding.analyze_hlo(hlo_text, system="tpu-v5e:4x4")

Rooms, in the order data flows through them:
- `rules.py`: logical axis names, rule presets (logical -> mesh axes), the strict resolver,
  `AxisRules.ways` (how many ways a logical axis splits), activation constraints.
- `mesh.py`: a jax Mesh over a system's devices; the fake CPU device count.
- `compiler.py`: backends (fake CPU, deviceless TPU and GPU), lowering and compiling,
  XLA's captured warnings, the out-of-memory refusal, the compiler's memory figure;
  `progress.py`: the stages of a long run, for a terminal.
- `hlo.py`: the HLO text parser (shapes, instructions, computations, call graph) and the
  model operation behind an op_name; `replica_groups.py`: every replica-group form;
  `loops.py`: trip counts and how often each computation runs.
- `collectives.py`: collectives, their bytes (nccl-tests buffer size S), counts and mesh axes.
- `flops.py`, `dequant.py`, `dataflow.py`, `traffic.py`: FLOPs of matmuls, fused
  dequantisation, shared dataflow questions, HBM traffic of memory-bound kernels;
  `compute.py` turns them into per-instruction times and step totals.
- `schedule.py`: the list-scheduling simulation of compute and link streams.
- `plan.py`: a module read once into what the timing needs (work, counts, collectives,
  schedule graph), whatever the system: re-timing a stored program starts from it.
- `report.py`: the Report (time, throughput, MFU, memory, bottleneck, JSON); `text.py`:
  its terminal layout; `units.py`: bytes, seconds, watts in words; `html.py`: the HTML
  report.
- `analysis.py`: `AnalysisInputs`, the one record an estimate is made from (the program
  as read, where its devices sit, the compiler, what the caller knows of the step).
- `api.py`: `estimate` (the record timed on a system: the Report, built once), and the
  ways to make the record: `analyze` (compile a function), `analyze_hlo` (any dump),
  `analyze_module`, `analyze_plan`, `reanalyze` (a stored record on another system or
  calibration); without a system, `analyze` gives the collectives' bytes and counts alone.
- `testing.py`: `assert_collectives` (limits on a report's collectives, by kind or kind
  over mesh axes), meshes over fake CPU devices, collectives snapshots; the pytest plugin
  (pytest_shardscope.py, outside this package) offers them as fixtures. `hlo_source.py`:
  the file and line of an HLO instruction, for their messages.

May import `meshes`; knows nothing of models or configs.

Importing it on a machine without TPU chips keeps JAX from starting the TPU runtime (which
`libtpu`, installed for deviceless compiles, would otherwise start, find no chip and write
a page of warnings to stderr); set JAX_PLATFORMS to choose otherwise.
"""

import importlib.util
import os


def _skip_absent_tpu_runtime() -> None:
    """JAX_PLATFORMS for a machine with no TPU chip, when nobody chose one and JAX has not
    started: the CPU (for fake devices) and, with a GPU and its plugin, CUDA. Deviceless
    TPU and GPU compiles (sharding.compiler) need no runtime."""
    import jax
    from jax._src import hardware_utils, xla_bridge

    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or \
            xla_bridge.backends_are_initialized() or importlib.util.find_spec("libtpu") is None:
        return
    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return
    gpu = (os.path.exists("/dev/nvidiactl")
           and importlib.util.find_spec("jax_cuda12_plugin") is not None)
    jax.config.update("jax_platforms", "cuda,cpu" if gpu else "cpu")


_skip_absent_tpu_runtime()

# ruff: noqa: E402

from sharding.analysis import AnalysisInputs
from sharding.api import (
    analyze,
    analyze_hlo,
    analyze_module,
    analyze_plan,
    estimate,
    reanalyze,
)
from sharding.collectives import Collective, extract_collectives
from sharding.compiler import Compiled, compile_to_hlo
from sharding.hlo import HloParseError, parse_hlo
from sharding.mesh import ensure_cpu_devices, make_mesh
from sharding.plan import Plan, build_plan
from sharding.report import Memory, Report
from sharding.rules import (
    LOGICAL_AXES,
    MESH_AXES,
    RULE_PRESETS,
    AxisRules,
    constrain,
    default_rules,
    resolve,
    rules_preset,
    use_rules,
)
from sharding.testing import assert_collectives

__all__ = [
    "AnalysisInputs",
    "LOGICAL_AXES",
    "MESH_AXES",
    "RULE_PRESETS",
    "AxisRules",
    "Collective",
    "Compiled",
    "HloParseError",
    "Memory",
    "Plan",
    "Report",
    "analyze",
    "analyze_hlo",
    "analyze_module",
    "analyze_plan",
    "assert_collectives",
    "build_plan",
    "compile_to_hlo",
    "estimate",
    "constrain",
    "default_rules",
    "ensure_cpu_devices",
    "extract_collectives",
    "make_mesh",
    "parse_hlo",
    "reanalyze",
    "resolve",
    "rules_preset",
    "use_rules",
]
