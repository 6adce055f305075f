"""A parser for HLO text: computations, instructions, shapes, the call graph, and which model
operation an instruction came from.

It reads what `jax.jit(...).lower(...).compile().as_text()` and XLA's `--xla_dump_to` print on
every backend (CPU, TPU, GPU): tuple shapes, tiled layouts like `{1,0:T(8,128)(2,1)}`,
`metadata={op_name=...}`, called computations (fusion, call, while, conditional, async).

Replica groups are read by sharding/replica_groups.py, loop trip counts and execution counts
worked out by sharding/loops.py. Only what the explorer needs is parsed eagerly (name,
shape, opcode, operands); attributes are scanned on demand so that a multi-megabyte module
parses quickly.
"""

from __future__ import annotations

import dataclasses
import math
import re
from functools import cached_property

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

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s({]+)\s*[({]")


class HloParseError(ValueError):
    """Malformed HLO text; the message names the line."""


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayShape:
    dtype: str  # HLO element type, e.g. "bf16"
    dims: tuple[int, ...]
    # The layout's memory space: 0 is device memory (HBM); others (the TPU's S(1), on-chip
    # VMEM; S(5), host memory) are not HBM.
    memory_space: int = 0

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        return math.ceil(self.num_elements * ELEMENT_BITS[self.dtype] / 8)

    @property
    def hbm_bytes(self) -> int:
        """Bytes it occupies in HBM: none when its layout puts it in another memory."""
        return self.nbytes if self.memory_space == 0 else 0


def parse_shape(text: str) -> list[ArrayShape]:
    """All arrays of a (possibly nested tuple) shape, in order; of a layout only the memory
    space is kept."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        if dtype not in ELEMENT_BITS:
            raise HloParseError(f"unknown element type {dtype!r} in shape {text!r}")
        space = _MEMORY_SPACE.search(layout) if layout else None
        out.append(ArrayShape(dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d),
                              int(space.group(1)) if space else 0))
    if not out and not text.startswith("(") and not _is_scalar_type(text):
        raise HloParseError(f"cannot read shape {text!r}")
    return out


def _is_scalar_type(text: str) -> bool:
    return text.split("{")[0] in ("token[]", "token", "opaque[]")


def _string_end(text: str, i: int) -> int:
    """Index of the quote closing the string that opens at text[i] (escaped quotes skipped)."""
    j = text.find('"', i + 1)
    while j != -1 and text[j - 1] == "\\":
        j = text.find('"', j + 1)
    return len(text) if j == -1 else j


def scan_top_level(text: str, start: int = 0, sep: str = ",") -> tuple[list[str], int]:
    """Split text[start:] on `sep` outside (), {}, [] and strings, up to the bracket that
    closes one opened before `start` (or the end of the text).

    Returns:
        (the stripped non-empty parts, the index of that closing bracket or len(text)).
    """
    parts, depth, cur, i, n = [], 0, start, start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i = _string_end(text, i)
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            if depth == 0:
                break
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[cur:i])
            cur = i + 1
        i += 1
    parts.append(text[cur:i])
    return [p.strip() for p in parts if p.strip()], i


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside of (), {}, [] and quotes."""
    return scan_top_level(text, 0, sep)[0]


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
    num_partitions: int  # the devices it runs on: partitions, or a replica-mode dump's replicas
    header: str

    @property
    def is_scheduled(self) -> bool:
        """A final, scheduled module (not the post-partitioning one, whose copies and
        layouts later passes still rewrite)."""
        return "is_scheduled=true" in self.header

    @cached_property
    def call_sites(self) -> dict[str, list[tuple[str, Instruction, str]]]:
        """computation -> [(caller computation, calling instruction, role)]; how often each
        runs is sharding/loops.py's business."""
        sites: dict[str, list] = {}
        for comp in self.computations.values():
            for inst in comp.instructions:
                if inst.opcode in ("async-update", "async-done") or inst.opcode.endswith("-done"):
                    continue  # the async-start carries the computation; count it once
                for role, callee in inst.called_computations():
                    sites.setdefault(callee, []).append((comp.name, inst, role))
        return sites


# -----------------------------------------------------------------------------
# Source attribution.

_PLUMBING = frozenset({"while", "body", "cond", "closed_call", "checkpoint",
                       "rematted_computation", "shard_map", "remat", "pjit", ""})
# Primitives JAX itself adds outside the model's scopes, by what they do.
_UNSCOPED = {"dynamic_update_index_in_dim": "layer scan: stacking per-layer values",
             "dynamic_index_in_dim": "layer scan: reading per-layer values",
             "dynamic_update_slice": "layer scan: stacking per-layer values",
             "dynamic_slice": "layer scan: reading per-layer values",
             "while": "loop control", "lt": "loop control", "cond": "loop control"}
_WRAPPER = re.compile(r"^(?:jvp|transpose|vmap|jit|pjit|remat|checkpoint)\((.*)\)$")
# The named scopes of a training step's data-parallel gradient sum and optimizer update
# (models/train.py enters them as sharding.gpu_frameworks' names)
GRADIENT_SUM, OPTIMIZER = "gradient_sum", "optimizer"


def operation_of(op_name: str) -> str:
    """The model operation behind an HLO op_name, with its phase.

    `jit(step)/transpose(jvp())/while/body/closed_call/checkpoint/attention/out_proj/
    blhe,hed->bld/dot_general` -> "attention/out_proj (backward)". Named scopes survive;
    transform wrappers, loop plumbing, einsum specs and the primitive name do not. An
    instruction XLA made from several (a combined all-reduce: `prefix/(a:b:c)`) reads as
    its members' distinct operations joined by " + ".
    """
    if not op_name:
        return "compiler-made (no op_name)"
    if (members := _merged_members(op_name)) is not None:
        return " + ".join(dict.fromkeys(operation_of(m) for m in members))
    parts = op_name.split("/")
    phase = "forward"
    if "rematted_computation" in parts:
        phase = "recomputed"
    elif "transpose(" in op_name or GRADIENT_SUM in parts:
        phase = "backward"  # (the step's gradient sums end the backward pass)
    elif OPTIMIZER in parts:
        phase = "update"
    kept = []
    for i, part in enumerate(parts[:-1]):  # the last part is the primitive
        while (m := _WRAPPER.match(part)) is not None:
            part = m.group(1)
        if i == 0 and op_name.startswith("jit("):
            continue  # the jitted function's own name
        if part in _PLUMBING or "->" in part or part.startswith("_"):
            continue
        if kept and kept[-1] == part:
            continue  # a scope entered again inside itself (a custom VJP's own scope)
        kept.append(part)
    if kept and kept[0] in _UNSCOPED:
        name = _UNSCOPED[kept[0]]
    elif kept:
        name = "/".join(kept)
    else:  # a primitive outside every named scope: JAX's own plumbing has plain names
        primitive = re.sub(r"\.\d+$", "", parts[-1])
        name = _UNSCOPED.get(primitive, primitive)
    return f"{name} ({phase})"


def _merged_members(op_name: str) -> list[str] | None:
    """The members' op_names of an instruction XLA merged from several, which it names
    as their common prefix and their suffixes in parentheses, colon-separated
    (`jit(step)/jvp()/while/body/(q/dot_general:k/dot_general)`); None for any other."""
    if not op_name.endswith(")"):
        return None
    depth = 0
    for i in range(len(op_name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(op_name[i], 0)
        if depth == 0:
            break
    if i == 0 or op_name[i - 1] != "/":  # not a path component of its own: a wrapper
        return None
    prefix, inner = op_name[:i], op_name[i + 1:-1]
    members, depth, start = [], 0, 0
    for j, ch in enumerate(inner):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ":" and depth == 0:
            members.append(inner[start:j])
            start = j + 1
    members.append(inner[start:])
    return [prefix + m for m in members] if len(members) > 1 else None


# -----------------------------------------------------------------------------
# The module parser.


def _devices(header: str) -> int:
    """The devices a module runs on: its partitions (SPMD), or its replicas in a
    replica-mode dump (PyTorch/XLA DDP, an older jax.pmap: replica_count=N and no
    num_partitions), whose replica groups then name replicas.

    Raises:
        HloParseError: both above one (a multi-replica SPMD program), which this does not
            read.
    """
    found = {key: int(m.group(1)) if (m := re.search(rf"\b{key}=(\d+)", header)) else 1
             for key in ("num_partitions", "replica_count")}
    partitions, replicas = found["num_partitions"], found["replica_count"]
    if partitions > 1 and replicas > 1:
        raise HloParseError(f"the module runs {replicas} replicas of {partitions} partitions "
                            f"(replica_count={replicas}, num_partitions={partitions}); only "
                            f"one of them above 1 is read: dump the program with SPMD "
                            f"partitioning alone (jax.jit over a mesh of all the devices)")
    return max(partitions, replicas)


def parse_hlo(text: str) -> HloModule:
    """Parse HLO module text.

    Raises:
        HloParseError: with the line number of the first line that cannot be read.
        TypeError: `text` is not a str (the bytes of a file, a path).
    """
    if not isinstance(text, str):
        kind = type(text).__name__
        raise TypeError(f"the HLO text is of type {kind}, not str; give the dump's text: "
                        f"data.decode() of its bytes, gzip.decompress(data).decode() of a "
                        f".gz, pathlib.Path(path).read_text() of a file")
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
                    _expand_tuple_references(current)
                    computations[current.name] = current
                    current = None
                    continue
                current.instructions.append(_parse_instruction(stripped, lineno))
                continue
            if line.startswith("HloModule"):
                header = line
                module_name = line.split()[1].rstrip(",")
                num_partitions = _devices(line)
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
    _check_references(computations)
    _inherit_fusion_op_names(computations)
    return HloModule(module_name, computations, entry, num_partitions, header)


def _expand_tuple_references(comp: Computation) -> None:
    """Newer XLA prints a tuple's element as an operand `%t#2` in place of a
    get-tuple-element instruction: each one becomes that instruction (named `t#2`, placed
    before its first user), so that the dump reads as older ones do."""
    out: list[Instruction] = []
    shapes = {i.name: i.shape_text for i in comp.instructions}  # and each element made

    def element(ref: str, user: Instruction) -> None:
        if "#" not in ref or ref in shapes:
            return
        tuple_name, _, index = ref.rpartition("#")
        element(tuple_name, user)
        parts = split_top_level(shapes.get(tuple_name, "()").strip()[1:-1])
        try:
            shape = _COMMENT.sub("", parts[int(index)]).strip()
        except (ValueError, IndexError):
            raise HloParseError(f"HLO line {user.line}: %{user.name} uses %{ref}, an element "
                                f"%{tuple_name} does not have (damaged dump?)") from None
        shapes[ref] = shape
        out.append(Instruction(ref, shape, "get-tuple-element", [tuple_name], f"index={index}",
                               user.line))

    for inst in comp.instructions:
        if inst.opcode != "constant":
            for operand in inst.operands:
                element(operand, inst)
        out.append(inst)
    comp.instructions = out


def _check_references(computations: dict[str, Computation]) -> None:
    """Every operand is an instruction of its computation and every called computation is
    in the module: a damaged or truncated dump gets the line it breaks on."""
    for comp in computations.values():
        defined = {i.name for i in comp.instructions}
        for inst in comp.instructions:
            where = f"HLO line {inst.line}: %{inst.name}"
            if inst.opcode not in ("constant", "parameter"):
                missing = next((o for o in inst.operands if o not in defined), None)
                if missing is not None:
                    raise HloParseError(f"{where} uses %{missing}, which computation "
                                        f"{comp.name!r} does not define (damaged dump?)")
            roles = inst.called_computations()
            if inst.opcode == "while" and not {"body", "condition"} <= {r for r, _ in roles}:
                raise HloParseError(f"{where}: a while without its body= and condition= "
                                    f"computations (damaged dump?)")
            for _, callee in roles:
                if callee not in computations:
                    raise HloParseError(f"{where} calls computation {callee!r}, which the "
                                        f"module does not define (truncated dump?)")
        if not any(i.is_root for i in comp.instructions) and comp.instructions:
            raise HloParseError(f"HLO line {comp.line}: computation {comp.name!r} has no ROOT "
                                f"instruction (damaged dump?)")


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


_COMMENT = re.compile(r"/\*.*?\*/")


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
        _, end = scan_top_level(rest, 1)
        if end >= len(rest):
            raise HloParseError("unbalanced () in the tuple shape")
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
    parts, close = scan_top_level(rest, paren + 1)
    if close >= len(rest):
        raise HloParseError("unbalanced () in the operand list")
    if opcode == "constant":
        operands = [rest[paren + 1: close]]
    else:
        # `s32[] %x`, or `/*index=5*/%x` in long operand lists.
        operands = [_COMMENT.sub(" ", o).split()[-1].lstrip("%") for o in parts]
    attr_text = rest[close + 1:].lstrip(", ")
    return Instruction(name, shape_text, opcode, operands, attr_text, lineno, is_root)
