"""Backward epilogues: the gradients of a GEMM epilogue, derived from its graph.

For ``outputs = f(acc, operands)`` and the gradients ``grad_<name>`` the loss sends back to each
differentiable output, the backward needs

- ``dacc = sum_j grad_j * d out_j / d acc`` (a tile: the GEMM's data and weight gradients multiply it),
  and for a gated epilogue ``dacc_up`` likewise by its second accumulator;
- each operand's gradient ``sum_j grad_j * d out_j / d operand``, reduced to the operand's kind: a tile
  stays a tile, a row vector (one value per column) is a ``col_sum``, a column vector a ``row_sum``,
  a scalar a ``col_sum`` that the caller sums.

:func:`gradient_graph` builds that as one graph of the epilogue IR, with the tangent rules of the op
table (:func:`epicute.epilogue.derivative.replay_with_tangents`): the forward's nodes, then the
tangents', then the sums. It reads the accumulator either as the ``acc`` leaf (a GEMM recomputes it)
or as a saved tile operand (``saved_acc=True``: the forward stored it); :func:`reads_accumulator`
says whether it needs it at all (``acc + bias`` does not). :func:`replay_epilogue` makes any graph an
epilogue function again, so the gradient runs wherever an epilogue runs: the CPU reference, or a GEMM kernel's
epilogue (recomputing ``acc``, or over a zero-K accumulator when it reads saved tiles only).

Outputs without a gradient: reductions (statistics), ``quantize_groups``' tiles and scales, and tiles
stored in fp8 (:func:`differentiable_outputs`). An output that depends on a reduction of the
accumulator cannot be differentiated elementwise; asking for its gradient raises.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from epicute.epilogue.derivative import ACCUMULATORS, is_undifferentiable, replay_with_tangents
from epicute.epilogue.graph import REDUCTIONS, UP_OUTPUT, Graph, Node
from epicute.epilogue.operands import PINS
from epicute.epilogue.proxy import Recorder, Value
from epicute.epilogue.tracer import _finish
from epicute.errors import GradientError

#: fp8 storage: a tile stored this way carries no gradient (a quantized activation, as torch's float8 casts).
FP8 = ("fp8e4m3", "fp8e5m2")
#: The gradient graph's outputs: the accumulators' gradients, then ``d_<operand>``.
DACC, DACC_UP = "D", UP_OUTPUT
#: The saved accumulators' operand names, when the graph reads them as tiles (``saved_acc=True``).
SAVED = {"acc": "saved_acc", "acc_up": "saved_acc_up"}
#: An operand's gradient, per element, reduced to its kind (a scalar's is summed by the caller).
_REDUCE_TO_KIND = {"tile": None, "row": "col_sum", "col": "row_sum", "scalar": "col_sum"}


def grad_name(output: str) -> str:
    """The gradient graph's operand holding the gradient of forward output ``output``."""
    return f"grad_{output}"


def operand_grad_name(operand: str) -> str:
    """The gradient graph's output holding the gradient of forward operand ``operand``."""
    return f"d_{operand}"


@functools.lru_cache(maxsize=1024)
def differentiable_outputs(graph: Graph) -> tuple[str, ...]:
    """The outputs a gradient flows back through: tiles that are neither reductions, nor ``quantize_groups``
    results, nor stored in fp8."""
    stored = dict(graph.output_dtypes)
    return tuple(
        name for name, node_id in graph.outputs
        if graph.node(node_id).op not in (*REDUCTIONS, "group_quant", "group_scales") and stored.get(name) not in FP8
    )  # fmt: skip


