"""`shardscope compare CONFIG --systems A,B,C`: one model and workload on several systems,
side by side.

Each system gets the config's sharding where it is valid there (the validator's reason
otherwise), its batch-sharding axis scaled to the system's device count (`fit_to_devices`:
256 TPU7x chips are 512 devices), or with `--search` the fastest sharding that fits from a
search on that system. On the CPU path the compiled program depends only on the mesh, not
on the machine, so it is compiled once per device count and sharding and re-timed on every
system of that size (`sharding.reanalyze`: each system's chips and links, no recompile); a
test checks this equals compiling for each.

Power, energy per token, tokens/s per MW and USD per million tokens are each report's
(meshes/power.py: the chips from idle to TDP by how busy the schedule keeps them, the
hosts, NICs and NVLink switches, the PUE; the catalog's dated price per chip-hour, or the
config's `[cost]`, or `--price-per-device-hour` for every system); None where no public
power figure or price exists.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Sequence

from experiments import config as config_mod
from experiments import runner
from experiments.config import ConfigError
from sharding.mesh import CPU_MAX_DEVICES
from sharding.report import Report
from sharding.rules import MESH_AXES
from sharding.text import column_table
from sharding.units import fmt_bytes, fmt_duration, fmt_s, fmt_watts, fmt_wh


@dataclasses.dataclass(frozen=True)
class Entry:
    """One system's column."""

    system: str
    status: str  # "ok" | "refused"
    message: str = ""
    report: Report | None = None
    parallelism: dict = dataclasses.field(default_factory=dict)
    retimed_from: str = ""  # the system whose compile was re-timed ("" when compiled)
    note: str = ""  # how the config's sharding was fitted to the system, or found
    # chips within a power budget and runs of N tokens (meshes.power.Energy.scale_out)
    scale_out: dict | None = None

    def _energy(self, figure: str) -> float | None:
        """A figure of the step's energy and cost (meshes/power.py), None where the system
        did not run or no public figure exists."""
        e = self.report.energy if self.report else None
        return None if e is None else getattr(e, figure)

    @property
    def power_w(self) -> float | None:
        """The facility's draw running the step."""
        return self._energy("power_w")

    @property
    def joules_per_token(self) -> float | None:
        return self._energy("joules_per_token")

    @property
    def usd_per_million_tokens(self) -> float | None:
        return self._energy("usd_per_million_tokens")

    @property
    def tokens_per_s_per_chip(self) -> float | None:
        """Per physical chip (a TPU7x chip is two JAX devices)."""
        from meshes import get_system

        r = self.report
        if r is None or r.tokens_per_s is None:
            return None
        return r.tokens_per_s / (r.num_devices / get_system(self.system).chip.devices_per_chip)

    @property
    def tokens_per_s_per_mw(self) -> float | None:
        return self._energy("tokens_per_s_per_mw")

    def to_dict(self) -> dict:
        r = self.report
        return {
            "system": self.system, "status": self.status, "message": self.message,
            "parallelism": self.parallelism, "retimed_from": self.retimed_from or None,
            "note": self.note or None,
            "step_time_s": r.step_time_s if r else None,
            "tokens_per_s": r.tokens_per_s if r else None,
            "tokens_per_s_per_device": r.tokens_per_s_per_device if r else None,
            "tokens_per_s_per_chip": self.tokens_per_s_per_chip,
            "mfu": r.mfu if r else None, "bottleneck": r.bottleneck() if r else None,
            "fits": r.fits if r else None,
            "memory_per_device_bytes": r.memory_per_device_bytes if r else None,
            "power_w": self.power_w, "joules_per_token": self.joules_per_token,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "tokens_per_s_per_mw": self.tokens_per_s_per_mw,
            "power": r.energy.to_dict() if r and r.energy else None,
            "scale_out": self.scale_out,
        }


