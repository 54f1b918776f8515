"""check_grouped_args: a call like one already validated is bound to its new tensors, never waved through."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.grouped import validate


@pytest.fixture
def on_a_gpu(monkeypatch):
    """CPU tensors treated as the GPU's (the device check is the only one that needs one)."""
    monkeypatch.setattr(validate, "check_on_one_hopper_gpu", lambda *named: None)
    validate._CHECKED.clear()


def _args(tokens: int, k: int, n: int, groups: int, gathered: bool = False):
    a = torch.randn(tokens, k, dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, dtype=torch.bfloat16).transpose(-2, -1)
    rows = tokens * 2 if gathered else tokens
    offsets = torch.sort(torch.randint(0, rows + 1, (groups,), dtype=torch.int32)).values
    offsets[-1] = rows
    index = torch.randint(0, tokens, (rows,), dtype=torch.int32) if gathered else None
    return a, b, offsets, index


@pytest.mark.parametrize("gathered", [False, True])
def test_a_repeated_signature_binds_the_new_tensors(on_a_gpu, gathered):
    first = _args(301, 136, 72, 5, gathered)
    want = validate.check_grouped_args(*first[:3], a_index=first[3], gated=False)
    assert len(validate._CHECKED) == 1
    second = _args(301, 136, 72, 5, gathered)  # new tensors, the same shapes, strides, dtypes and alignment
    got = validate.check_grouped_args(*second[:3], a_index=second[3], gated=False)
    assert got.problem == want.problem and got.out_dtype == want.out_dtype and len(validate._CHECKED) == 1
    for bound, given, first_bound in ((got.a, second[0], want.a), (got.b, second[1], want.b)):
        assert bound.data_ptr() == given.data_ptr()
        assert (bound.shape, bound.stride()) == (first_bound.shape, first_bound.stride())
    assert got.offsets is second[2] and got.a_index is second[3]
    assert torch.equal(got.a[0], second[0]) and torch.equal(got.b, second[1])


def test_what_the_checks_depend_on_is_checked_again(on_a_gpu):
    a, b, offsets, _ = _args(301, 136, 72, 5)
    validate.check_grouped_args(a, b, offsets)
    misaligned = torch.empty(301 * 136 + 8, dtype=torch.bfloat16)[1:][: 301 * 136].view(301, 136)
    with pytest.raises(epicute.AlignmentError, match="16-byte boundary"):
        validate.check_grouped_args(misaligned, b, offsets)
    with pytest.raises(epicute.ShapeError, match="offsets has shape"):
        validate.check_grouped_args(a, b, offsets[:4])
    with pytest.raises(epicute.DtypeError, match="offsets has dtype"):
        validate.check_grouped_args(a, b, offsets.long())
    # Copies made by the checks (offsets and an int64 index narrowed to int32) are never bound from a memo.
    index64 = torch.randint(0, 301, (301,))
    call = validate.check_grouped_args(a, b, offsets, a_index=index64)
    assert call.a_index.dtype == torch.int32 and len(validate._CHECKED) == 1


def _fp8_args(ragged_k: bool):
    """fp8 operands with blockwise scales: groups of rows (b_scale (G, KB, NB) transposed, a view) or variable K."""
    if ragged_k:
        offsets = torch.tensor([128, 128, 384], dtype=torch.int32)
        a, t = torch.randn(200, 384).to(torch.float8_e4m3fn), torch.randn(136, 384).to(torch.float8_e4m3fn)
        return a, t.t(), offsets, torch.rand(200, 3), torch.rand(2, 3)
    offsets = torch.tensor([100, 100, 301], dtype=torch.int32)
    a, w = torch.randn(301, 256).to(torch.float8_e4m3fn), torch.randn(3, 200, 256).to(torch.float8_e4m3fn)
    return a, w.transpose(-2, -1), offsets, torch.rand(2, 301).t(), torch.rand(3, 2, 2).transpose(-2, -1)


@pytest.mark.parametrize("ragged_k", [False, True])
def test_a_repeated_fp8_signature_binds_the_new_scales(on_a_gpu, ragged_k):
    """fp8 calls are remembered too: a second call binds its own tensors and scales (the same layouts as the first's
    views of them), never the first call's."""
    first = _fp8_args(ragged_k)
    want = validate.check_grouped_args(*first[:3], a_scale=first[3], b_scale=first[4])
    assert len(validate._CHECKED) == 1
    second = _fp8_args(ragged_k)
    got = validate.check_grouped_args(*second[:3], a_scale=second[3], b_scale=second[4])
    assert got.problem == want.problem and len(validate._CHECKED) == 1
    for bound, given, first_bound in ((got.block_scales.a, second[3], want.block_scales.a),
                                      (got.block_scales.b, second[4], want.block_scales.b), (got.a, second[0], want.a),
                                      (got.b, second[1], want.b)):  # fmt: skip
        assert bound.data_ptr() == given.data_ptr()
        assert (bound.shape, bound.stride()) == (first_bound.shape, first_bound.stride())
    assert torch.equal(got.block_scales.a[0], second[3])
    b_blocks = second[4].unsqueeze(0) if ragged_k else second[4].transpose(-2, -1)  # (G or 1, NB, KB)
    assert torch.equal(got.block_scales.b, b_blocks)
    # A call whose scales change shape is checked in full again (and refused here: a_scale one block short).
    with pytest.raises(epicute.ShapeError, match="a_scale"):
        validate.check_grouped_args(*second[:3], a_scale=second[3][:, :1].contiguous(), b_scale=second[4])
