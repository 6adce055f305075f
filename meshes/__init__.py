"""The machine: chips, systems, the physical place of every device, collective timing.

Rooms:
- `chips.py`: accelerators (peak rates, HBM, measured matmul and HBM efficiencies, the
  GpuTargetConfig facts XLA:GPU compiles for), each number with its source.
- `links.py`: link classes, measured nccl-tests bus-bandwidth curves, NCCL's latency
  constants, TPU ICI constants.
- `interpolate.py`: log-linear interpolation of measured curves.
- `system.py`: the System interface (placement, `collective_timing`), the collective kinds
  and nccl-tests bus factors.
- `gpu.py`: GPU families (HGX nodes, NVL72 racks) over a scale-out fabric, NCCL's model.
- `tpu.py`: TPU families (ICI tori with their wraparound rules), DCN between slices.
- `host.py`: `host-cpu:N`, this host's CPU as N fake devices, timed from a cached
  microbenchmark.
- `catalog.py`: `get_system("<family>:<size>")` and the list of names.

Imports nothing else from the project.
"""

from meshes.catalog import get_system, system_names
from meshes.chips import CHIPS, Chip
from meshes.gpu import GpuSystem
from meshes.host import HostCpuSystem
from meshes.links import BusBandwidthCurve, Link
from meshes.system import COLLECTIVE_KINDS, CollectiveTiming, System, bus_factor
from meshes.tpu import TpuSystem

__all__ = [
    "CHIPS",
    "COLLECTIVE_KINDS",
    "BusBandwidthCurve",
    "Chip",
    "CollectiveTiming",
    "GpuSystem",
    "HostCpuSystem",
    "Link",
    "System",
    "TpuSystem",
    "bus_factor",
    "get_system",
    "system_names",
]
