"""The benchmark harness's interleaving (CPU: the timer is replaced by a recorder)."""

from __future__ import annotations

import pytest

from epicute import benchmark


@pytest.mark.parametrize("n", (2, 3, 4, 5))
def test_balanced_orders_put_every_contender_after_every_other_equally_often(n):
    rows = 2 * n if n % 2 else n
    orders = benchmark.balanced_orders(n, rows)
    assert all(sorted(order) == list(range(n)) for order in orders)
    pairs = [(order[i - 1], order[i]) for order in orders for i in range(1, n)]
    counts = {pair: pairs.count(pair) for pair in set(pairs)}
    assert len(counts) == n * (n - 1) and len(set(counts.values())) == 1, counts
    assert benchmark.balanced_orders(n, rows + 1)[-1] == orders[0]  # further rounds cycle
    assert benchmark.balanced_orders(0, 3) == []


def test_time_interleaved_follows_the_orders(monkeypatch):
    timed = []

    def fake_time_cuda(fn, **timing):
        timed.append(fn())
        return {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}[timed[-1]]

    monkeypatch.setattr(benchmark, "time_cuda", fake_time_cuda)
    medians = benchmark.time_interleaved({name: (lambda name=name: name) for name in "abcd"}, rounds=5)
    expected = ["abcd"[i] for order in benchmark.balanced_orders(4, 5) for i in order]
    assert timed == expected and medians == {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}


def test_time_interleaved_takes_another_timer():
    seen = []
    medians = benchmark.time_interleaved(
        {"a": lambda: "a", "b": lambda: "b"}, rounds=3, timer=lambda fn, **timing: seen.append(timing) or 2.0, rep_ms=7
    )
    assert medians == {"a": 2.0, "b": 2.0} and seen == [{"rep_ms": 7}] * 6
