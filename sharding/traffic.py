"""HBM traffic of the memory-bound kernels the target compiler forms.

The HLO read on the CPU path is the module right after SPMD partitioning, before any
fusion, and XLA:CPU's own fusion decisions are not the TPU's or GPU's; so the model fuses
as those compilers do, to first order: connected producer-consumer regions of elementwise,
convert, transpose and data-movement ops form one kernel each; a reduction ends a kernel
(its consumers start a new one, as XLA's GPU and TPU emitters do); matmuls, collectives and
loop boundaries are kernel boundaries. A kernel reads each distinct value entering it once
and writes each value leaving it once. Slices read only what they keep, and
dynamic-update-slice / scatter write only their update (they work in place), and so does
an add of one into zeros (`acc + dynamic-update-slice(0, u, i)`, what autodiff makes of a
slice read in a loop), which XLA's algebraic simplifier rewrites into an in-place
`dynamic-update-slice(acc, dynamic-slice(acc, i) + u, i)`. Broadcasts,
reshapes and bitcasts are views: they cost nothing, and a broadcast's input is what is
read. Before scheduling (the post-SPMD module) a `copy` is a sharding annotation that copy
elision removes later: it costs nothing either. A slice of a stacked array that only
matmuls read (a layer's weights, its KV cache) is read by the matmul.

Already-fused HLO (TPU/GPU final modules): each `fusion` instruction is a kernel; its
operands and outputs are its HBM traffic, less what it only slices or updates in place.

Ops under the named scope `flash_attention` stand for a fused attention kernel whose
intermediates (the S x S scores) stay in on-chip memory.

On GPU systems (`gpu_kernels`), kernels are what the GPU training frameworks run: the ops
under a fused-kernel scope (norm, activation, RoPE, quantise, cross-entropy:
sharding/kernel_scopes.py) form that kernel, reductions included, and a quantise joins the
norm or activation that feeds it; an FP8 / FP4 GEMM's output scale and cast are its
epilogue, and so is the weight gradients' accumulation across pipeline ticks and
micro-steps (Megatron's gradient_accumulation_fusion); a layer scan's stacking of a
per-layer value, and its slices of stacked arrays, move no bytes of their own (the
framework keeps a saved tensor where its producer wrote it, and its readers read it there).
"""

from __future__ import annotations

import bisect
import itertools
import math

from sharding.dataflow import (
    IN_PLACE_OPS,
    MATMUL_OPS,
    SLICE_OPS,
    collective_reads_in_place,
    feeds_only_matmuls,
    fused_computation,
    is_collective,
    is_matmul,
    is_view,
    read_bytes,
    shapes_of,
    through_views,
    users_through_views,
)
from sharding.dequant import dequant_ops
from sharding.hlo import Computation, HloModule, Instruction
from sharding.kernel_scopes import GEMM_EPILOGUE, fuses, scope_key

# Ops that move no data of their own (views, bookkeeping, control).
FREE_OPS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "reshape", "broadcast",
    "iota", "partition-id", "replica-id", "after-all", "while", "call", "conditional",
    "opt-barrier", "custom-call", "domain", "add-dependency", "copy-start", "copy-done",
})


FUSED_KERNEL_SCOPE = "flash_attention"
# Decode attention over the KV cache: served by a fused kernel (vLLM's paged attention,
# JetStream's ragged attention) that reads the cache once and keeps the scores on chip.
# On an unfused module its elementwise ops are not kernels of their own and its matmuls
# move only what enters or leaves the scope (sharding/compute.py); a compiler's own
# fusions are taken as they are.
DECODE_ATTENTION_SCOPE = "kv_cache_attention"


REDUCTION_OPS = frozenset({"reduce", "reduce-window"})


