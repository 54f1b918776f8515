"""Checking grouped-GEMM arguments before anything is planned or launched (each error names the
argument and the fix; nothing is copied behind the user's back).

The offsets live on the GPU, so their values are checked only where that is cheap: when the
caller passes them on the CPU (they are then copied to the GPU once per call), or with
``check_offsets=True`` (one device-to-host read: a sync). Unchecked offsets that decrease or
pass ``total_M`` cannot make the kernel write outside ``out``: it clamps every group's rows to
``[0, total_M]`` and an empty group when they decrease (see
:class:`~epicute.sm90.tile_scheduler.GroupedTileScheduler`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epicute.epilogue.dtypes import TORCH_TO_IR
from epicute.epilogue.gated import check_gated_columns
from epicute.epilogue.scales import BLOCK_K, BlockScales, grouped_block_scales, ragged_k_block_scales
from epicute.errors import AlignmentError, DeviceError, DtypeError, EpilogueError, ShapeError
from epicute.gemm.validate import (
    FP8_TORCH_DTYPES,
    TMA_ALIGN_BYTES,
    _check_tma_strides,
    _major,
    check_d_rows,
    check_out_placement,
    resolve_out_dtype,
)
from epicute.grouped.plan import GroupedProblem
from epicute.runtime.checks import check_on_one_hopper_gpu

#: The most rows a grouped GEMM takes: the ragged store's coordinates (total_M - rows_g + i, and the
#: group's end one mode further) are int32.
MAX_TOTAL_ROWS = 2**30


@dataclass
class GroupedCall:
    """Validated operands: A ``(1, total_M, K)``, B ``(G, K, N)``, int32 offsets ``(G,)`` on A's device,
    ``out`` ``(1, total_M, N)`` or None; fp8 inputs' blockwise scales (A's ``(1, total_M, KB)``)."""

    problem: GroupedProblem
    a: torch.Tensor
    b: torch.Tensor
    offsets: torch.Tensor
    out: torch.Tensor | None
    out_dtype: torch.dtype
    block_scales: BlockScales | None = None
    #: gathered rows: int32 ``(total_M,)`` on A's device, A being the ``(1, T, K)`` rows gathered from
    a_index: torch.Tensor | None = None


def check_offsets_values(offsets: torch.Tensor, total: int, what: str = "row", multiple_of: int = 1) -> None:
    """Offsets must be group ends: non-decreasing, non-negative, the last one at most ``total`` (``total_M`` rows or
    ``total_K`` K rows: ``what``; the rows past it belong to no group), each a multiple of ``multiple_of``; reads
    them, a sync when they are on the GPU."""
    values = offsets.tolist()
    for g, value in enumerate(values):
        if value % multiple_of:
            raise ShapeError(
                f"offsets[{g}] = {value} is not a multiple of {multiple_of}: fp8 variable K sums whole 128-wide "
                "blocks of K, so every group must start and end on one; pad each group's rows with zeros to a "
                "multiple of 128 (zero rows add nothing to its D)"
            )
    if values and values[0] < 0:
        raise ShapeError(f"offsets[0] = {values[0]} is negative; offsets are each group's end {what}")
    for g in range(1, len(values)):
        if values[g] < values[g - 1]:
            raise ShapeError(
                f"offsets decrease at group {g} ({values[g - 1]} -> {values[g]}); they are cumulative group ends, "
                f"e.g. torch.cumsum(group_sizes, 0, dtype=torch.int32), with the {what}s sorted by group"
            )
    # Rows (or K rows) past the last group belong to none: a buffer with room for padded groups.
    if values and values[-1] > total:
        name = "total_M" if what == "row" else "total_K"
        raise ShapeError(
            f"offsets[-1] = {values[-1]} but there are {name} = {total} {what}s; the last group must end at or before "
            f"{name} (offsets are cumulative group ends: torch.cumsum(group_sizes, 0, dtype=torch.int32))"
        )


def _checked_offsets(offsets, groups: int, total: int, device, check_offsets: bool, what: str,
                     multiple_of: int = 1) -> torch.Tensor:  # fmt: skip
    """``offsets`` checked (dtype, shape; values where cheap) and on ``device``, contiguous."""
    if offsets.dtype != torch.int32:
        raise DtypeError(f"offsets has dtype {offsets.dtype}; pass int32 group ends (offsets.to(torch.int32))")
    if tuple(offsets.shape) != (groups,):
        hint = ""
        if tuple(offsets.shape) == (groups + 1,):
            first = int(offsets[0]) if offsets.device.type == "cpu" else None  # never a sync
            hint = (
                " (a (G + 1,) tensor starting at 0 is quack's cu_seqlens form: pass offsets[1:])" if first is None
                else " (it starts at 0: that is quack's cu_seqlens form, pass offsets[1:])" if first == 0
                else f" (it has one entry too many: b has {groups} groups, one end {what} each)"
            )  # fmt: skip
        raise ShapeError(f"offsets has shape {tuple(offsets.shape)}; it must be ({groups},), each group's end {what}, "
                         f"as torch._grouped_mm takes it{hint}")  # fmt: skip
    if offsets.device.type == "cpu" or check_offsets:
        check_offsets_values(offsets, total, what, multiple_of)
    if offsets.device != device:
        if offsets.device.type != "cpu":
            raise DeviceError(f"offsets is on {offsets.device} but a is on {device}; move it there")
        return offsets.to(device, non_blocking=True)
    if offsets.stride(0) != 1 and groups > 1:
        return offsets.contiguous()
    return offsets


#: Variable K's operand majors, 16-bit and fp8: (a's, b's, why, a's fix, b's fix). 16-bit: groups start at any K row,
#: and a TMA box may start there only along a strided dimension. fp8: WGMMA reads 8-bit operands K-major only, so
#: groups lie on 128-row blocks of K instead (the offsets' check), where no clipping is needed.
_RAGGED_K_MAJORS = {
    False: ("m", "n",
            ("with variable K each group's K rows start anywhere, which TMA can read only along a strided "
             "dimension"),
            "pass a as x.t() of a row-major (total_K, M) x", "pass a row-major (total_K, N) b (b.contiguous())"),
    True: ("k", "k", "WGMMA reads 8-bit operands K-major only",
           "pass a row-major (M, total_K) a (the transposed tokens, e.g. epicute.quantize(x, transpose=True))",
           "pass b as t.t() of a row-major (N, total_K) t"),
}  # fmt: skip


def _check_ragged_k(a, b, offsets, out, out_dtype, check_offsets: bool, gated: bool, scales: tuple) -> GroupedCall:
    """Variable K: ``D[g] = a[:, rows of g] @ b[rows of g, :]`` with a ``(M, total_K)``, b ``(total_K, N)``, majors
    as :data:`_RAGGED_K_MAJORS` says: 16-bit a M-major (``x.t()`` of a row-major ``(total_K, M)`` x) and b
    row-major; fp8 both K-major (the tile quantizer's transposed tokens, and ``t.t()`` of a row-major
    ``(N, total_K)`` t) with blockwise scales over the whole K, every group starting and ending on a 128-row block
    of K (checked where the offsets are read; the kernel gives NaN for a group that does not)."""
    m, total_k = a.shape
    kb, n = b.shape
    if kb != total_k:
        raise ShapeError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's K={total_k} != b's K={kb}")
    if total_k >= MAX_TOTAL_ROWS:
        raise ShapeError(f"a has K = {total_k}; the variable-K grouped GEMM takes fewer than {MAX_TOTAL_ROWS}")
    groups = offsets.shape[0] if offsets.dim() == 1 else 0
    if groups == 0:
        raise ShapeError(f"offsets has shape {tuple(offsets.shape)}; variable K takes (G,) group ends, G >= 1")
    if gated:  # a weight gradient's columns are one projection's: nothing pairs gate and up there
        raise EpilogueError("gated=True with a 2-D b (variable K): gated epilogues pair the columns of grouped "
                            "projections (b (G, K, 2N)); compute weight gradients without gated")  # fmt: skip
    fp8 = a.dtype in FP8_TORCH_DTYPES
    offsets = _checked_offsets(offsets, groups, total_k, a.device, check_offsets, "K row", BLOCK_K if fp8 else 1)
    if fp8 and total_k % TMA_ALIGN_BYTES:
        raise AlignmentError(f"K = {total_k} with fp8 inputs: TMA moves 16-byte rows of A and B, so the total K must "
                             "be a multiple of 16 (groups of 128-row blocks make it one)")  # fmt: skip
    a_major, b_major, why, a_fix, b_fix = _RAGGED_K_MAJORS[fp8]
    a3, b3 = a.unsqueeze(0), b.unsqueeze(0)
    if total_k > 1 and m > 1 and _major(a3, "a", "k", "m") != a_major:
        raise AlignmentError(f"a has strides {tuple(a.stride())}: {why}: {a_fix}")
    if total_k > 1 and n > 1 and _major(b3, "b", "n", "k") != b_major:
        raise AlignmentError(f"b has strides {tuple(b.stride())}: {why}: {b_fix}")
    block_scales = ragged_k_block_scales(scales[0], scales[1], m, n, total_k, a.device) if fp8 else None
    # fp8 inputs give bf16 by default: an fp8 D would drop what the scales carry.
    out_dtype = resolve_out_dtype(out, out_dtype, torch.bfloat16 if fp8 else a.dtype)
    if out is not None:
        check_out_placement(out, (groups, m, n), f"the variable-K grouped GEMM writes {(groups, m, n)}", a, b)
    b_dtype = TORCH_TO_IR[b.dtype] if b.dtype != a.dtype else ""
    problem = GroupedProblem(m, n, total_k, groups, TORCH_TO_IR[a.dtype], TORCH_TO_IR[out_dtype], a_major, b_major,
                             False, "k", b_dtype=b_dtype, block_scaled=fp8)  # fmt: skip
    if m and n and total_k:
        a3 = _check_tma_strides(a3, "a", 2 if a_major == "k" else 1, "LMK")
        b3 = _check_tma_strides(b3, "b", 2 if b_major == "n" else 1, "LKN")
    if m and n:
        out = check_d_rows(out, n, out_dtype)
    return GroupedCall(problem, a3, b3, offsets, out, out_dtype, block_scales)


def check_grouped_args(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    check_offsets: bool = False,
    require_cuda: bool = True,
    gated: bool = False,
    a_scale: Any = None,
    b_scale: Any = None,
    a_index: Any = None,
) -> GroupedCall:
    """Validate a grouped GEMM call and describe it as a :class:`GroupedProblem` (``gated``: B interleaves gate and
    up columns, D has half of them; ``a_scale``/``b_scale``: fp8 inputs' blockwise scales; ``a_index``: the rows
    of ``a`` each grouped row reads). A call like one already validated (:func:`_signature`) is not checked again."""
    signature = _signature(a, b, offsets, out, out_dtype, check_offsets, require_cuda, gated, a_scale, b_scale, a_index)
    scales = (a_scale, b_scale)
    if signature is not None:
        checked = _CHECKED.get(signature)
        if checked is not None:
            return checked.bind(a, b, offsets, a_index, scales)
    call = _check_grouped_args(a, b, offsets, out, out_dtype, check_offsets=check_offsets, require_cuda=require_cuda,
                               gated=gated, a_scale=a_scale, b_scale=b_scale, a_index=a_index)  # fmt: skip
    if signature is not None:
        checked = _Checked.of(call, a, b, offsets, a_index, scales)
        if checked is not None:
            if len(_CHECKED) >= 1024:  # a model makes a few dozen kinds of calls: forget the oldest
                del _CHECKED[next(iter(_CHECKED))]
            _CHECKED[signature] = checked
    return call


def _signature(a, b, offsets, out, out_dtype, check_offsets, require_cuda, gated, a_scale, b_scale, a_index):
    """What every check of a GPU call without ``out`` (offsets and ``a_index`` as the kernel reads them; fp8 scales as
    tensors) depends on: each tensor's shape, strides, dtype, device and base alignment; None for any other call
    (each is checked in full)."""
    if out is not None or check_offsets or not require_cuda:
        return None
    scales = () if a_scale is None and b_scale is None else (a_scale, b_scale)
    tensors = (a, b, offsets, *((a_index,) if a_index is not None else ()), *scales)
    if not all(type(t) is torch.Tensor for t in tensors):
        return None
    return (out_dtype, gated, a_index is None, bool(scales)) + tuple(
        (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % TMA_ALIGN_BYTES) for t in tensors
    )


def _same_storage(view: torch.Tensor, given: torch.Tensor) -> bool:
    return (view.storage_offset() == given.storage_offset()
            and view.untyped_storage().data_ptr() == given.untyped_storage().data_ptr())  # fmt: skip


@dataclass(frozen=True)
class _Checked:
    """A validated call's problem and its operands' layouts as the kernel reads them (fp8 scales' too), for new
    tensors of the same signature: views of them with the same storage offsets (offsets and ``a_index``
    themselves)."""

    problem: GroupedProblem
    out_dtype: torch.dtype
    #: (shape, stride) of A, B, and A's and B's blockwise scales (fp8) as the kernel reads them
    layouts: tuple

    @staticmethod
    def of(call: GroupedCall, a, b, offsets, a_index, scales: tuple) -> _Checked | None:
        """None where the call's operands are not views of the arguments as given (a copy was made)."""
        views = [(call.a, a), (call.b, b)]
        if call.block_scales is not None:
            views += [(call.block_scales.a, scales[0]), (call.block_scales.b, scales[1])]
        same = call.offsets is offsets and call.a_index is a_index
        if not same or call.out is not None or not all(_same_storage(v, t) for v, t in views):
            return None
        return _Checked(call.problem, call.out_dtype, tuple((v.shape, v.stride()) for v, _ in views))

    def bind(self, a, b, offsets, a_index, scales: tuple) -> GroupedCall:
        bound = [t.as_strided(*layout) for t, layout in zip((a, b, *scales), self.layouts)]
        block_scales = BlockScales(*bound[2:]) if len(bound) == 4 else None
        return GroupedCall(self.problem, bound[0], bound[1], offsets, None, self.out_dtype, block_scales, a_index)


_CHECKED: dict[tuple, _Checked] = {}


def _check_grouped_args(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    *,
    check_offsets: bool,
    require_cuda: bool,
    gated: bool,
    a_scale: Any,
    b_scale: Any,
    a_index: Any,
) -> GroupedCall:
    for name, t in (("a", a), ("b", b), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise DtypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if require_cuda:
        check_on_one_hopper_gpu(("a", a), ("b", b))
    fp8 = a.dtype in FP8_TORCH_DTYPES
    if fp8:
        if b.dtype not in FP8_TORCH_DTYPES:
            raise DtypeError(f"b has dtype {b.dtype} but a has {a.dtype}; fp8 inputs take an fp8 b (e4m3 or e5m2)")
    elif a.dtype not in (torch.bfloat16, torch.float16):
        raise DtypeError(
            f"a has dtype {a.dtype}; the grouped GEMM takes torch.bfloat16, torch.float16, or fp8 "
            "(torch.float8_e4m3fn/float8_e5m2) with blockwise a_scale and b_scale"
        )
    elif b.dtype != a.dtype:
        raise DtypeError(f"b has dtype {b.dtype} but a has {a.dtype}; cast one so that they match")
    elif a_scale is not None or b_scale is not None:
        raise DtypeError(f"a_scale/b_scale dequantize fp8 inputs; a is {a.dtype}: drop them or pass fp8 tensors")
    if a.dim() != 2:
        raise ShapeError(f"a has shape {tuple(a.shape)}; a grouped GEMM takes a 2-D (total_M, K), rows sorted by group")
    if b.dim() == 2:
        if a_index is not None:
            raise ShapeError(
                f"a_index with a 2-D b {tuple(b.shape)} (variable K): gathered rows are the rows of a (total_M, K) "
                "that a 3-D b's groups multiply; with variable K the groups split a's K columns, which a_index "
                "cannot gather: drop it, and gather the tokens first (a = x[a_index].t() for a = x.t())"
            )
        return _check_ragged_k(a, b, offsets, out, out_dtype, check_offsets, gated, (a_scale, b_scale))
    if b.dim() != 3:
        raise ShapeError(f"b has shape {tuple(b.shape)}; a grouped GEMM takes a 3-D (G, K, N), one (K, N) per group "
                         "(w.transpose(-2, -1) of a (G, N, K) weight works without a copy), or a 2-D (total_K, N) "
                         "whose rows the groups split (variable K)")  # fmt: skip
    total_m, k = a.shape
    groups, kb, n = b.shape
    if a_index is not None:
        a_index = _checked_a_index(a_index, a, check_offsets)
        total_m = a_index.numel()
    if kb != k:
        raise ShapeError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's K={k} != b's K={kb}")
    if groups == 0:
        raise ShapeError("b has G = 0 groups; a grouped GEMM needs at least one")
    if total_m >= MAX_TOTAL_ROWS:
        raise ShapeError(f"a has {total_m} rows; the grouped GEMM takes fewer than {MAX_TOTAL_ROWS}")
    offsets = _checked_offsets(offsets, groups, total_m, a.device, check_offsets, "row")

    # fp8 inputs give bf16 by default: an fp8 D would drop what the scales carry.
    out_dtype = resolve_out_dtype(out, out_dtype, torch.bfloat16 if fp8 else a.dtype)
    a3, b3 = a.unsqueeze(0), b
    a_major = _major(a3, "a", "k", "m")
    b_major = _major(b3, "b", "n", "k")
    block_scales = None
    if fp8:
        if k % TMA_ALIGN_BYTES:
            raise AlignmentError(
                f"K={k} with fp8 inputs: TMA moves 16-byte rows of A and B, so K must be a multiple of 16; pad K to "
                f"{-(-k // TMA_ALIGN_BYTES) * TMA_ALIGN_BYTES} with zeros"
            )
        if k and n > 1 and b_major != "k":
            raise AlignmentError(
                f"fp8 b has strides {tuple(b.stride())}: row-major (N contiguous), but WGMMA reads 8-bit operands "
                "K-major only; pass b as w.transpose(-2, -1) of a row-major (G, N, K) weight"
            )
        b_major = "k"
        # Gathered rows: A's scales are per token of a, read through the same index.
        block_scales = grouped_block_scales(a_scale, b_scale, a.shape[0] if a_index is not None else total_m, n, k,
                                            groups, a.device)  # fmt: skip
    chunk = TMA_ALIGN_BYTES // a.element_size()
    if a_index is not None and (a_major != "k" or k % chunk):
        raise AlignmentError(
            f"a has shape {tuple(a.shape)} and strides {tuple(a.stride())}: gathered rows are copied in 16-byte "
            f"chunks, so a must be row-major (a.contiguous()) with K a multiple of {chunk}"
        )
    if a_major == "m" and k > 1:
        # Groups start at any row, and a TMA box may start only 16-byte aligned along the contiguous dimension.
        raise AlignmentError(
            f"a has strides {tuple(a.stride())}: column-major (M contiguous), but a grouped GEMM reads each group's "
            "rows from wherever it starts, which TMA can do only along a strided dimension: pass a row-major a "
            "(a.contiguous())"
        )
    d_n = check_gated_columns(n, "b", gated)
    out3 = None
    if out is not None:
        check_out_placement(out, (total_m, d_n), f"the grouped GEMM writes {(total_m, d_n)}", a, b)
        out3 = out.unsqueeze(0)
    problem = GroupedProblem(
        total_m, n, k, groups, TORCH_TO_IR[a.dtype], TORCH_TO_IR[out_dtype], a_major, b_major, gated,
        b_dtype=TORCH_TO_IR[b.dtype] if b.dtype != a.dtype else "", block_scaled=fp8, gathered=a_index is not None,
    )  # fmt: skip
    if total_m and n and k:
        a3 = _check_tma_strides(a3, "a", 2 if a_major == "k" else 1, "LMK")
        b3 = _check_tma_strides(b3, "b", 2 if b_major == "n" else 1, "GKN")
        out3 = check_d_rows(out3, d_n, out_dtype)
    return GroupedCall(problem, a3, b3, offsets, out3, out_dtype, block_scales, a_index)


def check_a_index_values(a_index: torch.Tensor, rows: int) -> None:
    """Every index names one of ``a``'s ``rows`` (reads the index: a sync when it is on the GPU)."""
    if a_index.numel():
        low, high = int(a_index.min()), int(a_index.max())
        if low < 0 or high >= rows:
            raise ShapeError(f"a_index holds {low if low < 0 else high}, outside a's {rows} rows; indices must be in "
                             f"[0, {rows})")  # fmt: skip


def _checked_a_index(a_index: Any, a: torch.Tensor, check_offsets: bool) -> torch.Tensor:
    """``a_index`` checked (type, dtype, shape; values where cheap: on the CPU, or with ``check_offsets``) and
    as the kernel reads it: int32, contiguous, on ``a``'s device. An int64 index (what ``argsort`` returns)
    is narrowed, one small copy."""
    if not isinstance(a_index, torch.Tensor):
        raise DtypeError(f"a_index must be a torch.Tensor of row indices into a, got {type(a_index).__name__}")
    if a_index.dtype not in (torch.int32, torch.int64):
        raise DtypeError(f"a_index has dtype {a_index.dtype}; pass int32 (or int64) row indices into a")
    if a_index.dim() != 1:
        raise ShapeError(f"a_index has shape {tuple(a_index.shape)}; it must be 1-D (total_M,): the row of a that "
                         "each grouped row reads, sorted by group")  # fmt: skip
    if a_index.numel() >= MAX_TOTAL_ROWS:
        raise ShapeError(f"a_index has {a_index.numel()} rows; the grouped GEMM takes fewer than {MAX_TOTAL_ROWS}")
    if a_index.numel() and not a.shape[0]:
        raise ShapeError(f"a_index has {a_index.numel()} rows but a has none to gather them from")
    if check_offsets or a_index.device.type == "cpu":
        check_a_index_values(a_index, a.shape[0])
    if a_index.device != a.device and a_index.device.type != "cpu":
        raise DeviceError(f"a_index is on {a_index.device} but a is on {a.device}; move it there")
    return a_index.to(a.device, torch.int32, non_blocking=True).contiguous()


__all__ = ["MAX_TOTAL_ROWS", "GroupedCall", "check_a_index_values", "check_grouped_args", "check_offsets_values"]
