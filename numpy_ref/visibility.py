"""Which keys query i sees: the one definition every mask of the project uses.

A query row ``i`` and a key row ``j`` of one (batch, head).  Query ``i`` has a
diagonal ``a = i + offset``, where the alignment decides the offset::

    alignment_offset(tq, tk, "top-left")     = 0         (SDPA's is_causal)
    alignment_offset(tq, tk, "bottom-right") = tk − tq   (FlashAttention's)

(with per-batch lengths, ``tq`` and ``tk`` are that batch's lengths).  A
window ``(left, right)`` (FlashAttention's ``window_size``; −1 unbounded on
that side; causal is right = 0) and the lengths ``nq``, ``nk`` then say::

    query i sees key j  iff  i < nq  and  j < nk  and  a − left ≤ j ≤ a + right

``Visibility`` answers it for one (batch, head) tile by tile (the blockwise
loops ask it which keys a tile of queries may see, and for the tile's mask);
``visible_mask`` builds the whole (tq, tk) boolean from the same object.
"""

import functools

import numpy as np

__all__ = ["ALIGNMENTS", "alignment_offset", "window_sides", "Visibility", "visible_mask"]

ALIGNMENTS = ("top-left", "bottom-right")


def alignment_offset(tq, tk, align):
    """Query i's diagonal is key ``i + offset``: 0 top-left, ``tk − tq`` bottom-right."""
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    return int(tk) - int(tq) if align == "bottom-right" else 0


def window_sides(causal, window):
    """(left, right) keys around the diagonal, −1 unbounded; causal sets right = 0.
    ``window`` is None or a pair of ints ≥ −1."""
    left, right = (-1, -1) if window is None else window
    return int(left), (0 if causal else int(right))


class Visibility:
    """Which keys each query of one (batch, head) sees.

    Query ``i`` (``i < nq``) sees key ``j`` iff ``lo(i) ≤ j ≤ hi(i)``::

        lo(i) = max(0, i + offset − left)       (0 if left = −1: unbounded)
        hi(i) = min(nk − 1, i + offset + right)  (nk − 1 if right = −1)

    Padding queries (``i ≥ nq``) see nothing (``hi = −1``).  ``lo`` and ``hi``
    never decrease with ``i``, so a tile of rows [q0, q1) can only see keys in
    ``[lo(q0), hi(last real row)]``: a tile loop visits only those, and a tile
    whose every query sees every key of it needs no mask."""

    def __init__(self, nq, nk, offset=0, left=-1, right=-1):
        self.nq, self.nk, self.offset = int(nq), int(nk), int(offset)
        self.left, self.right = int(left), int(right)

    def lo(self, i):
        """First key row(s) ``i`` may see."""
        return np.maximum(i + self.offset - self.left, 0) if self.left >= 0 else i * 0

    def hi(self, i):
        """Last key row(s) ``i`` may see (inclusive; below ``lo`` when none)."""
        last = self.nk - 1
        h = np.minimum(i + self.offset + self.right, last) if self.right >= 0 else i * 0 + last
        return np.where(i < self.nq, h, -1)

    def key_range(self, q0, q1):
        """Keys [k_lo, k_hi) that some query of [q0, q1) sees (empty: k_lo >= k_hi)."""
        last_real = min(q1, self.nq) - 1
        if last_real < q0:
            return 0, 0
        return int(self.lo(q0)), int(self.hi(last_real)) + 1

    def mask(self, q0, q1, k0, k1):
        """(q1 − q0, k1 − k0) bool: True where query i sees key j."""
        rows, cols = np.arange(q0, q1), np.arange(k0, k1)
        return (cols[None, :] >= self.lo(rows)[:, None]) & (cols[None, :] <= self.hi(rows)[:, None])

    def tile_mask(self, q0, q1, k0, k1):
        """None when every query of [q0, q1) sees every key of [k0, k1) (no mask to
        build or apply); else `mask`, read-only.  A tile of real rows and keys has the
        mask of every tile as far from the diagonal (`_band`): built once, not per tile."""
        if q1 <= self.nq and self.lo(q1 - 1) <= k0 and self.hi(q0) >= k1 - 1:
            return None
        if q1 <= self.nq and k1 <= self.nk:
            return _band(q0 + self.offset - k0, self.left, self.right, q1 - q0, k1 - k0)
        return self.mask(q0, q1, k0, k1)


@functools.lru_cache(maxsize=64)
def _band(d, left, right, rows, cols):
    """(rows, cols) bool, read-only: row i sees column j iff ``i + d − left ≤ j ≤ i + d + right``
    (a side of −1 unbounded).  `Visibility.mask` of a tile of real rows and keys, whose
    ``d = q0 + offset − k0``: the clipping of ``lo`` to 0 and of ``hi`` to ``nk − 1`` cannot
    matter for keys inside [0, nk)."""
    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    seen = np.ones((rows, cols), dtype=bool)
    if left >= 0:
        seen &= j >= i + d - left
    if right >= 0:
        seen &= j <= i + d + right
    seen.flags.writeable = False
    return seen


def visible_mask(tq, tk, *, causal=False, align="top-left", window=None,
                 seqlen_q=None, seqlen_k=None):
    """(tq, tk) bool, True where query i sees key j: `Visibility` over the whole
    head.  ``seqlen_q`` / ``seqlen_k`` (default tq / tk) are the real lengths,
    the offset is theirs (``seqlen_k − seqlen_q`` bottom-right)."""
    nq = tq if seqlen_q is None else int(seqlen_q)
    nk = tk if seqlen_k is None else int(seqlen_k)
    left, right = window_sides(causal, window)
    vis = Visibility(nq, nk, alignment_offset(nq, nk, align), left, right)
    return vis.mask(0, tq, 0, tk)
