"""Name the mistake behind a failing tensor.

For each failing tensor, in this order:

0. *NaN or infinity*: how many entries, in which rows, and -- when the case has
   query rows that see no key (causal, bottom-right, Tq > Tk) -- what the check
   expects there and why.  No formula of the catalogue gives a NaN, and a NaN
   differs from itself, so this comes before the second call below.
1. *Dropout left on* (or any random draw): the target is called a second time on
   the same inputs; if the tensor moves by more than its bound, no fixed
   formula can explain it, and that is the diagnosis.
2. The catalogue (``mistakes``), plus a fitted *wrong softmax denominator* for
   out (each row the reference times its own factor c_i): each hypothesis's
   residual is the tensor's error measured against the hypothesis instead of
   the reference, with the same denominator; the smallest residual within the
   tensor's bound is the match: "out matches the reference with bottom-right
   causal alignment to 3e-07 (bound 2e-06)".  The bound is the *reference's*
   rounding budget; a mistake that sharpens the softmax (no scale, 1/D) rounds
   more than the reference does in the kernel's dtype, so a residual above the
   bound also matches when it is at most `MATCH_SHARE` of the error against the
   reference: the mistake explains all but that share of what went wrong.
3. Slice by slice: when no hypothesis explains the whole tensor, the (batch,
   head) slices that fail are compared on their own -- one head with a mistake
   and the others right reads "head 1 matches ... ; the other slices match the
   reference".
4. Otherwise "matches none of the catalogued mistakes", with the closest one
   when it comes closer than the reference (``measure`` then checks whether the
   error is the size of a lower precision's).

What is not claimed: a mistake whose prediction is zero everywhere (any kernel
returning zeros matches it: the shifted mask at T = 1), a fitted denominator
with a factor <= 0 or with one key (it then fits any multiple of v).  When out
passed, its gradients are tried only against backward mistakes, and their
sentence begins "the output is right; only the backward is wrong".

A pattern across cases -- the error growing with the sequence length -- is
found afterwards, over the rows of a whole run (``report``).
"""

from dataclasses import dataclass, field

import numpy as np

import parity_tests.kernels.mistakes as mistakes

__all__ = ["Diagnosis", "diagnose", "slice_errors", "DENSE_LIMIT"]

# Dense float64 recomputation: at most this many (query, key) pairs in all
# (2^25 x 8 bytes = 256 MiB per array).  Larger cases are diagnosed on the
# (batch, head) slice holding the largest error, if that slice fits.
DENSE_LIMIT = 2 ** 25

TENSORS = ("out", "dq", "dk", "dv")

# The per-row factor of the "wrong denominator" entry is fitted to the target's
# output, so it always explains *some* of the error; it counts only when what
# is left is at most this share of the error (a true row scaling leaves rounding).
FIT_SHARE = 0.1

# A catalogued mistake that leaves at most this share of the error against the
# reference explains the tensor, even where its own rounding exceeds the bound
# (measured: a float32 kernel without the 1/sqrt(D) scale leaves 1e-6 of its error
# of ~1; a wrong alignment or mask leaves < 1e-7; across the gallery the runner-up
# hypothesis leaves at least 0.2 of the error, so 1e-3 sits far from both).
MATCH_SHARE = 1e-3


def explains(residual, error, bound):
    """A hypothesis at ``residual`` from the target explains a tensor that is at
    ``error`` from the reference (arrays or numbers, elementwise)."""
    return (residual <= bound) | (residual <= MATCH_SHARE * error)


@dataclass
class Diagnosis:
    id: str                  # a catalogue id, "non-finite", "dropout", "denominator", "none", "not-diagnosed"
    sentence: str
    residual: float = float("nan")
    bound: float = float("nan")
    slices: list = field(default_factory=list)     # [(batch, head)] when only some slices

    def as_dict(self):
        return {"id": self.id, "sentence": self.sentence, "residual": _finite(self.residual),
                "bound": _finite(self.bound), "slices": [list(s) for s in self.slices]}


def _finite(x):
    return float(x) if np.isfinite(x) else None


def slice_errors(a, ref, denom):
    """(B, H) array: max |a - ref| over each (batch, head) slice, over ``denom``; inf if non-finite."""
    diff = np.abs(np.asarray(a, dtype=np.float64) - ref)
    worst = np.where(np.isfinite(diff), diff, np.inf).max(axis=(-1, -2))
    return worst / denom


def _row_scaled(a, ref):
    """out = c_i x reference row i: the best factor per row, and the fitted prediction."""
    num = (a * ref).sum(-1, keepdims=True)
    den = (ref * ref).sum(-1, keepdims=True)
    c = np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)
    return c, c * ref


def _fmt(x):
    return f"{x:.1e}"


