"""Argument checking before launch: one test per bad input, plus the accepted layouts.

``check_gemm_args(..., require_cuda=False)`` reaches every check past the device
ones with CPU tensors; ``epicute.gemm`` itself must stop at the device check.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import AlignmentError, DeviceError, DtypeError, OutputError, ShapeError
from epicute.gemm import GemmProblem
from epicute.gemm.validate import check_gemm_args

BF16 = torch.bfloat16


def rand(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def check(a, b, out=None, out_dtype=None):
    return check_gemm_args(a, b, out, out_dtype, require_cuda=False)


# --- epicute.gemm -----------------------------------------------------------


def test_gemm_rejects_cpu_tensors():
    with pytest.raises(DeviceError, match=r"a is on cpu; .* pass a\.cuda\(\)"):
        epicute.gemm(rand(16, 16), rand(16, 16))


def test_gemm_rejects_non_tensor():
    with pytest.raises(DtypeError, match=r"a must be a torch\.Tensor, got list"):
        epicute.gemm([[1.0]], rand(16, 16))


# --- dtypes -----------------------------------------------------------------


def test_non_tensor_b():
    with pytest.raises(DtypeError, match=r"b must be a torch\.Tensor, got ndarray"):
        check(rand(16, 16), rand(16, 16).float().numpy())


def test_float32_a():
    with pytest.raises(DtypeError, match=r"a has dtype torch\.float32; supported are"):
        check(rand(16, 16, dtype=torch.float32), rand(16, 16, dtype=torch.float32))


def test_a_b_dtype_mismatch():
    with pytest.raises(DtypeError, match=r"b has dtype torch\.float16 but a has torch\.bfloat16"):
        check(rand(16, 16), rand(16, 16, dtype=torch.float16))


def test_int8_out_dtype():
    with pytest.raises(DtypeError, match=r"out_dtype=torch\.int8; supported are"):
        check(rand(16, 16), rand(16, 16), out_dtype=torch.int8)


# --- shapes -----------------------------------------------------------------


def test_rank_1():
    with pytest.raises(ShapeError, match=r"a has 1 dimensions \(16,\); expected 2 \(M, K\) or 3"):
        check(rand(16), rand(16))


def test_rank_4():
    with pytest.raises(ShapeError, match=r"a has 4 dimensions"):
        check(rand(2, 2, 16, 16), rand(2, 2, 16, 16))


def test_rank_mismatch():
    with pytest.raises(ShapeError, match=r"a is 2-D \(16, 16\) but b is 3-D \(2, 16, 16\)"):
        check(rand(16, 16), rand(2, 16, 16))


def test_k_mismatch_names_both():
    with pytest.raises(ShapeError, match=r"a's K=32 != b's K=24"):
        check(rand(16, 32), rand(24, 16))


def test_batch_mismatch():
    with pytest.raises(ShapeError, match=r"batch sizes differ: a has L=2, b has L=3"):
        check(rand(2, 16, 16), rand(3, 16, 16))


# --- TMA alignment ----------------------------------------------------------


def test_row_major_a_with_unaligned_k():
    with pytest.raises(AlignmentError, match=r"K=9 is not a multiple of 8: pad it to 16"):
        check(rand(16, 9), rand(9, 16))


def test_column_major_a_with_unaligned_m():
    a = rand(16, 17).t()  # (M=17, K=16), M contiguous
    with pytest.raises(AlignmentError, match=r"a stride 17 .* M=17 is not a multiple of 8: pad it to 24"):
        check(a, rand(16, 16))


def test_neither_dim_contiguous():
    a = rand(16, 32)[:, ::2]
    with pytest.raises(AlignmentError, match=r"neither of its last two dim.* is contiguous.*pass a\.contiguous\(\)"):
        check(a, rand(16, 16))


def test_data_ptr_off_16_bytes():
    a = rand(1, 16 * 64 + 1)[0, 1:].view(16, 64)
    with pytest.raises(AlignmentError, match=r"a\.data_ptr\(\) is 2 bytes past a 16-byte boundary"):
        check(a, rand(64, 16))


def test_unaligned_n_without_out():
    b = rand(12, 16).t()  # (K=16, N=12), K contiguous, so only D's rows are unaligned
    with pytest.raises(AlignmentError, match=r"N=12 is not a multiple of 8: .* pad N to 16"):
        check(rand(16, 16), b)


def test_n_12_fits_fp32_rows():
    call = check(rand(16, 16), rand(12, 16).t(), out_dtype=torch.float32)
    assert call.problem.n == 12 and call.problem.d_dtype == "fp32"


# --- out --------------------------------------------------------------------


def test_out_wrong_shape():
    with pytest.raises(OutputError, match=r"out has shape \(16, 8\); a @ b has shape \(16, 16\)"):
        check(rand(16, 16), rand(16, 16), out=rand(16, 8))


def test_out_dtype_disagrees_with_out_dtype():
    with pytest.raises(OutputError, match=r"out has dtype torch\.bfloat16 but out_dtype=torch\.float32"):
        check(rand(16, 16), rand(16, 16), out=rand(16, 16), out_dtype=torch.float32)


def test_column_major_out():
    with pytest.raises(OutputError, match=r"out has strides \(1, 16\); it must be row-major"):
        check(rand(16, 16), rand(16, 16), out=rand(16, 16).t())


def test_out_aliasing_a():
    a = rand(16, 16)
    with pytest.raises(OutputError, match=r"out shares memory with a"):
        check(a, rand(16, 16), out=a)


def test_out_overlapping_part_of_b():
    b = rand(32, 16)
    with pytest.raises(OutputError, match=r"out shares memory with b"):
        check(rand(16, 32), b, out=b[8:24])


# --- accepted inputs --------------------------------------------------------

M, N, K = 24, 40, 32


@pytest.mark.parametrize(
    ("a_major", "b_major"), [("k", "n"), ("k", "k"), ("m", "n"), ("m", "k")], ids=["ak-bn", "ak-bk", "am-bn", "am-bk"]
)
@pytest.mark.parametrize("batch", [None, 3], ids=["2d", "batched"])
def test_all_transpositions(a_major, b_major, batch):
    lead = () if batch is None else (batch,)
    a = rand(*lead, M, K) if a_major == "k" else rand(*lead, K, M).transpose(-1, -2)
    b = rand(*lead, K, N) if b_major == "n" else rand(*lead, N, K).transpose(-1, -2)
    call = check(a, b)
    assert call.problem == GemmProblem(M, N, K, batch or 1, "bf16", "bf16", a_major, b_major)
    assert call.batched is (batch is not None)
    assert call.a.shape == (batch or 1, M, K) and call.b.shape == (batch or 1, K, N)
    assert call.out is None and call.out_dtype is BF16


def test_out_sets_out_dtype():
    out = rand(M, N, dtype=torch.float32)
    call = check(rand(M, K, dtype=torch.float16), rand(K, N, dtype=torch.float16), out=out)
    assert call.out_dtype is torch.float32 and call.problem.d_dtype == "fp32"
    assert call.out.shape == (1, M, N)


@pytest.mark.parametrize("batch_stride", [0, 3], ids=["stride-0", "stride-3"])
def test_size_one_batch_with_unaligned_stride_is_normalized(batch_stride):
    a = rand(M * K).as_strided((1, M, K), (batch_stride, K, 1))
    call = check(a, rand(1, K, N))
    assert call.problem.l == 1
    stride0 = call.a.stride(0)
    assert stride0 > 0 and stride0 % 8 == 0
    assert call.a.stride()[1:] == (K, 1)
    assert torch.equal(call.a, a)


def test_zero_size_m():
    call = check(rand(0, K), rand(K, N))
    assert (call.problem.m, call.problem.n, call.problem.k, call.problem.l) == (0, N, K, 1)


def test_size_one_m_with_unit_stride_is_normalized():
    # (1, K) view of a column: both strides are 1; the M stride is never used.
    a = rand(K, 1).t()
    call = check(a, rand(K, N))
    assert call.problem.m == 1 and call.problem.a_major == "k"
    assert call.a.stride(1) % 8 == 0 and call.a.stride(2) == 1


@pytest.mark.parametrize("layout", ["rr", "rc", "cr", "cc"])
def test_k1_is_accepted_in_every_layout(layout):
    # K = 1: A's K dimension has size 1, so A counts as column-major (M contiguous) whether it is an
    # (M, 1) tensor or the transpose of a (1, M) row; its only real stride is then M's unit one.
    a = rand(M, 1) if layout[0] == "r" else rand(1, M).t()
    b = rand(1, N) if layout[1] == "r" else rand(N, 1).t()
    call = check(a, b)
    assert call.problem.k == 1 and call.problem.a_major == "m" and call.problem.b_major == "n"
    assert call.a.stride(2) % 8 == 0 and call.a.stride(1) == 1 and call.b.stride(1) % 8 == 0


# --- repeated signatures (the hot path) ----------------------------------------
# A call shaped like one validated before skips the shape rules, but the rules
# that depend on the data pointers still hold on every call.


def test_repeat_with_out_matches_the_full_check():
    a, b, out = rand(2, M, K), rand(2, N, K).transpose(-1, -2), rand(2, M, N)
    first = check(a, b, out=out)
    a2, b2, out2 = rand(2, M, K), rand(2, N, K).transpose(-1, -2), rand(2, M, N)
    again = check(a2, b2, out=out2)
    assert again.problem == first.problem and again.batched
    for got, want in ((again.a, a2), (again.b, b2), (again.out, out2)):
        assert got.data_ptr() == want.data_ptr() and torch.equal(got, want)


def test_repeat_catches_out_aliasing_a():
    a = rand(2 * M, M)  # out=a[:M] below has a's shape (M, K=M) only when K == N
    check(rand(M, M), rand(M, M), out=rand(M, M))
    with pytest.raises(OutputError, match=r"out shares memory with a"):
        check(a[M:], rand(M, M), out=a[: M + 1][1:])


def test_repeat_catches_out_overlapping_b():
    b = rand(3 * K, N)
    check(rand(M, K), rand(K, N), out=rand(M, N).reshape(M, N))
    check(rand(M, K), b[:K], out=b[2 * K : 2 * K + M])  # same signature, disjoint: fine
    with pytest.raises(OutputError, match=r"out shares memory with b"):
        check(rand(M, K), b[K : 2 * K], out=b[2 * K - 1 : 2 * K - 1 + M])


def test_repeat_catches_a_misaligned_pointer():
    storage = rand(M * K + 8)
    check(storage[:-8].view(M, K), rand(K, N))
    with pytest.raises(AlignmentError, match=r"a.data_ptr\(\) is 2 bytes past a 16-byte boundary"):
        check(storage[1:-7].view(M, K), rand(K, N))