def gradient_graph(
    graph: Graph,
    grads: dict[str, str],
    operands: tuple[str, ...] = (),
    *,
    saved_acc: bool = False,
) -> Graph:
    """The backward of ``graph`` (a GEMM epilogue's): outputs :data:`DACC` (and :data:`DACC_UP` for a gated
    graph) in fp32, and ``d_<name>`` for each of ``operands`` reduced to its kind (fp32).

    ``grads``: the forward outputs that receive a gradient, each with the IR dtype the gradient comes in
    (operands ``grad_<name>``, tiles). ``saved_acc``: read the accumulators as tile operands
    (:data:`SAVED`, fp32) instead of the ``acc`` leaves. The accumulators' gradients are always outputs (an
    epilogue has a D), even where only operands need a gradient.

    Raises :class:`~epicute.errors.GradientError` for an output that has no gradient, or one whose value
    depends on a reduction of the accumulator.
    """
    names = dict(graph.outputs)
    allowed = differentiable_outputs(graph)
    for name in grads:
        if name not in allowed:
            why = "is not an output" if name not in names else "has no gradient (a reduction, or a quantized tile)"
            raise GradientError(f"output {name!r} of the epilogue {why}; its gradient cannot flow back")
    inputs = dict(graph.inputs)
    for name in operands:
        if name not in inputs:
            raise GradientError(f"operand {name!r} is not an operand of the epilogue ({sorted(inputs)})")
    gated = graph.gated
    wrts = (*ACCUMULATORS[: 2 if gated else 1], *operands)
    rec = Recorder("backward epilogue")
    with rec.active():
        rec.add("acc")  # node 0, the epilogue interface's accumulator, read or not
        leaf_inputs: dict[str, Value] = {}

        def leaf(node: Node) -> Value | None:
            if node.op == "input":  # the forward's operands keep their kinds and dtypes
                return leaf_inputs.setdefault(
                    node.attr("name"), rec.add("input", kind=node.kind, dtype=node.dtype, attrs=node.attrs)
                )
            if saved_acc and node.op in SAVED:
                return leaf_inputs.setdefault(
                    SAVED[node.op], rec.add("input", kind="tile", attrs=(("name", SAVED[node.op]),))
                )
            return None

        _, tangents = replay_with_tangents(graph, wrts, rec, leaf)
        for name, dtype in grads.items():
            grad = grad_name(name)
            leaf_inputs[grad] = rec.add("input", kind="tile", dtype=dtype, attrs=(("name", grad),))
        out_values: dict[str, Value] = {}
        for wrt, wrt_tangents in zip(wrts, tangents):
            total = None
            for name in grads:
                t = wrt_tangents[names[name]]
                if is_undifferentiable(t):
                    raise GradientError(
                        f"output {name!r} of the epilogue depends on {t.op}, a reduction of the accumulator, which "
                        "has no elementwise derivative: its gradient cannot flow back (return the reduction as an "
                        "output of its own, or detach what uses it)"
                    )
                if t is None:
                    continue
                grad = leaf_inputs[grad_name(name)]
                term = grad if isinstance(t, float) and t == 1.0 else grad * t
                total = term if total is None else total + term
            if total is None:  # no output depends on wrt: a zero tile
                total = leaf_inputs[grad_name(next(iter(grads)))] * 0.0 if grads else rec.add("const", kind="scalar")
            if wrt in ACCUMULATORS:
                out_values[DACC if wrt == "acc" else DACC_UP] = total
            else:
                reduce = _REDUCE_TO_KIND[graph.input_node(wrt).kind]
                if reduce is not None and total.node.kind == "tile":
                    total = rec.add(reduce, (total.id,), REDUCTIONS[reduce][0])
                elif total.node.kind != "tile":  # an operand's gradient without a tile grad in it cannot happen
                    total = total + leaf_inputs[grad_name(next(iter(grads)))] * 0.0
                out_values[operand_grad_name(wrt)] = total
    # Only the inputs some output reads (a kernel loads every input it is given), in a fixed order: the
    # forward's operands (as the forward declares them), saved tiles, gradients.
    live = _live(rec.nodes, [v.id for v in out_values.values()])
    order = [*(n for n, _ in graph.inputs), *SAVED.values(), *(grad_name(n) for n in grads)]
    kept = {name: leaf_inputs[name] for name in order if name in leaf_inputs and leaf_inputs[name].id in live}
    outputs = {name: v.node for name, v in out_values.items()}
    return _finish(rec, kept, outputs, {name: "fp32" for name in outputs})


