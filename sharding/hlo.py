"""A parser for HLO text: computations, instructions, shapes, call graph, trip counts.

It reads what `jax.jit(...).lower(...).compile().as_text()` and XLA's `--xla_dump_to` print on
every backend (CPU, TPU, GPU): tuple shapes, tiled layouts like `{1,0:T(8,128)(2,1)}`,
`metadata={op_name=...}`, called computations (fusion, call, while, conditional, async).

Only what the explorer needs is parsed eagerly (name, shape, opcode, operands); attributes
are scanned on demand so that a multi-megabyte module parses quickly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from functools import cached_property

import numpy as np

# Bits per element of every HLO primitive type.
ELEMENT_BITS: dict[str, int] = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f4e2m1fn": 4, "f6e2m3fn": 6, "f6e3m2fn": 6, "f8e3m4": 8,
    "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8, "f8e5m2": 8,
    "f8e5m2fnuz": 8, "f8e8m0fnu": 8, "token": 0, "opaque": 0,
}

# HLO element type -> the dtype name the rest of the project uses.
DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
               "s8": "int8", "u8": "uint8", "s4": "int4", "u4": "uint4", "s32": "int32",
               "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "f4e2m1fn": "float4_e2m1fn"}

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s({]+)\s*[({]")


class HloParseError(ValueError):
    """Malformed HLO text; the message names the line."""


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayShape:
    dtype: str  # HLO element type, e.g. "bf16"
    dims: tuple[int, ...]

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        return math.ceil(self.num_elements * ELEMENT_BITS[self.dtype] / 8)


def parse_shape(text: str) -> list[ArrayShape]:
    """All arrays of a (possibly nested tuple) shape, in order; layouts are ignored."""
    out = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype not in ELEMENT_BITS:
            raise HloParseError(f"unknown element type {dtype!r} in shape {text!r}")
        out.append(ArrayShape(dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d)))
    if not out and not text.startswith("(") and not _is_scalar_type(text):
        raise HloParseError(f"cannot read shape {text!r}")
    return out


def _is_scalar_type(text: str) -> bool:
    return text.split("{")[0] in ("token[]", "token", "opaque[]")


def _matching(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index of the bracket closing the one at `start`."""
    depth = 0
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = text.find('"', i + 1)
            i = n if j < 0 else j
        elif c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced {open_ch}{close_ch}")


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside of (), {}, [] and quotes."""
    parts, depth, cur, i = [], 0, 0, 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = text.find('"', i + 1)
            while j != -1 and text[j - 1] == "\\":
                j = text.find('"', j + 1)
            i = n if j == -1 else j
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[cur:i])
            cur = i + 1
        i += 1
    parts.append(text[cur:])
    return [p.strip() for p in parts if p.strip()]


@dataclasses.dataclass(slots=True)
class Instruction:
    name: str
    shape_text: str
    opcode: str
    operands: list[str]
    attr_text: str
    line: int
    is_root: bool = False
    _attrs: dict[str, str] | None = None
    # For a fusion whose own metadata was dropped by the compiler (XLA:GPU's reduction
    # fusions): the op_name of the instructions it fused.
    inherited_op_name: str = ""

    @property
    def shapes(self) -> list[ArrayShape]:
        return parse_shape(self.shape_text)

    @property
    def attrs(self) -> dict[str, str]:
        if self._attrs is None:
            d = {}
            for part in split_top_level(self.attr_text):
                key, eq, value = part.partition("=")
                if eq:
                    d[key.strip()] = value.strip()
            self._attrs = d
        return self._attrs

    def attr(self, key: str) -> str | None:
        if f"{key}=" not in self.attr_text:
            return None
        return self.attrs.get(key)

    @property
    def op_name(self) -> str:
        meta = self.attr("metadata")
        if not meta:
            return self.inherited_op_name
        m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
        return m.group(1) if m else self.inherited_op_name

    def called_computations(self) -> list[tuple[str, str]]:
        """(role, computation name) for every computation this instruction calls."""
        out = []
        for key in ("calls", "to_apply", "body", "condition", "true_computation",
                    "false_computation"):
            v = self.attr(key)
            if v:
                for name in v.strip("{}").split(","):
                    out.append((key, name.strip().lstrip("%")))
        v = self.attr("branch_computations")
        if v:
            for name in v.strip("{}").split(","):
                out.append(("branch", name.strip().lstrip("%")))
        return out


@dataclasses.dataclass
class Computation:
    name: str
    is_entry: bool
    line: int
    instructions: list[Instruction] = dataclasses.field(default_factory=list)

    @cached_property
    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}

    @cached_property
    def users(self) -> dict[str, list[Instruction]]:
        """instruction name -> the instructions that take it as an operand."""
        out: dict[str, list[Instruction]] = {}
        for i in self.instructions:
            if i.opcode == "constant":
                continue
            for o in i.operands:
                out.setdefault(o, []).append(i)
        return out

    @property
    def root(self) -> Instruction | None:
        for i in reversed(self.instructions):
            if i.is_root:
                return i
        return self.instructions[-1] if self.instructions else None


@dataclasses.dataclass
class HloModule:
    name: str
    computations: dict[str, Computation]
    entry: str
    num_partitions: int
    header: str

    @property
    def is_scheduled(self) -> bool:
        """A final, scheduled module (not the post-partitioning one, whose copies and
        layouts later passes still rewrite)."""
        return "is_scheduled=true" in self.header

    # -------------------------------------------------------------------------
    # Execution counts.

    @cached_property
    def call_sites(self) -> dict[str, list[tuple[str, Instruction, str]]]:
        """computation -> [(caller computation, calling instruction, role)]."""
        sites: dict[str, list] = {}
        for comp in self.computations.values():
            for inst in comp.instructions:
                if inst.opcode in ("async-update", "async-done") or inst.opcode.endswith("-done"):
                    continue  # the async-start carries the computation; count it once
                for role, callee in inst.called_computations():
                    sites.setdefault(callee, []).append((comp.name, inst, role))
        return sites

    @cached_property
    def trip_counts(self) -> dict[str, tuple[int, str]]:
        """while instruction name -> (trip count, how it was found)."""
        out = {}
        for comp in self.computations.values():
            for inst in comp.instructions:
                if inst.opcode == "while":
                    out[f"{comp.name}/{inst.name}"] = self._trip_count(comp, inst)
        return out

    @property
    def notes(self) -> list[str]:
        """Assumptions made while counting executions, for the report."""
        out = []
        for key, (n, how) in self.trip_counts.items():
            if how.startswith("unknown"):
                out.append(f"while loop {key}: trip count not found; its body is counted once")
        for callee, sites in self.call_sites.items():
            for caller, inst, role in sites:
                if role in ("branch", "true_computation", "false_computation"):
                    out.append(f"conditional {caller}/{inst.name}: branch {callee} counted as "
                               f"taken on every execution (an upper bound)")
        return out

    @cached_property
    def execution_counts(self) -> dict[str, int]:
        """How many times each computation runs per execution of the entry.

        While bodies multiply by their trip count; every branch of a conditional is counted
        as if taken once per execution (an upper bound; `notes` says so).
        """
        counts: dict[str, int] = {}
        visiting: set[str] = set()

        def count(name: str) -> int:
            if name in counts:
                return counts[name]
            if name == self.entry:
                return 1
            if name in visiting:
                raise HloParseError(f"computation {name!r} calls itself")
            visiting.add(name)
            total = 0
            for caller, inst, role in self.call_sites.get(name, []):
                mult = 1
                if inst.opcode == "while":
                    n, _ = self.trip_counts[f"{caller}/{inst.name}"]
                    mult = n + 1 if role == "condition" else n
                total += count(caller) * mult
            visiting.discard(name)
            counts[name] = total
            return total

        for name in self.computations:
            counts[name] = count(name)
        return counts

    def _trip_count(self, comp: Computation, inst: Instruction) -> tuple[int, str]:
        cfg = inst.attr("backend_config")
        if cfg and "known_trip_count" in cfg:
            try:
                return int(json.loads(cfg)["known_trip_count"]["n"]), "known_trip_count"
            except (ValueError, KeyError, TypeError):
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', cfg)
                if m:
                    return int(m.group(1)), "known_trip_count"
        n = self._trip_count_from_condition(comp, inst)
        if n is not None:
            return n, "loop condition"
        return 1, "unknown (counted once)"

    def _trip_count_from_condition(self, comp: Computation, inst: Instruction) -> int | None:
        """Match `i < N` on a tuple counter with a constant initial value and step 1."""
        cond_name = inst.attr("condition")
        body_name = inst.attr("body")
        if not cond_name or not body_name:
            return None
        cond = self.computations.get(cond_name.lstrip("%"))
        body = self.computations.get(body_name.lstrip("%"))
        if cond is None or body is None or cond.root is None:
            return None
        root = cond.root
        if root.opcode == "fusion":  # optimised HLO wraps the compare in a fusion
            return None
        if root.opcode != "compare" or len(root.operands) != 2:
            return None
        direction = root.attr("direction")
        a, b = (self._resolve(cond, o) for o in root.operands)
        if a is None or b is None:
            return None
        if a.opcode == "constant" and b.opcode == "get-tuple-element":
            a, b = b, a
            direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
        if a.opcode != "get-tuple-element" or b.opcode != "constant":
            return None
        index = int(a.attr("index") or -1)
        limit = _constant_int(b)
        init = self._tuple_element_constant(comp, inst.operands[0], index)
        step = self._counter_step(body, index)
        if limit is None or init is None or not step:
            return None
        if direction == "LT":
            return max(0, -(-(limit - init) // step))
        if direction == "LE":
            return max(0, (limit - init) // step + 1)
        return None

    def _resolve(self, comp: Computation, name: str) -> Instruction | None:
        inst = comp.by_name.get(name)
        while inst is not None and inst.opcode in ("copy", "bitcast", "convert") and inst.operands:
            inst = comp.by_name.get(inst.operands[0])
        return inst

    def _tuple_element_constant(self, comp: Computation, tuple_name: str, index: int) -> int | None:
        t = self._resolve(comp, tuple_name)
        if t is None or t.opcode != "tuple" or index >= len(t.operands):
            return None
        c = self._resolve(comp, t.operands[index])
        return _constant_int(c) if c is not None and c.opcode == "constant" else None

    def _counter_step(self, body: Computation, index: int) -> int | None:
        root = body.root
        if root is None or root.opcode != "tuple" or index >= len(root.operands):
            return None
        upd = self._resolve(body, root.operands[index])
        if upd is None or upd.opcode != "add":
            return None
        for o in upd.operands:
            c = self._resolve(body, o)
            if c is not None and c.opcode == "constant":
                return _constant_int(c)
        return None


def _constant_int(inst: Instruction) -> int | None:
    m = re.match(r"\s*(-?\d+)\s*$", inst.operands[0] if inst.operands else "")
    return int(m.group(1)) if m else None


# -----------------------------------------------------------------------------
# Source attribution.

_PLUMBING = frozenset({"while", "body", "cond", "closed_call", "checkpoint",
                       "rematted_computation", "shard_map", "remat", "pjit", ""})
_WRAPPER = re.compile(r"^(?:jvp|transpose|vmap|jit|pjit|remat|checkpoint)\((.*)\)$")


def operation_of(op_name: str) -> str:
    """The model operation behind an HLO op_name, with its phase.

    `jit(step)/transpose(jvp())/while/body/closed_call/checkpoint/attention/out_proj/
    blhe,hed->bld/dot_general` -> "attention/out_proj (backward)". Named scopes survive;
    transform wrappers, loop plumbing, einsum specs and the primitive name do not.
    """
    if not op_name:
        return "?"
    parts = op_name.split("/")
    phase = "forward"
    if "rematted_computation" in parts:
        phase = "recomputed"
    elif "transpose(" in op_name:
        phase = "backward"
    kept = []
    for i, part in enumerate(parts[:-1]):  # the last part is the primitive
        while (m := _WRAPPER.match(part)) is not None:
            part = m.group(1)
        if i == 0 and op_name.startswith("jit("):
            continue  # the jitted function's own name
        if part in _PLUMBING or "->" in part or part.startswith("_"):
            continue
        kept.append(part)
    name = "/".join(kept) if kept else parts[-1]
    return f"{name} ({phase})"


# -----------------------------------------------------------------------------
# Replica groups.


def parse_replica_groups(
    text: str | None, num_devices: int | None = None, device_ids: str | None = None
) -> list[list[int]]:
    """Replica groups in any of XLA's printed forms.

    - explicit `{{0,1},{2,3}}`; an empty `{}` means one group of all devices;
    - iota `[G,S]<=[dims]T(perm)`;
    - mesh axes `mesh['axis_0'=8,'axis_1'=2] {'axis_1'}`, optionally with
      `device_ids=([dims]T(perm)) {...}` giving the device at each mesh position (iota
      order when absent): one group per combination of the other axes.
    """
    if text is None:
        return []
    text = text.strip()
    if text.startswith("mesh["):
        return _mesh_axes_groups(text, device_ids)
    if text.startswith("["):
        return _iota_groups(text)
    if not text.startswith("{"):
        raise HloParseError(f"cannot read replica groups {text!r}")
    inner = text[1:-1].strip()
    if not inner:
        return [list(range(num_devices))] if num_devices else []
    groups = []
    for g in re.findall(r"\{([^{}]*)\}", inner):
        groups.append([int(x) for x in g.split(",") if x.strip()])
    return groups


_MESH_AXIS = re.compile(r"'([^']+)'\s*=\s*(\d+)")


def _mesh_axes_groups(text: str, device_ids: str | None) -> list[list[int]]:
    close = text.index("]")
    axes = _MESH_AXIS.findall(text[5:close])
    if not axes:
        raise HloParseError(f"cannot read mesh replica groups {text!r}")
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    rest = (text[close + 1:] + " " + (device_ids or "")).strip()
    m = re.search(r"\{([^{}]*)\}\s*$", rest)
    if not m:
        raise HloParseError(f"mesh replica groups {text!r} name no reduction axes {{...}}")
    grouped = [a.strip().strip("'") for a in m.group(1).split(",") if a.strip()]
    for a in grouped:
        if a not in names:
            raise HloParseError(f"mesh replica groups: axis {a!r} not in {names}")
    total = math.prod(sizes)
    devices = np.arange(total)
    if device_ids:
        dm = re.match(r"\(?\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\)?", device_ids.strip())
        if not dm:
            raise HloParseError(f"cannot read device_ids {device_ids!r}")
        dims = [int(x) for x in dm.group(1).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if dm.group(2):
            ids = ids.transpose([int(x) for x in dm.group(2).split(",")])
        devices = ids.reshape(-1)
        if devices.size != total:
            raise HloParseError(f"device_ids {device_ids!r} has {devices.size} ids for a mesh of "
                                f"{total}")
    arr = devices.reshape(sizes)
    keep = [i for i, a in enumerate(names) if a not in grouped]
    moved = [names.index(a) for a in grouped]
    arr = arr.transpose(keep + moved)
    group_size = math.prod(sizes[i] for i in moved)
    return arr.reshape(-1, group_size).tolist()


_IOTA = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")


def _iota_groups(text: str) -> list[list[int]]:
    m = _IOTA.match(text.replace(" ", ""))
    if not m:
        raise HloParseError(f"cannot read iota replica groups {text!r}")
    out_shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        perm = [int(x) for x in m.group(3).split(",")]
        if sorted(perm) != list(range(len(dims))):
            raise HloParseError(f"transpose {perm} is not a permutation of {len(dims)} dims")
        ids = ids.transpose(perm)
    if math.prod(out_shape) != ids.size:
        raise HloParseError(f"iota groups {text!r}: {out_shape} does not hold {ids.size} ids")
    ids = ids.reshape(out_shape)
    if ids.ndim == 1:
        ids = ids.reshape(1, -1)
    return ids.reshape(ids.shape[0], -1).tolist()


def parse_source_target_pairs(text: str | None) -> list[list[int]]:
    if not text:
        return []
    return [[int(a), int(b)] for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", text)]


# -----------------------------------------------------------------------------
# The module parser.


def parse_hlo(text: str) -> HloModule:
    """Parse HLO module text.

    Raises:
        HloParseError: with the line number of the first line that cannot be read.
    """
    lines = text.splitlines()
    module_name, header, num_partitions = "", "", 1
    computations: dict[str, Computation] = {}
    entry = ""
    current: Computation | None = None
    for lineno, line in enumerate(lines, start=1):
        if not line or line.isspace():
            continue
        try:
            if current is not None:
                stripped = line.strip()
                if stripped == "}" or stripped.startswith("}, "):  # `}, execution_thread=...`
                    computations[current.name] = current
                    current = None
                    continue
                current.instructions.append(_parse_instruction(stripped, lineno))
                continue
            if line.startswith("HloModule"):
                header = line
                module_name = line.split()[1].rstrip(",")
                m = re.search(r"num_partitions=(\d+)", line)
                num_partitions = int(m.group(1)) if m else 1
                continue
            if line.rstrip().endswith("{") and (line.startswith("%") or line.startswith("ENTRY")
                                                or _HEADER.match(line)):
                m = _HEADER.match(line)
                if not m:
                    raise HloParseError("cannot read computation header")
                current = Computation(name=m.group(2), is_entry=bool(m.group(1)), line=lineno)
                if current.is_entry:
                    entry = current.name
                continue
            # FileNames / StackFrames sections and other preamble lines are skipped.
        except HloParseError as e:
            raise HloParseError(f"HLO line {lineno}: {e}: {line.strip()[:160]}") from None
        except (ValueError, IndexError) as e:
            raise HloParseError(f"HLO line {lineno}: cannot parse ({e}): {line.strip()[:160]}") \
                from None
    if current is not None:
        raise HloParseError(
            f"HLO line {current.line}: computation {current.name!r} is never closed with '}}' "
            f"(truncated text?)"
        )
    if not computations:
        raise HloParseError("no HLO computations found (is this an HLO module dump?)")
    if not entry:
        entry = list(computations)[-1]
    _inherit_fusion_op_names(computations)
    return HloModule(module_name, computations, entry, num_partitions, header)


def _inherit_fusion_op_names(computations: dict[str, Computation]) -> None:
    """Give a fusion without metadata the op_name of what it fused (its root's, else the
    first one found), so that its work is attributed to the model operation."""
    for comp in computations.values():
        for inst in comp.instructions:
            if inst.opcode != "fusion" or "op_name=" in inst.attr_text:
                continue
            for _, callee in inst.called_computations():
                body = computations.get(callee)
                if body is None:
                    continue
                names = [i.op_name for i in sorted(body.instructions, key=lambda i: not i.is_root)]
                inst.inherited_op_name = next((n for n in names if n), "")
                break


def _parse_instruction(s: str, lineno: int) -> Instruction:
    is_root = s.startswith("ROOT ")
    if is_root:
        s = s[5:]
    eq = s.find(" = ")
    if eq < 0:
        raise HloParseError("expected '%name = shape opcode(...)'")
    name = s[:eq].lstrip("%")
    rest = s[eq + 3:]
    if rest.startswith("("):
        end = _matching(rest, 0, "(", ")")
        # a tuple shape may carry a layout-free suffix like `{...}` on TPU; none seen
        shape_text = rest[: end + 1]
        rest = rest[end + 1:].lstrip()
    else:
        sp = rest.find(" ")
        if sp < 0:
            raise HloParseError("missing opcode after shape")
        shape_text = rest[:sp]
        rest = rest[sp + 1:]
    paren = rest.find("(")
    if paren < 0:
        raise HloParseError("missing operand list")
    opcode = rest[:paren]
    if not opcode or " " in opcode:
        raise HloParseError(f"bad opcode {opcode!r}")
    close = _matching(rest, paren, "(", ")")
    operand_text = rest[paren + 1: close]
    if opcode == "constant":
        operands = [operand_text]
    else:
        operands = [o.split()[-1].lstrip("%") for o in split_top_level(operand_text)]
    attr_text = rest[close + 1:].lstrip(", ")
    return Instruction(name, shape_text, opcode, operands, attr_text, lineno, is_root)
