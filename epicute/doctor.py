"""``epicute doctor``: what this machine has, what epicute can do on it, and what is missing.

Each check is a :class:`Check` (what was looked at, what was found, whether it
is fine, and the fix when it is not). Nothing here fails: a missing GPU is a
finding (kernels still compile for sm_90a), not an error.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    found: str
    ok: bool
    fix: str = ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi, if there is one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def checks() -> list[Check]:
    """Every finding, in the order ``epicute doctor`` prints them."""
    import torch

    import epicute
    from epicute.runtime.cache import cache_dir, disk_entries

    found = [Check("python", platform.python_version(), True), Check("epicute", epicute.__version__, True)]
    found.append(Check("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})", True))
    dsl = _version("nvidia-cutlass-dsl")
    found.append(Check("CuTe DSL", dsl or "missing", dsl == "4.8.1", "" if dsl == "4.8.1" else "pip install nvidia-cutlass-dsl==4.8.1"))
    for dist, why in (("apache-tvm-ffi", "the low-overhead launch path"), ("torch-c-dlpack-ext", "fast tensor passing")):
        v = _version(dist)
        found.append(Check(dist, v or "missing", v is not None, "" if v else f"pip install {dist} ({why})"))
    driver = _driver()
    found.append(Check("NVIDIA driver", driver or "none found", driver is not None, "" if driver else "install the NVIDIA driver to run kernels"))
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
        hopper = cap == (9, 0)
        found.append(Check("GPU", f"{name} (sm_{cap[0]}{cap[1]})", hopper, "" if hopper else "epicute's kernels need a Hopper GPU (sm_90): they compile here but cannot run"))
    else:
        found.append(Check("GPU", "none visible", False, "kernels compile for sm_90a here (epicute compile, epicute demo) but run only on a Hopper GPU"))
    found.append(Check("target arch", os.environ.get("CUTE_DSL_ARCH", "sm_90a (set on import)"), True))
    root = cache_dir()
    if root is None:
        found.append(Check("kernel cache", "disabled (EPICUTE_CACHE=0)", False, "unset EPICUTE_CACHE to keep compiled kernels across processes"))
    else:
        entries = disk_entries(root)
        stale = sum(not e["current"] for e in entries)
        size = sum(e.get("size", 0) for e in entries)
        writable = os.access(root if root.exists() else root.parent if root.parent.exists() else "/", os.W_OK)
        found.append(Check(
            "kernel cache",
            f"{root}: {len(entries)} entries ({stale} stale), {size / 2**20:.1f} MiB",
            writable,
            "" if writable else f"{root} is not writable: set EPICUTE_CACHE_DIR to a writable directory",
        ))  # fmt: skip
    for dist, extra, why in (("matplotlib", "plot", "epicute bench's plot"), ("quack-kernels", None, "a bench peer")):
        v = _version(dist)
        fix = "" if v else f"pip install {f'epicute[{extra}]' if extra else dist} for {why} (optional)"
        found.append(Check(dist, v or "not installed (optional)", True, fix))
    return found


__all__ = ["Check", "checks"]
