"""Ahead-of-time compiles: a spec builds exactly the kernels the calls it names would use.

Compiling happens here without a GPU; a fresh process then finds the entries on
disk and loads them instead of compiling (launching them needs the device).
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import epicute
from epicute.errors import ConfigError, DtypeError, EpilogueError, ShapeError
from epicute.gemm import api
from epicute.gemm.aot import gemm_variants
from epicute.runtime.aot import compile_spec, import_object, read_spec
from tests.conftest import aot_compile_then_fresh_load

REPO = Path(__file__).resolve().parents[2]

SPEC = """
[[gemm]]
shapes = [[17, 136, 72, 3], [1000, 4104, 136, 2]]
dtype = "bf16"
b_major = "k"
config = { tile_n = 128, persistent = false, cluster_m = 1, evict_first = "" }
"""


def _launched_variant(monkeypatch, a, b, **kwargs):
    """The variant epicute.gemm would launch for these (CPU) tensors, captured instead of launched."""
    from epicute.gemm.launch import variant_of

    seen = {}
    real_check = api.check_gemm_args
    monkeypatch.setattr(api, "check_gemm_args", lambda *args, **kw: real_check(*args, **{**kw, "require_cuda": False}))
    monkeypatch.setattr(
        api, "bind_gemm", lambda call, plan, fusion=None, *rest, **kw: seen.update(v=variant_of(plan, fusion))
    )
    monkeypatch.setattr(api, "_run_and_record", lambda launch, fast: None)
    epicute.gemm(a, b, **kwargs)
    return seen["v"]


def test_spec_variants_are_the_ones_gemm_launches(monkeypatch, tmp_path):
    spec = tmp_path / "k.toml"
    spec.write_text(
        SPEC
        + """
[[gemm]]
shapes = [[256, 512, 128]]
out_dtype = "fp32"
epilogue = "epicute.epilogue.library:row_col_quant"
operands = { scale_m = "col:fp32", scale_n = "row:bf16" }
"""
    )
    plain, fused = read_spec(spec)["gemm"]
    # Both shapes plan the same pinned config (left to plan, the L2 hint would differ: 17 rows are one tile tall).
    ((aot_plain, what),) = gemm_variants(plain)
    assert what == "17x136x72x3"
    a = torch.randn(3, 17, 72, dtype=torch.bfloat16)
    w = torch.randn(3, 136, 72, dtype=torch.bfloat16)
    config = {"tile_n": 128, "persistent": False, "cluster_m": 1, "evict_first": ""}
    assert _launched_variant(monkeypatch, a, w.transpose(1, 2), config=config).key() == aot_plain.key()
    # A problem of one batch compiles the kernel's 2-D form, which an unbatched call launches.
    ((flat, _),) = gemm_variants({**plain, "shapes": [[1000, 4104, 136]]})
    assert flat.key() == replace(aot_plain, batched=False).key() != aot_plain.key()
    a, w = torch.randn(1000, 136, dtype=torch.bfloat16), torch.randn(4104, 136, dtype=torch.bfloat16)
    assert _launched_variant(monkeypatch, a, w.t(), config=config).key() == flat.key()

    ((aot_fused, _),) = gemm_variants(fused)
    a = torch.randn(256, 128, dtype=torch.bfloat16)
    b = torch.randn(128, 512, dtype=torch.bfloat16)
    launched = _launched_variant(
        monkeypatch, a, b, epilogue=epicute.epilogues.row_col_quant, out_dtype=torch.float32,
        scale_m=torch.rand(256), scale_n=torch.rand(512, dtype=torch.bfloat16),
    )  # fmt: skip
    assert launched.key() == aot_fused.key()


def test_spec_without_out_dtype_stores_d_like_gemm_does(monkeypatch, tmp_path):
    """No out_dtype: D takes the epilogue's own quantize dtype (fp8), in the spec as in epicute.gemm."""
    spec = tmp_path / "q.toml"
    spec.write_text(
        '[[gemm]]\nshapes = [[256, 512, 128]]\nepilogue = "epicute.epilogue.library:tensor_quant"\n'
        'operands = { scale = "scalar" }\n'
    )
    ((aot, _),) = gemm_variants(read_spec(spec)["gemm"][0])
    assert aot.d_dtype == "fp8e4m3"
    a, b = torch.randn(256, 128, dtype=torch.bfloat16), torch.randn(128, 512, dtype=torch.bfloat16)
    launched = _launched_variant(monkeypatch, a, b, epilogue=epicute.epilogues.tensor_quant, scale=0.5)
    assert launched.key() == aot.key()


