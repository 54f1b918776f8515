"""The grouped GEMM on the CPU: argument checks (typed errors naming the fix), the reference backend
against per-group float32 products, the grouped plan and its grid bound, and sm_90a compiles."""

from __future__ import annotations

import io
import math

import pytest
import torch

import epicute
from epicute import ops
from epicute.errors import (
    AlignmentError,
    ConfigError,
    DeviceError,
    DtypeError,
    EpilogueError,
    OutputError,
    ShapeError,
)
from epicute.grouped.api import describe_grouped_call
from epicute.grouped.compile import compile_grouped
from epicute.grouped.prepare import prepare
from epicute.sm90.tile_grid import ceil_div, grouped_cluster_bound
from tests.conftest import rel_err


def offsets_of(sizes) -> torch.Tensor:
    return torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32)


def operands(sizes, k=40, n=24, dtype=torch.bfloat16):
    offsets = offsets_of(sizes)
    a = torch.randn(int(offsets[-1]), k, dtype=dtype)
    b = torch.randn(len(sizes), n, k, dtype=dtype).transpose(-2, -1)
    return a, b, offsets


def per_group(a, b, offsets) -> torch.Tensor:
    ends = offsets.tolist()
    return torch.cat([a[s:e].double() @ b[g].double() for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])


def test_reference_is_the_per_group_product():
    a, b, offsets = operands([0, 1, 37, 9, 0])
    d = epicute.grouped_gemm(a, b, offsets, backend="reference")
    assert d.shape == (47, 24) and d.dtype == torch.bfloat16
    assert rel_err(d, per_group(a, b, offsets)) < 1e-2


def test_rows_past_the_last_group_belong_to_none():
    """A buffer with room (the last group ending before total_M): its rows past the groups are not written (NaN from
    the reference without ``out``; ``out``'s own values with it), row reductions too."""
    a, b, offsets = operands([3, 0, 5])
    a = torch.cat([a, torch.randn(6, 40, dtype=torch.bfloat16)])
    d = epicute.grouped_gemm(a, b, offsets, backend="reference")
    assert d.shape == (14, 24) and d[8:].isnan().all() and rel_err(d[:8], per_group(a[:8], b, offsets)) < 1e-2
    out = torch.full((14, 24), 7.0, dtype=torch.bfloat16)
    epicute.grouped_gemm(a, b, offsets, out=out, backend="reference")
    assert (out[8:] == 7.0).all() and rel_err(out[:8], per_group(a[:8], b, offsets)) < 1e-2
    sums = epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc: {"D": acc, "s": ops.row_sum(acc)},
                                backend="reference")["s"]  # fmt: skip
    assert sums.shape == (14,) and sums[8:].isnan().all()


def test_reference_epilogue_sees_each_rows_group():
    sizes = [3, 0, 5, 2]
    a, b, offsets = operands(sizes)
    bias = torch.randn(4, 24)
    score = torch.rand(10, 1)
    got = epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc, bias, score: {"D": acc * score + bias, "acc": acc},
                               bias=bias, score=score, backend="reference", out_dtype=torch.float32)  # fmt: skip
    group = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    acc = per_group(a, b, offsets)
    assert rel_err(got["D"], acc * score.double() + bias.double()[group]) < 1e-6
    assert rel_err(got["acc"], acc) < 1e-6


def test_reference_writes_out():
    a, b, offsets = operands([4, 6])
    out = torch.full((10, 24), float("nan"), dtype=torch.bfloat16)
    d = epicute.grouped_gemm(a, b, offsets, out=out, backend="reference")
    assert d.data_ptr() == out.data_ptr() and not torch.isnan(out).any()


BAD = {
    "offsets_int64": (lambda a, b, o: (a, b, o.long()), DtypeError, "int32"),
    "offsets_cu_seqlens": (
        lambda a, b, o: (a, b, torch.cat([torch.zeros(1, dtype=torch.int32), o])),
        ShapeError,
        "offsets[1:]",
    ),
    "offsets_decrease": (lambda a, b, o: (a, b, torch.tensor([5, 3, 10], dtype=torch.int32)), ShapeError, "decrease"),
    "offsets_past_m": (lambda a, b, o: (a, b, torch.tensor([2, 4, 11], dtype=torch.int32)), ShapeError, "total_M"),
    "offsets_negative": (lambda a, b, o: (a, b, torch.tensor([-1, 4, 10], dtype=torch.int32)), ShapeError, "negative"),
    "a_3d": (lambda a, b, o: (a[None], b, o), ShapeError, "2-D"),
    "b_4d": (lambda a, b, o: (a, b[None], o), ShapeError, "(G, K, N)"),
    "k_mismatch": (lambda a, b, o: (a[:, :8], b, o), ShapeError, "K="),
    "dtype_mismatch": (lambda a, b, o: (a, b.half(), o), DtypeError, "match"),
    "fp32": (lambda a, b, o: (a.float(), b.float(), o), DtypeError, "bfloat16"),
    "a_column_major": (lambda a, b, o: (a.t().contiguous().t(), b, o), AlignmentError, "a.contiguous()"),
    "n_unaligned": (lambda a, b, o: (a, b[:, :, :7], o), AlignmentError, "pad N"),
    "offsets_elsewhere": (lambda a, b, o: (a, b, o.to("meta")), DeviceError, "move it there"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_get_typed_errors(case):
    make, error, words = BAD[case]
    a, b, offsets = operands([2, 3, 5], k=32, n=24)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        epicute.grouped_gemm(*make(a, b, offsets), backend="reference")


def test_gpu_offsets_are_checked_only_when_asked():
    """Offsets on a device are not read (no sync) unless check_offsets=True; meta tensors stand in here."""
    a = torch.empty(10, 32, dtype=torch.bfloat16, device="meta")
    b = torch.empty(3, 32, 24, dtype=torch.bfloat16, device="meta")
    offsets = torch.empty(3, dtype=torch.int32, device="meta")
    describe_grouped_call(a, b, offsets, None, None, None, None, None, {}, require_cuda=False)
    with pytest.raises((NotImplementedError, RuntimeError)):  # reading a meta tensor's values
        describe_grouped_call(a, b, offsets, None, None, None, None, None, {}, require_cuda=False, check_offsets=True)


def test_out_errors():
    a, b, offsets = operands([2, 3, 5], k=32, n=24)
    with pytest.raises(OutputError, match="writes"):
        epicute.grouped_gemm(a, b, offsets, out=torch.empty(10, 16, dtype=torch.bfloat16), backend="reference")
    with pytest.raises(OutputError, match="out_dtype"):
        epicute.grouped_gemm(a, b, offsets, out=torch.empty(10, 24, dtype=torch.bfloat16), out_dtype=torch.float32,
                             backend="reference")  # fmt: skip


def test_epilogue_operand_errors():
    a, b, offsets = operands([2, 3, 5], k=32, n=24)
    per_group_rows = torch.randn(3, 10, 1)
    with pytest.raises(EpilogueError, match="each row belongs to one group"):
        epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc, s: acc * s, s=per_group_rows, backend="reference")
    with pytest.raises(EpilogueError, match="quantize_groups in a grouped GEMM"):
        epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc: dict(zip(("D", "s"), ops.quantize_groups(acc))),
                             backend="reference")  # fmt: skip
    with pytest.raises(EpilogueError, match="without an epilogue"):
        epicute.grouped_gemm(a, b, offsets, bias=torch.randn(24), backend="reference")


