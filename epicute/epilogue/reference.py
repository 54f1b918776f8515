"""The CPU reference: what an epilogue graph computes, spelled out in torch.

This interpreter defines the semantics the kernel must reproduce, and is what
GPU results are checked against; each elementwise op's torch formula is its
``reference`` in :mod:`epicute.epilogue.optable`. Values live in ``(L, M, N)``
broadcasting shapes: a tile ``(L, M, N)``, a row ``(L, 1, N)``, a col
``(L, M, 1)``, a scalar ``()``. Everything computes in ``compute_dtype`` (fp32,
like the kernel's registers); scalars and constants are rounded to fp32 first,
as the kernel receives them, and ``cast``/``quantize`` round to their dtype and
go on in the compute dtype. Conversions to fp8 saturate at the format's largest
finite value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from epicute.epilogue import optable
from epicute.epilogue.dtypes import ir_dtype, round_to
from epicute.epilogue.gated import gated_epilogue, interleave_gate_up, output_columns, split_gate_up
from epicute.epilogue.graph import REDUCTION_IDENTITY, REDUCTIONS, UP_OUTPUT, Graph, Node
from epicute.epilogue.group_quant import group_quantize
from epicute.epilogue.operands import OperandSpec
from epicute.epilogue.tracer import Epilogue, as_epilogue
from epicute.errors import EpilogueError, ShapeError

Tensor = torch.Tensor


def _fp32(value: float | Tensor, compute: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):  # a 0-d tensor scalar that trains: rounded as the kernel reads it, differentiably
        return value.to(device=device, dtype=torch.float32).to(compute)
    return torch.tensor(value, dtype=torch.float32, device=device).to(compute)


def _input(
    node: Node, spec: OperandSpec, lmn: tuple[int, int, int], compute: torch.dtype, device: torch.device
) -> Tensor:
    name = spec.name
    if spec.kind != node.kind:
        raise EpilogueError(f"operand {name!r} is a {spec.kind} operand, but the graph was traced with it {node.kind}")
    if spec.kind == "scalar":
        return _fp32(spec.value, compute, device)
    l, m, n = lmn
    expected = {"row": (l, n), "col": (l, m), "tile": (l, m, n)}[spec.kind]
    if tuple(spec.value.shape) != expected:
        raise EpilogueError(
            f"operand {name!r} has canonical shape {tuple(spec.value.shape)}, but the accumulator (L, M, N) = "
            f"{lmn} needs {expected}: resolve operands against the same problem"
        )
    value = spec.value.to(device=device, dtype=compute)
    return value.unsqueeze(1) if spec.kind == "row" else value.unsqueeze(2) if spec.kind == "col" else value


def reduce_tile(x: Tensor, op: str) -> Tensor:
    """Reduction ``op`` of a tile ``x`` (``(..., M, N)``): row reductions over N, column ones over M, ``amax`` over
    everything, accumulated in at least fp32 (sums of a 16-bit tile without a 32-bit copy of it), as the kernel's
    reductions are."""
    combine = REDUCTIONS[op][1]
    x = x.abs() if combine == "amax" else x
    dims = (-1,) if op.startswith("row_") else (-2,) if op.startswith("col_") else tuple(range(x.dim()))
    wide = torch.promote_types(x.dtype, torch.float32)
    if x.numel() == 0:  # torch's max refuses empty extents; the identity is the answer
        shape = [s for i, s in enumerate(x.shape) if i - x.dim() not in dims and i not in dims]
        return x.new_full(shape, REDUCTION_IDENTITY[combine], dtype=wide)
    return x.sum(dim=dims, dtype=wide) if combine == "sum" else x.amax(dim=dims).to(wide)


def _reduce(x: Tensor, op: str, lmn: tuple[int, int, int]) -> Tensor:
    return reduce_tile(x.expand(*lmn), op)


def _apply(node: Node, a: list[Tensor], lmn: tuple[int, int, int]) -> Tensor:
    if node.op in REDUCTIONS:
        return _reduce(a[0], node.op, lmn)
    op = optable.find(node.op)
    if op is None:
        raise EpilogueError(f"%{node.id}: unknown op {node.op!r}")
    return op.reference(*a, **dict(node.attrs))


def evaluate(
    graph: Graph,
    acc: Tensor,
    operands: Mapping[str, OperandSpec],
    out_dtypes: Mapping[str, torch.dtype] | None = None,
    compute_dtype: torch.dtype = torch.float32,
    index_values: Mapping[str, Tensor] | None = None,
    up: Tensor | None = None,
) -> dict[str, Tensor]:
    """Every output of ``graph`` for the accumulator ``acc`` ``(L, M, N)``, on ``acc``'s device.

    ``index_values`` gives each ``index`` leaf (score modifiers) as a tensor that
    broadcasts against ``(L, M, N)``; ``up`` a gated graph's ``acc_up`` leaf (``acc`` is then
    the gate: :func:`epicute.epilogue.gated.split_gate_up`).

    Tile outputs come back ``(L, M, N)`` in their stored dtype (the graph's, or
    ``out_dtypes[name]`` if given), row_* reductions ``(L, M)`` fp32, col_*
    ``(L, N)`` fp32, ``amax`` a 0-d fp32 over all batches.
    """
    if acc.dim() != 3:
        raise ShapeError(f"acc has shape {tuple(acc.shape)}; evaluate needs (L, M, N)")
    lmn = (acc.shape[0], acc.shape[1], acc.shape[2])
    device = acc.device
    values: list[Tensor] = []
    group_scales: dict[int, Tensor] = {}  # group_quant node -> its scales
    for node in graph.nodes:
        if node.op == "group_quant":
            q, group_scales[node.id] = group_quantize(values[node.args[0]].expand(*lmn), node.attr("dtype"),
                                                      node.attr("ue8m0"))  # fmt: skip
            values.append(q)
        elif node.op == "group_scales":
            values.append(group_scales[node.args[0]])
        elif node.op == "acc":
            values.append(acc.to(compute_dtype))
        elif node.op == "acc_up":
            if up is None or up.shape != acc.shape:
                raise EpilogueError("evaluate: a gated graph needs up=, the up accumulator, shaped like acc")
            values.append(up.to(compute_dtype))
        elif node.op == "input":
            name = node.attr("name")
            if name not in operands:
                raise EpilogueError(f"evaluate: no operand {name!r} (have {sorted(operands)})")
            values.append(_input(node, operands[name], lmn, compute_dtype, device))
        elif node.op == "const":
            values.append(_fp32(node.attr("value"), compute_dtype, device))
        elif node.op == "index":
            name = node.attr("name")
            if index_values is None or name not in index_values:
                raise EpilogueError(f"evaluate: the graph reads index {name!r}; pass index_values={{{name!r}: ...}}")
            values.append(index_values[name].to(device=device, dtype=compute_dtype))
        else:
            values.append(_apply(node, [values[i] for i in node.args], lmn))
    stored = dict(graph.output_dtypes)
    stored.update({k: ir_dtype(v, f"out_dtypes[{k!r}]") for k, v in (out_dtypes or {}).items()})
    results: dict[str, Tensor] = {}
    for name, node_id in graph.outputs:
        value = values[node_id]
        if graph.node(node_id).op in (*REDUCTIONS, "group_scales"):
            results[name] = value.to(torch.float32)
        else:
            results[name] = round_to(value.expand(*lmn), stored[name])
    if graph.paired:  # D stores D_up beside it, blocks interleaved (Graph.paired)
        results["D"] = interleave_gate_up(results["D"], results.pop(UP_OUTPUT), dim=-1)
    return results


def _batched(t: Tensor, name: str, dims: str) -> Tensor:
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() == 3:
        return t
    raise ShapeError(f"{name} has shape {tuple(t.shape)}; expected 2-D {dims} or batched 3-D (L, {dims[1:]}")


def training_scalars(specs: dict[str, OperandSpec], operands: Mapping[str, Any]) -> dict[str, OperandSpec]:
    """``specs`` with each tensor scalar that requires grad as itself: a scalar spec holds the number the kernel
    reads, and the reference backend's result must be differentiable in a scalar like in every other operand."""
    trained = {name: value for name, value in operands.items() if isinstance(value, Tensor) and value.requires_grad}
    return {name: replace(spec, value=trained[name].reshape(())) if spec.kind == "scalar" and name in trained
            else spec for name, spec in specs.items()}  # fmt: skip


