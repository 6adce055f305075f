"""Will it fit: a config's memory verdict, and the changes that make it fit.

The verdict is the memory model's (models/memory.py) for the program on the full mesh (an
abstract mesh: no devices, so any size) with the runtime's own reserve on the device
(meshes/reserves.py), or, when a real deviceless compiler made the program, that
compiler's own buffer assignment (`shardscope fit --backend tpu`).

The suggestions are a search over the knobs a user would turn: more microbatches, full
remat or the layer inputs offloaded to host memory, the distributed optimizer, vocabulary
tiling, and ways moved from data parallelism to FSDP, tensor or pipeline parallelism.
Every candidate is a config the validator accepts and its memory is the same model's;
single changes first, then pairs, then the greedy stack of the changes that save most.
Those that fit are compiled (XLA:CPU) and estimated, the fastest first: the cheapest way
to fit in step time, checked.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence

from experiments import config as config_mod
from experiments import runner
from experiments.config import ConfigError, Experiment
from experiments.reference import toml_value
from experiments.runner import memory_of

# The order changes are tried and shown in without a compile: roughly what each costs in
# step time (sharding the optimizer state costs a collective per step; tiling the loss a
# recomputed output projection; microbatches smaller matmuls; remat a recomputed forward).
_KNOBS = ("train.shard_optimizer_over_data", "train.num_vocab_tiling", "workload.microbatches",
          "train.remat", "parallelism")


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A change to the config ({"table.key": value}), the memory per device with it, and
    (when compiled) its estimated step time."""

    changes: dict
    memory_per_device_bytes: float
    fits: bool
    step_time_s: float | None = None

    def describe(self) -> str:
        from sharding.units import fmt_bytes

        change = ", ".join(f"{k} = {toml_value(v)}" for k, v in self.changes.items())
        step = "" if self.step_time_s is None else f", step {self.step_time_s:.3g} s"
        return f"{change} ({fmt_bytes(self.memory_per_device_bytes)} per device{step})"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _changed(exp: Experiment, changes: dict) -> Experiment | None:
    """The experiment with `changes` applied, or None when the validator refuses it."""
    raw = copy.deepcopy(exp.to_dict())
    for key, value in changes.items():
        table, _, name = key.partition(".")
        raw.setdefault(table, {})[name] = list(value) if isinstance(value, tuple) else value
    try:
        return config_mod.from_dict(raw)
    except ConfigError:
        return None


def candidates(exp: Experiment) -> list[dict]:
    """Single changes that may lower the memory per device, by knob."""
    w, t, par = exp.workload, exp.train, exp.parallelism
    out: list[dict] = []
    if w.kind == "train":
        if not t.shard_optimizer_over_data:
            out.append({"train.shard_optimizer_over_data": True})
        if t.num_vocab_tiling == 1:
            out += [{"train.num_vocab_tiling": k} for k in (4, 16) if w.seq_len % k == 0]
        more = [k for k in range(w.microbatches + 1, w.global_batch + 1)
                if w.global_batch % k == 0 and k % w.microbatches == 0]
        out += [{"workload.microbatches": k} for k in more[:4]]
        if t.remat != "full":
            out.append({"train.remat": "full", "train.save": [], "train.offload": []})
        if "decoder_layer_input" not in t.offload:
            out.append({"train.remat": "custom", "train.save": [],
                        "train.offload": ["decoder_layer_input"]})
    sizes = par.sizes()
    for src, dst in (("data", "fsdp"), ("data", "tensor"), ("data", "pipeline"),
                     ("fsdp", "tensor")):
        for k in _factors(sizes[src]):
            if dst == "pipeline" and w.kind != "train":
                continue
            out.append({f"parallelism.{src}": sizes[src] // k,
                        f"parallelism.{dst}": sizes[dst] * k})
    return out


def _factors(n: int) -> list[int]:
    """Ways to move: the two fewest and the two most (all of them), so that a large data
    axis can move whole to FSDP as well as in part."""
    ks = [k for k in range(2, n + 1) if n % k == 0]
    return sorted(set(ks[:2] + ks[-2:]))


