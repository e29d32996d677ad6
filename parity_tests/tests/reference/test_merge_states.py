"""numpy_ref.merge_states and its hand-derived backward: finite differences, the
union of key ranges in ring and tree order against reference_attention on every
key, empty partials (lse -inf, out NaN or garbage), large lse, planted faults and
bad input.  (The PyTorch autograd witness is tests/mirror/test_merge_autograd.py.)"""

import numpy as np
import pytest

from numpy_ref import merge as merge_mod
from numpy_ref import merge_states, merge_states_backward, reference_attention
from parity_tests.common.finite_diff import eval_numerical_gradient_array
from parity_tests.common.tolerances import FINITE_DIFF_BOUND, VARIANTS_FLOAT64_BOUND

SHAPE = (2, 3, 4, 5)                     # (B, H, T, D)


def rel(a, ref):
    """Normwise relative error; NaN anywhere is infinitely wrong."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(a).all():
        return np.inf
    return np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-300)


def draw_states(seed, shape=SHAPE, spread=3.0):
    rng = np.random.default_rng(seed)
    out_a, out_b = rng.standard_normal(shape), rng.standard_normal(shape)
    lse_a, lse_b = spread * rng.standard_normal(shape[:-1]), spread * rng.standard_normal(shape[:-1])
    dout, dlse = rng.standard_normal(shape), rng.standard_normal(shape[:-1])
    return [out_a, lse_a, out_b, lse_b], dout, dlse


def fd_grads(args, dout, dlse, skip=()):
    """Centred differences of L = Σ out·dout + Σ lse·dlse for each input (None for ``skip``)."""
    upstream = np.concatenate([dout.ravel(), dlse.ravel()])

    def f():
        out, lse = merge_states(*args)
        return np.concatenate([out.ravel(), lse.ravel()])
    return [None if i in skip else eval_numerical_gradient_array(f, args[i], upstream)
            for i in range(4)]


def dense_merge(out_a, lse_a, out_b, lse_b):
    """The formula as written, for finite inputs: logaddexp and the weights."""
    lse = np.logaddexp(lse_a, lse_b)
    w_a, w_b = np.exp(lse_a - lse), np.exp(lse_b - lse)
    return w_a[..., None] * out_a + w_b[..., None] * out_b, lse


# ----------------------------------------------------------------------------
# The formula and the backward

@pytest.mark.parametrize("seed", range(3))
def test_backward_matches_finite_differences(seed):
    args, dout, dlse = draw_states(seed)
    got = merge_states_backward(dout, dlse, *args)
    for name, g, fd in zip(("dout_a", "dlse_a", "dout_b", "dlse_b"), got, fd_grads(args, dout, dlse)):
        assert rel(g, fd) < FINITE_DIFF_BOUND, (name, rel(g, fd))


def test_forward_is_the_dense_formula_and_shift_invariant():
    args, _, _ = draw_states(3)
    out, lse = merge_states(*args)
    ref_out, ref_lse = dense_merge(*args)
    assert rel(out, ref_out) < VARIANTS_FLOAT64_BOUND and rel(lse, ref_lse) < VARIANTS_FLOAT64_BOUND
    # scores shifted by c shift every lse by c and leave out alone: no overflow at |lse| ~ 1e3
    for c in (800.0, -800.0, 1e4):
        shifted = [args[0], args[1] + c, args[2], args[3] + c]
        out_c, lse_c = merge_states(*shifted)
        assert rel(out_c, out) < VARIANTS_FLOAT64_BOUND, c
        assert np.abs(lse_c - c - lse).max() <= 1e-12 * abs(c), c


def test_weights_are_a_two_way_softmax_with_the_chapters_jacobian():
    """dlse_a = w_a (<dout, out_a - out> + dlse): with out_a = out_b the first term
    vanishes and what is left is logaddexp's derivative, w_a dlse."""
    args, dout, dlse = draw_states(4)
    args[2] = args[0]
    w_a = np.exp(args[1] - np.logaddexp(args[1], args[3]))
    dout_a, dlse_a, dout_b, dlse_b = merge_states_backward(dout, dlse, *args)
    assert rel(dlse_a, w_a * dlse) < VARIANTS_FLOAT64_BOUND
    assert rel(dout_a + dout_b, dout) < VARIANTS_FLOAT64_BOUND


# ----------------------------------------------------------------------------
# Partials cut from one attention, merged back in ring and tree order