def is_memory_op(inst: Instruction, comp: Computation | None = None) -> bool:
    op = inst.opcode
    if op in FREE_OPS or op in MATMUL_OPS or is_collective(op) or op.endswith(("-start", "-done")):
        return False
    if comp is not None and is_view(inst, comp):
        return False
    if comp is not None and inst.name in dequant_ops(comp):
        return False  # fused into the matmul's operand load
    if op in ("slice", "dynamic-slice", "transpose") and comp is not None \
            and feeds_only_matmuls(comp, inst):
        # Read by the matmul from where it lies, its operand bytes counting it: a layer's
        # weights (or KV cache) sliced out of the stacked array by the loop index, and a
        # transpose folded into the operand (XLA's transpose folding, a GEMM's transposed-
        # operand flag; a one-device program is read before XLA's simplifier folds them:
        # a 70B decode step transposed its out_proj weights, 268 MB a layer).
        return False
    if comp is not None and collective_reads_in_place(comp, inst):
        return False
    if FUSED_KERNEL_SCOPE in inst.op_name:
        return False
    return True


def kernels(
    comp: Computation, module: HloModule | None = None, *, final: bool = True,
    gpu_kernels: bool = False,
) -> list[tuple[float, float, list[Instruction]]]:
    """(HBM bytes, elements written, member instructions) of each fused kernel the target
    compiler would form; `gpu_kernels`: those a GPU framework runs (the module's
    docstring)."""
    by_name = comp.by_name
    members = [i for i in comp.instructions if is_memory_op(i, comp)
               and (final or i.opcode != "copy" or gpu_kernels and _copies_a_kernel(comp, i))
               and (final or DECODE_ATTENTION_SCOPE not in i.op_name)
               and not _slice_for_matmuls(module, comp, i)
               and not (gpu_kernels and (_read_in_place(comp, i) or _stacks(i)
                                         or _in_epilogue(comp, i)))]
    if gpu_kernels:
        fused_away = _accumulated_by_gemm(comp, members)
        members = [i for i in members if i.name not in fused_away]
    if not members:
        return []
    is_member = {i.name for i in members}
    parent = {name: name for name in is_member}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for inst in members:
        if inst.opcode == "fusion":
            continue  # a compiler-made kernel stays on its own
        for o in inst.operands:
            src = by_name.get(through_views(comp, o))
            if src is None or src.name not in is_member or src.opcode == "fusion":
                continue
            if gpu_kernels and not _one_gpu_kernel(comp, src, inst):
                continue
            if src.opcode in REDUCTION_OPS and not (gpu_kernels and scope_key(src.op_name)):
                continue  # a reduction ends its kernel; its consumers start another
            a, b = find(src.name), find(inst.name)
            if a != b:
                parent[a] = b

    regions: dict[str, list[Instruction]] = {}
    for inst in members:
        regions.setdefault(find(inst.name), []).append(inst)
    return [(*_kernel_traffic(comp, region, module), region) for region in regions.values()]


def _one_gpu_kernel(comp: Computation, src: Instruction, inst: Instruction) -> bool:
    """Whether `src` and its user `inst` are one kernel where a GPU framework's fused
    kernels run: both in one fused scope call (sharding/kernel_scopes.py), both outside
    every one (the compiler's fusion), or a fused kernel's output written in place into a
    stacked array (a layer's residual saved for its backward pass)."""
    ks, ki = _key(comp, src), _key(comp, inst)
    if ks is None and ki is None:
        return True
    return fuses(ks, ki) or (ki is None and inst.opcode in IN_PLACE_OPS)


_EPILOGUE_OPS = frozenset({"multiply", "divide", "convert", "reduce-precision"})


def _in_epilogue(comp: Computation, inst: Instruction, depth: int = 0) -> bool:
    """A scale or cast of a matmul's output that nothing else reads (an FP8 / FP4 GEMM's
    f32 result times its per-tensor scales, cast to bf16): the GEMM's epilogue does it
    (cuBLASLt's alpha and output type), not a kernel of its own."""
    if f"/{GEMM_EPILOGUE}/" in inst.op_name:
        return True  # marked by the model (kernel_scopes.GEMM_EPILOGUE)
    if inst.opcode not in _EPILOGUE_OPS or depth > 4:
        return False
    chain = [o for o in inst.operands if read_bytes(comp, o) > 8]  # not a scalar's broadcast
    src = comp.by_name.get(through_views(comp, chain[0])) if len(chain) == 1 else None
    if src is None or len(users_through_views(comp, src.name)) != 1:
        return False
    return is_matmul(src) or _in_epilogue(comp, src, depth + 1)


