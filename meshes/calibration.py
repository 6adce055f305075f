"""The step-time model's fitted efficiencies: a few physically meaningful parameters that
no microbenchmark in the reference pins down, fitted on published runs.

- `gpu_bf16_matmul_efficiency`: the fraction of peak a GPU's bf16 matmuls reach in a
  training step. The catalog's 0.80 is the scaling book's "80-85%", not a measurement.
- `gpu_low_precision_matmul_scale`: the fraction of the microbenchmarked cuBLASLt GEMM rate
  (H100 FP8 1290/1979; Blackwell FP8 2877/5000, FP4 7536/10000) a GPU's FP8 / FP4 matmuls
  sustain in a training step (clocks under sustained power, SMs shared with NCCL's
  kernels): what `tpu_matmul_scale` is for TPUs.
- `tpu_matmul_scale`: the fraction of the microbenchmarked GEMM rate (v6e 827/920, TPU7x
  950/1150) a TPU's matmuls sustain in a training step, where the MXUs share the chip with
  the vector units, HBM traffic and ICI DMA.
- `flash_attention_efficiency`: a GPU's fused flash-attention kernel's rate relative to
  its large-GEMM rate (its softmax, masking and tiles are not a large GEMM's; nor is it a
  GEMM of its tiles' size, so the GEMM size curve does not apply to it): cuDNN's /
  Transformer Engine's fused attention.
- `tpu_flash_attention_efficiency`: the same for a TPU's, another kernel (Pallas splash
  attention) on another machine (the vector units' softmax beside the MXUs).
- `kernel_overhead_s`: fixed time per kernel (launch, prologue, pipeline fill), added to
  every matmul and memory-bound kernel.

`shardscope calibrate DIR --out CAL.toml` fits them on measured runs; the catalog's values
(meshes/calibration.toml) were fitted that way on experiments/validation and carry their
provenance. `--calibration CAL.toml` on `run`, `fit`, `validate`, `search`, `compare` and
`measure` uses a user's own fit.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path

from meshes.chips import GPU_BF16_BOOK_EFFICIENCY, Chip, best_size_factor

CATALOG_FILE = Path(__file__).with_name("calibration.toml")

# name -> (lower bound, upper bound, the uncalibrated value, what it means). The bounds are
# what is physically possible, not what fits best.
PARAMETERS = {
    "gpu_bf16_matmul_efficiency": (0.3, 0.95, GPU_BF16_BOOK_EFFICIENCY,
                                   "GPU bf16 matmul fraction of peak"),
    "gpu_low_precision_matmul_scale": (0.3, 1.1, 1.0, "GPU FP8 / FP4 matmul rate / "
                                       "microbenchmarked GEMM rate"),
    "tpu_matmul_scale": (0.3, 1.1, 1.0, "TPU matmul rate / microbenchmarked GEMM rate"),
    "flash_attention_efficiency": (0.1, 1.0, 1.0,
                                   "GPU flash attention rate / large-GEMM rate"),
    "tpu_flash_attention_efficiency": (0.1, 1.0, 1.0,
                                       "TPU flash attention rate / large-GEMM rate"),
    "kernel_overhead_s": (0.0, 50e-6, 0.0, "fixed time per kernel, s"),
}
# Matmul rate classes: which parameter scales a matmul's rate.
# ("host": the rates `shardscope measure` benchmarked on this machine, which no fit scales)
RATE_CLASSES = ("gpu_bf16", "tpu", "measured", "host")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """Values of PARAMETERS, and where they come from."""

    gpu_bf16_matmul_efficiency: float = GPU_BF16_BOOK_EFFICIENCY
    gpu_low_precision_matmul_scale: float = 1.0
    tpu_matmul_scale: float = 1.0
    flash_attention_efficiency: float = 1.0
    tpu_flash_attention_efficiency: float = 1.0
    kernel_overhead_s: float = 0.0
    source: str = "uncalibrated: microbenchmark and book figures only"
    # System family and matmul format ("tpu-v6e bf16") -> (the best MFU a measured run
    # reached on it, with our model-FLOP count, and that run's name): what a suspect
    # estimate's message compares it with (not the threshold: Report.mfu_ceiling).
    best_mfu: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name, (lo, hi, _, meaning) in PARAMETERS.items():
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"calibration {name}={v!r} ({meaning}) must be a number in "
                                 f"[{lo:g}, {hi:g}]")

    @staticmethod
    def rate_class(chip: Chip, dtype: str) -> str:
        """Which parameter scales a matmul of `dtype` on `chip`."""
        if chip.size_curve == "tpu":
            return "tpu"
        if chip.rates_measured_here:
            return "host"
        measured = dtype.startswith(tuple(chip.low_precision_efficiency))
        return "measured" if measured else "gpu_bf16"

    def rate_factor(self, rate_class: str) -> float:
        """Multiplier on the catalog's matmul rate for a rate class (the GPUs' bf16 figure
        is the book's GPU_BF16_BOOK_EFFICIENCY)."""
        if rate_class == "gpu_bf16":
            return self.gpu_bf16_matmul_efficiency / GPU_BF16_BOOK_EFFICIENCY
        if rate_class == "tpu":
            return self.tpu_matmul_scale
        if rate_class == "host":
            return 1.0
        return self.gpu_low_precision_matmul_scale  # "measured"

    def rate_phrase(self, rate_class: str) -> str:
        """What a rate class's matmul rate is, in words: which figure it scales, by how
        much, and where that factor comes from (a report's bottleneck line says it, since
        a fitted bf16 one carries the fitted runs' framework costs, not the chip's alone)."""
        fitted = self != IDENTITY and not self.source.startswith("uncalibrated")
        # the provenance's head: "fitted on 25 measured runs (experiments/validation, ...)"
        how = self.source.split(":")[0] if fitted else "uncalibrated"
        if rate_class == "gpu_bf16":
            rate = f"{self.gpu_bf16_matmul_efficiency:.0%} of the bf16 peak"
            if fitted:
                return (f"{rate}, {how}: their frameworks' costs included, not the GEMM's "
                        f"alone")
            return f"{rate}, the scaling book's figure ({how})"
        if rate_class == "tpu":
            return f"{self.tpu_matmul_scale:.0%} of the TPU's microbenchmarked GEMM rate, {how}"
        if rate_class == "host":
            return "this machine's measured rates (shardscope measure)"
        return (f"{self.gpu_low_precision_matmul_scale:.0%} of the cuBLASLt FP8 / FP4 GEMM "
                f"microbenchmark, {how}")

    def best_matmul_rate(self, chip: Chip, dtype: str) -> float:
        """The fastest FLOP/s the step model times a matmul of `dtype` at on `chip`: the
        microbenchmarked large-GEMM efficiency at the measured curve's best size, times
        this calibration's factor (flash attention and smaller matmuls run slower)."""
        return (chip.peak_for(dtype) * chip.efficiency_for(dtype)
                * best_size_factor(chip.size_curve)
                * self.rate_factor(self.rate_class(chip, dtype)))

    def attention_factor(self, rate_class: str) -> float:
        """Multiplier on a rate class's matmul rate inside a fused flash-attention kernel
        (none on "host": this machine's measured rates, which no fit scales)."""
        if rate_class == "host":
            return 1.0
        return self.tpu_flash_attention_efficiency if rate_class == "tpu" \
            else self.flash_attention_efficiency

    def values(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PARAMETERS}

    def summary(self) -> dict:
        """Its values and where they come from: a report's JSON `calibration`."""
        return {**self.values(), "source": self.source}

    def to_dict(self) -> dict:
        """The calibration file's tables (`calibration_from_dict` reads them back): how a
        calibration travels to a compile in another process."""
        return {"parameters": self.values(), "provenance": {"summary": self.source},
                "best_measured_mfu": {f: {"mfu": m, "run": run}
                                      for f, (m, run) in self.best_mfu.items()}}


