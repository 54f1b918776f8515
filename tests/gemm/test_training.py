"""A repeat eager training call replays what the whole path would (``epicute.gemm.training``).

The first training call of a signature leaves a PreparedTraining; the first backward of each gradient signature
of it leaves a PreparedBackward, which the next backwards of that signature replay. Here, on CPU tensors with the
GPU check lifted and the kernel replaced by a stub (the recorder of tests/gemm/test_prepared.py, which also writes
D from its inputs), a replayed backward must hand the kernels what the whole path hands them for the same tensors
(the caller's tensors and views of them as they are, fresh outputs of the same layouts) and give the same
gradients. Every backward plan, aux outputs, a scalar operand, gated GEMMs and batched calls; values are the GPU
tests' (tests/gemm/test_autograd_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.gemm import api as api_module
from epicute.gemm import torch_op, training
from epicute.gemm.autograd import RECOMPUTE_BELOW_K
from epicute.gemm.training import PreparedBackward
from tests.gemm.autograd_cases import _leaf, cases
from tests.gemm.test_prepared import _described, stub_kernel

M, N = 40, 48
K_PLANS = {"recompute": RECOMPUTE_BELOW_K - 64, "save": RECOMPUTE_BELOW_K + 64}


class _Writing:
    """The stub kernel, also writing D: ``1 + sum(A) + sum(B)``, so every gradient depends on what each launch was
    handed (the reductions' workspaces and aux tiles stay as allocated: those gradients are compared by layout)."""

    def __init__(self, recorder) -> None:
        self.recorder = recorder

    def __call__(self, a, b, d, *rest) -> None:
        self.recorder(a, b, d, *rest)
        d.fill_(1.0 + a.float().sum().item() + b.float().sum().item())


@pytest.fixture
def kernel(monkeypatch):
    from epicute.gemm import launch as launch_module

    recorder = stub_kernel(monkeypatch)
    writing = _Writing(recorder)
    monkeypatch.setattr(launch_module, "kernel_for", lambda plan, fusion=None: writing)
    monkeypatch.setattr(api_module, "_TRAINING_CALLS", {})
    monkeypatch.setattr(torch_op, "_OP_REPEATS", {})
    return recorder


def _inputs(name: str, k: int, batch: int | None):
    epilogue, _, factories, options = cases(M, N, "cpu")[name]
    lead = (batch,) if batch else ()
    width = 2 * N if options.get("gated") else N
    a = torch.randn(*lead, M, k, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(*lead, width, k, dtype=torch.bfloat16, requires_grad=True)  # passed as weight^T
    operands = {name: make() for name, make in factories.items()}
    return epilogue, options, a, weight, operands


def _step(kernel, epilogue, options, a, weight, operands, upstream, call=None):
    """One forward and backward through ``call`` (default :func:`epicute.gemm`): the launches of the backward, and
    every leaf's gradient."""
    leaves = [a, weight, *(_leaf(v) for v in operands.values())]
    for t in leaves:
        t.grad = None
    b = weight.transpose(-1, -2)
    call = call or epicute.gemm
    out = call(a, b, epilogue=epilogue, **options, **operands) if epilogue else call(a, b)
    outs = out if isinstance(out, dict) else {"D": out}
    if not upstream:
        upstream |= {n: torch.randn_like(t) for n, t in outs.items() if t.requires_grad}
    before = len(kernel.calls)
    torch.autograd.backward([outs[n] for n in upstream], [upstream[n] for n in upstream])
    return kernel.calls[before:], [t.grad for t in leaves]


@pytest.mark.parametrize(
    ("name", "plan", "batch"),
    [("plain", "save", None), ("bias", "save", None), ("gelu_bias_residual", "save", None),
     ("gelu_bias_residual", "recompute", None), ("tanh_scaled_with_aux", "save", None),
     ("tanh_scaled_with_aux", "recompute", None), ("swiglu", "save", None), ("geglu_row_scale", "recompute", None),
     ("tanh_scaled_with_aux", "save", 3), ("swiglu", "recompute", 3)],
)  # fmt: skip
def test_a_repeat_backward_launches_what_the_whole_path_would(kernel, name, plan, batch):
    inputs = _inputs(name, K_PLANS[plan], batch)
    upstream: dict = {}
    _step(kernel, *inputs, upstream)  # the whole path, leaving a PreparedTraining
    _step(kernel, *inputs, upstream)  # the forward replayed, the backward recorded
    (entry,) = api_module._TRAINING_CALLS.values()
    (prepared,) = entry.backwards.values()
    assert isinstance(prepared, PreparedBackward), "the backward left no record"

    whole_path = []
    real_describe = api_module.describe_call
    api_module.describe_call = lambda *args: whole_path.append(1) or real_describe(*args)
    try:
        replayed, replayed_grads = _step(kernel, *inputs, upstream)
        assert not whole_path, "a replayed backward went through epicute.gemm's whole path"
        entry.backwards.clear()
        api_module._PREPARED_CALLS.clear()  # the whole path for every GEMM of the backward
        whole, whole_grads = _step(kernel, *inputs, upstream)
        assert whole_path
    finally:
        api_module.describe_call = real_describe

    assert len(replayed) == len(whole) > 0 or name == "bias"  # acc + bias: the gradients are torch's alone
    _assert_replays_the_whole_path(inputs, upstream, (replayed, replayed_grads), (whole, whole_grads))


def _assert_replays_the_whole_path(inputs, upstream: dict, replay: tuple, whole: tuple) -> None:
    """``replay`` and ``whole`` (each a backward's launches and the leaves' gradients) made the same launches: the
    same scalars, the caller's tensors wherever the whole path handed one, fresh tensors of the same layouts
    elsewhere; and gradients of the same layouts, a's and b's equal."""
    _, _, a, weight, operands = inputs
    callers = {t.untyped_storage().data_ptr() for t in (a, weight, *map(_leaf, operands.values()), *upstream.values())
               if isinstance(t, torch.Tensor)}  # fmt: skip
    for got_launch, want_launch in zip(replay[0], whole[0], strict=True):
        got, want = _described(got_launch), _described(want_launch)
        assert got[1] == want[1], "scalars differ"
        for g, w in zip(got[0], want[0], strict=True):
            assert g == w if w[3] in callers else (g[3] not in callers and g[:3] == w[:3])
    for got, want in zip(replay[1], whole[1], strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    # a and b's gradients are D of launches that read only what they were handed: equal if those were.
    for got, want in zip(replay[1][:2], whole[1][:2]):
        assert torch.equal(got, want)


def test_a_backward_needing_other_gradients_is_recorded_apart(kernel):
    """Another set of inputs needing a gradient makes a record of its own; a non-contiguous upstream gradient is
    made contiguous first (as the whole path does) and replays the contiguous one's."""
    epilogue, options, a, weight, operands = _inputs("gelu_bias_residual", K_PLANS["save"], None)
    upstream = {"D": torch.randn(M, N, dtype=torch.bfloat16)}
    for _ in range(2):
        _step(kernel, epilogue, options, a, weight, operands, upstream)
    (entry,) = api_module._TRAINING_CALLS.values()
    assert len(entry.backwards) == 1
    transposed = {"D": torch.randn(N, M, dtype=torch.bfloat16).t()}
    _, grads = _step(kernel, epilogue, options, a, weight, operands, transposed)
    assert len(entry.backwards) == 1
    _, contiguous = _step(kernel, epilogue, options, a, weight, operands, {"D": transposed["D"].contiguous()})
    assert all(torch.equal(got, want) for got, want in zip(grads[:2], contiguous[:2]))
    _, grads = _step(kernel, epilogue, options, a.detach(), weight, operands, upstream)  # b's gradient alone
    assert len(entry.backwards) == 2 and grads[0] is None and grads[1] is not None


def test_a_backward_that_records_its_own_graph_takes_the_whole_path(kernel):
    """``create_graph=True``: the backward's GEMMs must be differentiable calls, never a replay."""
    epilogue, options, a, weight, operands = _inputs("gelu_bias_residual", K_PLANS["save"], None)
    upstream = {"D": torch.randn(M, N, dtype=torch.bfloat16)}
    for _ in range(3):
        _step(kernel, epilogue, options, a, weight, operands, upstream)
    (entry,) = api_module._TRAINING_CALLS.values()
    (prepared,) = entry.backwards.values()
    calls = []
    entry.backwards = {key: _Counting(prepared, calls) for key in entry.backwards}
    d = epicute.gemm(a, weight.t(), epilogue=epilogue, **options, **operands)
    (da,) = torch.autograd.grad(d, a, upstream["D"], create_graph=True)
    assert not calls and da.requires_grad


class _Counting:
    def __init__(self, inner, calls) -> None:
        self.inner, self.calls = inner, calls

    def __call__(self, *args):
        self.calls.append(1)
        return self.inner(*args)


def test_a_training_call_the_op_replays_still_leaves_its_record(kernel):
    """Where gemm's cached path forgot the forward (its table cleared) and the op implementation replays the one it
    kept, the training call is still remembered, with that forward."""
    inputs = _inputs("gelu_bias_residual", K_PLANS["save"], None)
    upstream: dict = {}
    _step(kernel, *inputs, upstream)
    api_module._TRAINING_CALLS.clear()
    api_module._PREPARED_CALLS.clear()
    _step(kernel, *inputs, upstream)
    (entry,) = api_module._TRAINING_CALLS.values()
    (kept,) = torch_op._OP_REPEATS.values()
    assert entry.forward is kept[1]


@pytest.mark.parametrize("name", ["gelu_bias_residual", "tanh_scaled_with_aux", "swiglu"])
def test_a_compiled_backward_replays_what_the_whole_path_would(kernel, monkeypatch, name):
    """A compiled training step's backward is one op (``epicute::gemm_backward``) whose implementation records its
    launches on the first call and replays them after, as an eager backward does: the same launches as the whole
    path for the same tensors, the same gradients."""
    monkeypatch.setattr(training, "_OP_BACKWARDS", {})
    torch._dynamo.reset()
    compiled = torch.compile(epicute.gemm, fullgraph=True, backend="aot_eager")
    inputs = _inputs(name, K_PLANS["save"], None)
    upstream: dict = {}
    for _ in range(2):
        _step(kernel, *inputs, upstream, call=compiled)
    (records,) = training._OP_BACKWARDS.values()
    assert [type(r) for r in records.values()] == [PreparedBackward]
    whole_path = []
    real_describe = api_module.describe_call
    monkeypatch.setattr(api_module, "describe_call", lambda *args: whole_path.append(1) or real_describe(*args))
    replayed, replayed_grads = _step(kernel, *inputs, upstream, call=compiled)
    assert not whole_path, "the compiled backward went through epicute.gemm's whole path"
    records.clear()
    api_module._PREPARED_CALLS.clear()
    whole, whole_grads = _step(kernel, *inputs, upstream, call=compiled)
    assert whole_path
    assert len(replayed) == len(whole) > 0
    _assert_replays_the_whole_path(inputs, upstream, (replayed, replayed_grads), (whole, whole_grads))
