"""The paged KV cache and the Attention layer on the CPU (the reference backend)."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.nn import PagedKVCache, attention_with_kvcache
from tests.nn.kv_cases import E4M3, FP8_TOL, attention_layer_step, fp8_cache_serving, paged_appends

TOL = 2e-2  # bf16 q, k, v and outputs


def test_appends_land_in_their_pages_and_attention_reads_them(reference_layers):
    result = paged_appends("cpu")
    assert result["landed"] and result["seqlens"] == [8, 25, 48]
    assert result["worst"] < TOL, result


def test_an_fp8_cache_appends_rounded_values_and_attends_over_them(reference_layers):
    result = paged_appends("cpu", dtype=E4M3)
    assert result["landed"] and result["seqlens"] == [8, 25, 48]
    assert result["worst"] < FP8_TOL, result


def test_the_attention_layer_serves_through_an_fp8_cache(reference_layers):
    assert fp8_cache_serving("cpu") < FP8_TOL


def test_the_attention_layer_trains_and_serves_the_same_outputs(reference_layers):
    errors = attention_layer_step("cpu")
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("steps", (1, 3))
def test_q_is_quantized_per_sequence_and_kv_head(reference_layers, steps):
    # each (sequence, K/V head)'s rows by epicute.quantize's rowwise recipe (one query a step: q's own memory, the GPU
    # kernel; longer steps a transposed copy): q_descale = amax / 448 and q within one e4m3 rounding of q8 * q_descale
    from epicute.nn.kv_cache import _quantized_query

    q = (torch.randn(3, steps, 8, 64) * torch.rand(3, 1, 8, 1) * 9).to(torch.bfloat16)
    q8, scale = _quantized_query(q, 2)
    assert q8.dtype == E4M3 and q8.shape == q.shape and scale.shape == (3, 2)
    amax = q.double().view(3, steps, 2, 4, 64).abs().amax(dim=(1, 3, 4))
    assert ((scale.double() - amax / 448).abs() / (amax / 448)).max() < 1e-6
    per_head = scale.double().repeat_interleave(4, dim=1)[:, None, :, None]
    err = (q8.double() * per_head - q.double()).abs()
    assert (err <= 2.0**-4 * q.double().abs() + 2.0**-9 * per_head).all()


def test_bad_caches_and_appends_are_refused():
    with pytest.raises(epicute.ShapeError, match="page_size=24"):
        PagedKVCache(2, 64, 2, 64, page_size=24)
    cache = PagedKVCache(2, 64, 2, 64, page_size=16)
    with pytest.raises(epicute.ShapeError, match=r"need \(batch=2, s, 2, 64\)"):
        cache.append(torch.randn(2, 1, 4, 64), torch.randn(2, 1, 4, 64))
    # 64 positions a sequence: 65 new tokens never fit; 40 after 40 do not either (checked where the lengths are
    # on the CPU), and the refused append leaves the cache as it was.
    with pytest.raises(epicute.ShapeError, match="appending 65 tokens would fill a sequence to 65: the cache holds 64"):
        cache.append(torch.randn(2, 65, 2, 64), torch.randn(2, 65, 2, 64))
    cache.append(torch.randn(2, 40, 2, 64), torch.randn(2, 40, 2, 64))
    with pytest.raises(epicute.ShapeError, match="appending 40 tokens would fill a sequence to 80"):
        cache.append(torch.randn(2, 40, 2, 64), torch.randn(2, 40, 2, 64))
    assert cache.seqlens.tolist() == [40, 40]
    with pytest.raises(epicute.ShapeError, match="k_scale: pass a positive number or one per key/value head"):
        PagedKVCache(2, 64, 2, 64, page_size=32, dtype=E4M3, k_scale=torch.ones(3))
    with pytest.raises(epicute.ShapeError, match="fp8 cache's pages hold a multiple of 32 keys"):
        PagedKVCache(2, 64, 2, 64, page_size=16, dtype=E4M3)
    with pytest.raises(epicute.ShapeError, match="together"):
        attention_with_kvcache(torch.randn(2, 1, 4, 64), cache, torch.randn(2, 1, 2, 64))
    fp8_cache = PagedKVCache(2, 64, 2, 64, page_size=32, dtype=E4M3)
    with pytest.raises(epicute.GradientError, match="fp8 cache has no backward"):
        attention_with_kvcache(torch.randn(2, 1, 4, 64, dtype=torch.bfloat16, requires_grad=True), fp8_cache)
