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

from epicute.epilogue import optable
from epicute.epilogue.graph import LEAVES, Graph
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
    rec, _, tangent = _differentiate(graph, wrt, output)
    return Graph(nodes=tuple(rec.nodes), inputs=graph.inputs, outputs=(("D", tangent.id),),
                 output_dtypes=(("D", "fp32"),))  # fmt: skip


def value_and_derivative(graph: Graph, wrt: str = "acc", output: str = "D") -> Graph:
    """One graph of both ``output`` (as ``"D"``) and ``d output / d wrt`` (as ``"dD"``, fp32), sharing
    their nodes: what attention's backward emits for a score_mod (P needs the value, dS the slope).

    Example:
        >>> import epicute
        >>> from epicute.epilogue.derivative import value_and_derivative
        >>> softcap = epicute.score_mod(lambda score, b, h, q_idx, kv_idx: 30.0 * epicute.ops.tanh(score / 30.0))
        >>> [name for name, _ in value_and_derivative(softcap.trace({}, {}, None)).outputs]
        ['D', 'dD']
    """
    rec, value, tangent = _differentiate(graph, wrt, output)
    return Graph(nodes=tuple(rec.nodes), inputs=graph.inputs, outputs=(("D", value.id), ("dD", tangent.id)),
                 output_dtypes=(("D", "fp32"), ("dD", "fp32")))  # fmt: skip


def _differentiate(graph: Graph, wrt: str, output: str) -> tuple[Recorder, Value, Value]:
    """The recorder holding ``graph``'s nodes and the tangent's, ``output``'s node and its tangent's."""
    names = dict(graph.outputs)
    if output not in names:
        raise EpilogueError(f"derivative: the graph has no output {output!r}; it has {sorted(names)}")
    if wrt not in ACCUMULATORS and wrt not in dict(graph.inputs):
        raise EpilogueError(f"derivative: wrt={wrt!r} is neither {' nor '.join(ACCUMULATORS)} nor an operand of the "
                            f"graph ({sorted(dict(graph.inputs))})")  # fmt: skip
    rec = Recorder()
    values: list[Value] = []
    tangents: list = []
    with rec.active():
        for node in graph.nodes:
            # The node again (its id may move: tangent nodes come between), over its arguments' new ids.
            args = tuple(values[a] for a in node.args)
            values.append(rec.add(node.op, tuple(a.id for a in args), node.kind, node.dtype, node.attrs))
            if node.op in LEAVES:
                seeded = node.op == wrt if wrt in ACCUMULATORS else node.op == "input" and node.attr("name") == wrt
                tangents.append(1.0 if seeded else None)
                continue
            op = optable.find(node.op)
            arg_tangents = tuple(tangents[a] for a in node.args)
            if all(t is None for t in arg_tangents):
                tangents.append(None)
                continue
            if op is None:  # a reduction (or a quantize_groups), which no elementwise derivative passes
                tangents.append(_Undifferentiable(node.op))
                continue
            if any(isinstance(t, _Undifferentiable) for t in arg_tangents):
                tangents.append(next(t for t in arg_tangents if isinstance(t, _Undifferentiable)))
                continue
            if op.tangent is None:
                raise EpilogueError(f"derivative: op {node.op!r} has no derivative rule; give its OpDef a tangent "
                                    "(CONTRIBUTING.md, 'Adding an epilogue op')")  # fmt: skip
            tangents.append(op.tangent(args, arg_tangents, values[-1], **dict(node.attrs)))
        result = tangents[names[output]]
        if isinstance(result, _Undifferentiable):
            raise EpilogueError(f"derivative: output {output!r} depends on {result.op}, a reduction, which has no "
                                "elementwise derivative")  # fmt: skip
        if result is None or isinstance(result, float):  # output does not depend on wrt, or does linearly
            result = rec.add("const", kind="scalar", attrs=(("value", 0.0 if result is None else result),))
    return rec, values[names[output]], result


class _Undifferentiable:
    """The tangent of a value that comes through a reduction: an error if an output needs it."""

    def __init__(self, op: str) -> None:
        self.op = op


__all__ = ["ACCUMULATORS", "derivative"]
