"""Name the mistake behind a failing row of ``check --merge``.

For each failing tensor of a case (out, lse, dout_parts, dlse_parts), in order:

1. *NaN or infinity* (or a finite lse where the union is empty): the rows where
   it sits are compared with
   - the rows where some partial is empty (lse −inf, out NaN or garbage): *an
     empty partial turned into NaN* (``0 · NaN``; in the backward, the branch
     ``torch.where`` did not take still gets ``0 · NaN``);
   - the rows where the merge without the running maximum, ``exp(lse)`` in
     lse's dtype, overflows or underflows to 0/0: *the merge forgets the
     running maximum*.
2. *lse in base 2*: the reference recomputed with ``exp2``/``log2`` (every lse,
   the inputs' and the merged one, read as base 2); its residual against the
   target is measured as the error is, and it matches when within the bound or
   leaves at most ``diagnosis.MATCH_SHARE`` of the error.
3. *Weights not normalised* (out only): the merges folded with
   ``out = α_a out_a + α_b out_b`` (``α = exp(lse − m)`` never divided by its
   sum), or each output row the reference's times a factor of its own, fitted
   per row (any other ``w_a + w_b ≠ 1``).
4. *lse off by the difference* (out, lse): the fold replayed with each merge's lse off by
   ±(lse_a − lse_b), what the sigmoid form ``lse_a − logsigmoid(lse_a − lse_b)`` gives with
   its argument negated; or off by it only where it is positive (``log1p(exp(−d))`` where
   ``log1p(exp(−|d|))`` is meant); its out right per pair, the later merges weighing that lse.
5. *A weight from the merged lse* (out): the fold replayed with a piece weighed by
   sigmoid(lse_x − lse), lse the merged one, where sigmoid(lse_x − lse_y) is meant (the
   update of lse written before that of out).
6. *A piece's output gradient weighed by the other's weight* (dout_parts, dlse_parts): each
   merge's backward replayed with dout_b = w_a dout (or dout_a = w_b dout, or both swapped),
   its lse gradients right given what it receives; or *the merged lse's gradient handed to each
   piece whole* (dlse_parts): dlse_x = w_x ⟨dO, out_x − out⟩ + dlse.
7. Otherwise "matches none of the merge mistakes", with the closest one when it
   comes closer than the reference.
"""

import itertools
import math

import numpy as np

from numpy_ref import merge as ref
from parity_tests.kernels.diagnosis.diagnose import Diagnosis, MATCH_SHARE

__all__ = ["diagnose_case", "bad_entries", "base2_prediction", "unnormalised_prediction", "lse_off_prediction",
           "merged_lse_weight_prediction", "dout_weight_prediction", "dlse_unweighted_prediction", "naive_bad_rows"]

LN2 = math.log(2.0)
# The merged lse off by the difference of the two, everywhere or on one side (`lse_off_prediction`):
# id -> (x, y) -> (what is off, why), x the piece whose lse the error follows
LSE_OFF = {
    "lse-off-by-difference": lambda x, y: (
        f"off by lse_{x} - lse_{y}", f"the sigmoid form's argument sign flipped (lse_{x} - logsigmoid(lse_{y} - "
        f"lse_{x}) is logaddexp(lse_a, lse_b) + (lse_{x} - lse_{y}))"),
    "lse-off-one-side": lambda x, y: (
        f"too large by lse_{x} - lse_{y} where lse_{x} > lse_{y}, right elsewhere,",
        f"max(lse_a, lse_b) + log1p(exp(-d)) with d = lse_{y} - lse_{x} where log1p(exp(-|d|)) is meant (the "
        "absolute value dropped)"),
}


def _rows(bad, tensor):
    """(B, H, T) bool: the query rows holding a True entry of ``bad``."""
    if tensor.endswith("_parts"):
        bad = bad.any(axis=0)
    return bad.any(axis=-1) if tensor.startswith(("out", "dout")) else bad


def bad_entries(got, gold):
    """Entries that are non-finite where the golden one is finite, or not −inf where it is."""
    neginf = np.isneginf(gold)
    return (~np.isfinite(got) & ~neginf) | (neginf & ~np.isneginf(got))


def base2_prediction(states, dout, dlse, order):
    """(out, lse, dout_parts, dlse_parts) of a merge that reads and writes lse in base 2."""
    scaled = [(o, l * LN2) for o, l in states]
    out, lse = ref.merge_many(scaled, order)
    grads = ref.merge_many_backward(dout, dlse / LN2, scaled, order)
    return {"out": out, "lse": lse / LN2, "dout_parts": np.stack([g[0] for g in grads]),
            "dlse_parts": np.stack([g[1] * LN2 for g in grads])}


