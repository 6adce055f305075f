"""`[measured]`: a run's measured step, in the validation configs and in what
`shardscope measure --out` writes (its own table of experiments/config.py)."""

from __future__ import annotations

import dataclasses
import math

from models.program import described


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """`[measured]`: a published measurement of the run (validation configs,
    experiments/validation)."""

    step_time_s: float = described("the measured step time, seconds")
    source: str = described("where it was published (repository and path, or URL)", "")
    evidence: str = described('how it was obtained: "MEASURED-LOG" (a training log), '
                              '"MEASURED-TABLE" (a published table), with "DERIVED" for '
                              'what was computed from them; "shardscope measure" (what '
                              '`measure --out` writes)', "")
    tflops_per_chip: float = described("the published TFLOP/s per chip (0: not published)",
                                       0.0)
    mfu: float = described("the published MFU (0: not published)", 0.0)
    # written by `shardscope measure --out`: where and with what the run was measured
    host: str = described("the host that ran it (shardscope measure)", "")
    date: str = described("the day it was measured, YYYY-MM-DD (shardscope measure)", "")
    jax_version: str = described("the JAX version that ran it (shardscope measure)", "")
    backend: str = described('the devices that ran it, e.g. "cpu", "gpu NVIDIA H200" '
                             '(shardscope measure)', "")
    backend_version: str = described("the backend's own version, e.g. the CUDA or libtpu "
                                     "runtime's (shardscope measure)", "")

    def __post_init__(self):
        # nan and inf are TOML floats: they passed `<= 0` and ended a fit after compiling
        # ("Residuals are not finite", "math domain error")
        if not (math.isfinite(self.step_time_s) and self.step_time_s > 0):
            raise ValueError(f"measured.step_time_s={self.step_time_s} must be above 0 and "
                             f"finite: the run's measured seconds per optimizer step, e.g. "
                             f"step_time_s = 4.546")
        for name in ("tflops_per_chip", "mfu"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"measured.{name}={v} must be a finite number, 0 or above "
                                 f"(0: not published)")
