"""The Report: collectives with their links and times, compute, memory, step time.

Step time is the simulated schedule's (sharding/schedule.py: collectives overlap the
compute that does not need them), held within the bounds any schedule lands between:
perfect overlap, max(compute, each link's busy time), and none, compute + comm. Without a
schedule (a Report built by hand) it is compute + comm.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from meshes.calibration import IDENTITY, Calibration
from meshes.chips import FORMAT_LABELS, dtype_class
from meshes.power import Energy
from sharding.collectives import Collective, collective_dict
from sharding.compute import ComputeCost
from sharding.hlo import operation_of
from sharding.units import fmt_bytes

# The schedule's overlap is a model: exposed communication below this share of the step is
# within what the model can tell apart from perfect overlap, so such a step is not called
# communication-bound.
EXPOSED_COMM_SIGNIFICANT = 0.05
# Where a decode step's fixed cost per kernel comes from when it runs as a CUDA graph.
_GRAPH_LAUNCH = ("launches under CUDA graphs as serving engines replay decode, "
                 "measured on an H100: serving.cuda_graphs, docs/limits.md")
# Where a TPU step's fixed cost per kernel comes from: the chip runs its program's ops itself.
_PROGRAM_OP = ("a TPU op's own time, measured on TPU7x: the chip sequences its program's ops "
               "without a launch from the host; meshes/chips.py TPU_OP_S, docs/limits.md")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes per device, by component.

    Attributes:
        components: (what, bytes per device), e.g. ("parameters", 4.0e9).
        source: how the figures were obtained.
        compiler_bytes: the compiling backend's own peak figure, for reference, when it is
            not the one used (XLA:CPU upcasts bf16 temporaries to f32).
        host_bytes: what the compiled program keeps in host memory instead (activations
            offloaded by a remat policy); not HBM, not in the total.
    """

    components: tuple[tuple[str, float], ...]
    source: str
    compiler_bytes: float | None = None
    compiler_source: str = ""
    # What else a reader of the verdict needs (e.g. the JAX memory fraction a GPU run needs).
    notes: tuple[str, ...] = ()
    # What the runtime keeps on the device beside the program (meshes/reserves.py).
    reserved: tuple[tuple[str, float], ...] = ()
    host_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        """The program's bytes and the runtime's reserve."""
        return sum(b for _, b in (*self.components, *self.reserved))

    @property
    def program_bytes(self) -> float:
        return sum(b for _, b in self.components)

    @property
    def known(self) -> bool:
        """False for a bare HLO dump: no figures, so no verdict on fitting."""
        return bool(self.components)

    def largest(self, n: int = 4) -> list[tuple[str, float]]:
        """The n largest lines, the last of them the rest summed when there are more, so
        that the lines add up to the total."""
        lines = sorted((*self.components, *self.reserved), key=lambda c: -c[1])
        if len(lines) <= n:
            return lines
        rest = lines[n - 1:]
        return [*lines[:n - 1], (f"{len(rest)} more: " + ", ".join(w for w, _ in rest),
                                 sum(b for _, b in rest))]

    def to_dict(self) -> dict:
        return {"components": dict(self.components), "source": self.source,
                "compiler_bytes": self.compiler_bytes, "compiler_source": self.compiler_source,
                "total_bytes": self.total_bytes, "notes": list(self.notes),
                "reserved": dict(self.reserved), "host_bytes": self.host_bytes}


def host_transfer_time(nbytes: float, bytes_per_s: float | None) -> float:
    """Host transfers' time on their own link (0 when there are none or it is not timed)."""
    return nbytes / bytes_per_s if nbytes and bytes_per_s else 0.0


def step_time_bounds(compute_s: float, collectives, host_s: float = 0.0
                     ) -> tuple[float, float]:
    """Perfect overlap (compute, every link and the host link busy at once) and none."""
    per_link: dict[str, float] = defaultdict(float)
    for c in collectives:
        per_link[c.link or "none"] += c.total_time_s
    comm_s = sum(c.total_time_s for c in collectives)
    return max([compute_s, *per_link.values(), host_s]), compute_s + comm_s + host_s


