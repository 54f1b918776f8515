"""The ``epicute`` command line: in-process through typer's runner, and as a user runs it
(the console script in a fresh process, from a working directory of the test's own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from epicute.cli import app
from tests.conftest import has_hopper, subprocess_env

runner = CliRunner()


def epicute_cli(*args: str, cwd: Path, cache: Path, **env: str) -> subprocess.CompletedProcess:
    """``epicute *args`` in a fresh process from ``cwd`` with its kernel cache at ``cache``.

    The console script when it is installed next to this Python, else ``python -P -m
    epicute`` (``-P``: like the script, the working directory is not put on sys.path)."""
    script = Path(sys.executable).parent / "epicute"
    if script.exists():
        command = [str(script)]
    elif sys.version_info >= (3, 11):
        command = [sys.executable, "-P", "-m", "epicute"]
    else:
        pytest.skip("needs the epicute console script or Python >= 3.11 (-P)")
    run_env = subprocess_env(EPICUTE_CACHE_DIR=str(cache), **{"COLUMNS": "200", **env})
    run_env.pop("EPICUTE_CACHE", None)
    return subprocess.run(
        [*command, *args], cwd=cwd, env=run_env, capture_output=True, text=True, timeout=300, check=False
    )


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "explain" in result.output


def test_explain_gemm_prints_the_plan():
    result = runner.invoke(app, ["explain", "gemm", "--m", "4096", "--n", "14336", "--k", "4096"])
    assert result.exit_code == 0, result.output
    needles = ("CTA tile        128 x 256 x 64", "warpgroup 0     producer", "PipelineTmaAsync", "total", "predicted")
    for needle in needles:
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
    assert "--dtype 'int8': give one of bf16, fp16" in result.output


def test_demo_runs_or_compiles():
    result = runner.invoke(app, ["demo", "--m", "256", "--n", "256", "--k", "128"])
    assert result.exit_code == 0, result.output
    if has_hopper():
        assert "PASS" in result.output and "TFLOPS" in result.output
    else:
        assert "No Hopper GPU found" in result.output
        assert "compiled for sm_90a" in result.output or "loaded from the kernel cache" in result.output


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
    spec.write_text("[[gemm]]\nshapes = [[17, 136, 72]]\nconfig = { tile_n = 128, persistent = false }\n")
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


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["explain", "gemm", "--m", "abc", "--n", "8", "--k", "8"], ("--m", "'abc'", "integer")),
        (["explain", "gemm", "--m", "8", "--n", "8", "--k", "8", "--bogus"], ("No such option: --bogus",)),
        (["explain", "gemm", "--m", "8", "--n", "8", "--k", "8", "--batch", "x"], ("--l/--batch", "'x'")),
        (["explain", "grouped", "--total-m", "8", "--n", "8", "--k", "8", "--groups", "0"], ("--groups", "0", "1")),
        (["explain", "attention", "--seqlen-q", "8", "--heads-q", "8", "--heads-kv", "0"], ("--heads-kv", "0", "1")),
        (["explain", "gemm", "--n", "8", "--k", "8"], ("Missing option '--m'",)),
        (["cache", "ls", "--stale"], ("No such option: --stale",)),
        (["doctor", "--bogus"], ("No such option: --bogus",)),
        (["nosuch"], ("No such command 'nosuch'",)),
        (["--bogus"], ("No such option: --bogus",)),
    ],
)
def test_usage_errors_exit_2_in_one_line(args, needles):
    """What click refuses while parsing is printed like the errors epicute raises: one line, exit status 2,
    naming the option, the reason and where the options are listed (typer would draw a boxed panel)."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert all(needle in lines[0] for needle in needles) and "--help')" in lines[0], result.output
    assert not any(ch in result.output for ch in "╭│╰"), result.output


def test_no_arguments_still_print_the_help():
    result = runner.invoke(app, ["explain"])
    assert result.exit_code == 2 and "gemm" in result.output and "attention" in result.output


