"""The written-out baseline (``dense._written_out``) judged against autograd's plain path, in
float32 and bfloat16, as the bound depends on it:

- the written-out path is no less accurate than autograd's, up to the chance of rounding (a
  factor 2 and the check's floor of a rounding or two: measured 0.49 .. 1.52 times over the
  check's grid, 2.03 times (4.2 u against 2.1 u) on dq of a bfloat16 block of rows on
  PyTorch 2.1): a baseline that errs more would loosen every bound;
- autograd's plain computation passes the check's bound with the written-out error as its
  baseline (``tolerances.check_bound``): a baseline luckily more accurate than a plain
  computation must not make the bound false-alarm.

(A two-sided ratio of the two errors depends on the thread count and the PyTorch release,
not on the method.)"""

import numpy as np

from parity_tests.common.tolerances import CHECK_FLOOR_ULPS, UNIT_ROUNDOFF, check_bound
from parity_tests.kernels import runner


def assert_errs_as_autograd(gold, written, autograd, dtype, names, where=()):
    den = runner.denominators(gold)
    floor = CHECK_FLOOR_ULPS[dtype] * UNIT_ROUNDOFF[dtype]
    logits = float(np.abs(gold["lse"][np.isfinite(gold["lse"])]).max(initial=0.0))
    for n in names:
        seen = np.isfinite(gold[n])
        assert np.array_equal(np.isfinite(written[n]), seen), (dtype, n) + where
        err = lambda r: np.abs(r[n][seen] - gold[n][seen]).max(initial=0.0) / den[n]
        assert err(written) <= 2.0 * err(autograd) + floor, (dtype, n, err(written), err(autograd)) + where
        assert err(autograd) <= check_bound(dtype, err(written), logits), (dtype, n, err(written), err(autograd)) + where
