"""The softmax Jacobian J = diag(w) - w w^T against two oracles, and its properties.

Oracles: PyTorch's autograd (torch.autograd.functional.jacobian of torch.softmax)
and centred finite differences of numpy_ref.softmax, both in float64.
Score vectors: the chapter's attn_scores_2 and random ones of several lengths
and spreads (a spread of 8 puts some weights near 1e-7: the hard case for rank).
"""

import numpy as np
import pytest
import torch

from numpy_ref import softmax, softmax_jacobian
from parity_tests.common import chapter_values as cv
from parity_tests.common.finite_diff import fd_jacobian

ROUNDING = 1e-12


def _score_vectors():
    rng = np.random.default_rng(2024)
    vectors = {"chapter attn_scores_2": np.array(cv.SIMPLE_ATTN_SCORES_2)}
    for n, spread in ((2, 1.0), (5, 0.3), (8, 3.0), (16, 1.0), (12, 8.0)):
        vectors[f"n={n}, spread={spread}"] = rng.standard_normal(n) * spread
    return vectors


VECTORS = _score_vectors()


@pytest.fixture(params=list(VECTORS), ids=list(VECTORS))
def case(request):
    x = VECTORS[request.param]
    w = softmax(x)
    return x, w, softmax_jacobian(w)


def test_matches_autograd(case):
    x, _, J = case
    J_torch = torch.autograd.functional.jacobian(
        lambda t: torch.softmax(t, dim=0), torch.tensor(x, dtype=torch.float64)).numpy()
    np.testing.assert_allclose(J, J_torch, rtol=0, atol=ROUNDING)


def test_matches_finite_differences(case):
    x, _, J = case
    np.testing.assert_allclose(J, fd_jacobian(softmax, x), rtol=0, atol=1e-8)


def test_entries_are_the_chapter_formula(case):
    """J[i, j] = w_i (delta_ij - w_j), written out element by element."""
    _, w, J = case
    n = w.size
    expected = [[w[i] * ((i == j) - w[j]) for j in range(n)] for i in range(n)]
    np.testing.assert_allclose(J, expected, rtol=0, atol=1e-15)


def test_rows_and_columns_sum_to_zero(case):
    _, _, J = case
    assert np.abs(J.sum(axis=1)).max() <= ROUNDING
    assert np.abs(J.sum(axis=0)).max() <= ROUNDING


def test_symmetric(case):
    _, _, J = case
    assert np.array_equal(J, J.T)


def test_psd_with_eigenvalues_within_half(case):
    _, w, J = case
    eig = np.linalg.eigvalsh(J)
    assert eig[0] >= -ROUNDING, eig
    assert eig[-1] <= 0.5 + ROUNDING, eig
    # J = diag(w) - w w^T <= diag(w) (w w^T is PSD), so no eigenvalue exceeds max(w)
    assert eig[-1] <= w.max() + ROUNDING


def test_rank_n_minus_one_null_space_all_ones(case):
    _, w, J = case
    n = w.size
    # relative threshold: the smallest non-zero eigenvalue can be ~ min(w) ~ 1e-7
    eig = np.linalg.eigvalsh(J)
    assert np.sum(eig > 1e-14) == n - 1, eig
    assert np.abs(J @ np.ones(n)).max() <= ROUNDING


def test_vector_jacobian_product_uses_the_same_formula(case):
    """softmax_backward(w, g) == g @ J for a random upstream gradient g."""
    from numpy_ref import softmax_backward
    _, w, J = case
    g = np.random.default_rng(7).standard_normal(w.size)
    np.testing.assert_allclose(softmax_backward(w, g), g @ J, rtol=0, atol=ROUNDING)


def test_batched_jacobian_is_per_row():
    x = np.random.default_rng(3).standard_normal((2, 3, 5))
    J = softmax_jacobian(softmax(x))
    assert J.shape == (2, 3, 5, 5)
    np.testing.assert_allclose(J[1, 2], softmax_jacobian(softmax(x[1, 2])), rtol=0, atol=0)


def test_a_wrong_jacobian_is_caught():
    """The oracle comparison can fail: forgetting the diagonal term is caught."""
    x = np.array(cv.SIMPLE_ATTN_SCORES_2)
    w = softmax(x)
    wrong = -np.outer(w, w)
    assert np.abs(wrong - fd_jacobian(softmax, x)).max() > 0.05
