"""Checks every kernel family makes before a launch: the device, TMA's alignment rule, aliasing.

Each raises an :class:`~epicute.errors.EpicuteError` subclass naming the argument and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from epicute.errors import ConfigError, DeviceError, EpilogueError, GradientError, OutputError

#: TMA moves whole 16-byte units: base addresses and every stride but the unit one are multiples of it.
TMA_ALIGN_BYTES = 16
#: Tensor types whose data pointers and views are their own, tested by ``type(t) in PLAIN_TENSORS`` on hot paths:
#: subclasses (fake, functional or traced tensors) never reach one, and take the whole path.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def with_aligned_unit_dims(t: torch.Tensor, contiguous_dim: int) -> torch.Tensor:
    """``t`` with the stride of each size-1 dimension but ``contiguous_dim`` made a multiple of 16 bytes (a view):
    no index steps along such a dimension, but a TMA descriptor encodes every stride, so it gets an aligned value
    instead of rejecting the tensor. Other strides are left as they are."""
    step = TMA_ALIGN_BYTES // t.element_size()
    strides = [
        -(-max(st, 1) // step) * step if size == 1 and d != contiguous_dim and (st % step or st == 0) else st
        for d, (size, st) in enumerate(zip(t.shape, t.stride()))
    ]
    return t if strides == list(t.stride()) else t.as_strided(t.shape, strides)


def _tensor_of(value: Any) -> torch.Tensor | None:
    """``value`` if it is a tensor, the tensor an operand pin (``epicute.RowVector(t)``) holds, else None."""
    if isinstance(value, torch.Tensor):
        return value
    inner = getattr(value, "value", None)  # a Pin (epicute.epilogue.operands), duck-typed: no import cycle
    return inner if isinstance(inner, torch.Tensor) else None


def _named(named: Iterable[tuple[str, Any]], operands: Mapping[str, Any] | None) -> Iterable[tuple[str, Any]]:
    """``(label, value)`` of each ``named`` argument, then of each operand."""
    yield from named
    for name, value in (operands or {}).items():
        yield f"operand {name!r}", value


def check_has_values(*named: tuple[str, Any], operands: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`DeviceError` for a ``meta`` tensor: the reference backend computes values, and it has none.
    ``named``: ``(argument, value)`` pairs; ``operands``: an epilogue's (or score_mod's) by name, pins unwrapped."""
    for label, value in _named(named, operands):
        t = _tensor_of(value)
        if t is not None and t.device.type == "meta":
            raise DeviceError(
                f"{label} is a meta tensor: backend='reference' computes values and it has none; pass real tensors "
                "(explain works on meta tensors)"
            )


def check_no_grad(entry: str, *named: tuple[str, Any], operands: Mapping[str, Any] | None = None,
                  instead: str = "") -> None:  # fmt: skip
    """Raise :class:`GradientError` when autograd records and an argument requires grad: ``entry`` records no
    backward, so its result would carry no gradient and a training step would silently stop learning. ``named``:
    ``(argument, value)`` pairs; ``operands``: the epilogue's by name (pins unwrapped); ``instead``: where a
    differentiable call is. Costs one ``torch.is_grad_enabled()`` under ``torch.no_grad()``/``inference_mode()``."""
    if not torch.is_grad_enabled():
        return
    for name, value in named:
        if value is not None and (value.requires_grad if type(value) is torch.Tensor else _requires_grad(value)):
            raise _gradient_error(entry, name, name, instead)
    if operands:
        for name, value in operands.items():
            if _requires_grad(value):
                raise _gradient_error(entry, f"operand {name!r}", name, instead)


def _requires_grad(value: Any) -> bool:
    t = _tensor_of(value)
    return t is not None and t.requires_grad


def _gradient_error(entry: str, label: str, expr: str, instead: str) -> GradientError:
    return GradientError(
        f"{label} requires grad, but {entry} records no backward: its result would carry no gradient (training "
        f"would silently stop learning). {instead or ''}For inference, call it under torch.no_grad() or "
        f"torch.inference_mode(), or pass {expr}.detach()"
    )


def check_flags(**flags: Any) -> None:
    """Each keyword is a yes/no option (``gated=``, ``causal=``...): True or False (or 1/0); else
    :class:`ConfigError` (a string or a tensor there would be read as True, or fail deep inside)."""
    for name, value in flags.items():
        if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool too
            continue
        if isinstance(value, numbers.Integral) and value in (0, 1):
            continue
        raise ConfigError(f"{name}={value!r}: pass True or False")


