"""Whole transformers models on epicute against the ways they usually run (H200): tokens per second.

Usage: python bench/models.py [--cases llama_train,llama_train_8x2048,llama_prefill,mixtral_train,qwen3_moe_train,
                               llama_decode_b32,llama_decode_b128] [--layers 2] [--fp8] [--out PATH]

Models are built from configs (random weights, nothing downloaded), bf16, ``--layers`` decoder layers, the real
vocabulary (its LM head and loss are part of every step):

- ``llama_train``: Llama-3-8B-shaped (hidden 4096, MLP 14336, 32/8 heads, vocab 128256), a training step
  (``model(input_ids, labels=...).loss.backward()``) on batch 2 x 4096 (``llama_train_8x2048``: 8 x 2048);
- ``llama_prefill``: the same model's forward over batch 4 x 2048 (no labels; inference mode);
- ``mixtral_train`` / ``qwen3_moe_train``: Mixtral-8x7B- and Qwen3-30B-A3B-shaped MoE models, a training step on
  batch 2 x 4096;
- ``llama_decode_b32`` / ``_b128``: the Llama model's decode step (one new token per sequence, logits of it) at
  batch 32 / 128 over a 4096-token context in a static cache of exactly that length (filled once by the unpatched
  model's prefill and copied to every contender, so none reads more keys than another). Contenders: ``hf_sdpa``
  eager, ``hf_sdpa_graphs`` (``torch.compile(mode="reduce-overhead")``: CUDA graphs, HF's recipe for static caches),
  ``epicute`` (patched, under the same compile mode: epicute's ops are opaque to it and recorded into its CUDA
  graphs) and ``epicute_eager`` (patched, no graphs). Unit: thousand tokens per second (batch / step time).

Contenders, each built from the same weights (a deep copy of one model) and fed the same tokens:

- ``epicute``: ``epicute.integrations.transformers.patch(model, linears=True)`` (MLPs, MoE experts, every linear
  layer and the attention on epicute) under ``torch.compile`` (default mode, static shapes): epicute's ops opaque to
  it, the rest (norms, rotary, routing, the loss) fused by Inductor; ``epicute_eager``: the patched model as it is;
  with ``--fp8`` (training cases), ``epicute_fp8``: ``patch(model, linears=True, fp8="blockwise")`` under the same
  compile (every swapped layer but the LM head trained in fp8, DeepSeek-V3's recipe), epicute's own figure beside
  the bf16 one (not a peer);
- ``hf_sdpa``: transformers with ``attn_implementation="sdpa"`` (its default); ``hf_eager``: ``"eager"``;
- ``hf_sdpa_compile``: ``hf_sdpa`` under ``torch.compile`` (default mode, static shapes);
- ``liger`` (training): Liger's ``apply_liger_kernel_to_<model>(model=...)`` (:data:`LIGER`) on an SDPA model
  (RMSNorm, SwiGLU, RoPE and its fused linear cross-entropy). Liger patches the modeling module's globals (RoPE,
  the RMSNorm and MLP classes); those patches are undone for everyone else and applied only around its own
  steps, so no other contender runs Liger's code.

Every contender's first step is checked, not timed: its loss (training) or last-position logits (prefill)
against the unpatched SDPA model's, relative error; a failing contender is reported and left out. Then all are
timed in interleaved rounds (``time_flushed``: L2 flushed, medians). Writes bench/results/models.json (unit:
thousand tokens per second).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import sys
from collections.abc import Callable
from pathlib import Path

from common import Row, finish_peer_run, measure_rates, start_peer_run

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "models.json"
TOLERANCE = 2e-2  # bf16 end to end: the unpatched bf16 model is itself the reference

LLAMA = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)  # fmt: skip
MIXTRAL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=32000, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=8192)  # fmt: skip
QWEN3_MOE = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                 max_position_embeddings=8192)  # fmt: skip
#: case -> (config class name, model class name, config, batch, sequence length, training)
CASES = {
    "llama_train": ("LlamaConfig", "LlamaForCausalLM", LLAMA, 2, 4096, True),
    "llama_train_8x2048": ("LlamaConfig", "LlamaForCausalLM", LLAMA, 8, 2048, True),
    "llama_prefill": ("LlamaConfig", "LlamaForCausalLM", LLAMA, 4, 2048, False),
    "mixtral_train": ("MixtralConfig", "MixtralForCausalLM", MIXTRAL, 2, 4096, True),
    "qwen3_moe_train": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE, 2, 4096, True),
}
#: decode case -> (the model's case, batch, context)
DECODE_CASES = {"llama_decode_b32": ("llama_prefill", 32, 4096), "llama_decode_b128": ("llama_prefill", 128, 4096)}


def build(name: str, layers: int, attn: str):
    import torch
    import transformers

    config_name, model_name, sizes, *_ = CASES[name]
    config = getattr(transformers, config_name)(num_hidden_layers=layers, attn_implementation=attn, **sizes)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, model_name)(config)
    return model.to(torch.bfloat16)


def with_weights(model, like):
    """``model`` holding ``like``'s weights (an attention implementation is fixed when a model is built)."""
    model.load_state_dict(like.state_dict())
    return model


