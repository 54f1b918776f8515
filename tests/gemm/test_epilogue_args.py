"""A fused epilogue's tensors, checked and arranged before launch (epicute.gemm.epilogue_args).

``kernel_inputs`` orders the operand tensors as ``EpilogueFusion.tensor_args``
says and refuses ones on the wrong device or unfit for TMA; ``aux_outputs``
checks preallocated ``outs`` and allocates the rest. All on the CPU (the "GPU"
is played by the CPU device; "meta" is the wrong one).
"""

from __future__ import annotations

import pytest
import torch

from epicute import AlignmentError, DeviceError, OutputError, ops
from epicute.epilogue.fusion import EpilogueFusion
from epicute.epilogue.tracer import as_epilogue
from epicute.gemm.epilogue_args import aux_outputs, kernel_inputs

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def rand(*shape, dtype=BF16):
    return torch.randn(shape, dtype=dtype)


def prepare(fn, values: dict, m: int, n: int, l: int = 1, out_dtypes=None):
    """The specs and fusion epicute.gemm would build for ``fn`` with these operands."""
    epi = as_epilogue(fn)
    specs = epi.operands(values, m, n, l)
    graph = epi.trace(
        {k: s.kind for k, s in specs.items()}, {k: s.dtype for k, s in specs.items()},
        {"D": BF16, **(out_dtypes or {})}, d_dtype=BF16,
    )  # fmt: skip
    return specs, EpilogueFusion(graph, tuple((s.name, s.kind, s.dtype) for s in specs.values()))


def test_operands_must_share_the_gemm_device():
    specs, fusion = prepare(lambda acc, bias, alpha: alpha * acc + bias, {"bias": rand(40), "alpha": 2.0}, 24, 40)
    with pytest.raises(DeviceError, match="operand 'bias' is on cpu; move it to meta"):
        kernel_inputs(fusion, specs, torch.device("meta"))
    tensors, scalars = kernel_inputs(fusion, specs, CPU)
    assert len(tensors) == 1 and tensors[0].shape == (1, 40) and scalars == (2.0,)


def test_tensors_follow_the_fusion_order():
    m, n = 24, 40
    values = {
        "c": rand(m, 1),
        "s": 0.5,
        "t2": rand(m, n),
        "r": rand(n, dtype=torch.float16),
        "t1": rand(m, n),
        "u": 3.0,
    }

    def fn(acc, c, s, t2, r, t1, u):
        return {"D": acc * s + t1 - t2 * r + c * u, "aux": acc, "rs": ops.row_sum(acc)}

    specs, fusion = prepare(fn, values, m, n)
    tensors, scalars = kernel_inputs(fusion, specs, CPU)
    inputs = [(role, name) for role, name, _ in fusion.tensor_args if role in ("tile", "row", "col")]
    assert [role for role, _ in inputs] == ["tile", "tile", "row", "col"]
    assert len(tensors) == len(inputs)
    for t, (_, name) in zip(tensors, inputs):
        assert t.data_ptr() == values[name].data_ptr() and t.dtype == values[name].dtype, name
    assert scalars == tuple(float(values[name]) for name in fusion.scalar_inputs) and len(scalars) == 2


def test_a_broadcast_tile_in_a_batched_problem_is_materialized():
    l, m, n = 3, 17, 24
    shared, per_batch = rand(m, n), rand(l, m, n)
    specs, fusion = prepare(lambda acc, t, u: acc + t * u, {"t": shared, "u": per_batch}, m, n, l)
    (t, u), _ = kernel_inputs(fusion, specs, CPU)
    assert t.shape == (l, m, n) and t.stride() == (m * n, n, 1) and t.data_ptr() != shared.data_ptr()
    assert torch.equal(t, shared.expand(l, m, n))
    assert u.data_ptr() == per_batch.data_ptr()  # a real batch needs no copy
    specs, fusion = prepare(lambda acc, t: acc + t, {"t": shared}, m, n, 1)
    (t,), _ = kernel_inputs(fusion, specs, CPU)
    assert t.shape == (1, m, n) and t.data_ptr() == shared.data_ptr()  # L = 1: nothing to broadcast


