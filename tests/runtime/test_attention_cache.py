"""Attention variants in the shared compile cache: what their keys hold, and what they must not.

A key holds everything that changes the attention kernel's code: config (tiles,
stages, ping-pong...; head_dim is part of it), dtype, causal, the score_mod and
epilogue semantic hashes with their operands' kinds and dtypes, operand
alignment, the target arch and the code versions. Batch, sequence lengths, head
counts (so the GQA ratio: the kernel divides the head counts at run time),
softmax_scale and operand values are runtime arguments and never in a key.

Variants are captured from the public call itself (``epicute.attention`` on CPU
tensors, its launch replaced), so the keys are the ones a real call makes.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import epicute
from epicute import ops
from epicute.attention import api as attention_api
from epicute.attention import launch as rt_attention
from epicute.runtime import compile as rt_compile
from epicute.runtime.cache import CacheKey, KernelCache
from tests.conftest import subprocess_env

REPO = Path(__file__).resolve().parents[2]


@epicute.score_mod
def softcap_alibi(s, b, h, q_idx, kv_idx, slopes, cap):
    return cap * ops.tanh(s / cap) + slopes * (kv_idx - q_idx)


def softcap_30(s, b, h, q_idx, kv_idx):
    return 30.0 * ops.tanh(s / 30.0)


def softcap_50(s, b, h, q_idx, kv_idx):
    return 50.0 * ops.tanh(s / 50.0)


@epicute.epilogue
def gated(o, gate, bias):
    return o * ops.sigmoid(gate) + bias


def qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, d, dtype=dtype))  # fmt: skip


def launched_variant(monkeypatch, q, k, v, **kwargs) -> rt_attention.AttentionVariant:
    """The variant ``epicute.attention`` would launch for these CPU tensors (captured, not launched)."""
    seen = {}
    real_check = attention_api.check_attention_args
    monkeypatch.setattr(
        attention_api, "check_attention_args", lambda *a, **kw: real_check(*a, **{**kw, "require_cuda": False})
    )
    monkeypatch.setattr(
        rt_attention, "launch_attention", lambda call, variant, *rest: seen.update(v=variant) or ({"D": None}, None)
    )
    epicute.attention(q, k, v, **kwargs)
    return seen["v"]


def launched_key(monkeypatch, q, k, v, **kwargs) -> CacheKey:
    return launched_variant(monkeypatch, q, k, v, **kwargs).key()


def hooked(b, sq, sk, hq, hkv, d=128, slopes_dtype=torch.float32, **kwargs):
    """A call with both hooks; its operands are sized to the problem."""
    q, k, v = qkv(b, sq, sk, hq, hkv, d)
    return (q, k, v), dict(
        score_mod=softcap_alibi, slopes=torch.rand(hq, dtype=slopes_dtype), cap=float(torch.rand(()) * 40 + 1),
        epilogue=gated, gate=torch.randn(b, sq, hq, d, dtype=torch.bfloat16), bias=torch.randn(d), **kwargs,
    )  # fmt: skip


def test_sizes_heads_ratio_scale_and_operand_values_share_one_key(monkeypatch):
    keys = set()
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv): MHA, GQA 4:1, MQA, seqlen_q != seqlen_k both ways, 1s.
    for b, sq, sk, hq, hkv in [(2, 17, 17, 8, 8), (1, 129, 1000, 8, 2), (3, 1000, 40, 16, 1), (1, 1, 1, 2, 2)]:
        args, kwargs = hooked(b, sq, sk, hq, hkv, causal=True, softmax_scale=float(torch.rand(())) + 0.01)
        keys.add(launched_key(monkeypatch, *args, **kwargs))
    assert len(keys) == 1
    (key,) = keys
    assert key.kind == "attention" and key.arch == "sm_90a"
    # A 1-element tensor operand is read as a scalar, like a Python number.
    args, kwargs = hooked(2, 17, 17, 8, 8, causal=True)
    assert launched_key(monkeypatch, *args, **{**kwargs, "cap": torch.tensor(7.0)}) == key


def test_each_codegen_change_gives_a_new_key(monkeypatch):
    q, k, v = qkv(2, 33, 65, 8, 2, 128)
    q64, k64, v64 = qkv(2, 33, 65, 8, 2, 64)
    q256, k256, v256 = qkv(2, 33, 65, 8, 2, 256)
    calls = {
        "base": ((q, k, v), {}),
        "fp16": ((q.half(), k.half(), v.half()), {}),
        "d64": ((q64, k64, v64), {}),
        "d256": ((q256, k256, v256), {}),
        "causal": ((q, k, v), {"causal": True}),
        "tile_n": ((q, k, v), {"config": {"tile_n": 64}}),
        "stages": ((q, k, v), {"config": {"stages": 3}}),
        "no_pingpong": ((q, k, v), {"config": {"pingpong": False}}),
        "softcap30": ((q, k, v), {"score_mod": softcap_30}),
        "softcap50": ((q, k, v), {"score_mod": softcap_50}),
        "alibi": ((q, k, v), {"score_mod": softcap_alibi, "slopes": torch.rand(8), "cap": 30.0}),
        "alibi_bf16_slopes": ((q, k, v), {"score_mod": softcap_alibi, "slopes": torch.rand(8).bfloat16(), "cap": 30.0}),
        "alibi_scalar_slopes": ((q, k, v), {"score_mod": softcap_alibi, "slopes": 0.5, "cap": 30.0}),
        "gated": ((q, k, v), {"epilogue": gated, "gate": torch.randn_like(q), "bias": torch.randn(128)}),
        "gated_scalar_bias": ((q, k, v), {"epilogue": gated, "gate": torch.randn_like(q), "bias": 1.0}),
        "gated_fp32_gate": ((q, k, v), {"epilogue": gated, "gate": torch.randn_like(q).float(), "bias": 1.0}),
    }
    keys = {name: launched_key(monkeypatch, *args, **kwargs) for name, (args, kwargs) in calls.items()}
    by_key: dict[CacheKey, list[str]] = {}
    for name, key in keys.items():
        by_key.setdefault(key, []).append(name)
    assert all(len(names) == 1 for names in by_key.values()), [n for n in by_key.values() if len(n) > 1]
    variant = launched_variant(monkeypatch, q, k, v)
    assert dataclasses.replace(variant, arch="sm_100a").key() != keys["base"]
    assert dataclasses.replace(variant).key() == keys["base"]


def test_key_is_plain_text_with_versions_and_the_same_in_a_fresh_process(monkeypatch):
    args, kwargs = hooked(2, 17, 40, 8, 2, causal=True)
    key = launched_key(monkeypatch, *args, **kwargs)
    for part in ("kind=attention", "arch=sm_90a", "epicute=", "epicute-sources=", "cutlass-dsl=", "tvm-ffi="):
        assert part in key.text
    assert "softcap_alibi" not in key.text  # semantic hashes, not names
    code = (
        "import pytest\n"
        "from tests.runtime.test_attention_cache import hooked, launched_key\n"
        "args, kwargs = hooked(1, 100, 7, 8, 1, causal=True)\n"
        "print(launched_key(pytest.MonkeyPatch(), *args, **kwargs).digest)\n"
    )
    env = subprocess_env()
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO, check=False
    )
    assert out.stdout.strip() == key.digest, out.stderr


def test_the_attention_family_compiles_once_across_sizes(monkeypatch):
    """Through the shared cache: one compile for two prefill sizes (over 64 query rows: fewer are
    planned as decode tiles), a second for another variant."""
    monkeypatch.setattr(rt_compile, "KERNEL_CACHE", KernelCache())
    monkeypatch.setenv("EPICUTE_CACHE", "0")
    built = []
    monkeypatch.setitem(rt_attention.ATTENTION_CACHE.compilers, "sm_90a", lambda v: built.append(v) or object())
    assert rt_compile.FAMILIES["attention"] is rt_attention.ATTENTION_CACHE
    small = launched_variant(monkeypatch, *qkv(1, 65, 17, 2, 2, 64))
    large = launched_variant(monkeypatch, *qkv(4, 1000, 129, 16, 4, 64))
    causal = launched_variant(monkeypatch, *qkv(1, 65, 17, 2, 2, 64), causal=True)
    first = rt_attention.ATTENTION_CACHE.get(small)
    assert rt_attention.ATTENTION_CACHE.get(large) is first
    assert rt_attention.ATTENTION_CACHE.get(causal) is not first
    assert built == [small, causal]
    assert rt_compile.KERNEL_CACHE.stats.compiles == 2 and len(rt_compile.KERNEL_CACHE) == 2


def test_a_tensor_can_never_leak_into_a_key():
    with pytest.raises(TypeError, match="recompile on every call"):
        CacheKey("attention", (torch.zeros(1),))
