"""Checking GEMM arguments before anything is compiled or launched.

Every rule here exists because breaking it would otherwise crash, hang or
silently corrupt a kernel: TMA needs 16-byte-aligned base addresses and
row strides, WGMMA supports a fixed set of dtypes, and an output that aliases
an input would be read while it is being written. Each error names the argument
and the fix. Nothing is ever copied behind the user's back.

A repeat call of the same signature skips this module altogether: it replays
the first call's recorded launch (:mod:`epicute.gemm.prepared`), re-checking
only whether ``out`` overlaps ``a`` or ``b``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from epicute.epilogue.dtypes import TORCH_TO_IR
from epicute.epilogue.gated import check_gated_columns, output_columns, stored_columns
from epicute.errors import AlignmentError, DtypeError, OutputError, ShapeError
from epicute.gemm.config import GemmProblem
from epicute.runtime.checks import (
    TMA_ALIGN_BYTES,
    check_on_one_hopper_gpu,
    check_outputs_apart,
    with_aligned_unit_dims,
)

AB_TORCH_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
FP8_TORCH_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: D's dtypes; fp8 conversions saturate at the format's largest finite value.
D_TORCH_DTYPES = tuple(TORCH_TO_IR)


@dataclass
class GemmCall:
    """Validated operands, viewed as 3-D ``(L, ., .)`` tensors, and the problem."""

    problem: GemmProblem
    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor | None
    out_dtype: torch.dtype
    batched: bool
    #: fp8 blockwise scales, read by the mainloop (``problem.block_scaled``); see epicute.epilogue.scales
    block_scales: object = None
    #: B interleaves gate and up columns for a gated epilogue (epicute.epilogue.gated): D has N / 2
    gated: bool = False

    @property
    def d_n(self) -> int:
        """D's columns."""
        return output_columns(self.problem.n, self.gated)


