"""Compiling and launching the attention kernel.

An :class:`AttentionVariant` is everything that changes the generated code
(config, dtype, causal, the fused score_mod and epilogue graphs). It compiles
against fake tensors -- sizes, batch/seq/head strides and head counts symbolic,
head_dim static and contiguous, 16-byte aligned -- so one compile serves every
problem shape, on machines without a GPU too. Compiled variants live in the
process-wide kernel cache under the ``"attention"`` family.

Dynamically scheduled variants (``AttentionConfig.dynamic_tiles``) claim work
tiles from an int32 counter in global memory (:func:`tile_counter`): one per
(device, stream), zero between launches because each launch's last claim
resets it, so a launch needs no memset and concurrent streams never share one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from epicute.attention.fp8 import FP8_INPUT_DTYPES, padded_keys, stored_dtype, value_slots
from epicute.attention.plan import AttentionConfig
from epicute.epilogue.dtypes import IR_TO_TORCH
from epicute.errors import CompileError
from epicute.runtime import compile as compile_module
from epicute.runtime.buffers import keep, stream_key
from epicute.runtime.cache import CacheKey
from epicute.runtime.compile import FAMILIES, OPERAND_ALIGN_BYTES, launch_or_skip, past_missing
from epicute.runtime.target import DEFAULT_ARCH, current_target


@dataclass(frozen=True)
class AttentionVariant:
    config: AttentionConfig
    dtype: str
    causal: bool
    #: the score_mod (``ScoreModFusion``) and output epilogue (``EpilogueFusion``), if any
    score_mod: object = None
    epilogue: object = None
    #: the target's arch; nothing else of the target (the persistent CTA count is a launch argument)
    arch: str = DEFAULT_ARCH
    #: keys per page of a paged K/V cache (0: contiguous K/V), and whether seqused_k is passed
    page_size: int = 0
    seqused_k: bool = False
    #: packed variable-length sequences (cu_seqlens_q/k)
    varlen: bool = False

    @property
    def out_dtype(self) -> str:
        """O's stored dtype: q's (bf16 for fp8 inputs), unless the epilogue's own final cast says otherwise."""
        return stored_dtype(self.dtype) if self.epilogue is None else self.epilogue.output_dtypes["D"]

    def key(self) -> CacheKey:
        """The compile cache's key (see :mod:`epicute.runtime.cache`)."""
        parts = (
            self.config.key(), self.dtype, self.causal,
            None if self.score_mod is None else self.score_mod.key(),
            None if self.epilogue is None else self.epilogue.key(),
            ("align", OPERAND_ALIGN_BYTES), ("page_size", self.page_size), ("seqused_k", self.seqused_k),
        ) + ((("varlen", True),) if self.varlen else ())  # fmt: skip
        c = self.config
        label = (
            f"attention d{c.head_dim} {c.tile_m}x{c.tile_n} {self.dtype}" + (" causal" if self.causal else "")
            + (f" gqa-pack{c.pack_gqa}" if c.pack_gqa > 1 else "") + (" split-kv" if c.split_kv else "")
            + (f" paged{self.page_size}" if self.page_size else "") + (" seqused" if self.seqused_k else "")
            + (" varlen" if self.varlen else "")
            + ("" if self.score_mod is None else " +score_mod") + ("" if self.epilogue is None else " +epilogue")
        )  # fmt: skip
        return CacheKey("attention", parts, self.arch, label)


def _fake_bshd(dtype, head_dim: int):
    """A fake (batch, seqlen, heads, head_dim) tensor: head_dim static and contiguous, other strides 16 B aligned."""
    from cutlass import cute

    div = 16 * 8 // dtype.width
    shape = (cute.sym_int(), cute.sym_int(), cute.sym_int(), head_dim)
    stride = (cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div), 1)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=OPERAND_ALIGN_BYTES)


def _fake_keys_contiguous(dtype, head_dim: int):
    """fp8 V as the kernel reads it: a ``(batch, slots, heads, head_dim)`` view whose slots are contiguous
    (:func:`epicute.attention.fp8.value_layout`), other strides 16 B aligned."""
    from cutlass import cute

    div = 16 * 8 // dtype.width
    shape = (cute.sym_int(), cute.sym_int(), cute.sym_int(), head_dim)
    stride = (cute.sym_int64(divisibility=div), 1, cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div))
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=OPERAND_ALIGN_BYTES)


