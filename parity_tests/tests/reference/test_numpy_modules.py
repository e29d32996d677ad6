"""The six NumPy modules: hand-written backward vs finite differences (float64, random
upstream gradient) for the input and every parameter, one row per case; dtypes;
the chapter's numbers that need no PyTorch."""

import numpy as np
import pytest

import numpy_ref as nr
from numpy_ref import ops
from parity_tests.common import chapter_values as cv
from parity_tests.common.finite_diff import gradient_errors
from parity_tests.common.tolerances import FINITE_DIFF_BOUND as FD_BOUND
from parity_tests.common.tolerances import FLOAT64_BOUND, FLOOR_ULPS, UNIT_ROUNDOFF

# name -> (factory, x shape, keep_mask shape or None)
# keep_mask shapes: Causal (B, T, T), MHA (B, H, T, T), Wrapper (H, B, T, T)
FD_CASES = {
    "simplified_one_token": (lambda: nr.SimplifiedSelfAttention(), (1, 3), None),
    "simplified_6x3": (lambda: nr.SimplifiedSelfAttention(), (6, 3), None),
    "simplified_dim_1": (lambda: nr.SimplifiedSelfAttention(), (4, 1), None),
    "v1_one_token": (lambda: nr.SelfAttention_v1(3, 2, rng=0), (1, 3), None),
    "v1_3_to_2": (lambda: nr.SelfAttention_v1(3, 2, rng=1), (6, 3), None),
    "v1_2_to_5": (lambda: nr.SelfAttention_v1(2, 5, rng=2), (4, 2), None),
    "v1_d_out_1": (lambda: nr.SelfAttention_v1(3, 1, rng=3), (4, 3), None),
    "v2_no_bias": (lambda: nr.SelfAttention_v2(3, 2, rng=4), (6, 3), None),
    "v2_bias": (lambda: nr.SelfAttention_v2(3, 2, True, rng=5), (5, 3), None),
    "v2_bias_one_token": (lambda: nr.SelfAttention_v2(4, 4, True, rng=6), (1, 4), None),
    "causal_one_token": (lambda: nr.CausalAttention(3, 2, 4, 0.0, rng=7), (1, 1, 3), None),
    "causal_short_seq_batch": (lambda: nr.CausalAttention(3, 2, 6, 0.0, rng=8), (2, 4, 3), None),
    "causal_bias_d_out_1": (lambda: nr.CausalAttention(2, 1, 5, 0.0, True, rng=9), (3, 5, 2), None),
    "causal_dropout_mask": (lambda: nr.CausalAttention(3, 4, 5, 0.5, True, rng=10),
                            (2, 5, 3), (2, 5, 5)),
    "wrapper_2_heads": (lambda: nr.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2, rng=11),
                        (2, 6, 3), None),
    "wrapper_d_out_1_bias": (lambda: nr.MultiHeadAttentionWrapper(3, 1, 4, 0.0, 2, True, rng=12),
                             (1, 3, 3), None),
    "wrapper_dropout_mask": (lambda: nr.MultiHeadAttentionWrapper(2, 2, 4, 0.3, 3, True, rng=13),
                             (2, 4, 2), (3, 2, 4, 4)),
    "mha_2_heads": (lambda: nr.MultiHeadAttention(3, 4, 6, 0.0, 2, rng=14), (2, 6, 3), None),
    "mha_head_dim_1": (lambda: nr.MultiHeadAttention(3, 4, 5, 0.0, 4, True, rng=15),
                       (2, 3, 3), None),
    "mha_one_head_one_token": (lambda: nr.MultiHeadAttention(2, 3, 3, 0.0, 1, rng=16),
                               (3, 1, 2), None),
    "mha_dropout_mask": (lambda: nr.MultiHeadAttention(4, 6, 5, 0.4, 2, True, rng=17),
                         (2, 5, 4), (2, 2, 5, 5)),
}


