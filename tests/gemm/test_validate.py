"""Argument checking before launch: one test per bad input, plus the accepted layouts.

``check_gemm_args(..., require_cuda=False)`` reaches every check past the device
ones with CPU tensors; ``epicute.gemm`` itself must stop at the device check.
"""

from __future__ import annotations

import re

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


# --- gradients: what has none is refused before anything launches; the rest trains (tests/gemm/test_autograd.py)


def _needs_grad(t: torch.Tensor) -> torch.Tensor:
    return t.requires_grad_()


def _fp8(*shape):
    return rand(*shape).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: epicute.gemm(_needs_grad(rand(16, 16)), rand(16, 16), out=rand(16, 16)), "out=/outs= were given"),
        (lambda: epicute.gemm(_needs_grad(rand(16, 16)), rand(16, 16), epilogue=lambda acc: {"D": acc, "e": acc * 2},
                              outs={"e": rand(16, 16)}), "out=/outs= were given"),
        (lambda: epicute.gemm(_fp8(16, 128), _fp8(16, 128).t(), a_scale=torch.ones(1, requires_grad=True),
                              b_scale=1.0, epilogue=lambda acc, bias: acc + bias, bias=_needs_grad(rand(16))),
         "a_scale requires grad: fp8 dequantization scales take no gradient"),
        (lambda: epicute.gemm(_needs_grad(rand(16, 128).to(torch.float8_e4m3fn)), _fp8(16, 128).t(), a_scale=1.0,
                              b_scale=1.0), "a is an fp8 tensor that requires grad"),
    ],
    ids=["out", "outs", "fp8-scale", "fp8-input"],
)  # fmt: skip
def test_gradients_through_what_has_none_are_refused_before_anything_else(call, words):
    """Refused before the device check (CPU tensors reach it); the same call under torch.no_grad() fails on the
    device instead, which shows that nothing but the gradient refused it."""
    with pytest.raises(epicute.GradientError, match=re.escape(words)):
        call()
    with torch.no_grad(), pytest.raises(DeviceError, match="cuda"):
        call()


def test_calls_needing_gradients_go_through_the_differentiable_op(monkeypatch):
    """A call autograd records is never served by the cached path (whose launch records no backward): it goes to
    the op that carries the backward; inference keeps the cached path."""
    from epicute.gemm import api

    a, b = _needs_grad(rand(16, 16)), rand(16, 16)
    key = (a.shape, a.stride(), a.dtype, a.get_device(), b.shape, b.stride(), b.dtype, b.get_device(), None)

    class Recorded:
        def plain(self, a, b):
            return "launched"

    monkeypatch.setitem(api._PREPARED_CALLS, key, Recorded())
    monkeypatch.setattr(api, "_differentiable", lambda *args: "differentiable")
    assert epicute.gemm(a, b) == "differentiable"
    assert epicute.gemm(rand(16, 16), b, epilogue=lambda acc, s: acc * s, s=_needs_grad(rand(16))) == "differentiable"
    with torch.no_grad():
        assert epicute.gemm(a, b) == "launched"  # inference keeps the cached path
    assert epicute.gemm(a.detach(), b) == "launched"


def test_prepared_calls_refuse_gradients():
    from epicute.gemm.prepared import PreparedGemmCall, call_signature

    a, b = rand(16, 16), rand(16, 16)
    prepared = PreparedGemmCall(call_signature((a, b, None, None, None)), (), (), whole=lambda *args, **kw: "ran")
    assert prepared(a, b) == "ran"
    with pytest.raises(epicute.GradientError, match=r"^b requires grad, but a prepared call .* call epicute.gemm"):
        prepared(a, _needs_grad(rand(16, 16)))
    with torch.no_grad():
        assert prepared(a, _needs_grad(rand(16, 16))) == "ran"


