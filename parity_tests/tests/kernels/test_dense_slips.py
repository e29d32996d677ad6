"""The dense formula's knobs for the online softmax's slips, a backward masked otherwise than
its forward, and the softcap applied last -- each against a formula written here in NumPy,
loop by loop as a kernel runs (no code shared with ``dense``)."""

import numpy as np
import pytest
import torch

from parity_tests.kernels import dense

RNG = np.random.default_rng(7)
B, H, TQ, TK, D = 1, 2, 9, 45, 8
SCALE = 0.9 / np.sqrt(D)


def _inputs(tq=TQ, tk=TK):
    q, k, v, dout = (RNG.standard_normal(s) for s in ((B, H, tq, D), (B, H, tk, D), (B, H, tk, D), (B, H, tq, D)))
    return 2.0 * q, k, v, dout          # scores of spread ~2: the maximum moves between blocks


def _scores(q, k, causal):
    S = SCALE * np.einsum("bhid,bhjd->bhij", q, k)
    if causal:                                           # top-left: j <= i
        S = np.where(np.arange(S.shape[-1])[None, :] <= np.arange(S.shape[-2])[:, None], S, -np.inf)
    return S


def _loop(q, k, v, causal, block, slip):
    """FlashAttention's forward, row by row and block by block, with ``slip`` planted."""
    S = _scores(q, k, causal)
    out = np.zeros(S.shape[:-1] + (v.shape[-1],))
    for b, h, i in np.ndindex(*S.shape[:-1]):
        if slip == "split":                              # partials on their own, then merged
            acc, l = np.zeros(v.shape[-1]), 0.0
            for j0 in range(0, S.shape[-1], block):
                s = S[b, h, i, j0:j0 + block]
                if np.isfinite(s).any():
                    p = np.exp(s - s.max())
                    acc, l = acc + p @ v[b, h, j0:j0 + block], l + p.sum()
            out[b, h, i] = acc / l if l else 0.0
            continue
        m, l, acc = -np.inf, (1.0 if slip == "l-one" else 0.0), np.zeros(v.shape[-1])
        for j0 in range(0, S.shape[-1], block):
            s = S[b, h, i, j0:j0 + block]
            m_new = max(m, s.max())
            if not np.isfinite(m_new):
                continue
            alpha = np.exp(m - m_new) if np.isfinite(m) else 1.0
            p = np.exp(s - m_new)
            l = (l if slip == "stale" else l * alpha) + p.sum()
            acc = (acc if slip in ("stale", "acc") else acc * alpha) + p @ v[b, h, j0:j0 + block]
            m = m_new
        out[b, h, i] = acc / l if l else 0.0
    return out


def _dense_out(q, k, v, causal, **knobs):
    t = lambda a: torch.as_tensor(a).double()
    return dense.attention(t(q), t(k), t(v), scale=SCALE, causal=causal, **knobs)[0].numpy()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("slip", ["acc", "l-one", "split"])
@pytest.mark.parametrize("block", [16, 64])
def test_each_online_slip_is_the_loop_that_makes_it(slip, block, causal):
    q, k, v, _ = _inputs(tq=TK)                           # causal rows past the first block too
    want = _loop(q, k, v, causal, block, slip)
    got = _dense_out(q, k, v, causal, online=(slip, block))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    right = _loop(q, k, v, causal, block, "right")
    np.testing.assert_allclose(_dense_out(q, k, v, causal), right, rtol=1e-12, atol=1e-12)   # the loop itself
    if block < TK or slip == "l-one":                   # the slip shows (one block: only l = 1 does)
        assert np.abs(got - right).max() > 1e-3


def test_the_stale_block_knob_is_the_slip_where_neither_is_rescaled():
    q, k, v, _ = _inputs()
    np.testing.assert_allclose(_dense_out(q, k, v, True, stale_block=16), _loop(q, k, v, True, 16, "stale"),
                               rtol=1e-12, atol=1e-12)


def _grads_by_hand(q, k, v, dout, fwd_causal, bwd_causal):
    """out of the forward's mask; dq, dk, dv of a backward recomputing P' = exp(S' - lse) under
    its own mask with the forward's lse, D = rowsum(dO * O) from the forward's O."""
    S_f, S_b = _scores(q, k, fwd_causal), _scores(q, k, bwd_causal)
    top = S_f.max(-1, keepdims=True)
    lse = top + np.log(np.exp(S_f - top).sum(-1, keepdims=True))
    P, P_b = np.exp(S_f - lse), np.exp(S_b - lse)
    O = P @ v
    dS = P_b * (dout @ v.swapaxes(-1, -2) - (dout * O).sum(-1, keepdims=True))
    return O, SCALE * dS @ k, SCALE * dS.swapaxes(-1, -2) @ q, P_b.swapaxes(-1, -2) @ dout


@pytest.mark.parametrize("fwd_causal", [False, True], ids=["forward-full", "forward-causal"])
def test_a_backward_masked_otherwise_than_its_forward(fwd_causal):
    q, k, v, dout = _inputs(tq=TK)
    want = _grads_by_hand(q, k, v, dout, fwd_causal, not fwd_causal)
    got = dense.run(q, k, v, dout, {"scale": SCALE, "causal": fwd_causal}, backward_causal=not fwd_causal)
    right = dense.run(q, k, v, dout, {"scale": SCALE, "causal": fwd_causal})
    for n, w in zip(("out", "dq", "dk", "dv"), want):
        np.testing.assert_allclose(got[n], w, rtol=1e-10, atol=1e-12, err_msg=n)
        if n != "out":                                   # the backward alone is wrong
            assert np.abs(got[n] - right[n]).max() > 1e-2, n
    np.testing.assert_array_equal(got["out"], right["out"])


def test_the_softcap_applied_after_alibi_and_bias():
    q, k, v, _ = _inputs()
    slopes, bias, cap = np.array([0.5, 0.125]), RNG.standard_normal((TQ, TK)), 2.0
    i, j = np.arange(TQ)[:, None], np.arange(TK)[None, :]
    S = cap * np.tanh((_scores(q, k, False) - slopes[:, None, None] * np.abs(i - j) + bias) / cap)
    S = np.where(j <= i, S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    want = (P / P.sum(-1, keepdims=True)) @ v
    t = lambda a: torch.as_tensor(a).double()
    kw = dict(scale=SCALE, causal=True, softcap=cap, alibi_slopes=t(slopes), bias=t(bias))
    got = dense.attention(t(q), t(k), t(v), softcap_last=True, **kw)[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.abs(got - dense.attention(t(q), t(k), t(v), **kw)[0].numpy()).max() > 1e-2
