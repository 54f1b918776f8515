"""epicute.integrations.transformers.patch on tiny models (CPU; the GEMMs by the reference backend): the patched
model computes what the original does, trains the same (gradients against the original's autograd), and keeps
its state dict."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import epicute
from epicute.integrations.transformers import patch
from epicute.nn import GatedMLP, Linear
from tests.integrations.block_step import generate_logits_error, mlp_block_step

transformers = pytest.importorskip("transformers")

TOL = 2e-2  # bf16 end to end through two decoder layers: the original model in torch's bf16 is the peer


def _tiny(kind: str):
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    config = config_cls(hidden_size=256, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    return model_cls(config).to(torch.bfloat16)


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _train_steps(*models) -> tuple[list, list]:
    """One language-modelling step of each model on the same random tokens: the losses, and each model's parameter
    gradients by name."""
    ids = torch.randint(0, 96, (2, 11))
    losses, grads = [], []
    for model in models:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    return losses, grads


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("linears", [False, True])
def test_patched_model_trains_like_the_original(reference_layers, kind, linears):
    original = _tiny(kind)
    patched = copy.deepcopy(original)
    report = patch(patched, linears=linears)
    assert report["GatedMLP"] == 2 and report["Linear"] == (9 if linears else 0) and report["attention"] == 2
    assert patched.config._attn_implementation == "epicute"
    assert sum(isinstance(m, GatedMLP) for m in patched.modules()) == 2
    assert sorted(patched.state_dict()) == sorted(original.state_dict())
    for key, value in original.state_dict().items():
        assert torch.equal(patched.state_dict()[key], value), key  # the same values, moved into place

    losses, grads = _train_steps(original, patched)
    assert _rel(losses[1], losses[0]) < TOL
    # the patched model's MLP gradients sit in the interleaved weight: compare on the checkpoint's layout
    for layer in range(2):
        mlp = patched.model.layers[layer].mlp
        ref = original.model.layers[layer].mlp
        want = epicute.interleave_gate_up(ref.gate_proj.weight.grad, ref.up_proj.weight.grad)
        assert _rel(mlp.gate_up.grad, want) < TOL
        assert _rel(mlp.down_proj.weight.grad, ref.down_proj.weight.grad) < TOL
    assert _rel(grads[1]["model.embed_tokens.weight"], grads[0]["model.embed_tokens.weight"]) < TOL


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generate_reads_only_the_cached_keys(reference_layers, cache):
    """A static cache holds its full length from the first step: the empty slots must never be attended."""
    original = _tiny("llama").eval()
    patched = copy.deepcopy(original)
    patch(patched)
    with torch.no_grad():
        assert generate_logits_error(original, patched, torch.randint(0, 96, (2, 9)), cache) < TOL


def test_a_patched_model_compiles(reference_layers):
    """torch.compile of a patched model (epicute's ops opaque to it, the rest Inductor's): the forward agrees with
    the original; a compiled attention backward on the reference backend is refused with what to do instead."""
    torch._dynamo.reset()
    original = _tiny("llama")
    patched = copy.deepcopy(original)
    patch(patched, linears=True)
    compiled = torch.compile(patched, dynamic=False)
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        assert _rel(compiled(input_ids=ids).logits, original(input_ids=ids).logits) < TOL
    loss = compiled(input_ids=ids, labels=ids).loss
    with pytest.raises(epicute.ConfigError, match="train without torch.compile"):
        loss.backward()


def test_padded_batches_and_dropout_are_refused(reference_layers):
    model = _tiny("llama")
    patch(model)
    ids = torch.randint(0, 96, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0
    with pytest.raises(epicute.ConfigError, match="padding mask with zeros"):
        model(input_ids=ids, attention_mask=mask)
    model(input_ids=ids, attention_mask=torch.ones_like(mask))  # a mask of ones is no padding
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(epicute.ConfigError, match="attention dropout 0.1"):
        model(input_ids=ids)


def test_linears_share_the_original_parameters():
    model = _tiny("llama")
    q_proj = model.model.layers[0].self_attn.q_proj
    patch(model, mlps=False, linears=True)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Linear)
    assert model.model.layers[0].self_attn.q_proj.weight is q_proj.weight


def test_a_model_that_is_not_a_transformers_model_is_refused_with_the_fix():
    with pytest.raises(epicute.ConfigError, match="model is a Sequential: patch takes a transformers model"):
        patch(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    with pytest.raises(epicute.ConfigError, match="model is a int"):
        patch(3, attention=False)
    # Without attention, a plain module's linears swap as in a transformers model.
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16))
    assert patch(plain, attention=False, linears=True)["Linear"] == 1


def test_unsupported_transformers_versions_are_refused(monkeypatch):
    model = _tiny("llama")  # before the version is faked: building a model reads transformers' modules
    # The module as patch() imports it (transformers' lazy module may have replaced the one imported above).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    with pytest.raises(epicute.ConfigError, match=r"transformers 4.46.0 is not supported"):
        patch(model)


def _tiny_moe(kind: str):
    config_cls, model_cls = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[kind]
    sizes = {"intermediate_size": 136, **({"moe_intermediate_size": 136} if kind == "qwen3_moe" else {})}
    config = config_cls(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=96, num_local_experts=5, num_experts=5, num_experts_per_tok=2,
                        max_position_embeddings=64, **sizes)  # fmt: skip
    torch.manual_seed(0)
    return model_cls(config).to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_patched_moe_experts_train_like_the_original(reference_layers, kind):
    """One MoE block, original and patched, on the same hidden states: the router picks the same experts on both
    (a whole model in bf16 may route a token differently after a last-bit difference upstream, which moves its
    gradients to other experts: a comparison of routing, not of epicute's experts)."""
    original = _tiny_moe(kind)
    patched = copy.deepcopy(original)
    report = patch(patched)
    assert report["MoEExperts"] == 2
    assert sum(isinstance(m, epicute.nn.MoEExperts) for m in patched.modules()) == 2
    assert patched.state_dict().keys() == original.state_dict().keys()  # transformers' keys and layout
    for name, want in original.state_dict().items():
        assert torch.equal(patched.state_dict()[name], want), name
    hidden = torch.randn(2, 13, 256, dtype=torch.bfloat16)
    upstream = torch.randn(2, 13, 256, dtype=torch.bfloat16)
    (out0, dx0, grads0), (out1, dx1, grads1) = (mlp_block_step(m, hidden, upstream) for m in (original, patched))
    assert _rel(out1, out0) < TOL and _rel(dx1, dx0) < TOL
    # The patched experts train their gate/up weight interleaved: its gradient is the interleaved original's.
    gate_up_grad = grads0.pop("experts.gate_up_proj")
    want = epicute.interleave_gate_up(*gate_up_grad.chunk(2, dim=-2))
    assert _rel(grads1.pop("experts.gate_up"), want) < TOL
    assert sorted(grads1) == sorted(grads0)
    for name, want in grads0.items():
        assert _rel(grads1[name], want) < TOL, name


def test_the_pinned_transformers_range_is_the_supported_one():
    """pyproject's ``transformers`` extra (and the test extra) pin what ``patch`` accepts: one range, two places."""
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    from epicute.integrations.transformers import SUPPORTED

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    (low_major, low_minor), (high_major, _) = SUPPORTED
    pin = f"transformers>={low_major}.{low_minor},<{high_major}"
    assert project["optional-dependencies"]["transformers"] == [pin]
    assert pin in project["optional-dependencies"]["test"]


#: fp8 training's inputs rounded to e4m3 (tests/nn/fp8_cases.py): the loss, and one block's output and gradients
FP8_TOL = 2.0**-3


def test_fp8_patch_trains_every_layer_but_the_head_in_fp8(reference_layers):
    """``patch(fp8="blockwise", linears=True)``: the MLPs and every linear but ``lm_head`` train in fp8; the loss and
    the embedding's gradient follow the original model's within fp8's rounding, the state dict is the original's."""
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=144, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    patched = copy.deepcopy(original)
    report = patch(patched, linears=True, fp8="blockwise")
    assert report["GatedMLP"] == 2 and report["Linear"] == 9 and report["fp8"] == 10  # 8 projections, 2 MLPs
    assert patched.lm_head.fp8 is None and patched.model.layers[0].self_attn.q_proj.fp8 == "blockwise"
    assert sorted(patched.state_dict()) == sorted(original.state_dict())
    losses, grads = _train_steps(original, patched)
    embedding = "model.embed_tokens.weight"
    assert _rel(losses[1], losses[0]) < FP8_TOL and _rel(grads[1][embedding], grads[0][embedding]) < FP8_TOL
    assert all(p.grad is not None for p in patched.parameters())


def test_fp8_patch_trains_moe_experts_in_fp8(reference_layers):
    """Mixtral's experts under ``patch(fp8="blockwise")``: one MoE block against the original's (the same routing),
    output, input gradient and every weight's gradient within fp8's rounding."""
    config = transformers.MixtralConfig(hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                        num_local_experts=5, num_experts_per_tok=2,
                                        max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    original = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    patched = copy.deepcopy(original)
    report = patch(patched, fp8="blockwise")
    assert report["MoEExperts"] == 2 and report["fp8"] == 2
    hidden = torch.randn(2, 37, 256, dtype=torch.bfloat16)
    upstream = torch.randn(2, 37, 256, dtype=torch.bfloat16)
    (out0, dx0, grads0), (out1, dx1, grads1) = (mlp_block_step(m, hidden, upstream) for m in (original, patched))
    assert _rel(out1, out0) < FP8_TOL and _rel(dx1, dx0) < FP8_TOL
    want = epicute.interleave_gate_up(*grads0.pop("experts.gate_up_proj").chunk(2, dim=-2))
    assert _rel(grads1.pop("experts.gate_up"), want) < FP8_TOL
    for name, want in grads0.items():
        assert _rel(grads1[name], want) < FP8_TOL, name


@pytest.mark.parametrize(("fp8", "error", "match"), [
    ("rowwise", epicute.ConfigError, "fp8='rowwise': patch trains in fp8 with 'blockwise'"),
    ("blockwise", epicute.ShapeError, "intermediate_size=136: fp8 experts need"),
])  # fmt: skip
def test_fp8_patch_refuses_what_it_cannot_train(fp8, error, match):
    model = _tiny_moe("mixtral")  # intermediate 136: not a multiple of 64
    with pytest.raises(error, match=match):
        patch(model, fp8=fp8)