# The output gradients' weights of a pair merge's backward other than (w_a, w_b): (a's, b's) -> words
DOUT_WEIGHTS = {("a", "a"): "dout_b = w_a dout where w_b dout is meant (b's output gradient weighed by a's weight: "
                            "a line copied)",
                ("b", "b"): "dout_a = w_b dout where w_a dout is meant (a's output gradient weighed by b's weight: "
                            "a line copied)",
                ("b", "a"): "dout_a = w_b dout and dout_b = w_a dout (the two weights swapped in the backward)"}


def _replayed_backward(states, dout, dlse, order, pair):
    """(dout_parts, dlse_parts) of a fold whose pair merge's backward is ``pair``(g_out, g_lse, w,
    right, out) -> (dout_a, dlse_a, dout_b, dlse_b), given the gradients its merge receives, the
    pieces' weights w {"a": w_a, "b": w_b} (0 for an empty piece), the right backward's four and
    the pair's merged out (a fold passes a wrong gradient on)."""
    work, tape = list(states), []
    for i, j in ref.merge_plan(len(states), order):
        tape.append((i, j, work[i], work[j]))
        work[i] = ref.merge_states(*work[i], *work[j])
    grads = [None] * len(states)
    grads[0] = (dout, dlse)
    for i, j, s_i, s_j in reversed(tape):
        g_out, g_lse = grads[i]
        right = ref.merge_states_backward(g_out, g_lse, *s_i, *s_j)
        w = dict(zip("ab", ref._weights(s_i[1], s_j[1])[:2]))
        da_out, da_lse, db_out, db_lse = pair(g_out, g_lse, w, right, ref.merge_states(*s_i, *s_j)[0])
        grads[i], grads[j] = (da_out, da_lse), (db_out, db_lse)
    return {"dout_parts": np.stack([g[0] for g in grads]), "dlse_parts": np.stack([g[1] for g in grads])}


def dout_weight_prediction(states, dout, dlse, order, weights):
    """(dout_parts, dlse_parts) of a merge whose backward weighs each piece's output gradient by
    ``weights`` (a's, b's: "a" or "b", a key of `DOUT_WEIGHTS`) where (w_a, w_b) is meant, each lse
    gradient right given the output gradient its merge receives."""
    return _replayed_backward(states, dout, dlse, order, lambda g_out, g_lse, w, right, out: (
        w[weights[0]][..., None] * g_out, right[1], w[weights[1]][..., None] * g_out, right[3]))


def dlse_unweighted_prediction(states, dout, dlse, order):
    """(dout_parts, dlse_parts) of a merge whose backward hands the merged lse's gradient to each
    piece whole, dlse_x = w_x <dO, out_x − out> + dlse where w_x (<dO, out_x − out> + dlse) is meant
    (∂lse/∂lse_x = w_x taken as 1): each piece's lse gradient too large by (1 − w_x) dlse."""
    return _replayed_backward(states, dout, dlse, order, lambda g_out, g_lse, w, right, out: (
        right[0], right[1] + (1 - w["a"]) * g_lse, right[2], right[3] + (1 - w["b"]) * g_lse))


def detached_prediction(states, dout, dlse, order):
    """dlse_parts of a merge whose weights exp(lse_x − lse) hold the merged lse constant (detached
    as the stabilising maximum may be): each partial lse's gradient w_x (<dO, out_x − out> + dlse)
    loses its −<dO, out> term, w_x <dO, out> more than the right one (0 for an empty piece)."""
    def pair(g_out, g_lse, w, right, out):
        held = np.einsum("...d,...d->...", g_out, out)                                  # <dO, out>
        return (right[0], right[1] + w["a"] * held, right[2], right[3] + w["b"] * held)
    return _replayed_backward(states, dout, dlse, order, pair)["dlse_parts"]


