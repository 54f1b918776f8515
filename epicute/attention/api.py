"""epicute's attention: :func:`attention` (FlashAttention-3 style forward) and :func:`explain_attention`.

Layout ``(batch, seqlen, heads, head_dim)`` as in flash-attn. Two traced hooks
share the epilogue language (:mod:`epicute.ops`):

- ``score_mod(score, b, h, q_idx, kv_idx, *operands)`` rewrites each scaled
  score ``q . k * softmax_scale`` before the softmax; operands are scalars or
  per-head vectors ``(heads_q,)`` (ALiBi slopes);
- ``epilogue(o, *operands)`` rewrites each element of the normalized output
  before it is stored; operands are scalars, ``(head_dim,)`` vectors or full
  ``(batch, seqlen_q, heads_q, head_dim)`` tiles. It is the GEMM's epilogue
  language with the GEMM's outputs: ``{"D": ...}`` plus aux tiles
  ``(batch, seqlen_q, heads_q, head_dim)``, reductions (``row_*`` over head_dim:
  ``(batch, heads_q, seqlen_q)``; ``col_*`` over the queries: ``(batch, heads_q,
  head_dim)``; ``amax``: 0-d) and fp8 outputs through ``ops.quantize``/``ops.cast``.

Operands are passed by name as keyword arguments and go to whichever hook
declares them.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

import torch

from epicute.attention.backward_plan import render_backward_plan
from epicute.attention.fp8 import descales as fp8_descales
from epicute.attention.fp8 import stored_dtype, values_of_slots
from epicute.attention.plan import AttentionPlan, render_attention_plan
from epicute.attention.prepare import Hook, prepare
from epicute.attention.torch_op import EagerAttention, attention_op_call
from epicute.attention.validate import (
    AttentionCall,
    check_attention_args,
    check_attention_out,
    check_packed_offsets,
    check_page_table_values,
    check_seqused_k_values,
)
from epicute.epilogue.dtypes import IR_TO_TORCH
from epicute.epilogue.reference import evaluate, round_to
from epicute.epilogue.score_mod import score_mod as as_score_mod
from epicute.epilogue.tracer import Epilogue, as_epilogue
from epicute.errors import ConfigError, ShapeError
from epicute.runtime.backend import resolve_backend
from epicute.runtime.checks import (
    PLAIN_TENSORS,
    TMA_ALIGN_BYTES,
    check_flags,
    check_has_values,
    check_one_device,
    check_operand_names,
    check_text_file,
    keyword_parameters,
)
from epicute.runtime.target import Target, resolve_target
from epicute.runtime.torch_ops import traced


def reference_attention(
    call: AttentionCall,
    score: Hook | None = None,
    epi: Hook | None = None,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    p_dtype: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every output (``"D"``: O ``(B, Sq, H, D)``, and the epilogue's others) and LSE ``(B, H, Sq)``,
    computed in ``compute_dtype`` on ``device`` (the CPU by default; GPU tests use the GPU with TF32
    off for speed): what the kernel must return. Tile outputs are stored in ``out_dtype`` if given,
    else in their own dtype (fp8 saturating); reductions are fp32.

    Fully masked rows (causal with seqlen_q > seqlen_k, or seqused_k 0) give O = 0 and LSE = -inf,
    as flash-attn does. A paged cache is gathered through the page table first; with seqused_k,
    sequence b's keys past seqused_k[b] are masked and its causal diagonal ends at its last used key.
    Packed sequences (varlen) are computed one by one: O ``(total_q, H, D)`` and LSE ``(H, total_q)``.
    ``p_dtype``: round P (at each row's maximum) to it before ``P V``, the row sums kept unrounded: the
    fp8 kernel's rounding of P, for tests that size its error.
    """
    if call.problem.varlen:
        return _reference_packed(call, score, epi, compute_dtype, out_dtype, device, p_dtype)
    return _reference_dense(call, score, epi, compute_dtype, out_dtype, device, p_dtype=p_dtype)


