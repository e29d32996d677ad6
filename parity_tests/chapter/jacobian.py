"""``attention-parity jacobian [--scores 0.95,1.50,...] [--plot DIR]``

The chapter derives, with the quotient rule on ``w_i = exp(x_i) / Z``::

    dw_i/dx_j = w_i (delta_ij - w_j)          J = diag(w) - w w^T

This verb computes that J for the given scores (default: the chapter's
``attn_scores_2``), checks it against two independent oracles (PyTorch's
autograd and centred finite differences) and measures its properties: rows and
columns sum to 0, symmetric, positive semi-definite, eigenvalues in [0, 1/2],
rank n - 1 (its null space is the all-ones vector: adding a constant to every
score changes nothing).

Then the same for the sum normalisation ``w_i = x_i / S`` and the chapter's two
objections to it: its Jacobian ``(delta_ij S - x_i) / S^2`` scales with 1/S, and
it breaks for scores that are not positive.
"""

import argparse

import numpy as np
import torch

from numpy_ref.softmax import (softmax, softmax_jacobian, sum_normalize,
                               sum_normalize_jacobian)
from parity_tests.common import chapter_values as cv
from parity_tests.common import plots
from parity_tests.common.finite_diff import fd_jacobian
from parity_tests.common.help_text import Parser, plain
from parity_tests.common.verdicts import (fmt, loose, parse_verb_args, print_section, sci,
                                   summary, exit_status, verdict)

ROUNDING = 1e-12        # float64: sums/symmetry of n ~ 10 terms of size <= 1
FD_STEP = 1e-6          # centred differences: error ~ h^2 + eps/h ~ 1e-10
FD_TOL = 1e-8           # relative to max(1, max |J|)
SATURATED = 1e-10       # a weight below this is beyond float64's reach next to 1
SCALES = (0.5, 1.0, 2.0, 10.0, 100.0)
SHIFTS = (1.0, 10.0, 100.0)
# --scores limits.  The work grows as n^3 (n autograd passes and n finite-difference
# columns, each O(n^2) with the explicit J): 1000 scores take ~3 s and 80 MB, 2000
# ~16 s, 10,000 scores would take half an hour and gigabytes.
MAX_SCORES = 1000
# Softmax only sees differences between scores, and float64 resolves a difference
# between scores of size |x| only to |x| * 2.2e-16.  The checks move scores by the
# finite-difference step (1e-6) and shift them by 1: at |x| = 1e6 float64 still
# places them to 1e-10 (1e-4 of the step); beyond, the rows would compare rounding
# noise.  (Any two scores 745 apart already give a weight of exactly 0 in float64.)
MAX_ABS_SCORE = 1e6


def parse_scores(text):
    """``"0.95,1.50,..."`` -> float64 array; argparse reports the message."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        x = np.array([float(p) for p in parts], dtype=np.float64)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--scores must be comma-separated numbers, e.g. 0.95,1.50,1.48; got {text!r}")
    if x.size < 2:
        raise argparse.ArgumentTypeError(
            f"--scores needs at least 2 numbers (a softmax over one score is always 1), "
            f"got {x.size}")
    if x.size > MAX_SCORES:
        raise argparse.ArgumentTypeError(
            f"--scores takes at most {MAX_SCORES} numbers (the work grows as n^3: "
            f"{MAX_SCORES} take a few seconds), got {x.size}")
    if not np.all(np.isfinite(x)):
        raise argparse.ArgumentTypeError(f"--scores must be finite numbers, got {text!r}")
    if np.max(np.abs(x)) > MAX_ABS_SCORE:
        raise argparse.ArgumentTypeError(
            f"--scores must lie within +-{MAX_ABS_SCORE:g} (got {np.max(np.abs(x)):g}): softmax "
            f"sees only differences between scores, and float64 places scores that large "
            f"too coarsely for the finite-difference step ({FD_STEP:g}) and the shifts the "
            f"checks apply; subtract a constant (softmax is unchanged by it) or rescale")
    return x


def parse_args(argv):
    p = Parser(page="docs/chapter.md", prog="attention-parity jacobian", description=plain(__doc__),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scores", type=parse_scores, default=None,
                   help="comma-separated attention scores; write --scores=-1,2 when the first "
                        "is negative (default: the chapter's "
                        "attn_scores_2 = " + ",".join(map(str, cv.SIMPLE_ATTN_SCORES_2)) + ")")
    p.add_argument("--plot", metavar="DIR", default=None,
                   help="write PNG heatmaps of both Jacobians into DIR (needs matplotlib)")
    return p.parse_args(argv)


# --- oracles ---------------------------------------------------------------------

def autograd_jacobian(fn, x):
    """PyTorch's Jacobian of ``fn`` at ``x`` (float64), as a NumPy array."""
    xt = torch.tensor(x, dtype=torch.float64)
    return torch.autograd.functional.jacobian(fn, xt).numpy()


