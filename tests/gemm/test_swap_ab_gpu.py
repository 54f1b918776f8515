"""Swap-AB on the GPU: decode GEMMs computed as D^T = B^T A^T and stored transposed into row-major D.

Odd M (1, 3, 17, 50, 64: the last two in 64-row ping-pong tiles), N and K that are no multiples of the tiles,
split and unsplit, one tile per CTA and persistent, bias + relu and a per-row scale (the epilogue's vectors trade
places), fp32 D, a prepared call and the split sum's determinism; D NaN-poisoned, against a float32 reference.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from tests.conftest import decode_operands, rel_err

pytestmark = pytest.mark.gpu

TOL = 1e-2


@pytest.fixture(autouse=True)
def _exact_reference():
    torch.backends.cuda.matmul.allow_tf32 = False


def poisoned(m, n, dtype=torch.bfloat16):
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


@pytest.mark.parametrize("m", [1, 3, 17, 50, 64])
@pytest.mark.parametrize("n,k", [(1000, 4104), (4104, 1000), (264, 72)])
def test_planned_swap_matches_the_reference(m, n, k):
    x, w = decode_operands(m, n, k)
    assert epicute.explain(x, w.t(), file=None).config.swap_ab
    out = poisoned(m, n)
    epicute.gemm(x, w.t(), out=out)
    assert rel_err(out, x.float() @ w.float().t()) <= TOL, (m, n, k)


@pytest.mark.parametrize("m", [1, 17, 64])
def test_bias_relu_and_a_row_scale_trade_places(m):
    n, k = 1000, 2056
    x, w = decode_operands(m, n, k)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(m, 1, device="cuda", dtype=torch.float32) + 0.5

    def epi(acc, bias, scale):
        return ops.relu(acc + bias) * scale

    assert epicute.explain(x, w.t(), epilogue=epi, bias=bias, scale=scale, file=None).config.swap_ab
    out = poisoned(m, n)
    epicute.gemm(x, w.t(), epilogue=epi, bias=bias, scale=scale, out=out)
    ref = torch.relu(x.float() @ w.float().t() + bias.float()) * scale
    assert rel_err(out, ref) <= TOL
    plain = epicute.gemm(x, w.t(), epilogue=lambda acc, bias: ops.relu(acc + bias), bias=bias)
    assert rel_err(plain, torch.relu(x.float() @ w.float().t() + bias.float())) <= TOL


@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "bias_relu_scale"])
def test_wider_rows_swap_in_two_splits(epilogue):
    # 100 rows: the planner swaps where 128x64 tiles of A would leave half the SMs idle and K is long.
    m, n, k = 100, 1000, 8200
    x, w = decode_operands(m, n, k)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(m, 1, device="cuda", dtype=torch.float32) + 0.5
    args = {"epilogue": lambda acc, bias, scale: ops.relu(acc + bias) * scale, "bias": bias, "scale": scale}
    args = args if epilogue else {}
    c = epicute.explain(x, w.t(), file=None, **args).config
    assert c.swap_ab and c.split_k == 2 and c.tile_n == 112
    out = poisoned(m, n)
    epicute.gemm(x, w.t(), out=out, **args)
    ref = x.float() @ w.float().t()
    ref = torch.relu(ref + bias.float()) * scale if epilogue else ref
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("split_k", [1, 2, 3, 8])
def test_every_split_and_fp32_d(split_k):
    x, w = decode_operands(5, 520, 8200)
    out = poisoned(5, 520, torch.float32)
    epicute.gemm(x, w.t(), out=out, config={"swap_ab": True, "split_k": split_k})
    assert rel_err(out, x.float() @ w.float().t()) <= 1e-3


def test_persistent_swap_over_more_tiles_than_sms():
    x, w = decode_operands(33, 20000, 1032)  # 157 tiles of 128 weight rows, 48 columns each
    plan = epicute.explain(x, w.t(), file=None)
    assert plan.config.swap_ab and plan.config.persistent and plan.config.tile_n == 48
    out = poisoned(33, 20000)
    epicute.gemm(x, w.t(), out=out)
    assert rel_err(out, x.float() @ w.float().t()) <= TOL
    out.fill_(float("nan"))
    epicute.gemm(x, w.t(), out=out, config={"split_k": 2})  # persistent and split
    assert rel_err(out, x.float() @ w.float().t()) <= TOL


def test_pinned_swap_of_other_majors():
    """The kernel swaps any 16-bit majors (its A M-major, its B N-major here); the planner only picks k/k."""
    a = torch.randn(2056, 24, device="cuda", dtype=torch.bfloat16).t()  # (24, 2056), column-major
    b = torch.randn(2056, 1000, device="cuda", dtype=torch.bfloat16)  # row-major (K, N)
    out = poisoned(24, 1000)
    epicute.gemm(a, b, out=out, config={"swap_ab": True})
    assert rel_err(out, a.float() @ b.float()) <= TOL


def test_a_prepared_swapped_call_and_a_deterministic_split_sum():
    x, w = decode_operands(7, 2048, 16384)
    call = epicute.prepare_gemm(x, w.t(), out_dtype=torch.float32)
    first = call(x, w.t())
    assert rel_err(first, x.float() @ w.float().t()) <= 1e-3
    for _ in range(10):
        assert torch.equal(call(x, w.t()), first)
    x2 = torch.randn_like(x)
    assert rel_err(call(x2, w.t()), x2.float() @ w.float().t()) <= 1e-3


WIDE_TILES = {
    # the swapped 256-row tile the tuner offers at M = 1000 (cuBLAS's shape there): a 144-row ragged last band of
    # B^T (3000 = 11 x 256 + 184), M = 997 in 7 tiles of 144 (the last one 133), a weight of rows (K-major)
    "swapped-256x144": ({"swap_ab": True, "schedule": "cooperative", "tile_m": 256, "tile_n": 144}, (997, 3000, 520)),
    # a 256-row swapped tile split in two, fp32 partials of 256 x 128
    "swapped-256x128-split": (
        {"swap_ab": True, "schedule": "cooperative", "tile_m": 256, "tile_n": 128, "split_k": 2}, (301, 1000, 1096)
    ),
    # the unswapped 256-row cooperative tile (two 64-row blocks a warpgroup), ragged M and N, a 2x1 cluster
    "256x128": ({"schedule": "cooperative", "tile_m": 256, "tile_n": 128, "cluster_m": 2}, (1001, 1000, 264)),
}


@pytest.mark.parametrize("m,n,k", [(301, 14336, 264), (131, 28672, 520)])
def test_planned_256_row_swap_at_mid_size_m(m, n, k):
    # The planner's swapped 256-row tile where it saves a wave (301 rows: two tiles of 160, one ragged; 131: one of
    # 144); N's last weight tile is whole, M's ragged.
    x, w = decode_operands(m, n, k)
    plan = epicute.explain(x, w.t(), file=None).config
    assert plan.swap_ab and plan.tile_m == 256
    out = poisoned(m, n)
    epicute.gemm(x, w.t(), out=out)
    assert rel_err(out, x.float() @ w.float().t()) <= TOL, (m, n, k)


@pytest.mark.parametrize(
    "m,n,k,tile",
    [(777, 4104, 1000, (128, 208)), (777, 8200, 1032, (128, 208)), (531, 3000, 1032, (128, 192)),
     (601, 14344, 2056, (256, 160)), (841, 11016, 1032, (256, 144)), (777, 5128, 1032, (256, 144))],
)
@pytest.mark.parametrize("weight_rows", [True, False], ids=["w-rows", "kn"])
def test_planned_mid_m_swap(m, n, k, tile, weight_rows):
    # The planner's swapped tiles from 512 rows: 128-row ones whose width fits M (777 rows in 4 tiles of 208, the
    # last ragged; 531 in 3 of 192), one tile per CTA (33 x 4 tiles) and persistent (65 x 4); 256-row ones whose
    # count fills the last wave, persistent (57 x 4, 44 x 6 tiles) and one tile per CTA (21 x 6). N's last weight
    # tile ragged.
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if weight_rows
         else torch.randn(k, n, device="cuda", dtype=torch.bfloat16))  # fmt: skip
    plan = epicute.explain(x, b, file=None).config
    assert (plan.swap_ab, plan.tile_m, plan.tile_n) == (True, *tile)
    out = poisoned(m, n)
    epicute.gemm(x, b, out=out)
    assert rel_err(out, x.float() @ b.float()) <= TOL, (m, n, k)


@pytest.mark.parametrize("name", list(WIDE_TILES))
@pytest.mark.parametrize("weight_rows", [True, False], ids=["w-rows", "kn"])
def test_256_row_tiles_swapped_and_not(name, weight_rows):
    pins, (m, n, k) = WIDE_TILES[name]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if weight_rows
         else torch.randn(k, n, device="cuda", dtype=torch.bfloat16))  # fmt: skip
    plan = epicute.explain(x, b, config=pins, file=None).config
    assert (plan.tile_m, plan.tile_n, plan.swap_ab) == (256, pins["tile_n"], pins.get("swap_ab", False))
    out = poisoned(m, n)
    epicute.gemm(x, b, out=out, config=pins)
    assert rel_err(out, x.float() @ b.float()) <= TOL
