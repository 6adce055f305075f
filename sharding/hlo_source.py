"""Where in the user's code an HLO instruction came from: the file and line of its metadata.

JAX prints the locations once, in tables before the first computation (`FileNames`,
`FileLocations`, `StackFrames`), and each instruction names its innermost frame
(`metadata={op_name="..." stack_frame_id=4}`); older dumps carry `source_file="..."
source_line=N` in the metadata itself. Read only when a message names the line (an
assertion over collectives that fails): the parser (sharding/hlo.py) skips the tables.
"""

from __future__ import annotations

import re

from sharding.hlo import HloModule, Instruction

_ENTRY = re.compile(r"^(\d+) (.*)$")
_LOCATION = re.compile(r"file_name_id=(\d+)\b.*?\bline=(\d+)")
_FRAME = re.compile(r"file_location_id=(\d+)")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="((?:[^"\\]|\\.)*)"\s+source_line=(\d+)')


def stack_frames(hlo_text: str) -> dict[int, str]:
    """Stack frame id -> "file:line" of the frame's own location (the innermost call)."""
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
    frames = {}
    for i, text in tables.get("StackFrames", {}).items():
        if (m := _FRAME.search(text)) and int(m.group(1)) in locations:
            frames[i] = locations[int(m.group(1))]
    return frames


def source_of(inst: Instruction, frames: dict[int, str]) -> str:
    """"file:line" of an instruction, or "" when its metadata names none."""
    meta = inst.attr("metadata") or ""
    if m := _FRAME_ID.search(meta):
        return frames.get(int(m.group(1)), "")
    if m := _SOURCE.search(meta):
        return f"{m.group(1)}:{m.group(2)}"
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
