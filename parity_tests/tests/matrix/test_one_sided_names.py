"""A gradient reported by one side only is a failing row, in every dtype.

An extra name on either side (a parameter the other implementation does not
have) or a missing one must show as a row with an infinite error, never be
dropped from the compared list: dropping it would leave float64 runs with no row
at all for it, and a green run.
"""

import numpy as np
import pytest

from parity_tests.matrix import harness

DTYPES = ["float64", "float32"] + [d for d in ("bfloat16", "float16")
                                   if harness.dtype_supported(d, "cpu")]
SPEC = next(s for s in harness.MODULES if s.name == "CausalAttention")
CONFIG = next(c for c in SPEC.configs if c.qkv_bias)


def _rows(monkeypatch, dtype, side, change):
    """Rows of one case with ``change(results)`` applied to one side's results."""
    target = "run_torch" if side == "torch" else "run_numpy"
    original = getattr(harness, target)

    def changed(*args, **kwargs):
        results = original(*args, **kwargs)
        change(results)
        return results

    monkeypatch.setattr(harness, target, changed)
    return harness.run_case(harness.Case(SPEC, CONFIG, "eval", dtype, "cpu"))


def _extra(results):
    results["ghost.weight"] = np.zeros((2, 2))


def _missing(results):
    results.pop("W_key.bias", None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side", ["torch", "numpy"])
@pytest.mark.parametrize("change, name", [(_extra, "ghost.weight"), (_missing, "W_key.bias")],
                         ids=["extra", "missing"])
def test_a_one_sided_gradient_is_a_failing_row(monkeypatch, dtype, side, change, name):
    rows = _rows(monkeypatch, dtype, side, change)
    named = [r for r in rows if r["tensor"] == name]
    assert named, f"{dtype}: no row for {name!r}, reported by one side only"
    failing = [r for r in named if not r["passed"]]
    assert failing and all(r["error"] == float("inf") for r in failing), named
    assert harness.summarize(rows)["failed"] == len([r for r in rows if not r["passed"]]) > 0
