"""The one record an estimate is made from: `AnalysisInputs`.

Everything a Report says comes from it and from the system it is timed on: the program as
read (sharding/plan.py) with where its devices sit, which compiler made it, and what the
caller knows of the step (memory, model FLOPs, tokens, the pipeline, offload, advice).
`sharding.api.estimate` turns it into a Report once; `analyze` builds it from a compile,
`reanalyze` re-times a stored one. It is JSON-ready but for the HLO text and the plan, so
that a search keeps it with every compiled program.
"""

from __future__ import annotations

import dataclasses

from sharding.plan import Plan
from sharding.report import Memory


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnalysisInputs:
    """What a step is estimated from.

    Attributes:
        hlo_text: the program's HLO (may be "" when `plan` is given).
        mesh_shape, axis_names: the mesh the program was partitioned over.
        device_ids: the system device id of each mesh position (row-major); () for mesh
            order.
        compiler: the compiler that made the HLO, in words (sharding.compiler.compiler_name).
        compiler_note: why that compiler may not be the target's ("" when it is).
        extrapolated_from: how a program compiled on fewer devices is read as this run
            (sharding/extrapolate.py); "" when compiled at full size. The report adds the
            system it is timed on.
        memory: memory per device (the caller's model, with the compiler's figure).
        compute_dtype: the matmuls' format, for their peak rate.
        model_flops_per_step, tokens_per_step, sequences_per_step: for MFU and throughput.
        warnings: the caller's and the compiler's, in that order.
        name: what the step is called (an experiment's name).
        model: the model it runs, in words, for the report's header ("" for none named).
        host_transfer_bytes: activations offloaded to host memory and back, per device and
            step.
        pipeline: the pipeline schedule the program runs (models.Pipeline.summary()).
        fit_advice: what would make a step that does not fit in HBM fit.
        tp_comm_overlap: GPU systems: the tensor-parallel all-gathers and reduce-scatters
            overlap the GEMM they feed or follow (Transformer Engine's userbuffers).
        overlap_grad_reduce, overlap_param_gather: GPU systems: the data-parallel
            gradient sum and parameter all-gather in chunks beside the loops (Megatron's).
        bucket_size: GPU systems: parameters per gradient bucket; 0: Megatron's default.
        overlap_p2p_comm: GPU systems: an interleaved pipeline's stage transfers beside
            other microbatches' compute, but in its warm-up and flush (Megatron's).
        gradient_buckets: GPU systems: small data-parallel gradient sums ride in Megatron's
            gradient buckets (a framework's training step, not any function).
        cuda_graphs: GPU systems: the step is replayed as a CUDA graph, as serving engines
            run decode: each kernel's fixed time is the launch under CUDA graphs
            (meshes.chips.CUDA_GRAPH_KERNEL_S), not the calibration's fit on training steps.
        timings: the stages already timed (build, lower, compile, parse, read).
        plan: the program as read; re-timing from it skips reading the HLO.
    """

    hlo_text: str = ""
    mesh_shape: tuple[int, ...] = ()
    axis_names: tuple[str, ...] = ()
    device_ids: tuple[int, ...] = ()
    compiler: str = ""
    compiler_note: str = ""
    extrapolated_from: str = ""
    memory: Memory | None = None
    compute_dtype: str | None = None
    model_flops_per_step: float | None = None
    tokens_per_step: float | None = None
    sequences_per_step: float | None = None
    warnings: tuple[str, ...] = ()
    name: str = ""
    model: str = ""
    host_transfer_bytes: float = 0.0
    pipeline: dict | None = None
    fit_advice: tuple[str, ...] = ()
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: int = 0
    overlap_p2p_comm: bool = False
    gradient_buckets: bool = False
    cuda_graphs: bool = False
    timings: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)
    plan: Plan | None = None

    _TUPLES = ("mesh_shape", "axis_names", "device_ids", "warnings", "fit_advice")

    def __post_init__(self):
        for name in self._TUPLES:
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("hlo_text", "memory", "plan", "timings")}
        m = self.memory
        d["memory"] = None if m is None else {
            "components": [list(c) for c in m.components], "source": m.source,
            "compiler_bytes": m.compiler_bytes, "compiler_source": m.compiler_source,
            "notes": list(m.notes), "reserved": [list(r) for r in m.reserved]}
        return d

    @classmethod
    def from_dict(cls, d: dict, hlo_text: str, plan: Plan | None = None) -> AnalysisInputs:
        m = d.get("memory")
        memory = None if m is None else Memory(
            components=tuple((w, b) for w, b in m["components"]), source=m["source"],
            compiler_bytes=m["compiler_bytes"], compiler_source=m["compiler_source"],
            notes=tuple(m.get("notes", ())),
            reserved=tuple((w, b) for w, b in m.get("reserved", ())))
        known = {f.name for f in dataclasses.fields(cls)}
        # a record stored before the field was the experiment runner's, which bucketed
        d = {"gradient_buckets": True, **d}
        return cls(hlo_text=hlo_text, memory=memory, plan=plan,
                   **{k: v for k, v in d.items() if k != "memory" and k in known})