@contextlib.contextmanager
def module_globals(module, values: dict):
    """``module``'s globals set to ``values`` within the block (Liger's patches, for Liger's own steps only)."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


#: model class -> (Liger's patch function, the transformers module whose globals it patches)
LIGER = {
    "LlamaForCausalLM": ("apply_liger_kernel_to_llama", "transformers.models.llama.modeling_llama"),
    "MixtralForCausalLM": ("apply_liger_kernel_to_mixtral", "transformers.models.mixtral.modeling_mixtral"),
    "Qwen3MoeForCausalLM": ("apply_liger_kernel_to_qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe"),
}


def liger_model(base):
    """An SDPA model with ``base``'s weights, patched by Liger; the modeling module and its globals that Liger
    patched (undone, to be set only around Liger's own steps)."""
    import importlib

    import liger_kernel.transformers

    apply_name, module_name = LIGER[type(base).__name__]
    modeling = importlib.import_module(module_name)
    model = copy.deepcopy(base)
    before = dict(vars(modeling))
    getattr(liger_kernel.transformers, apply_name)(model=model)
    patched = {name: value for name, value in vars(modeling).items() if before.get(name) is not value}
    for name in patched:
        if name in before:
            setattr(modeling, name, before[name])
    return model, modeling, patched


def run_case(name: str, layers: int, fp8: bool = False) -> tuple[Row, bool]:
    import torch

    from epicute.integrations.transformers import patch

    torch._dynamo.reset()
    *_, batch, seqlen, training = CASES[name]
    row: Row = {"case": f"{name} L{layers} {batch}x{seqlen}"}
    print(row["case"])
    sdpa = build(name, layers, "sdpa")
    vocab = sdpa.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seqlen), device="cuda")
    models: dict[str, tuple[object, contextlib.AbstractContextManager | None]] = {}
    epicute_model = copy.deepcopy(sdpa)
    print(f"  epicute patched: {patch(epicute_model, linears=True)}")
    # The patched model under torch.compile: epicute's ops stay opaque, Inductor fuses what lies between them.
    models["epicute"] = (torch.compile(epicute_model, dynamic=False), None)
    models["epicute_eager"] = (epicute_model, None)
    if fp8 and training:
        fp8_model = copy.deepcopy(sdpa)
        print(f"  epicute_fp8 patched: {patch(fp8_model, linears=True, fp8='blockwise')}")
        models["epicute_fp8"] = (torch.compile(fp8_model, dynamic=False), None)
    models["hf_sdpa"] = (sdpa, None)
    models["hf_eager"] = (with_weights(build(name, layers, "eager"), sdpa), None)
    models["hf_sdpa_compile"] = (torch.compile(copy.deepcopy(sdpa), dynamic=False), None)
    if training and type(sdpa).__name__ in LIGER:
        try:
            liger, modeling, patched = liger_model(sdpa)
            models["liger"] = (liger, functools.partial(module_globals, modeling, patched))
        except (ImportError, AttributeError) as exc:  # no Liger wheel, or one without this model's patch
            print(f"  liger            not run: {exc}")

    def step(model, scope) -> Callable[[], object]:
        def run():
            with scope() if scope else contextlib.nullcontext():
                if training:
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    return loss.detach()
                with torch.inference_mode():
                    return model(input_ids=ids).logits[:, -1].float()

        return run

    steps = {label: step(model, scope) for label, (model, scope) in models.items()}
    want = steps["hf_sdpa"]()  # the reference: the unpatched SDPA model
    for model, _ in models.values():
        model.zero_grad(set_to_none=True)

    def error(got) -> float:
        return ((got.double() - want.double()).norm() / want.double().norm()).item()

    runs = {label: (fn, fn) for label, fn in steps.items()}
    return row, measure_rates(row, runs, error, TOLERANCE, batch * seqlen)


