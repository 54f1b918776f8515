"""The ``epicute`` command line, run in-process through typer's runner."""

from __future__ import annotations

from typer.testing import CliRunner

from epicute.cli import app
from tests.conftest import has_hopper

runner = CliRunner()


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "explain" in result.output


def test_explain_gemm_prints_the_plan():
    result = runner.invoke(app, ["explain", "gemm", "--m", "4096", "--n", "14336", "--k", "4096"])
    assert result.exit_code == 0, result.output
    for needle in ("CTA tile        128 x 256 x 64", "warpgroup 0     producer", "PipelineTmaAsync", "total", "predicted"):
        assert needle in result.output


def test_explain_gemm_with_overrides_and_layouts():
    args = ["explain", "gemm", "--m", "129", "--n", "136", "--k", "72", "--l", "3", "--out-dtype", "fp32",
            "--a-major", "m", "--b-major", "k", "--tile-n", "64", "--no-persistent"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "128 x 64 x 64" in result.output and "column-major (M contiguous)" in result.output
    assert "D fp32" in result.output and "one tile per CTA" in result.output


def test_explain_gemm_rejects_bad_dtype_with_exit_code_2():
    result = runner.invoke(app, ["explain", "gemm", "--m", "8", "--n", "8", "--k", "8", "--dtype", "int8"])
    assert result.exit_code == 2
    assert "ab_dtype='int8'" in result.output


def test_demo_runs_or_compiles():
    result = runner.invoke(app, ["demo", "--m", "256", "--n", "256", "--k", "128"])
    assert result.exit_code == 0, result.output
    if has_hopper():
        assert "PASS" in result.output and "TFLOPS" in result.output
    else:
        assert "No Hopper GPU found" in result.output
        assert "compiled for sm_90a" in result.output
