"""What the NumPy modules promise beyond the maths: state between forward and
backward, repeated backwards, softmax edge cases, bad arguments.  NumPy only."""

import numpy as np
import pytest

import numpy_ref as nr

# name -> (factory taking dropout, x shape, keep_mask shape or None)
MODULES = {
    "simplified": (lambda p: nr.SimplifiedSelfAttention(rng=0), (4, 3), None),
    "v1": (lambda p: nr.SelfAttention_v1(3, 2, rng=0), (4, 3), None),
    "v2": (lambda p: nr.SelfAttention_v2(3, 2, True, rng=0), (4, 3), None),
    "causal": (lambda p: nr.CausalAttention(3, 2, 5, p, True, rng=0), (2, 4, 3), (2, 4, 4)),
    "wrapper": (lambda p: nr.MultiHeadAttentionWrapper(3, 2, 5, p, 2, True, rng=0),
                (2, 4, 3), (2, 2, 4, 4)),
    "mha": (lambda p: nr.MultiHeadAttention(3, 4, 5, p, 2, True, rng=0), (2, 4, 3), (2, 2, 4, 4)),
    "fast": (lambda p: _fast(nr.FastMultiHeadAttention(3, 4, 5, p, 2, True, rng=0)),
             (2, 4, 3), (2, 2, 4, 4)),
}
DTYPES = [np.float32, np.float64]


def _fast(m):
    m.block_size = 2            # two blocks on 4 tokens: the blocked path
    return m


def _inputs(name, dtype, seed=1):
    """x, a random upstream gradient and a keep-mask (or None) for module ``name``."""
    factory, x_shape, mask_shape = MODULES[name]
    rng = np.random.default_rng(seed)
    m = factory(0.5)
    x = rng.standard_normal(x_shape).astype(dtype)
    out_shape = m(x).shape
    grad_out = rng.standard_normal(out_shape).astype(dtype)
    keep = None if mask_shape is None else rng.random(mask_shape) >= 0.5
    return x, grad_out, keep


def _run(name, dtype, between=lambda m, x, keep: None):
    """forward, ``between(m, x, keep)``, backward -> (dx, grads)."""
    x, grad_out, keep = _inputs(name, dtype)
    m = MODULES[name][0](0.5)
    m(x) if keep is None else m(x, keep)
    between(m, x, keep)
    dx = m.backward(grad_out)
    return dx, {k: g.copy() for k, g in m.grads.items()}


def _assert_same(a, b):
    (dx_a, grads_a), (dx_b, grads_b) = a, b
    np.testing.assert_array_equal(dx_a, dx_b)
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        np.testing.assert_array_equal(grads_a[k], grads_b[k], err_msg=k)


# --- forward then backward: the backward differentiates what the forward saw --------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODULES)
def test_changing_x_in_place_after_forward_changes_no_gradient(name, dtype):
    def bump(m, x, keep):
        x += 1.0
        x *= 2.0
    _assert_same(_run(name, dtype), _run(name, dtype, bump))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [n for n in MODULES if n != "simplified"])
def test_changing_parameters_in_place_after_forward_changes_no_gradient(name, dtype):
    """The same for every input dtype: the parameters are taken at forward."""
    def step(m, x, keep):
        for _, p in m.named_parameters():
            p -= 0.5                            # an optimiser step taken too early
    _assert_same(_run(name, dtype), _run(name, dtype, step))


@pytest.mark.parametrize("name", [n for n in MODULES if MODULES[n][2] is not None])
def test_changing_keep_mask_in_place_after_forward_is_refused(name):
    def flip(m, x, keep):
        keep[(0,) * keep.ndim] ^= True          # one entry
    x, grad_out, keep = _inputs(name, np.float64)
    m = MODULES[name][0](0.5)
    m(x, keep)
    before = {k: g.copy() for k, g in m.grads.items()}
    flip(m, x, keep)
    with pytest.raises(ValueError, match="keep_mask.*changed"):
        m.backward(grad_out)
    assert m.grads.keys() == before.keys()      # nothing half-updated
    for child in getattr(m, "heads", []):
        assert child.grads == {}


