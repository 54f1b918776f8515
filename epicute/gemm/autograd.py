"""Autograd of ``epicute.gemm``: the backward of a GEMM and its epilogue, derived from the epilogue's graph.

For ``outputs = f(acc, operands)`` with ``acc = a @ b``, the loss's gradients of the outputs give (see
:mod:`epicute.epilogue.backward`) ``dacc`` and the operands' gradients, one epilogue graph; then
``da = dacc @ b^T`` and ``db = a^T @ dacc``, two plain GEMMs. Where that graph runs is the backward plan
(:func:`plan_backward`, printed by ``epicute explain``):

- ``plain``: no epilogue; ``dacc`` is D's gradient itself.
- ``none``: no output carries a gradient (statistics, quantized tiles): nothing to run.
- ``operands``: the gradient graph does not read the accumulator (``acc + bias``, ``acc * alpha + residual``):
  the forward saves nothing, and the backward runs the graph as the epilogue of a zero-K GEMM (an
  elementwise pass over the gradients, the bias gradient a ``col_sum`` of the same kernel).
- ``save``: the forward also stores the accumulator (the pre-activation) as an aux output in the
  inputs' dtype, ``M x N x 2`` bytes, and the backward's zero-K pass reads it.
- ``recompute``: the forward saves nothing; the backward recomputes ``a @ b`` with the gradient graph as its
  epilogue (``2 M N K`` flops, no extra memory). It costs less time than ``save``'s write and read only
  while ``K`` is small (:data:`RECOMPUTE_BELOW_K`), so the planner picks it there.

Outputs without a gradient (reductions, ``quantize_groups``, fp8 tiles) are marked non-differentiable.
The op ``torch.ops.epicute.gemm`` carries this backward (``torch.library.register_autograd``), so eager
training and ``torch.compile`` (``dynamic=True`` too) run the same code; :func:`epicute.gemm` routes a call
whose tensors require grad through the op.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from epicute.epilogue.backward import (
    DACC,
    DACC_UP,
    SAVED,
    differentiable_outputs,
    forwarded_gradients,
    grad_name,
    gradient_graph,
    operand_grad_name,
    reads_accumulator,
    reduced_gradients,
    replay_epilogue,
)
from epicute.epilogue.dtypes import IR_TO_TORCH, ir_dtype
from epicute.epilogue.graph import UP_OUTPUT, Graph
from epicute.epilogue.operands import Pin
from epicute.epilogue.reference import reduce_tile
from epicute.errors import GradientError
from epicute.runtime.torch_ops import registered_outputs

#: Below this K, recomputing ``a @ b`` in the backward (``2 M N K`` flops at ~800 TFLOPS) costs less than
#: saving the accumulator and reading it back (``4 M N`` bytes at ~4.8 TB/s on an H200): they meet at K ~ 330.
RECOMPUTE_BELOW_K = 256
#: The plans, as :func:`plan_backward` names them.
PLANS = ("plain", "none", "operands", "save", "recompute")


@dataclass(frozen=True)
class BackwardPlan:
    """How a GEMM call's backward runs (see the module docstring)."""

    mode: str
    #: the forward epilogue's graph (None for a plain GEMM)
    graph: Graph | None
    #: the accumulators the forward stores as extra outputs (``save``): names in :data:`SAVED`
    saved: tuple[str, ...] = ()

    def explain(self, m: int, n: int, k: int, dtype_bytes: int = 2, torch_reductions: bool = True) -> str:
        """``explain``'s account: the plan, what the forward saves, and the backward's kernels with their
        epilogues (the derived gradient graph's nodes, every operand needing a gradient) or what stands in for
        them (gradients forwarded as they are, torch reductions of a gradient)."""
        if self.mode == "plain":
            return "backward: plain\n  1. da = dD @ b^T\n  2. db = a^T @ dD"
        if self.mode == "none":
            return "backward: none: no output carries a gradient (reductions, quantize_groups and fp8 tiles do not)"
        why = {
            "operands": "the gradient does not read acc: nothing saved",
            "save": f"the forward also stores acc ({m * n * dtype_bytes * len(self.saved) / 2**20:.1f} MiB): "
            f"K={k} >= {RECOMPUTE_BELOW_K}, cheaper than recomputing a @ b",
            "recompute": f"K={k} < {RECOMPUTE_BELOW_K}: recomputing a @ b costs less than saving acc; nothing saved",
        }[self.mode]
        grads = tuple((name, "bf16") for name in differentiable_outputs(self.graph))
        operands = tuple(name for name, _ in self.graph.inputs)
        step = gradient_pass_of(self.graph, grads, operands, self.mode == "save", torch_reductions)
        lines = [f"backward: {self.mode} ({why})"]
        if step.epilogue is not None:
            gb = step.graph
            ops = ", ".join(f"%{node.id} {node.op}" for node in gb.nodes if node.op not in ("acc", "input", "const"))
            results = ", ".join(name for name, _ in gb.outputs)
            first = "a GEMM recomputing a @ b" if self.mode == "recompute" else "a zero-K pass (the epilogue alone)"
            lines.append(f"{first}, epilogue derived from the forward's: {results} <- {ops}")
        lines += [f"{out} = {op}({name}) by torch: one read of the gradient, no pass of the kernel"
                  for out, op, name in step.reduced]  # fmt: skip
        lines += [f"{out} = {name} as it is" for out, name in step.forwarded]
        dacc = "dacc" if step.epilogue is not None else "dD"
        lines += [f"da = {dacc} @ b^T", f"db = a^T @ {dacc}"]
        return lines[0] + "".join(f"\n  {i}. {line}" for i, line in enumerate(lines[1:], 1))