def attention_and_cuts(seed, B=2, H=2, Tq=7, Tk=23, D=6, Dv=4, causal=True):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((B, H, Tq, D)), rng.standard_normal((B, H, Tk, D))
    v = rng.standard_normal((B, H, Tk, Dv))
    # a causal mask as a -inf bias, so that some rows see no key of some ranges
    bias = np.zeros((1, 1, Tq, Tk))
    if causal:
        bias = np.where(np.arange(Tk) > np.arange(Tq)[:, None] + 4, -np.inf, 0.0)[None, None]
    n = int(rng.integers(2, 9))
    cuts = np.sort(np.concatenate([[0, Tk], rng.integers(0, Tk + 1, n - 1)])).tolist()
    return q, k, v, bias, cuts


@pytest.mark.parametrize("order", merge_mod.ORDERS)
@pytest.mark.parametrize("seed", range(6))
def test_merged_partials_are_the_attention_over_all_keys(seed, order):
    q, k, v, bias, cuts = attention_and_cuts(seed, causal=seed % 2 == 0)
    whole = reference_attention(q, k, v, bias=bias)
    states = merge_mod.split_states(q, k, v, cuts, bias=bias)
    out, lse = merge_mod.merge_many(states, order)
    assert rel(out, whole["out"]) < VARIANTS_FLOAT64_BOUND, cuts
    assert rel(lse, whole["lse"]) < VARIANTS_FLOAT64_BOUND, cuts


def test_merging_is_associative_and_commutative():
    q, k, v, bias, _ = attention_and_cuts(10)
    states = merge_mod.split_states(q, k, v, [0, 5, 11, 23], bias=bias)
    ring = merge_mod.merge_many(states, "ring")
    backwards = merge_mod.merge_many(states[::-1], "ring")
    right = merge_states(*states[0], *merge_states(*states[1], *states[2]))
    for other in (backwards, right):
        assert rel(other[0], ring[0]) < VARIANTS_FLOAT64_BOUND
        assert rel(other[1], ring[1]) < VARIANTS_FLOAT64_BOUND


