"""Checking ``epicute.attention`` arguments before anything is compiled or launched.

Q, K, V are ``(batch, seqlen, heads, head_dim)`` like flash-attn. TMA loads them
one ``(tile, head_dim)`` box at a time, so head_dim must be contiguous and every
other stride 16-byte aligned; WGMMA takes bf16/fp16; the kernel is compiled
for head_dim 64/128/256 and for ``heads_q`` a multiple of ``heads_kv`` (GQA/MQA).
A paged cache ``(num_pages, page_size, heads_kv, head_dim)`` comes with an int32
``page_table`` ``(batch, pages per sequence)``; ``seqused_k`` is int32 ``(batch,)``.
Each error names the argument and the fix; nothing is copied behind the user's back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epicute.attention.plan import HEAD_DIMS, AttentionProblem
from epicute.epilogue.dtypes import TORCH_TO_IR
from epicute.errors import AlignmentError, ConfigError, DeviceError, DtypeError, OutputError, ShapeError
from epicute.runtime.checks import TMA_ALIGN_BYTES, check_on_one_hopper_gpu, overlaps

ATTN_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class AttentionCall:
    problem: AttentionProblem
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    softmax_scale: float
    out: torch.Tensor | None = None
    #: int32 ``(batch, pages per sequence)`` when K and V are a paged cache
    page_table: torch.Tensor | None = None
    #: int32 ``(batch,)``: keys each sequence uses
    seqused_k: torch.Tensor | None = None


def tma_layout_problem(t: torch.Tensor, name: str) -> str | None:
    """Why TMA cannot read ``t`` as a ``(batch, seqlen, heads, head_dim)`` operand, with the fix, or None."""
    if t.stride(-1) != 1 and t.size(-1) > 1:
        return (
            f"{name} has strides {tuple(t.stride())}: head_dim (the last dimension) must be contiguous for TMA; "
            f"pass {name}.contiguous()"
        )
    if t.data_ptr() % TMA_ALIGN_BYTES:
        return (
            f"{name}.data_ptr() is {t.data_ptr() % TMA_ALIGN_BYTES} bytes past a 16-byte boundary; "
            f"TMA needs 16-byte-aligned bases: pass {name}.clone()"
        )
    step = TMA_ALIGN_BYTES // t.element_size()
    for d, dim in enumerate(("batch", "seqlen", "heads")):
        if t.size(d) > 1 and t.stride(d) % step:
            return (
                f"{name} stride {t.stride(d)} along {dim} is not a multiple of {step} elements (16 bytes), "
                f"which TMA needs; pass {name}.contiguous()"
            )
    return None


def _check_strides(t: torch.Tensor, name: str) -> None:
    problem = tma_layout_problem(t, name)
    if problem:
        raise AlignmentError(problem)


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    out: torch.Tensor | None = None,
    require_cuda: bool = True,
    page_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
) -> AttentionCall:
    """Validate ``attention(q, k, v)`` and describe it as an :class:`AttentionProblem`.

    With ``page_table``, K and V are a paged cache ``(num_pages, page_size, heads_kv, head_dim)``
    and sequence ``b``'s keys are pages ``page_table[b, :]`` in order (flash-attn's convention);
    ``seqused_k`` (int32 ``(batch,)``) limits each sequence to its first keys. Their values are not
    read here (that would wait for the GPU): entries out of range read zeros, not other memory."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise DtypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(
                f"{name} has shape {tuple(t.shape)}; attention takes 4-D (batch, seqlen, heads, head_dim) tensors"
            )
    if require_cuda:
        check_on_one_hopper_gpu(("q", q), ("k", k), ("v", v))
    if q.dtype not in ATTN_DTYPES:
        raise DtypeError(f"q has dtype {q.dtype}; supported are torch.bfloat16 and torch.float16")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise DtypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; cast them to one dtype")
    batch, seqlen_q, heads_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ShapeError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape (head_dim_v = head_dim)")
    page_size = 0
    if page_table is not None:
        page_size = _check_page_table(page_table, q, k)
    elif k.size(0) != batch:
        raise ShapeError(f"k has batch {k.size(0)} but q has {batch}")
    if seqused_k is not None:
        _check_index_vector(seqused_k, "seqused_k", (batch,), q)
    if k.size(3) != head_dim:
        raise ShapeError(f"k has head_dim {k.size(3)} but q has {head_dim}; they must match")
    if head_dim not in HEAD_DIMS:
        raise ShapeError(f"head_dim={head_dim} is not supported; use one of {HEAD_DIMS}")
    seqlen_k, heads_kv = k.size(1), k.size(2)
    if page_size:
        seqlen_k = page_size * page_table.size(1)  # a sequence's capacity
    if heads_kv == 0 or heads_q % heads_kv:
        raise ShapeError(
            f"q has {heads_q} heads and k/v have {heads_kv}: heads_q must be a multiple of heads_kv (GQA/MQA)"
        )
    if seqlen_k == 0 and seqlen_q > 0:
        if page_size:
            raise ShapeError("page_table has 0 pages per sequence: pass at least one page (seqused_k may be 0)")
        raise ShapeError("k and v have seqlen 0: softmax over no keys is undefined; pass at least one key")
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    elif not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ConfigError(f"softmax_scale={softmax_scale!r}: must be a positive number (default head_dim ** -0.5)")
    if q.numel():
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_strides(t, name)
    problem = AttentionProblem(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv,
        head_dim=head_dim, dtype=TORCH_TO_IR[q.dtype], causal=bool(causal), page_size=page_size,
        seqused_k=seqused_k is not None,
    )  # fmt: skip
    call = AttentionCall(problem, q, k, v, float(softmax_scale), page_table=page_table, seqused_k=seqused_k)
    if out is not None:
        check_attention_out(call, out, q.dtype)
    return call


