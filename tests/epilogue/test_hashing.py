"""The semantic hash: equal for the same math, different for anything the generated code depends on."""

from __future__ import annotations

import re

import torch

import epicute
from epicute import ops
from epicute.epilogue.hashing import canonical_text, semantic_hash
from epicute.epilogue.tracer import as_epilogue

KINDS = {"bias": "row", "alpha": "scalar"}


def h(fn, kinds=KINDS, dtypes=None, out_dtypes=None) -> str:
    return semantic_hash(as_epilogue(fn).trace(kinds, dtypes, out_dtypes))


def f(acc, bias, alpha):
    return ops.gelu(alpha * acc + bias)


def test_is_a_sha256_hex_digest_and_stable_across_traces():
    digest = h(f)
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert h(f) == digest == h(epicute.epilogue(f))


def test_same_body_under_another_name_hashes_the_same():
    def g(acc, bias, alpha):
        return ops.gelu(alpha * acc + bias)

    assert h(g) == h(f)


def test_edited_body_changes_the_hash():
    def tanh_gelu(acc, bias, alpha):
        return ops.gelu(alpha * acc + bias, approximate="tanh")

    def swapped(acc, bias, alpha):
        return ops.gelu(alpha * (acc + bias))

    assert len({h(f), h(tanh_gelu), h(swapped)}) == 3


def test_captured_constant_changes_the_hash():
    def make(scale):
        return lambda acc, bias, alpha: alpha * acc + bias * scale

    assert h(make(2.0)) == h(make(2.0))
    assert h(make(2.0)) != h(make(3.0))
    assert h(make(0.0)) != h(make(-0.0))


def test_global_constant_changed_between_traces_changes_the_hash():
    ns = {"ops": ops, "SCALE": 2.0}
    exec("def g(acc, bias, alpha):\n    return alpha * acc + bias * SCALE", ns)
    epi = as_epilogue(ns["g"])
    before = semantic_hash(epi.trace(KINDS))
    ns["SCALE"] = 4.0
    assert semantic_hash(epi.trace(KINDS)) != before


def test_scalar_operand_value_does_not_change_the_hash():
    epi = as_epilogue(f)
    bias = torch.randn(8)
    hashes = set()
    for alpha in (0.5, 2.0, torch.tensor(7.0)):
        specs = epi.operands({"bias": bias, "alpha": alpha}, 4, 8)
        hashes.add(semantic_hash(epi.trace({k: s.kind for k, s in specs.items()})))
    assert len(hashes) == 1


def test_operand_kinds_dtypes_and_output_dtypes_change_the_hash():
    base = h(f)
    assert h(f, kinds={"bias": "col", "alpha": "scalar"}) != base
    assert h(f, dtypes={"bias": "bf16"}) != base
    assert h(f, out_dtypes={"D": torch.bfloat16}) != base


def test_canonical_text_lists_nodes_inputs_and_stored_outputs():
    text = canonical_text(as_epilogue(f).trace(KINDS, out_dtypes={"D": torch.float16}))
    assert text.splitlines()[0].startswith("epicute-epilogue-ir")
    assert "input alpha = %2" in text and "output D = %5 : fp16" in text and "gelu_erf(%4)" in text
