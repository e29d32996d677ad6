"""Every tolerance constant is tight enough to matter: loosened tenfold, a known-bad
comparison would pass.

For each constant of `parity_tests.common.tolerances` a *slip* of a fixed size (a
literal here, not derived from the constants) is added to one tensor of one case
of the matrix, as a fault would add it, and judged by the real harness.  The test
asserts that the slip fails today, and that with that one constant loosened
tenfold (monkeypatched) the same slip passes: so the slip sits inside the tenfold
window, and loosening the constant tenfold in tolerances.py makes the first
assertion -- and the suite -- fail.  `test_every_constant_is_guarded` keeps the
list complete.
"""

import numpy as np
import pytest

from parity_tests.common import finite_diff
from parity_tests.common import tolerances as tol
from parity_tests.matrix import harness

from loosen import loosen
from needs import needs_dtype

# (case: module, config, dtype; tensor; check; relative slip; constants it guards)
# The slips: float64 rows are held to 1e-10; the float32 "input" row below has a
# 4-draw baseline of 8.4e-7 (bound 5.3e-6); the one-token output of the simplified
# attention is exact (weight 1, output = x), so its bound is the floor alone:
# 32 u = 1.9e-6 in float32, 8 u = 3.1e-2 in bfloat16 and 3.9e-3 in float16.
SCENARIOS = [
    ("SelfAttention_v2", "d_in 5 > d_out 3, bias", "float64", "output", "numpy vs torch",
     3e-10, ["FLOAT64_BOUND"]),
    ("SelfAttention_v2", "d_in 5 > d_out 3, bias", "float64", "W_key.bias", "numpy vs torch",
     3e-11, ["SCALE_FLOOR"]),                     # zero in theory: judged on the floor
    ("SimplifiedSelfAttention", "d_in 2 < d_out 4", "float32", "input", "torch vs golden",
     1.5e-5, ["LOW_PRECISION_FACTOR"]),
    ("SimplifiedSelfAttention", "one token", "float32", "output", "torch vs golden",
     6e-6, ["FLOOR_ULPS[float32]", "UNIT_ROUNDOFF[float32]"]),
    ("SimplifiedSelfAttention", "one token", "bfloat16", "output", "torch vs golden",
     0.1, ["FLOOR_ULPS[bfloat16]", "UNIT_ROUNDOFF[bfloat16]"]),
    ("SimplifiedSelfAttention", "one token", "float16", "output", "torch vs golden",
     0.0125, ["FLOOR_ULPS[float16]", "UNIT_ROUNDOFF[float16]"]),
]
# Constants that are not a size to loosen, and what guards them instead.
NOT_SIZES = {
    "BUFFER_BOUND": "exact comparison: any loosening of 0 fails test_buffer_bound_is_exact",
    "BASELINE_DRAWS": "a count of draws; kept in 2..8 by test_baseline_draws_stay_few",
    "UNIT_ROUNDOFF[float64]": "float64 rows use FLOAT64_BOUND, not a roundoff",
}
# The bounds of `attention-parity check`, guarded the same way in its own room.
GUARDED_BY_KERNELS = ({"CHECK_FACTOR"} | {f"CHECK_FLOOR_ULPS[{k}]" for k in tol.CHECK_FLOOR_ULPS}
                      | {f"CHECK_ZERO_FLOOR[{k}]" for k in tol.CHECK_ZERO_FLOOR} | {"LOGIT_SCALE"})
# The judge's own limit, guarded in tests/kernels/test_check_judge_defects.py (a shared rule planted
# wrong is its defect in each dtype; loosened, it passes).
GUARDED_BY_KERNELS |= {"JUDGE_LIMIT_ULPS", "JUDGE_LIMIT_CAP"}
# The production variants' bound, guarded in tests/matrix/test_variant_rows.py.
GUARDED_BY_VARIANTS = {"VARIANTS_FLOAT64_BOUND"}


def _case(module, config, dtype):
    spec = next(s for s in harness.MODULES if s.name == module)
    config = next(c for c in spec.configs if c.label == config)
    return harness.Case(spec, config, "eval", dtype, "cpu")


