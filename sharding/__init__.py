"""The explorer's core, for any JAX function: logical axis rules, meshes, compilation, the
HLO parser, collective accounting, the step-time and memory estimate, the report.

    rep = sharding.analyze(fn, *args, mesh=mesh, system="gb200-nvl72:72")
    rep = sharding.analyze_hlo(hlo_text, system="tpu-v5e:4x4")

May import `meshes`; knows nothing of models or configs.
"""

from sharding.api import Compiled, analyze, analyze_hlo, analyze_module, compile_to_hlo
from sharding.collectives import Collective, extract_collectives
from sharding.hlo import HloParseError, parse_hlo
from sharding.mesh import ensure_cpu_devices, make_mesh
from sharding.report import Memory, Report
from sharding.rules import (
    LOGICAL_AXES,
    MESH_AXES,
    AxisRules,
    constrain,
    default_rules,
    resolve,
    use_rules,
)

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "AxisRules",
    "Collective",
    "Compiled",
    "HloParseError",
    "Memory",
    "Report",
    "analyze",
    "analyze_hlo",
    "analyze_module",
    "compile_to_hlo",
    "constrain",
    "default_rules",
    "ensure_cpu_devices",
    "extract_collectives",
    "make_mesh",
    "parse_hlo",
    "resolve",
    "use_rules",
]
