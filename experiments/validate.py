"""`shardscope validate`: every config of a directory that carries a [measured] table, run and
compared with its published step time.

Each case compiles in a worker process (experiments/workers.py, as a search's configs do: a
JAX with the device count it needs), a few at a time; a compiler crash or a refusal is
that case's row, never the end of the run. The
summary gives the median and 90th percentile of |error| overall and per family (system
family and matmul precision), the figures a step-time model is judged by.

Errors are (estimate - measured) / measured: positive means the estimate is too slow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from meshes.calibration import Calibration
from meshes.chips import FORMAT_LABELS
from sharding.units import counted

if TYPE_CHECKING:
    from experiments.config import Experiment

VALIDATION_DIR = Path(__file__).resolve().parent / "validation"


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
    memory_per_device_bytes: float | None = None
    hbm_capacity_bytes: float | None = None
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
    return f"{family} {FORMAT_LABELS.get(exp.precision.compute, exp.precision.compute)}"


def find_cases(where: str | Path | Sequence[str | Path]) -> list[Path]:
    """The TOML configs of a directory (sorted), or of several directories and files, each
    once; a missing path or an empty directory is an error."""
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
    unique = {p.resolve(): p for p in reversed(paths)}  # a file named twice is one run
    return [p for p in paths if unique[p.resolve()] is p]


def load_case(path: str | Path) -> tuple[dict, Experiment]:
    """A validation config, read once: (its tables as written, the hf_config path made
    the file's; the experiment), which must carry a [measured] table."""
    from experiments import config
    from meshes.calibration import TABLES

    raw = config.load_raw(path)  # a case is a file find_cases found
    if "parameters" in raw and set(raw) <= set(TABLES):
        raise config.ConfigError(f"{path} is a calibration file (`shardscope calibrate "
                                 f"--out`), not a run with a [measured] table; move it out "
                                 f"of the folder of runs (--calibration {path} uses it)")
    try:
        exp = config.from_dict(raw)
    except config.ConfigError as e:  # one file of a folder: say which
        if str(path) in str(e):
            raise
        raise config.ConfigError(f"{path}: {e}") from None
    if exp.measured is None:
        raise config.ConfigError(f"{path}: no [measured] table; validation configs need "
                                 f"measured.step_time_s")
    return raw, exp


def _row(path: Path, exp, answer: dict) -> Row:
    """A case's row from its worker's answer (experiments/workers.py)."""
    base = dict(name=exp.name, path=str(path), family=family_of(exp),
                measured_s=exp.measured.step_time_s, wall_s=answer.get("wall_s", 0.0))
    if answer["status"] != "ok":
        return Row(**base, status=answer["status"], message=answer.get("message", ""))
    rep = answer["report"]
    return Row(**base, status="ok", estimate_s=rep["step_time_s"], mfu=rep["mfu"],
               bottleneck=rep["time_bottleneck"], compiler=rep["compiler"], fits=rep["fits"],
               memory_per_device_bytes=rep["memory_per_device_bytes"],
               hbm_capacity_bytes=rep["hbm_capacity_bytes"],
               timings=dict(rep["timings"]), features=answer["features"])


def validate(directory: str | Path | Sequence[str | Path] | None = None, *,
             backend: str = "cpu", workers: int | None = None, timeout_s: float = 1800.0,
             calibration: Calibration | None = None) -> list[Row]:
    """Every case of `directory`, `workers` at a time (the core count by default), each
    with its leave-one-out estimate: the step under a calibration fitted on the other
    cases (experiments/calibrate.py). `calibration`: the efficiencies to estimate with
    (the catalog's by default)."""
    from experiments import workers as workers_mod

    paths = find_cases(VALIDATION_DIR if not directory else directory)
    read = {path: load_case(path) for path in paths}  # config mistakes: before compiling
    cases = [(path, exp) for path, (_, exp) in read.items()]
    _check_names(cases)
    submit, shutdown, _ = workers_mod.executor(workers=workers, timeout_s=timeout_s)
    request = {"backend": backend, "keep_unfit": True,
               "calibration": calibration.to_dict() if calibration else None}
    try:
        futures = [submit(workers_mod.devices_for(exp.system.num_devices),
                          {**request, "config": read[path][0]})
                   for path, exp in cases]
        rows = [_row(path, exp, f.result()) for (path, exp), f in zip(cases, futures, strict=True)]
    finally:
        shutdown(False)
    return _with_leave_one_out(rows)


def _check_names(cases) -> None:
    """Each run's name is its key (leave-one-out, a calibration's provenance): two runs of
    one name are a ConfigError naming both files."""
    from experiments.config import ConfigError

    seen: dict[str, Path] = {}
    for path, exp in cases:
        if exp.name in seen:
            raise ConfigError(f"{seen[exp.name]} and {path} are both named {exp.name!r}; give "
                              f"each run its own name (the name = ... line)")
        seen[exp.name] = path


def _with_leave_one_out(rows: list[Row]) -> list[Row]:
    from experiments.calibrate import LOO_MIN_RUNS, leave_one_out

    ran = [r for r in rows if r.status == "ok"]
    if len(ran) < LOO_MIN_RUNS:
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


def _known(values: list[float], q: float) -> float | None:
    """The q-th percentile, None (JSON's null, the table's "-") of none: --json wrote NaN,
    which is not JSON (JSON.parse and jq refuse the file)."""
    return percentile(values, q) if values else None


def summary(rows: list[Row]) -> dict:
    """Median and p90 of |error| over the cases that ran, overall and per family (None
    where there are none)."""
    def stats(rs: list[Row]) -> dict:
        errs = [abs(r.error) for r in rs if r.error is not None]
        loo = [abs(r.loo_error) for r in rs if r.loo_error is not None]
        return {"cases": len(rs), "ran": len(errs), "median_abs_error": _known(errs, 50),
                "p90_abs_error": _known(errs, 90), "loo_median_abs_error": _known(loo, 50),
                "loo_p90_abs_error": _known(loo, 90)}

    families = sorted({r.family for r in rows})
    return {"overall": stats(rows),
            "families": {f: stats([r for r in rows if r.family == f]) for f in families}}


def format_table(rows: list[Row], stats: dict) -> str:
    """One row per case (error with the calibration used, and under leave-one-out), then
    the summary overall and per family."""
    lines = [f"{'case':<36}{'family':<18}{'measured':>10}{'estimate':>10}{'error':>8}"
             f"{'LOO':>7}{'MFU meas':>10}{'MFU est':>9}{'memory':>17}  bottleneck"]
    lines.append("-" * 153)
    for r in rows:
        if r.status != "ok":
            lines.append(f"{r.name[:35]:<36}{r.family:<18}{r.measured_s:>9.3f}s"
                         f"{r.status:>10}  {r.message[:80]}")
            continue
        loo = "" if r.loo_error is None else f"{r.loo_error:+.0%}"
        lines.append(f"{r.name[:35]:<36}{r.family:<18}{r.measured_s:>9.3f}s{r.estimate_s:>9.3f}s"
                     f"{r.error:>+8.0%}{loo:>7}{r.measured_mfu:>10.1%}{r.mfu:>9.1%}"
                     f"{memory_cell(r):>17}  {r.bottleneck.split(':')[0]}")
    lines.append("-" * 153)
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
    if any(not r.family.endswith(("bf16", "f32")) for r in rows):
        lines.append("MFU: model FLOPs against the bf16 peak (FP8 and FP4 runs can pass "
                     "100%; `run` gives it against each matmul's format too)")
    return "\n".join(lines)


def memory_cell(r: Row) -> str:
    """The memory verdict: "fits 71/85 GB", or "NO FIT 120/85 GB"."""
    if r.memory_per_device_bytes is None or not r.hbm_capacity_bytes:
        return "-"
    word = "fits" if r.fits else "NO FIT"
    return (f"{word} {r.memory_per_device_bytes / 1e9:.0f}/"
            f"{r.hbm_capacity_bytes / 1e9:.0f} GB")


def unfit(rows: list[Row]) -> list[Row]:
    """Published runs the memory model says cannot fit, though they ran."""
    return [r for r in rows if r.status == "ok" and r.fits is False]


def timing_lines(rows: list[Row], wall_s: float) -> list[str]:
    """How long validation took: the wall time, and per case the work after compiling."""
    ran = [r for r in rows if r.status == "ok"]
    after = [sum(r.timings.get(k, 0) for k in ("parse_s", "read_s", "estimate_s"))
             for r in ran]
    compile_s = [r.timings.get("compile_s", 0) for r in ran]
    if not ran:
        return [f"wall {wall_s:.1f} s"]
    return [f"wall {wall_s:.1f} s for {counted(len(rows), 'case')}; per case: compile "
            f"{sum(compile_s) / len(ran):.1f} s mean, after compile (parse + estimate) "
            f"{sum(after) / len(ran):.3f} s mean, {max(after):.3f} s max"]
