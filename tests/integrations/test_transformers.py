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
from epicute.nn import functional as EF

transformers = pytest.importorskip("transformers")

TOL = 2e-2  # bf16 end to end through two decoder layers: the original model in torch's bf16 is the peer


@pytest.fixture
def reference_kernels(monkeypatch):
    gemm = EF.gemm
    monkeypatch.setattr(EF, "gemm", lambda a, b, /, **kwargs: gemm(a, b, **kwargs, backend="reference"))


def _tiny(kind: str):
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    config = config_cls(hidden_size=64, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    return model_cls(config).to(torch.bfloat16)


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("linears", [False, True])
def test_patched_model_trains_like_the_original(reference_kernels, kind, linears):
    original = _tiny(kind)
    patched = copy.deepcopy(original)
    report = patch(patched, linears=linears)
    assert report["GatedMLP"] == 2 and (report["Linear"] > 0) == linears
    assert sum(isinstance(m, GatedMLP) for m in patched.modules()) == 2
    assert sorted(patched.state_dict()) == sorted(original.state_dict())
    for key, value in original.state_dict().items():
        assert torch.equal(patched.state_dict()[key], value), key  # the same values, moved into place

    ids = torch.randint(0, 96, (2, 11))
    losses, grads = [], []
    for model in (original, patched):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert _rel(losses[1], losses[0]) < TOL
    # the patched model's MLP gradients sit in the interleaved weight: compare on the checkpoint's layout
    for layer in range(2):
        mlp = patched.model.layers[layer].mlp
        ref = original.model.layers[layer].mlp
        want = epicute.interleave_gate_up(ref.gate_proj.weight.grad, ref.up_proj.weight.grad)
        assert _rel(mlp.gate_up.grad, want) < TOL
        assert _rel(mlp.down_proj.weight.grad, ref.down_proj.weight.grad) < TOL
    assert _rel(grads[1]["model.embed_tokens.weight"], grads[0]["model.embed_tokens.weight"]) < TOL


def test_linears_share_the_original_parameters():
    model = _tiny("llama")
    q_proj = model.model.layers[0].self_attn.q_proj
    patch(model, mlps=False, linears=True)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Linear)
    assert model.model.layers[0].self_attn.q_proj.weight is q_proj.weight


def test_unsupported_transformers_versions_are_refused(monkeypatch):
    model = _tiny("llama")  # before the version is faked: building a model reads transformers' modules
    # The module as patch() imports it (transformers' lazy module may have replaced the one imported above).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    with pytest.raises(epicute.ConfigError, match=r"transformers 4.46.0 is not supported"):
        patch(model)


@pytest.fixture
def reference_grouped(monkeypatch):
    from epicute.integrations import transformers as integration

    grouped = integration.grouped_gemm
    monkeypatch.setattr(integration, "grouped_gemm",
                        lambda a, b, offsets, /, **kwargs: grouped(a, b, offsets, **kwargs, backend="reference"))


def _tiny_moe(kind: str):
    config_cls, model_cls = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[kind]
    sizes = {"intermediate_size": 136, **({"moe_intermediate_size": 136} if kind == "qwen3_moe" else {})}
    config = config_cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=96, num_local_experts=5, num_experts=5, num_experts_per_tok=2,
                        max_position_embeddings=64, **sizes)  # fmt: skip
    torch.manual_seed(0)
    return model_cls(config).to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_patched_moe_experts_train_like_the_original(reference_kernels, reference_grouped, kind):
    original = _tiny_moe(kind)
    patched = copy.deepcopy(original)
    report = patch(patched)
    assert report["experts"] == 2
    assert patched.config._experts_implementation == "epicute"
    ids = torch.randint(0, 96, (2, 13))
    losses, grads = [], []
    for model in (original, patched):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert _rel(losses[1], losses[0]) < TOL
    assert sorted(grads[1]) == sorted(grads[0])  # every parameter the original trains gets a gradient
    for name in grads[0]:
        if "experts" in name or "gate" in name:
            assert _rel(grads[1][name], grads[0][name]) < TOL, name
