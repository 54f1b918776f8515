"""The grouped GEMM's public functions: :func:`grouped_gemm` and :func:`explain_grouped`."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TextIO

import torch

from epicute.epilogue.dtypes import IR_TO_TORCH
from epicute.epilogue.gated import check_gated_call, gated_epilogue, split_gate_up, stored_columns
from epicute.epilogue.graph import UP_OUTPUT
from epicute.epilogue.operands import OperandSpec
from epicute.epilogue.reference import evaluate, round_to, training_scalars
from epicute.epilogue.scales import BLOCK_K, dequantize_blockwise
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import EpilogueError, OutputError
from epicute.gemm.autograd import explain_backward
from epicute.gemm.config import GemmConfig
from epicute.gemm.epilogue_args import aux_outputs, kernel_inputs
from epicute.gemm.prepare import ir_items
from epicute.gemm.validate import check_d_rows
from epicute.grouped.launch import run_grouped
from epicute.grouped.plan import GroupedPlan, render_grouped_plan
from epicute.grouped.prepare import GroupedRequest, PreparedGrouped, prepare
from epicute.grouped.torch_op import grouped_gemm_op_call, needs_grouped_backward
from epicute.grouped.validate import GroupedCall, check_a_index_values, check_grouped_args, check_offsets_values
from epicute.runtime.backend import resolve_backend
from epicute.runtime.checks import (
    check_flags,
    check_has_values,
    check_one_device,
    check_operand_names,
    check_text_file,
    config_pins,
    keyword_parameters,
)
from epicute.runtime.compile import reference_device
from epicute.runtime.target import Target, resolve_target
from epicute.runtime.torch_ops import traced


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    /,
    *,
    epilogue: Callable | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    backend: str | None = None,
    config: dict | None = None,
    check_offsets: bool = False,
    gated: bool = False,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    a_index: torch.Tensor | None = None,
    **operands: Any,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """``a[rows of g] @ b[g]`` for every group ``g`` in one kernel (mixture-of-experts layers), optionally
    with a fused epilogue; with a 2-D ``b``, the variable-K mode ``a[:, rows of g] @ b[rows of g]`` (weight
    gradients).

    Args:
        a: ``(total_M, K)`` bf16 or fp16, rows sorted by group, row- or column-major; or fp8
            (``torch.float8_e4m3fn``/``float8_e5m2``) row-major, with blockwise ``a_scale``/``b_scale``. Variable K:
            ``(M, total_K)`` M-major, ``x.t()`` of the row-major ``(total_K, M)`` tokens ``x``; fp8: K-major (the
            tokens' quantized transpose, ``(M, total_K)`` row-major), with blockwise scales over the whole K.
        b: ``(G, K, N)``, ``a``'s dtype, one ``(K, N)`` per group, row- or column-major
            (``w.transpose(-2, -1)`` of a ``(G, N, K)`` weight works without a copy). Variable K:
            a row-major ``(total_K, N)`` (e.g. the output gradients ``dy``), its rows split by ``offsets``
            like ``a``'s columns, and D is ``(G, M, N)``: ``D[g] = x[rows of g].T @ dy[rows of g]``,
            zeros for an empty group (``torch._grouped_mm(x.t(), dy, offs)`` computes the same). fp8: K-major,
            ``w.transpose(-2, -1)`` of a row-major ``(G, N, K)`` weight (variable K: ``t.t()`` of a row-major
            ``(N, total_K)`` ``t``).
        offsets: int32 ``(G,)``: each group's end row in ``a``, as ``torch._grouped_mm`` takes
            ``offs`` (``torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)``; quack's
            ``(G + 1,)`` ``cu_seqlens_m`` is ``offsets[1:]`` of this). Groups may be empty or of
            any size; the last may end before ``total_M`` (``total_K``): the rows past it belong to no group (D's
            are not written; a buffer with room for padded groups). Read on the GPU: no sync, CUDA-graph safe.
            fp8 variable K: every group starts and ends on a 128-row block of K (pad each with zero rows), checked
            where the offsets are read; the kernel gives NaN for a group that does not.
        epilogue: a function ``f(acc, *operands) -> {"D": ...}`` as for :func:`epicute.gemm`. Its
            operands, by name: scalars; per-group row vectors ``(G, N)`` (an expert's bias or
            scales) or one ``(N,)`` for all groups; per-row column vectors ``(total_M, 1)`` or
            ``epicute.ColVector(w)`` of a ``(total_M,)`` ``w`` (router weights); tiles ``(total_M, N)``.
            Its outputs are tiles and reductions: per row over N (``ops.row_sum``/``row_max``: ``(total_M,)``) and,
            per group, over its rows (``ops.col_sum``/``col_max``: ``(G, N)``) or its whole tile (``ops.amax``:
            ``(G,)``), combined in a fixed order (bitwise reproducible). Variable K: operands and reductions of
            the dense batched GEMM with the groups as its batch (``(G, N)`` rows, ``(G, M, 1)`` columns, ``(G, M, N)``
            tiles; ``(G, M)`` and ``(G, N)`` reductions, one amax).
        out: optional preallocated row-major ``(total_M, N)`` output (variable K: ``(G, M, N)``).
        out_dtype, out_dtypes: as for :func:`epicute.gemm`.
        backend: ``"kernel"`` (the GPU) or ``"reference"`` (float32 on the CPU, per group).
        config: :class:`~epicute.gemm.config.GemmConfig` fields to pin.
        check_offsets: read the offsets back and check them (a device sync; offsets passed on the CPU are
            always checked). Unchecked offsets that decrease or pass ``total_M`` never make the kernel
            write outside ``out``, but rows no group covers are left as they were.
        gated: SwiGLU/GeGLU experts in one kernel: ``b``'s ``2N`` columns hold each expert's gate and up
            projections interleaved in blocks of 8 (:func:`epicute.interleave_gate_up`), and the epilogue
            is ``f(gate, up, *operands)``, e.g. ``lambda gate, up, score: ops.silu(gate) * up * score``;
            D and the operands have ``N`` columns.
        a_scale, b_scale: fp8 inputs' blockwise scales (DeepSeek-V3's recipe, as DeepGEMM's grouped GEMMs
            take them), fp32: ``a_scale`` ``(total_M, ceil(K/128))`` one per row and 128-wide block of K, any
            strides; ``b_scale`` ``(G, ceil(N/128), ceil(K/128))`` one per 128x128 block of each group's
            ``(N, K)`` weight (or ``(G, KB, NB)``); variable K: ``(M, KB)`` and ``(ceil(N/128), KB)`` over the
            whole K. Applied in the mainloop with fp32 promotion, as for :func:`epicute.gemm`. D is bf16 unless
            ``out``/``out_dtype`` say otherwise.
        a_index: gathered rows: int32 (or int64) ``(total_M,)``, grouped row ``r`` reads ``a[a_index[r]]``, so ``a``
            is the ``(T, K)`` tokens as they are (row-major, K a multiple of 8) and routed tokens need no
            permuted copy (top-k routing: ``a_index = sorted_slot // k``). D has ``total_M`` rows, in group order.
            Indices are checked where cheap (on the CPU, or with ``check_offsets``); the kernel clamps any other to
            ``a``'s rows, so a bad one reads a wrong row, never outside ``a``. Groups splitting M; fp8 ``a`` takes
            its ``a_scale`` per token, ``(T, ceil(K/128))``, read through the same index.

    Differentiable (rows, gathered or not, and gated): under autograd, ``a``, ``b`` and every floating-point
    epilogue operand get gradients, derived from the epilogue (:mod:`epicute.gemm.autograd`); ``da`` of gathered
    rows is summed back into each token, ``db`` runs on the variable-K kernel. fp8 inputs and scales, ``out`` and
    variable-K calls take none (:class:`~epicute.errors.GradientError`; fp8 training of experts:
    :func:`epicute.nn.fp8_moe_experts`).
    ``a``, ``b`` and ``offsets`` are positional-only: epilogue operands may take those names.

    Returns:
        D ``(total_M, N)`` (variable K: ``(G, M, N)``); a dict of every output when the epilogue returns
        more than ``"D"``.

    Example:
        >>> import torch, epicute                                              # doctest: +SKIP
        >>> x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)  # tokens sorted by expert
        >>> w = torch.randn(8, 2048, 1024, device="cuda", dtype=torch.bfloat16)
        >>> offs = torch.cumsum(torch.full((8,), 512, device="cuda"), 0, dtype=torch.int32)
        >>> y = epicute.grouped_gemm(x, w.transpose(-2, -1), offs)             # (4096, 2048)
        >>> z = epicute.grouped_gemm(x, w.transpose(-2, -1), offs, epilogue=lambda acc, score: acc * score,
        ...                          score=torch.rand(4096, 1, device="cuda"))
        >>> w13 = epicute.interleave_gate_up(w[:, :1024], w[:, 1024:])          # (8, 2048, 1024)
        >>> h = epicute.grouped_gemm(x, w13.transpose(-2, -1), offs, gated=True,  # (4096, 1024)
        ...                          epilogue=lambda gate, up: epicute.ops.silu(gate) * up)
        >>> dy = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)  # output gradients
        >>> dw = epicute.grouped_gemm(x.t(), dy, offs)                           # (8, 1024, 2048)
        >>> routed = torch.randint(0, 4096, (8192,), device="cuda")              # two experts per token
        >>> y2 = epicute.grouped_gemm(x, w.transpose(-2, -1), 2 * offs, a_index=routed)  # (8192, 2048)
    """
    if traced(a):
        # torch.compile sees one custom op (epicute::grouped_gemm), never this Python code.
        return grouped_gemm_op_call(
            a, b, offsets, epilogue=epilogue, out=out, out_dtype=out_dtype, out_dtypes=out_dtypes, backend=backend,
            config=config, check_offsets=check_offsets, gated=gated,
            loader_args={"a_index": a_index, "a_scale": a_scale, "b_scale": b_scale}, operands=operands,
        )  # fmt: skip
    backend = resolve_backend(backend)
    on_gpu = backend == "kernel"
    named = (("a", a), ("b", b), ("out", out), ("a_scale", a_scale), ("b_scale", b_scale))
    loader_args = {"a_index": a_index, "a_scale": a_scale, "b_scale": b_scale}
    if on_gpu and needs_grouped_backward(a, b, out, loader_args, operands):
        # Through the op, whose backward (epicute.gemm.autograd) is derived from the epilogue.
        return grouped_gemm_op_call(
            a, b, offsets, epilogue=epilogue, out=None, out_dtype=out_dtype, out_dtypes=out_dtypes, backend=backend,
            config=config, check_offsets=check_offsets, gated=gated, loader_args=loader_args, operands=operands,
        )  # fmt: skip
    if not on_gpu:
        check_has_values(*named, operands=operands)  # offsets and a_index: their device is checked with a's
        needs_grouped_backward(a, b, out, loader_args, operands)  # the kernels' refusals, the same here
    call, specs, request = describe_grouped_call(
        a, b, offsets, epilogue, out, out_dtype, out_dtypes, config, operands, on_gpu, check_offsets, gated,
        (a_scale, b_scale), a_index,
    )  # fmt: skip
    prepared = prepare(request)
    paired = prepared.epilogue is not None and prepared.epilogue.fusion.paired
    if paired and call.out is not None:
        raise OutputError(f"the epilogue returns {UP_OUTPUT!r}, stored interleaved with D in a new (total_M, 2N) D; "
                          "leave out= out (the call returns that D)")  # fmt: skip
    width = stored_columns(call.problem.d_n, paired)
    if prepared.d_torch_dtype != call.out_dtype or paired:  # the epilogue's own cast chose D's dtype (no out given)
        if call.problem.total_m and call.problem.n and call.problem.k:
            check_d_rows(None, width, prepared.d_torch_dtype)
        call = replace(call, problem=prepared.plan.problem, out_dtype=prepared.d_torch_dtype)
    if backend == "reference":
        results = reference_grouped(call, prepared, training_scalars(specs, operands))
    elif prepared.epilogue is None:
        results = run_grouped(call, prepared.plan)
    else:
        p, device = call.problem, call.a.device
        tensors, scalars = kernel_inputs(prepared.fusion, specs, device)
        aux = aux_outputs(prepared.fusion, {}, p.out_shape, True, device)
        results = run_grouped(call, prepared.plan, prepared.fusion, tensors, scalars, aux)
    return results["D"] if set(results) == {"D"} else results


def describe_grouped_call(
    a, b, offsets, epilogue, out, out_dtype, out_dtypes, config, operands, require_cuda: bool,
    check_offsets: bool = False, gated: bool = False, scales: tuple = (None, None), a_index=None,
) -> tuple[GroupedCall, dict[str, OperandSpec], GroupedRequest]:  # fmt: skip
    """Validate a call and describe it: the call, its operands resolved for the kernel (per-group rows
    ``(G, N)``, per-row columns ``(G, total_M)`` with a zero group stride, tiles ``(1, total_M, N)``) and
    its :class:`GroupedRequest`."""
    if out_dtypes is not None and not isinstance(out_dtypes, Mapping):
        raise OutputError(f"out_dtypes is a {type(out_dtypes).__name__}; pass a dict by output name, e.g. "
                          "out_dtypes={'pre': torch.float32}")  # fmt: skip
    if epilogue is None and (operands or out_dtypes):
        raise EpilogueError(f"operands/outputs {sorted(operands) or list(out_dtypes)} were given without an epilogue")
    check_flags(gated=gated, check_offsets=check_offsets)
    check_gated_call(gated, epilogue)
    overrides = config_pins(config, GemmConfig)
    epi = None
    if epilogue is not None:
        # Before any argument is checked: an operand named like the call's own parameter never reached the epilogue.
        epi = gated_epilogue(epilogue) if gated else as_epilogue(epilogue)
        check_operand_names("epilogue", epi.name, epi.params, GROUPED_KEYWORDS, "epicute.grouped_gemm")
    if out_dtypes and "D" in out_dtypes:
        out_dtype = out_dtype or out_dtypes["D"]
    call = check_grouped_args(a, b, offsets, out, out_dtype, check_offsets=check_offsets, require_cuda=require_cuda,
                              gated=gated, a_scale=scales[0], b_scale=scales[1], a_index=a_index)  # fmt: skip
    p = call.problem
    if epi is None:
        return call, {}, GroupedRequest(p, overrides=overrides)
    specs = epi.operands(operands, p.total_m, p.d_n, p.groups)
    if p.ragged == "m":  # per-row operands span all groups' rows
        specs = {name: _grouped_operand(spec, p.groups) for name, spec in specs.items()}
    request = GroupedRequest(
        p, epi, tuple((s.name, s.kind, s.dtype) for s in specs.values()),
        d_explicit=out is not None or out_dtype is not None, out_dtypes=ir_items(out_dtypes, "out_dtypes"),
        overrides=overrides,
    )  # fmt: skip
    return call, specs, request


def _grouped_operand(spec: OperandSpec, groups: int) -> OperandSpec:
    """Per-row operands are one tensor over all rows (each row belongs to one group): a ``(G, ...)`` one is
    refused; tiles go to the kernel as ``(1, total_M, N)``."""
    if spec.kind in ("col", "tile") and groups > 1 and spec.value.stride(0) != 0:
        shape = "(total_M, 1)" if spec.kind == "col" else "(total_M, N)"
        raise EpilogueError(
            f"operand {spec.name!r} has one {spec.kind} per group; in a grouped GEMM each row belongs to one group, "
            f"so a per-row operand is {shape} over all rows (index it by group on the host for per-group values)"
        )
    if spec.kind == "tile":
        return replace(spec, value=spec.value[:1])
    return spec


def reference_grouped(call: GroupedCall, prepared: PreparedGrouped, specs: Mapping[str, OperandSpec]) -> dict:
    """The grouped GEMM in float32 on the CPU (:func:`~epicute.runtime.compile.reference_device`), group by group
    (reads the offsets; checks them)."""
    p = call.problem
    device = reference_device(call.a)
    offsets = call.offsets.cpu()
    if p.ragged == "k":  # fp8: groups on whole 128-row blocks of K, as the kernel sums them
        check_offsets_values(offsets, p.k, "K row", BLOCK_K if p.block_scaled else 1)
    else:
        check_offsets_values(offsets, p.total_m, "row")
    if call.block_scales is None:
        a, b = call.a[0].to(device, torch.float32), call.b.to(device, torch.float32)
    else:  # fp8: dequantized (gathered rows: per token, before the gather), then float32 math
        a, b = dequantize_blockwise(call.a, call.b, call.block_scales)
        a, b = a[0].to(device), b.to(device)
    if call.a_index is not None:
        index = call.a_index.cpu().long()
        check_a_index_values(index, a.shape[0])
        a = a[index.to(device)]
    graph = None if prepared.epilogue is None else prepared.epilogue.graph
    # Reductions along rows or over whole tiles are per group (column sums (G, N), amax (G,)) when groups split M.
    per_group = set() if graph is None or p.ragged == "k" else {
        r.name for r in prepared.epilogue.fusion.reductions if r.axis != "row"}  # fmt: skip
    pieces: dict[str, list] = {}
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if p.ragged == "k":
            acc = (a[:, start:end] @ b[0, start:end]).unsqueeze(0)
        else:
            acc = (a[start:end] @ b[g]).unsqueeze(0)
        up = None
        if p.gated:
            acc, up = split_gate_up(acc)
        if graph is None:
            results = {"D": round_to(acc, p.d_dtype)}
        else:
            operands = {name: _group_slice(s, g, start, end, p.ragged) for name, s in specs.items()}
            results = evaluate(graph, acc, operands, up=up)
        for name, value in results.items():
            pieces.setdefault(name, []).append(value if value.dim() == 0 else value[0])
        start = end
    if p.ragged == "k":  # one (M, N) output per group; a whole-output reduction over all of them
        results = {name: torch.stack(values) for name, values in pieces.items()}
        for r in () if graph is None else prepared.epilogue.fusion.reductions:
            if r.axis == "all":
                results[r.name] = results[r.name].amax()
        if call.out is not None:
            call.out.copy_(results["D"])
            results["D"] = call.out
        return results
    if not pieces:  # no rows at all
        fusion = None if prepared.epilogue is None else prepared.epilogue.fusion
        stored = {"D": p.d_dtype} if fusion is None else {n: fusion.output_dtypes[n] for n in fusion.returned_outputs}
        width = stored_columns(p.d_n, fusion is not None and fusion.paired)
        pieces = {name: [torch.empty(0, width if name == "D" else p.d_n, dtype=IR_TO_TORCH[d])]
                  for name, d in stored.items()}  # fmt: skip
    if start < p.total_m:  # rows past the last group belong to none: the kernel never writes them (NaN here)
        for name, values in pieces.items():
            if name not in per_group:
                values.append(values[0].new_full((p.total_m - start, *values[0].shape[1:]), float("nan")))
    results = {name: torch.stack(values) if name in per_group else torch.cat(values) for name, values in pieces.items()}
    if call.out is not None:
        call.out[0, :start].copy_(results["D"][:start])
        results["D"] = call.out[0]
    return results


def _group_slice(spec: OperandSpec, g: int, start: int, end: int, ragged: str = "m") -> OperandSpec:
    """Group ``g``'s part of an operand, as a batch of one (variable K: batch ``g`` of a dense batched operand)."""
    if spec.kind == "scalar":
        return spec
    v = spec.value
    if ragged == "k":
        return replace(spec, value=v[g : g + 1])
    part = v[g : g + 1] if spec.kind == "row" else v[:1, start:end] if spec.kind in ("col", "tile") else v
    return replace(spec, value=part)


