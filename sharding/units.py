"""Figures in the units a reader expects: bytes, seconds, watts, joules, watt-hours,
durations; each in the largest unit it reaches."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_s(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def _in_units(v: float, units, smaller) -> str:
    """`v` in the largest of `units` ((scale, name), largest first) it reaches, 3 digits;
    `smaller(v)` below them all."""
    for scale, unit in units:
        if v >= scale:
            return f"{v / scale:,.3g} {unit}"
    return smaller(v)


def fmt_watts(w: float) -> str:
    return _in_units(w, ((1e9, "GW"), (1e6, "MW"), (1e3, "kW")), lambda v: f"{v:,.0f} W")


def fmt_joules(j: float) -> str:
    return _in_units(j, ((1e12, "TJ"), (1e9, "GJ"), (1e6, "MJ"), (1e3, "kJ")),
                     lambda v: f"{v:,.3g} J")


def fmt_wh(j: float) -> str:
    """Joules as kWh / MWh / GWh, the units a facility is billed in."""
    return _in_units(j / 3600, ((1e9, "GWh"), (1e6, "MWh"), (1e3, "kWh")),
                     lambda v: f"{v:,.3g} Wh")


def fmt_duration(s: float) -> str:
    return _in_units(s, ((365.25 * 86400, "years"), (86400, "days"), (3600, "hours"),
                         (60, "min")), fmt_s)


def counted(n: int, noun: str) -> str:
    """"1 config", "3 configs"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