def _reference_packed(call, score, epi, compute_dtype, out_dtype, device, p_dtype=None):
    """:func:`reference_attention` of packed sequences: each one a batch of one (its ``b`` index kept)."""
    p = call.problem
    # The kernels clamp offsets they do not read; the reference reads them, so it checks them.
    cu_q = check_packed_offsets(call.cu_seqlens_q, "cu_seqlens_q", call.q.size(0))
    cu_k = check_packed_offsets(call.cu_seqlens_k, "cu_seqlens_k", call.k.size(0))
    for name, cu, longest in (("q", cu_q, p.seqlen_q), ("k", cu_k, p.seqlen_k)):
        b, length = max(enumerate(y - x for x, y in itertools.pairwise(cu)), key=lambda bl: bl[1], default=(0, 0))
        if length > longest:  # the kernel would leave the rows past max_seqlen unwritten (or keys unread)
            raise ShapeError(
                f"max_seqlen_{name}={longest}, but sequence {b} of cu_seqlens_{name} has {length} rows; pass the "
                f"longest sequence's length (max_seqlen_{name}={length}), or leave it out to have it read"
            )
    outs, lses = [], []
    for b in range(p.batch):
        q, k, v = call.q[cu_q[b] : cu_q[b + 1]], call.k[cu_k[b] : cu_k[b + 1]], call.v[cu_k[b] : cu_k[b + 1]]
        problem = replace(p, batch=1, seqlen_q=q.size(0), seqlen_k=k.size(0), varlen=False)
        scales = None if call.descales is None else tuple(t[b : b + 1] for t in call.descales)
        one = AttentionCall(problem, q[None], k[None], v[None], call.softmax_scale, descales=scales)
        results, lse = _reference_dense(one, score, epi, compute_dtype, out_dtype, device, b, p_dtype)
        outs.append(results["D"][0])
        lses.append(lse[0])
    return {"D": torch.cat(outs)}, torch.cat(lses, dim=1)