# Without a compile, parallelism moves are shown by what they add to the step: FSDP a
# gather of each layer's weights (overlapped), tensor parallelism collectives in every
# layer's critical path, pipeline parallelism a bubble.
_DESTINATIONS = ("fsdp", "tensor", "pipeline")


def _destination(changes: dict) -> int:
    grown = [k.split(".", 1)[1] for k in changes if k.startswith("parallelism.")]
    return min((_DESTINATIONS.index(a) for a in grown if a in _DESTINATIONS), default=0)


def _knob(changes: dict) -> str:
    key = next(iter(changes))
    return "parallelism" if key.startswith("parallelism.") else key


def search(exp: Experiment, *, limit: int = 3, compile: bool = True, backend: str = "cpu",
           calibration=None, budget: int = 400) -> list[Suggestion]:
    """Changes that make the experiment fit, cheapest in step time first (compiled and
    estimated when `compile`; at most `limit` kept). `budget`: candidates sized at most
    (by the memory model, ~10 ms each: every single change and pair of ~20 singles)."""
    capacity = exp.system.chip.hbm_bytes
    sized: dict[str, tuple[dict, float]] = {}

    def size(changes: dict) -> float | None:
        key = repr(sorted(changes.items()))
        if key not in sized and len(sized) < budget:
            new = _changed(exp, changes)
            try:
                sized[key] = (changes, memory_of(new).total_bytes if new else float("inf"))
            except ValueError:
                sized[key] = (changes, float("inf"))
        return sized[key][1] if key in sized else None

    singles = candidates(exp)
    fitting = [c for c in singles if (size(c) or float("inf")) <= capacity]
    if not fitting:
        pairs = [{**a, **b} for a, b in itertools.combinations(singles, 2)
                 if _knob(a) != _knob(b) and not set(a) & set(b)]
        fitting = [c for c in pairs if (size(c) or float("inf")) <= capacity]
    if not fitting:
        fitting = _greedy(singles, size, capacity)
    fitting.sort(key=lambda c: (_KNOBS.index(_knob(c)) if _knob(c) in _KNOBS else 9,
                                len(c), _destination(c), -size(c)))
    out = []
    for changes in fitting[:limit if not compile else 2 * limit]:
        step = None
        if compile:
            step = _step_time(_changed(exp, changes), backend, calibration)
            if step is None:
                continue
        out.append(Suggestion(changes, size(changes), True, step))
    if compile:
        out.sort(key=lambda s: s.step_time_s)
    return out[:limit]


def _greedy(singles: Sequence[dict], size, capacity: float) -> list[dict]:
    """Stack the changes that save most, one knob at a time, until it fits (or none is
    left)."""
    stack: dict = {}
    while True:
        options = [c for c in singles if _knob(c) not in {_knob({k: v}) for k, v in
                                                          stack.items()}]
        scored = [(size({**stack, **c}), c) for c in options]
        scored = [(m, c) for m, c in scored if m is not None]
        if not scored:
            return []
        best, change = min(scored, key=lambda mc: mc[0])
        stack = {**stack, **change}
        if best <= capacity:
            return [stack]


