"""Emitting an epilogue graph into the GEMM kernel's TMA-store epilogue.

:class:`EpilogueFusion` is the compile-time half: the traced graph and its stage
schedule, split into what each part of the kernel handles --

- **tile operands**: TMA-loaded into a shared-memory ring, one epilogue subtile
  per stage, by the producer's epilogue-load warp while the mainloop runs;
- **row / column vectors**: this tile's slice loaded by the consumer threads
  *before* the mainloop (one element each, so the latency hides behind it),
  parked in shared memory after it, and read once per distinct coordinate;
- **scalars**: fp32 kernel arguments;
- **outputs**: D and any auxiliary full tiles, staged and TMA-stored together;
- **reductions**: folded per thread, combined across lanes with butterfly
  shuffles, and written as per-tile partials to an fp32 workspace in global
  memory; the host finalizes them with one ordered torch reduction, so results
  are bitwise reproducible (no float atomics).

The device half is :meth:`EpilogueFusion.compute` (one element: every node as
fp32 scalar DSL ops, the reference interpreter's semantics) and the reduction
helpers the kernel calls per subtile and per tile.

Kernel tensor arguments arrive batch-first in :attr:`EpilogueFusion.tensor_args`
order: tile operands, row vectors, column vectors, aux outputs, workspaces.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from epicute.epilogue.dtypes import FP8_MAX
from epicute.epilogue.graph import REDUCTION_IDENTITY, REDUCTIONS, Graph
from epicute.epilogue.hashing import semantic_hash
from epicute.epilogue.schedule import EpilogueSchedule, needed_nodes, schedule
from epicute.errors import EpilogueError
from epicute.plan.smem import EpilogueBuffers

#: Epilogue value dtypes the kernel can load, store or round to.
DSL_DTYPES = {
    "bf16": cutlass.BFloat16,
    "fp16": cutlass.Float16,
    "fp32": cutlass.Float32,
    "fp8e4m3": cutlass.Float8E4M3FN,
    "fp8e5m2": cutlass.Float8E5M2,
}

#: Rows one warp owns in a WGMMA accumulator (64-row atom / 4 warps): the band of
#: rows a column-reduction partial covers.
ROWS_PER_WARP = 16

_SQRT1_2 = 0.7071067811865476
# erfc(z) ~ t * P(t) * exp(-z^2), t = 1 / (1 + p z), z >= 0: Abramowitz & Stegun 7.1.26,
# absolute error <= 1.5e-7 on erf.
_ERFC_P = 0.3275911
_ERFC_POLY = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)
_GELU_TANH_C = 0.7978845608028654
_GELU_EXP2_SCALE = 0.8493218002880191  # s = sqrt(log2(e) / 2): exp2(-(x s)^2) = exp(-x^2 / 2)
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Reduction:
    """One reduction output: ``axis`` "row" (row_*: over N, one value per row),
    "col" (col_*: over M, one per column) or "all" (amax)."""

    name: str
    node: int
    arg: int
    combine: str  # "sum" | "max" | "amax"
    axis: str

    def workspace_shape(self, l: int, m: int, n: int, tile_n: int) -> tuple[int, int, int]:
        """Per-tile partials, batch-first: row (L, N tiles, M); col (L, M bands, N); all (L, M bands, N tiles)."""
        bands, tiles_n = -(-m // ROWS_PER_WARP), -(-n // tile_n)
        return {"row": (l, tiles_n, m), "col": (l, bands, n), "all": (l, bands, tiles_n)}[self.axis]

    def finalize(self, workspace):
        """The deterministic final combine (a torch reduction in a fixed order)."""
        if self.axis == "all":
            return workspace.amax() if workspace.numel() else workspace.new_zeros(())
        if workspace.shape[1] == 0:  # nothing to combine (N or M is 0): the identity
            return workspace.new_full((workspace.shape[0], workspace.shape[2]), REDUCTION_IDENTITY[self.combine])
        return workspace.sum(dim=1) if self.combine == "sum" else workspace.amax(dim=1)


@dataclass(frozen=True)
class EpilogueFusion:
    graph: Graph
    #: (name, kind, dtype) of each operand, in parameter order
    operands: tuple[tuple[str, str, str], ...]
    sched: EpilogueSchedule = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sched", schedule(self.graph))
        # The tracer already guarantees a tile "D" and only tile or reduction outputs.
        for node in self.graph.nodes:
            if node.op == "index":
                raise EpilogueError("index inputs (q_idx, kv_idx, ...) exist only in attention score_mod")
            if node.op in ("cast", "quantize") and node.attr("dtype") not in DSL_DTYPES:
                raise EpilogueError(
                    f"%{node.id} {node.op} to {node.attr('dtype')}: the kernel rounds to {sorted(DSL_DTYPES)}"
                )
        for name, kind, dtype in self.operands:
            if kind != "scalar" and dtype not in DSL_DTYPES:
                raise EpilogueError(f"operand {name!r} has dtype {dtype}; the kernel loads {sorted(DSL_DTYPES)}")

    # ------------------------------------------------------------ host side
    # Cached: the fusion is immutable, and the launch path reads these on every call.
    def _dtype(self, name: str) -> str:
        return next(d for n, _, d in self.operands if n == name)

    def _kind(self, name: str) -> str:
        return next(k for n, k, _ in self.operands if n == name)

    @functools.cached_property
    def tile_inputs(self) -> tuple[str, ...]:
        return self.sched.tile_operands

    @functools.cached_property
    def row_inputs(self) -> tuple[str, ...]:
        return tuple(n for n in self.sched.vector_operands if self._kind(n) == "row")

    @functools.cached_property
    def col_inputs(self) -> tuple[str, ...]:
        return tuple(n for n in self.sched.vector_operands if self._kind(n) == "col")

    @functools.cached_property
    def scalar_inputs(self) -> tuple[str, ...]:
        return self.sched.scalar_operands

    @functools.cached_property
    def output_dtypes(self) -> dict[str, str]:
        return dict(self.graph.output_dtypes)

    @functools.cached_property
    def aux_outputs(self) -> tuple[str, ...]:
        return tuple(n for n in self.sched.tile_outputs if n != "D")

    @functools.cached_property
    def reductions(self) -> tuple[Reduction, ...]:
        outputs = dict(self.graph.outputs)
        result = []
        for name in self.sched.reductions:
            node = self.graph.node(outputs[name])
            kind, combine = REDUCTIONS[node.op]
            axis = {"col": "row", "row": "col", "scalar": "all"}[kind]
            result.append(Reduction(name, node.id, node.args[0], combine, axis))
        return tuple(result)

    @functools.cached_property
    def tensor_args(self) -> tuple[tuple[str, str, str], ...]:
        """(role, name, dtype) of the kernel's tensor arguments, in order."""
        outs = self.output_dtypes
        return (
            tuple(("tile", n, self._dtype(n)) for n in self.tile_inputs)
            + tuple(("row", n, self._dtype(n)) for n in self.row_inputs)
            + tuple(("col", n, self._dtype(n)) for n in self.col_inputs)
            + tuple(("aux", n, outs[n]) for n in self.aux_outputs)
            + tuple(("workspace", r.name, "fp32") for r in self.reductions)
        )

    def buffers(self) -> EpilogueBuffers:
        """Shared memory this epilogue needs (the planner's and the kernel's single source)."""
        return self.sched.buffers()

    def key(self) -> tuple:
        return (semantic_hash(self.graph), self.operands)

    # ---------------------------------------------------------- device side
    def compute(self, acc, tiles: dict, vectors: dict, scalars: tuple) -> dict:
        """Every needed node's fp32 value for one element.

        ``tiles``/``vectors``: this element's operand values by name (fp32);
        ``scalars``: the kernel's scalar tuple, in :attr:`scalar_inputs` order.
        """
        scalar_slot = {name: i for i, name in enumerate(self.scalar_inputs)}
        needed = needed_nodes(self.graph)
        values = {}
        for node in self.graph.nodes:
            if node.id not in needed or node.op in REDUCTIONS:
                continue
            if node.op == "acc":
                v = acc
            elif node.op == "const":
                v = Float32(node.attr("value"))
            elif node.op == "input":
                name = node.attr("name")
                v = (
                    scalars[scalar_slot[name]]
                    if node.kind == "scalar"
                    else tiles[name]
                    if node.kind == "tile"
                    else vectors[name]
                )
            else:
                v = _emit_op(node.op, [values[a] for a in node.args], node)
            values[node.id] = v
        return values


