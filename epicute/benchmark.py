"""``epicute bench``: GEMM throughput over a list of shapes, against the peers installed.

Each shape is checked against float32 torch first (a wrong kernel is reported,
never timed), then timed with CUDA events over rotating inputs (so L2 starts
cold) for epicute, cuBLAS (``torch.matmul``) and quack when it is installed:
the median of five rounds that interleave the contenders.
The plot needs matplotlib (``pip install 'epicute[plot]'``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from epicute.errors import ConfigError, DeviceError

Shape = tuple[int, int, int]
Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]

DEFAULT_SHAPES: tuple[Shape, ...] = (
    (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
    (4096, 14336, 4096), (8192, 4096, 14336),
)  # fmt: skip
TOLERANCE = 1e-2
#: Timing rounds per case, contenders interleaved within each (see time_interleaved). Five, because
#: single rounds of one configuration spread widely even within one process on the device
#: (bench/NOTES.md, 'Five timing rounds').
TIMING_ROUNDS = 5


def parse_shapes(text: str) -> list[Shape]:
    """``"4096x4096x4096,1x8192x8192"`` -> ``[(4096, 4096, 4096), (1, 8192, 8192)]``."""
    shapes = []
    for item in text.split(","):
        try:
            m, n, k = (int(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise ConfigError(f"shape {item.strip()!r}: write it as MxNxK, e.g. 4096x4096x4096") from None
        shapes.append((m, n, k))
    return shapes


def require_matplotlib():
    """``matplotlib.pyplot`` with a file-only backend, or a ConfigError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("the plot needs matplotlib: pip install 'epicute[plot]' (or pass --no-plot)") from None
    return plt


def contenders() -> dict[str, Gemm]:
    """epicute first, then each peer that imports."""
    import epicute

    found: dict[str, Gemm] = {
        "epicute": lambda a, b, d: epicute.gemm(a, b, out=d),
        "cublas": lambda a, b, d: torch.matmul(a, b, out=d),
    }
    try:
        from quack.gemm_interface import gemm as quack_gemm

        found["quack"] = lambda a, b, d: quack_gemm(a, b, out=d, tuned=False)
    except Exception:  # noqa: BLE001 - a peer that does not import is left out
        pass
    return found


#: GPU cycles (~0.5 ms on an H100) the stream sleeps before each timed call.
HOST_AHEAD_CYCLES = 1_000_000


def time_cuda(
    fn: Callable[[], object], *, warmup: int = 10, iters: int = 50, host_ahead_cycles: int = HOST_AHEAD_CYCLES
) -> float:
    """Median milliseconds of GPU work of ``fn()`` over ``iters`` calls, each bracketed by its own CUDA events.

    Before each call the stream sleeps (``torch.cuda._sleep``) long enough for
    the host to enqueue the call's kernels (``host_ahead_cycles``: raise it for
    calls whose host cost passes ~0.5 ms), so the start event fires right
    before them and the figure is kernel time: without it, a kernel shorter
    than its host-side cost (a few tens of microseconds at small M) would be
    timed as host overhead, and each library's Python cost (measured apart by
    ``bench/runtime.py``) would decide small shapes. Warm-up calls are
    excluded; rotating inputs (to defeat L2 reuse) is the caller's job: make
    ``fn`` cycle through them. ``bench/`` uses this too.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, stop in events:
        torch.cuda._sleep(host_ahead_cycles)
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events)


#: Bytes zeroed before each call timed by :func:`time_flushed` (``triton.testing.do_bench``'s figure).
FLUSH_BYTES = 256 * 2**20


def time_flushed(fn: Callable[[], object], *, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median milliseconds of ``fn()`` timed the way ``triton.testing.do_bench`` times it.

    Each timed call follows the zeroing of a 256 MiB buffer (L2 cold) and the
    calls are queued back to back, so the GPU runs them at the clock and power
    it sustains. That matters for power-capped kernels (an fp8 GEMM draws the
    H100's 700 W and runs well under its top clock): :func:`time_cuda`'s sleep
    before each call lets the GPU cool, and contenders gain unequally from it
    (bench/NOTES.md, 'fp8: timing at the power cap'). A call whose host cost
    exceeds the flush's GPU time (~0.1 ms) is timed with the GPU waiting on the
    host, as a caller would see it; ``bench/runtime.py`` measures host cost apart.
    """
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    stop.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(stop) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(1, int(rep_ms / estimate)))]  # fmt: skip
    for start, stop in events:
        flush.zero_()
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events)


