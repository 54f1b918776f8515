"""``[[grouped_gemm]]`` ahead-of-time entries build exactly the variants the calls they describe launch, and a
``gated`` ``[[gemm]]`` entry those of gated calls (no GPU: variants are compared by key, one is compiled)."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from epicute.errors import ConfigError, EpilogueError
from epicute.gemm.aot import gemm_variants
from epicute.grouped.aot import grouped_variants
from epicute.grouped.api import describe_grouped_call
from epicute.grouped.prepare import prepare
from epicute.runtime.aot import compile_spec


def swiglu(gate, up, score):
    return ops.silu(gate) * up * score


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def launched(a, b, offsets, epilogue=None, operands=None, config=None, **kw):
    """The variant grouped_gemm launches for these arguments (its own describe + prepare path)."""
    request = describe_grouped_call(a, b, offsets, epilogue, None, None, None, config, operands or {}, False, **kw)[2]
    return prepare(request).variant()


def test_entries_build_the_variants_the_calls_launch():
    offs = meta(8, dtype=torch.int32)
    ((plain, what),) = grouped_variants({"shapes": [[16384, 14336, 4096, 8]]})
    assert what == "16384x14336x4096 G=8 rows"
    assert plain.key() == launched(meta(16384, 4096), meta(8, 14336, 4096).transpose(-2, -1), offs).key()

    entry = {"shapes": [[32768, 2 * 7168, 4096, 8]], "mode": "gathered", "gated": True,
             "epilogue": "tests.grouped.test_grouped_aot:swiglu", "operands": {"score": "col:fp32"}}  # fmt: skip
    ((gated, _),) = grouped_variants(entry)
    want = launched(meta(16384, 4096), meta(8, 2 * 7168, 4096).transpose(-2, -1), offs, swiglu,
                    {"score": meta(32768, 1, dtype=torch.float32)}, gated=True,
                    a_index=meta(32768, dtype=torch.int32))  # fmt: skip
    assert gated.gathered and gated.key() == want.key()

    ((wgrad, _),) = grouped_variants({"shapes": [[4096, 14336, 16384, 8]], "mode": "variable_k"})
    assert wgrad.ragged_k and wgrad.key() == launched(meta(16384, 4096).t(), meta(16384, 14336), offs).key()

    fp8 = {"shapes": [[16384, 14336, 4096, 8]], "dtype": "fp8e4m3"}
    ((block, _),) = grouped_variants(fp8)
    e4m3 = torch.float8_e4m3fn
    want = launched(meta(16384, 4096, dtype=e4m3), meta(8, 14336, 4096, dtype=e4m3).transpose(-2, -1), offs,
                    scales=(meta(16384, 32, dtype=torch.float32), meta(8, 112, 32, dtype=torch.float32)))  # fmt: skip
    assert block.block_scaled and block.key() == want.key()


def test_gated_gemm_entries_match_gated_calls():
    ((aot, _),) = gemm_variants({"shapes": [[4096, 2 * 7168, 4096]], "b_major": "k", "gated": True,
                                 "epilogue": "tests.grouped.test_grouped_aot:swiglu",
                                 "operands": {"score": "col:fp32"}})  # fmt: skip
    plan = epicute.explain(meta(4096, 4096), meta(2 * 7168, 4096).t(), gated=True, epilogue=swiglu,
                           score=meta(4096, 1, dtype=torch.float32), file=None)  # fmt: skip
    assert aot.config == plan.config and aot.fusion is not None and aot.fusion.gated


@pytest.mark.parametrize(
    ("entry", "error", "match"),
    [
        ({"shapes": [[100, 64, 64]]}, ConfigError, r"\[total_M, N, K, G\]"),
        ({"shapes": [[100, 64, 64, 2]], "mode": "ragged"}, ConfigError, "rows, gathered, variable_k"),
        ({"shapes": [[100, 64, 64, 2]], "dtype": "fp32"}, ConfigError, "bf16, fp16 or fp8"),
        ({"shapes": [[100, 64, 64, 2]], "gated": True}, ConfigError, "need an epilogue"),
        ({"shapes": [[100, 64, 64, 2]], "epilogue": "tests.grouped.test_grouped_aot:swiglu"}, EpilogueError, "missing"),
        ({"shapes": [[100, 64, 64, 2]], "sizes": 3}, ConfigError, "unknown fields"),
    ],
)
def test_bad_entries_say_what_to_fix(entry, error, match):
    with pytest.raises(error, match=match):
        grouped_variants(entry)


@pytest.mark.compile
def test_compile_spec_builds_a_gathered_gated_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "moe.toml"
    spec.write_text(
        '[[grouped_gemm]]\nshapes = [[8192, 512, 256, 4]]\nmode = "gathered"\ngated = true\n'
        'epilogue = "tests.grouped.test_grouped_aot:swiglu"\noperands = { score = "col:fp32" }\n'
    )
    (result,) = compile_spec(spec)
    assert result.kind == "grouped_gemm" and result.status in ("compiled", "cached")
    variant = grouped_variants({"shapes": [[8192, 512, 256, 4]], "mode": "gathered", "gated": True,
                                "epilogue": "tests.grouped.test_grouped_aot:swiglu",
                                "operands": {"score": "col:fp32"}})[0][0]  # fmt: skip
    assert result.digest == variant.key().digest
