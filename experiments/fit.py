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

A Megatron-style config (frameworks.style: training on a GPU system without FSDP that
splits the model or sets one of Megatron's own settings, the distributed optimizer among
them) is searched as
Megatron-LM would change it: data-parallel ways moved to tensor, pipeline or context
parallelism keep the micro-batch of each data-parallel rank (Megatron's --micro-batch-size,
its number of microbatches growing), and what its usual recipes do not run (FSDP past the
distributed optimizer, vocabulary tiling, offload by tensor name) comes after every change
they do run, said so in its line. Every suggestion that changes the micro-batch or the
number of microbatches says so, in its line and in its JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence

from experiments import config as config_mod
from experiments import runner
from experiments.config import ConfigError, Experiment
from experiments.frameworks import style
from experiments.reference import toml_value
from experiments.runner import memory_of

# The order changes are tried and shown in without a compile: roughly what each costs in
# step time (sharding the optimizer state costs a collective per step; tiling the loss a
# recomputed output projection; microbatches smaller matmuls; remat a recomputed forward).
_KNOBS = ("train.shard_optimizer_over_data", "train.num_vocab_tiling", "workload.microbatches",
          "train.remat", "parallelism")
# Megatron's own knobs first (the distributed optimizer, recompute, a smaller micro-batch,
# tensor / pipeline / context parallelism), then what its usual recipes do not run.
_MEGATRON_KNOBS = ("train.shard_optimizer_over_data", "train.remat", "workload.microbatches",
                   "parallelism", "train.num_vocab_tiling")
