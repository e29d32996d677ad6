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
match in the catalogue's order is the diagnosis (``diagnosis.name_non_finite``); others
that match as well are named beside it.  Where every row is NaN, nothing finite tells the
readings apart: the target is called again with that memory holding 0 (``Caller.unread``),
and only the readings whose ``zeroed`` prediction that call gives remain.
"""

from dataclasses import dataclass

import numpy as np

__all__ = ["Poisoned", "rows_non_finite"]


@dataclass
class Poisoned:
    """A ``mistakes.Hypothesis`` (the same fields) whose prediction holds NaN."""
    id: str
    says: str
    predict: object          # (grads=True) -> {tensor: array}, NaN in the rows that surely read one
    tensors: tuple = ("out", "lse")
    maybe: object = None     # () -> (B, H, Tq) bool: rows that may be non-finite besides the sure ones
    zeroed: object = None    # () -> {tensor: array}: its prediction where that memory holds 0 instead


def rows_non_finite(a):
    """(B, H, T) bool: the rows of a judged (B, H, T, D) array holding a non-finite entry."""
    return ~np.isfinite(a).all(axis=-1)
