"""The semantic hash of an epilogue graph: the key a compiled epilogue is cached under.

It covers everything the generated code depends on (ops, constants, kinds and
dtypes of every node, operand names and order, outputs and their stored dtypes,
the definitions of ops registered at run time, ``optable.fingerprint``)
and nothing it does not: values of scalar operands are inputs, not part of the
graph, so changing them hits the cache. It is sha256 over a canonical text, so it
is stable across processes and machines, unlike Python's ``hash``.
"""

from __future__ import annotations

import hashlib

from epicute.epilogue import optable
from epicute.epilogue.graph import Graph

#: Bump when the IR's meaning changes, so old cache entries can never match.
IR_VERSION = "epicute-epilogue-ir 1"


def canonical_text(graph: Graph) -> str:
    """One line per node, operand and output; floats as ``repr`` (exact, round-trips)."""
    lines = [IR_VERSION, *(str(node) for node in graph.nodes)]
    lines += [f"input {name} = %{node_id}" for name, node_id in graph.inputs]
    stored = dict(graph.output_dtypes)
    lines += [f"output {name} = %{node_id} : {stored.get(name, '?')}" for name, node_id in graph.outputs]
    # Ops registered at run time (not built in, so IR_VERSION does not cover them): their definitions.
    registered = sorted({node.op for node in graph.nodes if optable.fingerprint(node.op) is not None})
    lines += [f"op {op} = {optable.fingerprint(op)}" for op in registered]
    return "\n".join(lines)


def semantic_hash(graph: Graph) -> str:
    """sha256 hex digest of :func:`canonical_text`."""
    return hashlib.sha256(canonical_text(graph).encode()).hexdigest()
