"""``needs(name, ...)``: a test of something PyTorch added after the floor (2.1) skips, with
the release that brought it, where the installed PyTorch lacks it (`capabilities.NEEDS`)."""

import pytest

from parity_tests.common import capabilities


def needs(*names):
    why = capabilities.lacks(*names)
    return pytest.mark.skipif(why is not None, reason=why or "")


def as_if_lacking(monkeypatch, *names):
    """The installed PyTorch, for one test, as if it lacked ``names`` (`capabilities.NEEDS`)."""
    has = capabilities.has
    monkeypatch.setattr(capabilities, "has", lambda name: name not in names and has(name))


def needs_dtype(dtype, device="cpu"):
    """Skip where the installed PyTorch cannot compute in ``dtype`` on ``device`` (float16 on
    the CPU before PyTorch 2.2)."""
    why = capabilities.dtype_lacks(dtype, device)
    return pytest.mark.skipif(why is not None, reason=why or "")
