"""``torch.ops.epicute.grouped_gemm``: the grouped GEMM family's custom op (see :mod:`epicute.runtime.torch_ops`).

``torch.ops.epicute.grouped_gemm(a, b, offsets, operands, scalars, epilogue, spec) -> list[Tensor]`` runs
:func:`epicute.grouped_gemm`; under ``torch.compile`` :func:`epicute.grouped_gemm` turns into one call of it,
gated epilogues, gathered rows, fp8 scales and variable K included. ``a_index``, ``a_scale`` and ``b_scale``
travel among the operands under their parameter names. The fake implementation gives every output's
shape and dtype without reading the offsets; outputs are ``[D, *aux outputs]`` in the epilogue's order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from epicute.epilogue.dtypes import IR_TO_TORCH, ir_dtype
from epicute.epilogue.gated import gated_epilogue, output_columns
from epicute.epilogue.graph import REDUCTIONS
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import ConfigError, EpilogueError
from epicute.gemm.config import GemmConfig
from epicute.gemm.torch_op import fake_lowered_graph, fake_operand_values
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

    parsed = json.loads(spec)
    result = grouped_gemm(
        a, b, offsets,
        epilogue=registered_epilogue(epilogue) if epilogue else None,
        out_dtype=IR_TO_TORCH[parsed["out_dtype"]] if parsed["out_dtype"] else None,
        out_dtypes={k: IR_TO_TORCH[v] for k, v in parsed["out_dtypes"].items()} or None,
        config=config_of(parsed),
        gated=parsed["gated"],
        **operand_values(operands, scalars, parsed),
    )  # fmt: skip
    if isinstance(result, torch.Tensor):
        return [result]
    return [result[name] for name in registered_outputs(epilogue)]


def _grouped_gemm_fake(a, b, offsets, operands, scalars, epilogue, spec) -> list[torch.Tensor]:
    spec = json.loads(spec)
    values = fake_operand_values(operands, scalars, spec, not_scalars=LOADER_ARGS)
    a_index = values.pop("a_index", None)
    for name in LOADER_ARGS:
        values.pop(name, None)
    groups, n = offsets.shape[0], b.shape[-1]
    d_n = output_columns(n, spec["gated"])
    if b.dim() == 2:  # variable K: one (M, N) per group
        rows, batch, shape = a.shape[0], groups, (groups, a.shape[0], d_n)
    else:
        rows = a.shape[0] if a_index is None else a_index.shape[0]
        batch, shape = groups, (rows, d_n)
    fp8 = a.dtype in FP8_TORCH_DTYPES
    default_d = "bf16" if fp8 else ir_dtype(a.dtype, "a")  # as check_grouped_args settles it
    d_dtype = spec["out_dtype"] or spec["out_dtypes"].get("D") or default_d
    if not epilogue:
        return [a.new_empty(shape, dtype=IR_TO_TORCH[d_dtype])]
    epi = registered_epilogue(epilogue)
    graph = fake_lowered_graph(a, d_dtype, epi, epi.operands(values, rows, d_n, batch), spec)
    stored = dict(graph.output_dtypes)
    variable_k = b.dim() == 2
    # Reductions as run_grouped returns them (by the kind of vector each gives): one value per row, per column of
    # each group, or per group (variable K: the dense batched GEMM's, one amax).
    reduced = {"col": (groups, rows) if variable_k else (rows,), "row": (groups, d_n),
               "scalar": () if variable_k else (groups,)}  # fmt: skip
    outputs = []
    for name, node_id in graph.outputs:
        op = graph.node(node_id).op
        if op == "group_scales":
            raise EpilogueError("quantize_groups in a grouped GEMM's epilogue is not supported yet")
        if op in REDUCTIONS:
            outputs.append(a.new_empty(reduced[REDUCTIONS[op][0]], dtype=torch.float32))
        else:
            outputs.append(a.new_empty(shape, dtype=IR_TO_TORCH[stored[name]]))
    return outputs


#: The op (defined by ``import epicute`` from the family's declaration, :mod:`epicute.families`).
GROUPED_GEMM_OP = TorchOp("epicute::grouped_gemm", grouped_gemm_op, _grouped_gemm_fake)


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
    if backend != "kernel":
        raise ConfigError(f"backend={backend!r} cannot be compiled with torch.compile; use backend='kernel'")
    if check_offsets:
        raise ConfigError("check_offsets=True reads the offsets on the host, a sync torch.compile cannot trace; "
                          "check them outside the compiled region")  # fmt: skip
    # The op has no backward yet: refuse inputs that need one, as the eager call does.
    check_no_grad("epicute.grouped_gemm", ("a", a), ("b", b), ("out", out), ("a_scale", loader_args.get("a_scale")),
                  ("b_scale", loader_args.get("b_scale")), operands=operands)  # fmt: skip
    if epilogue is None and (operands or out_dtypes or gated):
        given = sorted(operands) or list(out_dtypes or ["gated"])
        raise EpilogueError(f"operands/outputs {given} were given without an epilogue")
    if epilogue is not None:
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
        (("out_dtype", out_dtype), ("out_dtypes", tuple(sorted((out_dtypes or {}).items()))), ("gated", gated)),
    )  # fmt: skip
    results = dict(zip(outputs, torch.ops.epicute.grouped_gemm(a, b, offsets, tensors, scalars, key, spec)))
    if out is not None:
        out.copy_(results["D"])
        results["D"] = out
    return results["D"] if len(outputs) == 1 else results


__all__ = ["GROUPED_GEMM_OP", "grouped_gemm_op", "grouped_gemm_op_call"]