def _reference_dense(call, score, epi, compute_dtype, out_dtype, device, first_batch: int = 0, p_dtype=None):
    """:func:`reference_attention` of a ``(batch, seqlen, heads, head_dim)`` call; ``first_batch``: the
    ``b`` index of its first sequence (a packed sequence's own)."""
    p = call.problem
    B, Sq, Sk, H, D = p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.head_dim
    group = H // p.heads_kv
    q = call.q.to(device, compute_dtype)
    k, v = call.k, call.v
    if call.v_slots:  # fp8 values in the kernel's layout (pages, or padded sequences): back in key order
        v = values_of_slots(v, v.size(1) if call.page_table is not None else Sk)
    if call.page_table is not None:  # (pages, page_size, Hkv, D) -> (B, pages per sequence x page_size, Hkv, D)
        check_page_table_values(call.page_table, k.size(0))  # the kernel does not read them on the host
        pages = call.page_table.to(k.device).long()
        k, v = (t[pages].reshape(B, Sk, p.heads_kv, D) for t in (k, v))
    k, v = k.to(device, compute_dtype), v.to(device, compute_dtype)
    if call.descales is not None:  # fp8: the dequantized operands, one scale per (sequence, key/value head)
        qs, ks, vs = (t.to(device, compute_dtype)[:, None, :, None] for t in call.descales)
        q, k, v = q * qs.repeat_interleave(group, dim=2), k * ks, v * vs
    q = q.permute(0, 2, 1, 3).reshape(B * H, Sq, D)
    k, v = (t.repeat_interleave(group, dim=2).permute(0, 2, 1, 3).reshape(B * H, Sk, D) for t in (k, v))
    # Keys each sequence uses, per (batch, head) row block.
    used = torch.full((B,), Sk, device=device)
    if call.seqused_k is not None:
        check_seqused_k_values(call.seqused_k, Sk, call.page_table is not None)  # the kernel does not read them
        used = call.seqused_k.to(device).long().clamp(0, Sk)
    used = used.repeat_interleave(H).view(-1, 1, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * call.softmax_scale
    if score is not None:
        l_idx = torch.arange(B * H, device=device)
        index = {
            "b": (l_idx // H + first_batch).view(-1, 1, 1), "h": (l_idx % H).view(-1, 1, 1),
            "q_idx": torch.arange(Sq, device=device).view(1, -1, 1),
            "kv_idx": torch.arange(Sk, device=device).view(1, 1, -1),
        }  # fmt: skip
        s = evaluate(score.graph, s, score.reference_specs(p), compute_dtype=compute_dtype, index_values=index)["D"]
        s = s.to(compute_dtype)
    kv_idx = torch.arange(Sk, device=device).view(1, 1, -1)
    allowed = kv_idx < used
    if p.causal:
        allowed = allowed & (kv_idx <= torch.arange(Sq, device=device).view(1, -1, 1) + used - Sq)
    s = s.masked_fill(~allowed, float("-inf"))
    if Sk:
        row_max = s.amax(dim=-1, keepdim=True)
    else:
        row_max = torch.full((B * H, Sq, 1), float("-inf"), dtype=compute_dtype, device=device)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    e = torch.exp(s - row_max)
    total = e.sum(dim=-1, keepdim=True)
    lse = torch.where(total == 0, float("-inf"), row_max + torch.log(total)).squeeze(-1)
    p_v = e if p_dtype is None else e.to(p_dtype).to(compute_dtype)
    o = torch.matmul(p_v, v) / torch.where(total == 0, torch.ones_like(total), total)
    lse = lse.reshape(B, H, Sq).to(torch.float32)
    if epi is None:
        outputs, stored = {"D": o}, {"D": stored_dtype(p.dtype)}
    else:
        outputs = evaluate(epi.graph, o, epi.reference_specs(p), compute_dtype=compute_dtype)
        stored = epi.fusion.tile_output_dtypes
    results = {}
    for name, value in outputs.items():
        if name in stored:  # a tile: (B * H, Sq, D) -> (B, Sq, H, D), rounded as the kernel stores it
            value = value.to(compute_dtype).reshape(B, H, Sq, D).permute(0, 2, 1, 3)
            results[name] = value.to(out_dtype) if out_dtype is not None else round_to(value, stored[name])
        else:  # a reduction: (L, M) -> (B, H, Sq), (L, N) -> (B, H, D), or 0-d
            results[name] = value.reshape(B, H, -1) if value.dim() else value
    return results, lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    /,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    score_mod: Callable | None = None,
    epilogue: Callable | None = None,
    out: torch.Tensor | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    backend: str | None = None,
    config: dict | None = None,
    page_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    deterministic: bool = False,
    q_descale: torch.Tensor | float | None = None,
    k_descale: torch.Tensor | float | None = None,
    v_descale: torch.Tensor | float | None = None,
    v_layout: str = "bshd",
    **operands: Any,
) -> torch.Tensor | dict[str, torch.Tensor] | tuple:
    """``softmax(q k^T * softmax_scale) v`` on a Hopper GPU (FlashAttention-3 style).

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)``, bf16, fp16 or fp8 (``float8_e4m3fn``: see
            ``q_descale``), head_dim 64, 128 or 256.
        k, v: ``(batch, seqlen_k, heads_kv, head_dim)``; ``heads_q`` a multiple of ``heads_kv`` (GQA/MQA):
            query head ``h`` reads KV head ``h // (heads_q // heads_kv)``, as flash-attn and SDPA do.
        causal: query i attends keys ``<= i + seqlen_k - seqlen_q`` (bottom-right aligned, as flash-attn);
            rows that see no key give O = 0 and LSE = -inf.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        return_lse: also return the log-sum-exp of each row, fp32 ``(batch, heads_q, seqlen_q)``.
        score_mod: ``f(score, b, h, q_idx, kv_idx, *operands)`` on the scaled scores (see :mod:`epicute.ops`);
            ``b`` and ``h`` are the batch and query-head indices, ``q_idx`` and ``kv_idx`` the raw 0-based
            positions in q's and k's sequences (not shifted by the causal alignment), as FlexAttention's.
        epilogue: ``f(o, *operands)`` on the normalized output before it is stored, in the GEMM's
            epilogue language: ``{"D": ...}`` is O, any other key an aux tile ``(batch, seqlen_q,
            heads_q, head_dim)`` or a reduction (``row_*``: ``(batch, heads_q, seqlen_q)``, over
            head_dim; ``col_*``: ``(batch, heads_q, head_dim)``, over the queries; ``amax``: 0-d; all
            fp32, deterministic). Each tile output is stored in ``out_dtypes[name]``, else its own
            final ``ops.cast``/``ops.quantize``'s dtype (fp8 saturates), else q's; the kernel stages
            outputs in Q's shared memory, so none may be wider than q's elements (no fp32 tiles).
        out: optional preallocated O: q's shape and device, O's stored dtype.
        out_dtypes: stored dtypes of the epilogue's tile outputs by name (``"D"`` is O).
        backend: ``"kernel"`` (the GPU) or ``"reference"`` (float32 on the CPU, any device).
        config: :class:`epicute.attention.plan.AttentionConfig` fields to pin (e.g. ``{"tile_n": 64}``,
            ``{"num_splits": 4}``).
        page_table: int32 ``(batch, pages per sequence)``: k and v are then a paged KV cache
            ``(num_pages, page_size, heads_kv, head_dim)`` (page_size a multiple of 16, at most 256)
            and sequence ``b``'s keys are its pages in table order, as flash-attn's ``page_table``.
            Entries must be valid page indices (not checked: that would wait for the GPU).
        seqused_k: int32 ``(batch,)``: sequence ``b`` attends over its first ``seqused_k[b]`` keys
            (a decode step's cache lengths; causal alignment ends at the last of them). Cache slots
            past them are read but masked: they must hold finite values (a NaN there would reach O
            through the zero weight it gets).
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``: a variable-length batch packed as flash-attn's
            varlen functions take it. q is ``(total_q, heads_q, head_dim)`` and k, v ``(total_k, heads_kv,
            head_dim)``; sequence ``b`` is rows ``cu_seqlens_q[b]`` to ``cu_seqlens_q[b + 1]`` of q (and
            likewise of k and v), causal per sequence (bottom-right aligned), ``b`` in score_mod its index.
            O comes back packed like q and LSE as ``(heads_q, total_q)``. No output epilogue, paged cache
            or seqused_k with it.
        max_seqlen_q, max_seqlen_k: the longest sequence's length in each: the kernel's grid is cut from
            it. Left out, it is read from ``cu_seqlens`` (a sync with the GPU) and the offsets are checked
            on the way; given, they are not (a sequence longer than ``max_seqlen_q`` leaves the rows past
            it unwritten, and offsets outside the tensors are clamped, never followed).
        deterministic: the backward adds each key block's part of dQ in a fixed order, so gradients are
            bitwise reproducible (as flash-attn's ``deterministic``; it costs some speed: the backward table
            of docs/performance.md has the deterministic rows). The forward is deterministic either way.
        q_descale, k_descale, v_descale: with fp8 q, k and v (all ``float8_e4m3fn``), what each is multiplied
            by to dequantize it: a number, a one-element fp32 tensor, or fp32 ``(batch, heads_kv)``, one per
            sequence and key/value head (FlashAttention-3's ``descale_q/k/v``); default 1. O is then stored
            bf16 (or through ``epilogue``: fp8 via ``ops.quantize``). The fp8 forward is FA3's: both GEMMs
            fp8, P rounded to e4m3 in registers; V is rewritten keys-contiguous in one pass before the
            kernel (:mod:`epicute.attention.fp8`). Inference only (no backward).
        v_layout: ``"bshd"`` (v like k), or ``"slots"``: fp8 v already in the kernel's value layout
            (:func:`epicute.attention.fp8.value_layout`'s result, or a paged cache's value pages as
            ``epicute.nn.PagedKVCache(..., dtype=torch.float8_e4m3fn)`` keeps them), read without the pass.
        **operands: the hooks' operands by name.

    Training: when q, k or v require grad, autograd runs the backward kernel
    (:mod:`epicute.attention.backward`): in eager through an autograd Function that launches the
    kernels itself (:class:`~epicute.attention.torch_op.EagerAttention`), under ``torch.compile``
    through the custom op ``epicute::attention``, whose registered autograd runs the same kernels;
    a score_mod's gradient is derived from its traced graph.
    A score_mod's per-head vectors that require grad get gradients (summed in the backward kernel).
    The backward covers head_dim 64, 128 and 256 with no output epilogue, paged cache or seqused_k;
    other calls that need gradients get a :class:`~epicute.errors.ConfigError` before any launch.

    Decode-shaped calls (the query heads sharing a K/V head times the queries per sequence fit 64
    rows, e.g. one token per sequence with GQA) are planned as decode tiles: the GQA group's heads
    packed into one tile, and when the tiles leave SMs idle, each sequence's keys split over
    several CTAs whose results a second kernel combines (split-KV, deterministic).
    :func:`explain_attention` prints the plan and why. Those plans take no output ``epilogue``.

    Example:
        >>> import torch, epicute                                               # doctest: +SKIP
        >>> q = torch.randn(2, 1000, 16, 128, device="cuda", dtype=torch.bfloat16)
        >>> kv = torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16)
        >>> o = epicute.attention(q, kv, kv, causal=True)
        >>> softcap = lambda s, b, h, qi, ki: 30 * epicute.ops.tanh(s / 30)
        >>> o, lse = epicute.attention(q, kv, kv, score_mod=softcap, return_lse=True)
        >>> r = epicute.attention(q, kv, kv, epilogue=epicute.epilogues.tensor_quant, scale=4.0)
        >>> r["D"].dtype, r["amax"].shape                  # fp8 O * 4 and max |O * 4|, a 0-d tensor
        (torch.float8_e4m3fn, torch.Size([]))
        >>> # decode over a paged cache: one new token per sequence, 128-key pages
        >>> cache_k = torch.randn(1024, 128, 4, 128, device="cuda", dtype=torch.bfloat16)
        >>> cache_v = torch.randn_like(cache_k)
        >>> table = torch.randperm(1024, device="cuda", dtype=torch.int32).view(8, 128)
        >>> lengths = torch.full((8,), 16000, device="cuda", dtype=torch.int32)
        >>> q1 = torch.randn(8, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
        >>> o = epicute.attention(q1, cache_k, cache_v, page_table=table, seqused_k=lengths, causal=True)

        >>> # a packed batch of 3 sequences (flash-attn's varlen layout)
        >>> lengths = torch.tensor([0, 1000, 17, 4000], device="cuda").cumsum(0).int()
        >>> qp = torch.randn(5017, 16, 128, device="cuda", dtype=torch.bfloat16)
        >>> kvp = torch.randn(5017, 4, 128, device="cuda", dtype=torch.bfloat16)
        >>> o = epicute.attention(qp, kvp, kvp, causal=True, cu_seqlens_q=lengths, cu_seqlens_k=lengths,
        ...                       max_seqlen_q=4000, max_seqlen_k=4000)       # (5017, 16, 128)

    Returns:
        O; a dict of every output (``"D"`` is O) when the epilogue returns more than O; with
        ``return_lse``, a pair of that and the fp32 LSE ``(batch, heads_q, seqlen_q)`` (packed:
        ``(heads_q, total_q)``).
    """
    varlen = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
              "max_seqlen_k": max_seqlen_k}  # fmt: skip
    fp8_args = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if traced(q):
        # torch.compile sees one custom op (epicute::attention), never this Python code.
        return attention_op_call(
            q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, score_mod=score_mod,
            epilogue=epilogue, out=out, out_dtypes=out_dtypes, backend=backend, config=config, operands=operands,
            page_table=page_table, seqused_k=seqused_k, deterministic=deterministic, descales=fp8_args,
            v_layout=v_layout, **varlen,
        )  # fmt: skip
    if v_layout != "bshd":
        fp8_args["v_layout"] = v_layout
    backend = resolve_backend(backend)
    score_mod, epilogue = _named_hooks(score_mod, epilogue)
    check_flags(causal=causal, return_lse=return_lse, deterministic=deterministic)
    indices = (page_table, seqused_k, cu_seqlens_q, cu_seqlens_k)
    signature = None
    if backend == "kernel" and score_mod is None and epilogue is None and out is None and not (
            operands or out_dtypes or config):  # fmt: skip
        signature = _plain_signature(q, k, v, indices, causal, softmax_scale, max_seqlen_q, max_seqlen_k, fp8_args)
    remembered = _remembered(signature, q, k, v, indices)
    if remembered is not None:
        call, prepared = remembered
        if call.descales is not None:  # fp8: this call's descales, checked against the remembered problem
            p = call.problem
            call.descales = fp8_descales(q_descale, k_descale, v_descale, p.batch, p.heads_kv, q.device)
    else:
        if backend == "reference":
            check_has_values(("q", q), ("k", k), ("v", v), ("out", out), ("page_table", page_table),
                             ("seqused_k", seqused_k), ("cu_seqlens_q", cu_seqlens_q),
                             ("cu_seqlens_k", cu_seqlens_k), operands=operands)  # fmt: skip
        call = check_attention_args(
            q, k, v, causal=causal, softmax_scale=softmax_scale, require_cuda=backend == "kernel",
            page_table=page_table, seqused_k=seqused_k, **varlen, **fp8_args,
        )  # fmt: skip
        prepared = prepare(call, score_mod, epilogue, operands, out_dtypes, config)
        if signature is not None and not _misaligned(q, k, v, *indices):
            _remember(signature, call, prepared)
    score, epi = prepared.score, prepared.epilogue
    needs_grad = any(t.requires_grad for t in (q, k, v, *(x for x in operands.values() if isinstance(x, torch.Tensor))))
    if backend == "kernel" and torch.is_grad_enabled() and needs_grad:
        # Training: what the custom op's autograd runs, without its dispatch (checked here, before any launch);
        # under torch.compile the op itself (above).
        _check_differentiable(prepared, out, operands)
        prepared.backward_variant()  # what the backward launches, built before the forward runs
        names = tuple(name for name, value in operands.items() if isinstance(value, torch.Tensor))
        o, lse = EagerAttention.apply(call, prepared, deterministic, names, q, k, v, *(operands[n] for n in names))
        return (o, lse) if return_lse else o
    if out is not None:
        check_attention_out(call, out, IR_TO_TORCH[prepared.output_dtypes["D"]])
    if backend == "reference":
        if torch.is_grad_enabled() and needs_grad:
            _check_differentiable(prepared, out, operands)
        results, lse = reference_attention(call, score, epi)
        # Contiguous, as the kernels write them (and as the torch op's fake promises).
        results = {name: value.to(q.device).contiguous() for name, value in results.items()}
        lse = lse.to(q.device)
        if out is not None:
            results["D"] = out.copy_(results["D"])
    else:
        from epicute.attention.launch import launch_attention

        device = q.device
        results, lse = launch_attention(
            call, prepared.variant(),
            score.kernel_operands(device) if score else ((), ()),
            epi.kernel_operands(device) if epi else ((), ()),
            prepared.plan.max_ctas,
        )  # fmt: skip
    result = results["D"] if set(results) == {"D"} else results
    return (result, lse) if return_lse else result