def build_case(name):
    factory, x_shape, keep_shape = FD_CASES[name]
    rng = np.random.default_rng(list(FD_CASES).index(name))
    m = factory()
    x = rng.normal(size=x_shape)
    keep_mask = None if keep_shape is None else rng.random(keep_shape) >= 0.4
    out = m(x) if keep_mask is None else m(x, keep_mask)
    return m, x, rng.normal(size=out.shape), keep_mask


@pytest.mark.parametrize("name", list(FD_CASES))
def test_backward_matches_finite_differences(name):
    m, x, dout, keep_mask = build_case(name)
    errors = gradient_errors(m, x, dout, keep_mask)
    assert list(errors) == ["input"] + [n for n, _ in m.named_parameters()]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= FD_BOUND, f"{name}: {worst} relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("cls", [nr.SelfAttention_v2, nr.CausalAttention, nr.MultiHeadAttention])
def test_key_bias_gradient_is_zero(cls):
    """Adding b to every key adds q.b to a whole row of scores; the softmax ignores it."""
    args = (3, 4) if cls is nr.SelfAttention_v2 else (3, 4, 5, 0.0)
    args += (2,) if cls is nr.MultiHeadAttention else ()
    m = cls(*args, qkv_bias=True, rng=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3) if cls is nr.SelfAttention_v2 else (2, 5, 3))
    out = m(x)
    m.backward(rng.normal(size=out.shape))
    assert np.max(np.abs(m.grads["W_key.bias"])) < 1e-12 * np.max(np.abs(m.grads["W_key.weight"]))


# -- dtypes -------------------------------------------------------------------------

DTYPE_CASES = {
    "simplified": (lambda: nr.SimplifiedSelfAttention(), (4, 3)),
    "v1": (lambda: nr.SelfAttention_v1(3, 2, rng=0), (4, 3)),
    "v2": (lambda: nr.SelfAttention_v2(3, 2, True, rng=0), (4, 3)),
    "causal": (lambda: nr.CausalAttention(3, 2, 4, 0.5, True, rng=0), (2, 4, 3)),
    "wrapper": (lambda: nr.MultiHeadAttentionWrapper(3, 2, 4, 0.5, 2, rng=0), (2, 4, 3)),
    "mha": (lambda: nr.MultiHeadAttention(3, 4, 4, 0.5, 2, True, rng=0), (2, 4, 3)),
}


