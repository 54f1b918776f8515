"""bench/'s result tables: rows are compared with their own baseline peer (CPU, no torch call)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from common import peer_groups
from readme_table import render


def _row(case, **figures):
    return {"case": case, "epicute": figures.pop("epicute", None), **figures}


def test_rows_with_another_baseline_start_another_table():
    rows = [
        _row("tensorwise a", epicute=3.0, cublas_tensorwise=2.0, cublas_tensorwise_fast=4.0),
        _row("tensorwise b", epicute=1.0, cublas_tensorwise=2.0, cublas_tensorwise_fast=1.0),
        _row("rowwise a", epicute=3.0, cublas_rowwise=1.5, cublas_rowwise_fast=6.0),
        _row("blockwise a", cublas_blockwise=5.0),
    ]
    assert [[r["case"] for r in g] for g in peer_groups(rows)] == [
        ["tensorwise a", "tensorwise b"], ["rowwise a"], ["blockwise a"]
    ]  # fmt: skip
    text = render({"benchmark": "fp8", "unit": "TFLOPS", "higher_is_better": True, "rows": rows})
    assert text.count("| case |") == 3
    assert "| rowwise a | 3.0 | 1.5 | 6.0 | 2.00× | 0.50× |" in text
    # tensorwise: epicute/cublas 1.5 and 0.5, epicute/best 0.75 and 0.5
    assert "| geomean |  |  |  | 0.87× | 0.61× |" in text


def test_rows_missing_a_peer_or_without_peers_stay_in_one_table():
    rows = [
        _row("a", epicute=1.0, torch_eager=2.0, quack=1.0),
        _row("b", epicute=1.0, torch_eager=2.0),
        _row("cold_s", epicute=1.0),
        _row("host_us", epicute=3.0, torch_matmul=1.0),
    ]
    assert len(peer_groups(rows[:3])) == 1 and len(peer_groups(rows[2:])) == 1
    assert len(peer_groups(rows)) == 2  # torch_matmul is another baseline than torch_eager
