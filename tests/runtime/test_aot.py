"""Ahead-of-time compiles: a spec builds exactly the kernels the calls it names would use.

Compiling happens here without a GPU; a fresh process then finds the entries on
disk and loads them instead of compiling (launching them needs the device).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import epicute
import epicute.api as api
from epicute.errors import ConfigError, EpilogueError
from epicute.runtime.aot import compile_spec, gemm_variants, read_spec
from tests.conftest import aot_compile_then_fresh_load

REPO = Path(__file__).resolve().parents[2]

SPEC = """
[[gemm]]
shapes = [[17, 136, 72, 3], [1000, 4104, 136]]
dtype = "bf16"
b_major = "k"
config = { tile_n = 128, persistent = false, cluster_m = 1 }
"""


def _launched_variant(monkeypatch, a, b, **kwargs):
    """The variant epicute.gemm would launch for these (CPU) tensors, captured instead of launched."""
    from epicute.runtime.launch import variant_of

    seen = {}
    real_check = api.check_gemm_args
    monkeypatch.setattr(api, "check_gemm_args", lambda *args, **kw: real_check(*args, **{**kw, "require_cuda": False}))
    monkeypatch.setattr(api, "launch_gemm", lambda call, plan, fusion=None, *rest, **kw: seen.update(v=variant_of(plan, fusion)))
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
    ((aot_plain, what),) = gemm_variants(plain)  # both shapes plan the same pinned config
    assert what == "17x136x72x3"
    a = torch.randn(3, 17, 72, dtype=torch.bfloat16)
    w = torch.randn(3, 136, 72, dtype=torch.bfloat16)
    config = {"tile_n": 128, "persistent": False, "cluster_m": 1}
    assert _launched_variant(monkeypatch, a, w.transpose(1, 2), config=config).key() == aot_plain.key()

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
        ("[[gemm]]\nshapes = [[8, 8, 8]]\nepilogue = 'epicute.epilogue.library:missing'\n", ConfigError, "cannot import"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\nepilogue = 'epicute.epilogue.library:row_col_quant'\n", EpilogueError, "missing"),
        ("[[gemm]]\nshapes = [[8, 8, 8]]\noperands = { x = 'row' }\n", ConfigError, "need an epilogue"),
        ("[[conv]]\nshapes = [[8, 8, 8]]\n", ConfigError, "unknown kernel kinds"),
        ("[[gemm]\n", ConfigError, "not valid TOML"),
    ],
)
def test_bad_specs_say_what_to_fix(tmp_path, text, error, match):
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    with pytest.raises(error, match=match):
        compile_spec(spec, dry_run=True)


LOADER = textwrap.dedent(
    """
    from epicute.plan import GemmProblem
    from epicute.runtime.cache import KERNEL_CACHE
    from epicute.runtime.compile import GEMM_CACHE
    from epicute.runtime.launch import cached_plan, variant_of

    # What epicute.gemm does for a (3, 17, 72) @ (3, 72, 136)^T call with these pins.
    pins = (("cluster_m", 1), ("persistent", False), ("tile_n", 128))
    GEMM_CACHE.get(variant_of(cached_plan(GemmProblem(17, 136, 72, 3, "bf16", "bf16", "k", "k"), pins)))
    print("compiles", KERNEL_CACHE.stats.compiles, "disk_loads", KERNEL_CACHE.stats.disk_loads)
    """
)


@pytest.mark.compile
def test_aot_compile_then_a_fresh_process_loads(tmp_path):
    aot_compile_then_fresh_load(tmp_path, SPEC, LOADER)