# ------------------------------------------------------------------ reductions
def combine(kind: str, a, b):
    """Fold two partials (``amax`` partials are already absolute values)."""
    return a + b if kind == "sum" else cutlass.max(a, b)


def fold_element(kind: str, partial, x, valid):
    """``partial`` with element ``x`` folded in; lanes outside the problem contribute the identity."""
    x = _select(x < Float32(0.0), -x, x) if kind == "amax" else x
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
    return x.to(DSL_DTYPES[dtype]).to(Float32)


def saturate(x, dtype: str):
    """Clamp ``x`` into fp8 ``dtype``'s finite range (the reference's saturating conversion)."""
    limit = Float32(FP8_MAX[dtype])
    return cutlass.max(cutlass.min(x, limit), -limit)


def gelu_erf(x, absf, rcp, exp2, maximum, minimum, const=Float32):
    """``x * Phi(x)`` through erfc of ``|x| / sqrt(2)``, written over its primitives
    so the same code runs in the kernel (DSL scalars) and in tests (torch tensors).

    One reciprocal, one exp2 and twelve fp32 ALU instructions per element, against
    ~28 for ``0.5 x (1 + erf(x / sqrt(2)))`` with the generic erf, which evaluates
    both of its polynomial ranges and selects. The ALU count is what a fused
    epilogue pays: under ping-pong each fp32 instruction per element slows the
    other warpgroup's WGMMAs by ~0.25 % at K = 4096, where two MUFU instructions
    cost ~0.6 % together (bench/NOTES.md, session 10). So ``x * Phi(x)`` is written
    ``max(x, 0) - |x| Phi(-|x|)`` (no select), and ``x * s`` with
    ``s = sqrt(log2(e) / 2)`` feeds both the reciprocal's argument and exp2's.
    Error <= 7e-7 absolute over all fp32 inputs (torch's fp32 gelu: 1.2e-6); the
    tail ``Phi(-|x|) = erfc(|x| / sqrt(2)) / 2`` is computed directly, not as
    ``1 - ...``, so negative inputs keep their relative accuracy. ``|x|`` is capped
    at the largest float before it multiplies the tail (which is 0 there), so
    ``gelu(+inf) = inf`` and ``gelu(-inf) = 0``, the limits."""
    xs = x * const(_GELU_EXP2_SCALE)
    t = rcp(const(1.0) + const(_ERFC_P * _SQRT1_2 / _GELU_EXP2_SCALE) * absf(xs))
    half_poly = const(0.5 * _ERFC_POLY[0])  # Phi = erfc / 2: the half folded into P
    for coeff in _ERFC_POLY[1:]:
        half_poly = half_poly * t + const(0.5 * coeff)
    tail = t * half_poly * exp2(-xs * xs)  # Phi(-|x|)
    return maximum(x, const(0.0)) - minimum(absf(x), const(_FLOAT32_MAX)) * tail


