"""GPU correctness of decode attention: packed GQA tiles, split-KV, paged KV caches, seqused_k.

Against the float32 reference of the same math (a paged cache gathered through its page
table, keys past seqused_k masked). O, LSE and split-KV's partials are NaN-poisoned, so an
element nobody writes fails; odd lengths, empty sequences (seqused_k = 0), splits with no
key blocks, every head_dim and page sizes from 16 to 256.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.attention import launch as rt_attention
from epicute.attention.api import reference_attention
from epicute.attention.plan import packed_rows
from epicute.attention.prepare import hooks_of
from epicute.attention.validate import check_attention_args
from tests.attention.test_attention_gpu import _poisoned_outputs_and_exact_reference  # noqa: F401  (fixture)
from tests.conftest import assert_attention_close

pytestmark = pytest.mark.gpu

TOL = 1e-2


KEPT_PARTIALS = rt_attention.split_partials


@pytest.fixture(autouse=True)
def _poisoned_partials(monkeypatch):
    """O, LSE and the rest as the forward's tests poison them, and split-KV's partials too, fresh for every call
    (not the kept ones: :func:`test_kept_partials_serve_repeat_calls` runs those)."""

    def poisoned_partials(splits, p, device):
        return tuple(t.fill_(float("nan")) for t in rt_attention.new_partials(splits, p, device))

    monkeypatch.setattr(rt_attention, "split_partials", poisoned_partials)


def test_kept_partials_serve_repeat_calls(monkeypatch):
    # the kept split-KV partials: a second call of the same shape reuses the first's (NaN-poisoned) buffers and must
    # overwrite every row it reads, including an empty split's (7 splits of 8 blocks)
    monkeypatch.setattr(rt_attention, "_PARTIALS", {})
    monkeypatch.setattr(rt_attention, "split_partials", KEPT_PARTIALS)
    real = rt_attention.new_partials
    monkeypatch.setattr(rt_attention, "new_partials",
                        lambda splits, p, device: tuple(t.fill_(float("nan")) for t in real(splits, p, device)))
    for _ in range(3):
        q, k, v = dense(2, 1, 1000, 8, 2, 128)
        check(q, k, v, causal=True, config={"num_splits": 7}, expect={"num_splits": 7})
    assert len(rt_attention._PARTIALS) == 1  # one kept pair served every call


def paged_cache(batch, pages, page_size, hkv, d, dtype=torch.bfloat16, spare=3):
    """A cache with ``spare`` unused pages and each sequence's pages scattered in random order."""
    total = batch * pages + spare
    k = torch.randn(total, page_size, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    table = torch.randperm(total, device="cuda")[: batch * pages].view(batch, pages).to(torch.int32)
    return k, v, table


def check(q, k, v, causal=False, score_mod=None, config=None, page_table=None, seqused_k=None, expect=None, **ops):
    out = torch.full_like(q, float("nan"))
    got, lse = epicute.attention(
        q, k, v, causal=causal, score_mod=score_mod, out=out, return_lse=True, config=config,
        page_table=page_table, seqused_k=seqused_k, **ops,
    )  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    call = check_attention_args(q, k, v, causal=causal, softmax_scale=None, page_table=page_table, seqused_k=seqused_k)
    if expect is not None:  # the planner chose what the test means to exercise
        plan = epicute.explain_attention(
            q, k, v, causal=causal, score_mod=score_mod, config=config, page_table=page_table, seqused_k=seqused_k,
            file=None, **ops,
        )  # fmt: skip
        for field, value in expect.items():
            assert getattr(plan.config, field) == value, (field, getattr(plan.config, field), value)
    score, _ = hooks_of(call, score_mod, None, ops)
    ref, ref_lse = reference_attention(call, score, None, out_dtype=torch.float32, device="cuda")
    what = f"q{tuple(q.shape)} k{tuple(k.shape)} causal={causal} config={config}"
    assert_attention_close(out, lse, ref["D"], ref_lse, what, TOL)
    return out, lse


def dense(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16):
    return (torch.randn(b, sq, hq, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype))  # fmt: skip


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_packed_gqa_and_split_kv(d, causal):
    # One query per sequence, GQA 4:1: packed, and split while tiles are few.
    check(*dense(2, 1, 4097, 8, 2, d), causal=causal, expect={"pack_gqa": 4, "split_kv": True})
    # Speculative decoding: 3 queries x 8 heads per K/V head = 24 packed rows.
    check(*dense(3, 3, 1000, 16, 2, d), causal=causal, expect={"pack_gqa": 8})
    # MQA: all 16 heads share one K/V head; a short cache leaves too few blocks to split.
    check(*dense(1, 1, 17, 16, 1, d), causal=causal, expect={"pack_gqa": 16, "split_kv": False})
    # MHA decode: nothing to pack, still split.
    check(*dense(1, 2, 3000, 2, 2, d), causal=causal, expect={"pack_gqa": 1, "split_kv": True})


#: Query heads per K/V head: every ratio up to 8, and larger ones that do not divide the 64-row
#: tile (a padded group: 3 -> 4 rows a query, 40 -> 64), up to 64 heads on one K/V head.
RATIOS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 20, 24, 40, 48, 63, 64)


