"""Each op of numpy_ref.ops: its backward against centred finite differences (float64,
random upstream gradient), and the softmax Jacobians against finite differences."""

import numpy as np
import pytest

from numpy_ref import ops
from parity_tests.common.finite_diff import eval_numerical_gradient_array, fd_jacobian, rel_error
from parity_tests.common.tolerances import FINITE_DIFF_BOUND as FD_BOUND


def rand(rng, *shape):
    return rng.normal(size=shape)


def check_op(forward, backward, inputs, rng):
    """Compare ``backward(dout, cache)`` with finite differences for every input."""
    out, cache = forward(*inputs)
    dout = rng.normal(size=out.shape)
    grads = backward(dout, cache)
    grads = grads if isinstance(grads, tuple) else (grads,)
    for i, (x, dx) in enumerate(zip(inputs, grads)):
        numeric = eval_numerical_gradient_array(lambda: forward(*inputs)[0], x, dout)
        err = rel_error(dx, numeric)
        assert err <= FD_BOUND, f"input {i}: relative error {err:.2e} > {FD_BOUND}"


def causal(T):
    return np.triu(np.ones((T, T), dtype=bool), k=1)


def masked_softmax_forward(attn_scores, mask):
    masked, mask_cache = ops.causal_mask_forward(attn_scores, mask)
    attn_weights = ops.softmax(masked)
    return attn_weights, (mask_cache, attn_weights)


def masked_softmax_backward(dout, cache):
    mask_cache, attn_weights = cache
    return ops.causal_mask_backward(ops.softmax_backward(attn_weights, dout), mask_cache)


OP_CASES = {
    "linear_v1": (ops.linear_v1_forward, ops.linear_v1_backward, [(2, 4, 3), (3, 5)]),
    "linear_v1_2d": (ops.linear_v1_forward, ops.linear_v1_backward, [(4, 3), (3, 2)]),
    "linear_bias_3d": (ops.linear_forward, ops.linear_backward, [(2, 4, 3), (5, 3), (5,)]),
    "linear_no_bias": (ops.linear_forward, lambda d, c: ops.linear_backward(d, c)[:2],
                       [(4, 3), (2, 3)]),
    "scores_scaled": (ops.scores_forward, ops.scores_backward, [(2, 3, 4, 5), (2, 3, 4, 5)]),
    "scores_cross": (ops.scores_forward, ops.scores_backward, [(3, 2), (5, 2)]),
    "scores_raw": (lambda q, k: ops.scores_forward(q, k, scaled=False),
                   ops.scores_backward, [(4, 3), (4, 3)]),
    "weighted_sum": (ops.weighted_sum_forward, ops.weighted_sum_backward,
                     [(2, 4, 5), (2, 5, 3)]),
    "split_heads": (lambda x: ops.split_heads_forward(x, 3), ops.split_heads_backward,
                    [(2, 4, 6)]),
    "merge_heads": (ops.merge_heads_forward, ops.merge_heads_backward, [(2, 3, 4, 2)]),
    # the mask's output holds -inf (inf - inf = nan in a difference): check it
    # through the softmax that always follows it
    "masked_softmax": (lambda s: masked_softmax_forward(s, causal(4)),
                       masked_softmax_backward, [(2, 4, 4)]),
    "dropout_fixed_mask": (lambda x: ops.dropout_forward(
                               x, np.arange(x.size).reshape(x.shape) % 3 != 0, 0.4),
                           ops.dropout_backward, [(3, 4)]),
    "concat_heads": (lambda a, b: ops.concat_heads_forward([a, b]),
                     lambda d, c: tuple(ops.concat_heads_backward(d, c)),
                     [(2, 3, 2), (2, 3, 1)]),
}


@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_backward_matches_finite_differences(name):
    forward, backward, shapes = OP_CASES[name]
    rng = np.random.default_rng(len(name))
    check_op(forward, backward, [rand(rng, *s) for s in shapes], rng)


def test_softmax_backward_matches_finite_differences():
    rng = np.random.default_rng(1)
    x = rand(rng, 2, 3, 5)
    fwd = lambda x: (ops.softmax(x), None)
    w = ops.softmax(x)
    check_op(fwd, lambda d, _: ops.softmax_backward(w, d), [x], rng)


def test_masked_scores_get_zero_gradient():
    rng = np.random.default_rng(2)
    mask = causal(5)
    masked, cache = ops.causal_mask_forward(rand(rng, 3, 5, 5), mask)
    assert np.all(np.isneginf(masked[:, mask]))
    dscores = ops.causal_mask_backward(rand(rng, 3, 5, 5), cache)
    assert np.all(dscores[:, mask] == 0)
    assert np.all(dscores[:, ~mask] != 0)


