"""The device half of the epilogue language: a graph's values as DSL code.

:func:`emit_graph` walks a graph and emits each op from the op table over the DSL
math namespace (the reference interpreter's semantics, as fp32 scalar ops); the
attention score_mod and every epilogue's ``compute`` stage use it.
:class:`TileEpilogue` holds one thread's state over an output tile (vector reads,
reduction partials) for the chain's ``compute``, ``reduce`` and
``finalize_reductions`` stages (:mod:`epicute.sm90.epilogue_chain`), and the
reduction helpers fold, shuffle and store the partials. What a kernel needs to
know about its epilogue (operands, outputs, reductions, chain) is the host half,
:class:`epicute.epilogue.fusion.EpilogueFusion`.
"""

from __future__ import annotations

import cutlass
import torch
from cutlass import Float32, Int32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from epicute.epilogue import optable
from epicute.epilogue.dtypes import FP8_MAX
from epicute.epilogue.dtypes import round_to as round_tensor
from epicute.epilogue.fusion import KERNEL_DTYPES, ROWS_PER_WARP, EpilogueFusion
from epicute.epilogue.graph import REDUCTION_IDENTITY, REDUCTIONS
from epicute.epilogue.schedule import needed_nodes
from epicute.errors import EpilogueError

#: The DSL type of each of the kernel's value dtypes.
DSL_DTYPES = {
    "bf16": cutlass.BFloat16,
    "fp16": cutlass.Float16,
    "fp32": cutlass.Float32,
    "fp8e4m3": cutlass.Float8E4M3FN,
    "fp8e5m2": cutlass.Float8E5M2,
}
assert set(DSL_DTYPES) == KERNEL_DTYPES


#: A gated epilogue's up value travels with the element's operand tiles under this name (no operand
#: can take it: it is not an identifier), read by the kernel's ``tile_value``.
UP = "acc:up"


def emit_graph(graph, leaf, needed: set[int] | None = None) -> dict:
    """Every needed elementwise node's fp32 value for one element, as DSL scalars.

    ``leaf(node)`` gives the value of each leaf (``acc``, ``input``, ``index``; constants
    are emitted here); reductions are skipped (their argument is a value like any other).
    """
    needed = needed_nodes(graph) if needed is None else needed
    values = {}
    for node in graph.nodes:
        if node.id not in needed or node.op in REDUCTIONS or node.op == "group_scales":
            continue
        if node.op == "group_quant":  # the values it quantizes: the tile's second pass scales them
            values[node.id] = values[node.args[0]]
            continue
        if node.op == "const":
            v = Float32(node.attr("value"))
        elif node.op in ("acc", "input", "index", "acc_up"):
            v = leaf(node)
        else:
            v = emit_op(node.op, [values[a] for a in node.args], node)
        values[node.id] = v
    return values


def emit_score_mod(graph, score, index: dict, operands: dict) -> dict:
    """A traced score_mod's values for one score (see :func:`emit_graph`): its leaves are the scaled
    score (``acc``), the index leaves and the operands, by name."""

    def leaf(node):
        if node.op == "acc":
            return score
        return (index if node.op == "index" else operands)[node.attr("name")]

    return emit_graph(graph, leaf)


def compute(fusion: EpilogueFusion, acc, tiles: dict, vectors: dict, scalars: tuple) -> dict:
    """Every needed node's fp32 value for one element of a fused epilogue.

    ``tiles``/``vectors``: this element's operand values by name (fp32), and a gated epilogue's up
    value under :data:`UP`;
    ``scalars``: the kernel's scalar tuple, in ``fusion.scalar_inputs`` order.
    """
    scalar_slot = {name: i for i, name in enumerate(fusion.scalar_inputs)}

    def leaf(node):
        if node.op == "acc":
            return acc
        if node.op == "acc_up":
            return tiles[UP]
        name = node.attr("name")
        if node.kind == "scalar":
            return scalars[scalar_slot[name]]
        return (tiles if node.kind == "tile" else vectors)[name]

    return emit_graph(fusion.graph, leaf, fusion.needed)


# ------------------------------------------------------------------ reductions
def combine(kind: str, a, b):
    """Fold two partials (``amax`` partials are already absolute values). A max propagates NaN, as torch's
    does, through ``max.NaN`` (one FMNMX.NAN: the generic NaN-propagating max takes three instructions)."""
    return a + b if kind == "sum" else cute.arch.fmax(a, b, nan=True)


