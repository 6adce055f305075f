"""A single-file HTML report with plots drawn as inline SVG (no scripts, no network):

- where the step goes: compute (matmul, memory-bound) and exposed communication, with each
  link's total collective time beside it;
- bytes per step on each link class;
- a roofline of the step's operations: arithmetic intensity against attained FLOP/s, under
  the matmul rate and HBM bandwidth the step model times with (achieved, with the nominal
  figures beside them), and the operations behind it in a table.

`page` is the shell and `bar_chart` the bar chart every HTML page of shardscope uses (the
search and compare pages in experiments/pages.py too).
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence

from meshes.chips import Chip
from sharding.report import Report
from sharding.units import counted, fmt_bytes, fmt_s

_COLORS = {"matmul": "#4c78a8", "memory-bound": "#72b7b2", "exposed communication": "#e45756",
           "nvlink": "#f58518", "infiniband": "#e45756", "ici": "#54a24b", "dcn": "#b279a2",
           "neuronlink": "#54a24b", "efa": "#b279a2"}
_W = 760


def page(title: str, body: str, *, width: int = 1000, style: str = "") -> str:
    """A whole HTML page: the one shell every page of shardscope shares (no scripts, no
    network)."""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>shardscope: {html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:{width}px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}
pre{{background:#f6f6f6;padding:1em;font-size:12px;white-space:pre-wrap;overflow-x:auto}}
h2{{margin-top:1.6em}}.nofit{{color:#b00}}{style}</style></head><body>
{body}
</body></html>
"""


def bar_chart(rows: Sequence[tuple[str, float, str]], fmt, *, cls: str = "",
              best: int | None = None, width: int = _W, left: int = 220) -> str:
    """Horizontal bars, one per (label, value, colour), labels left of them and values at
    their ends; `best`: the row to mark (class "best", red); each bar's tooltip is its
    label and value. `left` grows to the longest label (about 7 px a character at 12 px
    sans-serif), and the chart with it."""
    longest = max((len(label) for label, _, _ in rows), default=0)
    left = max(left, 16 + math.ceil(7 * longest))
    width = max(width, left + 300)
    top = max((v for _, v, _ in rows), default=0) or 1.0
    h, gap = 22, 8
    parts = [f'<svg class="bars{" " + cls if cls else ""}" width="{width}" '
             f'height="{10 + len(rows) * (h + gap)}" xmlns="http://www.w3.org/2000/svg" '
             f'font-family="sans-serif" font-size="12">']
    for i, (label, v, color) in enumerate(rows):
        w = (width - left - 110) * v / top
        y = 4 + i * (h + gap)
        mark = i == best
        text = html.escape(fmt(v))
        parts.append(f'<text x="{left - 8}" y="{y + h * 0.7:.1f}" text-anchor="end" '
                     f'class="label">{html.escape(label)}</text>'
                     f'<rect class="bar{" best" if mark else ""}" x="{left}" y="{y}" '
                     f'width="{w:.1f}" height="{h}" fill="{"#e45756" if mark else color}">'
                     f'<title>{html.escape(label)}: {text}</title></rect>'
                     f'<text x="{left + w + 6:.1f}" y="{y + h * 0.7:.1f}" class="value">'
                     f'{text}</text>')
    parts.append("</svg>")
    return "".join(parts)


def step_plot(r: Report) -> str:
    rows = [("matmul", r.compute.matmul_s, _COLORS["matmul"]),
            ("memory-bound ops", r.compute.memory_bound_s, _COLORS["memory-bound"]),
            ("exposed communication", r.exposed_comm_s, _COLORS["exposed communication"])]
    rows += [(f"{link} collectives (overlapped or not)", d["time_s"], _COLORS.get(link, "#999"))
             for link, d in r.by_link().items()]
    return bar_chart(rows, fmt_s, cls="step")


def link_bytes_plot(r: Report) -> str:
    rows = [(link, d["bytes"], _COLORS.get(link, "#999")) for link, d in r.by_link().items()]
    return bar_chart(rows, fmt_bytes, cls="links") if rows else "<p>(no collectives)</p>"


