"""Unmodified model code under ``torch.compile`` with epicute's backend against plain ``torch.compile`` (H200).

Usage: python bench/compile.py [--cases llama_train,llama_prefill,mixtral_train,gpt2_mlp_train,vit_block_train]
                               [--max-autotune] [--out PATH]

Nothing in the models is changed: ``torch.compile(model, backend=epicute.integrations.compile.backend)`` lifts what
it finds (linears with their elementwise chains, transformers' grouped experts, SDPA; each GEMM candidate measured
against Inductor's own chain and kept where it wins), against ``torch.compile(model)`` (default mode) and, with
``--max-autotune``, ``mode="max-autotune"``, which epicute's contender then takes too (its candidates measured
against Inductor's autotuned chains, the graph around them autotuned and replayed as CUDA graphs).
Cases (bf16, random weights from configs, nothing downloaded):

- ``llama_train`` / ``llama_prefill``: 2 Llama-3-8B-shaped decoder layers (bench/models.py's model), a training step
  on 2 x 4096 tokens / a forward over 4 x 2048;
- ``mixtral_train``: 2 Mixtral-8x7B-shaped layers (transformers' grouped-mm experts), a training step on 2 x 4096;
- ``gpt2_mlp_train``: a GPT-2-style MLP block, ``x + fc2(gelu(fc1(ln(x))))``, hidden 4096, 4x, biases, 8192 tokens;
- ``vit_block_train``: one ViT-L/16-shaped ``ViTLayer`` (1024 hidden, 16 heads, MLP 4096) on 64 images x 197 tokens.

Each contender's first call compiles, cold (:func:`cold_caches`: Inductor's and Triton's caches fresh, epicute's
kernels and lift decisions in an empty directory and none in memory); its wall time is printed. Each is checked
against the eager model (loss, logits or output, relative error); then all are timed in interleaved rounds
(``time_flushed``, L2 flushed, medians). Writes bench/results/compile.json (unit: thousand tokens per second), and
the first calls' seconds beside it (compile_time.json; compile_time_X.json for an ``--out`` of compile_X.json).
Also prints, per case, what epicute's backend lifted and left (``last_report``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import Row, announced, finish_peer_run, measure_rates, start_peer_run, write_result

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compile.json"
TOLERANCE = 2e-2  # bf16 end to end; the eager model is the reference
CASES = ("llama_train", "llama_prefill", "mixtral_train", "gpt2_mlp_train", "vit_block_train")


def case_model(name: str):
    """(module, its inputs, tokens per step, training); a training case's language model gets labels."""
    if name in ("llama_train", "llama_prefill", "mixtral_train"):
        from models import build

        model = build({"mixtral_train": "mixtral_train"}.get(name, "llama_train"), 2, "sdpa")
        batch, seqlen = (4, 2048) if name == "llama_prefill" else (2, 4096)
        ids = torch.randint(0, model.config.vocab_size, (batch, seqlen), device="cuda")
        training = name != "llama_prefill"
        return model, {"input_ids": ids, **({"labels": ids} if training else {})}, batch * seqlen, training
    torch.manual_seed(0)
    if name == "gpt2_mlp_train":
        model = ResidualMLP(4096).to(device="cuda", dtype=torch.bfloat16)
        x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return model, {"x": x}, 8192, True
    from transformers import ViTConfig
    from transformers.models.vit.modeling_vit import ViTLayer

    config = ViTConfig(hidden_size=1024, num_attention_heads=16, intermediate_size=4096, attn_implementation="sdpa")
    model = ViTLayer(config).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 197, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return model, {"hidden_states": x}, 64 * 197, True