def lse_off_prediction(states, order, sign, one_sided=False):
    """(out, lse) of a fold whose pair merge gives lse off by ``sign`` (lse_a − lse_b): the sigmoid
    form lse = lse_a − logsigmoid(lse_a − lse_b) with the argument's sign flipped is logaddexp(lse_a,
    lse_b) + (lse_a − lse_b); ``one_sided``: off by it only where it is positive, as max(lse_a, lse_b)
    + log1p(exp(−d)) gives with d = ±(lse_a − lse_b) where log1p(exp(−|d|)) is meant.  Each out is the
    pair's own (its weights from the lse it is given), so the fold's later merges weigh the wrong lse;
    a pair with an empty partial is right."""
    work = list(states)
    for i, j in ref.merge_plan(len(work), order):
        (out_a, lse_a), (out_b, lse_b) = work[i], work[j]
        out, lse = ref.merge_states(out_a, lse_a, out_b, lse_b)
        both = np.isfinite(lse_a) & np.isfinite(lse_b)
        off = sign * (np.where(both, lse_a, 0.0) - np.where(both, lse_b, 0.0))
        work[i] = (out, np.where(both, lse + (np.maximum(off, 0.0) if one_sided else off), lse))
    return work[0]


def merged_lse_weight_prediction(states, order, piece):
    """out of a fold whose pair merge weighs ``piece`` ("a" or "b") by sigmoid(lse_x − lse) with lse
    the merged one, where sigmoid(lse_x − lse_y) (its share, exp(lse_x − lse)) is meant: the
    ring-attention update ``out = out − sigmoid(lse_b − lse)(out − out_b)`` written after
    ``lse = lse − logsigmoid(lse − lse_b)`` instead of before.  Its lse right; a pair with an empty
    partial right."""
    work = list(states)
    for i, j in ref.merge_plan(len(work), order):
        (out_a, lse_a), (out_b, lse_b) = work[i], work[j]
        out, lse = ref.merge_states(out_a, lse_a, out_b, lse_b)
        both = np.isfinite(lse_a) & np.isfinite(lse_b)
        mine, other = (out_b, out_a) if piece == "b" else (out_a, out_b)
        lse_x = lse_b if piece == "b" else lse_a
        w = 1.0 / (1.0 + np.exp(np.where(both, lse, 0.0) - np.where(both, lse_x, 0.0)))
        work[i] = (np.where(both[..., None], other + w[..., None] * (mine - other), out), lse)
    return work[0][0]


def _unnormalised_pair(out_a, lse_a, out_b, lse_b):
    """The rescale factors alpha = exp(lse - m) used as weights, never divided by their sum."""
    _, lse = ref.merge_states(out_a, lse_a, out_b, lse_b)
    m = np.maximum(lse_a, lse_b)
    m = np.where(np.isneginf(m), 0, m)
    term = lambda o, l: np.exp(l - m)[..., None] * np.where(np.isneginf(l)[..., None], 0, o)
    return term(out_a, lse_a) + term(out_b, lse_b), lse


def unnormalised_prediction(states, order):
    """out of a fold of `_unnormalised_pair` (float64)."""
    work = list(states)
    for i, j in ref.merge_plan(len(work), order):
        work[i] = _unnormalised_pair(*work[i], *work[j])
    return work[0][0]


def naive_bad_rows(states, order, dtype):
    """(B, H, T) bool: rows where ``exp(lse)`` without the max, in ``dtype``, gives a
    non-finite out or lse (empty partials' terms taken as 0, so only overflow shows)."""
    work = [(o, l.astype(dtype)) for o, l in states]
    bad = np.zeros(states[0][1].shape, bool)
    with np.errstate(all="ignore"):
        for i, j in ref.merge_plan(len(work), order):
            (oa, la), (ob, lb) = work[i], work[j]
            ea, eb = np.exp(la), np.exp(lb)
            total = ea + eb
            out = (ea[..., None] * np.where(np.isneginf(la)[..., None], 0, oa)
                   + eb[..., None] * np.where(np.isneginf(lb)[..., None], 0, ob)) / total[..., None]
            lse = np.log(total)
            bad |= ~np.isfinite(out).all(axis=-1) | np.isposinf(lse)
            work[i] = (out, lse)
    return bad