#: Plain kernel calls (no hooks, out, operands or options) validated and prepared once per signature: every check
#: of :func:`check_attention_args` depends only on what :func:`_plain_signature` holds and on 16-byte-aligned
#: pointers, so a repeat call binds its tensors to the first call's problem and plan (~100 us of host time on an
#: H200's host, more than a decode step's kernel). The calls are kept without their tensors.
_VALIDATED: dict[tuple, tuple[AttentionCall, Any]] = {}


def _plain_signature(
    q, k, v, indices: tuple, causal, softmax_scale, max_seqlen_q, max_seqlen_k, fp8: dict
) -> tuple | None:
    """What a plain call's validation depends on, or None for a call it must always see (a tensor subclass, or
    packed sequences whose longest lengths are read from the offsets). ``fp8``: the descales (their kinds: their
    values are checked and bound per call) and ``v_layout``."""
    tensors = (q, k, v, *(t for t in indices if t is not None))
    if any(type(t) not in PLAIN_TENSORS for t in tensors):
        return None
    if indices[2] is not None and (max_seqlen_q is None or max_seqlen_k is None):
        return None
    # The device's index, not the device (a new torch.device each read); only CUDA calls are remembered.
    layouts = tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.get_device()) for t in (q, k, v, *indices))
    numbers = tuple((type(x), x) for x in (softmax_scale, max_seqlen_q, max_seqlen_k))  # True is 1, not valid
    kinds = tuple((name, x if isinstance(x, str) else type(x)) for name, x in fp8.items() if x is not None)
    return (layouts, k is v, causal, numbers, kinds)


