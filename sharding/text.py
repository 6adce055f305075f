"""The report as text: the terminal table (`format_report`), the same step under several
labels side by side (`format_side_by_side`), and the scale-out lines of a power budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshes.power import CHIPS_ONLY, POD_SHARE
from sharding.units import (
    counted,
    fmt_bytes,
    fmt_duration,
    fmt_joules,
    fmt_s,
    fmt_watts,
    fmt_wh,
)

if TYPE_CHECKING:  # annotations only: report.py imports this module to print itself
    from sharding.report import Report


def column_table(labels: list[str], rows: list[tuple[str, list[str]]]) -> list[str]:
    """Lines of a table with one right-aligned column per label and a row per figure."""
    w0 = max(len(what) for what, _ in rows) + 2
    widths = [max(len(label), *(len(vals[i]) for _, vals in rows)) + 2
              for i, label in enumerate(labels)]
    lines = [" " * w0 + "".join(f"{label:>{w}}" for label, w in
                                zip(labels, widths, strict=True))]
    lines += [f"{what:<{w0}}" + "".join(f"{v:>{w}}" for v, w in zip(vals, widths, strict=True))
              for what, vals in rows]
    return lines


def format_side_by_side(reports: list[tuple[str, Report]]) -> str:
    """The same step under several labels (backends, systems): one column each, a row per
    figure, then where the largest difference comes from."""
    def row(what, fn):
        return (what, [fn(r) for _, r in reports])

    rows = [
        row("compiler", lambda r: r.compiler.split(" (")[0]),
        row("step time", lambda r: fmt_s(r.step_time_s)),
        row("compute", lambda r: fmt_s(r.compute_s)),
        row("  matmul", lambda r: fmt_s(r.compute.matmul_s)),
        row("  memory-bound", lambda r: fmt_s(r.compute.memory_bound_s)),
        row("communication", lambda r: fmt_s(r.comm_s)),
        row("  exposed", lambda r: fmt_s(r.exposed_comm_s)),
        row("matmul TFLOP/dev", lambda r: f"{r.compute.matmul_flops / 1e12:.1f}"),
        row("HBM traffic/dev", lambda r: fmt_bytes(r.compute.hbm_bytes)),
        row("collective bytes", lambda r: fmt_bytes(sum(r.by_kind().values()))),
        row("MFU", lambda r: "-" if r.mfu is None else f"{r.mfu:.1%}"),
        row("memory/device", lambda r: fmt_bytes(r.memory_per_device_bytes)
            + (" (no fit)" if r.fits is False else "")),
    ]
    lines = column_table([label for label, _ in reports], rows)
    for label, r in reports:
        lines.append(f"bottleneck ({label}): {r.bottleneck()}")
    if len(reports) > 1:
        parts = {"matmul": lambda r: r.compute.matmul_s,
                 "memory-bound kernels": lambda r: r.compute.memory_bound_s,
                 "exposed communication": lambda r: r.exposed_comm_s}
        (la, a), (lb, b) = min(reports, key=lambda x: x[1].step_time_s), \
            max(reports, key=lambda x: x[1].step_time_s)
        what, fn = max(parts.items(), key=lambda kv: abs(kv[1](b) - kv[1](a)))
        if b.step_time_s > 0:
            lines.append(f"difference: the {lb} step is {b.step_time_s / a.step_time_s - 1:.0%} "
                         f"longer than the {la} one; most of it in {what} ({fmt_s(fn(b))} vs "
                         f"{fmt_s(fn(a))})")
    return "\n".join(lines)


def format_report(r: Report) -> str:
    """The terminal report: collectives by row and by model operation, then the step."""
    if not r.timed:
        return "\n".join([*_collective_lines(r), "", "untimed: no system given, so the "
                          "collectives' bytes and counts only (give one to time them)"])
    return "\n".join([*_collective_lines(r), "", *_summary_lines(r)])


def _collective_lines(r: Report) -> list[str]:
    lines = []
    title = f"{r.name}  " if r.name else ""
    placed = f": {r.placement}" if r.placement else ""
    system = r.system or "no system"
    devices = counted(r.num_devices, "device")
    lines.append(f"{title}on {system} ({devices}{placed}), HLO from "
                 f"{r.compiler}")
    if r.fits is False:
        lines.append(f"DOES NOT FIT: needs {fmt_bytes(r.memory_per_device_bytes)} of HBM per "
                     f"device, has {fmt_bytes(r.hbm_capacity_bytes)}; the times below are "
                     f"as if it fit")
    if r.compiler_note:
        lines.append(f"HLO compiler: {r.compiler_note}")
    if r.extrapolated_from:
        lines.append(f"extrapolated: {r.extrapolated_from}")
    if r.model:  # last: the lines above keep their places (the verdict second)
        lines.append(f"model: {r.model}")
    lines.append("")

    def time_cell(t: float) -> str:  # an untimed report has no times, not zero ones
        return fmt_s(t) if r.timed else "untimed"

    rows = r.rows()
    algo_w = max([len("algorithm"), *(len(g["algorithm"]) for g in rows)]) + 2
    axes_w = max([len("mesh axes"), *(len(",".join(g["mesh_axes"])) for g in rows)]) + 2
    link_w = max([len("link"), *(len(g["link"] or "") for g in rows)]) + 2
    lead = 20 + axes_w + link_w + algo_w
    header = (f"{'collective':<20}{'mesh axes':<{axes_w}}{'link':<{link_w}}"
              f"{'algorithm':<{algo_w}}{'bytes/step':>12}{'count':>8}{'time/step':>12}")
    lines.append(header)
    lines.append("-" * len(header))
    for g in rows:
        lines.append(
            f"{g['kind']:<20}{','.join(g['mesh_axes']) or '-':<{axes_w}}{g['link']:<{link_w}}"
            f"{g['algorithm']:<{algo_w}}{fmt_bytes(g['bytes']):>12}{g['count']:>8}"
            f"{time_cell(g['time_s']):>12}"
        )
    if not r.collectives:
        lines.append("(no collectives)")
    lines.append("-" * len(header))
    lines.append(f"{'total':<{lead}}{fmt_bytes(sum(r.by_kind().values())):>12}"
                 f"{sum(c.count for c in r.collectives):>8}{time_cell(r.comm_s):>12}")
    ops = r.by_operation()[:6]
    if ops:
        lines.append("")
        lines.append("slowest collectives by model operation:")
        op_w = max(len(o["operation"]) for o in ops) + 2
        whats = [f"{o['kind']} over {','.join(o['mesh_axes']) or '-'}" for o in ops]
        what_w = max(map(len, whats)) + 2
        for o, what in zip(ops, whats, strict=True):
            lines.append(f"  {o['operation']:<{op_w}}{what:<{what_w}}"
                         f"{fmt_bytes(o['bytes']):>12}{time_cell(o['time_s']):>12}")
    return lines


def _energy_lines(r: Report) -> list[str]:
    e = r.energy
    if e is None:
        return []
    return _energy_and_cost(e, _if_fit(r))


def _if_fit(r: Report) -> str:
    """The mark of a figure of a step that does not fit (as step time and MFU carry it):
    its power, cost and runs are of a step that cannot run."""
    return "  -- if it fit" if r.fits is False else ""


def _energy_and_cost(e, if_fit: str = "") -> list[str]:
    lines = []
    if e.power_w is None:
        lines.append("power          unknown: no public power figure for this chip or system")
    else:
        lines.extend(_power_lines(e, if_fit))
    if e.usd_per_million_tokens is not None:
        power = ""
        if e.usd_per_kwh:  # the energy billed apart is in the figure: say how much
            power = (f"; power billed apart at ${e.usd_per_kwh:g} per kWh, "
                     f"${e.usd_per_kwh * e.power_per_chip_w / 1e3:.3g} per chip-hour")
        lines.append(f"cost           ${e.usd_per_million_tokens:,.4g} per million tokens  "
                     f"(${e.usd_per_chip_hour:g} per chip-hour: {e.price_source}{power})"
                     f"{if_fit}")
    elif e.usd_per_step is not None:  # no tokens per step (an HLO dump): was no line
        lines.append(f"cost           ${e.usd_per_step:,.4g} per step  "
                     f"(${e.usd_per_chip_hour:g} per chip-hour: {e.price_source}; no tokens "
                     f"per step to price a token){if_fit}")
    elif e.usd_per_chip_hour is None:
        lines.append("cost           no public price for this chip: set [cost] "
                     "usd_per_chip_hour")
    elif e.usd_per_kwh and e.power_w is None:  # was no line at all
        lines.append("cost           unknown: [cost] usd_per_kwh bills the power apart, and "
                     "this chip has no public power figure; set it to 0 for the chip-hours "
                     "alone")
    return lines


def _power_lines(e, if_fit: str = "") -> list[str]:
    # said where the IT power is not chips plus the rest of their node: a GB300 rack or a
    # TPU v4 slice counted its chips alone under the same words as a GB200 rack's whole draw
    what, rest = "chips", ("; hosts, NICs and switches not counted (no public rating)"
                           if e.counted == CHIPS_ONLY else "")
    if e.rest_w is not None:
        rest = f", hosts/NICs/switches {fmt_watts(e.rest_w * e.chips)}"
    elif e.counted == POD_SHARE:
        what = "the pod's published draw per chip (chips, hosts, network)"
    lines = [f"power          {fmt_watts(e.power_w)} at the facility  (IT {fmt_watts(e.it_w)}: "
             f"{what} {fmt_watts(e.chip_w * e.chips)}, busy {e.busy:.0%} of the step{rest}; "
             f"PUE {e.pue:g}, {e.pue_label or 'given'}){if_fit}"]
    per_token = "" if e.joules_per_token is None else f", {e.joules_per_token:.3g} J per token"
    lines.append(f"energy         {fmt_joules(e.energy_per_step_j)} per step{per_token}{if_fit}")
    return lines


def format_scale_out(r: Report, plan: dict) -> list[str]:
    """The lines of `Energy.scale_out`: chips within a power budget, and a run of N tokens
    on the run's chips and on those."""
    e, if_fit = r.energy, _if_fit(r)  # marks the figures of the step, not the refusals
    lines = []

    def run_line(run: dict, where: str) -> str:
        usd = "" if run["usd"] is None else f", ${run['usd']:,.0f}"
        energy = "" if run["energy_j"] is None else f", {fmt_wh(run['energy_j'])} at the facility"
        return (f"{run['tokens']:.3g} tokens {where}: {fmt_duration(run['time_s'])}{energy}"
                f"{usd}{if_fit}")

    if plan.get("power_budget_w") is not None and plan.get("chips_within_budget") is None:
        lines.append("power budget   no estimate: no public power figure for this chip or "
                     "system")
    elif plan.get("power_budget_w") is not None:
        unit = plan["replica_chips"]
        unit_w = fmt_watts(e.power_per_chip_w * unit)
        if not plan["chips_within_budget"]:
            lines.append(f"power budget   {fmt_watts(plan['power_budget_w'])} feeds no "
                         f"data-parallel replica of this step: one, {unit:,.4g} chips, draws "
                         f"{unit_w} at the facility")
        else:
            lines.append(f"power budget   {fmt_watts(plan['power_budget_w'])} feeds "
                         f"{plan['chips_within_budget']:,} chips of this system running this "
                         f"step ({plan['chips_within_budget'] / unit:,.0f} data-parallel "
                         f"replicas of {unit:,.4g} chips, {fmt_watts(e.power_per_chip_w)} a "
                         f"chip at the facility){if_fit}")
    if plan.get("run"):
        lines.append("run            " + run_line(plan["run"], f"on these {e.chips:,.0f} chips"))
    if plan.get("run_within_budget"):
        chips = plan["chips_within_budget"]
        how = "more" if chips > e.chips else "fewer" if chips < e.chips else "as many"
        bound = ": a lower bound on time" if how == "more" else ""
        lines.append("               " + run_line(
            plan["run_within_budget"], f"on {chips:,} chips ({how} data-parallel replicas "
            f"at this step's tokens/s per chip{bound})"))
    return lines