def _emit_op(op: str, args: list, node):
    """One elementwise op on fp32 scalars (the semantics of epicute.epilogue.reference)."""
    one, zero = Float32(1.0), Float32(0.0)
    math = cute.math
    if op == "add":
        return args[0] + args[1]
    if op == "sub":
        return args[0] - args[1]
    if op == "mul":
        return args[0] * args[1]
    if op == "div":
        return args[0] / args[1]
    if op == "neg":
        return -args[0]
    if op == "abs":
        return math.absf(args[0])
    if op == "minimum":
        return cutlass.min(args[0], args[1])
    if op == "maximum":
        return cutlass.max(args[0], args[1])
    if op == "fma":
        return args[0] * args[1] + args[2]
    if op in ("exp", "exp2", "log", "sqrt", "rsqrt", "tanh"):
        return getattr(math, op)(args[0])
    if op == "sigmoid":
        return one / (one + math.exp(-args[0]))
    if op == "relu":
        return cutlass.max(args[0], zero)
    if op == "gelu_erf":
        exp2 = functools.partial(math.exp2, fastmath=True)
        return gelu_erf(args[0], math.absf, cute.arch.rcp_approx, exp2, cutlass.max, cutlass.min)
    if op == "gelu_tanh":
        x = args[0]
        return Float32(0.5) * x * (one + math.tanh(Float32(_GELU_TANH_C) * (x + Float32(0.044715) * x * x * x)))
    if op == "silu":
        return args[0] / (one + math.exp(-args[0]))
    if op == "softplus":
        # torch's threshold: above 20, softplus(x) == x in fp32.
        return _select(args[0] > Float32(20.0), args[0], math.log1p(math.exp(args[0])))
    if op == "clamp":
        x = args[0]
        lo, hi = node.attr("lo"), node.attr("hi")
        if hi is not None:
            x = cutlass.min(x, Float32(hi))
        if lo is not None:
            x = cutlass.max(x, Float32(lo))
        return x
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        a, b = args
        cond = {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b}[op]
        return _select(cond, one, zero)
    if op == "where":
        return _select(args[0] != zero, args[1], args[2])
    if op == "cast":
        return round_to(args[0], node.attr("dtype"))
    if op == "quantize":
        return round_to(args[0] * args[1], node.attr("dtype"))
    raise EpilogueError(f"unknown epilogue op {op!r}")