@pytest.mark.parametrize("name", [n for n in MODULES if MODULES[n][2] is not None])
def test_a_keep_mask_changed_and_restored_is_accepted(name):
    def flip_twice(m, x, keep):
        keep[(0,) * keep.ndim] ^= True
        keep[(0,) * keep.ndim] ^= True
    _assert_same(_run(name, np.float64), _run(name, np.float64, flip_twice))


@pytest.mark.parametrize("name", MODULES)
def test_changing_the_returned_output_in_place_changes_no_gradient(name):
    x, grad_out, keep = _inputs(name, np.float64)
    results = []
    for scribble in (False, True):
        m = MODULES[name][0](0.5)
        out = m(x) if keep is None else m(x, keep)
        if scribble:
            out[...] = 7.0
        results.append((m.backward(grad_out), dict(m.grads)))
    _assert_same(*results)


# --- backward twice: grads are overwritten, never accumulated -----------------------

@pytest.mark.parametrize("name", MODULES)
def test_a_second_backward_overwrites_grads(name):
    x, grad_out, keep = _inputs(name, np.float64)
    m = MODULES[name][0](0.5)
    m(x) if keep is None else m(x, keep)
    dx_2 = m.backward(2.0 * grad_out)
    grads_2 = {k: g.copy() for k, g in m.grads.items()}
    dx_1 = m.backward(grad_out)
    np.testing.assert_allclose(dx_2, 2.0 * dx_1, rtol=1e-13, atol=0)
    for k, g in grads_2.items():
        np.testing.assert_allclose(g, 2.0 * m.grads[k], rtol=1e-13, atol=0, err_msg=k)
    _assert_same((m.backward(grad_out), dict(m.grads)), (dx_1, dict(m.grads)))


# --- public knobs --------------------------------------------------------------------

@pytest.mark.parametrize("value, error", [(-1, ValueError), (0, ValueError),
                                          (2.5, TypeError), (True, TypeError),
                                          ("4", TypeError)])
def test_fast_block_size_is_a_positive_int(value, error):
    m = nr.FastMultiHeadAttention(3, 4, 5, 0.0, 2, rng=0)
    x = np.ones((1, 4, 3))
    m(x)
    cache = m._cache
    with pytest.raises(error, match="block_size"):
        m.block_size = value
        m(x)
    assert m._cache is cache                    # the refused forward left no trace


@pytest.mark.parametrize("value, error", [(-0.1, ValueError), (1.5, ValueError),
                                          (float("nan"), ValueError), ("0.1", TypeError)])
def test_dropout_set_after_construction_is_checked_at_forward(value, error):
    m = nr.MultiHeadAttention(3, 4, 5, 0.0, 2, rng=0)
    m.dropout = value
    with pytest.raises(error, match="dropout"):
        m(np.ones((1, 4, 3)))


# --- softmax_backward writing over one of its inputs -------------------------------

@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_backward_out_may_be_w_or_grad_w(axis):
    rng = np.random.default_rng(0)
    w = nr.softmax(rng.standard_normal((3, 5)), axis=axis)
    g = rng.standard_normal((3, 5))
    expected = nr.softmax_backward(w, g, axis=axis)
    for target in ("w", "grad_w"):
        w_, g_ = w.copy(), g.copy()
        out = w_ if target == "w" else g_
        got = nr.softmax_backward(w_, g_, axis=axis, out=out)
        assert got is out
        np.testing.assert_allclose(got, expected, rtol=1e-14, atol=1e-16, err_msg=target)


def test_softmax_backward_refuses_an_out_of_another_shape():
    w = nr.softmax(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="out"):
        nr.softmax_backward(w, w, out=np.empty((3, 2)))
    with pytest.raises(TypeError, match="out"):
        nr.softmax_backward(w, w, out=np.empty((2, 3), dtype=np.int64))


# --- the softmax family on N-D input, along every axis --------------------------------

def _softmax_1d(v):
    e = np.exp(v - v.max())
    return e / e.sum()


