"""Stage-by-stage progress of a long compile, for a terminal: the CLI installs a sink
(`reporting`), library code names its stages (`stage`); without a sink nothing is printed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

# A sink takes (message, notice=False): a stage line, or a notice when `notice`.
_SINK: contextvars.ContextVar[Callable[..., None] | None] = contextvars.ContextVar(
    "shardscope_progress", default=None)


@contextlib.contextmanager
def reporting(sink: Callable[..., None] | None):
    """Send the stages named inside this block to `sink` (None: keep quiet)."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def stage(message: str) -> None:
    """The stage about to start, e.g. "compiling with XLA:CPU for 72 devices"."""
    sink = _SINK.get()
    if sink is not None:
        sink(message)


def notice(message: str) -> None:
    """Something the user should read before a long wait, e.g. that a compile will take
    minutes and what is quicker; shown even where stage lines are not (not a terminal)."""
    sink = _SINK.get()
    if sink is not None:
        sink(message, notice=True)