def _accumulated_by_gemm(comp: Computation, members: list[Instruction]) -> set[str]:
    """A loop's accumulation of weight gradients into its loop-carried sum: the carried
    sum plus what an inner loop (the layers' scan, which stacks each layer's weight
    gradient) returns, placed into zeros (a pipeline tick's chunk: XLA's in-place add) or
    cast or not (a micro-step's). Megatron's weight-gradient GEMM accumulates into
    main_grad in its epilogue (gradient_accumulation_fusion), under the GEMM's math: none
    of these is a kernel of its own. Returns their names."""
    by_name = comp.by_name

    def src(name):
        return by_name.get(through_views(comp, name))

    def single_use(x):
        return len(users_through_views(comp, x.name)) == 1

    def element_of(x, opcode: str) -> bool:  # an element of a parameter's / loop's tuple
        if x is None or x.opcode != "get-tuple-element":
            return False
        tup = src(x.operands[0])
        return tup is not None and tup.opcode == opcode

    out: set[str] = set()
    for inst in members:
        if inst.opcode != "add" or len(inst.operands) != 2:
            continue
        a, b = (src(o) for o in inst.operands)
        carried = [element_of(a, "parameter"), element_of(b, "parameter")]
        if carried.count(True) != 1:
            continue
        x = b if carried[0] else a
        fused = {inst.name}
        if x is not None and x.opcode in IN_PLACE_OPS \
                and inst.name in _in_place_accumulates(comp, [inst]) and single_use(x):
            fused.add(x.name)
            x = src(x.operands[-1 if x.opcode == "scatter" else 1])
        while x is not None and x.opcode == "convert" and single_use(x):
            fused.add(x.name)
            x = src(x.operands[0])
        if element_of(x, "while"):
            out |= fused
    return out


def _stacks(inst: Instruction) -> bool:
    """A layer scan stacking a per-layer value (a residual saved for the backward pass, a
    layer's weight gradient): a GPU framework keeps the tensor where its producer wrote it
    (XLA writes the producer's output into the stack's slice), so the stacking moves no
    bytes of its own."""
    return (inst.opcode == "dynamic-update-slice"
            and "/jit(dynamic_update_index_in_dim)/" in inst.op_name)


def _key(comp: Computation, inst: Instruction) -> tuple[str, str] | None:
    """An op's fused scope call; a copy (a sharding annotation between a kernel and its
    user, before copy elision) is its operand's."""
    while inst.opcode == "copy" and inst.operands and (
            src := comp.by_name.get(through_views(comp, inst.operands[0]))) is not None:
        inst = src
    return scope_key(inst.op_name)


def _copies_a_kernel(comp: Computation, inst: Instruction) -> bool:
    """A copy (a sharding annotation) of a fused kernel's output: it is that output, where
    the kernel writes it (the copy of a matmul's output stays free)."""
    src = comp.by_name.get(through_views(comp, inst.operands[0])) if inst.operands else None
    return src is not None and src.opcode != "copy" and is_memory_op(src, comp) and \
        _key(comp, src) is not None