# ----------------------------------------------------------- device-side state
@cute.jit
def store_if(pred, tensor: cute.Tensor, coord, value):
    """``tensor[coord] = value`` where ``pred`` holds (a predicated global store)."""
    if pred:
        tensor[coord] = value


class TileEpilogue:
    """Trace-time state of the fused epilogue over one output tile, for one thread.

    ``coords`` holds the tile-local (m, n) of each of this thread's accumulator
    values (dynamic), ``coords0`` thread 0's (static ints). Layouts are linear
    in the thread index, so equal static coordinates mean equal offsets from
    this thread's base: the key under which each vector element is read from
    shared memory once and each reduction partial is folded.
    """

    def __init__(self, fusion: EpilogueFusion, coords, coords0, vectors: list, scalars: tuple, origin, extent):
        self.fusion = fusion
        self.coords, self.coords0 = coords, coords0
        self.vectors = dict(zip(fusion.row_inputs + fusion.col_inputs, vectors))
        self.scalars = scalars
        self.origin, self.extent = origin, extent  # global (m, n) of the tile's corner; problem (M, N)
        self._vector_cache: dict = {}
        #: row reductions: (name, static m) -> [partial, tile-local m]
        self.row_partials: dict = {}
        #: whole-tensor reductions, per 16-row band: (name, static band) -> [partial, tile-local m]
        self.all_partials: dict = {}

    def _vector(self, name: str, m0, n0, m, n):
        row = name in self.fusion.row_inputs
        key = (name, n0 if row else m0)
        if key not in self._vector_cache:
            self._vector_cache[key] = self.vectors[name][n if row else m]
        return self._vector_cache[key]

    def subtile(self, rD, base: int, tiles: list, aux: list) -> dict:
        """Compute one subtile in place: ``rD`` holds its accumulators in, D (fp32) out.

        ``tiles``: register copies of the operand tiles' subtile; ``aux``: fp32
        register tensors receiving the aux outputs. Returns this subtile's column
        reduction partials, ``(name, static n) -> [partial, tile-local n, tile-local m]`` (a
        subtile holds one 16-row band of each warp, so any of its rows names the band).
        """
        fusion, outputs = self.fusion, dict(self.fusion.graph.outputs)
        col_partials: dict = {}
        for v in range(cute.size(rD)):
            m0, n0 = self.coords0[base + v]
            m, n = self.coords[base + v]
            vectors = {name: self._vector(name, m0, n0, m, n) for name in self.vectors}
            tile_values = {name: t[v].to(Float32) for name, t in zip(fusion.tile_inputs, tiles)}
            values = fusion.compute(rD[v], tile_values, vectors, self.scalars)
            rD[v] = values[outputs["D"]]
            for name, out in zip(fusion.aux_outputs, aux):
                out[v] = values[outputs[name]]
            if fusion.reductions:
                valid = (self.origin[0] + m < self.extent[0]) & (self.origin[1] + n < self.extent[1])
            for r in fusion.reductions:
                x = values[r.arg]
                if r.axis == "row":
                    slot = self.row_partials.setdefault((r.name, m0), [identity(r.combine), m])
                elif r.axis == "col":
                    slot = col_partials.setdefault((r.name, n0), [identity(r.combine), n, m])
                else:
                    key = (r.name, m0 // ROWS_PER_WARP)
                    slot = self.all_partials.setdefault(key, [identity(r.combine), m])
                slot[0] = fold_element(r.combine, slot[0], x, valid)
        return col_partials

    def _band(self, m_local):
        """The global 16-row band (one warp's rows of a WGMMA block) holding tile-local row ``m_local``."""
        return (self.origin[0] + m_local) // ROWS_PER_WARP

    def store_col_partials(self, col_partials: dict, workspaces: tuple, tl, lane) -> None:
        """One subtile's column reductions: lanes sharing a column (they differ in lane
        bits 2-4) combine, then lanes 0-3 hold their warp's 16-row partial and store it."""
        for r, ws in zip(self.fusion.reductions, workspaces):
            if r.axis != "col":
                continue
            for (name, _), (partial, n_local, m_local) in col_partials.items():
                if name != r.name:
                    continue
                value = butterfly(r.combine, partial, (4, 8, 16))
                band = self._band(m_local)
                n = self.origin[1] + n_local
                pred = (lane < 4) & (n < self.extent[1]) & (band * ROWS_PER_WARP < self.extent[0])
                store_if(pred, ws, (tl, band, n), value)

    def store_tile_partials(self, workspaces: tuple, tn, tl, lane) -> None:
        """The tile's row reductions (the 4 lanes of a quad share a row) and whole-tile ones (the
        warp, once per 16-row band it covers)."""
        for r, ws in zip(self.fusion.reductions, workspaces):
            if r.axis == "row":
                for (name, _), (partial, m_local) in self.row_partials.items():
                    if name != r.name:
                        continue
                    value = butterfly(r.combine, partial, (1, 2))
                    m = self.origin[0] + m_local
                    store_if((lane % 4 == 0) & (m < self.extent[0]), ws, (tl, tn, m), value)
            elif r.axis == "all":
                for (name, _), (partial, m_local) in self.all_partials.items():
                    if name != r.name:
                        continue
                    value = butterfly(r.combine, partial, (1, 2, 4, 8, 16))
                    band = self._band(m_local)
                    store_if((lane == 0) & (band * ROWS_PER_WARP < self.extent[0]), ws, (tl, band, tn), value)


def round_for_store(values, dtype: str) -> None:
    """Prepare fp32 ``values`` for conversion to an output ``dtype``: fp8 saturates like the reference."""
    if dtype in FP8_MAX:
        for v in range(cute.size(values)):
            values[v] = saturate(values[v], dtype)