def test_the_reference_backend_keeps_gradients():
    a = _needs_grad(rand(16, 16))
    d = epicute.gemm(a, rand(16, 16), epilogue=lambda acc, s: acc * s, s=2.0, backend="reference")
    assert d.requires_grad and d.grad_fn is not None
    d.float().sum().backward()
    assert a.grad is not None


# --- malformed arguments get typed errors naming them (issue 56, item 6) ----------------------------------------


def ref(*args, **kwargs):
    return epicute.gemm(*args, backend="reference", **kwargs)


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("tile_n=128", r"config='tile_n=128' \(str\): pass a dict of GemmConfig fields"),
        ([("tile_n", 128)], r"config=\[\('tile_n', 128\)\] \(list\): pass a dict"),
        ({"tile_n": "128"}, r"config\['tile_n'\]='128' \(str\): GemmConfig.tile_n takes a positive int"),
        ({"cluster_m": "2"}, r"config\['cluster_m'\]='2'"),
        ({"split_k": "2"}, r"config\['split_k'\]='2'"),
        ({"epi_tile": 64}, r"config\['epi_tile'\]=64 \(int\): GemmConfig.epi_tile takes a tuple of 2 positive ints"),
        ({"tile_n": [128]}, r"config\['tile_n'\]=\[128\]"),
        ({"tile_m": 0}, r"config\['tile_m'\]=0"),
        ({"swizzle": 0}, r"config\['swizzle'\]=0"),
        ({"persistent": "yes"}, r"config\['persistent'\]='yes' \(str\): GemmConfig.persistent takes True or False"),
        ({1: 2}, r"unknown field 1"),
        ({"tile": 128}, r"unknown field 'tile'; did you mean"),
    ],
)
def test_malformed_configs_are_config_errors_in_every_entry(config, match):
    a, b = rand(16, 32), rand(32, 64)
    with pytest.raises(epicute.ConfigError, match=match):
        ref(a, b, config=config)
    with pytest.raises(epicute.ConfigError, match=match):
        epicute.explain(meta(256, 256), meta(256, 256), config=config, file=None)
    with pytest.raises(epicute.ConfigError, match=match):
        epicute.explain(meta(256, 256), meta(256, 256), epilogue=lambda acc: acc, config=config, file=None)


def test_config_none_values_and_lists_are_taken():
    plan = epicute.explain(meta(256, 256), meta(256, 256), config={"tile_n": None, "epi_tile": [128, 32]}, file=None)
    assert plan.config.epi_tile == (128, 32)


@pytest.mark.parametrize("name", ["a", "b"])
def test_operands_may_be_named_like_the_inputs(name):
    """``a`` and ``b`` are positional-only: an operand of either name reaches the epilogue."""
    a, b, v = rand(16, 32), rand(32, 64), rand(64)
    got = ref(a, b, epilogue=eval(f"lambda acc, {name}: acc + {name}"), **{name: v})
    want = ref(a, b, epilogue=lambda acc, bias: acc + bias, bias=v)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["out", "config", "a_scale", "b_scale", "outs", "out_dtype", "backend", "gated",
                                  "tune", "epilogue", "target", "file"])  # fmt: skip
