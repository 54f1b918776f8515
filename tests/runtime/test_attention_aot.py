"""Ahead-of-time attention compiles: an ``[[attention]]`` spec entry builds exactly what calls launch.

Compiling happens here without a GPU; a fresh process making an attention call
of other sizes then finds the entry on disk and loads it instead of compiling.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from epicute.attention.aot import attention_variants
from epicute.errors import ConfigError, EpilogueError, ShapeError
from epicute.runtime.aot import compile_spec, read_spec
from tests.conftest import aot_compile_then_fresh_load
from tests.runtime.test_attention_cache import launched_key, qkv

REPO = Path(__file__).resolve().parents[2]
HOOKS = "tests.runtime.test_attention_cache"

SPEC = f"""
[[attention]]
dtype = "bf16"
head_dim = 64
causal = true
heads = [8, 2]
config = {{ tile_n = 64 }}
score_mod = "{HOOKS}:softcap_alibi"
epilogue = "{HOOKS}:gated"
operands = {{ slopes = "head:fp32", cap = "scalar", gate = "tile:bf16", bias = "row" }}
"""


def test_spec_variants_are_the_ones_attention_launches(monkeypatch, tmp_path):
    from tests.runtime.test_attention_cache import gated, softcap_alibi

    spec = tmp_path / "k.toml"
    spec.write_text(SPEC + '\n[[attention]]\nhead_dim = [64, 128, 256]\ncausal = [false, true]\ndtype = "fp16"\n')
    hooked, grid = read_spec(spec)["attention"]
    ((aot_hooked, what),) = attention_variants(hooked)
    assert what == "d64 bf16 causal"
    # Any sizes and any GQA ratio: the same variant.
    q, k, v = qkv(2, 100, 77, 12, 3, 64)
    launched = launched_key(
        monkeypatch, q, k, v, causal=True, config={"tile_n": 64}, score_mod=softcap_alibi, slopes=torch.rand(12),
        cap=30.0, epilogue=gated, gate=torch.randn_like(q), bias=torch.randn(64),
    )  # fmt: skip
    assert launched == aot_hooked.key()

    aot_grid = attention_variants(grid)
    assert [w for _, w in aot_grid] == [f"d{d} fp16{c}" for d in (64, 128, 256) for c in ("", " causal")]
    for (variant, _), (d, causal) in zip(aot_grid, [(d, c) for d in (64, 128, 256) for c in (False, True)]):
        q, k, v = qkv(1, 17, 1000, 4, 1, d, dtype=torch.float16)
        assert launched_key(monkeypatch, q, k, v, causal=causal) == variant.key()


def test_dry_run_lists_attention_next_to_gemm(tmp_path):
    spec = tmp_path / "k.toml"
    spec.write_text("[[gemm]]\nshapes = [[128, 128, 64]]\n[[attention]]\nhead_dim = [64, 128]\n")
    results = compile_spec(spec, dry_run=True)
    assert [(r.kind, r.what, r.status) for r in results] == [
        ("gemm", "128x128x64", "planned"), ("attention", "d64 bf16", "planned"), ("attention", "d128 bf16", "planned"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "text, error, match",
    [
        ("[[attention]]\nhead_dims = 64\n", ConfigError, "unknown fields"),
        ("[[attention]]\ndtype = 'fp32'\n", ConfigError, "'bf16', 'fp16' or 'fp8e4m3'"),
        ("[[attention]]\nheads = [8]\n", ConfigError, r"\[heads_q, heads_kv\]"),
        ("[[attention]]\nheads = [8, 3]\n", ShapeError, "multiple of heads_kv"),
        ("[[attention]]\ncausal = 'yes'\n", ConfigError, "true, false"),
        ("[[attention]]\nhead_dim = 96\n", ShapeError, "head_dim=96"),
        ("[[attention]]\nconfig = { tile_m = 100 }\n", ConfigError, "tile_m=100"),
        ("[[attention]]\nscore_mod = 'nope'\n", ConfigError, "module:function"),
        (f"[[attention]]\nscore_mod = '{HOOKS}:softcap_alibi'\n", EpilogueError, r"missing \['cap', 'slopes'\]"),
        (f"[[attention]]\nepilogue = '{HOOKS}:gated'\noperands = {{ gate = 'tile', bias = 'row', x = 'scalar' }}\n",
         EpilogueError, r"unexpected \['x'\]"),
        (f"[[attention]]\nepilogue = '{HOOKS}:gated'\noperands = {{ gate = 'col', bias = 'row' }}\n",
         EpilogueError, "must be scalar, head, row or tile"),
        (f"[[attention]]\nepilogue = '{HOOKS}:gated'\noperands = {{ gate = 'tile:int7', bias = 'row' }}\n",
         EpilogueError, "dtype 'int7'"),
        (f"[[attention]]\nscore_mod = '{HOOKS}:gated'\n", EpilogueError, "positional indices"),
        ("[[attention]]\noperands = { x = 'scalar' }\n", EpilogueError, r"unexpected \['x'\]"),
    ],
)  # fmt: skip
def test_bad_attention_specs_say_what_to_fix(tmp_path, text, error, match):
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    with pytest.raises(error, match=match):
        compile_spec(spec, dry_run=True)


LOADER = textwrap.dedent(
    f"""
    import pytest, torch
    from epicute.attention import launch as rt
    from epicute.runtime.cache import KERNEL_CACHE
    from {HOOKS} import gated, launched_variant, qkv, softcap_alibi

    # An epicute.attention call of other sizes and another GQA ratio than the spec's; its
    # launch only fetches the kernel (launching needs the GPU).
    q, k, v = qkv(3, 129, 1000, 4, 1, 64)
    variant = launched_variant(
        pytest.MonkeyPatch(), q, k, v, causal=True, config={{"tile_n": 64}}, score_mod=softcap_alibi,
        slopes=torch.rand(4), cap=30.0, epilogue=gated, gate=torch.randn_like(q), bias=torch.randn(64),
    )
    assert callable(rt.ATTENTION_CACHE.get(variant))
    print("compiles", KERNEL_CACHE.stats.compiles, "disk_loads", KERNEL_CACHE.stats.disk_loads)
    """
)


@pytest.mark.compile
def test_aot_compile_then_a_fresh_process_loads(tmp_path):
    aot_compile_then_fresh_load(tmp_path, SPEC, LOADER)


def test_decode_entries_compile_the_variants_decode_calls_launch(monkeypatch, tmp_path):
    spec = tmp_path / "k.toml"
    spec.write_text("[[attention]]\nhead_dim = 128\ncausal = true\nheads = [32, 8]\ndecode = true\n")
    (entry,) = read_spec(spec)["attention"]
    variants = dict((what, variant) for variant, what in attention_variants(entry))
    assert sorted(variants) == ["d128 bf16 causal", "d128 bf16 causal decode", "d128 bf16 causal decode split-kv"]
    split = variants["d128 bf16 causal decode split-kv"]
    assert split.config.pack_gqa == 4 and split.config.split_kv
    # A decode call of another batch and cache length launches one of them.
    q, k, v = qkv(3, 1, 5000, 32, 8, 128)
    assert launched_key(monkeypatch, q, k, v, causal=True) == split.key()
    q, k, v = qkv(200, 1, 300, 32, 8, 128)
    assert launched_key(monkeypatch, q, k, v, causal=True) == variants["d128 bf16 causal decode"].key()
    spec.write_text('[[attention]]\ndecode = "yes"\n')
    with pytest.raises(ConfigError, match="true or false"):
        attention_variants(read_spec(spec)["attention"][0])


def test_fp8_entries_compile_the_kernel_calls_launch_and_its_value_pass(monkeypatch, tmp_path):
    from epicute.attention.launch import ValueLayoutVariant

    spec = tmp_path / "k.toml"
    spec.write_text('[[attention]]\ndtype = "fp8e4m3"\nhead_dim = [128, 256]\ncausal = true\n')
    (entry,) = read_spec(spec)["attention"]
    jobs = attention_variants(entry)
    assert [w for _, w in jobs] == ["d128 fp8e4m3 causal", "d128 fp8 value layout", "d256 fp8e4m3 causal",
                                    "d256 fp8 value layout"]  # fmt: skip
    assert [type(v) for v, _ in jobs][1::2] == [ValueLayoutVariant] * 2
    q, k, v = (t.to(torch.float8_e4m3fn) for t in qkv(1, 300, 77, 8, 2, 128))
    assert launched_key(monkeypatch, q, k, v, causal=True, q_descale=0.5) == jobs[0][0].key()
    assert [r.status for r in compile_spec(spec, dry_run=True)] == ["planned"] * 4