@pytest.mark.parametrize("order", merge_mod.ORDERS)
def test_backward_of_many_merges_matches_finite_differences(order):
    q, k, v, bias, _ = attention_and_cuts(11, Tq=3, Tk=9, D=3, Dv=2, B=1)
    states = [tuple(s) for s in merge_mod.split_states(q, k, v, [0, 2, 5, 7, 9], bias=bias)]
    rng = np.random.default_rng(0)
    dout, dlse = rng.standard_normal(states[0][0].shape), rng.standard_normal(states[0][1].shape)
    grads = merge_mod.merge_many_backward(dout, dlse, states, order)
    upstream = np.concatenate([dout.ravel(), dlse.ravel()])
    flat = [a for s in states for a in s]

    def f():
        out, lse = merge_mod.merge_many([(flat[2 * i], flat[2 * i + 1]) for i in range(len(states))], order)
        return np.concatenate([out.ravel(), lse.ravel()])
    for i, x in enumerate(flat):
        if np.isneginf(x).any() or np.isnan(x).any():
            continue
        fd = eval_numerical_gradient_array(f, x, upstream)
        assert rel(grads[i // 2][i % 2], fd) < FINITE_DIFF_BOUND, (order, i)


# ----------------------------------------------------------------------------
# Empty partials

@pytest.mark.parametrize("garbage", [np.nan, np.inf, 1e30])
def test_an_empty_partial_contributes_nothing_forward_and_backward(garbage):
    args, dout, dlse = draw_states(5)
    empty = np.zeros(SHAPE[:-1], bool)
    empty[0, 1, 2] = empty[1, 0, :] = True
    args[1] = np.where(empty, -np.inf, args[1])
    args[0] = np.where(empty[..., None], garbage, args[0])
    with np.errstate(all="raise"):
        out, lse = merge_states(*args)
        grads = merge_states_backward(dout, dlse, *args)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert np.array_equal(out[empty], args[2][empty]) and np.array_equal(lse[empty], args[3][empty])
    assert all(np.isfinite(g).all() for g in grads)
    assert not grads[0][empty].any() and not grads[1][empty].any()        # the empty side: 0
    assert np.array_equal(grads[2][empty], dout[empty])                    # the other: out = out_b
    assert np.array_equal(grads[3][empty], dlse[empty])
    # elsewhere the finite differences hold (the empty side's out is held fixed)
    args[0] = np.where(empty[..., None], 0.0, args[0])
    fd = fd_grads(args, dout, dlse, skip=(1,))
    for i in (0, 2, 3):
        assert rel(grads[i], fd[i]) < FINITE_DIFF_BOUND, i


def test_both_empty_gives_out_0_lse_minus_inf_and_no_gradient():
    args, dout, dlse = draw_states(6)
    args = [np.full(SHAPE, np.nan), np.full(SHAPE[:-1], -np.inf)] * 2
    with np.errstate(all="raise"):
        out, lse = merge_states(*args)
        grads = merge_states_backward(dout, dlse, *args)
    assert not out.any() and np.isneginf(lse).all()
    assert all(not g.any() for g in grads)


def test_float32_stays_float32_and_close():
    args, dout, dlse = draw_states(7)
    got = merge_states(*(a.astype(np.float32) for a in args))
    ref = merge_states(*args)
    assert all(g.dtype == np.float32 for g in got)
    assert rel(got[0], ref[0]) < 1e-6 and rel(got[1], ref[1]) < 1e-6


# ----------------------------------------------------------------------------
# Planted faults fail the comparisons above

def _no_centring(out_x, out, empty):              # the -out term of dlse dropped
    return np.where(empty[..., None], 0, out_x)


def _no_rescale(lse_a, lse_b):                     # alpha = exp(lse - m), never normalised
    m = np.maximum(lse_a, lse_b)
    return np.exp(lse_a - m), np.exp(lse_b - m), np.logaddexp(lse_a, lse_b)


def test_dropping_the_minus_out_term_fails_the_finite_differences(monkeypatch):
    args, dout, dlse = draw_states(0)
    fd = fd_grads(args, dout, dlse)
    monkeypatch.setattr(merge_mod, "_centred", _no_centring)
    got = merge_states_backward(dout, dlse, *args)
    assert rel(got[1], fd[1]) > 1e-3 and rel(got[3], fd[3]) > 1e-3


def test_forgetting_the_normalisation_fails_the_union(monkeypatch):
    q, k, v, bias, _ = attention_and_cuts(1)
    whole = reference_attention(q, k, v, bias=bias)
    monkeypatch.setattr(merge_mod, "_weights", _no_rescale)
    out, _ = merge_mod.merge_many(merge_mod.split_states(q, k, v, [0, 4, 9, 23], bias=bias))
    assert rel(out, whole["out"]) > 1e-3


# ----------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("which, bad, error, name", [
    (0, np.zeros((2, 3, 4)), ValueError, "out_a"),
    (2, np.zeros((2, 3, 4, 6)), ValueError, "out_b"),
    (1, np.zeros((2, 3, 5)), ValueError, "lse_a"),
    (3, np.zeros((2, 3)), ValueError, "lse_b"),
    (2, np.zeros(SHAPE, np.float32), TypeError, "out_b"),
    (1, np.zeros(SHAPE[:-1], np.float32), TypeError, "lse_a"),
    (3, np.zeros(SHAPE[:-1], np.int64), TypeError, "lse_b"),
])
def test_bad_input_is_refused_naming_the_argument(which, bad, error, name):
    args, dout, dlse = draw_states(8)
    args[which] = bad
    with pytest.raises(error, match=name):
        merge_states(*args)
    with pytest.raises(error, match=name):
        merge_states_backward(dout, dlse, *args)


def test_bad_upstream_gradients_are_refused():
    args, dout, dlse = draw_states(9)
    with pytest.raises(ValueError, match="dout"):
        merge_states_backward(dout[..., :2], dlse, *args)
    with pytest.raises(ValueError, match="dlse"):
        merge_states_backward(dout, dlse[..., :2], *args)
    with pytest.raises(ValueError, match="order"):
        merge_mod.merge_many([tuple(args[:2]), tuple(args[2:])], "star")
    with pytest.raises(ValueError, match="states"):
        merge_mod.merge_many([tuple(args[:2])])


def test_inputs_are_not_modified():
    args, dout, dlse = draw_states(10)
    copies = [a.copy() for a in args + [dout, dlse]]
    merge_states(*args)
    merge_states_backward(dout, dlse, *args)
    assert all(np.array_equal(a, c) for a, c in zip(args + [dout, dlse], copies))
