"""Eager training calls of ``epicute.gemm`` repeated at little host cost.

An eager training call runs the op's autograd Function: the forward through ``epicute.gemm``'s keyword path, the
backward through :mod:`epicute.gemm.autograd` (the saved tensors taken apart, the gradient graph looked up, one
``epicute.gemm`` keyword call per GEMM, each keyed again to find the launch it made the step before). A model
repeats the same signatures every step, so:

- the first training call of a signature leaves a :class:`PreparedTraining`: its op arguments, its
  :class:`~epicute.gemm.autograd.OpCall` and the forward's prepared launch, replayed by the next calls;
- the first backward of each gradient signature of it leaves a :class:`PreparedBackward`: the prepared launch
  each of its GEMMs went through (the gradient epilogue's pass, the data and weight gradients) and where each
  takes its tensors from, replayed by the next backwards of that signature.

A replay makes the launches the whole path would make, with the same tensors (``tests/gemm/test_training.py``).
Whatever a record does not cover takes the whole path: another backend, kernel discovery, a backward that records
a graph of its own (``create_graph=True``), launches ``epicute.gemm`` could not record. A compiled backward is one
op, ``epicute::gemm_backward`` (:func:`gemm_backward_op`), whose implementation keeps the same records per forward
signature: one op call a step for the backward's GEMMs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from epicute.epilogue.backward import DACC, grad_name, operand_grad_name
from epicute.epilogue.dtypes import ir_dtype
from epicute.epilogue.reference import reduce_tile
from epicute.epilogue.scales import SCALE_NAMES
from epicute.gemm.autograd import (
    BackwardStep,
    OpCall,
    forward_record,
    gradient_pass_of,
    saved_dtype,
    setup_backward,
    to_operand_shape,
)
from epicute.gemm.prepared import PreparedGemmCall, call_signature
from epicute.gemm.torch_op import (
    GEMM_OP,
    DenseKernels,
    OpArguments,
    dense_backward,
    dense_call,
    forward_sources,
    gemm_op,
    listed,
    op_results,
    results_by_name,
)
from epicute.runtime.backend import resolve_backend
from epicute.runtime.checks import TMA_ALIGN_BYTES
from epicute.runtime.compile import DISCOVERING
from epicute.runtime.torch_ops import TorchOp, eager_layout, grad_slot, runs_eagerly, split_operands


class PreparedTraining:
    """An eager training call of one signature, as the op's first call of it decided: its arguments beside the
    tensors, its :class:`~epicute.gemm.autograd.OpCall`, and the forward's prepared launch (the one the op's
    implementation recorded). A repeat call runs the op's own autograd Function with the launch replayed directly,
    and its backward through the :class:`PreparedBackward` of its gradients' signature."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, args: OpArguments, call: OpCall,
                 forward: PreparedGemmCall) -> None:  # fmt: skip
        self.args, self.call, self.forward = args, call, forward
        self.op = TorchOp(GEMM_OP.name, self._impl, GEMM_OP.fake, self._backward, self._setup)
        self.layout = eager_layout((a, b, args.tensors, args.scalars, args.epilogue, args.spec))
        #: by gradient signature (:func:`_gradient_key`); None: one the whole path runs every time
        self.backwards: dict[tuple, PreparedBackward | None] = {}

    def __call__(self, a: torch.Tensor, b: torch.Tensor, operands: dict) -> torch.Tensor | dict[str, torch.Tensor]:
        _, tensors, _, scalars, _ = split_operands(operands)
        args = self.args
        results = self.op.eager(self.layout, a, b, tensors, scalars, args.epilogue, args.spec)
        return op_results(args.outputs, dict(zip(args.outputs, results)))

    def _impl(self, a, b, tensors, scalars, epilogue, spec) -> list[torch.Tensor]:
        sources = forward_sources(a, b, tensors, scalars)
        if not self.forward.fits(sources):  # the recorded call passed one tensor twice, this one two tensors
            return gemm_op(a, b, tensors, scalars, epilogue, spec)
        return listed(self.forward.replay(sources), self.call.outputs)

    def _setup(self, ctx, inputs, output) -> None:
        a, b, operands, scalars, _, _ = inputs
        setup_backward(ctx, self.call.plan, self.call.names, output, (a, b), operands, scalars, self.call.spec)

    def _backward(self, ctx, grads: list) -> tuple:
        return replayed_backward(ctx, grads, self.backwards)


