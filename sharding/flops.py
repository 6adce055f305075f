"""FLOPs and operand bytes of a dot, a convolution or a library GEMM call, as XLA's
HloCostAnalysis counts them."""

from __future__ import annotations

import json
import re

from sharding.dequant import LOW_PRECISION_MMA, dequant_read_bytes, dequant_source_dtype
from sharding.hlo import DTYPE_NAMES, ArrayShape, Computation, Instruction


def dot_flops(inst: Instruction, comp: Computation) -> tuple[float, str, float]:
    """(FLOPs, matmul dtype, HBM bytes of operands + output) of a dot, a convolution or a
    GEMM library call (`dataflow.is_gemm_call`: its output is the first of its tuple, its
    workspace not counted)."""
    out = inst.shapes
    if not out:
        return 0.0, "float32", 0.0
    out_elems = out[0].num_elements
    lhs = _operand_shape(comp, inst, 0)
    rhs = _operand_shape(comp, inst, 1)
    dtype = DTYPE_NAMES.get(lhs.dtype, lhs.dtype) if lhs else "float32"
    if len(inst.operands) >= 2:
        sources = {dequant_source_dtype(comp, o) for o in inst.operands[:2]}
        if len(sources) == 1 and (narrow := sources.pop()) in LOW_PRECISION_MMA:
            dtype = LOW_PRECISION_MMA[narrow]  # both operands block-scaled narrow floats
    io_bytes = out[0].hbm_bytes
    for i, shape in ((0, lhs), (1, rhs)):
        fused = dequant_read_bytes(comp, inst.operands[i]) if i < len(inst.operands) else None
        io_bytes += fused if fused is not None else (shape.hbm_bytes if shape else 0)
    if inst.opcode in ("dot", "custom-call"):
        contract = 1
        if lhs is not None:
            for d in _lhs_contracting_dims(inst):
                contract *= lhs.dims[d]
        return 2.0 * out_elems * contract, dtype, io_bytes
    if lhs is None or rhs is None:
        return 0.0, dtype, io_bytes
    return convolution_flops(inst, lhs, rhs, out[0]), dtype, io_bytes


def _lhs_contracting_dims(inst: Instruction) -> list[int]:
    """The left operand's contracting dimensions of a dot, or of a cuBLAS / cuBLASLt call
    from the `dot_dimension_numbers` of its backend_config (JSON; under
    `gemm_backend_config` in current XLA, at the top in older dumps)."""
    if inst.opcode == "dot":
        dims = (inst.attr("lhs_contracting_dims") or "").strip("{}").split(",")
        return [int(d) for d in dims if d.strip()]
    text = inst.attr("backend_config") or ""
    try:
        config = json.loads(json.loads(text) if text.startswith('"') else text)
    except ValueError:
        return []
    gemm = config.get("gemm_backend_config", config) if isinstance(config, dict) else {}
    numbers = gemm.get("dot_dimension_numbers") or {}
    return [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]


def convolution_flops(inst: Instruction, lhs: ArrayShape, rhs: ArrayShape,
                      out: ArrayShape) -> float:
    """FLOPs of an HLO convolution, counting only window positions that land on real input
    (not padding or dilation holes), as XLA's HloCostAnalysis does. The TPU compiler writes
    many einsums as convolutions whose padded windows are mostly empty."""
    labels = inst.attr("dim_labels") or ""
    m = re.match(r"([^_]+)_([^-]+)->(.+)", labels)
    if not m:
        return 2.0 * out.num_elements
    lhs_l, rhs_l, out_l = m.groups()
    window = _window(inst.attr("window") or "")
    spatial = sorted({ch for ch in lhs_l if ch.isdigit()})
    positions = 1
    for k, ch in enumerate(spatial):
        size_in = lhs.dims[lhs_l.index(ch)]
        size_out = out.dims[out_l.index(ch)]
        w = window.get("size", [1] * len(spatial))[k]
        stride = window.get("stride", [1] * len(spatial))[k]
        lhs_dil = window.get("lhs_dilate", [1] * len(spatial))[k]
        rhs_dil = window.get("rhs_dilate", [1] * len(spatial))[k]
        pad_lo = window.get("pad_lo", [0] * len(spatial))[k]
        valid = 0
        for o in range(size_out):
            for j in range(w):
                pos = o * stride + j * rhs_dil - pad_lo
                if pos >= 0 and pos % lhs_dil == 0 and pos // lhs_dil < size_in:
                    valid += 1
        positions *= valid
    in_features = lhs.dims[lhs_l.index("f")]
    out_features = rhs.dims[rhs_l.index("o")]
    batch = lhs.dims[lhs_l.index("b")]
    fgc = int(inst.attr("feature_group_count") or 1)
    bgc = int(inst.attr("batch_group_count") or 1)
    return 2.0 * (in_features / fgc) * out_features * (batch / bgc) * positions


def _window(text: str) -> dict[str, list[int]]:
    """`size=1x4 pad=0_0x3_3 stride=1x3 lhs_dilate=2x4` -> lists per spatial dim."""
    out: dict[str, list[int]] = {}
    for part in text.strip("{}").split():
        key, _, value = part.partition("=")
        if key == "pad":
            pads = [p.split("_") for p in value.split("x")]
            out["pad_lo"] = [int(p[0]) for p in pads]
        elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
            out[key] = [int(v) for v in value.split("x")]
    return out


def _operand_shape(comp: Computation, inst: Instruction, i: int) -> ArrayShape | None:
    if i >= len(inst.operands):
        return None
    src = comp.by_name.get(inst.operands[i])
    if src is None:
        return None
    shapes = src.shapes
    return shapes[0] if len(shapes) == 1 else None