def test_operand_named_like_a_gemm_parameter_is_refused_naming_the_clash(name):
    fn = eval(f"lambda acc, {name}: acc * {name}")
    match = rf"takes an operand named '{name}', which is epicute.gemm's own parameter {name}=.*Rename"
    with pytest.raises(epicute.EpilogueError, match=match):
        ref(rand(16, 32), rand(32, 64), epilogue=fn)
    with pytest.raises(epicute.EpilogueError, match=match):
        epicute.explain(meta(64, 64), meta(64, 64), epilogue=fn, file=None)
    if name == "out":  # passing it binds to out=: the clash is named, not out's shape
        with pytest.raises(epicute.EpilogueError, match=match):
            ref(rand(16, 32), rand(32, 64), epilogue=fn, out=rand(64))
    gated = eval(f"lambda gate, up, {name}: gate * up")
    with pytest.raises(epicute.EpilogueError, match=match):
        ref(rand(16, 32), rand(32, 64), gated=True, epilogue=gated)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"epilogue": lambda acc, bias: acc + bias, "bias": meta(64)}, "operand 'bias'"),
        ({"epilogue": lambda acc, t: acc + t, "t": meta(16, 64)}, "operand 't'"),
        ({"epilogue": lambda acc, s: acc * s, "s": meta(1)}, "operand 's'"),
        ({"epilogue": lambda acc, s: acc * s, "s": epicute.Scalar(meta(1))}, "operand 's'"),
        ({"epilogue": lambda acc: {"D": acc, "p": acc}, "outs": {"p": meta(16, 64)}}, r"outs\['p'\]"),
    ],
)
def test_meta_tensors_beside_cpu_inputs_are_refused_on_the_reference(kwargs, name):
    with pytest.raises(DeviceError, match=rf"^{name} is a meta tensor: backend='reference' computes values"):
        ref(rand(16, 32), rand(32, 64), **kwargs)


def test_meta_scalar_operands_plan_in_explain():
    plan = epicute.explain(meta(64, 64), meta(64, 64), epilogue=lambda acc, s: acc * s, s=meta(1, dtype=torch.float32),
                           file=None)  # fmt: skip
    assert plan.config.tile_m == 128


def test_explain_refuses_inputs_on_two_devices():
    """explain plans for tensors of any device, meta included, but of one: a CPU ``a`` beside a meta ``b`` (or the
    reverse) is refused as the kernel path refuses two devices (check_on_one_hopper_gpu's wording). The grouped
    GEMM's and attention's explain do the same; inputs of one device, and meta scalars beside CPU inputs, plan."""
    i32 = torch.int32
    cases = [
        (lambda: epicute.explain(rand(64, 64), meta(64, 64), file=None), "a on cpu, b on meta"),
        (lambda: epicute.explain(meta(64, 64), rand(64, 64), file=None), "a on meta, b on cpu"),
        (lambda: epicute.explain_grouped(rand(64, 64), meta(2, 64, 32), torch.tensor([32, 64], dtype=i32), file=None),
         "a on cpu, b on meta"),
        (lambda: epicute.explain_grouped(meta(64, 64), rand(2, 64, 32), meta(2, dtype=i32), file=None),
         "a on meta, b on cpu"),
        (lambda: epicute.explain_attention(rand(1, 128, 2, 64), meta(1, 128, 2, 64), meta(1, 128, 2, 64), file=None),
         "q on cpu, k on meta, v on meta"),
        (lambda: epicute.explain_attention(meta(1, 128, 2, 64), meta(1, 128, 2, 64), rand(1, 128, 2, 64), file=None),
         "q on meta, k on meta, v on cpu"),
    ]  # fmt: skip
    for explain, where in cases:
        with pytest.raises(DeviceError, match=rf"^{where}; move them to one device$"):
            explain()
    assert epicute.explain(rand(64, 64), rand(64, 64), file=None).problem.m == 64
    assert epicute.explain(meta(64, 64), meta(64, 64), file=None).problem.m == 64
    plan = epicute.explain(rand(64, 64), rand(64, 64), epilogue=lambda acc, s: acc * s,
                           s=meta(1, dtype=torch.float32), file=None)  # fmt: skip
    assert plan.problem.m == 64
    offsets = torch.tensor([32, 64], dtype=i32)
    assert epicute.explain_grouped(rand(64, 64), rand(2, 64, 32), offsets, file=None).problem.groups == 2
    assert epicute.explain_attention(*(meta(1, 128, 2, 64),) * 3, file=None) is not None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"out_dtypes": [torch.float32]}, OutputError, r"out_dtypes is a list; pass a dict by output name"),
        ({"outs": [rand(16, 64)]}, OutputError, r"outs is a list; pass a dict by output name"),
        ({"outs": {"p": 1.0}}, OutputError, r"outs\['p'\] is a float; pass a preallocated tensor"),
        ({"outs": {"p": rand(3, 3)}}, OutputError, r"outs\['p'\] has shape \(3, 3\); the epilogue writes \(16, 64\)"),
        ({"gated": "yes"}, epicute.ConfigError, r"gated='yes': pass True or False"),
        ({"tune": "yes"}, epicute.ConfigError, r"tune='yes': pass True or False"),
    ],
)
def test_malformed_output_arguments_and_flags(kwargs, error, match):
    with pytest.raises(error, match=match):
        ref(rand(16, 32), rand(32, 64), epilogue=lambda acc: {"D": acc, "p": acc}, **kwargs)


