"""The weights a kernel gives, read by calling it on one-hot values.

Attention is linear in v: out = W v, with W the weights every query row gives every key of
every (batch, kv head) slice -- whatever the kernel's scores, masks, block tables and tiles do
with q and k.  Called on the case's q and k with a v whose column c is one-hot, the kernel
returns column c of W itself.  Two readings, of a few forward calls each:

- *by slice*: v[b, g, :, c] = 1 on the slice numbered c = b * Hkv + g (all its keys), 0 on the
  others.  out[b, h, i, c] is the weight row i of (b, h) gives slice c's values: the row's whole
  weight (1, less the sinks') on its own slice, 0 on the others.  A row weighing another slice
  reads another sequence's pages, another batch entry or another kv head.
- *by key*: v[:, :, j, c] = 1 on key j.  out[b, h, i, j] is the weight row i gives key j: the
  reference's P where the rows read their own slice.  Where the two differ: keys weighed that
  the reference hides (a mask on other positions), keys the reference weighs that the kernel
  does not (a visible range cut short), or the right keys weighed otherwise (their scores, or
  their values read at other keys' rows), each by rows and keys.

A v stored in another dtype with a scale (FP8's) is handed as that scale times the one-hot, so
that its stored values are exact ones.  Where both readings agree with the reference, the
weights are right and the error lies in what the kernel does with v's values themselves.

The backward's are read alike (`read_backward`), where out is right and dk or dv fails: dv = Pᵀ dO
is linear in dO, so dO one-hot on a query slice, then on a query row, gives the weights with which
the dK/dV pass takes each key's dO -- a key tile reading query rows of another slice (its loop
started before the slice), a kv head summing other heads, rows recomputed with other scores.

Not read: a kernel whose out is not 0 where v is (a term added to out, not linear in v), a block
of rows (`row_block`), dropout (random weights), and a case needing more than `CALLS` calls or,
at its own forward time, `SECONDS`.
"""

import numpy as np
import torch

from parity_tests.kernels.diagnosis.location import ranges
from parity_tests.kernels.features import per_head, stored_inputs

__all__ = ["read", "read_backward", "ID", "MASKED_AS", "MIXED_ID", "SCORED_WITH", "CALLS", "SECONDS"]

ID = "weights-read"     # the diagnosis id of what this reading finds: it locates, it names no mistake
# ... but where the weights show one mechanism exactly, these ids name it (a cause, as a fitted reading's)
MASKED_AS = "rows-masked-as"          # `_rows_masked_as`: every row under another row's mask
MIXED_ID = "keys-mixed"               # `_keys_mixed`: values taking other keys' weights, W = P M
SCORED_WITH = "rows-scored-with"      # `_rows_scored_with`: rows scored with another vector for their q

CALLS = 17             # at most this many forward calls: v = 0, then ceil(slices / Dv) + ceil(Tk / Dv) one-hot
SECONDS = 10.0         # ... and at most this long in all, at the case's own forward time
# A weight counts as given where it is past this share of its row's largest reference weight, and as
# none at or below its square (a kernel's masked key has weight exactly 0; an unmasked one in a
# float32 row 1e-3 of the largest is far from its rounding).
GIVEN = 1e-3
# A key's score, read from the weights, differs from the reference's past this many roundoffs
# (`_tolerance`).
ROUNDOFFS = 4.0
LISTED = 4             # rows or slices named one by one in a sentence
MOVED_WORK = 2 ** 26   # `_keys_moved`, `_keys_mixed`: not tried past this many (rows x keys x keys) entries
MIXED = 3              # `_keys_mixed`: at most this many keys' weights on one value
AGREE = 0.7            # `_rows_masked_as`: the share of (row, key) pairs the shifted mask must account for
SIDE = 0.9             # `_which_side`: a share of a row's keys (or a key's rows) that is nearly all of them