def replayed_backward(ctx, grads: list, backwards: dict) -> tuple:
    """The op's backward for ``ctx`` (an eager call's, or the traced backward op's stand-in) and ``grads``: replayed
    from ``backwards``' record of its gradient signature (:func:`_gradient_key`), which the first backward of that
    signature leaves there."""
    # A backward recording its own graph (create_graph=True) calls the differentiable epicute.gemm.
    if torch.is_grad_enabled() or resolve_backend(None) != "kernel" or DISCOVERING.is_set():
        return dense_backward(ctx, grads)[0]
    grads = [g if g is None or g.is_contiguous() else g.contiguous() for g in grads]  # as BackwardStep.of has them
    key = _gradient_key(ctx, grads)
    if key in backwards:
        prepared = backwards[key]
        result = prepared(ctx, grads) if prepared is not None else None
        if result is not None:
            return result
        return dense_backward(ctx, grads)[0]
    result, step, kernels = dense_backward(ctx, grads, _RecordingKernels)
    if len(backwards) >= 64:
        backwards.clear()
    backwards[key] = PreparedBackward.of(ctx, grads, step, kernels) if step is not None else None
    return result


def _gradient_key(ctx, grads: list) -> tuple:
    """What decides a backward of a :class:`PreparedTraining`: its gradients' signatures (None where an output got
    none), which inputs need a gradient, which operands required one in the forward."""
    signatures = tuple(None if g is None else (g.shape, g.stride(), g.dtype, g.data_ptr() % TMA_ALIGN_BYTES)
                       for g in grads)  # fmt: skip
    return signatures, ctx.needs_input_grad, ctx.call.operand_needs


class _RecordingKernels(DenseKernels):
    """:class:`~epicute.gemm.torch_op.DenseKernels` noting, per GEMM role, what it was handed and the prepared call
    that ``epicute.gemm``'s cached path keeps for it (None where it keeps none)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: dict[str, tuple] = {}

    def run_gemm(self, role, a, b, epilogue=None, out_dtypes=None, operands=None, gated=False, scales=None):
        from epicute.gemm.api import recorded_call

        result = super().run_gemm(role, a, b, epilogue, out_dtypes, operands, gated, scales)
        operands = operands or {}
        prepared = None if scales else recorded_call(a, b, operands, epilogue=epilogue, out_dtypes=out_dtypes,
                                                     gated=gated)  # fmt: skip
        self.seen[role] = (prepared, a, b, tuple(operands))
        return result


class _ReplayingKernels(DenseKernels):
    """:class:`~epicute.gemm.torch_op.DenseKernels` launching each GEMM by the prepared call recorded for its role
    (the data and weight gradients: plain GEMMs of a known signature)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, calls: dict[str, PreparedGemmCall]) -> None:
        super().__init__(a, b, False, {})
        self.calls = calls

    def run_gemm(self, role, a, b, epilogue=None, out_dtypes=None, operands=None, gated=False, scales=None):
        return self.calls[role].plain(a, b)