def _fake_elementwise(dtype, rank: int):
    """A fake tensor read element by element: any strides."""
    from cutlass import cute

    return cute.runtime.make_fake_tensor(
        dtype, tuple(cute.sym_int() for _ in range(rank)), stride=tuple(cute.sym_int64() for _ in range(rank)),
        assumed_align=max(dtype.width // 8, 1),
    )  # fmt: skip


def _fake_score_operands(fusion) -> tuple[tuple, tuple]:
    """A score_mod's fake per-head vectors and fp32 scalar placeholders."""
    import cutlass

    from epicute.sm90.epilogue_emit import DSL_DTYPES

    if fusion is None:
        return (), ()
    tensors = tuple(_fake_elementwise(DSL_DTYPES[dtype], 1) for _, _, dtype in fusion.tensor_operands)
    return tensors, tuple(cutlass.Float32(0.0) for _ in fusion.scalar_operands)


def _fake_epilogue_tensors(fusion, head_dim: int) -> tuple[tuple, tuple]:
    """The output epilogue's fake tensors in ``fusion.tensor_args`` order -- operand tiles
    ``(B, Sq, H, D)`` and ``(D,)`` vectors read element by element, aux tiles stored by TMA like O,
    fp32 reduction workspaces -- and fp32 scalar placeholders."""
    import cutlass

    from epicute.sm90.epilogue_emit import DSL_DTYPES

    if fusion is None:
        return (), ()
    rank = {"tile": 4, "row": 1, "workspace": 3}
    tensors = tuple(
        _fake_bshd(DSL_DTYPES[dtype], head_dim) if role == "aux" else _fake_elementwise(DSL_DTYPES[dtype], rank[role])
        for role, _, dtype in fusion.tensor_args
    )
    return tensors, tuple(cutlass.Float32(0.0) for _ in fusion.scalar_inputs)


def _fake_partials(head_dim: int) -> tuple:
    """Split-KV's fake fp32 partials: O ``(splits, batch, seqlen_q, heads, head_dim)`` (head_dim
    static and contiguous, rows a multiple of head_dim apart: :func:`new_partials` makes them so)
    and LSE ``(splits, batch, heads, seqlen_q)``."""
    import cutlass
    from cutlass import cute

    o = cute.runtime.make_fake_tensor(
        cutlass.Float32, (*(cute.sym_int() for _ in range(4)), head_dim),
        stride=(*(cute.sym_int64(divisibility=head_dim) for _ in range(4)), 1), assumed_align=OPERAND_ALIGN_BYTES,
    )  # fmt: skip
    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32, tuple(cute.sym_int() for _ in range(4)), stride=(*(cute.sym_int64() for _ in range(3)), 1),
        assumed_align=4,
    )  # fmt: skip
    return o, lse


