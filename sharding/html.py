"""A single-file HTML report: the summary, collectives by group, and a stacked bar of the
step (compute vs communication per link), drawn in inline SVG (no scripts, no network)."""

from __future__ import annotations

import html
from pathlib import Path

from sharding.report import Report, _fmt_bytes, _fmt_s

_COLORS = {"matmul": "#4c78a8", "memory-bound": "#72b7b2", "nvlink": "#f58518",
           "infiniband": "#e45756", "ici": "#54a24b", "dcn": "#b279a2"}


def _step_bar(r: Report, width: int = 760) -> str:
    parts = [("matmul", r.compute.matmul_s), ("memory-bound", r.compute.memory_bound_s)]
    parts += [(link, d["time_s"]) for link, d in r.by_link().items()]
    total = sum(t for _, t in parts) or 1.0
    x, rects, legend = 0.0, [], []
    for i, (label, t) in enumerate(parts):
        w = width * t / total
        color = _COLORS.get(label, "#999")
        rects.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="36" fill="{color}">'
                     f"<title>{html.escape(label)}: {_fmt_s(t)}</title></rect>")
        legend.append(f'<rect x="{i * 150}" y="48" width="12" height="12" fill="{color}"/>'
                      f'<text x="{i * 150 + 16}" y="59" font-size="12">'
                      f"{html.escape(label)} {_fmt_s(t)}</text>")
        x += w
    return (f'<svg width="{width}" height="70" xmlns="http://www.w3.org/2000/svg">'
            + "".join(rects) + "".join(legend) + "</svg>")


def render_html(r: Report) -> str:
    rows = "".join(
        f"<tr><td>{g['kind']}</td><td>{','.join(g['mesh_axes']) or '-'}</td><td>{g['link']}</td>"
        f"<td>{html.escape(g['algorithm'])}</td><td>{_fmt_bytes(g['bytes'])}</td>"
        f"<td>{g['count']}</td><td>{_fmt_s(g['time_s'])}</td>"
        f"<td>{html.escape(', '.join(sorted(g['ops']))[:200])}</td></tr>"
        for g in r.groups()
    )
    summary = html.escape(r.format_table().split("\n\n")[-1])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>shardscope: {html.escape(r.name or r.system)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}pre{{background:#f6f6f6;padding:1em}}
</style></head><body>
<h1>{html.escape(r.name or "report")} on {html.escape(r.system)}</h1>
<p>{r.num_devices} devices; HLO from {html.escape(r.compiler)}.</p>
<h2>Where the step goes (no overlap assumed)</h2>{_step_bar(r)}
<h2>Collectives</h2>
<table><tr><th>kind</th><th>mesh axes</th><th>link</th><th>algorithm</th><th>bytes/step</th>
<th>count</th><th>time/step</th><th>operations</th></tr>{rows}</table>
<h2>Summary</h2><pre>{summary}</pre>
</body></html>
"""


def write_html(r: Report, path: str) -> None:
    out = Path(path)
    if not out.parent.exists():
        raise ValueError(f"--html {path!r}: folder {str(out.parent)!r} does not exist")
    out.write_text(render_html(r))
