"""The baseline on the check's own cases: each case of the default grid and each input
class every run adds (at its own shape), drawn and rounded as the check draws them.

``dense.run`` takes its written-out path (``dense._written_out``) on every one of them; in
float64 that path gives the autograd path's result, and in float32 and bfloat16 it errs as
autograd's does (``baseline_errors``: no less accurate, and no bound from it false-alarms a
plain computation).  Both formulations of the weights (``tolerances.BASELINE_FORMULATIONS``) on every case.  The
grid's largest shape runs under ``slow``."""

import numpy as np
import pytest

from parity_tests.common.tolerances import BASELINE_FORMULATIONS
from parity_tests.kernels import dense, runner
from parity_tests.kernels.cases import build_grid
from parity_tests.kernels.variations import grid_cases
from baseline_errors import assert_errs_as_autograd
from sampled import one_in

TENSORS = ("out", "lse", "dq", "dk", "dv")
# Pairs Tq x Tk past which a case runs under slow only (the 2049 x 2049 shape).
SLOW_PAIRS = 2 ** 22


def _check_cases():
    """(case, alignment): the default grid, and each input class at its own shape (Tq > Tk
    bottom-right, where its rows that see no key are)."""
    grid = [(case, "top-left") for case in build_grid()]
    added = [(cases[0], "bottom-right" if cases[0].tq > cases[0].tk else "top-left")
             for _, cases in grid_cases((True, False))]
    return grid + added


CASES = one_in(2, [pytest.param(case, align, id=f"{case} {align}",
                                marks=[pytest.mark.slow] if case.tq * case.tk >= SLOW_PAIRS else [])
                   for case, align in _check_cases()])


def _both_paths(case, align, dtype, weights, monkeypatch):
    """(golden, written-out result, autograd result) on the case's inputs rounded to ``dtype``."""
    inputs = runner.round_inputs(runner.draw(case), dtype, case)
    opts = runner.reference_options(case, align, inputs)
    taken = []
    monkeypatch.setattr(dense, "_written_out", lambda *a, _f=dense._written_out: taken.append(1) or _f(*a))
    run = lambda **path: dense.run(inputs["q"], inputs["k"], inputs["v"], inputs["dout"], opts,
                                   runner.DTYPES[dtype], weights=weights, **path)
    written, autograd = run(), run(autograd=True)
    assert taken == [1], "the written-out path was not taken on plain options"
    return runner.golden(inputs, opts), written, autograd


@pytest.mark.parametrize("case, align", CASES)
@pytest.mark.parametrize("weights", BASELINE_FORMULATIONS)
def test_the_written_out_baseline_on_the_checks_cases(case, align, weights, monkeypatch):
    _, written, autograd = _both_paths(case, align, "float64", weights, monkeypatch)
    for n in TENSORS:
        np.testing.assert_allclose(written[n], autograd[n], rtol=1e-12, atol=1e-12, err_msg=n)
    for dtype in ("float32", "bfloat16"):
        gold, written, autograd = _both_paths(case, align, dtype, weights, monkeypatch)
        assert_errs_as_autograd(gold, written, autograd, dtype, TENSORS)