def test_explain_file_must_be_a_stream():
    with pytest.raises(epicute.ConfigError, match=r"file=3: pass 'stdout'"):
        epicute.explain(meta(64, 64), meta(64, 64), file=3)


def test_an_epilogue_raising_while_traced_is_an_epilogue_error():
    def broken(acc):
        return acc * (1 / 0)

    with pytest.raises(epicute.EpilogueError, match=r"epilogue 'broken' raised ZeroDivisionError while it was traced"):
        ref(rand(16, 32), rand(32, 64), epilogue=broken)


def test_explain_takes_a_meta_out():
    """Meta tensors have no memory (every data pointer is 0): an ``out`` beside meta inputs does not overlap them."""
    plan = epicute.explain(meta(64, 64), meta(64, 64), out=meta(64, 64), file=None)
    assert plan.problem.m == 64


# --- outputs that share memory, out_dtypes['D'], strides TMA cannot store (issue 56, second pass) ------------------

PAIR = lambda acc: {"D": acc, "p": acc}


@pytest.mark.parametrize("entry", ["reference", "explain"])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"out": rand(1, 64).expand(16, 64)}, r"^out has shape \(16, 64\) and strides \(0, 1\): some of its"),
        ({"out": rand(184).as_strided((16, 64), (8, 1))}, r"^out has shape \(16, 64\) and strides \(8, 1\): some"),
        ({"epilogue": PAIR, "outs": {"p": rand(1, 64).expand(16, 64)}}, r"^outs\['p'\] has shape \(16, 64\) and"),
        ({"epilogue": PAIR, "outs": {"p": rand(64, 16).t()}}, r"^outs\['p'\] has strides \(1, 16\); it must be row"),
        ({"epilogue": PAIR, "outs": {"p": rand(16, 128)[:, ::2]}}, r"^outs\['p'\] has strides \(128, 2\); it must"),
        ({"epilogue": PAIR, "outs": {"q": rand(16, 64)}}, r"^outs names \['q'\], which the epilogue does not return"),
        ({"epilogue": PAIR, "outs": {"p": rand(16, 63)}}, r"^outs\['p'\] has shape \(16, 63\); the epilogue writes"),
        ({"epilogue": PAIR, "out_dtypes": {"D": torch.int8}}, r"^out_dtypes\['D'\]=torch.int8; D's dtype is one of"),
        ({"epilogue": PAIR, "out_dtype": BF16, "out_dtypes": {"D": torch.float32}},
         r"^out_dtype=torch.bfloat16 but out_dtypes\['D'\]=torch.float32; D has one dtype"),
    ],
)
def test_outputs_the_kernel_could_not_store_are_refused_in_every_entry(entry, kwargs, match):
    # Before: an expanded out raised torch's RuntimeError from the reference's copy (and would race in the kernel);
    # explain planned bad outs without a word; out_dtypes['D'] was reported as out_dtype.
    error = epicute.DtypeError if "int8" in match else OutputError
    a, b = rand(16, 32), rand(32, 64)
    with pytest.raises(error, match=match):
        if entry == "reference":
            ref(a, b, **kwargs)
        else:
            epicute.explain(a, b, file=None, **kwargs)


