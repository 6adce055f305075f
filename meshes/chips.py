"""Accelerator chips: peak rates, HBM, and achieved efficiencies, each with its source.

Every number here comes from a spec sheet, the scaling book ("How to Scale Your Model",
jax-ml, 2025-2026) or a published microbenchmark, named next to it (in a comment or the
entry's `source`). Peak FLOP/s are dense (no sparsity). Figures are per JAX device: a TPU7x
chip shows as two devices, so its entry is per TensorCore.
"""

from __future__ import annotations

import dataclasses

from meshes.interpolate import log_interp

TERA = 1e12
PETA = 1e15
GB = 1e9
GiB = 2**30
MiB = 2**20
# A GPU's HBM is what its driver reports as the device's memory, nvidia-smi's memory.total
# (MiB), for every NVIDIA GPU here: the datasheets' "80GB" / "141GB" / "180GB" read as
# 1e9 bytes were 4-7% low. (The CUDA runtime's total is a few hundred MiB below it: 79.22
# GiB on an H100, vllm-project/vllm#10511; 178.35 GiB on a B200, pytorch/ao#4002. It is
# not public for every chip, so one convention, the driver's, is used for all.) A TPU's is
# what XLA reports, in GiB. Each entry's `hbm_source` says which; `Chip.hbm_figure` writes
# the figure in the units each reader knows (`shardscope systems`).
NVIDIA_SMI = "nvidia-smi's memory.total"
_XLA_HBM = ("XLA's HBM in GiB, as the scaling book's tpus.md gives it; JAX's bytes_limit "
            "keeps a runtime reserve below it (meshes/reserves.py)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One JAX device's worth of an accelerator.

    Attributes:
        name: catalog name, e.g. "h100".
        peak_flops_per_s: dense peak by matmul dtype ("bfloat16", "float8", "float4", "int8").
        hbm_bytes: HBM capacity per device.
        hbm_source: what the HBM figure is (the driver's total, XLA's) and where from.
        hbm_bytes_per_s: spec HBM bandwidth per device.
        matmul_efficiency: achieved / peak FLOP/s on a large matmul (microbenchmark).
        hbm_efficiency: achieved / spec HBM bandwidth on a large copy (microbenchmark).
        tdp_w: spec power per device, None where no public figure was found.
        devices_per_chip: JAX devices per physical chip (TPU7x: 2).
        source: where the numbers come from.
    """

    name: str
    peak_flops_per_s: dict[str, float]
    hbm_bytes: float
    hbm_bytes_per_s: float
    matmul_efficiency: float
    hbm_efficiency: float
    tdp_w: float | None
    devices_per_chip: int = 1
    source: str
    hbm_source: str = ""
    # Measured matmul efficiency for other dtypes (FP8, FP4), where a benchmark exists.
    low_precision_efficiency: dict[str, float] = dataclasses.field(default_factory=dict)
    # Which measured size curve scales the efficiency with matmul size ("gpu" or "tpu").
    size_curve: str = "gpu"
    # The link to host memory, per device and direction (activation offload), with source;
    # None where no public figure is in the reference.
    host_bytes_per_s: float | None = None
    host_source: str = ""
    # A fixed time per kernel measured on the chip itself (host-cpu), used in place of the
    # calibration's fitted kernel_overhead_s; None: the fit's.
    kernel_overhead_s: float | None = None
    # The fixed time of one op of a compiled program that the chip sequences itself (TPUs:
    # TPU_OP_S, a published microbenchmark), which every step on it pays per kernel in place
    # of the calibration's kernel_overhead_s (fitted on GPU steps, whose kernels a host
    # launches); unlike kernel_overhead_s its kernels are counted in the report, and left out
    # of the fit. None: the fit's.
    program_op_s: float | None = None
    program_op_source: str = ""
    # The rates were benchmarked on this machine (meshes/host.py): no fit scales them.
    rates_measured_here: bool = False

    def hbm_figure(self) -> str:
        """The HBM figure in MiB, GiB and GB (datasheets say "80GB" for about 80 GiB,
        reports print GB), with what it is and its source."""
        return (f"{self.hbm_bytes / MiB:,.0f} MiB = {self.hbm_bytes / GiB:.2f} GiB = "
                f"{self.hbm_bytes / GB:.2f} GB per device: {self.hbm_source}")

    def efficiency_for(self, dtype: str, size: float | None = None) -> float:
        """Achieved / peak for a matmul in `dtype`; `size` is its cube-equivalent
        dimension (M*N*K)^(1/3). The chip's figures are for large (~8192^3) matmuls; the
        measured curve of its family scales them (small matmuls are slower)."""
        base = self.low_precision_efficiency.get(dtype_class(dtype), self.matmul_efficiency)
        if size is None:
            return base
        return base * size_factor(self.size_curve, size)

    def peak_for(self, dtype: str) -> float:
        """Peak FLOP/s for a matmul dtype; float32 runs at the bf16 rate / 2 when absent."""
        dtype = dtype_class(dtype)
        if dtype in self.peak_flops_per_s:
            return self.peak_flops_per_s[dtype]
        if dtype == "float32":
            # No chip here has an fp32 tensor-core figure in the catalog; an fp32 matmul is
            # done in multiple bf16 passes on TPU and at TF32-ish rates on GPU. Half the
            # bf16 rate is a deliberately optimistic stand-in; real runs compute in bf16.
            return self.peak_flops_per_s["bfloat16"] / 2
        if dtype in ("int8", "float8") and "float8" in self.peak_flops_per_s:
            return self.peak_flops_per_s["float8"]
        return self.peak_flops_per_s["bfloat16"]


# Measured GEMM efficiency against size (cube-equivalent dimension): H100 FP8 cuBLASLt on
# Azure ND H100 v5 (Azure/AI-benchmarking-guide, Azure_Results/ND_H100_v5_results.md) for
# GPUs; TPU7x bf16 per TensorCore (AI-Hypercomputer/tpu-recipes ironwood microbenchmarks)
# for TPUs. Only the curve's shape is used: relative to its value at 8192, where each chip's
# own efficiency was measured; flat below its smallest size. The GPU run's 1024^3 point
# (274 TFLOP/s: 7.8 us) is left out: t = a + 2 N^3 / R through its 4096 and 8192 points
# gives a = 7.5 us, R = 1302 TFLOP/s, so that GEMM's time is the fixed time of a kernel,
# which the calibration's kernel_overhead_s adds to every kernel: in the rate too, small
# matmuls (a decode step's, 16 rows of tokens) paid it twice and read as math-bound at
# 11% of peak where they stream their weights.
MATMUL_SIZE_CURVES = {
    "gpu": ((4096, 1217 / 1979), (8192, 1290 / 1979), (16384, 1377 / 1979)),
    "tpu": ((4096, 893 / 1150), (16384, 950 / 1150)),
}
_REFERENCE_SIZE = 8192


def size_factor(curve: str, size: float) -> float:
    """Efficiency at `size` relative to the efficiency at 8192^3 on the measured curve."""
    sizes, effs = zip(*MATMUL_SIZE_CURVES[curve])
    return log_interp(sizes, effs, size) / log_interp(sizes, effs, _REFERENCE_SIZE)


def best_size_factor(curve: str) -> float:
    """The largest `size_factor` on the curve: matmuls bigger than 8192^3 may run faster."""
    sizes, effs = zip(*MATMUL_SIZE_CURVES[curve])
    return max(effs) / log_interp(sizes, effs, _REFERENCE_SIZE)


# How reports and `shardscope validate` name a matmul format (a dtype class).
FORMAT_LABELS = {"bfloat16": "bf16", "float32": "f32", "float8": "fp8", "float4": "fp4"}


def dtype_class(dtype: str) -> str:
    """"float8_e4m3fn" -> "float8", "float4_e2m1fn" -> "float4", "uint8" -> "int8"."""
    for prefix in ("float8", "float4"):
        if dtype.startswith(prefix):
            return prefix
    return "int8" if dtype in ("int8", "uint8") else dtype


# Measured low-precision GEMMs (Azure/AI-benchmarking-guide, Azure_Results/): H100 FP8
# cuBLASLt 1290 TFLOP/s at 8192^3 (ND_H100_v5_results.md); GB200 FP8 2877 and FP4 7536
# TFLOP/s at 8192^3 (ND_GB200_v6_results.md). B200 and GB300 share GB200's Blackwell tensor
# cores: same ratios.
_H100_LOW = {"float8": 1290 / 1979}
_BLACKWELL_LOW = {"float8": 2877 / 5000, "float4": 7536 / 10000}

# GPU large-matmul efficiency: the scaling book (roofline.md) says GPUs reach 80-85% of
# peak on large matmuls; H100 FP8 cuBLASLt measures 1290/1979 = 0.65 at 8192^3 (Azure ND
# H100 v5) -- that is FP8, whose peak is harder to reach. We take 0.80 for bf16 on GPUs.
GPU_BF16_BOOK_EFFICIENCY = 0.80
# H100 HBM STREAM triad 2.97 TB/s of 3.35 spec (Azure ND H100 v5): 0.887.
_GPU_HBM_EFF = 2.97 / 3.35

# The fixed time a kernel costs on a GPU when the step is replayed as a CUDA graph, as
# serving engines run decode: the GPU's gap between one kernel and the next, measured on an
# H100 with a dummy kernel that records its start and end times: ~2.1 us launched on a
# CUDA stream, ~1.3 us replayed from a CUDA graph. It is a launch, not a training step's
# fitted per-kernel time (meshes/calibration.toml's kernel_overhead_s, which also holds a
# framework's host gaps). Measured on Hopper only; the catalog's other NVIDIA GPUs are given
# the same figure (no public measurement for them).
CUDA_GRAPH_KERNEL_S = 1.3e-6
CUDA_GRAPH_KERNEL_SOURCE = (
    "Hazy Research, 'Look Ma, No Bubbles! Designing a Low-Latency Megakernel for Llama-1B' "
    "(2025-05-27, hazyresearch.stanford.edu/blog/2025-05-27-no-bubbles): a dummy kernel "
    "on an H100, ~2.1 us launch cost on a CUDA stream, ~1.3 us with CUDA graphs")

# The fixed time of one op on a TPU. A TPU runs a step as one compiled program whose ops the
# chip sequences itself, with no launch from the host, in training as in decode; an op with
# next to nothing to do still takes its DMA setup and its pipeline's fill and drain. Measured
# on TPU7x, per TensorCore, as the op's device duration in the profiler's trace: a 128^3 bf16
# GEMM (4.2 MFLOP, 96 KiB) runs at 2.59 TFLOP/s, 1.62 us; the HBM copy sweep from 2 to 256
# MiB fits t = 1.53 us + 2 x bytes / 3.20 TB/s (least squares). A gap between one op and the
# next, which the trace does not time, is not in it. Measured on TPU7x only; the catalog's
# other TPUs are given the same figure (no public measurement for them).
TPU_OP_S = 1.6e-6
TPU_OP_SOURCE = (
    "AI-Hypercomputer/tpu-recipes@9e2e1dbc microbenchmarks/ironwood: README.md GEMM table "
    "(128^3 bf16, 2.59 TFLOP/s per device: 1.62 us) and hbm/hbm.md copy sweep (intercept "
    "1.53 us), each the op's device duration in the trace "
    "(AI-Hypercomputer/accelerator-microbenchmarks); measured on TPU7x, given to the other "
    "TPUs as is")

CHIPS: dict[str, Chip] = {
    "a100": Chip(
        name="a100",
        peak_flops_per_s={"bfloat16": 312 * TERA, "int8": 624 * TERA},
        hbm_bytes=81920 * MiB,
        hbm_source=f"{NVIDIA_SMI} on an A100 80GB (modal-labs/modal-client#2797)",
        hbm_bytes_per_s=2.04e12,
        matmul_efficiency=GPU_BF16_BOOK_EFFICIENCY,
        hbm_efficiency=_GPU_HBM_EFF,
        tdp_w=400,
        host_bytes_per_s=32e9,
        host_source="PCIe Gen4 x16, 64 GB/s both ways (A100 SXM datasheet)",
        source="NVIDIA A100 SXM 80GB datasheet",
    ),
    "h100": Chip(
        name="h100",
        low_precision_efficiency=_H100_LOW,
        peak_flops_per_s={"bfloat16": 989 * TERA, "float8": 1979 * TERA, "int8": 1979 * TERA},
        hbm_bytes=81559 * MiB,
        hbm_source=(f"{NVIDIA_SMI} on an H100 80GB HBM3, the datasheet's \"80GB\" "
                    f"(modal-labs/modal-client#2797; huggingface/text-embeddings-inference#350)"),
        hbm_bytes_per_s=3.35e12,
        matmul_efficiency=GPU_BF16_BOOK_EFFICIENCY,
        hbm_efficiency=_GPU_HBM_EFF,
        tdp_w=700,
        host_bytes_per_s=64e9,
        host_source="PCIe Gen5 x16, 128 GB/s both ways (H100 SXM datasheet)",
        source="NVIDIA H100 SXM datasheet; scaling book gpus.md",
    ),
    "h200": Chip(
        name="h200",
        low_precision_efficiency=_H100_LOW,
        peak_flops_per_s={"bfloat16": 989 * TERA, "float8": 1979 * TERA, "int8": 1979 * TERA},
        hbm_bytes=143771 * MiB,
        hbm_source=(f"{NVIDIA_SMI} on an H200, the datasheet's \"141GB\" (public nvidia-smi "
                    f"logs)"),
        hbm_bytes_per_s=4.8e12,
        matmul_efficiency=GPU_BF16_BOOK_EFFICIENCY,
        hbm_efficiency=_GPU_HBM_EFF,
        tdp_w=700,
        host_bytes_per_s=64e9,
        host_source="PCIe Gen5 x16, 128 GB/s both ways (H200 SXM datasheet)",
        source="NVIDIA H200 SXM datasheet; scaling book gpus.md",
    ),
    "b200": Chip(
        name="b200",
        low_precision_efficiency=_BLACKWELL_LOW,
        # Scaling book gpus.md gives 2.3e15 bf16; NVIDIA HGX B200 (1000 W) 2.25e15: we use
        # the datasheet figure.
        peak_flops_per_s={"bfloat16": 2.25 * PETA, "float8": 4.5 * PETA, "float4": 9 * PETA},
        hbm_bytes=183359 * MiB,
        hbm_source=(f"{NVIDIA_SMI} on an HGX B200, the datasheet's \"180GB\" "
                    f"(NVIDIA/TensorRT-LLM#10278)"),
        hbm_bytes_per_s=7.7e12,  # 7.7-8 TB/s by source; scaling book uses 8.0e12.
        matmul_efficiency=GPU_BF16_BOOK_EFFICIENCY,
        hbm_efficiency=_GPU_HBM_EFF,
        tdp_w=1000,
        host_bytes_per_s=64e9,
        host_source="PCIe Gen5 x16 to the host CPU, 128 GB/s both ways (HGX B200 host interface)",
        source="NVIDIA HGX B200 datasheet; glennklockwood.com B200 page; scaling book gpus.md",
    ),
    "gb200": Chip(
        name="gb200",
        low_precision_efficiency=_BLACKWELL_LOW,
        peak_flops_per_s={"bfloat16": 2.5 * PETA, "float8": 5 * PETA, "float4": 10 * PETA},
        hbm_bytes=189471 * MiB,
        hbm_source=(f"{NVIDIA_SMI} on a GB200, the datasheet's \"186GB\" (public nvidia-smi "
                    f"logs)"),
        hbm_bytes_per_s=8e12,
        # FP8 GEMM 2877 TF at 8192^3 of 5000 (Azure ND GB200 v6) = 0.575 for FP8; bf16 on
        # GPUs per the scaling book: 0.80.
        matmul_efficiency=GPU_BF16_BOOK_EFFICIENCY,
        hbm_efficiency=_GPU_HBM_EFF,
        tdp_w=1200,
        host_bytes_per_s=225e9,
        host_source=("NVLink-C2C, 900 GB/s both ways between Grace and its two GPUs "
                     "(GB200 NVL72 datasheet)"),
        source="glennklockwood.com B200 page (GB200 at 1200 W); NVIDIA GB200 NVL72 datasheet",
    ),
    "gb300": Chip(
        name="gb300",
        low_precision_efficiency=_BLACKWELL_LOW,
        peak_flops_per_s={"bfloat16": 2.5 * PETA, "float8": 5 * PETA, "float4": 15 * PETA},
        hbm_bytes=284208 * MiB,
        hbm_source=(f"{NVIDIA_SMI} on a GB300, 279-288 GB by source (OCI GB300 bring-up "
                    f"guide's nvidia-smi output)"),
        hbm_bytes_per_s=8e12,
        matmul_efficiency=GPU_BF16_BOOK_EFFICIENCY,
        hbm_efficiency=_GPU_HBM_EFF,
        tdp_w=1400,
        host_bytes_per_s=225e9,
        host_source=("NVLink-C2C, 900 GB/s both ways between Grace and its two GPUs "
                     "(GB300 NVL72 datasheet)"),
        source="verda.com GB300 architecture post; NVIDIA GB300 NVL72 datasheet",
    ),
    # TPUs: scaling book tpus.md table. TPU chip power is public for v4 only (Google Cloud's
    # TPU v4 page: 192 W maximum); None for the others (TPU7x has a pod figure:
    # meshes/power.py).
    "tpu-v4": Chip(
        name="tpu-v4",
        size_curve="tpu",
        program_op_s=TPU_OP_S,
        program_op_source=TPU_OP_SOURCE,
        peak_flops_per_s={"bfloat16": 2.75e14, "int8": 2.75e14},
        hbm_bytes=32 * GiB,
        hbm_source=_XLA_HBM,
        hbm_bytes_per_s=1.2e12,
        matmul_efficiency=0.90,  # v6e measured 827/920; same MXU design family.
        hbm_efficiency=1.36 / 1.6,  # v6e HBM copy 1.36 of 1.6 TB/s (tpu-recipes).
        tdp_w=192,
        source="scaling book tpus.md; 192 W max (Google Cloud TPU v4 documentation)",
    ),
    "tpu-v5e": Chip(
        name="tpu-v5e",
        size_curve="tpu",
        program_op_s=TPU_OP_S,
        program_op_source=TPU_OP_SOURCE,
        peak_flops_per_s={"bfloat16": 1.97e14, "int8": 3.94e14, "float8": 3.94e14},
        hbm_bytes=16 * GiB,
        hbm_source=_XLA_HBM,
        hbm_bytes_per_s=8.2e11,
        matmul_efficiency=0.90,
        hbm_efficiency=1.36 / 1.6,
        tdp_w=None,
        source="scaling book tpus.md",
    ),
    "tpu-v5p": Chip(
        name="tpu-v5p",
        size_curve="tpu",
        program_op_s=TPU_OP_S,
        program_op_source=TPU_OP_SOURCE,
        peak_flops_per_s={"bfloat16": 4.59e14, "int8": 9.18e14, "float8": 9.18e14},
        hbm_bytes=96 * GiB,
        hbm_source=_XLA_HBM,
        hbm_bytes_per_s=2.8e12,
        matmul_efficiency=0.90,
        hbm_efficiency=1.36 / 1.6,
        tdp_w=None,
        source="scaling book tpus.md",
    ),
    "tpu-v6e": Chip(
        name="tpu-v6e",
        size_curve="tpu",
        program_op_s=TPU_OP_S,
        program_op_source=TPU_OP_SOURCE,
        peak_flops_per_s={"bfloat16": 9.20e14, "int8": 1.84e15, "float8": 1.84e15},
        hbm_bytes=32 * GiB,
        hbm_source=_XLA_HBM,
        hbm_bytes_per_s=1.6e12,
        matmul_efficiency=827 / 920,  # bf16 8192^3 matmul, tpu-recipes microbenchmarks.
        hbm_efficiency=1.36 / 1.6,  # HBM copy of 32 MiB, tpu-recipes microbenchmarks.
        tdp_w=None,
        source="scaling book tpus.md; AI-Hypercomputer tpu-recipes microbenchmarks",
    ),
    "tpu7x": Chip(
        name="tpu7x",
        size_curve="tpu",
        program_op_s=TPU_OP_S,
        program_op_source=TPU_OP_SOURCE,
        # Per TensorCore (one JAX device): the chip's 2.30e15 bf16 / 4.61e15 fp8, 192 GB and
        # 7.4e12 B/s are split over its two TensorCores.
        peak_flops_per_s={"bfloat16": 2.30e15 / 2, "float8": 4.61e15 / 2, "int8": 4.61e15 / 2},
        hbm_bytes=192 * GiB / 2,
        hbm_source=f"half the chip's 192 GiB, one TensorCore's; {_XLA_HBM}",
        hbm_bytes_per_s=7.4e12 / 2,
        matmul_efficiency=950 / 1150,  # bf16 GEMM per core 16384^3 (tpu-recipes ironwood).
        hbm_efficiency=3.2 / 3.7,  # HBM copy >= 128 MiB per core (tpu-recipes ironwood).
        tdp_w=None,
        devices_per_chip=2,
        source="scaling book tpus.md; AI-Hypercomputer tpu-recipes ironwood microbenchmarks",
    ),
    # AWS Trainium2 (AWS Neuron docs, Trainium2 architecture: 667 BF16 and 1,299 FP8 dense
    # TFLOPS, 96 GiB of HBM at 2.9 TB/s). No public GEMM or copy microbenchmark: its
    # systolic tensor engines borrow the TPU's measured large-GEMM and HBM-copy efficiencies
    # and size curve, and the TPU fit applies (no Trainium run is in the validation set).
    # Power is not public.
    "trainium2": Chip(
        name="trainium2",
        size_curve="tpu",
        peak_flops_per_s={"bfloat16": 667e12, "float8": 1299e12},
        hbm_bytes=96 * GiB,
        hbm_source="96 GiB a chip (AWS Neuron docs, Trainium2 architecture)",
        hbm_bytes_per_s=2.9e12,
        matmul_efficiency=827 / 920,
        hbm_efficiency=1.36 / 1.6,
        tdp_w=None,
        source="AWS Neuron docs (Trainium2 architecture; Trainium2 Architecture Guide for "
               "NKI); efficiencies borrowed from TPU v6e microbenchmarks (none public)",
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuTarget:
    """What XLA:GPU needs to compile for a GPU it cannot see (its GpuTargetConfig):
    streaming multiprocessors, CUDA compute capability, boost clock, L2 and shared memory.
    HBM size and bandwidth come from the Chip entry."""

    description: str
    sm_count: int
    compute_capability: tuple[int, int]
    clock_ghz: float
    l2_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    source: str


_HOPPER_SMEM = dict(shared_memory_per_sm=233472, shared_memory_per_block_optin=232448)
_HOPPER_SOURCE = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper (132 SMs on SXM5, "
                  "50 MB L2, 228 KB shared memory per SM, compute capability 9.0); "
                  "XLA's H100 GpuTargetConfig, openxla/xla "
                  "xla/backends/gpu/target_config/specs/h100_sxm.txtpb")
_BLACKWELL_SMEM = dict(shared_memory_per_sm=233472, shared_memory_per_block_optin=232448)

GPU_TARGETS: dict[str, GpuTarget] = {
    "a100": GpuTarget(description="NVIDIA A100-SXM4-80GB", sm_count=108,
                      compute_capability=(8, 0), clock_ghz=1.41, l2_bytes=40 * 2**20,
                      shared_memory_per_sm=167936, shared_memory_per_block_optin=166912,
                      source="NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs, "
                             "40 MB L2, 164 KB shared memory per SM, compute capability 8.0)"),
    "h100": GpuTarget(description="NVIDIA H100 80GB HBM3", sm_count=132,
                      compute_capability=(9, 0), clock_ghz=1.98, l2_bytes=50 * 2**20,
                      **_HOPPER_SMEM, source=_HOPPER_SOURCE),
    "h200": GpuTarget(description="NVIDIA H200", sm_count=132, compute_capability=(9, 0),
                      clock_ghz=1.98, l2_bytes=50 * 2**20, **_HOPPER_SMEM,
                      source="the H100's GH100 die with 141 GB HBM3e (H200 datasheet); "
                             + _HOPPER_SOURCE),
    "b200": GpuTarget(description="NVIDIA B200", sm_count=148, compute_capability=(10, 0),
                      clock_ghz=1.965, l2_bytes=126 * 2**20, **_BLACKWELL_SMEM,
                      source="NVIDIA Blackwell architecture technical brief (two dies, 148 "
                             "SMs, compute capability 10.0); the L2 size and clock are not "
                             "from a datasheet: they steer only XLA's tiling "
                             "heuristics, not which collectives it emits"),
    "gb200": GpuTarget(description="NVIDIA GB200", sm_count=148, compute_capability=(10, 0),
                       clock_ghz=1.965, l2_bytes=126 * 2**20, **_BLACKWELL_SMEM,
                       source="the B200 GPU of a Grace Blackwell superchip (GB200 NVL72 "
                              "datasheet)"),
    "gb300": GpuTarget(description="NVIDIA GB300", sm_count=160, compute_capability=(10, 3),
                       clock_ghz=1.965, l2_bytes=126 * 2**20, **_BLACKWELL_SMEM,
                       source="NVIDIA technical blog 'Inside NVIDIA Blackwell Ultra' (160 SMs, "
                              "compute capability 10.3); L2 and clock as B200 (unverified, "
                              "tiling heuristics only)"),
}
