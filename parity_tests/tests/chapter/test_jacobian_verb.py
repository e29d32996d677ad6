"""``attention-parity jacobian``: exit status, verdicts, values, refused --scores."""

import numpy as np
import pytest

from parity_tests.chapter import jacobian
from parity_tests.common.verdicts import FAIL, IMPRECISE, PASS


def run(capsys, *argv):
    status = jacobian.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def rows_of(out):
    """Table rows (claim, ..., verdict) from printed output, verdict last word."""
    return [line for line in out.splitlines()
            if line.rstrip().endswith((PASS, FAIL, IMPRECISE)) and " checks: " not in line]


def test_default_scores_pass_and_print_the_chapter_weights(capsys):
    status, out, _ = run(capsys)
    assert status == 0
    assert "[0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]" in out  # softmax weights
    assert "[0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656]" in out  # sum-normalised
    assert not [r for r in rows_of(out) if r.endswith(FAIL)]
    # the chapter's "independent of the raw scale" is only true for shifts
    assert any("independent of the raw scale" in r and r.endswith(IMPRECISE) for r in rows_of(out))
    assert "28 checks: 27 pass, 1 imprecise" in out


def test_default_eigenvalues_and_rank(capsys):
    _, out, _ = run(capsys)
    rank_row = next(r for r in rows_of(out) if r.startswith("rank n - 1"))
    assert "5 (n = 6)" in rank_row
    eig_row = next(r for r in rows_of(out) if r.startswith("eigenvalues within"))
    assert "0.2356]" in eig_row


def test_custom_scores(capsys):
    status, out, _ = run(capsys, "--scores", "0.5, 2,3.25")
    assert status == 0
    assert "scores x = [0.5000, 2.0000, 3.2500]" in out
    assert "2 (n = 3)" in out


def test_non_positive_sum_skips_the_sum_normalisation(capsys):
    status, out, _ = run(capsys, "--scores=-1,-2,0.5")
    assert status == 0
    assert "meaningless" in out
    assert "S < 0: the highest score gets the lowest sum-normalised weight" in out


@pytest.mark.parametrize("bad, message", [
    ("1,a", "comma-separated numbers"),
    ("1", "at least 2 numbers"),
    ("", "at least 2 numbers"),
    ("1,nan", "finite"),
])
def test_bad_scores_are_refused(capsys, bad, message):
    status, out, err = run(capsys, f"--scores={bad}")
    assert status == 2
    assert message in err
    assert out == ""


def test_a_wrong_jacobian_fails_the_verb(capsys, monkeypatch):
    """Plant diag(w) - 2 w w^T: the oracle rows and the row sums must say FAIL."""
    def broken(w):
        return np.diag(w) - 2 * np.outer(w, w)
    monkeypatch.setattr(jacobian, "softmax_jacobian", broken)
    status, out, _ = run(capsys)
    assert status == 1
    failed = [r for r in rows_of(out) if r.endswith(FAIL)]
    assert any("autograd" in r for r in failed)
    assert any("rows sum to 0" in r for r in failed)


def test_reached_through_the_command_line_dispatch(capsys):
    from parity_tests import cli
    assert cli.main(["jacobian", "--scores", "1,2"]) == 0
    assert "scores x = [1.0000, 2.0000]" in capsys.readouterr().out


def test_help_exits_0(capsys):
    assert jacobian.main(["--help"]) == 0
    assert "w_i (delta_ij - w_j)" in capsys.readouterr().out


def test_saturated_scores_are_imprecise_not_failed(capsys):
    """A margin of 300 rounds the weights to exactly 0 and 1: the chapter's 'strictly
    non-zero' gradient and rank n - 1 hold only in exact arithmetic."""
    status, out, _ = run(capsys, "--scores=300,1,2")
    assert status == 0
    rows = rows_of(out)
    assert next(r for r in rows if r.startswith("diagonal w_i")).endswith(IMPRECISE)
    assert next(r for r in rows if r.startswith("rank n - 1")).endswith(IMPRECISE)
    assert "saturate the softmax" in out


def test_small_positive_sum_keeps_finite_differences_accurate(capsys):
    """S = 0.0045: the finite-difference step shrinks with S and the tolerance
    follows the size of J (~ 1/S), so the oracle still agrees."""
    status, out, _ = run(capsys, "--scores=0.001,0.002,0.0015")
    assert status == 0
    assert next(r for r in rows_of(out) if r.startswith("sum: explicit J == finite")).endswith(PASS)


@pytest.mark.parametrize("scores, message", [
    (",".join(["0.5"] * (jacobian.MAX_SCORES + 1)), f"at most {jacobian.MAX_SCORES} numbers"),
    ("1e308,0.5", "must lie within"),
    ("-2e6,0.5,1", "must lie within"),
])
def test_too_many_or_too_large_scores_are_refused_before_any_work(capsys, scores, message):
    status, out, err = run(capsys, f"--scores={scores}")
    assert status == 2 and out == ""
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("scores", [
    "2,3,10,1",                          # one weight near 1: the rank was misjudged as n
    "1e4,1e4,1e4,10001",                 # large scores: the finite-difference step was rounded
    "1e6,-5e5,3e5,9e5",                  # at the limit: saturated, imprecise, never FAIL
    ",".join(str(v) for v in np.linspace(-3, 3, 40)),  # sums to 7e-15: rounding, not S > 0
])
def test_scores_within_the_limits_never_fail(capsys, scores):
    status, out, _ = run(capsys, f"--scores={scores}")
    assert status == 0, "\n".join(r for r in rows_of(out) if r.endswith(FAIL))
