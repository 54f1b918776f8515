"""The attention call's host path with the kernel stubbed: a plain repeat call binds its own tensors to the
remembered validation and plan, and the custom op's implementation reads its spec once per string."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch

import epicute
from epicute.attention import launch
from epicute.attention.validate import check_attention_args
from epicute.runtime import backend as backend_module
from epicute.runtime.buffers import per_call_buffers
from epicute.runtime.family import declarations, resolve
from epicute.runtime.torch_ops import parsed_spec, spec_text

api = importlib.import_module("epicute.attention.api")


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch's (variant, arguments), on the CPU: the kernels' backend with CUDA's check lifted."""
    recorded = []

    class Recorder:
        def __init__(self, variant):
            self.variant = variant

        def __call__(self, *args):
            recorded.append((self.variant, args))

    monkeypatch.setattr(backend_module, "_DEFAULT", ["kernel"])
    monkeypatch.setattr(api, "check_attention_args",
                        lambda *a, **kw: check_attention_args(*a, **{**kw, "require_cuda": False}))  # fmt: skip
    monkeypatch.setattr(launch.ATTENTION_CACHE, "get", Recorder)
    monkeypatch.setattr(launch, "current_target", lambda: type("Target", (), {"num_sms": 132})())
    monkeypatch.setattr(launch, "tile_counter", lambda device, dynamic: None)
    monkeypatch.setattr(api, "_VALIDATED", {})
    return recorded


def _qkv(batch=2, seqlen=197, heads=4, head_dim=64):
    q = torch.randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16)
    return q, torch.randn_like(q), torch.randn_like(q)


def test_a_repeat_call_launches_its_own_tensors_on_the_remembered_plan(launches):
    first, again = _qkv(), _qkv()
    with torch.no_grad():
        epicute.attention(*first, causal=True)
        assert len(api._VALIDATED) == 1
        epicute.attention(*again, causal=True)
    (variant_1, args_1), (variant_2, args_2) = launches
    assert variant_2 is variant_1  # the prepared call's variant, built once
    assert all(a is b for a, b in zip(args_2[:3], again)) and all(a is b for a, b in zip(args_1[:3], first))
    assert args_2[5] == args_1[5] == pytest.approx(64**-0.5)  # the remembered softmax scale
    assert args_2[3] is not args_1[3] and args_2[3].shape == again[0].shape  # a fresh O per call


def test_other_layouts_and_options_are_validated_anew(launches):
    q, k, v = _qkv()
    with torch.no_grad():
        epicute.attention(q, k, v)
        epicute.attention(q, k, v, causal=True)  # another option
        epicute.attention(q, k[:, :100], v[:, :100])  # other key lengths (and strides)
        epicute.attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)  # q's other strides
    assert len(api._VALIDATED) == 4
    assert launches[2][1][1].shape[1] == 100 and launches[3][1][0].stride() != q.stride()


def test_the_ops_implementation_reads_each_spec_once(launches):
    op = next(s.torch_op for s in declarations() if s.torch_op and str(s.torch_op).endswith("ATTENTION_OP"))
    impl = per_call_buffers(resolve(op).impl)
    spec = spec_text((), (), (), (), (("causal", True), ("softmax_scale", 0.125)))
    assert parsed_spec(spec) is parsed_spec(spec)
    for q, k, v in (_qkv(), _qkv()):
        o, lse = impl(q, k, v, [], [], "", "", spec, None, None, None, None)
        assert o.shape == q.shape and lse.shape == (2, 4, 197)
        variant, args = launches[-1]
        assert variant.causal and args[5] == pytest.approx(0.125) and args[0] is q
    assert parsed_spec(spec) == json.loads(spec)  # still what the string says: no caller wrote to it


def test_the_backward_is_planned_once_per_prepared_call_and_options(launches):
    from epicute.attention.prepare import prepare

    q, k, v = _qkv(heads=8)
    prepared = prepare(check_attention_args(q, k, v, causal=True, softmax_scale=None, require_cuda=False))
    plain = prepared.backward_variant()
    assert prepared.backward_variant() is plain and prepared.backward_variant(False, False) is plain
    deterministic = prepared.backward_variant(True)
    assert deterministic is not plain and deterministic.deterministic and not plain.deterministic
    assert prepared.backward_variant(True) is deterministic


