"""Prepared GEMM calls: :class:`PreparedGemmCall`, made by :func:`epicute.prepare_gemm` and by ``epicute.gemm``.

A call's signature -- every tensor's shape, strides, dtype, device and 16-byte alignment class, the
numbers' types, and (fixed when it is prepared) the epilogue, output dtypes and config pins --
decides everything validation, tracing and planning do. So a prepared call goes the whole way once
(:func:`epicute.gemm.prepare.prepare`, then :func:`epicute.gemm.launch.bind_gemm`) and records the
launch: each tensor the kernel takes is one of the caller's, a view of one (replayed with
``as_strided``), or an output or workspace allocated for the call (allocated again). Calling it
checks that the arguments have the recorded signature, replays the record and launches: no tracing,
planning or validation. ``epicute.gemm`` keeps one per signature it has met
(``epicute.gemm.api._PREPARED_CALLS``) and repeats its calls through it.

A plain GEMM whose A and B reach the kernel as the caller gave them (2-D ones through the kernel
compiled for one batch, or 3-D ones) is launched *directly* (:class:`_DirectGemmCall`): it compares
A's and B's shapes, strides, dtypes and devices with the prepared ones, checks their alignment,
allocates D with one ``a.new_empty`` and calls the kernel's TVM-FFI function: one torch object per
call, where a replay makes several and each costs microseconds of host time (bench/NOTES.md, "A
prepared GEMM call"). An fp8 call with scale tensors and nothing else is keyed the same way plus the
scales' layouts, and :meth:`PreparedGemmCall.scaled` rebuilds only the scales' views.

K = 0's zero operands are taken again as they are where they are kept (eager calls), and allocated anew each
call where not. Not recorded: launches that copied a tensor (a 2-D tile operand broadcast over a batch) and calls
where distinct tensors share storage (which of them a view came from would be
ambiguous). ``epicute.gemm`` runs those the whole way every time; a prepared one checks its
arguments and does the same. One tensor passed twice (``a_scale=s, b_scale=s``) is recorded, and
replayed only for calls that pass one tensor twice there too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from epicute.epilogue.operands import Pin
from epicute.errors import AlignmentError, OutputError, SignatureError
from epicute.gemm.launch import GemmLaunch, launch_results, launcher, split_workspace
from epicute.runtime.checks import PLAIN_TENSORS, TMA_ALIGN_BYTES, check_no_grad, check_outputs_apart, overlaps

#: The arguments a call's sources start with; the epilogue's operands follow (in the prepared order),
#: then the ``outs`` tensors.
FIXED_SOURCES = ("a", "b", "out", "a_scale", "b_scale")

_SAME, _VIEW, _FRESH, _CONST, _WITHIN, _FILLED = 0, 1, 2, 3, 4, 5
#: Stands for a tensor in the recorded launch, which keeps the launch's structure, not its memory.
_VACANT = object()
_FIX = "prepare a call for it (epicute.prepare_gemm), or call epicute.gemm, which prepares one per signature"


def unwrap(value: Any) -> Any:
    """An operand's value without its kind pin (``epicute.RowVector(t)`` -> ``t``)."""
    return value.value if isinstance(value, Pin) else value


def source_signature(value: Any) -> object:
    """What validation and planning see of one argument; ``False``: nothing the cached path can key."""
    kind = type(value)
    if kind in PLAIN_TENSORS:
        return (value.shape, value.stride(), value.dtype, value.device, value.data_ptr() % TMA_ALIGN_BYTES)
    if value is None or kind is float or kind is int or kind is bool:
        return kind
    if isinstance(value, Pin):
        inner = source_signature(value.value)
        return False if inner is False else (type(value), inner)
    return False


def call_signature(values: tuple) -> tuple | None:
    """Every source's :func:`source_signature`, or None when one has none."""
    parts = tuple(source_signature(v) for v in values)
    return None if False in parts else parts