def _non_finite(t, got, gold, states, order, lse_dtype, forward_ok):
    bad = bad_entries(got, gold)
    if not bad.any():
        return None
    rows = _rows(bad, t)
    count = f"{t} has {int(bad.sum())} NaN or infinite entries of {bad.size} (in {int(rows.sum())} query rows)"
    empty = np.zeros_like(rows)
    for _, lse in states:
        empty |= np.isneginf(lse)
    naive = naive_bad_rows(states, order, lse_dtype)
    if (rows & ~empty).any() and not (rows & ~(naive | empty)).any():
        top = max(float(np.abs(np.where(np.isfinite(l), l, 0)).max()) for _, l in states)
        limit = math.log(np.finfo(lse_dtype).max)
        return Diagnosis("merge-no-max", f"{count}, where exp(lse) overflows or underflows in "
                         f"{np.dtype(lse_dtype).name} (|lse| up to {top:.0f}; exp overflows past {limit:.1f}): "
                         "the merge forgets the running maximum: subtract m = max(lse_a, lse_b) before exp "
                         "(alpha = exp(lse - m), the online softmax's rescale)")
    if not (rows & ~empty).any():
        backward = (" (the forward is right; in the backward a 0 weight still meets a NaN or infinite "
                    "factor: the branch torch.where did not take, log(0)'s derivative; zero the empty "
                    "inputs before they enter any product)" if t.startswith("d") and forward_ok else "")
        return Diagnosis("merge-empty-nan", f"{count}, all where a partial is empty (lse -inf, out NaN or "
                         "garbage): an empty partial turned into NaN: its weight exp(-inf) = 0 times its out "
                         "is 0 * NaN; take its term as 0 (torch.where(lse == -inf, 0, out)), and out 0, "
                         f"lse -inf when every partial is empty{backward}")
    return Diagnosis("non-finite", f"{count}: not where a partial is empty nor where exp(lse) overflows")


def _residual(got, pred, denom):
    if not np.isfinite(got).all() or pred.shape != got.shape:
        return math.inf
    same = np.isneginf(got) & np.isneginf(pred)
    diff = np.abs(np.where(same, 0, got) - np.where(same, 0, pred))
    return float(diff.max() / denom) if np.isfinite(diff).all() else math.inf


def _row_scaled(got, gold):
    """out_i = c_i x reference row i: the fitted prediction and the factors."""
    num, den = (got * gold).sum(-1, keepdims=True), (gold * gold).sum(-1, keepdims=True)
    c = np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)
    return c * gold, c


def diagnose_case(rows, got, gold, denoms, states, dout, dlse, order, dtype):
    """Set ``.diagnosis`` on each failing row of one case that has a result."""
    lse_dtype = np.float64 if dtype == "float64" else np.float32
    predicted = {"base-2": base2_prediction(states, dout, dlse, order),       # {tensor: array}
                 "unnormalised": unnormalised_prediction(states, order),     # out
                 **{("merged-lse-weight", x): merged_lse_weight_prediction(states, order, x) for x in "ab"}}
    for sign, kind in itertools.product((1, -1), LSE_OFF):                   # out and lse
        predicted[sign, kind] = dict(zip(("out", "lse"), lse_off_prediction(states, order, sign,
                                                                            kind == "lse-off-one-side")))
    if any(r.failed and r.tensor == "dlse_parts" for r in rows):
        predicted["detached"] = detached_prediction(states, dout, dlse, order)
    if any(r.failed and r.tensor == "dout_parts" for r in rows):
        predicted.update({("dout-weight", w): dout_weight_prediction(states, dout, dlse, order, w)
                          for w in DOUT_WEIGHTS})
    if any(r.failed and r.tensor == "dlse_parts" for r in rows):
        predicted["dlse-unweighted"] = dlse_unweighted_prediction(states, dout, dlse, order)
    named_out = None
    forward_ok = not any(r.failed for r in rows if r.tensor in ("out", "lse"))
    for row in rows:
        t = row.tensor
        if not row.failed or got[t] is None:
            continue
        found = _non_finite(t, got[t], gold[t], states, order, lse_dtype, forward_ok)
        if found is None:
            found = _catalogue(t, got[t], gold[t], denoms[t], row.error, row.bound, predicted)
        if t == "out" and found.id != "none":
            named_out = found.id
        elif found.id == "none" and named_out:
            found.sentence += f" (out of this case: {named_out})"
        row.diagnosis = found


