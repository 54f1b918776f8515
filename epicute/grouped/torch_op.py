"""``torch.ops.epicute.grouped_gemm``: the grouped GEMM family's custom op (see :mod:`epicute.runtime.torch_ops`).

``torch.ops.epicute.grouped_gemm(a, b, offsets, operands, scalars, epilogue, spec) -> list[Tensor]`` runs
:func:`epicute.grouped_gemm`; under ``torch.compile`` :func:`epicute.grouped_gemm` turns into one call of it,
gated epilogues, gathered rows, fp8 scales and variable K included. ``a_index``, ``a_scale`` and ``b_scale``
travel among the operands under their parameter names. The fake implementation gives every output's
shape and dtype without reading the offsets; outputs are ``[D, *aux outputs]`` in the epilogue's order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from epicute.epilogue.dtypes import IR_TO_TORCH, ir_dtype
from epicute.epilogue.gated import gated_epilogue, output_columns, stored_columns
from epicute.epilogue.graph import REDUCTIONS, UP_OUTPUT
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import ConfigError, EpilogueError, GradientError
from epicute.gemm.autograd import (
    BackwardStep,
    OpCall,
    op_call,
    saved_dtype,
    setup_backward,
)
from epicute.gemm.config import GemmConfig
from epicute.gemm.torch_op import (
    fake_lowered_graph,
    fake_operand_values,
    needs_backward,
    op_options,
    stored_transposed,
)
from epicute.gemm.validate import FP8_TORCH_DTYPES
from epicute.runtime.backend import check_traced_backend
from epicute.runtime.checks import check_operand_names, config_pins
from epicute.runtime.compile import or_reference
from epicute.runtime.torch_ops import (
    TorchOp,
    assume_constant_result,
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

#: Keyword arguments of :func:`epicute.grouped_gemm` that travel among the op's operands.
LOADER_ARGS = ("a_index", "a_scale", "b_scale")


def grouped_gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: str,
    spec: str,
) -> list[torch.Tensor]:
    """``epicute.grouped_gemm(a, b, offsets, ...)`` as an op: ``[D, *aux outputs]`` (see the module docstring)."""
    from epicute.grouped.api import grouped_gemm

    call = grouped_call(a, b, offsets, operands, scalars, epilogue, spec)
    result = or_reference(grouped_gemm, a, b, offsets, **call.options, **operand_values(operands, scalars, call.spec))
    if isinstance(result, torch.Tensor):
        return [result]
    return [result[name] for name in call.outputs]


def grouped_call(a, b, offsets, operands, scalars, epilogue: str, spec: str) -> OpCall:
    """The op call's :class:`~epicute.gemm.autograd.OpCall` (decided once per signature)."""

    def options(parsed: dict) -> dict:
        return {"epilogue": registered_epilogue(epilogue) if epilogue else None, **op_options(parsed)}

    graph = lambda parsed: _user_graph(a, b, offsets, operands, scalars, epilogue, parsed)[0]  # noqa: E731
    return op_call("grouped_gemm", (a, b, offsets, *operands), epilogue, spec, options, graph)


def _user_graph(a, b, offsets, operands, scalars, epilogue: str, spec: dict):
    """The graph of the call's own epilogue with every output's stored dtype settled, and the call's rows; the
    graph is None without an epilogue. Tensor values are never read."""
    values = fake_operand_values(operands, scalars, spec, not_scalars=LOADER_ARGS)
    a_index = values.pop("a_index", None)
    for name in LOADER_ARGS:
        values.pop(name, None)
    groups, d_n = offsets.shape[0], output_columns(b.shape[-1], spec["gated"])
    # Variable K (a 2-D b) has one (M, N) per group; gathered rows have a_index's.
    rows = a.shape[0] if b.dim() == 2 or a_index is None else a_index.shape[0]
    d_dtype = _d_dtype(a, spec)
    if not epilogue:
        return None, rows, d_n, d_dtype
    epi = registered_epilogue(epilogue)
    return fake_lowered_graph(a, d_dtype, epi, epi.operands(values, rows, d_n, groups), spec), rows, d_n, d_dtype


def _d_dtype(a: torch.Tensor, spec: dict) -> str:
    default_d = "bf16" if a.dtype in FP8_TORCH_DTYPES else ir_dtype(a.dtype, "a")  # as check_grouped_args settles it
    return spec["out_dtype"] or spec["out_dtypes"].get("D") or default_d


def _grouped_gemm_fake(a, b, offsets, operands, scalars, epilogue, spec) -> list[torch.Tensor]:
    call = grouped_call(a, b, offsets, operands, scalars, epilogue, spec)
    graph, rows, d_n, d_dtype = _user_graph(a, b, offsets, operands, scalars, epilogue, call.spec)
    groups = offsets.shape[0]
    shape = (groups, a.shape[0], d_n) if b.dim() == 2 else (rows, d_n)
    saved = [a.new_empty(shape, dtype=saved_dtype(a.dtype)) for _ in (call.plan.saved if call.plan else ())]
    if graph is None:
        return [a.new_empty(shape, dtype=IR_TO_TORCH[d_dtype])]
    return _epilogue_fakes(a, b, graph, groups, rows, shape) + saved


