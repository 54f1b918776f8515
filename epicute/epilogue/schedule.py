"""An epilogue graph lowered to the chain of stages the kernel runs.

As in CK Tile's epilogue chainer (seed 003: a scheduler assembles an epilogue from
nodes that share one context), an epilogue is a chain of stage nodes, and the
graph only decides which nodes are present and what they carry. The kernels
assemble their epilogues from this chain: :mod:`epicute.sm90.epilogue_chain` has
one emitter per stage kind (:data:`STAGE_KINDS`), and a kernel runs the chain's
hooks in chain order -- before its mainloop, at a tile's start, once per epilogue
subtile, at the tile's end -- so the chain ``explain`` prints is the program the
kernel runs. The ready schedules (:mod:`epicute.epilogue.library`) are
compositions of these nodes like any user's epilogue.

Kernel families differ in where operands come from and where outputs are staged;
a :class:`ChainStyle` says how, and picks the nodes:

- :data:`GEMM_SM90`: tile operands arrive by TMA through their own shared-memory
  ring, one epilogue subtile per stage (``load_tiles``); row/column vectors are
  fetched before the mainloop and parked in shared memory after it
  (``load_vectors``); every stored output has its own staging ring and one bulk
  group stores a subtile of all of them (one ``fence_barrier`` and one
  ``tma_store``); a tile is several subtiles (``advance``).
- :data:`ATTENTION_SM90`: operands are read from global memory where the compute
  needs them (``read_tiles``, ``read_vectors``); the O tile is one subtile, and its
  outputs are staged in turn through the one buffer the kernel has for them (Q's),
  each with its own fence, barrier and TMA store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from epicute.epilogue import optable
from epicute.epilogue.dtypes import FP8_MAX
from epicute.epilogue.gated import GATE_BLOCK, output_columns
from epicute.epilogue.graph import LEAVES, REDUCTIONS, Graph, Node
from epicute.epilogue.group_quant import GROUP_N, GROUP_OPS
from epicute.epilogue.operands import OperandSpec
from epicute.errors import EpilogueError

#: Every stage kind: its scope (``tile``: once per output tile; ``subtile``: once per
#: epilogue subtile) and what it does. The kernels' emitters are keyed by these names.
STAGE_KINDS = {
    "load_vectors": ("tile", "row/column vector slices: global -> registers before the mainloop, -> smem after it"),
    "slice_acc": ("subtile", "this subtile's fp32 accumulators"),
    "load_tiles": ("subtile", "operand tiles: wait for the TMA load of this subtile, smem -> registers, release"),
    "read_tiles": ("subtile", "operand tiles: global -> registers where the compute reads them"),
    "read_vectors": ("subtile", "vectors: global -> registers, once per distinct row/column"),
    "compute": ("subtile", "the graph's ops, per element in fp32 registers"),
    "reduce": ("subtile", "fold a value into per-thread partials"),
    "cast": ("subtile", "round an output to its stored dtype"),
    "store_smem": ("subtile", "registers -> an output's smem staging buffer"),
    "fence_barrier": ("subtile", "fence.proxy.async.shared::cta, then named barrier over the epilogue's threads"),
    "tma_store": ("subtile", "one thread issues TMA stores smem -> global as one bulk group"),
    "advance": ("subtile", "next subtile: accumulator slice and staging buffers"),
    "delayed_store": ("subtile", ("the previous subtile's fence, barrier, TMA store and staging advance (the last "
                                  "subtile's after the loop): the store issued one subtile later")),
    "group_amax": ("subtile", "quantize_groups, first pass: fold |x| into per-row, per-128-column partials; keep x"),
    "group_scales": ("tile", "quantize_groups: the groups' amax across lanes, their scales stored, reciprocals kept"),
    "group_quantize": ("subtile", "quantize_groups, second pass: the kept x times its group's reciprocal scale"),
    "finalize_reductions": ("tile", "partials across lanes, then per-tile partials to an fp32 workspace"),
}

_REDUCED_SHAPE = {"col": "(L, M)", "row": "(L, N)", "scalar": "scalar"}

#: Estimated SASS instructions per element of each op as the kernel emits it (fp32; the
#: transcendental ones with their range reduction, IEEE division and square root with
#: their fix-up sequence): each op's ``instructions`` in :mod:`epicute.epilogue.optable`,
#: a live view. The planner sizes the unrolled epilogue's code from this and the
#: roofline its arithmetic time per tile.
OP_INSTRUCTIONS = optable.view(lambda op: op.instructions, "instructions per element")
#: Per element and per operand or output: a tile operand's smem load and conversion, a
#: vector's smem read, a stored output's conversion and staging, a reduction's fold.
IO_INSTRUCTIONS = {"tile_input": 2, "vector": 1, "tile_output": 2, "reduction": 4, "group_quant": 5}


@dataclass(frozen=True)
class ChainStyle:
    """How a kernel family provides operands and stages outputs (see the module docstring)."""

    name: str
    #: "smem": tile operands by a TMA ring, vectors parked in smem; "global": read where used
    operands: str
    #: "own": each output its own staging ring, one bulk group per subtile; "shared": one
    #: buffer, outputs staged and stored in turn
    staging: str
    #: what a stored output's staging buffer is, for explain
    staging_buffer: str
    #: a tile is several epilogue subtiles
    subtiles: bool
    #: the accumulator the chain starts from, for explain
    acc: str


GEMM_SM90 = ChainStyle(
    "gemm_sm90", operands="smem", staging="own", staging_buffer="its smem staging ring", subtiles=True,
    acc="acc: this subtile's fp32 accumulators (registers)",
)  # fmt: skip
ATTENTION_SM90 = ChainStyle(
    "attention_sm90", operands="global", staging="shared", subtiles=False,
    staging_buffer="the smem staging tile (Q's buffer, or the outputs' own)",
    acc="acc: the O tile, normalized by the row sums (fp32 registers)",
)  # fmt: skip


@dataclass(frozen=True)
class EpilogueBuffers:
    """What a fused epilogue needs in shared memory, by dtype (from its schedule); the
    family's shared-memory layout sizes them for a configuration."""

    #: dtypes of the full-tile operands, loaded by TMA one epilogue subtile at a time
    tile_inputs: tuple[str, ...] = ()
    #: dtypes of the full-tile outputs besides D, each staged and TMA-stored like D
    aux_outputs: tuple[str, ...] = ()
    #: kinds ("row" / "col") of the vector operands, staged as fp32 once per tile
    vectors: tuple[str, ...] = ()
    #: the stage chain, as ``explain`` prints it (not part of the layout, but part of the
    #: identity: plans are cached by these buffers, and each epilogue's plan shows its own chain)
    chain: tuple[str, ...] = ()
    #: estimated SASS instructions per output element: sizes the unrolled epilogue's code
    #: (``heuristics.EPILOGUE_CODE_BUDGET``) and its arithmetic time (``roofline``)
    instructions_per_element: int = 0
    #: D is quantized per row and group of this many columns (``ops.quantize_groups``; 0: not): a
    #: tile must hold whole groups
    group_n: int = 0
    #: a gated epilogue (:mod:`epicute.epilogue.gated`): a tile's output has half its accumulator's columns
    gated: bool = False
    #: D stores a ``D_up`` output beside it, blocks interleaved (:attr:`~epicute.epilogue.graph.Graph.paired`)
    paired: bool = False
    #: the chain of the same epilogue over D^T (row and column vectors trading places), as a swap-AB GEMM
    #: runs it; empty where the epilogue has no transpose (see :meth:`transposed`)
    transposed_chain: tuple[str, ...] = ()
    #: the chain with its TMA store issued one subtile later (:func:`delay_stores`), as a GEMM planned with
    #: ``delay_tma_store`` runs it; empty where the chain cannot be delayed (:func:`delayable`)
    delayed_chain: tuple[str, ...] = ()
    #: the same of :attr:`transposed_chain`
    transposed_delayed_chain: tuple[str, ...] = ()

    @property
    def loads_tiles(self) -> bool:
        return bool(self.tile_inputs)

    def transposed(self) -> EpilogueBuffers | None:
        """What the epilogue needs when a swap-AB GEMM computes D^T: row vectors become column vectors and the
        other way round. None where the epilogue has no such form: tile operands and aux tiles (stored
        row-major by TMA), reductions and group quantization (along one axis), gating (pairs B's columns). A
        plain GEMM's (no chain) is itself."""
        if not self.chain:
            return self
        if not self.transposed_chain:
            return None
        vectors = tuple("row" for k in self.vectors if k == "col") + tuple("col" for k in self.vectors if k == "row")
        return replace(self, vectors=vectors, chain=self.transposed_chain, transposed_chain=self.chain,
                       delayed_chain=self.transposed_delayed_chain, transposed_delayed_chain=self.delayed_chain)

    def out_tile_n(self, tile_n: int) -> int:
        """Output columns of an accumulator tile ``tile_n`` wide (half of them when gated)."""
        return output_columns(tile_n, self.gated)


