"""Loosening one tolerance constant tenfold, for the tests that prove each has teeth
(tests/matrix/test_tolerance_teeth.py, tests/kernels/test_check_tolerance_teeth.py)."""

from parity_tests.common import tolerances as tol


def loosen(monkeypatch, constant):
    """``constant`` (``NAME`` or ``NAME[key]``) of `tolerances` made ten times looser."""
    name, _, key = constant.partition("[")
    value = getattr(tol, name)
    if key:
        monkeypatch.setitem(value, key.rstrip("]"), value[key.rstrip("]")] * 10)
    else:
        monkeypatch.setattr(tol, name, value * 10)
