"""A long case's diagnosis on a block of its query rows.

A case too large to recompute whole under each mistake (``diagnosis.DENSE_LIMIT``
(query, key) pairs in one (batch, head) slice) is diagnosed where its error sits: the
(batch, head) slice with the largest error, then a block of query rows around that
slice's worst row, each row with every key (the keys a row does not see masked, as
in the whole case: the dense formula places the mask by the rows' own indices).

What a row block can judge, and what it cannot:

- out, lse and dq of a query row depend on that row alone (its q, dO, dlse and every
  k, v): the block's rows of the reference are the reference, and each mistake
  recomputed on the block gives exactly the rows the whole case would.
- dk and dv sum over every query row that sees a key: the block holds only its own
  rows' share, so a mistake that changes the forward is not judged on them.  Those
  the reference itself gives (dk missing the scale) are judged on the whole slice.
- The softmax over the query axis needs every query row, and the (B, T, H, D) layout
  mistake every head and token: neither is tried on a block (the sentence says so).
  A stale running maximum and split-KV merges run over the keys of each row, so they
  are tried on the block as on the whole case.

A case that does fit (up to ``DENSE_LIMIT`` pairs a slice) is still screened on a
block when it is large (`screen`): each mistake that changes out is first recomputed on
a block of query rows of every slice, and only those that could explain out there are
recomputed on the whole case.  The block's rows are exact, so a mistake further from
the target's out on the block than any explanation of the whole case's error allows is
as far or further on the whole case: dropping it changes no verdict.
"""

from dataclasses import replace

import numpy as np

__all__ = ["ROW_BLOCK_ELEMENTS", "MAX_ROWS", "SCREEN_FROM", "block_of_rows", "on_rows", "ROW_TENSORS",
           "worst_row", "where_judged", "screen"]

# A block holds at most this many (query, key) pairs (float64: 32 MiB per array, some
# ten arrays alive in one mistake's autograd) and at most MAX_ROWS rows: at Tk = 16384,
# 256 rows; at 65536, 64.
ROW_BLOCK_ELEMENTS = 2 ** 22
MAX_ROWS = 256
MIN_ROWS = 16

# The tensors judged row by row; the others (dk, dv, the extra inputs' gradients) sum over the rows.
ROW_TENSORS = ("out", "lse", "dq")
# A case recomputed whole is screened on a block first past this many pairs a slice
# (measured, T = 4096 causal, SDPA without its scale: the diagnosis took 10.7 s, 8.3 s
# of it recomputing seventeen mistakes' out on the whole case).
SCREEN_FROM = 2 ** 21

def block_of_rows(tq, tk, worst):
    """(first, end): the block of query rows centred on row ``worst``, within 0 .. tq."""
    n = int(min(tq, MAX_ROWS, max(MIN_ROWS, ROW_BLOCK_ELEMENTS // max(tk, 1))))
    first = int(min(max(0, worst - n // 2), tq - n))
    return first, first + n


def worst_row(ev, b, h, failing):
    """The query row of slice (b, h) with the largest error of the first failing row-wise
    tensor (of out when only dk, dv fail)."""
    n = next((t for t in ROW_TENSORS if t in failing and t in ev.arrays), "out")
    if n not in ev.arrays:
        return 0
    diff = np.abs(ev.arrays[n][b, h] - ev.gold[n][b, h]).max(axis=-1)
    return int(np.argmax(np.where(np.isfinite(diff), diff, np.inf)))


def on_rows(ev, b, h, first, end):
    """The evidence of slice (b, h), its row-wise tensors and inputs cut to query rows
    first .. end - 1 (k, v, dk, dv whole), as a case of one batch entry and one head;
    (b, h) = (None, None): every slice, the case's batch and heads kept."""
    row_wise = ROW_TENSORS + ("q", "dout", "dlse")            # axis 2 is the query row
    bs, hs = (slice(None), slice(None)) if b is None else (slice(b, b + 1), slice(h, h + 1))

    def cut(arrays):
        return {n: a[bs, hs, first:end] if n in row_wise else a[bs, hs] for n, a in arrays.items()}
    case = ev.case if b is None else replace(ev.case, batch=1, heads=1)
    return replace(ev, case=case, rounded=cut(ev.rounded), gold=cut(ev.gold), gold_raw=cut(ev.gold_raw),
                   arrays=cut(ev.arrays), rows=(first, ev.case.tq))


def where_judged(b, h, first, end, tq, skipped):
    """The words appended to a sentence judged on a block."""
    said = f" (judged on (batch, head) ({b}, {h}), query rows {first} .. {end - 1} of {tq} with every key " \
           "they see: the whole case is too large to recompute"
    if skipped:
        said += "; not tried on a block of rows: " + ", ".join(skipped)
    return said + ")"


def screen(hyps, ev, catalogue_of, explains, slice_errors):
    """Of ``hyps`` (the whole case's catalogue), those that may explain out on the whole
    case: each mistake that changes out is recomputed (forward only) on a block of query
    rows of every slice, around out's worst row, and dropped when its residual there cannot
    explain the whole case's error of out in any slice.  ``catalogue_of(block evidence)``
    gives the block's catalogue; a mistake is paired with its namesake there (the n-th of
    an id with the n-th), and one without a namesake (a mistake needing every row, or an id
    whose count differs on the block) is kept untried."""
    worst = slice_errors(ev.arrays["out"], ev.gold["out"], 1.0)
    b, h = (int(i) for i in np.unravel_index(np.argmax(worst), worst.shape))
    first, end = block_of_rows(ev.case.tq, ev.case.tk, worst_row(ev, b, h, ("out",)))
    block = on_rows(ev, None, None, first, end)
    namesakes = {}
    for part in catalogue_of(block):
        namesakes.setdefault(part.id, []).append(part)
    counts = {}
    for whole in hyps:
        counts[whole.id] = counts.get(whole.id, 0) + 1
    den, bound = ev.den["out"], ev.bounds["out"]
    error = slice_errors(ev.arrays["out"], ev.gold["out"], den)                 # the whole case's
    kept, seen = [], {}
    for whole in hyps:
        n = seen[whole.id] = seen.get(whole.id, -1) + 1
        same = namesakes.get(whole.id, [])
        if "out" in whole.tensors and len(same) == counts[whole.id]:
            residual = slice_errors(block.arrays["out"], same[n].predict(grads=False)["out"], den)
            if not explains(residual, error, bound).any():
                continue
        kept.append(whole)
    return kept