@dataclasses.dataclass(frozen=True)
class Roofs:
    """The roofline's two roofs, as the step model uses them (achieved) and as the
    catalog lists them (nominal)."""

    flops: float  # the best matmul rate: peak x efficiency x calibration, largest sizes
    hbm: float  # achieved HBM bandwidth: nominal x efficiency
    peak_flops: float
    peak_hbm: float
    dtype: str

    @classmethod
    def of(cls, r: Report, chip: Chip, dtype: str) -> Roofs:
        return cls(flops=r.calibration.best_matmul_rate(chip, dtype),
                   hbm=chip.hbm_bytes_per_s * chip.hbm_efficiency,
                   peak_flops=chip.peak_for(dtype), peak_hbm=chip.hbm_bytes_per_s,
                   dtype=dtype)

    def labels(self) -> tuple[str, str]:
        return (f"roofs as the model times them: {self.dtype} matmuls at "
                f"{self.flops / 1e12:.0f} TFLOP/s ({self.flops / self.peak_flops:.0%} of the "
                f"{self.peak_flops / 1e12:.0f} peak),",
                f"HBM at {self.hbm / 1e12:.2f} TB/s ({self.hbm / self.peak_hbm:.0%} of the "
                f"{self.peak_hbm / 1e12:.2f} nominal); y: attained FLOP/s per device")


def roofline_points(r: Report) -> list[dict]:
    """One point per model operation: its matmuls and memory-bound kernels together (a
    fused matmul's operand traffic is its fusion's), FLOPs over HBM bytes against FLOPs over
    time. Operations with no HBM traffic (all operands on chip) have no finite intensity
    and are left out; so are those that take no time."""
    ops: dict[str, dict[str, float]] = {}
    for (name, kind), d in r.compute.ops.items():
        o = ops.setdefault(name, {"flops": 0.0, "bytes": 0.0, "time_s": 0.0, "matmul_s": 0.0})
        o["flops"] += d["flops"]
        o["bytes"] += d["bytes"]
        o["time_s"] += d["time_s"]
        if kind == "matmul":
            o["matmul_s"] += d["time_s"]
    return [{"operation": name, **o, "intensity": o["flops"] / o["bytes"],
             "flops_per_s": o["flops"] / o["time_s"],
             "kind": "matmul" if o["matmul_s"] >= o["time_s"] / 2 else "memory-bound"}
            for name, o in ops.items() if o["bytes"] > 0 and o["time_s"] > 0 and o["flops"] > 0]


def _si(v: float) -> str:
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if v >= div:
            return f"{v / div:g}{unit}"
    return f"{v:g}"


def roofline_plot(r: Report, roofs: Roofs, width: int = _W, height: int = 380) -> str:
    """Log-log roofline: x = FLOP per HBM byte, y = attained FLOP/s per device, with ticks
    on both axes and the roofs the model times with."""
    pts = sorted(roofline_points(r), key=lambda p: -p["time_s"])[:40]
    peak = roofs.flops
    x_lo, x_hi = 0.01, 1e4
    y_hi = 10 ** math.ceil(math.log10(peak * 1.5))
    y_lo = y_hi / 1e6
    left, right, top, bottom = 70, 20, 52, 50

    def px(x):
        return left + (width - left - right) * (math.log10(x) - math.log10(x_lo)) / \
            (math.log10(x_hi) - math.log10(x_lo))

    def py(y):
        return height - bottom - (height - top - bottom) * (
            math.log10(y) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo))

    ridge = peak / roofs.hbm
    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" '
             f'font-family="sans-serif" font-size="11" class="roofline">',
             f'<rect x="{left}" y="{top}" width="{width - left - right}" '
             f'height="{height - top - bottom}" fill="none" stroke="#ccc"/>']
    for d in range(-2, 5):  # x ticks
        x = px(10.0 ** d)
        parts.append(f'<line x1="{x:.1f}" y1="{height - bottom}" x2="{x:.1f}" '
                     f'y2="{height - bottom + 4}" stroke="#333"/>'
                     f'<text x="{x:.1f}" y="{height - bottom + 16}" text-anchor="middle">'
                     f'{10.0 ** d:g}</text>')
    for e in range(round(math.log10(y_lo)), round(math.log10(y_hi)) + 1):  # y ticks
        y = py(10.0 ** e)
        parts.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" '
                     f'stroke="#eee"/><text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" '
                     f'class="ytick">{_si(10.0 ** e)}</text>')
    x0 = max(x_lo, y_lo / roofs.hbm)
    parts.append(f'<polyline fill="none" stroke="#333" stroke-width="2" class="roof" points="'
                 f'{px(x0):.1f},{py(x0 * roofs.hbm):.1f} {px(ridge):.1f},{py(peak):.1f} '
                 f'{px(x_hi):.1f},{py(peak):.1f}"/>')
    parts.append(f'<text x="{width / 2:.0f}" y="{height - 10}" text-anchor="middle">FLOP per '
                 f'HBM byte</text>')
    first, second = roofs.labels()
    parts.append(f'<text x="{left}" y="{top - 30}">{html.escape(first)}</text>'
                 f'<text x="{left}" y="{top - 14}">{html.escape(second)}</text>')
    for p in pts:
        x = min(max(p["intensity"], x_lo), x_hi)
        y = min(max(p["flops_per_s"], y_lo), y_hi)
        color = _COLORS["matmul"] if p["kind"] == "matmul" else _COLORS["memory-bound"]
        radius = 3 + 9 * math.sqrt(p["time_s"] / max(r.compute_s, 1e-12))
        parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{radius:.1f}" '
                     f'fill="{color}" fill-opacity="0.6" class="point {p["kind"]}">'
                     f'<title>{html.escape(p["operation"])}: {fmt_s(p["time_s"])}, '
                     f'{p["flops_per_s"] / 1e12:.1f} TFLOP/s at {p["intensity"]:.1f} '
                     f'FLOP/byte</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


