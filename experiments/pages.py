"""The HTML pages of `search --html` / `results --html` (the Pareto scatter and the ranking)
and of `compare --html` (a bar chart per figure and the table), in the page shell and with
the bar chart of sharding/html.py."""

from __future__ import annotations

import html as h
import math
from collections.abc import Sequence

from experiments.compare import Entry, format_compare
from experiments.ranking import pareto, ranking, why_not
from experiments.store import Result
from sharding.html import bar_chart, page
from sharding.units import fmt_bytes, fmt_duration, fmt_s, fmt_watts


def _scatter(results: Sequence[Result], title: str) -> str:
    """Step time against memory per device, both log: every config that ran, the Pareto
    front joined and labelled, those that do not fit hollow."""
    ok = [r for r in results if r.status == "ok" and r.step_time_s and
          r.memory_per_device_bytes]
    front = pareto(results)
    width, height, left, right, top, bottom = 760, 420, 80, 30, 30, 50
    svg = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" '
           f'font-family="sans-serif" font-size="11" class="pareto">',
           f'<rect x="{left}" y="{top}" width="{width - left - right}" '
           f'height="{height - top - bottom}" fill="none" stroke="#ccc"/>']
    if ok:
        xs = [r.memory_per_device_bytes for r in ok]
        ys = [r.step_time_s for r in ok]
        x_lo, x_hi = min(xs) / 1.2, max(xs) * 1.2
        y_lo, y_hi = min(ys) / 1.2, max(ys) * 1.2

        def px(x):
            return left + (width - left - right) * math.log(x / x_lo) / math.log(x_hi / x_lo)

        def py(y):
            return height - bottom - (height - top - bottom) * math.log(y / y_lo) / \
                math.log(y_hi / y_lo)

        for frac in (0.0, 0.25, 0.5, 0.75, 1.0):  # ticks, log-spaced
            xv = x_lo * (x_hi / x_lo) ** frac
            yv = y_lo * (y_hi / y_lo) ** frac
            svg.append(f'<text x="{px(xv):.1f}" y="{height - bottom + 16}" '
                       f'text-anchor="middle" class="xtick">{fmt_bytes(xv)}</text>'
                       f'<text x="{left - 6}" y="{py(yv) + 4:.1f}" text-anchor="end" '
                       f'class="ytick">{fmt_s(yv)}</text>')
        svg.append(f'<text x="{width / 2:.0f}" y="{height - 10}" text-anchor="middle">memory '
                   f'per device (log)</text><text x="{left}" y="{top - 10}">step time (log); '
                   f'the Pareto front joined</text>')
        pts = " ".join(f"{px(r.memory_per_device_bytes):.1f},{py(r.step_time_s):.1f}"
                       for r in sorted(front, key=lambda r: r.memory_per_device_bytes))
        svg.append(f'<polyline class="front" fill="none" stroke="#e45756" '
                   f'stroke-width="1.5" points="{pts}"/>')
        for r in ok:
            fill = "#4c78a8" if r.fits is not False else "none"
            svg.append(f'<circle class="config{" on-front" if r in front else ""}" '
                       f'cx="{px(r.memory_per_device_bytes):.1f}" cy="{py(r.step_time_s):.1f}" '
                       f'r="5" fill="{fill}" stroke="#4c78a8"><title>{h.escape(r.name)}: '
                       f'{fmt_s(r.step_time_s)}, {fmt_bytes(r.memory_per_device_bytes)}'
                       f'{"" if r.fits is not False else " (does not fit)"}</title></circle>')
            if r in front:  # the front's configs by their sharding
                short = r.name.removeprefix(f"{title}-")
                svg.append(f'<text x="{px(r.memory_per_device_bytes) + 7:.1f}" '
                           f'y="{py(r.step_time_s) - 7:.1f}" class="label">'
                           f'{h.escape(short)}</text>')
    svg.append("</svg>")
    return "".join(svg)


def search_page(results: Sequence[Result], title: str = "search") -> str:
    """The Pareto scatter of step time against memory per device and the ranking."""
    ok = [r for r in results if r.status == "ok" and r.step_time_s]
    ranked = ranking(results)
    best = ranked[0] if ranked else None
    rows = "".join(
        f"<tr><td>{i}</td><td>{h.escape(r.name)}</td><td>{fmt_s(r.step_time_s)}</td>"
        f"<td>{(r.tokens_per_s_per_device or 0):,.0f}</td><td>{(r.mfu or 0):.1%}</td>"
        f"<td>{fmt_bytes(r.memory_per_device_bytes)}</td>"
        f"<td>{h.escape(r.bottleneck)}</td></tr>" for i, r in enumerate(ranked, 1))
    lost = "".join(f"<tr><td>{h.escape(r.name)}</td><td>{h.escape(why_not(r, best))}</td></tr>"
                   for r in results if r not in ranked)
    return page(f"search {title}", f"""<h1>Search: {h.escape(title)}</h1>
<p>{len(results)} configs; {len(ok)} estimated, {len(ranked)} fit. Hover a point for its
config.</p>
{_scatter(results, title)}
<h2>Ranking (those that fit, fastest first)</h2>
<table class="ranking"><tr><th>rank</th><th>config</th><th>step</th><th>tokens/s per device</th>
<th>MFU</th><th>memory/device</th><th>bottleneck</th></tr>{rows}</table>
<h2>The others</h2><table class="others"><tr><th>config</th><th>why</th></tr>{lost}</table>""",
                width=1100)


# The bar charts of the compare page: (title, class, value of an entry, how to print it,
# higher is better).
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


def compare_page(entries: Sequence[Entry], title: str = "compare") -> str:
    """A bar chart per figure (each system that ran, the best one marked; a figure a
    system has no number for is left out of its chart and said) and the full table of
    `format_compare`."""
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
        missing = [e.label for e, v in vals if v is None or v <= 0]
        best = None
        fitting = [(e, v) for e, v in known if e.report.fits]
        if fitting:  # a system whose step does not fit is drawn, grey, and never the best
            pick = max if higher else min
            best = known.index(pick(fitting, key=lambda ev: ev[1]))
        chart = bar_chart([(e.label if e.report.fits else f"{e.label} (no fit)", v,
                            "#4c78a8" if e.report.fits else "#b0b0b0") for e, v in known],
                          fmt, cls=cls, best=best, width=720, left=190)
        note = (f'<p class="missing">No figure for {h.escape(", ".join(missing))}.</p>'
                if missing else "")
        charts.append(f"<h2>{h.escape(name)}{'' if higher else ' (lower is better)'}</h2>"
                      f"{chart}{note}")
    refused = "".join(f"<li>{h.escape(e.label)}: {h.escape(e.message)}</li>"
                      for e in entries if e.report is None)
    return page(f"compare {title}", f"""<h1>Compare: {h.escape(title)}</h1>
<p>The same model and workload on {len(entries)} systems; {len(ran)} estimated. The best
system of each figure is red (of those where the step fits; grey: it does not); hover a bar
for its value.</p>
{''.join(charts)}
{f'<h2>Not run</h2><ul class="refused">{refused}</ul>' if refused else ''}
<h2>Every figure</h2>
<pre class="table">{h.escape(format_compare(entries))}</pre>""", width=1100)
