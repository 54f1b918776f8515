"""Precompiling the kernels code needs in worker processes: discovery stops a call before a missing kernel, workers
put it on disk, the code runs on until it needs none (no GPU: the variants compile for sm_90a on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest

from epicute.errors import ConfigError
from epicute.runtime.aot import JOB_KINDS
from epicute.runtime.cache import KERNEL_CACHE
from epicute.runtime.compile import DISCOVERING, FAMILIES, KernelMissing, past_missing, reference_device
from epicute.runtime.precompile import compile_workers, missing_kernels, precompile

GEMMS = FAMILIES["gemm"]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty disk cache and no kernel in this process's memory (restored after)."""
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(KERNEL_CACHE, "_fns", {})
    monkeypatch.setattr(KERNEL_CACHE, "events", {})


def _variants(*shapes: list[int]) -> list:
    """Plain bf16 GEMM variants, one per shape's plan (odd sizes: a ragged last tile in each)."""
    return [variant for variant, _ in JOB_KINDS["gemm"]({"shapes": [list(s) for s in shapes]}, None)]


def test_chained_kernels_are_compiled_by_workers_and_then_loaded_from_disk(fresh):
    first, second = _variants([257, 520, 136], [9, 520, 136])
    assert GEMMS.key(first) != GEMMS.key(second)
    runs = []

    def chain():  # a forward and the backward it leads to: the second kernel is only reached after the first
        runs.append(1)
        GEMMS.get(first)
        GEMMS.get(second)

    idle = []
    done = precompile([chain, chain], idle=[lambda: idle.append(1)] * 2, workers=2)
    assert done.workers == 2 and not done.failed and done.unfinished == 0
    # What the wall time went to: the workers' last compile, and the idle tasks run meanwhile.
    assert idle == [1, 1] and done.idle_tasks == 2 and 0 < done.kernels_done <= done.seconds
    assert "2 other tasks meanwhile" in str(done)
    assert sorted(done.compiled) == sorted([GEMMS.key(first).label, GEMMS.key(second).label])
    assert len(runs) == 2 * 3  # each stopped at the first kernel, then the second, then ran to its end
    assert not DISCOVERING.is_set()
    KERNEL_CACHE._fns.clear()
    GEMMS.get(first), GEMMS.get(second)
    assert [KERNEL_CACHE.events[GEMMS.key(v)][0] for v in (first, second)] == ["disk", "disk"]


def test_a_failed_compile_is_reported_and_the_run_left_to_meet_it(fresh):
    (plain,) = _variants([129, 72, 40])
    other_arch = dataclasses.replace(plain, arch="sm_80")  # the workers have no gemm kernel for it
    idle_calls = []
    done = precompile([lambda: GEMMS.get(other_arch)], idle=[lambda: idle_calls.append(1)] * 3, workers=2)
    assert done.compiled == [] and done.unfinished == 1
    ((label, error),) = done.failed.items()
    assert label == GEMMS.key(other_arch).label and "no gemm kernel for sm_80" in error
    assert idle_calls == [1, 1, 1]
    with pytest.raises(ConfigError, match="no gemm kernel for sm_80"):  # the run meets the error itself
        GEMMS.get(other_arch)


def test_discovery_finds_a_stop_however_the_call_wraps_it(fresh):
    (plain,) = _variants([33, 40, 24])

    def wrapped():
        try:
            GEMMS.get(plain)
        except Exception:  # noqa: BLE001 - what a layer wrapping any error does
            raise RuntimeError("a layer's own message") from None

    (missing,) = missing_kernels(wrapped)
    assert isinstance(missing, KernelMissing) and missing.variant == plain and missing.kind == "gemm"
    assert missing_kernels(lambda: None) == []
    assert missing_kernels(lambda: 1 / 0) == []  # the run's own error: not a kernel to compile
    assert not DISCOVERING.is_set() and GEMMS.key(plain) not in KERNEL_CACHE._fns


