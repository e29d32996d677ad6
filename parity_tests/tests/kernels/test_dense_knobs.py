"""``dense.attention``'s knobs, each the formula of one catalogued mistake, held to a
witness written here in NumPy with plain loops (no code shared with ``dense``): a knob
whose formula drifted would name a kernel's mistake wrongly, or fail to name it.  Each
knob is also shown to change the result, so that a knob ignored is caught as well.  The
online softmax's slips are written loop by loop as a kernel runs (`_online_row`); a
backward masked otherwise than its forward, and the softcap applied last, by hand."""

import math

import numpy as np
import pytest
import torch

from parity_tests.kernels import dense
from baseline_errors import assert_errs_as_autograd

B, H, D = 1, 4, 4


def _inputs(tq, tk, hkv, seed=0, batch=B):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, H, tq, D)) * 1.5
    k, v = rng.standard_normal((batch, hkv, tk, D)) * 1.5, rng.standard_normal((batch, hkv, tk, D))
    return q, k, v, rng.standard_normal((batch, H, tq, D))


def _online_row(s, V, block, slip):
    """One row of FlashAttention's forward over key blocks (``s``: its visible scores, -inf
    elsewhere) with ``slip`` planted: "stale" (neither l nor acc rescaled), "acc" (acc alone
    not), "l-one" (l started at 1), "split" (partials merged without exp(m_s - m)), "acc-late" (acc
    rescaled after the block's p V is added, by exp(m - m_new) unguarded: 0 on the first block
    seen), "rescale-exp" and "rescale-exp2" (both rescaled by alpha ** (log2 e) or ** (ln 2))."""
    if slip == "split":                              # partials on their own, then merged
        acc, l = np.zeros(V.shape[-1]), 0.0
        for j0 in range(0, len(s), block):
            t = s[j0:j0 + block]
            if np.isfinite(t).any():
                p = np.exp(t - t.max())
                acc, l = acc + p @ V[j0:j0 + block], l + p.sum()
        return acc / l if l else 0.0
    m, l, acc = -np.inf, (1.0 if slip == "l-one" else 0.0), np.zeros(V.shape[-1])
    for j0 in range(0, len(s), block):
        t = s[j0:j0 + block]
        m_new = max(m, t.max())
        if not np.isfinite(m_new):
            continue
        alpha = np.exp(m - m_new) if np.isfinite(m) else 1.0
        alpha = alpha ** {"rescale-exp": 1 / math.log(2), "rescale-exp2": math.log(2)}.get(slip, 1.0)
        p = np.exp(t - m_new)
        l = (l if slip == "stale" else l * alpha) + p.sum()
        if slip == "acc-late":
            acc = (acc + p @ V[j0:j0 + block]) * np.exp(m - m_new)
        else:
            acc = (acc if slip in ("stale", "acc") else acc * alpha) + p @ V[j0:j0 + block]
        m = m_new
    return acc / l if l else 0.0