def _read_in_place(comp: Computation, inst: Instruction) -> bool:
    """A slice (a layer's saved residual or weights out of the stacked array) that kernels
    and matmuls read: each reads it where it lies (a GPU framework indexes the saved
    tensor; XLA fuses the slice into each reader), no copy is made. Remat's optimisation
    barrier passes it on untouched, and so does a loop it is handed to (a pipeline stage's
    layers, run by a scan: PyTorch passes the tensor, not a copy). A gather of one slice
    (a dynamic index vmapped over pipeline stages) is such a slice too."""
    if inst.opcode not in ("slice", "dynamic-slice", "gather") or inst.is_root or \
            not inst.operands or inst.opcode == "gather" and not _one_slice(inst):
        return False
    src = comp.by_name.get(through_views(comp, inst.operands[0]))
    if src is None or src.opcode not in ("parameter", "get-tuple-element"):
        return False  # a slice of a value computed here is part of its kernel
    users = users_through_views(comp, inst.name)
    return bool(users) and all(not u.is_root and (u.opcode != "tuple" or all(
        b.opcode in ("opt-barrier", "while") for b in comp.users.get(u.name, [])))
        for u in users)


def _one_slice(gather: Instruction) -> bool:
    """A gather that takes one slice of its operand (its output is slice_sizes' elements):
    a dynamic index, batched over a vmapped dimension of size one."""
    sizes = (gather.attr("slice_sizes") or "").strip("{}")
    try:
        elements = math.prod(int(x) for x in sizes.split(",") if x.strip())
    except ValueError:
        return False
    return bool(sizes) and [s.num_elements for s in gather.shapes] == [elements]


def _kernel_traffic(
    comp: Computation, region: list[Instruction], module: HloModule | None = None
) -> tuple[float, float]:
    inside = {i.name for i in region}
    read: dict[str, float] = {}
    written = 0.0
    elems = 0.0
    accumulates = _in_place_accumulates(comp, region)
    for inst in region:
        out_bytes = float(sum(a.hbm_bytes for a in inst.shapes))
        elems += sum(a.num_elements for a in inst.shapes)
        fused_reads, fused_write = _fusion_io(module, inst) if inst.opcode == "fusion" \
            else ({}, None)
        if fused_write is not None:
            out_bytes = fused_write
        for k, o in enumerate(inst.operands):
            if o in inside or through_views(comp, o) in inside:
                continue
            if k in fused_reads:
                read[f"{o}@{inst.name}"] = fused_reads[k]
            elif inst.name in accumulates:
                read[f"{o}@{inst.name}"] = accumulates[inst.name]  # the updated part
            elif inst.opcode in SLICE_OPS and k == 0:
                read[f"{o}@{inst.name}"] = out_bytes  # only the kept part is read
            elif inst.opcode in IN_PLACE_OPS and k == 0:
                continue  # updated in place: the untouched part is neither read nor written
            elif o not in read:
                read[o] = read_bytes(comp, o)
        users = comp.users.get(inst.name, [])
        leaves = inst.is_root or any(_leaves_region(comp, u, inside) for u in users)
        if leaves:
            if inst.name in accumulates:
                written += accumulates[inst.name]
            elif inst.opcode in IN_PLACE_OPS and len(inst.operands) > 1:
                update = inst.operands[-1 if inst.opcode == "scatter" else 1]
                written += float(sum(a.hbm_bytes for a in shapes_of(comp, update)))
            else:
                written += out_bytes
    return sum(read.values()) + written, elems


def _slice_for_matmuls(module: HloModule | None, comp: Computation, inst: Instruction) -> bool:
    """A compiler's fusion that only slices one layer out of a stacked array (XLA:GPU's
    `dynamic_slice_fusion`) for matmuls alone: the matmuls' operand reads count the layer,
    as a serving engine's GEMMs read a layer's weights (or cache) where they lie."""
    fused = fused_computation(module, inst)
    if fused is None or fused.root is None or any(a.memory_space for a in inst.shapes):
        return False  # a copy into on-chip memory (TPU VMEM) is the layer's one read
    root = fused.by_name.get(through_views(fused, fused.root.name))
    while root is not None and root.opcode == "copy":  # the layout the GEMM wants: an
        root = fused.by_name.get(through_views(fused, root.operands[0]))  # engine stores it so
    if root is None or root.opcode not in ("slice", "dynamic-slice"):
        return False
    if fused.by_name.get(through_views(fused, root.operands[0])).opcode != "parameter":
        return False
    users = users_through_views(comp, inst.name)
    return bool(users) and all(
        is_matmul(u) or (f := fused_computation(module, u)) is not None
        and any(i.opcode in MATMUL_OPS for i in f.instructions) for u in users)


