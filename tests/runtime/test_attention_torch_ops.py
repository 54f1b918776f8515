"""``epicute::attention`` as a torch custom op: fake shapes, opcheck, torch.compile tracing.

On the CPU the op runs on meta tensors (its meta kernel is the fake
implementation) and under FakeTensorMode; and end to end with the op's eager
call switched to ``backend="reference"``, which checks that everything the
call needs (causal, softmax_scale, config, the hooks' keys and operands)
survives the trip through the graph. The GPU test compares the compiled kernel
path with eager.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import epicute
from epicute import ops
from epicute.attention import api as attention_api
from epicute.epilogue.score_mod import ScoreMod
from epicute.errors import ConfigError, EpilogueError
from epicute.runtime.torch_ops import register_epilogue, register_score_mod, registered_epilogue
from tests.conftest import recording_backend, rel_err
from tests.runtime.test_attention_cache import gated, softcap_30, softcap_alibi


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def spec(tensors=(), scalars=(), causal=False, softmax_scale=None, config=None, pins=None) -> str:
    return json.dumps(
        {"tensors": list(tensors), "scalars": list(scalars), "pins": pins or {}, "causal": causal,
         "softmax_scale": softmax_scale, "config": config or {}},
        sort_keys=True,
    )  # fmt: skip


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim): MHA, GQA 4:1 with seqlen_q < seqlen_k, MQA with >.
SHAPES = [(2, 17, 17, 4, 4, 64), (1, 129, 1000, 8, 2, 128), (3, 1000, 40, 8, 1, 256)]
SHAPE_IDS = ["mha", "gqa-sq<sk", "mqa-sq>sk"]


def op_args(b, sq, sk, hq, hkv, d, hooks=False, dtype=torch.bfloat16):
    q, k, v = meta(b, sq, hq, d, dtype=dtype), meta(b, sk, hkv, d, dtype=dtype), meta(b, sk, hkv, d, dtype=dtype)
    if not hooks:
        return (q, k, v, [], [], "", "", spec(causal=True), None, None, None, None)
    operands = [torch.randn(d), meta(b, sq, hq, d), meta(hq, dtype=torch.float32)]
    return (
        q, k, v, operands, [30.0], register_score_mod(softcap_alibi), register_epilogue(gated),
        spec(["bias", "gate", "slopes"], ["cap"], softmax_scale=0.1), None, None, None, None,
    )  # fmt: skip


@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "hooks"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fake_outputs_have_eager_shapes_dtypes_and_strides(shape, hooks):
    b, sq, _, hq, _, d = shape
    o, lse = torch.ops.epicute.attention(*op_args(*shape, hooks=hooks, dtype=torch.float16))
    assert o.shape == (b, sq, hq, d) and o.dtype == torch.float16 and o.is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_fake_output_is_contiguous_for_a_strided_q():
    q = meta(2, 8, 17, 64).transpose(1, 2)  # (2, 17, 8, 64) with heads outermost, as eager accepts it
    kv = meta(2, 9, 8, 64)
    o, lse = torch.ops.epicute.attention(q, kv, kv, [], [], "", "", spec(), None, None, None, None)
    assert o.shape == (2, 17, 8, 64) and o.stride() == (17 * 8 * 64, 8 * 64, 64, 1)
    assert lse.shape == (2, 8, 17)


@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "hooks"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=SHAPE_IDS[:2])
def test_opcheck_on_meta_tensors(shape, hooks):
    torch.library.opcheck(torch.ops.epicute.attention.default, op_args(*shape, hooks=hooks))


@pytest.mark.parametrize("scalars", [[], [30.0]], ids=["no-scalars", "scalars"])
def test_autograd_runs_the_backward_op_with_the_inputs_structure(scalars):
    # On meta tensors the fakes run: this checks the registered autograd end to end (its saved
    # tensors and the structure of its result, which autograd compares with the op's inputs).
    q = meta(2, 17, 4, 64).requires_grad_()
    k, v = meta(2, 33, 2, 64).requires_grad_(), meta(2, 33, 2, 64).requires_grad_()
    slopes = torch.ones(4)
    o, lse = torch.ops.epicute.attention(
        q, k, v, [slopes], scalars, "", "", spec(["slopes"], ["cap"] if scalars else []), None, None, None, None
    )
    dq, dk, dv = torch.autograd.grad((o, lse), (q, k, v), (torch.empty_like(o), torch.empty_like(lse)))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.device.type == "meta" and dk.dtype == k.dtype


def test_opcheck_backward_on_meta_tensors():
    q, k, v = meta(2, 17, 4, 64), meta(2, 33, 2, 64), meta(2, 33, 2, 64)
    lse = meta(2, 4, 17, dtype=torch.float32)
    torch.library.opcheck(
        torch.ops.epicute.attention_backward.default,
        (q, k, v, q, lse, q, None, [], [], "", spec(causal=True), None, None),
    )


def test_score_mod_keys_are_semantic_and_hold_score_mods():
    key = register_score_mod(softcap_alibi)
    assert key.startswith("softcap_alibi:")
    assert register_score_mod(softcap_alibi.fn) == key  # the object or its plain function: one key
    assert isinstance(registered_epilogue(key), ScoreMod)
    assert isinstance(registered_epilogue(register_score_mod(softcap_30)), ScoreMod)

    def softcap_31(s, b, h, q_idx, kv_idx):
        return 31.0 * ops.tanh(s / 31.0)

    assert register_score_mod(softcap_31) != register_score_mod(softcap_30)
    # The indices are index leaves of a score_mod, not operands as they would be in an epilogue.
    assert register_epilogue(softcap_30) != register_score_mod(softcap_30)


def f_plain(q, k, v):
    return epicute.attention(q, k, v, causal=True) * 2


def f_lse(q, k, v):
    o, lse = epicute.attention(q, k, v, softmax_scale=0.2, return_lse=True)
    return o.float() + 1, lse


def f_hooks(q, k, v, slopes, gate, bias):
    return epicute.attention(
        q, k, v, causal=True, score_mod=softcap_alibi, slopes=slopes, cap=30.0, epilogue=gated, gate=gate, bias=bias,
        return_lse=True,
    )  # fmt: skip


#: Valid for every head_dim (tile_m pinned too), as pins are checked on both backends.
PINS = {"tile_m": 128, "tile_n": 64, "mma_atoms_mn": (2, 1)}


def f_plain_fn_hook(q, k, v):
    return epicute.attention(q, k, v, score_mod=softcap_30, config=PINS)


def f_out(q, k, v, out):
    return epicute.attention(q, k, v, out=out)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_torch_compile_fullgraph_traces_through_attention_on_meta(backend, shape):
    torch._dynamo.reset()
    b, sq, sk, hq, hkv, d = shape
    q, k, v = meta(b, sq, hq, d), meta(b, sk, hkv, d), meta(b, sk, hkv, d)
    o = torch.compile(f_plain, fullgraph=True, backend=backend)(q, k, v)
    assert o.shape == (b, sq, hq, d) and o.dtype == torch.bfloat16
    o, lse = torch.compile(f_lse, fullgraph=True, backend=backend)(q, k, v)
    assert o.shape == (b, sq, hq, d) and o.dtype == torch.float32
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    o, lse = torch.compile(f_hooks, fullgraph=True, backend=backend)(
        q, k, v, meta(hq, dtype=torch.float32), meta(b, sq, hq, d), meta(d)
    )
    assert o.shape == (b, sq, hq, d) and o.stride() == q.stride() and lse.shape == (b, hq, sq)
    assert torch.compile(f_plain_fn_hook, fullgraph=True, backend=backend)(q, k, v).shape == q.shape
    out = meta(b, sq, hq, d)
    assert torch.compile(f_out, fullgraph=True, backend=backend)(q, k, v, out).shape == q.shape


def test_dynamic_sizes_trace_once():
    backend, frames = recording_backend()

    f = torch.compile(f_hooks, fullgraph=True, backend=backend, dynamic=True)
    # Sizes distinct within a call (dynamo's duck sizing would otherwise tie equal ones together).
    for b, sq, sk in [(3, 17, 40), (5, 100, 33), (6, 1000, 999)]:
        q, kv = meta(b, sq, 8, 128), meta(b, sk, 4, 128)
        o, lse = f(q, kv, kv, meta(8, dtype=torch.float32), meta(b, sq, 8, 128), meta(128))
        assert o.shape == (b, sq, 8, 128) and lse.shape == (b, 8, sq)
    assert len(frames) == 1


def test_torch_compile_under_fake_tensor_mode_records_one_op_per_call():
    backend, graphs = recording_backend()

    with FakeTensorMode():
        q = torch.empty(2, 129, 8, 128, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(2, 1000, 2, 128, dtype=torch.bfloat16, device="cuda")
        slopes = torch.empty(8, device="cuda")
        bias = torch.empty(128, device="cuda")
        o, lse = torch.compile(f_hooks, fullgraph=True, backend=backend)(q, kv, kv, slopes, torch.empty_like(q), bias)
    assert o.shape == q.shape and o.device.type == "cuda" and lse.shape == (2, 8, 129)
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "epicute" in str(n.target)]
    assert len(calls) == 1
    # The hooks are string keys in the graph, not Python objects.
    strings = [arg for arg in calls[0].args if isinstance(arg, str)]
    assert any(s.startswith("softcap_alibi:") for s in strings) and any(s.startswith("gated:") for s in strings)


@pytest.fixture
def reference_op(monkeypatch):
    """The op's eager call runs the reference backend, so the compiled path runs on the CPU; returns its calls.

    (Tracing the eager code instead of the op would fail: the kernel backend refuses CPU tensors.)
    """
    calls = []
    reference = functools.partial(attention_api.attention, backend="reference")
    monkeypatch.setattr(attention_api, "attention", lambda *a, **kw: calls.append(kw) or reference(*a, **kw))
    return calls


def qkv(b, sq, sk, hq, hkv, d):
    return (torch.randn(b, sq, hq, d, dtype=torch.bfloat16), torch.randn(b, sk, hkv, d, dtype=torch.bfloat16),
            torch.randn(b, sk, hkv, d, dtype=torch.bfloat16))  # fmt: skip


@pytest.mark.parametrize("shape", [(2, 17, 40, 4, 1, 64), (1, 70, 33, 6, 2, 128)], ids=["mqa-sq<sk", "gqa-sq>sk"])
def test_compiled_call_equals_eager_on_cpu_through_the_op(reference_op, shape):
    torch._dynamo.reset()
    *_, hq, _, d = shape
    q, k, v = qkv(*shape)
    slopes, gate, bias = torch.rand(hq), torch.randn_like(q), torch.randn(d)
    eager = attention_api.attention  # eager on the reference backend (the fixture's)
    o, lse = torch.compile(f_hooks, fullgraph=True, backend="aot_eager")(q, k, v, slopes, gate, bias)
    (kwargs,) = reference_op  # the op ran once, with the call's arguments rebuilt from the graph
    assert kwargs["score_mod"].fn is softcap_alibi.fn and kwargs["epilogue"].fn is gated.fn and kwargs["causal"] is True
    assert kwargs["cap"] == 30.0 and torch.equal(kwargs["slopes"], slopes) and kwargs["return_lse"] is True
    ref_o, ref_lse = eager(
        q, k, v, causal=True, score_mod=softcap_alibi, slopes=slopes, cap=30.0, epilogue=gated, gate=gate, bias=bias,
        return_lse=True,
    )  # fmt: skip
    assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
    o, lse = torch.compile(f_lse, fullgraph=True, backend="eager")(q, k, v)
    ref_o, ref_lse = eager(q, k, v, softmax_scale=0.2, return_lse=True)
    assert torch.equal(o, ref_o.float() + 1) and torch.equal(lse, ref_lse)
    # Honest: the comparison above can fail (another scale gives other numbers).
    assert rel_err(eager(q, k, v, softmax_scale=0.3, return_lse=True)[1], lse) > 1e-3
    out = torch.full_like(q, float("nan"))
    got = torch.compile(f_out, fullgraph=True, backend="eager")(q, k, v, out)
    assert torch.equal(got, eager(q, k, v)) and torch.equal(out, got)
    reference_op.clear()
    torch.compile(f_plain_fn_hook, fullgraph=True, backend="eager")(q, k, v)
    assert reference_op[0]["config"] == PINS  # tuples survive JSON


def test_compiled_reference_backend_is_refused():
    torch._dynamo.reset()

    def f(q, k, v):
        return epicute.attention(q, k, v, backend="reference")

    with pytest.raises(Exception) as info:
        torch.compile(f, fullgraph=True, backend="eager")(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64))
    assert isinstance(info.value, ConfigError) or "backend='kernel'" in str(info.value)


def f_aux_and_reduction(q, k, v):
    return epicute.attention(q, k, v, epilogue=lambda o: {"D": o, "pre": o * 2.0, "rs": ops.row_sum(o)})


def f_fp8_o(q, k, v):
    return epicute.attention(q, k, v, epilogue=epicute.epilogues.tensor_quant, scale=2.0)


@pytest.mark.parametrize("f", [f_aux_and_reduction, f_fp8_o])
def test_compiled_epilogues_beyond_o_are_refused_with_the_way_out(f):
    """The op's outputs are O in q's dtype and LSE: an epilogue with aux outputs or reductions, or one
    that stores O in fp8, is refused while tracing (not given wrong output metadata)."""
    torch._dynamo.reset()
    q = meta(1, 8, 2, 64)
    with pytest.raises(Exception) as info:
        torch.compile(f, fullgraph=True, backend="eager")(q, q, q)
    assert isinstance(info.value, EpilogueError) or "may only rewrite O" in str(info.value)
    assert "torch.compiler.disable" in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 129, 1000, 8, 2, 128), (1, 1000, 17, 4, 1, 64)], ids=["gqa", "mqa"])
def test_torch_compile_matches_eager_on_cuda(shape):
    torch._dynamo.reset()
    b, sq, sk, hq, hkv, d = shape
    q, k, v = (t.cuda() for t in qkv(*shape))
    slopes, gate, bias = torch.rand(hq, device="cuda"), torch.randn_like(q), torch.randn(d, device="cuda")
    compiled = torch.compile(f_hooks, fullgraph=True)
    o, lse = compiled(q, k, v, slopes, gate, bias)
    ref_o, ref_lse = f_hooks(q, k, v, slopes, gate, bias)
    assert torch.isfinite(o).all() and torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
    # Other sizes with the same variant: no recompile of the kernel, still equal to eager.
    q2, k2, v2 = (t.cuda() for t in qkv(b, sq + 17, sk + 3, hq, hkv, d))
    gate2 = torch.randn_like(q2)
    o2, lse2 = compiled(q2, k2, v2, slopes, gate2, bias)
    ref_o2, ref_lse2 = f_hooks(q2, k2, v2, slopes, gate2, bias)
    assert torch.equal(o2, ref_o2) and torch.equal(lse2, ref_lse2)
    # And eager itself is right (float32 reference on the GPU).
    expected, _ = attention_api.attention(
        q, k, v, causal=True, score_mod=softcap_alibi, slopes=slopes, cap=30.0, epilogue=gated, gate=gate, bias=bias,
        return_lse=True, backend="reference",
    )  # fmt: skip
    assert rel_err(o, expected.to(o.device)) < 1e-2


def test_backward_copies_gradients_tma_cannot_read():
    from epicute.attention.torch_op import _tma_ready

    do = torch.randn(2, 17, 4, 64)
    assert _tma_ready(do) is do
    for strided in (torch.ones(()).expand(2, 17, 4, 64), do.transpose(-1, -2).contiguous().transpose(-1, -2),
                    torch.randn(2, 17, 4, 65)[..., :64]):  # fmt: skip
        ready = _tma_ready(strided)
        assert ready.is_contiguous() and torch.equal(ready, strided)


def test_packed_sequences_fake_and_autograd():
    # Packed (varlen) q (total_q, heads, d): O like q, LSE (heads, total_q); the offsets ride along as
    # tensors (no gradient) and the longest lengths in the spec.
    q = meta(300, 4, 64).requires_grad_()
    k, v = meta(500, 2, 64).requires_grad_(), meta(500, 2, 64).requires_grad_()
    cu_q, cu_k = (torch.empty(3, dtype=torch.int32, device="meta") for _ in range(2))
    packed = json.loads(spec(causal=True))
    packed.update(max_seqlen_q=200, max_seqlen_k=400)
    o, lse = torch.ops.epicute.attention(
        q, k, v, [], [], "", "", json.dumps(packed, sort_keys=True), None, None, cu_q, cu_k
    )
    assert o.shape == q.shape and lse.shape == (4, 300) and lse.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad((o, lse), (q, k, v), (torch.empty_like(o), torch.empty_like(lse)))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_fp8_attention_compiles_to_the_op_with_its_descales(reference_op):
    torch._dynamo.reset()
    q, k, v = (t.to(torch.float8_e4m3fn) for t in qkv(2, 33, 70, 8, 2, 128))
    q_scale = torch.rand(2, 2) + 0.5

    def f(q, k, v, q_scale):
        return epicute.attention(q, k, v, causal=True, q_descale=q_scale, k_descale=0.25, return_lse=True)

    o, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, q_scale)
    (kwargs,) = reference_op  # one op, the descales rebuilt from the graph by name (a tensor and a number)
    assert torch.equal(kwargs["q_descale"], q_scale) and kwargs["k_descale"] == 0.25 and kwargs["v_layout"] == "bshd"
    ref_o, ref_lse = attention_api.attention(q, k, v, causal=True, q_descale=q_scale, k_descale=0.25,
                                             return_lse=True)  # fmt: skip
    assert o.dtype == torch.bfloat16 and torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
    # Honest: other descales give other numbers.
    assert rel_err(attention_api.attention(q, k, v, causal=True, q_descale=q_scale, return_lse=True)[1], lse) > 1e-3
    fake_o, _ = torch.ops.epicute.attention(*op_args(2, 17, 17, 4, 4, 64, dtype=torch.float8_e4m3fn))
    assert fake_o.dtype == torch.bfloat16  # the fake's O is stored bf16 for fp8 q, as the kernel's
    with pytest.raises(Exception) as info:  # refused while tracing (dynamo wraps the typed error)
        torch.compile(f, fullgraph=True, backend="aot_eager")(q.requires_grad_(), k, v, q_scale)
    assert isinstance(info.value, ConfigError) or "fp8 forward is for inference" in str(info.value)