class ResidualMLP(torch.nn.Module):
    """GPT-2's MLP block: ``x + fc2(gelu(fc1(ln(x))))``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = (
            torch.nn.LayerNorm(hidden),
            torch.nn.Linear(hidden, 4 * hidden),
            torch.nn.Linear(4 * hidden, hidden),
        )

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


@contextlib.contextmanager
def cold_caches():
    """A first call compiling from nothing: Inductor's and Triton's caches fresh (``fresh_cache``), epicute's disk
    cache (kernels, lift decisions) an empty directory and its in-process kernels forgotten."""
    from torch._inductor.utils import fresh_cache

    from epicute.runtime.cache import KERNEL_CACHE

    saved = os.environ.get("EPICUTE_CACHE_DIR")
    with tempfile.TemporaryDirectory() as empty, fresh_cache():
        os.environ["EPICUTE_CACHE_DIR"] = empty
        KERNEL_CACHE.clear_memory()
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("EPICUTE_CACHE_DIR", None)
            else:
                os.environ["EPICUTE_CACHE_DIR"] = saved


def _output(result):
    """The tensor a step is judged by: a model's loss or last logits, a layer's output."""
    if hasattr(result, "loss") and result.loss is not None:
        return result.loss
    if hasattr(result, "logits"):
        return result.logits[:, -1]
    return result[0] if isinstance(result, tuple) else result


def step_of(module, inputs: dict, training: bool) -> Callable[[], object]:
    """One step of ``module`` on ``inputs``: the output (a loss, last logits or a layer's output), with its backward
    where the case trains (the output summed; every gradient dropped after, as a training loop's ``zero_grad``
    does: a gradient kept into the next step would be a CUDA graph's output that step overwrites, under
    ``mode="max-autotune"``)."""
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        if training:
            out = _output(module(**inputs))
            out.float().sum().backward()
            module.zero_grad(set_to_none=True)
            for leaf in leaves:
                leaf.grad = None
            return out.detach().clone()
        with torch.inference_mode():
            return _output(module(**inputs)).float()

    return run


def run_case(name: str, max_autotune: bool) -> tuple[Row, bool, Row]:
    """The case's rates (thousand tokens a second), whether epicute ran right, and each contender's cold compile
    (seconds of its first call)."""
    from epicute.integrations import compile as EC

    torch._dynamo.reset()
    model, inputs, tokens, training = case_model(name)
    row: Row = {"case": name}
    print(name)
    # Under --max-autotune epicute's backend takes the mode too: the rest of the graph autotuned and run as CUDA
    # graphs like the peer's, and each candidate measured against Inductor's autotuned chain (Measured.settings).
    contenders = {"epicute": dict(backend=EC.backend, **({"mode": "max-autotune"} if max_autotune else {})),
                  "torch_compile": {}}  # fmt: skip
    if max_autotune:
        contenders["torch_compile_max_autotune"] = {"mode": "max-autotune"}
    models = {label: torch.compile(copy.deepcopy(model), dynamic=False, **options)
              for label, options in contenders.items()}  # fmt: skip
    step = functools.partial(step_of, inputs=inputs, training=training)
    want = step(model)()

    def error(got) -> float:
        return ((got.double() - want.double()).norm() / want.double().norm()).item()

    def report() -> None:
        print("    " + str(EC.last_report()).replace("\n", "\n    "))

    compile_seconds: Row = {"case": name}

    def first_call(label: str, module) -> Callable[[], object]:
        announce = announced(label, step(module), report if label == "epicute" else None)

        def run():
            start = time.perf_counter()
            with cold_caches():
                result = announce()
            compile_seconds[label] = round(time.perf_counter() - start, 1)
            return result

        return run

    runs = {label: (first_call(label, module), step(module)) for label, module in models.items()}
    return row, measure_rates(row, runs, error, TOLERANCE, tokens), compile_seconds


def times_path_of(out: Path) -> Path:
    """Where the cold first calls of a run writing ``out`` go: compile.json's beside it as compile_time.json,
    compile_X.json's as compile_time_X.json (two runs into one folder keep both)."""
    rest = out.stem.removeprefix("compile") if out.stem.startswith("compile") else f"_{out.stem}"
    return out.with_name(f"compile_time{rest}{out.suffix}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--max-autotune", action="store_true", help="add torch.compile(mode='max-autotune')")
    args = start_peer_run(parser, DEFAULT_OUT)
    if args is None:
        return 2
    rows, oks, compile_rows = [], [], []
    for name in args.cases.split(","):
        row, ok, seconds = run_case(name, args.max_autotune)
        rows.append(row)
        oks.append(ok)
        compile_rows.append(seconds)
    command = " ".join(["python", "bench/compile.py", *sys.argv[1:]])
    times_path = times_path_of(Path(args.out))
    times = write_result(times_path, "compile_time", command, "s", False, compile_rows)
    print(f"wrote {times} (cold first calls, s): {compile_rows}")
    return finish_peer_run(args.out, "compile", rows, all(oks), unit="ktokens/s")


if __name__ == "__main__":
    sys.exit(main())
