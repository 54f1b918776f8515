"""Derivatives of traced graphs: a score_mod's ``d score_mod / d score``, for attention's backward pass.

:func:`derivative` differentiates a graph in forward mode, node by node in its topological order:
the leaf it is taken with respect to has tangent 1, every other leaf 0, and each op's tangent
comes from its arguments' by the rule the op table holds for it
(:attr:`epicute.epilogue.optable.OpDef.tangent`; one rule per op, beside its reference and its
kernel code). The result is another graph of the same IR, recorded with the tracer's recorder: it
keeps the original nodes (the forward values a derivative needs) and adds the tangent's, so the CPU
reference evaluates it and every kernel's emitter emits it like any epilogue. A user writes
``score_mod`` once; FlexAttention derives its gradient the same way, flash-attn-4 asks for a
hand-written ``score_mod_bwd``.

Roundings (``cast``, ``quantize``) pass the tangent straight through, as torch's autograd does
through ``.to(dtype)``; comparisons and masks have none, and ``where`` picks its branch's. Ties of
``maximum``/``minimum`` split it in halves, as torch does. Reductions have no elementwise derivative:
a graph whose output depends on one is refused.
"""

from __future__ import annotations

from collections.abc import Callable

from epicute.epilogue import optable
from epicute.epilogue.graph import LEAVES, Graph, Node
from epicute.epilogue.proxy import Recorder, Value
from epicute.errors import EpilogueError

#: What a derivative can be taken with respect to: the accumulator (a score_mod's score), a gated
#: epilogue's second accumulator, or an operand (by name).
ACCUMULATORS = ("acc", "acc_up")


def derivative(graph: Graph, wrt: str = "acc", output: str = "D") -> Graph:
    """The graph of ``d output / d wrt``, elementwise, as its output ``"D"`` (fp32).

    ``wrt``: ``"acc"`` (a score_mod's score, an epilogue's accumulator), ``"acc_up"`` (a gated epilogue's
    up projection) or an operand's name (its tangent per element; a backward pass reduces it to the
    operand's shape). The graph keeps ``graph``'s inputs, so it takes the same operands.

    Example:
        >>> import epicute
        >>> from epicute.epilogue.derivative import derivative
        >>> softcap = epicute.score_mod(lambda score, b, h, q_idx, kv_idx: 30.0 * epicute.ops.tanh(score / 30.0))
        >>> graph = softcap.trace({}, {}, None)
        >>> print(derivative(graph).output_node("D").op)  # 30 * (1 - tanh^2) / 30: a product of the chain
        mul
    """
    rec, _, (tangent,) = _differentiate(graph, (wrt,), output)
    return Graph(nodes=tuple(rec.nodes), inputs=graph.inputs, outputs=(("D", tangent.id),),
                 output_dtypes=(("D", "fp32"),))  # fmt: skip


def value_and_derivative(graph: Graph, wrt: str = "acc", output: str = "D", operands: tuple[str, ...] = ()) -> Graph:
    """One graph of both ``output`` (as ``"D"``) and ``d output / d wrt`` (as ``"dD"``, fp32), sharing
    their nodes: what attention's backward emits for a score_mod (P needs the value, dS the slope).
    ``operands``: names whose derivatives ``d output / d operand`` it also gives, as ``"d_<name>"`` (fp32,
    per element: the backward weighs them by dS and sums them into the operand's gradient).

    Example:
        >>> import epicute
        >>> from epicute.epilogue.derivative import value_and_derivative
        >>> softcap = epicute.score_mod(lambda score, b, h, q_idx, kv_idx, cap: cap * epicute.ops.tanh(score / cap))
        >>> graph = softcap.trace({"cap": "col"}, {}, None)  # a per-head vector (attention traces it as a column)
        >>> [name for name, _ in value_and_derivative(graph, operands=("cap",)).outputs]
        ['D', 'dD', 'd_cap']
    """
    rec, value, tangents = _differentiate(graph, (wrt, *operands), output)
    outputs = (("D", value.id), ("dD", tangents[0].id), *((f"d_{n}", t.id) for n, t in zip(operands, tangents[1:])))
    return Graph(nodes=tuple(rec.nodes), inputs=graph.inputs, outputs=outputs,
                 output_dtypes=tuple((name, "fp32") for name, _ in outputs))  # fmt: skip


