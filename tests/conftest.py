"""Shared test fixtures: GPU detection, random operands, the error metric."""

from __future__ import annotations

import os
import re

import pytest
import torch

from epicute.runtime import compile as compile_module


@pytest.fixture(autouse=True, scope="session")
def _private_kernel_cache(tmp_path_factory):
    """Tests compile into a cache of their own, never the user's (unless EPICUTE_CACHE_DIR says otherwise)."""
    if "EPICUTE_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["EPICUTE_CACHE_DIR"] = str(tmp_path_factory.mktemp("epicute-cache"))
    yield
    del os.environ["EPICUTE_CACHE_DIR"]


def has_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if has_hopper():
        return
    skip = pytest.mark.skip(reason="needs a CUDA Hopper GPU (run on the device: bash bench/device.sh test)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf so it fails."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def nan_tensor(shape, dtype=torch.float32, device=None) -> torch.Tensor:
    """An output buffer poisoned with NaN: a kernel that skips a value leaves it visible (the
    signature of the runtime's ``new_output``/``new_grad`` seams, so tests patch them with it)."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def poison_attention_outputs(monkeypatch, forward: bool = True, backward: bool = True) -> None:
    """Every buffer the attention runtime allocates for a kernel to fill (O and LSE with ``forward``, dK and dV
    with ``backward``) starts as NaN, and the float32 references run without TF32."""
    from epicute.attention import backward as rt_backward
    from epicute.attention import launch as rt_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    if forward:
        monkeypatch.setattr(rt_attention, "new_lse", lambda shape, device: nan_tensor(shape, device=device))
        monkeypatch.setattr(rt_attention, "new_output", nan_tensor)
    if backward:
        monkeypatch.setattr(rt_backward, "new_grad", nan_tensor)


def assert_attention_close(out, lse, ref, ref_lse, what: str, tol: float) -> None:
    """O within ``tol`` (relative) of the float32 reference, and LSE: -inf on exactly the rows that see no key,
    within 1e-4 elsewhere."""
    err = rel_err(out, ref)
    assert err <= tol, f"O rel err {err:.2e} for {what}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"LSE -inf pattern differs for {what}"
    lse_err = rel_err(lse[~empty], ref_lse[~empty]) if (~empty).any() else 0.0
    assert lse_err <= 1e-4, f"LSE rel err {lse_err:.2e} for {what}"


def decode_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) and a row-major (N, K) weight used as ``w.t()``, the serving layout (bf16, on the GPU)."""
    return (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16))  # fmt: skip


def aot_compile_then_fresh_load(tmp_path, spec_text: str, loader_text: str) -> str:
    """``epicute compile`` a spec into a private cache (twice: the second finds it cached),
    then assert a fresh process running ``loader_text`` loads its one kernel from disk; returns what it printed."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    spec = tmp_path / "k.toml"
    spec.write_text(spec_text)
    env = subprocess_env(EPICUTE_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("EPICUTE_CACHE", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], check=False, env=env, capture_output=True, text=True, timeout=600, cwd=repo
        )

    built = run("-m", "epicute.cli", "compile", str(spec))
    assert built.returncode == 0, built.stdout + built.stderr
    assert "1 variants (1 compiled now)" in built.stdout
    again = run("-m", "epicute.cli", "compile", str(spec))
    assert "(0 compiled now)" in again.stdout and "cached" in again.stdout

    loader = tmp_path / "load.py"
    loader.write_text(loader_text)
    loaded = run(str(loader))
    assert loaded.returncode == 0, loaded.stderr
    assert "compiles 0 disk_loads 1" in loaded.stdout
    return loaded.stdout


def recording_backend():
    """A fresh dynamo state and a ``torch.compile`` backend that records each graph it is
    given (and runs it unchanged): ``backend, graphs = recording_backend()``."""
    import torch

    torch._dynamo.reset()
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a fresh Python process running this checkout: the repository first on
    PYTHONPATH, the caller's entries kept (the device bundle lives there), plus ``extra``."""
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture
def ptxas_report(monkeypatch, capfd):
    """Compiles made under this fixture print ptxas's report (``remarks{ptx}``); the returned
    function reads what was printed since the last call: ``(spill store bytes per kernel,
    injected-WGMMA-fence warnings)``. Spills and injected fences are what cost attention most:
    see bench/NOTES.md, "Attention registers and instruction order"."""
    monkeypatch.setattr(compile_module, "DSL_COMPILE_OPTIONS", compile_module.DSL_COMPILE_OPTIONS + " remarks{ptx}")

    def read() -> tuple[list[int], list[str]]:
        out = "".join(capfd.readouterr())
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out)]
        assert spills, "no ptxas report was printed: did the compile go through DSL_COMPILE_OPTIONS?"
        return spills, re.findall(r"\(C7519\)[^\n]*", out)

    return read


@pytest.fixture
def reference_layers():
    """epicute.nn's kernels (its GEMMs, grouped GEMMs and the transformers integration's attention) computed by the
    reference backends (``epicute.use_backend("reference")``): differentiable torch on the CPU, so the layers' own
    logic (routing, interleaving, fused backward programs, state dicts) is tested without a GPU."""
    import epicute

    with epicute.use_backend("reference"):
        yield
