"""fp8 attention on the CPU: the value tile's key order against a model of the WGMMA register layouts, the
value layout pass, the descales' checks, the plan, and the reference backend against float64 math."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.attention.fp8 import KEY_GROUP, VALUE_SLOT_KEYS, descales, key_of_slot, value_layout, value_starts
from epicute.errors import ConfigError, DtypeError, ShapeError

E4M3 = torch.float8_e4m3fn


def test_handing_p_over_register_for_register_carries_the_slot_keys():
    # WGMMA's m64nN fp32 accumulator: lane q of a quad holds element (v0, row half, chunk j) at column 8 j + 2 q + v0;
    # an 8-bit register A operand's slot (a0, row half, a2) of k-block kb is key 32 kb + 16 a2 + 4 q + a0. The
    # kernel writes accumulator chunk j0 + 2 j1 + 4 kb, element v0, into slot a0 = v0 + 2 j0, a2 = j1 (no shuffle).
    for q in range(4):
        for kb in range(2):
            for j1 in range(2):
                for j0 in range(2):
                    for v0 in range(2):
                        column = 8 * (j0 + 2 * j1 + 4 * kb) + 2 * q + v0
                        slot = 32 * kb + 16 * j1 + 4 * q + v0 + 2 * j0
                        assert slot // KEY_GROUP == column // KEY_GROUP
                        assert key_of_slot(slot % KEY_GROUP) == column % KEY_GROUP
    assert sorted(VALUE_SLOT_KEYS) == list(range(KEY_GROUP))  # a permutation of each group


def test_value_layout_of_batched_values():
    v = torch.randn(2, 37, 3, 64).to(E4M3)
    slots = value_layout(v)
    assert slots.shape == (2, 48, 3, 64) and slots.stride(1) == 1  # keys padded to 48, contiguous
    raw, got = v.view(torch.uint8), slots.contiguous().view(torch.uint8)
    for s in range(48):
        key = s // KEY_GROUP * KEY_GROUP + VALUE_SLOT_KEYS[s % KEY_GROUP]
        expected = raw[:, key] if key < 37 else torch.zeros_like(raw[:, 0])
        assert torch.equal(got[:, s], expected), s


def test_value_layout_of_packed_sequences():
    lengths = [5, 0, 33, 16]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    v = torch.randn(sum(lengths), 2, 64).to(E4M3)
    got = value_layout(v, cu)[0].contiguous().view(torch.uint8)  # (slots, heads, dim)
    raw = v.view(torch.uint8)
    assert got.shape[0] % KEY_GROUP == 0
    starts = value_starts(cu[:-1].long())
    assert starts.tolist() == [0, 16 + 16, 16 + 32, 48 + 48]  # 16-aligned, a group per earlier sequence
    for b, n in enumerate(lengths):
        start = int(starts[b])
        for i in range(-(-n // KEY_GROUP) * KEY_GROUP):
            key = i // KEY_GROUP * KEY_GROUP + VALUE_SLOT_KEYS[i % KEY_GROUP]
            expected = raw[int(cu[b]) + key] if key < n else torch.zeros_like(raw[0])
            assert torch.equal(got[start + i], expected), (b, i)


def test_descales_broadcast_and_their_refusals():
    d = descales(0.5, torch.tensor([2.0]), torch.full((3, 2), 4.0), 3, 2, torch.device("cpu"))
    assert [t.shape for t in d] == [(3, 2)] * 3
    assert d[0].eq(0.5).all() and d[1].eq(2.0).all() and d[2].eq(4.0).all()
    with pytest.raises(ShapeError, match=r"q_descale.*\(batch, heads_kv\) = \(3, 2\)"):
        descales(torch.ones(3), None, None, 3, 2, torch.device("cpu"))
    with pytest.raises(DtypeError, match="k_descale.*fp32"):
        descales(None, torch.ones(3, 2, dtype=torch.float64), None, 3, 2, torch.device("cpu"))


def fp8_qkv(b=2, sq=50, sk=70, hq=4, hkv=2, d=64):
    return tuple((torch.randn(b, s, h, d) * 4).to(E4M3) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def test_fp8_reference_backend_matches_float64_math():
    q, k, v = fp8_qkv()
    qs, ks, vs = torch.rand(2, 2) + 0.1, torch.rand(2, 2) + 0.1, torch.rand(2, 2) + 0.1
    got = epicute.attention(q, k, v, causal=True, q_descale=qs, k_descale=ks, v_descale=vs, backend="reference")
    assert got.dtype == torch.bfloat16
    qd = q.double() * qs.double().repeat_interleave(2, dim=1)[:, None, :, None]
    kd = (k.double() * ks.double()[:, None, :, None]).repeat_interleave(2, dim=2)
    vd = (v.double() * vs.double()[:, None, :, None]).repeat_interleave(2, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * 64**-0.5
    mask = torch.ones(50, 70, dtype=torch.bool).tril(70 - 50)
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < 8e-3, err  # bf16 O's rounding


def test_fp8_refusals_name_the_fix():
    q, k, v = fp8_qkv()
    bf = torch.randn(2, 50, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="descales dequantize fp8"):
        epicute.attention(bf, bf, bf, q_descale=2.0, backend="reference")
    with pytest.raises(DtypeError, match="k has dtype"):
        epicute.attention(q, k.to(torch.bfloat16), v, backend="reference")
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ConfigError, match="paged fp8 cache"):
        epicute.attention(q, k[:, :16], v[:, :16], page_table=table, backend="reference")
    with pytest.raises(ConfigError, match="tile_n=80: fp8 attention needs a multiple of 32"):
        epicute.explain_attention(q, k, v, config={"tile_n": 80}, file=None)


def test_fp8_explain_names_the_recipe(capsys):
    q, k, v = (torch.empty(2, 4096, h, 128, dtype=E4M3, device="meta") for h in (32, 8, 8))
    plan = epicute.explain_attention(q, k, v, causal=True)
    text = capsys.readouterr().out
    assert plan.config.tile_n % 32 == 0
    assert "fp8             e4m3 Q, K, V" in text and "O stored bf16" in text
    assert "keys contiguous" in text  # the V ring's row in the shared-memory table
    assert "not available: attention backward: fp8" in text
    softcap = lambda s, b, h, qi, ki: 30 * epicute.ops.tanh(s / 30)
    q, k, v = (torch.empty(2, 4096, h, 256, dtype=E4M3, device="meta") for h in (16, 8, 8))
    assert epicute.explain_attention(q, k, v, file=None).config.tile_n == 128
    assert epicute.explain_attention(q, k, v, score_mod=softcap, file=None).config.tile_n == 96  # 128 spills


def test_the_slot_of_each_key_inverts_the_table():
    # the formula the value pass kernel and the cache's appends use, on ints and on tensors alike
    from epicute.attention.fp8 import slot_of_key, slot_of_position

    assert [slot_of_key(VALUE_SLOT_KEYS[s]) for s in range(KEY_GROUP)] == list(range(KEY_GROUP))
    positions = torch.arange(48)
    assert [VALUE_SLOT_KEYS[int(s) % 16] + int(s) // 16 * 16 for s in slot_of_position(positions)] == list(range(48))


def test_values_in_slots_must_be_the_canonical_layout():
    q, k, v = fp8_qkv(sk=64)
    slots = value_layout(v)
    got = epicute.attention(q, k, slots, v_layout="slots", backend="reference")
    want = epicute.attention(q, k, v, backend="reference")
    assert torch.equal(got, want)  # the same values, read back in key order
    with pytest.raises(epicute.AlignmentError, match="pass epicute.attention.fp8.value_layout"):
        epicute.attention(q, k, slots.contiguous(), v_layout="slots", backend="reference")
    with pytest.raises(ShapeError, match="keys padded"):
        epicute.attention(q, k, value_layout(v[:, :40]), v_layout="slots", backend="reference")
    with pytest.raises(ConfigError, match="v_layout='nope'"):
        epicute.attention(q, k, v, v_layout="nope", backend="reference")