NO_EPILOGUE = EpilogueBuffers()


@dataclass(frozen=True)
class Stage:
    """One node of the chain: its ``kind`` (a :data:`STAGE_KINDS` key), what it does on what
    (``detail``), the graph nodes it covers and the operands or outputs it handles by name."""

    kind: str
    detail: str
    nodes: tuple[int, ...] = ()
    names: tuple[str, ...] = ()

    @property
    def scope(self) -> str:
        return STAGE_KINDS[self.kind][0]

    def __str__(self) -> str:
        return f"{self.scope:<8} {self.kind:<20} {self.detail}"


@dataclass(frozen=True)
class EpilogueSchedule:
    """The stages of one epilogue, plus what they touch (names, in parameter / output order).

    Operands no output depends on are neither loaded nor listed.
    """

    graph: Graph
    style: ChainStyle
    stages: tuple[Stage, ...]
    tile_operands: tuple[str, ...]
    vector_operands: tuple[str, ...]
    scalar_operands: tuple[str, ...]
    tile_outputs: tuple[str, ...]
    reductions: tuple[str, ...]

    def buffers(self) -> EpilogueBuffers:
        """Shared memory the kernel gives this epilogue (what the planner budgets and ``explain`` prints)."""
        g = self.graph
        inputs, stored = dict(g.inputs), dict(g.output_dtypes)
        transposed = schedule(g.transposed(), style=self.style).stages if self.transposable else ()
        kinds = [g.node(inputs[name]).kind for name in self.vector_operands]
        return EpilogueBuffers(
            tile_inputs=tuple(g.node(inputs[name]).dtype for name in self.tile_operands),
            aux_outputs=tuple(stored[name] for name in self.tile_outputs if name != "D"),
            vectors=tuple(k for k in kinds if k == "row") + tuple(k for k in kinds if k == "col"),
            chain=tuple(str(stage) for stage in self.stages),
            instructions_per_element=self.instructions_per_element(),
            group_n=GROUP_N if self.quantizes_groups else 0,
            gated=g.gated,
            paired=g.paired,
            transposed_chain=tuple(str(stage) for stage in transposed) if self.transposable else (),
            delayed_chain=_delayed(self.stages),
            transposed_delayed_chain=_delayed(transposed) if self.transposable else (),
        )

    @property
    def transposable(self) -> bool:
        """Whether the GEMM can run this epilogue over D^T (swap-AB): elementwise ops over the accumulator,
        scalars and row/column vectors, with D its only output."""
        return (
            self.style == GEMM_SM90 and not self.tile_operands and self.tile_outputs == ("D",) and not self.reductions
            and not self.quantizes_groups and not self.graph.gated
        )  # fmt: skip

    @property
    def quantizes_groups(self) -> bool:
        """D is ``ops.quantize_groups``' tile: the epilogue runs two passes over the subtiles."""
        return any(stage.kind == "group_scales" for stage in self.stages)

    def instructions_per_element(self) -> int:
        """Estimated SASS instructions per output element (:data:`OP_INSTRUCTIONS`)."""
        compute = next((stage.nodes for stage in self.stages if stage.kind == "compute"), ())
        io = IO_INSTRUCTIONS
        return (
            sum(OP_INSTRUCTIONS[self.graph.node(i).op] for i in compute)
            + io["tile_input"] * len(self.tile_operands)
            + io["vector"] * len(self.vector_operands)
            + io["tile_output"] * len(self.tile_outputs)
            + io["reduction"] * len(self.reductions)
            + io["group_quant"] * self.quantizes_groups
        )

    def __str__(self) -> str:
        return "\n".join(f"{i:>2}  {stage}" for i, stage in enumerate(self.stages))


