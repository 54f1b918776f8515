"""The exception hierarchy of epicute.

Every failure a user can cause raises a subclass of :class:`EpicuteError` before
anything is launched on the GPU. Each message names the offending argument and
says how to fix it, so a user never has to read kernel code to understand it.
"""

from __future__ import annotations


class EpicuteError(Exception):
    """Base class of every error epicute raises on purpose."""


class DeviceError(EpicuteError):
    """A tensor lives on the wrong device, or no suitable GPU is present."""


class DtypeError(EpicuteError, TypeError):
    """A dtype is unsupported, or two operands disagree on their dtype."""


class ShapeError(EpicuteError, ValueError):
    """Operand shapes are inconsistent or of an unsupported rank."""


class AlignmentError(EpicuteError, ValueError):
    """A stride or data pointer violates TMA's 16-byte alignment rule."""


class OutputError(EpicuteError, ValueError):
    """A preallocated output has the wrong shape/dtype/layout or aliases an input."""


class ConfigError(EpicuteError, ValueError):
    """A kernel configuration (tile, cluster, stages, epilogue tile) is invalid."""


class EpilogueError(EpicuteError, ValueError):
    """An epilogue function cannot be traced, or its operands do not fit it."""


class GradientError(EpicuteError, RuntimeError):
    """Inputs require grad where epicute has no backward yet (the GEMMs'): the result would silently carry no
    gradient, so the call is refused."""


class CompileError(EpicuteError, RuntimeError):
    """The CuTe DSL failed to compile a kernel that the planner accepted."""


class SignatureError(EpicuteError, ValueError):
    """A prepared call (:func:`epicute.prepare_gemm`) got an argument other than the kind, shape, strides,
    dtype or device it was prepared for."""


__all__ = [
    "AlignmentError",
    "CompileError",
    "ConfigError",
    "DeviceError",
    "DtypeError",
    "EpicuteError",
    "EpilogueError",
    "GradientError",
    "OutputError",
    "ShapeError",
    "SignatureError",
]