def compile_attention(variant: AttentionVariant):
    """Compile one variant for sm_90a; returns ``f(q, k, v, o, lse, softmax_scale, score_tensors, score_scalars,
    epi_tensors, epi_scalars, max_ctas, tile_counter, paged, seqused, partials, varlen, descales)`` taking torch
    tensors (layout ``(batch, seqlen, heads, head_dim)``, LSE ``(batch, heads, seqlen_q)`` fp32 contiguous); a
    persistent variant launches at most ``max_ctas`` CTAs (one per SM); a dynamically scheduled one claims
    tiles from ``tile_counter`` (int32, one element, zero at launch), which the others never read.
    ``paged``, ``seqused``, ``partials``, ``varlen``: ``()`` unless the variant takes them (see
    :meth:`epicute.attention.kernel_sm90.AttentionSm90.__call__`)."""
    import cutlass
    from cutlass import cute

    from epicute.attention.kernel_sm90 import AttentionSm90
    from epicute.sm90.epilogue_emit import DSL_DTYPES

    dtype = DSL_DTYPES[variant.dtype]
    d = variant.config.head_dim
    fp8 = variant.dtype in FP8_INPUT_DTYPES
    q, k = (_fake_bshd(dtype, d) for _ in range(2))
    v = _fake_keys_contiguous(dtype, d) if fp8 else _fake_bshd(dtype, d)
    descales = tuple(_fake_elementwise(cutlass.Float32, 2) for _ in range(3)) if fp8 else ()
    o = _fake_bshd(DSL_DTYPES[variant.out_dtype], d)
    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32,
        (cute.sym_int(), cute.sym_int(), cute.sym_int()),
        stride=(cute.sym_int64(), cute.sym_int64(), 1),
        assumed_align=4,
    )
    counter = cute.runtime.make_fake_tensor(cutlass.Int32, (1,), stride=(1,), assumed_align=4)
    score_tensors, score_scalars = _fake_score_operands(variant.score_mod)
    epi_tensors, epi_scalars = _fake_epilogue_tensors(variant.epilogue, d)
    paged = (_fake_elementwise(cutlass.Int32, 2),) if variant.page_size else ()
    seqused = (_fake_elementwise(cutlass.Int32, 1),) if variant.seqused_k else ()
    partials = _fake_partials(d) if variant.config.split_kv else ()
    varlen = ()
    if variant.varlen:  # cu_seqlens_q, cu_seqlens_k, max_seqlen_q
        varlen = (_fake_elementwise(cutlass.Int32, 1), _fake_elementwise(cutlass.Int32, 1), cutlass.Int32(1))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = AttentionSm90(
        variant.config, variant.dtype, variant.causal, variant.score_mod, variant.epilogue, variant.page_size,
        variant.seqused_k, variant.varlen,
    )  # fmt: skip
    try:
        with warnings.catch_warnings():
            # Empty operand tuples become compile-time constants, which is what we want.
            warnings.filterwarnings(
                "ignore",
                message=r"Argument ((score|epi)_(tensors|scalars)|paged|seqused|partials|varlen|descales) .*cannot be "
                r"converted",
            )
            return cute.compile(
                kernel, q, k, v, o, lse, cutlass.Float32(1.0), score_tensors, score_scalars, epi_tensors, epi_scalars,
                cutlass.Int32(1), counter, paged, seqused, partials, varlen, descales, stream,
                options=compile_module.DSL_COMPILE_OPTIONS,
            )  # fmt: skip
    except Exception as exc:  # the DSL raises many types; report one
        raise CompileError(f"CuTe DSL failed to compile {variant}: {exc}") from exc


ATTENTION_CACHE = FAMILIES["attention"]


@dataclass(frozen=True)
class CombineVariant:
    """Split-KV's combine kernel (:mod:`epicute.attention.combine_sm90`) for one O dtype and head_dim."""

    out_dtype: str
    head_dim: int
    arch: str = DEFAULT_ARCH

    def key(self) -> CacheKey:
        return CacheKey(
            "attention_combine", (self.out_dtype, self.head_dim), self.arch,
            f"split-KV combine d{self.head_dim} {self.out_dtype}",
        )  # fmt: skip


def compile_combine(variant: CombineVariant):
    """Compile the combine kernel; returns ``f(o_part, lse_part, o, lse)`` taking torch tensors."""
    import cutlass
    from cutlass import cute

    from epicute.attention.combine_sm90 import SplitCombineSm90
    from epicute.sm90.epilogue_emit import DSL_DTYPES

    d = variant.head_dim
    o_part, lse_part = _fake_partials(d)
    o = _fake_bshd(DSL_DTYPES[variant.out_dtype], d)
    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
        stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4,
    )  # fmt: skip
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = SplitCombineSm90(DSL_DTYPES[variant.out_dtype], d)
    try:
        return cute.compile(kernel, o_part, lse_part, o, lse, stream, options=compile_module.DSL_COMPILE_OPTIONS)
    except Exception as exc:  # the DSL raises many types; report one
        raise CompileError(f"CuTe DSL failed to compile {variant}: {exc}") from exc


COMBINE_CACHE = FAMILIES["attention_combine"]


@dataclass(frozen=True)
class ValueLayoutVariant:
    """fp8 attention's value pass (:mod:`epicute.attention.value_layout_sm90`) for one head_dim, batched or packed."""

    head_dim: int
    varlen: bool = False
    arch: str = DEFAULT_ARCH

    def key(self) -> CacheKey:
        return CacheKey(
            "attention_value_layout", (self.head_dim, self.varlen), self.arch,
            f"fp8 value layout d{self.head_dim}" + (" varlen" if self.varlen else ""),
        )  # fmt: skip


