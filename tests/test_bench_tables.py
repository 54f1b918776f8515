"""bench/'s result tables: rows are compared with their own baseline peer (CPU, no torch call); the full tables go to
docs/performance.md and a headline row per comparison to README.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from common import peer_groups
from readme_table import END, HEADLINE_END, HEADLINE_START, START, headline, main, render


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


def test_headline_has_a_row_per_comparison_with_a_peer():
    fp8 = {"benchmark": "fp8", "device": "NVIDIA H200", "higher_is_better": True, "rows": [
        _row("tensorwise a", epicute=3.0, cublas_tensorwise=2.0, cublas_tensorwise_fast=4.0),
        _row("tensorwise b", epicute=1.0, cublas_tensorwise=2.0, cublas_tensorwise_fast=1.0),
        _row("quantize a", epicute=1.0, epicute_plain=2.0),  # epicute's own variants only: no row
    ]}  # fmt: skip
    runtime = {"benchmark": "runtime", "device": "NVIDIA H100 80GB HBM3", "higher_is_better": False, "rows": [
        _row("cold_s", epicute=3.0), _row("host_us", epicute=8.0, torch_matmul=10.0)]}  # fmt: skip
    text = headline([fp8, runtime])
    assert text.count("\n") == 3  # header, rule, two rows
    assert "| fp8 | tensorwise a, tensorwise b | cublas_tensorwise | 0.87× (0.50–1.50×) | 0.61× | H200 |" in text
    assert "| runtime | host_us | torch_matmul (time: lower is better) | 0.80× (one case) | – | H100 |" in text


def test_write_fills_the_tables_in_one_file_and_the_headline_in_another(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    (results / "gemm.json").write_text(json.dumps({"benchmark": "gemm", "device": "NVIDIA H200", "unit": "TFLOPS",
                                                   "rows": [_row("a", epicute=2.0, cublas=1.0)]}))  # fmt: skip
    performance, readme, other = tmp_path / "performance.md", tmp_path / "README.md", tmp_path / "other.md"
    performance.write_text(f"# P\n{START}\nold\n{END}\ntail\n")
    readme.write_text(f"# R\n{HEADLINE_START}\nold\n{HEADLINE_END}\n")
    other.write_text("no markers\n")
    argv = ["readme_table.py", "--results", str(results), "--write", str(performance), "--write", str(readme)]
    monkeypatch.setattr(sys, "argv", argv)
    assert main() == 0
    assert "| a | 2.0 | 1.0 | 2.00× |" in performance.read_text() and performance.read_text().endswith(f"{END}\ntail\n")
    assert "| gemm | a | cublas | 2.00× (one case) | – | H200 |" in readme.read_text()
    monkeypatch.setattr(sys, "argv", [*argv[:3], "--write", str(other)])
    assert main() == 1 and other.read_text() == "no markers\n"
