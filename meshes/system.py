"""The System interface: devices of one chip, their physical places, collective timing.

Families live in their own rooms: `meshes/gpu.py` (NVLink domains over a scale-out fabric,
NCCL's model) and `meshes/tpu.py` (ICI tori, DCN between slices); `meshes/catalog.py`
turns a name like `gb200-nvl72:72` into one.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

from meshes.chips import Chip
from meshes.links import Link

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)


@dataclasses.dataclass(frozen=True)
class CollectiveTiming:
    """How long one collective takes and on what.

    Attributes:
        time_s: wall time of one execution.
        link: the link class of the slowest stage ("nvlink", "infiniband", "ici", "dcn").
        algorithm: the algorithm assumed, e.g. "ring", "nvls", "hierarchical ring".
        link_share: the share of what a device sends (its wire bytes) that crosses `link`,
            where a collective across NVLink domains or slices sends the rest inside them
            (a flat ring over m GPUs a node: 1/m through each GPU's NIC); 1 otherwise.
    """

    time_s: float
    link: str
    algorithm: str
    link_share: float = 1.0


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: bytes each device moves per byte of S."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind in ("collective-permute", "collective-broadcast"):
        return 1.0
    return (n - 1) / n


class System(abc.ABC):
    """A machine: `num_devices` devices of one `chip`, with links between them."""

    name: str
    family: str
    chip: Chip
    num_devices: int
    links: dict[str, Link]
    # The real network where it differs from the catalog (meshes/catalog.py OVERRIDES).
    overrides: dict[str, object] = {}

    @property
    def label(self) -> str:
        """The name, with the overrides of the catalog's network, for reports."""
        if not self.overrides:
            return self.name
        return f"{self.name} [{', '.join(f'{k}={v}' for k, v in self.overrides.items())}]"

    @property
    def placement(self) -> str:
        """How the job's devices sit in the machine, where that is not plain from the name
        (e.g. NVLink domains used in part); "" otherwise."""
        return ""

    @abc.abstractmethod
    def coords(self, device_id: int) -> tuple[int, ...]:
        """Physical coordinates of a device id (see `coord_names`)."""

    def place(self, device_id: int) -> dict[str, int]:
        """Named physical place of a device, e.g. {"rack": 0, "tray": 3, "gpu": 1}."""
        return dict(zip(self.coord_names, self.coords(device_id), strict=True))

    coord_names: tuple[str, ...] = ()

    def _check_ids(self, ids: Sequence[int]) -> None:
        for i in ids:
            if not 0 <= i < self.num_devices:
                raise ValueError(
                    f"device id {i} is outside system {self.name!r}, which has device ids "
                    f"0..{self.num_devices - 1}; use a system with more devices or fix the "
                    f"replica groups"
                )

    @abc.abstractmethod
    def collective_timing(
        self, kind: str, nbytes: float, groups: Sequence[Sequence[int]]
    ) -> CollectiveTiming:
        """Time, link class and algorithm of one collective over concurrent `groups`."""

    def collective_time_s(
        self, kind: str, nbytes: float, groups: Sequence[Sequence[int]]
    ) -> float:
        """Seconds for one collective of `kind` with buffer `nbytes` (the per-device buffer S
        of nccl-tests: algorithm bandwidth = S / time) over replica `groups` of device ids
        running at the same time."""
        return self.collective_timing(kind, nbytes, groups).time_s

    def describe(self) -> list[tuple[str, str]]:
        """(field, value with source) rows for `shardscope systems`."""
        c, k = self.chip, self.chip.devices_per_chip

        def figures(n: int) -> str:
            return (f"{n * c.peak_flops_per_s['bfloat16'] / 1e12:.0f} TFLOP/s bf16, "
                    f"{n * c.hbm_bytes / 1e9:.0f} GB HBM at {n * c.hbm_bytes_per_s / 1e12:.2f} "
                    f"TB/s")

        rows = [("devices", f"{self.num_devices} ({k} per chip)")]
        if k == 1:
            rows.append(("chip", f"{c.name}: {figures(1)} [{c.source}]"))
        else:  # a JAX device is part of a chip: say which figures are whose
            rows += [("chip", f"{c.name}: {figures(k)} ({k} devices)"),
                     ("device", f"{figures(1)} [{c.source}]")]
        if c.program_op_s is not None:  # the chip sequences its program's ops itself
            rows.append(("op", f"{c.program_op_s * 1e6:.1f} us fixed time per op (kernel), "
                               f"no launch from the host [{c.program_op_source}]"))
        if c.hbm_source:  # the one place the HBM figure says what it is
            rows.append(("hbm", c.hbm_figure()))
        for link in self.links.values():
            rows.append((link.name, f"{link.bytes_per_s / 1e9:.1f} GB/s "
                                     f"{self.link_scope(link.name)} per direction "
                                     f"[{link.source}]"))
        return rows

    def link_scope(self, link: str) -> str:
        """What one `bytes_per_s` of link class `link` belongs to, in words."""
        return "per device"
