"""Every bad input of the contract is refused with a message naming the argument,
and nothing half-updated is left behind."""

import numpy as np
import pytest

import numpy_ref as nr

X3 = np.zeros((2, 4, 3))

# name -> (call, exception, message pattern)
CONSTRUCTOR_CASES = {
    "v1 d_in zero": (lambda: nr.SelfAttention_v1(0, 2), ValueError, "d_in"),
    "v1 d_out negative": (lambda: nr.SelfAttention_v1(3, -1), ValueError, "d_out"),
    "v1 d_in float": (lambda: nr.SelfAttention_v1(3.0, 2), TypeError, "d_in"),
    "v2 d_out bool": (lambda: nr.SelfAttention_v2(3, True), TypeError, "d_out"),
    "v2 qkv_bias str": (lambda: nr.SelfAttention_v2(3, 2, "yes"), TypeError, "qkv_bias"),
    "v1 rng str": (lambda: nr.SelfAttention_v1(3, 2, rng="seed"), TypeError, "rng"),
    "causal context zero": (lambda: nr.CausalAttention(3, 2, 0, 0.0), ValueError, "context_length"),
    "causal dropout 1": (lambda: nr.CausalAttention(3, 2, 4, 1.01), ValueError, "dropout"),
    "causal dropout negative": (lambda: nr.CausalAttention(3, 2, 4, -0.1), ValueError, "dropout"),
    "causal dropout str": (lambda: nr.CausalAttention(3, 2, 4, "0.1"), TypeError, "dropout"),
    "wrapper heads zero": (lambda: nr.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 0), ValueError,
                           "num_heads"),
    "wrapper d_in zero": (lambda: nr.MultiHeadAttentionWrapper(0, 2, 4, 0.0, 2), ValueError,
                          "d_in"),
    "mha not divisible": (lambda: nr.MultiHeadAttention(3, 5, 4, 0.0, 2), ValueError,
                          "d_out must be divisible by num_heads"),
    "mha heads negative": (lambda: nr.MultiHeadAttention(3, 4, 4, 0.0, -2), ValueError,
                           "num_heads"),
    "mha dropout 1.5": (lambda: nr.MultiHeadAttention(3, 4, 4, 1.5, 2), ValueError, "dropout"),
}


@pytest.mark.parametrize("name", list(CONSTRUCTOR_CASES))
def test_bad_constructor_argument_refused(name):
    call, exc, match = CONSTRUCTOR_CASES[name]
    with pytest.raises(exc, match=match):
        call()


def modules():
    return {
        "simplified": nr.SimplifiedSelfAttention(),
        "v1": nr.SelfAttention_v1(3, 2, rng=0),
        "v2": nr.SelfAttention_v2(3, 2, rng=0),
        "causal": nr.CausalAttention(3, 2, 4, 0.5, rng=0),
        "wrapper": nr.MultiHeadAttentionWrapper(3, 2, 4, 0.5, 2, rng=0),
        "mha": nr.MultiHeadAttention(3, 4, 4, 0.5, 2, rng=0),
    }


# name -> (module key, x, extra kwargs, exception, message pattern)
FORWARD_CASES = {
    "simplified 3-D": ("simplified", X3, {}, ValueError, r"x must be 2-D"),
    "simplified int": ("simplified", np.ones((2, 3), dtype=int), {}, TypeError, "floating"),
    "v1 1-D": ("v1", np.zeros(3), {}, ValueError, r"x must be 2-D"),
    "v1 last dim": ("v1", np.zeros((4, 5)), {}, ValueError, "d_in=3"),
    "v2 3-D": ("v2", X3, {}, ValueError, r"x must be 2-D"),
    "v2 zero tokens": ("v2", np.zeros((0, 3)), {}, ValueError, "at least one token"),
    "causal 2-D": ("causal", np.zeros((4, 3)), {}, ValueError, r"x must be 3-D"),
    "causal last dim": ("causal", np.zeros((2, 4, 2)), {}, ValueError, "d_in=3"),
    "causal too long": ("causal", np.zeros((2, 5, 3)), {}, ValueError, "context_length=4"),
    "causal bool x": ("causal", X3.astype(bool), {}, TypeError, "floating"),
    "causal keep shape": ("causal", X3, {"keep_mask": np.ones((2, 4, 5), bool)}, ValueError,
                          "keep_mask"),
    "causal keep dtype": ("causal", X3, {"keep_mask": np.ones((2, 4, 4))}, TypeError,
                          "keep_mask"),
    "wrapper too long": ("wrapper", np.zeros((1, 6, 3)), {}, ValueError, "context_length"),
    "wrapper keep shape": ("wrapper", X3, {"keep_mask": np.ones((2, 4, 4), bool)}, ValueError,
                           r"keep_mask must have shape \(num_heads, batch"),
    "mha 4-D": ("mha", np.zeros((1, 2, 4, 3)), {}, ValueError, r"x must be 3-D"),
    "mha last dim": ("mha", np.zeros((2, 4, 4)), {}, ValueError, "d_in=3"),
    "mha keep shape": ("mha", X3, {"keep_mask": np.ones((2, 4, 4), bool)}, ValueError,
                       r"keep_mask must have shape \(batch, num_heads"),
}


def good_x(m):
    return np.random.default_rng(0).normal(size=(4, 3) if m.__class__.__name__ in (
        "SimplifiedSelfAttention", "SelfAttention_v1", "SelfAttention_v2") else (2, 3, 3))


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_bad_forward_refused_and_last_forward_kept(name):
    key, x, kwargs, exc, match = FORWARD_CASES[name]
    m = modules()[key].train("keep_mask" in kwargs)   # a keep_mask is read in training only
    good = good_x(m)
    out = m(good)
    dout = np.random.default_rng(1).normal(size=out.shape)
    dx = m.backward(dout)
    grads = {k: v.copy() for k, v in m.grads.items()}
    with pytest.raises(exc, match=match):
        m(x, **kwargs)
    np.testing.assert_array_equal(m.backward(dout), dx)        # cache of the good forward
    for k, v in m.grads.items():
        np.testing.assert_array_equal(v, grads[k])


@pytest.mark.parametrize("key", ["causal", "wrapper", "mha"])
def test_keep_mask_ignored_in_eval_mode(key):
    m = modules()[key].eval()
    x = good_x(m)
    np.testing.assert_array_equal(m(x, keep_mask=np.zeros((1, 1), bool)), m(x))


@pytest.mark.parametrize("key", list(modules()))
def test_backward_before_forward_refused(key):
    m = modules()[key]
    with pytest.raises(ValueError, match="before forward"):
        m.backward(np.zeros((4, 2)))


@pytest.mark.parametrize("key", list(modules()))
def test_grad_out_of_wrong_shape_or_type_refused(key):
    m = modules()[key]
    out = m(good_x(m))
    with pytest.raises(ValueError, match=r"grad_out must have the shape"):
        m.backward(np.zeros(out.shape + (1,)))
    with pytest.raises(TypeError, match="grad_out"):
        m.backward(np.zeros(out.shape, dtype=int))


def test_nan_in_x_propagates_not_refused():
    m = nr.CausalAttention(3, 2, 4, 0.0, rng=0)
    x = np.zeros((1, 3, 3))
    x[0, 0, 0] = np.nan
    assert np.isnan(m(x)).any()
