"""The epilogue graph IR: what a traced epilogue function *is*.

A :class:`Graph` is a list of :class:`Node` in topological order (every node's
arguments come before it). It is the single representation that the CPU
reference interpreter evaluates, the scheduler turns into a chain of per-subtile
stages, and the kernel emits as register code. It is plain, immutable Python:
printable, hashable, and free of torch or CuTe objects.

Node ``kind`` says how a value is laid over the output tile:

- ``"tile"``: one value per (m, n) element (the accumulator, full-tile operands);
- ``"row"``: one value per column n, broadcast along M (shape ``(N,)``/``(L, N)``, as torch broadcasts);
- ``"col"``: one value per row m, broadcast along N (shape ``(M, 1)``/``(L, M, 1)``);
- ``"scalar"``: one value for the whole problem.

An elementwise op's result kind is the "widest" of its arguments' kinds
(scalar < row/col < tile; row with col gives tile). Reductions turn a tile
into ``"col"`` (row_*: one value per row), ``"row"`` (col_*: one per column) or
``"scalar"`` (amax).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from epicute.epilogue import optable
from epicute.errors import EpilogueError

KINDS = ("scalar", "row", "col", "tile")

#: Elementwise ops: name -> arity. Each op is declared in :mod:`epicute.epilogue.optable`
#: (attrs, reference semantics, kernel code, cost); this is a live view of that table.
ELEMENTWISE = optable.view(lambda op: op.arity, "arities")

#: Reductions over a tile: name -> (result kind, combine).
REDUCTIONS = {
    "row_sum": ("col", "sum"), "row_max": ("col", "max"), "row_amax": ("col", "amax"),
    "col_sum": ("row", "sum"), "col_max": ("row", "max"), "col_amax": ("row", "amax"),
    "amax": ("scalar", "amax"),
}  # fmt: skip

#: What a reduction's output holds before any element is combined into it (also the
#: result over an empty extent): the host initializes reduction outputs with this.
REDUCTION_IDENTITY = {"sum": 0.0, "max": float("-inf"), "amax": 0.0}

#: Leaves: the accumulator, a named operand, a compile-time constant, an index, and a gated
#: epilogue's second accumulator (``acc_up``: the up projection's column beside the gate's ``acc``).
LEAVES = ("acc", "input", "const", "index", "acc_up")

#: The output that pairs with D (:attr:`Graph.paired`): a gated epilogue's gradient to its ``up`` column.
UP_OUTPUT = "D_up"

#: ``index`` leaves (score modifiers of attention): the position of a score in the
#: ``(L, M, N) = (batch * heads, seqlen_q, seqlen_k)`` problem, by ``name`` attr,
#: and the kind that follows from what each one varies along.
INDEX_KINDS = {"b": "col", "h": "col", "q_idx": "col", "kv_idx": "row"}


@dataclass(frozen=True)
class Node:
    id: int
    op: str
    args: tuple[int, ...] = ()
    kind: str = "tile"
    dtype: str = "fp32"
    #: Sorted (key, value) pairs: ``name`` for inputs, ``value`` for consts,
    #: ``dtype`` for casts/quantize, ``lo``/``hi`` for clamp.
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)

    def __str__(self) -> str:
        args = ", ".join(f"%{a}" for a in self.args)
        attrs = ", ".join(f"{k}={v!r}" for k, v in self.attrs)
        inner = ", ".join(x for x in (args, attrs) if x)
        return f"%{self.id} = {self.op}({inner}) : {self.kind} {self.dtype}"


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    #: operand name -> node id of its ``input`` node, in parameter order
    inputs: tuple[tuple[str, int], ...]
    #: output name -> node id; ``"D"`` is the main output
    outputs: tuple[tuple[str, int], ...]
    #: dtype of each output as stored (D and aux tiles; reductions are fp32)
    output_dtypes: tuple[tuple[str, str], ...] = field(default=())

    def node(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def input_node(self, name: str) -> Node:
        return self.nodes[dict(self.inputs)[name]]

    def output_node(self, name: str) -> Node:
        return self.nodes[dict(self.outputs)[name]]

    def __hash__(self) -> int:
        # Graphs key the memos of every host path (plans, derived gradients): hashed once, not node by node per call.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.nodes, self.inputs, self.outputs, self.output_dtypes))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # The cached hash is this process's (string hashes are salted per process): never pickled.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def gated(self) -> bool:
        """A gated epilogue's graph (:class:`~epicute.epilogue.tracer.GatedEpilogue`): its accumulator pairs
        gate and up columns, and D has half of B's columns."""
        return any(node.op == "acc_up" for node in self.nodes)

    @property
    def paired(self) -> bool:
        """D pairs with :data:`UP_OUTPUT`, the dual of :attr:`gated`: the two are stored interleaved in blocks of
        ``GATE_BLOCK`` columns into one D of twice the accumulator's columns, the layout of a gated B's columns (so a
        gated epilogue's gradient, d gate and d up, is the ``dacc`` its GEMM's backward multiplies as it is)."""
        return any(name == UP_OUTPUT for name, _ in self.outputs)

    def transposed(self) -> Graph:
        """The same epilogue over the transposed output (what a swap-AB kernel computes, D^T): row and column
        values trade kinds. Reductions and index leaves name an axis and are not transposed."""
        axis_bound = [node.op for node in self.nodes if node.op in REDUCTIONS or node.op == "index"]
        if axis_bound:
            raise EpilogueError(f"{axis_bound[0]} works along one axis of the output: the graph has no transpose")
        swap = {"row": "col", "col": "row"}
        nodes = tuple(replace(node, kind=swap.get(node.kind, node.kind)) for node in self.nodes)
        return replace(self, nodes=nodes)

    def __str__(self) -> str:
        lines = [str(n) for n in self.nodes]
        lines += [f"output {name} = %{nid}" for name, nid in self.outputs]
        return "\n".join(lines)