def _epilogue_fakes(a, b, graph, groups: int, rows, shape) -> list[torch.Tensor]:
    """The epilogue's outputs as fakes, in its order."""
    d_n = shape[-1]
    stored = dict(graph.output_dtypes)
    variable_k = b.dim() == 2
    # Reductions as run_grouped returns them (by the kind of vector each gives): one value per row, per column of
    # each group, or per group (variable K: the dense batched GEMM's, one amax).
    reduced = {"col": (groups, rows) if variable_k else (rows,), "row": (groups, d_n),
               "scalar": () if variable_k else (groups,)}  # fmt: skip
    outputs = []
    for name, node_id in graph.outputs:
        op = graph.node(node_id).op
        if graph.paired and name == UP_OUTPUT:  # inside D, which stores both halves
            continue
        if op == "group_scales":
            raise EpilogueError("quantize_groups in a grouped GEMM's epilogue is not supported yet")
        if op in REDUCTIONS:
            outputs.append(a.new_empty(reduced[REDUCTIONS[op][0]], dtype=torch.float32))
        else:
            width = stored_columns(d_n, graph.paired) if name == "D" else d_n
            outputs.append(a.new_empty((*shape[:-1], width), dtype=IR_TO_TORCH[stored[name]]))
    return outputs


def _setup_context(ctx, inputs, output) -> None:
    a, b, offsets, operands, scalars, epilogue, spec = inputs
    call = grouped_call(a, b, offsets, operands, scalars, epilogue, spec)
    setup_backward(ctx, call.plan, call.names, output, (a, b, offsets), operands, scalars, call.spec)


def _backward(ctx, grads):
    step = BackwardStep.of(ctx, grads, "epicute.grouped_gemm", LOADER_ARGS)
    if step is None:
        return None, None, None, [None] * ctx.call.count, grad_slot(ctx.call.scalars), None, None
    a, b, offsets = step.inputs
    kernels = GroupedKernels(a, b, offsets, step.gated, step.loaders)
    da, db, by_operand = step.run(kernels, tuple(ctx.needs_input_grad[:2]), saved_dtype(a.dtype))
    return da, db, None, step.operand_grads(by_operand), grad_slot(ctx.call.scalars), None, None


class GroupedKernels:
    """:class:`~epicute.gemm.autograd.GradientKernels` of ``epicute.grouped_gemm`` over rows (gathered or not):
    the gradient epilogue per group, ``da`` a grouped GEMM with the transposed weights (scattered back to the
    tokens by ``a_index``), ``db`` the variable-K grouped GEMM. Each is a call of the op (eager, or traced)."""

    #: Column reductions are per group (a per-expert bias's gradient): the kernel's pass computes them.
    TORCH_REDUCTIONS = False

    def __init__(self, a, b, offsets, gated: bool, loaders: dict) -> None:
        self.a, self.b, self.offsets, self.gated, self.loaders = a, b, offsets, gated, loaders

    def gradient_pass(self, epilogue, recompute, out_dtypes, operands):
        a, b, offsets = self.a, self.b, self.offsets
        if recompute:
            results = _grouped(a, b, offsets, epilogue, out_dtypes, operands, self.gated, self.loaders)
        else:  # the epilogue over a zero accumulator (K = 0), which it does not read
            index = self.loaders.get("a_index")
            rows, dtype = a.shape[0] if index is None else index.shape[0], out_dtypes["D"]
            zero_b = a.new_zeros((b.shape[0], 0, output_columns(b.shape[-1], self.gated)), dtype=dtype)
            results = _grouped(a.new_zeros((rows, 0), dtype=dtype), zero_b, offsets, epilogue, out_dtypes, operands)
        return results if isinstance(results, dict) else {"D": results}

    def data_grad(self, dacc):
        rows = _grouped(dacc, self.b.transpose(-2, -1), self.offsets)
        index = self.loaders.get("a_index")
        if index is None:
            return rows
        return sum_rows_by_index(rows, index, self.a.shape[0]).to(self.a.dtype)

    def weight_grad(self, dacc):
        index = self.loaders.get("a_index")
        rows = (self.a if index is None else self.a[index.long()]).contiguous()
        # variable K: x[rows of g].T @ dacc[rows of g], or its transpose in the weight's own layout
        if stored_transposed(self.b):
            return _grouped(dacc.t(), rows, self.offsets).transpose(-2, -1)
        return _grouped(rows.t(), dacc, self.offsets)


