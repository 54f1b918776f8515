"""The paged KV cache and the Attention layer on the GPU: appends through a shuffled page table, the layer's
training and serving paths, and a decode step (append and attend) captured in a CUDA graph and replayed."""

from __future__ import annotations

import pytest
import torch

from epicute.nn import PagedKVCache, attention_with_kvcache
from tests.nn.kv_cases import (
    BF16,
    E4M3,
    FP8_TOL,
    attention64,
    attention_layer_step,
    cached_keys,
    fp8_cache_serving,
    paged_appends,
    rel,
)

pytestmark = pytest.mark.gpu

TOL = 2e-2  # bf16 q, k, v and outputs


def test_appends_land_in_their_pages_and_attention_reads_them():
    result = paged_appends("cuda")
    assert result["landed"] and result["seqlens"] == [8, 25, 48]
    assert result["worst"] < TOL, result


def test_the_attention_layer_trains_and_serves_the_same_outputs():
    errors = attention_layer_step("cuda")
    assert all(e < TOL for e in errors.values()), errors


def test_a_decode_step_replays_in_a_cuda_graph():
    """Append one token per sequence and attend, captured once; each replay reads new q/k/v from the static inputs
    and the lengths the previous replay advanced (on the GPU: no host sync anywhere in the step)."""
    batch, heads, kv_heads, d = 4, 24, 8, 128  # Llama-3.2-3B's GQA 3:1
    cache = PagedKVCache(batch, 512, kv_heads, d, page_size=64, device="cuda", dtype=BF16,
                         seqlens=torch.tensor([1, 100, 255, 300]))  # fmt: skip
    cache.k_pages.normal_()
    cache.v_pages.normal_()
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=BF16)
    k_new, v_new = (torch.randn(batch, 1, kv_heads, d, device="cuda", dtype=BF16) for _ in range(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and plans outside the capture
        attention_with_kvcache(q, cache, k_new, v_new)
    torch.cuda.current_stream().wait_stream(side)
    cache.seqlens -= 1  # undo the warm-up's append
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_with_kvcache(q, cache, k_new, v_new)
    # (capturing records the step without running it: the lengths have not moved)
    for step in range(3):
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert cache.seqlens.tolist() == [2 + step, 101 + step, 256 + step, 301 + step]
        for b in range(batch):
            k, v = cached_keys(cache, b)
            assert torch.equal(k[-1], k_new[b, 0]) and torch.equal(v[-1], v_new[b, 0])
            assert rel(out[b], attention64(q[b], k, v)) < TOL, (step, b)


def test_an_fp8_cache_appends_and_the_fp8_kernel_attends_over_it():
    result = paged_appends("cuda", dtype=E4M3)
    assert result["landed"] and result["seqlens"] == [8, 25, 48]
    assert result["worst"] < FP8_TOL, result


def test_the_attention_layer_serves_through_an_fp8_cache():
    assert fp8_cache_serving("cuda") < FP8_TOL