def test_operand_kinds_must_agree_with_the_epilogue_annotation():
    """``scale`` is annotated Scalar in tensor_quant: the CLI refuses another kind as epicute.explain refuses
    another pin, with the same EpilogueError wording."""
    import torch

    import epicute

    base = ["explain", "gemm", "--m", "256", "--n", "256", "--k", "256", "--epilogue", "tensor_quant"]
    result = runner.invoke(app, [*base, "--operand", "scale=row"])
    assert result.exit_code == 2, result.output
    declared = "error: operand 'scale' is declared Scalar by the epilogue, but was passed as 'row'; describe it as "
    assert declared + "scale=scalar" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert runner.invoke(app, [*base, "--operand", "scale=scalar"]).exit_code == 0
    a = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    row = epicute.RowVector(torch.empty(256, device="meta"))
    with pytest.raises(epicute.EpilogueError, match="operand 'scale' is declared Scalar by the epilogue, but was"):
        epicute.explain(a, a, epilogue=epicute.epilogues.tensor_quant, scale=row, file=None)


@pytest.mark.parametrize(
    ("operands", "message"),
    [
        (["a_scale=tile"], "a_scale=tile: no fp8 recipe takes a 'tile' scale; give a_scale as scalar, row, col or"),
        (["b_scale=col"], "b_scale=col: no fp8 recipe takes a 'col' scale; give b_scale as scalar, row or blockwise"),
        (["b_scale=tile:fp32"], "b_scale=tile:fp32: no fp8 recipe takes a 'tile' scale"),
        (["a_scale=col:bf16"], "a_scale=col:bf16: scales are fp32; give a_scale=col:fp32"),
        (["a_scale=scalar", "b_scale=scalar"], None),
        (["a_scale=row", "b_scale=row:fp32"], None),  # tensorwise, as a 1-element tensor
        (["a_scale=col"], None),  # rowwise (b_scale's default: row)
        (["a_scale=blockwise", "b_scale=blockwise"], None),
    ],
)
def test_fp8_scale_operands_take_the_recipes_kinds(operands, message):
    """fp8 scales described with --operand are the kinds epicute.gemm makes of tensorwise, rowwise and blockwise
    scales; any other kind is refused before planning, in one line."""
    args = ["explain", "gemm", "--m", "256", "--n", "256", "--k", "256", "--dtype", "fp8e4m3"]
    result = runner.invoke(app, [*args, *(x for item in operands for x in ("--operand", item))])
    if message is None:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 2 and f"error: {message}" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


# ------------------------------------------------------- as a user runs it (fresh processes)
def test_python_m_epicute_is_the_cli(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "epicute", "--help"], cwd=tmp_path, env=subprocess_env(COLUMNS="200"),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Usage: epicute" in result.stdout
    assert all(command in result.stdout for command in ("compile", "explain", "cache", "doctor"))


EPILOGUES_PY = """
import epicute
from epicute import ops


@epicute.epilogue
def bias_gelu(acc, bias):
    return ops.gelu(acc + bias)
"""

DOCS_SPEC = """
[[gemm]]
shapes = [[1, 14336, 4096], [4096, 14336, 4096]]
b_major = "k"
epilogue = "mypkg.epilogues:bias_gelu"
operands = { bias = "row:bf16" }
"""


def test_compile_imports_the_spec_epilogue_from_the_working_directory(tmp_path):
    """docs/runtime.md's layout: mypkg/epilogues.py beside kernels.toml, `epicute compile kernels.toml` run there."""
    project = tmp_path / "project"
    (project / "mypkg").mkdir(parents=True)
    (project / "mypkg" / "epilogues.py").write_text(EPILOGUES_PY)
    (project / "kernels.toml").write_text(DOCS_SPEC)
    here = epicute_cli("compile", "kernels.toml", "--dry-run", cwd=project, cache=tmp_path / "cache")
    assert here.returncode == 0, here.stdout + here.stderr
    assert "2 variants (0 compiled now)" in here.stdout
    # From elsewhere: the spec's own directory is searched too.
    there = epicute_cli("compile", str(project / "kernels.toml"), "--dry-run", cwd=tmp_path, cache=tmp_path / "cache")
    assert there.returncode == 0, there.stdout + there.stderr
    # A spec whose module is nowhere: the error says where it looked and what to do.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "kernels.toml").write_text(DOCS_SPEC)
    missing = epicute_cli("compile", "kernels.toml", "--dry-run", cwd=tmp_path / "elsewhere", cache=tmp_path / "cache")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "no module 'mypkg'" in missing.stdout and "PYTHONPATH" in missing.stdout
    assert "kernels.toml, [[gemm]] entry 1" in missing.stdout


