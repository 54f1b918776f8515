"""Compiling kernel variants, with or without a GPU; every compile goes through the cache.

Kernels are compiled against *fake* tensors: symbolic sizes and strides, fixed
dtypes, majors and 16-byte alignment. The result therefore serves every
problem size, and compiling needs no GPU (``CUTE_DSL_ARCH=sm_90a`` is set when
none is present), which is how CI proves every variant builds.

Compiled functions use the DSL's TVM-FFI calling convention: they take torch
tensors directly and launch on torch's current stream.

:class:`KernelFamily` puts one kernel kind's variants through the process-wide
:data:`~epicute.runtime.cache.KERNEL_CACHE` (memory, then disk, then compile):
a variant only needs ``key()`` (a ``CacheKey``) and ``arch``; a family compiles
each arch with its own function (an ``"sm_100a"`` entry in the family's declaration would
add a Blackwell kernel beside the Hopper one). The families are made from their declarations
(:mod:`epicute.families`, see :mod:`epicute.runtime.family`) on first use: :data:`FAMILIES`.

What depends on the GPU but not on the code -- the number of persistent CTAs --
is a launch argument (``max_active_clusters``), so keys hold the arch and no
SM count: one ahead-of-time cache serves every Hopper part.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

from epicute.errors import ConfigError
from epicute.runtime.cache import KERNEL_CACHE
from epicute.runtime.family import Declared, resolve

#: Options of every ``cute.compile``: kernels are called through TVM-FFI. Tests append
#: ``remarks{ptx}`` to have the DSL print ptxas's register and spill report.
DSL_COMPILE_OPTIONS = "--enable-tvm-ffi"

#: Base-address alignment every TMA operand is compiled to assume (checked per call on the host).
OPERAND_ALIGN_BYTES = 16


#: Set while :func:`epicute.runtime.precompile.precompile` runs code to learn the kernels it needs: a compile is then
#: refused with :class:`KernelMissing`, which is also appended to :data:`MISSED` (whatever a caller between the
#: family and the code wraps it in). Process-wide, not per thread: autograd runs a backward on a thread of its own.
DISCOVERING = threading.Event()
MISSED: list[KernelMissing] = []


class KernelMissing(Exception):
    """A variant neither in memory nor on disk, reached under :data:`DISCOVERING`: the call stops before its launch."""

    def __init__(self, kind: str, variant: Any, key: Any) -> None:
        super().__init__(f"{kind} kernel {key.label} is not compiled yet")
        self.kind, self.variant, self.key = kind, variant, key


def past_missing(launch: Callable[[], Any], stand_in: Callable[[], Any]) -> Any:
    """``launch()``, except while discovering where it stops at a missing kernel: then ``stand_in()``, a result of
    the same shapes (computed another way, or left unwritten), so that the launches after it, which need its
    shapes but not its values, find their own kernels in the same pass (a backward's data- and weight-gradient
    GEMMs behind its gradient pass). Outside discovery, exactly ``launch()``."""
    if not DISCOVERING.is_set():
        return launch()
    missed = len(MISSED)
    try:
        return launch()
    except Exception:
        if len(MISSED) == missed:  # an error of the call's own
            raise
        return stand_in()


def or_reference(entry: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``entry(*args, **kwargs)``, an epicute entry point; while discovering, where it stops at a missing kernel, the
    same call on the reference backend (:func:`past_missing`): its outputs, right in shape and value, let the calls
    after it (a training call's backward) find their own kernels in the same pass."""
    if not DISCOVERING.is_set():
        return entry(*args, **kwargs)
    return past_missing(lambda: entry(*args, **kwargs), lambda: entry(*args, **kwargs, backend="reference"))


def reference_device(tensor: Any) -> Any:
    """Where a reference computation of ``tensor``'s call runs: the CPU, the oracle the kernels are tested against,
    independent of the GPU's math; while discovering, ``tensor``'s own device. A stand-in's values then only carry
    the call on to its next kernels (:func:`or_reference`): computed on the GPU they stay where the calls after them
    expect them, and a model's GEMMs in float32 on the CPU took longer than the compiles they stood in for
    (bench/NOTES.md, ninth session of 2026-11-30)."""
    import torch

    return tensor.device if DISCOVERING.is_set() else torch.device("cpu")


def launch_or_skip(family: KernelFamily, variant: Any, *args: Any) -> None:
    """``family.get(variant)(*args)``, a launch writing buffers its caller made; while discovering, skipped where its
    kernel is missing (:func:`past_missing`): for passes whose successors read those buffers as values only (never
    indices, counters or sizes), which find their own kernels in the same pass."""
    if DISCOVERING.is_set():
        past_missing(lambda: family.get(variant)(*args), lambda: None)
    else:
        family.get(variant)(*args)


