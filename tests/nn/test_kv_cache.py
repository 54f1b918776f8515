"""The paged KV cache and the Attention layer on the CPU (the reference backend)."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.nn import PagedKVCache, attention_with_kvcache
from tests.nn.kv_cases import attention_layer_step, paged_appends

TOL = 2e-2  # bf16 q, k, v and outputs


def test_appends_land_in_their_pages_and_attention_reads_them(reference_layers):
    result = paged_appends("cpu")
    assert result["landed"] and result["seqlens"] == [8, 25, 48]
    assert result["worst"] < TOL, result


def test_the_attention_layer_trains_and_serves_the_same_outputs(reference_layers):
    errors = attention_layer_step("cpu")
    assert all(e < TOL for e in errors.values()), errors


def test_bad_caches_and_appends_are_refused():
    with pytest.raises(epicute.ShapeError, match="page_size=24"):
        PagedKVCache(2, 64, 2, 64, page_size=24)
    cache = PagedKVCache(2, 64, 2, 64, page_size=16)
    with pytest.raises(epicute.ShapeError, match=r"need \(batch=2, s, 2, 64\)"):
        cache.append(torch.randn(2, 1, 4, 64), torch.randn(2, 1, 4, 64))
    with pytest.raises(epicute.ShapeError, match="together"):
        attention_with_kvcache(torch.randn(2, 1, 4, 64), cache, torch.randn(2, 1, 2, 64))
