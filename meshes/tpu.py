"""TPU systems: chips on a 2D/3D torus (ICI) with wraparound where the slice has it, and
slices joined over the data-center network (DCN).

Device ids are slice-major, then z, then y, then x (x fastest), then TensorCore within the
chip (TPU7x shows 2 devices per chip); the deviceless compiler's devices are placed by
their own torus coordinates (sharding/compiler.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from meshes.chips import CHIPS
from meshes.links import TPU_ICI_EFFICIENCY, TPU_ICI_HOP_LATENCY_S, Link
from meshes.system import CollectiveTiming, System, bus_factor


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuFamily:
    name: str
    chip: str
    ndim: int
    max_shape: tuple[int, ...]
    wrap_rule: str  # "cube": wraps every axis once a multiple of 4x4x4; "16": axis of 16;
    # "always": every axis of the slice wraps
    ici_bytes_per_s: float  # one link, one direction
    dcn_bytes_per_s_per_chip: float
    source: str
    example_shape: tuple[int, ...]  # the slice `shardscope systems` shows
    # What the chip-to-chip torus and the network between slices are called on reports.
    link_names: tuple[str, str] = ("ici", "dcn")
    # The deviceless compiler that builds for it ("tpu": libtpu), "" when none is here.
    compiler: str = "tpu"
    # Each torus axis's link bandwidth relative to `ici_bytes_per_s` (empty: all equal);
    # the Trn2 UltraServer's ring across instances runs at half the bandwidth.
    axis_scale: tuple[float, ...] = ()
    # The slice shapes Google provisions, in Google's orientation (either is accepted): a 2D
    # family's all of them; a cube family's below one 4x4x4 cube (the default shape of each
    # size; larger slices are whole cubes, `shape_error`). Empty: no list (Trainium).
    slice_shapes: tuple[tuple[int, ...], ...] = ()
    # Google's accelerator-type spellings of the family (`v5litepod-256`, MaxText's
    # `v5e-256`), and what their number counts: TensorCores (2 a chip on v4, v5p, TPU7x),
    # or chips (1 on v5e, v6e).
    accelerator_types: tuple[str, ...] = ()
    type_cores_per_chip: int = 1

    def axis_bytes_per_s(self, axis: int) -> float:
        return self.ici_bytes_per_s * (self.axis_scale[axis] if self.axis_scale else 1.0)

    def shape_error(self, shape: tuple[int, ...]) -> str | None:
        """Why a slice cannot have this shape, or None. A TPU slice is made of hosts of
        2 x 2 chips (a smaller slice is part of one): each of its first two dimensions is
        1 or even (libtpu refuses the others, e.g. v5e:3x3). Past that, what Google
        provisions: a 2D family's listed shapes; a 3D slice below one 4x4x4 cube one of the
        family's listed sub-cube shapes, in any orientation; a 3D slice larger than a cube is
        whole cubes, every dimension a multiple of 4 (Cloud TPU docs, types and
        topologies: "A, B, C are either all <= 4 or all integer multiples of 4")."""
        if len(shape) != self.ndim:
            return f"{self.name} slices are {self.ndim}D"
        if any(s < 1 for s in shape):
            return f"each dimension of a {self.name} slice is at least 1"
        if any(s > m for s, m in zip(shape, self.max_shape, strict=True)):
            return (f"the largest {self.name} slice is {'x'.join(map(str, self.max_shape))} "
                    f"(more chips are slices over DCN, *N)")
        if self.compiler == "tpu" and any(s != 1 and s % 2 for s in shape[:2]):
            return (f"a {self.name} slice is made of hosts of 2x2 chips, so each of its first "
                    f"two dimensions is 1 or even")
        if self.ndim == 2 and self.slice_shapes and \
                shape not in self.slice_shapes and shape[::-1] not in self.slice_shapes:
            listed = ", ".join("x".join(map(str, s)) for s in self.slice_shapes)
            return (f"Google provisions {self.name} slices of {listed} only (Cloud TPU "
                    f"{self.name.removeprefix('tpu-')} docs; no custom 2D shapes)")
        if self.ndim == 3 and self.slice_shapes and all(s <= 4 for s in shape) and \
                shape != (4, 4, 4) and not self._sub_cube(shape):
            listed = ", ".join("x".join(map(str, s)) for s in self.slice_shapes)
            return (f"Google provisions {self.name} slices below one 4x4x4 cube of {listed} "
                    f"only, in any orientation that keeps a host's 2x2 chips in the first two "
                    f"dimensions (Cloud TPU {self.name.removeprefix('tpu-')} docs, "
                    f"configurations)")
        if self.wrap_rule == "cube" and any(s > 4 for s in shape) and \
                any(s % 4 for s in shape):
            return (f"a {self.name} slice larger than one 4x4x4 cube is whole cubes, so "
                    f"every dimension is a multiple of 4 (Cloud TPU docs: all <= 4 or all "
                    f"multiples of 4)")
        return None

    def _sub_cube(self, shape: tuple[int, ...]) -> bool:
        """Whether `shape` is a listed sub-cube slice turned about: the same dimensions,
        and no 1 in its first two where the listed shape has a host's 2x2 chips (2x2x1
        turned to 1x2x2 would split a host)."""
        return any(sorted(shape) == sorted(g) and min(shape[:2]) >= min(g[:2])
                   for g in self.slice_shapes)

    def example_for(self, shape: tuple[int, ...]) -> str:
        """Valid system names near a refused `shape`: as many largest slices over DCN when
        it has that many chips (MaxText's 4 x v5e-256 written `4x256`), else the nearest
        valid shapes with no more and with no fewer chips."""
        largest = "x".join(map(str, self.max_shape))
        slices, rest = divmod(math.prod(shape), math.prod(self.max_shape))
        if slices > 1 and not rest:
            return f"{self.name}:{largest}*{slices} ({slices} slices over DCN)"
        near = self.nearest_shapes(shape)
        if not near:
            return f"{self.name}:{'x'.join(map(str, self.example_shape))}"
        return " or ".join(f"{self.name}:{'x'.join(map(str, s))} ({math.prod(s)} chips)"
                           for s in near)

    def valid_shapes(self):
        """Every slice shape the family has (`shape_error` None), in either orientation."""
        def sizes(m: int) -> list[int]:
            if self.wrap_rule != "cube":
                return list(range(1, m + 1))
            # a cube family's dimensions: up to 4, or multiples of 4 (fewer to try)
            return sorted({*range(1, min(m, 4) + 1), *range(4, m + 1, 4)})

        for dims in itertools.product(*(sizes(m) for m in self.max_shape)):
            if self.shape_error(dims) is None:
                yield dims

    def nearest_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The valid shapes closest to `shape` dimension by dimension, one with no more
        chips and one with no fewer (one shape when they are the same)."""
        if len(shape) != self.ndim:
            return []
        n = math.prod(shape)

        def distance(s):
            return sum(abs(a - b) for a, b in zip(s, shape, strict=True)), math.prod(s)

        valid = list(self.valid_shapes())
        below = min((s for s in valid if math.prod(s) <= n), key=distance, default=None)
        above = min((s for s in valid if math.prod(s) >= n), key=distance, default=None)
        return list(dict.fromkeys(s for s in (below, above) if s is not None))

    def default_shape(self, chips: int) -> tuple[int, ...] | None:
        """The shape Google gives a slice of `chips` chips, or None when it has none: the
        listed shape of that size, else (cube families) the whole-cube shape most like a
        cube ("the default topology is the one most similar to a cube", Cloud TPU docs,
        types and topologies; v5p: 128 chips 4x4x8, 384 chips 4x8x12), written smallest
        dimension first as Google writes them."""
        listed = [s for s in self.slice_shapes if math.prod(s) == chips]
        if listed:
            return listed[0]
        if self.wrap_rule != "cube" or chips % 64:
            return None
        cubes = [s for s in self.valid_shapes()
                 if math.prod(s) == chips and all(d % 4 == 0 for d in s)]
        if not cubes:
            return None
        return tuple(sorted(min(cubes, key=lambda s: sorted(s, reverse=True))))


# Below one 4x4x4 cube, the shapes Google lists for v4 and v5p (Cloud TPU v4 and v5p docs,
# configurations; xpk's system_characteristics generates the same four before whole cubes).
_SUB_CUBE = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
# v5e and v6e: no custom 2D shapes, these eight (Cloud TPU v5e docs, "v5e supports the
# following 2D slice shapes"; v6e docs, the same topologies v6e-1 ... v6e-256).
_PLANE = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))

