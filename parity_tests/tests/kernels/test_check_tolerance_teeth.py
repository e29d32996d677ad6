"""Every bound constant of ``attention-parity check`` is tight enough to matter.

A kernel that is SDPA's own plus a *slip* of a fixed size (a literal here, not
derived from the constants) on one output entry is judged by the real check.
The slip must fail today, and pass with that one constant loosened tenfold: so
loosening it tenfold in tolerances.py makes this test, and the suite, fail.
One token makes the baseline exact (the output is v), so the bound is the floor
alone; 64 tokens give a baseline for the factor to multiply.
"""

import pytest
import torch
import torch.nn.functional as F

import parity_tests
from parity_tests.common import capabilities
from parity_tests.common import tolerances as tol
from parity_tests.kernels import runner, targets
from parity_tests.kernels.cases import Case

from parity_tests.kernels.planted.correct import CORRECT
from loosen import loosen
from needs import needs_dtype

# (dtype, tokens, relative slip of the largest |out|, the constant it guards)
SCENARIOS = [
    ("float32", "64", 5e-6, "CHECK_FACTOR"),           # baseline 4.0e-7, bound 2.1e-6
    ("float64", "1", 3e-15, "CHECK_FLOOR_ULPS[float64]"),    # bound 8 u = 8.9e-16
    ("float32", "1", 2e-6, "CHECK_FLOOR_ULPS[float32]"),     # bound 8 u = 4.8e-7
    ("bfloat16", "1", 0.03, "CHECK_FLOOR_ULPS[bfloat16]"),   # bound 2 u = 7.8e-3
    ("float16", "1", 4e-3, "CHECK_FLOOR_ULPS[float16]"),     # bound 2 u = 9.8e-4
]


def _slipped(rel):
    def kernel(q, k, v, *, causal, scale):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        slip = torch.zeros_like(out)
        slip.view(-1)[0] = rel * out.detach().abs().max()      # a constant: gradients unchanged
        return out + slip
    return kernel


def _out_row(dtype, tokens, rel):
    report = parity_tests.check(_slipped(rel), dtypes=[dtype], tokens=[tokens], head_dims=[32],
                                heads=[1], batch=[1], causal="no")
    (row,) = [r for r in report.rows if r.tensor == "out" and r.dims["heads"] == 1 and not r.dims["features"]]
    return row


@pytest.mark.parametrize("dtype, tokens, rel, constant", [pytest.param(*s, marks=needs_dtype(s[0])) for s in SCENARIOS],
                         ids=[s[3] for s in SCENARIOS])
def test_a_slip_fails_and_would_pass_with_the_constant_ten_times_looser(
        monkeypatch, dtype, tokens, rel, constant):
    row = _out_row(dtype, tokens, rel)
    assert row.failed, f"a {rel:g} slip passes in {dtype}: is {constant} too loose? {row}"
    loosen(monkeypatch, constant)
    assert _out_row(dtype, tokens, rel).passed, f"{constant} x 10 still fails: it guards nothing"


def test_every_check_constant_is_guarded():
    constants = {"CHECK_FACTOR"} | {f"CHECK_FLOOR_ULPS[{k}]" for k in tol.CHECK_FLOOR_ULPS}
    assert constants == {s[3] for s in SCENARIOS}


class _DqSlip(torch.autograd.Function):
    """q unchanged; its gradient plus ``rel`` x max|dO| on one entry (dO seen by _SeeDout)."""

    @staticmethod
    def forward(ctx, q, rel, seen):
        ctx.rel, ctx.seen = rel, seen
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        slip = torch.zeros(g.numel(), dtype=g.dtype)
        slip[0] = ctx.rel * ctx.seen[0]
        return g + slip.view(g.shape), None, None


class _SeeDout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, seen):
        ctx.seen = seen
        return out.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.seen[0] = float(g.abs().max())
        return g, None


def _zero_wide_dq_row(rel):
    """dq of a 0-wide window (one key per row: dq = 0 by theory, measured against
    SCALE_FLOOR x max|dv| = 0.1 max|dO|), float32, with a slip of rel x max|dO|."""
    def kernel(q, k, v, *, causal, scale, window=None):
        seen = [0.0]
        n = q.shape[-2]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = torch.ones(n, n, dtype=torch.bool)
        if window is not None:
            mask = (j >= i - window[0] if window[0] >= 0 else mask) & (j <= i + window[1] if window[1] >= 0 else mask)
        out = F.scaled_dot_product_attention(_DqSlip.apply(q, rel, seen), k, v, attn_mask=mask, scale=scale)
        return _SeeDout.apply(out, seen)
    rows = runner.run_case(targets.resolve(kernel), Case(1, 2, 113, 113, 64, False, (("window", (0, 0)),)),
                           "float32", "cpu", wanted=("window",))
    (row,) = [r for r in rows if r.tensor == "dq"]
    return row


def test_the_zero_by_theory_floor_is_tight(monkeypatch):
    # the floor 128 u = 7.6e-6 of 0.1 max|dO|: a slip of 3e-6 max|dO| is 3e-5 of it
    row = _zero_wide_dq_row(3e-6)
    assert row.failed and row.error < 1e-3, row              # failed on its error, not a crash
    loosen(monkeypatch, "CHECK_ZERO_FLOOR[float32]")
    assert _zero_wide_dq_row(3e-6).passed


def _outliers_out_row(rel):
    """float64, the heavy-tailed case (scores ~10^3): SDPA's math backend with a slip."""
    def kernel(q, k, v, *, causal, scale):
        with capabilities.sdpa_backend("MATH"):
            return _slipped(rel)(q, k, v, causal=causal, scale=scale)
    report = parity_tests.check(kernel, dtypes=["float64"], tokens=["1"], head_dims=[32], heads=[1], batch=[1],
                                causal="no")
    (row,) = [r for r in report.rows if r.tensor == "out" and "outliers" in r.case]
    return row


def _lse_weighted_rows():
    """float32, a correct kernel forming P = exp(S − lse): its rows on the heavy-tailed cases."""
    report = parity_tests.check(CORRECT["lse_weights"], dtypes=["float32"], tokens=["1"], seed=0)
    rows = [r for r in report.rows if "outliers" in r.case]
    assert rows
    return rows


def test_the_log_sum_exp_formulation_of_the_baseline_is_needed(monkeypatch):
    # scores ~10^3: weights formed through the lse carry u |lse| on a whole row; past
    # LOGIT_SCALE the baseline is computed that way too, so a correct kernel passes
    assert all(r.passed for r in _lse_weighted_rows())
    monkeypatch.setattr(tol, "BASELINE_FORMULATIONS", ("softmax",))     # the logit floor alone
    assert any(r.failed for r in _lse_weighted_rows()), "the lse formulation guards nothing: drop it"


def test_the_logit_scale_of_the_floor_is_needed_and_tight(monkeypatch):
    # scores ~10^3: a correct float64 kernel sits up to ~10 x its baseline (rounding of its
    # largest score); the floor grows with the logits past LOGIT_SCALE so that it passes ...
    scale = tol.LOGIT_SCALE
    assert _outliers_out_row(0.0).passed
    monkeypatch.setattr(tol, "LOGIT_SCALE", float("inf"))
    assert _outliers_out_row(0.0).failed, "the logit scale guards nothing: drop it"
    # ... and no more: a slip of 2e-13 fails, and would pass with the scale ten times looser
    monkeypatch.setattr(tol, "LOGIT_SCALE", scale)
    assert _outliers_out_row(2e-13).failed
    monkeypatch.setattr(tol, "LOGIT_SCALE", scale / 10)
    assert _outliers_out_row(2e-13).passed