def witness(q, k, v, dout, *, scale, causal=False, align="top-left", window=None, window_align=None,
            softcap=None, cap_first=False, cap_grad=True, slopes=None, alibi_offset=None, kv=None,
            shift=0, axis=-1, finite_mask=False, online=None, delta=True):
    """(out, lse, dq, dk, dv) of one mistake's attention, entry by entry."""
    tq, tk, hkv = q.shape[2], k.shape[2], k.shape[1]
    kv = kv or (lambda h: h // (H // hkv))
    o = (0 if align == "top-left" else tk - tq) + shift
    w = o if window_align is None else (0 if window_align == "top-left" else tk - tq)
    a_off = o if alibi_offset is None else alibi_offset
    out, lse = np.zeros(q.shape[:3] + (v.shape[-1],)), np.full(q.shape[:3], -np.inf)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            g = kv(h)
            Q, K, V, dO = q[b, h], k[b, g], v[b, g], dout[b, h]
            raw = Q @ K.T
            if softcap is None:
                S, dS_draw = raw * scale, np.full(raw.shape, scale)
            elif cap_first:
                t = np.tanh(raw / softcap)
                S, dS_draw = softcap * t * scale, scale * (1 - t * t)
            else:
                t = np.tanh(raw * scale / softcap)
                S, dS_draw = softcap * t, scale * ((1 - t * t) if cap_grad else 1.0)
            seen = np.ones((tq, tk), dtype=bool)
            for i in range(tq):
                for j in range(tk):
                    if slopes is not None:
                        S[i, j] -= slopes[h] * abs(i + a_off - j)
                    if causal and j > i + o:
                        seen[i, j] = False
                    if window is not None and window[0] >= 0 and j < i + w - window[0]:
                        seen[i, j] = False
                    if window is not None and window[1] >= 0 and not causal and j > i + w + window[1]:
                        seen[i, j] = False
            P = np.zeros((tq, tk))
            if axis == -2:                       # each key's weights over the queries that see it
                for j in range(tk):
                    rows = seen[:, j]
                    if rows.any():
                        e = np.exp(S[rows, j] - S[rows, j].max())
                        P[rows, j] = e / e.sum()
            for i in range(tq):
                keys = seen[i]
                if keys.any():
                    m = S[i, keys].max()
                    lse[b, h, i] = m + math.log(np.exp(S[i, keys] - m).sum())
                if axis == -2:
                    continue
                if not keys.any():
                    if finite_mask:              # every score the same finite minimum: a uniform average
                        P[i] = 1.0 / tk
                    continue
                if online:                       # an online softmax's slip: out alone
                    out[b, h, i] = _online_row(np.where(keys, S[i], -np.inf), V, online[1], online[0])
                    continue
                P[i, keys] = np.exp(S[i, keys] - lse[b, h, i])
            if not online:
                out[b, h] = P @ V
            dP = dO @ V.T
            if axis == -2:                       # each column's own normaliser
                Dr = (P * dP).sum(0, keepdims=True)
            else:
                Dr = (dO * out[b, h]).sum(-1, keepdims=True) if delta else 0.0
            dS = P * (dP - Dr) * dS_draw
            dq[b, h] = dS @ K
            dk[b, g] += dS.T @ Q
            dv[b, g] += P.T @ dO
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def dense_run(q, k, v, dout, *, slopes=None, **kw):
    Q, K, V = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    if slopes is not None:
        kw["alibi_slopes"] = torch.tensor(slopes)
    out, lse = dense.attention(Q, K, V, **kw)
    dq, dk, dv = torch.autograd.grad(out, (Q, K, V), torch.tensor(dout))
    return {n: x.detach().numpy() for n, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv))}


SLOPES = [0.5, 0.25, 0.125, 0.0625]
SLIPS = ("stale", "acc", "l-one", "split", "acc-late", "rescale-exp", "rescale-exp2")

# knob: (Tq, Tk, kv heads, the options both take, the knob for dense, the witness's words for it,
#        the tensors the knob changes)
KNOBS = {
    "kv_map repeat": (6, 6, 2, dict(causal=True), dict(kv_map="repeat"), dict(kv=lambda h: h % 2),
                      ("out", "dq", "dk", "dv")),
    "softcap_first": (6, 9, 4, dict(causal=True, softcap=2.0), dict(softcap_first=True), dict(cap_first=True),
                      ("out", "lse", "dq", "dk")),
    "softcap_no_grad": (6, 9, 4, dict(causal=True, softcap=2.0), dict(softcap_no_grad=True),
                        dict(cap_grad=False), ("dq", "dk")),
    "shift +1": (7, 7, 4, dict(causal=True), dict(shift=1), dict(shift=1), ("out", "lse", "dq", "dk", "dv")),
    "shift -1": (7, 7, 4, dict(causal=True), dict(shift=-1), dict(shift=-1), ("out", "lse", "dq", "dk", "dv")),
    "window_align": (5, 9, 4, dict(window=(2, 1)), dict(window_align="bottom-right"),
                     dict(window_align="bottom-right"), ("out", "lse", "dq", "dk", "dv")),
    "alibi_no_offset": (5, 9, 4, dict(causal=True, align="bottom-right", slopes=SLOPES), dict(alibi_no_offset=True),
                        dict(alibi_offset=0), ("out", "lse", "dq", "dk", "dv")),
    "alibi_offset_sign": (5, 9, 4, dict(causal=True, align="bottom-right", slopes=SLOPES),
                          dict(alibi_offset_sign=-1), dict(alibi_offset=-4), ("out", "lse", "dq", "dk", "dv")),
    "axis": (7, 7, 4, dict(causal=True), dict(axis=-2), dict(axis=-2), ("out", "dq", "dk", "dv")),
    "finite_mask": (9, 5, 4, dict(causal=True, align="bottom-right"), dict(finite_mask=True),
                    dict(finite_mask=True), ("out",)),
    **{f"online {slip}": (6, 9, 4, dict(window=(4, -1)), dict(online=(slip, 3)), dict(online=(slip, 3)), ("out",))
       for slip in SLIPS},
    **{f"online {slip} causal": (9, 9, 4, dict(causal=True), dict(online=(slip, 4)), dict(online=(slip, 4)),
                                 ("out",)) for slip in SLIPS},
    "online l-one one pass": (6, 9, 4, dict(), dict(online=("l-one", 9)), dict(online=("l-one", 9)), ("out",)),
    "no_delta": (6, 9, 4, dict(causal=True, align="bottom-right"), dict(no_delta=True), dict(delta=False),
                 ("dq", "dk")),
}


