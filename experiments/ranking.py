"""Reading search results: the ranking (those that ran and fit, fastest first), the Pareto
front of step time against memory, why each of the others lost, the table and the JSON."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from experiments.store import Result
from sharding.units import counted, fmt_bytes, fmt_s


def ranking(results: Sequence[Result]) -> list[Result]:
    """Those that ran and fit, fastest first."""
    ok = [r for r in results if r.status == "ok" and r.step_time_s and r.fits is not False]
    return sorted(ok, key=lambda r: r.step_time_s)


def pareto(results: Sequence[Result]) -> list[Result]:
    """The configs no other beats on both step time and memory per device."""
    ok = [r for r in results if r.status == "ok" and r.step_time_s]
    front, best_mem = [], math.inf
    for r in sorted(ok, key=lambda r: (r.step_time_s, r.memory_per_device_bytes)):
        if r.memory_per_device_bytes < best_mem:
            front.append(r)
            best_mem = r.memory_per_device_bytes
    return front


def why_not(r: Result, best: Result | None) -> str:
    if r.status != "ok":
        return f"{r.status}: {r.message}"
    if r.fits is False:
        return f"does not fit ({fmt_bytes(r.memory_per_device_bytes)} per device)"
    if best is not None and r.step_time_s:
        return f"{r.step_time_s / best.step_time_s - 1:+.0%} slower than the best"
    return ""


def format_results(results: Sequence[Result], top: int = 10, untried: int = 0) -> str:
    """The ranking table, the counts (with the configs a budget left `untried`), the Pareto
    front and why the others lost."""
    ranked = ranking(results)
    best = ranked[0] if ranked else None
    w = max([len("config"), *(len(r.name) for r in ranked[:top])]) + 2
    head = (f"{'rank':>4}  {'config':<{w}}{'step':>11}{'tok/s/dev':>11}{'MFU':>7}"
            f"{'memory/dev':>12}  bottleneck")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(ranked[:top], 1):
        lines.append(f"{i:>4}  {r.name:<{w}}{fmt_s(r.step_time_s):>11}"
                     f"{r.tokens_per_s_per_device or 0:>11,.0f}{(r.mfu or 0):>7.1%}"
                     f"{fmt_bytes(r.memory_per_device_bytes):>12}  "
                     f"{r.bottleneck.split(';')[0]}")
    if not ranked:
        lines.append("(no config ran and fit)")
    others = [r for r in results if r not in ranked[:top]]
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "refused", "error")}
    lines.append("")
    lines.append(f"{counted(len(results), 'config')}: {counts['ok']} estimated "
                 f"({len(ranked)} fit), {counts['refused']} refused, {counts['error']} failed"
                 + (f", {untried} not tried (the budget)" if untried else ""))
    front = pareto(results)
    if front:
        lines.append("pareto front (none is both faster and smaller):")
        fw = max(len(r.name) for r in front) + 2
        lines += [f"  {r.name:<{fw}}{fmt_s(r.step_time_s):>11}"
                  f"{fmt_bytes(r.memory_per_device_bytes):>12}" for r in front]
    if others:
        lines.append("why the others lost:")
        for r in others[:20]:
            lines.append(f"  {r.name}: {why_not(r, best)}")
        if len(others) > 20:
            lines.append(f"  ... and {len(others) - 20} more (--json has them all)")
    return "\n".join(lines)


def to_json(results: Sequence[Result]) -> dict:
    ranked = ranking(results)
    return {"results": [r.summary() for r in results],
            "best": ranked[0].summary() if ranked else None,
            "pareto": [r.name for r in pareto(results)]}


@dataclasses.dataclass(frozen=True)
class Search:
    """The rows of one search in a store: its name (as it first stored them), the system
    and backend compiled for, and the tool version."""

    search: str
    system: str
    backend: str
    tool_version: str
    results: list[Result]
    versions: int = 1  # tool versions in the store: named in the label when several

    @property
    def label(self) -> str:
        version = f", shardscope {self.tool_version}" if self.versions > 1 else ""
        return f"{self.search} on {self.system} ({self.backend}{version})"

    def to_json(self) -> dict:
        return {"search": self.search, "system": self.system, "backend": self.backend,
                "tool_version": self.tool_version, **to_json(self.results)}


def searches(results: Sequence[Result]) -> list[Search]:
    """A store's rows by search, system, backend and tool version, each ranked apart (the
    same config from two of them would be listed twice, their figures not comparable)."""
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault((r.search, r.system, r.backend, r.tool_version), []).append(r)
    versions = len({k[3] for k in groups})
    return [Search(*k, rows, versions) for k, rows in groups.items()]