def read(ev, P):
    """(`ID`, sentence) for the kernel of evidence ``ev`` (its ``caller`` called on one-hot
    values), against the reference's weights ``P`` (B, Hq, Tq, Tk: None on a block of rows, with
    dropout or past its size limit); None where the weights are not read (module docstring) or a
    call fails."""
    case, r = ev.case, ev.rounded
    if P is None or r["v"].ndim != 4:
        return None
    B, G, T, D = r["v"].shape
    Hq = r["q"].shape[1]
    if P.shape != (B, Hq, P.shape[2], T) or Hq % G:
        return None
    slices = B * G
    calls = 1 + -(-slices // D) + -(-T // D)
    took = ev.caller.forward_seconds or ev.caller.seconds or 0.0
    if calls > CALLS or calls * took > SECONDS:
        return None
    spec = stored_inputs(case).get("v")
    sigma = per_head(r[spec.scale], G) if spec is not None else np.ones((B, G, 1, 1))      # (B, G, 1, 1)
    kv = np.arange(Hq) // (Hq // G)
    own = np.arange(B)[:, None] * G + kv[None, :]                           # (B, Hq): each row's own slice

    def on_slice(c, v):
        v[c // G, c % G, :, c % D] = 1.0

    def on_key(c, v):
        v[:, :, c, c % D] = 1.0
    zero = _out_on(ev, np.zeros_like(r["v"]))
    if zero is None or not (zero == 0).all():                          # not linear in v: a term of its own
        return None
    forward = lambda v: _out_on(ev, v * sigma)
    by_slice, by_key = _called(slices, D, r["v"].shape, on_slice, forward), _called(T, D, r["v"].shape, on_key, forward)
    if by_slice is None or by_key is None:
        return None
    mass = by_slice / sigma.reshape(1, 1, 1, slices)                       # (B, Hq, Tq, slices): weight per slice
    W = by_key / sigma[:, kv]                                              # (B, Hq, Tq, Tk), the own slice's scale
    top = P.max(-1)
    rows = (top > 0) & np.isfinite(mass).all(-1) & np.isfinite(W).all(-1)  # rows that see a key, read whole
    if not rows.any():
        return None
    tolerance = _tolerance(ev)
    named, said = _first((ID, lambda: _other_slices(mass, own, rows, G)),
                         (MASKED_AS, lambda: _rows_masked_as(W, P, top, rows)),
                         (ID, lambda: _keys_moved(W, P, top, rows, tolerance)),
                         (MIXED_ID, lambda: _keys_mixed(W, P, top, rows, tolerance)),
                         (SCORED_WITH, lambda: _rows_scored_with(W, P, top, rows, tolerance, ev)),
                         (ID, lambda: _keys(W, P, top, rows, tolerance)))
    lead = ("out: its weights, read by calling the kernel on one-hot values (out = W v is linear in v: "
            "v one-hot on a slice, then on a key, gives W's column)")
    if said is not None:
        return named, f"{lead}: {said}"
    failing = np.abs(ev.arrays["out"] - ev.gold["out"]).max(-1) / ev.den["out"] > ev.bounds["out"]
    if (failing & ~rows).any():                   # failing rows it could not read (rows that see no key)
        return None
    return ID, (f"{lead}, are the reference's on every row that sees a key: the weights are right, the error "
                "lies in what the kernel does with v's values themselves")


def read_backward(ev, P):
    """(`ID`, sentence) for the weights the kernel's backward gives dv, read as `read` reads the
    forward's: dv = Pᵀ dO is linear in dO, whatever the dK/dV pass's tiles, ranges and head
    reduction do.  Called on the case's q, k, v with dO one-hot on a query slice (b, h) (dO[b, h, :,
    c] = 1 for the slice numbered c = b Hq + h), dv[b', g, j, c] is the weight key j of kv head g
    takes from slice c's rows: the column sum of P on its own group's heads, 0 on every other
    slice; then dO one-hot on a (head of the group, query row), dv[b, g, j, c] is that row's weight
    on key j, the reference's P where the backward reads it so.  None where not read (a case
    without dv, another layout, a dv not 0 at dO = 0, past `CALLS` or `SECONDS`) or where a call
    fails; the sentence that the weights are right only where every row that sees a key was read."""
    r = ev.rounded
    if P is None or r.get("dout") is None or r["dout"].ndim != 4 or r["v"].ndim != 4 or "dv" not in ev.arrays:
        return None
    B, Hq, Tq, D = r["dout"].shape
    G, Tk = r["v"].shape[1], r["v"].shape[2]
    if P.shape != (B, Hq, Tq, Tk) or Hq % G:
        return None
    group = Hq // G
    calls = 1 + -(-B * Hq // D) + -(-group * Tq // D)
    if calls > CALLS or calls * (ev.caller.seconds or 0.0) > SECONDS:
        return None
    zero = _dv_on(ev, np.zeros_like(r["dout"]))
    if zero is None or not (zero == 0).all():                    # not linear in dO: a term of its own
        return None

    def on_slice(c, dout):
        dout[c // Hq, c % Hq, :, c % D] = 1.0

    def on_row(c, dout):
        dout[:, np.arange(G) * group + c // Tq, c % Tq, c % D] = 1.0
    backward = lambda dout: _dv_on(ev, dout)
    by_slice, by_row = (_called(n, D, r["dout"].shape, mark, backward)
                        for n, mark in ((B * Hq, on_slice), (group * Tq, on_row)))
    if by_slice is None or by_row is None:
        return None
    kv = np.arange(Hq) // group
    took = np.zeros((B, G, Tk, B * Hq))                             # the reference's: each slice's column sums
    for b in range(B):
        for h in range(Hq):
            took[b, kv[h], :, b * Hq + h] = P[b, h].sum(0)
    W = by_row.reshape(B, G, Tk, group, Tq).transpose(0, 1, 3, 4, 2).reshape(B, Hq, Tq, Tk)
    top = P.max(-1)
    rows = (top > 0) & np.isfinite(W).all(-1)
    lead = ("dk, dv: the weights the backward gives dv, read by calling it on one-hot dO (dv = Pᵀ dO is linear "
            "in dO: dO one-hot on a query slice, then on a query row, gives Pᵀ's column)")
    tolerance = _tolerance(ev)
    by_rows = ((MASKED_AS, lambda: _rows_masked_as(W, P, top, rows)),
               (ID, lambda: _keys_moved(W, P, top, rows, tolerance)),
               (ID, lambda: _keys(W, P, top, rows, tolerance))) if rows.any() else ()
    named, said = _first((ID, lambda: _slices_taken(by_slice, took, Hq)), *by_rows)
    if said is not None:
        return named, f"{lead}: {said}"
    if not rows.any() or (rows != (top > 0)).any() or not np.isfinite(by_slice).all():
        return None                               # rows it could not read
    return ID, (f"{lead}, are the reference's: the dK/dV pass weighs the right rows, the error lies in what it does "
                "with them (dO, D, q or the scale)")


def _first(*readings):
    """(id, words) of the first of ``readings`` ((id, a call giving words or None)) that says something,
    or (None, None)."""
    for named, reading in readings:
        said = reading()
        if said is not None:
            return named, said
    return None, None


def _dv_on(ev, dout):
    """The kernel's dv (B, Hkv, Tk, Dv) on the case's q, k, v with ``dout``, or None."""
    got = ev.caller.called_on({**ev.rounded, "dout": dout}, grads=True)
    dv = got.get("dv") if isinstance(got, dict) else None
    return dv if isinstance(dv, np.ndarray) and dv.shape == ev.rounded["v"].shape else None


def _slices_taken(got, took, Hq):
    """Words for the kv heads' keys whose dv takes dO from query slices other than their own
    group's, past `GIVEN` of the largest column sum; or None (their own heads' rows taken otherwise
    are the row reading's).  Where every slice but the first takes the query slice just before its
    own in memory (`_every_slice_but`), rows read before its start are said."""
    B, G = got.shape[:2]
    other = ~took.any(2, keepdims=True)                                       # (B, G, 1, slices): not its own
    off = other & (np.abs(got) > GIVEN * np.abs(took).max(initial=0.0))        # (B, G, Tk, slices)
    if not off.any():
        return None
    words, flagged, previous = [], [], True
    for b, g in zip(*np.nonzero(off.any((-1, -2)))):
        keys, src = np.nonzero(off[b, g].any(-1))[0], np.nonzero(off[b, g].any(0))[0]
        flagged.append(int(b * G + g))
        previous &= bool((src == b * Hq + g * (Hq // G) - 1).all())       # the query slice before its first
        words.append(f"(batch, kv head) ({b}, {g}) keys {ranges([int(j) for j in keys])} take the dO of query "
                     "(batch, head) " + ", ".join(f"({c // Hq}, {c % Hq})" for c in src[:LISTED]) +
                     (", ..." if len(src) > LISTED else ""))
    n = len(words)
    before = ("; each the query slice just before its own in memory ((batch, head) order): rows read before its "
              "slice's first row, a loop over query tiles started below row 0 (its start not clamped at 0)"
              if previous and _every_slice_but(flagged, B * G, last=False) else "")
    return (f"{n} of {B * G} (batch, kv head) slices take dO from the query rows of other slices (another batch "
            f"entry, head or group, or rows read past a slice's start): " + "; ".join(words[:LISTED]) +
            ("; ..." if n > LISTED else "") + before)


def _every_slice_but(found, slices, last):
    """Whether the (batch, kv head) slices ``found`` (their memory-order indices) are every one of
    ``slices`` but the last (``last``) or the first, of 3 or more: a read past each slice's end (or
    before its start) reaches the next (previous) one in every slice that has one."""
    return slices >= 3 and found == (list(range(slices - 1)) if last else list(range(1, slices)))


def _called(n, D, shape, mark, call):
    """``call(x)``'s answers, (..., n), for an x of ``shape`` one-hot on n things (slices, keys or
    rows), ``D`` of them a call, each on its own channel of x's last axis: ``mark(c, x)`` sets thing
    c's ones in a zero x; None where a call answers None."""
    parts = []
    for first in range(0, n, D):
        x = np.zeros(shape)
        for c in range(first, min(first + D, n)):
            mark(c, x)
        got = call(x)
        if got is None:
            return None
        parts.append(got[..., : min(D, n - first)])
    return np.concatenate(parts, -1)


def _out_on(ev, v):
    """The kernel's out (B, Hq, Tq, Dv) on the case's q, k with ``v``, or None."""
    got = ev.caller.forward_on({**ev.rounded, "v": v})
    return got if isinstance(got, np.ndarray) and got.ndim == 4 and got.shape[-1] == v.shape[-1] else None


def _other_slices(mass, own, rows, G):
    """Words for the rows weighing other slices' values past `GIVEN`, or None; where every slice but
    the last weighs the one just after it in memory (`_every_slice_but`), keys read past its end."""
    B, Hq = mass.shape[:2]
    other = mass.copy()
    np.put_along_axis(other, np.broadcast_to(own[:, :, None, None], mass.shape[:3] + (1,)), 0.0, -1)
    bad = rows & (np.abs(other).max(-1) > GIVEN)
    if not bad.any():
        return None
    words, flagged, following = [], set(), True
    for b, h in zip(*np.nonzero(bad.any(-1))):
        i = np.nonzero(bad[b, h])[0]
        read = np.abs(other[b, h, i]).sum(0)
        s = int(read.argmax())
        flagged.add(int(own[b, h]))
        following &= bool(s == own[b, h] + 1)                                # the kv slice after its own
        words.append(f"(batch, head) ({b}, {h}) rows {ranges([int(x) for x in i])} give "
                     f"{float(np.abs(other[b, h, i, s]).max()):.2g} of their weight to the values of (batch, "
                     f"kv head) ({s // G}, {s % G}), their own ({own[b, h] // G}, {own[b, h] % G})")
    n = len(words)
    after = ("; each the slice just after its own in memory ((batch, kv head) order): keys read past its slice's "
             "end, a last key tile loaded without its bound (its loads not masked at Tk)"
             if following and _every_slice_but(sorted(flagged), B * G, last=True) else "")
    return (f"{n} of {B * Hq} (batch, head) slices weigh the values of other slices (another sequence's pages, "
            f"batch entry or kv head): " + "; ".join(words[:LISTED]) + ("; ..." if n > LISTED else "") + after)


def _keys(W, P, top, rows, tolerance):
    """Words for the keys weighed otherwise than the reference weighs them, or None: keys given weight
    that the reference hides, keys given none that it weighs, and keys given both but whose scores
    differ.  A score is read as log W − log P up to one constant per row (its normaliser): the
    constant most of the row's keys share within ``tol``, and a key off it by more; only where both
    weights are past ``small`` of the row's largest (`_tolerance`)."""
    tol, small = tolerance
    scale, live = top[..., None], rows[..., None]
    hidden = live & (W > GIVEN * scale) & (P == 0)
    missed = live & (W <= GIVEN ** 2 * scale) & (P > small * scale)
    both = live & (W > small * scale) & (P > small * scale)
    d = np.where(both, np.log(np.where(both, W, 1.0)) - np.log(np.where(both, P, 1.0)), np.nan)
    c = _row_constant(d, tol)
    # a key off in most rows that weigh it is off in all: each row's constant again without such keys
    # (where a row's wrong keys outnumber its right ones and happen to agree within the tolerance)
    off_keys = (both & (np.abs(d - c) > tol)).sum((0, 1, 2)) > both.sum((0, 1, 2)) / 2
    kept = both & ~off_keys
    c = np.where(kept.any(-1, keepdims=True), _row_constant(np.where(kept, d, np.nan), tol), c)
    scored = both & (np.abs(d - c) > tol)
    words = []
    for what, bad in (("weigh keys the reference hides", hidden),
                      ("give no weight to keys the reference weighs", missed),
                      ("weigh keys whose scores differ from the reference's", scored)):
        if bad.any():
            keys = [int(j) for j in np.nonzero(bad.any((0, 1, 2)))[0]]
            words.append(f"{_rows(bad)} {what} (keys {ranges(keys)} in all; {_examples(bad, P)})")
    if scored.any():
        words[-1] += f", their scores off by up to {float(np.abs(d - c)[scored].max()):.2g}" + \
            _which_side(scored, both)
    return "; ".join(words) or None


def _which_side(scored, both):
    """': on each such row nearly every key it weighs (...)' where the scores that differ are whole
    rows' (a row's q, or its scale, read otherwise), ': each such key in nearly every row that weighs
    it (...)' where they are whole keys' (a key's k read otherwise); '' where neither or both."""
    rows = scored.any(-1)
    keys = scored.any((0, 1, 2))
    by_row = scored.sum(-1)[rows] >= SIDE * both.sum(-1)[rows]
    by_key = scored.sum((0, 1, 2))[keys] >= SIDE * both.sum((0, 1, 2))[keys]
    if by_row.all() == by_key.all():
        return ""
    if by_row.all():
        return ": on each such row nearly every key it weighs (the row's q, or its scale, read otherwise)"
    return ": each such key in nearly every row that weighs it (the key's k read otherwise)"


def _rows_masked_as(W, P, top, rows):
    """Words for each query row weighing the keys another row sees, row i + d's for one shift d ≠ 0, or
    None: the keys each row weighs (past `GIVEN` of its largest reference weight) all among those row
    i + d sees (none past the last row), and at least `AGREE` of the (row, key) pairs either weighs or
    row i + d sees weighed and seen (a tiled pass may skip a few blocks too) -- a mask built from another
    tile's rows (a row offset advanced before the mask is formed) -- the smallest |d| that holds, where
    the weights differ somewhere."""
    scale, live = top[..., None], rows[..., None]
    given = live & (W > GIVEN * scale)
    sees = P > 0
    if not (given != sees)[rows].any():
        return None
    Tq = P.shape[2]
    for d in sorted(range(1 - Tq, Tq), key=abs):
        if d == 0:
            continue
        other = np.zeros_like(sees)
        if d > 0:
            other[:, :, :Tq - d] = sees[:, :, d:]
        else:
            other[:, :, -d:] = sees[:, :, :Tq + d]
        if not (given & ~other).any() and (given & other).sum() >= AGREE * (given | other)[rows].sum():
            empty = [int(i) for i in np.nonzero((rows & ~given.any(-1)).any((0, 1)))[0]]
            past = f"; rows {ranges(empty)} weigh no key ({'past the last row' if d > 0 else 'before the first'})" \
                if empty else ""
            return (f"each query row i weighs the keys row i {'+' if d > 0 else '-'} {abs(d)} sees (every row read: "
                    f"masked as the row {abs(d)} {'later' if d > 0 else 'earlier'}{past}): a mask built from another "
                    "tile's rows, such as a row offset advanced (for the next tile's loads) before the mask is formed")
    return None


def _keys_moved(W, P, top, rows, tolerance):
    """Words for W's key columns being the reference's of other keys, or None: each key j whose
    column (over every row read) is not its own P's but another key's, k's, within the score's
    tolerance (`_tolerance`: a weight's relative error is its log's) of that column's largest --
    key j's value multiplied by key k's weight (v's rows, or P's columns, in another order) --
    every key's column matching some key's."""
    w, p = (x[rows] / top[rows][:, None] for x in (W, P))               # (rows read, Tk), each row's largest 1
    T = w.shape[1]
    if T < 2 or T * T * len(w) > MOVED_WORK:
        return None
    err = np.stack([np.abs(w[:, j:j + 1] - p).max(0) for j in range(T)])          # (Tk of W, Tk of P)
    size = np.maximum(w.max(0)[:, None], p.max(0)[None, :])
    err = np.where(size > 0, err / np.where(size > 0, size, 1.0), 0.0)
    best = err.argmin(1)
    within = tolerance[0]
    moved = [j for j in range(T) if best[j] != j and err[j, j] > within]
    if not moved or err[np.arange(T), best].max() > within:
        return None
    by_shift = {}
    for j in moved:
        by_shift.setdefault(int(best[j]) - j, []).append(j)
    shifts = sorted(by_shift.items(), key=lambda x: -len(x[1]))
    said = "; ".join(f"key j given key j {'+' if d > 0 else '-'} {abs(d)}'s on keys {ranges(keys)}"
                     for d, keys in shifts[:3]) + ("; ..." if len(shifts) > 3 else "")
    return (f"{len(moved)} of {T} keys are weighed as other keys are (each key's column of weights, over every "
            f"row, the reference's of another key: {said}): each such key's value multiplied by another key's "
            "weight, v's rows or P's columns in another order")


def _keys_mixed(W, P, top, rows, tolerance):
    """Words for W's key columns being sums of the reference's columns of other keys, or None: W = P M
    over every row read, M (Tk x Tk) of 0s and 1s (key k's weight put on value j where M[k, j] = 1),
    each value's column taken apart greedily (the reference column nearest what is left, while it
    brings it nearer, up to `MIXED` of them) and held to half the score's tolerance (`_tolerance`) of
    each row's largest weight, the reference's own weights past twice it -- a value tile's rows read
    at another offset (an index where an offset is meant), some values taken twice and some never."""
    w, p = (x[rows] / top[rows][:, None] for x in (W, P))               # (rows read, Tk), each row's largest 1
    T, within = w.shape[1], tolerance[0]
    if T < 2 or T * T * len(w) > MOVED_WORK or np.abs(p - w).max() <= 2 * within:
        return None                     # (a clear margin: the reference's own weights well outside the tolerance)
    M = np.zeros((T, T))
    for j in range(T):
        left = w[:, j].copy()
        for _ in range(MIXED):
            if np.abs(left).max() <= within / 2:
                break
            far = ((left[:, None] - p) ** 2).sum(0)                          # each reference column taken off
            k = int(far.argmin())
            if far[k] >= (left ** 2).sum() or M[k, j]:
                return None
            M[k, j], left = 1.0, left - p[:, k]
        if np.abs(left).max() > within / 2:
            return None
    seen = p.max(0) > within                                             # keys some row weighs past the tolerance
    own = np.diag(M) == 1
    shifts = {}
    for k, j in zip(*np.nonzero(M)):
        if k != j and seen[k]:
            shifts.setdefault(int(j) - int(k), []).append(int(k))
    if not shifts:
        return None                     # every key on its own value or on none: `_keys` says which it weighs
    by_shift = sorted(shifts.items(), key=lambda x: -len(x[1]))
    said = "; ".join(f"key k's weight on value k {'+' if d > 0 else '-'} {abs(d)} for keys {ranges(ks)}"
                     for d, ks in by_shift[:3]) + ("; ..." if len(by_shift) > 3 else "")
    unused = [int(j) for j in np.nonzero(seen & (M.sum(0) == 0))[0]]
    lost = [int(k) for k in np.nonzero(seen & ~own)[0]]
    twice = [int(j) for j in np.nonzero(M.sum(0) > 1)[0]]
    parts = [said] + ([f"the values of keys {ranges(unused)} given no weight"] if unused else []) + \
        ([f"keys {ranges(lost)} not weighing their own value"] if lost else []) + \
        ([f"values of keys {ranges(twice)} given several keys' weights"] if twice else [])
    return (f"each key's weight falls on other keys' values (W = P M over every row read, M of 0s and 1s: "
            f"{'; '.join(parts)}): v's rows read at other keys' places where P's are meant (a value tile sliced "
            "at an index where its offset is meant, or rows of v in another order)")


def _rows_scored_with(W, P, top, rows, tolerance, ev):
    """Words for rows scored with another vector in place of their own q, or None: where a row's scores
    differ (`_keys`), log W − log P = scale (x − q_i) · k_j + one constant per row, x a row of q, k or v
    of the same (batch, head) slice (a q tile loaded at other rows, or from a buffer that holds keys or
    values by then); every such row matched within the score's tolerance, each by its nearest vector,
    said by the vector's index relative to the row's.  Not with a softcap (scores not linear in q) or
    with q or k stored with a scale (FP8)."""
    r, opts = ev.rounded, ev.opts
    if opts.get("softcap") or {"q", "k"} & set(stored_inputs(ev.case)) or r["q"].ndim != 4:
        return None
    tol, small = tolerance
    scale, live = top[..., None], rows[..., None]
    both = live & (W > small * scale) & (P > small * scale)
    d = np.where(both, np.log(np.where(both, W, 1.0)) - np.log(np.where(both, P, 1.0)), np.nan)
    off = both & (np.abs(d - _row_constant(d, tol)) > tol)
    if not off.any():
        return None
    group = r["q"].shape[1] // r["k"].shape[1]
    k = np.repeat(r["k"], group, 1)
    pools = {"q": r["q"], "k": k}
    if r["v"].shape[-1] == r["q"].shape[-1]:
        pools["v"] = np.repeat(r["v"], group, 1)
    taken = {}
    for b, h, i in zip(*np.nonzero(off.any(-1))):
        seen = both[b, h, i]
        K, di, qi = k[b, h][seen], d[b, h, i, seen], r["q"][b, h, i]
        best = (np.inf, None)
        for name, pool in pools.items():
            res = opts["scale"] * (pool[b, h] - qi) @ K.T - di                 # (rows of the pool, keys seen)
            res = np.abs(res - res.mean(-1, keepdims=True)).max(-1)
            if name == "q":
                res[i] = np.inf
            j = int(res.argmin())
            if res[j] < best[0]:
                best = (res[j], (name, j - int(i)))
        if best[0] > tol:
            return None
        taken.setdefault(best[1], []).append(int(i))
    groups = sorted(taken.items(), key=lambda x: -len(x[1]))
    said = "; ".join(f"{'rows' if len(set(rows_)) > 1 else 'row'} {ranges(sorted(set(rows_)))} with {name}'s row "
                     + ("i" if shift == 0 else f"i {'+' if shift > 0 else '-'} {abs(shift)}")
                     for (name, shift), rows_ in groups[:3]) + ("; ..." if len(groups) > 3 else "")
    return (f"{_rows(off)} are scored with another vector in place of their own q (log W − log P = scale (x − q_i) · "
            f"k_j up to a constant per row: {said}): a q tile loaded at other rows, or from a buffer that holds k or v "
            "by then (shared memory reused before q is copied out)")


def _row_constant(d, tol):
    """(…, 1): for each row of ``d`` (NaN where not read), the middle of the window of width 2 ``tol``
    holding the most of its values; 0 for a row with none."""
    flat = d.reshape(-1, d.shape[-1])
    mid = np.zeros(len(flat))
    for r, x in enumerate(flat):
        x = np.sort(x[np.isfinite(x)])
        if x.size:
            end = np.searchsorted(x, x + 2 * tol, side="right")
            k = int(np.argmax(end - np.arange(x.size)))
            mid[r] = (x[k] + x[end[k] - 1]) / 2
    return mid.reshape(d.shape[:-1] + (1,))


def _rows(bad):
    """'query rows 16 .. 44 of 45 in every (batch, head)' for the rows holding a True of ``bad``."""
    B, H, R, _ = bad.shape
    per = bad.any(-1)
    slices = per.any(-1)
    where = "every (batch, head)" if slices.all() else \
        "(batch, head) " + ", ".join(f"({b}, {h})" for b, h in list(zip(*np.nonzero(slices)))[:LISTED]) + \
        (", ..." if slices.sum() > LISTED else "")
    return f"query rows {ranges([int(i) for i in np.nonzero(per.any((0, 1)))[0]])} of {R} in {where}"


def _examples(bad, P):
    """The first two rows of ``bad``, each with its keys and the reference's visible keys."""
    said = []
    for b, h, i in list(zip(*np.nonzero(bad.any(-1))))[:2]:
        seen = [int(j) for j in np.nonzero(P[b, h, i] > 0)[0]]
        said.append(f"row {i} of ({b}, {h}): keys {ranges([int(j) for j in np.nonzero(bad[b, h, i])[0]])}, "
                    f"its visible keys {ranges(seen) if seen else 'none'}")
    return "; ".join(said)


def _tolerance(ev):
    """(score, small): how far a score read from the weights may sit from the reference's in rounding
    alone, and below what share of its row's largest a weight is too small to read a score from.
    The weights are rounded once in the case's lowest precision (its dtype's, or FP8's where q, k or
    v are stored so), of unit roundoff u, and the scores accumulated in float32 (float64 in a float64
    case) over the head dim, of the case's largest |score|: the score `ROUNDOFFS` times both; small,
    `GIVEN` or 4 u^2 (FP8's e4m3 weights below 2^-6 are subnormal, their relative error past 2^-4)."""
    unit = lambda d: torch.finfo(getattr(torch, d)).eps / 2
    low = max(unit(d) for d in [ev.dtype] + [i.dtype for i in stored_inputs(ev.case).values()] if hasattr(torch, d))
    acc = unit("float64" if ev.dtype == "float64" else "float32")
    score = ROUNDOFFS * (low + acc * (1.0 + ev.logits) * np.sqrt(ev.rounded["k"].shape[-1]))
    return score, max(GIVEN, 4 * low ** 2)