def fold_element(kind: str, partial, x, valid):
    """``partial`` with element ``x`` folded in; lanes outside the problem contribute the identity."""
    x = cute.math.absf(x) if kind == "amax" else x
    return combine(kind, partial, _select(valid, x, identity(kind)))


def identity(kind: str):
    return Float32(REDUCTION_IDENTITY[kind])


def butterfly(kind: str, value, lane_masks: tuple[int, ...]):
    """Combine ``value`` across the lanes that differ in ``lane_masks`` bits (fixed order: deterministic)."""
    for mask in lane_masks:
        value = combine(kind, value, cute.arch.shuffle_sync_bfly(value, offset=mask))
    return value


# ------------------------------------------------------------- elementwise ops
def _select(cond, a, b):
    # select_ yields a raw IR value; keep every node value a Float32 (cast needs .to()).
    return Float32(cutlass.select_(cond, a, b))


def round_to(x, dtype: str):
    """``x`` rounded to ``dtype`` and back to fp32; fp8 saturates to its largest finite value."""
    if dtype in FP8_MAX:
        x = saturate(x, dtype)
    if _is_constant(x):
        return Float32(_rounded_constant(x.value, dtype))
    return x.to(DSL_DTYPES[dtype]).to(Float32)


def _is_constant(x) -> bool:
    """Whether ``x`` is a trace-time number (a constant of the epilogue), not a value of the kernel."""
    return isinstance(getattr(x, "value", None), (int, float))


def _rounded_constant(value: float, dtype: str) -> float:
    """A trace-time number rounded to ``dtype`` as the reference rounds it. The DSL's conversion of a constant
    keeps its Python value unrounded (``Float32(-3.19).to(Float8E5M2)`` is still -3.19), so it is done here."""
    return float(round_tensor(torch.tensor(float(value), dtype=torch.float32), dtype).float())


def saturate(x, dtype: str):
    """Clamp ``x`` into fp8 ``dtype``'s finite range (the reference's saturating conversion)."""
    limit = Float32(FP8_MAX[dtype])
    return cutlass.max(cutlass.min(x, limit), -limit)


class DslMath:
    """The math namespace the op table's emitters are written over (:mod:`epicute.epilogue.optable`),
    with the CuTe DSL: each primitive is one DSL call on fp32 scalars (``optable.TorchMath``
    is the same namespace on torch tensors)."""

    const = staticmethod(Float32)
    exp = staticmethod(cute.math.exp)
    exp2 = staticmethod(cute.math.exp2)
    log = staticmethod(cute.math.log)
    log1p = staticmethod(cute.math.log1p)
    sqrt = staticmethod(cute.math.sqrt)
    rsqrt = staticmethod(cute.math.rsqrt)
    tanh = staticmethod(cute.math.tanh)
    absf = staticmethod(cute.math.absf)
    rcp_approx = staticmethod(cute.arch.rcp_approx)
    max = staticmethod(cutlass.max)
    min = staticmethod(cutlass.min)
    select = staticmethod(_select)
    round_to = staticmethod(round_to)


DSL_MATH = DslMath()
assert all(hasattr(DSL_MATH, name) for name in optable.MATH_PRIMITIVES)


def emit_op(op: str, args: list, node):
    """One elementwise op on fp32 scalars: its table entry's ``emit`` (the semantics of its ``reference``)."""
    spec = optable.find(op)
    if spec is None:
        raise EpilogueError(f"unknown epilogue op {op!r}")
    return spec.emit(DSL_MATH, *args, **dict(node.attrs))


# ----------------------------------------------------------- device-side state
@cute.jit
def store_if(pred, tensor: cute.Tensor, coord, value):
    """``tensor[coord] = value`` where ``pred`` holds (a predicated global store)."""
    if pred:
        tensor[coord] = value