def test_explain_gemm_imports_the_epilogue_from_the_working_directory(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "epilogues.py").write_text(EPILOGUES_PY)
    args = ["explain", "gemm", "--m", "256", "--n", "512", "--k", "128", "--epilogue", "mypkg.epilogues:bias_gelu",
            "--operand", "bias=row:bf16"]  # fmt: skip
    result = epicute_cli(*args, cwd=tmp_path, cache=tmp_path / "cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "epilogue chain" in result.stdout


def test_user_text_is_never_read_as_markup(tmp_path):
    bracketed = epicute_cli("explain", "gemm", "--m", "8", "--n", "8", "--k", "8", "--epilogue", "foo[/bar]:fn",
                            cwd=tmp_path, cache=tmp_path / "cache")  # fmt: skip
    assert bracketed.returncode == 2 and "Traceback" not in bracketed.stderr
    assert "'foo[/bar]:fn' is not an import path" in bracketed.stdout
    (tmp_path / "k.toml").write_text("[[gemm]]\nshapes = [[8, 8, 8]]\nshape = 3\n")
    misspelled = epicute_cli("compile", "k.toml", "--dry-run", cwd=tmp_path, cache=tmp_path / "cache")
    assert misspelled.returncode == 2
    assert "[[gemm]] entry 1: unknown fields ['shape']" in misspelled.stdout


def test_bench_install_hint_keeps_its_brackets(monkeypatch):
    # In-process: the message is only reached past the GPU check, so the device is faked.
    from epicute import benchmark
    from epicute.errors import ConfigError

    def no_matplotlib():
        raise ConfigError("the plot needs matplotlib: pip install 'epicute[plot]' (or pass --no-plot)")

    monkeypatch.setattr(benchmark, "check_device", lambda: "a fake Hopper")
    monkeypatch.setattr(benchmark, "require_matplotlib", no_matplotlib)
    result = runner.invoke(app, ["bench", "--shapes", "256x256x256"])
    assert result.exit_code == 2 and "pip install 'epicute[plot]'" in result.output


@pytest.mark.skipif(has_hopper(), reason="checks the message a machine without a GPU gets")
def test_bench_checks_the_gpu_before_matplotlib(tmp_path):
    # A matplotlib that cannot import, first on the path: the GPU message must still come first.
    (tmp_path / "fake" / "matplotlib").mkdir(parents=True)
    (tmp_path / "fake" / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    path = os.pathsep.join((str(tmp_path / "fake"), subprocess_env()["PYTHONPATH"]))
    result = epicute_cli("bench", "--shapes", "256x256x256", cwd=tmp_path, cache=tmp_path / "cache", PYTHONPATH=path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs a CUDA GPU" in result.stdout and "matplotlib" not in result.stdout


def test_an_unusable_cache_directory_is_reported_by_every_command(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    cache = tmp_path / "afile" / "cache"
    (tmp_path / "k.toml").write_text("[[gemm]]\nshapes = [[8, 8, 8]]\n")
    for args in (("compile", "k.toml"), ("cache", "info"), ("cache", "ls"), ("cache", "clear")):
        result = epicute_cli(*args, cwd=tmp_path, cache=cache)
        assert result.returncode == 2, (args, result.stdout + result.stderr)
        assert "Traceback" not in result.stderr
        assert f"{tmp_path / 'afile'} is a file, not a directory" in result.stdout
        assert "set EPICUTE_CACHE_DIR to a writable directory" in result.stdout
    doctor = epicute_cli("doctor", cwd=tmp_path, cache=cache)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    (line,) = [line for line in doctor.stdout.splitlines() if line.split()[1:3] == ["kernel", "cache"]]
    assert line.startswith("warn") and "unusable" in line
    assert "set EPICUTE_CACHE_DIR to a writable directory" in doctor.stdout


def _fake_entries(root: Path, labels: list[str]) -> list[str]:
    """Disk entries (one per label) written as a compile would, with stand-in object files; their digests."""
    from epicute.runtime.cache import CacheKey, KernelCache

    class Compiled:
        def export_to_c(self, path: str, function_name: str) -> None:
            Path(path).write_bytes(b"object code of " + function_name.encode())

    old = os.environ.get("EPICUTE_CACHE_DIR")
    os.environ["EPICUTE_CACHE_DIR"] = str(root)
    try:
        keys = [CacheKey("gemm", ("cli-test", label, os.urandom(8).hex()), label=label) for label in labels]
        for key in keys:
            KernelCache().ensure_on_disk(key, Compiled)
    finally:
        os.environ["EPICUTE_CACHE_DIR"] = old if old is not None else ""
        if old is None:
            del os.environ["EPICUTE_CACHE_DIR"]
    return [key.digest for key in keys]


def test_cache_ls_verifies_entries_and_is_not_cut_when_piped(tmp_path):
    label = "gemm 128x256x64 cluster 2x1 persistent cooperative bf16->bf16 a:k b:n [a label as long as a real one]"
    intact, missing, corrupt = _fake_entries(tmp_path / "cache", [label, "missing", "corrupt"])
    kernels = tmp_path / "cache" / "kernels"
    (kernels / f"{missing}.o").unlink()
    data = (kernels / f"{corrupt}.o").read_bytes()
    (kernels / f"{corrupt}.o").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))

    result = epicute_cli("cache", "ls", cwd=tmp_path, cache=tmp_path / "cache", COLUMNS="")  # piped: no terminal
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│")}
    assert " yes " in rows[intact[:16]] and label in rows[intact[:16]]
    assert " damaged " in rows[missing[:16]] and " damaged " in rows[corrupt[:16]]
    assert f"damaged {missing[:16]}: object file missing" in result.stdout
    assert f"damaged {corrupt[:16]}: object file is {len(data)} bytes and fails its checksum" in result.stdout
    assert "3 entries" in result.stdout


def test_malformed_specs_fail_in_one_line(tmp_path):
    (tmp_path / "trailing.json").write_text(json.dumps({"gemm": [{"shapes": [[8, 8, 8]]}]})[:-2] + ",]}")
    (tmp_path / "empty.toml").write_text("# nothing yet\n")
    (tmp_path / "scalar.toml").write_text("gemm = 3\n")
    (tmp_path / "strings.toml").write_text('[[gemm]]\nshapes = [["a", 64, 64]]\n')
    expected = {
        "trailing.json": "trailing.json is not valid JSON",
        "empty.toml": "names no kernels to compile; add an entry, e.g. [[gemm]] then shapes = [[4096, 4096, 4096]]",
        "scalar.toml": "gemm entry 1 is 3; each entry is a table of fields: write [[gemm]]",
        "strings.toml": "shape ['a', 64, 64]: give [M, N, K] or [M, N, K, L] of integers",
    }
    for name, message in expected.items():
        result = epicute_cli("compile", name, "--dry-run", cwd=tmp_path, cache=tmp_path / "cache")
        assert result.returncode == 2, (name, result.stdout + result.stderr)
        assert "Traceback" not in result.stderr
        assert message in result.stdout, result.stdout


def test_explain_attention_prints_the_plan(tmp_path):
    args = ["explain", "attention", "--batch", "2", "--seqlen-q", "4096", "--heads-q", "32", "--heads-kv", "8",
            "--head-dim", "128", "--causal"]  # fmt: skip
    result = epicute_cli(*args, cwd=tmp_path, cache=tmp_path / "cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "O[2x4096x32x128]" in result.stdout and "GQA 4:1" in result.stdout and "causal" in result.stdout
    for needle in ("CTA tile", "warp roles", "shared memory"):
        assert needle in result.stdout
    bad = epicute_cli(*args[:-5], "--heads-kv", "7", cwd=tmp_path, cache=tmp_path / "cache")
    assert bad.returncode == 2 and "multiple of heads_kv" in bad.stdout
    fp32 = epicute_cli(*args, "--dtype", "fp32", cwd=tmp_path, cache=tmp_path / "cache")
    assert fp32.returncode == 2 and "--dtype 'fp32': give one of bf16, fp16" in fp32.stdout
    assert "output epilogue chain" in result.stdout and "D: fp32 -> bf16" in result.stdout  # the plain chain
    quant = epicute_cli(*args, "--epilogue", "tensor_quant", "--operand", "scale=scalar", cwd=tmp_path,
                        cache=tmp_path / "cache")  # fmt: skip
    assert quant.returncode == 0, quant.stdout + quant.stderr
    assert "D: fp32 -> fp8e4m3 (saturating)" in quant.stdout and "finalize_reductions" in quant.stdout
    lonely = epicute_cli(*args, "--operand", "scale=scalar", cwd=tmp_path, cache=tmp_path / "cache")
    assert lonely.returncode == 2 and "--operand needs --epilogue or --score-mod" in lonely.stdout


def test_cli_spells_dtypes_and_ready_epilogues_as_the_library_does():
    import epicute
    from epicute import cli
    from epicute.attention.validate import ATTN_DTYPES
    from epicute.epilogue.dtypes import TORCH_TO_IR
    from epicute.gemm import config

    assert (cli.AB_DTYPES, cli.D_DTYPES) == (config.AB_DTYPES, config.D_DTYPES)
    assert tuple(TORCH_TO_IR[d] for d in ATTN_DTYPES) == cli.ATTENTION_DTYPES
    assert sorted(cli.READY_EPILOGUES.split(", ")) == sorted(epicute.epilogues.__all__)


def test_explain_gemm_names_its_options_and_the_ready_epilogues(tmp_path):
    base = ["explain", "gemm", "--m", "256", "--n", "512", "--k", "128"]
    out_dtype = epicute_cli(*base, "--out-dtype", "int8", cwd=tmp_path, cache=tmp_path / "cache")
    assert out_dtype.returncode == 2
    assert "--out-dtype 'int8': give one of bf16, fp16, fp32, fp8e4m3, fp8e5m2" in out_dtype.stdout
    help_text = epicute_cli("explain", "gemm", "--help", cwd=tmp_path, cache=tmp_path / "cache").stdout
    assert "fp8e4m3" in help_text and "192" in help_text and "row_col_quant" in help_text
    for epilogue in ("row_col_quant", "epicute.epilogues:row_col_quant"):
        result = epicute_cli(*base, "--epilogue", epilogue, "--operand", "scale_m=col", "--operand", "scale_n=row",
                             cwd=tmp_path, cache=tmp_path / "cache")  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "epilogue chain" in result.stdout


def test_demo_says_when_it_loaded_from_the_cache(monkeypatch):
    import torch

    from epicute import demo
    from epicute.runtime.cache import KERNEL_CACHE

    class FromDisk:
        def get(self, variant):
            KERNEL_CACHE.events[variant.key()] = ("disk", 0.01)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(demo, "GEMM_CACHE", FromDisk())
    monkeypatch.setattr(KERNEL_CACHE, "events", {})
    lines: list[str] = []
    assert demo.run_demo(256, 256, 128, echo=lines.append)
    assert lines[-1].startswith("\nloaded from the kernel cache in")


def test_cli_names_the_targets_as_the_library_does():
    from epicute import cli
    from epicute.runtime.target import TARGETS

    assert tuple(TARGETS) == cli.TARGET_NAMES


@pytest.mark.compile
def test_compile_for_a_named_target_builds_kernels_every_hopper_part_loads(tmp_path):
    """`epicute compile --target h100-pcie` on the CPU: one real (persistent) kernel; its key holds
    no SM count, so the same spec for h20 or the default part finds it cached."""
    spec = tmp_path / "k.toml"
    spec.write_text("[[gemm]]\nshapes = [[17, 136, 72]]\nconfig = { tile_n = 128, cluster_m = 1, persistent = true }\n")
    cache = tmp_path / "cache"
    built = epicute_cli("compile", "--target", "h100-pcie", "k.toml", cwd=tmp_path, cache=cache)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "target h100-pcie (NVIDIA H100 PCIe): sm_90a, 114 SMs" in built.stdout
    assert "gemm 17x136x72: compiled" in built.stdout and "1 variants (1 compiled now)" in built.stdout
    for target in ("h20", "h100-sxm"):
        again = epicute_cli("compile", "k.toml", "--target", target, cwd=tmp_path, cache=cache)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "gemm 17x136x72: cached" in again.stdout and "(0 compiled now)" in again.stdout
    assert len(list((cache / "kernels").glob("*.o"))) == 1


def test_compile_and_explain_refuse_an_unknown_target(tmp_path):
    (tmp_path / "k.toml").write_text("[[gemm]]\nshapes = [[128, 128, 64]]\n")
    for args in (("compile", "k.toml", "--dry-run", "--target", "h100"),
                 ("explain", "gemm", "--m", "256", "--n", "256", "--k", "256", "--target", "h100"),
                 ("explain", "attention", "--seqlen-q", "256", "--heads-q", "4", "--target", "h100")):  # fmt: skip
        result = runner.invoke(app, list(args))
        assert result.exit_code == 2, (args, result.output)
        assert "unknown target 'h100'; known targets are h100-sxm, h100-pcie, h200, h20" in result.output


def test_explain_with_a_target_shows_its_grid_and_roofline():
    base = ["explain", "gemm", "--m", "8192", "--n", "8192", "--k", "8192", "--tile-n", "256", "--cluster-m", "2",
            "--persistent"]  # fmt: skip
    sxm = runner.invoke(app, [*base, "--target", "h100-sxm"])
    h20 = runner.invoke(app, [*base, "--target", "h20"])
    assert sxm.exit_code == 0 and h20.exit_code == 0, sxm.output + h20.output
    assert "grid            (2, 1, 66)" in sxm.output and "grid            (2, 1, 39)" in h20.output
    assert "at 989 TFLOP/s" in sxm.output and "at 148 TFLOP/s" in h20.output and "at 4.00 TB/s" in h20.output
    attention = ["explain", "attention", "--batch", "4", "--seqlen-q", "8192", "--heads-q", "16"]
    pcie = runner.invoke(app, [*attention, "--target", "h100-pcie"])
    assert pcie.exit_code == 0, pcie.output
    assert "h100-pcie (NVIDIA H100 PCIe): sm_90a, 114 SMs" in pcie.output and "at 756 TFLOP/s" in pcie.output


def test_explain_grouped_prints_the_grouped_schedule():
    args = [
        "explain",
        "grouped",
        "--total-m",
        "32768",
        "--n",
        "28672",
        "--k",
        "4096",
        "--groups",
        "8",
        "--mode",
        "gathered",
        "--gated",
        "--epilogue",
        "tests.grouped.test_grouped_aot:swiglu",
        "--operand",
        "score=col:fp32",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "grouped schedule" in result.output and "gathered through a_index" in result.output
    assert "gated" in result.output and "epilogue chain" in result.output
    assert "TMA multicast: B to 2 CTAs" in result.output and "A to 1" not in result.output  # A gathered per CTA
    wgrad = runner.invoke(app, ["explain", "grouped", "--total-m", "4096", "--n", "14336", "--k", "16384", "--groups",
                                "8", "--mode", "variable_k"])  # fmt: skip
    assert wgrad.exit_code == 0 and "variable K" in wgrad.output
    bad = runner.invoke(app, ["explain", "grouped", "--total-m", "8", "--n", "8", "--k", "8", "--groups", "2", "--mode",
                              "ragged"])  # fmt: skip
    assert bad.exit_code == 2 and "rows, gathered, variable_k" in bad.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["gemm", "--m", "8", "--n", "8", "--k", "8", "--tile-n", "0"], "--tile-n 0: pin a positive size"),
        (["gemm", "--m", "8", "--n", "8", "--k", "8", "--cluster-m", "0"], "--cluster-m 0: pin a positive size"),
        (["grouped", "--total-m", "64", "--n", "64", "--k", "64", "--groups", "2", "--tile-n", "0"], "--tile-n 0"),
        (["gemm", "--m", "16", "--n", "16", "--k", "8", "--dtype", "fp8e4m3"], "K=8 with fp8 inputs"),
        (["grouped", "--total-m", "64", "--n", "64", "--k", "100", "--groups", "2", "--dtype", "fp8e4m3"],
         "K=100 with fp8 inputs"),
    ],
)
def test_explain_refuses_zero_pins_and_fp8_k_in_one_line(args, words):
    # Before: a ZeroDivisionError traceback from the planner for a zero pin; fp8 plans for a K no kernel can run.
    result = runner.invoke(app, ["explain", *args])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_compile_refuses_a_zero_config_pin_and_fp8_k(tmp_path):
    spec = tmp_path / "k.toml"
    spec.write_text("[[gemm]]\nshapes = [[16, 16, 16]]\nconfig = { tile_n = 0 }\n")
    result = runner.invoke(app, ["compile", str(spec), "--dry-run"])
    assert result.exit_code == 2 and "config tile_n = 0; it takes positive sizes" in result.output
    spec.write_text("[[gemm]]\nshapes = [[16, 16, 8]]\ndtype = 'fp8e4m3'\n")
    result = runner.invoke(app, ["compile", str(spec), "--dry-run"])
    assert result.exit_code == 2 and "K=8 with fp8 inputs" in result.output


def test_usage_errors_of_the_console_script_are_one_line_on_stderr(tmp_path):
    for args, needle in ((("explain", "gemm", "--m", "abc", "--n", "8", "--k", "8"), "--m"),
                         (("cache", "ls", "--stale"), "No such option: --stale")):  # fmt: skip
        result = epicute_cli(*args, cwd=tmp_path, cache=tmp_path / "cache")
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stdout == "" and "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
        assert "'epicute " in lines[0]  # the command path as the user typed it, for its --help