def fit_to_devices(raw: dict, num_devices: int) -> str:
    """Fit the config's sharding to a system of another device count, in place: the
    batch-sharding axis (fsdp where it is used, else data) takes the ratio, or `tensor`
    where the batch would not split that many ways; the other axes (pipeline, experts,
    context) stay. A TPU7x chip is two devices, so 256 chips of it run twice the ways of
    256 GPUs. Returns what changed ("" when nothing did or nothing fits: the validator then
    says why)."""
    par = raw.setdefault("parallelism", {})
    total = math.prod(int(par.get(a, 1)) for a in MESH_AXES)
    if num_devices == total:
        return ""
    work = raw.get("workload", {})
    micro = (int(work["global_batch"]) // int(work.get("microbatches", 1))
             if "global_batch" in work else 0)
    batch_ways = math.prod(int(par.get(a, 1)) for a in ("data", "fsdp", "expert"))
    for axis in ("fsdp" if int(par.get("fsdp", 1)) > 1 else "data", "tensor"):
        old = int(par.get(axis, 1))
        if num_devices % total == 0:
            new = old * (num_devices // total)
        elif total % num_devices == 0 and old % (total // num_devices) == 0:
            new = old // (total // num_devices)
        else:
            continue
        ways = batch_ways * new // old if axis != "tensor" else batch_ways
        if micro % ways == 0:  # the batch still splits: else the next axis takes it
            par[axis] = new
            return f"{axis} {old} -> {new} for its {num_devices} devices"
    return ""


def compare(raw: dict, systems: Sequence[str], *, calibration=None,
            price_per_device_hour: float | None = None, search: dict | None = None,
            on_result=None) -> list[Entry]:
    """Each system's estimate of the config's step (XLA:CPU; one compile per device count
    and sharding): the config's sharding fitted to the system's device count
    (`fit_to_devices`), or with `search` ({"store": path, "axes": (...), "workers": n,
    "budget": n}) the fastest sharding that fits from a search on that system (stored, so
    a rerun compiles nothing new)."""
    import sharding
    from meshes import get_system

    if not systems:
        raise ConfigError("--systems: give at least one system, e.g. --systems "
                          "h100:64,b200:64,gb200-nvl72:64")
    compiled: dict[tuple, tuple[str, Report]] = {}
    out = []
    devices: dict[str, int | str] = {}  # devices, or why the name is not a system
    for name in systems:
        try:
            devices[name] = get_system(name).num_devices
        except ValueError as e:
            devices[name] = f"system.name: {e}"
    known = [n for n in devices.values() if isinstance(n, int)]
    if known:  # JAX's CPU backend fakes one device count per process: the largest
        try:
            sharding.ensure_cpu_devices(min(max(known), CPU_MAX_DEVICES))
        except ValueError:
            pass  # already started smaller (tests, notebooks): a system past it says so
    for name in systems:
        r = copy.deepcopy(raw)
        r["system"] = {"name": name}
        n = devices[name]
        if isinstance(n, str):
            out.append(Entry(name, "refused", n))
            continue
        note = fit_to_devices(r, n)
        if search is not None:
            r, note, why = _searched(r, name, n, search, calibration, on_result)
            if r is None:
                out.append(Entry(name, "refused", why))
                continue
        try:
            exp = config_mod.from_dict(r)
        except ConfigError as e:
            out.append(Entry(name, "refused", str(e).splitlines()[0], note=note))
            continue
        if price_per_device_hour is not None:
            exp = dataclasses.replace(exp, cost=dataclasses.replace(
                exp.cost,
                usd_per_chip_hour=price_per_device_hour * exp.system.chip.devices_per_chip))
        sizes = {a: s for a, s in exp.parallelism.sizes().items() if s > 1}
        key = (n, json.dumps(r["parallelism"], sort_keys=True))
        if key in compiled:
            first, rep = compiled[key]
            report = sharding.reanalyze(
                dataclasses.replace(rep.inputs, name=exp.name, fit_advice=()),
                system=exp.system, calibration=calibration, cost=exp.cost)
            out.append(Entry(name, "ok", report=report, parallelism=sizes, retimed_from=first,
                             note=note))
            continue
        try:
            report = runner.run(exp, backend="cpu", calibration=calibration)
        except ConfigError as e:
            out.append(Entry(name, "refused", str(e).splitlines()[0], note=note))
            continue
        compiled[key] = (name, report)
        out.append(Entry(name, "ok", report=report, parallelism=sizes, note=note))
    return out


def _searched(r: dict, name: str, n: int, opts: dict, calibration, on_result):
    """(the config with the fastest sharding that fits on `name`, a note, why not)."""
    from experiments import search as search_mod
    from experiments.store import Store

    label = f"compare {r['name']} on {name}"
    with Store(opts["store"]) as store:
        search_mod.run_search(r, num_devices=n, axes=opts.get("axes", ("data", "fsdp",
                                                                       "tensor")),
                              vary=(), store=store, search=label,
                              workers=opts.get("workers"), budget=opts.get("budget"),
                              calibration=opts.get("calibration"), on_result=on_result)
        ranked = search_mod.ranking(store.results(search=label))
    if not ranked:
        return None, "", f"the search on {name} found no sharding that runs and fits"
    best = ranked[0]
    shape = ", ".join(f"{a} {s}" for a, s in best.parallelism.items() if s > 1)
    out = copy.deepcopy(best.config)
    out["name"] = r["name"]
    return out, f"searched: {shape} fastest of {len(ranked)} that fit", ""


def with_scale_out(entries: Sequence[Entry], *, power_budget_w: float | None = None,
                   tokens: float | None = None) -> list[Entry]:
    """Each system's chips within `power_budget_w` and its runs of `tokens`."""
    if power_budget_w is None and tokens is None:
        return list(entries)
    return [dataclasses.replace(e, scale_out=e.report.energy.scale_out(
        power_budget_w=power_budget_w, tokens=tokens)) if e.report and e.report.energy else e
        for e in entries]


def _scale_out_rows(entries: Sequence[Entry]) -> list:
    """Rows for the budget's chips and the runs' wall time and energy, where asked."""
    first = next((e.scale_out for e in entries if e.scale_out), None)
    if first is None:
        return []
    budget, tokens = first["power_budget_w"], first["tokens"]

    def get(e: Entry, *keys):
        v = e.scale_out
        for k in keys:
            v = None if v is None else v.get(k)
        return v

    rows = []
    if budget is not None:
        rows.append((f"chips in {fmt_watts(budget)}", lambda e: None if get(
            e, "chips_within_budget") is None else f"{get(e, 'chips_within_budget'):,}"))
    if tokens is not None:
        rows.append((f"{tokens:.3g} tokens, these chips", lambda e: None if get(
            e, "run") is None else fmt_duration(get(e, "run", "time_s"))))
        if budget is not None:
            rows.append((f"{tokens:.3g} tokens in {fmt_watts(budget)}", lambda e: None if get(
                e, "run_within_budget") is None else fmt_duration(
                get(e, "run_within_budget", "time_s"))))
        rows.append((f"{tokens:.3g} tokens: energy", lambda e: None if get(
            e, "run", "energy_j") is None else fmt_wh(get(e, "run", "energy_j"))))
        rows.append((f"{tokens:.3g} tokens: USD", lambda e: None if get(
            e, "run", "usd") is None else f"${get(e, 'run', 'usd'):,.0f}"))
    return rows


def format_compare(entries: Sequence[Entry]) -> str:
    from meshes import get_system

    def cell(e: Entry, fn) -> str:
        if e.report is None:
            return "refused"
        try:
            v = fn(e)
        except (TypeError, ZeroDivisionError):
            return "-"
        return "-" if v is None else v

    def chip_of(e: Entry):
        return get_system(e.system).chip

    def per_device_links(e: Entry) -> str:
        s = get_system(e.system)
        return ", ".join(f"{link.name} {link.bytes_per_s / 1e9:.0f}"
                         for link in s.links.values())

    rows = [
        ("step time", lambda e: fmt_s(e.report.step_time_s)),
        ("tokens/s", lambda e: f"{e.report.tokens_per_s:,.0f}"),
        ("tokens/s per chip", lambda e: f"{e.tokens_per_s_per_chip:,.0f}"),
        ("MFU", lambda e: f"{e.report.mfu:.1%}"),
        ("memory/device", lambda e: fmt_bytes(e.report.memory_per_device_bytes)
         + ("" if e.report.fits else " (no fit)")),
        ("HBM TB/s per chip",
         lambda e: f"{chip_of(e).hbm_bytes_per_s * chip_of(e).devices_per_chip / 1e12:.2f}"),
        ("links GB/s per device", per_device_links),
        ("power (facility)", lambda e: None if e.power_w is None else fmt_watts(e.power_w)),
        ("energy per token", lambda e: None if e.joules_per_token is None
         else f"{e.joules_per_token:.4g} J"),
        ("tokens/s per MW", lambda e: None if e.tokens_per_s_per_mw is None
         else f"{e.tokens_per_s_per_mw:,.0f}"),
        ("USD per M tokens", lambda e: None if e.usd_per_million_tokens is None
         else f"{e.usd_per_million_tokens:.4g}"),
        *_scale_out_rows(entries),
        ("compiled", lambda e: f"re-timed from {e.retimed_from}" if e.retimed_from
         else "yes"),
    ]
    table = [(what, [cell(e, fn) for e in entries]) for what, fn in rows]
    lines = column_table([e.system for e in entries], table)
    for e in entries:
        lines.append(f"{e.system}: " + (e.report.bottleneck() if e.report else e.message)
                     + (f" [{e.note}]" if e.note else ""))
    lines.append("power: chips (idle to TDP by how busy the schedule keeps them), hosts, NICs "
                 "and NVLink switches, times the PUE (meshes/power.py); '-' where no public "
                 "power figure or price exists")
    return "\n".join(lines)


# The bar charts of the HTML page: (title, class, value of an entry, how to print it, higher
# is better).
_BARS = (
    ("Step time", "step", lambda e: e.report.step_time_s, fmt_s, False),
    ("Tokens/s per chip", "tokens", lambda e: e.tokens_per_s_per_chip,
     lambda v: f"{v:,.0f}", True),
    ("MFU", "mfu", lambda e: e.report.mfu, lambda v: f"{v:.1%}", True),
    ("Tokens/s per MW (facility)", "per-mw", lambda e: e.tokens_per_s_per_mw,
     lambda v: f"{v:,.0f}", True),
    ("USD per million tokens", "usd", lambda e: e.usd_per_million_tokens,
     lambda v: f"${v:,.4g}", False),
)


def render_html(entries: Sequence[Entry], title: str = "compare") -> str:
    """One page: a bar chart per figure (each system that ran, the best one marked; a
    figure a system has no number for is left out of its chart and said) and the full
    table of `format_compare`."""
    import html as h

    ran = [e for e in entries if e.report is not None]
    charts = []
    bars = list(_BARS)
    first = next((e.scale_out for e in ran if e.scale_out), None)
    if first and first.get("tokens") and first.get("power_budget_w"):
        bars.append((f"{first['tokens']:.3g} tokens in a {fmt_watts(first['power_budget_w'])} "
                     f"building", "run-in-budget",
                     lambda e: ((e.scale_out or {}).get("run_within_budget") or {}).get(
                         "time_s"), fmt_duration, False))
    for name, cls, value, fmt, higher in bars:
        vals = [(e, value(e)) for e in ran]
        known = [(e, v) for e, v in vals if v is not None and v > 0]
        missing = [e.system for e, v in vals if v is None or v <= 0]
        width, left, bar, gap = 720, 190, 22, 8
        height = 20 + len(known) * (bar + gap)
        svg = [f'<svg class="bars {cls}" width="{width}" height="{height}" '
               f'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="12">']
        if known:
            top = max(v for _, v in known)
            best = (max if higher else min)(known, key=lambda ev: ev[1])[0]
            for i, (e, v) in enumerate(known):
                y = 10 + i * (bar + gap)
                w = (width - left - 110) * v / top
                color = "#e45756" if e is best else "#4c78a8"
                svg.append(f'<text x="{left - 8}" y="{y + bar * 0.7:.1f}" text-anchor="end" '
                           f'class="system">{h.escape(e.system)}</text>'
                           f'<rect class="bar{" best" if e is best else ""}" x="{left}" '
                           f'y="{y}" width="{w:.1f}" height="{bar}" fill="{color}">'
                           f'<title>{h.escape(e.system)}: {fmt(v)}</title></rect>'
                           f'<text x="{left + w + 6:.1f}" y="{y + bar * 0.7:.1f}" '
                           f'class="value">{fmt(v)}</text>')
        svg.append("</svg>")
        note = (f'<p class="missing">No figure for {h.escape(", ".join(missing))}.</p>'
                if missing else "")
        charts.append(f"<h2>{h.escape(name)}{'' if higher else ' (lower is better)'}</h2>"
                      f"{''.join(svg)}{note}")
    refused = "".join(f"<li>{h.escape(e.system)}: {h.escape(e.message)}</li>"
                      for e in entries if e.report is None)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>shardscope compare: {h.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}
pre{{font-size:12px;background:#f6f6f6;padding:1em;overflow-x:auto}}</style></head><body>
<h1>Compare: {h.escape(title)}</h1>
<p>The same model and workload on {len(entries)} systems; {len(ran)} estimated. The best
system of each figure is red; hover a bar for its value.</p>
{''.join(charts)}
{f'<h2>Not run</h2><ul class="refused">{refused}</ul>' if refused else ''}
<h2>Every figure</h2>
<pre class="table">{h.escape(format_compare(entries))}</pre>
</body></html>
"""