def reduced_gradients(graph: Graph) -> tuple[Graph, tuple[tuple[str, str, str], ...]]:
    """``graph`` without the outputs that are a reduction of an incoming gradient as it is (a bias's gradient is
    ``col_sum(dD)``), and those outputs as ``((output, reduction, gradient input), ...)``: a torch reduction reads
    the gradient once, where a pass of the GEMM's kernel would read it and store a copy of it as ``dacc`` too."""
    inputs = {node_id: name for name, node_id in graph.inputs}
    reduced = {}
    for name, i in graph.outputs:
        node = graph.node(i)
        source = inputs.get(node.args[0]) if node.op in REDUCTIONS else None
        if source is not None and source.startswith(grad_name("")) and graph.node(node.args[0]).kind == "tile":
            reduced[name] = (node.op, source)
    if not reduced:
        return graph, ()
    outputs = [(name, i) for name, i in graph.outputs if name not in reduced]
    return _pruned(graph, outputs), tuple((name, op, source) for name, (op, source) in reduced.items())


def forwarded_gradients(graph: Graph) -> tuple[Graph, tuple[tuple[str, str], ...]]:
    """``graph`` without the outputs that are an incoming gradient as it is (a residual's gradient is D's: nothing
    to compute, and a kernel would copy it), and those outputs as ``((output, gradient input), ...)``. The
    accumulators' gradients stay while anything else is computed (a GEMM epilogue has a D); when every output
    is forwarded, the graph keeps none and there is no pass to run."""
    inputs = {node_id: name for name, node_id in graph.inputs}
    forwarded = {name: inputs[i] for name, i in graph.outputs
                 if i in inputs and graph.node(i).kind == "tile" and inputs[i].startswith(grad_name(""))}  # fmt: skip
    if set(forwarded) != {name for name, _ in graph.outputs}:
        forwarded = {name: v for name, v in forwarded.items() if name not in (DACC, DACC_UP)}
    if not forwarded:
        return graph, ()
    outputs = [(name, i) for name, i in graph.outputs if name not in forwarded]
    return _pruned(graph, outputs), tuple(forwarded.items())


def _pruned(graph: Graph, outputs: list[tuple[str, int]]) -> Graph:
    """``graph`` with only ``outputs`` and what they read, renumbered."""
    live = _live(graph.nodes, [i for _, i in outputs])
    rec = Recorder("backward epilogue")
    with rec.active():
        values: list[Value] = []
        for node in graph.nodes:
            values.append(rec.add(node.op, tuple(values[a].id for a in node.args), node.kind, node.dtype, node.attrs))
    inputs = {name: values[i] for name, i in graph.inputs if i in live}
    dtypes = dict(graph.output_dtypes)
    kept = {name: values[i].node for name, i in outputs}
    return _finish(rec, inputs, kept, {name: dtypes[name] for name in kept})


def _live(nodes, roots) -> set[int]:
    """Ids of the nodes ``roots`` depend on (themselves included); ``nodes`` in topological order."""
    live = set(roots)
    for node in reversed(nodes):
        if node.id in live:
            live.update(node.args)
    return live


def reads_accumulator(graph: Graph) -> bool:
    """Whether an output of ``graph`` reads an accumulator (``acc``/``acc_up`` leaves, or saved tiles)."""
    live = _live(graph.nodes, [i for _, i in graph.outputs])
    return any(node.id in live for node in graph.nodes if node.op in SAVED) or any(
        name in dict(graph.inputs) for name in SAVED.values()
    )