@dsl_user_op
def store_f32_if(pred, pointer, value, *, loc=None, ip=None) -> None:
    """``*pointer = value`` (fp32, global) where ``pred`` holds, as one predicated ``st.global``: no branch, so
    the address arithmetic the stores share stays outside them (a branch per store lets the compiler sink a
    copy of it into each one)."""
    llvm.inline_asm(
        None,
        [Int32(pred).ir_value(loc=loc, ip=ip), pointer.llvm_ptr, Float32(value).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, $0, 0;\n@p st.global.f32 [$1], $2;\n}",
        "r,l,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class TileEpilogue:
    """Trace-time state of the fused epilogue over one output tile, for one thread.

    ``coords`` holds the tile-local (m, n) of each of this thread's accumulator
    values (dynamic), ``coords0`` thread 0's (static ints). Layouts are linear
    in the thread index, so equal static coordinates mean equal offsets from
    this thread's base: the key under which each vector element is read from
    shared memory once and each reduction partial is folded.
    """

    def __init__(self, fusion: EpilogueFusion, coords, coords0, vectors: dict, scalars: tuple, origin, extent,
                 band_origin=None):  # fmt: skip
        self.fusion = fusion
        self.coords, self.coords0 = coords, coords0
        #: name -> a tensor of the vector indexed by tile-local position (n for rows, m for columns)
        self.vectors = vectors
        self.scalars = scalars
        self.origin, self.extent = origin, extent  # global (m, n) of the tile's corner; problem (M, N)
        #: Where the tile's column and whole-tile partials go: None, the 16-row bands of its global rows; else
        #: the row of the tile's own slots (a grouped GEMM's: groups share no band, see GroupedGemmSm90).
        self.band_origin = band_origin
        self._vector_cache: dict = {}
        #: row reductions: (name, static m) -> [partial, tile-local m]
        self.row_partials: dict = {}
        #: whole-tensor reductions, per 16-row band: (name, static band) -> [partial, tile-local m]
        self.all_partials: dict = {}

    def _vector(self, name: str, m0, n0, m, n):
        row = name in self.fusion.row_inputs
        key = (name, n0 if row else m0)
        if key not in self._vector_cache:
            value = self.vectors[name][n if row else m]
            # Parked vectors are fp32 already; vectors read from global memory (attention) are converted.
            if self.vectors[name].element_type is not Float32:
                value = value.to(Float32)
            self._vector_cache[key] = value
        return self._vector_cache[key]

    def compute(self, acc, base: int, tile_value, outputs: dict, visitors=()) -> None:
        """The chain's ``compute`` stage over one subtile.

        ``acc``: the subtile's accumulators (fp32 registers), ``base``: the offset of its first
        value in the thread's coordinates; ``tile_value(name, v, m, n)``: operand tile ``name``'s
        value ``v`` (tile-local (m, n)) as fp32, and a gated epilogue's up value (``name`` :data:`UP`);
        each output's value goes to ``outputs[name][v]`` (D's tensor may be ``acc`` itself). Each of
        ``visitors`` is called per element as
        ``visit(at, values)`` with ``at = (v, m0, n0, m, n)`` (thread 0's and this thread's
        coordinates) and every node's value: the later stages that work element by element
        (``reduce``) fold there, so no value outlives its element.
        """
        fusion, out_ids = self.fusion, dict(self.fusion.graph.outputs)
        for v in range(cute.size(acc)):
            m0, n0 = self.coords0[base + v]
            m, n = self.coords[base + v]
            vectors = {name: self._vector(name, m0, n0, m, n) for name in self.vectors}
            tile_values = {name: tile_value(name, v, m, n) for name in fusion.tile_inputs}
            if fusion.gated:
                tile_values[UP] = tile_value(UP, v, m, n)
            values = compute(fusion, acc[v], tile_values, vectors, self.scalars)
            for name, t in outputs.items():
                t[v] = values[out_ids[name]]
            for visit in visitors:
                visit((v, m0, n0, m, n), values)

    def fold(self, r, at, x, col_partials: dict) -> None:
        """Fold element ``x`` (at ``(v, m0, n0, m, n)``) of reduction ``r`` into this thread's
        partials: row and whole-tensor partials live for the tile, column partials
        (``(name, static n) -> [partial, tile-local n, tile-local m]``) for the subtile (a subtile
        holds one 16-row band of each warp, so any of its rows names the band)."""
        _, m0, n0, m, n = at
        # A row's partial past N, or a column's past M, is never stored: only the other bound masks.
        rows_in, cols_in = self.origin[0] + m < self.extent[0], self.origin[1] + n < self.extent[1]
        valid = cols_in if r.axis == "row" else rows_in if r.axis == "col" else rows_in & cols_in
        if r.axis == "row":
            slot = self.row_partials.setdefault((r.name, m0), [identity(r.combine), m])
        elif r.axis == "col":
            slot = col_partials.setdefault((r.name, n0), [identity(r.combine), n, m])
        else:
            slot = self.all_partials.setdefault((r.name, m0 // ROWS_PER_WARP), [identity(r.combine), m])
        slot[0] = fold_element(r.combine, slot[0], x, valid)

    def _band(self, m_local):
        """The 16-row band (one warp's rows of a WGMMA block) holding tile-local row ``m_local``: global, or in
        the tile's own slots."""
        first = self.origin[0] if self.band_origin is None else self.band_origin
        return (first + m_local) // ROWS_PER_WARP

    def _band_in_workspace(self, band):
        """Whether ``band`` has a slot (a tile's own slots always do, rows past the problem holding the identity)."""
        if self.band_origin is None:
            return band * ROWS_PER_WARP < self.extent[0]
        return band >= 0

    def store_col_partials(self, r, col_partials: dict, ws, tl, lane) -> None:
        """One subtile's partials of column reduction ``r``: lanes sharing a column (they differ in
        lane bits 2-4) combine, then lanes 0-3 hold their warp's 16-row partial and store it.

        The partials share one band, so its row of ``ws`` is addressed once and each store adds its
        column's static offset (``n0``: thread 0's column; every thread's differ by one constant).
        Address arithmetic per store made the unrolled epilogue large enough to miss the instruction
        cache under ping-pong (bench/NOTES.md, "The GELU MLP's dh GEMM")."""
        if not col_partials:
            return
        (_, n0_first), (_, n_first, m_local) = next(iter(col_partials.items()))
        band = self._band(m_local)
        n_first = self.origin[1] + n_first
        row = ws[(tl, band, None)]
        first = row.iterator + row.layout(n_first)
        row_ok = (lane < 4) & self._band_in_workspace(band)
        for (_, n0), (partial, _, _) in col_partials.items():
            value = butterfly(r.combine, partial, (4, 8, 16))
            offset = n0 - n0_first
            store_f32_if(row_ok & (n_first + offset < self.extent[1]), first + row.layout(offset), value)

    def store_tile_partials(self, workspaces: tuple, tn, tl, lane) -> None:
        """The tile's row reductions (the 4 lanes of a quad share a row) and whole-tile ones (the
        warp, once per 16-row band it covers). A tile wholly past N (a cluster's second CTA beside
        the last column of tiles) has no slot: its workspace index ``tn`` is one past the end."""
        tile_in_n = self.origin[1] < self.extent[1]
        for r, ws in zip(self.fusion.reductions, workspaces):
            if r.axis == "row":
                for (name, _), (partial, m_local) in self.row_partials.items():
                    if name != r.name:
                        continue
                    value = butterfly(r.combine, partial, (1, 2))
                    m = self.origin[0] + m_local
                    store_if((lane % 4 == 0) & (m < self.extent[0]) & tile_in_n, ws, (tl, tn, m), value)
            elif r.axis == "all":
                for (name, _), (partial, m_local) in self.all_partials.items():
                    if name != r.name:
                        continue
                    value = butterfly(r.combine, partial, (1, 2, 4, 8, 16))
                    band = self._band(m_local)
                    store_if((lane == 0) & self._band_in_workspace(band) & tile_in_n, ws, (tl, band, tn), value)


def ceil_pow2(x):
    """Positive normal fp32 ``x`` rounded up to a power of two, by its bits (``group_quant.ceil_pow2``)."""
    bits = Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value(), loc=None, ip=None))
    bits = (bits + Int32(0x7FFFFF)) & Int32(-0x800000)
    return Float32(llvm.bitcast(Float32.mlir_type, bits.ir_value(), loc=None, ip=None))


def round_scalar(x, dtype: str):
    """One fp32 value converted to an output ``dtype`` (fp8 saturates like the reference)."""
    x = saturate(x, dtype) if dtype in FP8_MAX else x
    if _is_constant(x):
        return DSL_DTYPES[dtype](_rounded_constant(x.value, dtype))
    return x.to(DSL_DTYPES[dtype])


def round_for_store(values, dtype: str) -> None:
    """Prepare fp32 ``values`` for conversion to an output ``dtype``: fp8 saturates like the reference."""
    if dtype in FP8_MAX:
        for v in range(cute.size(values)):
            values[v] = saturate(values[v], dtype)