def _where(slices, shape):
    b, h = shape
    heads = sorted({s[1] for s in slices})
    if b == 1 or len(slices) == len(heads) * b and all((i, hh) in slices for i in range(b) for hh in heads):
        word = "head" if len(heads) == 1 else "heads"
        every = "" if b == 1 else " (every batch)"
        return f"{word} {', '.join(map(str, heads))}{every}"
    return "(batch, head) " + ", ".join(str(tuple(s)) for s in slices)


def diagnose(failing, got, golden, denoms, bounds, case, offset, align, inputs, dout, rerun):
    """``{tensor: Diagnosis}`` for the tensors in ``failing``.

    got, golden: dicts tensor -> float64 array (B, H, T, D); denoms, bounds: per tensor;
    inputs: (q, k, v) float64 rounded; rerun: () -> a second call's dict, or None.
    """
    result = {t: _non_finite(t, got[t], case, offset, align) for t in failing if not np.isfinite(got[t]).all()}
    second = rerun() if len(result) < len(failing) else None
    for t in failing:
        if t in result:
            continue
        if second is not None and t in second:
            moved = slice_errors(second[t], got[t], denoms[t]).max()
            if moved > bounds[t]:
                result[t] = Diagnosis("dropout", f"{t} changes between two calls on the same inputs "
                                      f"(by {_fmt(moved)}, bound {_fmt(bounds[t])}): dropout left on, "
                                      "or another random draw in the kernel", moved, bounds[t])
    rest = [t for t in failing if t not in result]
    if not rest:
        return result
    sel, sub = _subset(case, got, golden, inputs, dout)
    if sel is None:
        for t in rest:
            result[t] = Diagnosis("not-diagnosed", f"{t} not diagnosed: Tq x Tk = {case.tq * case.tk} is too "
                                  f"large for the dense float64 recomputation (limit {DENSE_LIMIT}); "
                                  "rerun with --tokens 4096 or less")
        return result
    g_got, g_ref, g_in, g_dout = sub
    hyps = mistakes.catalogue(case, offset, align, g_in, g_dout, g_ref)
    cache = {}
    out_right = "out" not in failing and "out" in got       # judged, and passed
    out_fits = {} if out_right else _out_fits(hyps, cache, g_got, g_ref["out"], denoms["out"], bounds["out"])
    for t in rest:
        tried = hyps if t == "out" else [h for h in hyps if "out" not in h.tensors or out_fits.get(id(h))]
        result[t] = _diagnose_tensor(t, tried, cache, g_got, g_ref, denoms[t], bounds[t], sel)
        if out_right:
            result[t].sentence = "the output is right; only the backward is wrong: " + result[t].sentence
        if sel != (slice(None), slice(None)):
            result[t].sentence += (f" (judged on (batch, head) {tuple(int(i) for i in sel)} alone, the one "
                                   "with the largest error: the whole case is too large to recompute)")
    named = result.get("out")
    if named is not None and named.id not in ("none", "not-diagnosed"):
        for t in rest:                # a gradient no entry explains, of an output one does
            if result[t].id == "none":
                result[t].sentence += f" (out of this case: {named.id})"
    return result


def _ranges(indices):
    """'0 .. 89' / '3, 7 .. 9' for sorted distinct ints (at most four pieces, then '...')."""
    pieces, start = [], indices[0]
    for a, b in zip(indices, indices[1:] + [None]):
        if b != a + 1:
            pieces.append(f"{start}" if start == a else f"{start} .. {a}")
            start = b
    return ", ".join(pieces[:4]) + (", ..." if len(pieces) > 4 else "")


def _non_finite(t, a, case, offset, align):
    """How many entries of ``a`` are NaN or infinite, in which rows, and what the check
    expects in the query rows that see no key."""
    bad = ~np.isfinite(a)                                           # (B, H, T, D)
    nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    rows = sorted(int(i) for i in np.nonzero(bad.any(axis=(0, 1, 3)))[0])
    kind = "query" if t in ("out", "dq") else "key"
    b, h, i = (int(x[0]) for x in np.nonzero(bad)[:3])
    sentence = (f"{t} has {nan} NaN and {inf} infinite entries of {a.size}, in {kind} rows "
                f"{_ranges(rows)} (first at (b, h, row) = ({b}, {h}, {i}))")
    blind = -offset if case.causal and offset < 0 else 0       # query rows 0 .. blind-1 see no key
    if blind:
        expects = ("zeros there" if kind == "query" else "them to add nothing to dk and dv")
        sentence += (f"; query rows 0 .. {blind - 1} see no key ({align} causal mask with Tq = {case.tq} > "
                     f"Tk = {case.tk}): the check expects {expects}, as SDPA and FlashAttention return "
                     "(a softmax over no key is 0/0: zero those rows' weights after the softmax)")
    return Diagnosis("non-finite", sentence, float("inf"), float("nan"))


def _out_fits(hyps, cache, got, golden_out, denom, bound):
    """Whether each forward mistake reproduces the target's out in at least one slice:
    the ones that do not are not tried on the gradients (saves their autograd)."""
    fits = {}
    for hyp in hyps:
        if "out" in hyp.tensors:
            out = cache[id(hyp)]["out"] if id(hyp) in cache else hyp.predict(grads=False)["out"]
            residual = slice_errors(got["out"], out, denom)
            error = slice_errors(got["out"], golden_out, denom)
            fits[id(hyp)] = bool(explains(residual, error, bound).any())
    return fits


