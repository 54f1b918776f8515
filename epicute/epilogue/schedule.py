"""An epilogue graph lowered to the chain of stages the kernel runs, as data.

Like CK Tile's epilogue chainer (slice -> cast/store to LDS -> load -> apply ->
store -> move), the kernel's epilogue is a fixed chain per output subtile, and
the graph only decides which links are present and what they carry. Per tile:
the row/col vectors are loaded once. Per subtile: slice the accumulators, load
each tile operand from shared memory, compute, cast and stage each stored
output, fence and barrier, TMA-store, fold reductions into partials, advance.
Per tile end: finalize the reductions. The kernel emitter walks
:attr:`EpilogueSchedule.stages` in order; ``explain`` prints them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from epicute.epilogue import optable
from epicute.epilogue.dtypes import FP8_MAX
from epicute.epilogue.graph import LEAVES, REDUCTIONS, Graph
from epicute.epilogue.operands import OperandSpec
from epicute.errors import EpilogueError
from epicute.gemm.smem import EpilogueBuffers

#: Stages run once per output tile; all others run once per epilogue subtile.
PER_TILE = ("load_vectors", "finalize_reductions")

_REDUCED_SHAPE = {"col": "(L, M)", "row": "(L, N)", "scalar": "scalar"}

#: Estimated SASS instructions per element of each op as the kernel emits it (fp32; the
#: transcendental ones with their range reduction, IEEE division and square root with
#: their fix-up sequence): each op's ``instructions`` in :mod:`epicute.epilogue.optable`,
#: a live view. The planner sizes the unrolled epilogue's code from this and the
#: roofline its arithmetic time per tile.
OP_INSTRUCTIONS = optable.view(lambda op: op.instructions, "instructions per element")
#: Per element and per operand or output: a tile operand's smem load and conversion, a
#: vector's smem read, a stored output's conversion and staging, a reduction's fold.
IO_INSTRUCTIONS = {"tile_input": 2, "vector": 1, "tile_output": 2, "reduction": 4}


@dataclass(frozen=True)
class Stage:
    """One link of the chain: what it does (``kind``), on what (``detail``), and the graph nodes it covers."""

    kind: str
    detail: str
    nodes: tuple[int, ...] = ()

    @property
    def scope(self) -> str:
        return "tile" if self.kind in PER_TILE else "subtile"

    def __str__(self) -> str:
        return f"{self.scope:<8} {self.kind:<20} {self.detail}"


@dataclass(frozen=True)
class EpilogueSchedule:
    """The stages of one epilogue, plus what they touch (names, in parameter / output order).

    Operands no output depends on are neither loaded nor listed.
    """

    graph: Graph
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
        kinds = [g.node(inputs[name]).kind for name in self.vector_operands]
        return EpilogueBuffers(
            tile_inputs=tuple(g.node(inputs[name]).dtype for name in self.tile_operands),
            aux_outputs=tuple(stored[name] for name in self.tile_outputs if name != "D"),
            vectors=tuple(k for k in kinds if k == "row") + tuple(k for k in kinds if k == "col"),
            chain=tuple(str(stage) for stage in self.stages),
            instructions_per_element=self.instructions_per_element(),
        )

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
        )

    def __str__(self) -> str:
        return "\n".join(f"{i:>2}  {stage}" for i, stage in enumerate(self.stages))


def needed_nodes(graph: Graph) -> set[int]:
    """Ids of the nodes some output depends on."""
    needed = {node_id for _, node_id in graph.outputs}
    for node in reversed(graph.nodes):
        if node.id in needed:
            needed.update(node.args)
    return needed


def schedule(graph: Graph, operand_specs: Mapping[str, OperandSpec] | None = None) -> EpilogueSchedule:
    """Lower ``graph`` to its stage chain; ``operand_specs``, if given, must be what it was traced for."""
    if operand_specs is not None:
        for name, node_id in graph.inputs:
            node, spec = graph.node(node_id), operand_specs.get(name)
            if spec is None or (spec.kind, spec.dtype) != (node.kind, node.dtype):
                got = "nothing" if spec is None else f"{spec.kind} {spec.dtype}"
                raise EpilogueError(f"operand {name!r}: the graph was traced for {node.kind} {node.dtype}, got {got}")
    needed = needed_nodes(graph)
    used = [(name, graph.node(node_id)) for name, node_id in graph.inputs if node_id in needed]
    vectors = [(name, node) for name, node in used if node.kind in ("row", "col")]
    tiles = [(name, node) for name, node in used if node.kind == "tile"]
    stored = dict(graph.output_dtypes)
    tile_outputs = [(name, graph.node(i)) for name, i in graph.outputs if graph.node(i).op not in REDUCTIONS]
    reductions = [(name, graph.node(i)) for name, i in graph.outputs if graph.node(i).op in REDUCTIONS]
    compute = [node for node in graph.nodes if node.id in needed and node.op not in LEAVES + tuple(REDUCTIONS)]

    stages: list[Stage] = []
    if vectors:
        listed = ", ".join(f"{name} ({node.kind}, {node.dtype})" for name, node in vectors)
        stages.append(Stage("load_vectors", f"{listed}: this tile's slice, global -> registers before the "
                            "mainloop (latency hidden), -> smem after it",
                            tuple(node.id for _, node in vectors)))  # fmt: skip
    stages.append(Stage("slice_acc", "acc: this subtile's fp32 accumulators (registers)", (0,)))
    for name, node in tiles:
        stages.append(Stage("load_tiles", f"{name} ({node.dtype}): wait for its TMA load, smem -> registers, to fp32",
                            (node.id,)))  # fmt: skip
    if compute:
        stages.append(Stage("compute", ", ".join(f"%{n.id} {n.op}" for n in compute), tuple(n.id for n in compute)))
    for name, node in tile_outputs:
        dtype = stored[name]
        how = "saturating" if dtype in FP8_MAX else "no conversion" if dtype == "fp32" else "round to nearest even"
        stages.append(Stage("cast", f"{name}: fp32 -> {dtype} ({how})", (node.id,)))
    for name, node in tile_outputs:
        stages.append(Stage("store_smem", f"{name}: registers -> its smem staging buffer", (node.id,)))
    stages.append(Stage("fence_barrier", "fence.proxy.async.shared::cta, then named barrier over the MMA threads"))
    for i, (name, node) in enumerate(tile_outputs):
        last = "; commit the bulk group, acquire the next staging buffers" if i == len(tile_outputs) - 1 else ""
        stages.append(Stage("tma_store", f"{name}: one thread issues the TMA store smem -> global{last}", (node.id,)))
    for name, node in reductions:
        combine = REDUCTIONS[node.op][1]
        stages.append(Stage("reduce", f"{name} = {node.op}(%{node.args[0]}): fold this subtile into per-thread "
                            f"{combine} partials, out-of-bounds elements excluded", (node.id,)))  # fmt: skip
    stages.append(Stage("advance", "next subtile: accumulator slice, staging buffer, tile-operand pipeline"))
    if reductions:
        listed = ", ".join(f"{name} {_REDUCED_SHAPE[node.kind]}" for name, node in reductions)
        stages.append(Stage("finalize_reductions", "butterfly-shuffle partials across lanes, store per-tile partials "
                            f"to an fp32 workspace; after the kernel one ordered torch reduction gives {listed} "
                            "(deterministic: no float atomics)",
                            tuple(node.id for _, node in reductions)))  # fmt: skip

    return EpilogueSchedule(
        graph=graph,
        stages=tuple(stages),
        tile_operands=tuple(name for name, _ in tiles),
        vector_operands=tuple(name for name, _ in vectors),
        scalar_operands=tuple(name for name, node in used if node.kind == "scalar"),
        tile_outputs=tuple(name for name, _ in tile_outputs),
        reductions=tuple(name for name, _ in reductions),
    )
