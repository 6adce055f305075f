"""System names: `<family>:<size>` -> a System.

`gb200-nvl72:72`, `h100:64`, `tpu-v5e:16x16`, `tpu-v6e:16x16*2` (two slices over DCN). The
families are the tables of `meshes/gpu.py` and `meshes/tpu.py`; adding a row there adds a
name here.
"""

from __future__ import annotations

import difflib
import math
import re

from meshes.gpu import GPU_FAMILIES, GpuFamily, GpuSystem
from meshes.host import FAMILY as HOST_FAMILY
from meshes.host import host_system
from meshes.system import System
from meshes.tpu import TPU_FAMILIES, TpuFamily, TpuSystem

_TOPOLOGY = re.compile(r"^(\d+(?:x\d+)*)(?:\*(\d+))?$")
# Google's accelerator types (gcloud --accelerator-type, GKE and xpk device types, MaxText's
# compile_topology): `v6e-256`, `v5litepod-16`, `v5p-128`, `tpu7x-64`, with shardscope's
# `*SLICES` for several over DCN.
_ACCELERATOR_TYPE = re.compile(r"^([a-z0-9]+)-(\d+)(?:\*(\d+))?$")
ACCELERATOR_TYPES: dict[str, TpuFamily] = {
    t: f for f in TPU_FAMILIES.values() for t in f.accelerator_types}


def system_names() -> list[str]:
    """One example name per family (GPU: one NVLink domain; TPU: the family's example
    slice), for error messages and `shardscope systems`."""
    gpus = [f"{f.name}:{f.domain_size}" for f in GPU_FAMILIES.values()]
    tpus = [f"{f.name}:{'x'.join(map(str, f.example_shape))}" for f in TPU_FAMILIES.values()]
    return gpus + tpus


def system_of_size(system: System, devices: int) -> str | None:
    """A name of `system`'s family with `devices` devices (TPUs: Google's default shape
    for that many chips, else any slice the family has), or None when it has none."""
    if not isinstance(system, TpuSystem):
        return f"{system.family.name}:{devices}"
    f = system.family
    chips, rest = divmod(devices, system.chip.devices_per_chip)
    if rest or chips < 1:
        return None
    shape = f.default_shape(chips) or next(
        (s for s in f.valid_shapes() if math.prod(s) == chips), None)
    return None if shape is None else f"{f.name}:{'x'.join(map(str, shape))}"


# Overrides of the catalog's network, for a real cluster: (systems they apply to, type,
# what they mean). `[system]` in a config takes the same keys.
OVERRIDES = {
    "nic_gbps": ("gpu", float, "scale-out bandwidth per GPU, Gb/s"),
    "sharp": ("gpu", bool, "in-network reduction on the scale-out fabric (IB SHARP)"),
    "nvls": ("gpu", bool, "NVLink SHARP in NCCL's all-reduces (NCCL_NVLS_ENABLE; false: "
                          "rings and trees only)"),
    "gpus_per_domain": ("gpu", int, "GPUs of each NVLink domain the job uses"),
    "allreduce_alpha_us": ("gpu", float, "the cluster's smallest all-reduce across 2 nodes "
                                          "(nccl-tests, 8 B), us"),
    "pod_gpus": ("gpu", int, "GPUs per pod, the non-blocking fabric under the spine"),
    "pod_oversubscription": ("gpu", float, "the spine's taper above a pod (7 for 7:1)"),
    "fabric": ("gpu", str, "a published cluster's fabric, \"meta-24k\", "
                           "\"dgx-superpod-b200\" or \"dgx-superpod-gb200\", which sets "
                           "pod_gpus and pod_oversubscription (meshes.catalog.FABRICS)"),
    "dcn_gbps": ("tpu", float, "DCN bandwidth per chip between slices, Gb/s"),
}

# Published clusters' scale-out fabrics: what `[system] fabric = NAME` sets, with sources.
FABRICS = {
    "meta-24k": {
        "pod_gpus": 3072, "pod_oversubscription": 7.0,
        "source": "Meta's two 24,576-H100 clusters (RoCE and InfiniBand): 8 pods of 3,072 "
                  "GPUs, non-blocking inside a pod, 7:1 oversubscribed between pods (the "
                  "Llama 3 paper, section 3.3.1; glennklockwood.com, Meta's H100 clusters)",
    },
    "dgx-superpod-b200": {
        "pod_gpus": 2048, "pod_oversubscription": 1.0,
        "source": "NVIDIA DGX SuperPOD B200 reference architecture: scalable units of 32 "
                  "DGX B200 (256 GPUs); up to 8 SUs (2,048 GPUs) on leaf and spine, a core "
                  "tier above; as many leaf-spine and spine-core cables as node-leaf ones, "
                  "so every tier is non-blocking (its switch and cable count table)",
    },
    "dgx-superpod-gb200": {
        "pod_gpus": 576, "pod_oversubscription": 1.0,
        "source": "NVIDIA DGX SuperPOD GB200 reference architecture: a scalable unit is 8 "
                  "GB200 NVL72 racks (576 GPUs, 1.2 MW), NDR 400 Gb/s InfiniBand between "
                  "racks, scaling past 128 racks (9,216 GPUs); taken as non-blocking above "
                  "the SU like the B200 SuperPOD's tiers (the GB200 RA's cable table was "
                  "not read)",
    },
}


