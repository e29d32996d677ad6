"""numpy_ref.reference_attention with dropout on the weights (``keep``, ``dropout_p``):
PyTorch autograd of the same formula, the backward's row term, tiles, lse, and bad input
(its finite differences are among test_reference_attention's variants)."""

import numpy as np
import pytest
import torch

from numpy_ref import reference_attention
from parity_tests.common.tolerances import VARIANTS_FLOAT64_BOUND


def draw(seed, B=2, Hq=4, Hkv=2, Tq=4, Tk=5, D=3, Dv=2, p=0.4):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Tq, D))
    k = rng.standard_normal((B, Hkv, Tk, D))
    v = rng.standard_normal((B, Hkv, Tk, Dv))
    dout = rng.standard_normal((B, Hq, Tq, Dv))
    keep = rng.random((B, Hq, Tq, Tk)) >= p
    return q, k, v, dout, keep


def autograd(q, k, v, dout, keep, p, causal=False):
    """The same formula in PyTorch float64: P = softmax(S), out = (P ∘ keep / (1 − p)) V,
    GQA by repeat_interleave, gradients from autograd."""
    t = lambda a: torch.tensor(a, dtype=torch.float64, requires_grad=True)
    Q, K, V = t(q), t(k), t(v)
    group = q.shape[1] // k.shape[1]
    S = Q @ K.repeat_interleave(group, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    P = torch.softmax(S, dim=-1)
    out = (P * torch.from_numpy(keep) / (1 - p)) @ V.repeat_interleave(group, 1)
    out.backward(torch.from_numpy(dout))
    lse = torch.logsumexp(S, dim=-1)
    return {"out": out.detach().numpy(), "lse": lse.detach().numpy(), "dq": Q.grad.numpy(),
            "dk": K.grad.numpy(), "dv": V.grad.numpy()}


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("causal", [False, True])
def test_pytorch_autograd_of_the_same_formula_agrees(p, causal):
    q, k, v, dout, keep = draw(2, Tq=9, Tk=9, D=8, Dv=5, p=p)
    got = reference_attention(q, k, v, dout, keep=keep, dropout_p=p, causal=causal)
    ref = autograd(q, k, v, dout, keep, p, causal)
    for n, a in ref.items():
        assert np.abs(got[n] - a).max() <= VARIANTS_FLOAT64_BOUND * max(1.0, np.abs(a).max()), n


def test_the_row_term_is_rowsum_of_dout_times_the_dropped_output():
    """Σ_j P_ij dP_ij with dP = (dO Vᵀ) ∘ M equals dO_i · O_i for the dropped O, and
    differs from the row term without M, dO_i · (P V)_i."""
    q, k, v, dout, keep = draw(3, Hq=2, Hkv=2)
    p = 0.4
    S = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    M = keep / (1 - p)
    dP = (dout @ v.swapaxes(-1, -2)) * M
    out = reference_attention(q, k, v, keep=keep, dropout_p=p)["out"]
    D = (dout * out).sum(-1)
    assert np.abs((P * dP).sum(-1) - D).max() <= 1e-14
    assert np.abs((P * (dout @ v.swapaxes(-1, -2))).sum(-1) - D).max() > 0.1


def test_lse_is_that_of_the_undropped_scores_and_keep_all_at_p0_changes_nothing():
    q, k, v, dout, keep = draw(4)
    plain = reference_attention(q, k, v, dout)
    dropped = reference_attention(q, k, v, dout, keep=keep, dropout_p=0.3)
    assert np.array_equal(plain["lse"], dropped["lse"])
    assert np.abs(plain["out"] - dropped["out"]).max() > 0.1
    everything = reference_attention(q, k, v, dout, keep=np.ones_like(keep), dropout_p=0.0)
    for n in plain:
        assert np.array_equal(everything[n], plain[n]), n


def test_every_weight_dropped_gives_zero_output_and_zero_gradients():
    q, k, v, dout, keep = draw(5)
    r = reference_attention(q, k, v, dout, keep=np.zeros_like(keep), dropout_p=0.5)
    for n in ("out", "dq", "dk", "dv"):
        assert not r[n].any(), n


def test_keep_broadcasts_and_results_do_not_depend_on_the_tile_sizes():
    q, k, v, dout, keep = draw(6, Tq=11, Tk=13)
    row = keep[:1, :, :1]                                               # (1, Hq, 1, Tk): per key
    full = np.broadcast_to(row, keep.shape).copy()
    a = reference_attention(q, k, v, dout, keep=row, dropout_p=0.25, causal=True)
    b = reference_attention(q, k, v, dout, keep=full, dropout_p=0.25, causal=True, block_q=3, block_k=4)
    for n in a:
        assert np.abs(a[n] - b[n]).max() <= 1e-13, n
    c = reference_attention(q, k, v, dout, keep=keep, dropout_p=0.25, block_q=1, block_k=1)
    d = reference_attention(q, k, v, dout, keep=keep, dropout_p=0.25, block_q=4, block_k=100)
    for n in c:
        assert np.abs(c[n] - d[n]).max() <= 1e-13, n


def test_float32_is_computed_in_float32():
    q, k, v, dout, keep = draw(7)
    r = reference_attention(*(a.astype(np.float32) for a in (q, k, v, dout)), keep=keep, dropout_p=0.2)
    assert all(a.dtype == np.float32 for a in r.values())


@pytest.mark.parametrize("options,error,match", [
    (dict(dropout_p=1.0, keep=True), ValueError, r"dropout_p must lie in \[0, 1\)"),
    (dict(dropout_p=-0.1, keep=True), ValueError, r"dropout_p must lie in \[0, 1\)"),
    (dict(dropout_p=float("nan"), keep=True), ValueError, "dropout_p must be finite"),
    (dict(dropout_p="half", keep=True), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=0.5), ValueError, "dropout_p = 0.5 needs keep"),
    (dict(dropout_p=0.5, keep=np.ones((2, 4, 4, 4), dtype=bool)), ValueError, "keep must broadcast"),
    (dict(dropout_p=0.5, keep=np.ones((1, 2, 4, 4, 5), dtype=bool)), ValueError, "keep must broadcast"),
    (dict(dropout_p=0.5, keep=np.ones((2, 4, 4, 5))), TypeError, "keep must be a bool array"),
])
def test_bad_dropout_options_are_refused_naming_the_option(options, error, match):
    q, k, v, dout, _ = draw(8)
    with pytest.raises(error, match=match):
        reference_attention(q, k, v, dout, **options)
