"""GPU correctness of the SM90 GEMM: odd shapes, all transpositions, batches, dtypes.

Every output is NaN-poisoned before the launch, so an unwritten element fails;
the reference is a float32 matmul (TF32 off) of the same rounded inputs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import epicute
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-3}


@pytest.fixture(autouse=True)
def _exact_reference():
    torch.backends.cuda.matmul.allow_tf32 = False


def operand(rows: int, cols: int, dtype, transposed: bool, batch: int | None = None) -> torch.Tensor:
    """A random (batch, rows, cols) operand, stored column-major when ``transposed``."""
    shape = (rows, cols) if batch is None else (batch, rows, cols)
    if not transposed:
        return torch.randn(shape, device="cuda", dtype=dtype)
    return torch.randn(shape[:-2] + (cols, rows), device="cuda", dtype=dtype).transpose(-1, -2)


def run_and_check(a, b, out_dtype, config=None):
    shape = a.shape[:-1] + b.shape[-1:]
    out = torch.full(shape, float("nan"), device="cuda", dtype=out_dtype)
    got = epicute.gemm(a, b, out=out, config=config)
    assert got.data_ptr() == out.data_ptr()
    ref = torch.matmul(a.float(), b.float())
    err = rel_err(out, ref)
    assert err <= TOL[out_dtype], f"rel err {err:.2e} for a{tuple(a.shape)} b{tuple(b.shape)} -> {out_dtype}"


MS = (1, 17, 129, 1000)
NKS = (8, 136, 1000, 4104)
# A column-major makes M its contiguous dimension, which TMA needs 16-byte aligned.
CASES = [(m, a_t, b_t) for a_t, b_t in itertools.product((False, True), repeat=2) for m in (NKS if a_t else MS)]


@pytest.mark.parametrize("m,a_t,b_t", CASES, ids=lambda v: str(v) if not isinstance(v, bool) else "TN"[not v])
def test_odd_shapes_every_transposition(m, a_t, b_t):
    for n, k in itertools.product(NKS, NKS):
        a = operand(m, k, torch.bfloat16, a_t)
        b = operand(k, n, torch.bfloat16, b_t)
        run_and_check(a, b, torch.bfloat16)


@pytest.mark.parametrize("in_dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("out_dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_dtypes(in_dtype, out_dtype):
    for m, n, k in ((129, 136, 1000), (1000, 4104, 136), (17, 8, 8)):
        run_and_check(operand(m, k, in_dtype, False), operand(k, n, in_dtype, True), out_dtype)


@pytest.mark.parametrize("batch", (1, 3))
@pytest.mark.parametrize("a_t,b_t", list(itertools.product((False, True), repeat=2)), ids=lambda t: "T" if t else "N")
def test_batched(batch, a_t, b_t):
    for m, n, k in ((136 if a_t else 129, 136, 72), (1000, 1000, 4104)):
        a = operand(m, k, torch.bfloat16, a_t, batch)
        b = operand(k, n, torch.bfloat16, b_t, batch)
        run_and_check(a, b, torch.bfloat16)


# Every kernel path on ragged problems: clusters, persistence, reuse, tile widths, stages.
CONFIGS = [
    {"tile_n": 256, "cluster_m": 2, "persistent": True},
    {"tile_n": 128, "cluster_n": 2, "persistent": True},
    {"tile_n": 64, "persistent": True, "ab_stages": 2, "num_epi_stages": 1},
    {"tile_n": 256, "persistent": False},
    {"tile_n": 128, "cluster_m": 2, "persistent": False},
    {"tile_n": 256, "epi_tile": (128, 64), "persistent": True, "raster_along_m": False, "swizzle": 3},
    {"tile_n": 128, "epi_tile": (128, 128), "persistent": True},
    {"tile_n": 192, "persistent": True},
    {"tile_n": 224, "cluster_m": 2, "persistent": True},
    {"tile_n": 224, "cluster_m": 2, "persistent": False},  # planned at 129-256 rows of 14336 columns: one wave
    # ping-pong: alternate tiles per warpgroup; odd tile counts leave one warpgroup a tile short
    {"schedule": "pingpong", "tile_n": 128},
    {"schedule": "pingpong", "tile_n": 192, "cluster_m": 2},
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 256, "cluster_n": 2, "epi_tile": (64, 64)},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("out_dtype", (torch.bfloat16, torch.float32))
def test_kernel_paths(config, out_dtype):
    for m, n, k, l in ((1000, 4104, 1000, 1), (129, 1000, 136, 3), (17, 8, 8, 1), (4000, 2056, 520, 2)):
        a = operand(m, k, torch.bfloat16, False, l)
        b = operand(k, n, torch.bfloat16, False, l)
        run_and_check(a, b, out_dtype, config)


def test_without_out_and_2d_result():
    a, b = operand(300, 200, torch.bfloat16, False), operand(200, 64, torch.bfloat16, False)
    d = epicute.gemm(a, b)
    assert d.shape == (300, 64) and d.dtype == torch.bfloat16 and d.is_contiguous()
    assert rel_err(d, a.float() @ b.float()) <= 1e-2


def test_zero_sizes():
    a, b = operand(0, 64, torch.bfloat16, False), operand(64, 32, torch.bfloat16, False)
    assert epicute.gemm(a, b).shape == (0, 32)
    a = torch.empty(16, 0, device="cuda", dtype=torch.bfloat16)
    b = torch.empty(0, 32, device="cuda", dtype=torch.bfloat16)
    d = epicute.gemm(a, b)
    assert d.shape == (16, 32) and (d == 0).all()


def test_large_square_matches_cublas_accuracy():
    a, b = operand(4096, 4096, torch.bfloat16, False), operand(4096, 4096, torch.bfloat16, False)
    run_and_check(a, b, torch.bfloat16)


@pytest.mark.parametrize("budget", [1, 3, 7])
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_persistent_clusters_cover_every_tile_once_for_any_runtime_budget(budget, cluster_m):
    # The persistent CTA count is a launch argument (not compiled in): a budget far below the SM
    # count makes every cluster walk many tiles; a poisoned output shows any tile left unwritten.
    from epicute.gemm import GemmProblem
    from epicute.gemm.launch import kernel_for
    from epicute.gemm.prepare import GemmRequest, prepare

    m, n, k = 1000, 1032, 200  # 8 x 5 tiles of 128 x 256 (ragged in both)
    a, b = operand(m, k, torch.bfloat16, False), operand(k, n, torch.bfloat16, False)
    pins = (("cluster_m", cluster_m), ("persistent", True), ("tile_n", 256))
    plan = prepare(GemmRequest(GemmProblem(m, n, k), overrides=pins)).plan
    assert plan.config.persistent and plan.num_tiles > budget * plan.config.cluster_size
    kernel = kernel_for(plan)  # one batch: the kernel's 2-D form
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernel(a, b, out, (), (), (), (), budget)
    torch.cuda.synchronize()
    assert rel_err(out, torch.matmul(a.float(), b.float())) <= TOL[torch.bfloat16]
