"""Kept device buffers (epicute.runtime.buffers): never from a CUDA graph's memory pool."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.runtime.buffers import keep, keeping, per_call_buffers
from tests.conftest import rel_err


def test_eager_calls_keep_and_calls_through_the_torch_ops_do_not():
    cache: dict = {}
    assert keeping() and keep(cache, "eager", 1) == 1 and cache == {"eager": 1}

    @per_call_buffers
    def through_the_op(x):
        assert not keeping()
        return keep(cache, "op", x)

    assert through_the_op(2) == 2 and "op" not in cache
    assert keeping()  # restored after the call
    with pytest.raises(ZeroDivisionError):
        per_call_buffers(lambda: 1 / 0)()
    assert keeping()  # and after a call that raised


@pytest.mark.gpu
def test_compiled_calls_replay_in_cuda_graph_trees():
    """torch.compile(mode="reduce-overhead"): CUDA-graph trees warm the graph up with its allocations in the graph's
    pool, then record it; a decode attention (a work counter) and a split-K GEMM (a workspace) must keep none of
    them, and the replays compute new inputs right."""
    torch._dynamo.reset()
    q = torch.randn(3, 1, 28, 128, device="cuda", dtype=torch.bfloat16)  # Qwen2.5-7B's 7:1 GQA, one query
    k, v = (torch.randn(3, 301, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    a, b = torch.randn(5, 4104, device="cuda", dtype=torch.bfloat16), torch.randn(4104, 136, device="cuda",
                                                                                  dtype=torch.bfloat16)  # fmt: skip

    def step(q, k, v, a, b):
        return epicute.attention(q, k, v, causal=True), epicute.gemm(a, b, config={"split_k": 4})

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, record, replays
        for t in (q, k, v, a, b):
            t.copy_(torch.randn_like(t))
        o, d = (x.clone() for x in compiled(q, k, v, a, b))
        ref_o = torch.nn.functional.scaled_dot_product_attention(
            q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2), enable_gqa=True
        ).transpose(1, 2)
        assert rel_err(o, ref_o) < 2e-2  # bf16 O
        assert rel_err(d, a.double() @ b.double()) < 1e-2  # bf16 D
