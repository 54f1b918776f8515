"""The pre-launch checks the families share (epicute.runtime.checks): TMA's alignment rule as the launch applies
it, gradients refused where no backward exists, config pins, operand names."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.attention.plan import AttentionConfig
from epicute.gemm.config import GemmConfig
from epicute.runtime.checks import (
    check_flags,
    check_no_grad,
    check_operand_names,
    check_text_file,
    config_pins,
    with_aligned_unit_dims,
)


def test_size_one_dims_get_aligned_strides_and_keep_their_values():
    # torch._scaled_mm's M-major blockwise scales, padded rows, as one batch: the batch stride torch gives the
    # unsqueezed view (1001 floats) is never stepped along, but a TMA descriptor encodes it.
    rows, blocks = 1001, 9
    scales = torch.rand(blocks, rows + 3)[:, :rows].t().unsqueeze(0)  # (1, M, KB), strides (?, 1, 1004)
    view = with_aligned_unit_dims(scales, contiguous_dim=1)
    assert view.shape == scales.shape and view.data_ptr() == scales.data_ptr()
    assert view.stride(0) % 4 == 0 and view.stride()[1:] == scales.stride()[1:]
    assert torch.equal(view, scales)  # the same elements of the same storage
    aligned = torch.rand(2, 8, 4)
    assert with_aligned_unit_dims(aligned, contiguous_dim=2) is aligned  # nothing to change: the tensor itself
    assert with_aligned_unit_dims(torch.rand(1, 4, 1)[:, :, :], contiguous_dim=1).stride()[2] % 4 == 0


# --- gradients (issue 56, item 5) -------------------------------------------------------------------------------


def test_no_grad_check_names_the_argument_and_the_fix():
    t = torch.ones(3, requires_grad=True)
    with pytest.raises(epicute.GradientError, match=r"^b requires grad, but a prepared call records no") as info:
        check_no_grad("a prepared call", ("a", torch.ones(3)), ("b", t), ("out", None), instead="Call f instead. ")
    for fix in ("torch.no_grad()", "torch.inference_mode()", "b.detach()", "Call f instead."):
        assert fix in str(info.value)
    assert isinstance(info.value, RuntimeError)  # a training loop catching RuntimeError still sees it
    with pytest.raises(epicute.GradientError, match=r"operand 'bias' requires grad.*pass bias\.detach\(\)"):
        check_no_grad("epicute.gemm", ("a", torch.ones(3)), operands={"s": 2.0, "bias": epicute.RowVector(t)})
    # Nothing to refuse: autograd off, or nothing requires grad.
    with torch.no_grad():
        check_no_grad("epicute.gemm", ("a", t), operands={"bias": t})
    with torch.inference_mode():
        check_no_grad("epicute.gemm", ("a", t))
    check_no_grad("epicute.gemm", ("a", t.detach()), ("b", [1.0]), operands={"x": 1.0, "y": None})


# --- config= (issue 56, item 6) ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("tile_n=128", r"config='tile_n=128' \(str\): pass a dict of GemmConfig fields"),
        (["tile_n"], r"config=\['tile_n'\] \(list\): pass a dict"),
        ([("tile_n", 128)], r"\(list\): pass a dict"),
        (5, r"config=5 \(int\): pass a dict"),
        ({"tile": 128}, r"unknown field 'tile'; did you mean 'tile_[mnk]'"),
        ({1: 2}, r"unknown field 1; GemmConfig fields are"),
        ({"tile_n": "128"}, r"config\['tile_n'\]='128' \(str\): GemmConfig.tile_n takes a positive int"),
        ({"tile_n": 128.5}, r"config\['tile_n'\]=128.5 \(float\): GemmConfig.tile_n takes a positive int"),
        ({"tile_n": [128]}, r"tile_n takes a positive int"),
        ({"cluster_m": "2"}, r"cluster_m takes a positive int"),
        ({"tile_m": 0}, r"tile_m takes a positive int"),
        ({"split_k": -1}, r"split_k takes a positive int"),
        ({"persistent": "yes"}, r"persistent takes True or False"),
        ({"swap_ab": 2}, r"swap_ab takes True or False"),
        ({"schedule": 1}, r"schedule takes a string"),
        ({"epi_tile": 64}, r"epi_tile takes a tuple of 2 positive ints"),
        ({"epi_tile": "ab"}, r"epi_tile takes a tuple of 2 positive ints"),
        ({"epi_tile": (128, 0)}, r"epi_tile takes a tuple of 2 positive ints"),
        ({"reasons": ("x",)}, r"unknown field 'reasons'"),
    ],
)
def test_malformed_gemm_configs_are_config_errors(config, match):
    with pytest.raises(epicute.ConfigError, match=match):
        config_pins(config, GemmConfig)


def test_config_pins_are_sorted_normalized_and_none_pins_nothing():
    assert config_pins(None, GemmConfig) == () == config_pins({}, GemmConfig)
    pins = config_pins({"tile_n": 128.0, "epi_tile": [128, 32], "persistent": 1, "tile_m": None}, GemmConfig)
    assert pins == (("epi_tile", (128, 32)), ("persistent", True), ("tile_n", 128))
    assert type(dict(pins)["tile_n"]) is int
    pins = config_pins({"num_splits": 4, "mma_atoms_mn": (1, 1)}, AttentionConfig)
    assert pins == (("mma_atoms_mn", (1, 1)), ("num_splits", 4))
    with pytest.raises(epicute.ConfigError, match="unknown field 'tile_k'; did you mean 'tile_[mn]'.*AttentionConfig"):
        config_pins({"tile_k": 64}, AttentionConfig)


# --- operand names, flags, explain's file= (issue 56, item 6) ----------------------------------------------------


def test_operand_named_like_an_entry_parameter_is_refused_naming_the_clash():
    check_operand_names("epilogue", "f", ("bias", "b"), {"out", "config"}, "epicute.gemm")
    match = r"epilogue 'f' takes an operand named 'out', which is epicute.gemm's own parameter out=.*Rename.*out_"
    with pytest.raises(epicute.EpilogueError, match=match):
        check_operand_names("epilogue", "f", ("bias", "out"), {"out", "config"}, "epicute.gemm")


@pytest.mark.parametrize("value", ["yes", 2, None, torch.ones(2), 1.0])
def test_flags_take_true_or_false(value):
    check_flags(gated=True, causal=False, tune=0)
    with pytest.raises(epicute.ConfigError, match=r"^gated=.*: pass True or False"):
        check_flags(gated=value)


def test_explain_file_is_a_stream_stdout_or_none():
    import io

    for ok in (None, "stdout", io.StringIO()):
        check_text_file(ok)
    for bad in (3, "out.txt", [1]):
        with pytest.raises(epicute.ConfigError, match=r"file=.*: pass 'stdout'"):
            check_text_file(bad)


def test_self_overlapping_reads_only_the_layout():
    from epicute.runtime.checks import self_overlapping

    t = torch.empty(8, 24)
    assert not self_overlapping(t) and not self_overlapping(t.t()) and not self_overlapping(t[:, ::2])
    assert not self_overlapping(torch.empty(2, 8, 24)[:, 1:]) and not self_overlapping(torch.empty(1, 24).expand(1, 24))
    assert not self_overlapping(torch.empty(0, 24).expand(0, 24))
    assert self_overlapping(torch.empty(1, 24).expand(8, 24))
    assert self_overlapping(torch.empty(64).as_strided((8, 24), (4, 1)))  # rows 24 wide, 4 apart
    assert self_overlapping(torch.empty(64).as_strided((8, 24), (1, 1)))