AXES = [0, 1, 2, -1, -2, -3]


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("fn", [nr.softmax, nr.softmax_naive])
def test_softmax_along_each_axis_of_3d_input(fn, axis):
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    got = fn(x, axis=axis)
    np.testing.assert_allclose(got, np.apply_along_axis(_softmax_1d, axis, x), rtol=1e-14)
    np.testing.assert_allclose(got.sum(axis=axis), 1.0, rtol=1e-14)


@pytest.mark.parametrize("fn", [nr.softmax, nr.softmax_naive, nr.sum_normalize])
def test_default_axis_is_the_last_on_2d_input(fn):
    x = np.random.default_rng(1).random((3, 5)) + 0.5
    np.testing.assert_allclose(fn(x).sum(axis=-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(fn(x), fn(x, axis=1), rtol=0)


@pytest.mark.parametrize("axis", AXES)
def test_sum_normalize_along_each_axis_of_3d_input(axis):
    x = np.random.default_rng(2).random((2, 3, 4)) + 0.5
    expected = np.apply_along_axis(lambda v: v / v.sum(), axis, x)
    np.testing.assert_allclose(nr.sum_normalize(x, axis=axis), expected, rtol=1e-14)


@pytest.mark.parametrize("axis", AXES)
def test_softmax_backward_along_each_axis_matches_the_jacobian(axis):
    rng = np.random.default_rng(3)
    w = nr.softmax(rng.standard_normal((2, 3, 4)), axis=axis)
    g = rng.standard_normal(w.shape)
    # move the axis last, contract with J = diag(w) - w w^T, move it back
    w_last, g_last = np.moveaxis(w, axis, -1), np.moveaxis(g, axis, -1)
    jac = nr.softmax_jacobian(w_last)                            # (..., n, n)
    expected = np.moveaxis(np.einsum("...i,...ij->...j", g_last, jac), -1, axis)
    np.testing.assert_allclose(nr.softmax_backward(w, g, axis=axis), expected,
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("jacobian, forward, positive", [
    (nr.softmax_jacobian, nr.softmax, False),
    (nr.sum_normalize_jacobian, nr.sum_normalize, True),
])
def test_jacobians_of_nd_input_are_the_jacobians_of_each_row(jacobian, forward, positive):
    """Each (n, n) slice against central differences of the forward on that row."""
    rng = np.random.default_rng(4)
    x = rng.random((2, 3, 4)) + 0.5 if positive else rng.standard_normal((2, 3, 4))
    arg = forward(x) if jacobian is nr.softmax_jacobian else x
    jac = jacobian(arg)                                          # (2, 3, 4, 4)
    assert jac.shape == (2, 3, 4, 4)
    h = 1e-6
    for idx in np.ndindex(2, 3):
        for j in range(4):
            step = np.zeros(4)
            step[j] = h
            column = (forward(x[idx] + step) - forward(x[idx] - step)) / (2 * h)
            np.testing.assert_allclose(jac[idx][:, j], column, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("fn", [nr.softmax, nr.softmax_naive, nr.sum_normalize])
@pytest.mark.parametrize("shape, axis", [((2, 0), -1), ((0, 3), 0), ((2, 0, 3), 1)])
def test_an_empty_axis_gives_an_empty_result(fn, shape, axis):
    out = fn(np.empty(shape), axis=axis)           # as torch.softmax on an empty dim
    assert out.shape == shape


@pytest.mark.parametrize("shape, axis", [((2, 0), -1), ((0, 3), 0)])
def test_softmax_backward_and_jacobians_on_an_empty_axis(shape, axis):
    empty = np.empty(shape)
    assert nr.softmax_backward(empty, empty, axis=axis).shape == shape
    assert nr.softmax_jacobian(np.empty((2, 0))).shape == (2, 0, 0)
    assert nr.sum_normalize_jacobian(np.empty((2, 0))).shape == (2, 0, 0)


@pytest.mark.parametrize("fn", [nr.softmax, nr.softmax_naive, nr.sum_normalize])
def test_an_axis_out_of_range_is_refused_naming_axis(fn):
    with pytest.raises(ValueError, match="axis"):
        fn(np.ones((2, 3)), axis=2)


# --- bad arguments name themselves ---------------------------------------------------

class Unreadable:
    """Stands for an object NumPy cannot convert (a tensor that requires grad, say)."""

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("cannot be read")


@pytest.mark.parametrize("seed", [-1, -(2**40)])
def test_a_negative_rng_seed_is_refused_naming_rng(seed):
    with pytest.raises(ValueError, match="rng"):
        nr.SelfAttention_v1(3, 2, rng=seed)


@pytest.mark.parametrize("mode", ["False", "", 0, 1, None, 1.0])
@pytest.mark.parametrize("name", MODULES)
def test_train_takes_a_bool_only(name, mode):
    m = MODULES[name][0](0.5).eval()
    with pytest.raises(TypeError, match="mode"):
        m.train(mode)
    assert m.training is False
    assert all(c.training is False for c in m._children.values())
    assert m.train(np.bool_(True)).training is True


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("bad, error, what", [
    (Unreadable(), TypeError, "cannot be read"),
    ([[[1.0, 2.0, 3.0], [1.0, 2.0]]], ValueError, "rectangular"),
])
def test_unreadable_or_ragged_x_is_refused_naming_x(name, bad, error, what):
    m = MODULES[name][0](0.5)
    with pytest.raises(error, match=f"^x .*{what}"):
        m(bad)


def test_unreadable_or_ragged_grad_out_and_keep_mask_are_refused_by_name():
    m = nr.CausalAttention(3, 2, 5, 0.5, rng=0)
    x = np.ones((1, 2, 3))
    with pytest.raises(TypeError, match="^keep_mask "):
        m(x, Unreadable())
    with pytest.raises(ValueError, match="^keep_mask .*rectangular"):
        m(x, [[[True, False], [True]]])
    m(x)
    with pytest.raises(TypeError, match="^grad_out "):
        m.backward(Unreadable())
    with pytest.raises(ValueError, match="^grad_out .*rectangular"):
        m.backward([[[1.0, 2.0], [1.0]]])


@pytest.mark.parametrize("fn", [nr.softmax, nr.softmax_naive, nr.sum_normalize,
                                nr.softmax_jacobian, nr.sum_normalize_jacobian])
def test_softmax_family_names_an_unreadable_or_ragged_argument(fn):
    arg = "w" if fn is nr.softmax_jacobian else "x"
    with pytest.raises(TypeError, match=f"^{arg} "):
        fn(Unreadable())
    with pytest.raises(ValueError, match=f"^{arg} .*rectangular"):
        fn([[1.0, 2.0], [1.0]])
    with pytest.raises(TypeError, match="^grad_w "):
        nr.softmax_backward(np.ones(2), Unreadable())


# --- dropout = 1.0, as nn.Dropout(1.0): every weight dropped in training -------------

@pytest.mark.parametrize("name", ["causal", "wrapper", "mha", "fast"])
def test_dropout_one_drops_every_weight_in_training(name):
    x, grad_out, keep = _inputs(name, np.float64)
    m = MODULES[name][0](1.0)
    for given in (None, np.ones_like(keep)):    # even a mask keeping everything
        out = m(x, given)
        dx = m.backward(grad_out)
        if name in ("mha", "fast"):             # only out_proj's bias is left
            np.testing.assert_array_equal(out, np.broadcast_to(m._parameters["out_proj.bias"],
                                                               out.shape))
        else:
            np.testing.assert_array_equal(out, 0.0)
        np.testing.assert_array_equal(dx, 0.0)
        for k, g in m.grads.items():
            if not k.startswith("out_proj"):
                np.testing.assert_array_equal(g, 0.0, err_msg=k)
    m.eval()
    np.testing.assert_allclose(m(x), MODULES[name][0](0.0).eval()(x), rtol=0)


def test_dropout_op_with_p_one_gives_zeros_and_passes_no_gradient():
    x = np.arange(6.0).reshape(2, 3)
    out, cache = nr.ops.dropout_forward(x, np.ones((2, 3), dtype=bool), 1.0)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(nr.ops.dropout_backward(np.ones((2, 3)), cache), 0.0)
