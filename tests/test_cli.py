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


def test_help_lists_the_runtime_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("bench", "compile", "cache", "doctor"):
        assert command in result.output
    cache_help = runner.invoke(app, ["cache", "--help"])
    assert all(sub in cache_help.output for sub in ("ls", "info", "clear"))


def test_doctor_reports_versions_gpu_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    for needle in ("CuTe DSL", "4.8.1", "GPU", "NVIDIA driver", "kernel cache", str(tmp_path)):
        assert needle in result.output
    if not has_hopper():
        assert "none visible" in result.output and "compile for sm_90a" in result.output


def test_cache_commands_on_an_aot_compiled_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "k.toml"
    spec.write_text('[[gemm]]\nshapes = [[17, 136, 72]]\nconfig = { tile_n = 128, persistent = false }\n')
    dry = runner.invoke(app, ["compile", str(spec), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "planned" in dry.output and "0 compiled now" in dry.output

    built = runner.invoke(app, ["compile", str(spec)])
    assert built.exit_code == 0, built.output
    assert "compiled" in built.output

    info = runner.invoke(app, ["cache", "info"])
    assert info.exit_code == 0 and "entries     1 (0 stale)" in info.output and "cutlass-dsl 4.8.1" in info.output
    listing = runner.invoke(app, ["cache", "ls"])
    assert listing.exit_code == 0 and "gemm" in listing.output and "1 entries" in listing.output
    cleared = runner.invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 1 entries" in cleared.output
    assert "0 entries" in runner.invoke(app, ["cache", "ls"]).output


def test_compile_with_a_bad_spec_exits_2_with_the_fix(tmp_path):
    spec = tmp_path / "k.toml"
    spec.write_text("[[gemm]]\nshapes = [[8, 8, 8]]\nepilogue = 'nope'\n")
    result = runner.invoke(app, ["compile", str(spec)])
    assert result.exit_code == 2
    assert "module:function" in result.output


def test_bench_rejects_bad_shapes_and_needs_a_gpu():
    bad = runner.invoke(app, ["bench", "--shapes", "4096x4096", "--no-plot"])
    assert bad.exit_code == 2 and "MxNxK" in bad.output
    if not has_hopper():
        result = runner.invoke(app, ["bench", "--shapes", "256x256x256", "--no-plot"])
        assert result.exit_code == 2 and "needs a CUDA GPU" in result.output


def test_explain_gemm_with_a_fused_epilogue_prints_its_chain_and_buffers():
    args = ["explain", "gemm", "--m", "4096", "--n", "4096", "--k", "4096",
            "--epilogue", "epicute.epilogue.library:tensor_quant", "--operand", "scale=scalar"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "D fp8e4m3 row-major" in result.output  # the epilogue's quantize picks D's dtype
    assert "epilogue chain" in result.output and "finalize_reductions" in result.output
    bad = runner.invoke(app, [*args[:-2], "--operand", "scale=diagonal"])
    assert bad.exit_code == 2 and "kind 'diagonal'" in bad.output
