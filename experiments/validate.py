"""`shardscope validate`: every config of a directory that carries a [measured] table, run and
compared with its published step time.

Each case compiles in its own process (a fresh JAX with the device count it needs), a few
at a time; a compiler crash or a refusal is that case's row, never the end of the run. The
summary gives the median and 90th percentile of |error| overall and per family (system
family and matmul precision), the figures a step-time model is judged by.

Errors are (estimate - measured) / measured: positive means the estimate is too slow.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

VALIDATION_DIR = Path(__file__).resolve().parent / "validation"
_PRECISION = {"bfloat16": "bf16", "float32": "f32", "float8": "fp8", "float4": "fp4"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One validation case: what was measured, what we estimate, and how the run went."""

    name: str
    path: str
    family: str
    measured_s: float
    status: str  # "ok" | "refused" | "error"
    message: str = ""
    estimate_s: float | None = None
    mfu: float | None = None  # estimated
    bottleneck: str = ""
    compiler: str = ""
    fits: bool | None = None
    timings: dict = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0
    features: dict = dataclasses.field(default_factory=dict)  # Report.calibration_features
    loo_estimate_s: float | None = None  # estimated with a fit of the other cases

    @property
    def error(self) -> float | None:
        """(estimate - measured) / measured."""
        if self.estimate_s is None:
            return None
        return (self.estimate_s - self.measured_s) / self.measured_s

    @property
    def measured_mfu(self) -> float | None:
        """The run's MFU with our model-FLOP count (so that it compares with ours): the
        estimated MFU scaled by estimated / measured step time."""
        if self.mfu is None or self.estimate_s is None:
            return None
        return self.mfu * self.estimate_s / self.measured_s

    @property
    def loo_error(self) -> float | None:
        if self.loo_estimate_s is None:
            return None
        return (self.loo_estimate_s - self.measured_s) / self.measured_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "error": self.error,
                "measured_mfu": self.measured_mfu, "loo_error": self.loo_error}


def family_of(exp) -> str:
    """The group a case is summarised in: its system family and matmul precision."""
    family = getattr(exp.system.family, "name", exp.system.family)
    return f"{family} {_PRECISION.get(exp.precision.compute, exp.precision.compute)}"


def find_cases(where: str | Path | Sequence[str | Path]) -> list[Path]:
    """The TOML configs of a directory (sorted), or of several directories and files; a
    missing path or an empty directory is an error."""
    from experiments.config import ConfigError

    paths: list[Path] = []
    for item in [where] if isinstance(where, str | Path) else where:
        d = Path(item)
        if d.is_file() and d.suffix == ".toml":
            paths.append(d)
            continue
        if not d.is_dir():
            raise ConfigError(f"validation path {str(item)!r} not found; give folders or .toml "
                              f"files of configs with [measured] tables, e.g. "
                              f"experiments/validation")
        found = sorted(d.glob("*.toml"))
        if not found:
            raise ConfigError(f"{str(item)!r} holds no .toml configs; add configs with a "
                              f"[measured] table")
        paths += found
    return paths


def load_case(path: str | Path):
    """A validation config: an experiment that must carry a [measured] table."""
    from experiments import config

    exp = config.load(path)
    if exp.measured is None:
        raise config.ConfigError(f"{path}: no [measured] table; validation configs need "
                                 f"measured.step_time_s")
    return exp


def run_case(path: str | Path, *, backend: str = "cpu", calibration: str | None = None) -> Row:
    """Load, compile and estimate one case in this process (`calibration`: a calibration
    file; the catalog's by default)."""
    from experiments import runner
    from experiments.config import load_calibration

    exp = load_case(path)
    base = dict(name=exp.name, path=str(path), family=family_of(exp),
                measured_s=exp.measured.step_time_s)
    t0 = time.perf_counter()
    try:
        report = runner.run(exp, backend=backend, calibration=load_calibration(calibration)
                            if calibration else None)
    except ValueError as e:
        return Row(**base, status="refused", message=_first_line(e),
                   wall_s=time.perf_counter() - t0)
    return Row(**base, status="ok", estimate_s=report.step_time_s, mfu=report.mfu,
               bottleneck=report.time_bottleneck(), compiler=report.compiler, fits=report.fits,
               timings=dict(report.timings), wall_s=time.perf_counter() - t0,
               features=report.calibration_features())


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _run_in_subprocess(path: Path, backend: str, timeout_s: float,
                       calibration: str | None) -> Row:
    """Run one case in a fresh interpreter; a crash or a timeout becomes an error row."""
    cmd = [sys.executable, "-m", "experiments.validate", "--case", str(path),
           "--backend", backend] + (["--calibration", str(calibration)] if calibration else [])
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return _error_row(path, f"did not finish within {timeout_s:.0f} s", t0)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return _error_row(path, f"exit {p.returncode}: {lines[-1] if lines else 'no output'}", t0)
    return Row(**json.loads(p.stdout.strip().splitlines()[-1]))


def _error_row(path: Path, message: str, t0: float) -> Row:
    from experiments import config

    try:
        exp = config.load(path)
        base = dict(name=exp.name, family=family_of(exp), measured_s=exp.measured.step_time_s)
    except (ValueError, AttributeError):
        base = dict(name=path.stem, family="?", measured_s=float("nan"))
    return Row(**base, path=str(path), status="error", message=message,
               wall_s=time.perf_counter() - t0)


