"""Device memory a training or serving program cannot use: the runtime's own share of HBM.

On TPUs the runtime keeps part of HBM for itself: XLA's out-of-memory report reads
"Total hbm usage = reserved + program + arguments", and JAX's `memory_stats()["bytes_limit"]`
is the rest. On GPUs the CUDA context, the libraries' workspaces and NCCL's buffers live
beside the program, and JAX preallocates a fraction of HBM for it
(`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 by default). Every figure carries its source.
"""

from __future__ import annotations

import dataclasses

from meshes.host import HostCpuSystem
from meshes.tpu import TpuSystem

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Reserve:
    """Bytes per device a runtime keeps out of the program's reach, and why."""

    what: str
    bytes: float
    source: str


# TPU generation -> HBM the runtime reserves per device: HBM less JAX's bytes_limit, or the
# "reserved" of XLA's out-of-memory report.
TPU_RESERVED: dict[str, tuple[float, str]] = {
    "tpu-v4": (1.25 * GiB, "XLA's out-of-memory report on a v4-32: 'of 30.75G hbm ... "
                           "reserved 1.25G' (erfanzar/EasyDeL#166); bytes_limit 30.75 GiB "
                           "(jax-ml/jax#1491)"),
    "tpu-v5e": (0.25 * GiB, "bytes_limit 16,909,332,480 B = 15.75 GiB of 16 GiB on a Kaggle "
                            "v5e-8; XLA: 'of 15.75G hbm' (m-cahill/tunix-rt M38 summary, "
                            "2025-12)"),
    "tpu-v5p": (0.26 * GiB, "XLA's out-of-memory error on v5p: 'exceeding available bytes: "
                            "95.74G' of 96 GiB (openxla/xla docs/errors/error_1000.md)"),
    "tpu-v6e": (0.75 * GiB, "bytes_limit 33,550,237,696 B = 31.25 GiB of 32 GiB on v6e "
                            "(vllm-project/vllm#16211, 2025-04)"),
    "tpu7x": (0.75 * GiB, "no public bytes_limit for TPU7x: v6e's 0.75 GiB assumed"),
}

# GPUs: the CUDA context with cuBLAS / cuDNN workspaces, and NCCL's buffers per
# communicator (one per parallelism group the program communicates over).
CUDA_RESERVE = Reserve(
    "CUDA context and library workspaces", 1 * GiB,
    "nccl-tests holds back 1 GB per GPU for CUDA's own use, 'empirical ... on HGX/DGX' "
    "(NVIDIA/nccl-tests#198); a context alone is ~300-555 MiB (pytorch/pytorch#107667, "
    "ggml-org/llama.cpp#23604)")
NCCL_PER_COMMUNICATOR = (
    0.6 * GiB,
    "NCCL's buffers per communicator: 544-688 MB per group on 4 A100s over NVLink "
    "(NVIDIA/nccl#964); they grow with channels and with NVLink SHARP (vllm-project/vllm#9699: "
    "2.25 GiB of NVLS buffers on 8 H200s)")
# JAX preallocates this fraction of a GPU's total memory for its pool (JAX docs, GPU memory
# allocation; of the total since jaxlib 0.4.1).
JAX_GPU_MEM_FRACTION = 0.75


def runtime_reserve(system, communicators: int) -> list[Reserve]:
    """What the runtime keeps per device on `system` (a meshes.System) for a program that
    communicates over `communicators` groups (the mesh axes of size > 1)."""
    if isinstance(system, HostCpuSystem):
        return []  # host memory: nothing set aside per device
    if isinstance(system, TpuSystem):
        entry = TPU_RESERVED.get(system.chip.name)  # Trainium: no public figure
        return [] if entry is None else [Reserve("TPU runtime reserve", *entry)]
    nccl, source = NCCL_PER_COMMUNICATOR
    out = [CUDA_RESERVE]
    if communicators:
        plural = "" if communicators == 1 else "s"
        out.append(Reserve(f"NCCL buffers ({communicators} communicator{plural})",
                           nccl * communicators, source))
    return out


def reserved(system, communicators: int) -> tuple[tuple[str, float], ...]:
    """`runtime_reserve` as the (what, bytes) pairs a sharding.Memory keeps."""
    return tuple((r.what, r.bytes) for r in runtime_reserve(system, communicators))