def explain_grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    /,
    *,
    epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    config: dict | None = None,
    gated: bool = False,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    a_index: torch.Tensor | None = None,
    target: Target | str | None = None,
    file: TextIO | str | None = "stdout",
    **operands: Any,
) -> GroupedPlan:
    """Print (to ``file``; ``None``: quiet) and return the plan :func:`grouped_gemm` launches for these
    arguments: the grouped schedule, the tile plan and the epilogue chain. Tensors may be on any device
    (``"meta"`` included: the offsets' values are never read), ``a`` and ``b`` on the same one.

    Example:
        >>> import torch, epicute
        >>> x = torch.empty(16384, 4096, dtype=torch.bfloat16, device="meta")
        >>> w = torch.empty(8, 14336, 4096, dtype=torch.bfloat16, device="meta")
        >>> offs = torch.empty(8, dtype=torch.int32, device="meta")
        >>> plan = epicute.explain_grouped(x, w.transpose(-2, -1), offs, file=None)
        >>> plan.config.tile_m, plan.grid[2] <= 132
        (128, True)
    """
    check_text_file(file)
    check_one_device(("a", a), ("b", b))
    _, _, request = describe_grouped_call(a, b, offsets, epilogue, None, out_dtype, out_dtypes, config, operands,
                                          False, gated=gated, scales=(a_scale, b_scale), a_index=a_index)  # fmt: skip
    prepared = prepare(replace(request, target=resolve_target(target)))
    plan = prepared.plan
    if file is not None:
        p = plan.problem
        graph = prepared.epilogue.graph if prepared.epilogue is not None else None
        backward = explain_backward(graph, p.total_m, p.d_n, p.k, torch_reductions=False) if p.ragged == "m" else (
            "under autograd\n  backward: none (a variable-K call takes no gradient)")  # fmt: skip
        print(render_grouped_plan(plan) + "\n\n" + backward, file=sys.stdout if file == "stdout" else file)
    return plan


#: Keyword parameters of the grouped GEMM's entry points: an epilogue operand of one of these names would bind to
#: the parameter (refused by describe_grouped_call); ``a``, ``b`` and ``offsets`` are positional-only.
GROUPED_KEYWORDS = keyword_parameters(grouped_gemm, explain_grouped)


__all__ = ["GROUPED_KEYWORDS", "explain_grouped", "grouped_gemm", "reference_grouped"]
