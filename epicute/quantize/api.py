"""``epicute.quantize``: fp8 values and scales in exactly the layouts epicute's and torch's fp8 GEMMs take."""

from __future__ import annotations

import math

import torch

from epicute.epilogue.dtypes import FP8_MAX, TORCH_TO_IR, round_to
from epicute.epilogue.group_quant import AMAX_FLOOR, GROUP_N, ceil_pow2
from epicute.errors import AlignmentError, ConfigError, DtypeError, GradientError, ShapeError
from epicute.quantize.torch_op import quantize_op_call
from epicute.runtime.backend import check_traced_backend, resolve_backend
from epicute.runtime.checks import check_on_one_hopper_gpu
from epicute.runtime.torch_ops import traced

#: recipe -> what one scale covers
RECIPES = {
    "groups": "1 x 128: a row's 128 consecutive values (activations: DeepSeek-V3's recipe)",
    "rowwise": "a whole row (torch._scaled_mm's rowwise scale_a)",
    "tensorwise": "the whole tensor",
    "blocks": "128 x 128 values of a 2-D weight (DeepSeek-V3's weights)",
}
FP8_DTYPES = {torch.float8_e4m3fn: "fp8e4m3", torch.float8_e5m2: "fp8e5m2"}
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize(
    x: torch.Tensor,
    *,
    recipe: str = "groups",
    dtype: torch.dtype = torch.float8_e4m3fn,
    ue8m0: bool = False,
    transpose: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in fp8 and its scales: ``x ≈ q * scale`` (each scale broadcast over the values it covers).

    A scale is ``max(amax, 1e-4) / fp8_max`` of the values it covers (``ue8m0=True``: rounded up to a power of
    two, DeepSeek-V3's scale format), and ``q = x * (1 / scale)`` rounded to ``dtype``, saturating: the math of
    the GEMM epilogue's :func:`epicute.ops.quantize_groups`. Recipes (``x`` has any leading dimensions and
    ``K`` values per row, a multiple of 16 so that fp8 rows are 16-byte aligned for the next GEMM's TMA loads):

    - ``"groups"``: one scale per row and 128 columns, ``(*leading, ceil(K / 128))`` fp32, M-major (rows
      contiguous): ``epicute.gemm``'s and ``torch._scaled_mm``'s blockwise ``a_scale``. On the GPU one
      memory-bound kernel (bf16 or fp16 ``x``); the rest are torch operations on ``x``'s device.
    - ``"rowwise"``: ``(*leading, 1)`` (on the GPU one kernel for rows of 128, 256, 512 or 1024 values, a warp's
      each: a decode step's query heads); ``"tensorwise"``: a 0-d scale; ``"blocks"``: a 2-D ``(N, K)`` weight in
      128 x 128 blocks, scales ``(ceil(N / 128), ceil(K / 128))`` (the blockwise ``b_scale`` of ``w.t()``).

    ``transpose=True`` quantizes ``x.t()`` of a 2-D ``x`` without materializing it (``"groups"`` or ``"blocks"``;
    ``x``'s row count is then the K, a multiple of 16): what a weight gradient ``dy.t() @ x`` takes of ``dy`` and
    ``x``, whose K is the tokens. On the GPU the blocks recipe and the transposes are one memory-bound kernel
    (:mod:`epicute.quantize.tile_sm90`).

    Example:
        >>> import torch, epicute
        >>> x = torch.randn(4, 256, dtype=torch.bfloat16)
        >>> with epicute.use_backend("reference"):
        ...     q, scales = epicute.quantize(x, ue8m0=True)
        >>> q.dtype, tuple(scales.shape), scales.stride()
        (torch.float8_e4m3fn, (4, 2), (1, 4))
    """
    backend = backend if traced(x) else resolve_backend(backend)  # traced: the op runs the default backend
    if transpose:
        if recipe not in TILE_RECIPES:
            raise ConfigError(f"recipe={recipe!r} with transpose=True; x.t() is quantized by {TILE_RECIPES}")
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"type {type(x).__name__}"
            raise ShapeError(f"x has {got}; transpose=True takes a 2-D x")
        if x.shape[0] % 16:
            raise AlignmentError(f"x has {x.shape[0]} rows, the K of x.t(): fp8 rows must be 16-byte aligned for the "
                                 f"GEMM that reads them: pad x's rows to {-(-x.shape[0] // 16) * 16}")  # fmt: skip
        _, columns = quantize_pair(x, None, recipe, dtype=dtype, ue8m0=ue8m0, backend=backend)
        return columns
    fp8, shape = _check(x, recipe, dtype, ue8m0)
    if traced(x):
        check_traced_backend(backend)
        return quantize_op_call(x, recipe, None, dtype, ue8m0)[0]
    if backend == "kernel":
        check_on_one_hopper_gpu(("x", x))
        if recipe == "blocks" and x.dtype != torch.float32 and x.numel():
            (q, scales), _ = quantize_pair(x, "blocks", None, dtype=dtype, ue8m0=ue8m0, backend=backend)
            return q, scales
        if recipe in ("groups", "rowwise") and x.dtype != torch.float32 and x.numel():
            from epicute.quantize.launch import ROWWISE_KERNEL_K, QuantizeVariant, launch_group_quantize

            if recipe == "groups" or shape[-1] in ROWWISE_KERNEL_K:
                rows = x.view(-1, shape[-1])
                _check_aligned(x)
                variant = (QuantizeVariant.rowwise(TORCH_TO_IR[x.dtype], fp8, ue8m0, shape[-1]) if recipe == "rowwise"
                           else QuantizeVariant(TORCH_TO_IR[x.dtype], fp8, ue8m0))  # fmt: skip
                q, scales = launch_group_quantize(rows, variant, dtype)
                return q.view(shape), scales.view(*shape[:-1], scales.shape[-1])
        return _quantize(x, recipe, fp8, ue8m0)
    q, scales = _quantize(x.detach().cpu(), recipe, fp8, ue8m0)
    return q.to(x.device), scales.to(x.device)


#: The recipes the tile quantizer writes, along rows or columns.
TILE_RECIPES = ("groups", "blocks")
Quantized = tuple[torch.Tensor, torch.Tensor]


def quantize_pair(
    x: torch.Tensor,
    rows: str | None,
    columns: str | None,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    ue8m0: bool = False,
    backend: str | None = None,
) -> tuple[Quantized | None, Quantized | None]:
    """A 2-D ``x`` ``(R, C)`` quantized by recipe ``rows`` (as :func:`quantize` would) and ``x.t()`` by recipe
    ``columns``, its K (``x``'s rows) padded with zero rows to a multiple of 16 (they add nothing to a product),
    from one read of ``x`` on the GPU; either recipe ``None`` (that one not made). The recipes are ``"groups"``
    and ``"blocks"``; each result ``(q, scales)`` in the layout :func:`quantize` gives. Used by fp8 training,
    where a forward's operand is also its weight gradient's (along the tokens)."""
    if any(r not in (None, *TILE_RECIPES) for r in (rows, columns)) or (rows, columns) == (None, None):
        raise ConfigError(f"rows={rows!r}, columns={columns!r}: each takes {TILE_RECIPES} or None, one at least")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ShapeError(f"x has shape {tuple(getattr(x, 'shape', ()))}; quantizing rows and columns takes 2-D x")
    backend = backend if traced(x) else resolve_backend(backend)
    fp8, _ = _check(x, rows or columns, dtype, ue8m0)  # x's own rows: both outputs read them
    if traced(x):
        check_traced_backend(backend)
        return quantize_op_call(x, rows, columns, dtype, ue8m0)
    if backend == "kernel":
        check_on_one_hopper_gpu(("x", x))
        if x.dtype != torch.float32:
            from epicute.quantize.launch import TileQuantizeVariant, launch_tile_quantize

            _check_aligned(x)
            variant = TileQuantizeVariant(TORCH_TO_IR[x.dtype], fp8, ue8m0, rows, columns)
            return launch_tile_quantize(x, variant, dtype)
    made_rows, made_columns = reference_pair(x if backend == "kernel" else x.detach().cpu(), rows, columns, fp8, ue8m0)
    if backend != "kernel":
        made_rows, made_columns = (tuple(t.to(x.device) for t in m) if m else None for m in (made_rows, made_columns))
    return made_rows, made_columns


def _check(x, recipe: str, dtype, ue8m0) -> tuple[str, tuple[int, ...]]:
    """Every argument checked before anything runs: (the fp8 IR name, x's shape)."""
    if not isinstance(x, torch.Tensor):
        raise DtypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if recipe not in RECIPES:
        raise ConfigError(f"recipe={recipe!r}; use one of {sorted(RECIPES)}")
    if dtype not in FP8_DTYPES:
        raise DtypeError(f"dtype={dtype}; quantize makes torch.float8_e4m3fn or torch.float8_e5m2")
    if not isinstance(ue8m0, bool):
        raise ConfigError(f"ue8m0={ue8m0!r}; pass True (power-of-two scales) or False")
    if x.requires_grad and torch.is_grad_enabled():
        raise GradientError("x requires grad, and fp8 values and scales carry none: pass x.detach(), or train "
                            "through epicute.nn.fp8_linear (its backward quantizes the gradients)")  # fmt: skip
    if x.dtype not in INPUT_DTYPES:
        raise DtypeError(f"x has dtype {x.dtype}; quantize takes torch.bfloat16, torch.float16 or torch.float32")
    if x.dim() == 0 or (recipe == "blocks" and x.dim() != 2):
        want = "a 2-D (N, K) weight" if recipe == "blocks" else "at least one dimension"
        raise ShapeError(f"x has shape {tuple(x.shape)}; recipe {recipe!r} takes {want}")
    k = x.shape[-1]
    if k % 16:
        raise AlignmentError(f"x has K={k} values per row; fp8 rows must be 16-byte aligned for the GEMM that reads "
                             f"them: pad K to {-(-k // 16) * 16}")  # fmt: skip
    if x.numel() and (x.stride(-1) != 1 or any(x.stride(d) % 16 for d in range(x.dim() - 1) if x.shape[d] > 1)):
        raise AlignmentError(f"x has strides {tuple(x.stride())}: rows must be contiguous and 16-value aligned; "
                             "pass x.contiguous()")  # fmt: skip
    try:
        x.view(-1, k)
    except RuntimeError:
        raise AlignmentError(f"x has strides {tuple(x.stride())}: its leading dimensions do not flatten into rows "
                             "without a copy; pass x.contiguous()") from None  # fmt: skip
    return FP8_DTYPES[dtype], tuple(x.shape)


def _check_aligned(x: torch.Tensor) -> None:
    """The kernels' 16-byte loads start at ``x``'s first element."""
    if x.data_ptr() % 16:
        raise AlignmentError("x.data_ptr() is not 16-byte aligned (a view with an element offset?); pass x.clone()")


def _scale(amax: torch.Tensor, fp8: str, ue8m0: bool) -> torch.Tensor:
    scale = torch.clamp(amax.float(), min=AMAX_FLOOR) / torch.tensor(FP8_MAX[fp8], dtype=torch.float32)
    return ceil_pow2(scale) if ue8m0 else scale


def reference_pair(x: torch.Tensor, rows: str | None, columns: str | None, fp8: str,
                   ue8m0: bool) -> tuple[Quantized | None, Quantized | None]:  # fmt: skip
    """What :func:`quantize_pair` makes (``columns`` None: :func:`quantize`'s ``(q, scales)`` of recipe ``rows``, any
    recipe), in torch operations on ``x``'s device: the reference backend, and the op's fake implementation
    (:mod:`epicute.quantize.torch_op`), whose shapes and strides these are."""
    made_rows = _quantize(x, rows, fp8, ue8m0) if rows else None
    made_columns = None
    if columns:
        pad = -x.shape[0] % 16
        made_columns = _quantize(torch.nn.functional.pad(x.t(), (0, pad)).contiguous(), columns, fp8, ue8m0)
    return made_rows, made_columns


def _quantize(x: torch.Tensor, recipe: str, fp8: str, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One recipe in torch operations (fp32 math; the group kernel's, operation for operation). Never traced by
    torch.compile, which sees the op (:mod:`epicute.quantize.torch_op`)."""
    shape, k = x.shape, x.shape[-1]
    v = x.float()
    if recipe == "groups":
        groups, m = -(-k // GROUP_N), math.prod(shape[:-1])  # m, not -1: K may be 0 (no tokens to transpose)
        padded = torch.nn.functional.pad(v.reshape(m, k).abs(), (0, groups * GROUP_N - k))
        scales = _scale(padded.view(m, groups, GROUP_N).amax(-1), fp8, ue8m0)  # (M, groups)
        expanded = scales.repeat_interleave(GROUP_N, dim=-1)[:, :k].reshape(shape)
        scales = scales.t().contiguous().t().view(*shape[:-1], groups)  # M-major
    elif recipe == "rowwise":
        scales = _scale(v.abs().amax(-1, keepdim=True), fp8, ue8m0) if k else v.new_ones(*shape[:-1], 1)
        expanded = scales
    elif recipe == "tensorwise":
        scales = _scale(v.abs().amax(), fp8, ue8m0) if v.numel() else v.new_ones(())
        expanded = scales
    else:  # 128 x 128 blocks of an (N, K) weight
        n = shape[0]
        nb, kb = -(-n // GROUP_N), -(-k // GROUP_N)
        padded = torch.nn.functional.pad(v.abs(), (0, kb * GROUP_N - k, 0, nb * GROUP_N - n))
        scales = _scale(padded.view(nb, GROUP_N, kb, GROUP_N).amax(dim=(1, 3)), fp8, ue8m0)
        expanded = scales.repeat_interleave(GROUP_N, 0).repeat_interleave(GROUP_N, 1)[:n, :k]
    q = round_to(v * (1.0 / expanded), fp8)
    return q, scales


__all__ = ["RECIPES", "TILE_RECIPES", "quantize", "quantize_pair", "reference_pair"]