def _close(a, b):
    return np.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("knob", list(KNOBS))
def test_each_knob_is_its_mistakes_formula(knob):
    tq, tk, hkv, both, turned, says, changed = KNOBS[knob]
    q, k, v, dout = _inputs(tq, tk, hkv)
    scale = 1 / math.sqrt(D)
    mine = {n: both[n] for n in ("causal", "align", "window", "softcap", "slopes") if n in both}
    right = witness(q, k, v, dout, scale=scale, **mine)
    assert {n: _close(a, right[n]) for n, a in dense_run(q, k, v, dout, scale=scale, **mine).items()} == \
        dict.fromkeys(right, True), "dense without the knob is not the witness's right attention"
    wrong = witness(q, k, v, dout, scale=scale, **mine, **says)
    got = dense_run(q, k, v, dout, scale=scale, **mine, **turned)
    # the stale online softmax and the finite mask: judged on out, where their mistake shows
    judged = ("out",) if knob.startswith("online") or knob == "finite_mask" else tuple(got)
    for n in judged:
        assert _close(got[n], wrong[n]), f"{knob}: {n} is not the witness's"
    assert all(not _close(wrong[n], right[n]) for n in changed), f"{knob} changes nothing here"


SCALE = 0.9 / math.sqrt(D)


def _scores(q, k, causal):
    S = SCALE * np.einsum("bhid,bhjd->bhij", q, k)
    if causal:                                           # top-left: j <= i
        S = np.where(np.arange(S.shape[-1])[None, :] <= np.arange(S.shape[-2])[:, None], S, -np.inf)
    return S


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
    q, k, v, dout = _inputs(9, 45, H, seed=7)
    want = _grads_by_hand(q, k, v, dout, fwd_causal, not fwd_causal)
    got = dense.run(q, k, v, dout, {"scale": SCALE, "causal": fwd_causal}, backward_options={"causal": not fwd_causal})
    right = dense.run(q, k, v, dout, {"scale": SCALE, "causal": fwd_causal}, autograd=True)
    for n, w in zip(("out", "dq", "dk", "dv"), want):
        np.testing.assert_allclose(got[n], w, rtol=1e-10, atol=1e-12, err_msg=n)
        if n != "out":                                   # the backward alone is wrong
            assert np.abs(got[n] - right[n]).max() > 1e-2, n
    np.testing.assert_array_equal(got["out"], right["out"])


def test_a_backward_recomputing_its_scores_with_other_options():
    """Sinks scaled and the bias left out in the backward alone: P' = exp(S' − lse) of the
    backward's own scores S', the forward's lse, D = rowsum(dO ∘ O) − dlse; dS = P' ∘ (dP − D)
    carried to q and k by the scale, written as dbias, and −Σ_i p'_sink D_i as dsinks."""
    q, k, v, dout = _inputs(9, 45, H, seed=3)
    rng = np.random.default_rng(4)
    bias, sinks, dlse = rng.standard_normal((9, 45)), rng.standard_normal(H) + 2.0, rng.standard_normal((B, H, 9))
    opts = {"scale": SCALE, "causal": True, "bias": bias, "sinks": sinks}
    got = dense.run(q, k, v, dout, opts, dlse=dlse, backward_options={"sinks": sinks * SCALE, "bias": None})
    right = dense.run(q, k, v, dout, opts, dlse=dlse, autograd=True)
    S = _scores(q, k, True) + bias
    sink = np.broadcast_to(sinks[None, :, None, None], S.shape[:-1] + (1,))
    full = np.concatenate([S, sink], -1)
    lse = np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) + full.max(-1, keepdims=True)
    O = np.exp(S - lse) @ v
    P_b = np.exp(_scores(q, k, True) - lse)
    p_sink = np.exp(sinks[None, :, None, None] * SCALE - lse)[..., 0]
    D = (dout * O).sum(-1) - dlse
    dS = P_b * (dout @ v.swapaxes(-1, -2) - D[..., None])
    want = {"out": O, "lse": lse[..., 0], "dq": SCALE * dS @ k, "dk": SCALE * dS.swapaxes(-1, -2) @ q,
            "dv": P_b.swapaxes(-1, -2) @ dout, "dbias": dS.sum((0, 1)), "dsinks": -(p_sink * D).sum((0, 2))}
    for n, w in want.items():
        np.testing.assert_allclose(got[n], w, rtol=1e-10, atol=1e-12, err_msg=n)
        if n not in ("out", "lse"):                      # the backward alone is wrong
            assert np.abs(got[n] - right[n]).max() > 1e-3, n
    np.testing.assert_array_equal(got["out"], right["out"])