def _judged(monkeypatch, case, tensor, check, rel):
    """The row of ``tensor`` / ``check`` once PyTorch's ``tensor`` is off by ``rel``
    (of its largest entry, or of the largest gradient for a zero-by-theory one)."""
    original = harness.run_torch

    def slipped(module, case_, x, grad_out, keep):
        results = original(module, case_, x, grad_out, keep)
        if x.dtype == harness.DTYPES[case_.dtype]:       # not the golden's float64 check
            t = results[tensor].copy()
            size = max(np.abs(v).max() for k, v in results.items()
                       if (k == "output") == (tensor == "output"))
            t[np.unravel_index(np.argmax(np.abs(t)), t.shape)] += rel * size
            results[tensor] = t
        return results

    monkeypatch.setattr(harness, "run_torch", slipped)
    rows = [r for r in harness.run_case(case) if r["tensor"] == tensor and r["check"] == check]
    monkeypatch.setattr(harness, "run_torch", original)
    assert len(rows) == 1
    return rows[0]


@pytest.mark.parametrize("module, config, dtype, tensor, check, rel, constants",
                         [pytest.param(*s, marks=needs_dtype(s[2])) for s in SCENARIOS],
                         ids=[" ".join(s[6]) for s in SCENARIOS])
def test_a_slip_fails_and_would_pass_with_a_constant_ten_times_looser(
        monkeypatch, module, config, dtype, tensor, check, rel, constants):
    case = _case(module, config, dtype)
    row = _judged(monkeypatch, case, tensor, check, rel)
    assert not row["passed"], (f"a {rel:g} slip in {tensor} ({dtype}) passes: is one of "
                               f"{constants} looser than it should be? {row}")
    for constant in constants:
        with monkeypatch.context() as m:
            loosen(m, constant)
            loose = _judged(m, case, tensor, check, rel)
        assert loose["passed"], f"{constant} x 10 still fails the slip: it does not guard it"


def test_finite_difference_bound_has_teeth(monkeypatch):
    """A gradient off by 3e-7 (relative) fails the finite-difference check at
    FINITE_DIFF_BOUND and would pass it at ten times the bound."""
    import numpy_ref
    m = numpy_ref.SelfAttention_v2(3, 2, qkv_bias=True, rng=0)
    rng = np.random.default_rng(0)
    x, dout = rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    m.forward(x)
    dx = m.backward(dout)
    fd = finite_diff.eval_numerical_gradient_array(lambda: m.forward(x), x, dout)
    assert finite_diff.rel_error(dx, fd) <= tol.FINITE_DIFF_BOUND / 100    # the check is sharp
    slipped = dx.copy()
    slipped.flat[np.argmax(np.abs(dx))] += 3e-7 * np.abs(dx).max()
    assert finite_diff.rel_error(slipped, fd) > tol.FINITE_DIFF_BOUND
    assert finite_diff.rel_error(slipped, fd) <= 10 * tol.FINITE_DIFF_BOUND


def test_buffer_bound_is_exact():
    """Masks hold 0/1: one wrong entry is an error of 1, so the bound must stay 0."""
    assert tol.BUFFER_BOUND == 0.0
    mask = np.triu(np.ones((4, 4)), k=1)
    wrong = mask.copy()
    wrong[0, 1] = 0
    assert harness.relative_error(wrong, mask)[0] > tol.BUFFER_BOUND


def test_baseline_draws_stay_few():
    assert 2 <= tol.BASELINE_DRAWS <= 8


def test_every_constant_is_guarded():
    guarded = ({c for s in SCENARIOS for c in s[6]} | set(NOT_SIZES) | {"FINITE_DIFF_BOUND"}
               | GUARDED_BY_KERNELS | GUARDED_BY_VARIANTS)
    constants = set()
    for name in dir(tol):
        value = getattr(tol, name)
        if not name.isupper():
            continue
        if isinstance(value, dict):
            constants |= {f"{name}[{k}]" for k in value}
        elif isinstance(value, (int, float)):
            constants.add(name)
    assert constants <= guarded, f"tolerance constants with no guard: {sorted(constants - guarded)}"
