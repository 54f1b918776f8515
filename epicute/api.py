"""epicute's public functions: :func:`gemm` and :func:`explain`."""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from epicute.plan import GemmPlan, render_plan
from epicute.runtime.launch import cached_plan, launch_gemm
from epicute.runtime.validate import check_gemm_args


def _overrides(config: dict | None) -> tuple:
    return tuple(sorted((config or {}).items()))


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``a @ b`` on a Hopper GPU with epicute's warp-specialized TMA/WGMMA kernel.

    Args:
        a: ``(M, K)`` or batched ``(L, M, K)``, bf16 or fp16, row- or column-major.
        b: ``(K, N)`` or ``(L, K, N)``, same dtype as ``a``, row- or column-major
            (``w.t()`` of a row-major ``(N, K)`` weight works without a copy).
        out: optional preallocated row-major output ``(M, N)`` / ``(L, M, N)``.
        out_dtype: bf16, fp16 or fp32; defaults to ``out.dtype`` or ``a.dtype``.
        config: optional :class:`epicute.plan.GemmConfig` fields to pin
            (e.g. ``{"tile_n": 128}``); the planner chooses the rest.

    Returns:
        The product, accumulated in fp32 and rounded once to ``out_dtype``.

    Example:
        >>> import torch, epicute                                  # doctest: +SKIP
        >>> a = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
        >>> w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
        >>> y = epicute.gemm(a, w.t())                              # (1000, 14336)
    """
    call = check_gemm_args(a, b, out, out_dtype)
    return launch_gemm(call, cached_plan(call.problem, _overrides(config)))


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