def sum_rows_by_index(rows: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """``out[i] = sum of rows[j] with index[j] == i`` (fp32, ``(count, N)``), deterministic: each output row adds its
    rows in their own order, one after another (a stable sort by index, then a segmented sum), so gradients are the
    same bits run to run, eager or compiled (an accumulating scatter lowers to atomics under torch.compile). No
    device sync: CUDA-graph safe."""
    index = index.long()
    order = torch.argsort(index, stable=True)
    lengths = torch.zeros(count, dtype=torch.long, device=index.device).scatter_add_(0, index, torch.ones_like(index))
    return torch.segment_reduce(rows[order].float(), "sum", lengths=lengths, axis=0, unsafe=True)


def _grouped(a, b, offsets, epilogue=None, out_dtypes=None, operands=None, gated=False, loaders=None):
    """One grouped GEMM of a backward: :func:`epicute.grouped_gemm` itself when eager, the op while torch.compile
    traces the backward."""
    if runs_eagerly(a, b):
        from epicute.grouped.api import grouped_gemm

        return or_reference(grouped_gemm, a, b, offsets, epilogue=epilogue, out_dtypes=out_dtypes, gated=gated,
                            **(loaders or {}), **(operands or {}))  # fmt: skip
    return grouped_gemm_op_call(
        a, b, offsets, epilogue=epilogue, out=None, out_dtype=None, out_dtypes=out_dtypes, backend="kernel",
        config=None, check_offsets=False, gated=gated, loader_args=loaders or {}, operands=operands or {},
    )  # fmt: skip


#: The op (defined by ``import epicute`` from the family's declaration, :mod:`epicute.families`), differentiable
#: by the backward :mod:`epicute.gemm.autograd` derives from its epilogue.
GROUPED_GEMM_OP = TorchOp("epicute::grouped_gemm", grouped_gemm_op, _grouped_gemm_fake, _backward, _setup_context)


@assume_constant_result
def _check_names_traced(fn: Callable, gated: bool) -> bool:
    """:func:`~epicute.runtime.checks.check_operand_names` of an epilogue, run once while dynamo traces."""
    from epicute.grouped.api import GROUPED_KEYWORDS

    hook = gated_epilogue(fn) if gated else as_epilogue(fn)
    check_operand_names("epilogue", hook.name, hook.params, GROUPED_KEYWORDS, "epicute.grouped_gemm")
    return True


def grouped_gemm_op_call(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    *,
    epilogue: Callable | None,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    out_dtypes: dict | None,
    backend: str,
    config: dict | None,
    check_offsets: bool,
    gated: bool,
    loader_args: dict[str, Any],
    operands: dict[str, Any],
) -> torch.Tensor | dict[str, torch.Tensor]:
    """:func:`epicute.grouped_gemm` while ``torch.compile`` traces it: one ``epicute::grouped_gemm`` op."""
    check_traced_backend(backend)
    if check_offsets:
        raise ConfigError("check_offsets=True reads the offsets on the host, a sync torch.compile cannot trace; "
                          "check them outside the compiled region")  # fmt: skip
    backward = needs_grouped_backward(a, b, out, loader_args, operands)
    if epilogue is None and (operands or out_dtypes or gated):
        given = sorted(operands) or list(out_dtypes or ["gated"])
        raise EpilogueError(f"operands/outputs {given} were given without an epilogue")
    if epilogue is not None and not runs_eagerly(a, b):  # an eager call's names are checked where it runs
        _check_names_traced(plain_fn(epilogue), gated)
    config = config_pins(config, GemmConfig)
    if out is not None and out_dtype is None:  # the op returns a fresh D in out's dtype, copied in below
        out_dtype = out.dtype
    if epilogue is None:
        key, outputs = "", ("D",)
    else:
        key, outputs = (register_gated_traced if gated else register_traced)(plain_fn(epilogue))
    loaders = {name: value for name, value in loader_args.items() if value is not None}
    tensor_names, tensors, scalar_names, scalars, pins = split_operands({**operands, **loaders})
    spec = spec_text(
        tuple(tensor_names), tuple(scalar_names), tuple(pins), config,
        (("out_dtype", out_dtype), ("out_dtypes", tuple(sorted((out_dtypes or {}).items()))), ("gated", gated),
         *((("backward", True),) if backward else ())),
    )  # fmt: skip
    results = dict(zip(outputs, GROUPED_GEMM_OP(a, b, offsets, tensors, scalars, key, spec)))
    if out is not None:
        out.copy_(results["D"])
        results["D"] = out
    return results["D"] if len(outputs) == 1 else results


def needs_grouped_backward(a, b, out, loader_args: dict, operands: dict) -> bool:
    """Whether autograd records this call (:func:`epicute.gemm.torch_op.needs_backward`'s rules); a variable-K call
    (a weight gradient itself) takes none."""
    if not needs_backward(a, b, loader_args.get("a_scale"), loader_args.get("b_scale"), out, None, operands):
        return False
    if b.dim() == 2:
        raise GradientError("a variable-K grouped GEMM (a 2-D b: weight gradients) records no backward; call it "
                            "under torch.no_grad() or pass .detach()-ed tensors")  # fmt: skip
    return True


__all__ = ["GROUPED_GEMM_OP", "GroupedKernels", "grouped_gemm_op", "grouped_gemm_op_call", "needs_grouped_backward"]
