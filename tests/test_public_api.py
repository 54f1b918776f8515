"""The public surface of ``epicute``: exported names, the error hierarchy, the version."""

from __future__ import annotations

import re

import pytest

import epicute
import epicute.errors


@pytest.mark.parametrize("name", epicute.__all__)
def test_exported_name_exists(name):
    assert hasattr(epicute, name)


@pytest.mark.parametrize("name", epicute.errors.__all__)
def test_error_class_is_exported_and_subclasses_epicute_error(name):
    cls = getattr(epicute, name)
    assert cls is getattr(epicute.errors, name)
    assert issubclass(cls, epicute.EpicuteError)
    assert issubclass(cls, Exception)


def test_errors_keep_builtin_bases():
    assert issubclass(epicute.DtypeError, TypeError)
    for cls in (epicute.ShapeError, epicute.AlignmentError, epicute.OutputError, epicute.ConfigError):
        assert issubclass(cls, ValueError)
    assert issubclass(epicute.CompileError, RuntimeError)


def test_version_is_a_release_string():
    assert isinstance(epicute.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+", epicute.__version__)
