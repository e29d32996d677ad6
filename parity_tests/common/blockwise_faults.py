"""Mistakes only a blockwise attention code can make, as replacements for the small
helpers of ``numpy_ref.blockwise`` (NumPy only, so the NumPy-only tests use them too).

Each entry: name -> (helper replaced, make(original) -> replacement, what it breaks).
``parity_tests.common.faults`` registers them for ``--plant-fault``.

- max not updated: the running maximum stays at the first tile's.  Exact in
  theory (softmax(x) = softmax(x - c) for any c), so only scores that rise by
  more than ~709 (float64; ~88 in float32) over the first tile's show it: exp
  overflows.  The parity matrix has a large-input case for it.
- output not rescaled: acc keeps exp(S - m_old) terms when the maximum moves.
- L without m: the backward's P = exp(S - L) off by exp(m) per row.
- D from one tile: the chapter's softmax backward applied to each tile alone,
  sum(P * dP) of that tile instead of rowsum(dO * O) over the whole row.
- causal skip off by one: the last key tile a query tile sees (the diagonal
  one) skipped as if it were in the future.
"""

import numpy as np

__all__ = ["BLOCKWISE_FAULTS"]


def _max_not_updated(original):
    def _update_max(m, S):
        return np.where(np.isneginf(m), S.max(axis=-1), m)   # first tile's maximum, kept
    return _update_max


def _output_not_rescaled(original):
    def _rescale(acc, alpha):
        return acc                                       # forgets exp(m_old - m_new)
    return _rescale


def _lse_without_max(original):
    def _log_sum_exp(m, l):
        return np.log(l)                                 # L = log ℓ: the shift lost
    return _log_sum_exp


def _delta_from_one_tile(original):
    def _scores_grad(P, dP, D):
        return P * (dP - (P * dP).sum(axis=-1, keepdims=True))   # <w, g> of this tile only
    return _scores_grad


def _causal_skip_off_by_one(original):
    def _key_tiles(vis, q0, q1, B_c):
        tiles = original(vis, q0, q1, B_c)
        return tiles[:-1] if vis.right >= 0 else tiles     # causal: the diagonal tile dropped
    return _key_tiles


BLOCKWISE_FAULTS = {
    "blockwise-max-not-updated": (
        "_update_max", _max_not_updated,
        "blockwise running maximum kept from the first tile (exp overflows on rising scores)"),
    "blockwise-output-not-rescaled": (
        "_rescale", _output_not_rescaled,
        "blockwise partial output not rescaled when the maximum moves"),
    "blockwise-lse-without-max": (
        "_log_sum_exp", _lse_without_max, "blockwise L stored as log ℓ, without m"),
    "blockwise-delta-one-tile": (
        "_scores_grad", _delta_from_one_tile,
        "blockwise D taken from P ∘ dP of one tile instead of rowsum(dO ∘ O)"),
    "blockwise-causal-skip-off-by-one": (
        "_key_tiles", _causal_skip_off_by_one,
        "blockwise causal tile skip one tile short (the diagonal tile skipped)"),
}