@pytest.mark.parametrize(("block", "clusters_n", "groups"), [(128, 3, 5), (256, 1, 7), (64, 2, 40)])
def test_grid_bound_covers_every_routing_and_is_reached(block, clusters_n, groups):
    total = 3 * block + 11
    bound = grouped_cluster_bound(total, groups, block, clusters_n)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):  # random routings, empty groups included
        cuts = sorted(torch.randint(0, total + 1, (groups - 1,), generator=gen).tolist())
        ends = [*cuts, total]
        sizes = [e - s for s, e in zip([0, *ends[:-1]], ends)]
        assert sum(ceil_div(s, block) for s in sizes) * clusters_n <= bound
    # Groups one row past a multiple of the block, as many as fit: the bound is reached.
    fits = min(groups, total // (block + 1))
    sizes = [block + 1] * (fits - 1) + [total - (fits - 1) * (block + 1)] + [0] * (groups - fits)
    assert sum(sizes) == total
    tight = grouped_cluster_bound(total, fits, block, clusters_n)
    assert sum(ceil_div(s, block) for s in sizes) * clusters_n == tight <= bound


def test_explain_grouped_prints_the_schedule_and_chain(capsys):
    a = torch.empty(16384, 4096, dtype=torch.bfloat16, device="meta")
    w = torch.empty(8, 14336, 4096, dtype=torch.bfloat16, device="meta")
    offsets = torch.empty(8, dtype=torch.int32, device="meta")
    plan = epicute.explain_grouped(a, w.transpose(-2, -1), offsets, epilogue=lambda acc, bias: ops.silu(acc + bias),
                                   bias=torch.empty(8, 14336, dtype=torch.bfloat16, device="meta"))  # fmt: skip
    text = capsys.readouterr().out
    assert "grouped schedule" in text and "ragged TMA descriptor" in text and "epilogue chain" in text
    assert text.count("  grid ") == 1 and "output tiles" not in text  # the grouped grid only
    assert plan.grid[2] == min(plan.cluster_bound, plan.max_active_clusters)
    c = plan.config
    assert plan.cluster_bound == (16384 + 8 * (c.tile_m * c.cluster_m - 1)) // (c.tile_m * c.cluster_m) * ceil_div(
        ceil_div(14336, c.tile_n), c.cluster_n
    )


@pytest.mark.parametrize(("groups", "rows"), [(8, 16384), (64, 16384), (128, 32768)])
def test_clusters_pair_tiles_per_group(groups, rows, capsys):
    """Where the planner wants a 2-CTA cluster, it pairs tiles per group (no group padded to two row tiles); a pinned
    cluster is kept as pinned, unpaired."""
    a = torch.empty(rows, 7168, dtype=torch.bfloat16, device="meta")
    w = torch.empty(groups, 2048, 7168, dtype=torch.bfloat16, device="meta")
    offsets = torch.empty(groups, dtype=torch.int32, device="meta")
    plan = epicute.explain_grouped(a, w.transpose(-2, -1), offsets, target="h200")
    text = capsys.readouterr().out
    c = plan.config
    assert (c.cluster_m, c.cluster_n, c.pair_tiles) == (2, 1, True)
    assert "nor pad them" in text and "B or A to 2 CTAs, per tile" in text and "paired tiles" in text
    for pin in ({"cluster_m": 2}, {"cluster_n": 2}):
        pinned = epicute.explain_grouped(a, w.transpose(-2, -1), offsets, target="h200", config=pin, file=None)
        assert not pinned.config.pair_tiles and pinned.config.cluster_m == pin.get("cluster_m", 1)
    off = epicute.explain_grouped(a, w.transpose(-2, -1), offsets, target="h200", config={"pair_tiles": False},
                                  file=None)  # fmt: skip
    assert not off.config.pair_tiles
    on = epicute.explain_grouped(a, w.transpose(-2, -1), offsets, target="h200", config={"pair_tiles": True},
                                 file=None)  # fmt: skip
    assert (on.config.cluster_m, on.config.cluster_n, on.config.pair_tiles) == (2, 1, True)
    with pytest.raises(ConfigError, match="paired tiles take a 2x1 cluster"):
        epicute.explain_grouped(a, w.transpose(-2, -1), offsets, config={"pair_tiles": True, "cluster_n": 2},
                                file=None)  # fmt: skip