@pytest.mark.parametrize("which", ["a", "b", "out", "operand"])
def test_outs_sharing_memory_with_an_input_or_out_are_refused(which):
    # Before: accepted on the reference and by explain (the kernel would read an input while writing outs, or
    # store D and an aux tile into the same memory).
    a, b, out, bias = rand(16, 64), rand(64, 64), rand(16, 64), rand(16, 64)
    aliased = {"a": a, "b": b[:16], "out": out, "operand": bias}[which]
    label = {"operand": "operand 'bias'"}.get(which, which)
    with pytest.raises(OutputError, match=rf"^outs\['p'\] shares memory with {label}"):
        ref(a, b, epilogue=lambda acc, bias: {"D": acc + bias, "p": acc}, bias=bias, out=out, outs={"p": aliased})


def test_unit_stride_is_required_along_the_contiguous_dimension():
    # TMA reads the contiguous dimension with unit stride: a tile operand with a step of 2 along N passed the
    # stride check (only the other strides were looked at) and would have been read as contiguous.
    from epicute.gemm.validate import _check_tma_strides

    tile = rand(1, 16, 128)[..., ::2]
    with pytest.raises(AlignmentError, match=r"^operand 'r' has strides \(2048, 128, 2\): its dimension N must be "
                                             r"contiguous \(stride 1\) for TMA"):  # fmt: skip
        _check_tma_strides(tile, "operand 'r'", contiguous_dim=2, dims="LMN")


def test_the_cached_path_refuses_outs_sharing_memory(monkeypatch):
    """A repeat call with ``outs`` skips the full checks: outs aliasing an input there must still be refused (the
    fake prepared call stands for one recorded on a GPU)."""
    from epicute.gemm import api

    epi = lambda acc: {"D": acc, "p": acc}
    a, b, p = rand(16, 16), rand(16, 16), rand(16, 16)
    fast = api._fast_key(a, b, None, (None, None), epi, {}, {"p": p}, None, None, None, False)

    class Recorded:
        def fits(self, sources):
            return True

        def replay(self, sources):
            return "launched"

    monkeypatch.setitem(api._PREPARED_CALLS, fast.key, Recorded())
    assert epicute.gemm(a, b, epilogue=epi, outs={"p": p}) == "launched"
    with pytest.raises(OutputError, match=r"^outs\['p'\] shares memory with a"):
        epicute.gemm(a, b, epilogue=epi, outs={"p": a})


# --- D's rows, checked once the epilogue has settled D's dtype --------------


def test_epilogue_cast_to_fp32_settles_ds_rows():
    """N = 12: a bf16 D's rows (24 bytes) would not be 16-byte aligned, the fp32 D the epilogue casts to (48) are
    (B column-major, ``w.t()``: its own rows are K long)."""
    a, b = rand(33, 40), rand(12, 40).t()
    with epicute.use_backend("reference"):
        d = epicute.gemm(a, b, epilogue=lambda acc: epicute.ops.cast(acc * 2.0, torch.float32))
    expected = (a.double() @ b.double()) * 2.0
    assert d.dtype == torch.float32
    assert ((d.double() - expected).norm() / expected.norm()).item() < 1e-5


def test_epilogue_quantize_to_fp8_checks_ds_rows_in_fp8():
    """N = 24: bf16 rows (48 bytes) are aligned, e4m3 rows (24) are not: refused naming the fp8 dtype, by gemm and
    explain alike."""
    a, b = rand(32, 48), rand(48, 24)
    fp8_d = lambda acc: epicute.ops.cast(acc, torch.float8_e4m3fn)
    with epicute.use_backend("reference"), pytest.raises(AlignmentError, match=r"N=24 .*float8_e4m3fn.*pad N to 32"):
        epicute.gemm(a, b, epilogue=fp8_d)
    meta = dict(device="meta", dtype=BF16)
    with pytest.raises(AlignmentError, match=r"N=24 .*float8_e4m3fn"):
        epicute.explain(torch.empty(32, 48, **meta), torch.empty(48, 24, **meta), epilogue=fp8_d, file=None)
