"""Checking ``epicute.attention`` arguments before anything is compiled or launched.

Q, K, V are ``(batch, seqlen, heads, head_dim)`` like flash-attn. TMA loads them
one ``(tile, head_dim)`` box at a time, so head_dim must be contiguous and every
other stride 16-byte aligned; WGMMA takes bf16/fp16; the kernel is compiled
for head_dim 64/128/256 and for ``heads_q`` a multiple of ``heads_kv`` (GQA/MQA).
Each error names the argument and the fix; nothing is copied behind the user's back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epicute.attention.plan import HEAD_DIMS, AttentionProblem
from epicute.epilogue.dtypes import TORCH_TO_IR
from epicute.errors import AlignmentError, ConfigError, DtypeError, OutputError, ShapeError
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


def _check_strides(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1 and t.size(-1) > 1:
        raise AlignmentError(
            f"{name} has strides {tuple(t.stride())}: head_dim (the last dimension) must be contiguous for TMA; "
            f"pass {name}.contiguous()"
        )
    if t.data_ptr() % TMA_ALIGN_BYTES:
        raise AlignmentError(
            f"{name}.data_ptr() is {t.data_ptr() % TMA_ALIGN_BYTES} bytes past a 16-byte boundary; "
            f"TMA needs 16-byte-aligned bases: pass {name}.clone()"
        )
    step = TMA_ALIGN_BYTES // t.element_size()
    for d, dim in enumerate(("batch", "seqlen", "heads")):
        if t.size(d) > 1 and t.stride(d) % step:
            raise AlignmentError(
                f"{name} stride {t.stride(d)} along {dim} is not a multiple of {step} elements (16 bytes), "
                f"which TMA needs; pass {name}.contiguous()"
            )


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    out: torch.Tensor | None = None,
    require_cuda: bool = True,
) -> AttentionCall:
    """Validate ``attention(q, k, v)`` and describe it as an :class:`AttentionProblem`."""
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
    if k.size(0) != batch:
        raise ShapeError(f"k has batch {k.size(0)} but q has {batch}")
    if k.size(3) != head_dim:
        raise ShapeError(f"k has head_dim {k.size(3)} but q has {head_dim}; they must match")
    if head_dim not in HEAD_DIMS:
        raise ShapeError(f"head_dim={head_dim} is not supported; use one of {HEAD_DIMS}")
    seqlen_k, heads_kv = k.size(1), k.size(2)
    if heads_kv == 0 or heads_q % heads_kv:
        raise ShapeError(
            f"q has {heads_q} heads and k/v have {heads_kv}: heads_q must be a multiple of heads_kv (GQA/MQA)"
        )
    if seqlen_k == 0 and seqlen_q > 0:
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
        head_dim=head_dim, dtype=TORCH_TO_IR[q.dtype], causal=bool(causal),
    )  # fmt: skip
    call = AttentionCall(problem, q, k, v, float(softmax_scale))
    if out is not None:
        check_attention_out(call, out, q.dtype)
    return call


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
