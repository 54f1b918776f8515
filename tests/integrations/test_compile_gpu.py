"""The torch.compile integration on the GPU: the block's lifted GEMMs run the kernels, Inductor compiles the rest;
forward and backward against float64 autograd, static and dynamic shapes."""

from __future__ import annotations

import functools

import pytest
import torch

from epicute.integrations import compile as EC
from tests.integrations.compile_cases import (
    block,
    block_leaves,
    experts,
    experts_errors,
    masked_sdpa,
    step_errors,
)

pytestmark = pytest.mark.gpu

TOL = 1e-2  # bf16 inputs, weights and outputs
#: Every candidate lifted: these tests check the lifted kernels (which candidates win is bench/compile.py's question).
LIFT_ALL = functools.partial(EC.backend, decide=EC.always)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_block_trains_through_its_lifted_kernels(dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=LIFT_ALL, fullgraph=True, dynamic=dynamic)
    for tokens in ((3, 333), (1001,)):
        errors = step_errors(compiled, block_leaves(tokens, "cuda"))
        assert all(e < TOL for e in errors.values()), (tokens, errors)
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "gelu", "mul", "add"), ("silu", "add")]


def test_a_block_trains_through_its_lifted_kernels_in_cuda_graphs():
    """``mode="reduce-overhead"`` through the backend: Inductor runs the step as CUDA graphs with epicute's lifted
    calls recorded in them; replays on fresh inputs (copied into the graphs' static buffers) stay right."""
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=LIFT_ALL, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        errors = step_errors(compiled, block_leaves((3, 333), "cuda"))
        assert all(e < TOL for e in errors.values()), errors
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "gelu", "mul", "add"), ("silu", "add")]


def test_each_candidate_is_measured_against_inductor_compiled_with_the_graphs_settings():
    """``options={"max_autotune": True, ...}`` reach the measured peers (the default policy on a GPU): the report
    names them, every candidate is decided by a measurement, and the step trains right whichever side won."""
    torch._dynamo.reset()
    options = {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}  # autotuning among cuBLAS's own choices
    compiled = torch.compile(block, backend=EC.backend, options=options, fullgraph=True)
    errors = step_errors(compiled, block_leaves((3, 333), "cuda"))
    assert all(e < TOL for e in errors.values()), errors
    report = EC.last_report()
    assert len(report.measured) == 2 and all(why.startswith("measured") for _, why in report.measured), str(report)
    assert str(report).splitlines()[-1] == ("measured against Inductor compiled with max_autotune=True, "
                                            "max_autotune_gemm_backends=ATEN")


def test_a_chain_with_a_cast_trains_through_its_lifted_kernel():
    """``gelu(x @ w.T + b).float() * 2 + r`` (an fp32 tile ``r``): one GEMM storing fp32, its backward reading the
    fp32 gradient; forward and every gradient against float64 autograd (ragged 333 tokens, 136 outputs)."""

    def f(x, w, b, r):
        return torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b)).float() * 2.0 + r

    torch._dynamo.reset()
    x = torch.randn(3, 333, 64, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(136, 64, device="cuda") / 8).to(torch.bfloat16)
    b = torch.randn(136, device="cuda", dtype=torch.bfloat16)
    leaves = [t.requires_grad_() for t in (x, w, b, torch.randn(3, 333, 136, device="cuda"))]
    errors = step_errors(torch.compile(f, backend=LIFT_ALL, fullgraph=True), dict(zip("xwbr", leaves)), math=f)
    assert all(e < TOL for e in errors.values()), errors
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "gelu", "to_float32", "mul", "add")]


def test_a_linear_chain_ending_in_a_cast_trains_through_its_lifted_kernel():
    """``(x @ w.T + r).float()`` (Llama's last down projection before the final norm): the gradient reaches the
    backward's GEMMs as it comes, fp32, and is rounded to the inputs' dtype first, as autograd rounds a cast's."""

    def f(x, w, r):
        return (torch.nn.functional.linear(x, w) + r).float()

    torch._dynamo.reset()
    x = torch.randn(2, 301, 96, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(72, 96, device="cuda") / 8).to(torch.bfloat16)
    r = torch.randn(2, 301, 72, device="cuda", dtype=torch.bfloat16)
    leaves = [t.requires_grad_() for t in (x, w, r)]
    errors = step_errors(torch.compile(f, backend=LIFT_ALL, fullgraph=True), dict(zip("xwr", leaves)), math=f)
    assert all(e < TOL for e in errors.values()), errors
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "to_float32")]