def explain_backward(graph: Graph | None, m: int, n: int, k: int, torch_reductions: bool = True) -> str:
    """``explain``'s "under autograd" paragraph for a call whose epilogue lowers to ``graph`` (``torch_reductions``:
    as the family's :class:`GradientKernels` says)."""
    try:
        line = plan_backward(graph, k).explain(m, n, k, torch_reductions=torch_reductions)
    except GradientError as exc:
        line = f"backward: none ({exc})"
    return "under autograd\n  " + line


def plan_backward(graph: Graph | None, k: int) -> BackwardPlan:
    """The backward plan of a call whose forward epilogue is ``graph``: raises
    :class:`~epicute.errors.GradientError` when an output has no gradient it could need (it depends on a
    reduction of the accumulator)."""
    return _plan_backward(graph, bool(k < RECOMPUTE_BELOW_K))  # a guard on K under symbolic shapes


@functools.lru_cache(maxsize=1024)
def _plan_backward(graph: Graph | None, small_k: bool) -> BackwardPlan:
    if graph is None:
        return BackwardPlan("plain", None)
    if graph.paired:
        raise GradientError(
            f"the epilogue returns {UP_OUTPUT!r}, stored interleaved with D (a gated epilogue's gradient): it has no "
            "backward of its own; call it on tensors that need no gradient (under torch.no_grad()), or name that "
            "output otherwise"
        )
    outputs = differentiable_outputs(graph)
    operands = tuple(name for name, _ in graph.inputs)
    if not outputs:
        return BackwardPlan("none", graph)
    probe = gradient_graph(graph, dict.fromkeys(outputs, "fp32"), operands)
    if not reads_accumulator(probe):
        return BackwardPlan("operands", graph)
    if small_k:
        return BackwardPlan("recompute", graph)
    return BackwardPlan("save", graph, ("saved_acc", "saved_acc_up") if graph.gated else ("saved_acc",))


@dataclass(frozen=True)
class OpCall:
    """What an op call's static arguments decide, once per signature (:func:`op_call`): the forward, its
    ``setup_context`` and its fake all read this one record, so no fact is decided twice."""

    #: the parsed spec (read only)
    spec: dict
    #: the epilogue's own outputs, D first
    names: tuple[str, ...]
    #: the backward plan; None for a call made without one (no input required grad)
    plan: BackwardPlan | None
    #: the public function's keyword options (epilogue, out_dtype, out_dtypes, ...), a ``save`` plan's included
    options: dict
    #: the op's outputs: ``names``, then a ``save`` plan's accumulators
    outputs: tuple[str, ...]


_OP_CALLS: dict[tuple, OpCall] = {}


