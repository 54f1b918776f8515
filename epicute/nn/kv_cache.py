"""A paged KV cache that appends, and attention over it (``flash_attn_with_kvcache``'s call, on epicute).

- :class:`PagedKVCache`: one layer's keys and values for ``batch`` sequences in fixed-size pages, the layout
  :func:`epicute.attention` reads through ``page_table`` and ``seqused_k``. :meth:`PagedKVCache.append` writes new
  keys and values behind each sequence's own length, on the device (no host sync: a decode step that appends and
  attends can be captured in a CUDA graph and replayed, the lengths advancing on the GPU).
- :func:`attention_with_kvcache`: append ``k_new``/``v_new`` (optional), then attend ``q`` (causal, bottom-right
  aligned: query ``i`` of ``s`` new ones sees the cache and the new keys up to its own) over each sequence's cache.
- An fp8 cache (``dtype=torch.float8_e4m3fn``) stores keys and values in e4m3 with one scale per key/value head
  (``k_scale``, ``v_scale``: what a stored value is multiplied by, vLLM's convention; calibrate them, or values past
  448 x scale saturate), its value pages in the fp8 kernel's layout (:mod:`epicute.attention.fp8`); attention over
  it quantizes ``q`` per (sequence, key/value head) and runs the fp8 kernel, reading half the bytes of bf16.

Example:
    >>> import torch, epicute
    >>> from epicute.nn import PagedKVCache, attention_with_kvcache
    >>> cache = PagedKVCache(2, 256, kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cpu")
    >>> q = torch.randn(2, 5, 8, 64, dtype=torch.bfloat16)  # a 5-token prefill, 8 query heads (GQA 4:1)
    >>> k, v = (torch.randn(2, 5, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    >>> with epicute.use_backend("reference"):
    ...     out = attention_with_kvcache(q, cache, k, v)
    >>> out.shape, cache.seqlens.tolist()
    (torch.Size([2, 5, 8, 64]), [5, 5])
"""

from __future__ import annotations

from typing import Any

import torch

from epicute.attention.api import attention
from epicute.attention.fp8 import slot_of_position
from epicute.epilogue.dtypes import FP8_MAX
from epicute.errors import GradientError, ShapeError
from epicute.quantize.api import quantize

E4M3_MAX = FP8_MAX["fp8e4m3"]