@dataclass(frozen=True, slots=True)
class PreparedBackward:
    """The backward of one :class:`PreparedTraining` for gradients of one signature, as its first run went
    (:meth:`of`): the gradient epilogue's pass, the incoming gradients it forwards or reduces by torch, the data
    and weight gradients, each operand's gradient. A call replays them over the tensors the backward holds, in
    one tuple (:meth:`__call__`): the saved tensors, the incoming gradients, the scalars, then the record's
    constants (the zero-K pass's empty A and B)."""

    #: the data and weight gradients' prepared calls, by role (``"data"``, ``"weight"``)
    calls: dict[str, PreparedGemmCall]
    #: the gradient epilogue's pass and its sources (indices into the backward's values), or None
    pass_call: PreparedGemmCall | None
    pass_sources: tuple[int, ...]
    #: outputs of the gradient epilogue that are an incoming gradient as it is, or torch's reduction of one
    forwarded: tuple
    reduced: tuple
    #: where ``dacc`` is: D's incoming gradient (a plain GEMM), else the pass's output
    dacc_slot: int | None
    acc_dtype: torch.dtype
    #: whether a and b need a gradient
    needs: tuple[bool, bool]
    #: per operand of the op, ``(its gradient's output, its kind)``, or None where it needs none
    operand_grads: tuple
    constants: tuple

    @classmethod
    def of(cls, ctx, grads: list, step: BackwardStep, kernels: _RecordingKernels) -> PreparedBackward | None:
        """The record of the backward that ``step`` and ``kernels`` just ran, or None where one of its GEMMs left
        no prepared call."""
        recorded = step.recorded
        saved, scalars = ctx.saved_tensors, recorded.scalars
        spec, plan = recorded.spec, recorded.plan
        slots = {name: 2 + i for i, name in enumerate(spec["tensors"])}
        slots |= {name: 2 + recorded.count + i for i, name in enumerate(plan.saved)}
        slots |= {grad_name(name): len(saved) + i for i, name in enumerate(recorded.names)}
        slots |= {name: len(saved) + len(grads) + i for i, name in enumerate(spec["scalars"])}
        fixed = len(saved) + len(grads) + len(scalars)  # where the constants start: None, then the pass's A and B
        constants: tuple = (None,)
        calls, pass_call, pass_sources = {}, None, ()
        for role, (prepared, a, b, names) in kernels.seen.items():
            if prepared is None:
                return None
            if role != "pass":
                calls[role] = prepared
                continue
            if a is step.inputs[0]:  # recomputing a @ b: the saved a and b
                ab = (0, 1)
            else:  # a zero-K pass: its empty A and B, kept with the record
                constants, ab = (None, a, b), (fixed + 1, fixed + 2)
            pass_call = prepared
            pass_sources = (*ab, fixed, fixed, fixed, *(slots.get(name) for name in names))
            if None in pass_sources:
                return None
        forwarded = reduced = ()
        if plan.mode != "plain":
            grad_dtypes = tuple((name, ir_dtype(t.dtype, name)) for name, t in step.grads.items())
            gradient_pass = gradient_pass_of(plan.graph, grad_dtypes, step.needing, plan.mode == "save",
                                             kernels.TORCH_REDUCTIONS)  # fmt: skip
            forwarded = tuple((out, slots[name]) for out, name in gradient_pass.forwarded)
            reduced = tuple((out, op, slots[name]) for out, op, name in gradient_pass.reduced)
        operand_grads = tuple((operand_grad_name(name), plan.graph.input_node(name).kind) if name in step.needing
                              else None for name in spec["tensors"])  # fmt: skip
        return cls(
            acc_dtype=saved_dtype(step.inputs[0].dtype), calls=calls, constants=constants,
            dacc_slot=slots[grad_name(DACC)] if plan.mode == "plain" else None, forwarded=forwarded,
            needs=tuple(ctx.needs_input_grad[:2]), operand_grads=operand_grads, pass_call=pass_call,
            pass_sources=pass_sources, reduced=reduced,
        )  # fmt: skip

    def __call__(self, ctx, grads: list) -> tuple | None:
        """The op's gradients, or None where the pass's recorded launch does not fit these tensors (it passed one
        tensor twice where they are two): the whole path then runs."""
        saved = ctx.saved_tensors
        scalars = ctx.call.scalars
        values = (*saved, *grads, *scalars, *self.constants)
        results = {out: values[i] for out, i in self.forwarded}
        if self.pass_call is not None:
            sources = tuple(values[i] for i in self.pass_sources)
            if not self.pass_call.fits(sources):
                return None
            results |= results_by_name(self.pass_call.replay(sources))
        results |= {out: reduce_tile(values[i], op) for out, op, i in self.reduced}
        dacc = values[self.dacc_slot] if self.dacc_slot is not None else results[DACC]
        if dacc.dtype != self.acc_dtype:  # as backward_of rounds it
            dacc = dacc.to(self.acc_dtype)
        kernels = _ReplayingKernels(saved[0], saved[1], self.calls)
        da = kernels.data_grad(dacc) if self.needs[0] else None
        db = kernels.weight_grad(dacc) if self.needs[1] else None
        operand_grads = [None if entry is None else to_operand_shape(results[entry[0]], saved[2 + i], entry[1])
                         for i, entry in enumerate(self.operand_grads)]  # fmt: skip
        return da, db, operand_grads, grad_slot(scalars), None, None