def _remembered(signature: tuple | None, q, k, v, indices: tuple) -> tuple[AttentionCall, Any] | None:
    """The remembered ``(call, prepared)`` of a plain call's ``signature`` bound to this call's tensors, or None
    (none remembered, or a pointer off TMA's alignment, which the signature does not hold)."""
    validated = _VALIDATED.get(signature) if signature is not None else None
    if validated is None or _misaligned(q, k, v, *indices):
        return None
    return validated[0].rebound(q, k, v, *indices), validated[1]


def remembered_plain_call(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, max_seqlen_q, max_seqlen_k):
    """What :func:`attention` remembered of a plain bf16/fp16 call with these arguments, bound to these tensors
    (``(call, prepared)``), or None: the custom op's backward takes it rather than validating and preparing again."""
    indices = (None, None, cu_seqlens_q, cu_seqlens_k)
    signature = _plain_signature(q, k, v, indices, causal, softmax_scale, max_seqlen_q, max_seqlen_k, {})
    return _remembered(signature, q, k, v, indices)


def _misaligned(*tensors: torch.Tensor | None) -> int:
    pointers = 0
    for t in tensors:
        if t is not None:
            pointers |= t.data_ptr()
    return pointers % TMA_ALIGN_BYTES


def _remember(signature: tuple, call: AttentionCall, prepared) -> None:
    if len(_VALIDATED) >= 1024:  # packed batches vary their longest lengths: a bounded memo
        _VALIDATED.clear()
    _VALIDATED[signature] = (call.rebound(None, None, None, None, None, None, None), prepared)  # kept without tensors