def balanced_orders(n: int, rounds: int) -> list[list[int]]:
    """``rounds`` orders of ``n`` contenders from a Williams design: over each ``n`` rounds (``2n``
    for odd ``n``) every contender is timed right after every other one equally often."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(c + i) % n for c in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [rows[r % len(rows)] for r in range(rounds)] if n else []


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int = TIMING_ROUNDS,
    timer: Callable[..., float] | None = None,
    **timing,
) -> dict[str, float]:
    """Median milliseconds per contender over ``rounds`` rounds, each timing every contender once
    (``timer``: :func:`time_cuda` by default, or :func:`time_flushed` for power-capped kernels; ``timing``
    passed on). Interleaving keeps any contender from being the one timed while the GPU still ramps
    its clocks after untimed calls (compiles, checks), and spreads drift over all alike. The order
    changes from round to round (:func:`balanced_orders`), so no contender is always timed right
    after the same neighbour: after a slow, low-power one the GPU has power headroom and boosts its
    clock for whatever comes next."""
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for order in balanced_orders(len(names), rounds):
        for i in order:
            samples[names[i]].append((timer or time_cuda)(fns[names[i]], **timing))
    return {name: statistics.median(times) for name, times in samples.items()}


def _rotating(fn: Gemm, sets: Sequence[tuple[torch.Tensor, ...]]) -> Callable[[], object]:
    """``fn`` on the next of ``sets`` at each call, cycling (one cycle of its own per contender)."""
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


def run_shape(shape: Shape, fns: dict[str, Gemm], dtype: torch.dtype = torch.bfloat16) -> dict[str, float | str | None]:
    """TFLOPS of each contender on one shape (None: failed or wrong; the reason under ``"<name>_error"``)."""
    m, n, k = shape
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    count = max(2, math.ceil(2 * l2 / (2 * (m * k + k * n + m * n))))
    sets = [
        (torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(k, n, device="cuda", dtype=dtype),
         torch.empty(m, n, device="cuda", dtype=dtype))
        for _ in range(count)
    ]  # fmt: skip
    a0, b0, _ = sets[0]
    ref = a0.float() @ b0.float()
    row: dict[str, float | str | None] = {"case": f"{m}x{n}x{k}"}
    correct = []
    for name, fn in fns.items():  # untimed first calls (compiles), checked against the reference
        try:
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            fn(a0, b0, out)
            err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not err <= TOLERANCE:  # NaN fails too
                row[name], row[f"{name}_error"] = None, f"relative error {err:.2e}"
            else:
                correct.append(name)
        except Exception as exc:  # noqa: BLE001 - one failing contender must not stop the others
            row[name], row[f"{name}_error"] = None, f"{type(exc).__name__}: {exc}"
    timed = {name: _rotating(fns[name], sets) for name in correct}
    for name, ms in time_interleaved(timed, warmup=5, iters=30).items():
        row[name] = round(2 * m * n * k / (ms * 1e-3) / 1e12, 1)
    return row


def check_device() -> str:
    """The GPU's name, or a DeviceError when there is no Hopper GPU to benchmark on."""
    if not torch.cuda.is_available():
        raise DeviceError("epicute bench needs a CUDA GPU (sm_90); none is visible. Try `epicute doctor`")
    if torch.cuda.get_device_capability() != (9, 0):
        raise DeviceError(f"{torch.cuda.get_device_name()} is not a Hopper GPU (sm_90); epicute's kernels need one")
    return torch.cuda.get_device_name()


def plot(rows: Sequence[dict], names: Sequence[str], path: Path, title: str) -> Path:
    """TFLOPS vs shape, one bar group per shape and one bar per contender, as a PNG."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(rows)), 4.0))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [row.get(name) or 0.0 for row in rows], width, label=name)
    ax.set_xticks(range(len(rows)), [str(row["case"]) for row in rows], rotation=20, ha="right")
    ax.set_ylabel("TFLOPS")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["DEFAULT_SHAPES", "check_device", "contenders", "parse_shapes", "plot", "require_matplotlib", "run_shape"]
