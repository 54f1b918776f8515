"""The attention backward: compiling and launching its kernel, and the host steps around it.

:func:`attention_backward` takes the forward's inputs, O, LSE and dO and returns dQ, dK, dV:

1. the preprocess kernel (:mod:`epicute.attention.backward_prep_sm90`): ``D = rowsum(dO * O)`` in
   fp32 and LSE in log2 units, both padded to whole query blocks (packed sequences: each one's rows
   from a block boundary, see :func:`stat_rows_start`), with LSE = +inf on the padding and on rows
   the forward saw no key of (their P is then exactly 0, as their O was), and dQ's fp32
   accumulator zeroed (:func:`preprocess_reference` is the same math in torch);
2. the main kernel (:mod:`epicute.attention.backward_sm90`): dK and dV stored in the input dtype
   (``head_split``: added into zeroed fp32 accumulators, :func:`key_accumulators`), dQ added into the
   accumulator (``deterministic``: in a fixed order, through zeroed turn
   counters, one per query block and head);
3. the postprocess kernel: ``dQ = accumulator * softmax_scale`` cast to the input dtype, un-permuted
   from the order the main kernel adds it in (``head_split``: dK and dV too, key blocks for query blocks).

A :class:`BackwardVariant` (config, dtype, causal...), a :class:`PreprocessVariant` and a
:class:`PostprocessVariant` are what change the generated code; they compile against fake tensors
with symbolic sizes, like the forward, so CI compiles every variant without a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from epicute.attention.backward_plan import BackwardConfig, backward_grid, stat_rows_start
from epicute.epilogue.dtypes import TORCH_TO_IR
from epicute.runtime.cache import CacheKey
from epicute.runtime.compile import FAMILIES, OPERAND_ALIGN_BYTES, dsl_compile, launch_or_skip
from epicute.runtime.target import DEFAULT_ARCH, current_target

LOG2_E = math.log2(math.e)


@dataclass(frozen=True)
class BackwardVariant:
    config: BackwardConfig
    dtype: str
    causal: bool
    #: the forward's score_mod (``ScoreModFusion``), if any: the kernel emits it and its derivative
    score_mod: object = None
    arch: str = DEFAULT_ARCH
    #: packed variable-length sequences (cu_seqlens_q/k)
    varlen: bool = False
    #: dQ's parts added in a fixed order: bitwise reproducible gradients
    deterministic: bool = False
    #: the score_mod's per-head vectors get gradients (summed in the kernel, see ``operand_grads``)
    operand_grads: bool = False
    #: query heads a CTA walks (:func:`~epicute.attention.backward_plan.heads_per_cta`; 0: the whole group). A
    #: runtime argument: only whether it splits the group (``head_split``) changes the code.
    heads_per_cta: int = field(default=0, compare=False)
    #: the group's query heads split over CTAs: dK and dV reduce-added in fp32, then cast by the postprocess
    head_split: bool = False

    def key(self) -> CacheKey:
        """The compile cache's key (see :mod:`epicute.runtime.cache`)."""
        c = self.config
        label = (f"attention backward d{c.head_dim} {c.tile_m}x{c.tile_n} {self.dtype}"
                 + (" causal" if self.causal else "") + ("" if self.score_mod is None else " +score_mod")
                 + (" varlen" if self.varlen else "") + (" deterministic" if self.deterministic else "")
                 + (" +operand grads" if self.operand_grads else "")
                 + (" head split" if self.head_split else ""))  # fmt: skip
        score_key = None if self.score_mod is None else self.score_mod.key()
        parts = (c.key(), self.dtype, self.causal, score_key, ("align", OPERAND_ALIGN_BYTES))
        if self.varlen:
            parts += (("varlen", True),)
        if self.deterministic:
            parts += (("deterministic", True),)
        if self.operand_grads:
            parts += (("operand_grads", True),)
        if self.head_split:
            parts += (("head_split", True),)
        return CacheKey("attention_backward", parts, self.arch, label)