def _step_time(exp: Experiment | None, backend: str, calibration) -> float | None:
    """The compiled estimate's step time, None when it does not build."""
    if exp is None:
        return None
    try:
        return runner.run(exp, backend=backend, calibration=calibration).step_time_s
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether the experiment's step fits in HBM, its memory per device by part, where the
    figures come from, and the changes that make it fit (none when it does)."""

    name: str
    system: str
    fits: bool
    memory_per_device_bytes: float
    hbm_capacity_bytes: float
    breakdown: tuple[tuple[str, float], ...]
    source: str
    notes: tuple[str, ...] = ()
    suggestions: tuple[Suggestion, ...] = ()
    compiler_bytes: float | None = None
    compiler_source: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "system": self.system, "fits": self.fits,
                "memory_per_device_bytes": self.memory_per_device_bytes,
                "hbm_capacity_bytes": self.hbm_capacity_bytes,
                "breakdown": [{"part": p, "bytes": b} for p, b in self.breakdown],
                "source": self.source, "notes": list(self.notes),
                "compiler_bytes": self.compiler_bytes, "compiler_source": self.compiler_source,
                "suggestions": [s.to_dict() for s in self.suggestions]}

    def format(self) -> str:
        from sharding.units import fmt_bytes

        word = "fits" if self.fits else "DOES NOT FIT"
        lines = [f"{self.name} on {self.system}: {word} ({fmt_bytes(self.memory_per_device_bytes)}"
                 f" per device of {fmt_bytes(self.hbm_capacity_bytes)} HBM)",
                 f"memory per device ({self.source}):"]
        lines += [f"  {fmt_bytes(b):>10}  {p}" for p, b in
                  sorted(self.breakdown, key=lambda pb: -pb[1])]
        if self.compiler_bytes is not None:
            lines.append(f"  (the compiler's own figure: {fmt_bytes(self.compiler_bytes)}, "
                         f"{self.compiler_source})")
        lines += [f"  {n}" for n in self.notes]
        if not self.fits:
            lines.append("to fit (each compiled and estimated, fastest first):"
                         if any(s.step_time_s for s in self.suggestions) else "to fit:")
            lines += [f"  {i}. {s.describe()}" for i, s in enumerate(self.suggestions, 1)]
            if not self.suggestions:
                lines.append("  no change the search tries is enough: shard over more devices")
        return "\n".join(lines)


def fit(exp: Experiment, *, backend: str = "cpu", calibration=None, limit: int = 3,
        compile: bool = True) -> Verdict:
    """The experiment's memory verdict and, when it does not fit, the changes that make it
    fit. On the CPU path the verdict is the memory model's (no compile); with the system's
    own compiler (backend tpu, gpu, auto) it is that compiler's buffer assignment."""
    from sharding import compiler
    from sharding.mesh import CPU_MAX_DEVICES

    resolved = compiler.resolve_backend(backend, exp.system)
    # `auto` reads a TPU pod past what XLA:CPU fakes from the memory model, as `run` reads
    # it from fewer replicas on the CPU path (it hands a GPU run to XLA:GPU whole)
    if backend == "auto" and resolved == "tpu" and exp.system.num_devices > CPU_MAX_DEVICES:
        resolved = "cpu"
    refused = ()
    if resolved == "cpu":
        memory = memory_of(exp)
    else:
        # the resolved backend, not `auto`: a refusal is the verdict, not a fallback to
        # the CPU path and the memory model's figure
        try:
            memory = runner.run(exp, backend=resolved, calibration=calibration).memory
        except runner.TargetRefused as e:
            memory = memory_of(exp)
            refused = (f"{compiler.compiler_name(resolved, exp.system)} refused it: "
                       f"{e.reason}",)
    cap = exp.system.chip.hbm_bytes
    fits = memory.total_bytes <= cap and not refused
    # each suggestion compiled and timed by the same compiler as the verdict
    suggestions = () if fits else tuple(search(exp, limit=limit, compile=compile,
                                               backend=resolved, calibration=calibration))
    return Verdict(name=exp.name, system=exp.system.label, fits=fits,
                   memory_per_device_bytes=memory.total_bytes, hbm_capacity_bytes=cap,
                   breakdown=(*memory.components, *memory.reserved), source=memory.source,
                   notes=(*refused, *memory.notes), suggestions=suggestions,
                   compiler_bytes=memory.compiler_bytes, compiler_source=memory.compiler_source)


def advice(exp: Experiment, calibration=None) -> tuple[str, ...]:
    """The run report's "to fit" lines (runner.run's `advise`): the search's changes, or
    why none is enough."""
    found = search(exp, calibration=calibration)
    if found:
        return tuple(s.describe() for s in found)
    need, cap = memory_of(exp).total_bytes, exp.system.chip.hbm_bytes
    return (f"no change the search tries is enough ({need / cap:.1f}x the HBM): shard over "
            f"more devices",)
