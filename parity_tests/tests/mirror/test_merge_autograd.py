"""numpy_ref.merge_states against PyTorch: a dense formula (torch.logaddexp and the
weights) differentiated by autograd, with a random upstream gradient on out and
lse; and the whole attention merged from key ranges against SDPA's."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from numpy_ref import merge as merge_mod
from numpy_ref import merge_states, merge_states_backward
from parity_tests.common.tolerances import VARIANTS_FLOAT64_BOUND


def rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return np.inf if not np.isfinite(a).all() else np.abs(a - ref).max() / np.abs(ref).max()


def dense_torch(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - lse), torch.exp(lse_b - lse)
    return w_a[..., None] * out_a + w_b[..., None] * out_b, lse


def autograd_case(seed, shape=(2, 4, 9, 16), spread=4.0, shift=0.0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape), spread * rng.standard_normal(shape[:-1]) + shift,
              rng.standard_normal(shape), spread * rng.standard_normal(shape[:-1]) + shift]
    dout, dlse = rng.standard_normal(shape), rng.standard_normal(shape[:-1])
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, lse = dense_torch(*leaves)
    grads = torch.autograd.grad((out, lse), leaves, (torch.tensor(dout), torch.tensor(dlse)))
    return arrays, dout, dlse, (out.detach().numpy(), lse.detach().numpy()), [g.numpy() for g in grads]


@pytest.mark.parametrize("seed, shift", [(0, 0.0), (1, 0.0), (2, 500.0), (3, -500.0)])
def test_forward_and_backward_match_autograd(seed, shift):
    arrays, dout, dlse, (t_out, t_lse), t_grads = autograd_case(seed, shift=shift)
    out, lse = merge_states(*arrays)
    assert rel(out, t_out) < VARIANTS_FLOAT64_BOUND and rel(lse, t_lse) < VARIANTS_FLOAT64_BOUND
    for name, g, t in zip(("dout_a", "dlse_a", "dout_b", "dlse_b"),
                          merge_states_backward(dout, dlse, *arrays), t_grads):
        assert rel(g, t) < VARIANTS_FLOAT64_BOUND, (name, rel(g, t))


def test_dropping_the_minus_out_term_fails_against_autograd(monkeypatch):
    arrays, dout, dlse, _, t_grads = autograd_case(0)
    monkeypatch.setattr(merge_mod, "_centred", lambda out_x, out, empty: out_x)
    grads = merge_states_backward(dout, dlse, *arrays)
    assert rel(grads[1], t_grads[1]) > 1e-3 and rel(grads[3], t_grads[3]) > 1e-3


def test_empty_partial_matches_autograd_of_the_other_side_alone():
    """lse_a = -inf: the merge is (out_b, lse_b), whose gradients autograd gives directly."""
    arrays, dout, dlse, _, _ = autograd_case(4)
    arrays[0] = np.full_like(arrays[0], np.nan)
    arrays[1] = np.full_like(arrays[1], -np.inf)
    out, lse = merge_states(*arrays)
    assert np.array_equal(out, arrays[2]) and np.array_equal(lse, arrays[3])
    dout_a, dlse_a, dout_b, dlse_b = merge_states_backward(dout, dlse, *arrays)
    assert not dout_a.any() and not dlse_a.any()
    assert np.array_equal(dout_b, dout) and np.array_equal(dlse_b, dlse)


@pytest.mark.parametrize("order", merge_mod.ORDERS)
def test_key_ranges_merged_give_sdpa_over_all_keys(order):
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 2, 5, 8)), rng.standard_normal((1, 2, 40, 8)), rng.standard_normal((1, 2, 40, 8))
    states = merge_mod.split_states(q, k, v, [0, 3, 17, 17, 30, 40])
    out, _ = merge_mod.merge_many(states, order)
    sdpa = F.scaled_dot_product_attention(*(torch.tensor(a) for a in (q, k, v))).numpy()
    assert rel(out, sdpa) < VARIANTS_FLOAT64_BOUND
