"""``torch.ops.epicute.gemm``: the GEMM family's custom op (see :mod:`epicute.runtime.torch_ops`).

``torch.ops.epicute.gemm(a, b, operands, scalars, epilogue, spec) -> list[Tensor]`` runs
:func:`epicute.gemm`; under ``torch.compile`` :func:`epicute.gemm` turns into one call of it.
Its fake implementation gives every output's shape, dtype and strides without running
anything (D's dtype by ``prepare``'s first half, as the call settles it); its real one is
the eager path. Outputs are ``[D, *aux outputs]`` in the epilogue's output order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from epicute.epilogue.backward import DACC
from epicute.epilogue.dtypes import IR_TO_TORCH, ir_dtype
from epicute.epilogue.gated import check_gated_call, gated_epilogue, output_columns, stored_columns
from epicute.epilogue.graph import REDUCTIONS, UP_OUTPUT
from epicute.epilogue.group_quant import GROUP_N
from epicute.epilogue.operands import PINS, Pin
from epicute.epilogue.scales import SCALE_NAMES, fp8_scaling
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import EpilogueError, GradientError
from epicute.gemm.autograd import (
    BackwardStep,
    OpCall,
    op_call,
    saved_dtype,
    setup_backward,
    to_operand_shape,
)
from epicute.gemm.config import GemmConfig, GemmProblem
from epicute.gemm.prepare import GemmRequest, lower_epilogue
from epicute.gemm.prepared import PreparedGemmCall, call_signature
from epicute.gemm.validate import FP8_TORCH_DTYPES
from epicute.runtime.backend import check_traced_backend, resolve_backend
from epicute.runtime.checks import check_operand_names, config_pins
from epicute.runtime.compile import DISCOVERING, or_reference
from epicute.runtime.torch_ops import (
    TorchOp,
    assume_constant_result,
    config_of,
    grad_slot,
    operand_values,
    plain_fn,
    register_gated_traced,
    register_traced,
    registered_epilogue,
    runs_eagerly,
    spec_text,
    split_operands,
)


def op_options(spec: dict) -> dict:
    """The keyword options of the public call an op stands for, from its spec (the epilogue and operands aside)."""
    return {
        "out_dtype": IR_TO_TORCH[spec["out_dtype"]] if spec["out_dtype"] else None,
        "out_dtypes": {k: IR_TO_TORCH[v] for k, v in spec["out_dtypes"].items()} or None,
        "config": config_of(spec),
        "gated": spec.get("gated", False),
    }


def dense_call(a, b, operands, scalars, epilogue: str, spec: str) -> OpCall:
    """The op call's :class:`~epicute.gemm.autograd.OpCall` (decided once per signature)."""

    def options(parsed: dict) -> dict:
        return {"epilogue": registered_epilogue(epilogue) if epilogue else None, **op_options(parsed)}

    return op_call("gemm", (a, b, *operands), epilogue, spec, options,
                   lambda parsed: user_graph(a, b, operands, scalars, epilogue, parsed))  # fmt: skip


#: The implementation's repeat calls (a compiled graph's, every step): by epilogue, spec and the sources' signatures,
#: the outputs' names and the forward's prepared call that the first call recorded, replayed with none of
#: ``epicute.gemm``'s keyword handling and keying (bench/NOTES.md, thirteenth session).
_OP_REPEATS: dict[tuple, tuple[tuple[str, ...], PreparedGemmCall]] = {}


def gemm_op(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], scalars: list[float], epilogue: str, spec: str
) -> list[torch.Tensor]:
    """``epicute.gemm(a, b, ...)`` as an op: ``[D, *aux outputs]`` (see the module docstring)."""
    from epicute.gemm.api import gemm, prepared_forward

    # A plain call's own cached path (gemm's, keyed by A's and B's layouts alone) costs less than this one's key.
    sources = forward_sources(a, b, operands, scalars)
    key = _op_repeat_key(sources, epilogue, spec)
    repeat = _OP_REPEATS.get(key) if key is not None else None
    if repeat is not None and _replays(repeat[1], sources):
        return listed(repeat[1].replay(sources), repeat[0])
    call = dense_call(a, b, operands, scalars, epilogue, spec)
    # An fp8 call's scales travel among the operands, under their parameter names.
    values = operand_values(operands, scalars, call.spec)
    result = or_reference(gemm, a, b, **call.options, **values)
    if key is not None and not DISCOVERING.is_set() and not SCALE_NAMES & values.keys():
        forward = prepared_forward(a, b, call, values)
        if forward is not None:
            if len(_OP_REPEATS) >= 1024:
                _OP_REPEATS.clear()
            _OP_REPEATS[key] = (call.outputs, forward)
    return listed(result, call.outputs)


