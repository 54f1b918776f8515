"""epicute.quantize's group kernel on the GPU against float64 math: odd row counts, K not a multiple of 128, leading
dimensions, both fp8 types and scale formats, NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.quantize import api, launch
from epicute.quantize.api import quantize_pair
from tests.conftest import nan_tensor
from tests.quantize.checks import check_group_quantization, check_pair

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    def poisoned_output(shape, dtype, device):
        return nan_tensor(shape, torch.float32, device).to(dtype)  # fp8 NaN too

    monkeypatch.setattr(launch, "new_output", poisoned_output)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize(("shape", "dtype"), [((1001, 4112), torch.bfloat16), ((3, 37, 400), torch.float16),
                                              ((1, 16), torch.bfloat16), ((2049, 7168), torch.bfloat16)])  # fmt: skip
def test_groups_against_float64(shape, dtype, fp8, ue8m0):
    x = (torch.randn(shape, device="cuda") * torch.rand(shape[-1], device="cuda") * 30).to(dtype)
    q, scales = epicute.quantize(x, dtype=fp8, ue8m0=ue8m0)
    torch.cuda.synchronize()
    check_group_quantization(x, q, scales, fp8, ue8m0)


@pytest.mark.parametrize("k", launch.ROWWISE_KERNEL_K)
@pytest.mark.parametrize(("fp8", "ue8m0"), [(torch.float8_e4m3fn, False), (torch.float8_e5m2, True)])
def test_rowwise_short_rows_in_one_kernel(k, fp8, ue8m0, monkeypatch):
    """Rows of up to 1024 values quantized whole by the group kernel (a decode step's query heads), a part-filled
    CTA; the torch path is switched off, so the kernel is what answers."""
    monkeypatch.setattr(api, "_quantize", _refused)
    x = (torch.randn(3, 13, k, device="cuda") * torch.rand(k, device="cuda") * 30).to(torch.bfloat16)
    q, scales = epicute.quantize(x, recipe="rowwise", dtype=fp8, ue8m0=ue8m0)
    torch.cuda.synchronize()
    assert scales.shape == (3, 13, 1)
    check_group_quantization(x, q, scales, fp8, ue8m0, group=k)


def _refused(*args, **kwargs):
    raise AssertionError("the torch path ran")


def test_nan_stays_in_its_group():
    x = torch.randn(3, 384, device="cuda", dtype=torch.bfloat16)
    x[1, 200] = float("nan")
    _, scales = epicute.quantize(x)
    assert torch.isnan(scales[1, 1]) and torch.isfinite(scales[1, 0]) and torch.isfinite(scales[1, 2])
    assert torch.isfinite(scales[0]).all() and torch.isfinite(scales[2]).all()


def test_a_misaligned_view_is_refused():
    x = torch.randn(4 * 256 + 8, device="cuda", dtype=torch.bfloat16)[8 - 1 : -1].view(4, 256)
    with pytest.raises(epicute.AlignmentError, match="16-byte aligned"):
        epicute.quantize(x)


@pytest.mark.parametrize(("groups_per_lane", "values_per_lane"), [(1, 8), (4, 8), (2, 16), (3, 16)])
def test_every_split_of_the_work_among_lanes(groups_per_lane, values_per_lane):
    """The splits the tuning sweep compares (bench/NOTES.md) hold to the same checks as the default, on a row count
    that leaves a CTA part-filled and a K whose last group is short."""
    x = (torch.randn(1003, 4112, device="cuda") * 7).to(torch.bfloat16)
    variant = launch.QuantizeVariant("bf16", "fp8e4m3", True, groups_per_lane, values_per_lane)
    q, scales = launch.launch_group_quantize(x, variant, torch.float8_e4m3fn)
    torch.cuda.synchronize()
    check_group_quantization(x, q, scales, torch.float8_e4m3fn, True)


@pytest.mark.parametrize(("rows", "columns"), [("groups", "blocks"), ("blocks", "blocks"), ("groups", "groups"),
                                               (None, "groups"), ("blocks", None)])  # fmt: skip
@pytest.mark.parametrize(("shape", "dtype", "fp8", "ue8m0"), [
    ((1001, 4112), torch.bfloat16, torch.float8_e4m3fn, False),  # a part-filled tile each way, a short group
    ((129, 400), torch.float16, torch.float8_e5m2, True),
    ((7, 16), torch.bfloat16, torch.float8_e4m3fn, True),
])  # fmt: skip
def test_rows_and_columns_against_float64(shape, dtype, fp8, ue8m0, rows, columns):
    """The tile kernel: x along its rows and x.t() along its rows padded with zeros to 16, against float64."""
    x = (torch.randn(shape, device="cuda") * torch.rand(shape[-1], device="cuda") * 30).to(dtype)
    made = quantize_pair(x, rows, columns, dtype=fp8, ue8m0=ue8m0)
    torch.cuda.synchronize()
    check_pair(x, rows, columns, made, fp8, ue8m0)


def test_blocks_and_transpose_through_quantize():
    x = torch.randn(2000, 1040, device="cuda", dtype=torch.bfloat16)
    q, scales = epicute.quantize(x, recipe="blocks")
    q_t, scales_t = epicute.quantize(x, recipe="groups", transpose=True)
    torch.cuda.synchronize()
    check_pair(x, "blocks", "groups", ((q, scales), (q_t, scales_t)), torch.float8_e4m3fn, False)


def test_nan_stays_in_its_column_group():
    x = torch.randn(256, 32, device="cuda", dtype=torch.bfloat16)
    x[200, 5] = float("nan")
    _, (_, scales_t) = quantize_pair(x, None, "groups")
    assert torch.isnan(scales_t[5, 1]) and torch.isfinite(scales_t[5, 0]) and torch.isfinite(scales_t[:5]).all()


def test_torch_compile_runs_the_kernels_through_the_op():
    """Compiled (fullgraph, dynamic sizes): the group and tile kernels run inside ``epicute::quantize``, their
    outputs in the fake's layouts, values against float64."""
    from tests.quantize.checks import check_block_quantization

    x = (torch.randn(3, 37, 400, device="cuda") * 30).to(torch.bfloat16)
    w = (torch.randn(300, 272, device="cuda") * 30).to(torch.bfloat16)

    def step(x, w):
        return epicute.quantize(x), quantize_pair(w, "groups", "blocks"), epicute.quantize(w, recipe="blocks")

    (q, scales), made, (qw, sw) = torch.compile(step, fullgraph=True, dynamic=True)(x, w)
    torch.cuda.synchronize()
    check_group_quantization(x, q, scales, torch.float8_e4m3fn, False)
    check_pair(w, "groups", "blocks", made, torch.float8_e4m3fn, False)
    check_block_quantization(w, qw, sw, torch.float8_e4m3fn, False)
