"""Mistakes that read memory no one should read, named by where their NaN lands.

Every slot a kernel must not read is NaN (the packed tail of ``varlen``, the unused
pages and page tails of ``paged``), so a kernel that reads one returns NaN, and an
output with NaN goes to the diagnosis's non-finite branch before the catalogue (no
finite formula reproduces a NaN).  A `Poisoned` hypothesis is a catalogued mistake
recomputed on the poisoned memory: its prediction is NaN in the rows that surely
read a NaN (a visible key is NaN) and finite elsewhere; ``maybe`` marks the rows that
may turn NaN besides (a hidden NaN key inside the range a kernel walks, multiplied by
a weight of 0).  It matches a tensor when::

    sure ⊆ the tensor's non-finite rows ⊆ sure ∪ maybe

and the tensor's finite rows sit within their bound of the prediction's.  The first
match in the catalogue's order is the diagnosis (``diagnosis`` calls `name_non_finite`);
others that match as well are named beside it (a kernel whose every row is NaN leaves
several readings open).
"""

from dataclasses import dataclass

import numpy as np

__all__ = ["Poisoned", "name_non_finite"]


@dataclass
class Poisoned:
    """A ``mistakes.Hypothesis`` (the same fields) whose prediction holds NaN."""
    id: str
    says: str
    predict: object          # (grads=True) -> {tensor: array}, NaN in the rows that surely read one
    tensors: tuple = ("out", "lse")
    maybe: object = None     # () -> (B, H, Tq) bool: rows that may be non-finite besides the sure ones


def _rows(a):
    """(B, H, T) bool: the rows of a judged (B, H, T, D) array holding a non-finite entry."""
    return ~np.isfinite(a).all(axis=-1)


def _context(ev):
    from parity_tests.kernels import mistakes
    from parity_tests.kernels.measure import judged
    r = ev.rounded
    return mistakes.Context(ev.case, ev.align, (r["q"], r["k"], r["v"], r["dout"]), r.get("dlse"), ev.opts,
                            ev.gold_raw, judged, ev.wanted)


def name_non_finite(n, ev):
    """A `diagnosis.Diagnosis` naming the poisoned mistake behind tensor ``n``'s NaN, or None."""
    from parity_tests.kernels import diagnosis, mistakes
    if n not in ("out", "lse") or n not in ev.arrays:
        return None
    matches = list(_matches(n, ev, diagnosis, mistakes))
    if not matches:
        return None
    (hyp, residual), others = matches[0], [h.says for h, _ in matches[1:]]
    plain = diagnosis._non_finite(n, ev.arrays[n], ev.case, ev.align)
    also = f" (the same rows as: {'; '.join(others)})" if others else ""
    bad = _rows(ev.arrays[n])
    rest = f", the other rows within {residual:.1e} (bound {ev.bounds[n]:.1e})" if not bad.all() else ""
    return diagnosis.Diagnosis(hyp.id, f"{n} matches the reference with {hyp.says}{also}: non-finite in the "
                               f"{int(bad.sum())} rows that mistake makes non-finite{rest}; {plain.sentence}",
                               residual, ev.bounds[n])


def _matches(n, ev, diagnosis, mistakes):
    """(hypothesis, residual) of each poisoned hypothesis that explains tensor ``n``."""
    a = ev.arrays[n]
    bad = _rows(a)
    for hyp in mistakes.catalogue(_context(ev)):
        if not isinstance(hyp, Poisoned) or n not in hyp.tensors:
            continue
        pred = hyp.predict(grads=False).get(n)
        if pred is None:
            continue
        if n == "lse":                       # rows that see no key are not judged
            pred = np.where(ev.gold[n] == 0.0, np.where(np.isnan(pred), pred, 0.0), pred)
        sure = _rows(pred)
        maybe = sure | (hyp.maybe() if hyp.maybe is not None else False)
        if not (np.all(bad[sure]) and not np.any(bad & ~maybe)):
            continue
        both = ~bad & ~sure
        residual = float(np.abs(a[both] - pred[both]).max(initial=0.0)) / ev.den[n]
        error = float(np.abs(a[both] - ev.gold[n][both]).max(initial=0.0)) / ev.den[n]
        if diagnosis.explains(residual, error, ev.bounds[n]):
            yield hyp, residual