@pytest.mark.parametrize("name", list(DTYPE_CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_computation_in_the_dtype_of_x(name, dtype):
    factory, x_shape = DTYPE_CASES[name]
    m = factory()                                  # parameters are float32
    x = np.random.default_rng(0).normal(size=x_shape).astype(dtype)
    out = m(x)
    dx = m.backward(np.random.default_rng(1).normal(size=out.shape))
    assert out.dtype == dtype and dx.dtype == dtype
    assert all(g.dtype == dtype for g in m.grads.values()), {k: g.dtype for k, g in m.grads.items()}


@pytest.mark.parametrize("name", list(DTYPE_CASES))
def test_float32_close_to_float64_golden(name):
    factory, x_shape = DTYPE_CASES[name]
    m = factory().eval()
    x = np.random.default_rng(1).normal(size=x_shape)
    golden = m(x)                                  # float32 weights, float64 compute
    # normwise, within the float32 floor of parity_tests.tolerances (measured: ~2 u)
    bound = FLOOR_ULPS["float32"] * UNIT_ROUNDOFF["float32"]
    assert np.abs(m(x.astype(np.float32)) - golden).max() <= bound * np.abs(golden).max()


# -- the chapter's numbers that need no PyTorch ------------------------------------


def test_simplified_attention_prints_the_chapters_context_vectors():
    out = nr.SimplifiedSelfAttention()(np.array(cv.INPUTS, dtype=np.float32))
    np.testing.assert_allclose(out, cv.SIMPLE_ALL_CONTEXT_VECS, rtol=0, atol=cv.PRINTED_ATOL)


def test_exercise_3_1_v2_weights_transposed_into_v1_give_the_same_output():
    v2 = nr.SelfAttention_v2(3, 2, rng=789)
    v1 = nr.SelfAttention_v1(3, 2, rng=0)
    v1.load_state_dict({name: v2.state_dict()[f"{name}.weight"].T for name in
                        ("W_query", "W_key", "W_value")})
    x = np.array(cv.INPUTS)
    np.testing.assert_allclose(v1(x), v2(x), rtol=1e-14, atol=0)


def test_mha_equals_the_wrapper_with_stacked_weights_and_identity_out_proj():
    """Head h of MultiHeadAttention is columns h*D..(h+1)*D of one projection."""
    wrapper = nr.MultiHeadAttentionWrapper(3, 2, 5, 0.3, 3, True, rng=0)
    mha = nr.MultiHeadAttention(3, 6, 5, 0.3, 3, True, rng=1)
    w = wrapper.state_dict()
    sd = {"mask": w["heads.0.mask"], "out_proj.weight": np.eye(6), "out_proj.bias": np.zeros(6)}
    for layer in ("W_query", "W_key", "W_value"):
        for part in ("weight", "bias"):
            sd[f"{layer}.{part}"] = np.concatenate([w[f"heads.{h}.{layer}.{part}"] for h in range(3)])
    mha.load_state_dict(sd)
    x = np.random.default_rng(2).normal(size=(2, 4, 3))
    keep = np.random.default_rng(3).random((2, 3, 4, 4)) >= 0.3    # (B, H, T, T)
    # the same float32 weights, both computed in float64: agreement to rounding
    np.testing.assert_allclose(mha(x, keep), wrapper(x, keep.transpose(1, 0, 2, 3)),
                               rtol=FLOAT64_BOUND, atol=FLOAT64_BOUND)


def test_causal_output_of_token_i_ignores_later_tokens():
    m = nr.CausalAttention(3, 2, 6, 0.0, rng=0)
    x = np.random.default_rng(0).normal(size=(1, 6, 3))
    changed = x.copy()
    changed[:, 4:] += 10.0
    np.testing.assert_array_equal(m(x)[:, :4], m(changed)[:, :4])


def test_simplified_backward_sums_three_paths_into_x():
    """Freeze two of the three roles of x and the gradient changes: all three count."""
    rng = np.random.default_rng(0)
    x, dout = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    m = nr.SimplifiedSelfAttention()
    m(x)
    dx = m.backward(dout)
    w = ops.softmax(x @ x.T)
    dw = dout @ x.T
    ds = ops.softmax_backward(w, dw)
    paths = {"queries": ds @ x, "keys": ds.T @ x, "values": w.T @ dout}
    np.testing.assert_allclose(dx, sum(paths.values()), rtol=1e-13)
    for name, path in paths.items():
        assert np.max(np.abs(dx - path)) > 1e-3, f"dx equals the {name} path alone"


# -- the finite-difference helper itself ----------------------------------------------


def test_finite_differences_refuse_a_module_drawing_dropout_masks():
    m = nr.CausalAttention(3, 2, 4, 0.5, rng=0)                 # training, p > 0, no keep_mask
    x = np.random.default_rng(0).normal(size=(1, 4, 3))
    with pytest.raises(ValueError, match="not deterministic"):
        gradient_errors(m, x, np.ones((1, 4, 2)))
    assert max(gradient_errors(m.eval(), x, np.ones((1, 4, 2))).values()) <= FD_BOUND


def test_finite_differences_leave_the_module_untouched():
    m = nr.MultiHeadAttention(3, 4, 4, 0.0, 2, True, rng=0)
    before = m.state_dict()
    x = np.random.default_rng(0).normal(size=(1, 3, 3))
    gradient_errors(m, x, np.random.default_rng(1).normal(size=(1, 3, 4)))
    for key, value in m.state_dict().items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, before[key])