def test_split_then_merge_is_the_identity_and_heads_are_contiguous_slices():
    x = np.arange(2 * 3 * 6, dtype=float).reshape(2, 3, 6)
    heads, _ = ops.split_heads_forward(x, 2)                     # (B, H, T, D)
    assert heads.shape == (2, 2, 3, 3)
    np.testing.assert_array_equal(heads[:, 1], x[:, :, 3:6])    # head 1 = columns 3..5
    merged, _ = ops.merge_heads_forward(heads)
    np.testing.assert_array_equal(merged, x)


# -- Explicit Jacobians ---------------------------------------------------------


def test_softmax_jacobian_matches_finite_differences():
    x = np.random.default_rng(3).normal(size=(4, 6))
    J = ops.softmax_jacobian(ops.softmax(x))
    assert rel_error(J, fd_jacobian(ops.softmax, x)) <= FD_BOUND


def test_sum_normalize_jacobian_matches_finite_differences():
    x = np.random.default_rng(4).uniform(0.5, 2.0, size=(3, 5))  # positive scores
    J = ops.sum_normalize_jacobian(x)
    assert rel_error(J, fd_jacobian(ops.sum_normalize, x)) <= FD_BOUND


def test_softmax_backward_is_g_transpose_J():
    rng = np.random.default_rng(5)
    w = ops.softmax(rng.normal(size=(2, 3, 6)))
    g = rng.normal(size=w.shape)
    via_J = np.einsum("...i,...ij->...j", g, ops.softmax_jacobian(w))
    np.testing.assert_allclose(ops.softmax_backward(w, g), via_J, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_backward_into_its_upstream_gradient(axis):
    # out=grad_w overwrites grad_w only after <w, g> has been read from it
    rng = np.random.default_rng(6)
    w = ops.softmax(rng.normal(size=(2, 5, 4)), axis=axis)
    g = rng.normal(size=w.shape)
    expected = ops.softmax_backward(w, g, axis=axis)
    result = ops.softmax_backward(w, g, axis=axis, out=g)
    assert result is g
    np.testing.assert_allclose(result, expected, rtol=1e-14, atol=1e-16)


def test_softmax_jacobian_is_diag_w_minus_w_wT():
    w = ops.softmax(np.array([0.1, 1.0, -0.5]))
    np.testing.assert_allclose(ops.softmax_jacobian(w), np.diag(w) - np.outer(w, w),
                               rtol=0, atol=1e-16)


def test_softmax_is_stable_on_large_inputs():
    x = np.array([1000.0, 1001.0, 1002.0], dtype=np.float32)
    w = ops.softmax(x)
    assert np.all(np.isfinite(w))
    np.testing.assert_allclose(w, ops.softmax(np.array([0.0, 1.0, 2.0])), rtol=1e-6)


def test_softmax_naive_overflows_at_89_in_float32():
    x = np.array([89.0, 1.0], dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        w = ops.softmax_naive(x)
    assert np.isnan(w[0]), f"expected inf/inf = nan, got {w}"
    assert np.all(np.isfinite(ops.softmax(x)))


# -- Dropout ----------------------------------------------------------------------


def test_dropout_survivors_scaled_exactly_and_dropped_are_zero():
    p = 0.3
    rng = np.random.default_rng(6)
    x = rng.uniform(0.1, 1.0, size=(5, 7)).astype(np.float32)
    keep = ops.draw_keep_mask(rng, x.shape, p)
    out, cache = ops.dropout_forward(x, keep, p)
    assert out.dtype == np.float32
    scale = np.float32(1.0 / (1.0 - p))
    np.testing.assert_array_equal(out[keep], x[keep] * scale)
    assert np.all(out[~keep] == 0)
    dout = rng.normal(size=x.shape).astype(np.float32)
    dx = ops.dropout_backward(dout, cache)
    np.testing.assert_array_equal(dx[keep], dout[keep] * scale)
    assert np.all(dx[~keep] == 0)


def test_drawn_keep_mask_keeps_a_fraction_consistent_with_1_minus_p():
    binomtest = pytest.importorskip("scipy.stats").binomtest
    for p in (0.1, 0.5, 0.8):
        keep = ops.draw_keep_mask(np.random.default_rng(7), (100, 100), p)
        result = binomtest(int(keep.sum()), keep.size, 1 - p)
        assert result.pvalue > 1e-6, f"p={p}: kept {keep.mean():.4f}, pvalue {result.pvalue:.1e}"
