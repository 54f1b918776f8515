"""Operand kinds inferred from what is passed, canonical views, pins, and the errors that name the fix."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.epilogue import library
from epicute.epilogue.operands import ColVector, RowVector, Scalar, Tile, operand_spec, resolve_operands
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import EpilogueError
from tests.epilogue.conftest import randn

L, M, N = 3, 5, 7


def broadcast(spec_value: torch.Tensor, kind: str) -> torch.Tensor:
    """The canonical value as the (L, M, N) tensor it stands for."""
    return {"row": lambda v: v[:, None, :], "col": lambda v: v[:, :, None], "tile": lambda v: v}[kind](
        spec_value
    ).expand(L, M, N)


# shape -> (kind, the (L, M, N) tensor the passed value t stands for)
CASES = {
    (N,): ("row", lambda t: t[None, None, :]),
    (1, N): ("row", lambda t: t[None, :, :]),
    (L, N): ("row", lambda t: t[:, None, :]),
    (L, 1, N): ("row", lambda t: t),
    (M, 1): ("col", lambda t: t[None, :, :]),
    (L, M, 1): ("col", lambda t: t),
    (M, N): ("tile", lambda t: t[None]),
    (L, M, N): ("tile", lambda t: t),
}


@pytest.mark.parametrize("shape", list(CASES))
def test_kind_and_canonical_view_from_shape(gen, shape):
    t = randn(gen, *shape, dtype=torch.bfloat16)
    kind, meaning = CASES[shape]
    spec = operand_spec("x", t, M, N, L)
    assert (spec.name, spec.kind, spec.dtype) == ("x", kind, "bf16")
    assert spec.value.shape == {"row": (L, N), "col": (L, M), "tile": (L, M, N)}[kind]
    assert torch.equal(broadcast(spec.value, kind), meaning(t).expand(L, M, N))
    assert spec.value.data_ptr() == t.data_ptr(), "canonical operands must be views, not copies"


@pytest.mark.parametrize("shape", list(CASES))
def test_repeat_resolution_views_the_new_tensor(gen, shape):
    # The second resolution of a same-shaped operand replays the first's view on the new data.
    kind, meaning = CASES[shape]
    operand_spec("x", randn(gen, *shape, dtype=torch.bfloat16), M, N, L)
    t = randn(gen, *shape, dtype=torch.bfloat16)[..., :]  # a view: storage offsets must carry over
    offset = randn(gen, 3 + t.numel(), dtype=torch.bfloat16)[3:].view(t.shape)
    for value in (t, offset):
        spec = operand_spec("x", value, M, N, L)
        assert spec.kind == kind and spec.value.data_ptr() == value.data_ptr()
        assert torch.equal(broadcast(spec.value, kind), meaning(value).expand(L, M, N))


def test_repeat_resolution_still_checks_a_pin_against_the_shape(gen):
    operand_spec("x", RowVector(randn(gen, N)), M, N, L)
    with pytest.raises(EpilogueError, match="ambiguous|must be"):
        operand_spec("x", ColVector(randn(gen, N)), M, N, L)


@pytest.mark.parametrize(
    "value", [0.5, 2, torch.tensor(0.5), torch.tensor([0.5]), torch.tensor([[0.5]], dtype=torch.bfloat16)]
)
def test_numbers_and_one_element_tensors_are_scalars(value):
    spec = operand_spec("alpha", value, M, N, L)
    assert (spec.kind, spec.dtype) == ("scalar", "fp32")
    assert type(spec.value) is float and spec.value == float(torch.as_tensor(value).item())


def test_one_element_float64_tensor_is_a_fine_scalar():
    assert operand_spec("s", torch.tensor(0.25, dtype=torch.float64), M, N).value == 0.25


def test_readings_with_the_same_meaning_pick_the_narrowest_kind(gen):
    # M == 1: (1, N) is both a row (L=1) and a tile; (M, 1) with N == 1 is a col and a tile.
    t = randn(gen, 1, 9)
    spec = operand_spec("x", t, 1, 9, 1)
    assert spec.kind == "row" and torch.equal(spec.value, t)
    spec = operand_spec("x", randn(gen, 6, 1), 6, 1, 1)
    assert spec.kind == "col" and spec.value.shape == (1, 6)


def test_a_1d_operand_is_a_row_vector_also_when_m_equals_n(gen):
    # torch's broadcasting: the last dimension runs over N, whatever M is.
    t = randn(gen, 8)
    spec = operand_spec("bias", t, 8, 8, 1)
    assert spec.kind == "row" and torch.equal(spec.value, t[None])
    assert operand_spec("bias", t, 8, 8, 3).kind == "row"
    col = operand_spec("bias", t[:, None], 8, 8, 1)
    assert col.kind == "col" and torch.equal(col.value, t[None])


@pytest.mark.parametrize("shape", [(M,), (L, M)])
def test_a_length_m_vector_needs_a_column_shape_or_pin(gen, shape):
    t = randn(gen, *shape)
    with pytest.raises(EpilogueError, match=r"last dimension runs over N.*scale\[\.\.\., None\] or epicute\.ColVector"):
        operand_spec("scale", t, M, N, L)
    spec = operand_spec("scale", ColVector(t), M, N, L)
    assert spec.kind == "col"
    assert torch.equal(broadcast(spec.value, "col"), t.reshape(-1, M)[:, :, None].expand(L, M, N))


def test_pins_resolve_the_square_ambiguity(gen):
    t = randn(gen, 8)
    row = operand_spec("bias", RowVector(t), 8, 8, 2)
    col = operand_spec("bias", epicute.ColVector(t), 8, 8, 2)
    assert row.kind == "row" and col.kind == "col"
    assert torch.equal(row.value, t.expand(2, 8)) and torch.equal(col.value, t.expand(2, 8))


def test_batch_equal_to_M_makes_L_by_N_ambiguous_until_pinned(gen):
    t = randn(gen, 4, 6)
    with pytest.raises(EpilogueError, match=r"epicute\.Tile\(w\) or epicute\.RowVector\(w\)"):
        operand_spec("w", t, 4, 6, 4)
    tile = operand_spec("w", Tile(t), 4, 6, 4)
    assert tile.kind == "tile" and tile.value.shape == (4, 4, 6) and torch.equal(tile.value[3], t)
    assert operand_spec("w", RowVector(t), 4, 6, 4).kind == "row"


def test_misshaped_operand_lists_every_accepted_shape(gen):
    with pytest.raises(EpilogueError) as err:
        operand_spec("residual", randn(gen, M, N + 1), M, N, L)
    msg = str(err.value)
    assert "'residual'" in msg and f"({M}, {N + 1})" in msg
    for accepted in (f"(N,) = ({N},)", f"(L, N) = ({L}, {N})", f"(M, 1) = ({M}, 1)", f"(L, M, N) = ({L}, {M}, {N})"):
        assert accepted in msg


def test_pinned_misshaped_operand_lists_that_kinds_shapes(gen):
    with pytest.raises(EpilogueError) as err:
        operand_spec("scale", ColVector(randn(gen, N)), M, N, L)
    msg = str(err.value)
    assert f"(M,) = ({M},)" in msg and "(N,)" not in msg and "column vector" in msg


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (Scalar(torch.ones(2)), "a scalar must be a Python number or a 1-element tensor"),
        (RowVector(0.5), "is a number, but it is pinned to a row vector"),
        (torch.ones(M, N, dtype=torch.float64), r"dtype torch.float64; use bf16, fp16, fp32 or fp8"),
        (torch.ones(N, dtype=torch.int32), "dtype torch.int32"),
        ([1.0, 2.0], "expected a torch tensor or a Python number, got list"),
        (Tile(RowVector(torch.ones(N))), "got RowVector"),
    ],
)
def test_bad_operand_values(value, match):
    with pytest.raises(EpilogueError, match=match):
        operand_spec("x", value, M, N, L)


def test_scalar_pin_accepts_numbers_and_one_element_tensors():
    assert operand_spec("a", Scalar(3), M, N).value == 3.0
    assert operand_spec("a", Scalar(torch.tensor([[2.0]])), M, N).value == 2.0


def test_missing_and_extra_operands_are_named():
    with pytest.raises(EpilogueError, match=r"takes bias, alpha \(after acc\): missing 'alpha'; unexpected 'gamma'"):
        resolve_operands(("bias", "alpha"), {"bias": 1.0, "gamma": 2.0}, M, N, epilogue="f")
    with pytest.raises(EpilogueError, match="takes no operands.*unexpected 'x'"):
        as_epilogue(lambda acc: acc).operands({"x": 1.0}, M, N)


def test_epilogue_operands_use_defaults_and_resolve_in_parameter_order(gen):
    def f(acc, bias, alpha=0.5):
        return alpha * acc + bias

    specs = as_epilogue(f).operands({"bias": randn(gen, N)}, M, N, L)
    assert list(specs) == ["bias", "alpha"]
    assert specs["alpha"].kind == "scalar" and specs["alpha"].value == 0.5
    assert as_epilogue(f).operands({"bias": 1.0, "alpha": 2.0}, M, N)["alpha"].value == 2.0


def test_annotations_fix_kinds_so_square_problems_need_no_pins(gen):
    scale_m, scale_n = randn(gen, 16), randn(gen, 16)
    specs = library.row_col_quant.operands({"scale_m": scale_m, "scale_n": scale_n}, 16, 16)
    assert specs["scale_m"].kind == "col" and specs["scale_n"].kind == "row"


def test_string_annotations_are_evaluated():
    ns: dict = {}
    exec("from __future__ import annotations\nimport epicute\ndef f(acc, s: epicute.ColVector): return acc * s", ns)
    assert as_epilogue(ns["f"]).pins == {"s": "col"}
    exec("from __future__ import annotations\ndef g(acc, s: Undefined): return acc * s", ns)
    assert as_epilogue(ns["g"]).pins == {}


def test_a_pin_that_contradicts_the_annotation_is_an_error(gen):
    with pytest.raises(
        EpilogueError, match="'scale_m' is declared ColVector by the epilogue, but was passed as RowVector"
    ):
        library.row_col_quant.operands({"scale_m": RowVector(randn(gen, 16)), "scale_n": randn(gen, 16)}, 16, 16)