def test_a_tile_operand_unfit_for_tma_is_refused_by_name():
    m, n = 17, 24
    offset = rand(m, n + 8)[:, 1 : n + 1]  # base 2 bytes past a 16-byte boundary
    specs, fusion = prepare(lambda acc, res: acc + res, {"res": offset}, m, n)
    with pytest.raises(AlignmentError, match="operand 'res'"):
        kernel_inputs(fusion, specs, CPU)


def test_vectors_may_have_any_strides():
    m, n = 17, 24
    row = rand(2 * n)[::2]
    specs, fusion = prepare(lambda acc, r: acc * r, {"r": row}, m, n)
    (r,), _ = kernel_inputs(fusion, specs, CPU)
    assert r.data_ptr() == row.data_ptr() and r.shape == (1, n) and r.stride(1) == 2


def aux_fusion(out_dtypes=None, m=17, n=24, l=1):
    _, fusion = prepare(
        lambda acc, bias: {"D": ops.gelu(acc + bias), "pre": acc + bias, "rs": ops.row_sum(acc)},
        {"bias": rand(n)}, m, n, l, out_dtypes,
    )  # fmt: skip
    return fusion


def test_aux_outputs_are_allocated_batch_first_in_their_dtype():
    fusion = aux_fusion({"pre": torch.float32}, l=2)
    aux = aux_outputs(fusion, {}, (2, 17, 24), True, CPU)
    assert list(aux) == ["pre"] and aux["pre"].shape == (2, 17, 24) and aux["pre"].dtype == torch.float32


def test_preallocated_aux_outputs_are_used_in_place():
    fusion = aux_fusion({"pre": torch.float32})
    pre = torch.full((17, 24), float("nan"))
    aux = aux_outputs(fusion, {"pre": pre}, (1, 17, 24), False, CPU)
    assert aux["pre"].shape == (1, 17, 24) and aux["pre"].data_ptr() == pre.data_ptr()
    batched = torch.full((3, 17, 24), float("nan"))
    aux = aux_outputs(aux_fusion({"pre": torch.float32}, l=3), {"pre": batched}, (3, 17, 24), True, CPU)
    assert aux["pre"].data_ptr() == batched.data_ptr()


@pytest.mark.parametrize(
    "outs,error,match",
    [
        ({"post": torch.empty(17, 24)}, OutputError, r"outs names \['post'\].*returns \['pre'\]"),
        ({"D": torch.empty(17, 24)}, OutputError, "pass D as out="),
        ({"rs": torch.empty(17)}, OutputError, r"outs names \['rs'\]"),
        (
            {"pre": torch.empty(17, 16)},
            OutputError,
            r"outs\['pre'\] has shape \(17, 16\); the epilogue writes \(17, 24\)",
        ),
        ({"pre": torch.empty(1, 17, 24)}, OutputError, r"outs\['pre'\] has shape \(1, 17, 24\)"),
        ({"pre": torch.empty(17, 24, dtype=BF16)}, OutputError, r"outs\['pre'\] has dtype torch.bfloat16.*out_dtypes"),
        ({"pre": torch.empty(17, 24, device="meta")}, DeviceError, r"outs\['pre'\] is on meta"),
        ({"pre": torch.empty(17, 25)[:, :24]}, AlignmentError, r"outs\['pre'\]"),
    ],
)  # fmt: skip
def test_bad_outs_are_refused_by_name(outs, error, match):
    # 2-D problem: outs are (M, N); "pre" is stored fp32.
    with pytest.raises(error, match=match):
        aux_outputs(aux_fusion({"pre": torch.float32}), outs, (1, 17, 24), False, CPU)


def test_fp8_aux_outputs_are_allocated_in_their_dtype():
    # Whether TMA can store their rows is prepare()'s check (tests/gemm/test_prepare.py), made before this.
    aux = aux_outputs(aux_fusion({"pre": torch.float8_e4m3fn}, n=32), {}, (1, 17, 32), False, CPU)
    assert aux["pre"].dtype == torch.float8_e4m3fn and aux["pre"].shape == (1, 17, 32)