def _summary_lines(r: Report) -> list[str]:
    lines = []
    c = r.compute
    lines.append(f"compute        {fmt_s(r.compute_s)}  (matmul {fmt_s(c.matmul_s)}, "
                 f"memory-bound {fmt_s(c.memory_bound_s)}; {c.matmul_flops / 1e12:.1f} TFLOP "
                 f"and {fmt_bytes(c.hbm_bytes)} HBM per device)")
    how = "simulated overlap" if r.scheduled_step_s is not None else "no overlap assumed"
    lines.append(f"communication  {fmt_s(r.comm_s)}  (exposed {fmt_s(r.exposed_comm_s)}; "
                 f"{how})")
    lo, hi = r.step_time_bounds_s
    if r.host_transfer_bytes:
        timed = (f"{fmt_s(r.host_transfer_s)} at {r.host_bytes_per_s / 1e9:.0f} GB/s, "
                 f"overlapped with compute" if r.host_bytes_per_s else
                 "not timed: no host-link bandwidth for this chip in the catalog")
        lines.append(f"host offload   {fmt_bytes(r.host_transfer_bytes)} per device to host "
                     f"memory and back ({timed})")
    if r.pipeline is not None:
        lines.append(f"pipeline       {r.pipeline['description']} (~{fmt_s(r.pipeline_bubble_s)} "
                     f"of compute)")
        if r.pipeline.get("as_run"):
            lines.append(f"               as Megatron runs it: {r.pipeline['as_run']}")
    if_fit = "  -- if it fit" if r.fits is False else ""
    lines.append(f"step time      {fmt_s(r.step_time_s)}  (bounds {fmt_s(lo)} .. {fmt_s(hi)})"
                 f"{if_fit}")
    if r.tokens_per_s is not None:
        per_user = ("" if r.tokens_per_s_per_user is None
                    else f", {r.tokens_per_s_per_user:,.1f} per user")
        if r.time_per_output_token_s is not None:
            per_user += (f"; {fmt_s(r.time_per_output_token_s)} per output token at "
                         f"{r.sequences_per_step:g} sequences")
        lines.append(f"throughput     {r.tokens_per_s:,.0f} tokens/s, "
                     f"{r.tokens_per_s_per_device:,.0f} per device{per_user}")
    if r.mfu is not None:
        what = "model FLOPs" if r.model_flops_per_step else "HLO matmul FLOPs"
        lines.append(f"MFU            {r.mfu:.1%}  ({what}){if_fit}")
        shares = r.matmul_flops_by_format
        if r.mfu_format is not None and set(shares) - {"bfloat16"}:
            formats = ", ".join(f"{d} {s:.0%}"
                                for d, s in sorted(shares.items(), key=lambda x: -x[1]))
            lines.append(f"               {r.mfu_bf16:.1%} of the bf16 peak, {r.mfu_format:.1%} of "
                         f"the peak of each matmul's format (matmul FLOPs: {formats})")
        if (suspect := r.suspect_mfu()) is not None:
            lines.append(f"               {suspect}")
    m = r.memory
    if not m.known:
        lines.append(f"memory/device  unknown ({m.source}; HBM {fmt_bytes(r.hbm_capacity_bytes)}"
                     f" per device): no verdict on fitting")
    else:
        lines.append(f"memory/device  {fmt_bytes(m.total_bytes)} of "
                     f"{fmt_bytes(r.hbm_capacity_bytes)} HBM: "
                     f"{'fits' if r.fits else 'DOES NOT FIT'}  ({m.source})")
    for what, nbytes in m.largest(6):
        lines.append(f"  {fmt_bytes(nbytes):>10}  {what}")
    if m.compiler_bytes is not None:
        lines.append(f"  (compiler's own figure: {fmt_bytes(m.compiler_bytes)}, from "
                     f"{m.compiler_source})")
    for note in m.notes:
        lines.append(f"  {note}")
    for advice in r.fit_advice:
        lines.append(f"  to fit: {advice}")
    lines.extend(_energy_lines(r))
    lines.append(f"bottleneck     {r.bottleneck()}")
    if r.fits is False:
        lines.append(f"               if it fit: {r.time_bottleneck()}")
    lines.append(f"calibration    {r.calibration.source}")
    slow = r.slowest_link()
    if slow:
        lines.append(f"busiest link   {slow} ({fmt_s(r.by_link()[slow]['time_s'])} of "
                     f"collectives)")
    hop = r.slowest_hop()
    if hop:
        lines.append(f"slowest hop    {hop}")
    for w in r.warnings:
        lines.append(f"warning        {w}")
    for u in r.unknown_ops:
        lines.append(f"unrecognised   {u}")
    return lines