def _catalogue(t, got, gold, denom, error, bound, predicted):
    """The merge mistake whose prediction (``predicted``: by mistake) explains tensor ``t``."""
    fmt = lambda x: f"{x:.1e}"
    explains = lambda r: r <= bound or r <= MATCH_SHARE * error
    tried = [("lse-base-2", _residual(got, predicted["base-2"][t], denom))]
    c = None
    if t == "out":
        fitted, c = _row_scaled(got, gold)
        tried += [("weights-not-normalised", _residual(got, fitted, denom)),
                  ("weights-not-normalised", _residual(got, predicted["unnormalised"], denom))]
        tried += [(f"merged-lse-weight-{x}", _residual(got, predicted["merged-lse-weight", x], denom)) for x in "ab"]
    if t == "dlse_parts" and predicted.get("detached") is not None:
        tried.append(("normaliser-detached", _residual(got, predicted["detached"], denom)))
    if t == "dlse_parts" and predicted.get("dlse-unweighted") is not None:
        tried.append(("dlse-unweighted", _residual(got, predicted["dlse-unweighted"][t], denom)))
    if t in ("dout_parts", "dlse_parts"):
        tried += [(key, _residual(got, p[t], denom)) for key, p in predicted.items()
                  if isinstance(key, tuple) and key[0] == "dout-weight"]
    if t in ("out", "lse"):
        tried += [(f"{kind}{'' if sign > 0 else '-negated'}", _residual(got, predicted[sign, kind][t], denom))
                  for kind in LSE_OFF for sign in (1, -1)]
    name, res = min(tried, key=lambda p: p[1])
    if explains(res) and isinstance(name, tuple):
        return Diagnosis("merge-dout-weight", f"{t} matches the reference with {DOUT_WEIGHTS[name[1]]} to {fmt(res)} "
                         f"(bound {fmt(bound)}): each piece's output gradient is its own weight times dout", res, bound)
    name = name if isinstance(name, str) else "merge-dout-weight"
    kind = next((k for k in LSE_OFF if name.startswith(k)), None)
    if explains(res) and kind is not None:
        x, y = ("a", "b") if name == kind else ("b", "a")
        said, why = LSE_OFF[kind](x, y)
        return Diagnosis(kind, f"{t} matches the reference with each merge's lse {said} to {fmt(res)} (bound "
                         f"{fmt(bound)}): {why}; the later merges weigh that lse", res, bound)
    if explains(res) and name.startswith("merged-lse-weight"):
        x, y = name[-1], "a" if name[-1] == "b" else "b"
        return Diagnosis("merged-lse-weight", f"{t} matches the reference with {x}'s weight sigmoid(lse_{x} - lse) "
                         f"taken from the merged lse, where sigmoid(lse_{x} - lse_{y}) is meant, to {fmt(res)} (bound "
                         f"{fmt(bound)}): lse updated before out (out = out - sigmoid(lse_b - lse)(out - out_b) "
                         "needs the running lse as it was); the later merges weigh that out", res, bound)
    if explains(res) and name == "dlse-unweighted":
        return Diagnosis(name, f"{t} matches the reference with the merged lse's gradient handed to each piece whole, "
                         f"dlse_x = w_x <dO, out_x - out> + dlse where w_x (<dO, out_x - out> + dlse) is meant, to "
                         f"{fmt(res)} (bound {fmt(bound)}): d lse / d lse_x is w_x, not 1", res, bound)
    if explains(res) and name == "normaliser-detached":
        return Diagnosis(name, f"{t} matches the reference with the merged lse held constant in the weights "
                         f"w_x = exp(lse_x - lse) (detached, as the stabilising maximum may be) to {fmt(res)} "
                         f"(bound {fmt(bound)}): each partial lse's gradient w_x (<dO, out_x - out> + dlse) "
                         "loses its -<dO, out> term: let the gradient flow through lse", res, bound)
    if explains(res):
        if name == "lse-base-2":
            return Diagnosis(name, f"{t} matches the reference with lse in base 2 (exp2 and log2 in place of "
                             f"exp and log) to {fmt(res)} (bound {fmt(bound)}): lse in base 2: multiply by ln 2 "
                             "(a kernel working in base 2 takes lse * log2(e) in and gives lse2 * ln 2 out)",
                             res, bound)
        return Diagnosis(name, f"{t} matches the reference with the weights not normalised (each merge's out "
                         f"scaled by exp(lse_a - m) + exp(lse_b - m); row factors {c.min():.3g} .. {c.max():.3g} "
                         f"overall) to {fmt(res)} (bound {fmt(bound)}): the weights are not normalised: "
                         "w_a = exp(lse_a - lse) and w_b = exp(lse_b - lse) sum to 1", res, bound)
    closest = f"; closest: {name} at {fmt(res)}" if res < error else ""
    return Diagnosis("none", f"{t} matches none of the merge mistakes (lse in base 2, weights not "
                     f"normalised, the merged lse detached in the weights, a piece's output gradient weighed by the "
                     f"other's weight, the merged lse's gradient handed whole, no running maximum, empty partial to "
                     f"NaN){closest}", res, bound)