def compile_value_layout(variant: ValueLayoutVariant):
    """Compile the value pass; returns ``f(v, out, varlen)`` taking uint8 views of torch tensors."""
    import cutlass
    from cutlass import cute

    from epicute.attention.value_layout_sm90 import ValueLayoutSm90

    d = variant.head_dim
    v = _fake_bshd(cutlass.Uint8, d)
    out = cute.runtime.make_fake_tensor(
        cutlass.Uint8, (cute.sym_int(), cute.sym_int(), d, cute.sym_int()),
        stride=(cute.sym_int64(divisibility=16), cute.sym_int64(divisibility=16), cute.sym_int64(divisibility=16), 1),
        assumed_align=OPERAND_ALIGN_BYTES,
    )  # fmt: skip
    varlen = (_fake_elementwise(cutlass.Int32, 1), cutlass.Int32(1)) if variant.varlen else ()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Argument varlen .*cannot be converted")
            return cute.compile(ValueLayoutSm90(d, variant.varlen), v, out, varlen, stream,
                                options=compile_module.DSL_COMPILE_OPTIONS)  # fmt: skip
    except Exception as exc:  # the DSL raises many types; report one
        raise CompileError(f"CuTe DSL failed to compile {variant}: {exc}") from exc


VALUE_LAYOUT_CACHE = FAMILIES["attention_value_layout"]


def lay_out_values(v: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None):
    """:func:`epicute.attention.fp8.value_layout` on the GPU: one kernel pass; packed sequences into a zeroed
    buffer (the slots between them are read, masked, by the last block of each sequence)."""
    d = v.size(-1)
    if cu_seqlens_k is None:
        batch, seqlen, heads, _ = v.shape
        physical = torch.empty((batch, heads, d, padded_keys(seqlen)), dtype=v.dtype, device=v.device)
        packed, varlen = v, ()
    else:
        total, heads, _ = v.shape
        batch = cu_seqlens_k.numel() - 1
        if max_seqlen_k is None:  # one read of the offsets (a sync)
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if batch else 0
        physical = torch.zeros((1, heads, d, value_slots(total, batch)), dtype=v.dtype, device=v.device)
        packed, varlen = v.unsqueeze(0), (cu_seqlens_k, max_seqlen_k)
    if v.numel() and physical.numel():
        kernel = VALUE_LAYOUT_CACHE.get(ValueLayoutVariant(d, cu_seqlens_k is not None, current_target().arch))
        kernel(packed.view(torch.uint8), physical.view(torch.uint8), varlen)
    return physical.permute(0, 3, 1, 2)


_TILE_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def tile_counter(device: torch.device, dynamic: bool = True) -> torch.Tensor:
    """The work counter of dynamically scheduled launches on ``device``'s current stream
    (see the module docstring): allocated zeroed on first use, then left at zero by every launch.
    With ``dynamic=False``, one placeholder per device that the kernel never reads (no stream query)."""
    key = stream_key(device) if dynamic else (device, None)
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter = keep(_TILE_COUNTERS, key, torch.zeros(1, dtype=torch.int32, device=device))
    return counter