def get_system(name: str, **overrides) -> System:
    """Parse `<family>:<size>` into a System, with the real network's `overrides` of the
    catalog (OVERRIDES: nic_gbps, sharp, gpus_per_domain, allreduce_alpha_us for GPUs;
    dcn_gbps for TPUs).

    Raises:
        ValueError: unknown family, a size the family cannot have, or a bad override.
    """
    valid = ", ".join([*system_names(), f"{HOST_FAMILY}:N"])
    if not isinstance(name, str):
        raise TypeError(f"system name {name!r} is not a string; give <family>:<size>, e.g. "
                        f"{valid}")
    accelerator = _ACCELERATOR_TYPE.match(name)
    if accelerator and accelerator.group(1) in ACCELERATOR_TYPES:
        f = ACCELERATOR_TYPES[accelerator.group(1)]
        _check_overrides(name, "tpu", overrides)
        return _tpu_system(f, name, _accelerator_size(f, name, accelerator), overrides,
                           alias=name)
    family, sep, size = name.partition(":")
    if not sep or not size:
        raise ValueError(f"system {name!r} needs the form <family>:<size> or a TPU "
                         f"accelerator type (v6e-256, v5p-256); e.g. {valid}")
    if family in GPU_FAMILIES:
        _check_overrides(name, "gpu", overrides)
        return _gpu_system(GPU_FAMILIES[family], name, size, overrides)
    if family in TPU_FAMILIES:
        _check_overrides(name, "tpu", overrides)
        return _tpu_system(TPU_FAMILIES[family], name, size, overrides)
    if family == HOST_FAMILY:  # this machine's CPU as fake devices (meshes/host.py)
        if overrides:
            raise ValueError(f"system {name!r} takes no overrides ({', '.join(overrides)}): "
                             f"its rates are measured on this host")
        return host_system(size, name)
    families = [*GPU_FAMILIES, *TPU_FAMILIES, HOST_FAMILY]
    # a family the name begins (gb200 -> gb200-nvl72, not b200: another machine), else the
    # nearest spelling
    close = [f for f in families if f.startswith(f"{family.lower()}-")] or \
        difflib.get_close_matches(family.lower(), families, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}:{size}? " if close else ""
    raise ValueError(f"unknown system family {family!r} in {name!r}; {hint}valid: {valid}")


def _check_overrides(name: str, kind: str, overrides: dict) -> None:
    mine = [k for k, (applies, _, _) in OVERRIDES.items() if applies == kind]
    for key, value in overrides.items():
        if key not in OVERRIDES:
            raise ValueError(f"unknown system override {key!r}; valid: "
                             f"{', '.join(OVERRIDES)}")
        applies, want, meaning = OVERRIDES[key]
        if applies != kind:
            raise ValueError(f"system override {key!r} ({meaning}) applies to {applies.upper()} "
                             f"systems, not {name!r}; for it use {', '.join(mine)}")
        if want is str:
            if value not in FABRICS:
                raise ValueError(f"system override {key}={value!r} is not a known fabric; "
                                 f"valid: {', '.join(FABRICS)} (or set pod_gpus and "
                                 f"pod_oversubscription)")
            continue
        ok = isinstance(value, bool) if want is bool else (
            isinstance(value, int | float) and not isinstance(value, bool) and value > 0
            and (want is not int or float(value).is_integer()))
        if not ok:
            what = "true or false" if want is bool else f"a positive {want.__name__}"
            raise ValueError(f"system override {key}={value!r} must be {what} ({meaning})")