def _as_3d(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() == 3:
        return t
    raise ShapeError(f"{name} has {t.dim()} dimensions {tuple(t.shape)}; expected 2 (M, K) or 3 (L, M, K)")


def _major(t: torch.Tensor, name: str, row_major: str, col_major: str) -> str:
    """Which of the last two dims is contiguous; the other stride stays free.

    A size-1 dimension's stride is never stepped along, so it counts as
    contiguous; when both count, the dimension that really has unit stride
    and extent wins (``x.t()`` of a ``(1, 64)`` row is column-major, K = 1).
    """
    row, col = (t.stride(-1) == 1 or t.size(-1) == 1), (t.stride(-2) == 1 or t.size(-2) == 1)
    if row and col and t.size(-1) == 1 and t.size(-2) > 1:
        return col_major
    if row:
        return row_major
    if col:
        return col_major
    raise AlignmentError(
        f"{name} has strides {tuple(t.stride())}: neither of its last two dimensions is contiguous, "
        f"which TMA needs; pass {name}.contiguous()"
    )


def _check_tma_strides(t: torch.Tensor, name: str, contiguous_dim: int, dims: str) -> torch.Tensor:
    """Every stride but the unit one must be a multiple of 16 bytes.

    A size-1 batch dimension's stride is never used, so it is normalized
    instead of rejected.
    """
    elem = t.element_size()
    if t.data_ptr() % TMA_ALIGN_BYTES:
        raise AlignmentError(
            f"{name}.data_ptr() is {t.data_ptr() % TMA_ALIGN_BYTES} bytes past a 16-byte boundary "
            f"(a view with an element offset?); TMA needs 16-byte-aligned bases: pass {name}.clone()"
        )
    if t.size(contiguous_dim) > 1 and t.stride(contiguous_dim) != 1:
        raise AlignmentError(
            f"{name} has strides {tuple(t.stride())}: its dimension {dims[contiguous_dim]} must be contiguous (stride "
            f"1) for TMA; pass {name}.contiguous()"
        )
    step = TMA_ALIGN_BYTES // elem
    t = with_aligned_unit_dims(t, contiguous_dim)
    for d in range(3):
        if d == contiguous_dim:
            continue
        if t.stride(d) % step:
            extent = t.size(contiguous_dim)
            hint = (
                f"its contiguous dimension {dims[contiguous_dim]}={extent} is not a multiple of {step}: "
                f"pad it to {-(-extent // step) * step}"
                if d != 0 and t.stride(d) == extent
                else f"make every stride but the contiguous one a multiple of {step} elements"
            )
            raise AlignmentError(
                f"{name} stride {t.stride(d)} (dim {d}) is not a multiple of 16 bytes, which TMA needs; {hint}"
            )
    return t


def check_gemm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    require_cuda: bool = True,
    gated: bool = False,
    d_settled: bool = True,
) -> GemmCall:
    """Validate ``a @ b`` (optionally into ``out``) and describe it as a :class:`GemmProblem` (``gated``: B
    interleaves gate and up columns, D has half of them). ``d_settled=False``: an epilogue settles a new D's dtype
    later (its own cast or quantize may choose it), and :func:`settle_d` checks D's rows then."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise DtypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if require_cuda:
        check_on_one_hopper_gpu(("a", a), ("b", b))
    if a.dtype not in AB_TORCH_DTYPES:
        raise DtypeError(
            f"a has dtype {a.dtype}; supported are torch.bfloat16, torch.float16, torch.float8_e4m3fn and "
            "torch.float8_e5m2"
        )
    fp8 = a.dtype in FP8_TORCH_DTYPES
    if b.dtype != a.dtype and not (fp8 and b.dtype in FP8_TORCH_DTYPES):
        raise DtypeError(
            f"b has dtype {b.dtype} but a has {a.dtype}; cast one so that they match "
            "(only fp8 inputs may mix e4m3 and e5m2)"
        )
    if a.dim() != b.dim():
        raise ShapeError(f"a is {a.dim()}-D {tuple(a.shape)} but b is {b.dim()}-D {tuple(b.shape)}; use the same rank")
    batched = a.dim() == 3
    a3, b3 = _as_3d(a, "a"), _as_3d(b, "b")
    if a3.size(0) != b3.size(0):
        raise ShapeError(f"batch sizes differ: a has L={a3.size(0)}, b has L={b3.size(0)}")
    if a3.size(2) != b3.size(1):
        raise ShapeError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's K={a3.size(2)} != b's K={b3.size(1)}")
    l, m, k = a3.shape
    n = b3.size(2)

    # fp8 inputs give bf16 by default: an fp8 D would drop what the scales carry.
    out_dtype = resolve_out_dtype(out, out_dtype, torch.bfloat16 if fp8 else a.dtype)

    a_major = _major(a3, "a", "k", "m")
    b_major = _major(b3, "b", "n", "k")
    if fp8 and k % TMA_ALIGN_BYTES:
        raise AlignmentError(
            f"K={k} with fp8 inputs: TMA moves 16-byte rows of A and B, so K must be a multiple of 16; pad K to "
            f"{-(-k // TMA_ALIGN_BYTES) * TMA_ALIGN_BYTES} with zeros"
        )
    if fp8 and k and (a_major, b_major) != ("k", "k"):
        raise AlignmentError(
            f"fp8 a is {'row' if a_major == 'k' else 'column'}-major and b {'column' if b_major == 'k' else 'row'}"
            "-major: WGMMA reads 8-bit operands K-major only. Pass a row-major a (M, K) (a.contiguous()) and b as "
            "w.t() of a row-major (N, K) weight (b.t().contiguous().t())"
        )
    d_n = check_gated_columns(n, "b", gated)
    out3 = None
    if out is not None:
        # An epilogue returning D_up stores it in D, twice as wide (Graph.paired): settle_d checks which it is.
        width = 2 * d_n if not d_settled and out.dim() and out.shape[-1] == 2 * d_n else d_n
        expected = (l, m, width) if batched else (m, width)
        check_out_placement(out, expected, f"{'gated(a @ b)' if gated else 'a @ b'} has shape {expected}", a, b)
        out3 = _as_3d(out, "out")

    problem = GemmProblem(
        m=m, n=n, k=k, l=l,
        ab_dtype=TORCH_TO_IR[a.dtype], d_dtype=TORCH_TO_IR[out_dtype],
        a_major="k" if fp8 else a_major, b_major="k" if fp8 else b_major,
        b_dtype=TORCH_TO_IR[b.dtype] if b.dtype != a.dtype else "",
    )  # fmt: skip
    if m and n and k:
        a3 = _check_tma_strides(a3, "a", 2 if a_major == "k" else 1, "LMK")
        b3 = _check_tma_strides(b3, "b", 2 if b_major == "n" else 1, "LKN")
        if out3 is not None or d_settled:
            out3 = check_d_rows(out3, d_n, out_dtype)
    return GemmCall(problem, a3, b3, out3, out_dtype, batched, gated=gated)


def settle_d(call: GemmCall, d_dtype: torch.dtype, paired: bool = False) -> GemmCall:
    """``call`` with D stored in ``d_dtype``, as preparing its epilogue settled it, and a new D's rows checked for
    that dtype (``check_gemm_args(..., d_settled=False)`` left them): the one place an epilogue call's D is checked.
    ``paired``: D holds ``D_up`` too (:attr:`~epicute.epilogue.graph.Graph.paired`), twice as wide."""
    p = call.problem
    width = stored_columns(call.d_n, paired)
    if call.out is not None and call.out.shape[-1] != width:
        given = tuple(call.out.shape if call.batched else call.out.shape[1:])
        raise OutputError(f"out has shape {given}; the epilogue writes D of shape {(*given[:-1], width)}"
                          + (" (D and D_up interleaved)" if paired else ""))  # fmt: skip
    if call.out is None and p.m and p.n and p.k:
        check_d_rows(None, width, d_dtype)
    if d_dtype == call.out_dtype:
        return call
    return replace(call, problem=replace(p, d_dtype=TORCH_TO_IR[d_dtype]), out_dtype=d_dtype)


def resolve_out_dtype(out: torch.Tensor | None, out_dtype: torch.dtype | None, default: torch.dtype) -> torch.dtype:
    """D's dtype: ``out``'s (which ``out_dtype`` must then agree with), else ``out_dtype``, else ``default``."""
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise OutputError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise OutputError(f"out has dtype {out.dtype} but out_dtype={out_dtype}; drop one or make them agree")
        out_dtype = out.dtype
    out_dtype = out_dtype or default
    if out_dtype not in D_TORCH_DTYPES:
        raise DtypeError(f"out_dtype={out_dtype}; supported are {', '.join(map(str, D_TORCH_DTYPES))}")
    return out_dtype


def check_out_placement(out: torch.Tensor, expected: tuple, writes: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out`` has the ``expected`` shape (``writes`` says what the kernel writes), lives with ``a``, shares no
    memory with ``a`` or ``b`` and is row-major."""
    if tuple(out.shape) != expected:
        raise OutputError(f"out has shape {tuple(out.shape)}; {writes}")
    if out.device != a.device:
        raise OutputError(f"out is on {out.device} but the operands are on {a.device}")
    check_outputs_apart((("out", out),), (("a", a), ("b", b)))
    if out.numel() and out.stride(-1) != 1 and out.size(-1) > 1:
        raise OutputError(f"out has strides {tuple(out.stride())}; it must be row-major (last stride 1)")


def check_d_rows(out3: torch.Tensor | None, n: int, out_dtype: torch.dtype) -> torch.Tensor | None:
    """D's rows must suit TMA stores: ``out``'s strides (returned normalized), or a new D's N."""
    if out3 is not None:
        return _check_tma_strides(out3, "out", 2, "LMN")
    d_step = TMA_ALIGN_BYTES // torch.empty((), dtype=out_dtype).element_size()
    if n % d_step:
        raise AlignmentError(
            f"N={n} is not a multiple of {d_step}: the {out_dtype} output's rows would not be "
            f"16-byte aligned for TMA; pad N to {-(-n // d_step) * d_step}"
        )
    return None