# (from, to): the mesh axes a move takes ways between, in the order shown without a compile
_MOVES = {
    "jax": (("data", "fsdp"), ("data", "tensor"), ("data", "pipeline"), ("fsdp", "tensor")),
    "megatron": (("data", "tensor"), ("data", "pipeline"), ("data", "sequence"),
                 ("data", "fsdp")),
}


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A change to the config ({"table.key": value}), the memory per device with it, and
    (when compiled) its estimated step time. `microbatches` and `micro_batch_per_rank`
    (sequences per data-parallel rank in each microbatch, Megatron's --micro-batch-size):
    (before, after); `notes`: what the line says beside the change (a changed micro-batch,
    a change Megatron's usual recipes do not run)."""

    changes: dict
    memory_per_device_bytes: float
    fits: bool
    step_time_s: float | None = None
    microbatches: tuple[int, int] = (1, 1)
    micro_batch_per_rank: tuple[int, int] = (1, 1)
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        from sharding.units import fmt_bytes

        change = ", ".join(f"{k} = {toml_value(v)}" for k, v in self.changes.items())
        step = "" if self.step_time_s is None else f", step {self.step_time_s:.3g} s"
        notes = "".join(f"{n}; " for n in self.notes)
        return f"{change} ({notes}{fmt_bytes(self.memory_per_device_bytes)} per device{step})"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _per_rank(exp: Experiment) -> int:
    """Sequences per data-parallel rank in one microbatch (Megatron's --micro-batch-size)."""
    rules, sizes = exp.parallelism.axis_rules(), exp.parallelism.sizes()
    return exp.workload.micro_batch // rules.ways("batch", sizes)


def _foreign(changes: dict, exp: Experiment) -> str:
    """What a change is that Megatron's usual recipes do not run ("" for one they do)."""
    if changes.get("parallelism.fsdp", 1) > exp.parallelism.fsdp:
        return ("FSDP: past the distributed optimizer (ZeRO-1) of Megatron's usual recipes "
                "(Megatron-LM runs it with --use-megatron-fsdp)")
    if changes.get("train.num_vocab_tiling", 1) > 1:
        return "vocabulary tiling: MaxText's, no Megatron flag"
    if changes.get("train.offload"):
        return "offload by tensor name: MaxText's, no Megatron flag"
    return ""


def _suggestion(exp: Experiment, changes: dict, memory: float,
                step: float | None = None, kind: str | None = None) -> Suggestion:
    """The suggestion, with what it does to the batch said (the global batch never
    changes) and, on a Megatron-style config, what Megatron would not run. `kind`:
    frameworks.style(exp), computed once by the caller."""
    new = _changed(exp, changes)
    mb = (exp.workload.microbatches, new.workload.microbatches)
    per_rank = (_per_rank(exp), _per_rank(new))
    notes = []
    if exp.workload.kind != "train" and per_rank[0] != per_rank[1]:  # serving: one batch
        notes.append(f"batch {per_rank[0]} -> {per_rank[1]} sequences per data-parallel rank")
    elif per_rank[0] != per_rank[1]:
        kept = (f"microbatches {mb[0]} -> {mb[1]}" if mb[0] != mb[1] else
                f"microbatches kept at {mb[0]}")
        notes.append(f"micro-batch {per_rank[0]} -> {per_rank[1]} sequences per "
                     f"data-parallel rank, {kept}")
    elif mb[0] != mb[1]:
        notes.append(f"microbatches {mb[0]} -> {mb[1]}, micro-batch kept at {per_rank[0]} "
                     f"sequence{'s' if per_rank[0] > 1 else ''} per data-parallel rank")
    if notes:
        notes[-1] += f", global batch {exp.workload.global_batch} kept"
    kind = kind or style(exp)
    foreign = _foreign(changes, exp) if kind == "megatron" else ""
    return Suggestion(changes, memory, True, step, mb, per_rank,
                      tuple(notes) + ((foreign,) if foreign else ()))


def _changed(exp: Experiment, changes: dict) -> Experiment | None:
    """The experiment with `changes` applied, or None when the validator refuses it."""
    raw = copy.deepcopy(exp.to_dict())
    for key, value in changes.items():
        table, _, name = key.partition(".")
        raw.setdefault(table, {})[name] = list(value) if isinstance(value, tuple) else value
    try:
        return config_mod.rebuilt(exp, raw)
    except ConfigError:
        return None


def candidates(exp: Experiment, kind: str | None = None) -> list[dict]:
    """Single changes that may lower the memory per device, by knob (`kind`:
    frameworks.style(exp), computed when not given)."""
    w, t = exp.workload, exp.train
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
    return out + _moves(exp, kind or style(exp))


def _moves(exp: Experiment, kind: str) -> list[dict]:
    """Ways moved between mesh axes. On a Megatron-style config a move out of the batch
    axes keeps each data-parallel rank's micro-batch, as Megatron keeps --micro-batch-size
    and derives the number of microbatches (global batch / (micro-batch x data-parallel))."""
    w, par = exp.workload, exp.parallelism
    sizes, batch_axes = par.sizes(), par.axis_rules().mesh_axes("batch")
    megatron = kind == "megatron"
    out = []
    for src, dst in _MOVES[kind]:
        if dst == "pipeline" and w.kind != "train":
            continue
        # Megatron's tensor sizes are few (they divide the heads) and each one matters
        for k in _factors(sizes[src], every=megatron and dst == "tensor"):
            change = {f"parallelism.{src}": sizes[src] // k,
                      f"parallelism.{dst}": sizes[dst] * k}
            if megatron and w.kind == "train" and src in batch_axes and dst not in batch_axes:
                change["workload.microbatches"] = w.microbatches * k
            out.append(change)
    return out


def _factors(n: int, every: bool = False) -> list[int]:
    """Ways to move: the two fewest and the two most (all of them), so that a large data
    axis can move whole to FSDP as well as in part; `every`: each divisor."""
    ks = [k for k in range(2, n + 1) if n % k == 0]
    return ks if every else sorted(set(ks[:2] + ks[-2:]))


def _paired(exp: Experiment, a: dict, b: dict, kind: str) -> dict | None:
    """Two changes as one: two knobs side by side, or, on a Megatron-style config, two
    moves out of data parallelism to different axes (tensor x pipeline, as Megatron
    splits a model too large for one of them), each taking its ways from data."""
    if _knob(a) != _knob(b):
        return None if set(a) & set(b) else {**a, **b}
    if _knob(a) != "parallelism" or kind != "megatron":
        return None
    data, m = exp.parallelism.data, exp.workload.microbatches
    grown = [next(k for k in c if k.startswith("parallelism.") and k != "parallelism.data")
             for c in (a, b)]
    if "parallelism.data" not in a or "parallelism.data" not in b or grown[0] == grown[1]:
        return None
    ka, kb = data // a["parallelism.data"], data // b["parallelism.data"]
    if data % (ka * kb):
        return None
    out = {"parallelism.data": data // (ka * kb), grown[0]: a[grown[0]], grown[1]: b[grown[1]]}
    more = a.get("workload.microbatches", m) // m * b.get("workload.microbatches", m) // m
    return {**out, "workload.microbatches": m * more} if more > 1 else out


# Without a compile, parallelism moves are shown by what they add to the step: FSDP a
# gather of each layer's weights (overlapped), tensor parallelism collectives in every
# layer's critical path, pipeline parallelism a bubble. A Megatron-style config: its own
# model-parallel axes, context parallelism among them, then FSDP.
_DESTINATIONS = {"jax": ("fsdp", "tensor", "pipeline"),
                 "megatron": ("tensor", "pipeline", "sequence", "fsdp")}


def _destination(changes: dict, kind: str = "jax") -> int:
    order = _DESTINATIONS[kind]
    grown = [k.split(".", 1)[1] for k in changes if k.startswith("parallelism.")]
    return min((order.index(a) for a in grown if a in order), default=0)


def _order(exp: Experiment, size, kind: str):
    """The sort key of the changes shown without a compile (and compiled first)."""
    knobs = _MEGATRON_KNOBS if kind == "megatron" else _KNOBS

    def key(c: dict):
        foreign = kind == "megatron" and bool(_foreign(c, exp))
        return (foreign, knobs.index(_knob(c)) if _knob(c) in knobs else 9, len(c),
                _destination(c, kind), -size(c))
    return key


def _knob(changes: dict) -> str:
    key = next(iter(changes))
    return "parallelism" if key.startswith("parallelism.") else key


def search(exp: Experiment, *, limit: int = 3, compile: bool = True, backend: str = "cpu",
           calibration=None, budget: int = 400, kind: str | None = None) -> list[Suggestion]:
    """Changes that make the experiment fit, cheapest in step time first (compiled and
    estimated when `compile`; at most `limit` kept). `budget`: candidates sized at most
    (by the memory model, ~10 ms each: every single change and pair of ~20 singles).
    `kind`: frameworks.style(exp), computed here when not given."""
    kind = kind or style(exp)
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

    singles = candidates(exp, kind)
    # on a Megatron-style config a change Megatron runs is looked for (in pairs, then
    # stacked) while only changes it does not run fit
    megatron = kind == "megatron"

    def own(changes: Sequence[dict]) -> list[dict]:
        return [c for c in changes if not (megatron and _foreign(c, exp))]

    fitting = [c for c in singles if (size(c) or float("inf")) <= capacity]
    if not own(fitting):
        pairs = [p for a, b in itertools.combinations(singles, 2)
                 if (p := _paired(exp, a, b, kind)) is not None]
        fitting += [c for c in pairs if (size(c) or float("inf")) <= capacity]
    if not own(fitting):
        fitting += _greedy(own(singles), size, capacity) if megatron else []
    if not fitting:
        fitting = _greedy(singles, size, capacity)
    fitting.sort(key=_order(exp, size, kind))
    out = []
    for changes in fitting[:limit if not compile else 2 * limit]:
        step = None
        if compile:
            step = _step_time(_changed(exp, changes), backend, calibration)
            if step is None:
                continue
        out.append(_suggestion(exp, changes, size(changes), step, kind))
    if compile:
        # fastest first; on a Megatron-style config what Megatron runs before what it does
        # not, however fast
        out.sort(key=lambda s: (megatron and bool(_foreign(s.changes, exp)), s.step_time_s))
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
    style: str = "jax"  # frameworks.style: "megatron" ranks what Megatron runs first
    model: str = ""  # the model, in words (Experiment.model_label)

    def to_dict(self) -> dict:
        return {"name": self.name, "model": self.model or None, "system": self.system,
                "fits": self.fits, "style": self.style,
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
                 *([f"model: {self.model}"] if self.model else []),
                 f"memory per device ({self.source}):"]
        lines += [f"  {fmt_bytes(b):>10}  {p}" for p, b in
                  sorted(self.breakdown, key=lambda pb: -pb[1])]
        if self.compiler_bytes is not None:
            lines.append(f"  (the compiler's own figure: {fmt_bytes(self.compiler_bytes)}, "
                         f"{self.compiler_source})")
        lines += [f"  {n}" for n in self.notes]
        if not self.fits:
            order = ("each compiled and estimated, fastest first"
                     if any(s.step_time_s for s in self.suggestions) else "")
            if self.style == "megatron" and self.suggestions:
                order += ("; " if order else "") + ("as Megatron-LM runs it: tensor, pipeline, "
                                                    "context parallelism before FSDP")
            lines.append(f"to fit ({order}):" if order else "to fit:")
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
    kind = style(exp)
    # each suggestion compiled and timed by the same compiler as the verdict
    suggestions = () if fits else tuple(search(exp, limit=limit, compile=compile,
                                               backend=resolved, calibration=calibration,
                                               kind=kind))
    return Verdict(name=exp.name, model=exp.model_label, system=exp.system.label, fits=fits,
                   memory_per_device_bytes=memory.total_bytes, hbm_capacity_bytes=cap,
                   breakdown=(*memory.components, *memory.reserved), source=memory.source,
                   notes=(*refused, *memory.notes), suggestions=suggestions,
                   compiler_bytes=memory.compiler_bytes, compiler_source=memory.compiler_source,
                   style=kind)


def advice(exp: Experiment, calibration=None) -> tuple[str, ...]:
    """The run report's "to fit" lines (runner.run's `advise`): the search's changes, or
    why none is enough."""
    found = search(exp, calibration=calibration)
    if found:
        return tuple(s.describe() for s in found)
    need, cap = memory_of(exp).total_bytes, exp.system.chip.hbm_bytes
    return (f"no change the search tries is enough ({need / cap:.1f}x the HBM): shard over "
            f"more devices",)