def test_keys_seen_by_no_query_from_their_first_index_per_batch_entry():
    q, k, v, dout = _inputs(9, 45, H, seed=7, batch=2)
    got = dense.run(q, k, v, dout, {"scale": SCALE}, unseen_from=[40, 45])
    for b, first in ((0, 40), (1, 45)):
        sl = lambda a: a[b:b + 1, :, :first]
        want = dense.run(q[b:b + 1], sl(k), sl(v), dout[b:b + 1], {"scale": SCALE}, autograd=True)
        for n in ("out", "dq"):
            np.testing.assert_allclose(got[n][b:b + 1], want[n], rtol=1e-12, atol=1e-14, err_msg=n)
        for n in ("dk", "dv"):
            np.testing.assert_allclose(got[n][b:b + 1, :, :first], want[n], rtol=1e-12, atol=1e-14, err_msg=n)
            assert not got[n][b, :, first:].any(), n


def test_the_softcap_applied_after_alibi_and_bias():
    q, k, v, _ = _inputs(9, 45, H, seed=7)
    slopes, bias, cap = np.array(SLOPES), np.random.default_rng(8).standard_normal((9, 45)), 2.0
    i, j = np.arange(9)[:, None], np.arange(45)[None, :]
    S = cap * np.tanh((_scores(q, k, False) - slopes[:, None, None] * np.abs(i - j) + bias) / cap)
    S = np.where(j <= i, S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    want = (P / P.sum(-1, keepdims=True)) @ v
    t = lambda a: torch.as_tensor(a).double()
    kw = dict(scale=SCALE, causal=True, softcap=cap, alibi_slopes=t(slopes), bias=t(bias))
    got = dense.attention(t(q), t(k), t(v), softcap_last=True, **kw)[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.abs(got - dense.attention(t(q), t(k), t(v), **kw)[0].numpy()).max() > 1e-2


# The baseline's common case (``dense._written_out``: plain options, the backward written
# out) against the autograd path it replaces.
WRITTEN_OUT_CASES = [  # (Hkv, Tq, Tk, causal, align, weights, rows, window, lengths (q, k) or None)
    (2, 17, 33, True, "top-left", "softmax", None, None, None),
    (4, 45, 77, True, "bottom-right", "lse", None, (7, 3), None),
    (1, 77, 45, True, "top-left", "lse", None, None, None),
    (4, 33, 33, False, "top-left", "softmax", None, (-1, 4), None),
    (2, 600, 300, True, "top-left", "softmax", (5, 610), (40, -1), None),
    (4, 1, 5, True, "top-left", "softmax", None, None, None),
    (2, 300, 290, False, "bottom-right", "softmax", None, (25, 9), None),
    (2, 40, 60, True, "bottom-right", "lse", None, (5, -1), ([40, 0, 17], [60, 9, 3])),
    (4, 40, 60, False, "top-left", "softmax", None, None, ([1, 40, 0], [60, 0, 33]))]


def _both_paths(tq, tk, hkv, causal, align, weights, rows, window, lengths, dtype=torch.float64, seed=0):
    q, k, v, dout = _inputs(tq, tk, hkv, seed, batch=1 if lengths is None else len(lengths[0]))
    opts = {"scale": 0.7, "causal": causal, "align": align, "window": window}
    if lengths is not None:
        opts.update(seqlens_q=np.array(lengths[0]), seqlens_k=np.array(lengths[1]))
    run = lambda **knob: dense.run(q, k, v, dout, opts, dtype=dtype, weights=weights, rows=rows, **knob)
    return run(), run(autograd=True), (q, k, v, dout, opts)


@pytest.mark.parametrize("hkv, tq, tk, causal, align, weights, rows, window, lengths", WRITTEN_OUT_CASES)
def test_the_written_out_backward_is_autograds_in_float64(hkv, tq, tk, causal, align, weights, rows, window,
                                                          lengths, monkeypatch):
    calls = []
    monkeypatch.setattr(dense, "_written_out", lambda *a, _f=dense._written_out: calls.append(1) or _f(*a))
    written, autograd, _ = _both_paths(tq, tk, hkv, causal, align, weights, rows, window, lengths)
    assert len(calls) == 1                                     # taken once, and not with autograd=True
    assert set(written) == set(autograd) == {"out", "lse", "dq", "dk", "dv"}
    for n, a in autograd.items():
        seen = np.isfinite(a)
        assert np.array_equal(np.isfinite(written[n]), seen), n
        np.testing.assert_allclose(written[n][seen], a[seen], rtol=1e-12, atol=1e-12, err_msg=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_written_out_baseline_errs_as_the_autograd_one(dtype):
    """A baseline's error is the bound's scale: as autograd's on each tensor (``baseline_errors``)."""
    for hkv, tq, tk, causal, align, weights, rows, window, lengths in WRITTEN_OUT_CASES:
        if tq * tk < 100:
            continue                       # a handful of entries: the ratio of two roundings is noise
        written, autograd, (q, k, v, dout, opts) = _both_paths(tq, tk, hkv, causal, align, weights, rows, window,
                                                               lengths, dtype)
        rounded = [torch.tensor(x).to(dtype).double().numpy() for x in (q, k, v, dout)]
        gold = dense.run(*rounded, opts, rows=rows)
        assert_errs_as_autograd(gold, written, autograd, str(dtype).replace("torch.", ""),
                                ("out", "dq", "dk", "dv"), (tq, tk))


def test_an_option_the_dense_formula_does_not_know_is_refused_not_dropped():
    q, k, v, dout = _inputs(5, 7, H)
    for call in (lambda o: dense.run(q, k, v, dout, o), lambda o: dense.keywords(o)):
        with pytest.raises(TypeError, match="no such option q_descale"):
            call({"scale": 0.5, "causal": True, "q_descale": np.ones(H)})


@pytest.mark.parametrize("form", ["of-capped", "capped-squared", "dp-only"])
def test_a_softcap_derivative_in_another_form(form):
    """The forward capped as it should be; the backward's 1 − tanh²(S/c) replaced by
    1 − tanh²(capped/c) or 1 − capped², by hand: dS_raw = P ∘ (dP − D) ∘ slope; or applied to
    dP alone ("dp-only"): dS_raw = P ∘ ((1 − tanh²(S/c)) dP − D)."""
    q, k, v, dout = _inputs(9, 45, H, seed=5)
    cap = 2.0
    got = dense.run(q, k, v, dout, {"scale": SCALE, "causal": True, "softcap": cap}, softcap_derivative=form)
    right = dense.run(q, k, v, dout, {"scale": SCALE, "causal": True, "softcap": cap}, autograd=True)
    S = _scores(q, k, False)
    capped = cap * np.tanh(S / cap)
    capped = np.where(np.arange(45)[None, :] <= np.arange(9)[:, None], capped, -np.inf)
    P = np.exp(capped - capped.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    O = P @ v
    dP, D = dout @ v.swapaxes(-1, -2), (dout * O).sum(-1, keepdims=True)
    c = cap * np.tanh(S / cap)
    if form == "dp-only":
        dS = P * ((1 - np.tanh(S / cap) ** 2) * dP - D)
    else:
        dS = P * (dP - D) * (1 - np.tanh(c / cap) ** 2 if form == "of-capped" else 1 - c ** 2)
    np.testing.assert_allclose(got["out"], O, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got["dq"], SCALE * dS @ k, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["dk"], SCALE * dS.swapaxes(-1, -2) @ q, rtol=1e-10, atol=1e-12)
    assert np.abs(got["dq"] - right["dq"]).max() > 1e-2


def test_a_backward_whose_dp_alone_is_scaled():
    """dp_factor c: dS = P (c dP - D), D = rowsum(dO O); dv as the right backward's."""
    q, k, v, dout = _inputs(6, 9, 4)
    P = np.exp(_scores(q, k, False) - _scores(q, k, False).max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    dP, D = dout @ v.swapaxes(-1, -2), (dout * (P @ v)).sum(-1, keepdims=True)
    for c in (1.0, 0.25):
        got = dense_run(q, k, v, dout, scale=SCALE, dp_factor=c)
        dS = P * (c * dP - D)
        assert _close(got["dq"], SCALE * dS @ k) and _close(got["dk"], SCALE * dS.swapaxes(-1, -2) @ q)
        assert _close(got["dv"], P.swapaxes(-1, -2) @ dout) and _close(got["out"], P @ v)


def test_mask_positions_formed_in_bfloat16():
    """Past 256, positions round in bfloat16 (spacing 2 to 512): row i sees key j when j's rounded
    position is at most i's."""
    rows = torch.arange(250, 300)
    got = dense.visible(rows, 300, causal=True, positions_dtype=torch.bfloat16)
    r = lambda x: np.asarray(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).double())
    want = r(np.arange(300))[None, :] <= r(np.arange(250, 300))[:, None]
    assert np.array_equal(got.numpy(), want) and not np.array_equal(want, np.tril(np.ones((300, 300)))[250:])


def test_a_head_dim_block_reads_the_first_channels_alone():
    q, k, v, dout = _inputs(5, 7, 4)
    got = dense_run(q, k, v, dout, scale=SCALE, channels=2)
    cut = lambda x: np.where(np.arange(D) < 2, x, 0.0)
    S = SCALE * np.einsum("bhid,bhjd->bhij", cut(q), cut(k))
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    assert _close(got["out"], P @ cut(v)) and not np.any(got["dq"][..., 2:])


@pytest.mark.parametrize("slip", ["rescale-exp", "rescale-exp2"])
def test_an_online_rescale_in_the_other_base_returns_its_own_lse(slip):
    """lse = m + log l, its l rescaled as its weights are: the witness's loop, its l read back."""
    q, k, v, dout = _inputs(12, 12, 4)
    got = dense_run(q, k, v, dout, scale=SCALE, causal=True, online=(slip, 4))
    S = _scores(q, k, True)
    for h in range(H):
        for i in range(S.shape[2]):
            s = S[0, h, i]
            one = np.ones((len(s), 1))                 # v of ones: out = l' / l' = 1; l read apart
            m, l = -np.inf, 0.0
            for j0 in range(0, len(s), 4):
                t = s[j0:j0 + 4]
                m_new = max(m, t.max())
                if not np.isfinite(m_new):
                    continue
                alpha = (np.exp(m - m_new) if np.isfinite(m) else 1.0) ** \
                    {"rescale-exp": 1 / math.log(2), "rescale-exp2": math.log(2)}[slip]
                l, m = l * alpha + np.exp(t - m_new).sum(), m_new
            assert math.isclose(got["lse"][0, h, i], m + math.log(l), rel_tol=1e-12), (h, i)
            assert _close(_online_row(s, one, 4, slip), 1.0)
    right = dense_run(q, k, v, dout, scale=SCALE, causal=True)
    assert not _close(got["lse"], right["lse"])


def test_a_backward_whose_dp_alone_is_scaled_under_dropout():
    """With dropout's keep mask Z and p: dP = dO V^T Z / (1 - p), scaled by c alone; D from the
    dropped output."""
    q, k, v, dout = _inputs(6, 9, 4)
    keep = np.random.default_rng(1).random((B, H, 6, 9)) >= 0.3
    P = np.exp(_scores(q, k, False) - _scores(q, k, False).max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    Z = keep / 0.7
    O = (P * Z) @ v
    dS = P * (0.5 * (dout @ v.swapaxes(-1, -2)) * Z - (dout * O).sum(-1, keepdims=True))
    got = dense_run(q, k, v, dout, scale=SCALE, dp_factor=0.5, keep=torch.tensor(keep), dropout_p=0.3)
    assert _close(got["out"], O) and _close(got["dq"], SCALE * dS @ k)
    assert _close(got["dv"], (P * Z).swapaxes(-1, -2) @ dout)


def test_mask_positions_in_bfloat16_round_twice_past_an_offset():
    """arange(Tq) in bfloat16, then + offset in bfloat16: two roundings, as a kernel writes it."""
    rows = torch.arange(250, 300)
    got = dense.visible(rows, 320, causal=True, offset=7, positions_dtype=torch.bfloat16)
    r = lambda x: np.asarray(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).double())
    want = r(np.arange(320))[None, :] <= r(r(np.arange(250, 300)) + 7)[:, None]
    once = r(np.arange(320))[None, :] <= r(np.arange(257, 307))[:, None]
    assert np.array_equal(got.numpy(), want) and not np.array_equal(want, once)