def _op_table(r: Report) -> str:
    pts = sorted(roofline_points(r), key=lambda p: -p["time_s"])[:12]
    rows = "".join(
        f"<tr><td>{html.escape(p['operation'])}</td><td>{p['kind']}</td>"
        f"<td>{fmt_s(p['time_s'])}</td><td>{p['flops_per_s'] / 1e12:.1f}</td>"
        f"<td>{p['intensity']:.1f}</td></tr>" for p in pts)
    return ("<table class=\"ops\"><tr><th>operation</th><th>mostly</th><th>time/step</th>"
            f"<th>TFLOP/s</th><th>FLOP/byte</th></tr>{rows}</table>")


def _extrapolated(r: Report) -> str:
    """How a program compiled on fewer devices is read as this run ("" when it was not)."""
    return f", extrapolated: {html.escape(r.extrapolated_from)}" if r.extrapolated_from else ""


def render_html(r: Report, *, chip: Chip, compute_dtype: str = "bfloat16") -> str:
    """The report's page: where the step goes, bytes per link, the roofline, the
    collectives and the text summary."""
    roofs = Roofs.of(r, chip, compute_dtype)
    rows = "".join(
        f"<tr><td>{g['kind']}</td><td>{','.join(g['mesh_axes']) or '-'}</td><td>{g['link']}</td>"
        f"<td>{html.escape(g['algorithm'])}</td><td>{fmt_bytes(g['bytes'])}</td>"
        f"<td>{g['count']}</td><td>{fmt_s(g['time_s'])}</td>"
        f"<td>{html.escape(', '.join(sorted(g['ops'])))}</td></tr>"
        for g in r.rows()
    )
    summary = html.escape(r.format_table().split("\n\n")[-1])
    title = r.name or "report"
    verdict = "" if r.fits is not False else (f"<p class=\"nofit\"><b>Does not fit</b>: "
                                 f"{html.escape(r.bottleneck())}; times are as if it fit.</p>")
    devices = counted(r.num_devices, "device") + (
        f" ({html.escape(r.placement)})" if r.placement else "")
    model = f"Model {html.escape(r.model)}; " if r.model else ""
    return page(title, f"""<h1>{html.escape(title)} on {html.escape(r.system)}</h1>{verdict}
<p>{model}{devices}; HLO
from {html.escape(r.compiler)}{_extrapolated(r)}. Step
{fmt_s(r.step_time_s)} (between {fmt_s(r.step_time_bounds_s[0])} with perfect overlap and
{fmt_s(r.step_time_bounds_s[1])} with none). Bottleneck: {html.escape(r.bottleneck())}.</p>
<h2>Where the step goes</h2>{step_plot(r)}
<h2>Bytes per step on each link</h2>{link_bytes_plot(r)}
<h2>Roofline of the step's operations</h2>
<p>Each circle is a model operation, its matmuls and memory-bound kernels together (area ~ its
time): blue mostly matmul time, teal mostly memory-bound. Hover for its name; the table
below lists the largest.</p>
{roofline_plot(r, roofs)}
{_op_table(r)}
<h2>Collectives</h2>
<table><tr><th>kind</th><th>mesh axes</th><th>link</th><th>algorithm</th><th>bytes/step</th>
<th>count</th><th>time/step</th><th>operations</th></tr>{rows}</table>
<h2>Summary</h2><pre>{summary}</pre>""")
