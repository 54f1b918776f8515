"""Every plan the planners make is one their own checks accept (issue 56, item 4).

The GEMM planner used to pick a tile and then refuse it: bf16 ``gated=True`` with ``ops.quantize_groups``
at 8192 x 4096 -> 2 x 14336 planned ping-pong 128x256 ("needs 256 accumulator registers per thread"), and
fp8 blockwise gated + quantize (DeepSeek-V3's MLP) was refused at every tile. Its candidates now go through
the check its final config gets (``epicute.gemm.heuristics.check_config``), so these sweeps ask ``explain``
(GEMM, grouped GEMM, attention forward, decode and the backward it reports) for plans over a grid of shapes,
dtypes, scale recipes, epilogue kinds and targets, drawn with a fixed seed, and require every one to plan
and to pass the checks the kernel itself makes when it is built (its constructor, no compile). CPU only,
``"meta"`` tensors: the planners are pure Python.
"""

from __future__ import annotations

import io
import random

import pytest
import torch

import epicute
from epicute import ops

TARGETS = ("h100-sxm", "h100-pcie", "h200", "h20")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, FP16 = torch.bfloat16, torch.float16
SEED = 56
#: Draws per target: enough to cover each axis many times over, few enough to run in seconds.
GEMM_DRAWS, GROUPED_DRAWS, ATTENTION_DRAWS = 400, 120, 120


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _quantized(x):
    q, scales = ops.quantize_groups(x, ue8m0=True)
    return {"D": q, "scales": scales}


#: GEMM epilogues by kind: (function, operands(m, n) -> dict). ``n`` is D's columns.
EPILOGUES = {
    "plain": (None, lambda m, n: {}),
    "row_vector": (lambda acc, bias: ops.gelu(acc + bias), lambda m, n: {"bias": meta(n)}),
    "col_vector": (lambda acc, s: acc * s, lambda m, n: {"s": meta(m, 1, dtype=torch.float32)}),
    "tile": (lambda acc, r: ops.silu(acc) + r, lambda m, n: {"r": meta(m, n)}),
    "aux": (lambda acc: {"D": ops.gelu(acc), "pre": acc}, lambda m, n: {}),
    "reductions": (
        lambda acc: {"D": acc, "rows": ops.row_sum(acc), "cols": ops.col_amax(acc), "peak": ops.amax(acc)},
        lambda m, n: {},
    ),  # fmt: skip
    "quantize": (lambda acc: _quantized(ops.silu(acc)), lambda m, n: {}),
    "quantize_reduce": (lambda acc: {**_quantized(acc), "rows": ops.row_max(acc)}, lambda m, n: {}),
    "tensor_quant": (epicute.epilogues.tensor_quant, lambda m, n: {"scale": 0.05}),
}
GATED_EPILOGUES = {
    "swiglu": (lambda gate, up: ops.silu(gate) * up, lambda m, n: {}),
    "geglu_operands": (
        lambda gate, up, bias, score: ops.gelu(gate + bias) * up * score,
        lambda m, n: {"bias": meta(n), "score": meta(m, 1, dtype=torch.float32)},
    ),  # fmt: skip
    "swiglu_aux_reductions": (
        lambda gate, up: {"D": ops.silu(gate) * up, "act": ops.silu(gate), "u": ops.row_sum(up)},
        lambda m, n: {},
    ),  # fmt: skip
    "swiglu_quantize": (lambda gate, up: _quantized(ops.silu(gate) * up), lambda m, n: {}),
}
# Sizes: D's columns and K multiples of 16 (fp8's and every dtype's alignment), M anything.
MS = (1, 7, 16, 33, 64, 100, 128, 129, 300, 513, 1000, 2048, 4096, 8192, 16384)
NS = (16, 64, 128, 144, 256, 400, 1024, 2048, 4096, 7168, 14336, 18432, 28672)
KS = (16, 64, 128, 1008, 2048, 4096, 7168, 14336)


