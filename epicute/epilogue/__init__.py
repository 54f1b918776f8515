"""Fused GEMM epilogues: a Python function of the accumulator, traced into a graph.

A user writes ``f(acc, *operands)`` with :mod:`epicute.ops` and decorates it
with :func:`epilogue`; the pieces here turn it into everything the kernel needs:

- :mod:`.graph`: the IR (nodes, kinds, dtypes; fixed, shared with the kernel emitter);
- :mod:`.optable`: the elementwise ops, each declared once (arity, attrs, torch reference,
  kernel code, instruction estimate, fuzzer domain): everything else reads it;
- :mod:`.tracer` (and :mod:`.proxy`, :mod:`.ops`): the function -> a :class:`Graph`;
- :mod:`.operands`: passed values -> operand kinds and canonical views (and the pins);
- :mod:`.hashing`: the graph's semantic hash, the compile-cache key;
- :mod:`.reference`: the CPU interpreter that defines what a graph computes;
- :mod:`.schedule`: the graph as the kernel's chain of per-subtile stages;
- :mod:`.library`: ready epilogues (``epicute.epilogues``).

Import submodules with ``from epicute.epilogue.x import y``: at the top level,
``epicute.epilogue`` is the decorator, not this package.
"""

from epicute.epilogue import library, ops
from epicute.epilogue.graph import Graph, Node
from epicute.epilogue.hashing import semantic_hash
from epicute.epilogue.operands import ColVector, OperandSpec, RowVector, Scalar, Tile, resolve_operands
from epicute.epilogue.reference import evaluate, reference_gemm
from epicute.epilogue.schedule import EpilogueSchedule, Stage, schedule
from epicute.epilogue.tracer import Epilogue, as_epilogue, epilogue

__all__ = [
    "ColVector",
    "Epilogue",
    "EpilogueSchedule",
    "Graph",
    "Node",
    "OperandSpec",
    "RowVector",
    "Scalar",
    "Stage",
    "Tile",
    "as_epilogue",
    "epilogue",
    "evaluate",
    "library",
    "ops",
    "reference_gemm",
    "resolve_operands",
    "schedule",
    "semantic_hash",
]  # fmt: skip
