"""`shardscope diff OLD NEW`: two reports (`run --json`) side by side, as a CI gate.

The step time, the memory per device, and the collectives grouped by kind and mesh axes
(bytes per step: each collective's buffer times how often it runs), each with its change.
A collective group that appears in NEW, or grows past `max_bytes_increase` percent, fails
the gate, as does a step or memory increase past its threshold: the command then exits 1.
What is compared is the report's own fields, so a report from an older version of the tool
compares as long as it has them.

Two results stores (`search --store`) compare config by config: the same config hash on
the same backend, else the same name; each pair's reports as above, a config that ran in
OLD and not in NEW fails, and the configs in one store only are listed. `--json` has
`regressions` (what fails the gate) and `changes` (every figure that moved), for reports
and stores alike.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from experiments.config import ConfigError
from experiments.store import Result, Store
from sharding.units import fmt_bytes, fmt_s

# Defaults of the thresholds, in percent. The step and the memory are estimates, which may
# move a little with no change to the program (a re-fitted calibration, a changed fusion
# or memory model); a collective's bytes per step are counted exactly from the compiled
# HLO, so any growth is a change in what the program sends: it fails by default.
MAX_STEP_INCREASE = 5.0
MAX_BYTES_INCREASE = 0.0
MAX_MEMORY_INCREASE = 5.0
# A collective group that grew more than this many times over is shown by the bytes it
# gained, not as a percentage of its base: a 4-byte scalar all-reduce becoming a 1.32 MB
# one is "+1.32 MB (from 4 B)", where a percentage (+32972800%) says nothing.
PERCENT_UP_TO_RATIO = 10.0

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

    @property
    def from_small_base(self) -> bool:
        """Grown more than PERCENT_UP_TO_RATIO times over (or from nothing): its growth is
        read in bytes, not as a percentage of the base."""
        return (self.old is not None and self.new is not None and self.new > self.old
                and self.new > PERCENT_UP_TO_RATIO * self.old)


@dataclasses.dataclass(frozen=True)
class Diff:
    step: Line
    memory: Line
    collectives: tuple[Line, ...]
    # The thresholds applied, percent: (what, limit), for the verdict to name.
    limits: tuple[tuple[str, float], ...] = ()

    @property
    def failures(self) -> list[str]:
        return [f"{ln.what}: {ln.failure}" for ln in self.lines if ln.failure]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def lines(self) -> tuple[Line, ...]:
        return (self.step, self.memory, *self.collectives)

    def regressions(self) -> list[dict]:
        """The figures over their threshold, as `--json` lists them."""
        return [dataclasses.asdict(ln) for ln in self.lines if ln.failure]

    def changes(self) -> list[dict]:
        """Every figure that moved, appeared or vanished, as `--json` lists them."""
        return [dataclasses.asdict(ln) for ln in self.lines if ln.change != 0.0]

    def to_dict(self) -> dict:
        return {"ok": self.ok, "failures": self.failures,
                "thresholds": _thresholds(self.limits),
                "regressions": self.regressions(), "changes": self.changes(),
                "step": dataclasses.asdict(self.step),
                "memory": dataclasses.asdict(self.memory),
                "collectives": [dataclasses.asdict(c) for c in self.collectives]}


def _gated(what: str, old: float | None, new: float | None, limit: float) -> Line:
    change = _change(old, new)
    line = Line(what, old, new, change)
    if change is None or change <= limit:
        return line
    grew = (f"+{fmt_bytes(new - old)} from {fmt_bytes(old)}" if line.from_small_base
            else f"+{change:.1f}%")
    return dataclasses.replace(line, failure=f"{grew} (over +{limit:g}%)")


def _limits(step: float, memory: float, nbytes: float) -> tuple[tuple[str, float], ...]:
    return (("step", step), ("memory", memory), ("collective bytes", nbytes))


def _thresholds(limits: tuple[tuple[str, float], ...]) -> dict[str, float]:
    """The thresholds applied, as `--json` names them (the flags' names)."""
    flags = {"step": "max_step_increase", "memory": "max_memory_increase",
             "collective bytes": "max_bytes_increase"}
    return {flags[what]: limit for what, limit in limits}


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
    return Diff(step, memory, tuple(lines),
                _limits(max_step_increase, max_memory_increase, max_bytes_increase))


def _table(d: Diff) -> list[str]:
    """The step, the memory and the collectives that changed, one row each."""
    def cell(v, fmt):
        return "-" if v is None else fmt(v)

    w = max(len(ln.what) for ln in d.lines) + 2

    def row(ln: Line, fmt) -> str:
        change = ("new" if ln.old is None else "gone" if ln.new is None
                  else f"+{fmt(ln.new - ln.old)} (from {fmt(ln.old)})" if ln.from_small_base
                  else f"{ln.change:+.1f}%")
        verdict = f"  FAIL {ln.failure}" if ln.failure else ""
        return (f"  {ln.what:<{w}}{cell(ln.old, fmt):>12} {cell(ln.new, fmt):>12}"
                f"  {change}{verdict}")

    lines = [f"  {'':<{w}}{'old':>12} {'new':>12}  change",
             row(d.step, fmt_s), row(d.memory, fmt_bytes),
             "collectives (bytes per step, by kind over mesh axes):"]
    changed = [ln for ln in d.collectives if ln.change != 0.0]
    lines += [row(ln, fmt_bytes) for ln in changed]
    if len(changed) < len(d.collectives):
        lines.append(f"  ({len(d.collectives) - len(changed)} "
                     f"{'more ' if changed else ''}the same in both)")
    return lines


def _verdict(failures: list[str], limits: tuple[tuple[str, float], ...]) -> str:
    if not failures:
        return "ok: within the thresholds"
    named = ", ".join(f"{what} +{limit:g}%" for what, limit in limits)
    return (f"FAIL: {len(failures)} over the thresholds ({named}; a new collective fails "
            f"at any threshold; --max-step-increase, --max-memory-increase and "
            f"--max-bytes-increase set them)")


def format_diff(d: Diff, old_name: str, new_name: str) -> str:
    return "\n".join([f"{old_name} -> {new_name}", *_table(d),
                      _verdict(d.failures, d.limits)])


# ---- two results stores -------------------------------------------------------------------

SQLITE_HEADER = b"SQLite format 3\x00"


def is_store(path: str) -> bool:
    """Whether `path` is an SQLite file (a results store, or refused as one when read)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:
        return False


def load_store(path: str) -> list[Result]:
    """A store's results, the newest of each config (by backend and config hash) when it
    kept several tool versions' figures; nothing in the file is changed."""
    try:
        with Store(path, read_only=True) as store:
            rows = store.results()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    newest = {(r.backend, r.config_hash): r for r in rows}  # results() is oldest first
    return list(newest.values())


def match(old: list[Result], new: list[Result]
          ) -> tuple[list[tuple[Result, Result]], list[Result], list[Result]]:
    """Pairs (old, new) of the same config: the same config hash on the same backend, then
    the same name (a change that adds a config key changes every hash, not the names),
    each key only where it names one result on each side; and the results only in OLD,
    only in NEW."""
    pairs, left_old, left_new = [], list(old), list(new)
    for key in (lambda r: (r.backend, r.config_hash), lambda r: (r.backend, r.name)):
        counts = Counter(map(key, left_old)) + Counter(map(key, left_new))
        by_key = {key(r): r for r in left_new if counts[key(r)] == 2}  # one on each side
        matched = [(r, by_key[key(r)]) for r in left_old if key(r) in by_key]
        pairs += matched
        left_old = [r for r in left_old if key(r) not in by_key]
        left_new = [r for r in left_new if key(r) not in by_key]
    return sorted(pairs, key=lambda p: p[1].name), left_old, left_new


@dataclasses.dataclass(frozen=True)
class ConfigDiff:
    """One config in both stores: its statuses, and the reports' diff when both ran."""

    name: str
    old_status: str
    new_status: str
    message: str  # NEW's when it did not run
    diff: Diff | None

    @property
    def stopped(self) -> str:
        """Why its status fails the gate: "" unless it ran in OLD and not in NEW."""
        if self.old_status == "ok" and self.new_status != "ok":
            return f"ran in OLD, {self.new_status} in NEW: {self.message}"
        return ""

    @property
    def failures(self) -> list[str]:
        if self.stopped:
            return [f"{self.name}: {self.stopped}"]
        return [f"{self.name}: {f}" for f in self.diff.failures] if self.diff else []

    def entries(self, *, regressions: bool) -> list[dict]:
        """Its `--json` entries: the regressions, or every change."""
        if self.diff is not None:
            lines = self.diff.regressions() if regressions else self.diff.changes()
            return [{"config": self.name, **ln} for ln in lines]
        if self.old_status == self.new_status or (regressions and not self.stopped):
            return []
        return [{"config": self.name, "what": "status", "old": self.old_status,
                 "new": self.new_status, "change": None, "failure": self.stopped}]


@dataclasses.dataclass(frozen=True)
class StoreDiff:
    configs: tuple[ConfigDiff, ...]
    only_old: tuple[str, ...]
    only_new: tuple[str, ...]
    limits: tuple[tuple[str, float], ...] = ()

    @property
    def failures(self) -> list[str]:
        return [f for c in self.configs for f in c.failures]

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {"ok": self.ok, "failures": self.failures,
                "thresholds": _thresholds(self.limits),
                "regressions": [e for c in self.configs for e in c.entries(regressions=True)],
                "changes": [e for c in self.configs for e in c.entries(regressions=False)],
                "configs": [{"name": c.name, "old_status": c.old_status,
                             "new_status": c.new_status,
                             **(c.diff.to_dict() if c.diff else {})} for c in self.configs],
                "only_in_old": list(self.only_old), "only_in_new": list(self.only_new)}


def diff_stores(old: list[Result], new: list[Result], **thresholds: float) -> StoreDiff:
    """Each config of both stores compared as `diff` compares two reports (the thresholds
    likewise); a config that ran in OLD and not in NEW (refused, failed, or pruned as
    unfit) fails the gate; configs in one store only are listed."""
    pairs, only_old, only_new = match(old, new)
    configs = []
    for a, b in pairs:
        both = a.status == b.status == "ok" and a.report and b.report
        configs.append(ConfigDiff(b.name, a.status, b.status, b.message,
                                  diff(a.report, b.report, **thresholds) if both else None))
    return StoreDiff(tuple(configs), tuple(sorted(r.name for r in only_old)),
                     tuple(sorted(r.name for r in only_new)),
                     _limits(thresholds.get("max_step_increase", MAX_STEP_INCREASE),
                             thresholds.get("max_memory_increase", MAX_MEMORY_INCREASE),
                             thresholds.get("max_bytes_increase", MAX_BYTES_INCREASE)))


def format_store_diff(d: StoreDiff, old_name: str, new_name: str) -> str:
    lines = [f"{old_name} -> {new_name}: {len(d.configs)} configs in both, "
             f"{len(d.only_old)} only in old, {len(d.only_new)} only in new"]
    for c in d.configs:
        if c.diff is None:
            moved = (f"{c.old_status} -> {c.new_status}" if c.old_status != c.new_status
                     else f"{c.new_status} in both")
            fail = f"  FAIL {c.stopped}" if c.stopped else ""
            lines.append(f"{c.name}: {moved}{fail}")
        elif not c.diff.changes():
            lines.append(f"{c.name}: the same")
        else:
            lines += [f"{c.name}:", *("  " + ln for ln in _table(c.diff))]
    for what, names in (("only in old", d.only_old), ("only in new", d.only_new)):
        if names:
            lines.append(f"{what}: {', '.join(names)}")
    lines.append(_verdict(d.failures, d.limits))
    return "\n".join(lines)