def _gpu_system(f: GpuFamily, name: str, size: str, overrides: dict) -> GpuSystem:
    if not size.isdigit() or int(size) < 1:
        raise ValueError(f"system {name!r}: size {size!r} must be a GPU count, e.g. {f.name}:"
                         f"{f.domain_size}")
    n = int(size)
    domain = int(overrides.get("gpus_per_domain", f.domain_size))
    if domain > f.domain_size:
        raise ValueError(f"system override gpus_per_domain={domain} exceeds the {f.domain_size} "
                         f"GPUs of a {f.name} NVLink domain; use at most {f.domain_size}")
    if overrides.get("pod_gpus", domain) % domain:  # a pod is whole nodes (racks)
        raise ValueError(f"system override pod_gpus={overrides['pod_gpus']} is not whole "
                         f"NVLink domains of {domain} GPUs; use a multiple of {domain}")
    if not 1 <= overrides.get("pod_oversubscription", 1) < math.inf:  # nan and inf too
        raise ValueError(f"system override pod_oversubscription="
                         f"{overrides['pod_oversubscription']} must be a finite number of at "
                         f"least 1 (1: a non-blocking spine; 7 for 7:1)")
    nic = overrides.get("nic_gbps")
    kw = dict(nic_bytes_per_s=nic * 1e9 / 8 if nic else None,
              sharp=bool(overrides.get("sharp", False)),
              nvls=bool(overrides.get("nvls", True)),
              gpus_per_domain=domain if "gpus_per_domain" in overrides else None)
    fixed = None
    if "allreduce_alpha_us" in overrides:
        # The fixed cost is what the measured 2-node time leaves over NCCL's constants.
        two = GpuSystem(f, 2 * domain, **kw, net_fixed_latency_s=0.0)
        model = two.collective_time_s("all-reduce", 8, [list(range(2 * domain))])
        fixed = max(0.0, overrides["allreduce_alpha_us"] * 1e-6 - model)
    tiers = dict(FABRICS[overrides["fabric"]]) if "fabric" in overrides else {}
    tiers.update({k: overrides[k] for k in ("pod_gpus", "pod_oversubscription")
                  if k in overrides})
    return GpuSystem(f, n, **kw, overrides=overrides, net_fixed_latency_s=fixed,
                     pod_gpus=int(tiers["pod_gpus"]) if "pod_gpus" in tiers else None,
                     pod_oversubscription=float(tiers.get("pod_oversubscription", 1.0)))


def _accelerator_size(f: TpuFamily, name: str, m: re.Match) -> str:
    """The `<shape>[*slices]` of an accelerator type (`v5p-256` -> `4x4x8`): the shape
    Google gives that many chips."""
    count, slices = int(m.group(2)), m.group(3)
    per_chip = f.type_cores_per_chip
    unit = "TensorCores (2 a chip)" if per_chip > 1 else "chips"
    shape = f.default_shape(count // per_chip) if count % per_chip == 0 else None
    if shape is None:
        sizes = _accelerator_sizes(f)
        near = sorted(sizes, key=lambda n: (abs(n - count), n))[:2]
        listed = ", ".join(f"{m.group(1)}-{n}" for n in sizes[:8])
        more = ", ... (then whole 4x4x4 cubes)" if len(sizes) > 8 else ""
        raise ValueError(f"system {name!r}: the number of {m.group(1)}-N counts {unit}, and "
                         f"Google has no {f.name} slice of {count}; the nearest are "
                         f"{' and '.join(f'{m.group(1)}-{n}' for n in sorted(near))} (sizes: "
                         f"{listed}{more}), or write the shape, e.g. {f.name}:"
                         f"{'x'.join(map(str, f.example_shape))}")
    return "x".join(map(str, shape)) + (f"*{slices}" if slices else "")


def _accelerator_sizes(f: TpuFamily) -> list[int]:
    """The N of every `<type>-N` the family has (one default shape each)."""
    chips = sorted({math.prod(s) for s in f.valid_shapes()})
    return [c * f.type_cores_per_chip for c in chips if f.default_shape(c) is not None]


def _tpu_system(f: TpuFamily, name: str, size: str, overrides: dict, *,
                alias: str = "") -> TpuSystem:
    """`alias`: the accelerator type the user wrote (`v5p-256`), said on reports."""
    m = _TOPOLOGY.match(size)
    example = "x".join(["4"] * f.ndim)
    if not m:
        raise ValueError(f"system {name!r}: size {size!r} must be a torus shape like "
                         f"{f.name}:{example} (optionally *SLICES)")
    shape = tuple(int(s) for s in m.group(1).split("x"))
    slices = int(m.group(2) or 1)
    if len(shape) != f.ndim:
        raise ValueError(f"system {name!r}: {f.name} slices are {f.ndim}D; give {f.ndim} "
                         f"dimensions like {f.name}:{example}")
    if slices < 1:
        raise ValueError(f"system {name!r}: *{slices} slices; give at least one, e.g. "
                         f"{f.name}:{m.group(1)}*2 for two slices over DCN")
    why = f.shape_error(shape)
    if why:
        raise ValueError(f"system {name!r}: {why}; {m.group(1)} is not; e.g. "
                         f"{f.example_for(shape)}")
    dcn = overrides.get("dcn_gbps")
    if dcn and slices == 1:
        raise ValueError(f"system override dcn_gbps applies to several slices over DCN; "
                         f"{name!r} is one slice (write e.g. {name}*2)")
    return TpuSystem(f, shape, slices, dcn_bytes_per_s_per_chip=dcn * 1e9 / 8 if dcn else None,
                     overrides=overrides, alias=alias)
