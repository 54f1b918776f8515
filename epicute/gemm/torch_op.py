"""``torch.ops.epicute.gemm``: the GEMM family's custom op (see :mod:`epicute.runtime.torch_ops`).

``torch.ops.epicute.gemm(a, b, operands, scalars, epilogue, spec) -> list[Tensor]`` runs
:func:`epicute.gemm`; under ``torch.compile`` :func:`epicute.gemm` turns into one call of it.
Its fake implementation gives every output's shape, dtype and strides without running
anything (D's dtype by ``prepare``'s first half, as the call settles it); its real one is
the eager path. Outputs are ``[D, *aux outputs]`` in the epilogue's output order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from epicute.epilogue.dtypes import IR_TO_TORCH, ir_dtype
from epicute.epilogue.gated import check_gated_call, gated_epilogue, output_columns
from epicute.epilogue.graph import REDUCTIONS
from epicute.epilogue.group_quant import GROUP_N
from epicute.epilogue.operands import PINS
from epicute.epilogue.scales import SCALE_NAMES, fp8_scaling
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import ConfigError, EpilogueError
from epicute.gemm.config import GemmConfig, GemmProblem
from epicute.gemm.prepare import GemmRequest, lower_epilogue
from epicute.gemm.validate import FP8_TORCH_DTYPES
from epicute.runtime.checks import check_no_grad, check_operand_names, config_pins
from epicute.runtime.torch_ops import (
    TorchOp,
    assume_constant_result,
    config_of,
    operand_values,
    plain_fn,
    register_gated_traced,
    register_traced,
    registered_epilogue,
    registered_outputs,
    spec_text,
    split_operands,
)


def _gemm_kwargs(operands: list[torch.Tensor], scalars: list[float], epilogue: str, spec: dict) -> dict:
    """The keyword arguments of the :func:`epicute.gemm` call the op stands for (an fp8 call's scales
    travel among the operands, under their parameter names)."""
    return {
        "epilogue": registered_epilogue(epilogue) if epilogue else None,
        "out_dtype": IR_TO_TORCH[spec["out_dtype"]] if spec["out_dtype"] else None,
        "out_dtypes": {k: IR_TO_TORCH[v] for k, v in spec["out_dtypes"].items()} or None,
        "config": config_of(spec),
        "gated": spec.get("gated", False),
        **operand_values(operands, scalars, spec),
    }


def gemm_op(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], scalars: list[float], epilogue: str, spec: str
) -> list[torch.Tensor]:
    """``epicute.gemm(a, b, ...)`` as an op: ``[D, *aux outputs]`` (see the module docstring)."""
    from epicute.gemm.api import gemm

    result = gemm(a, b, **_gemm_kwargs(operands, scalars, epilogue, json.loads(spec)))
    if isinstance(result, torch.Tensor):
        return [result]
    return [result[name] for name in registered_outputs(epilogue)]


def _gemm_fake(a, b, operands, scalars, epilogue, spec) -> list[torch.Tensor]:
    spec = json.loads(spec)
    l_dims = (a.shape[0],) if a.dim() == 3 else ()
    m, n = a.shape[-2], output_columns(b.shape[-1], spec.get("gated", False))
    fp8 = a.dtype in FP8_TORCH_DTYPES
    default_d = "bf16" if fp8 else ir_dtype(a.dtype, "a")  # as check_gemm_args settles it
    d_dtype = IR_TO_TORCH[spec["out_dtype"] or spec["out_dtypes"].get("D") or default_d]
    if not epilogue and not fp8:
        return [a.new_empty((*l_dims, m, n), dtype=d_dtype)]
    epi = registered_epilogue(epilogue) if epilogue else None
    values = fake_operand_values(operands, scalars, spec)
    l = a.shape[0] if a.dim() == 3 else 1
    if fp8:  # the scales: operands of the scaled epilogue, or the mainloop's (blockwise), as epicute.gemm takes them
        scales = [values.pop(name, None) for name in SCALE_NAMES]
        epi, values = fp8_scaling(*scales, m, n, a.shape[-1], l, a.dim() == 3).apply(epi, values)
        if epi is None:
            return [a.new_empty((*l_dims, m, n), dtype=d_dtype)]
    graph = fake_lowered_graph(a, ir_dtype(d_dtype, "out_dtype"), epi, epi.operands(values, m, n, l), spec)
    stored = dict(graph.output_dtypes)
    shapes = {"col": (*l_dims, m), "row": (*l_dims, n), "scalar": ()}
    outputs = []
    for name, node_id in graph.outputs:
        op = graph.node(node_id).op
        if op in REDUCTIONS:
            outputs.append(a.new_empty(shapes[REDUCTIONS[op][0]], dtype=torch.float32))
        elif op == "group_scales":  # M-major (L, M, groups), as the kernel returns them
            groups = -(-n // GROUP_N)
            outputs.append(a.new_empty((*l_dims, groups, m), dtype=torch.float32).transpose(-1, -2))
        else:
            outputs.append(a.new_empty((*l_dims, m, n), dtype=IR_TO_TORCH[stored[name]]))
    return outputs


#: The op (defined by ``import epicute`` from the family's declaration, :mod:`epicute.families`).
GEMM_OP = TorchOp("epicute::gemm", gemm_op, _gemm_fake)


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


def gemm_op_call(
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
) -> torch.Tensor | dict[str, torch.Tensor]:
    """:func:`epicute.gemm` while ``torch.compile`` traces it: one ``epicute::gemm`` op (dynamo-traceable)."""
    if backend != "kernel":
        raise ConfigError(f"backend={backend!r} cannot be compiled with torch.compile; use backend='kernel'")
    # The op has no backward yet: refuse inputs that need one, as the eager call does.
    check_no_grad("epicute.gemm", ("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale), ("out", out),
                  *((f"outs[{n!r}]", t) for n, t in (outs or {}).items()), operands=operands)  # fmt: skip
    if epilogue is None and (operands or out_dtypes or outs):
        given = sorted(operands) or list(out_dtypes or outs)
        raise EpilogueError(f"operands/outputs {given} were given without an epilogue")
    if epilogue is not None:
        _check_names_traced(plain_fn(epilogue), gated)
    config = config_pins(config, GemmConfig)
    # Preallocated outputs: the op returns fresh ones in their dtypes, copied in below.
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
        (("out_dtype", out_dtype), ("out_dtypes", tuple(sorted(out_dtypes.items()))), ("gated", gated)),
    )  # fmt: skip
    results = torch.ops.epicute.gemm(a, b, tensors, scalars, key, spec)
    results = dict(zip(outputs, results))
    for name, target in {**(outs or {}), **({"D": out} if out is not None else {})}.items():
        target.copy_(results[name])
        results[name] = target
    return results["D"] if len(outputs) == 1 else results


__all__ = ["GEMM_OP", "gemm_op", "gemm_op_call"]
