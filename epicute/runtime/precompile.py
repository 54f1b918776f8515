"""Compiling the kernels some code needs in worker processes, all at once, before the code runs for real.

A variant is known only when a call reaches its family's :meth:`~epicute.runtime.compile.KernelFamily.get`:
validation, the plan, the epilogue's lowering and an autograd backward's derived calls all come first, and a
training call's backward variants only once its forward has run. So :func:`precompile` *runs* each piece of code
with discovery on (:data:`~epicute.runtime.compile.DISCOVERING`): the first kernel found neither in memory nor on
disk raises :class:`~epicute.runtime.compile.KernelMissing` before anything launches or caches it; where the code
can go on without that kernel's values it does (:func:`~epicute.runtime.compile.past_missing`: a GEMM computed by
the reference instead, an attention pass skipped), so a training call's forward and backward kernels are found in
one pass. Worker processes compile what was missing into the disk cache, and the code runs again once it is there,
until it runs to its end.
The pieces advance side by side, each as soon as its own kernel is ready, so the wall time is about the longest
piece's chain of compiles rather than the sum of all of them: one variant's compile is single-threaded (the DSL's
IR building in Python, then its MLIR passes and ptxas, a few seconds each), and the host's other cores sit idle
through a serial compile. Work that needs the host while the workers compile (Inductor's compiles, say) is
handed in as ``idle`` tasks, run between the workers' results.

The disk cache is where the workers' kernels meet the caller's, so nothing is precompiled with ``EPICUTE_CACHE=0``.
``EPICUTE_COMPILE_WORKERS`` caps the pool (``0``: none); by default half the CPUs this process may use, at most 8:
each worker holds a CuTe DSL compiler (~1 GiB).
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, as_completed, wait
from dataclasses import dataclass, field
from typing import Any

from epicute.errors import CompileError, ConfigError
from epicute.runtime.compile import DISCOVERING, FAMILIES, MISSED, KernelMissing

#: The most worker processes by default: each holds a compiler, and a compiled graph rarely has more independent
#: chains of variants than this.
DEFAULT_MAX_WORKERS = 8


@dataclass
class Precompiled:
    """What :func:`precompile` did: the variants its workers compiled (or found on disk), the ones that failed (by
    their label, with the error; the code then compiles them itself when it runs, and meets the error there), the
    pieces of code left before their end (a failed compile, a variant that would not pickle, or an error of the code's
    own: none of them is precompile's to report) and the wall seconds."""

    workers: int = 0
    compiled: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unfinished: int = 0
    seconds: float = 0.0
    #: when the first pass over the code had sent every kernel it found to the workers, when their last compile
    #: ended (seconds from the start), and the seconds the ``idle`` tasks took: where a shorter wall time must come from
    found: float = 0.0
    kernels_done: float = 0.0
    idle_seconds: float = 0.0
    idle_tasks: int = 0
    #: why nothing was precompiled, where the caller gave up on it (the calls then compile as they go)
    skipped: str = ""

    def __str__(self) -> str:
        if self.skipped:
            return f"not precompiled ({self.skipped}): compiled as the calls need them"
        if not self.workers:
            return "kernels compiled as the calls need them (no worker processes)"
        if not self.compiled and not self.failed:
            return f"none to compile (every kernel in memory or on disk; found in {self.seconds:.1f} s)"
        text = (f"{len(self.compiled)} kernels compiled in {self.seconds:.1f} s by {self.workers} worker processes "
                f"(the first pass over the code done at {self.found:.1f} s, the last compile at "
                f"{self.kernels_done:.1f} s")  # fmt: skip
        text += f"; {self.idle_tasks} other tasks meanwhile, {self.idle_seconds:.1f} s)" if self.idle_tasks else ")"
        return text + (f"; {len(self.failed)} failed there: {', '.join(self.failed)}" if self.failed else "")


def compile_workers() -> int:
    """How many worker processes :func:`precompile` may start: ``EPICUTE_COMPILE_WORKERS``, else half the CPUs this
    process may run on, at most :data:`DEFAULT_MAX_WORKERS`. Fewer than two is none (one worker would only move
    the serial compile to another process)."""
    text = os.environ.get("EPICUTE_COMPILE_WORKERS", "").strip()
    if text:
        if not text.isdigit():
            raise ConfigError(f"EPICUTE_COMPILE_WORKERS={text!r}: give a number of worker processes (0: none)")
        workers = int(text)
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = min(DEFAULT_MAX_WORKERS, cpus // 2)
    return workers if workers >= 2 else 0


def missing_kernels(run: Callable[[], Any]) -> list[KernelMissing]:
    """Run ``run()`` with discovery on; the kernels it found missing, each once (none where it ran to its end, or
    stopped for a reason of its own: the run's own errors are its caller's to meet when it runs for real). A run
    stops at its first missing kernel unless the code goes on past it (:func:`~epicute.runtime.compile.past_missing`:
    epicute's GEMM ops, attention passes and quantizers), so one pass may find several."""
    MISSED.clear()
    DISCOVERING.set()
    try:
        run()
    except Exception:  # noqa: BLE001 - the stop, however wrapped on its way out, or the run's own error
        pass
    finally:
        DISCOVERING.clear()
    return list({missing.key.digest: missing for missing in MISSED}.values())


def precompile(runs: Sequence[Callable[[], Any]], idle: Iterable[Callable[[], Any]] = (),
               workers: int | None = None) -> Precompiled:  # fmt: skip
    """Run each of ``runs`` until every kernel it needs is on disk, compiling the missing ones in up to ``workers``
    processes (:func:`compile_workers` by default) side by side; call each of ``idle`` once meanwhile (all of them,
    in order, by the time this returns). A piece of code runs until a pass finds nothing missing, each pass stopped
    at its first missing kernel (or going on past the ones its code can do without: :func:`missing_kernels`), so it
    must be safe to repeat (a function of fresh inputs).

    Example:
        >>> import torch, epicute
        >>> from epicute.runtime.precompile import precompile
        >>> a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
        >>> print(precompile([lambda: epicute.gemm(a, b, backend="reference")], workers=0))
        kernels compiled as the calls need them (no worker processes)
    """
    from epicute.runtime.cache import cache_dir

    started, idle = time.perf_counter(), list(idle)
    workers = compile_workers() if workers is None else workers
    root = cache_dir()
    done = Precompiled(workers=workers if root is not None else 0)

    def run_idle(task: Callable[[], Any]) -> None:
        begun = time.perf_counter()
        task()
        done.idle_seconds += time.perf_counter() - begun
        done.idle_tasks += 1

    def compiled_now(_: Future) -> None:  # when a compile ended, not when the loop sees it (an idle task may run then)
        done.kernels_done = max(done.kernels_done, time.perf_counter() - started)

    if not done.workers:
        for task in idle:
            run_idle(task)
        return done
    pool: _Workers | None = None
    compiles: dict[str, tuple[Future, str]] = {}  # key digest -> (the worker's compile, the variant's label)
    waiting: dict[str, list[int]] = {}  # key digest -> the runs waiting for it
    pending: dict[int, set[str]] = {}  # run -> the compiles it waits for

    def advance(i: int) -> None:
        nonlocal pool
        found = missing_kernels(runs[i])
        # Compiled, and still missing (a cache that cannot be read back): left to the run itself, not a loop.
        if any(m.key.digest in compiles and compiles[m.key.digest][0].done() for m in found):
            done.unfinished += 1
            return
        for missing in found:
            digest = missing.key.digest
            if digest not in compiles:
                try:
                    payload = pickle.dumps((str(root), missing.kind, missing.variant))
                except Exception:  # noqa: BLE001 - a variant holding a local function: compiled where it is called
                    done.unfinished += 1
                    return
                if pool is None:
                    pool = _Workers(done.workers)
                future = pool.submit(payload)
                future.add_done_callback(compiled_now)
                compiles[digest] = (future, missing.key.label)
        for missing in found:
            waiting.setdefault(missing.key.digest, []).append(i)
        if found:
            pending[i] = {missing.key.digest for missing in found}

    try:
        for i in range(len(runs)):
            advance(i)
        done.found = time.perf_counter() - started
        while waiting:
            ready = [digest for digest in waiting if compiles[digest][0].done()]
            if not ready:
                if idle:
                    run_idle(idle.pop(0))
                else:
                    wait([compiles[digest][0] for digest in waiting], return_when=FIRST_COMPLETED)
                continue
            for digest in ready:
                future, label = compiles[digest]
                failed = future.exception() is not None
                if failed:
                    done.failed[label] = f"{type(future.exception()).__name__}: {future.exception()}"
                else:
                    done.compiled.append(label)
                for i in waiting.pop(digest):
                    if i not in pending:  # already given up on
                        continue
                    pending[i].discard(digest)
                    if failed:  # the run meets the error itself when it runs for real
                        del pending[i]
                        done.unfinished += 1
                    elif not pending[i]:
                        del pending[i]
                        advance(i)
        for task in idle:
            run_idle(task)
    finally:
        if pool is not None:
            pool.close()
    done.seconds = time.perf_counter() - started
    return done


def ensure_all_on_disk(jobs: Sequence[tuple[str, Any]], workers: int) -> Iterator[tuple[int, str, float]]:
    """Compile each ``(kind, variant)`` of ``jobs`` into the disk cache unless it is there, ``workers`` at a time
    in worker processes; yields ``(index, "compiled" | "cached", seconds)`` as each finishes (seconds from the
    start: workers overlap). The first failure stops the rest and is raised, a :class:`CompileError` naming it.
    Variants that do not pickle are compiled here, after the others."""
    from epicute.runtime.cache import KERNEL_CACHE, cache_dir

    started, root = time.perf_counter(), cache_dir()
    payloads, here = {}, []
    for i, (kind, variant) in enumerate(jobs):
        if KERNEL_CACHE.on_disk(FAMILIES[kind].key(variant)):  # no worker started for a spec compiled before
            yield i, "cached", time.perf_counter() - started
            continue
        try:
            payloads[i] = pickle.dumps((str(root), kind, variant))
        except Exception:  # noqa: BLE001 - a variant holding a local function
            here.append(i)
    if payloads:
        pool = _Workers(min(workers, len(payloads)))
        try:
            futures = {pool.submit(payload): i for i, payload in payloads.items()}
            for future in as_completed(futures):
                yield futures[future], future.result(), time.perf_counter() - started
        finally:
            pool.close()
    for i in here:
        kind, variant = jobs[i]
        yield i, FAMILIES[kind].ensure_on_disk(variant)[0], time.perf_counter() - started


class _Workers:
    """Worker interpreters, each started as ``python -m epicute.runtime.precompile`` and fed one pickled variant at a
    time through its stdin (its answer on its stdout). Not ``multiprocessing``: its children import the caller's main
    module again, which runs a training script without a main guard a second time."""

    def __init__(self, count: int) -> None:
        import queue
        import subprocess
        import sys
        from concurrent.futures import ThreadPoolExecutor
        from pathlib import Path

        import epicute

        home = str(Path(epicute.__file__).resolve().parents[1])  # the epicute this process runs, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (home, os.environ.get("PYTHONPATH")) if p)}
        self._processes = [
            subprocess.Popen([sys.executable, "-m", "epicute.runtime.precompile"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
            for _ in range(count)
        ]  # fmt: skip
        self._idle: queue.Queue = queue.Queue()
        for process in self._processes:
            self._idle.put(process)
        self._threads = ThreadPoolExecutor(count)

    def submit(self, payload: bytes) -> Future:
        return self._threads.submit(self._compile, payload)

    def _compile(self, payload: bytes) -> str:
        process = self._idle.get()
        try:
            _write_message(process.stdin, payload)
            answer = _read_message(process.stdout)
        finally:
            self._idle.put(process)
        if answer is None:
            raise CompileError(f"a compile worker exited (status {process.poll()})")
        ok, value = pickle.loads(answer)
        if not ok:
            raise CompileError(value)
        return value

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        for process in self._processes:
            process.stdin.close()  # the worker's loop ends at end of input
        for process in self._processes:
            try:
                process.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a worker stuck in a compile: stop it
                process.kill()


def _write_message(stream: Any, data: bytes) -> None:
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _read_message(stream: Any) -> bytes | None:
    """One length-prefixed message, None at end of stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    data = stream.read(int.from_bytes(head, "little"))
    return data if len(data) == int.from_bytes(head, "little") else None


def _serve() -> None:
    """A worker's loop: compile each variant that arrives into the disk cache it names (the caller's, whatever
    this process's environment says), answer ``(True, "compiled" | "cached")`` or ``(False, error)``. What the
    compiler prints goes to stderr: stdout carries the answers."""
    import sys

    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import cutlass.cute  # noqa: F401 - the DSL's import, most of a worker's start, before the first variant

    while (message := _read_message(sys.stdin.buffer)) is not None:
        try:
            root, kind, variant = pickle.loads(message)
            os.environ["EPICUTE_CACHE_DIR"] = root
            os.environ.pop("EPICUTE_CACHE", None)
            answer = (True, FAMILIES[kind].ensure_on_disk(variant)[0])
        except Exception as exc:  # noqa: BLE001 - any failure is the caller's to report
            answer = (False, f"{type(exc).__name__}: {exc}")
        _write_message(answers, pickle.dumps(answer))


__all__ = [
    "DEFAULT_MAX_WORKERS",
    "Precompiled",
    "compile_workers",
    "ensure_all_on_disk",
    "missing_kernels",
    "precompile",
]


if __name__ == "__main__":
    _serve()