class _TracedContext(NamedTuple):
    """What the backward reads of an autograd context, rebuilt from the backward op's arguments."""

    saved_tensors: tuple
    call: Any
    needs_input_grad: tuple


def gemm_backward_op(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], saved: list[torch.Tensor],
    grads: list[torch.Tensor | None], scalars: list[float], epilogue: str, spec: str, needs: list[bool],
) -> list[torch.Tensor]:  # fmt: skip
    """``epicute::gemm``'s whole backward as one op, what a compiled backward graph calls (one op call for its
    GEMMs, replayed from one record; :func:`gemm_backward_outputs` says which gradients it returns). ``saved``: a
    ``save`` plan's accumulators; ``needs``: whether a and b need a gradient, then whether each operand required
    one in the forward."""
    call = dense_call(a, b, operands, scalars, epilogue, spec)
    ctx = _TracedContext((a, b, *operands, *saved), forward_record(call.plan, call.spec, scalars, call.names, 2,
                                                                   tuple(needs[2:])), tuple(needs[:2]))  # fmt: skip
    if runs_eagerly(a, b):
        key = (epilogue, spec, call_signature(forward_sources(a, b, operands, scalars)))
        backwards = _OP_BACKWARDS.get(key)
        if backwards is None:
            if len(_OP_BACKWARDS) >= 1024:
                _OP_BACKWARDS.clear()
            backwards = _OP_BACKWARDS[key] = {}
        da, db, operand_grads, *_ = replayed_backward(ctx, grads, backwards)
    else:  # the fake: the backward's GEMMs as op calls on fake tensors give every gradient's layout
        da, db, operand_grads, *_ = dense_backward(ctx, grads)[0]
    sources = gemm_backward_outputs(ctx, grads)
    return [t for t, source in zip((da, db, *operand_grads), sources, strict=True) if source == "op"]


#: The backward op's records by the forward call's signature (epilogue, spec, sources), then by gradient signature.
_OP_BACKWARDS: dict[tuple, dict] = {}


def gemm_backward_outputs(ctx, grads: list) -> tuple | None:
    """Where each of ``(da, db, *operand gradients)`` of a traced backward comes from: ``"op"`` (returned by
    :func:`gemm_backward_op`), None (no gradient), or the index of the incoming gradient it is as it is (an operand's
    gradient the gradient epilogue forwards: taken beside the op, which may return no alias of its inputs). None
    where the backward runs nothing (no differentiable output got a gradient)."""
    recorded = ctx.call
    given = tuple((name, g.dtype) for name, g in zip(recorded.names, grads)
                  if g is not None and name in recorded.differentiable)  # fmt: skip
    return _output_sources(recorded.plan, tuple(recorded.spec["tensors"]), recorded.names, given,
                           recorded.operand_needs, tuple(ctx.needs_input_grad[:2])) if given else None  # fmt: skip


@functools.lru_cache(maxsize=256)
def _output_sources(plan, tensors: tuple, names: tuple, given: tuple, operand_needs: tuple, needs: tuple) -> tuple:
    """:func:`gemm_backward_outputs` for one signature (decided once: every step of a compiled graph asks)."""
    needing = tuple(name for name, need in zip(tensors, operand_needs) if need and name not in SCALE_NAMES)
    forwarded = {}
    if plan.mode != "plain":
        grad_dtypes = tuple((name, ir_dtype(dtype, name)) for name, dtype in given)
        step = gradient_pass_of(plan.graph, grad_dtypes, needing, plan.mode == "save", DenseKernels.TORCH_REDUCTIONS)
        index = {grad_name(name): i for i, name in enumerate(names)}
        forwarded = {out: index[name] for out, name in step.forwarded}
    operands = (forwarded.get(operand_grad_name(name), "op") if name in needing else None for name in tensors)
    return (*("op" if need else None for need in needs), *operands)


GEMM_BACKWARD_OP = TorchOp("epicute::gemm_backward", gemm_backward_op, gemm_backward_op)

__all__ = ["GEMM_BACKWARD_OP", "PreparedBackward", "PreparedTraining", "gemm_backward_op", "replayed_backward"]