def _subset(case, got, golden, inputs, dout):
    """All slices, or the worst one, or None when even one slice is too large."""
    q, k, v = inputs
    if case.batch * case.heads * case.tq * case.tk <= DENSE_LIMIT:
        return (slice(None), slice(None)), (got, golden, inputs, dout)
    if case.tq * case.tk > DENSE_LIMIT:
        return None, None
    b, h = np.unravel_index(np.argmax(slice_errors(got["out"], golden["out"], 1.0)), (case.batch, case.heads))
    pick = lambda a: a[b:b + 1, h:h + 1]
    return (b, h), ({n: pick(a) for n, a in got.items()}, {n: pick(a) for n, a in golden.items()},
                    tuple(pick(a) for a in inputs), pick(dout))


def _predict(hyp, cache):
    key = id(hyp)
    if key not in cache:
        cache[key] = hyp.predict()
    return cache[key]


def _diagnose_tensor(t, hyps, cache, got, ref, denom, bound, sel):
    a, r = got[t], ref[t]
    candidates = []                               # (per-slice residuals, id, says)
    for hyp in hyps:
        # a mistake that predicts zeros everywhere (the shifted mask at T = 1) is matched by
        # any kernel returning zeros: it cannot be told apart, so it is not claimed
        if t in hyp.tensors and np.any(_predict(hyp, cache)[t]):
            candidates.append((slice_errors(a, _predict(hyp, cache)[t], denom), hyp.id, hyp.says))
    if t == "out" and np.all(np.isfinite(a)):
        c, fitted = _row_scaled(a, r)
        residual = slice_errors(a, fitted, denom)
        # a fitted hypothesis must explain the error, not shave it: 90% of it at least; a
        # denominator is positive (a factor 0 is an output of zeros); and with one key it
        # fits any output proportional to v, so it is not claimed there
        # the key count from a key-side gradient; a forward-only case (decode) has none
        one_key = next((ref[n].shape[-2] for n in ("dk", "dv") if n in ref), None) == 1
        if residual.max() <= FIT_SHARE * slice_errors(a, r, denom).max() and c.min() > 0 and not one_key:
            lo, hi = float(c.min()), float(c.max())
            candidates.append((residual, "denominator", f"each row divided by a wrong softmax "
                               f"denominator (row factors {lo:.6g} .. {hi:.6g})"))
    if not np.any(a) and np.any(r):
        return Diagnosis("zeros", f"{t} is zero everywhere (the reference is not): nothing written, "
                         "or every weight masked")
    if not candidates:
        return Diagnosis("none", f"{t} matches none of the catalogued mistakes")
    whole = [(res.max(), i, s) for res, i, s in candidates]
    best = min(whole, key=lambda w: w[0])
    error = slice_errors(a, r, denom).max()
    if explains(best[0], error, bound):
        beyond = "" if best[0] <= bound else f", {best[0] / error:.0e} of its error {_fmt(error)}"
        return Diagnosis(best[1], f"{t} matches the reference with {best[2]} to {_fmt(best[0])} "
                         f"(bound {_fmt(bound)}{beyond})", best[0], bound)
    by_slice = _by_slice(t, candidates, a, r, denom, bound, sel)
    if by_slice is not None:
        return by_slice
    if best[0] >= slice_errors(a, r, denom).max():       # nothing comes closer than the reference
        return Diagnosis("none", f"{t} matches none of the catalogued mistakes")
    return Diagnosis("none", f"{t} matches none of the catalogued mistakes (closest: {best[2]}, "
                     f"{_fmt(best[0])} vs bound {_fmt(bound)})", best[0], bound)


def _by_slice(t, candidates, a, r, denom, bound, sel):
    """One mistake in some (batch, head) slices, the reference in the others."""
    plain = slice_errors(a, r, denom)
    bad = plain > bound
    if not bad.any() or bad.all():
        return None
    fits = [(res[bad].max(), i, s) for res, i, s in candidates
            if np.all(explains(res[bad], plain[bad], bound))]
    if not fits:
        return None
    res, hid, says = min(fits, key=lambda f: f[0])
    offset_b, offset_h = (0, 0) if sel == (slice(None), slice(None)) else sel
    slices = [(int(b) + offset_b, int(h) + offset_h) for b, h in zip(*np.nonzero(bad))]
    where = _where(slices, plain.shape)
    verb = "matches" if len(slices) == 1 else "match"
    return Diagnosis(hid, f"{t}: {where} ({len(slices)} of {plain.size} (batch, head) slices) "
                     f"{verb} the reference with {says} to {_fmt(res)} (bound {_fmt(bound)}); "
                     "the other slices match the reference", res, bound, slices)