TPU_FAMILIES: dict[str, TpuFamily] = {
    "tpu-v4": TpuFamily(name="tpu-v4", chip="tpu-v4", ndim=3, max_shape=(16, 16, 16),
                        wrap_rule="cube", ici_bytes_per_s=4.5e10, dcn_bytes_per_s_per_chip=6.25e9,
                        source="scaling book tpus.md",
                      example_shape=(4, 4, 4), slice_shapes=_SUB_CUBE,
                        accelerator_types=("v4",), type_cores_per_chip=2),
    "tpu-v5e": TpuFamily(name="tpu-v5e", chip="tpu-v5e", ndim=2, max_shape=(16, 16),
                         wrap_rule="16", ici_bytes_per_s=4.5e10, dcn_bytes_per_s_per_chip=3.125e9,
                         source="scaling book tpus.md",
                       example_shape=(16, 16), slice_shapes=_PLANE,
                         accelerator_types=("v5litepod", "v5e")),
    "tpu-v5p": TpuFamily(name="tpu-v5p", chip="tpu-v5p", ndim=3, max_shape=(16, 20, 28),
                         wrap_rule="cube", ici_bytes_per_s=9.0e10, dcn_bytes_per_s_per_chip=6.25e9,
                         source="scaling book tpus.md",
                       example_shape=(8, 8, 8), slice_shapes=_SUB_CUBE,
                         accelerator_types=("v5p",), type_cores_per_chip=2),
    "tpu-v6e": TpuFamily(name="tpu-v6e", chip="tpu-v6e", ndim=2, max_shape=(16, 16),
                         wrap_rule="16", ici_bytes_per_s=9.0e10, dcn_bytes_per_s_per_chip=1.25e10,
                         source="scaling book tpus.md",
                       example_shape=(16, 16), slice_shapes=_PLANE,
                         accelerator_types=("v6e",)),
    # TPU7x: two TensorCores a chip, and `tpu7x-N` counts them as v5p's type does
    # (tpu7x-8 = 2x2x1, tpu7x-128 = 4x4x4: MaxText accelerator_to_spec_map.py, which also
    # has the single chip, tpu7x-2 = 1x1x1; Cloud TPU7x docs: 2 TensorCores per chip).
    "tpu7x": TpuFamily(name="tpu7x", chip="tpu7x", ndim=3, max_shape=(16, 24, 24),
                       wrap_rule="cube", ici_bytes_per_s=9.0e10, dcn_bytes_per_s_per_chip=1.25e10,
                       source="scaling book tpus.md; MaxText accelerator_to_spec_map.py",
                     example_shape=(4, 4, 4), slice_shapes=((1, 1, 1), *_SUB_CUBE),
                       accelerator_types=("tpu7x",), type_cores_per_chip=2),
    # AWS Trainium2: a trn2.48xlarge is 16 chips on a 4x4 2D torus of NeuronLink-v3, 1,024
    # GB/s per chip over its 4 links (taken as both directions: 128 GB/s per link and
    # direction); instances joined by EFA, 3.2 Tb/s per 16 chips = 25 GB/s per chip. Slices
    # are instances: `trn2:4x4*16` is 16 instances, 256 chips.
    "trn2": TpuFamily(name="trn2", chip="trainium2", ndim=2, max_shape=(4, 4),
                      wrap_rule="always", ici_bytes_per_s=1024e9 / 4 / 2,
                      dcn_bytes_per_s_per_chip=3.2e12 / 8 / 16,
                      source="AWS Neuron docs, Amazon EC2 Trn2 architecture (trn2-arch: 4x4 "
                             "2D torus, 1,024 GB/s NeuronLink-v3 per device, EFA 3,200 Gb/s "
                             "per instance) and Trainium2 architecture (4 NeuronLink-v3 per "
                             "device)",
                      example_shape=(4, 4), link_names=("neuronlink", "efa"), compiler=""),
    # A Trn2 UltraServer: 4 trn2u.48xlarge instances whose chips at the same 4x4 position
    # form a ring over NeuronLink-v3 at 256 GB/s per device (2 ring links: 64 GB/s per link
    # and direction, half the in-instance links' 128): a 4x4x4 torus whose
    # third axis is the instances. UltraServers are joined by EFA: `trn2u:4x4x4*4` is 4 of
    # them, 256 chips.
    "trn2u": TpuFamily(name="trn2u", chip="trainium2", ndim=3, max_shape=(4, 4, 4),
                       wrap_rule="always", ici_bytes_per_s=1024e9 / 4 / 2,
                       dcn_bytes_per_s_per_chip=3.2e12 / 8 / 16, axis_scale=(1.0, 1.0, 0.5),
                       source="AWS Neuron docs, Amazon EC2 Trn2 architecture (trn2-arch: "
                              "u-trn2x64 UltraServer, chips at the same coordinates of its 4 "
                              "instances in a ring; NeuronLink-v3 1,024 GB/s per device in an "
                              "instance, 256 GB/s per device between instances; EFA 3,200 "
                              "Gb/s per instance)",
                       example_shape=(4, 4, 4), link_names=("neuronlink", "efa"), compiler=""),
}


