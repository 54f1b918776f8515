"""The text ``explain`` prints: every section is present and agrees with the plan."""

from __future__ import annotations

import io
import re

import pytest
import torch

import epicute
import epicute.gemm.api
from epicute.gemm import GemmPlan, GemmProblem, plan_gemm, render_plan
from epicute.gemm import api as gemm_api
from epicute.runtime.target import H100_SXM

BIG = GemmProblem(4096, 4096, 4096)
TINY = GemmProblem(1, 8, 8, d_dtype="fp32")


def _smem_rows(text: str) -> tuple[list[int], int]:
    """Byte values of the shared-memory table's rows, and its printed total."""
    section = text.split("\nshared memory\n", 1)[1]
    rows, total = [], None
    for line in section.splitlines():
        match = re.match(r"  (\S.*?)\s+(\d+) B  ", line)
        if match is None:
            break
        if match[1] == "total":
            total = int(match[2])
        else:
            rows.append(int(match[2]))
    return rows, total


def test_big_plan_report_sections():
    plan = plan_gemm(BIG, H100_SXM)
    text = render_plan(plan)
    assert text.startswith("epicute GEMM plan: D[1x4096x4096] = A[1x4096x4096] @ B[1x4096x4096]")
    assert "CTA tile        128 x 256 x 64   (512 output tiles)" in text
    assert "cluster         2 x 1   (TMA multicast: A to 1, B to 2 CTAs)" in text
    assert "cooperative, persistent" in text
    assert "grid            (2, 1, 66)  x 384 threads" in text
    assert "warpgroup 0     producer: warp 0 issues TMA loads of A and B   setmaxnreg 40" in text
    assert "warpgroup 1     consumer: WGMMA on rows 0-63, then epilogue   setmaxnreg 232" in text
    assert "warpgroup 2     consumer: WGMMA on rows 64-127, then epilogue   setmaxnreg 232" in text
    assert "PipelineTmaAsync, 4 stages" in text
    assert "PipelineTmaStore, 4 buffers" in text
    assert re.search(r"predicted\s+[\d.]+ us \(compute-bound, [\d.]+ waves\)", text)


@pytest.mark.parametrize("problem", [BIG, TINY], ids=["persistent", "one-tile-per-cta"])
def test_smem_table_adds_up_to_printed_total(problem):
    plan = plan_gemm(problem, H100_SXM)
    rows, total = _smem_rows(render_plan(plan))
    assert len(rows) == 5
    assert sum(rows) == total == plan.smem_bytes


def test_reused_a_ring_is_reported():
    text = render_plan(plan_gemm(TINY, H100_SXM))
    assert "one tile per CTA" in text
    assert re.search(r"D staging\s+0 B  4 x 128x32 fp32, aliases the A ring", text)
    assert "D staging aliases the A ring" in text


def test_report_lists_every_reason():
    plan = plan_gemm(BIG, H100_SXM)
    why = render_plan(plan).split("\nwhy\n", 1)[1].splitlines()
    assert why == [f"  - {reason}" for reason in plan.config.reasons]


def test_report_shows_overridden_register_budgets():
    text = render_plan(plan_gemm(BIG, H100_SXM, producer_regs=48, consumer_regs=224))
    assert "setmaxnreg 48" in text
    assert text.count("setmaxnreg 224") == 2
    assert f"registers       {128 * (48 + 2 * 224)} of 65536 per SM" in text


def _meta_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    b = torch.empty(n, k, dtype=torch.bfloat16, device="meta").t()
    return a, b


def test_explain_meta_tensors_prints_and_returns_the_plan():
    a, b = _meta_operands(4096, 1024, 2048)
    buf = io.StringIO()
    plan = epicute.explain(a, b, out_dtype=torch.float32, file=buf)
    assert isinstance(plan, GemmPlan)
    assert plan.problem == GemmProblem(4096, 1024, 2048, d_dtype="fp32", a_major="k", b_major="k")
    assert buf.getvalue().startswith(render_plan(plan) + "\n\nunder autograd\n  backward: plain")
    assert "B bf16 column-major (K contiguous); D fp32 row-major" in buf.getvalue()


@pytest.mark.parametrize(
    ("k", "epilogue", "plan"),
    [
        (2048, lambda acc, bias: acc + bias, "backward: operands (the gradient does not read acc: nothing saved)"),
        (2048, lambda acc, bias: epicute.ops.gelu(acc + bias), "backward: save (the forward also stores acc (16.0"),
        (64, lambda acc, bias: epicute.ops.gelu(acc + bias), "1. a GEMM recomputing a @ b, epilogue derived"),
        (2048, lambda acc, bias: dict(zip(("D", "scales"), epicute.ops.quantize_groups(acc + bias))),
         "backward: none: no output carries a gradient"),
    ],
    ids=["operands", "save", "recompute", "quantized"],
)
def test_explain_prints_the_backward_plan(k, epilogue, plan):
    a, b = _meta_operands(4096, 2048, k)
    bias = torch.empty(2048, dtype=torch.bfloat16, device="meta")
    buf = io.StringIO()
    epicute.explain(a, b, epilogue=epilogue, bias=bias, file=buf)
    backward = buf.getvalue().split("under autograd")[1]
    assert plan in backward
    if "operands" in plan:  # the bias's gradient is a column sum of dD alone: torch's, and no pass of the kernel
        assert "1. d_bias = col_sum(grad_D) by torch" in backward and "4. db = a^T @ dD" in backward
        assert "zero-K pass" not in backward
    elif "none" not in plan:
        assert "D, d_bias <- " in backward and "col_sum" in backward and "3. db = a^T @ dacc" in backward


def test_explain_passes_config_overrides():
    a, b = _meta_operands(4096, 4096, 4096)
    plan = epicute.explain(a, b, config={"tile_n": 128, "ab_stages": 3}, file=None)
    assert (plan.config.tile_n, plan.config.ab_stages) == (128, 3)


def test_explain_with_no_file_renders_nothing(monkeypatch, capsys):
    def must_not_render(plan):
        raise AssertionError("explain(file=None) rendered the plan")

    monkeypatch.setattr(gemm_api, "render_plan", must_not_render)
    a, b = _meta_operands(256, 256, 256)
    plan = epicute.explain(a, b, file=None)
    assert plan.problem.m == 256
    assert capsys.readouterr() == ("", "")


def test_explain_follows_redirected_stdout():
    import contextlib

    a = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        epicute.explain(a, a)
    assert "CTA tile" in buf.getvalue()
