"""Cold calls from several threads at once: each compile enters the CuTe DSL alone.

Two DSL compiles on two threads at once abort the interpreter (MLIR's builder
state is process-global), so the cache serializes every miss; these tests start
concurrent cold compiles of different variants and check every one of them.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

import epicute
from epicute import ops
from epicute.gemm import GemmConfig
from epicute.gemm.compile import GemmVariant, compile_gemm
from epicute.gemm.launch import kernel_for
from epicute.runtime.cache import KERNEL_CACHE, KernelCache
from tests.conftest import rel_err


def _run_in_threads(jobs: list) -> list:
    """Run each zero-argument job on its own thread, released together; return their results in order."""
    start = threading.Barrier(len(jobs))
    results: list = [None] * len(jobs)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - any failure on the worker is handed to the main thread to report
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not failed, f"jobs failed: {failed}"
    return results


@pytest.mark.compile
def test_concurrent_cold_compiles_of_different_variants(monkeypatch):
    monkeypatch.setenv("EPICUTE_CACHE", "0")  # every get is a compile
    cache = KernelCache()
    variants = [
        GemmVariant(GemmConfig(tile_n=64, persistent=False), "bf16", "bf16", "k", "n"),
        GemmVariant(GemmConfig(tile_n=64, persistent=False), "fp16", "fp32", "m", "k"),
        GemmVariant(GemmConfig(tile_n=128, persistent=False), "bf16", "fp16", "k", "k"),
    ]
    jobs = [functools.partial(cache.get, v.key(), functools.partial(compile_gemm, v)) for v in variants]
    kernels = _run_in_threads(jobs)
    assert all(callable(k) for k in kernels)
    assert cache.stats.compiles == len(variants) and len(cache) == len(variants)


@pytest.mark.gpu
def test_concurrent_first_calls_on_their_own_streams(tmp_path, monkeypatch):
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))  # cold on disk too
    kernel_for.cache_clear()
    KERNEL_CACHE.clear_memory()

    @epicute.epilogue
    def scaled_bias(acc, bias):
        return {"D": acc * 2.0 + bias, "rs": ops.row_sum(acc + bias)}

    @epicute.epilogue
    def gated(acc, bias):
        return ops.silu(acc) * bias

    shapes = [(257, 136, 72, torch.bfloat16, scaled_bias), (129, 264, 200, torch.float16, gated),
              (1000, 48, 40, torch.bfloat16, gated), (64, 520, 1000, torch.float16, scaled_bias)]  # fmt: skip
    cases = []
    for m, n, k, dtype, fn in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        cases.append((a, b, bias, fn))

    def call(a, b, bias, fn):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            out = epicute.gemm(a, b, epilogue=fn, bias=bias)
        stream.synchronize()
        return out

    compiled_before = KERNEL_CACHE.stats.compiles
    results = _run_in_threads([functools.partial(call, *case) for case in cases])
    assert KERNEL_CACHE.stats.compiles - compiled_before >= 2  # cold: at least two variants compiled at once
    for (a, b, bias, fn), got in zip(cases, results):
        ref = epicute.gemm(a, b, epilogue=fn, bias=bias, backend="reference")
        got, ref = (got, ref) if isinstance(got, dict) else ({"D": got}, {"D": ref})
        for name in ref:
            assert rel_err(got[name].float().cpu(), ref[name].float()) < 1e-2, name
