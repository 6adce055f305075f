"""`shardscope diff OLD NEW`: two reports (`run --json`) side by side, as a CI gate.

The step time, the memory per device, and the collectives grouped by kind and mesh axes
(bytes per step: each collective's buffer times how often it runs), each with its change.
A collective group that appears in NEW, or grows past `max_bytes_increase` percent, fails
the gate, as does a step or memory increase past its threshold: the command then exits 1.
What is compared is the report's own fields, so a report from an older version of the tool
compares as long as it has them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from experiments.config import ConfigError
from sharding.units import fmt_bytes, fmt_s

# Defaults of the thresholds, in percent: any added communication fails; the step and the
# memory may move a little (a re-fitted calibration, a changed fusion).
MAX_STEP_INCREASE = 5.0
MAX_BYTES_INCREASE = 0.0
MAX_MEMORY_INCREASE = 5.0

_NEEDED = ("step_time_s", "memory_per_device_bytes", "collectives")


def load(path: str) -> dict:
    """A report written by `run --json` (or `inspect --json`), or a one-line ConfigError."""
    p = Path(path)
    try:
        report = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; write one with "
                          f"`shardscope run CONFIG --json report.json`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a JSON report ({type(e).__name__}); write one with "
                          f"`shardscope run CONFIG --json report.json`") from None
    missing = [k for k in _NEEDED if not isinstance(report, dict) or k not in report]
    if missing:
        raise ConfigError(f"{path}: not a shardscope report (no {', '.join(missing)}); write "
                          f"one with `shardscope run CONFIG --json report.json`")
    return report


def collective_bytes(report: Mapping) -> dict[str, float]:
    """Bytes per step by "KIND over AXES" (each collective's buffer times its count)."""
    out: dict[str, float] = {}
    for c in report["collectives"]:
        axes = ",".join(c.get("mesh_axes") or ()) or "devices"
        key = f"{c['kind']} over {axes}"
        out[key] = out.get(key, 0.0) + float(c["bytes"]) * float(c.get("count", 1))
    return out


def _change(old: float | None, new: float | None) -> float | None:
    """Percent change; None when there is no old figure to compare with."""
    if old is None or new is None:
        return None
    if old == 0:
        return 0.0 if new == 0 else float("inf")
    return 100.0 * (new - old) / old


@dataclasses.dataclass(frozen=True)
class Line:
    """One compared figure: what, old and new (None: absent), percent change, and why it
    fails the gate ("" when it passes)."""

    what: str
    old: float | None
    new: float | None
    change: float | None
    failure: str = ""


@dataclasses.dataclass(frozen=True)
class Diff:
    step: Line
    memory: Line
    collectives: tuple[Line, ...]

    @property
    def failures(self) -> list[str]:
        return [f"{ln.what}: {ln.failure}" for ln in (self.step, self.memory, *self.collectives)
                if ln.failure]

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {"ok": self.ok, "failures": self.failures,
                "step": dataclasses.asdict(self.step),
                "memory": dataclasses.asdict(self.memory),
                "collectives": [dataclasses.asdict(c) for c in self.collectives]}


def _gated(what: str, old: float | None, new: float | None, limit: float) -> Line:
    change = _change(old, new)
    failure = (f"+{change:.1f}% (over +{limit:g}%)" if change is not None and change > limit
               else "")
    return Line(what, old, new, change, failure)


def diff(old: Mapping, new: Mapping, *, max_step_increase: float = MAX_STEP_INCREASE,
         max_bytes_increase: float = MAX_BYTES_INCREASE,
         max_memory_increase: float = MAX_MEMORY_INCREASE) -> Diff:
    """NEW against OLD: the step, the memory and each collective group, with the gate."""
    step = _gated("step time", old["step_time_s"], new["step_time_s"], max_step_increase)
    memory = _gated("memory/device", old["memory_per_device_bytes"],
                    new["memory_per_device_bytes"], max_memory_increase)
    a, b = collective_bytes(old), collective_bytes(new)
    lines = []
    for key in sorted(a.keys() | b.keys(), key=lambda k: -max(a.get(k, 0), b.get(k, 0))):
        if key not in a:
            lines.append(Line(key, None, b[key], None, "new in this report"))
        elif key not in b:
            lines.append(Line(key, a[key], None, None))
        else:
            lines.append(_gated(key, a[key], b[key], max_bytes_increase))
    return Diff(step, memory, tuple(lines))


def format_diff(d: Diff, old_name: str, new_name: str) -> str:
    def cell(v, fmt):
        return "-" if v is None else fmt(v)

    w = max(len(ln.what) for ln in (d.step, d.memory, *d.collectives)) + 2

    def row(ln: Line, fmt) -> str:
        change = ("new" if ln.old is None else "gone" if ln.new is None
                  else f"{ln.change:+.1f}%" if ln.change != float("inf") else "new bytes")
        verdict = f"  FAIL {ln.failure}" if ln.failure else ""
        return (f"  {ln.what:<{w}}{cell(ln.old, fmt):>12} {cell(ln.new, fmt):>12}"
                f"  {change}{verdict}")

    lines = [f"{old_name} -> {new_name}",
             f"  {'':<{w}}{'old':>12} {'new':>12}  change",
             row(d.step, fmt_s), row(d.memory, fmt_bytes),
             "collectives (bytes per step, by kind over mesh axes):"]
    changed = [ln for ln in d.collectives if ln.change != 0.0]
    lines += [row(ln, fmt_bytes) for ln in changed]
    if len(changed) < len(d.collectives):
        lines.append(f"  ({len(d.collectives) - len(changed)} "
                     f"{'more ' if changed else ''}the same in both)")
    lines.append("ok: within the thresholds" if d.ok else
                 f"FAIL: {len(d.failures)} over the thresholds")
    return "\n".join(lines)
