"""The runtime on the GPU: compile, warm call and disk load (what happens; bench/runtime.py times it),
CUDA graphs, torch.compile, the op for real."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import epicute
from epicute.gemm.launch import kernel_for
from epicute.runtime.cache import KERNEL_CACHE
from tests.conftest import rel_err, subprocess_env

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


@epicute.epilogue
def bias_relu(acc, bias, alpha):
    return epicute.ops.relu(alpha * acc + bias)


def _ref_bias_relu(a, b, bias, alpha):
    return torch.relu(alpha * (a.float() @ b.float()) + bias.float())


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


FRESH = textwrap.dedent(
    """
    import torch, epicute
    from epicute.runtime.cache import KERNEL_CACHE
    a = torch.randn(257, 136, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(136, 264, device="cuda", dtype=torch.bfloat16)
    d = epicute.gemm(a, b, config={"tile_n": 64, "persistent": False})
    err = ((d.float() - a.float() @ b.float()).norm() / (a.float() @ b.float()).norm()).item()
    (how, _), = KERNEL_CACHE.events.values()
    print(how, err, KERNEL_CACHE.stats.compiles)
    """
)


def test_cold_compile_warm_call_and_fresh_process_disk_load(tmp_path, monkeypatch):
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    kernel_for.cache_clear()
    KERNEL_CACHE.clear_memory()
    a, b = randn(257, 136), randn(136, 264)
    pins = {"tile_n": 64, "persistent": False}
    compiles = KERNEL_CACHE.stats.compiles
    epicute.gemm(a, b, config=pins)
    ((how, _),) = KERNEL_CACHE.events.values()
    assert how == "compiled"
    for _ in range(3):  # warm calls: the compiled kernel, no compile
        d = epicute.gemm(a, b, config=pins)
    assert KERNEL_CACHE.stats.compiles == compiles + 1
    assert rel_err(d, a.float() @ b.float()) < 1e-2

    script = tmp_path / "fresh.py"
    script.write_text(FRESH)
    env = subprocess_env(EPICUTE_CACHE_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr
    how, err, compiles = out.stdout.split()
    # How long each step takes is bench/runtime.py's to measure (no timings in tests); here: what happened.
    assert how == "disk" and compiles == "0" and float(err) < 1e-2


@pytest.mark.parametrize("with_epilogue", [False, True], ids=["plain", "bias-relu"])
def test_cuda_graph_capture_and_replay_equal_eager(with_epilogue):
    m, n, k = 1000, 264, 136
    a, b, bias = randn(m, k), randn(k, n), randn(n)
    kwargs = {"epilogue": bias_relu, "bias": bias, "alpha": 0.5} if with_epilogue else {}
    epicute.gemm(a, b, **kwargs)  # warm: compile (or load) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on a side stream: the kernel must launch on torch's current one
        captured = epicute.gemm(a, b, **kwargs)
    for _ in range(2):  # new inputs in the captured buffers, then replay
        a.copy_(randn(m, k))
        b.copy_(randn(k, n))
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = epicute.gemm(a, b, **kwargs)
        assert torch.equal(captured, eager)
        ref = _ref_bias_relu(a, b, bias, 0.5) if with_epilogue else a.float() @ b.float()
        assert rel_err(captured, ref) < 1e-2


def test_torch_compile_end_to_end_matches_eager_across_sizes():
    torch._dynamo.reset()

    def block(x, w, bias):
        y = epicute.gemm(x, w.t(), epilogue=bias_relu, bias=bias, alpha=0.5)
        return epicute.gemm(y, w) + 1.0

    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    w, bias = randn(264, 136), randn(264)
    for m in (129, 1000, 17):
        x = randn(m, 136)
        got = compiled(x, w, bias)
        want = block(x, w, bias)
        assert got.shape == want.shape == (m, 136)
        assert rel_err(got, want.float()) < 1e-2


def test_opcheck_with_cuda_tensors():
    from epicute.runtime.torch_ops import register_epilogue

    a, b, bias = randn(129, 136), randn(136, 264), randn(264)
    spec = '{"config": {}, "out_dtype": null, "out_dtypes": {}, "pins": {}, "scalars": ["alpha"], "tensors": ["bias"]}'
    torch.library.opcheck(torch.ops.epicute.gemm.default, (a, b, [bias], [0.5], register_epilogue(bias_relu), spec))
    plain = '{"config": {}, "out_dtype": "fp32", "out_dtypes": {}, "pins": {}, "scalars": [], "tensors": []}'
    torch.library.opcheck(torch.ops.epicute.gemm.default, (a, b, [], [], "", plain))