class PreparedGemmCall:
    """``epicute.gemm`` for arguments of one signature, prepared once: see :func:`epicute.prepare_gemm`.

    Call it as ``epicute.gemm`` is called, less the options fixed when it was prepared:
    ``prepared(a, b, out=..., a_scale=..., b_scale=..., outs=..., **operands)``, with tensors of the
    prepared shapes, strides, dtypes and device, and numbers where numbers were (their values may
    change). An argument that differs raises :class:`~epicute.errors.SignatureError` (or, for a
    misaligned pointer or an ``out`` overlapping an input, the error ``epicute.gemm`` raises) naming
    it, before anything is launched. Results are ``epicute.gemm``'s: new tensors each call, or
    ``out``/``outs``.
    """

    __slots__ = ("_aliases", "_bounds", "_fn", "_inputs", "_launch", "_names", "_outs_names", "_parts",
                 "_scalar_sources", "_scaled_plan", "_steps", "_whole")  # fmt: skip

    def __init__(self, parts: tuple, names: tuple, outs_names: tuple, launch: GemmLaunch | None = None,
                 steps: tuple | None = None, scalar_sources: tuple = (), aliases: tuple = (),
                 whole: Callable | None = None):  # fmt: skip
        # The recorded sources' signatures; the epilogue's operand names and the ``outs`` names, in source order.
        self._parts, self._names, self._outs_names = parts, names, outs_names
        # The launch with its tensors vacant; how to rebuild them (None: not recorded, run ``whole``).
        self._launch, self._steps = launch, steps
        # The sources the kernel's fp32 scalars are read from; pairs of sources that were one tensor.
        self._scalar_sources, self._aliases = scalar_sources, aliases
        self._whole = whole
        # A replay calls the kernel's TVM-FFI function itself (the template launch keeps the kernel, its owner,
        # alive): the tensors before ``_inputs`` are A, B, D and the epilogue's operands; ``_bounds`` (None where D
        # is the only result) ends the aux outputs, the reductions' workspaces and the epilogue's tensors.
        self._fn = self._inputs = self._bounds = None
        if launch is not None and launch.kernel is not None:
            self._fn, self._inputs = launcher(launch.kernel), 3 + len(launch.inputs)
            if launch.aux or launch.workspaces or launch.group_scales is not None:
                aux_end = self._inputs + len(launch.aux)
                workspaces_end = aux_end + len(launch.workspaces)
                self._bounds = aux_end, workspaces_end, workspaces_end + (launch.group_scales is not None)
        self._scaled_plan = self._plan_scaled(steps, scalar_sources)

    def _plan_scaled(self, steps: tuple | None, scalar_sources: tuple) -> tuple | None:
        """How :meth:`scaled` launches without the generic replay: ``(D's shape, D's dtype, each kernel tensor after
        D as (its source, its view or None), how many of them are epilogue operands)``; None unless A and B go in
        as given, D is allocated, and every other tensor is a scale or a view of one."""
        if self._fn is None or self._bounds is not None or steps is None or scalar_sources or len(steps) < 3:
            return None
        if steps[2][0] != _FRESH:
            return None
        if steps[:2] != ((_SAME, 0), (_SAME, 1)) or any(s[0] == _FRESH or s[1] not in (3, 4) for s in steps[3:]):
            return None
        views = tuple((step[1], None if step[0] == _SAME else step[2:]) for step in steps[3:])
        _, d_shape, d_dtype, _ = steps[2]
        return d_shape, d_dtype, views, self._inputs - 3

    @classmethod
    def record(cls, launch: GemmLaunch, values: tuple, parts: tuple, scalar_sources: tuple, names: tuple,
               outs_names: tuple) -> PreparedGemmCall | None:  # fmt: skip
        """How to repeat ``launch`` for new arguments of the signature ``parts`` of ``values`` (the sources: see
        :data:`FIXED_SOURCES`); None when it cannot be (a tensor copied for the call, or sources sharing storage)."""
        sources = tuple(map(unwrap, values))
        by_storage: dict[int, int] = {}
        aliases = []
        for i, s in enumerate(sources):
            if isinstance(s, torch.Tensor) and s.untyped_storage().nbytes():  # empty ones share no data
                ptr = s.untyped_storage().data_ptr()
                if ptr in by_storage:
                    if sources[by_storage[ptr]] is not s:
                        return None
                    aliases.append((by_storage[ptr], i))
                    continue
                by_storage[ptr] = i
        steps = []
        fresh_at: dict[int, int] = {}  # a new tensor's storage -> its step
        for t in launch.tensors():
            if id(t) in launch.fresh:  # the device by index: torch.empty parses it faster than a device object
                if t.untyped_storage().nbytes():
                    fresh_at[t.untyped_storage().data_ptr()] = len(steps)
                steps.append((_FRESH, tuple(t.shape), t.dtype, t.device.index if t.is_cuda else t.device))
                continue
            if id(t) in launch.constant:
                steps.append((_CONST, t))
                continue
            fill = launch.filled.get(id(t))
            if fill is not None:  # allocated for the call holding one value: a replay allocates its own
                numel = t.untyped_storage().nbytes() // t.element_size()
                steps.append((_FILLED, fill, numel, t.dtype, t.device.index if t.is_cuda else t.device,
                              tuple(t.shape), tuple(t.stride()), t.storage_offset()))  # fmt: skip
                continue
            j = fresh_at.get(t.untyped_storage().data_ptr()) if t.untyped_storage().nbytes() else None
            if j is not None:  # a view of a new tensor (a paired D's D_up: D's own tensor)
                steps.append((_WITHIN, j, tuple(t.shape), tuple(t.stride()), t.storage_offset()))
                continue
            i = by_storage.get(t.untyped_storage().data_ptr())
            if i is None:
                return None
            s = sources[i]
            if t is s or _same_view(t, s):
                steps.append((_SAME, i))
            else:
                steps.append((_VIEW, i, tuple(t.shape), tuple(t.stride()), t.storage_offset() - s.storage_offset()))
        template = launch.with_tensors([_VACANT] * len(steps), ())
        steps, aliases = tuple(steps), tuple(aliases)
        direct = (
            launch.fusion is None and launch.kernel is not None and not scalar_sources and len(steps) == 3
            and steps[:2] == ((_SAME, 0), (_SAME, 1)) and (steps[2][0] == _FRESH or steps[2] == (_SAME, 2))
        )  # fmt: skip
        return (_DirectGemmCall if direct else cls)(parts, names, outs_names, template, steps, scalar_sources, aliases)

    def __call__(self, a, b, /, *, out=None, outs=None, a_scale=None, b_scale=None, **operands):
        if outs is not None and not isinstance(outs, dict):
            raise SignatureError(f"outs is a {type(outs).__name__}; pass a dict of preallocated aux tiles by name")
        # A recorded launch has no backward: refuse inputs that need one (epicute.gemm has it).
        check_no_grad("a prepared call (epicute.prepare_gemm)", ("a", a), ("b", b), ("a_scale", a_scale),
                      ("b_scale", b_scale), ("out", out), *((f"outs[{n!r}]", t) for n, t in (outs or {}).items()),
                      operands=operands, instead="To train, call epicute.gemm, which is differentiable. ")  # fmt: skip
        if operands.keys() != set(self._names):  # dict keys against a set: in any order
            raise SignatureError(
                f"operands {sorted(operands)}: this call was prepared for {sorted(self._names)}; pass those, or {_FIX}"
            )
        if (outs or {}).keys() != set(self._outs_names):
            raise SignatureError(f"outs names {sorted(outs or {})}: prepared for {sorted(self._outs_names)}")
        values = (a, b, out, a_scale, b_scale, *(operands[n] for n in self._names),
                  *(outs[n] for n in self._outs_names))  # fmt: skip
        parts = tuple(source_signature(v) for v in values)
        if parts != self._parts:
            names = (*FIXED_SOURCES, *self._names, *(f"outs[{n!r}]" for n in self._outs_names))
            for name, value, got, want in zip(names, values, parts, self._parts):
                if got != want:
                    raise _mismatch(name, value, got, want)
        sources = tuple(map(unwrap, values))
        for i, j in self._aliases:
            if sources[i] is not sources[j]:
                raise SignatureError(
                    f"{_source_name(self, i)} and {_source_name(self, j)} were one tensor when this call was "
                    f"prepared; pass one tensor for both, or {_FIX}"
                )
        if out is not None:
            check_out_apart(out, a, b)
        if outs:  # each apart from what the kernel reads and from D (its layout was checked when prepared)
            check_outputs_apart(((f"outs[{n!r}]", outs[n]) for n in self._outs_names),
                                (("a", a), ("b", b), ("out", out), ("a_scale", a_scale), ("b_scale", b_scale),
                                 *((f"operand {n!r}", unwrap(operands[n])) for n in self._names)))  # fmt: skip
        if self._steps is None:
            return self._whole(a, b, out=out, outs=outs, a_scale=a_scale, b_scale=b_scale, **operands)
        return self.replay(sources)

    def fits(self, sources: tuple) -> bool:
        """Whether ``sources`` pass one tensor wherever the recorded call did."""
        return all(sources[i] is sources[j] for i, j in self._aliases)

    def replay(self, sources: tuple) -> torch.Tensor | dict[str, torch.Tensor]:
        """Launch for ``sources`` (pins unwrapped; of the recorded signature, unchecked) and return the results."""
        tensors = []
        for step in self._steps:
            kind = step[0]
            if kind == _SAME:
                tensors.append(sources[step[1]])
            elif kind == _VIEW:
                s = sources[step[1]]
                tensors.append(s.as_strided(step[2], step[3], s.storage_offset() + step[4]))
            elif kind == _CONST:
                tensors.append(step[1])
            elif kind == _WITHIN:
                tensors.append(tensors[step[1]].as_strided(step[2], step[3], step[4]))
            elif kind == _FILLED:
                _, fill, numel, dtype, device, shape, stride, offset = step
                tensors.append(torch.full((numel,), fill, dtype=dtype, device=device).as_strided(shape, stride, offset))
            else:
                tensors.append(torch.empty(*step[1], dtype=step[2], device=step[3]))
        scalars = tuple(_number(sources[i]) for i in self._scalar_sources)
        if self._fn is None:
            return self._launch.with_tensors(tensors, scalars).run()
        # GemmLaunch.run, less the object: the epilogue's tensors, then the blockwise scales (the only ones after).
        launch, a, b, d, i = self._launch, tensors[0], tensors[1], tensors[2], self._inputs
        plan, bounds = launch.plan, self._bounds
        split = split_workspace(plan, d.device) if plan.config.split_k > 1 else ()
        end = i if bounds is None else bounds[2]
        self._fn(a, b, d, tuple(tensors[3:end]), scalars, tuple(tensors[end:]), split, plan.max_active_clusters)
        if bounds is None:
            return launch.caller_d(d)
        aux_end, spaces_end, end = bounds
        aux = dict(zip(launch.aux, tensors[i:aux_end]))
        workspaces = dict(zip(launch.workspaces, tensors[aux_end:spaces_end]))
        return launch_results(launch.fusion, launch.batched, launch.caller_d(d), aux, workspaces,
                              tensors[spaces_end] if end > spaces_end else None)  # fmt: skip

    def plain(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """:meth:`replay` of a plain call (no ``out``, scales or operands)."""
        return self.replay((a, b, None, None, None))

    def scaled(self, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
        """:meth:`replay` of an fp8 call with scale tensors and nothing else (no ``out`` or operands)."""
        plan = self._scaled_plan
        if plan is None:
            return self.replay((a, b, None, a_scale, b_scale))
        d_shape, d_dtype, views, first_block = plan
        d = a.new_empty(d_shape, dtype=d_dtype)  # on A's device, as recorded
        scales = (a_scale, b_scale)
        tensors = tuple(
            s if view is None else s.as_strided(view[0], view[1], s.storage_offset() + view[2])
            for s, view in ((scales[i - 3], view) for i, view in views)
        )
        launch_plan = self._launch.plan
        split = split_workspace(launch_plan, d.device) if launch_plan.config.split_k > 1 else ()
        self._fn(a, b, d, tensors[:first_block], (), tensors[first_block:], split, launch_plan.max_active_clusters)
        return self._launch.caller_d(d)


class _DirectGemmCall(PreparedGemmCall):
    """A plain GEMM handing the kernel the caller's A, B (and ``out``) as given: checked and launched with
    as few Python and torch operations as it takes (see the module docstring; each one below was timed on
    the device's host, bench/NOTES.md)."""

    __slots__ = ("_d_dtype", "_d_shape", "_signature", "_split_plan", "_tail")

    def __init__(self, parts, names, outs_names, launch, steps, scalar_sources, aliases):  # fmt: skip
        super().__init__(parts, names, outs_names, launch, steps, scalar_sources, aliases)
        (a_shape, a_stride, a_dtype, device, _), (b_shape, b_stride, b_dtype, _, _) = parts[0], parts[1]
        index = device.index if device.type == "cuda" else -1  # as Tensor.get_device() says it
        # What a call's A and B must show, in the order __call__ builds its tuple: one comparison in C.
        self._signature = (a_shape, b_shape, a_stride, b_stride, a_dtype, b_dtype, index, index)
        # D's sizes where it is allocated per call (None: the caller's ``out``) and its dtype where it is not A's:
        # ``a.new_empty(*sizes)`` takes D's device (and dtype) from A, the cheapest allocation torch's Python
        # API has (bench/NOTES.md, "Host overhead").
        self._d_shape = self._d_dtype = None
        if steps[2][0] == _FRESH:
            _, self._d_shape, d_dtype, _ = steps[2]
            self._d_dtype = None if d_dtype == a_dtype else d_dtype
        plan = launch.plan
        self._split_plan = plan if plan.config.split_k > 1 else None
        # The launch's constant arguments, the empty tuples converted to TVM-FFI arrays once (a tuple is
        # converted on every call otherwise); None where the split-K workspace is looked up per call.
        empty = _ffi_empty()
        self._tail = None if self._split_plan is not None else (empty, empty, empty, empty, plan.max_active_clusters)

    def __call__(self, a, b, /, *, out=None, **others):
        try:
            if (
                (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.get_device(), b.get_device())
                == self._signature and not (a.data_ptr() | b.data_ptr()) % TMA_ALIGN_BYTES and not others
                and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))  # else the whole check
            ):  # fmt: skip
                if out is None and self._d_shape is not None:
                    return self.plain(a, b)
                if (out is not None and self._d_shape is None and source_signature(out) == self._parts[2]
                        and not (out.requires_grad and torch.is_grad_enabled())):  # fmt: skip
                    check_out_apart(out, a, b)
                    return self._launch_into(a, b, out)
        except AttributeError:  # not a tensor: the whole check names it
            pass
        return PreparedGemmCall.__call__(self, a, b, out=out, **others)  # raises, naming what differs

    def plain(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d = a.new_empty(*self._d_shape) if self._d_dtype is None else a.new_empty(*self._d_shape, dtype=self._d_dtype)
        tail = self._tail
        if tail is None:
            return self._launch_into(a, b, d)
        self._fn(a, b, d, *tail)
        return d

    def _launch_into(self, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        if self._tail is not None:
            self._fn(a, b, d, *self._tail)
        else:  # split-K: the workspace of the current stream
            empty = _ffi_empty()
            self._fn(a, b, d, empty, empty, empty, split_workspace(self._split_plan, d.device),
                     self._split_plan.max_active_clusters)  # fmt: skip
        return d

    def replay(self, sources: tuple) -> torch.Tensor:
        out = sources[2]
        return self.plain(sources[0], sources[1]) if out is None else self._launch_into(sources[0], sources[1], out)


def check_out_apart(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out`` may share no memory with ``a`` or ``b`` (the kernel would read them while writing it)."""
    for name, t in (("a", a), ("b", b)):
        if overlaps(out, t):
            raise OutputError(f"out shares memory with {name}; the kernel would read {name} while writing out")


def _same_view(t: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether ``t`` views ``s``'s storage exactly as ``s`` does (``a.unsqueeze(0)[0]``): it may be ``s``."""
    return t.shape == s.shape and t.stride() == s.stride() and t.storage_offset() == s.storage_offset()


@functools.cache
def _ffi_empty():
    """An empty TVM-FFI array (what a ``()`` argument becomes), or ``()`` where TVM-FFI is absent."""
    try:
        import tvm_ffi
    except ImportError:  # pragma: no cover - the DSL depends on it
        return ()
    return tvm_ffi.convert(())


def _source_name(prepared: PreparedGemmCall, i: int) -> str:
    names = (*FIXED_SOURCES, *prepared._names, *(f"outs[{n!r}]" for n in prepared._outs_names))
    return names[i]


def _describe(part: object) -> str:
    """A source's signature in words."""
    if isinstance(part, tuple) and len(part) == 5:
        return f"a {part[2]} tensor of shape {tuple(part[0])}"
    if isinstance(part, tuple):
        return f"{part[0].__name__}({_describe(part[1])})"
    return {type(None): "not given", float: "a float", int: "an int", bool: "a bool"}.get(part, "something else")


def _mismatch(name: str, value: Any, got: object, want: object) -> Exception:
    """The error for source ``name`` (``value``, signature ``got``) where a call was prepared for ``want``."""
    if got is False:
        return SignatureError(
            f"{name} is a {type(value).__name__}; a prepared call takes tensors, Python numbers and operand pins"
        )
    if isinstance(got, tuple) and isinstance(want, tuple) and len(got) == len(want) == 2 and got[0] is want[0]:
        return _mismatch(name, unwrap(value), got[1], want[1])  # one pin around another tensor
    if not (isinstance(got, tuple) and isinstance(want, tuple) and len(got) == len(want) == 5):
        return SignatureError(f"{name} is {_describe(got)}; this call was prepared with {_describe(want)}: {_FIX}")
    (shape, stride, dtype, device, align), (want_shape, want_stride, want_dtype, want_device, want_align) = got, want
    if shape != want_shape:
        return SignatureError(f"{name} has shape {tuple(shape)}; this call was prepared for {tuple(want_shape)}: "
                              f"{_FIX}")  # fmt: skip
    if dtype != want_dtype:
        return SignatureError(f"{name} has dtype {dtype}; this call was prepared for {want_dtype}: {_FIX}")
    if device != want_device:
        return SignatureError(f"{name} is on {device}; this call was prepared on {want_device}: {_FIX}")
    if stride != want_stride:
        return SignatureError(
            f"{name} has strides {stride}; this call was prepared for {want_stride}: pass it in that layout, or {_FIX}"
        )
    if align and not want_align:
        return AlignmentError(
            f"{name}.data_ptr() is {align} bytes past a 16-byte boundary (a view with an element offset?); "
            f"TMA needs 16-byte-aligned bases: pass {name}.clone()"
        )
    return SignatureError(
        f"{name}.data_ptr() is {align} bytes past a 16-byte boundary, {want_align} when this call was prepared "
        f"(the kernel's views of it depend on it): {_FIX}"
    )


def _number(value: Any) -> float:
    """A scalar operand's value: a Python number, or a 1-element tensor read on the host."""
    return float(value.item() if isinstance(value, torch.Tensor) else value)


__all__ = ["FIXED_SOURCES", "PreparedGemmCall", "call_signature", "source_signature", "unwrap"]