def test_paired_tiles_are_not_planned_where_they_cannot_help_or_run():
    offsets = torch.empty(64, dtype=torch.int32, device="meta")
    x = torch.empty(16384, 7168, dtype=torch.bfloat16, device="meta")
    narrow = torch.empty(64, 128, 7168, dtype=torch.bfloat16, device="meta")  # one column tile: no pair along N
    plan = epicute.explain_grouped(x, narrow.transpose(-2, -1), offsets, target="h200", file=None)
    assert not plan.config.pair_tiles
    w = torch.empty(64, 2048, 7168, dtype=torch.bfloat16, device="meta").transpose(-2, -1)
    index = torch.empty(16384, dtype=torch.int32, device="meta")
    gathered = epicute.explain_grouped(x, w, offsets, a_index=index, target="h200", file=None)
    assert not gathered.config.pair_tiles and gathered.config.cluster_n == 1
    with pytest.raises(ConfigError, match="pair_tiles=True with gathered rows"):
        epicute.explain_grouped(x, w, offsets, a_index=index, config={"pair_tiles": True}, file=None)
    dy = torch.empty(16384, 2048, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ConfigError, match="pair_tiles=True with variable K"):
        epicute.explain_grouped(x.t(), dy, offsets, config={"pair_tiles": True}, file=None)
    with pytest.raises(ConfigError, match="pair_tiles=True: paired tiles are a grouped GEMM's schedule"):
        epicute.explain(torch.empty(256, 64, dtype=torch.bfloat16, device="meta"),
                        torch.empty(64, 256, dtype=torch.bfloat16, device="meta"),
                        config={"pair_tiles": True}, file=None)  # fmt: skip


def test_groups_many_tiles_long_plan_unpaired_pingpong_tiles(capsys):
    """At 8 experts x 2048 rows (55 waves of 128x256 tiles) the cooperative tile's exposed store makes ping-pong
    128x192 the estimate's pick, in a plain 2x1 cluster (measured ahead of paired ping-pong tiles); gathered rows
    stay cooperative, and variable K (the weight gradient) takes ping-pong too, each tile its own k-tiles."""
    x = torch.empty(16384, 4096, dtype=torch.bfloat16, device="meta")
    w = torch.empty(8, 14336, 4096, dtype=torch.bfloat16, device="meta").transpose(-2, -1)
    offsets = torch.empty(8, dtype=torch.int32, device="meta")
    plan = epicute.explain_grouped(x, w, offsets, target="h200")
    text = capsys.readouterr().out
    c = plan.config
    assert (c.schedule, c.tile_n, c.cluster_m, c.cluster_n, c.pair_tiles) == ("pingpong", 192, 2, 1, False)
    assert "store runs with no WGMMA in flight" in text and "cluster 2x1 unpaired" in text
    index = torch.empty(16384, dtype=torch.int32, device="meta")
    gathered = epicute.explain_grouped(x, w, offsets, a_index=index, target="h200", file=None)
    assert gathered.config.schedule == "cooperative"
    assert any(r.startswith("schedule cooperative: gathered rows") for r in gathered.config.reasons)
    pinned = epicute.explain_grouped(x, w, offsets, a_index=index, target="h200", config={"schedule": "pingpong"},
                                     file=None)  # fmt: skip
    assert pinned.config.schedule == "pingpong"
    dy = torch.empty(16384, 14336, dtype=torch.bfloat16, device="meta")
    wgrad = epicute.explain_grouped(x.t(), dy, offsets, target="h200", file=None)
    assert (wgrad.problem.ragged, wgrad.config.schedule, wgrad.config.tile_n) == ("k", "pingpong", 192)
    epicute.explain_grouped(x.t(), dy, offsets, target="h200")
    assert "steps its ring over the other's tiles by their groups' k-tiles" in capsys.readouterr().out


@pytest.mark.parametrize("fields", [{"cluster_n": 2}, {}, {"cluster_m": 2, "split_k": 2}])
def test_paired_tiles_take_a_2x1_cluster(fields):
    from epicute.gemm.config import GemmConfig

    with pytest.raises(ConfigError, match="pair_tiles"):
        GemmConfig(pair_tiles=True, **fields).validate()


def _prepared(config, dtype=torch.bfloat16, epilogue=None, **ops_):
    a = torch.empty(300, 64, dtype=dtype, device="meta")
    b = torch.empty(5, 136, 64, dtype=dtype, device="meta").transpose(-2, -1)
    offsets = torch.empty(5, dtype=torch.int32, device="meta")
    return prepare(describe_grouped_call(a, b, offsets, epilogue, None, None, None, config, ops_, False)[2])


COMPILES = {
    "plain_cooperative_2x1": ({"tile_n": 256, "cluster_m": 2}, torch.bfloat16, None, {}),
    "fp16_pingpong": ({"schedule": "pingpong", "tile_n": 128}, torch.float16, None, {}),
    "one_tile_per_cta": ({"persistent": False, "tile_n": 64}, torch.bfloat16, None, {}),
    "paired_with_every_epilogue_kind": (
        {"cluster_m": 2, "pair_tiles": True, "tile_n": 64},
        torch.bfloat16,
        lambda acc, bias, score, res: {"D": ops.silu(acc + bias) * score + res, "pre": acc, "colsum": ops.col_sum(acc)},
        {"bias": torch.empty(5, 136, dtype=torch.bfloat16, device="meta"),
         "score": torch.empty(300, 1, device="meta"),
         "res": torch.empty(300, 136, dtype=torch.bfloat16, device="meta")},
    ),
    "epilogue_every_kind": (
        {"cluster_n": 2},
        torch.bfloat16,
        lambda acc, bias, score, res: {"D": ops.silu(acc + bias) * score + res, "pre": acc},
        {"bias": torch.empty(5, 136, dtype=torch.bfloat16, device="meta"),
         "score": torch.empty(300, 1, device="meta"),
         "res": torch.empty(300, 136, dtype=torch.bfloat16, device="meta")},
    ),
}  # fmt: skip


