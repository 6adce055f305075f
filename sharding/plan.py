"""What the estimate needs of a compiled program, whatever system it is timed on.

Reading a module (parsing it, finding its collectives and replica groups, forming the
kernels the target compiler would, counting loop trips, wiring the schedule) does not depend
on the chip, the links or the calibration; timing it does. A `Plan` is the first half: built
once from the parsed module, it is all that `sharding.api` times. The search keeps it with
each compiled program so that a new calibration, or another system with the same device
count, re-times thousands of stored programs in milliseconds each without reading their
HLO again (`sharding.reanalyze`).
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import zlib
from collections.abc import Sequence

from sharding import loops
from sharding.collectives import Collective, extract_collectives
from sharding.compute import Work, work
from sharding.hlo import HloModule
from sharding.schedule import Graph, schedule_graph

# Bumped whenever a Plan's fields or their meaning change, how its work is read from the HLO
# too (3: a stage's vmapped weight slice, reductions' combiners, fused gradient sums; 4:
# collectives over one-member groups dropped, reduce-scatter shapes by their scatter
# dimension, all-reduces sliced through views or tuples read as reduce-scatters, sums over
# size-1 dimensions as views, slices only a collective reads as read in place, a layer
# scan's collectives named by their readers): a stored plan of another format is rebuilt
# from its HLO instead.
PLAN_FORMAT = 4


@dataclasses.dataclass(frozen=True)
class Plan:
    """A compiled program, read: per-device work per computation, execution counts, the
    collectives (untimed) and the schedule graph, with the notes reading it gave."""

    num_partitions: int
    counts: dict[str, int]
    work: dict[str, Work]
    graph: Graph
    collectives: tuple[Collective, ...]
    unknown_ops: tuple[str, ...]
    notes: tuple[str, ...]
    format: int = PLAN_FORMAT

    def to_bytes(self) -> bytes:
        return zlib.compress(pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL), 1)

    @staticmethod
    def from_bytes(blob: bytes | None) -> Plan | None:
        """The stored plan, or None when there is none or it is of another format (an
        older shardscope wrote it): the caller then reads the HLO again."""
        if not blob:
            return None
        try:
            plan = pickle.loads(zlib.decompress(blob))
        except Exception:  # noqa: BLE001 - a plan of another version: rebuild it
            return None
        if not isinstance(plan, Plan) or plan.format != PLAN_FORMAT:
            return None
        return plan


def build_plan(module: HloModule, *, mesh_shape: Sequence[int] = (),
               axis_names: Sequence[str] = ()) -> Plan:
    """Read a parsed per-device module once: everything the timing needs."""
    collectives, unknown = extract_collectives(module, mesh_shape=mesh_shape,
                                               axis_names=axis_names)
    works = work(module)
    keep = {name: w.timed_names() for name, w in works.items()}
    for c in collectives:
        keep.setdefault(c.computation, set()).add(c.name)
    return Plan(
        num_partitions=module.num_partitions,
        counts=dict(loops.execution_counts(module)),
        work=works,
        graph=schedule_graph(module, keep),
        collectives=tuple(collectives),
        unknown_ops=tuple(unknown),
        notes=(*loops.notes(module), *_remat_note(module)),
    )


_COMPILER_REMAT = re.compile(r"\.remat\d*$")


def _remat_note(module: HloModule) -> tuple[str, ...]:
    """The target compiler's own rematerialisation (XLA:GPU's HLO rematerialisation pass
    names its copies `*.remat`, `*.remat2`, ...): it recomputes when the program would not
    fit in HBM otherwise, and the extra work is in the estimate."""
    names = [i for comp in module.computations.values() for i in comp.instructions
             if i.opcode in ("fusion", "dot", "custom-call") and _COMPILER_REMAT.search(i.name)]
    if not names:
        return ()
    return (f"the compiler rematerialised {len(names)} kernels (recomputed to fit in HBM; "
            f"e.g. {names[0].name}): their work is in the estimate; more remat or sharding in "
            f"the config would control it",)
