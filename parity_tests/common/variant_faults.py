"""Mistakes only a production variant shows, as replacements for the small pieces
of ``numpy_ref.variants`` and ``numpy_ref.reference`` (NumPy only).

Each entry: name -> (module or class, attribute replaced, make(original) ->
replacement, what it breaks).  ``parity_tests.common.faults`` registers them
for ``--plant-fault``; the parity matrix's variants family must fail each.
"""

import numpy as np

from numpy_ref import reference, variants

__all__ = ["VARIANT_FAULTS"]


def _gqa_repeat(original):
    def kv_head(h, num_q_heads, num_kv_heads):
        return h % num_kv_heads            # torch.repeat's order, not repeat_interleave's
    return kv_head


def _window_left_off_by_one(original):
    def lo(self, i):
        return original(self, i - 1)       # one key further left than the window allows
    return lo


def _softcap_no_derivative(original):
    def softcap_backward(dS, t):
        return dS                          # the 1 - tanh² factor left out
    return softcap_backward


def _alibi_sign_flipped(original):
    def alibi_forward(S, slope, rows, cols, offset):
        return original(S, -slope, rows, cols, offset)   # a reward for distance
    return alibi_forward


def _sink_not_in_dsinks(original):
    def sink_backward(p_sink, D):
        return np.zeros((), dtype=D.dtype)  # counted in the forward, no gradient
    return sink_backward


def _padding_key_seen(original):
    def _lengths(name, a, B, T):
        n = original(name, a, B, T)
        return np.minimum(n + 1, T) if name == "seqlens_k" else n   # one padding key read
    return _lengths


VARIANT_FAULTS = {
    "variant-gqa-repeat": (
        variants, "kv_head", _gqa_repeat,
        "GQA maps query head h to kv head h % Hkv (repeat) instead of h // (Hq/Hkv)"),
    "variant-window-left-off-by-one": (
        variants.Visibility, "lo", _window_left_off_by_one,
        "sliding window sees one key more on its left edge"),
    "variant-softcap-no-derivative": (
        variants, "softcap_backward", _softcap_no_derivative,
        "softcap backward leaves out 1 - tanh²(S/c)"),
    "variant-alibi-sign-flipped": (
        variants, "alibi_forward", _alibi_sign_flipped,
        "ALiBi adds slope·|i - j| instead of subtracting it"),
    "variant-sink-not-in-dsinks": (
        variants, "sink_backward", _sink_not_in_dsinks,
        "a sink counted in the softmax but given no gradient (dsinks = 0)"),
    "variant-padding-key-seen": (
        reference, "_lengths", _padding_key_seen,
        "the first padding key after seqlens_k is attended to"),
}
