"""What the command line writes: JSON and HTML files (never into a folder that does not
exist), plain tables, and progress on a terminal."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from experiments.config import ConfigError
from sharding import progress


def _jsonable(o):
    if isinstance(o, set | frozenset | tuple):
        return list(o)
    return str(o)


def checked(path: str, flag: str) -> Path:
    """The path a flag writes to; an error naming the flag when its folder is missing or is
    a file, or the path is a folder (call it before a long run, not only when writing)."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{flag} {path!r} is a folder; give a file's path, e.g. "
                          f"{str(out / ('result' + _SUFFIXES.get(flag, '')))!r}")
    if out.parent and not out.parent.exists():
        raise ConfigError(f"{flag} {path!r}: folder {str(out.parent)!r} does not exist; create "
                          f"it or write elsewhere")
    if not out.parent.is_dir():
        raise ConfigError(f"{flag} {path!r}: {str(out.parent)!r} is a file, not a folder; "
                          f"write elsewhere")
    return out


_SUFFIXES = {"--json": ".json", "--features": ".json", "--html": ".html"}


def folder(path: str, flag: str) -> Path:
    """A folder a flag writes into (--profile's trace), made now, before a long run: an
    error naming the flag when it is a file, lies under one, or cannot be made."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {path!r} is a file; {flag} takes a folder (a new or an "
                          f"existing one)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {path!r}: cannot make the folder ({e.strerror}); give a "
                          f"folder you can write, e.g. {flag} trace") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r}: the folder is not writable; give one you can "
                          f"write, e.g. {flag} trace")
    return out


def kept(path: str | None, force: bool, flag: str = "--out") -> None:
    """A file the user has is not overwritten: an error naming `flag` when `path` exists
    and --force was not given (call it before a long run, not only when writing)."""
    if path and Path(path).exists() and not force:
        raise ConfigError(f"{flag} {path!r} exists; choose another name or add --force to "
                          f"overwrite it")


def write_json(path: str, data: dict, flag: str = "--json") -> None:
    checked(path, flag).write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    print(f"\nwrote {path}")


def write_text(path: str, text: str, flag: str = "--html") -> None:
    checked(path, flag).write_text(text)
    print(f"wrote {path}")


def format_columns(header, rows) -> str:
    """A plain table: each column as wide as its widest cell, text left, numbers right."""
    cells = [tuple(map(str, header)), *(tuple(map(str, r)) for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(isinstance(r[i], int | float) for r in rows) for i in range(len(header))]
    numeric = [n or all(str(r[i])[:1].isdigit() for r in rows) and i > 0
               for i, n in enumerate(numeric)]

    def line(r):
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(r, widths, numeric, strict=True)).rstrip()
    return "\n".join([line(cells[0]), *(line(r) for r in cells[1:])])


def _stderr_copy():
    """A copy of the terminal's stderr: compiles capture the process's fd 2 to keep libtpu's
    and XLA's noise away, so progress is written to a duplicate of it."""
    return os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)


@contextlib.contextmanager
def progress_sink(args):
    """Inside this block, stage lines with the elapsed time on stderr when it is a terminal
    and --quiet is not given, and notices (a compile that will take minutes) on stderr
    unless --quiet (sharding/progress.py)."""
    if args.quiet:
        with progress.reporting(None):
            yield
        return
    tty = sys.stderr.isatty()
    try:
        out = _stderr_copy()
    except (OSError, ValueError, AttributeError):  # a stderr with no descriptor (a test's)
        out = None
    t0 = time.perf_counter()

    def sink(message: str, notice: bool = False) -> None:
        to = out or sys.stderr
        if notice:
            to.write(f"shardscope: {message}\n")
        elif tty:
            to.write(f"[{time.perf_counter() - t0:6.1f} s] {message}\n")

    try:
        with progress.reporting(sink):
            yield
    finally:
        if out is not None:
            out.close()


class SearchProgress:
    """A progress bar on stderr when it is a terminal (rich): done of total, running,
    failed, elapsed and ETA; nothing otherwise or with --quiet."""

    def __init__(self, args):
        self.bar = None
        if args.quiet or not sys.stderr.isatty():
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("search"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[state]}"), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(),
                            console=Console(stderr=True), transient=True)
        self.task = None

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, r, p) -> None:
        if self.bar is None:
            return
        if self.task is None:
            self.task = self.bar.add_task("search", total=p["total"], state="")
        self.bar.update(self.task, completed=p["done"],
                        state=f"{p['running']} running, {p['failed']} failed")