def test_code_that_goes_past_a_missing_kernel_finds_the_next_ones_in_the_same_pass(fresh):
    """A backward's gradient GEMMs behind its gradient pass: with each launch behind ``past_missing``, one pass finds
    all three kernels, the workers compile them together, and the second pass runs to its end."""
    kernels = _variants([257, 520, 136], [9, 520, 136], [1000, 72, 40])
    passes, stand_ins = [], []

    def backward():
        passes.append(1)
        for variant in kernels:
            past_missing(lambda v=variant: GEMMS.get(v), lambda: stand_ins.append(1))

    assert [m.variant for m in missing_kernels(backward)] == kernels and len(stand_ins) == 3
    passes.clear()
    done = precompile([backward], workers=3)
    assert len(done.compiled) == 3 and not done.failed and len(passes) == 2  # found all at once, then ran through


def test_past_missing_is_the_launch_itself_outside_discovery_and_for_other_errors(fresh):
    (plain,) = _variants([33, 40, 24])
    assert past_missing(lambda: 7, lambda: 0) == 7
    with pytest.raises(ZeroDivisionError):  # not discovering: the error is the caller's
        past_missing(lambda: 1 / 0, lambda: 0)

    results = []

    def run():
        try:  # discovering, but no kernel missing in it: still the caller's
            past_missing(lambda: 1 / 0, lambda: 0)
        except ZeroDivisionError:
            results.append("raised")
        results.append(past_missing(lambda: GEMMS.get(plain), lambda: "stand-in"))

    assert [m.variant for m in missing_kernels(run)] == [plain] and results == ["raised", "stand-in"]


def test_without_workers_the_idle_tasks_still_run_and_nothing_else(fresh):
    calls = []
    done = precompile([lambda: calls.append("run")], idle=[lambda: calls.append("idle")], workers=0)
    assert calls == ["idle"] and done.workers == 0 and "no worker processes" in str(done)


def test_compile_workers_reads_its_setting(monkeypatch):
    for text, workers in (("0", 0), ("1", 0), ("3", 3), (" 12 ", 12)):
        monkeypatch.setenv("EPICUTE_COMPILE_WORKERS", text)
        assert compile_workers() == workers
    monkeypatch.setenv("EPICUTE_COMPILE_WORKERS", "many")
    with pytest.raises(ConfigError, match="EPICUTE_COMPILE_WORKERS='many': give a number"):
        compile_workers()
    monkeypatch.delenv("EPICUTE_COMPILE_WORKERS")
    assert compile_workers() == 0 or 2 <= compile_workers() <= 8


def test_no_disk_cache_means_no_workers(monkeypatch):
    monkeypatch.setenv("EPICUTE_CACHE", "0")
    assert precompile([lambda: None], workers=4).workers == 0


@pytest.mark.compile
def test_a_spec_compiles_in_worker_processes_and_reports_in_its_order(fresh, tmp_path, monkeypatch):
    from epicute.runtime import precompile as precompile_module
    from epicute.runtime.aot import compile_spec

    spec = tmp_path / "k.toml"
    spec.write_text("[[gemm]]\nshapes = [[257, 520, 136], [9, 520, 136]]\n")
    heard = []
    results = compile_spec(spec, workers=2, on_result=heard.append)
    assert [r.what for r in results] == ["257x520x136", "9x520x136"] and sorted(heard, key=results.index) == results
    assert [r.status for r in results] == ["compiled", "compiled"]
    monkeypatch.setattr(precompile_module, "_Workers", lambda count: pytest.fail("a worker started for cached ones"))
    assert [r.status for r in compile_spec(spec, workers=2)] == ["cached", "cached"]


def test_a_failed_compile_among_many_is_raised_naming_it(fresh):
    from epicute.errors import CompileError
    from epicute.runtime.precompile import ensure_all_on_disk

    (plain,) = _variants([129, 72, 40])
    jobs = [("gemm", dataclasses.replace(plain, arch="sm_80"))]
    with pytest.raises(CompileError, match="ConfigError: no gemm kernel for sm_80"):
        list(ensure_all_on_disk(jobs, workers=2))


def test_the_reference_runs_on_the_inputs_device_only_while_discovering():
    """The reference is the CPU's oracle; a stand-in while discovering stays on the device the calls after it use."""
    import torch

    on_meta = torch.empty(2, device="meta")
    assert reference_device(on_meta) == torch.device("cpu")
    DISCOVERING.set()
    try:
        assert reference_device(on_meta) == torch.device("meta")
    finally:
        DISCOVERING.clear()