def step_time(scheduled_s: float | None, compute_s: float, collectives,
              host_s: float = 0.0) -> float:
    """The simulated schedule's step held within its bounds (host transfers run on their
    own link, overlapped with the schedule: they show only where they outlast it), or no
    overlap at all without a schedule."""
    lo, hi = step_time_bounds(compute_s, collectives, host_s)
    if scheduled_s is None:
        return hi
    return min(max(scheduled_s, host_s, lo), hi)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    system: str
    num_devices: int
    compiler: str
    collectives: list[Collective]
    compute: ComputeCost
    memory: Memory
    hbm_capacity_bytes: float | None  # None: no system (untimed), so no HBM to fit in
    peak_flops_per_device: float
    model_flops_per_step: float | None = None
    # The chip's peak for each format the matmuls ran in, and bf16's (meshes/chips.py).
    peak_flops_by_dtype: dict[str, float] = dataclasses.field(default_factory=dict)
    # The fastest rate the step model times each of those formats' matmuls at
    # (Calibration.best_matmul_rate): the roof of `mfu_ceiling`.
    matmul_roof_by_dtype: dict[str, float] = dataclasses.field(default_factory=dict)
    tokens_per_step: float | None = None
    sequences_per_step: float | None = None  # for tokens/s per user when serving
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    unknown_ops: tuple[str, ...] = ()
    name: str = ""
    model: str = ""  # the model the step runs, in words ("" when the caller named none)
    scheduled_step_s: float | None = None  # from sharding.schedule; None: no overlap
    calibration: Calibration = IDENTITY  # the fitted efficiencies the times used
    # The fixed time per kernel where the step is replayed as a CUDA graph (a serving
    # engine's decode on a GPU: meshes.chips.CUDA_GRAPH_KERNEL_S), in place of the
    # calibration's kernel_overhead_s; None: the calibration's (or the chip's own).
    cuda_graph_kernel_s: float | None = None
    # The fixed time per kernel of a chip that sequences its compiled program's ops itself
    # (a TPU: meshes.chips.TPU_OP_S, a microbenchmark), in place of the calibration's
    # kernel_overhead_s; None: the calibration's.
    program_op_s: float | None = None
    system_family: str = ""  # for the calibration's best measured MFU
    # Activations moved to host memory and back (offload), per device and step, and the
    # host link's bandwidth (None: not in the catalog, the transfers are not timed).
    host_transfer_bytes: float = 0.0
    host_bytes_per_s: float | None = None
    placement: str = ""  # how the devices sit in the machine (System.placement)
    # What would make a step that does not fit in HBM fit, worked out by the caller.
    fit_advice: tuple[str, ...] = ()
    # The pipeline schedule the program runs (models.Pipeline.summary()), None without one.
    pipeline: dict | None = None
    # Why the HLO's compiler may not be the target's (sharding.compiler.target_compiler_note).
    compiler_note: str = ""
    # How the program was compiled on fewer devices than it runs on and read as the full
    # run's (sharding/extrapolate.py); "" when compiled at full size.
    extrapolated_from: str = ""
    # The step's power, energy and cost (meshes/power.py); None where no power figure is
    # public for the chip.
    energy: Energy | None = None
    # What the estimate was made from (sharding.api.AnalysisInputs), for re-timing it
    # without compiling; not part of the report's JSON.
    inputs: object = dataclasses.field(default=None, compare=False, repr=False)

    # --- time ----------------------------------------------------------------------
    @property
    def timed(self) -> bool:
        """False for a report on no system (sharding.api.untimed): bytes and counts only."""
        return bool(self.system)

    # The times below are None on an untimed report: nothing was timed, which 0.0 would hide.
    @property
    def compute_s(self) -> float | None:
        return self.compute.compute_s if self.timed else None

    @property
    def comm_s(self) -> float | None:
        return sum(c.total_time_s for c in self.collectives) if self.timed else None

    @property
    def step_time_s(self) -> float | None:
        """The simulated schedule's step (sharding.schedule) held within its bounds, or
        compute + comm without one."""
        if not self.timed:
            return None
        return step_time(self.scheduled_step_s, self.compute_s, self.collectives,
                         self.host_transfer_s)

    @property
    def pipeline_bubble_s(self) -> float | None:
        """Idle stage time: the bubble's share of the compiled ticks, which compute it
        (models/pipeline.py), applied to the compute time."""
        if self.pipeline is None or not self.timed:
            return None
        return self.pipeline["bubble"] * self.compute_s

    @property
    def host_transfer_s(self) -> float:
        """Time of the host transfers on their own link (0 when not timed)."""
        return host_transfer_time(self.host_transfer_bytes, self.host_bytes_per_s)

    @property
    def exposed_comm_s(self) -> float | None:
        """Communication the schedule could not hide behind compute."""
        return max(0.0, self.step_time_s - self.compute_s) if self.timed else None

    @property
    def step_time_bounds_s(self) -> tuple[float, float] | None:
        """Perfect overlap (compute, every link and the host link busy at once) and none at
        all."""
        if not self.timed:
            return None
        return step_time_bounds(self.compute_s, self.collectives, self.host_transfer_s)

    # --- throughput ----------------------------------------------------------------
    @property
    def tokens_per_s(self) -> float | None:
        if not self.timed or not self.tokens_per_step or self.step_time_s <= 0:
            return None
        return self.tokens_per_step / self.step_time_s

    @property
    def tokens_per_s_per_device(self) -> float | None:
        t = self.tokens_per_s
        return None if t is None else t / self.num_devices

    @property
    def tokens_per_s_per_user(self) -> float | None:
        t = self.tokens_per_s
        return None if t is None or not self.sequences_per_step else t / self.sequences_per_step

    @property
    def time_per_output_token_s(self) -> float | None:
        """A decode step's time: each sequence gets one token per step (None otherwise)."""
        if not self.sequences_per_step or self.tokens_per_step != self.sequences_per_step:
            return None
        return self.step_time_s

    @property
    def mfu(self) -> float | None:
        """Model FLOPs (the HLO's matmul FLOPs without a count) per second over the peak."""
        if not self.timed or self.step_time_s <= 0:
            return None
        return self._flops() / (self.step_time_s * self.num_devices * self.peak_flops_per_device)

    @property
    def mfu_bf16(self) -> float | None:
        """MFU against the bf16 peak, whatever format the matmuls run in."""
        return self._mfu_at({"bfloat16": 1.0})

    @property
    def mfu_format(self) -> float | None:
        """MFU against each matmul format's peak, the model FLOPs split over the formats as
        the step's matmul FLOPs are (NVFP4: FP4 projections, bf16 attention)."""
        return self._mfu_at(self.matmul_flops_by_format or {"bfloat16": 1.0})

    @property
    def matmul_flops_by_format(self) -> dict[str, float]:
        """Each matmul format's share of the step's matmul FLOPs."""
        total = self.compute.matmul_flops
        return {d: f / total for d, f in self.compute.flops_by_dtype.items() if f and total}

    def _mfu_at(self, shares: dict[str, float]) -> float | None:
        if not self.timed or self.step_time_s <= 0 or not self.peak_flops_by_dtype:
            return None
        at_peak_s = self._flops() * sum(s / self.peak_flops_by_dtype[d] for d, s in shares.items())
        return at_peak_s / (self.step_time_s * self.num_devices)

    def _flops(self) -> float:
        f = self.model_flops_per_step
        return self.compute.matmul_flops * self.num_devices if f is None else f

    # --- memory --------------------------------------------------------------------
    @property
    def memory_per_device_bytes(self) -> float:
        return self.memory.total_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the step fits in HBM; None without a verdict: no system (no HBM to fit
        in) or no memory figures (a bare HLO dump)."""
        if not self.timed or not self.memory.known or self.hbm_capacity_bytes is None:
            return None
        return self.memory_per_device_bytes <= self.hbm_capacity_bytes

    # --- breakdowns ----------------------------------------------------------------
    def by_kind(self) -> dict[str, int]:
        """Bytes per step by collective kind (bytes x count, summed)."""
        out: dict[str, int] = defaultdict(int)
        for c in self.collectives:
            out[c.kind] += c.total_bytes
        return dict(out)

    def by_link(self) -> dict[str, dict[str, float]]:
        """Per link class: bytes, what each device sends over it, and time."""
        out: dict[str, dict[str, float]] = {}
        for c in self.collectives:
            d = out.setdefault(c.link or "none", {"bytes": 0, "wire_bytes": 0.0, "time_s": 0.0})
            d["bytes"] += c.total_bytes
            in_switch = c.kind == "all-reduce" and (c.algorithm or "").split(" ")[0].rstrip(
                ",") in ("nvls", "sharp")
            # NVLink SHARP and in-network reduction: the switch sums, each device sends its
            # buffer once (a ring sends it twice over, 2(n - 1)/n); across domains or slices
            # the share of it that crosses the link (the rest moves inside them)
            sent = c.wire_bytes * c.link_share if c.link_share != 1.0 else (
                c.bytes if in_switch else c.wire_bytes)
            d["wire_bytes"] += sent * c.count
            d["time_s"] += c.total_time_s
        return out

    def rows(self) -> list[dict]:
        """The report's collective rows: collectives summed by (kind, mesh axes, link,
        algorithm), slowest first."""
        rows: dict[tuple, dict] = {}
        for c in self.collectives:
            key = (c.kind, c.mesh_axes, c.link, c.algorithm)
            r = rows.setdefault(key, {"kind": c.kind, "mesh_axes": c.mesh_axes, "link": c.link,
                                      "algorithm": c.algorithm, "bytes": 0, "count": 0,
                                      "time_s": 0.0, "ops": set()})
            r["bytes"] += c.total_bytes
            r["count"] += c.count
            r["time_s"] += c.total_time_s
            if c.op_name:
                r["ops"].add(operation_of(c.op_name))
        return sorted(rows.values(), key=lambda r: -r["time_s"])

    def by_operation(self) -> list[dict]:
        """Collectives by the model operation that caused them, slowest first."""
        rows: dict[tuple, dict] = {}
        for c in self.collectives:
            key = (operation_of(c.op_name), c.kind, c.mesh_axes, c.link)
            r = rows.setdefault(key, {"operation": key[0], "kind": c.kind,
                                      "mesh_axes": list(c.mesh_axes), "link": c.link,
                                      "bytes": 0, "count": 0, "time_s": 0.0})
            r["bytes"] += c.total_bytes
            r["count"] += c.count
            r["time_s"] += c.total_time_s
        return sorted(rows.values(), key=lambda r: -r["time_s"])

    def bottleneck(self) -> str:
        """The narrowest pipe, in words: HBM capacity when the step does not fit, else what
        limits its time."""
        if self.fits is False:
            return (f"HBM capacity: needs {fmt_bytes(self.memory_per_device_bytes)} per "
                    f"device, has {fmt_bytes(self.hbm_capacity_bytes)}")
        return self.time_bottleneck()

    def time_bottleneck(self) -> str:
        """What limits the step's time (as if it fit), in words."""
        if not self.timed:
            return "untimed: no system given"
        step = self.step_time_s
        if step <= 0:
            return "nothing to run"
        rows = self.rows()
        worst = rows[0] if rows else None
        cost = self.compute
        hbm_s = cost.hbm_bound_matmul_s + cost.memory_bound_s
        math_s = cost.matmul_s - cost.hbm_bound_matmul_s
        if worst is not None and worst["time_s"] > max(hbm_s, math_s) and \
                self.exposed_comm_s > EXPOSED_COMM_SIGNIFICANT * step:
            axes = ",".join(worst["mesh_axes"]) or "?"
            return (f"communication: {worst['kind']} over {worst['link']} on axis {axes} "
                    f"takes {worst['time_s'] / step:.0%} of the step; "
                    f"{self.exposed_comm_s / step:.0%} of the step is exposed communication")
        graphs = self.cuda_graph_kernel_s is not None
        # where a measured fixed cost per kernel comes from (None: the calibration's fit)
        measured = _GRAPH_LAUNCH if graphs else \
            _PROGRAM_OP if self.program_op_s is not None else None
        if cost.overhead_s > 0.5 * (hbm_s + math_s) and cost.kernels:
            # The fixed cost per kernel outweighs the kernels' own bytes and FLOPs: many
            # small kernels (decode), which HBM bandwidth would not speed up.
            origin = ""
            if measured:
                origin = f" ({measured})"
            elif self.time_per_output_token_s is not None and \
                    self.system_family != "host-cpu":
                # the figure a decode step stands on: say where it comes from
                origin = ("; that cost is fitted on GPU training steps: a serving engine "
                          "replaying CUDA graphs (serving.cuda_graphs, GPU systems) may pay "
                          "less (docs/limits.md)")
            return (f"kernel count: {cost.kernels:,.0f} kernels at "
                    f"{cost.overhead_s / cost.kernels * 1e6:.1f} us fixed cost each are "
                    f"{cost.overhead_s / step:.0%} of the step, their bytes and FLOPs "
                    f"{(hbm_s + math_s - cost.overhead_s) / step:.0%}{origin}")
        # Each class's own bytes or FLOPs, its kernels' fixed cost said apart when it counts
        # (always in a decode step whose cost per kernel is measured: the figure it stands on)
        hbm_s -= cost.overhead_s - cost.math_overhead_s
        math_s -= cost.math_overhead_s
        said = graphs or (measured and self.time_per_output_token_s is not None)
        fixed = ""
        if cost.kernels and (said or cost.overhead_s >= 0.1 * step):
            fixed = (f"; the {cost.kernels:,.0f} kernels' fixed cost "
                     f"{cost.overhead_s / step:.0%}")
            if measured:
                fixed += (f" ({cost.overhead_s / cost.kernels * 1e6:.1f} us each: "
                          f"{measured})")
        if hbm_s >= math_s:
            return (f"HBM bandwidth: bandwidth-bound work (matmuls streaming their weights or "
                    f"KV cache, and memory-bound kernels) is {hbm_s / step:.0%} of the "
                    f"step{fixed}")
        # the rate most of the matmul time runs at, said with where it comes from
        by_class: dict[str, float] = {}
        for key, t in cost.math_s_by_class.items():
            by_class[key.partition("/")[0]] = by_class.get(key.partition("/")[0], 0.0) + t
        rate = "the chip's math rate"
        if by_class:
            rate = self.calibration.rate_phrase(max(by_class, key=by_class.get))
        return f"compute: matmuls are {math_s / step:.0%} of the step, at {rate}{fixed}"

    def slowest_hop(self) -> str | None:
        """The link class that moves this program's bytes slowest: the lowest achieved
        bandwidth per device (wire bytes / time, over all its collectives), with the
        collective row that spends the most time on it."""
        links = self.by_link()
        rates = {k: d["wire_bytes"] / d["time_s"] for k, d in links.items() if d["time_s"] > 0}
        if not rates:
            return None
        link = min(rates, key=rates.get)
        top = next(g for g in self.rows() if g["link"] == link)
        axes = ",".join(top["mesh_axes"]) or "?"
        return (f"{link} at {rates[link] / 1e9:.1f} GB/s sent per device over all "
                f"its links (`systems` lists one link, one direction); most of its time: "
                f"{top['kind']} over {axes} ({top['algorithm']})")

    def slowest_link(self) -> str | None:
        if not self.timed:  # no links: nothing was placed on the system's network
            return None
        links = self.by_link()
        return max(links, key=lambda k: links[k]["time_s"]) if links else None

    @property
    def format_family(self) -> str:
        """The system family and the format most matmul FLOPs run in, as `shardscope
        validate` groups runs ("gb200-nvl72 fp4")."""
        formats = self.matmul_flops_by_format or {"bfloat16": 1.0}
        top = dtype_class(max(formats, key=formats.get))
        return f"{self.system_family} {FORMAT_LABELS.get(top, top)}"

    @property
    def mfu_ceiling(self) -> float | None:
        """The highest MFU this step could have if its matmuls did no more than the model
        FLOPs, each at the fastest rate the step model times its format at on this chip
        (Calibration.best_matmul_rate: the microbenchmarked GEMM at its best size, times
        the calibration), in the shares of the step's matmul formats; None untimed."""
        shares = self.matmul_flops_by_format or {"bfloat16": 1.0}
        if not self.timed or not all(self.matmul_roof_by_dtype.get(d) for d in shares):
            return None
        at_roof = sum(s / self.matmul_roof_by_dtype[d] for d, s in shares.items())
        return 1 / (self.peak_flops_per_device * at_roof)

    def suspect_mfu(self) -> str | None:
        """Why the estimated MFU is suspect: above `mfu_ceiling`, which no step reaches
        unless its matmuls count fewer FLOPs than the model's (the compute model left out
        work the run does). The best MFU a measured run reached on the system family and
        matmul format (the calibration's) is said beside it, for scale: it is no ceiling,
        since a better sharding than any measured run is what the tool is for."""
        ceiling = self.mfu_ceiling
        if self.mfu is None or ceiling is None or self.mfu <= ceiling:
            return None
        shares = self.matmul_flops_by_format or {"bfloat16": 1.0}
        rates = ", ".join(f"{FORMAT_LABELS.get(dtype_class(d), d)} "
                          f"{self.matmul_roof_by_dtype[d] / 1e12:,.0f} TFLOP/s"
                          for d in sorted(shares, key=lambda d: -shares[d]))
        key = self.format_family
        best = self.calibration.best_mfu.get(key)
        if best is None:
            key = self.system_family
            best = self.calibration.best_mfu.get(key)
        measured = "" if best is None else \
            f"; the best measured on {key}: {best[0]:.1%} ({best[1]})"
        return (f"estimated MFU {self.mfu:.1%} is above {ceiling:.1%}, the most this chip's "
                f"matmuls allow (model FLOPs at the fastest rate the model times them: "
                f"{rates}){measured}: suspect -- the step counts fewer matmul FLOPs than "
                f"the model; check the compute model for this program (it may leave out "
                f"work the run does)")

    def calibration_features(self) -> dict:
        """The step decomposed by what each calibration parameter scales, at the
        uncalibrated rates, for fitting (experiments/calibrate.py): the math time of the
        math-bound matmuls by rate class (and inside flash attention or not), the kernels
        run (none under CUDA graphs, whose launches no fit scales), the rest of compute
        (memory-bound kernels, HBM-bound matmuls) and the communication the schedule left
        exposed."""
        cal, c = self.calibration, self.compute
        math_s = {}
        for key, t in c.math_s_by_class.items():
            rate_class, _, attention = key.partition("/")
            factor = cal.rate_factor(rate_class)
            if attention:
                factor *= cal.attention_factor(rate_class)
            math_s[key] = t * factor
        # kernels whose fixed cost is measured (a TPU's op, a CUDA graph's launch) are not
        # the fit's: their cost stays in the rest of compute
        fitted = self.program_op_s is None and self.cuda_graph_kernel_s is None
        return {"math_s": math_s, "kernels": c.kernels if fitted else 0.0,
                "other_s": self.compute_s - sum(c.math_s_by_class.values())
                - (c.overhead_s if fitted else 0.0),
                "exposed_s": self.step_time_s - self.compute_s}

    # --- output --------------------------------------------------------------------
    def to_dict(self, *, groups: bool = True) -> dict:
        """JSON-ready. groups=False keeps each collective's first replica group only (with
        `group_count`): at thousands of devices the groups are most of the file."""
        bounds = self.step_time_bounds_s
        e = self.energy
        cost, timed = self.compute, self.timed  # an untimed report costs no work
        return {
            "name": self.name,
            "model": self.model or None,
            "system": self.system,
            "placement": self.placement,
            "num_devices": self.num_devices,
            "compiler": self.compiler,
            "compiler_note": self.compiler_note,
            "extrapolated_from": self.extrapolated_from or None,
            "step_time_s": self.step_time_s,
            "step_time_bounds_s": None if bounds is None else list(bounds),
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "tokens_per_s_per_user": self.tokens_per_s_per_user,
            "time_per_output_token_s": self.time_per_output_token_s,
            "mfu": self.mfu,
            "mfu_bf16": self.mfu_bf16,
            "mfu_format": self.mfu_format,
            "matmul_flops_by_format": self.matmul_flops_by_format,
            "compute_s": self.compute_s,
            "matmul_s": cost.matmul_s if timed else None,
            "memory_bound_s": cost.memory_bound_s if timed else None,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "flops_per_device": cost.flops if timed else None,
            "matmul_flops_per_device": cost.matmul_flops if timed else None,
            "model_flops_per_step": self.model_flops_per_step,
            "memory_per_device_bytes": self.memory_per_device_bytes,
            "memory": self.memory.to_dict(),
            "hbm_capacity_bytes": self.hbm_capacity_bytes,
            "hbm_bytes": cost.hbm_bytes if timed else None,
            "fits": self.fits,
            "power_w": e.power_w if e else None,
            "energy_per_step_j": e.energy_per_step_j if e else None,
            "joules_per_token": e.joules_per_token if e else None,
            "usd_per_million_tokens": e.usd_per_million_tokens if e else None,
            "power": e.to_dict() if e else None,
            "collectives": [collective_dict(c, groups) for c in self.collectives],
            "by_kind": self.by_kind(),
            "by_link": self.by_link(),
            "by_operation": self.by_operation(),
            "bottleneck": self.bottleneck(),
            "time_bottleneck": self.time_bottleneck(),
            "fit_advice": list(self.fit_advice),
            "slowest_link": self.slowest_link(),
            "slowest_hop": self.slowest_hop(),
            "timings": dict(self.timings),
            "warnings": list(self.warnings),
            "suspect_mfu": self.suspect_mfu(),
            "mfu_ceiling": self.mfu_ceiling,
            "host_transfer_bytes": self.host_transfer_bytes,
            "host_transfer_s": self.host_transfer_s if self.host_bytes_per_s and self.timed
            else None,
            "calibration": self.calibration.summary(),
            "cuda_graph_kernel_s": self.cuda_graph_kernel_s,
            "program_op_s": self.program_op_s,
            "unknown_ops": list(self.unknown_ops),
            "pipeline": None if self.pipeline is None else {
                **self.pipeline, "bubble_s": self.pipeline_bubble_s},
        }

    def format_table(self) -> str:
        from sharding.text import format_report

        return format_report(self)