@pytest.mark.compile
@pytest.mark.parametrize("case", list(COMPILES))
def test_grouped_variants_compile_for_sm90a(case):
    config, dtype, epi, ops_ = COMPILES[case]
    compile_grouped(_prepared(config, dtype, epi, **ops_).variant())


def test_variable_k_reference_and_explain():
    sizes = [3, 0, 20, 7]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x, dy = torch.randn(30, 16).bfloat16(), torch.randn(30, 24).bfloat16()
    dw = epicute.grouped_gemm(x.t(), dy, offsets, out_dtype=torch.float32, backend="reference")
    starts = [0, *offsets.tolist()[:-1]]
    want = torch.stack([x[s:e].double().t() @ dy[s:e].double() for s, e in zip(starts, offsets.tolist())])
    assert dw.shape == (4, 16, 24) and (dw.double() - want).abs().max() <= 1e-6 * want.abs().max()
    assert not dw[1].any()
    meta = torch.empty(16384, 4096, dtype=torch.bfloat16, device="meta")
    dy_meta = torch.empty(16384, 2048, dtype=torch.bfloat16, device="meta")
    text = io.StringIO()
    plan = epicute.explain_grouped(meta.t(), dy_meta, torch.empty(8, dtype=torch.int32, device="meta"), file=text)
    assert plan.problem.ragged == "k" and f"schedule        {plan.config.schedule}, persistent" in text.getvalue()
    assert "variable K" in text.getvalue() and "rows past the group's end arrive as zeros" in text.getvalue()


VARIABLE_K_BAD = {
    "a_row_major": (lambda x, dy, o: (x.t().contiguous(), dy, o), AlignmentError, "x.t()"),
    "b_column_major": (lambda x, dy, o: (x.t(), dy.t().contiguous().t(), o), AlignmentError, "row-major (total_K, N)"),
    "k_mismatch": (lambda x, dy, o: (x.t(), dy[:-1], o), ShapeError, "K="),
    "offsets_past_k": (lambda x, dy, o: (x.t(), dy, torch.tensor([4, 12], dtype=torch.int32)), ShapeError, "total_K"),
    "gated": (lambda x, dy, o: (x.t(), dy, o), EpilogueError, "variable K"),
}


@pytest.mark.parametrize("case", list(VARIABLE_K_BAD))
def test_variable_k_bad_arguments_get_typed_errors(case):
    make, error, words = VARIABLE_K_BAD[case]
    x, dy = torch.randn(10, 16).bfloat16(), torch.randn(10, 24).bfloat16()
    gated = {"epilogue": lambda gate, up: gate * up, "gated": True} if case == "gated" else {}
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        epicute.grouped_gemm(*make(x, dy, torch.tensor([4, 10], dtype=torch.int32)), backend="reference",
                             **gated)  # fmt: skip


