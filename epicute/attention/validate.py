"""Checking ``epicute.attention`` arguments before anything is compiled or launched.

Q, K, V are ``(batch, seqlen, heads, head_dim)`` like flash-attn. TMA loads them
one ``(tile, head_dim)`` box at a time, so head_dim must be contiguous and every
other stride 16-byte aligned; WGMMA takes bf16/fp16; the kernel is compiled
for head_dim 64/128/256 and for ``heads_q`` a multiple of ``heads_kv`` (GQA/MQA).
A paged cache ``(num_pages, page_size, heads_kv, head_dim)`` comes with an int32
``page_table`` ``(batch, pages per sequence)``; ``seqused_k`` is int32 ``(batch,)``.
Variable-length batches are packed as flash-attn's varlen functions take them: Q, K, V
``(total, heads, head_dim)`` with int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``(batch + 1,)``
(sequence ``b`` is rows ``cu[b]`` to ``cu[b + 1]``) and the longest lengths ``max_seqlen_q/k``.
Each error names the argument and the fix; nothing is copied behind the user's back.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass, replace

import torch

from epicute.attention.fp8 import check_no_descales, descales, padded_keys, stored_dtype
from epicute.attention.plan import HEAD_DIMS, AttentionProblem
from epicute.epilogue.dtypes import IR_TO_TORCH, TORCH_TO_IR
from epicute.errors import AlignmentError, ConfigError, DeviceError, DtypeError, OutputError, ShapeError
from epicute.runtime.checks import TMA_ALIGN_BYTES, check_on_one_hopper_gpu, check_outputs_apart

ATTN_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
#: The softmax scales the kernels take: positive normal float32 values.
FLOAT32_NORMAL_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


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
    #: int32 ``(batch + 1,)`` each, packed variable-length sequences (``problem.varlen``)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    #: fp8 inputs' descales, Q's, K's and V's, fp32 ``(batch, heads_kv)`` each (epicute.attention.fp8), else None
    descales: tuple | None = None
    #: fp8 v already in the kernel's value layout (``v_layout="slots"``), read as it is
    v_slots: bool = False

    def rebound(self, q, k, v, page_table, seqused_k, cu_seqlens_q, cu_seqlens_k) -> AttentionCall:
        """This validated call over other tensors of the same layouts (a repeat call's), nothing rechecked. Made
        without ``__init__``: ``dataclasses.replace`` would rerun it, which cost more than the rest of the binding."""
        call = object.__new__(AttentionCall)
        call.__dict__.update(self.__dict__, q=q, k=k, v=v, page_table=page_table, seqused_k=seqused_k,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)  # fmt: skip
        return call


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
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    v_layout: str = "bshd",
) -> AttentionCall:
    """Validate ``attention(q, k, v)`` and describe it as an :class:`AttentionProblem`.

    With ``page_table``, K and V are a paged cache ``(num_pages, page_size, heads_kv, head_dim)``
    and sequence ``b``'s keys are pages ``page_table[b, :]`` in order (flash-attn's convention);
    ``seqused_k`` (int32 ``(batch,)``) limits each sequence to its first keys. Their values are not
    read here (that would wait for the GPU): entries out of range read zeros, not other memory.

    Packed (``cu_seqlens_q``/``cu_seqlens_k``): see :func:`_check_packed`; the problem's batch is the
    number of sequences and its seqlens are the longest ones. fp8 (float8_e4m3fn) q, k, v take descales
    (:func:`epicute.attention.fp8.descales`), and v may come in the kernel's value layout (``v_layout="slots"``)."""
    scales = (q_descale, k_descale, v_descale)
    if v_layout not in ("bshd", "slots"):
        raise ConfigError(f"v_layout={v_layout!r}: pass 'bshd' (v like k) or 'slots' (fp8 v in the value layout of "
                          "epicute.attention.fp8.value_layout)")  # fmt: skip
    slots = v_layout == "slots"
    if slots and (cu_seqlens_q is not None or cu_seqlens_k is not None):
        raise ConfigError("v_layout='slots' with cu_seqlens: pass packed v as it is (v_layout='bshd'); the call lays "
                          "it out")  # fmt: skip
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _check_packed(
            q, k, v, causal, softmax_scale, out, require_cuda, page_table, seqused_k,
            (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k), scales,
        )  # fmt: skip
    if max_seqlen_q is not None or max_seqlen_k is not None:
        raise ConfigError("max_seqlen_q/max_seqlen_k go with cu_seqlens_q and cu_seqlens_k (packed sequences)")
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
        raise DtypeError(
            f"q has dtype {q.dtype}; supported are torch.bfloat16, torch.float16 and torch.float8_e4m3fn (with "
            "q_descale, k_descale, v_descale)"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise DtypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; cast them to one dtype")
    batch, seqlen_q, heads_q, head_dim = q.shape
    if slots:
        _check_value_slots(v, k, page_table is not None)
    elif k.shape != v.shape:
        raise ShapeError(_kv_mismatch(k, v, page_table is not None))
    check_no_descales(TORCH_TO_IR[q.dtype], q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    page_size = 0
    if page_table is not None:
        if q.dtype == torch.float8_e4m3fn and not slots:
            raise ConfigError(
                "page_table= with fp8 q, k, v: a paged fp8 cache keeps its values in the kernel's value layout; pass "
                "them with v_layout='slots' (epicute.nn.PagedKVCache(..., dtype=torch.float8_e4m3fn) stores them so)"
            )
        page_size = _check_page_table(page_table, q, k)
        if q.dtype == torch.float8_e4m3fn and page_size % 32:
            raise ShapeError(f"fp8 k and v have pages of {page_size} keys; fp8 attention reads whole pages of a "
                             "multiple of 32 keys (its PV WGMMA's K): use page_size 32, 64, 128 or 256")  # fmt: skip
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
    elif not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool) or not (
        FLOAT32_NORMAL_RANGE[0] <= softmax_scale <= FLOAT32_NORMAL_RANGE[1]
    ):
        # The kernels scale scores in float32 and mask with -inf: a scale that is 0, subnormal or inf there
        # would turn masked scores into NaN.
        raise ConfigError(
            f"softmax_scale={softmax_scale!r}: must be a positive number that float32 holds as a normal value "
            f"({FLOAT32_NORMAL_RANGE[0]:.3g} to {FLOAT32_NORMAL_RANGE[1]:.3g}; default head_dim ** -0.5)"
        )
    if q.numel():
        for name, t in (("q", q), ("k", k), ("v", v)) if not slots else (("q", q), ("k", k)):
            _check_strides(t, name)
    problem = AttentionProblem(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv,
        head_dim=head_dim, dtype=TORCH_TO_IR[q.dtype], causal=bool(causal), page_size=page_size,
        seqused_k=seqused_k is not None,
    )  # fmt: skip
    call = AttentionCall(problem, q, k, v, float(softmax_scale), page_table=page_table, seqused_k=seqused_k,
                         v_slots=slots)  # fmt: skip
    if q.dtype == torch.float8_e4m3fn:
        call.descales = descales(*scales, batch, heads_kv, q.device)
    if out is not None:
        check_attention_out(call, out, IR_TO_TORCH[stored_dtype(problem.dtype)])
    return call


def _check_value_slots(v, k: torch.Tensor, paged: bool) -> None:
    """fp8 ``v`` in the kernel's value layout (``v_layout="slots"``): k's dtype, ``(batch, padded keys, heads_kv,
    head_dim)`` (paged: k's page shape) with the slots contiguous and the other strides 16-byte aligned."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ShapeError("v_layout='slots': v must be a 4-D tensor (epicute.attention.fp8.value_layout's result)")
    if k.dtype != torch.float8_e4m3fn:
        raise ConfigError("v_layout='slots' is fp8 attention's value layout: pass float8_e4m3fn q, k, v")
    want = tuple(k.shape) if paged else (k.size(0), padded_keys(k.size(1)), k.size(2), k.size(3))
    if tuple(v.shape) != want:
        raise ShapeError(f"v_layout='slots': v is {tuple(v.shape)}, but k {tuple(k.shape)} needs {want} (keys padded "
                         "to a multiple of 16: epicute.attention.fp8.value_layout(v))")  # fmt: skip
    _, slots, heads, dim = v.shape
    # The layout value_layout and the cache make, strides of size-1 dimensions included: the TMA descriptor is built
    # from every stride (a packed batch's stride equal to head_dim's made one that trapped).
    canonical = (heads * dim * slots, 1, dim * slots, slots)
    if tuple(v.stride()) != canonical or v.data_ptr() % TMA_ALIGN_BYTES:
        raise AlignmentError(f"v_layout='slots': v has strides {tuple(v.stride())}; the value layout is a "
                             f"(batch, heads_kv, head_dim, slots) tensor seen as (batch, slots, heads_kv, head_dim), "
                             f"strides {canonical}, 16-byte aligned: pass epicute.attention.fp8.value_layout(v)")


def _kv_mismatch(k: torch.Tensor, v: torch.Tensor, paged: bool, packed: bool = False) -> str:
    """Why k and v, whose shapes differ, cannot be one call's keys and values, naming the dimension."""
    if packed:
        dims = ("total", "heads", "head_dim")
    elif paged:
        dims = ("num_pages", "page_size", "heads", "head_dim")
    else:
        dims = ("batch", "seqlen", "heads", "head_dim")
    d = next(i for i, (x, y) in enumerate(zip(k.shape, v.shape)) if x != y)
    what = {
        "head_dim": "v's head_dim must equal k's (head_dim_v = head_dim)",
        "seqlen": "every key needs its value: give v k's sequence length",
        "total": "every key needs its value: give v k's packed rows",
        "heads": "v must have k's heads_kv",
    }.get(dims[d], f"v must have k's {dims[d]}")
    shapes = f"k is {tuple(k.shape)} and v is {tuple(v.shape)}"
    return f"{shapes}: they differ in {dims[d]} ({k.size(d)} != {v.size(d)}); {what}"


def _check_packed(q, k, v, causal, softmax_scale, out, require_cuda, page_table, seqused_k, cu, max_seqlens, scales):
    """Packed sequences: Q ``(total_q, heads_q, d)``, K and V ``(total_k, heads_kv, d)``, int32 ``cu_seqlens_q``
    and ``cu_seqlens_k`` ``(batch + 1,)``. Q, K and V are checked as the ``(1, total, heads, d)`` tensors the
    kernel reads. ``max_seqlen_q/k`` bound the sequences' lengths; when not given they are read from
    ``cu_seqlens`` (one sync), and then the offsets' values are checked too. Given, nothing is read: an
    offset outside ``[0, total]`` is clamped in the kernel (a wrong sequence, never a stray access), and a
    sequence longer than ``max_seqlen_q`` leaves its rows past it unwritten, as in flash-attn."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise DtypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ShapeError(
                f"{name} has shape {tuple(t.shape)}; with cu_seqlens, attention takes packed (total, heads, "
                f"head_dim) tensors (flash-attn's varlen layout)"
            )
    if k.shape != v.shape:
        raise ShapeError(_kv_mismatch(k, v, False, packed=True))
    if page_table is not None or seqused_k is not None:
        raise ConfigError("cu_seqlens with page_table/seqused_k: packed sequences read contiguous K and V; pass "
                          "one or the other")  # fmt: skip
    names = ("cu_seqlens_q", "cu_seqlens_k")
    if cu[0] is None or cu[1] is None:
        raise ConfigError(f"pass both cu_seqlens_q and cu_seqlens_k (got only {names[cu[0] is None]})")
    if not isinstance(cu[0], torch.Tensor) or cu[0].dim() != 1 or cu[0].numel() < 1:
        raise ShapeError("cu_seqlens_q must be an int32 (batch + 1,) tensor of cumulative sequence starts")
    batch = cu[0].numel() - 1
    for name, t in zip(names, cu):
        _check_index_vector(t, name, (batch + 1,), q)
    call = check_attention_args(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=causal, softmax_scale=softmax_scale,
        require_cuda=require_cuda,
    )  # fmt: skip
    check_no_descales(call.problem.dtype, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    lengths = []
    for name, t, total, given in zip(names, cu, (q.size(0), k.size(0)), max_seqlens):
        if given is None:
            lengths.append(_packed_max_length(t, name, total))
        elif isinstance(given, bool) or not isinstance(given, int) or given < 0:
            raise ConfigError(f"max_seqlen_{name[-1]}={given!r}: pass the longest sequence's length, an int >= 0")
        elif given > total:  # no sequence is longer than the packed tensor; the kernel's grid is cut from it
            raise ConfigError(f"max_seqlen_{name[-1]}={given}, but the packed {name[-1]} has {total} rows, which no "
                              "sequence exceeds; pass the longest sequence's length")  # fmt: skip
        else:
            lengths.append(given)
    problem = replace(call.problem, batch=batch, seqlen_q=lengths[0], seqlen_k=lengths[1], varlen=True)
    call = AttentionCall(problem, q, k, v, call.softmax_scale, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    if q.dtype == torch.float8_e4m3fn:
        call.descales = descales(*scales, batch, k.size(1), q.device)
    if out is not None:
        check_attention_out(call, out, IR_TO_TORCH[stored_dtype(problem.dtype)])
    return call


def _packed_max_length(cu: torch.Tensor, name: str, total: int) -> int:
    """The longest sequence of ``cu`` (cumulative starts, checked: from 0, non-decreasing, ending at ``total``);
    reads the offsets (a sync when they are on the GPU)."""
    if cu.device.type == "meta":
        raise ConfigError(f"{name} is a meta tensor: pass max_seqlen_{name[-1]} (its values cannot be read)")
    values = check_packed_offsets(cu, name, total)
    return max((b - a for a, b in itertools.pairwise(values)), default=0)


def check_packed_offsets(cu: torch.Tensor, name: str, total: int) -> list[int]:
    """``cu``'s values (cumulative sequence starts), checked: from 0, non-decreasing, ending at the packed
    tensor's ``total`` rows. Reads them (a sync when they are on the GPU)."""
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        raise ShapeError(f"{name} runs from {values[0]} to {values[-1]}; it must run from 0 to the packed tensor's "
                         f"{total} rows (torch.cumsum of the lengths, with a 0 in front)")  # fmt: skip
    lengths = [b - a for a, b in itertools.pairwise(values)]
    if any(n < 0 for n in lengths):
        raise ShapeError(f"{name} decreases at sequence {next(i for i, n in enumerate(lengths) if n < 0)}; "
                         "it holds cumulative sequence starts")  # fmt: skip
    return values


def check_page_table_values(page_table: torch.Tensor, num_pages: int) -> None:
    """Every entry of ``page_table`` names one of the cache's ``num_pages`` pages (reads the table: a sync when it
    is on the GPU; the kernel never reads it on the host)."""
    if not page_table.numel():
        return
    bad = (page_table < 0) | (page_table >= num_pages)
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ShapeError(
            f"page_table[{b}, {i}] = {int(page_table[b, i])} is not a page of the cache: k and v hold {num_pages} "
            f"pages (dim 0 of the paged (num_pages, page_size, heads_kv, head_dim) cache), so entries must be in "
            f"[0, {num_pages})"
        )


def check_seqused_k_values(seqused_k: torch.Tensor, capacity: int, paged: bool) -> None:
    """Every sequence uses between 0 and ``capacity`` keys (k's seqlen, or a paged sequence's pages times the page
    size); reads ``seqused_k`` (a sync when it is on the GPU; the kernel never reads it on the host)."""
    bad = (seqused_k < 0) | (seqused_k > capacity)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        holds = "its pages in page_table times page_size" if paged else "k's seqlen"
        raise ShapeError(
            f"seqused_k[{b}] = {int(seqused_k[b])}, but a sequence holds 0 to {capacity} keys ({holds}); pass each "
            f"sequence's used keys, in [0, {capacity}]"
        )


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
    check_outputs_apart((("out", out),), (("q", q), ("k", call.k), ("v", call.v)))
    if out.numel():
        try:
            _check_strides(out.unsqueeze(0) if call.problem.varlen else out, "out")
        except AlignmentError as exc:
            raise OutputError(str(exc)) from exc
    call.out = out