class PagedKVCache:
    """Keys and values of ``batch`` sequences of up to ``max_seqlen`` tokens, in pages of ``page_size`` tokens.

    ``k_pages``/``v_pages`` ``(num_pages, page_size, kv_heads, head_dim)``; ``page_table`` int32 ``(batch, pages per
    sequence)`` (default: sequence ``b`` owns pages ``b * P`` to ``b * P + P - 1``; pass your own, e.g. a block
    manager's, to share a pool); ``seqlens`` int32 ``(batch,)``, each sequence's cached tokens (zero to start, or
    given). Appending past a sequence's pages is not checked (that would read the lengths back to the host).
    """

    def __init__(
        self,
        batch: int,
        max_seqlen: int,
        kv_heads: int,
        head_dim: int,
        *,
        page_size: int = 64,
        page_table: torch.Tensor | None = None,
        num_pages: int | None = None,
        seqlens: torch.Tensor | None = None,
        device: Any = None,
        dtype: torch.dtype = torch.bfloat16,
        k_scale: float | torch.Tensor = 1.0,
        v_scale: float | torch.Tensor = 1.0,
    ) -> None:
        if page_size % 16 or not 16 <= page_size <= 256:
            raise ShapeError(f"page_size={page_size}: epicute's paged attention takes a multiple of 16 up to 256")
        if dtype == torch.float8_e4m3fn and page_size % 32:
            raise ShapeError(f"page_size={page_size}: an fp8 cache's pages hold a multiple of 32 keys (the fp8 "
                             "kernel's PV step)")  # fmt: skip
        per_sequence = -(-max_seqlen // page_size)
        if page_table is None:
            page_table = torch.arange(batch * per_sequence, device=device, dtype=torch.int32).view(batch, -1)
        if page_table.shape[0] != batch or page_table.dtype != torch.int32:
            raise ShapeError(f"page_table {tuple(page_table.shape)} {page_table.dtype}: pass int32 (batch={batch}, "
                             "pages per sequence)")  # fmt: skip
        num_pages = num_pages or batch * per_sequence
        self.page_size, self.page_table = page_size, page_table
        self.fp8 = dtype == torch.float8_e4m3fn
        self.k_pages = torch.zeros(num_pages, page_size, kv_heads, head_dim, device=device, dtype=dtype)
        if self.fp8:  # value pages keys-contiguous in the fp8 kernel's slot order, seen (pages, page_size, heads, dim)
            pages = torch.zeros(num_pages, kv_heads, head_dim, page_size, device=device, dtype=dtype)
            self.v_pages = pages.permute(0, 3, 1, 2)
            self.k_scale, self.v_scale = (self._head_scale(x, n, kv_heads) for x, n in ((k_scale, "k_scale"),
                                                                                        (v_scale, "v_scale")))
        else:
            self.v_pages = torch.zeros_like(self.k_pages)
        self.seqlens = (torch.zeros(batch, device=device, dtype=torch.int32) if seqlens is None
                        else seqlens.to(device=self.k_pages.device, dtype=torch.int32).clone())  # fmt: skip

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write ``k_new``/``v_new`` ``(batch, s, kv_heads, head_dim)`` at positions ``seqlens[b]`` to
        ``seqlens[b] + s - 1`` of each sequence, then advance ``seqlens`` by ``s`` (all on the device)."""
        batch, s = k_new.shape[:2]
        if k_new.shape != v_new.shape or k_new.shape[2:] != self.k_pages.shape[2:] or batch != self.seqlens.shape[0]:
            want = f"(batch={self.seqlens.shape[0]}, s, {self.k_pages.shape[2]}, {self.k_pages.shape[3]})"
            raise ShapeError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)}: need {want} each")
        room = self.page_table.shape[1] * self.page_size
        # The lengths live on the device: checked where that reads nothing back (a GPU index past the page table
        # stops at torch's device-side assert in the gather below).
        eager_cpu = self.seqlens.device.type == "cpu" and batch and not torch.compiler.is_compiling()
        longest = s + (int(self.seqlens.max()) if eager_cpu else 0)
        if longest > room:
            raise ShapeError(f"appending {s} tokens would fill a sequence to {longest}: the cache holds {room} a "
                             "sequence (max_seqlen in whole pages); build it with a larger max_seqlen")  # fmt: skip
        positions = self.seqlens.long()[:, None] + torch.arange(s, device=self.seqlens.device)  # (batch, s)
        pages = self.page_table.long().gather(1, positions // self.page_size)
        slots = positions % self.page_size
        if self.fp8:
            self.k_pages[pages, slots] = _to_e4m3(k_new, self.k_scale)
            self.v_pages[pages, slot_of_position(slots)] = _to_e4m3(v_new, self.v_scale)
        else:
            self.k_pages[pages, slots] = k_new.to(self.k_pages.dtype)
            self.v_pages[pages, slots] = v_new.to(self.v_pages.dtype)
        self.seqlens += s

    def _head_scale(self, value, name: str, kv_heads: int) -> torch.Tensor:
        """A per-head fp32 scale ``(kv_heads,)`` from a number or a tensor of one or ``kv_heads`` values."""
        device = self.k_pages.device
        t = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
        if t.numel() not in (1, kv_heads) or not bool(torch.isfinite(t).all() & (t > 0).all()):
            raise ShapeError(f"{name}: pass a positive number or one per key/value head ({kv_heads},)")
        return t.expand(kv_heads).clone()

    def descales(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_descale, v_descale) ``(batch, kv_heads)`` as :func:`epicute.attention` takes them (fp8 caches)."""
        return self.k_scale.expand(batch, -1), self.v_scale.expand(batch, -1)

    def reset(self) -> None:
        """Every sequence empty again (the pages are reused as they are)."""
        self.seqlens.zero_()


def attention_with_kvcache(
    q: torch.Tensor,
    cache: PagedKVCache,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``flash_attn_with_kvcache``'s call: append ``k_new``/``v_new`` to ``cache`` (when given), then
    :func:`epicute.attention` of ``q`` ``(batch, s, heads, head_dim)`` over each sequence's cached keys (their
    ``seqlens``, new ones included). ``kwargs`` go to :func:`epicute.attention` (``score_mod``, ``config``...)."""
    if (k_new is None) != (v_new is None):
        raise ShapeError("pass k_new and v_new together (or neither)")
    if k_new is not None:
        cache.append(k_new, v_new)
    if cache.fp8:
        if q.requires_grad and torch.is_grad_enabled():
            raise GradientError("q requires grad, and attention over an fp8 cache has no backward (it serves "
                                "inference): call it under torch.no_grad() or pass q.detach()")  # fmt: skip
        q8, q_scale = _quantized_query(q, cache.k_pages.size(2))
        k_descale, v_descale = cache.descales(q.size(0))
        out = attention(q8, cache.k_pages, cache.v_pages, causal=causal, softmax_scale=softmax_scale,
                        page_table=cache.page_table, seqused_k=cache.seqlens, q_descale=q_scale, k_descale=k_descale,
                        v_descale=v_descale, v_layout="slots", **kwargs)  # fmt: skip
        return out if q.dtype == torch.bfloat16 else out.to(q.dtype)
    return attention(q, cache.k_pages, cache.v_pages, causal=causal, softmax_scale=softmax_scale,
                     page_table=cache.page_table, seqused_k=cache.seqlens, **kwargs)  # fmt: skip


def _quantized_query(q: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``(batch, s, heads, head_dim)`` in e4m3 with one scale per (sequence, key/value head): fp8 attention's
    ``q_descale`` ``(batch, kv_heads)``, by :func:`epicute.quantize`'s rowwise recipe over each group's rows of
    ``s x group x head_dim`` values (a one-query step's are q itself, up to 1024 values a row: one kernel)."""
    batch, s, heads, dim = q.shape
    group_values = heads // kv_heads * dim
    rows = q.reshape(batch, s, kv_heads, group_values).transpose(1, 2).reshape(batch * kv_heads, s * group_values)
    if rows.data_ptr() % 16:  # a view at an odd offset: the kernel's 16-byte loads want its first element aligned
        rows = rows.clone()
    q8, scales = quantize(rows, recipe="rowwise")
    q8 = q8.view(batch, kv_heads, s, group_values).transpose(1, 2).reshape(batch, s, heads, dim)
    return q8, scales.view(batch, kv_heads)


def _to_e4m3(x: torch.Tensor, head_scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``(..., kv_heads, head_dim)`` divided by its head's scale, saturated and rounded to e4m3."""
    scaled = x.float() / head_scale[:, None]
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


__all__ = ["PagedKVCache", "attention_with_kvcache"]
