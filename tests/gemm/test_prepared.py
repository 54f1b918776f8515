"""The cached path of ``epicute.gemm`` launches what the whole path would.

``epicute.gemm`` runs here on CPU tensors with the GPU check lifted and the compiled
kernel replaced by a recorder. For each case, a first call records its launch; a second
call with new tensors of the same signature (other values, other storage offsets, other
scalars) must take the cached path, and hand the kernel what the whole path hands it
for those tensors: the same tensors (views of the same storage at the same offsets, in
the same shapes and strides), fresh outputs and workspaces of the same shapes and
dtypes, and the same scalars.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import OutputError, ops
from epicute.epilogue.tracer import TraceMemo
from epicute.gemm import api as api_module
from epicute.gemm import launch as launch_module
from epicute.gemm import validate as validate_module
from epicute.runtime.buffers import per_call_buffers

M, N, K, L = 136, 144, 256, 3
E4 = torch.float8_e4m3fn


class Recorder:
    """Stands in for a compiled kernel: remembers what each launch is handed."""

    def __init__(self):
        self.calls = []

    def __call__(self, a, b, out3, epi_tensors, scalars, block_scales, split_workspace, max_active_clusters):
        self.calls.append(((a, b, out3, *epi_tensors, *block_scales), scalars))


def stub_kernel(monkeypatch) -> Recorder:
    """Lift the GPU check, record launches instead of running them, and start with no prepared calls."""
    recorder = Recorder()
    monkeypatch.setattr(validate_module, "check_on_one_hopper_gpu", lambda *named: None)
    monkeypatch.setattr(launch_module, "kernel_for", lambda plan, fusion=None: recorder)
    monkeypatch.setattr(api_module, "_PREPARED_CALLS", {})
    return recorder


@pytest.fixture
def kernel(monkeypatch):
    return stub_kernel(monkeypatch)


def rand(*shape, dtype=torch.bfloat16, offset=0):
    """Random values in a view ``offset`` elements (a multiple of 16 bytes) into a larger buffer."""
    n = torch.Size(shape).numel()
    return torch.randn(n + offset).to(dtype)[offset:].view(shape)


def _cases():
    def plain(offset):
        return (rand(M, K, offset=offset), rand(N, K, offset=offset).t()), {}

    def epilogue(offset):
        kw = {
            "epilogue": lambda acc, bias, scale, alpha, C: {
                "D": ops.gelu(alpha * acc * scale + bias) + C,
                "pre": acc + bias,
                "rs": ops.row_sum(acc),
                "am": ops.amax(acc),
            },
            "bias": rand(N, offset=offset),
            "scale": rand(M, 1, dtype=torch.float32, offset=offset),
            "alpha": 0.5 + offset,
            "C": rand(M, N, offset=offset),
            "out_dtypes": {"pre": torch.float32},
        }
        return (rand(M, K, offset=offset), rand(K, N, offset=offset)), kw

    def batched_out(offset):
        out = torch.full((L, M, N), float("nan"), dtype=torch.float16)
        kw = {"epilogue": lambda acc, bias: acc + bias, "bias": rand(L, N, offset=offset), "out": out}
        return (rand(L, M, K, dtype=torch.float16, offset=offset), rand(L, K, N, dtype=torch.float16)), kw

    def group_quant(offset):
        def epilogue(acc, bias):
            q, scales = ops.quantize_groups(ops.silu(acc + bias), E4)
            return {"D": q, "scales": scales, "rows": ops.row_sum(acc)}

        return (rand(M, K, offset=offset), rand(N, K, offset=offset).t()), {"epilogue": epilogue,
                                                                             "bias": rand(N, offset=offset)}

    def fp8(a_scale, b_scale):
        def case(offset):
            a, w = rand(M, K, dtype=E4, offset=16 * offset), rand(N, K, dtype=E4)
            return (a, w.t()), {"a_scale": a_scale(offset), "b_scale": b_scale(offset)}

        return case

    return {
        "plain": plain,
        "epilogue": epilogue,
        "batched_out": batched_out,
        "group_quant": group_quant,
        "fp8_float_scales": fp8(lambda o: 0.5 + o, lambda o: 2.0 - o),
        "fp8_tensorwise": fp8(lambda o: rand(1, dtype=torch.float32, offset=o), lambda o: torch.rand(())),
        "fp8_rowwise": fp8(lambda o: rand(M, 1, dtype=torch.float32, offset=o), lambda o: torch.rand(1, N)),
        "fp8_blockwise": fp8(
            lambda o: rand(K // 128, M, dtype=torch.float32, offset=4 * o).t(), lambda o: torch.rand(2, K // 128)
        ),
    }


def _described(kernel_args):
    """What a kernel launch is handed: per tensor its shape, strides, dtype, storage and offset; the scalars."""
    tensors, scalars = kernel_args
    return [
        (t.shape, t.stride(), t.dtype, t.untyped_storage().data_ptr(), t.storage_offset()) for t in tensors
    ], scalars


@pytest.mark.parametrize("name", list(_cases()))
def test_a_repeat_call_launches_what_the_whole_path_would(kernel, monkeypatch, name):
    make = _cases()[name]
    (a1, b1), kw1 = make(0)
    (a2, b2), kw2 = make(16)
    epicute.gemm(a1, b1, **kw1)
    assert len(api_module._PREPARED_CALLS) == 1, "the first call's launch was not recorded"

    whole_path = []
    real_describe = api_module.describe_call
    monkeypatch.setattr(api_module, "describe_call", lambda *args: whole_path.append(1) or real_describe(*args))
    epicute.gemm(a2, b2, **kw2)
    assert not whole_path, "the repeat call took the whole path"
    cached = kernel.calls[-1]

    monkeypatch.setattr(api_module, "_PREPARED_CALLS", {})
    epicute.gemm(a2, b2, **kw2)
    assert whole_path
    callers = {t.untyped_storage().data_ptr() for t in _tensors(a2, b2, *kw2.values())}
    got, want = _described(cached), _described(kernel.calls[-1])
    assert got[1] == want[1], "scalars differ"
    assert len(got[0]) == len(want[0])
    for g, w in zip(got[0], want[0]):
        if w[3] in callers:  # the caller's tensor or a view of one: the very same view
            assert g == w
        else:  # allocated for the call: a new tensor of the same shape, strides and dtype
            assert g[3] not in callers and g[:3] == w[:3]


@pytest.mark.parametrize("buffers", ["kept", "per_call"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_blockwise"])
def test_a_zero_k_repeat_is_replayed_over_zero_operands(kernel, monkeypatch, buffers, fp8):
    """K = 0 (a backward's gradient pass, made anew every step): A and B stand in as zeros one k-tile long (and
    blockwise scales as ones), kept between eager calls and allocated per call where buffers are not kept (a
    compiled graph's op calls, epicute.runtime.buffers). Either way a repeat call takes the cached path and hands the
    kernel tensors of the whole path's layouts and values; per call, new ones each time."""
    run = epicute.gemm if buffers == "kept" else per_call_buffers(epicute.gemm)
    dtype = E4 if fp8 else torch.bfloat16

    def call():
        a, w = torch.empty(M - 3, 0, dtype=dtype), torch.empty(N, 0, dtype=dtype)
        scales = {"a_scale": torch.ones(M - 3, 0), "b_scale": torch.ones(2, 0)} if fp8 else {}
        c = rand(M - 3, N)
        run(a, w.t(), epilogue=lambda acc, c: {"D": acc + c, "cs": ops.col_sum(acc + c)}, c=c, **scales)
        return kernel.calls[-1][0], c

    call()
    assert len(api_module._PREPARED_CALLS) == 1, "the first call's launch was not recorded"
    whole_path = []
    real_describe = api_module.describe_call
    monkeypatch.setattr(api_module, "describe_call", lambda *args: whole_path.append(1) or real_describe(*args))
    cached, c = call()
    assert not whole_path, "the repeat call took the whole path"
    monkeypatch.setattr(api_module, "_PREPARED_CALLS", {})
    whole, _ = call()
    assert whole_path
    stand_ins = 4 if fp8 else 2  # A, B (and their scales) stand in for K = 0
    for i in (0, 1, *range(len(whole) - stand_ins + 2, len(whole))):
        got, want = cached[i], whole[i]
        assert (got.shape, got.stride(), got.dtype, got.storage_offset()) == (
            want.shape, want.stride(), want.dtype, want.storage_offset())  # fmt: skip
        assert torch.equal(got.float(), torch.full(got.shape, 1.0 if i > 1 else 0.0))
        same = got.untyped_storage().data_ptr() == want.untyped_storage().data_ptr()
        assert same == (buffers == "kept" and i < 2), "zeros kept only by eager calls, scales of ones never"
    assert any(t.untyped_storage().data_ptr() == c.untyped_storage().data_ptr() for t in cached), "c not handed"


def _tensors(*values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            yield from _tensors(*v.values())


def test_a_new_signature_takes_the_whole_path(kernel):
    a, b = rand(M, K), rand(K, N)
    epicute.gemm(a, b)
    epicute.gemm(rand(M + 8, K), b)  # another shape
    epicute.gemm(a.to(torch.float16), b.to(torch.float16))  # another dtype
    epicute.gemm(rand(K, M).t(), b)  # another layout
    assert len(api_module._PREPARED_CALLS) == 4


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_a_plain_repeat_call_allocates_d_as_the_whole_path_does(kernel, monkeypatch, out_dtype):
    """The direct path allocates D from A (``a.new_empty``): out_dtype's dtype where it is not A's, never A's
    tensor type (a Parameter A gives a plain D)."""
    b = rand(N, K).t()
    want = epicute.gemm(rand(M, K), b, out_dtype=out_dtype)
    monkeypatch.setattr(api_module, "describe_call", None)  # the whole path would fail from here on
    a = torch.nn.Parameter(rand(M, K, offset=8), requires_grad=False)
    got = epicute.gemm(a, b, out_dtype=out_dtype)
    (recorded,) = api_module._PREPARED_CALLS.values()
    assert type(recorded).__name__ == "_DirectGemmCall" and kernel.calls[-1][0][2] is got
    assert type(got) is torch.Tensor and (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert got.dtype == (out_dtype or torch.bfloat16) and got.device == a.device and not got.requires_grad


def test_a_lambda_written_in_the_call_is_traced_once(kernel, monkeypatch):
    traced = []
    real_prepare = api_module.prepare
    monkeypatch.setattr(api_module, "prepare", lambda request: traced.append(1) or real_prepare(request))
    monkeypatch.setattr(api_module, "_PREPARED", TraceMemo())
    for scale in (0.5, 1.5):  # a new lambda object each time, the same code
        epicute.gemm(rand(M, K), rand(K, N), epilogue=lambda acc, s: ops.relu(acc * s), s=scale)
    assert len(traced) == 1
    assert len(kernel.calls) == 2 and kernel.calls[0][1] == (0.5,) and kernel.calls[1][1] == (1.5,)


def test_out_overlapping_an_input_is_refused_on_the_cached_path(kernel):
    buf = rand(2 * M, max(K, N))
    a, out = buf[:M, :K], buf[M:, :N]
    b = rand(K, N)
    epicute.gemm(a, b, out=out)
    with pytest.raises(OutputError, match="shares memory with a"):
        epicute.gemm(buf[M:, :K], b, out=out)  # same signature, but out is a's memory now


def test_one_scale_tensor_passed_twice_is_replayed_only_for_a_call_that_does_the_same(kernel):
    a, w = rand(M, K, dtype=E4), rand(N, K, dtype=E4)
    one, other = torch.rand(()), torch.rand(())
    epicute.gemm(a, w.t(), a_scale=one, b_scale=one)
    (recorded,) = api_module._PREPARED_CALLS.values()
    assert recorded._aliases == ((3, 4),)
    epicute.gemm(a, w.t(), a_scale=one, b_scale=other)  # the whole path: b's scale is its own tensor now
    assert kernel.calls[-1][0][-1].untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


def test_a_recorded_launch_keeps_no_tensor_alive(kernel):
    a, b, bias = rand(M, K), rand(K, N), rand(N)
    epicute.gemm(a, b, epilogue=lambda acc, bias: {"D": acc + bias, "rs": ops.row_sum(acc)}, bias=bias)
    (recorded,) = api_module._PREPARED_CALLS.values()
    held = [t for t in recorded._launch.tensors() if isinstance(t, torch.Tensor)]
    assert not held, "the record would keep the first call's inputs, outputs and workspaces in memory"
    assert recorded._launch.scalars == ()


def _op_args(offset, k=K):
    """The op's arguments of an epilogue call with operands and a scalar (as a compiled graph passes them)."""
    from epicute.gemm.torch_op import op_arguments

    kw = _cases()["epilogue"](offset)[1]
    a, b = rand(M, k, offset=offset), rand(k, N, offset=offset)
    epilogue, out_dtypes = kw.pop("epilogue"), kw.pop("out_dtypes")
    args = op_arguments(a, b, epilogue=epilogue, out=None, out_dtype=None, out_dtypes=out_dtypes, outs=None,
                        a_scale=None, b_scale=None, backend="kernel", config=None, operands=kw)  # fmt: skip
    return a, b, args


@pytest.mark.parametrize("buffers", ["kept", "per_call"])
@pytest.mark.parametrize("k", [K, 0], ids=["mainloop", "zero_k"])
def test_the_ops_repeat_call_replays_what_the_whole_path_would(kernel, monkeypatch, buffers, k):
    """The op's implementation (what a compiled graph calls every step) replays a repeat call of an epilogue from the
    forward it recorded, without epicute.gemm: the kernel gets what the whole path hands it, and the outputs come in
    the op's order. Another backend, a tensor recording a gradient, or discovery take the whole path."""
    from epicute.gemm import torch_op
    from epicute.runtime.compile import DISCOVERING

    impl = torch_op.gemm_op if buffers == "kept" else per_call_buffers(torch_op.gemm_op)
    monkeypatch.setattr(torch_op, "_OP_REPEATS", {})
    a, b, args = _op_args(0, k)
    impl(a, b, args.tensors, args.scalars, args.epilogue, args.spec)
    assert len(torch_op._OP_REPEATS) == 1, "the first call's forward was not remembered"

    whole_path = []
    real_gemm = api_module.gemm
    monkeypatch.setattr(api_module, "gemm", lambda *a, **kw: whole_path.append(1) or real_gemm(*a, **kw))
    a, b, args = _op_args(16, k)
    call = (a, b, args.tensors, args.scalars, args.epilogue, args.spec)
    replayed = impl(*call)
    assert not whole_path, "the repeat call took the whole path"
    cached = kernel.calls[-1]
    monkeypatch.setattr(torch_op, "_OP_REPEATS", {})
    whole = impl(*call)
    assert whole_path
    assert [(t.shape, t.dtype) for t in replayed] == [(t.shape, t.dtype) for t in whole]
    callers = {t.untyped_storage().data_ptr() for t in _tensors(a, b, *args.tensors)}
    got, want = _described(cached), _described(kernel.calls[-1])
    assert got[1] == want[1], "scalars differ"
    for g, w in zip(got[0], want[0], strict=True):
        assert g == w if w[3] in callers else (g[3] not in callers and g[:3] == w[:3])

    for detour in ("reference", "grad", "discovery"):
        whole_path.clear()
        grad = torch.enable_grad() if detour == "grad" else torch.no_grad()
        a_grad = a.detach().requires_grad_(detour == "grad")
        with epicute.use_backend("reference" if detour == "reference" else "kernel"), grad:
            if detour == "discovery":
                DISCOVERING.set()
            try:
                impl(a_grad, *call[1:])
            finally:
                DISCOVERING.clear()
        assert whole_path, f"{detour}: the repeat call was replayed"