def new_lse(shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """The LSE buffer of one call (a seam for tests, which poison it with NaN)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer the kernel fills: O, an aux tile or a reduction workspace (a seam for tests, which
    poison it with NaN: every element must be written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def new_partials(splits: int, p, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV's fp32 partial O ``(splits, batch, seqlen_q, heads_q, head_dim)`` and LSE ``(splits,
    batch, heads_q, seqlen_q)`` of one call (every row a split owns is written)."""
    o = torch.empty((splits, p.batch, p.seqlen_q, p.heads_q, p.head_dim), dtype=torch.float32, device=device)
    return o, torch.empty((splits, p.batch, p.heads_q, p.seqlen_q), dtype=torch.float32, device=device)


#: Split-KV partials kept per (device, stream, shape): two allocations a decode step does not repeat.
_PARTIALS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_KEPT_PARTIALS = 64


def split_partials(splits: int, p, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`new_partials` of ``device``'s current stream, kept between eager launches of one shape (every launch
    writes each row the combine then reads, empty splits included; a CUDA graph's own are not kept:
    :mod:`epicute.runtime.buffers`)."""
    key = (*stream_key(device), splits, p.batch, p.seqlen_q, p.heads_q, p.head_dim)
    kept = _PARTIALS.get(key)
    if kept is None:
        if len(_PARTIALS) >= _KEPT_PARTIALS:
            _PARTIALS.clear()
        kept = keep(_PARTIALS, key, new_partials(splits, p, device))
    return kept


def launch_attention(
    call,
    variant: AttentionVariant,
    score_operands: tuple = ((), ()),
    epi_operands: tuple = ((), ()),
    max_ctas: int | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Run the kernel on a validated ``call``; returns every output by name -- ``"D"``: O ``(B, Sq, Hq, D)``
    in its stored dtype (``call.out`` if given), aux tiles like it, reductions finalized -- and LSE
    ``(B, Hq, Sq)`` fp32; packed sequences (varlen) give O like q, ``(total_q, Hq, D)``, and LSE
    ``(Hq, total_q)``. ``max_ctas`` bounds a persistent grid (the plan's
    :attr:`~epicute.attention.plan.AttentionPlan.max_ctas`; default: one CTA per SM of the current GPU).
    A split-KV variant writes partials that :data:`COMBINE_CACHE`'s kernel then reduces into O and LSE."""
    p, device = call.problem, call.q.device
    fusion = variant.epilogue
    outputs = {"D": variant.out_dtype} if fusion is None else fusion.tile_output_dtypes
    stored = {name: IR_TO_TORCH[dtype] for name, dtype in outputs.items()}
    out = call.out
    if out is None:
        out = new_output(call.q.shape, stored["D"], device)
    aux = {name: new_output(call.q.shape, dtype, device) for name, dtype in stored.items() if name != "D"}
    reductions = () if fusion is None else fusion.reductions
    # Reductions see (L, M, N) = (batch * heads, seqlen_q, head_dim); one tile spans head_dim.
    lmn = (p.batch * p.heads_q, p.seqlen_q, p.head_dim)
    workspaces = {r.name: new_output(r.workspace_shape(*lmn, p.head_dim), torch.float32, device) for r in reductions}
    lse = new_lse((p.heads_q, call.q.size(0)) if p.varlen else (p.batch, p.heads_q, p.seqlen_q), device)
    # While precompiling, a missing kernel leaves O and LSE unwritten: the backward reads them as values only.
    kernel = past_missing(lambda: ATTENTION_CACHE.get(variant), lambda: None) if out.numel() else None
    if kernel is not None:
        if max_ctas is None:
            max_ctas = current_target().num_sms
        tensors, scalars = epi_operands
        epi_tensors = tensors + tuple(aux.values()) + tuple(workspaces.values())
        cfg = variant.config
        partials = split_partials(cfg.num_splits, p, device) if cfg.split_kv else ()
        q, k, v, o, lse_bhs, varlen = call.q, call.k, call.v, out, lse, ()
        if p.varlen:  # packed: one batch entry of every row
            q, k, o, lse_bhs = (t.unsqueeze(0) for t in (q, k, o, lse))
            v = v if p.dtype in FP8_INPUT_DTYPES else v.unsqueeze(0)
            varlen = (call.cu_seqlens_q, call.cu_seqlens_k, p.seqlen_q)
        descales = ()
        if p.dtype in FP8_INPUT_DTYPES:
            v = v if call.v_slots else lay_out_values(call.v, call.cu_seqlens_k, p.seqlen_k if p.varlen else None)
            descales = call.descales
        kernel(
            q, k, v, o, lse_bhs, call.softmax_scale, *score_operands, epi_tensors, scalars, max_ctas,
            tile_counter(call.q.device, cfg.dynamic_tiles),
            () if call.page_table is None else (call.page_table,), () if call.seqused_k is None else (call.seqused_k,),
            partials, varlen, descales,
        )  # fmt: skip
        if partials:
            launch_or_skip(COMBINE_CACHE, CombineVariant(variant.out_dtype, p.head_dim, variant.arch), *partials, out,
                           lse)  # fmt: skip
    results = {"D": out, **aux}
    for r in reductions:
        value = r.finalize(workspaces[r.name])
        results[r.name] = value if r.axis == "all" else value.reshape(p.batch, p.heads_q, -1)
    return results, lse