def _in_place_accumulates(comp: Computation, region: list[Instruction]) -> dict[str, float]:
    """{add: bytes of its update} for each `acc + dynamic-update-slice(zeros, u, i)` (or a
    scatter into zeros) in the region: XLA adds u into acc in place."""
    found = {}
    for inst in region:
        if inst.opcode != "add" or len(inst.operands) != 2:
            continue
        for o in inst.operands:
            src = comp.by_name.get(through_views(comp, o))
            if src is None or src.opcode not in IN_PLACE_OPS or len(src.operands) < 2:
                continue
            base = comp.by_name.get(through_views(comp, src.operands[0]))
            if base is not None and base.opcode == "broadcast" and base.operands:
                base = comp.by_name.get(base.operands[0])
            if base is not None and base.opcode == "constant":
                update = src.operands[-1 if src.opcode == "scatter" else 1]
                found[inst.name] = float(sum(a.hbm_bytes for a in shapes_of(comp, update)))
                break
    return found


def _fusion_io(module: HloModule | None,
               inst: Instruction) -> tuple[dict[int, float], float | None]:
    """What a compiler-made fusion really moves: an operand the fused computation only
    slices is read for the slices' size (a layer's weights out of the stacked array), an
    operand it only updates in place is not read, and a dynamic-update-slice root writes
    only its update."""
    fused = fused_computation(module, inst)
    if fused is None:
        return {}, None
    reads: dict[int, float] = {}
    for p in fused.instructions:
        if p.opcode != "parameter":
            continue
        sliced = _sliced_read(module, fused, p.name)
        if sliced is not None:
            reads[int(p.operands[0])] = sliced
    write = None
    root = fused.root
    if root is not None and root.opcode in IN_PLACE_OPS and len(root.operands) > 1:
        update = root.operands[-1 if root.opcode == "scatter" else 1]
        write = float(sum(a.hbm_bytes for a in shapes_of(fused, update)))
    return reads, write


def _sliced_read(module: HloModule, comp: Computation, name: str, depth: int = 0):
    """Bytes of parameter `name` a fused computation reads when it only slices it (directly
    or inside a nested fusion, as the TPU compiler nests a scanned layer's weight slice
    into the matmul's fusion) or only updates it in place (0); None when it reads it
    whole."""
    users = users_through_views(comp, name)
    if not users or depth > 8:
        return None
    source = comp.by_name.get(name)
    in_hbm = source is None or all(a.memory_space == 0 for a in source.shapes)
    total = 0.0
    for u in users:
        if u.opcode in SLICE_OPS and through_views(comp, u.operands[0]) == name:
            # what the slice reads, from wherever its operand lives
            total += float(sum(a.nbytes for a in u.shapes)) if in_hbm else 0.0
        elif u.opcode in IN_PLACE_OPS and through_views(comp, u.operands[0]) == name:
            continue
        elif (u.opcode in ("copy", "convert", "fusion") and source is not None
              and [a.dims for a in u.shapes] == [a.dims for a in source.shapes]
              and (after := _sliced_read(module, comp, u.name, depth + 1)) is not None):
            # an element-wise relayout or conversion of the whole array inside a kernel
            # whose result is only sliced: the kernel reads only the sliced elements
            ratio = sum(a.nbytes for a in source.shapes) / max(1, sum(a.nbytes
                                                                     for a in u.shapes))
            total += after * ratio if in_hbm else 0.0
        elif (u.opcode == "reduce" and len(u.shapes) == 1 and u.operands
              and through_views(comp, u.operands[0]) == name and source is not None
              and (after := _sliced_read(module, comp, u.name, depth + 1)) is not None):
            # a reduction (a split-K GEMM's partial sums added up) whose result is only
            # sliced: the kernel reduces only the elements it keeps
            ratio = sum(a.nbytes for a in source.shapes) / max(1, u.shapes[0].nbytes)
            total += after * ratio if in_hbm else 0.0
        elif u.opcode == "fusion":
            inner = fused_computation(module, u)
            positions = [k for k, o in enumerate(u.operands) if through_views(comp, o) == name]
            if inner is None or not positions:
                return None
            params = {int(i.operands[0]): i.name for i in inner.instructions
                      if i.opcode == "parameter"}
            for k in positions:
                part = _sliced_read(module, inner, params.get(k, ""), depth + 1)
                if part is None:
                    return None
                total += part
        else:
            return None
    return total


