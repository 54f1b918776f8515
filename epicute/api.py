"""epicute's public functions: :func:`gemm` and :func:`explain`."""

from __future__ import annotations

import sys
from typing import Any, Callable, TextIO

import torch

from epicute.epilogue.reference import reference_gemm
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import ConfigError, DeviceError, EpilogueError
from epicute.plan import GemmPlan, render_plan
from epicute.runtime.launch import cached_plan, launch_gemm
from epicute.runtime.validate import check_gemm_args


def _overrides(config: dict | None) -> tuple:
    return tuple(sorted((config or {}).items()))


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    epilogue: Callable | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    backend: str = "kernel",
    config: dict | None = None,
    **operands: Any,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """``a @ b`` on a Hopper GPU, optionally with a fused epilogue.

    Args:
        a: ``(M, K)`` or batched ``(L, M, K)``, bf16 or fp16, row- or column-major.
        b: ``(K, N)`` or ``(L, K, N)``, same dtype as ``a``, row- or column-major
            (``w.t()`` of a row-major ``(N, K)`` weight works without a copy).
        epilogue: a function ``f(acc, *operands) -> {"D": ...}`` (see
            :func:`epicute.epilogue`); its operands are passed by name as keyword
            arguments (scalars, row/column vectors or full tiles).
        out: optional preallocated row-major output ``(M, N)`` / ``(L, M, N)``.
        out_dtype: bf16, fp16 or fp32; defaults to ``out.dtype`` or ``a.dtype``.
        out_dtypes: dtypes of the epilogue's outputs by name (``"D"`` included).
        backend: ``"kernel"`` (the GPU) or ``"reference"`` (float32 on the CPU,
            any device: the oracle every GPU test compares against).
        config: optional :class:`epicute.plan.GemmConfig` fields to pin
            (e.g. ``{"tile_n": 128}``); the planner chooses the rest.

    Returns:
        D, accumulated in fp32 and rounded once to its dtype; a dict of all
        outputs when the epilogue returns more than ``"D"``.

    Example:
        >>> import torch, epicute                                  # doctest: +SKIP
        >>> a = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
        >>> w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
        >>> y = epicute.gemm(a, w.t())                              # (1000, 14336)
        >>> z = epicute.gemm(a, w.t(), epilogue=lambda acc, bias: epicute.ops.relu(acc + bias),
        ...                  bias=torch.randn(14336, device="cuda", dtype=torch.bfloat16))
    """
    if backend not in ("kernel", "reference"):
        raise ConfigError(f"backend={backend!r}: use 'kernel' or 'reference'")
    if epilogue is None and (operands or out_dtypes):
        raise EpilogueError(f"operands {sorted(operands) or list(out_dtypes)} were given without an epilogue")
    if out_dtypes and "D" in out_dtypes:
        out_dtype = out_dtype or out_dtypes["D"]
    call = check_gemm_args(a, b, out, out_dtype, require_cuda=backend == "kernel")
    if epilogue is None:
        if backend == "reference":
            return _deliver(call, {"D": _reference_matmul(call)})
        return launch_gemm(call, cached_plan(call.problem, _overrides(config)))

    p = call.problem
    epi = as_epilogue(epilogue)
    specs = epi.operands(operands, p.m, p.n, p.l)
    dtypes = {"D": call.out_dtype, **(out_dtypes or {})}
    if backend == "reference":
        results = reference_gemm(call.a, call.b, epi, operands, dtypes)
        return _deliver(call, results)
    graph = epi.trace(
        {k: s.kind for k, s in specs.items()}, {k: s.dtype for k, s in specs.items()}, dtypes, d_dtype=call.out_dtype
    )
    from epicute.kernels.epilogue_emit import EpilogueFusion  # imports the CuTe DSL: only when launching

    fusion = EpilogueFusion(graph, tuple((s.name, s.kind, s.dtype) for s in specs.values()))
    tensors, scalars = kernel_operands(specs, call.a.device)
    return launch_gemm(call, cached_plan(p, _overrides(config)), fusion, tensors, scalars)


def kernel_operands(specs: dict, device: torch.device) -> tuple[tuple, tuple]:
    """The kernel's operand tuples: tensors (checked to be on ``device``) and fp32 scalars."""
    tensors = []
    for s in specs.values():
        if s.kind == "scalar":
            continue
        if s.value.device != device:
            raise DeviceError(f"operand {s.name!r} is on {s.value.device}; move it to {device}")
        tensors.append(s.value)
    return tuple(tensors), tuple(float(s.value) for s in specs.values() if s.kind == "scalar")


def _reference_matmul(call) -> torch.Tensor:
    return torch.matmul(call.a.cpu().float(), call.b.cpu().float()).to(call.out_dtype)


def _deliver(call, results: dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """Reference results in the caller's rank, D copied into ``out`` when given."""
    if not call.batched:
        results = {k: v[0] if v.dim() == 3 else v for k, v in results.items()}
    if call.out is not None:
        target = call.out if call.batched else call.out[0]
        target.copy_(results["D"].reshape(target.shape))
        results["D"] = target if call.batched else call.out[0]
    return results["D"] if set(results) == {"D"} else results


def explain(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    file: TextIO | None | str = "stdout",
) -> GemmPlan:
    """Print (to ``file``, default stdout; ``None`` to stay quiet) and return the plan for ``a @ b``.

    Works without a GPU: ``a`` and ``b`` may live on any device, ``"meta"``
    included, and the plan then targets an H100.

    Example:
        >>> import torch, epicute
        >>> a = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta")
        >>> plan = epicute.explain(a, a, file=None)
        >>> plan.config.tile_m, plan.config.tile_n
        (128, 256)
    """
    call = check_gemm_args(a, b, None, out_dtype, require_cuda=False)
    plan = cached_plan(call.problem, _overrides(config))
    if file is not None:
        # Resolved per call so redirect_stdout, capsys and notebooks see the text.
        print(render_plan(plan), file=sys.stdout if file == "stdout" else file)
    return plan