def read_from_accumulator(graph: Graph, output: str = "D", bias_grad: str | None = None) -> Graph:
    """A gradient graph (``saved_acc=True``) made the epilogue of the GEMM that *produces* ``grad_<output>``: that
    operand becomes the accumulator. An MLP's down projection computes ``dh = dy @ w_down`` and, in the same
    epilogue, the activation's derivative (``dacc = dh * f'(pre)`` from the saved pre-activation); cuBLASLt's
    ``DGELU_BGRAD`` for any epilogue. ``bias_grad``: also output that name as ``col_sum`` of :data:`DACC` (a bias
    added to the accumulator before ``f``: its gradient is ``dacc`` summed over the rows)."""
    grad = grad_name(output)
    if grad not in dict(graph.inputs) or reads_leaf(graph):
        raise GradientError(f"read_from_accumulator: the graph must read {grad} and no accumulator leaf "
                            "(build it with saved_acc=True)")  # fmt: skip
    rec = Recorder("backward epilogue")
    with rec.active():
        acc = rec.add("acc")
        values: list[Value] = []
        inputs: dict[str, Value] = {}
        for node in graph.nodes:
            if node.op == "acc" or (node.op == "input" and node.attr("name") == grad):
                values.append(acc)
            elif node.op == "input":
                values.append(inputs.setdefault(node.attr("name"), rec.add("input", kind=node.kind, dtype=node.dtype,
                                                                           attrs=node.attrs)))  # fmt: skip
            else:
                values.append(rec.add(node.op, tuple(values[a].id for a in node.args), node.kind, node.dtype,
                                      node.attrs))  # fmt: skip
        outputs = {name: values[i] for name, i in graph.outputs}
        if bias_grad is not None:
            outputs[bias_grad] = rec.add("col_sum", (outputs[DACC].id,), "row")
    return _finish(rec, inputs, {name: v.node for name, v in outputs.items()}, {name: "fp32" for name in outputs})


def reads_leaf(graph: Graph) -> bool:
    """Whether an output of ``graph`` reads an accumulator leaf (``acc``/``acc_up``), not a saved tile."""
    live = _live(graph.nodes, [i for _, i in graph.outputs])
    return any(node.id in live for node in graph.nodes if node.op in SAVED)


@functools.lru_cache(maxsize=256)
def replay_epilogue(graph: Graph, name: str = "backward") -> Callable:
    """``graph`` as an epilogue function ``f(acc, *inputs)`` (``f(gate, up, *inputs)`` for a gated graph, to pass
    with ``gated=True``): tracing it replays the graph's nodes, so a derived graph runs wherever an epilogue runs
    (the reference, a GEMM kernel's epilogue). Its operands are pinned to the graph's kinds (annotations); a graph
    that does not read ``acc`` still takes it first, as every epilogue does. One function per graph."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(p, positional) for p in (("acc", "up") if graph.gated else ("acc",))]
    params += [inspect.Parameter(n, positional, annotation=PINS[graph.node(i).kind]) for n, i in graph.inputs]
    leaves = len(params) - len(graph.inputs)

    def replay(*args: Value) -> dict[str, Value]:
        acc, up = args[0], args[1] if leaves == 2 else None
        by_name = dict(zip((n for n, _ in graph.inputs), args[leaves:]))
        rec = acc._rec
        values: list[Value] = []
        for node in graph.nodes:
            if node.op in ("acc", "acc_up"):
                values.append(acc if node.op == "acc" else up)
            elif node.op == "input":
                values.append(by_name[node.attr("name")])
            else:
                values.append(rec.add(node.op, tuple(values[a].id for a in node.args), node.kind, node.dtype,
                                      node.attrs))  # fmt: skip
        return {out: values[i] for out, i in graph.outputs}

    replay.__signature__ = inspect.Signature(params)
    replay.__name__ = replay.__qualname__ = name
    return replay


__all__ = [
    "DACC", "DACC_UP", "SAVED", "differentiable_outputs", "forwarded_gradients", "grad_name", "gradient_graph",
    "operand_grad_name", "read_from_accumulator", "reads_accumulator", "reads_leaf", "reduced_gradients",
    "replay_epilogue",
]  # fmt: skip