def delayable(stages: tuple[Stage, ...]) -> bool:
    """Whether :func:`delay_stores` applies: one pass over the subtiles, one store group staged in its own
    buffers, and no operand tiles streaming in through the TMA ring. With them, a delayed store gave wrong values
    in the subtiles of the ring's second slot on the H200 (bench/NOTES.md, issue 60): the ring's consumers
    release a slot right after reading it, and only the per-subtile barrier a delayed store moves away kept the
    refill behind every warp's reads. CUTLASS likewise delays only epilogues without a source C."""
    kinds = [stage.kind for stage in stages]
    return ("group_scales" not in kinds and kinds.count("tma_store") == 1 and "advance" in kinds
            and "load_tiles" not in kinds)  # fmt: skip


def delay_stores(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """The chain with each subtile's store issued one subtile later (CUTLASS's ``DelayTmaStore``): the fence,
    barrier, TMA store and staging advance of subtile ``i`` run in subtile ``i + 1``, after its math and just
    before its registers are staged (the latest they can: the store must be committed before the next buffer is
    acquired), and the last subtile's after the loop. The barrier then waits for the slowest thread's staging
    writes while every thread has had a subtile's arithmetic to do, and the store warp's issue and wait sit after
    that arithmetic, not before it."""
    if not delayable(stages):
        raise EpilogueError("delay_stores: the chain makes two passes over the subtiles, stores in several groups or "
                            "loads operand tiles")
    store = next(stage for stage in stages if stage.kind == "tma_store")
    delayed = Stage("delayed_store", f"{', '.join(store.names)}: the previous subtile's fence.proxy.async.shared::"
                    "cta, named barrier and TMA store (one bulk group; commit, wait until the staging buffer about to "
                    "be reused has been read), then the next staging buffer; the last subtile's after the loop",
                    store.nodes, store.names)  # fmt: skip
    out: list[Stage] = []
    for stage in stages:
        if stage.kind == "store_smem" and delayed not in out:
            out.append(delayed)
        if stage.kind not in ("fence_barrier", "tma_store", "advance"):
            out.append(stage)
    return tuple(out)


def _delayed(stages: tuple[Stage, ...]) -> tuple[str, ...]:
    return tuple(str(stage) for stage in delay_stores(stages)) if delayable(stages) else ()


def needed_nodes(graph: Graph) -> set[int]:
    """Ids of the nodes some output depends on."""
    needed = {node_id for _, node_id in graph.outputs}
    for node in reversed(graph.nodes):
        if node.id in needed:
            needed.update(node.args)
    return needed


def _how_rounded(dtype: str) -> str:
    return "saturating" if dtype in FP8_MAX else "no conversion" if dtype == "fp32" else "round to nearest even"


def plain_graph(d_dtype: str) -> Graph:
    """The epilogue of a kernel without a fused one: D is the accumulator, stored in ``d_dtype``."""
    return Graph(nodes=(Node(0, "acc"),), inputs=(), outputs=(("D", 0),), output_dtypes=(("D", d_dtype),))


def schedule(
    graph: Graph, operand_specs: Mapping[str, OperandSpec] | None = None, style: ChainStyle = GEMM_SM90
) -> EpilogueSchedule:
    """Lower ``graph`` to the chain of ``style``; ``operand_specs``, if given, must be what it was
    traced for. A kernel without a fused epilogue runs the chain of :func:`plain_graph`."""
    if operand_specs is not None:
        for name, node_id in graph.inputs:
            node, spec = graph.node(node_id), operand_specs.get(name)
            if spec is None or (spec.kind, spec.dtype) != (node.kind, node.dtype):
                got = "nothing" if spec is None else f"{spec.kind} {spec.dtype}"
                raise EpilogueError(f"operand {name!r}: the graph was traced for {node.kind} {node.dtype}, got {got}")
    needed = needed_nodes(graph)
    used = [(name, graph.node(node_id)) for name, node_id in graph.inputs if node_id in needed]
    # Row vectors first, then column vectors: the order of the kernel's vector arguments and buffers.
    vectors = [(name, node) for kind in ("row", "col") for name, node in used if node.kind == kind]
    tiles = [(name, node) for name, node in used if node.kind == "tile"]
    stored = dict(graph.output_dtypes)
    tile_outputs = [
        (name, graph.node(i)) for name, i in graph.outputs if graph.node(i).op not in (*REDUCTIONS, "group_scales")
    ]
    reductions = [(name, graph.node(i)) for name, i in graph.outputs if graph.node(i).op in REDUCTIONS]
    compute = [
        node for node in graph.nodes if node.id in needed and node.op not in LEAVES + tuple(REDUCTIONS) + GROUP_OPS
    ]
    quantized = next(((name, node) for name, node in tile_outputs if node.op == "group_quant"), None)

    def ids(pairs) -> tuple[int, ...]:
        return tuple(node.id for _, node in pairs)

    def listed(pairs) -> str:
        return ", ".join(f"{name} ({node.kind}, {node.dtype})" for name, node in pairs)

    def names(pairs) -> tuple[str, ...]:
        return tuple(name for name, _ in pairs)

    stages: list[Stage] = []
    if vectors and style.operands == "smem":
        stages.append(Stage("load_vectors", f"{listed(vectors)}: this tile's slice, global -> registers before the "
                            "mainloop (latency hidden), -> smem after it", ids(vectors), names(vectors)))  # fmt: skip
    if graph.gated:
        up = next(node.id for node in graph.nodes if node.op == "acc_up")
        stages.append(Stage("slice_acc", f"gate, up: this subtile's fp32 accumulators, each output column's gate and "
                            f"up values (B's columns interleaved in blocks of {GATE_BLOCK}: the same thread's "
                            "registers)", (0, up)))  # fmt: skip
    else:
        stages.append(Stage("slice_acc", style.acc, (0,)))
    if tiles:
        if style.operands == "smem":
            stages.append(Stage("load_tiles", f"{listed(tiles)}: wait for this subtile's TMA load, smem -> registers, "
                                "to fp32, release the ring stage", ids(tiles), names(tiles)))  # fmt: skip
        else:
            stages.append(Stage("read_tiles", f"{listed(tiles)}: global -> registers where the compute reads them, "
                                "to fp32", ids(tiles), names(tiles)))  # fmt: skip
    if vectors and style.operands == "global":
        stages.append(Stage("read_vectors", f"{listed(vectors)}: global -> registers, once per distinct row or "
                            "column of the subtile", ids(vectors), names(vectors)))  # fmt: skip
    # D = acc alone needs no compute stage; any other output, a reduction or an op does (it routes values).
    if compute or len(graph.outputs) > 1 or graph.output_node("D").op != "acc":
        ops = ", ".join(f"%{n.id} {n.op}" for n in compute) or "no ops: acc to every output"
        stages.append(Stage("compute", ops, tuple(n.id for n in compute)))
    for name, node in reductions:
        combine = REDUCTIONS[node.op][1]
        stages.append(Stage("reduce", f"{name} = {node.op}(%{node.args[0]}): fold this subtile into per-thread "
                            f"{combine} partials, out-of-bounds elements excluded", (node.id,), (name,)))  # fmt: skip
    if quantized is not None:
        # Two passes over the tile: a group's scale needs all its columns, which span several subtiles.
        name, node = quantized
        scales = next((out for out, i in graph.outputs if graph.node(i).op == "group_scales"), None)
        if scales is None:
            raise EpilogueError("quantize_groups: return its scales too (q, scales = ...; {'D': q, 'scales': scales})")
        group = f"per row and group of {GROUP_N} columns"
        stages.append(Stage("group_amax", f"{name} = quantize_groups(%{node.args[0]}): fold |x| {group} into "
                            "per-thread partials (out-of-bounds elements excluded), keep x in the accumulator "
                            "registers",
                            (node.id,), (name,)))  # fmt: skip
        how = "max(amax, 1e-4) / fp8 max" + (", rounded up to a power of two (UE8M0)" if node.attr("ue8m0") else "")
        stages.append(Stage("group_scales", f"{scales}: butterfly-shuffle the partials across the 4 lanes of a "
                            f"row, scale = {how}, stored (M, N/{GROUP_N}) M-major; keep 1 / scale", (node.id,),
                            (scales,)))  # fmt: skip
        stages.append(Stage("group_quantize", f"{name}: second pass over the subtiles, kept x times 1 / scale",
                            (node.id,), (name,)))  # fmt: skip
    for name, node in tile_outputs:
        dtype = stored[name]
        stages.append(Stage("cast", f"{name}: fp32 -> {dtype} ({_how_rounded(dtype)})", ids([(name, node)]), (name,)))
    # Store groups: outputs staged together (own buffers) or one at a time (one shared buffer).
    groups = [tile_outputs] if style.staging == "own" else [[out] for out in tile_outputs]
    for group in groups:
        for name, node in group:
            stages.append(Stage("store_smem", f"{name}: registers -> {style.staging_buffer}", ids([(name, node)]),
                                (name,)))  # fmt: skip
        stages.append(Stage("fence_barrier", "fence.proxy.async.shared::cta, then named barrier over the "
                            "epilogue's threads", (), names(group)))  # fmt: skip
        wait = (
            "; commit the bulk group, wait until the staging buffer about to be reused has been read"
            if style.staging == "own" else "; wait until it has read the buffer, then barrier: the next "
            "output may be staged there"
        )  # fmt: skip
        plural = "s" if len(group) > 1 else ""
        stages.append(Stage("tma_store", f"{', '.join(names(group))}: one thread issues the TMA store{plural} "
                            f"smem -> global{wait}", ids(group), names(group)))  # fmt: skip
    if style.subtiles:
        stages.append(Stage("advance", "next subtile: accumulator slice, staging buffers"
                            + (", tile-operand ring" if tiles and style.operands == "smem" else "")))  # fmt: skip
    if reductions:
        listing = ", ".join(f"{name} {_REDUCED_SHAPE[node.kind]}" for name, node in reductions)
        stages.append(Stage("finalize_reductions", "butterfly-shuffle partials across lanes, store per-tile partials "
                            f"to an fp32 workspace; after the kernel one ordered torch reduction gives {listing} "
                            "(deterministic: no float atomics)", ids(reductions), names(reductions)))  # fmt: skip

    return EpilogueSchedule(
        graph=graph,
        style=style,
        stages=tuple(stages),
        tile_operands=names(tiles),
        vector_operands=names(vectors),
        scalar_operands=tuple(name for name, node in used if node.kind == "scalar"),
        tile_outputs=names(tile_outputs),
        reductions=names(reductions),
    )
