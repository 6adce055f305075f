"""The machine: chips, systems, the physical place of every device, collective timing.

Imports nothing else from the project.
"""

from meshes.chips import CHIPS, Chip
from meshes.links import BusBandwidthCurve, Link
from meshes.systems import (
    COLLECTIVE_KINDS,
    CollectiveTiming,
    GpuSystem,
    System,
    TpuSystem,
    bus_factor,
    get_system,
    system_names,
)

__all__ = [
    "CHIPS",
    "COLLECTIVE_KINDS",
    "BusBandwidthCurve",
    "Chip",
    "CollectiveTiming",
    "GpuSystem",
    "Link",
    "System",
    "TpuSystem",
    "bus_factor",
    "get_system",
    "system_names",
]