@pytest.mark.parametrize(
    "text, error, match",
    [
        ("[[gemm]]\nshapes = [[8, 8, 8]]\ntile = 3\n", ConfigError, "unknown fields"),
        ("[[gemm]]\ndtype = 'bf16'\n", ConfigError, "shapes"),
        ("[[gemm]]\nshapes = [[8, 8]]\n", ConfigError, r"\[M, N, K\]"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\nepilogue = 'nope'\n", ConfigError, "module:function"),
        (
            "[[gemm]]\nshapes = [[8, 8, 8]]\nepilogue = 'epicute.epilogue.library:missing'\n",
            ConfigError,
            "cannot import",
        ),
        (
            "[[gemm]]\nshapes = [[8, 8, 8]]\nepilogue = 'epicute.epilogue.library:row_col_quant'\n",
            EpilogueError,
            "missing",
        ),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\noperands = { x = 'row' }\n", ConfigError, "need an epilogue"),
        ("[[gemm]]\nshapes = [[64, 64, 64]]\nepilogue = 'tensor_quant'\noperands = { scale = 'row' }\n", EpilogueError,
         r"entry 1: operand 'scale' is declared Scalar by the epilogue, but was passed as 'row'; describe it as sc"),
        ("[[gemm]]\nshapes = [[64, 64, 64]]\ndtype = 'fp8e4m3'\noperands = { a_scale = 'tile' }\n", ShapeError,
         "a_scale=tile: no fp8 recipe takes a 'tile' scale"),
        ("[[gemm]]\nshapes = [[64, 64, 64]]\ndtype = 'fp8e4m3'\noperands = { b_scale = 'row:bf16' }\n", DtypeError,
         "b_scale=row:bf16: scales are fp32"),
        ("[[grouped_gemm]]\nshapes = [[64, 64, 64, 2]]\nepilogue = 'tensor_quant'\noperands = { scale = 'tile' }\n",
         EpilogueError, "operand 'scale' is declared Scalar by the epilogue, but was passed as 'tile'"),
        ("[[conv]]\nshapes = [[8, 8, 8]]\n", ConfigError, "unknown kernel kinds"),
        ("[[gemm]\n", ConfigError, "not valid TOML"),
        ("", ConfigError, r"names no kernels to compile; add an entry, e.g. \[\[gemm\]\] then shapes"),
        ("gemm = []\n", ConfigError, "names no kernels"),
        ("gemm = 3\n", ConfigError, r"gemm entry 1 is 3; each entry is a table of fields: write \[\[gemm\]\]"),
        ('[[gemm]]\nshapes = [["a", 64, 64]]\n', ConfigError, r"shape \['a', 64, 64\]: give \[M, N, K\]"),
        ("[[gemm]]\nshapes = [[8, 8, -8]]\n", ConfigError, "integers >= 0"),
        ("[[gemm]]\nshapes = 8\n", ConfigError, "shapes = 8; give shapes"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\ndtype = 'int8'\n", ConfigError, "dtype = 'int8'; A and B's dtype is one"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\nout_dtype = 'fp64'\n", ConfigError, "out_dtype = 'fp64'; D's dtype is"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\nepilogue = 3\n", ConfigError, "epilogue = 3; it takes a string"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\nconfig = 3\n", ConfigError, "config = 3; it takes a table"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\nconfig = { tile_n = 'x' }\n", ConfigError, "config tile_n = 'x'; it takes"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\nconfig = { tiles = 1 }\n", ConfigError, "config field 'tiles' is unknown"),
        ("[[attention]]\nconfig = { foo = 1 }\n", ConfigError, "config field 'foo' is unknown"),
        ("[[attention]]\nhead_dim = 'x'\n", ConfigError, "head_dim = 'x'; give 64, 128, 256"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\n[[gemm]]\nshapes = [[8, 8]]\n", ConfigError, r"toml, \[\[gemm\]\] entry 2"),
    ],
)  # fmt: skip
def test_bad_specs_say_what_to_fix(tmp_path, text, error, match):
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    with pytest.raises(error, match=match):
        compile_spec(spec, dry_run=True)


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"gemm": [{"shapes": [[8, 8, 8]]},]}', "bad.json is not valid JSON"),
        ("[1, 2]", r"a spec maps kernel kinds to entries, e.g. \{\"gemm\""),
        ("{}", r"names no kernels to compile; add an entry, e.g. \{\"gemm\""),
    ],
)
def test_bad_json_specs_say_what_to_fix(tmp_path, text, match):
    spec = tmp_path / "bad.json"
    spec.write_text(text)
    with pytest.raises(ConfigError, match=match):
        compile_spec(spec, dry_run=True)