def run_decode(name: str, layers: int) -> tuple[Row, bool]:
    import torch
    from transformers import StaticCache

    from epicute.integrations.transformers import patch

    torch._dynamo.reset()
    model_case, batch, context = DECODE_CASES[name]
    row: Row = {"case": f"{name} L{layers} {batch}x1 context {context}"}
    print(row["case"])
    sdpa = build(model_case, layers, "sdpa").eval()
    ids = torch.randint(0, sdpa.config.vocab_size, (batch, context), device="cuda")
    filled = StaticCache(config=sdpa.config, max_cache_len=context)
    with torch.inference_mode():  # the context's keys and values, once: every contender gets a copy
        sdpa(input_ids=ids[:, :-1], past_key_values=filled, logits_to_keep=1)
    new = ids[:, -1:]
    position = torch.full((batch, 1), context - 1, device="cuda")
    cache_position = torch.tensor([context - 1], device="cuda")
    patched = copy.deepcopy(sdpa)
    print(f"  epicute patched: {patch(patched, linears=True)}")
    graphs = {"hf_sdpa_graphs", "epicute"}  # CUDA graphs through torch.compile(mode="reduce-overhead")
    models = {"hf_sdpa": sdpa, "hf_sdpa_graphs": sdpa, "epicute": patched, "epicute_eager": patched}

    def step(label: str, model) -> Callable[[], object]:
        cache = copy.deepcopy(filled)
        for layer in cache.layers:  # a copy's tensors are new: fixed addresses again, as HF marks its own
            for t in (layer.keys, layer.values, layer.cumulative_length):
                torch._dynamo.mark_static_address(t)
        forward = torch.compile(model.forward, mode="reduce-overhead") if label in graphs else model.forward

        def run():  # the same slot written every step (the cache's own length set back): the same work each step
            with torch.inference_mode():  # the cache was filled in inference mode: its tensors are inference tensors
                for layer in cache.layers:
                    layer.cumulative_length.fill_(context - 1)
                out = forward(input_ids=new, past_key_values=cache, position_ids=position,
                              cache_position=cache_position, use_cache=True)  # fmt: skip
                return out.logits[:, -1].float().clone()

        return run

    steps = {label: step(label, model) for label, model in models.items()}
    want = steps["hf_sdpa"]()

    def error(got) -> float:
        return ((got.double() - want.double()).norm() / want.double().norm()).item()

    def checked(fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: [fn() for _ in range(3)][-1]  # CUDA-graph trees warm up, record, replay: the replay checked

    runs = {label: (checked(fn), fn) for label, fn in steps.items()}
    return row, measure_rates(row, runs, error, TOLERANCE, batch, rounds=5, digits=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join([*CASES, *DECODE_CASES]),
                        help=f"comma-separated subset of {[*CASES, *DECODE_CASES]}")  # fmt: skip
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--fp8", action="store_true", help="training cases: an epicute_fp8 contender too")
    args = start_peer_run(parser, DEFAULT_OUT)
    if args is None:
        return 2
    rows, all_ok = [], True
    for name in args.cases.split(","):
        row, ok = run_decode(name, args.layers) if name in DECODE_CASES else run_case(name, args.layers, args.fp8)
        rows.append(row)
        all_ok = all_ok and ok
    return finish_peer_run(args.out, "models", rows, all_ok, unit="ktokens/s")


if __name__ == "__main__":
    sys.exit(main())