def _named_hooks(score_mod, epilogue) -> tuple[Epilogue | None, Epilogue | None]:
    """The hooks as traceable objects (made once per call: tracing takes them as they are), refused before any
    argument is checked when one takes an operand named like :func:`attention`'s own keyword parameters (a value
    passed under that name binds to the parameter: ``causal=``, ``out=``...)."""
    sm = None if score_mod is None else as_score_mod(score_mod)
    epi = None if epilogue is None else as_epilogue(epilogue)
    for hook, fn in (("score_mod", sm), ("epilogue", epi)):
        if fn is not None:
            check_operand_names(hook, fn.name, fn.params, ATTENTION_KEYWORDS, "epicute.attention")
    return sm, epi


def _check_differentiable(prepared, out: torch.Tensor | None, operands: dict[str, Any]) -> None:
    """Refuse, with the fix, a call whose inputs need gradients the backward cannot give (on both backends: a
    program tried on the reference backend meets the kernels' rules): only a score_mod's per-head vectors among
    the operands, none of what :meth:`~epicute.attention.prepare.PreparedAttention.check_backward` names, no
    ``out=``."""
    score = prepared.score
    for name, value in operands.items():
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            continue
        if score is None or name not in score.operands:
            raise ConfigError(
                f"operand {name!r} requires grad: only the score_mod's per-head vectors get gradients (the output "
                f"epilogue has no backward); pass {name}.detach()"
            )
        if score.operands[name][0] != "head":
            raise ConfigError(
                f"operand {name!r} requires grad, but a one-element tensor is read as a number, which gets no "
                f"gradient; give it one entry per query head ({prepared.plan.problem.heads_q},) or pass {name}.detach()"
            )
    prepared.check_backward()
    if out is not None:
        raise ConfigError("out=: autograd needs attention to allocate O; drop out= or call under torch.no_grad()")