def _op_repeat_key(sources: tuple, epilogue: str, spec: str) -> tuple | None:
    parts = call_signature(sources) if epilogue else None
    return None if parts is None else (epilogue, spec, parts)


def op_repeat(a, b, operands: list, scalars: list, epilogue: str, spec: str) -> PreparedGemmCall | None:
    """The forward launch the op implementation keeps for a repeat of this call (None where it keeps none)."""
    repeat = _OP_REPEATS.get(_op_repeat_key(forward_sources(a, b, operands, scalars), epilogue, spec))
    return None if repeat is None else repeat[1]


def forward_sources(a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], scalars: list[float]) -> tuple:
    """The sources of the forward's prepared call (``epicute.gemm.prepared.FIXED_SOURCES``, then the epilogue's
    operands) in the order the op passes them: tensors, then numbers. An fp8 call's scales are among the op's
    operands instead: its calls are never replayed from these."""
    return (a, b, None, None, None, *operands, *scalars)


def _replays(forward: PreparedGemmCall, sources: tuple) -> bool:
    """Whether a repeat call may replay ``forward`` as the whole path would have run it: the kernels' backend, no
    discovery (which stops at missing kernels), one tensor wherever the recorded call had one, no gradient recorded
    here (the whole path would route such a call through the op again)."""
    if resolve_backend(None) != "kernel" or DISCOVERING.is_set() or not forward.fits(sources):
        return False
    return not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in sources))


def listed(result: torch.Tensor | dict[str, torch.Tensor], outputs: tuple[str, ...]) -> list[torch.Tensor]:
    """:func:`epicute.gemm`'s result as the op's list of outputs (``outputs``: their names, in order)."""
    return [result] if isinstance(result, torch.Tensor) else [result[name] for name in outputs]


def user_graph(a, b, operands, scalars, epilogue: str, spec: dict):
    """The graph of the call's own epilogue (fp8 scales aside: its ``acc`` is the scaled accumulator), with
    every output's stored dtype as the call settles it; None without an epilogue. Tensor values are never
    read (fake tensors do)."""
    if not epilogue:
        return None
    values = fake_operand_values(operands, scalars, spec)
    for name in SCALE_NAMES:
        values.pop(name, None)
    epi = registered_epilogue(epilogue)
    l = a.shape[0] if a.dim() == 3 else 1
    m, n = a.shape[-2], output_columns(b.shape[-1], spec.get("gated", False))
    return fake_lowered_graph(a, _d_dtype(a, spec), epi, epi.operands(values, m, n, l), spec)


def _d_dtype(a: torch.Tensor, spec: dict) -> str:
    """D's IR dtype as the call settles it (check_gemm_args' rule: fp8 inputs give bf16)."""
    default_d = "bf16" if a.dtype in FP8_TORCH_DTYPES else ir_dtype(a.dtype, "a")
    return spec["out_dtype"] or spec["out_dtypes"].get("D") or default_d


def _gemm_fake(a, b, operands, scalars, epilogue, spec) -> list[torch.Tensor]:
    call = dense_call(a, b, operands, scalars, epilogue, spec)
    l_dims = (a.shape[0],) if a.dim() == 3 else ()
    m, n = a.shape[-2], output_columns(b.shape[-1], call.spec.get("gated", False))
    saved = [a.new_empty((*l_dims, m, n), dtype=saved_dtype(a.dtype)) for _ in (call.plan.saved if call.plan else ())]
    return _forward_fake(a, b, operands, scalars, epilogue, call.spec) + saved


