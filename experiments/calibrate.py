"""`shardscope calibrate`: fit the step-time model's efficiencies (meshes/calibration.py) on
measured runs.

Each run is compiled and estimated once (experiments/validate.py); its step is then
decomposed by what each parameter scales (`Report.calibration_features`): the math time of
the math-bound matmuls by rate class (GPU bf16, TPU, measured low-precision) inside and
outside flash attention, the number of kernels, the rest of compute, and the communication
the schedule left exposed. With parameters p the step is, to first order,

    step(p) = other + exposed + kernels x kernel_overhead_s
              + sum over classes of math / (rate factor(p) [x its flash attention's])

(the exposed communication is held at what the schedule found). The fit minimises the
log-errors against the measured steps with a robust (soft-L1) loss, so that a run the
model cannot express -- a strategy it does not build yet -- does not drag the parameters,
within each parameter's physical bounds. It is deterministic: the same runs give the same
values. Leave-one-out refits without each run and estimates it with the others' fit.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path

import numpy as np

from meshes.calibration import PARAMETERS, Calibration

_NAMES = tuple(PARAMETERS)
# Soft-L1 scale: log-errors well inside it count as squares, beyond it linearly (about 20%).
_ROBUST_SCALE = 0.2


def _factor(values: dict[str, float], key: str) -> float:
    cal = Calibration(**values)
    rate_class, _, attention = key.partition("/")
    f = cal.rate_factor(rate_class)
    return f * cal.attention_factor(rate_class) if attention else f


def predict(features: dict, values: dict[str, float]) -> float:
    """The step of a run with parameter `values`, from its decomposition."""
    math_s = sum(t / _factor(values, key) for key, t in features["math_s"].items())
    return (features["other_s"] + features["exposed_s"]
            + features["kernels"] * values["kernel_overhead_s"] + math_s)


def informs(features: dict, name: str, *, share: float = 0.01) -> bool:
    """Whether a run's step depends on parameter `name` (by at least `share` of it)."""
    step = predict(features, Calibration().values())
    if name == "kernel_overhead_s":
        return features["kernels"] * 1e-6 > share * step  # 1 us per kernel would show
    keys = [k for k in features["math_s"]
            if (name == "flash_attention_efficiency" and k.endswith("/attention")
                and not k.startswith(("tpu", "host")))
            or (name == "tpu_flash_attention_efficiency" and k == "tpu/attention")
            or (name == "gpu_bf16_matmul_efficiency" and k.startswith("gpu_bf16"))
            or (name == "gpu_low_precision_matmul_scale" and k.startswith("measured"))
            or (name == "tpu_matmul_scale" and k.startswith("tpu"))]
    return sum(features["math_s"][k] for k in keys) > share * step


def step_range(features: dict) -> tuple[float, float]:
    """The fastest and the slowest step any parameter values within their physical bounds
    give a run (every rate at its upper bound and no time per kernel; the other way)."""
    fast = {n: (lo if n == "kernel_overhead_s" else hi) for n, (lo, hi, *_) in
            PARAMETERS.items()}
    slow = {n: (hi if n == "kernel_overhead_s" else lo) for n, (lo, hi, *_) in
            PARAMETERS.items()}
    return predict(features, fast), predict(features, slow)


def unexplained(cases: list[tuple[str, dict, float]]) -> list[str]:
    """A line for each (name, features, measured) run whose measured step no parameter
    values within their bounds reach: the fit cannot explain it, and it pulls the others
    toward their bounds (a step in ms written as s, the wrong config)."""
    lines = []
    for name, features, measured in cases:
        if not any(informs(features, n) for n in _NAMES):  # no fit moves it: nothing pulled
            continue
        fast, slow = step_range(features)
        if not fast <= measured <= slow:
            lines.append(f"{name}: measured {measured:.4g} s is outside {fast:.4g} .. "
                         f"{slow:.4g} s, every step the parameters' physical bounds give "
                         f"it; the fit cannot explain it and it pulls the others: check its "
                         f"[measured] step_time_s (seconds per optimizer step) and that "
                         f"the config is the run's")
    return lines


# A parameter is fitted on this many runs that inform it or more (one would be matched
# exactly, whatever else is wrong with it)
MIN_RUNS = 2