def _differentiate(graph: Graph, wrts: tuple[str, ...], output: str) -> tuple[Recorder, Value, tuple[Value, ...]]:
    """The recorder holding ``graph``'s nodes and the tangents', ``output``'s node and its tangent by each of
    ``wrts`` (one forward pass over the nodes: the tangents share the original values)."""
    names = dict(graph.outputs)
    if output not in names:
        raise EpilogueError(f"derivative: the graph has no output {output!r}; it has {sorted(names)}")
    for wrt in wrts:
        if wrt not in ACCUMULATORS and wrt not in dict(graph.inputs):
            raise EpilogueError(f"derivative: wrt={wrt!r} is neither {' nor '.join(ACCUMULATORS)} nor an operand of "
                                f"the graph ({sorted(dict(graph.inputs))})")  # fmt: skip
    rec = Recorder()
    with rec.active():
        values, tangents = replay_with_tangents(graph, wrts, rec)
        results = []
        for wrt_tangents in tangents:
            result = wrt_tangents[names[output]]
            if isinstance(result, _Undifferentiable):
                raise EpilogueError(f"derivative: output {output!r} depends on {result.op}, a reduction, which has "
                                    "no elementwise derivative")  # fmt: skip
            if result is None or isinstance(result, float):  # output does not depend on wrt, or does linearly
                result = rec.add("const", kind="scalar", attrs=(("value", 0.0 if result is None else result),))
            results.append(result)
    return rec, values[names[output]], tuple(results)


def replay_with_tangents(
    graph: Graph, wrts: tuple[str, ...], rec: Recorder, leaf: Callable[[Node], Value | None] | None = None
) -> tuple[list[Value], list[list]]:
    """Record ``graph``'s nodes again in ``rec`` (active) with each node's tangent by each of ``wrts``: the
    nodes' new values, and per ``wrt`` a list of tangents by node id (None: zero; a float: that constant;
    an undifferentiable marker for a value that came through a reduction). ``leaf(node)`` may give a leaf
    another value (a gradient graph reads a saved accumulator as an operand); the tangents still seed on
    the original leaves."""
    values: list[Value] = []
    tangents: list[list] = [[] for _ in wrts]
    for node in graph.nodes:
        replaced = leaf(node) if leaf is not None and node.op in LEAVES else None
        # The node again (its id may move: tangent nodes come between), over its arguments' new ids.
        args = tuple(values[a] for a in node.args)
        values.append(replaced if replaced is not None else
                      rec.add(node.op, tuple(a.id for a in args), node.kind, node.dtype, node.attrs))  # fmt: skip
        for wrt, wrt_tangents in zip(wrts, tangents):
            wrt_tangents.append(_tangent(node, args, values[-1], wrt, wrt_tangents))
    return values, tangents


def is_undifferentiable(tangent) -> bool:
    """Whether a tangent of :func:`replay_with_tangents` came through a reduction (has no elementwise derivative)."""
    return isinstance(tangent, _Undifferentiable)


def _tangent(node, args: tuple, value: Value, wrt: str, tangents: list):
    """``node``'s tangent by ``wrt`` (None: zero; a float: that constant), from its arguments' ``tangents``."""
    if node.op in LEAVES:
        seeded = node.op == wrt if wrt in ACCUMULATORS else node.op == "input" and node.attr("name") == wrt
        return 1.0 if seeded else None
    op = optable.find(node.op)
    arg_tangents = tuple(tangents[a] for a in node.args)
    if all(t is None for t in arg_tangents):
        return None
    if op is None:  # a reduction (or a quantize_groups), which no elementwise derivative passes
        return _Undifferentiable(node.op)
    if any(isinstance(t, _Undifferentiable) for t in arg_tangents):
        return next(t for t in arg_tangents if isinstance(t, _Undifferentiable))
    if op.tangent is None:
        raise EpilogueError(f"derivative: op {node.op!r} has no derivative rule; give its OpDef a tangent "
                            "(CONTRIBUTING.md, 'Adding an epilogue op')")  # fmt: skip
    return op.tangent(args, arg_tangents, value, **dict(node.attrs))


class _Undifferentiable:
    """The tangent of a value that comes through a reduction: an error if an output needs it."""

    def __init__(self, op: str) -> None:
        self.op = op


__all__ = ["ACCUMULATORS", "derivative", "is_undifferentiable", "replay_with_tangents", "value_and_derivative"]