def check_text_file(file: Any) -> None:
    """An ``explain`` function's ``file=``: ``"stdout"``, None (quiet) or something with a ``write`` method (a file
    opened for text, ``io.StringIO``); else :class:`ConfigError`."""
    if file is not None and file != "stdout" and not callable(getattr(file, "write", None)):
        raise ConfigError(
            f"file={file!r}: pass 'stdout' (the default), None to print nothing, or a text stream such as "
            "sys.stderr or open(path, 'w')"
        )


def keyword_parameters(*functions: Callable) -> frozenset[str]:
    """The keyword-only parameter names of ``functions`` (a family's entry points): names an epilogue's operands
    cannot take, since a keyword argument of that name binds to the entry's own parameter."""
    return frozenset(
        p.name for fn in functions for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    )  # fmt: skip


def check_operand_names(hook: str, fn_name: str, params: Iterable[str], reserved: Iterable[str], entry: str) -> None:
    """Raise :class:`EpilogueError` when a ``hook`` (``"epilogue"``, ``"score_mod"``) takes an operand named like
    one of ``entry``'s own keyword parameters (``reserved``): a value passed under that name would bind to the
    parameter (``out=``, ``config=``...), never reach the hook."""
    clash = sorted(set(params) & set(reserved))
    if clash:
        name = clash[0]
        raise EpilogueError(
            f"{hook} {fn_name!r} takes an operand named {name!r}, which is {entry}'s own parameter {name}=: a value "
            f"passed as {name}= goes to {entry}, never to the {hook}. Rename the {hook}'s parameter (e.g. "
            f"{name}_) and pass it under that name"
        )


#: Config fields' types, per config class: ``{field: default}`` of every field a caller may pin.
_CONFIG_FIELDS: dict[type, dict[str, Any]] = {}


def _config_fields(cls: type) -> dict[str, Any]:
    found = _CONFIG_FIELDS.get(cls)
    if found is None:
        found = _CONFIG_FIELDS[cls] = {
            f.name: f.default for f in dataclasses.fields(cls) if f.init and f.name != "reasons"
        }  # fmt: skip
    return found


def _config_value(name: str, value: Any, default: Any, cls: type) -> Any:
    """``value`` as config field ``name`` (of ``default``'s type) takes it, or a :class:`ConfigError`."""

    def refuse(what: str) -> ConfigError:
        return ConfigError(
            f"config[{name!r}]={value!r} ({type(value).__name__}): {cls.__name__}.{name} takes {what}, e.g. "
            f"config={{{name!r}: {default!r}}}"
        )

    def integral(x: Any) -> int | None:
        if isinstance(x, bool):
            return None
        if isinstance(x, numbers.Integral):
            return int(x)
        if isinstance(x, float) and x.is_integer():
            return int(x)
        return None

    if isinstance(default, bool):
        if isinstance(value, bool) or (integral(value) in (0, 1) and not isinstance(value, float)):
            return bool(value)
        raise refuse("True or False")
    if isinstance(default, int):  # every int field is a size or a count
        number = integral(value)
        if number is None or number < 1:
            raise refuse("a positive int")
        return number
    if isinstance(default, str):
        if not isinstance(value, str):
            raise refuse("a string")
        return value
    if isinstance(default, tuple):
        items = tuple(map(integral, value)) if isinstance(value, (tuple, list)) else None
        if items is None or len(items) != len(default) or any(x is None or x < 1 for x in items):
            raise refuse(f"a tuple of {len(default)} positive ints")
        return items
    return value


def config_pins(config: Any, cls: type) -> tuple[tuple[str, Any], ...]:
    """A call's ``config=`` as sorted ``(field, value)`` pins of the family's config dataclass ``cls``, checked: a
    dict (or other mapping) whose keys are ``cls``'s fields and whose values have each field's type (positive ints:
    every int field is a size or a count; bools, strings, tuples of positive ints; a whole float counts as an int, a
    list as a tuple). A None value pins nothing (the planner chooses, as if the key were absent). Raises
    :class:`ConfigError` naming the field and the fix. Whether the kernel can run the pinned values is the planner's
    to say."""
    if config is None:
        return ()
    known = _config_fields(cls)
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"config={config!r} ({type(config).__name__}): pass a dict of {cls.__name__} fields to pin, e.g. "
            f"config={{'tile_n': 128}} (fields: {', '.join(sorted(known))})"
        )
    pins = []
    for name, value in config.items():
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1) if isinstance(name, str) else []
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"config has an unknown field {name!r}; {hint}{cls.__name__} fields are {', '.join(sorted(known))}"
            )
        if value is not None:
            pins.append((name, _config_value(name, value, known[name], cls)))
    return tuple(sorted(pins))