def _attention_trains(f, seqlen: int, steps: tuple[str, ...], **compile_options) -> None:
    """``f(q, k, v)`` (GQA 4:1, head_dim 128) compiled with every candidate lifted: one attention lifted with
    ``steps``, O and the q/k/v gradients against float64 autograd of ``f``."""
    torch._dynamo.reset()
    q = torch.randn(2, 8, seqlen, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, seqlen, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    compiled = torch.compile(f, backend=LIFT_ALL, fullgraph=True, **compile_options)
    errors = step_errors(compiled, {"q": q, "k": k, "v": v}, math=f)
    assert all(e < TOL for e in errors.values()), errors
    assert EC.last_report().lifted == [("scaled_dot_product_attention", steps)]


def test_attention_trains_through_epicute():
    """F.scaled_dot_product_attention (causal, GQA 4:1) lifted to epicute.attention, forward and backward."""

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    _attention_trains(f, 300, ("attention",))


@pytest.mark.parametrize("repeat", ["repeat_kv", "repeat_interleave"])
def test_a_causal_mask_and_repeated_heads_train_through_epicute(repeat):
    """SDPA as transformers calls it under torch.compile (an explicit causal mask built from sizes, key/value heads
    repeated 4x) lifted to one GQA causal epicute.attention: O and q/k/v gradients against float64 autograd."""
    f = functools.partial(masked_sdpa, mask="causal", repeat=repeat)
    notes = ("key/value heads unrepeated (4x)", "the causal attn_mask as causal")
    _attention_trains(f, 301, ("attention", *notes), dynamic=False)


@pytest.mark.parametrize("dynamic", [False, True])
def test_grouped_mm_experts_train_through_epicute(dynamic):
    """torch._grouped_mm (transformers' experts) with SiLU and the router weights lifted into one grouped GEMM."""
    torch._dynamo.reset()
    compiled = torch.compile(experts, backend=LIFT_ALL, fullgraph=True, dynamic=dynamic)
    errors = experts_errors(compiled, [300, 300, 1000, 1001, 2049], "cuda", k=1024, n=520)  # an empty expert too
    assert all(e < TOL for e in errors.values()), errors
    assert [steps for _, steps in EC.last_report().lifted] == [("grouped", "silu", "mul")]


def test_a_measured_candidate_is_decided_once_and_remembered(monkeypatch, tmp_path):
    """The default backend on a GPU measures each GEMM candidate against Inductor's chain: the decision says what it
    measured, and a second compile takes it from the disk."""
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    for _ in range(2):
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=EC.backend, fullgraph=True)
        errors = step_errors(compiled, block_leaves((4096,), "cuda"))
        assert all(e < TOL for e in errors.values()), errors
        report = EC.last_report()
        assert len(report.measured) == 2
        assert all(why.startswith("measured (forward and backward): epicute") for _, why in report.measured)
    assert (tmp_path / "lifted.json").exists()


@pytest.mark.parametrize("score_mod", ["softcap", "alibi"])
def test_flex_attention_trains_through_epicute(score_mod):
    """flex_attention with a score_mod (softcap, or ALiBi's captured per-head slopes) and a causal block mask,
    lifted to epicute.attention: O and q/k/v gradients against float64 autograd of the same math."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from tests.integrations.test_compile import SLOPES, _causal, _flex_reference, _softcap

    torch._dynamo.reset()
    slopes = SLOPES.cuda()

    def alibi(score, b, h, q_idx, kv_idx):  # the CPU test's, on the GPU's copy of its slopes
        return score + slopes[h] * (kv_idx - q_idx)

    mod = {"softcap": _softcap, "alibi": alibi}[score_mod]
    mask = create_block_mask(_causal, None, None, 300, 300, device="cuda")

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=mod, block_mask=mask, enable_gqa=True)

    q = torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    y = torch.compile(f, backend=LIFT_ALL, fullgraph=True)(q, k, v)
    assert [steps[0] for _, steps in EC.last_report().lifted] == ["flex attention"]
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    want = _flex_reference(*ref, score_mod, True)
    want.backward(dy.cpu().double())
    assert ((y.detach().cpu().double() - want).norm() / want.norm()).item() < TOL
    for name, got, r in zip("qkv", (q, k, v), ref):
        assert ((got.grad.cpu().double() - r.grad).norm() / r.grad.norm()).item() < TOL, name


COLD_COMPILE = """
import functools, json, torch
from epicute.integrations import compile as EC
from epicute.runtime.cache import KERNEL_CACHE
from tests.integrations.compile_cases import block, block_leaves, step_errors

decide = EC.Measured(timer=lambda fn, inputs: (fn(*inputs), 1.0)[1])  # a tie: every candidate lifted
compiled = torch.compile(block, backend=functools.partial(EC.backend, decide=decide), fullgraph=True)
errors = step_errors(compiled, block_leaves((3, 333), "cuda"))
report = EC.last_report()
print(json.dumps({"errors": errors, "lifted": [list(s) for _, s in report.lifted], "report": str(report),
                  "workers": report.precompiled.workers, "compiled": report.precompiled.compiled,
                  "obtained": sorted({how for how, _ in KERNEL_CACHE.events.values()})}))
"""


def test_a_cold_compile_precompiles_the_lifted_kernels_in_worker_processes(tmp_path):
    """A fresh process, an empty kernel cache, four compile workers: the block's candidates' kernels (the forward's
    and those their backward derives) are compiled by the workers before the measurements, so the process compiles
    none itself (every kernel it runs came from disk), and the step trains right."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import subprocess_env

    env = subprocess_env(EPICUTE_CACHE_DIR=str(tmp_path / "cache"), EPICUTE_COMPILE_WORKERS="4")
    env.pop("EPICUTE_CACHE", None)
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", COLD_COMPILE], env=env, cwd=repo, capture_output=True, text=True,
                         timeout=900, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(e < TOL for e in result["errors"].values()), result["errors"]
    assert result["lifted"] == [["add", "gelu", "mul", "add"], ["silu", "add"]], result["report"]
    assert result["workers"] == 4 and len(result["compiled"]) >= 4, result["report"]
    assert result["obtained"] == ["disk"], result["report"]
