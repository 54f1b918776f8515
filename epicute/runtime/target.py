"""The GPU kernels are planned and compiled for: a :class:`Target`.

A target carries what the planner and the roofline need -- the arch the kernels
are compiled for, the SM count, the shared memory a CTA may opt into, the L2
size and the peaks -- and comes from one of two places:

- the visible GPU (:func:`current_target`): SM count, opt-in shared memory, L2
  size and name are read from the device; the peaks are those of the named part
  the device's name matches (an H100 PCIe gets ``h100-pcie``'s). A Hopper part
  that matches none (a GH200, an H800, an NVL board...) gets H100 SXM's peaks
  with the compute peaks scaled by its SM count (same clocks assumed) and H100
  SXM's HBM bandwidth; so does a matched part whose SM count differs from its
  name's (a MIG slice: its share of the compute, the whole HBM). Without a
  Hopper GPU (CPU machines, CI, ahead-of-time builds) it is :data:`H100_SXM`.
- a name (:func:`resolve_target`, ``epicute compile --target h100-pcie``,
  ``epicute.explain(..., target="h20")``): the figures of :data:`TARGETS`.

What a target changes is the *plan* (tiles, cluster, persistence, stages, the
roofline) and the *launch* (how many persistent CTAs), never the code of a given
configuration: compile keys hold the arch (``target.arch``) and nothing else of
the target, so one ahead-of-time cache serves every part of an arch. Kernels are
found by (family, arch) (:class:`epicute.runtime.compile.KernelFamily`).

Pure Python: importing this module loads neither torch nor the CuTe DSL
(``epicute/__init__`` reads :data:`DEFAULT_ARCH` before anything imports ``cutlass``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from epicute.errors import ConfigError

#: The arch every epicute kernel is compiled for today (the only one with kernels).
SM90A = "sm_90a"
#: The CuTe DSL's target (``CUTE_DSL_ARCH``) unless the environment says otherwise.
DEFAULT_ARCH = SM90A
#: Dynamic shared memory one CTA may opt into on any Hopper part (228 KiB per SM, 1 KiB reserved).
HOPPER_SMEM_PER_CTA = 227 * 1024
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Target:
    """One GPU as the planner sees it (see the module docstring)."""

    #: The named part whose figures these are (``h100-sxm``...), or ``hopper`` for an unmatched one.
    name: str
    #: The GPU's own name when read from a device, else the named part's.
    device: str
    #: What kernels are compiled for (part of every compile key).
    arch: str
    num_sms: int
    #: Dynamic shared memory one CTA may opt into (227 KiB on Hopper).
    smem_per_cta_bytes: int
    #: Dense bf16/fp16 tensor-core peak, TFLOP/s.
    peak_tflops_16bit: float
    #: Dense fp8 tensor-core peak, TFLOP/s.
    peak_tflops_fp8: float
    #: HBM bandwidth, TB/s.
    hbm_tb_per_s: float
    l2_bytes: int
    #: SM cycles per output element that a plain GEMM's cooperative tile spends storing D (cast, staged,
    #: TMA-stored) with no WGMMA in flight, where ping-pong stores under the other warpgroup's mainloop; the
    #: roofline charges it (:mod:`epicute.gemm.roofline`). H200: 0.055 (~1 us a 128x256 tile), inside the
    #: bracket its plain GEMMs set (ping-pong 128x192 ahead at 54-146 waves needs > ~0.4 us, cooperative
    #: 128x256 ahead at 7 waves < ~3.7 us; bench/NOTES.md, 'The cooperative store's exposed time'). 0 where
    #: not measured: the H100's last sweep of the 8-expert grouped GEMM (older kernels) had cooperative ahead.
    cooperative_store_cycles: float = 0.0
    #: Read from a visible GPU (as opposed to named, or assumed without one).
    detected: bool = False
    #: Where the figures come from, as ``explain`` prints it.
    origin: str = "named"

    @property
    def tensor_clock_hz(self) -> float:
        """The SM clock the 16-bit tensor-core peak assumes (4096 dense 16-bit FLOP per SM per cycle)."""
        return self.peak_tflops_16bit * 1e12 / (self.num_sms * 4096)

    def peak_tflops(self, ab_dtype: str) -> float:
        """The dense tensor-core peak for inputs of ``ab_dtype`` (``fp8e4m3``, ``bf16``...)."""
        return self.peak_tflops_fp8 if ab_dtype.startswith("fp8") else self.peak_tflops_16bit

    def describe(self) -> str:
        """One line: name, arch, SMs, peaks, L2 and where the figures come from."""
        return (
            f"{self.name} ({self.device}): {self.arch}, {self.num_sms} SMs, {self.peak_tflops_16bit:.0f} TFLOP/s dense "
            f"16-bit ({self.peak_tflops_fp8:.0f} fp8), {self.hbm_tb_per_s:.2f} TB/s HBM, "
            f"{self.l2_bytes / _MIB:.0f} MiB L2, {self.smem_per_cta_bytes // 1024} KiB smem per CTA [{self.origin}]"
        )


def _named(name: str, device: str, num_sms: int, tf16: float, tf8: float, tbs: float, l2_mib: int,
           store_cycles: float = 0.0) -> Target:  # fmt: skip
    return Target(name, device, SM90A, num_sms, HOPPER_SMEM_PER_CTA, tf16, tf8, tbs, l2_mib * _MIB, store_cycles)


#: The named parts (NVIDIA's dense peaks; fp8 is twice 16-bit on Hopper).
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _named("h100-sxm", "NVIDIA H100 SXM", 132, 989.0, 1979.0, 3.35, 50),
        _named("h100-pcie", "NVIDIA H100 PCIe", 114, 756.0, 1513.0, 2.0, 50),
        _named("h200", "NVIDIA H200", 132, 989.0, 1979.0, 4.8, 50, store_cycles=0.055),
        _named("h20", "NVIDIA H20", 78, 148.0, 296.0, 4.0, 60),
    )
}
#: The default: what plans assume without a GPU.
H100_SXM = TARGETS["h100-sxm"]

#: Device names (``torch.cuda.get_device_properties().name``) to named parts, first match wins.
_DEVICE_PATTERNS = (
    (re.compile(r"\bH20\b", re.IGNORECASE), "h20"),
    (re.compile(r"\bH200\b", re.IGNORECASE), "h200"),
    (re.compile(r"\bH100\b.*\bPCIe\b", re.IGNORECASE), "h100-pcie"),
    (re.compile(r"\bH100\b", re.IGNORECASE), "h100-sxm"),
)


def target_from_device(device: str, num_sms: int, smem_per_cta_bytes: int, l2_bytes: int) -> Target:
    """The target of a Hopper device with these properties (see the module docstring for the peaks)."""
    name = next((part for pattern, part in _DEVICE_PATTERNS if pattern.search(device)), None)
    base = TARGETS[name] if name is not None else H100_SXM
    share = num_sms / base.num_sms if num_sms > 0 else 1.0
    return replace(
        base,
        name=name or "hopper",
        device=device,
        num_sms=num_sms,
        smem_per_cta_bytes=smem_per_cta_bytes,
        l2_bytes=l2_bytes,
        peak_tflops_16bit=base.peak_tflops_16bit * share,
        peak_tflops_fp8=base.peak_tflops_fp8 * share,
        detected=True,
        origin="read from the GPU"
        + ("" if name and share == 1.0 else f"; compute peaks of {base.name} scaled to {num_sms} SMs"),
    )


@functools.cache
def current_target() -> Target:
    """The visible Hopper GPU's target, or :data:`H100_SXM` when there is none (read once per process)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return replace(H100_SXM, origin="assumed: no GPU visible")
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - a broken torch/CUDA setup raises many types; plan for the default part
        return replace(H100_SXM, origin="assumed: the GPU could not be queried")
    if (props.major, props.minor) != (9, 0):
        return replace(H100_SXM, origin=f"assumed: {props.name} is sm_{props.major}{props.minor}, not Hopper")
    return target_from_device(
        props.name,
        props.multi_processor_count,
        int(getattr(props, "shared_memory_per_block_optin", HOPPER_SMEM_PER_CTA)),
        int(getattr(props, "L2_cache_size", H100_SXM.l2_bytes)),
    )


def resolve_target(target: str | Target | None = None) -> Target:
    """A :class:`Target` from a name in :data:`TARGETS` (any case), a ``Target`` (itself), or ``None``
    (:func:`current_target`). Raises :class:`ConfigError` naming the known targets otherwise."""
    if target is None:
        return current_target()
    if isinstance(target, Target):
        return target
    if isinstance(target, str) and target.strip().lower() in TARGETS:
        return TARGETS[target.strip().lower()]
    raise ConfigError(
        f"unknown target {target!r}; known targets are {', '.join(TARGETS)} (or none: the visible GPU, else h100-sxm)"
    )


__all__ = [
    "DEFAULT_ARCH",
    "H100_SXM",
    "SM90A",
    "TARGETS",
    "Target",
    "current_target",
    "resolve_target",
    "target_from_device",
]  # fmt: skip