def _forward_fake(a, b, operands, scalars, epilogue, spec: dict) -> list[torch.Tensor]:
    """The outputs of the call's own epilogue, as fakes."""
    l_dims = (a.shape[0],) if a.dim() == 3 else ()
    m, n = a.shape[-2], output_columns(b.shape[-1], spec.get("gated", False))
    fp8 = a.dtype in FP8_TORCH_DTYPES
    d_dtype = IR_TO_TORCH[_d_dtype(a, spec)]
    if not epilogue and not fp8:
        return [a.new_empty((*l_dims, m, n), dtype=d_dtype)]
    epi = registered_epilogue(epilogue) if epilogue else None
    values = fake_operand_values(operands, scalars, spec)
    l = a.shape[0] if a.dim() == 3 else 1
    if fp8:  # the scales: operands of the scaled epilogue, or the mainloop's (blockwise), as epicute.gemm takes them
        scales = [values.pop(name, None) for name in SCALE_NAMES]
        # Of the problem's N: b's columns (gated, D holds half of them; the blockwise scales cover all).
        epi, values = fp8_scaling(*scales, m, b.shape[-1], a.shape[-1], l, a.dim() == 3).apply(epi, values)
        if epi is None:
            return [a.new_empty((*l_dims, m, n), dtype=d_dtype)]
    graph = fake_lowered_graph(a, ir_dtype(d_dtype, "out_dtype"), epi, epi.operands(values, m, n, l), spec)
    stored = dict(graph.output_dtypes)
    shapes = {"col": (*l_dims, m), "row": (*l_dims, n), "scalar": ()}
    outputs = []
    for name, node_id in graph.outputs:
        op = graph.node(node_id).op
        if graph.paired and name == UP_OUTPUT:  # inside D, which stores both halves
            continue
        if op in REDUCTIONS:
            outputs.append(a.new_empty(shapes[REDUCTIONS[op][0]], dtype=torch.float32))
        elif op == "group_scales":  # M-major (L, M, groups), as the kernel returns them
            groups = -(-n // GROUP_N)
            outputs.append(a.new_empty((*l_dims, groups, m), dtype=torch.float32).transpose(-1, -2))
        else:
            width = stored_columns(n, graph.paired) if name == "D" else n
            outputs.append(a.new_empty((*l_dims, m, width), dtype=IR_TO_TORCH[stored[name]]))
    return outputs


def _setup_context(ctx, inputs, output) -> None:
    a, b, operands, scalars, epilogue, spec = inputs
    call = dense_call(a, b, operands, scalars, epilogue, spec)
    setup_backward(ctx, call.plan, call.names, output, (a, b), operands, scalars, call.spec)
    ctx.op_strings = epilogue, spec  # what a traced backward hands the backward op


def _backward(ctx, grads):
    if runs_eagerly(*ctx.saved_tensors[:2]):
        return dense_backward(ctx, grads)[0]
    # Traced (a compiled backward): the whole backward as one op call, whose implementation replays its GEMMs.
    from epicute.gemm.training import GEMM_BACKWARD_OP, gemm_backward_outputs

    sources = gemm_backward_outputs(ctx, grads)
    recorded = ctx.call
    if sources is None:
        return None, None, [None] * recorded.count, grad_slot(recorded.scalars), None, None
    tensors = ctx.saved_tensors
    a, b = tensors[:2]
    operands, saved = list(tensors[2 : 2 + recorded.count]), list(tensors[2 + recorded.count :])
    needs = [*ctx.needs_input_grad[:2], *recorded.operand_needs]
    outputs = iter(GEMM_BACKWARD_OP(a, b, operands, saved, list(grads), list(recorded.scalars), *ctx.op_strings,
                                    needs))  # fmt: skip
    results = [next(outputs) if source == "op" else source for source in sources]
    graph = recorded.plan.graph
    for i, (name, operand) in enumerate(zip(recorded.spec["tensors"], operands)):
        if type(results[2 + i]) is int:  # a forwarded incoming gradient, as BackwardStep.of makes it contiguous
            results[2 + i] = to_operand_shape(grads[results[2 + i]].contiguous(), operand, graph.input_node(name).kind)
    da, db, *operand_grads = results
    return da, db, operand_grads, grad_slot(recorded.scalars), None, None


def dense_backward(ctx, grads, kernels_type: type[DenseKernels] | None = None) -> tuple[tuple, Any, Any]:
    """The op's backward: its gradients (in the op's argument order), the
    :class:`~epicute.gemm.autograd.BackwardStep` and the kernels object (``kernels_type``, default
    :class:`DenseKernels`) that ran it (both None where no differentiable output got a gradient)."""
    step = BackwardStep.of(ctx, grads, "epicute.gemm", SCALE_NAMES)
    if step is None:
        return (None, None, [None] * ctx.call.count, grad_slot(ctx.call.scalars), None, None), None, None
    a, b = step.inputs
    kernels = (kernels_type or DenseKernels)(a, b, step.gated, step.loaders)
    da, db, by_operand = step.run(kernels, tuple(ctx.needs_input_grad[:2]), saved_dtype(a.dtype))
    return (da, db, step.operand_grads(by_operand), grad_slot(ctx.call.scalars), None, None), step, kernels


class DenseKernels:
    """:class:`~epicute.gemm.autograd.GradientKernels` of ``epicute.gemm``: ``a @ b`` (batched or not) and its
    fp8 scales/gated flag. Each GEMM is a call of the op, which runs eagerly as well as under AOTAutograd's trace
    of a compiled backward; :meth:`run_gemm` is where each goes (a repeat eager backward replays the launches its
    first one went through, :mod:`epicute.gemm.training`)."""

    #: A gradient's column or row sums are the whole output's: torch's reduction of it serves.
    TORCH_REDUCTIONS = True

    def __init__(self, a: torch.Tensor, b: torch.Tensor, gated: bool, scales: dict[str, Any]) -> None:
        self.a, self.b, self.gated, self.scales = a, b, gated, scales

    def gradient_pass(self, epilogue, recompute, out_dtypes, operands):
        if recompute:
            return results_by_name(self.run_gemm("pass", self.a, self.b, epilogue, out_dtypes, operands, self.gated,
                                          self.scales))  # fmt: skip
        # An elementwise pass: the epilogue over a zero accumulator (K = 0), which it does not read.
        zero_a, zero_b = self.zero_operands(out_dtypes[DACC])
        return results_by_name(self.run_gemm("pass", zero_a, zero_b, epilogue, out_dtypes, operands))

    def zero_operands(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A and B of the zero-K pass: ``(..., M, 0)`` and ``(..., 0, N)``, holding nothing."""
        a, b = self.a, self.b
        lead, m, n = a.shape[:-2], a.shape[-2], output_columns(b.shape[-1], self.gated)
        return a.new_zeros((*lead, m, 0), dtype=dtype), a.new_zeros((*lead, 0, n), dtype=dtype)

    def data_grad(self, dacc):
        return self.run_gemm("data", dacc, self.b.transpose(-1, -2))

    def weight_grad(self, dacc):
        if stored_transposed(self.b):  # b = weight.t(): dB computed as weight's (N, K) (no transposing copy after)
            return self.run_gemm("weight", dacc.transpose(-1, -2), self.a).transpose(-1, -2)
        return self.run_gemm("weight", self.a.transpose(-1, -2), dacc)

    def run_gemm(self, role: str, a, b, epilogue=None, out_dtypes=None, operands=None, gated=False, scales=None):
        """The backward's GEMM ``role``: ``"pass"`` (the gradient epilogue's), ``"data"`` or ``"weight"``."""
        return _gemm(a, b, epilogue, out_dtypes, operands, gated, scales)


def stored_transposed(b: torch.Tensor) -> bool:
    """Whether ``b`` ``(..., K, N)`` is the transposed view of a row-major ``(..., N, K)`` weight (``w.t()``, as
    ``F.linear``'s weight is passed): its gradient is then computed as ``(..., N, K)`` rows, the weight's own layout,
    which autograd accumulates into ``weight.grad`` as is, where a ``(K, N)`` result would be copied to match it."""
    return b.stride(-2) == 1 and b.stride(-1) != 1 and b.shape[-1] > 1


def _gemm(a, b, epilogue=None, out_dtypes=None, operands=None, gated=False, scales=None):
    """One GEMM of a backward: :func:`epicute.gemm` itself when eager (its cached path; differentiable again
    under ``create_graph=True``), the op while torch.compile traces the backward."""
    scales = scales or {}
    if runs_eagerly(a, b):
        from epicute.gemm.api import gemm

        return or_reference(gemm, a, b, epilogue=epilogue, out_dtypes=out_dtypes, gated=gated,
                            a_scale=scales.get("a_scale"), b_scale=scales.get("b_scale"),
                            **(operands or {}))  # fmt: skip
    return gemm_op_call(
        a, b, epilogue=epilogue, out=None, out_dtype=None, out_dtypes=out_dtypes, outs=None,
        a_scale=scales.get("a_scale"), b_scale=scales.get("b_scale"), backend="kernel", config=None,
        operands=operands or {}, gated=gated,
    )  # fmt: skip


def results_by_name(results) -> dict:
    """:func:`epicute.gemm`'s result as a dict by output name (D alone as ``{"D": D}``)."""
    return results if isinstance(results, dict) else {"D": results}


#: The op (defined by ``import epicute`` from the family's declaration, :mod:`epicute.families`), differentiable
#: by the backward :mod:`epicute.gemm.autograd` derives from its epilogue.
GEMM_OP = TorchOp("epicute::gemm", gemm_op, _gemm_fake, _backward, _setup_context,
                  traced_backward="epicute.gemm.training:GEMM_BACKWARD_OP")


def fake_operand_values(operands: list, scalars: list, spec: dict, not_scalars: tuple = ()) -> dict[str, Any]:
    """A fake implementation's keyword operands by name, pins applied. A 1-element tensor that no pin (and no
    name in ``not_scalars``) makes a tensor is read as a scalar: its value is irrelevant to shapes (and
    unreadable here)."""
    values: dict[str, Any] = dict(zip(spec["scalars"], scalars))
    for name, t in zip(spec["tensors"], operands):
        is_scalar = t.numel() == 1 and spec["pins"].get(name, "scalar") == "scalar" and name not in not_scalars
        values[name] = 0.0 if is_scalar else t
    for name, kind in spec["pins"].items():
        values[name] = PINS[kind](values[name])
    return values


def fake_lowered_graph(a: torch.Tensor, d_dtype: str, epi, specs: dict, spec: dict):
    """The epilogue's graph as the call lowers it (prepare's first half: D's dtype by the call's rule, every
    output's stored dtype), for a fake implementation's output metadata. Sizes are symbolic here and never
    planned, so the request's problem carries only the dtypes."""
    fp8 = a.dtype in FP8_TORCH_DTYPES
    request = GemmRequest(
        GemmProblem(0, 0, 0, 1, ir_dtype(a.dtype, "a"), d_dtype, *(("k", "k") if fp8 else ())),
        epi,
        tuple((s.name, s.kind, s.dtype) for s in specs.values()),
        d_explicit=bool(spec["out_dtype"] or "D" in spec["out_dtypes"]),
        out_dtypes=tuple(sorted(spec["out_dtypes"].items())),
    )  # fmt: skip
    return lower_epilogue(request).graph


@assume_constant_result
def _check_names_traced(fn: Callable, gated: bool) -> bool:
    """:func:`~epicute.runtime.checks.check_operand_names` of an epilogue, run once while dynamo traces."""
    from epicute.gemm.api import GEMM_KEYWORDS

    hook = gated_epilogue(fn) if gated else as_epilogue(fn)
    check_operand_names("epilogue", hook.name, hook.params, GEMM_KEYWORDS, "epicute.gemm")
    return True


class OpArguments(NamedTuple):
    """An ``epicute::gemm`` call's arguments beside ``a`` and ``b``, and the names of the outputs it returns."""

    tensors: list
    scalars: list
    epilogue: str
    spec: str
    outputs: tuple


def op_arguments(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    epilogue: Callable | None,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    out_dtypes: dict | None,
    outs: dict[str, torch.Tensor] | None,
    a_scale: Any,
    b_scale: Any,
    backend: str,
    config: dict | None,
    operands: dict[str, Any],
    gated: bool = False,
) -> OpArguments:
    """What :func:`epicute.gemm`'s arguments become as one call of the op (checked; dynamo-traceable)."""
    check_traced_backend(backend)
    backward = needs_backward(a, b, a_scale, b_scale, out, outs, operands)
    if epilogue is None and (operands or out_dtypes or outs):
        given = sorted(operands) or list(out_dtypes or outs)
        raise EpilogueError(f"operands/outputs {given} were given without an epilogue")
    if epilogue is not None and not runs_eagerly(a, b):  # an eager call's names are checked where it runs
        _check_names_traced(plain_fn(epilogue), gated)
    config = config_pins(config, GemmConfig)
    # Preallocated outputs: the op returns fresh ones in their dtypes, copied in by gemm_op_call.
    if out is not None and out_dtype is None:
        out_dtype = out.dtype
    out_dtypes = {**{name: t.dtype for name, t in (outs or {}).items()}, **(out_dtypes or {})}
    check_gated_call(gated, epilogue)
    register = register_gated_traced if gated else register_traced
    key, outputs = register(plain_fn(epilogue)) if epilogue is not None else ("", ("D",))
    # fp8 scales travel as operands under their parameter names (the op's real call passes them back).
    scales = {name: value for name, value in zip(SCALE_NAMES, (a_scale, b_scale)) if value is not None}
    tensor_names, tensors, scalar_names, scalars, pins = split_operands({**operands, **scales})
    spec = spec_text(
        tuple(tensor_names), tuple(scalar_names), tuple(pins), config,
        (("out_dtype", out_dtype), ("out_dtypes", tuple(sorted(out_dtypes.items()))), ("gated", gated),
         *((("backward", True),) if backward else ())),
    )  # fmt: skip
    return OpArguments(tensors, scalars, key, spec, outputs)


def gemm_op_call(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out: torch.Tensor | None,
    outs: dict[str, torch.Tensor] | None,
    **options: Any,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """:func:`epicute.gemm` as one ``epicute::gemm`` op (dynamo-traceable); ``options``: :func:`op_arguments`'."""
    args = op_arguments(a, b, out=out, outs=outs, **options)
    results = dict(zip(args.outputs, GEMM_OP(a, b, args.tensors, args.scalars, args.epilogue, args.spec)))
    for name, target in {**(outs or {}), **({"D": out} if out is not None else {})}.items():
        target.copy_(results[name])
        results[name] = target
    return op_results(args.outputs, results)


def op_results(outputs: tuple, results: dict) -> torch.Tensor | dict[str, torch.Tensor]:
    """:func:`epicute.gemm`'s return value from the op's outputs by name: D alone, or all of them."""
    return results["D"] if len(outputs) == 1 else results


def needs_backward(a, b, a_scale, b_scale, out, outs, operands: dict) -> bool:
    """Whether autograd records this call (grad mode on, and a, b or an epilogue operand requires grad); raises
    :class:`~epicute.errors.GradientError` for what has no gradient: fp8 inputs, scales, ``out=``/``outs=``."""
    if not torch.is_grad_enabled():
        return False
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):  # alone too: the output would have no grad_fn
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise GradientError(f"{name} requires grad: fp8 dequantization scales take no gradient; pass "
                                f"{name}.detach()")  # fmt: skip
    tensors = {"a": a, "b": b, **{f"operand {name!r}": value.value if isinstance(value, Pin) else value
                                  for name, value in operands.items()}}  # fmt: skip
    needs = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needs:
        return False
    fp8 = [name for name in ("a", "b") if tensors[name].dtype in FP8_TORCH_DTYPES and tensors[name].requires_grad]
    if fp8:
        raise GradientError(f"{fp8[0]} is an fp8 tensor that requires grad: fp8 GEMM inputs take no gradient "
                            f"(quantize from a tensor that does, and pass the fp8 one .detach()-ed)")  # fmt: skip
    if out is not None or outs:
        raise GradientError(
            f"{' and '.join(needs)} require grad, but out=/outs= were given: outputs written into preallocated "
            "tensors take no gradient (as torch's out= arguments); drop out/outs to train"
        )
    return True


__all__ = [
    "GEMM_OP", "DenseKernels", "OpArguments", "dense_backward", "forward_sources", "gemm_op", "gemm_op_call",
    "listed", "needs_backward", "op_arguments", "op_options", "op_repeat", "results_by_name", "stored_transposed",
]  # fmt: skip