def op_call(
    family: str,
    tensors: tuple[torch.Tensor, ...],
    epilogue: str,
    spec: str,
    options: Callable[[dict], dict],
    graph: Callable[[dict], Graph | None],
) -> OpCall:
    """The :class:`OpCall` of a call of ``family``'s op over ``tensors`` (a and b first), remembered by the family,
    the epilogue's key, the spec and the tensors' shapes and dtypes (not remembered under symbolic shapes: a trace
    asks once anyway). ``options(spec)`` gives the public function's keyword options; ``graph(spec)`` the
    epilogue's graph as the call lowers it (asked only for a call that records a backward)."""
    shapes = tuple(tuple(t.shape) for t in tensors)
    memo = None
    if all(type(d) is int for shape in shapes for d in shape):
        memo = (family, epilogue, spec, shapes, tuple(t.dtype for t in tensors))
        found = _OP_CALLS.get(memo)
        if found is not None:
            return found
    parsed = json.loads(spec)
    names = registered_outputs(epilogue) if epilogue else ("D",)
    plan = plan_backward(graph(parsed), tensors[0].shape[-1]) if parsed.get("backward") else None
    kwargs, outputs = options(parsed), names
    if plan is not None and plan.saved:  # the forward of a "save" backward stores the accumulators too
        saving, outputs = saving_call(plan, names, tensors[0].dtype)
        kwargs = {**kwargs, **saving}
    found = OpCall(parsed, names, plan, kwargs, outputs)
    if memo is not None:
        if len(_OP_CALLS) >= 4096:
            _OP_CALLS.clear()
        _OP_CALLS[memo] = found
    return found


def saving_call(plan: BackwardPlan, names: tuple[str, ...], a_dtype: torch.dtype) -> tuple[dict, tuple[str, ...]]:
    """The forward of a ``save`` plan: the call's ``epilogue``, ``out_dtype`` and ``out_dtypes`` (every output of
    the epilogue's own, ``names``, in the dtype the call settled; the accumulators in :func:`saved_dtype`), and the
    names of all its outputs, the saved accumulators last."""
    stored = dict(plan.graph.output_dtypes)
    options = {
        "epilogue": saving_epilogue(plan.graph, ir_dtype(saved_dtype(a_dtype), "a")),
        "out_dtype": None,
        "out_dtypes": {name: IR_TO_TORCH[stored[name]] for name in names},
    }
    return options, (*names, *plan.saved)


def saving_epilogue(graph: Graph, dtype: str) -> Any:
    """The forward epilogue of a ``save`` plan: ``graph`` plus its accumulators as tile outputs (:data:`SAVED`)
    stored in ``dtype``, as a replayed epilogue function."""
    leaves = {node.op: node.id for node in graph.nodes if node.op in SAVED}
    extra = tuple((SAVED[op], leaves[op]) for op in ("acc", "acc_up") if op in leaves)
    augmented = Graph(graph.nodes, graph.inputs, graph.outputs + extra,
                      graph.output_dtypes + tuple((name, dtype) for name, _ in extra))  # fmt: skip
    return replay_epilogue(augmented, "forward_saving_acc")


def saved_dtype(a_dtype: torch.dtype) -> torch.dtype:
    """The dtype a ``save`` plan stores the accumulator in: the inputs' (16-bit), bf16 for fp8 inputs."""
    return a_dtype if a_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


@dataclass(frozen=True)
class GradientPass:
    """How a backward computes the gradient epilogue's outputs (:func:`gradient_pass_of`)."""

    #: the graph of the kernel's pass (no outputs: no pass), and its epilogue
    graph: Graph
    epilogue: Callable | None
    #: outputs that are an incoming gradient as it is: ``((output, gradient input), ...)``
    forwarded: tuple
    #: outputs that reduce an incoming gradient, by torch: ``((output, reduction, gradient input), ...)``
    reduced: tuple


@functools.lru_cache(maxsize=256)
def gradient_pass_of(graph: Graph, grads: tuple, operands: tuple, saved: bool, torch_reductions: bool) -> GradientPass:
    """The backward's gradient epilogue for the forward ``graph`` (``grads``: ``((output, dtype), ...)``), split
    into what a kernel pass computes, what is forwarded and (``torch_reductions``: a family whose reductions are
    whole columns, not per group) what a torch reduction of a gradient gives."""
    gb = gradient_graph(graph, dict(grads), operands, saved_acc=saved)
    gb, reduced = reduced_gradients(gb) if torch_reductions else (gb, ())
    gb, forwarded = forwarded_gradients(gb)
    return GradientPass(gb, replay_epilogue(gb) if gb.outputs else None, forwarded, reduced)


class GradientKernels(Protocol):
    """What a family runs for a backward (:func:`backward_of`): the gradient epilogue's pass, and the data and
    weight gradients of ``dacc``. ``TORCH_REDUCTIONS``: a reduction of an incoming gradient alone may be torch's
    (whole rows or columns of the output, as the family's kernel reduces them)."""

    TORCH_REDUCTIONS: bool

    def gradient_pass(self, epilogue: Callable, recompute: bool, out_dtypes: dict, operands: dict) -> dict: ...

    def data_grad(self, dacc: torch.Tensor) -> torch.Tensor: ...

    def weight_grad(self, dacc: torch.Tensor) -> torch.Tensor: ...


