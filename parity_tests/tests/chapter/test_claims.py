"""``attention-parity claims``: one full run, exact float32 thresholds, and planted
wrong chapter values that must flip a verdict to FAIL."""

import numpy as np
import pytest

from parity_tests.chapter import claims
from parity_tests.chapter import claims_stats as stats
from parity_tests.common.verdicts import FAIL, IMPRECISE, PASS
from verb_run import needs_matplotlib, run_verb


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return run_verb(claims.main, tmp_path_factory.mktemp("claims_plots"))


def verdict_of(out, claim_start):
    line = next(l for l in out.splitlines() if l.startswith(claim_start))
    return line.split()[-1]


def test_every_claim_holds_or_is_flagged_imprecise(full_run):
    status, out, _ = full_run
    assert status == 0
    assert "0 FAIL" in out
    assert "3 imprecise" in out
    assert verdict_of(out, "'Kaiming (He, 2015)'") == IMPRECISE
    assert verdict_of(out, "signal Var after nn.Linear") == IMPRECISE
    assert verdict_of(out, "w_i(1 - w_i) > 0 'never vanishes'") == IMPRECISE
    assert verdict_of(out, "torch.exp(torch.tensor(-104.0))") == PASS


@needs_matplotlib
def test_claims_plot_is_written(full_run):
    _, _, plot_dir = full_run
    png = plot_dir / "scaled_vs_unscaled.png"
    assert png.stat().st_size > 1000


def test_exact_float32_exp_thresholds():
    over = stats.bisect_float32(lambda v: np.isfinite(stats.np_exp32(v)), 80, 100)
    under = stats.bisect_float32(lambda v: stats.np_exp32(v) > 0, -90, -110)
    assert np.float32(over) == np.float32(88.72283)
    assert np.isinf(stats.np_exp32(np.nextafter(np.float32(over), np.float32(100))))
    assert np.float32(under) == np.float32(-103.97208)
    assert stats.np_exp32(np.nextafter(np.float32(under), np.float32(-110))) == 0
    # the mathematical thresholds: ln(FLT_MAX) and ln(2^-150) (half the least subnormal)
    assert abs(over - np.log(np.finfo(np.float32).max)) < 1e-4
    assert abs(under - (-150 * np.log(2))) < 1e-4


def test_bisection_finds_a_known_boundary():
    assert stats.bisect_float32(lambda v: v <= 1.5, 0, 10) == 1.5
    assert stats.bisect_float32(lambda v: v >= -2.0, 0, -10) == -2.0


@pytest.mark.parametrize("key, wrong, claim_start", [
    ("rand_var", 1 / 6, "torch.rand: Var"),
    ("linear_var_times_d_in", 1.0, "nn.Linear(3, .) weights"),
])
def test_a_wrong_init_variance_fails(key, wrong, claim_start):
    c = dict(claims.CHAPTER, **{key: wrong})
    rows = stats.init_rows(c, np.random.default_rng(0), claims.Z, n=30_000)
    row = next(r for r in rows if r[0].startswith(claim_start))
    assert row[3] == FAIL


def test_a_wrong_exp_threshold_fails():
    rows = stats.exp_rows(dict(claims.CHAPTER, exp_overflow_near=90.0))
    assert rows[0][3] == FAIL and rows[1][3] == PASS


def test_a_wrong_variance_law_fails():
    """Var(q.k) = 2 d_k lies outside every 99% interval."""
    c = dict(claims.CHAPTER, var_qk_per_dim=2.0)
    rows = stats.variance_rows(c, np.random.default_rng(0), (16, 256), 2000, claims.Z)
    assert [r[3] for r in rows] == [FAIL, FAIL]


def test_he_variance_would_pass_if_it_were_true():
    """The 'imprecise' verdict is measured, not hard-wired: claim 1/3 and it passes."""
    c = dict(claims.CHAPTER, he_var_times_d_in=1 / 3)
    rows = stats.init_rows(c, np.random.default_rng(0), claims.Z, n=30_000)
    assert next(r for r in rows if r[0].startswith("'Kaiming"))[3] == PASS


def test_monte_carlo_is_deterministic_for_a_seed():
    def once():
        return stats.variance_rows(claims.CHAPTER, np.random.default_rng(5), (4,), 500, claims.Z)
    assert once() == once()