@pytest.mark.compile
@pytest.mark.parametrize("cluster", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_variable_k_compiles_for_sm90a(cluster, schedule):
    meta = torch.empty(300, 64, dtype=torch.bfloat16, device="meta")
    dy = torch.empty(300, 136, dtype=torch.bfloat16, device="meta")
    config = {"tile_n": 128, "cluster_m": cluster[0], "cluster_n": cluster[1], "schedule": schedule}
    request = describe_grouped_call(meta.t(), dy, torch.empty(5, dtype=torch.int32, device="meta"),
                                    lambda acc, bias: acc + bias, None, torch.float32, None, config,
                                    {"bias": torch.empty(5, 136, device="meta")}, False)[2]  # fmt: skip
    variant = prepare(request).variant()
    assert variant.ragged_k and "ragged_k" in repr(variant.key().parts)
    compile_grouped(variant)


# ---- fp8 inputs with blockwise scales


def fp8_operands(sizes, k=256, n=200, b_dtype=torch.float8_e4m3fn):
    """Random fp8 tokens and per-group (N, K) weights as b = w.transpose(-2, -1), their blockwise scales, offsets."""
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    total, groups, kb, nb = int(offsets[-1]) if sizes else 0, len(sizes), -(-k // 128), -(-n // 128)
    x = torch.randn(total, k).to(torch.float8_e4m3fn)
    w = torch.randn(groups, n, k).to(b_dtype)
    return x, w.transpose(-2, -1), offsets, torch.rand(kb, total).t() + 0.5, torch.rand(groups, nb, kb) + 0.5


def reference_fp8(x, b, offsets, sa, sb) -> torch.Tensor:
    """Group by group in float64: (x * its 1x128 scales) @ (w * its 128x128 scales).T."""
    k, n = x.shape[1], b.shape[2]
    ends = offsets.tolist()
    pieces = []
    for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
        a = x[s:e].double() * sa[s:e].double().repeat_interleave(128, 1)[:, :k]
        w = b[g].t().double() * sb[g].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        pieces.append(a @ w.t())
    return torch.cat(pieces)


@pytest.mark.parametrize("b_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_blockwise_reference(b_dtype):
    """The reference dequantizes per group (A's scales by global row, B's by group), then float32 math."""
    x, b, offsets, sa, sb = fp8_operands([0, 100, 77, 1, 122], k=272, n=200, b_dtype=b_dtype)
    d = epicute.grouped_gemm(x, b, offsets, a_scale=sa, b_scale=sb, out_dtype=torch.float32, backend="reference")
    want = reference_fp8(x, b, offsets, sa, sb)
    assert d.dtype == torch.float32 and (d.double() - want).norm() / want.norm() < 1e-6
    default = epicute.grouped_gemm(x, b, offsets, a_scale=sa, b_scale=sb, backend="reference")
    assert default.dtype == torch.bfloat16  # fp8 inputs give bf16 by default
    transposed = epicute.grouped_gemm(x, b, offsets, a_scale=sa, b_scale=sb.transpose(-2, -1).contiguous()
                                      .transpose(-2, -1), out_dtype=torch.float32, backend="reference")  # fmt: skip
    assert (transposed.double() - want).norm() / want.norm() < 1e-6
    text = io.StringIO()
    plan = epicute.explain_grouped(x, b, offsets, a_scale=sa, b_scale=sb, file=text)
    assert plan.problem.block_scaled and plan.config.tile_k == 128 and "fp8 scales      blockwise" in text.getvalue()


FP8_BAD = {
    "no_scales": (lambda x, b, o, sa, sb: ((x, b, o), {}), DtypeError, "a_scale is missing"),
    "rowwise_b_scale": (
        lambda x, b, o, sa, sb: ((x, b, o), {"a_scale": sa, "b_scale": torch.rand(3, 200)}),
        ShapeError,
        "blockwise scales",
    ),  # fmt: skip
    "a_scale_shape": (
        lambda x, b, o, sa, sb: ((x, b, o), {"a_scale": sa[:-1], "b_scale": sb}),
        ShapeError,
        "one per row and 128-wide block",
    ),  # fmt: skip
    "scale_dtype": (lambda x, b, o, sa, sb: ((x, b, o), {"a_scale": sa.double(), "b_scale": sb}), DtypeError, "fp32"),
    "b_row_major": (
        lambda x, b, o, sa, sb: ((x, b.contiguous(), o), {"a_scale": sa, "b_scale": sb}),
        AlignmentError,
        "K-major",
    ),  # fmt: skip
    "k_not_16": (
        lambda x, b, o, sa, sb: ((x[:, :250], b[:, :250], o), {"a_scale": sa, "b_scale": sb}),
        AlignmentError,
        "multiple of 16",
    ),  # fmt: skip
    "mixed_bf16": (
        lambda x, b, o, sa, sb: ((x, b.bfloat16(), o), {"a_scale": sa, "b_scale": sb}),
        DtypeError,
        "fp8 b",
    ),  # fmt: skip
    "scales_on_bf16": (
        lambda x, b, o, sa, sb: ((x.bfloat16(), b.bfloat16(), o), {"a_scale": sa, "b_scale": sb}),
        DtypeError,
        "dequantize fp8 inputs",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(FP8_BAD))
def test_fp8_bad_arguments_get_typed_errors(case):
    make, error, words = FP8_BAD[case]
    args, kwargs = make(*fp8_operands([40, 60, 200], k=256, n=200))
    with pytest.raises(error, match=words):
        epicute.grouped_gemm(*args, **kwargs, backend="reference")


@pytest.mark.compile
@pytest.mark.parametrize("case", ["e4m3_planned", "e4m3_e5m2_epilogue", "cluster_1x2"])
def test_fp8_blockwise_variants_compile_for_sm90a(case):
    meta = lambda *s, dtype=torch.float8_e4m3fn: torch.empty(*s, dtype=dtype, device="meta")
    b_dtype = torch.float8_e5m2 if case == "e4m3_e5m2_epilogue" else torch.float8_e4m3fn
    epilogue, operands_ = None, {}
    if case == "e4m3_e5m2_epilogue":
        epilogue, operands_ = lambda acc, score: ops.silu(acc) * score, {"score": meta(3000, 1, dtype=torch.float32)}
    config = {"cluster_n": 2, "cluster_m": 1} if case == "cluster_1x2" else None
    request = describe_grouped_call(
        meta(3000, 512), meta(8, 640, 512, dtype=b_dtype).transpose(-2, -1), meta(8, dtype=torch.int32), epilogue,
        None, None, None, config, operands_, False, scales=(meta(3000, 4, dtype=torch.float32),
                                                            meta(8, 5, 4, dtype=torch.float32)),
    )[2]  # fmt: skip
    variant = prepare(request).variant()
    assert variant.block_scaled and variant.config.tile_k == 128
    compile_grouped(variant)


# ---- fp8 variable K (weight gradients over groups of 128-row blocks of K)


def fp8_variable_k_operands(sizes, m=200, n=136, room=0):
    """K-major fp8 A (M, total_K) and B = t.t() of a row-major (N, total_K) t, their blockwise scales over the whole
    K (``room`` K rows past the last group), and the group ends."""
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    total = int(offsets[-1]) + room
    a = torch.randn(m, total).to(torch.float8_e4m3fn)
    t = torch.randn(n, total).to(torch.float8_e4m3fn)
    return a, t.t(), offsets, torch.rand(m, total // 128) + 0.5, torch.rand(-(-n // 128), total // 128) + 0.5


def reference_fp8_variable_k(a, b, offsets, sa, sb) -> torch.Tensor:
    """D[g] = (a * its 1x128 scales)[:, rows of g] @ (b * its 128x128 scales)[rows of g, :] in float64."""
    n = b.shape[1]
    a64 = a.double() * sa.double().repeat_interleave(128, 1)
    t64 = b.t().double() * sb.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    ends = offsets.tolist()
    return torch.stack([a64[:, s:e] @ t64[:, s:e].t() for s, e in zip([0, *ends[:-1]], ends)])


def test_fp8_variable_k_reference_and_explain():
    """Groups on 128-row blocks of K (one empty), K rows past the last group read by none."""
    a, b, offsets, sa, sb = fp8_variable_k_operands([256, 0, 128, 384], room=256)
    d = epicute.grouped_gemm(a, b, offsets, a_scale=sa, b_scale=sb, out_dtype=torch.float32, backend="reference")
    want = reference_fp8_variable_k(a, b, offsets, sa, sb)
    assert d.shape == (4, 200, 136) and (d.double() - want).norm() / want.norm() < 1e-6 and not d[1].any()
    assert epicute.grouped_gemm(a, b, offsets, a_scale=sa, b_scale=sb, backend="reference").dtype == torch.bfloat16
    text = io.StringIO()
    plan = epicute.explain_grouped(a, b, offsets, a_scale=sa, b_scale=sb, file=text)
    assert plan.problem.ragged == "k" and plan.problem.block_scaled and plan.config.tile_k == 128
    assert "one TMA descriptor each over the whole K" in text.getvalue() and "gets NaN" in text.getvalue()


FP8_VARIABLE_K_BAD = {
    "offsets_unaligned": (lambda a, b, o, sa, sb: ((a, b, o - 1), {"a_scale": sa, "b_scale": sb}), ShapeError,
                          "not a multiple of 128"),  # fmt: skip
    "a_m_major": (lambda a, b, o, sa, sb: ((a.t().contiguous().t(), b, o), {"a_scale": sa, "b_scale": sb}),
                  AlignmentError, "K-major"),  # fmt: skip
    "b_n_major": (lambda a, b, o, sa, sb: ((a, b.contiguous(), o), {"a_scale": sa, "b_scale": sb}), AlignmentError,
                  "row-major \\(N, total_K\\)"),  # fmt: skip
    "no_scales": (lambda a, b, o, sa, sb: ((a, b, o), {}), DtypeError, "a_scale is missing"),
    "b_scale_per_group": (lambda a, b, o, sa, sb: ((a, b, o), {"a_scale": sa, "b_scale": sb.expand(3, -1, -1)}),
                          ShapeError, "whole K|128x128 block"),  # fmt: skip
    "a_scale_short": (lambda a, b, o, sa, sb: ((a, b, o), {"a_scale": sa[:, :-1], "b_scale": sb}), ShapeError,
                      "a_scale"),  # fmt: skip
    "bf16_b": (lambda a, b, o, sa, sb: ((a, b.bfloat16(), o), {"a_scale": sa, "b_scale": sb}), DtypeError, "fp8 b"),
}


@pytest.mark.parametrize("case", list(FP8_VARIABLE_K_BAD))
def test_fp8_variable_k_bad_arguments_get_typed_errors(case):
    make, error, words = FP8_VARIABLE_K_BAD[case]
    args, kwargs = make(*fp8_variable_k_operands([128, 256, 128]))
    with pytest.raises(error, match=words):
        epicute.grouped_gemm(*args, **kwargs, backend="reference")


@pytest.mark.compile
@pytest.mark.parametrize("config", [None, {"cluster_m": 1, "cluster_n": 2}, {"tile_n": 256, "cluster_m": 1}])
def test_fp8_variable_k_variants_compile_for_sm90a(config):
    meta = lambda *s, dtype=torch.float8_e4m3fn: torch.empty(*s, dtype=dtype, device="meta")
    request = describe_grouped_call(
        meta(4096, 8192), meta(1024, 8192).t(), meta(8, dtype=torch.int32), None, None, None, None, config, {}, False,
        scales=(meta(4096, 64, dtype=torch.float32), meta(8, 64, dtype=torch.float32)),
    )[2]  # fmt: skip
    variant = prepare(request).variant()
    assert variant.ragged_k and variant.block_scaled and (variant.a_major, variant.b_major) == ("k", "k")
    compile_grouped(variant)


# ---- gathered rows (a_index)


def test_gathered_reference_reads_the_indexed_rows():
    x = torch.randn(30, 40, dtype=torch.bfloat16)
    sizes = [5, 0, 9, 2]
    index = torch.randint(0, 30, (16,))
    b = torch.randn(4, 24, 40, dtype=torch.bfloat16).transpose(-2, -1)
    d = epicute.grouped_gemm(x, b, offsets_of(sizes), a_index=index, backend="reference")
    assert d.shape == (16, 24)
    assert rel_err(d, per_group(x[index], b, offsets_of(sizes))) < 1e-2


GATHER_BAD = {
    "index_float": (lambda x, i: (x, {"a_index": i.float()}), DtypeError, "int32"),
    "index_2d": (lambda x, i: (x, {"a_index": i[:, None]}), ShapeError, "1-D"),
    "index_list": (lambda x, i: (x, {"a_index": i.tolist()}), DtypeError, "torch.Tensor"),
    "index_out_of_range": (lambda x, i: (x, {"a_index": i + 30}), ShapeError, r"outside a's 30 rows"),
    "index_negative": (lambda x, i: (x, {"a_index": i - 31}), ShapeError, "outside"),
    "x_empty": (lambda x, i: (x[:0], {"a_index": i}), ShapeError, "none to gather"),
    "x_column_major": (lambda x, i: (x.t().contiguous().t(), {"a_index": i}), AlignmentError, r"a.contiguous\(\)"),
    "k_not_chunks": (
        lambda x, i: (torch.randn(30, 44, dtype=torch.bfloat16)[:, :36], {"a_index": i}),
        AlignmentError,
        "multiple of 8",
    ),  # fmt: skip
    "cluster_n_2": (lambda x, i: (x, {"a_index": i, "config": {"cluster_n": 2}}), ConfigError, "cluster_n=1"),
    "index_elsewhere": (lambda x, i: (x, {"a_index": i.to("meta")}), DeviceError, "move it there"),
    "too_few_rows": (lambda x, i: (x, {"a_index": i[:10]}), ShapeError, "total_M"),
}


@pytest.mark.parametrize("case", list(GATHER_BAD))
def test_gather_bad_arguments_get_typed_errors(case):
    make, error, words = GATHER_BAD[case]
    x = torch.randn(30, 40, dtype=torch.bfloat16)
    index = torch.randint(0, 30, (16,), dtype=torch.int32)
    a, kwargs = make(x, index)
    k = a.shape[1]
    b = torch.randn(2, 24, k, dtype=torch.bfloat16).transpose(-2, -1)
    with pytest.raises(error, match=words):
        epicute.grouped_gemm(a, b, offsets_of([6, 10]), **kwargs, backend="reference")


def test_gathered_fp8_reads_each_tokens_scales():
    """fp8 gathered rows: a_scale is per token of x (T, KB), and a grouped row takes its token's scales."""
    x, b, offsets, sa, sb = fp8_operands([40, 0, 77, 5], k=272, n=200)  # 122 tokens
    index = torch.randint(0, x.shape[0], (300,))
    offsets = offsets_of([90, 0, 177, 33])
    d = epicute.grouped_gemm(x, b, offsets, a_index=index, a_scale=sa, b_scale=sb, out_dtype=torch.float32,
                             backend="reference")  # fmt: skip
    want = reference_fp8(x[index], b, offsets, sa[index], sb)
    assert d.shape == (300, 200) and (d.double() - want).norm() / want.norm() < 1e-6
    with pytest.raises(ShapeError, match="a_scale"):  # scales per grouped row, not per token
        epicute.grouped_gemm(x, b, offsets, a_index=index, a_scale=torch.rand(300, 3), b_scale=sb, backend="reference")


def test_explain_gathered_says_how_a_arrives(capsys):
    x = torch.empty(4096, 7168, dtype=torch.bfloat16, device="meta")
    w = torch.empty(64, 2048, 7168, dtype=torch.bfloat16, device="meta")
    plan = epicute.explain_grouped(x, w.transpose(-2, -1), torch.empty(64, dtype=torch.int32, device="meta"),
                                   a_index=torch.empty(32768, dtype=torch.int32, device="meta"))  # fmt: skip
    text = capsys.readouterr().out
    assert "gathered through a_index" in text and "cp.async" in text and "multicast: A" not in text
    assert plan.problem.total_m == 32768 and plan.config.cluster_n == 1  # groups of 512 rows: no pairing along N


@pytest.mark.compile
def test_gathered_fp8_variant_compiles_for_sm90a():
    meta = lambda *s, dtype=torch.float8_e4m3fn: torch.empty(*s, dtype=dtype, device="meta")
    request = describe_grouped_call(meta(1000, 512), meta(8, 640, 512).transpose(-2, -1), meta(8, dtype=torch.int32),
                                    None, None, None, None, None, {}, False,
                                    scales=(meta(1000, 4, dtype=torch.float32), meta(8, 5, 4, dtype=torch.float32)),
                                    a_index=meta(3000, dtype=torch.int32))[2]  # fmt: skip
    variant = prepare(request).variant()
    assert variant.gathered and variant.block_scaled
    compile_grouped(variant)


@pytest.mark.compile
@pytest.mark.parametrize("config", [{"cluster_m": 2}, {"schedule": "pingpong", "tile_n": 128}])
def test_gathered_variants_compile_for_sm90a(config):
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
    request = describe_grouped_call(meta(1000, 200), meta(5, 136, 200).transpose(-2, -1), meta(5, dtype=torch.int32),
                                    lambda acc, score: acc * score, None, None, None, config,
                                    {"score": meta(3000, 1, dtype=torch.float32)}, False,
                                    a_index=meta(3000, dtype=torch.int32))[2]  # fmt: skip
    variant = prepare(request).variant()
    assert variant.gathered and variant.config.cluster_n == 1
    compile_grouped(variant)


# ---- reductions in grouped epilogues


def row_col_all(acc, bias):
    y = acc + bias
    return {"D": y, "rows": ops.row_sum(y), "cols": ops.col_sum(y), "colmax": ops.col_max(y), "peak": ops.amax(y)}


def test_grouped_reference_reductions_are_per_row_and_per_group():
    sizes = [3, 0, 40, 9]
    a, b, offsets = operands(sizes)
    bias = torch.randn(4, 24, dtype=torch.bfloat16)
    got = epicute.grouped_gemm(a, b, offsets, epilogue=row_col_all, bias=bias, backend="reference",
                               out_dtype=torch.float32)  # fmt: skip
    group = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    y = per_group(a, b, offsets) + bias.double()[group]
    assert rel_err(got["rows"], y.sum(1)) < 1e-6
    ends = offsets.tolist()
    for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
        if e == s:  # an empty group: each reduction's identity
            assert (got["cols"][g] == 0).all() and (got["colmax"][g] == -math.inf).all() and got["peak"][g] == 0
            continue
        assert rel_err(got["cols"][g], y[s:e].sum(0)) < 1e-6
        assert rel_err(got["colmax"][g], y[s:e].amax(0)) < 1e-6
        assert rel_err(got["peak"][g], y[s:e].abs().amax()) < 1e-6
    assert got["cols"].shape == (4, 24) and got["peak"].shape == (4,)


def test_grouped_reductions_compile_for_sm90a():
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
    request = describe_grouped_call(meta(3000, 200), meta(5, 136, 200).transpose(-2, -1), meta(5, dtype=torch.int32),
                                    row_col_all, None, None, None, None, {"bias": meta(5, 136)}, False)[2]  # fmt: skip
    variant = prepare(request).variant()
    assert len(variant.fusion.reductions) == 4
    compile_grouped(variant)


# --- issue 56: gradients, malformed arguments, names ------------------------------------------------------------


def test_kernel_calls_needing_gradients_are_differentiable(monkeypatch):
    """requires_grad under autograd routes the call through the op that carries the backward (before the device
    check: CPU tensors reach it); the same call under torch.no_grad() fails on the device instead."""
    from epicute.grouped import api

    a, b, offsets = operands([2, 3, 5], k=32, n=24)
    monkeypatch.setattr(api, "grouped_gemm_op_call", lambda *args, **kwargs: "differentiable")
    calls = [
        lambda: epicute.grouped_gemm(a.clone().requires_grad_(), b, offsets),
        lambda: epicute.grouped_gemm(a, torch.nn.Parameter(b), offsets),
        lambda: epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc, score: acc * score,
                                     score=torch.rand(10, 1, requires_grad=True)),
    ]  # fmt: skip
    for call in calls:
        assert call() == "differentiable"
        with torch.no_grad(), pytest.raises(DeviceError, match="cuda"):
            call()
    d = epicute.grouped_gemm(a.clone().requires_grad_(), b, offsets, backend="reference")  # the reference trains
    assert d.requires_grad


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("tile_n=128", r"config='tile_n=128' \(str\): pass a dict of GemmConfig fields"),
        ({"tile_n": "64"}, r"config\['tile_n'\]='64' \(str\): GemmConfig.tile_n takes a positive int"),
        ({"tile_m": 0}, r"config\['tile_m'\]=0"),
        ({"bogus": 1}, r"unknown field 'bogus'"),
    ],
)
def test_malformed_configs_are_config_errors(config, match):
    a, b, offsets = operands([2, 3, 5], k=32, n=24)
    with pytest.raises(ConfigError, match=match):
        epicute.grouped_gemm(a, b, offsets, config=config, backend="reference")
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
    with pytest.raises(ConfigError, match=match):
        epicute.explain_grouped(meta(10, 64), meta(2, 64, 64), meta(2, dtype=torch.int32), config=config, file=None)


def test_offsets_with_one_entry_too_many_get_the_hint_that_fits():
    a, b, _ = operands([2, 3, 5], k=32, n=24)
    shifted = torch.tensor([1, 2, 5, 10], dtype=torch.int32)  # (G + 1,), not quack's form: no "starting at 0"
    with pytest.raises(ShapeError, match=r"offsets has shape \(4,\); it must be \(3,\).*one entry too many: b has 3 "
                                         r"groups") as info:  # fmt: skip
        epicute.grouped_gemm(a, b, shifted, backend="reference")
    assert "starting at 0" not in str(info.value) and "offsets[1:]" not in str(info.value)
    quack = torch.tensor([0, 2, 5, 10], dtype=torch.int32)
    with pytest.raises(ShapeError, match=r"it starts at 0: that is quack's cu_seqlens form, pass offsets\[1:\]"):
        epicute.grouped_gemm(a, b, quack, backend="reference")
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
    with pytest.raises(ShapeError, match=r"a \(G \+ 1,\) tensor starting at 0 is quack's cu_seqlens form"):
        epicute.explain_grouped(meta(10, 64), meta(3, 64, 64), meta(4, dtype=torch.int32), file=None)  # not read


@pytest.mark.parametrize("name", ["a", "b", "offsets"])
def test_operands_may_be_named_like_the_inputs(name):
    a, b, offsets = operands([2, 3, 5], k=32, n=24)
    bias = torch.randn(24)
    got = epicute.grouped_gemm(a, b, offsets, epilogue=eval(f"lambda acc, {name}: acc + {name}"), backend="reference",
                               **{name: bias})  # fmt: skip
    want = epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc, bias: acc + bias, bias=bias, backend="reference")
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["out", "config", "a_index", "a_scale", "check_offsets", "gated", "file"])
def test_operand_named_like_a_grouped_parameter_is_refused(name):
    a, b, offsets = operands([2, 3, 5], k=32, n=24)
    match = rf"takes an operand named '{name}', which is epicute.grouped_gemm's own parameter {name}=.*Rename"
    with pytest.raises(EpilogueError, match=match):
        epicute.grouped_gemm(a, b, offsets, epilogue=eval(f"lambda acc, {name}: acc * {name}"), backend="reference")
    if name == "out":  # passed, it binds to out=: the clash is named, not out's shape
        with pytest.raises(EpilogueError, match=match):
            epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc, out: acc + out, out=torch.randn(24),
                                 backend="reference")  # fmt: skip


