"""Where in the user's code an HLO instruction came from: the file and line of its metadata.

JAX prints the locations once, in tables before the first computation (`FileNames`,
`FileLocations`, `StackFrames`), and each instruction names its innermost frame
(`metadata={op_name="..." stack_frame_id=4}`); older dumps carry `source_file="..."
source_line=N` in the metadata itself. Read only when a message names the line (an
assertion over collectives that fails): the parser (sharding/hlo.py) skips the tables.

The innermost frame of an op a library makes (a Flax layer's matmul) is the library's line
(flax/nnx/nn/linear.py:422); the user's own line is further out on the frame's stack, which
`user_stack_frames` walks to.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from sharding.hlo import HloModule, Instruction

_ENTRY = re.compile(r"^(\d+) (.*)$")
_LOCATION = re.compile(r"file_name_id=(\d+)\b.*?\bline=(\d+)")
_FRAME = re.compile(r"file_location_id=(\d+)")
_PARENT = re.compile(r"parent_frame_id=(\d+)")
# Packages whose lines are not the user's wherever they are installed (a source checkout
# too); anything under site-packages / dist-packages is a library's as well.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax", "equinox", "haiku", "numpy")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="((?:[^"\\]|\\.)*)"\s+source_line=(\d+)')


def _tables(hlo_text: str) -> tuple[dict[int, str], dict[int, int]]:
    """(stack frame id -> "file:line" of the frame's own location, stack frame id -> its
    caller's frame id). As XLA prints the table, a frame's `parent_frame_id=P` names
    frame P - 1, and 1 none (checked on a compile in tests/sharding/test_testing.py)."""
    tables: dict[str, dict[int, str]] = {}
    section: dict[int, str] | None = None
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{"):  # the first computation: the tables are above it
            break
        if line.strip() in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(line.strip(), {})
        elif section is not None and (m := _ENTRY.match(line)):
            section[int(m.group(1))] = m.group(2)
    files = {i: text.strip('"') for i, text in tables.get("FileNames", {}).items()}
    locations = {}
    for i, text in tables.get("FileLocations", {}).items():
        if m := _LOCATION.search(text):
            locations[i] = f"{files.get(int(m.group(1)), '?')}:{m.group(2)}"
    frames, parents = {}, {}
    for i, text in tables.get("StackFrames", {}).items():
        if (m := _FRAME.search(text)) and int(m.group(1)) in locations:
            frames[i] = locations[int(m.group(1))]
        if (m := _PARENT.search(text)) and int(m.group(1)) > 1:
            parents[i] = int(m.group(1)) - 1
    return frames, parents


def stack_frames(hlo_text: str) -> dict[int, str]:
    """Stack frame id -> "file:line" of the frame's own location (the innermost call)."""
    return _tables(hlo_text)[0]


def user_stack_frames(hlo_text: str) -> dict[int, str]:
    """Stack frame id -> "file:line" of the innermost call in the user's code (not in a
    library: LIBRARIES, site-packages), with the library's line it went through
    ("model.py:26 (through flax/nnx/nn/linear.py:422)"); where the stack holds no line of
    the user's, the library's line, said to be one."""
    frames, parents = _tables(hlo_text)
    out = {}
    for i, innermost in frames.items():
        j, seen = i, set()
        while j in frames and library_of(_file(frames[j])) and j not in seen:
            seen.add(j)
            j = parents.get(j, 0)
        if j == i:
            out[i] = innermost
        elif j in frames and j not in seen:
            out[i] = f"{frames[j]} (through {short_library_path(innermost)})"
        else:
            out[i] = library_line(innermost)
    return out


def library_of(path: str) -> str:
    """The library a source file belongs to ("flax"), or "" for the user's own."""
    parts = PurePath(path).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            i = parts.index(marker)
            return parts[i + 1] if i + 1 < len(parts) - 1 else PurePath(parts[-1]).stem
    return next((p for p in parts[:-1] if p in LIBRARIES), "")


def short_library_path(where: str) -> str:
    """A library's "file:line" from its package on: "flax/nnx/nn/linear.py:422"."""
    parts = PurePath(_file(where)).parts
    lib = library_of(_file(where))
    if lib in parts[:-1]:
        return str(PurePath(*parts[parts.index(lib):])) + where[len(_file(where)):]
    return where


def library_line(where: str) -> str:
    """A location, said to be a library's when it is (no line of the user's to give)."""
    lib = library_of(_file(where))
    if not lib:
        return where
    return (f"{short_library_path(where)} ({lib}'s code, not yours: the op name's path "
            f"says which of your calls made it)")


def _file(where: str) -> str:
    return where.rsplit(":", 1)[0]


def source_of(inst: Instruction, frames: dict[int, str]) -> str:
    """"file:line" of an instruction, or "" when its metadata names none."""
    meta = inst.attr("metadata") or ""
    if m := _FRAME_ID.search(meta):
        return frames.get(int(m.group(1)), "")
    if m := _SOURCE.search(meta):  # one location, no stack: say whose it is
        return library_line(f"{m.group(1)}:{m.group(2)}")
    return ""


def instruction_source(module: HloModule, frames: dict[int, str], computation: str,
                       name: str) -> str:
    """"file:line" of instruction `name` in `computation`, else of the instruction that
    calls that computation (a collective the compiler moved into a fusion often loses its
    metadata; the fusion keeps it), else ""."""
    comp = module.computations.get(computation)
    inst = comp.by_name.get(name) if comp is not None else None
    if inst is not None and (where := source_of(inst, frames)):
        return where
    for _, caller, _ in module.call_sites.get(computation, []):
        if where := source_of(caller, frames):
            return where
    return ""