def free_parameters(cases: list[tuple[dict, float]]) -> list[str]:
    """The parameters a fit of `cases` pins down: each informed by MIN_RUNS runs or more,
    and, in each group of runs joined by the parameters they share, fewer parameters than
    runs: as many would match every run exactly whatever is wrong with them (two TPU runs
    fitted both TPU parameters, 0.0% error). Where a group has too many, the parameter
    informed by the fewest runs (then the later in PARAMETERS) stays uncalibrated."""
    runs = {n: {i for i, (f, _) in enumerate(cases) if informs(f, n)} for n in _NAMES}
    free = [n for n in _NAMES if len(runs[n]) >= MIN_RUNS]
    while True:
        over = next((g for g in _groups(free, runs)
                     if len(g) >= len(set().union(*(runs[n] for n in g)))), None)
        if over is None:
            return free
        free.remove(min(over, key=lambda n: (len(runs[n]), -_NAMES.index(n))))


def _groups(names: list[str], runs: dict[str, set[int]]) -> list[list[str]]:
    """`names` grouped by shared runs (connected through any run two of them inform)."""
    groups: list[list[str]] = []
    for n in names:
        joined = [g for g in groups if any(runs[n] & runs[m] for m in g)]
        groups = [g for g in groups if g not in joined] + [sum(joined, []) + [n]]
    return groups


def fit(cases: list[tuple[dict, float]]) -> dict[str, float]:
    """Parameter values that best explain `cases` ((features, measured step) pairs).

    Parameters the cases do not pin down (`free_parameters`) keep their uncalibrated
    value."""
    from scipy.optimize import least_squares

    free = free_parameters(cases)
    base = Calibration().values()
    lo = np.array([PARAMETERS[n][0] for n in free])
    hi = np.array([PARAMETERS[n][1] for n in free])
    scale = np.array([1e-6 if n == "kernel_overhead_s" else 1.0 for n in free])

    def values_of(x) -> dict[str, float]:
        return {**base, **dict(zip(free, (x * scale).tolist()))}

    def residuals(x):
        v = values_of(x)
        return np.array([math.log(predict(f, v) / m) for f, m in cases])

    if not free:
        return base
    x0 = np.clip(np.array([base[n] for n in free]) / scale, lo / scale, hi / scale)
    result = least_squares(residuals, x0, bounds=(lo / scale, hi / scale), loss="soft_l1",
                           f_scale=_ROBUST_SCALE, x_scale="jac", xtol=1e-12, ftol=1e-12,
                           gtol=1e-12, max_nfev=2000)
    # Six significant digits, as the catalog file stores them (and a bound as the bound).
    return {k: float(f"{v:.6g}") if abs(v) > 1e-12 else 0.0
            for k, v in values_of(result.x).items()}


# Leave-one-out needs a run more than a fit: with fewer, each refit is left one run and
# fits nothing, and its "leave-one-out error" is the uncalibrated one.
LOO_MIN_RUNS = MIN_RUNS + 1


def leave_one_out(cases: list[tuple[dict, float]]) -> list[float]:
    """For each case, its estimated step under a fit of all the other cases."""
    return [predict(cases[i][0], fit(cases[:i] + cases[i + 1:])) for i in range(len(cases))]


@dataclasses.dataclass(frozen=True)
class FitResult:
    values: dict[str, float]
    names: list[str]  # the runs, in case order
    fitted_errors: list[float]  # (estimate - measured) / measured with the fit
    loo_errors: list[float]
    informed_by: dict[str, list[str]]
    fitted: list[str] = dataclasses.field(default_factory=list)  # free_parameters


def calibrate(cases: list[tuple[str, dict, float]]) -> FitResult:
    """Fit on (name, features, measured) cases, with leave-one-out from LOO_MIN_RUNS
    cases on (`loo_errors` empty below)."""
    pairs = [(f, m) for _, f, m in cases]
    values = fit(pairs)
    names = [n for n, _, _ in cases]
    fitted = [predict(f, values) / m - 1 for f, m in pairs]
    loo = [p / m - 1 for p, (_, m) in zip(leave_one_out(pairs), pairs)] \
        if len(pairs) >= LOO_MIN_RUNS else []
    informed = {p: [n for n, f, _ in cases if informs(f, p)] for p in _NAMES}
    return FitResult(values, names, fitted, loo, informed, free_parameters(pairs))


def _loo_words(loo: float, sep: str = " ") -> str:
    if math.isnan(loo):
        return f"leave-one-out{sep}- (it needs {LOO_MIN_RUNS} runs or more)"
    return f"leave-one-out{sep}{loo:.1%}"