def test_the_compiled_backward_takes_the_forwards_validation(launches, monkeypatch):
    """The custom op's backward of a plain call binds its tensors to what the forward validated and planned; a call
    the forward did not see (here: a score_mod's) is validated as before."""
    from epicute.attention import backward, torch_op
    from epicute.attention import validate as validate_module

    checked = []
    monkeypatch.setattr(validate_module, "check_attention_args",
                        lambda *a, **kw: checked.append(a) or check_attention_args(*a, **{**kw, "require_cuda": False}))
    for cache in (backward.BACKWARD_CACHE, backward.PREPROCESS_CACHE, backward.POSTPROCESS_CACHE):
        monkeypatch.setattr(cache, "get", lambda variant: lambda *args: launches.append((variant, args)))
    monkeypatch.setattr(backward, "current_target", lambda: type("Target", (), {"l2_bytes": 50 << 20})())
    op = next(s.torch_op for s in declarations() if s.torch_op and str(s.torch_op).endswith("ATTENTION_OP"))
    forward = per_call_buffers(resolve(op).impl)
    spec = spec_text((), (), (), (), (("causal", True), ("softmax_scale", None)))
    q, k, v = _qkv(heads=8)
    o, lse = forward(q, k, v, [], [], "", "", spec, None, None, None, None)
    do = torch.randn_like(o)
    dq, dk, dv, _ = torch_op.attention_backward_op(q, k, v, o, lse, do, None, [], [], "", spec, None, None, False)
    assert not checked and dq.shape == q.shape and dk.shape == dv.shape == k.shape
    main = next(args for variant, args in launches if isinstance(variant, backward.BackwardVariant))
    assert main[0] is q and main[1] is k and main[2] is v
    q2 = q.transpose(1, 2).contiguous().transpose(1, 2)  # strides the forward never saw
    torch_op.attention_backward_op(q2, k, v, o, lse, do, None, [], [], "", spec, None, None, False)
    assert len(checked) == 1


def test_the_backwards_launch_steps_are_worked_out_once_per_problem(launches, monkeypatch):
    """A training step's backward reuses its launch steps (the grid, the postprocess variants) and the preprocess's
    buffer shapes; the steps are keyed by heads per CTA, which the variant's equality leaves out. LSE * log2 e and D
    share one allocation, apart."""
    from epicute.attention import backward
    from epicute.attention.prepare import prepare

    for cache in (backward.BACKWARD_CACHE, backward.PREPROCESS_CACHE, backward.POSTPROCESS_CACHE):
        monkeypatch.setattr(cache, "get", lambda variant: lambda *args: launches.append((variant, args)))
    monkeypatch.setattr(backward, "current_target", lambda: type("Target", (), {"l2_bytes": 50 << 20})())
    backward._launch_steps.cache_clear()
    backward._preprocess_layout.cache_clear()
    q, k, v = _qkv(heads=8)
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()  # GQA 4:1, the group walked by one CTA
    call = check_attention_args(q, k, v, causal=True, softmax_scale=None, require_cuda=False)
    variant = prepare(call).backward_variant()
    assert variant.heads_per_cta == 4
    o, lse = torch.randn_like(q), torch.randn(2, 8, 197)
    for _ in range(2):
        backward.attention_backward(call, o, lse, torch.randn_like(q), variant)
    assert backward._launch_steps.cache_info().hits == 1 and backward._preprocess_layout.cache_info().hits == 1
    (pre, pre_args), (main, main_args) = launches[-3:-1]
    assert isinstance(pre, backward.PreprocessVariant) and isinstance(main, backward.BackwardVariant)
    lse_log2, dsum = pre_args[3:5]
    assert lse_log2.shape == dsum.shape and main_args[4] is lse_log2 and main_args[5] is dsum
    assert lse_log2.data_ptr() + lse_log2.numel() * 4 <= dsum.data_ptr()  # one allocation, the halves apart
    other = dataclasses.replace(variant, heads_per_cta=2)
    assert other == variant  # heads per CTA is a launch argument: equal variants...
    steps = [backward._launch_steps(x, x.heads_per_cta, call.problem, 50 << 20) for x in (variant, other)]
    assert steps[0].heads == 4 and steps[1].heads == 2  # ...with their own steps