def compile_backward(variant: BackwardVariant):
    """Compile one variant for sm_90a; returns ``f(q, k, v, do, lse_log2, d, dq_accum, dk, dv, softmax_scale,
    band, heads, score_tensors, score_scalars, varlen, dq_turns, operand_grads, dkv_accum)``
    taking torch tensors (see :meth:`~epicute.attention.backward_sm90.AttentionBackwardSm90.__call__`)."""
    import cutlass
    from cutlass import cute

    from epicute.attention.backward_sm90 import AttentionBackwardSm90
    from epicute.attention.launch import _fake_bshd, _fake_elementwise, _fake_score_operands
    from epicute.sm90.epilogue_emit import DSL_DTYPES

    dtype = DSL_DTYPES[variant.dtype]
    d = variant.config.head_dim
    q, k, v, do, dk, dv = (_fake_bshd(dtype, d) for _ in range(6))
    dq_accum = _fake_bshd(cutlass.Float32, d)  # (batch, heads, rows, head_dim)
    lse, dsum, turns = (
        cute.runtime.make_fake_tensor(
            element,
            (cute.sym_int(), cute.sym_int(), cute.sym_int()),
            stride=(cute.sym_int64(), cute.sym_int64(), 1),
            assumed_align=4,
        )  # fmt: skip
        for element in (cutlass.Float32, cutlass.Float32, cutlass.Int32)
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    score_tensors, score_scalars = _fake_score_operands(variant.score_mod)
    varlen = ()
    if variant.varlen:  # cu_seqlens_q, cu_seqlens_k, max_seqlen_k
        varlen = (_fake_elementwise(cutlass.Int32, 1), _fake_elementwise(cutlass.Int32, 1), cutlass.Int32(1))
    kernel = AttentionBackwardSm90(
        variant.config,
        variant.dtype,
        variant.causal,
        variant.score_mod,
        variant.varlen,
        variant.deterministic,
        variant.operand_grads,
        variant.head_split,
    )
    partials = tuple(
        cute.runtime.make_fake_tensor(
            cutlass.Float32, tuple(cute.sym_int() for _ in range(4)),
            stride=(*(cute.sym_int64() for _ in range(3)), 1), assumed_align=4,
        )
        for _ in kernel.grad_operands
    )  # fmt: skip
    return dsl_compile(
        variant,
        kernel,
        q,
        k,
        v,
        do,
        lse,
        dsum,
        dq_accum,
        dk,
        dv,
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cutlass.Int32(1),
        score_tensors,
        score_scalars,
        varlen,
        (turns,) if variant.deterministic else (),
        partials,
        (_fake_bshd(cutlass.Float32, d),) if variant.head_split else (),
        stream,
        constant_args=("score_tensors", "score_scalars", "varlen", "dq_turns", "operand_grads", "dkv_accum"),
    )


BACKWARD_CACHE = FAMILIES["attention_backward"]


@dataclass(frozen=True)
class PreprocessVariant:
    """The preprocess kernel's compile-time choices (see :mod:`epicute.attention.backward_prep_sm90`)."""

    dtype: str
    head_dim: int
    #: the main kernel's query block: LSE and D are padded (packed: laid out) in blocks of it
    tile_m: int
    varlen: bool = False
    #: LSE's gradient is subtracted from D
    has_dlse: bool = False
    #: the main kernel's dQ accumulator layout (:attr:`~epicute.attention.backward_plan.BackwardConfig.
    #: dq_fragment_order`), which the preprocess zeroes
    dq_fragment_order: bool = True
    arch: str = DEFAULT_ARCH

    def key(self) -> CacheKey:
        """The compile cache's key."""
        label = (f"attention backward preprocess d{self.head_dim} {self.dtype} x{self.tile_m}"
                 + (" varlen" if self.varlen else "") + (" dlse" if self.has_dlse else "")
                 + ("" if self.dq_fragment_order else " dq rows"))  # fmt: skip
        parts = (self.dtype, self.head_dim, self.tile_m, self.varlen, self.has_dlse, self.dq_fragment_order)
        return CacheKey("attention_backward_preprocess", parts, self.arch, label)


def compile_preprocess(variant: PreprocessVariant):
    """Compile the preprocess for sm_90a; returns ``f(o, do, lse, lse_log2, d, dq_accum, dlse, varlen)``."""
    import cutlass
    from cutlass import cute

    from epicute.attention.backward_prep_sm90 import BackwardPreprocessSm90
    from epicute.attention.launch import _fake_bshd, _fake_elementwise
    from epicute.sm90.epilogue_emit import DSL_DTYPES

    dtype, d = DSL_DTYPES[variant.dtype], variant.head_dim
    stats = tuple(_fake_elementwise(cutlass.Float32, 3) for _ in range(4))  # LSE, LSE log2, D, dLSE
    varlen = (_fake_elementwise(cutlass.Int32, 1), cutlass.Int32(1)) if variant.varlen else ()
    kernel = BackwardPreprocessSm90(d, variant.tile_m, variant.varlen, variant.has_dlse, variant.dq_fragment_order)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return dsl_compile(
        variant, kernel, _fake_bshd(dtype, d), _fake_bshd(dtype, d), stats[0], stats[1], stats[2],
        _fake_bshd(cutlass.Float32, d), stats[3:] if variant.has_dlse else (), varlen, stream,
        constant_args=("dlse", "varlen"),
    )  # fmt: skip


PREPROCESS_CACHE = FAMILIES["attention_backward_preprocess"]


@dataclass(frozen=True)
class PostprocessVariant:
    """The postprocess kernel's compile-time choices (see :mod:`epicute.attention.backward_prep_sm90`)."""

    dtype: str
    head_dim: int
    #: the main kernel's query block: with head_dim, how its dQ fragments are laid out
    tile_m: int
    varlen: bool = False
    arch: str = DEFAULT_ARCH

    def key(self) -> CacheKey:
        """The compile cache's key."""
        label = (f"attention backward postprocess d{self.head_dim} {self.dtype} x{self.tile_m}"
                 + (" varlen" if self.varlen else ""))  # fmt: skip
        parts = (self.dtype, self.head_dim, self.tile_m, self.varlen)
        return CacheKey("attention_backward_postprocess", parts, self.arch, label)


def compile_postprocess(variant: PostprocessVariant):
    """Compile the postprocess for sm_90a; returns ``f(dq_accum, dq, softmax_scale, varlen)``."""
    import cutlass
    from cutlass import cute

    from epicute.attention.backward_prep_sm90 import BackwardPostprocessSm90
    from epicute.attention.launch import _fake_bshd, _fake_elementwise
    from epicute.sm90.epilogue_emit import DSL_DTYPES

    d = variant.head_dim
    kernel = BackwardPostprocessSm90(d, variant.tile_m, variant.dtype, variant.varlen)
    varlen = (_fake_elementwise(cutlass.Int32, 1), cutlass.Int32(1)) if variant.varlen else ()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return dsl_compile(
        variant, kernel, _fake_bshd(cutlass.Float32, d), _fake_bshd(DSL_DTYPES[variant.dtype], d),
        cutlass.Float32(1.0), varlen, stream, constant_args=("varlen",),
    )  # fmt: skip


POSTPROCESS_CACHE = FAMILIES["attention_backward_postprocess"]


def preprocess(
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    tile_m: int,
    dlse: torch.Tensor | None = None,
    packed: tuple = (),
    dq_fragment_order: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The preprocess kernel: ``(LSE * log2 e, D)`` as :func:`preprocess_reference` returns them, and dQ's fp32
    accumulator zeroed: ``(batch, heads, rows, head_dim)``, its rows LSE's, in fragment order, else shaped
    like ``o``. ``packed``: ``(cu_seqlens_q, max_seqlen_q)`` for packed sequences."""
    sequences = packed[0].numel() - 1 if packed else None
    variant, stats, accumulator = _preprocess_layout(o.shape, TORCH_TO_IR[o.dtype], tile_m, sequences,
                                                     dlse is not None, dq_fragment_order)  # fmt: skip
    if packed:
        o, do, lse = o[None], do[None], lse[None]
        dlse = None if dlse is None else dlse[None]
    # LSE * log2 e and D in one allocation: an allocation costs a launch's host time
    lse_log2, dsum = torch.empty((2, *stats), dtype=torch.float32, device=o.device).unbind(0)
    if accumulator is None:  # packed and row-major: zeroed here, rows outside every sequence included
        dq_accum = torch.zeros(o.shape, dtype=torch.float32, device=o.device)
    else:  # the kernel zeroes each row
        dq_accum = new_grad(accumulator, torch.float32, o.device)
    # Each pass of the backward reads the last one's buffers as values: while precompiling, a missing one is skipped.
    launch_or_skip(PREPROCESS_CACHE, variant, o, do, lse, lse_log2, dsum, dq_accum, () if dlse is None else (dlse,),
                   packed)  # fmt: skip
    return lse_log2, dsum, dq_accum


@functools.lru_cache(maxsize=1024)
def _preprocess_layout(
    o_shape: tuple[int, ...], dtype: str, tile_m: int, sequences: int | None, has_dlse: bool, fragment_order: bool
) -> tuple[PreprocessVariant, tuple[int, ...], tuple[int, ...] | None]:
    """:func:`preprocess`'s kernel variant, its stats' shape ``(batch, heads, rows)`` and dQ's accumulator shape
    (None: zeroed like O), for O of ``o_shape`` (``sequences`` packed ones, else None); worked out once per
    problem, as a training step asks every step."""
    heads, head_dim = o_shape[-2], o_shape[-1]
    if sequences is not None:
        stats = (1, heads, stat_rows_start(o_shape[0], sequences, tile_m))
    else:
        stats = (o_shape[0], heads, -(-o_shape[1] // tile_m) * tile_m)
    if fragment_order:
        accumulator = (*stats, head_dim)
    elif sequences is None:  # row-major and dense: like O
        accumulator = tuple(o_shape)
    else:  # row-major and packed: zeroed by the caller
        accumulator = None
    variant = PreprocessVariant(dtype, head_dim, tile_m, sequences is not None, has_dlse, fragment_order)
    return variant, stats, accumulator


def preprocess_reference(
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    tile_m: int,
    dlse: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LSE * log2 e, D = rowsum(dO * O) - dLSE)``, fp32 ``(batch, heads, seqlen_q padded to tile_m)``;
    LSE is +inf on the padding and where the forward's row saw no key (LSE = -inf), so P = 0 there.
    ``dlse``: LSE's gradient (shaped like ``lse``), or None.
    Packed (``o`` ``(total_q, heads, dim)``, ``lse`` ``(heads, total_q)``, ``cu_seqlens_q``): ``(1, heads, rows)``
    with sequence ``b``'s rows from :func:`stat_rows_start` on (no host sync)."""
    if o.dim() == 3:
        lse_log2, dsum = preprocess_reference(o[None], do[None], lse[None], 1, None if dlse is None else dlse[None])
        total, batch = o.shape[0], cu_seqlens_q.numel() - 1
        rows = stat_rows_start(total, batch, tile_m)
        cu = cu_seqlens_q.long()
        row = torch.arange(total, device=o.device)
        seq = torch.searchsorted(cu[1:], row, right=True).clamp_(max=max(batch - 1, 0))
        # Clamped: malformed offsets give wrong rows, never an index past the buffers.
        dest = (stat_rows_start(cu[seq], seq, tile_m) + row - cu[seq]).clamp_(0, rows - 1)
        padded = (torch.full((1, o.shape[1], rows), math.inf, dtype=torch.float32, device=o.device),
                  torch.zeros((1, o.shape[1], rows), dtype=torch.float32, device=o.device))  # fmt: skip
        for out, values in zip(padded, (lse_log2, dsum)):
            out.index_copy_(2, dest, values)
        return padded
    batch, seqlen_q, heads, _ = o.shape
    padded = -(-seqlen_q // tile_m) * tile_m
    lse_log2 = torch.full((batch, heads, padded), math.inf, dtype=torch.float32, device=o.device)
    lse_log2[..., :seqlen_q] = torch.where(torch.isneginf(lse), math.inf, lse * LOG2_E)
    dsum = torch.zeros((batch, heads, padded), dtype=torch.float32, device=o.device)
    dsum[..., :seqlen_q] = torch.einsum("bshd,bshd->bhs", do.float(), o.float())
    if dlse is not None:
        dsum[..., :seqlen_q] -= dlse
    return lse_log2, dsum


def key_accumulators(k: torch.Tensor, tile_n: int, packed_k: tuple = ()) -> torch.Tensor:
    """dK's and dV's zeroed fp32 accumulators for a ``head_split`` backward, one tensor ``(2 batch, heads_kv, rows,
    head_dim)``: each batch's dK then dV (entries ``2 b`` and ``2 b + 1``: one set of strides and a constant offset
    for the kernel, whose split epilogue at head_dim 256 has no register to spare). Rows padded to whole key blocks
    (packed, ``packed_k`` = ``(cu_seqlens_k, max_seqlen_k)``: one batch's pair of entries, each sequence's rows
    from :func:`stat_rows_start` of its first key), as dQ's accumulator lays out queries."""
    if packed_k:
        shape = (2, k.shape[-2], stat_rows_start(k.shape[0], packed_k[0].numel() - 1, tile_n), k.shape[-1])
    else:
        shape = (2 * k.shape[0], k.shape[2], -(-k.shape[1] // tile_n) * tile_n, k.shape[-1])
    return torch.zeros(shape, dtype=torch.float32, device=k.device)


def new_grad(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """dK or dV before the kernel writes it (a seam for tests, which poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class _LaunchSteps:
    """What :func:`attention_backward` launches around its variant for one problem, worked out once: a training
    step asks every step, and this arithmetic cost the host more than the launches (bench/NOTES.md)."""

    heads: int  # query heads a CTA walks (backward_grid)
    band: int  # the grid's band of pairs (backward_grid)
    key_blocks: int  # the score_mod operands' partial sums: per key block...
    warps: int  # ...and consumer warp
    dq_post: PostprocessVariant | None  # dQ from its fragment-order accumulator, else a scaled cast
    dkv_post: PostprocessVariant | None  # a head split's dK and dV from theirs


@functools.lru_cache(maxsize=1024)
def _launch_steps(variant: BackwardVariant, heads_per_cta: int, problem, l2_bytes: int) -> _LaunchSteps:
    """``heads_per_cta`` keys the cache beside ``variant``, whose equality leaves it out (a launch argument)."""
    cfg = variant.config
    heads, _, band = backward_grid(variant, problem, l2_bytes)
    post = functools.partial(PostprocessVariant, variant.dtype, cfg.head_dim, varlen=problem.varlen)
    return _LaunchSteps(
        heads, band, -(-problem.seqlen_k // cfg.tile_n), cfg.num_mma_threads // 32,
        post(cfg.tile_m) if cfg.dq_fragment_order else None, post(cfg.tile_n) if variant.head_split else None,
    )  # fmt: skip


def attention_backward(
    call,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    variant: BackwardVariant,
    score_operands: tuple = ((), ()),
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """dQ, dK, dV and the score_mod's per-head vectors' gradients (by name; ``variant.operand_grads``,
    else none) of ``O = attention(q, k, v)`` (``call``: the forward's validated
    :class:`~epicute.attention.validate.AttentionCall`) for the gradient ``do`` of O (contiguous in
    head_dim); ``lse`` the forward's fp32 LSE. ``score_operands``: the score_mod's kernel operands, as
    the forward took them. ``dlse``: LSE's gradient, if LSE was used: since d LSE / d s = P, it enters
    as ``dS = P (dP - (D - dLSE))``.

    An operand's gradient sums, over every score, d loss / d score_mod (``P (dP - D)``) times the
    score_mod's derivative by the operand: the kernel leaves per (batch, head, key block, consumer warp)
    partial sums, reduced here in a fixed order."""
    q, k, v, p = call.q, call.k, call.v, call.problem
    steps = _launch_steps(variant, variant.heads_per_cta, p, current_target().l2_bytes)
    dk, dv = new_grad(k.shape, k.dtype, k.device), new_grad(v.shape, v.dtype, v.device)
    grad_names = [n for n, _, _ in variant.score_mod.tensor_operands] if variant.operand_grads else []
    sequences = call.cu_seqlens_q.numel() - 1 if p.varlen else p.batch
    partials = tuple(
        torch.zeros(sequences, p.heads_q, steps.key_blocks, steps.warps, dtype=torch.float32, device=q.device)
        for _ in grad_names
    )
    dq = new_grad(q.shape, q.dtype, q.device)
    if q.numel() and k.numel():
        packed = (call.cu_seqlens_q, p.seqlen_q) if p.varlen else ()
        cfg = variant.config
        lse_log2, dsum, dq_accum = preprocess(o, do, lse, cfg.tile_m, dlse, packed, cfg.dq_fragment_order)
        tensors, varlen = (q, k, v, do, dk, dv), ()
        if p.varlen:  # packed: one batch entry of every row
            tensors = tuple(t.unsqueeze(0) for t in tensors)
            varlen = (call.cu_seqlens_q, call.cu_seqlens_k, p.seqlen_k)
        q4, k4, v4, do4, dk4, dv4 = tensors
        dq_turns = ()
        if variant.deterministic:  # a counter per query block and head (LSE's rows are whole blocks)
            rows = lse_log2.shape
            dq_turns = (torch.zeros(*rows[:2], rows[2] // variant.config.tile_m, dtype=torch.int32, device=q.device),)
        packed_k = (call.cu_seqlens_k, p.seqlen_k) if p.varlen else ()
        dkv_accum = (key_accumulators(k, cfg.tile_n, packed_k),) if variant.head_split else ()
        launch_or_skip(
            BACKWARD_CACHE, variant, q4, k4, v4, do4, lse_log2, dsum, dq_accum, dk4, dv4, call.softmax_scale,
            steps.band, steps.heads, *score_operands, varlen, dq_turns, partials, dkv_accum,
        )  # fmt: skip
        if steps.dq_post is not None:
            launch_or_skip(POSTPROCESS_CACHE, steps.dq_post, dq_accum, dq[None] if p.varlen else dq,
                           call.softmax_scale, packed)  # fmt: skip
        else:
            torch.mul(dq_accum.view(q.shape), call.softmax_scale, out=dq)  # scaled and cast in one pass
        if steps.dkv_post is not None:  # dK (scaled in the kernel) and dV in the key blocks' fragment order
            for accum, grad in zip((dkv_accum[0][0::2], dkv_accum[0][1::2]), (dk, dv)):
                launch_or_skip(POSTPROCESS_CACHE, steps.dkv_post, accum, grad[None] if p.varlen else grad, 1.0,
                               packed_k)  # fmt: skip
    else:  # no queries: nothing flows back to the keys; no keys: none to the queries
        dq.zero_()
        dk.zero_()
        dv.zero_()
    operand_grads = {name: part.sum(dim=(0, 2, 3)) for name, part in zip(grad_names, partials)}
    return dq, dk, dv, operand_grads


__all__ = [
    "BACKWARD_CACHE",
    "POSTPROCESS_CACHE",
    "PREPROCESS_CACHE",
    "BackwardVariant",
    "PostprocessVariant",
    "PreprocessVariant",
    "attention_backward",
    "compile_backward",
    "compile_postprocess",
    "compile_preprocess",
    "key_accumulators",
    "preprocess",
    "preprocess_reference",
]