def _median_abs(errors: list[float]) -> float:
    return float(np.median(np.abs(errors))) if errors else math.nan


def best_mfu(rows, *, min_runs: int = 2) -> dict[str, tuple[float, str]]:
    """Family (system family and matmul format, "h100 fp8") -> the highest measured MFU
    among validation rows (our FLOP count, against the bf16 peak: an FP8 run's is no
    ceiling for a bf16 one, nor the other way), for families with at least `min_runs`
    measured runs (one run is no ceiling)."""
    by_family: dict[str, list] = {}
    for r in rows:
        if r.measured_mfu is not None:
            by_family.setdefault(r.family, []).append(r)
    return {family: max(((r.measured_mfu, r.name) for r in rs), key=lambda x: x[0])
            for family, rs in by_family.items() if len(rs) >= min_runs}


def write_calibration(result: FitResult, path: str | Path, *, fitted_on: str,
                      best: dict[str, tuple[float, str]] | None = None) -> None:
    """The calibration file `load_calibration` reads: the values, for each parameter the
    runs that inform it and the residual on them, and the best measured MFU per system
    family."""
    today = datetime.date.today().isoformat()
    med, loo = _median_abs(result.fitted_errors), _median_abs(result.loo_errors)
    lines = [f"# Written by `shardscope calibrate {fitted_on}` on {today}.", "",
             "[parameters]"]
    for name, value in result.values.items():
        if name not in result.fitted:  # not fitted: left out, reports say so
            continue
        lines.append(f"{name} = {value:.6g}  # uncalibrated {PARAMETERS[name][2]:g}; "
                     f"{PARAMETERS[name][3]}")
    lines += ["", "[provenance]",
              "summary = " + _quoted(f"fitted on {len(result.names)} measured runs "
                                     f"({fitted_on}, {today}): median |error| {med:.1%}, "
                                     f"{_loo_words(loo)}"),
              f"fitted_on = {_quoted(fitted_on)}", f'date = "{today}"',
              f"median_abs_error = {med:.4f}", f"loo_median_abs_error = {loo:.4f}",
              "runs = [" + ", ".join(map(_quoted, result.names)) + "]", ""]
    for name in result.values:
        runs = result.informed_by[name]
        errs = [e for n, e in zip(result.names, result.fitted_errors) if n in runs]
        lines += [f"[provenance.{name}]", f"informed_by = {len(runs)}",
                  "runs = [" + ", ".join(map(_quoted, runs)) + "]",
                  f"median_abs_error_on_them = {_median_abs(errs):.4f}", ""]
    if best:  # none (no family of 2 runs): no table, so the catalog's ceilings hold
        lines.append("[best_measured_mfu]  # our model-FLOP count, the measured step")
    for family, (mfu, run) in sorted((best or {}).items()):
        lines.append(f"{_quoted(family)} = {{ mfu = {mfu:.4f}, run = {_quoted(run)} }}")
    Path(path).write_text("\n".join(lines) + "\n")


def _quoted(text: str) -> str:
    """`text` as a TOML basic string (a JSON string is one): a run name or folder with a
    quote or a backslash wrote a file `--calibration` could not read."""
    return json.dumps(text, ensure_ascii=False)


def format_fit(result: FitResult) -> str:
    """The fitted parameters, what informs each and the residual on those runs."""
    lines = [f"{'parameter':<30}{'value':>12}{'uncalibrated':>14}{'runs':>6}"
             f"{'median |err| on them':>22}"]
    for name, value in result.values.items():
        runs = result.informed_by[name]
        errs = [e for n, e in zip(result.names, result.fitted_errors) if n in runs]
        if 0 < len(runs) < MIN_RUNS:
            err = f"  - ({len(runs)} run: too few, uncalibrated)"
        elif runs and name not in result.fitted:
            err = f"  - ({len(runs)} runs: too few for the parameters on them, uncalibrated)"
        else:
            err = f"{_median_abs(errs):>22.1%}" if errs else "  - (no run: uncalibrated)"
        lines.append(f"{name:<30}{value:>12.4g}{PARAMETERS[name][2]:>14.4g}{len(runs):>6}"
                     f"{err}")
    lines.append(f"fitted: median |error| {_median_abs(result.fitted_errors):.1%}; "
                 f"{_loo_words(_median_abs(result.loo_errors), ': ')} "
                 f"({len(result.names)} runs)")
    return "\n".join(lines)
