"""Where a tensor's error sits: the location signature every failing tensor gets.

In the terms of a kernel's loops -- batches, heads, rows (query rows for out, lse and dq;
key rows for dk and dv), head-dim channels, the last partial tile of a loop -- whatever
the cause, so that "what is wrong, and where" has its second half even when no mistake of
the catalogue matches.  Also whether the error is *spread* (no place of its own): only
such an error may be read by its size alone (a lower precision, a growth with length).
"""

import numpy as np

from parity_tests.kernels.features import INPUT_GRADS

__all__ = ["locate", "ranges", "exact_zeros", "zero_channels", "TILES", "SPREAD_SHARE"]

TILES = (16, 32, 64, 128, 256)
# An error "spread" over a tensor: its median row holds at least this share of the worst
# row's error (a bug in one place leaves most rows at rounding level, far below).
SPREAD_SHARE = 0.02


def locate(n, a, ref, den, bound):
    """(signature, spread, map): where tensor ``n``'s error exceeds its bound, said in the
    terms of a kernel's loops -- batches, heads, rows (query rows for out, lse, dq; key rows
    for dk, dv), head-dim channels, the last partial tile of a loop -- whatever the cause."""
    over = np.abs(a - ref) / den
    over = np.where(np.isfinite(over), over, np.inf)            # (B, H, R, C)
    bad = over > bound
    error_map = over.max(axis=3).transpose(2, 0, 1).reshape(over.shape[2], -1) / bound   # (R, B H)
    if not bad.any():
        return "", False, error_map
    kind = "key rows" if n in ("dk", "dv") else f"{n[1:]} rows" if n in INPUT_GRADS else "query rows"
    B, H, R, C = bad.shape
    parts = []
    batches, heads = np.nonzero(bad.any(axis=(1, 2, 3)))[0], np.nonzero(bad.any(axis=(0, 2, 3)))[0]
    rows, channels = np.nonzero(bad.any(axis=(0, 1, 3)))[0], np.nonzero(bad.any(axis=(0, 1, 2)))[0]
    if len(batches) < B:
        parts.append(f"only batch entries {ranges(list(map(int, batches)))} of {B}")
    if len(heads) < H:
        parts.append(f"only heads {ranges(list(map(int, heads)))} of {H}")
    if len(rows) == 1 and R > 1:
        parts.append(f"only {kind[:-1]} {int(rows[0])} of {R}")
    elif len(rows) < R:
        where = f"confined to {kind} {ranges(list(map(int, rows)))} of {R}"
        r0 = int(rows[0])
        tile = next((t for t in TILES if r0 % t == 0 and R - r0 < t and r0), None)
        if tile and len(rows) == R - r0:
            where += f": the last partial tile (tiles of {tile} or a larger power of two)"
        parts.append(where)
    if n != "lse" and n not in INPUT_GRADS and C > 1 and len(channels) < C:
        parts.append(f"only head-dim channels {ranges(list(map(int, channels)))} of {C}")

    by_row = over.max(axis=(0, 1, 3))
    active = by_row[(np.abs(ref).max(axis=(0, 1, 3)) > 0) | (by_row > 0)]   # rows some query reads
    spread = bool(active.size and np.isfinite(active).all() and np.median(active) >= SPREAD_SHARE * active.max())
    parts = parts or [f"spread over every batch, head and {kind[:-1]}"]
    zeros = [exact_zeros(a, ref, kind)] + ([zero_channels(a, ref)] if n != "lse" and n not in INPUT_GRADS else [])
    return "; ".join(parts + [z for z in zeros if z]), spread, error_map


def exact_zeros(a, ref, kind):
    """"exactly 0 on query rows 0 .. 31 (the reference is not): one tile of 32" where some rows
    (not all) of ``a`` are exactly zero and the reference's are not, or ""."""
    zero = ((a == 0).all(axis=3) & (np.abs(ref) > 0).any(axis=3)).any(axis=(0, 1))      # (R,)
    rows = [int(r) for r in np.nonzero(zero)[0]]
    if not rows or len(rows) == a.shape[2]:
        return ""
    said = f"exactly 0 on {kind} {ranges(rows)} of {a.shape[2]} (the reference is not)"
    width = len(rows)
    if rows == list(range(rows[0], rows[0] + width)) and width in TILES and rows[0] % width == 0:
        said += f": one tile of {width}"
    return said


def zero_channels(a, ref):
    """"exactly 0 on head-dim channels 32 .. 39 of 40 (the reference is not): those past the
    first 32" where some head-dim channels (not all) of ``a`` are exactly zero on every row of
    a (batch, head) slice whose reference is not: a head-dim block never written, or rounded
    down to a power of two; or ""."""
    zero = ((a == 0).all(axis=2) & (np.abs(ref) > 0).any(axis=2)).any(axis=(0, 1))      # (C,)
    channels = [int(c) for c in np.nonzero(zero)[0]]
    if not channels or len(channels) == a.shape[3]:
        return ""
    said = f"exactly 0 on head-dim channels {ranges(channels)} of {a.shape[3]} (the reference is not)"
    first = channels[0]
    if channels == list(range(first, a.shape[3])) and first & (first - 1) == 0:
        said += f": those past the first {first}"
    return said


def ranges(indices):
    """'0 .. 89' / '3, 7 .. 9' for sorted distinct ints (at most four pieces, then '...')."""
    pieces, start = [], indices[0]
    for a, b in zip(indices, indices[1:] + [None]):
        if b != a + 1:
            pieces.append(f"{start}" if start == a else f"{start} .. {a}")
            start = b
    return ", ".join(pieces[:4]) + (", ..." if len(pieces) > 4 else "")