def test_spec_modules_are_found_beside_the_spec_and_in_the_working_directory(tmp_path, monkeypatch):
    for name, where in (("beside_spec", tmp_path / "specs"), ("in_cwd", tmp_path / "work")):
        where.mkdir()
        source = "import epicute\n\n@epicute.epilogue\ndef scaled(acc, s):\n    return acc * s\n"
        (where / f"{name}.py").write_text(source)
    spec = tmp_path / "specs" / "k.toml"
    entry = "[[gemm]]\nshapes = [[64, 64, 64]]\nepilogue = '{}:scaled'\noperands = {{ s = 'scalar' }}\n"
    spec.write_text(entry.format("beside_spec") + entry.format("in_cwd"))
    monkeypatch.chdir(tmp_path / "work")
    path_before = list(sys.path)
    assert [r.status for r in compile_spec(spec, dry_run=True)] == ["planned", "planned"]
    assert sys.path == path_before  # searched while importing only


def test_import_object_names_ready_epilogues_and_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    library = epicute.epilogues
    assert import_object("row_col_quant") is library.row_col_quant
    assert import_object("epicute.epilogues:tensor_quant") is library.tensor_quant
    assert import_object("epicute.epilogue.library:plain") is library.plain
    with pytest.raises(ConfigError, match=f"no module 'mypkg' in {tmp_path} or on PYTHONPATH; run from the directory"):
        import_object("mypkg.epilogues:bias_gelu")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(ConfigError, match="importing broken needs a module that is missing"):
        import_object("broken:fn")
    (tmp_path / "raises.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="importing raises raised RuntimeError: boom"):
        import_object("raises:fn")
    with pytest.raises(ConfigError, match="module epicute.epilogues has no 'nope'"):
        import_object("epicute.epilogues:nope")
    with pytest.raises(ConfigError, match="is not an import path"):
        import_object("foo[/bar]:fn")


def test_compile_checks_the_cache_directory_before_compiling(tmp_path, monkeypatch):
    spec = tmp_path / "k.toml"
    spec.write_text("[[gemm]]\nshapes = [[8, 8, 8]]\n")
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path / "afile" / "cache"))
    with pytest.raises(ConfigError, match="EPICUTE_CACHE_DIR.*is a file, not a directory; set EPICUTE_CACHE_DIR"):
        compile_spec(spec)
    monkeypatch.setenv("EPICUTE_CACHE", "0")
    with pytest.raises(ConfigError, match="EPICUTE_CACHE=0"):
        compile_spec(spec)


LOADER = textwrap.dedent(
    """
    from epicute.gemm import GemmProblem
    from epicute.runtime.cache import KERNEL_CACHE
    from epicute.gemm.compile import GEMM_CACHE
    from epicute.gemm.launch import cached_plan, variant_of

    # What epicute.gemm does for a (3, 17, 72) @ (3, 72, 136)^T call with these pins.
    pins = (("cluster_m", 1), ("persistent", False), ("tile_n", 128), ("evict_first", ""))
    GEMM_CACHE.get(variant_of(cached_plan(GemmProblem(17, 136, 72, 3, "bf16", "bf16", "k", "k"), pins)))
    print("compiles", KERNEL_CACHE.stats.compiles, "disk_loads", KERNEL_CACHE.stats.disk_loads)
    import sys
    print("libraries", len(KERNEL_CACHE._libraries), "dsl imported", "cutlass" in sys.modules)
    """
)


@pytest.mark.compile
def test_aot_compile_then_a_fresh_process_loads(tmp_path):
    stdout = aot_compile_then_fresh_load(tmp_path, SPEC, LOADER)
    # With a C compiler (CI has one) the entry is also a shared library, which loads without the CuTe DSL.
    if shutil.which(os.environ.get("CC") or "cc"):
        assert "libraries 1 dsl imported False" in stdout, stdout