#: Page sizes the paged kernel takes: a multiple of 16 keys (WGMMA's N step), at most 256.
MAX_PAGE_SIZE = 256


def _check_index_vector(t, name: str, shape: tuple[int, ...], q: torch.Tensor) -> None:
    """An int32 index tensor read by the kernel: ``shape``, on q's device."""
    if not isinstance(t, torch.Tensor):
        raise DtypeError(f"{name} must be an int32 torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise DtypeError(f"{name} has dtype {t.dtype}; it must be torch.int32 (pass {name}.int())")
    if tuple(t.shape) != shape:
        raise ShapeError(f"{name} has shape {tuple(t.shape)}; it must be {shape}")
    if t.device != q.device:
        raise DeviceError(f"{name} is on {t.device} but q is on {q.device}; move it to {q.device}")


def _check_page_table(page_table, q: torch.Tensor, k: torch.Tensor) -> int:
    """A paged call's page table against q and the ``(num_pages, page_size, heads_kv, head_dim)``
    cache; returns the page size."""
    if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
        got = tuple(page_table.shape) if isinstance(page_table, torch.Tensor) else type(page_table).__name__
        raise ShapeError(f"page_table is {got}; it must be an int32 (batch, pages per sequence) tensor")
    _check_index_vector(page_table, "page_table", (q.size(0), page_table.size(1)), q)
    page_size = k.size(1)
    if page_size % 16 or not 16 <= page_size <= MAX_PAGE_SIZE:
        raise ShapeError(
            f"k and v have pages of {page_size} keys (dim 1 of a paged (num_pages, page_size, heads_kv, head_dim) "
            f"cache); page sizes must be multiples of 16 in [16, {MAX_PAGE_SIZE}]"
        )
    return page_size


def check_attention_out(call: AttentionCall, out: torch.Tensor, dtype: torch.dtype) -> None:
    """``out`` may receive O: q's shape and device, O's stored ``dtype`` (q's, unless an epilogue's
    own final cast says otherwise), TMA-storable, sharing no memory with an input. Sets ``call.out``."""
    q = call.q
    if not isinstance(out, torch.Tensor):
        raise OutputError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != dtype or out.device != q.device:
        raise OutputError(
            f"out is {out.dtype} {tuple(out.shape)} on {out.device}; it must be O's: "
            f"{dtype} {tuple(q.shape)} on {q.device}"
        )
    for name, t in (("q", q), ("k", call.k), ("v", call.v)):
        if overlaps(out, t):
            raise OutputError(f"out shares memory with {name}; the kernel would read {name} while writing out")
    if out.numel():
        try:
            _check_strides(out, "out")
        except AlignmentError as exc:
            raise OutputError(str(exc)) from exc
    call.out = out