IDENTITY = Calibration()


# A calibration file's tables, as `shardscope calibrate --out` writes them.
TABLES = ("parameters", "provenance", "best_measured_mfu")


def calibration_from_dict(raw: dict, where: str) -> Calibration:
    """A calibration file's contents: `[parameters]` (any of PARAMETERS; the rest
    uncalibrated, which the source shown in reports then says), `[provenance]` (what
    informed it; its `summary` is that source) and `[best_measured_mfu]`. ValueError, in
    one line naming the file, for anything else."""
    form = "as `shardscope calibrate --out` writes it"
    for key in raw:
        if key not in TABLES:
            raise ValueError(f"{where}: unknown table or key {key!r}; a calibration file has "
                             f"[parameters], [provenance] and [best_measured_mfu] ({form})")
    params = raw.get("parameters")
    if not isinstance(params, dict):
        raise ValueError(f"{where}: no [parameters] table of name = value lines ({form}; "
                         f"valid names: {', '.join(PARAMETERS)})")
    for key in params:
        if key not in PARAMETERS:
            raise ValueError(f"{where}: unknown calibration parameter {key!r}; valid: "
                             f"{', '.join(PARAMETERS)}")
    provenance = raw.get("provenance", {})
    summary = provenance.get("summary") if isinstance(provenance, dict) else None
    source = str(summary) if summary else f"fitted ({where})"
    missing = [n for n in PARAMETERS if n not in params]
    if missing:
        source += f"; uncalibrated here: {', '.join(missing)}"
    best = {}
    table = raw.get("best_measured_mfu", {})
    for family, v in (table.items() if isinstance(table, dict) else [("", table)]):
        if not (isinstance(v, dict) and isinstance(v.get("mfu"), int | float)
                and not isinstance(v.get("mfu"), bool) and "run" in v):
            raise ValueError(f"{where}: [best_measured_mfu] {family or 'table'} = {v!r}: "
                             f"write each family as \"tpu-v6e\" = {{ mfu = 0.46, run = "
                             f"\"NAME\" }}")
        if not 0 < v["mfu"] < math.inf:  # 0 or nan flagged every estimate as suspect
            raise ValueError(f"{where}: [best_measured_mfu] {family} mfu = {v['mfu']}: a "
                             f"measured MFU is a fraction above 0, e.g. mfu = 0.46")
        best[family] = (float(v["mfu"]), str(v["run"]))
    try:
        return Calibration(**params, source=source, best_mfu=best)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


_catalog: Calibration | None = None


def catalog_calibration() -> Calibration:
    """The catalog's fitted values (meshes/calibration.toml)."""
    global _catalog
    if _catalog is None:
        _catalog = calibration_from_dict(tomllib.loads(CATALOG_FILE.read_text()),
                                         "meshes/calibration.toml")
    return _catalog