def max_abs(a):
    return float(np.max(np.abs(a)))


# --- sections ----------------------------------------------------------------------

def oracle_rows(name, J, J_torch, J_fd, h=FD_STEP):
    """Both oracles, to tolerances relative to the size of J (at least absolute)."""
    scale = max(1.0, max_abs(J))
    return [
        (f"{name}: explicit J == torch.autograd.functional.jacobian",
         f"max |diff| {sci(max_abs(J - J_torch))}", f"<= {sci(ROUNDING * scale)}",
         verdict(max_abs(J - J_torch) <= ROUNDING * scale)),
        (f"{name}: explicit J == finite differences (h={h:.1g})",
         f"max |diff| {sci(max_abs(J - J_fd))}", f"<= {sci(FD_TOL * scale)}",
         verdict(max_abs(J - J_fd) <= FD_TOL * scale)),
    ]


def softmax_property_rows(J, saturated):
    """The exact-arithmetic properties; ``saturated`` (some weight < SATURATED)
    excuses the rank, which float64 cannot resolve then, as 'imprecise'."""
    n = J.shape[0]
    eig = np.linalg.eigvalsh(J)                       # J symmetric: real, ascending
    # J's entries are products of weights <= 1, computed to ~eps absolutely: an
    # eigenvalue below ROUNDING is rounding, whatever J's largest (NumPy's default
    # tolerance is relative to it, and counts rounding as rank when w saturates).
    rank = int(np.linalg.matrix_rank(J, tol=ROUNDING))
    return [
        ("rows sum to 0 (J 1 = 0: a shift of all scores changes nothing)",
         f"max |row sum| {sci(max_abs(J.sum(axis=1)))}", "0", verdict(max_abs(J.sum(axis=1)) <= ROUNDING)),
        ("columns sum to 0 (the weights always sum to 1)",
         f"max |col sum| {sci(max_abs(J.sum(axis=0)))}", "0", verdict(max_abs(J.sum(axis=0)) <= ROUNDING)),
        ("symmetric: J = diag(w) - w w^T",
         f"max |J - J^T| {sci(max_abs(J - J.T))}", "0", verdict(max_abs(J - J.T) <= ROUNDING)),
        ("positive semi-definite", f"min eigenvalue {sci(eig[0])}", ">= 0",
         verdict(eig[0] >= -ROUNDING)),
        ("eigenvalues within [0, 1/2]", f"[{sci(eig[0])}, {fmt(eig[-1])}]", "[0, 0.5]",
         verdict(eig[0] >= -ROUNDING and eig[-1] <= 0.5 + ROUNDING)),
        ("rank n - 1 (null space: the all-ones vector)", f"{rank} (n = {n})", f"{n - 1}",
         loose(rank == n - 1, precise_holds=saturated)),
    ]


def softmax_section(x, default):
    w = softmax(x)
    J = softmax_jacobian(w)
    J_torch = autograd_jacobian(lambda t: torch.softmax(t, dim=0), x)
    J_fd = fd_jacobian(softmax, x, FD_STEP)
    w_row = ("softmax weights w", fmt(w),
             fmt(cv.SIMPLE_ATTN_WEIGHTS_2) if default else "-",
             verdict(np.allclose(w, cv.SIMPLE_ATTN_WEIGHTS_2, rtol=0, atol=cv.PRINTED_ATOL))
             if default else verdict(abs(w.sum() - 1) <= ROUNDING))
    diag = np.diag(J)
    saturated = bool(w.min() < SATURATED)
    rows = [w_row,
            ("diagonal w_i (1 - w_i) > 0 ('strictly non-zero')", fmt(diag), "> 0",
             loose(np.all(diag > 0), precise_holds=saturated))]
    rows += oracle_rows("softmax", J, J_torch, J_fd)
    rows += softmax_property_rows(J, saturated)
    return rows, J, saturated


