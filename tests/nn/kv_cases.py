"""The paged KV cache and the Attention layer against float64 torch math, shared by the CPU and GPU tests."""

from __future__ import annotations

import math

import torch

from epicute.attention.fp8 import slot_of_position
from epicute.nn import Attention, PagedKVCache, attention_with_kvcache

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
#: An fp8 cache's outputs against float64 math of its (dequantized) contents: q is rounded to e4m3 per call and, in
#: the kernel, P too; each rounding is <= 2**-4 relative (RMS ~3.6 % on random values), so ~5 % together.
FP8_TOL = 8e-2


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence: q ``(s, H, D)`` over k, v ``(L, Hkv, D)``, causal bottom-right aligned, in float64."""
    s, heads, d = q.shape
    length, kv_heads = k.shape[:2]
    k, v = (t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("shd,lhd->hsl", q.double(), k) / math.sqrt(d)
    visible = torch.arange(length)[None, :] <= (length - s + torch.arange(s))[:, None]
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hsl,lhd->shd", scores.softmax(-1), v)


def cached_keys(cache: PagedKVCache, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s cached keys and values, in position order, read through its pages."""
    length = int(cache.seqlens[b])
    positions = torch.arange(length, device=cache.seqlens.device)
    pages = cache.page_table[b].long()[positions // cache.page_size]
    slots = positions % cache.page_size
    if cache.fp8:  # dequantized; values in the fp8 kernel's slot order within each page
        k = cache.k_pages[pages, slots].float() * cache.k_scale[:, None]
        return k, cache.v_pages[pages, slot_of_position(slots)].float() * cache.v_scale[:, None]
    return cache.k_pages[pages, slots], cache.v_pages[pages, slots]


def paged_appends(device: str, steps: tuple[int, ...] = (5, 1, 1, 1), dtype: torch.dtype = BF16) -> dict[str, float]:
    """Three sequences already holding 0, 17 and 40 tokens (pages of 16, or 32 for fp8, shuffled over a shared pool),
    GQA 3:1: each step appends ``s`` new keys and values and attends ``s`` queries. Returns the worst relative error
    of the outputs, and whether the appended keys landed where the table says (read back through the pages). An fp8
    ``dtype``: per-head scales, keys and values compared after their rounding to e4m3."""
    batch, heads, kv_heads, d, max_len = 3, 6, 2, 64, 96
    page_size = 32 if dtype == E4M3 else 16  # fp8 pages hold a multiple of 32 keys
    pages_per_seq = max_len // page_size
    table = torch.randperm(batch * pages_per_seq + 3, device=device)[: batch * pages_per_seq]
    scales = {"k_scale": torch.tensor([0.02, 0.01]), "v_scale": 0.015} if dtype == E4M3 else {}
    cache = PagedKVCache(batch, max_len, kv_heads, d, page_size=page_size, device=device,
                         page_table=table.view(batch, -1).to(torch.int32), num_pages=batch * pages_per_seq + 3,
                         seqlens=torch.tensor([0, 17, 40]), dtype=dtype, **scales)  # fmt: skip
    for pages in (cache.k_pages, cache.v_pages):
        pages.copy_(torch.randn(pages.shape, device=device) * (30 if dtype == E4M3 else 1))
    worst, landed = 0.0, True
    for s in steps:
        q = torch.randn(batch, s, heads, d, device=device, dtype=BF16)
        k_new, v_new = (torch.randn(batch, s, kv_heads, d, device=device, dtype=BF16) for _ in range(2))
        out = attention_with_kvcache(q, cache, k_new, v_new)
        if cache.fp8:  # what the cache holds of them: rounded to e4m3 at their heads' scales
            k_new, v_new = (
                (t.float() / scale[:, None]).to(E4M3).float() * scale[:, None]
                for t, scale in ((k_new, cache.k_scale), (v_new, cache.v_scale))
            )
        for b in range(batch):
            k, v = cached_keys(cache, b)
            landed &= torch.equal(k[-s:], k_new[b].to(k.dtype)) and torch.equal(v[-s:], v_new[b].to(v.dtype))
            worst = max(worst, rel(out[b], attention64(q[b], k, v)))
    return {"worst": worst, "landed": landed, "seqlens": cache.seqlens.tolist()}


def rotary64(t: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding as a complex rotation of the pairs ``(i, i + D/2)``, in float64 (Llama's convention)."""
    half = t.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=t.device) / half)
    turn = torch.polar(torch.ones_like(inv_freq), positions.double()[..., None] * inv_freq)[:, :, None, :]
    z = torch.complex(t[..., :half].double(), t[..., half:].double()) * turn
    return torch.cat([z.real, z.imag], dim=-1)


def attention_layer_math(layer: Attention, x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's forward (no cache) in float64 from its weights."""
    batch, s, _ = x.shape
    x = x.double()
    q, k, v = (torch.nn.functional.linear(x, weights[f"{n}_proj"]) for n in "qkv")
    q = q.view(batch, s, layer.num_heads, layer.head_dim)
    k, v = (t.view(batch, s, layer.num_kv_heads, layer.head_dim) for t in (k, v))
    positions = torch.arange(s, device=x.device)[None, :]
    q, k = rotary64(q, positions, layer.rope_theta), rotary64(k, positions, layer.rope_theta)
    out = torch.stack([attention64(q[b], k[b], v[b]) for b in range(batch)])
    return torch.nn.functional.linear(out.reshape(batch, s, -1), weights["o_proj"])


def fp8_cache_serving(device: str) -> float:
    """The Attention layer serving through an fp8 cache (per-head scales sized to the keys and values): a 5-token
    prefill and 4 decode steps against the whole 9 tokens at once in bf16. Returns the relative error."""
    torch.manual_seed(0)
    layer = Attention(512, 8, 2, rope_theta=500000.0, device=device, dtype=BF16)  # head_dim 64
    x = torch.randn(2, 9, 512, device=device, dtype=BF16)
    with torch.no_grad():
        whole = layer(x)
        k, v = layer.k_proj(x), layer.v_proj(x)  # the scales a calibration would pick: each head's amax / 448
        scales = [t.view(2, 9, 2, 64).abs().amax(dim=(0, 1, 3)).float() / 448 for t in (k, v)]
        cache = PagedKVCache(2, 64, 2, 64, page_size=32, device=device, dtype=E4M3, k_scale=scales[0],
                             v_scale=scales[1])  # fmt: skip
        served = [layer(x[:, :5], cache)] + [layer(x[:, i : i + 1], cache) for i in range(5, 9)]
    return rel(torch.cat(served, dim=1), whole)


def attention_layer_step(device: str) -> dict[str, float]:
    """Training (no cache) against float64 autograd, then serving: a 5-token prefill into a cache and 4 decode
    steps give the same outputs as the whole 9 tokens at once."""
    torch.manual_seed(0)
    layer = Attention(512, 8, 2, rope_theta=500000.0, device=device, dtype=BF16)  # head_dim 64
    x = torch.randn(2, 9, 512, device=device, dtype=BF16, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    weights = {f"{n}_proj": getattr(layer, f"{n}_proj").weight.detach().double().requires_grad_() for n in "qkvo"}
    x64 = x.detach().double().requires_grad_()
    want = attention_layer_math(layer, x64, weights)
    want.backward(grad.double())
    errors = {"out": rel(y, want.detach()), "x": rel(x.grad, x64.grad)}
    errors |= {name: rel(getattr(layer, name).weight.grad, w.grad) for name, w in weights.items()}
    cache = PagedKVCache(2, 64, 2, 64, page_size=16, device=device, dtype=BF16)
    with torch.no_grad():
        served = [layer(x[:, :5], cache)] + [layer(x[:, i : i + 1], cache) for i in range(5, 9)]
    errors["served vs whole"] = rel(torch.cat(served, dim=1), y.detach())
    return errors