def backward_of(
    plan: BackwardPlan,
    kernels: GradientKernels,
    values: dict[str, Any],
    saved: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    needs: tuple[bool, bool],
    operands: tuple[str, ...],
    acc_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
    """``(da, db, {operand: gradient as the kernel reduces it})`` for the outputs' gradients ``grads`` (by name).

    ``values``: the epilogue's operands by name; ``saved``: the tiles a ``save`` plan stored; ``needs``: whether
    a and b need a gradient; ``operands``: the operands that need one; ``acc_dtype``: what ``dacc`` is stored in.
    Operand gradients come back fp32, shaped as the kernel's reductions are (a row operand's ``col_sum``...).
    """
    if plan.mode == "plain":
        dacc, by_operand = grads["D"], {}
    else:
        grad_dtypes = tuple((name, ir_dtype(t.dtype, name)) for name, t in grads.items())
        step = gradient_pass_of(plan.graph, grad_dtypes, operands, plan.mode == "save", kernels.TORCH_REDUCTIONS)
        gb, epilogue = step.graph, step.epilogue
        given = {**values, **saved, **{grad_name(name): t for name, t in grads.items()}}
        results = {out: given[name] for out, name in step.forwarded}
        results |= {out: reduce_tile(given[name], op) for out, op, name in step.reduced}
        if epilogue is not None:
            inputs = {name for name, _ in gb.inputs}
            shape = next(iter(grads.values())).shape
            out_dtypes = {DACC: acc_dtype, DACC_UP: acc_dtype} | {
                operand_grad_name(name): _tile_gradient_dtype(values[name], shape) for name in operands}
            out_dtypes = {name: out_dtypes[name] for name, _ in gb.outputs
                          if name in (DACC, DACC_UP) or gb.output_node(name).kind == "tile"}  # fmt: skip
            needed = {name: value for name, value in given.items() if name in inputs}
            results |= kernels.gradient_pass(epilogue, plan.mode == "recompute", out_dtypes, needed)
        # A gated accumulator's gradient comes paired (Graph.paired): gate and up in B's column order already.
        dacc = results[DACC]
        by_operand = {name: results[operand_grad_name(name)] for name in operands}
    if dacc.dtype != acc_dtype:  # D stored wider than the inputs (a chain ending in ``.float()``): rounded back, as
        dacc = dacc.to(acc_dtype)  # autograd rounds a cast's gradient, for GEMMs that take 16-bit operands
    da = kernels.data_grad(dacc) if needs[0] else None
    db = kernels.weight_grad(dacc) if needs[1] else None
    return da, db, by_operand


def _tile_gradient_dtype(operand: Any, shape: torch.Size) -> torch.dtype:
    """What the gradient pass stores a tile operand's gradient in: the operand's dtype where it has the output's
    shape (rounded once, as a ``.to`` after the pass would), fp32 where it is broadcast over the batch and still
    to be summed."""
    tensor = operand.value if isinstance(operand, Pin) else operand
    return tensor.dtype if isinstance(tensor, torch.Tensor) and tensor.shape == shape else torch.float32


def setup_backward(
    ctx, plan: BackwardPlan | None, names: tuple, output, inputs: tuple, operands, scalars, spec: dict
) -> None:
    """An op's ``setup_context``: ``names`` its epilogue's outputs (then a ``save`` plan's accumulators, last in
    ``output``); ``inputs`` the GEMM's tensors (a, b and what else the backward needs); ``operands`` and
    ``scalars`` the op's operand lists."""
    ctx.set_materialize_grads(False)  # an output the loss does not use gets None: no zeros to fill and read
    ctx.call = forward_record(plan, spec, scalars, names, len(inputs), tuple(t.requires_grad for t in operands))
    # One call with all of them: each call replaces the last one's set. The saved accumulators carry none either.
    ctx.mark_non_differentiable(*(t for name, t in zip(names, output) if name not in ctx.call.differentiable),
                                *output[len(names):])  # fmt: skip
    ctx.save_for_backward(*inputs, *operands, *output[len(names):])


def forward_record(plan: BackwardPlan | None, spec: dict, scalars, names: tuple, inputs: int, operand_needs: tuple):
    """What an op's forward leaves for its backward beside the saved tensors (``ctx.call``): the plan, the spec, the
    scalars, the outputs' names and which of them carry a gradient, how many saved tensors are the GEMM's inputs,
    and which operands required grad."""
    differentiable = differentiable_outputs(plan.graph) if plan is not None and plan.graph is not None else ("D",)
    return _Recorded(plan, spec, scalars, names, differentiable, inputs, len(operand_needs), operand_needs)


class _Recorded(NamedTuple):
    """What an op's forward left for its backward (beside the saved tensors); a tuple, made every training call."""

    plan: BackwardPlan | None
    spec: dict
    scalars: Any
    names: tuple
    differentiable: tuple
    inputs: int
    count: int
    operand_needs: tuple


@dataclass(frozen=True)
class BackwardStep:
    """One backward of an op: its saved tensors taken apart, the gradients it got, the operands by name."""

    recorded: _Recorded
    inputs: tuple
    operands: tuple
    saved: dict
    grads: dict
    values: dict
    loaders: dict

    @classmethod
    def of(cls, ctx, grads, entry: str, loader_names: tuple) -> BackwardStep | None:
        """The step (None: no differentiable output got a gradient). ``loader_names``: operands that are the
        mainloop's (fp8 scales, gathered rows' index), not the epilogue's."""
        recorded: _Recorded = ctx.call
        if recorded.plan is None:
            raise GradientError(
                f"{entry} ran without autograd recording (no input required grad when it was called), so it saved "
                "nothing for a backward; call it with the inputs that need a gradient already requiring grad"
            )
        tensors = ctx.saved_tensors
        inputs, rest = tensors[: recorded.inputs], tensors[recorded.inputs :]
        operands, saved = rest[: recorded.count], rest[recorded.count :]
        by_name = {name: g for name, g in zip(recorded.names, grads)
                   if g is not None and name in recorded.differentiable}  # fmt: skip
        if not by_name:
            return None
        # Autograd may hand over expanded (stride 0) or strided gradients, which TMA cannot read.
        by_name = {name: g if g.is_contiguous() else g.contiguous() for name, g in by_name.items()}
        values = _operand_values(list(operands), recorded.scalars, recorded.spec)
        loaders = {name: values.pop(name) for name in loader_names if name in values}
        return cls(recorded, tuple(inputs), tuple(operands), dict(zip(recorded.plan.saved, saved)), by_name, values,
                   loaders)  # fmt: skip

    @property
    def gated(self) -> bool:
        return self.recorded.spec.get("gated", False)

    @property
    def needing(self) -> tuple[str, ...]:
        """The epilogue operands that need a gradient."""
        r = self.recorded
        return tuple(name for name, needs in zip(r.spec["tensors"], r.operand_needs) if needs and name in self.values)

    def run(self, kernels: GradientKernels, needs: tuple[bool, bool], acc_dtype: torch.dtype):
        return backward_of(self.recorded.plan, kernels, self.values, self.saved, self.grads, needs, self.needing,
                           acc_dtype)  # fmt: skip

    def operand_grads(self, by_operand: dict) -> list:
        """The op's operand list's gradients (None for those without one), each in its operand's shape."""
        graph = self.recorded.plan.graph
        return [to_operand_shape(by_operand[name], t, graph.input_node(name).kind) if name in by_operand else None
                for name, t in zip(self.recorded.spec["tensors"], self.operands)]  # fmt: skip


def _operand_values(operands: list, scalars, spec: dict) -> dict:
    from epicute.runtime.torch_ops import operand_values

    return operand_values(operands, scalars, spec)


def to_operand_shape(grad: torch.Tensor, operand: torch.Tensor, kind: str) -> torch.Tensor:
    """An operand's gradient from its canonical one (:func:`gemm_backward`): summed over what the operand was
    broadcast along (the batch; everything for a scalar), in the operand's shape and dtype."""
    if kind == "scalar":
        grad = grad.sum()
    elif grad.numel() != operand.numel():  # a 2-D operand of a batched call: broadcast over L
        grad = grad.sum(0)
    return grad.reshape(operand.shape).to(operand.dtype)


__all__ = [
    "PLANS", "RECOMPUTE_BELOW_K", "BackwardPlan", "BackwardStep", "GradientKernels", "OpCall", "backward_of",
    "explain_backward", "forward_record", "op_call", "plan_backward", "saved_dtype", "saving_call", "saving_epilogue",
    "setup_backward", "to_operand_shape",
]  # fmt: skip