def dsl_compile(variant, kernel, *args, constant_args: tuple[str, ...] = ()):
    """``cute.compile(kernel, *args)`` with epicute's options; a DSL failure becomes a :class:`CompileError`
    naming ``variant``. ``constant_args`` name the arguments that may be empty tuples (no fused epilogue):
    the DSL makes those compile-time constants, which is what we want, and warns on every compile."""
    import warnings

    from cutlass import cute

    from epicute.errors import CompileError

    try:
        with warnings.catch_warnings():
            if constant_args:
                warnings.filterwarnings(
                    "ignore", message=rf"Argument ({'|'.join(constant_args)}) .*cannot be converted"
                )
            return cute.compile(kernel, *args, options=DSL_COMPILE_OPTIONS)
    except Exception as exc:  # the DSL raises many types; report one
        raise CompileError(f"CuTe DSL failed to compile {variant}: {exc}") from exc


class KernelFamily:
    """One kernel kind's compiled variants, through :data:`KERNEL_CACHE`, found by (kind, arch).

    ``compilers[arch](variant)`` compiles a variant whose ``arch`` is ``arch`` (a function, or its
    ``"module:function"`` text, imported when first compiled with); ``variant.key()`` (a
    :class:`~epicute.runtime.cache.CacheKey`, which holds the arch) names it. Another arch's kernel is
    added beside the others (in the declaration, or with :meth:`register`), never inside them. Making
    one registers nothing: epicute's own are :data:`FAMILIES`, made from their declarations.
    """

    #: Variants whose keys a family remembers (then it forgets them all and starts again).
    REMEMBERED_KEYS = 4096

    def __init__(self, kind: str, compilers: Mapping[str, Callable[[Any], Any] | str]) -> None:
        self.kind = kind
        self.compilers = dict(compilers)
        self._keys: dict[Any, Any] = {}
        #: id(variant) -> (variant, kernel, the cache's memory it came from): a repeat launch of the same variant
        #: object (a prepared call's) finds its kernel without hashing the variant and its key, a few microseconds
        #: a launch on a slow host (bench/NOTES.md)
        self._kernels: dict[int, tuple[Any, Callable, dict]] = {}

    def register(self, arch: str, compile_fn: Callable[[Any], Any]) -> None:
        """Compile this family's variants for ``arch`` with ``compile_fn``."""
        self.compilers[arch] = compile_fn

    def compiler(self, arch: str) -> Callable[[Any], Any]:
        """The compile function of ``arch``; :class:`ConfigError` if this family has none."""
        try:
            fn = self.compilers[arch]
        except KeyError:
            raise ConfigError(
                f"no {self.kind} kernel for {arch}: epicute's {self.kind} kernels are for {', '.join(self.compilers)}"
            ) from None
        return resolve(fn) if isinstance(fn, str) else fn

    def compile(self, variant) -> Any:
        """Compile ``variant`` now (no cache) with its arch's function; :class:`KernelMissing` under
        :data:`DISCOVERING` (the cache calls this only on a miss of memory and disk)."""
        if DISCOVERING.is_set():
            MISSED.append(missing := KernelMissing(self.kind, variant, self.key(variant)))
            raise missing
        return self.compiler(variant.arch)(variant)

    def get(self, variant) -> Callable:
        """The compiled kernel of ``variant`` (memory, else disk, else compiled now)."""
        seen = self._kernels.get(id(variant))
        if seen is not None and seen[0] is variant and seen[2] is KERNEL_CACHE.memory:
            return seen[1]
        fn = KERNEL_CACHE.get(self.key(variant), functools.partial(self.compile, variant))
        try:
            hash(variant)  # hashable variants are immutable; another may change under the same id
        except TypeError:
            return fn
        if len(self._kernels) >= self.REMEMBERED_KEYS:
            self._kernels.clear()
        self._kernels[id(variant)] = (variant, fn, KERNEL_CACHE.memory)
        return fn

    def key(self, variant):
        """``variant.key()``, remembered per variant: a key checks its parts and formats its label, which costs
        more host time than a launch (a score_mod's key tens of microseconds), while a variant (a frozen
        dataclass whose compared fields make its key) hashes in one or two. An unhashable variant is keyed anew."""
        try:
            key = self._keys.get(variant)
        except TypeError:
            return variant.key()
        if key is None:
            if len(self._keys) >= self.REMEMBERED_KEYS:
                self._keys.clear()
            key = self._keys[variant] = variant.key()
        return key

    def ensure_on_disk(self, variant) -> tuple[str, Any]:
        """Ahead of time: compile ``variant`` into the disk cache unless it is there."""
        self.compiler(variant.arch)  # an arch without kernels fails here, before any lock or file
        return KERNEL_CACHE.ensure_on_disk(self.key(variant), functools.partial(self.compile, variant))


#: Every declared kernel family by kind (``epicute compile`` looks them up here), each made on first use from
#: its declaration (:mod:`epicute.families`); a family module takes its own from here (``FAMILIES["gemm"]``).
FAMILIES: Mapping[str, KernelFamily] = Declared(lambda spec: KernelFamily(spec.kind, spec.compilers))

__all__ = ["DISCOVERING", "DSL_COMPILE_OPTIONS", "FAMILIES", "MISSED", "OPERAND_ALIGN_BYTES", "KernelFamily",
           "KernelMissing", "dsl_compile", "launch_or_skip", "or_reference", "past_missing",
           "reference_device"]  # fmt: skip