class TpuSystem(System):
    """`num_slices` TPU slices of torus `shape`, joined over DCN."""

    def __init__(self, family: TpuFamily, shape: tuple[int, ...], num_slices: int, *,
                 dcn_bytes_per_s_per_chip: float | None = None, overrides: dict | None = None,
                 alias: str = ""):
        """`dcn_bytes_per_s_per_chip`: the DCN bandwidth per chip where the cluster's
        differs from the catalog's; `alias`: the accelerator type it was named by
        (`v5p-256`), said on reports."""
        self.family = family
        self.alias = alias
        self.overrides = dict(overrides or {})
        self.shape = shape
        self.num_slices = num_slices
        self.chip = CHIPS[family.chip]
        dims = "x".join(str(s) for s in shape)
        self.name = f"{family.name}:{dims}" + (f"*{num_slices}" if num_slices > 1 else "")
        self.num_chips = math.prod(shape) * num_slices
        self.num_devices = self.num_chips * self.chip.devices_per_chip
        self.wraps = tuple(self._axis_wraps(a) for a in range(len(shape)))
        axes = "xyz"[: len(shape)]
        self.coord_names = ("slice", *axes, "core")
        wrap_txt = ", ".join(f"{a}:{'wrap' if w else 'no wrap'}" for a, w in zip(axes, self.wraps))
        self.fast, self.slow = family.link_names
        self.links = {
            self.fast: Link(name=self.fast, bytes_per_s=family.ici_bytes_per_s,
                        latency_s=TPU_ICI_HOP_LATENCY_S, efficiency=TPU_ICI_EFFICIENCY,
                        source=f"{family.source}; per link ({wrap_txt})"),
        }
        if num_slices > 1:
            self.links[self.slow] = Link(
                name=self.slow,
                bytes_per_s=dcn_bytes_per_s_per_chip or family.dcn_bytes_per_s_per_chip,
                latency_s=0.0, efficiency=1.0,
                source="config override" if dcn_bytes_per_s_per_chip else family.source)

    @property
    def placement(self) -> str:
        # the accelerator type's translation: its number counts TensorCores on v4, v5p and
        # TPU7x, chips on v5e and v6e, and the shape is Google's default for the size
        if not self.alias:
            return ""
        return f"{self.alias} = {self.name}, {self.num_chips} chip{'s' * (self.num_chips != 1)}"

    def link_scope(self, link: str) -> str:
        # the torus's figure is one link's (a chip has two per axis); the DCN's a chip's,
        # whatever its TensorCores
        return "per link" if link == self.fast else "per chip"

    def _axis_wraps(self, axis: int) -> bool:
        if self.family.wrap_rule == "16":
            return self.shape[axis] == 16
        if self.family.wrap_rule == "always":
            return True
        # v4/v5p/TPU7x: every axis wraps once the slice is whole 4x4x4 cubes.
        return all(s % 4 == 0 for s in self.shape)

    def coords(self, device_id: int) -> tuple[int, ...]:
        """(slice, x, y[, z], core) of a device id; x is fastest after the core."""
        self._check_ids([device_id])
        chip, core = divmod(device_id, self.chip.devices_per_chip)
        per_slice = math.prod(self.shape)
        slice_, local = divmod(chip, per_slice)
        xyz = []
        for s in self.shape:
            local, c = divmod(local, s)
            xyz.append(c)
        return (slice_, *xyz, core)

    def device_id(self, slice_index: int, xyz, core: int = 0) -> int:
        """Inverse of `coords`: the id of the device at torus position `xyz`."""
        chip = 0
        for c, s in zip(reversed(list(xyz)), reversed(self.shape)):
            chip = chip * s + c
        chip += slice_index * math.prod(self.shape)
        return chip * self.chip.devices_per_chip + core

    def collective_timing(self, kind, nbytes, groups):
        if not groups:
            return CollectiveTiming(0.0, self.fast, "none")
        self._check_ids([i for g in groups for i in g])
        if kind == "collective-permute":
            return self._permute_timing(nbytes, groups)
        # Groups that run at once on the same chips share their links (TPU7x: one group
        # per TensorCore when another axis splits the cores): the busiest chip's count.
        chip_of = self.chip.devices_per_chip
        on_chip: dict[int, set[int]] = {}
        for k, g in enumerate(groups):
            for i in g:
                on_chip.setdefault(i // chip_of, set()).add(k)
        worst = None
        for g in groups[:1] if _uniform(groups) else groups:
            share = max(len(on_chip[i // chip_of]) for i in g)
            t = self._group_timing(kind, nbytes, g, share=share)
            if worst is None or t.time_s > worst.time_s:
                worst = t
        return worst

    def _group_timing(self, kind, nbytes, group, *, share: int = 1):
        n = len(group)
        if n <= 1 or nbytes <= 0:
            return CollectiveTiming(0.0, self.fast, "none")
        coords = [self.coords(i) for i in group]
        slices = {c[0] for c in coords}
        if len(slices) > 1:
            dcn = self.links[self.slow]
            here = [c for c in coords if c[0] == coords[0][0]]
            # Within each slice, then across: an all-reduce reduce-scatters and all-gathers
            # inside the slice (the ring's 2(m - 1)/m, counted once) around a DCN
            # all-reduce of each chip's 1/chips share, at the DCN's rate per chip.
            in_slice, _ = self._ici_time(kind, nbytes, here, share=share)
            chips = len({c[1:-1] for c in here})
            if kind == "all-to-all":
                # each device sends the other slices' share of its own buffer over DCN
                per_chip = nbytes * len(here) / chips * (len(slices) - 1) / len(slices)
            else:
                per_chip = nbytes / chips * bus_factor(kind, len(slices))
            t_dcn = per_chip * share / dcn.bytes_per_s
            # of what a device sends, the share that leaves the slice (its chip's DCN
            # bytes over the chip's devices in the group)
            wire = nbytes * bus_factor(kind, n)
            return CollectiveTiming(in_slice + t_dcn, self.slow, "hierarchical",
                                    link_share=per_chip * chips / len(here) / wire)
        t, algo = self._ici_time(kind, nbytes, coords, share=share)
        return CollectiveTiming(t, self.fast, algo)

    def _ici_time(self, kind: str, nbytes: float, coords, *,
                  share: int = 1) -> tuple[float, str]:
        """Ring collective over the torus axes the group spans; `share`: the groups that
        run on each of its chips at once (their links carry each one's bytes)."""
        n = len(coords)
        if n <= 1:
            return 0.0, "none"
        chips = {c[1:-1] for c in coords}
        cores_per_chip = n // len(chips)
        link = self.links[self.fast]
        bw_total = 0.0
        bisection = math.inf  # per direction, through the narrowest cut of the group
        latency_steps = 0.0
        axes_used = []
        for a in range(len(self.shape)):
            vals = sorted({c[a] for c in chips})
            if len(vals) <= 1:
                continue
            extent = len(vals)
            stride = _stride(vals)
            full_ring = self.wraps[a] and extent * stride == self.shape[a]
            # Both directions of a wrapped ring carry data; an open line gets one way's worth.
            directions = 2 if full_ring else 1
            axis_bw = self.family.axis_bytes_per_s(a) * link.efficiency / stride
            bw_total += directions * axis_bw
            # A cut across axis a severs each of the group's lines along a (one per chip
            # position on the other axes) once, or twice where it wraps.
            bisection = min(bisection, len(chips) / extent * directions * axis_bw)
            latency_steps = max(latency_steps, (extent / 2 if full_ring else extent - 1) * stride)
            axes_used.append(("xyz"[a], full_ring, stride))
        if bw_total == 0.0:
            # the TensorCores of one chip (TPU7x's two dies): no ICI link; the die-to-die
            # interface has no public rate, so no time (docs/limits.md)
            return 0.0, "on-chip"
        if kind == "all-to-all":
            # Bisection bound: each half of the n chips sends the other n/2 x n/2 x S/n
            # = n S / 4 (S per device, times the chip's TensorCores in the group) through
            # the links the narrowest cut severs: two per line along a wrapped axis, one
            # along an open one, times the lines (a k x k torus: 2k links, not one chip's 4).
            t = nbytes * cores_per_chip * len(chips) / 4 * share / bisection
            algo = "all-to-all over bisection"
        else:
            # A ring over the chips: each chip moves S x the ring's factor whatever the
            # group's cores on it (they combine or share their part on the chip first).
            t = nbytes * bus_factor(kind, len(chips)) * share / bw_total
            algo = "bidirectional ring" if all(r for _, r, _ in axes_used) else "ring (no wrap)"
            if kind == "all-reduce":
                latency_steps *= 2
        if len(axes_used) > 1:
            algo = f"{len(axes_used)}-axis torus " + algo
        return latency_steps * link.latency_s + t, algo

    def _torus_delta(self, a: int, src: int, dst: int) -> int:
        d = dst - src
        if self.wraps[a]:
            size = self.shape[a]
            d = (d + size // 2) % size - size // 2
        return d

    def _permute_timing(self, nbytes, pairs_as_groups) -> CollectiveTiming:
        """Route every pair dimension-order over the torus; the busiest link sets the time."""
        link = self.links[self.fast]
        load: dict[tuple, float] = {}
        max_hops = 0
        cross_slice = False
        for pair in pairs_as_groups:
            src, dst = self.coords(pair[0]), self.coords(pair[1])
            if src[0] != dst[0]:
                cross_slice = True
                continue
            deltas = [self._torus_delta(a, src[1 + a], dst[1 + a]) for a in range(len(self.shape))]
            moving = [a for a, d in enumerate(deltas) if d]
            max_hops = max(max_hops, sum(abs(d) for d in deltas))
            if not moving:
                continue
            # One route per starting axis (rotations of the axis order): the data splits
            # evenly over them, as the scaling book's tpus.md example assumes.
            for r in range(len(moving)):
                order = moving[r:] + moving[:r]
                pos = list(src[1:-1])
                for a in order:
                    step = 1 if deltas[a] > 0 else -1
                    for _ in range(abs(deltas[a])):
                        key = (src[0], a, tuple(pos), step)
                        load[key] = load.get(key, 0.0) + nbytes / len(moving)
                        pos[a] = (pos[a] + step) % self.shape[a]
        t = 0.0
        if load:
            t = max(v / (self.family.axis_bytes_per_s(key[1]) * link.efficiency)
                    for key, v in load.items())
            t += max_hops * link.latency_s
        if cross_slice:
            t = max(t, nbytes / self.links[self.slow].bytes_per_s)
            return CollectiveTiming(t, self.slow, "p2p")
        return CollectiveTiming(t, self.fast, "p2p (dimension-order routes)")


def _stride(vals: list[int]) -> int:
    gaps = {b - a for a, b in itertools.pairwise(vals)}
    return min(gaps) if gaps else 1


def _uniform(groups) -> bool:
    return len({len(g) for g in groups}) == 1