@pytest.mark.parametrize("group", RATIOS)
def test_every_gqa_ratio_packs_into_decode_tiles(group):
    hkv, packed = 2, packed_rows(group)
    expect_pack = group if group > 1 else 1
    # One query: packed, and split while the tiles are few.
    check(*dense(2, 1, 3001, group * hkv, hkv, 128), causal=True, expect={"pack_gqa": expect_pack, "split_kv": True})
    # As many queries as the padded group leaves room for in 64 rows, on a short cache (no split).
    sq = max(64 // packed, 1)
    for causal in (False, True):
        check(*dense(1, sq, 515, group * hkv, hkv, 64), causal=causal, expect={"pack_gqa": expect_pack})


#: Popular models' heads (query, key/value) whose group does not divide 64 (Llama-3.2-3B, Qwen2.5-7B,
#: Qwen2.5-14B/32B, Qwen2.5-1.5B), at seqlen_q 1, 4 and 17 (17 x the padded group is past one tile).
MODEL_HEADS = ((24, 8), (28, 4), (40, 8), (12, 2))


@pytest.mark.parametrize("hq,hkv", MODEL_HEADS, ids=("llama3.2-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-1.5b"))
def test_model_gqa_ratios_dense_and_paged(hq, hkv):
    k, v, table = paged_cache(3, 9, 256, hkv, 128)
    used = torch.tensor([1, 2000, 9 * 256], device="cuda", dtype=torch.int32)
    for sq in (1, 4, 17):
        q = torch.randn(3, sq, hq, 128, device="cuda", dtype=torch.bfloat16)
        check(q, k, v, causal=True, page_table=table, seqused_k=used)
        check(*dense(3, sq, 2001, hq, hkv, 128), causal=True)
    # A score_mod sees each packed row's own head (the padded rows take none).
    slopes = torch.rand(hq, device="cuda") * 0.1

    def alibi(s, b, h, q_idx, kv_idx, slopes):
        return s - slopes * epicute.ops.abs(q_idx - kv_idx) + h * 0.01

    check(*dense(2, 2, 3000, hq, hkv, 128), causal=True, score_mod=alibi, slopes=slopes,
          expect={"pack_gqa": hq // hkv})  # fmt: skip


@pytest.mark.parametrize("splits", (1, 3, 7, 33, 64))
def test_pinned_splits_including_empty_ones(splits):
    # 1000 keys are 8 blocks of 128: with 7 splits of 2 blocks, splits 4-6 get none; with 64, most.
    q, k, v = dense(2, 1, 1000, 8, 2, 128)
    for causal in (False, True):
        check(q, k, v, causal=causal, config={"num_splits": splits}, expect={"num_splits": splits})


@pytest.mark.parametrize("page_size", (16, 64, 128, 256))
def test_paged_cache_with_ragged_lengths(page_size):
    batch, pages, hq, hkv, d = 5, 4096 // page_size + 1, 8, 2, 128
    k, v, table = paged_cache(batch, pages, page_size, hkv, d)
    capacity = pages * page_size
    used = torch.tensor([0, 1, 777, capacity - 5, capacity], device="cuda", dtype=torch.int32)
    for sq in (1, 4):
        q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16)
        for causal in (False, True):
            check(q, k, v, causal=causal, page_table=table, seqused_k=used)
    # Every sequence full, no seqused_k.
    check(torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16), k, v, page_table=table)


def test_seqused_k_on_a_dense_cache():
    q, k, v = dense(4, 2, 2500, 32, 8, 64)
    used = torch.tensor([2500, 3, 0, 1999], device="cuda", dtype=torch.int32)
    for causal in (False, True):
        check(q, k, v, causal=causal, seqused_k=used)
    # One split: the empty sequence still runs one fully masked block.
    check(q, k, v, causal=True, seqused_k=used, config={"num_splits": 1}, expect={"pack_gqa": 4, "split_kv": False})
    # Prefill-shaped queries honour seqused_k too.
    q = torch.randn(4, 300, 8, 64, device="cuda", dtype=torch.bfloat16)
    check(q, k, v, causal=True, seqused_k=used, expect={"pack_gqa": 1, "split_kv": False})


def test_score_mods_see_each_packed_row_head():
    slopes = torch.rand(16, device="cuda") * 0.1

    def alibi(s, b, h, q_idx, kv_idx, slopes):
        return s - slopes * epicute.ops.abs(q_idx - kv_idx)

    def softcap(s, b, h, q_idx, kv_idx):
        return 30 * epicute.ops.tanh(s / 30)

    q, k, v = dense(2, 2, 3000, 16, 4, 128)
    check(q, k, v, causal=True, score_mod=alibi, slopes=slopes, expect={"pack_gqa": 4, "split_kv": True})
    check(q, k, v, score_mod=softcap, expect={"pack_gqa": 4})


def test_fp16_and_large_batch_decode():
    q, k, v = dense(64, 1, 1500, 32, 8, 128, torch.float16)
    check(q, k, v, causal=True, expect={"pack_gqa": 4, "split_kv": False})


def test_split_kv_is_deterministic():
    k, v, table = paged_cache(1, 64, 128, 8, 128)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    first = epicute.attention(q, k, v, page_table=table, return_lse=True)
    for _ in range(10):
        again = epicute.attention(q, k, v, page_table=table, return_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