def reference_gemm(
    a: Tensor,
    b: Tensor,
    epilogue: Epilogue | Callable,
    operands: Mapping[str, Any] | None = None,
    out_dtypes: Mapping[str, torch.dtype] | None = None,
    compute_dtype: torch.dtype = torch.float32,
    gated: bool = False,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """``epilogue(a @ b, **operands)`` on the CPU (or ``device``): what ``epicute.gemm`` with this epilogue must
    return.

    ``a`` is ``(M, K)``/``(L, M, K)`` and ``b`` ``(K, N)``/``(L, K, N)`` on any
    device; the product accumulates in ``compute_dtype``. D's dtype defaults to
    ``a``'s (as in :func:`epicute.gemm`). With 2-D inputs the outputs drop L.
    ``gated``: ``epilogue(gate, up, **operands)`` over B's interleaved gate and up
    columns (:mod:`epicute.epilogue.gated`); D has half of B's columns.
    """
    epi = gated_epilogue(epilogue) if gated else as_epilogue(epilogue)
    a3, b3 = _batched(a, "a", "(M, K)"), _batched(b, "b", "(K, N)")
    if a.dim() != b.dim() or a3.shape[0] != b3.shape[0] or a3.shape[2] != b3.shape[1]:
        raise ShapeError(f"a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply: need (L, M, K) @ (L, K, N)")
    l, m, n = a3.shape[0], a3.shape[1], output_columns(b3.shape[2], gated)
    specs = training_scalars(epi.operands(operands or {}, m, n, l), operands or {})
    d_dtype = a.dtype if a.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    graph = epi.trace(
        {k: s.kind for k, s in specs.items()}, {k: s.dtype for k, s in specs.items()}, out_dtypes, d_dtype=d_dtype
    )
    acc = torch.matmul(a3.to(device, compute_dtype), b3.to(device, compute_dtype))
    up = None
    if gated:
        acc, up = split_gate_up(acc)
    results = evaluate(graph, acc, specs, compute_dtype=compute_dtype, up=up)
    return results if a.dim() == 3 else {k: v.squeeze(0) if v.dim() else v for k, v in results.items()}
