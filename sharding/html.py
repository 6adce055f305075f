"""A single-file HTML report with plots drawn as inline SVG (no scripts, no network):

- where the step goes: compute (matmul, memory-bound) and exposed communication, with each
  link's total collective time beside it;
- bytes per step on each link class;
- a roofline of the step's operations: arithmetic intensity against attained FLOP/s, under
  the chip's peak and HBM bandwidth.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from sharding.report import Report, fmt_bytes, fmt_s

_COLORS = {"matmul": "#4c78a8", "memory-bound": "#72b7b2", "exposed communication": "#e45756",
           "nvlink": "#f58518", "infiniband": "#e45756", "ici": "#54a24b", "dcn": "#b279a2"}
_W = 760


def _bar_rows(rows: list[tuple[str, float, str]], fmt, width: int = _W) -> str:
    """Horizontal bars, one per (label, value, color)."""
    top = max((v for _, v, _ in rows), default=0) or 1.0
    h = 26
    parts = [f'<svg width="{width}" height="{h * len(rows) + 10}" '
             f'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="12">']
    for i, (label, v, color) in enumerate(rows):
        w = (width - 330) * v / top
        y = i * h + 4
        parts.append(f'<text x="0" y="{y + 15}">{html.escape(label)}</text>'
                     f'<rect x="220" y="{y}" width="{w:.1f}" height="{h - 8}" fill="{color}"/>'
                     f'<text x="{226 + w:.1f}" y="{y + 15}">{html.escape(fmt(v))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def step_plot(r: Report) -> str:
    rows = [("matmul", r.compute.matmul_s, _COLORS["matmul"]),
            ("memory-bound ops", r.compute.memory_bound_s, _COLORS["memory-bound"]),
            ("exposed communication", r.exposed_comm_s, _COLORS["exposed communication"])]
    rows += [(f"{link} collectives (overlapped or not)", d["time_s"], _COLORS.get(link, "#999"))
             for link, d in r.by_link().items()]
    return _bar_rows(rows, fmt_s)


def link_bytes_plot(r: Report) -> str:
    rows = [(link, d["bytes"], _COLORS.get(link, "#999")) for link, d in r.by_link().items()]
    return _bar_rows(rows, fmt_bytes) if rows else "<p>(no collectives)</p>"


def roofline_plot(r: Report, peak_flops: float, hbm_bw: float, width: int = _W,
                  height: int = 360) -> str:
    """Log-log roofline: x = FLOP/byte, y = attained FLOP/s per device."""
    pts = [(k, d) for k, d in r.compute.ops.items() if d["bytes"] > 0 and d["time_s"] > 0
           and d["flops"] > 0]
    x_lo, x_hi, y_lo, y_hi = 0.01, 1e4, peak_flops / 1e5, peak_flops * 2
    pad = 50

    def px(x):
        return pad + (width - 2 * pad) * (math.log10(x) - math.log10(x_lo)) / \
            (math.log10(x_hi) - math.log10(x_lo))

    def py(y):
        return height - pad - (height - 2 * pad) * (math.log10(y) - math.log10(y_lo)) / \
            (math.log10(y_hi) - math.log10(y_lo))

    ridge = peak_flops / hbm_bw
    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect x="{pad}" y="{pad}" width="{width - 2 * pad}" height="{height - 2 * pad}" '
             f'fill="none" stroke="#ccc"/>',
             f'<polyline fill="none" stroke="#333" stroke-width="2" points="'
             f'{px(x_lo):.1f},{py(max(y_lo, x_lo * hbm_bw)):.1f} {px(ridge):.1f},'
             f'{py(peak_flops):.1f} {px(x_hi):.1f},{py(peak_flops):.1f}"/>',
             f'<text x="{px(ridge) + 4:.1f}" y="{py(peak_flops) - 6:.1f}">peak '
             f'{peak_flops / 1e12:.0f} TFLOP/s; HBM {hbm_bw / 1e12:.2f} TB/s</text>']
    for d in range(-2, 5):
        parts.append(f'<text x="{px(10.0**d) - 8:.1f}" y="{height - pad + 16}">1e{d}</text>')
    parts.append(f'<text x="{width / 2 - 60}" y="{height - 8}">FLOP per HBM byte</text>')
    parts.append(f'<text x="4" y="{pad - 10}">attained FLOP/s per device (log)</text>')
    for (name, kind), d in sorted(pts, key=lambda p: -p[1]["time_s"])[:40]:
        x = min(max(d["flops"] / d["bytes"], x_lo), x_hi)
        y = min(max(d["flops"] / d["time_s"], y_lo), y_hi)
        color = _COLORS["matmul"] if kind == "matmul" else _COLORS["memory-bound"]
        radius = 3 + 9 * math.sqrt(d["time_s"] / max(r.compute_s, 1e-12))
        parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{radius:.1f}" '
                     f'fill="{color}" fill-opacity="0.6"><title>{html.escape(name)} ({kind}): '
                     f'{fmt_s(d["time_s"])}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(r: Report, *, peak_flops: float, hbm_bw: float) -> str:
    rows = "".join(
        f"<tr><td>{g['kind']}</td><td>{','.join(g['mesh_axes']) or '-'}</td><td>{g['link']}</td>"
        f"<td>{html.escape(g['algorithm'])}</td><td>{fmt_bytes(g['bytes'])}</td>"
        f"<td>{g['count']}</td><td>{fmt_s(g['time_s'])}</td>"
        f"<td>{html.escape(', '.join(sorted(g['ops']))[:200])}</td></tr>"
        for g in r.rows()
    )
    summary = html.escape(r.format_table().split("\n\n")[-1])
    title = html.escape(r.name or "report")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>shardscope: {title}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1000px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}pre{{background:#f6f6f6;padding:1em;
white-space:pre-wrap}}h2{{margin-top:1.6em}}</style></head><body>
<h1>{title} on {html.escape(r.system)}</h1>
<p>{r.num_devices} devices; HLO from {html.escape(r.compiler)}. Step
{fmt_s(r.step_time_s)} (between {fmt_s(r.step_time_bounds_s[0])} with perfect overlap and
{fmt_s(r.step_time_bounds_s[1])} with none). Bottleneck: {html.escape(r.bottleneck())}.</p>
<h2>Where the step goes</h2>{step_plot(r)}
<h2>Bytes per step on each link</h2>{link_bytes_plot(r)}
<h2>Roofline of the step's operations</h2>
<p>Each circle is a model operation (area ~ its time): blue matmuls, teal memory-bound kernels.</p>
{roofline_plot(r, peak_flops, hbm_bw)}
<h2>Collectives</h2>
<table><tr><th>kind</th><th>mesh axes</th><th>link</th><th>algorithm</th><th>bytes/step</th>
<th>count</th><th>time/step</th><th>operations</th></tr>{rows}</table>
<h2>Summary</h2><pre>{summary}</pre>
</body></html>
"""


def write_html(r: Report, path: str, *, peak_flops: float, hbm_bw: float) -> None:
    out = Path(path)
    if not out.parent.exists():
        raise ValueError(f"--html {path!r}: folder {str(out.parent)!r} does not exist; create "
                         f"it or write elsewhere")
    out.write_text(render_html(r, peak_flops=peak_flops, hbm_bw=hbm_bw))