def _kernel_accepts(prepared) -> None:
    """Build the kernel object of ``prepared`` (no compile): its constructor makes the kernel's own checks."""
    from epicute.gemm.compile import kernel_args

    variant = prepared.variant()
    kernel_class = variant.kernel_class() if hasattr(variant, "kernel_class") else None
    if kernel_class is None:
        from epicute.gemm.kernel_sm90 import GemmSm90 as kernel_class
    kernel_class(*kernel_args(variant))


def _gemm_case(rng: random.Random) -> dict:
    """One valid GEMM call, drawn: sizes, dtypes, scale recipe, layouts, epilogue kind."""
    recipe = rng.choice(("bf16", "fp16", "fp8_tensor", "fp8_row", "fp8_block", "fp8_block", "fp8_block_mixed"))
    gated = rng.random() < 0.35 and recipe in ("bf16", "fp16", "fp8_block", "fp8_block_mixed")
    kind = rng.choice(list(GATED_EPILOGUES if gated else EPILOGUES))
    fp8, m, n, k = recipe.startswith("fp8"), rng.choice(MS), rng.choice(NS), rng.choice(KS)
    while recipe.startswith("fp8_block") and -(-k // 128) == (2 * n if gated else n):
        k = rng.choice(KS)  # a (1, N) b_scale reads as rowwise: left to the argument checks (not a planner matter)
    return {
        "recipe": recipe, "gated": gated, "kind": kind, "m": m, "n": n, "k": k,
        "l": rng.choice((1, 1, 1, 3)), "a_major": "k" if fp8 or m % 8 else rng.choice("km"),  # M-major: M aligned
        "b_major": "k" if fp8 else rng.choice("kn"), "out_dtype": rng.choice((None, None, torch.float32)),
        "a_scale_layout": rng.choice(("m_major", "m_major_padded", "row_major")),
        "b_scale_layout": rng.choice(("weight", "transposed")),
    }  # fmt: skip


def _gemm_args(case: dict) -> tuple:
    """``(a, b, keywords)`` of the call ``case`` describes."""
    m, n, k, l, recipe = case["m"], case["n"], case["k"], case["l"], case["recipe"]
    n_acc = 2 * n if case["gated"] else n  # a gated B holds gate and up: 2N columns
    a_dtype = {"bf16": BF16, "fp16": FP16}.get(recipe, E4M3)
    b_dtype = E5M2 if recipe == "fp8_block_mixed" else a_dtype
    lead = (l,) if l > 1 else ()
    a = (
        meta(*lead, m, k, dtype=a_dtype)
        if case["a_major"] == "k"
        else meta(*lead, k, m, dtype=a_dtype).transpose(-1, -2)
    )
    b = (
        meta(*lead, n_acc, k, dtype=b_dtype).transpose(-1, -2)
        if case["b_major"] == "k"
        else meta(*lead, k, n_acc, dtype=b_dtype)
    )
    kw: dict = {}
    if recipe == "fp8_tensor":
        kw = {"a_scale": 0.5, "b_scale": 0.25}
    elif recipe == "fp8_row":
        kw = {"a_scale": meta(*lead, m, 1, dtype=torch.float32), "b_scale": meta(*lead, 1, n_acc, dtype=torch.float32)}
    elif recipe.startswith("fp8_block"):
        kb, nb = -(-k // 128), -(-n_acc // 128)
        sa = {
            "m_major": lambda: meta(*lead, kb, m, dtype=torch.float32).transpose(-1, -2),
            "m_major_padded": lambda: meta(*lead, kb, m + 3, dtype=torch.float32)[..., :m].transpose(-1, -2),
            "row_major": lambda: meta(*lead, m, kb, dtype=torch.float32),
        }[case["a_scale_layout"]]()
        sb = meta(*lead, nb, kb, dtype=torch.float32)
        if case["b_scale_layout"] == "transposed" and min(nb, kb) > 1:  # (1, KB) from (KB, 1).t() reads as (KB, 1)
            sb = meta(*lead, kb, nb, dtype=torch.float32).transpose(-1, -2)
        kw = {"a_scale": sa, "b_scale": sb}
    fn, operands = (GATED_EPILOGUES if case["gated"] else EPILOGUES)[case["kind"]]
    if fn is not None:
        kw["epilogue"] = fn
        kw.update(operands(m, n))
        if case["kind"] == "aux":
            kw["out_dtypes"] = {"pre": torch.float32}
    if case["gated"]:
        kw["gated"] = True
    if case["out_dtype"] is not None and not case["kind"].endswith(("quantize", "quant", "quantize_reduce")):
        kw["out_dtype"] = case["out_dtype"]
    return a, b, kw


def _prepare_gemm(a, b, kw: dict, target: str):
    """The preparation ``epicute.explain`` makes for ``a @ b`` with ``kw``, for ``target``."""
    from dataclasses import replace

    from epicute.gemm.api import describe_call
    from epicute.gemm.prepare import prepare
    from epicute.runtime.target import resolve_target

    kw = dict(kw)
    fixed = {name: kw.pop(name, None) for name in ("epilogue", "out_dtype", "out_dtypes", "a_scale", "b_scale")}
    gated = kw.pop("gated", False)
    _, _, request, _ = describe_call(a, b, fixed["epilogue"], None, fixed["out_dtype"], fixed["out_dtypes"], None, None,
                                     kw, False, (fixed["a_scale"], fixed["b_scale"]), gated)  # fmt: skip
    return prepare(replace(request, target=resolve_target(target)))


def _check_gemm_plan(plan, prepared) -> None:
    """The plan passes the planner's own rule and the kernel's constructor."""
    from epicute.gemm.heuristics import check_config

    check_config(plan.config, plan.kernel_problem, plan.kernel_epilogue, plan.target.smem_per_cta_bytes)
    assert plan.config == prepared.plan.config
    _kernel_accepts(prepared)


def _sweep(cases, run) -> list[str]:
    failures = []
    for case in cases:
        try:
            run(case)
        except Exception as exc:  # noqa: BLE001 - every refusal or crash of a valid call is a finding
            failures.append(f"{case}: {type(exc).__name__}: {exc}")
    return failures


def _report(failures: list[str], total: int) -> str:
    return f"{len(failures)} of {total} calls were not planned:\n" + "\n".join(failures[:20])


# ------------------------------------------------------------------ GEMM


@pytest.mark.parametrize("target", TARGETS)
def test_every_gemm_plan_validates(target):
    rng = random.Random(f"{SEED} gemm {target}")
    cases = [_gemm_case(rng) for _ in range(GEMM_DRAWS)]

    def run(case):
        a, b, kw = _gemm_args(case)
        plan = epicute.explain(a, b, target=target, file=io.StringIO(), **kw)
        _check_gemm_plan(plan, _prepare_gemm(a, b, kw, target))

    failures = _sweep(cases, run)
    assert not failures, _report(failures, len(cases))


#: The calls of issue 56 item 4, refused before: a Llama-3-8B MLP quantized for an fp8 down projection, and
#: DeepSeek-V3's dense MLP (gate/up -> SwiGLU -> 1x128 quantization for the down projection).
ISSUE_CALLS = {
    "llama3_8b_bf16_swiglu_quantize": {"recipe": "bf16", "m": 8192, "n": 14336, "k": 4096},
    "deepseek_v3_fp8_blockwise_swiglu_quantize": {"recipe": "fp8_block", "m": 4096, "n": 18432, "k": 7168},
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("call", list(ISSUE_CALLS))
def test_gated_quantize_mlps_plan_whole_group_tiles(call, target):
    case = {"gated": True, "kind": "swiglu_quantize", "l": 1, "a_major": "k", "b_major": "k", "out_dtype": None,
            "a_scale_layout": "m_major", "b_scale_layout": "weight", **ISSUE_CALLS[call]}  # fmt: skip
    a, b, kw = _gemm_args(case)
    text = io.StringIO()
    plan = epicute.explain(a, b, target=target, file=text, **kw)
    _check_gemm_plan(plan, _prepare_gemm(a, b, kw, target))
    # 256 accumulator columns are 128 output columns: one whole quantize group per tile.
    assert (plan.config.schedule, plan.config.tile_m, plan.config.tile_n) == ("cooperative", 128, 256)
    assert "a tile must hold whole groups of 128 columns of D" in text.getvalue()  # why not narrower, in "why"
    if plan.problem.block_scaled:
        from epicute.gemm.config import promote_chunks

        assert promote_chunks(plan.config) == 2 and "two 128-column halves" in text.getvalue()


# ------------------------------------------------------------------ grouped GEMM

GROUPED_EPILOGUES = {
    "plain": (None, lambda m, n, g: {}),
    "expert_bias": (lambda acc, bias: ops.silu(acc + bias), lambda m, n, g: {"bias": meta(g, n)}),
    "token_score": (lambda acc, score: acc * score, lambda m, n, g: {"score": meta(m, 1, dtype=torch.float32)}),
    "aux": (lambda acc: {"D": ops.gelu(acc), "pre": acc}, lambda m, n, g: {}),
    "reductions": (
        lambda acc: {"D": acc, "rows": ops.row_sum(acc), "cols": ops.col_sum(acc), "peak": ops.amax(acc)},
        lambda m, n, g: {},
    ),  # fmt: skip
}
GROUPED_GATED = {
    "swiglu": (lambda gate, up: ops.silu(gate) * up, lambda m, n, g: {}),
    "swiglu_score": (
        lambda gate, up, score: ops.silu(gate) * up * score,
        lambda m, n, g: {"score": meta(m, 1, dtype=torch.float32)},
    ),  # fmt: skip
}


def _grouped_case(rng: random.Random) -> dict:
    mode = rng.choice(("rows", "rows", "gathered", "variable_k"))
    recipe = rng.choice(("bf16", "fp16", "fp8_block")) if mode != "variable_k" else rng.choice(("bf16", "fp16"))
    gated = mode != "variable_k" and rng.random() < 0.35
    # Variable K's epilogue operands are the dense batched GEMM's (the groups its batch): no per-token or
    # per-expert rows.
    kinds = ("plain", "aux", "reductions") if mode == "variable_k" else GROUPED_GATED if gated else GROUPED_EPILOGUES
    kind = rng.choice(list(kinds))
    return {
        "mode": mode, "recipe": recipe, "gated": gated, "kind": kind, "groups": rng.choice((1, 4, 8, 64, 128)),
        "total_m": rng.choice((1, 100, 1000, 4096, 16384, 32768, 131072)), "n": rng.choice(NS), "k": rng.choice(KS),
        "b_major": "k" if recipe == "fp8_block" else rng.choice("kn"),
    }  # fmt: skip


def _grouped_args(case: dict) -> tuple:
    g, m, n, k, recipe = case["groups"], case["total_m"], case["n"], case["k"], case["recipe"]
    n_acc = 2 * n if case["gated"] else n
    dtype = {"bf16": BF16, "fp16": FP16}.get(recipe, E4M3)
    offs = meta(g, dtype=torch.int32)
    kw: dict = {}
    if case["mode"] == "variable_k":  # grouped_gemm(x.t(), dy, offs): x (total_K, M), dy (total_K, N)
        a, b = meta(case["total_m"], k, dtype=dtype).t(), meta(case["total_m"], n, dtype=dtype)
    else:
        rows = m
        if case["mode"] == "gathered":
            kw["a_index"] = meta(m, dtype=torch.int32)
            rows = max(m // 2, 1)  # the tokens gathered from
        a = meta(rows, k, dtype=dtype)
        b = (
            meta(g, n_acc, k, dtype=dtype).transpose(-1, -2)
            if case["b_major"] == "k"
            else meta(g, k, n_acc, dtype=dtype)
        )
        if recipe == "fp8_block":
            kw["a_scale"] = meta(rows, -(-k // 128), dtype=torch.float32)
            kw["b_scale"] = meta(g, -(-n_acc // 128), -(-k // 128), dtype=torch.float32)
    fn, operands = (GROUPED_GATED if case["gated"] else GROUPED_EPILOGUES)[case["kind"]]
    if fn is not None:
        kw["epilogue"] = fn
        kw.update(operands(m, n, g))
        if case["kind"] == "aux":
            kw["out_dtypes"] = {"pre": torch.float32}
    if case["gated"]:
        kw["gated"] = True
    return a, b, offs, kw


@pytest.mark.parametrize("target", TARGETS)
def test_every_grouped_plan_validates(target):
    from dataclasses import replace

    from epicute.grouped.api import describe_grouped_call
    from epicute.grouped.prepare import prepare
    from epicute.runtime.target import resolve_target

    rng = random.Random(f"{SEED} grouped {target}")
    cases = [_grouped_case(rng) for _ in range(GROUPED_DRAWS)]

    def run(case):
        a, b, offs, kw = _grouped_args(case)
        plan = epicute.explain_grouped(a, b, offs, target=target, file=io.StringIO(), **kw)
        from epicute.gemm.heuristics import check_config

        check_config(plan.config, plan.problem.mean_group(), plan.epilogue, plan.target.smem_per_cta_bytes)
        kw = dict(kw)
        fixed = {name: kw.pop(name, None) for name in ("epilogue", "out_dtypes", "a_scale", "b_scale", "a_index")}
        gated = kw.pop("gated", False)
        _, _, request = describe_grouped_call(a, b, offs, fixed["epilogue"], None, None, fixed["out_dtypes"], None,
                                              kw, False, gated=gated, scales=(fixed["a_scale"], fixed["b_scale"]),
                                              a_index=fixed["a_index"])  # fmt: skip
        prepared = prepare(replace(request, target=resolve_target(target)))
        assert prepared.plan.config == plan.config
        _kernel_accepts(prepared)

    failures = _sweep(cases, run)
    assert not failures, _report(failures, len(cases))


# ------------------------------------------------------------------ attention: forward, decode, backward


def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * ops.tanh(score / 30.0)


def _alibi(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes * ops.abs(q_idx - kv_idx)


def _attention_case(rng: random.Random, decode: bool) -> dict:
    heads_kv = rng.choice((1, 2, 4, 8, 16))
    group = rng.choice((1, 2, 3, 4, 5, 7, 8, 12, 16, 40) if decode else (1, 2, 3, 4, 5, 6, 7, 8))
    varlen = (not decode) and rng.random() < 0.2  # packed sequences take no output epilogue (a typed refusal)
    return {
        "decode": decode, "batch": rng.choice((1, 2, 4, 16, 64)), "heads_kv": heads_kv, "group": group,
        "seqlen_q": rng.choice((1, 2, 4) if decode else (1, 100, 1000, 4096, 8192)),
        "seqlen_k": rng.choice((1, 128, 1000, 4096, 32768, 131072) if decode else (100, 1000, 4096, 8192)),
        "head_dim": rng.choice((64, 128, 256)), "dtype": rng.choice((BF16, FP16)), "causal": rng.random() < 0.5,
        "score_mod": rng.choice((None, None, "softcap", "alibi")),
        "epilogue": not (decode or varlen) and rng.random() < 0.2, "paged": decode and rng.random() < 0.5,
        "page_size": rng.choice((16, 64, 128, 256)), "seqused_k": decode and rng.random() < 0.5,
        "varlen": varlen, "deterministic": rng.random() < 0.3,
    }  # fmt: skip


def _attention_args(case: dict) -> tuple:
    b, hkv, d, dtype = case["batch"], case["heads_kv"], case["head_dim"], case["dtype"]
    hq, sq, sk = hkv * case["group"], case["seqlen_q"], case["seqlen_k"]
    kw: dict = {"causal": case["causal"]}
    if case["varlen"]:
        q, k = meta(b * sq, hq, d, dtype=dtype), meta(b * sk, hkv, d, dtype=dtype)
        cu_q, cu_k = meta(b + 1, dtype=torch.int32), meta(b + 1, dtype=torch.int32)
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk)
    elif case["paged"]:
        page = case["page_size"]
        per_sequence = -(-sk // page)
        q, k = meta(b, sq, hq, d, dtype=dtype), meta(b * per_sequence, page, hkv, d, dtype=dtype)
        kw["page_table"] = meta(b, per_sequence, dtype=torch.int32)
    else:
        q, k = meta(b, sq, hq, d, dtype=dtype), meta(b, sk, hkv, d, dtype=dtype)
    if case["seqused_k"]:
        kw["seqused_k"] = meta(b, dtype=torch.int32)
    if case["score_mod"] == "softcap":
        kw["score_mod"] = _softcap
    elif case["score_mod"] == "alibi":
        kw["score_mod"], kw["slopes"] = _alibi, meta(hq, dtype=torch.float32)
    if case["epilogue"]:
        kw["epilogue"], kw["bias"] = (lambda o, bias: o + bias), meta(d, dtype=dtype)
    return q, k, k, kw


#: Decode groups whose heads pack into a power-of-two number of rows only once padded (issue 56 item 1).
PADDED_GQA = (3, 5, 6, 7, 12, 24, 40)


def _run_attention(case: dict, target: str) -> None:
    from epicute.attention.backward_plan import BACKWARD_HEAD_DIMS, backward_smem_layout
    from epicute.attention.prepare import prepare
    from epicute.attention.validate import check_attention_args
    from epicute.runtime.target import resolve_target

    q, k, v, kw = _attention_args(case)
    deterministic = case["deterministic"]
    text = io.StringIO()
    plan = epicute.explain_attention(q, k, v, target=target, file=text, deterministic=deterministic, **kw)
    hw = resolve_target(target)
    plan.config.validate(hw, plan.problem.dtype)
    # The backward explain reports is the one autograd runs: trainable calls must have one that fits.
    hooks = {name: kw.pop(name) for name in ("score_mod", "epilogue") if name in kw}
    causal = kw.pop("causal")
    operands = {name: kw.pop(name) for name in ("slopes", "bias") if name in kw}
    call = check_attention_args(q, k, v, causal=causal, softmax_scale=None, require_cuda=False, **kw)
    prepared = prepare(call, hooks.get("score_mod"), hooks.get("epilogue"), operands, None, None, hw)
    assert prepared.plan.config == plan.config
    trainable = (case["head_dim"] in BACKWARD_HEAD_DIMS and not case["epilogue"] and not case["paged"]
                 and not case["seqused_k"])  # fmt: skip
    if trainable:
        variant = prepared.backward_variant(deterministic)
        variant.config.validate()
        assert backward_smem_layout(variant.config, plan.problem.dtype).total_bytes <= hw.smem_per_cta_bytes
        assert "not available" not in text.getvalue()


@pytest.mark.parametrize("target", TARGETS)
def test_every_attention_plan_validates(target):
    """Forward (prefill, varlen, score_mod, epilogue), decode (packed GQA, split-KV, paged, seqused_k) and the
    backward explain reports for trainable calls, over group sizes that divide a 64-row tile and some that do
    not (more of those in :func:`test_attention_decode_with_padded_groups`)."""
    rng = random.Random(f"{SEED} attention {target}")
    cases = [_attention_case(rng, decode=i % 2 == 1) for i in range(ATTENTION_DRAWS)]
    failures = _sweep(cases, lambda case: _run_attention(case, target))
    assert not failures, _report(failures, len(cases))


@pytest.mark.parametrize("group", PADDED_GQA)
@pytest.mark.parametrize("target", TARGETS)
def test_attention_decode_with_padded_groups(target, group):
    rng = random.Random(f"{SEED} attention decode group {group} {target}")
    cases = [{**_attention_case(rng, decode=True), "group": group} for _ in range(8)]
    failures = _sweep(cases, lambda case: _run_attention(case, target))
    assert not failures, _report(failures, len(cases))
