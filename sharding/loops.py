"""How many times each computation of an HLO module runs per step.

While bodies run their trip count: XLA's `known_trip_count` when the compiler wrote it,
else a loop condition of the form `i < N` on a tuple counter with a constant start and step.
Every branch of a conditional is counted as taken once per execution (an upper bound, said
in `notes`). Results are memoised on the module (like its `call_sites`).
"""

from __future__ import annotations

import json
import re

from sharding.hlo import Computation, HloModule, HloParseError, Instruction

_MEMO = "_loops_memo"


def _memo(module: HloModule) -> dict:
    return vars(module).setdefault(_MEMO, {})


def trip_counts(module: HloModule) -> dict[str, tuple[int, str]]:
    """`computation/while instruction` -> (trip count, how it was found)."""
    memo = _memo(module)
    if "trips" not in memo:
        memo["trips"] = {f"{comp.name}/{inst.name}": _trip_count(module, comp, inst)
                         for comp in module.computations.values()
                         for inst in comp.instructions if inst.opcode == "while"}
    return memo["trips"]


def execution_counts(module: HloModule) -> dict[str, int]:
    """How many times each computation runs per execution of the entry."""
    memo = _memo(module)
    if "counts" not in memo:
        memo["counts"] = _execution_counts(module)
    return memo["counts"]


def notes(module: HloModule) -> list[str]:
    """Assumptions made while counting executions, for the report."""
    out = []
    for key, (_, how) in trip_counts(module).items():
        if how.startswith("unknown"):
            out.append(f"while loop {key}: trip count not found; its body is counted once")
    for callee, sites in module.call_sites.items():
        for caller, inst, role in sites:
            if role in ("branch", "true_computation", "false_computation"):
                out.append(f"conditional {caller}/{inst.name}: branch {callee} counted as "
                           f"taken on every execution (an upper bound)")
    return out


def _execution_counts(module: HloModule) -> dict[str, int]:
    trips = trip_counts(module)
    counts: dict[str, int] = {}
    visiting: set[str] = set()

    def count(name: str) -> int:
        if name in counts:
            return counts[name]
        if name == module.entry:
            return 1
        if name in visiting:
            raise HloParseError(f"computation {name!r} calls itself")
        visiting.add(name)
        total = 0
        for caller, inst, role in module.call_sites.get(name, []):
            mult = 1
            if inst.opcode == "while":
                n, _ = trips[f"{caller}/{inst.name}"]
                mult = n + 1 if role == "condition" else n
            total += count(caller) * mult
        visiting.discard(name)
        counts[name] = total
        return total

    for name in module.computations:
        counts[name] = count(name)
    return counts


def _trip_count(module: HloModule, comp: Computation, inst: Instruction) -> tuple[int, str]:
    cfg = inst.attr("backend_config")
    if cfg and "known_trip_count" in cfg:
        try:
            return int(json.loads(cfg)["known_trip_count"]["n"]), "known_trip_count"
        except (ValueError, KeyError, TypeError):
            m = re.search(r'"known_trip_count":\{"n":"(\d+)"', cfg)
            if m:
                return int(m.group(1)), "known_trip_count"
    n = _trip_count_from_condition(module, comp, inst)
    if n is not None:
        return n, "loop condition"
    return 1, "unknown (counted once)"


def _trip_count_from_condition(module: HloModule, comp: Computation,
                               inst: Instruction) -> int | None:
    """Match `i < N` on a tuple counter with a constant initial value and step."""
    cond = module.computations.get((inst.attr("condition") or "").lstrip("%"))
    body = module.computations.get((inst.attr("body") or "").lstrip("%"))
    if cond is None or body is None or cond.root is None:
        return None
    root = cond.root  # optimised HLO wraps the compare in a fusion: not read
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = root.attr("direction")
    a, b = (_resolve(cond, o) for o in root.operands)
    if a is None or b is None:
        return None
    if a.opcode == "constant" and b.opcode == "get-tuple-element":
        a, b = b, a
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    if a.opcode != "get-tuple-element" or b.opcode != "constant":
        return None
    index = int(a.attr("index") or -1)
    limit = _constant_int(b)
    init = _tuple_element_constant(comp, inst.operands[0], index)
    step = _counter_step(body, index)
    if limit is None or init is None or not step:
        return None
    if direction == "LT":
        return max(0, -(-(limit - init) // step))
    if direction == "LE":
        return max(0, (limit - init) // step + 1)
    return None


def _resolve(comp: Computation, name: str) -> Instruction | None:
    inst = comp.by_name.get(name)
    while inst is not None and inst.opcode in ("copy", "bitcast", "convert") and inst.operands:
        inst = comp.by_name.get(inst.operands[0])
    return inst


def _tuple_element_constant(comp: Computation, tuple_name: str, index: int) -> int | None:
    t = _resolve(comp, tuple_name)
    if t is None or t.opcode != "tuple" or index >= len(t.operands):
        return None
    c = _resolve(comp, t.operands[index])
    return _constant_int(c) if c is not None and c.opcode == "constant" else None


def _counter_step(body: Computation, index: int) -> int | None:
    root = body.root
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    upd = _resolve(body, root.operands[index])
    if upd is None or upd.opcode != "add":
        return None
    for o in upd.operands:
        c = _resolve(body, o)
        if c is not None and c.opcode == "constant":
            return _constant_int(c)
    return None


def _constant_int(inst: Instruction) -> int | None:
    m = re.match(r"\s*(-?\d+)\s*$", inst.operands[0] if inst.operands else "")
    return int(m.group(1)) if m else None