# Under dynamo (the families' ``*_op_call``) it runs once, at trace time, and its result is a constant of the graph:
# the mark ``torch._dynamo.assume_constant_result`` sets (see epicute.runtime.torch_ops.assume_constant_result).
config_pins._dynamo_marked_constant = True


def check_one_device(*named: tuple[str, Any], where: str = "one device") -> None:
    """Raise :class:`DeviceError` when the tensors among ``(name, value)`` live on different devices (``explain``
    plans for any device, ``"meta"`` included, but the call it describes has its inputs on one; the kernel path
    asks for one GPU). Values that are no tensors are left to the checks of their types."""
    tensors = [(name, t) for name, t in named if isinstance(t, torch.Tensor)]
    if len({t.device for _, t in tensors}) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in tensors)
        raise DeviceError(f"{listing}; move them to {where}")


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once (torch asks the driver every time: microseconds per call)."""
    return torch.cuda.get_device_capability(index)


def check_on_one_hopper_gpu(*named: tuple[str, torch.Tensor]) -> None:
    """Raise :class:`DeviceError` unless every ``(name, tensor)`` lives on one CUDA device, a Hopper GPU."""
    for name, t in named:
        if t.device.type != "cuda":
            raise DeviceError(f"{name} is on {t.device}; epicute kernels run on a CUDA device: pass {name}.cuda()")
    check_one_device(*named, where="one GPU")
    device = named[0][1].device
    major, minor = _capability(device.index)
    if (major, minor) != (9, 0):
        raise DeviceError(
            f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; epicute's kernels need a Hopper GPU (sm_90)"
        )


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (0 when empty)."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def ranges_meet(x0: int, x_span: int, y0: int, y_span: int) -> bool:
    """Whether byte ranges ``[x0, x0 + x_span)`` and ``[y0, y0 + y_span)`` meet."""
    return x0 < y0 + y_span and y0 < x0 + x_span


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an ``expand``-ed dimension's zero stride, an ``as_strided``
    view whose rows overlap): a kernel storing into ``t`` would write them in any order. Reads shape and strides
    only: a layout where each dimension's stride passes the span of the smaller ones is free of overlap."""
    reach = 0
    for stride, size in sorted((st, size) for size, st in zip(t.shape, t.stride()) if size > 1):
        if stride <= reach:
            return t.numel() > 0
        reach += (size - 1) * stride
    return False


def check_outputs_apart(outputs: Iterable[tuple[str, torch.Tensor]], inputs: Iterable[tuple[str, Any]] = ()) -> None:
    """Raise :class:`OutputError` when an output (``(argument, tensor)`` pairs: ``out``, ``outs[name]``) has elements
    that share memory, or shares memory with another output or with an input (``(argument, tensor or None)``)."""
    outputs, inputs = list(outputs), [(n, t) for n, t in inputs if isinstance(t, torch.Tensor)]
    for i, (name, t) in enumerate(outputs):
        if self_overlapping(t):
            raise OutputError(
                f"{name} has shape {tuple(t.shape)} and strides {tuple(t.stride())}: some of its elements share memory "
                f"(an expand()-ed or as_strided view), so the kernel's stores to them would collide; pass a tensor "
                f"of its own, e.g. torch.empty({tuple(t.shape)}, dtype={t.dtype})"
            )
        for other, u in (*outputs[:i], *inputs):
            if overlaps(t, u):
                raise OutputError(
                    f"{name} shares memory with {other}; the kernel would "
                    f"{'write both at once' if other.startswith('out') else f'read {other} while writing {name}'}: "
                    "pass separate tensors"
                )


def overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False
    if x.device != y.device or x.device.type == "meta":  # meta tensors have no memory (every pointer is 0)
        return False
    return ranges_meet(x.data_ptr(), span_bytes(x), y.data_ptr(), span_bytes(y))


__all__ = [
    "TMA_ALIGN_BYTES", "check_flags", "check_has_values", "check_no_grad", "check_on_one_hopper_gpu",
    "check_one_device", "check_operand_names", "check_outputs_apart", "check_text_file", "config_pins",
    "keyword_parameters", "overlaps", "ranges_meet", "self_overlapping", "span_bytes",
]  # fmt: skip