def validate(directory: str | Path | Sequence[str | Path] | None = None, *,
             backend: str = "cpu",
             workers: int | None = None, timeout_s: float = 1800.0,
             calibration: str | None = None) -> list[Row]:
    """Every case of `directory`, `workers` at a time (the core count by default), each
    with its leave-one-out estimate: the step under a calibration fitted on the other
    cases (experiments/calibrate.py)."""
    paths = find_cases(VALIDATION_DIR if not directory else directory)
    for path in paths:  # config mistakes are the user's: one line, before any compile
        load_case(path)
    workers = workers or os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        rows = list(pool.map(lambda p: _run_in_subprocess(p, backend, timeout_s, calibration),
                             paths))
    return _with_leave_one_out(rows)


def _with_leave_one_out(rows: list[Row]) -> list[Row]:
    from experiments.calibrate import leave_one_out

    ran = [r for r in rows if r.status == "ok"]
    if len(ran) < 3:
        return rows
    loo = dict(zip((r.name for r in ran),
                   leave_one_out([(r.features, r.measured_s) for r in ran])))
    return [dataclasses.replace(r, loo_estimate_s=loo[r.name]) if r.name in loo else r
            for r in rows]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between order statistics."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(rows: list[Row]) -> dict:
    """Median and p90 of |error| over the cases that ran, overall and per family."""
    def stats(rs: list[Row]) -> dict:
        errs = [abs(r.error) for r in rs if r.error is not None]
        loo = [abs(r.loo_error) for r in rs if r.loo_error is not None]
        return {"cases": len(rs), "ran": len(errs), "median_abs_error": percentile(errs, 50),
                "p90_abs_error": percentile(errs, 90),
                "loo_median_abs_error": percentile(loo, 50),
                "loo_p90_abs_error": percentile(loo, 90)}

    families = sorted({r.family for r in rows})
    return {"overall": stats(rows),
            "families": {f: stats([r for r in rows if r.family == f]) for f in families}}


def format_table(rows: list[Row], stats: dict) -> str:
    """One row per case (error with the calibration used, and under leave-one-out), then
    the summary overall and per family."""
    lines = [f"{'case':<36}{'family':<18}{'measured':>10}{'estimate':>10}{'error':>8}"
             f"{'LOO':>7}{'MFU meas':>10}{'MFU est':>9}  bottleneck"]
    lines.append("-" * 136)
    for r in rows:
        if r.status != "ok":
            lines.append(f"{r.name[:35]:<36}{r.family:<18}{r.measured_s:>9.3f}s"
                         f"{r.status:>10}  {r.message[:80]}")
            continue
        fits = "" if r.fits else " (does not fit in HBM)"
        loo = "" if r.loo_error is None else f"{r.loo_error:+.0%}"
        lines.append(f"{r.name[:35]:<36}{r.family:<18}{r.measured_s:>9.3f}s{r.estimate_s:>9.3f}s"
                     f"{r.error:>+8.0%}{loo:>7}{r.measured_mfu:>10.1%}{r.mfu:>9.1%}  "
                     f"{r.bottleneck.split(':')[0]}{fits}")
    lines.append("-" * 136)
    o = stats["overall"]
    def pct(v, width=0):
        return f"{'-':>{width}}" if v is None or math.isnan(v) else f"{v:>{width}.0%}"

    loo_note = "" if any(r.loo_error is not None for r in rows) else \
        " (leave-one-out refits without each case: it needs at least 3 that ran)"
    lines.append(f"all cases: {o['ran']} of {o['cases']} ran; median |error| "
                 f"{pct(o['median_abs_error'])}, p90 {pct(o['p90_abs_error'])}; leave-one-out "
                 f"median {pct(o['loo_median_abs_error'])}, p90 "
                 f"{pct(o['loo_p90_abs_error'])}{loo_note}")
    for f, s in stats["families"].items():
        lines.append(f"  {f:<22}{s['ran']:>3} ran   median {pct(s['median_abs_error'], 5)}   "
                     f"p90 {pct(s['p90_abs_error'], 5)}   leave-one-out median "
                     f"{pct(s['loo_median_abs_error'], 5)}")
    compilers = sorted({r.compiler for r in rows if r.compiler})
    lines.append(f"HLO from: {'; '.join(compilers) or '-'}")
    return "\n".join(lines)


def timing_lines(rows: list[Row], wall_s: float) -> list[str]:
    """How long validation took: the wall time, and per case the work after compiling."""
    ran = [r for r in rows if r.status == "ok"]
    after = [sum(r.timings.get(k, 0) for k in ("parse_s", "read_s", "estimate_s"))
             for r in ran]
    compile_s = [r.timings.get("compile_s", 0) for r in ran]
    if not ran:
        return [f"wall {wall_s:.1f} s"]
    return [f"wall {wall_s:.1f} s for {len(rows)} cases; per case: compile "
            f"{sum(compile_s) / len(ran):.1f} s mean, after compile (parse + estimate) "
            f"{sum(after) / len(ran):.3f} s mean, {max(after):.3f} s max"]


def main(argv: list[str] | None = None) -> int:
    """`python -m experiments.validate --case PATH`: one case, its row as JSON on stdout."""
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--calibration", default=None)
    args = p.parse_args(argv)
    row = run_case(args.case, backend=args.backend, calibration=args.calibration)
    print(json.dumps(dataclasses.asdict(row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
