"""The examples run as a newcomer runs them, on the CPU (``--tiny``: the reference backend)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_llama_learns_its_batch():
    losses = _example("train_llama").main(["--tiny", "--steps", "6"])
    assert len(losses) == 6
    assert losses[-1] < 0.8 * losses[0], losses  # AdamW on one fixed batch: the loss falls


def test_generate_matches_the_unpatched_model_step_by_step():
    out = _example("generate").main(["--tiny", "--new-tokens", "5"])
    assert out["tokens"].shape == (2, 24 + 5)
    logits, want = out["logits"].double(), out["unpatched_logits"].double()
    assert logits.shape == want.shape == (2, 5, 512)
    assert ((logits - want).norm() / want.norm()).item() < 2e-2  # bf16 through two layers, as tests/integrations