def explain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    /,
    *,
    causal: bool = False,
    score_mod: Callable | None = None,
    epilogue: Callable | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    config: dict | None = None,
    target: Target | str | None = None,
    file: TextIO | str | None = "stdout",
    page_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    deterministic: bool = False,
    q_descale: torch.Tensor | float | None = None,
    k_descale: torch.Tensor | float | None = None,
    v_descale: torch.Tensor | float | None = None,
    v_layout: str = "bshd",
    **operands: Any,
) -> AttentionPlan:
    """Print (to ``file``; ``None`` to stay quiet) and return the attention plan; works on ``"meta"`` tensors
    (q, k and v on one device).

    Takes :func:`attention`'s arguments and goes the same way (:func:`epicute.attention.prepare.prepare`):
    with a ``score_mod`` or ``epilogue`` (and their operands) the text ends with the epilogue chain
    the kernel runs. ``target``: the GPU to plan for, a name of :data:`epicute.runtime.target.TARGETS`
    or a :class:`~epicute.runtime.target.Target` (default: the visible GPU, else an H100 SXM).

    Example:
        >>> import torch, epicute
        >>> q = torch.empty(4, 8192, 16, 128, dtype=torch.bfloat16, device="meta")
        >>> plan = epicute.explain_attention(q, q, q, file=None)
        >>> plan.config.tile_m, plan.config.tile_n
        (128, 128)
        >>> q1 = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16, device="meta")   # one decode token
        >>> cache = torch.empty(1, 131072, 8, 128, dtype=torch.bfloat16, device="meta")
        >>> plan = epicute.explain_attention(q1, cache, cache, file=None)
        >>> plan.config.pack_gqa, plan.config.num_splits, plan.grid
        (4, 16, (128, 1, 1))
    """
    check_text_file(file)
    check_one_device(("q", q), ("k", k), ("v", v))
    score_mod, epilogue = _named_hooks(score_mod, epilogue)
    check_flags(causal=causal, deterministic=deterministic)
    call = check_attention_args(
        q, k, v, causal=causal, softmax_scale=None, require_cuda=False, page_table=page_table, seqused_k=seqused_k,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, v_layout=v_layout,
    )  # fmt: skip
    prepared = prepare(call, score_mod, epilogue, operands, out_dtypes, config, resolve_target(target))
    if file is not None:
        try:  # the kernel autograd would run, from the same prepared call
            variant = prepared.backward_variant(deterministic)
            backward = render_backward_plan(variant, prepared.plan.problem, prepared.plan.target)
        except ConfigError as exc:
            backward = ["backward (training)", f"  not available: {exc}"]
        text = "\n".join([render_attention_plan(prepared.plan, prepared.chain), "", *backward])
        print(text, file=sys.stdout if file == "stdout" else file)
    return prepared.plan


#: Keyword parameters of attention's entry points: a hook operand of one of these names would bind to the
#: parameter (refused by :func:`_named_hooks`); ``q``, ``k`` and ``v`` are positional-only.
ATTENTION_KEYWORDS = keyword_parameters(attention, explain_attention)