def scale_rows(x):
    """Objection 1: the sum normalisation's Jacobian scales with 1/S.  Softmax's
    depends on w alone, so it is exactly invariant when every score is shifted
    (S grows, w does not change); it is *not* invariant when the scores are
    multiplied (w sharpens: the scaled dot-product section's point)."""
    rows = []
    base = np.linalg.norm(sum_normalize_jacobian(x))
    for c in SCALES:
        n_sum = np.linalg.norm(sum_normalize_jacobian(c * x))
        n_soft = np.linalg.norm(softmax_jacobian(softmax(c * x)))
        rows.append((f"x * {c:g}: ||J_sum||_F = ||J_sum(x)||_F / {c:g} ; ||J_softmax||_F",
                     f"{fmt(n_sum)} ; {fmt(n_soft)}", f"{fmt(base / c)} (1/S)",
                     verdict(abs(n_sum * c - base) <= ROUNDING * base * 10)))
    J0 = softmax_jacobian(softmax(x))
    for t in SHIFTS:
        d_soft = max_abs(softmax_jacobian(softmax(x + t)) - J0)
        n_sum = np.linalg.norm(sum_normalize_jacobian(x + t))
        # The chapter: softmax's gradient is "independent of the raw scale".  Exactly
        # true for shifts; under multiplication (rows above) the norm moves.
        rows.append((f"x + {t:g}: softmax J unchanged ; ||J_sum||_F shrinks",
                     f"max |dJ_softmax| {sci(d_soft)} ; {fmt(n_sum)}",
                     f"0 ; < {fmt(base)}",
                     verdict(d_soft <= ROUNDING and n_sum < base)))
    moved = [np.linalg.norm(softmax_jacobian(softmax(c * x))) for c in SCALES]
    spread = max(moved) / min(moved) if min(moved) > 0 else np.inf
    rows.append(("softmax J 'independent of the raw scale' (x * c, c in "
                 + ",".join(f"{c:g}" for c in SCALES) + ")",
                 f"||J||_F varies x{spread:.3g}", "independent",
                 loose(spread <= 1 + ROUNDING, precise_holds=True)))
    return rows


def centred_scores(x):
    """The given scores minus their mean (sum 0); equal scores have no spread to
    play with, so fall back on the chapter's."""
    centred = x - x.mean()
    if max_abs(centred) < 1e-9:
        centred = np.asarray(cv.SIMPLE_ATTN_SCORES_2) - np.mean(cv.SIMPLE_ATTN_SCORES_2)
    return centred


def sign_rows(x):
    """Objection 2: sum normalisation needs positive scores.  The scores are
    shifted so that S = sum is near 0, then negative (S = -spread, spread =
    max |x_i - mean|): then w_i = x_i / S leaves [0, 1], the ranking flips, and
    the Jacobian (delta_ij S - x_i) / S^2 blows up as 1/S^2."""
    c = centred_scores(x)
    n, spread = c.size, max_abs(c)
    near0, negative = c + 1e-3 * spread / n, c - spread / n
    rows = []
    for label, y in (("S ~ 0 (1e-3 spread)", near0), ("S < 0 (-spread)", negative)):
        w, ws = sum_normalize(y), softmax(y)
        rows.append((f"{label}: sum-normalised weights leave [0, 1]",
                     f"[{fmt(w.min())}, {fmt(w.max())}]", "outside [0, 1]",
                     verdict(w.min() < 0 or w.max() > 1)))
        in_closed = ws.min() >= 0 and ws.max() <= 1 and abs(ws.sum() - 1) <= ROUNDING
        rows.append((f"{label}: softmax weights stay in (0, 1), sum 1",
                     f"[{fmt(ws.min())}, {fmt(ws.max())}], sum {fmt(ws.sum())}", "(0, 1)",
                     loose(in_closed and ws.min() > 0 and ws.max() < 1, precise_holds=in_closed)))
    rows.append(("S < 0: the highest score gets the lowest sum-normalised weight",
                 f"argmax x = {int(np.argmax(negative))}, argmin w = "
                 f"{int(np.argmin(sum_normalize(negative)))}", "ranking reversed",
                 verdict(np.argmax(negative) == np.argmin(sum_normalize(negative)))))
    n1 = np.linalg.norm(sum_normalize_jacobian(c + 1e-2 * spread / n))
    n2 = np.linalg.norm(sum_normalize_jacobian(near0))
    rows.append(("S -> 0: ||J_sum||_F grows as 1/S^2 (S = 1e-2 -> 1e-3 spread)",
                 f"{fmt(n1)} -> {fmt(n2)} (x{n2 / n1:.0f})", "x100",
                 verdict(n2 / n1 >= 50)))
    return rows


