"""Assertions and snapshots over a report's collectives, for tests of the user's own
sharding; the pytest plugin (pytest_shardscope.py) offers them as fixtures.

    report = sharding.analyze(step, x, w, mesh=mesh, system=None)   # bytes and counts
    sharding.assert_collectives(report, forbid=["all-gather over tensor"],
                                max_bytes={"all-reduce": 1 << 20},        # per step, summed
                                max_single_bytes={"all-gather": 64 << 20})  # any one

Collectives are named as `shardscope diff` names them: a kind (`"all-gather"`), or a kind
over mesh axes (`"all-reduce over tensor"`, `"all-gather over data,tensor"`, `"... over
devices"` for groups that map to no mesh axis). A kind over axes matches the collectives
over exactly those axes, in any order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Iterable, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from sharding.collectives import KINDS, Collective
from sharding.hlo import parse_hlo
from sharding.hlo_source import instruction_source, user_stack_frames
from sharding.report import Report
from sharding.units import fmt_bytes

# Rows of a failure's table before "and N more".
_MAX_ROWS = 10


@dataclasses.dataclass(frozen=True)
class Selector:
    """A kind, or a kind over exactly these mesh axes (None: over any)."""

    text: str
    kind: str
    mesh_axes: frozenset[str] | None

    def matches(self, c: Collective) -> bool:
        return c.kind == self.kind and (self.mesh_axes is None
                                        or frozenset(c.mesh_axes) == self.mesh_axes)


def label(c: Collective) -> str:
    """"KIND over AXES", as `shardscope diff` and the selectors write it."""
    return f"{c.kind} over {','.join(c.mesh_axes) or 'devices'}"


def selector(text: str, axis_names: Iterable[str] = ()) -> Selector:
    """Read `"all-gather"` or `"all-reduce over data,tensor"`; `axis_names`: the mesh's,
    to refuse an axis it does not have (nothing is checked when empty).

    Raises:
        ValueError: an unknown kind or mesh axis, with the valid ones.
    """
    kind, over, axes_text = str(text).partition(" over ")
    kind = kind.strip()
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r} in {text!r}; valid kinds: "
                         f"{', '.join(KINDS)}, alone or over mesh axes "
                         f"(e.g. 'all-reduce over tensor')")
    if not over:
        return Selector(text, kind, None)
    axes = [a.strip() for a in axes_text.split(",") if a.strip()]
    if axes == ["devices"]:
        axes = []
    names = tuple(axis_names)
    unknown = [a for a in axes if names and a not in names]
    if unknown or not axes_text.strip():
        raise ValueError(f"mesh axis {(unknown or [''])[0]!r} in {text!r} is not one of the "
                         f"report's mesh axes ({', '.join(names) or 'none'}); name some of "
                         f"them, comma-separated, or 'devices' for groups over no mesh axis")
    return Selector(text, kind, frozenset(axes))


def _limits(limit: int | Mapping[str, int] | None, names: tuple[str, ...], what: str
            ) -> list[tuple[Selector | None, int]]:
    """(selector or None for every collective, limit) pairs of a max_count / max_bytes /
    max_single_bytes."""
    if limit is None:
        return []
    pairs = limit.items() if isinstance(limit, Mapping) else [(None, limit)]
    out = []
    for key, value in pairs:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{what}[{key!r}] = {value!r}: give a number >= 0"
                             if key is not None else
                             f"{what}={value!r}: give a number >= 0, or a dict keyed by "
                             f"kind or kind over mesh axes")
        out.append((None if key is None else selector(key, names), value))
    return out


def assert_collectives(report: Report, *, max_count: int | Mapping[str, int] | None = None,
                       max_bytes: int | Mapping[str, int] | None = None,
                       forbid: str | Iterable[str] = (),
                       max_single_bytes: int | Mapping[str, int] | None = None) -> None:
    """Fail when the report's collectives break the limits.

    Args:
        report: from `sharding.analyze` (with or without a system).
        max_count: executions per step at most, over all collectives (an int) or per kind
            / kind over mesh axes (a dict, e.g. {"all-reduce over data": 2}), summed over
            the collectives it names.
        max_bytes: bytes per step at most, the TOTAL over the collectives it names (each
            collective's buffer times its count, summed), the same ways.
        forbid: kinds or kinds over mesh axes that must not appear at all (None: none).
        max_single_bytes: bytes at most of any ONE collective it names: its buffer per
            execution (`Collective.bytes`, the size S of the byte convention), whatever
            the count or the others; e.g. {"all-gather": 64 << 20} for "no all-gather
            bigger than 64 MiB".

    Raises:
        AssertionError: a table of each broken limit's collectives, with their op names
            and source lines (the innermost of the user's own code where the HLO carries
            the stack).
        ValueError: an unknown kind or mesh axis, or a limit that is not a number.
        TypeError: `forbid` is not a kind, a list of them or None.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this function's
    names = tuple(report.inputs.axis_names) if report.inputs is not None else ()
    forbid = _forbidden(forbid)
    rules: list[tuple[str, list[Collective]]] = []
    for s in [selector(f, names) for f in forbid]:
        found = [c for c in report.collectives if s.matches(c)]
        if found:
            rules.append((f"forbidden {s.text}: {sum(c.count for c in found)} found", found))
    checks = (("max_count", max_count, "executions", lambda c: c.count),
              ("max_bytes", max_bytes, "bytes", lambda c: c.total_bytes))
    for what, limits, unit, size in checks:
        for s, limit in _limits(limits, names, what):
            found = [c for c in report.collectives if s is None or s.matches(c)]
            total = sum(size(c) for c in found)
            if total > limit:
                scope = "all collectives" if s is None else s.text
                rules.append((f"{what} {scope}: {total:,} {unit}, at most {limit:,}", found))
    for s, limit in _limits(max_single_bytes, names, "max_single_bytes"):
        over = [c for c in report.collectives if (s is None or s.matches(c))
                and c.bytes > limit]
        if over:
            scope = "any collective" if s is None else f"any one {s.text}"
            rules.append((f"max_single_bytes {scope}: {len(over)} over {limit:,} bytes, the "
                          f"largest {max(c.bytes for c in over):,} bytes", over))
    if rules:
        raise AssertionError(_failure_table(report, rules))


def _forbidden(forbid) -> list[str]:
    """`forbid` as a list of selectors' texts: a kind, a list of them, or None as () (as
    max_count and max_bytes take None for no limit)."""
    if forbid is None:
        return []
    if isinstance(forbid, str):
        return [forbid]
    if not isinstance(forbid, Iterable) or isinstance(forbid, Mapping):
        raise TypeError(f"forbid={forbid!r}: give a kind or kind over mesh axes, or a list of "
                        f"them, e.g. forbid=['all-gather over tensor']")
    return list(forbid)


def _failure_table(report: Report, rules: list[tuple[str, list[Collective]]]) -> str:
    where = _sources(report)
    lines = [f"{len(rules)} collective limit{'s' * (len(rules) > 1)} broken "
             f"({report.num_devices} devices):"]
    for rule, found in rules:
        found = sorted(found, key=lambda c: (-c.total_bytes, c.name))
        lines.append(f"  {rule}")
        width = max(len(label(c)) for c in found[:_MAX_ROWS])
        for c in found[:_MAX_ROWS]:
            source = where.get((c.computation, c.name), "")
            each = f" ({fmt_bytes(c.bytes)} each)" if c.count > 1 else ""
            lines.append(f"    {label(c):<{width}}  x{c.count:<4} {fmt_bytes(c.total_bytes):>10}"
                         f"{each}  {c.op_name or '(no op_name)'}" + (f"  at {source}" if source
                                                                     else ""))
        if len(found) > _MAX_ROWS:
            lines.append(f"    and {len(found) - _MAX_ROWS} more")
    return "\n".join(lines)


def _sources(report: Report) -> dict[tuple[str, str], str]:
    """(computation, instruction) -> "file:line" of each collective in the user's code
    (hlo_source.user_stack_frames), paths relative to the working directory where they are
    under it; empty without the report's HLO."""
    text = getattr(report.inputs, "hlo_text", "")
    if not text:
        return {}
    module, frames = parse_hlo(text), user_stack_frames(text)
    here = os.getcwd() + os.sep
    out = {}
    for c in report.collectives:
        where = instruction_source(module, frames, c.computation, c.name)
        out[(c.computation, c.name)] = where.removeprefix(here)
    return out


# --- fake meshes ---------------------------------------------------------------------
def cpu_mesh(axis_sizes: Mapping[str, int], *, fix: str = "") -> Mesh:
    """A mesh over the first fake CPU devices with these axis names, in this order (the
    last fastest: consecutive device ids).

    Raises:
        ValueError: no axes, a size below 1, or more devices than JAX has (`fix`: how to
            fake more, with `{n}` for the count needed).
    """
    __tracebackhide__ = True  # a test that asks too much sees its own line and this error
    if not axis_sizes:
        raise ValueError("a mesh needs at least one axis, e.g. data=2, tensor=4")
    bad = next(((a, s) for a, s in axis_sizes.items()
                if isinstance(s, bool) or not isinstance(s, int) or s < 1), None)
    if bad is not None:
        raise ValueError(f"mesh axis {bad[0]}={bad[1]!r}: give a whole number of devices >= 1")
    names, shape = tuple(axis_sizes), tuple(axis_sizes.values())
    n = math.prod(shape)
    devices = sorted(jax.devices("cpu"), key=lambda d: d.id)
    if n > len(devices):
        sizes = " x ".join(f"{a}={s}" for a, s in axis_sizes.items())
        raise ValueError(f"mesh {sizes} needs {n} devices but JAX has {len(devices)} fake "
                         f"CPU devices; {(fix or 'fake {n} before JAX starts').format(n=n)}")
    return Mesh(np.array(devices[:n], dtype=object).reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(names))


# --- snapshots -----------------------------------------------------------------------
def snapshot(report: Report, *, test: str = "") -> dict:
    """What a snapshot keeps of a report: the mesh, and per kind over mesh axes the
    executions and bytes per step, sorted."""
    inputs = report.inputs
    mesh = dict(zip(inputs.axis_names, inputs.mesh_shape, strict=True)) if inputs else {}
    rows: dict[str, list[int]] = {}
    for c in report.collectives:
        r = rows.setdefault(label(c), [0, 0])
        r[0] += c.count
        r[1] += c.total_bytes
    return {"test": test, "num_devices": report.num_devices, "mesh": mesh,
            "collectives": {k: {"count": n, "bytes": b} for k, (n, b) in sorted(rows.items())}}


def snapshot_text(snap: dict) -> str:
    """JSON with one collective a line, so that a change reviews as a one-line diff."""
    head = {k: v for k, v in snap.items() if k != "collectives"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    rows = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in snap["collectives"].items()]
    body = "{\n" + ",\n".join(rows) + "\n  }" if rows else "{}"
    return "{\n" + "\n".join(lines) + f'\n  "collectives": {body}\n}}\n'


def snapshot_changes(old: dict, new: dict) -> list[tuple[str, str, str, str]]:
    """(change, what, old, new) rows: the mesh, and each kind over mesh axes that
    appeared, vanished or changed its executions or bytes per step."""
    out = []
    for key in ("num_devices", "mesh"):
        if old.get(key) != new.get(key):
            out.append(("changed", key, json.dumps(old.get(key)), json.dumps(new.get(key))))
    before, after = old.get("collectives", {}), new.get("collectives", {})

    def fig(r):
        return f"x{r['count']} {r['bytes']:,} B"

    for what in sorted(before.keys() | after.keys()):
        a, b = before.get(what), after.get(what)
        if a is None:
            out.append(("appeared", what, "-", fig(b)))
        elif b is None:
            out.append(("vanished", what, fig(a), "-"))
        elif (a.get("count"), a.get("bytes")) != (b["count"], b["bytes"]):
            out.append(("changed", what, fig(a), fig(b)))
    return out


def _snapshot_problem(snap) -> str | None:
    """What makes JSON not a snapshot (snapshot_text's shape), or None: a hand edit or a
    merge may leave valid JSON of another shape."""
    if not isinstance(snap, dict):
        return f"a JSON {type(snap).__name__}, not an object"
    rows = snap.get("collectives")
    if not isinstance(rows, dict):
        return "its 'collectives' is not an object of rows"
    for what, row in rows.items():
        if not isinstance(row, dict) or any(
                isinstance(row.get(k), bool) or not isinstance(row.get(k), int)
                for k in ("count", "bytes")):
            return f"row {what!r} is not {{\"count\": int, \"bytes\": int}}"
    if not isinstance(snap.get("test", ""), str):
        return "its 'test' is not a test's name"
    return None


def check_snapshot(report: Report, *, path: pathlib.Path, test: str, update: bool) -> str:
    """Compare the report with the snapshot at `path`: "same", or "written" when it was
    absent, or "updated" when `update` rewrote a different one.

    Raises:
        AssertionError: it differs (a table of what appeared, vanished or changed), or it
            is another test's.
    """
    __tracebackhide__ = True
    new = snapshot(report, test=test)
    if update or not path.exists():
        status = "updated" if path.exists() else "written"
        if path.exists() and path.read_text() == snapshot_text(new):
            return "same"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(snapshot_text(new))
        return status
    try:
        old = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AssertionError(f"{path}: not a collectives snapshot ({e}); "
                             f"--shardscope-update rewrites it") from None
    if (problem := _snapshot_problem(old)) is not None:
        raise AssertionError(f"{path}: not a collectives snapshot ({problem}); "
                             f"--shardscope-update rewrites it")
    if old.get("test", test) != test:
        raise AssertionError(f"{path} is the snapshot of {old['test']}, not of {test}: two "
                             f"tests beside each other share the name; pass name= to one, or "
                             f"--shardscope-update if the test moved")
    changes = snapshot_changes(old, new)
    if not changes:
        return "same"
    w = [max(len(r[i]) for r in changes) for i in range(3)]
    rows = [f"  {c:<{w[0]}}  {what:<{w[1]}}  {a:>{w[2]}}  ->  {b}" for c, what, a, b in changes]
    raise AssertionError(f"collectives differ from {path.name} (--shardscope-update rewrites "
                         f"it after review):\n" + "\n".join(rows))
