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
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,  # a failing nvidia-smi means "no driver found", read from returncode below
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def checks() -> list[Check]:
    """Every finding, in the order ``epicute doctor`` prints them."""
    import torch

    import epicute
    from epicute.errors import ConfigError
    from epicute.runtime.cache import cache_dir, check_cache_dir, disk_entries

    found = [Check("python", platform.python_version(), True), Check("epicute", epicute.__version__, True)]
    found.append(Check("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})", True))
    dsl = _version("nvidia-cutlass-dsl")
    dsl_fix = "" if dsl == "4.8.1" else "pip install nvidia-cutlass-dsl==4.8.1"
    found.append(Check("CuTe DSL", dsl or "missing", dsl == "4.8.1", dsl_fix))
    for dist, why in (
        ("apache-tvm-ffi", "the low-overhead launch path"),
        ("torch-c-dlpack-ext", "fast tensor passing"),
    ):
        v = _version(dist)
        found.append(Check(dist, v or "missing", v is not None, "" if v else f"pip install {dist} ({why})"))
    driver = _driver()
    driver_fix = "" if driver else "install the NVIDIA driver to run kernels"
    found.append(Check("NVIDIA driver", driver or "none found", driver is not None, driver_fix))
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
        hopper = cap == (9, 0)
        gpu_fix = "" if hopper else "epicute's kernels need a Hopper GPU (sm_90): they compile here but cannot run"
        found.append(Check("GPU", f"{name} (sm_{cap[0]}{cap[1]})", hopper, gpu_fix))
    else:
        gpu_fix = "kernels compile for sm_90a here (epicute compile, epicute demo) but run only on a Hopper GPU"
        found.append(Check("GPU", "none visible", False, gpu_fix))
    found.append(Check("target arch", os.environ.get("CUTE_DSL_ARCH", "sm_90a (set on import)"), True))
    root = cache_dir()
    if root is None:
        cache_fix = "unset EPICUTE_CACHE to keep compiled kernels across processes"
        found.append(Check("kernel cache", "disabled (EPICUTE_CACHE=0)", False, cache_fix))
    else:
        try:
            check_cache_dir(root, writable=True)
        except ConfigError as exc:
            found.append(Check("kernel cache", f"{root}: unusable", False, str(exc)))
        else:
            entries = disk_entries(root)
            stale = sum(not e["current"] for e in entries)
            size = sum(e.get("size", 0) for e in entries)
            summary = f"{root}: {len(entries)} entries ({stale} stale), {size / 2**20:.1f} MiB"
            found.append(Check("kernel cache", summary, True))
    for dist, extra, why in (("matplotlib", "plot", "epicute bench's plot"), ("quack-kernels", None, "a bench peer")):
        v = _version(dist)
        fix = "" if v else f"pip install {f'epicute[{extra}]' if extra else dist} for {why} (optional)"
        found.append(Check(dist, v or "not installed (optional)", True, fix))
    return found


__all__ = ["Check", "checks"]
