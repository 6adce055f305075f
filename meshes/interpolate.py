"""Log-linear interpolation of measured curves (bandwidth or efficiency against size)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


def log_interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """y at `x`, linear in log(x) between measured points, clamped at both ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    t = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])
