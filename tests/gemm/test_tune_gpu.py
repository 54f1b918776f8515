"""Autotuning on the GPU: every candidate runs, the winner is stored and used by gemm(tune=True)."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.gemm import api as gemm_api
from epicute.gemm import tune as gemm_tune
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu


def test_tune_stores_a_winner_that_gemm_uses(monkeypatch, tmp_path):
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    gemm_api._TUNED.clear()
    a = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 1032, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1032, device="cuda", dtype=torch.bfloat16)
    fn = lambda acc, bias: epicute.ops.relu(acc + bias)
    result = epicute.tune(a, b, epilogue=fn, bias=bias, iters=3, warmup=1, progress=False)
    assert len(result.times_ms) >= 4 and all(t > 0 for t in result.times_ms.values())
    assert result.times_ms[gemm_tune.label(result.best)] == min(result.times_ms.values())
    gemm_api._TUNED.clear()  # the next call reads the disk store
    out = epicute.gemm(a, b, epilogue=fn, bias=bias, tune=True)
    ref = epicute.gemm(a, b, epilogue=fn, bias=bias, backend="reference")
    assert rel_err(out.float().cpu(), ref.float()) < 1e-2
