"""numpy_ref.visibility: the one answer to "which keys does query i see", against
the contract's sentence written out element by element, and the tile questions
(key_range, tile_mask) consistent with the whole mask."""

import itertools

import numpy as np
import pytest

from numpy_ref import Visibility, alignment_offset, visible_mask
from numpy_ref.visibility import window_sides


def contract_mask(tq, tk, causal, align, window, nq, nk):
    """The contract, one (i, j) at a time: i < nq, j < nk, and with a = i + offset,
    a − left ≤ j ≤ a + right (−1 unbounded; causal: right = 0)."""
    offset = nk - nq if align == "bottom-right" else 0
    left, right = window or (-1, -1)
    right = 0 if causal else right
    seen = np.zeros((tq, tk), dtype=bool)
    for i, j in itertools.product(range(tq), range(tk)):
        a = i + offset
        seen[i, j] = (i < nq and j < nk and (left < 0 or j >= a - left)
                      and (right < 0 or j <= a + right))
    return seen


CASES = [(tq, tk, causal, align, window, nq, nk)
         for tq, tk in [(5, 5), (3, 7), (7, 3)]
         for causal in (False, True)
         for align in ("top-left", "bottom-right")
         for window in (None, (2, 1), (0, -1), (-1, 2))
         for nq, nk in [(tq, tk), (tq - 1, tk - 2)]]


@pytest.mark.parametrize("tq,tk,causal,align,window,nq,nk", CASES)
def test_visible_mask_is_the_contract_sentence(tq, tk, causal, align, window, nq, nk):
    got = visible_mask(tq, tk, causal=causal, align=align, window=window,
                       seqlen_q=nq, seqlen_k=nk)
    assert got.dtype == bool and got.shape == (tq, tk)
    assert np.array_equal(got, contract_mask(tq, tk, causal, align, window, nq, nk))


@pytest.mark.parametrize("tq,tk,causal,align,window,nq,nk", CASES[::3])
def test_the_tile_questions_agree_with_the_whole_mask(tq, tk, causal, align, window, nq, nk):
    """key_range covers every key a tile's queries see; tile_mask is None only for
    a tile seen whole, and otherwise is the mask's own tile."""
    whole = contract_mask(tq, tk, causal, align, window, nq, nk)
    vis = Visibility(nq, nk, alignment_offset(nq, nk, align), *window_sides(causal, window))
    for q0, q1 in [(0, 2), (1, min(4, tq)), (2, tq), (0, tq)]:
        k_lo, k_hi = vis.key_range(q0, q1)
        seen_cols = np.flatnonzero(whole[q0:q1].any(axis=0))
        if seen_cols.size:
            assert k_lo <= seen_cols[0] and seen_cols[-1] < k_hi
        else:
            assert k_lo >= k_hi
        for k0, k1 in [(0, 2), (1, tk), (0, tk)]:
            tile = vis.tile_mask(q0, q1, k0, k1)
            expected = whole[q0:q1, k0:k1]
            assert expected.all() if tile is None else np.array_equal(tile, expected)


def test_alignment_offsets_and_a_bad_align_is_refused():
    assert alignment_offset(3, 7, "top-left") == 0
    assert alignment_offset(3, 7, "bottom-right") == 4
    assert alignment_offset(7, 3, "bottom-right") == -4
    with pytest.raises(ValueError, match="align must be one of"):
        alignment_offset(3, 7, "center")
    with pytest.raises(ValueError, match="align must be one of"):
        visible_mask(3, 7, causal=True, align="bottom")


def test_the_chapter_mask_is_the_top_left_causal_one():
    assert np.array_equal(visible_mask(6, 6, causal=True), ~np.triu(np.ones((6, 6), bool), 1))


def test_a_tile_mask_built_once_per_distance_from_the_diagonal_is_the_tile_of_the_whole_mask():
    """tile_mask's cached band (one per distance from the diagonal, read-only) on random heads
    and tiles: lengths, offsets and windows that clip at the first and last keys included."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        tq, tk = rng.integers(1, 40, size=2)
        causal, align = bool(rng.integers(2)), ("top-left", "bottom-right")[rng.integers(2)]
        window = None if rng.integers(3) == 0 else tuple(int(x) for x in rng.integers(-1, 12, size=2))
        nq, nk = int(rng.integers(0, tq + 1)), int(rng.integers(0, tk + 1))
        whole = contract_mask(tq, tk, causal, align, window, nq, nk)
        vis = Visibility(nq, nk, alignment_offset(nq, nk, align), *window_sides(causal, window))
        q0, k0 = int(rng.integers(0, tq)), int(rng.integers(0, tk))
        q1, k1 = int(rng.integers(q0 + 1, tq + 1)), int(rng.integers(k0 + 1, tk + 1))
        tile = vis.tile_mask(q0, q1, k0, k1)
        expected = whole[q0:q1, k0:k1]
        assert expected.all() if tile is None else np.array_equal(tile, expected), (tq, tk, causal, align, window, nq, nk, q0, q1, k0, k1)
        if tile is not None and q1 <= nq and k1 <= nk:                 # the cached band: shared, read-only
            assert not tile.flags.writeable