def test_reference_refuses_meta_operands_and_malformed_output_arguments():
    a, b, offsets = operands([2, 3, 5], k=32, n=24)
    meta_score = torch.empty(10, 1, device="meta")
    with pytest.raises(DeviceError, match=r"^operand 'score' is a meta tensor: backend='reference'"):
        epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc, score: acc * score, score=meta_score,
                             backend="reference")  # fmt: skip
    with pytest.raises(OutputError, match=r"out_dtypes is a list; pass a dict by output name"):
        epicute.grouped_gemm(a, b, offsets, epilogue=lambda acc: acc, out_dtypes=[torch.float32], backend="reference")
    with pytest.raises(ConfigError, match=r"check_offsets='yes': pass True or False"):
        epicute.grouped_gemm(a, b, offsets, check_offsets="yes", backend="reference")


def test_a_index_with_variable_k_is_refused():
    # Before: a_index was dropped without a word with a 2-D b (variable K): the result ignored the gather.
    x, dy = torch.randn(10, 16).bfloat16(), torch.randn(10, 24).bfloat16()
    offsets, index = torch.tensor([4, 10], dtype=torch.int32), torch.arange(10)
    with pytest.raises(ShapeError, match=r"^a_index with a 2-D b \(10, 24\) \(variable K\)"):
        epicute.grouped_gemm(x.t(), dy, offsets, a_index=index, backend="reference")
    with pytest.raises(ShapeError, match=r"^a_index with a 2-D b"):
        epicute.explain_grouped(x.t(), dy, offsets, a_index=index, file=None)


def test_out_with_elements_sharing_memory_is_refused():
    # Before: torch's RuntimeError from the reference's copy_ (the kernel's stores would collide).
    a, b, offsets = operands([2, 3, 5], k=32, n=24)
    out = torch.empty(1, 24, dtype=torch.bfloat16).expand(10, 24)
    with pytest.raises(OutputError, match=r"^out has shape \(10, 24\) and strides \(0, 1\): some of its elements"):
        epicute.grouped_gemm(a, b, offsets, out=out, backend="reference")
