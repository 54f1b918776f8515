"""A fused GEMM epilogue as the kernel runs it: the host half, pure Python.

:class:`EpilogueFusion` is the traced graph and its stage schedule, split into
what each part of the kernel handles --

- **tile operands**: TMA-loaded into a shared-memory ring, one epilogue subtile
  per stage, by the producer's epilogue-load warp while the mainloop runs;
- **row / column vectors**: this tile's slice loaded by the consumer threads
  *before* the mainloop (one element each, so the latency hides behind it),
  parked in shared memory after it, and read once per distinct coordinate;
- **scalars**: fp32 kernel arguments;
- **outputs**: D and any auxiliary full tiles, staged and TMA-stored together;
- **reductions**: folded per thread, combined across lanes with butterfly
  shuffles, and written as per-tile partials to an fp32 workspace in global
  memory; :meth:`Reduction.finalize` combines them with one ordered torch
  reduction, so results are bitwise reproducible (no float atomics).

Kernel tensor arguments arrive batch-first in :attr:`EpilogueFusion.tensor_args`
order: tile operands, row vectors, column vectors, aux outputs, workspaces. The
device half (the DSL code of each node) is :mod:`epicute.sm90.epilogue_emit`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from epicute.epilogue import optable
from epicute.epilogue.graph import REDUCTION_IDENTITY, REDUCTIONS, UP_OUTPUT, Graph
from epicute.epilogue.group_quant import GROUP_N
from epicute.epilogue.hashing import semantic_hash
from epicute.epilogue.schedule import GEMM_SM90, ChainStyle, EpilogueBuffers, EpilogueSchedule, needed_nodes, schedule
from epicute.errors import EpilogueError

#: Value dtypes the kernel can load, store or round to.
KERNEL_DTYPES = frozenset(("bf16", "fp16", "fp32", "fp8e4m3", "fp8e5m2"))

#: Rows one warp owns in a WGMMA accumulator (64-row atom / 4 warps): the band of
#: rows a column-reduction partial covers.
ROWS_PER_WARP = 16


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
class GroupQuant:
    """D quantized per row and group of ``GROUP_N`` columns (:mod:`epicute.epilogue.group_quant`): the scales'
    output name, the fp8 dtype, UE8M0 rounding, and the node of the values quantized."""

    scales: str
    dtype: str
    ue8m0: bool
    arg: int

    def scales_shape(self, l: int, m: int, n: int) -> tuple[int, int, int]:
        """The kernel's scales tensor, ``(L, groups, M)``: M-major, returned as its ``(L, M, groups)`` transpose."""
        return (l, -(-n // GROUP_N), m)


@dataclass(frozen=True)
class EpilogueFusion:
    graph: Graph
    #: (name, kind, dtype) of each operand, in parameter order
    operands: tuple[tuple[str, str, str], ...]
    #: the kernel family's chain (how it gets operands and stages outputs)
    style: ChainStyle = GEMM_SM90
    sched: EpilogueSchedule = field(init=False, compare=False, repr=False)

    def __hash__(self) -> int:
        # Computed once: every launch with an epilogue looks its kernel up by fusion (a deep graph hash otherwise).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.graph, self.operands, self.style))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __post_init__(self) -> None:
        object.__setattr__(self, "sched", schedule(self.graph, style=self.style))
        # The tracer already guarantees a tile "D" and only tile or reduction outputs.
        for node in self.graph.nodes:
            if node.op == "index":
                raise EpilogueError("index inputs (q_idx, kv_idx, ...) exist only in attention score_mod")
            if optable.rounds(node.op) and node.attr("dtype") not in KERNEL_DTYPES:
                raise EpilogueError(
                    f"%{node.id} {node.op} to {node.attr('dtype')}: the kernel rounds to {sorted(KERNEL_DTYPES)}"
                )
        for name, kind, dtype in self.operands:
            if kind != "scalar" and dtype not in KERNEL_DTYPES:
                raise EpilogueError(f"operand {name!r} has dtype {dtype}; the kernel loads {sorted(KERNEL_DTYPES)}")
        self._check_group_quant()
        self._check_paired()
        if self.gated and self.style != GEMM_SM90:
            raise EpilogueError(
                f"a gated epilogue pairs GEMM accumulator columns; the {self.style.name} kernel has none"
            )

    def _check_paired(self) -> None:
        """A ``D_up`` output shares D's tensor (:attr:`Graph.paired`): a tile of D's dtype, beside a plain D."""
        if not self.paired:
            return
        up = self.graph.output_node(UP_OUTPUT)
        if up.kind != "tile" or up.op in REDUCTIONS:
            raise EpilogueError(f"output {UP_OUTPUT!r} is stored interleaved with D, so it must be a tile like D; "
                                f"give a {up.op} result another name")  # fmt: skip
        d_dtype, up_dtype = self.output_dtypes["D"], self.output_dtypes[UP_OUTPUT]
        if d_dtype != up_dtype:
            raise EpilogueError(f"output {UP_OUTPUT!r} is {up_dtype} but D is {d_dtype}: the two share one tensor "
                                f"(Graph.paired); set out_dtypes[{UP_OUTPUT!r}] to D's dtype")  # fmt: skip
        if self.graph.output_node("D").op == "group_quant" or self.style != GEMM_SM90:
            raise EpilogueError(f"output {UP_OUTPUT!r} pairs with a plain D of a GEMM's tile (quantize_groups and "
                                f"attention store D their own way)")  # fmt: skip

    def _check_group_quant(self) -> None:
        outputs = {name: self.graph.node(i) for name, i in self.graph.outputs}
        quantized = [name for name, node in outputs.items() if node.op == "group_quant"]
        if not quantized:
            return
        if self.style != GEMM_SM90:
            raise EpilogueError(
                f"quantize_groups: the {self.style.name} kernel has no quantizing epilogue; the GEMM has"
            )
        if quantized != ["D"]:
            raise EpilogueError(f"quantize_groups: its tile is output {quantized[0]!r}; return it as D")
        aux = [name for name in self.sched.tile_outputs if name != "D"]
        if aux:
            raise EpilogueError(
                f"quantize_groups stores D in a second pass over the tile; aux tile outputs {aux} are not supported "
                "beside it (reductions are)"
            )

    # ------------------------------------------------------------ host side
    # Cached: the fusion is immutable, and the launch path reads these on every call.
    def _dtype(self, name: str) -> str:
        return next(d for n, _, d in self.operands if n == name)

    def _kind(self, name: str) -> str:
        return next(k for n, k, _ in self.operands if n == name)

    @functools.cached_property
    def needed(self) -> frozenset[int]:
        """The graph nodes some output depends on."""
        return frozenset(needed_nodes(self.graph))

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
    def returned_outputs(self) -> tuple[str, ...]:
        """What a call hands back by name: every output but a paired ``D_up``, which is inside D."""
        return tuple(name for name in self.output_dtypes if not (self.paired and name == UP_OUTPUT))

    @functools.cached_property
    def tile_output_dtypes(self) -> dict[str, str]:
        """The stored dtype of each tile output (D first, then the aux tiles): what a kernel stages."""
        return {name: self.output_dtypes[name] for name in self.sched.tile_outputs}

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
            + ((("group_scales", self.group_quant.scales, "fp32"),) if self.group_quant else ())
        )

    @functools.cached_property
    def group_quant(self) -> GroupQuant | None:
        """D quantized by ``ops.quantize_groups``, or None."""
        d = self.graph.output_node("D")
        if d.op != "group_quant":
            return None
        scales = next(name for name, i in self.graph.outputs if self.graph.node(i).op == "group_scales")
        return GroupQuant(scales, d.attr("dtype"), d.attr("ue8m0"), d.args[0])

    @property
    def gated(self) -> bool:
        """Gate and up accumulator columns pair into one output column (:mod:`epicute.epilogue.gated`)."""
        return self.graph.gated

    @property
    def paired(self) -> bool:
        """D and its ``D_up`` output interleave into one D of twice the columns (:attr:`Graph.paired`)."""
        return self.graph.paired

    def buffers(self) -> EpilogueBuffers:
        """Shared memory this epilogue needs (the planner's and the kernel's single source)."""
        return self.sched.buffers()

    @functools.cached_property
    def transposed(self) -> EpilogueFusion:
        """This epilogue as a swap-AB GEMM runs it, over D^T: row vectors (one value per column of D) are column
        vectors of the kernel's output tile and the other way round (operands keep their names and canonical
        ``(L, N)``/``(L, M)`` tensors). Its ``buffers()`` are ``self.buffers().transposed()``."""
        if not self.sched.transposable:
            raise EpilogueError(
                "swap_ab runs epilogues of elementwise ops over the accumulator, scalars and row/column vectors "
                "with D their only output; this one has tile operands, aux tiles, reductions, group quantization "
                "or gating: use swap_ab=False"
            )
        swap = {"row": "col", "col": "row"}
        operands = tuple((name, swap.get(kind, kind), dtype) for name, kind, dtype in self.operands)
        return EpilogueFusion(self.graph.transposed(), operands, self.style)

    @property
    def stages(self):
        """The chain the kernel runs (:mod:`epicute.epilogue.schedule`)."""
        return self.sched.stages

    def key(self) -> tuple:
        return (semantic_hash(self.graph), self.operands, self.style.name)


#: Operand kinds of a score_mod as the attention kernel reads them: scalars and per-head vectors.
SCORE_MOD_KINDS = ("scalar", "head")


@dataclass(frozen=True)
class ScoreModFusion:
    """A traced score_mod as the attention kernel applies it: to each scaled score, before the masks
    and the softmax. Its leaves are the score (``acc``), the index leaves (``b``, ``h``, ``q_idx``,
    ``kv_idx``), scalars and per-head vectors (``(heads_q,)``); its ops are the op table's, emitted by
    the emitter every epilogue uses (:func:`epicute.sm90.epilogue_emit.emit_graph`)."""

    graph: Graph
    #: (name, kind, dtype) per operand, in parameter order; kind in SCORE_MOD_KINDS
    operands: tuple[tuple[str, str, str], ...]

    def __post_init__(self) -> None:
        if [name for name, _ in self.graph.outputs] != ["D"]:
            raise EpilogueError("a score_mod returns one value per score (the modified score), not a dict of outputs")
        for node in self.graph.nodes:
            if node.op in REDUCTIONS:
                raise EpilogueError(f"{node.op}: a score_mod has no reductions; it maps each score to a score")
            if optable.rounds(node.op) and node.attr("dtype") not in KERNEL_DTYPES:
                raise EpilogueError(
                    f"%{node.id} {node.op} to {node.attr('dtype')}: the kernel rounds to {sorted(KERNEL_DTYPES)}"
                )
        for name, kind, dtype in self.operands:
            if kind not in SCORE_MOD_KINDS:
                raise EpilogueError(f"operand {name!r}: kind {kind!r} is not one of {SCORE_MOD_KINDS}")
            if kind != "scalar" and dtype not in KERNEL_DTYPES:
                raise EpilogueError(f"operand {name!r} has dtype {dtype}; the kernel loads {sorted(KERNEL_DTYPES)}")

    @property
    def tensor_operands(self) -> tuple[tuple[str, str, str], ...]:
        return tuple(op for op in self.operands if op[1] != "scalar")

    @property
    def scalar_operands(self) -> tuple[tuple[str, str, str], ...]:
        return tuple(op for op in self.operands if op[1] == "scalar")

    def key(self) -> tuple:
        return (semantic_hash(self.graph), self.operands)


__all__ = ["KERNEL_DTYPES", "ROWS_PER_WARP", "SCORE_MOD_KINDS", "EpilogueFusion", "Reduction", "ScoreModFusion"]