def _leaves_region(comp: Computation, user: Instruction, inside: set[str]) -> bool:
    """Whether a value used by `user` must be written to HBM (a view passes it on)."""
    if user.name in inside:
        return False
    if is_view(user, comp):
        return user.is_root or any(_leaves_region(comp, u, inside)
                                   for u in comp.users.get(user.name, []))
    return True


def l2_reuse(comp: Computation, kernel_list) -> list[tuple[tuple[float, float], ...]]:
    """For a compiler-fused module (each `fusion` a kernel, in schedule order): per kernel,
    the HBM traffic that stays in a GPU's L2 cache when the cache is large enough, as
    (working set, bytes saved) pairs. A kernel's output that only kernels after it read
    (a split-K GEMM's f32 partial sums and their reduction, a softmax's scores) is still
    in L2 when they run, if it and the traffic of the kernels in between fit: its write
    and their reads of it never reach HBM. Outputs something else reads (a collective, a
    loop's carry, the result) go to HBM."""
    index = {inst.name: i for i, inst in enumerate(comp.instructions)}
    owner: dict[str, int] = {}
    for k, (_, _, members) in enumerate(kernel_list):
        for m in members:
            owner[m.name] = k
    pos = [index[members[-1].name] for _, _, members in kernel_list]
    # the kernels' traffic in schedule order, summed: what runs between two positions
    order = sorted(range(len(kernel_list)), key=pos.__getitem__)
    ordered_pos = [pos[j] for j in order]
    prefix = list(itertools.accumulate((kernel_list[j][0] for j in order), initial=0.0))
    out: list[list[tuple[float, float]]] = [[] for _ in kernel_list]
    for k, (nbytes, _, members) in enumerate(kernel_list):
        if len(members) != 1 or members[0].opcode != "fusion" or members[0].is_root:
            continue
        f = members[0]
        size = float(sum(a.hbm_bytes for a in f.shapes))
        users = _users_through_tuples(comp, f.name)
        readers = {owner.get(u.name) for u in users}
        if not users or None in readers or k in readers:
            continue
        def working_set(until: int) -> float:
            """The output and the traffic of the other kernels run before `until`."""
            lo = bisect.bisect_right(ordered_pos, pos[k])
            hi = bisect.bisect_left(ordered_pos, until)
            between = prefix[hi] - prefix[lo] - sum(
                kernel_list[r][0] for r in readers if pos[k] < pos[r] < until)
            return size + between

        # The write is saved only if the output is still in L2 for its last reader; each
        # read, if it is still there for that reader.
        out[k].append((working_set(max(pos[r] for r in readers)), min(size, nbytes)))
        for r in readers:
            r_out = float(sum(a.hbm_bytes for m in kernel_list[r][2] for a in m.shapes))
            read = max(0.0, kernel_list[r][0] - r_out)
            out[r].append((working_set(pos[r]), min(size, read)))
    return [tuple(x) for x in out]


def _users_through_tuples(comp: Computation, name: str) -> list[Instruction]:
    """The users of `name`, through views and the elements of a tuple it makes."""
    users = []
    for u in users_through_views(comp, name):
        if u.opcode == "get-tuple-element":
            users.extend(_users_through_tuples(comp, u.name))
        else:
            users.append(u)
    return users