def sum_is_formed(x):
    """True when S = sum(x) is positive and resolved: float64 forms S to within
    n * eps * sum|x|, so x / S (its Jacobian ~ 1/S) is known to ROUNDING only
    while that is below ROUNDING * S.  Mixed signs that cancel (S ~ 1e-14 from
    scores of size 3, say) leave S as rounding noise: x / S is then meaningless."""
    total = float(np.sum(x))
    return total > 0 and x.size * np.finfo(np.float64).eps * float(np.sum(np.abs(x))) <= ROUNDING * total


def sum_section(x, default):
    rows = []
    if sum_is_formed(x):
        w = sum_normalize(x)
        J = sum_normalize_jacobian(x)
        rows.append(("sum-normalised weights x / S", fmt(w),
                     fmt(cv.SIMPLE_SUM_NORMALIZED_2) if default else "-",
                     verdict(np.allclose(w, cv.SIMPLE_SUM_NORMALIZED_2, rtol=0, atol=cv.PRINTED_ATOL))
                     if default else verdict(abs(w.sum() - 1) <= ROUNDING)))
        J_torch = autograd_jacobian(lambda t: t / t.sum(), x)
        h = FD_STEP * min(1.0, float(np.sum(x)))      # a step small next to S
        rows += oracle_rows("sum", J, J_torch, fd_jacobian(sum_normalize, x, h), h)
        rows += scale_rows(x)
    rows += sign_rows(x)
    return rows


def print_matrix(name, J):
    print(f"{name} =")
    print(np.array2string(J, precision=4, floatmode="fixed", suppress_small=True))
    print()


def _why_no_sum(x):
    total = float(np.sum(x))
    if total <= 0:
        return f"the scores sum to S = {fmt(total)} <= 0, where the sum normalisation is meaningless"
    return (f"the scores sum to S = {total:.1e}, lost in the rounding of sum|x| = "
            f"{float(np.sum(np.abs(x))):.1e}: the sum normalisation x / S is rounding noise")


def write_plots(plot_dir, x, J_soft):
    path = f"{plot_dir}/softmax_jacobian.png"
    labels = plots.TOKENS if x.size == len(plots.TOKENS) else None
    mats, titles = [J_soft], ["softmax: w_i(delta_ij - w_j)"]
    if sum_is_formed(x):
        mats.append(sum_normalize_jacobian(x))
        titles.append("sum: (delta_ij S - x_i)/S^2")
    lim = max(max_abs(m) for m in mats)
    plots.heatmaps(path, mats, titles, suptitle="Jacobians dw_i/dx_j", labels=labels,
                   vmin=-lim, vmax=lim, cmap="RdBu_r", axis_titles=("score x_j", "weight w_i"))
    plots.announce([path])
    if len(mats) == 1:
        print(f"note: {path} shows the softmax Jacobian only: {_why_no_sum(x)}")


def main(argv=None):
    args, status = parse_verb_args(parse_args, argv)
    if status is not None:
        return status
    default = args.scores is None
    x = np.asarray(cv.SIMPLE_ATTN_SCORES_2 if default else args.scores, dtype=np.float64)
    print(f"scores x = {fmt(x)}" + ("  (the chapter's attn_scores_2)" if default else ""))
    print()
    soft_rows, J, saturated = softmax_section(x, default)
    print_matrix("softmax Jacobian J = diag(w) - w w^T", J)
    print_section("softmax: dw_i/dx_j = w_i (delta_ij - w_j)", soft_rows)
    sum_rows = sum_section(x, default)
    if not sum_is_formed(x):
        print(f"({_why_no_sum(x)}; only the non-positive checks below apply)\n")
    print_section("sum normalisation: dw_i/dx_j = (delta_ij S - x_i) / S^2", sum_rows)
    rows = soft_rows + sum_rows
    print("note: softmax's Jacobian depends on w alone, so it is exactly invariant to a shift "
          "of all scores (S grows, J does not move), but not to multiplying them: larger "
          "scores sharpen w and shrink J, which is why the chapter divides by sqrt(d_k).")
    if saturated:
        print(f"note: these scores saturate the softmax (min w = {softmax(x).min():.1e}): in "
              "floating point some w_i round to 0 or 1, so w_i(1 - w_i) is exactly 0 and J "
              "loses rank; the chapter's 'strictly non-zero' gradient holds only in exact "
              "arithmetic (the vanishing gradient the 1/sqrt(d_k) scaling prevents).")
    print(summary(rows))
    if args.plot:
        write_plots(args.plot, x, J)
    return exit_status(rows)
