"""reference_attention's dlse against PyTorch autograd on a dense float64 formula
(torch.logsumexp over the scores and the sink column), loss Σ out·dout + Σ lse·dlse."""

import numpy as np
import pytest
import torch

from numpy_ref import reference_attention


def dense(q, k, v, dout, dlse, bias, sinks, softcap, Tk_seen):
    """Causal bottom-right attention, GQA 2:1, softcap, a (Tq, Tk) bias, sinks,
    the plain way; lse -> 0 on rows with nothing to attend (no sink there)."""
    t = {n: torch.tensor(a, requires_grad=True) for n, a in
         dict(q=q, k=k, v=v, bias=bias, sinks=sinks).items() if a is not None}
    B, Hq, Tq, D = q.shape
    Tk = k.shape[2]
    kr, vr = (t[n].repeat_interleave(Hq // k.shape[1], dim=1) for n in ("k", "v"))
    S = (t["q"] @ kr.transpose(-1, -2)) / D ** 0.5
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    if "bias" in t:
        S = S + t["bias"]
    hidden = torch.arange(Tk)[None, :] > torch.arange(Tq)[:, None] + (Tk - Tq)
    S = S.masked_fill(hidden, float("-inf"))
    if "sinks" in t:
        S = torch.cat([S, t["sinks"].view(1, Hq, 1, 1).expand(B, Hq, Tq, 1)], dim=-1)
    empty = torch.isneginf(S).all(dim=-1)
    lse = torch.logsumexp(S.masked_fill(empty[..., None], 0.0), dim=-1)
    P = torch.exp(S - lse[..., None]).masked_fill(empty[..., None], 0.0)
    out = P[..., :Tk] @ vr
    loss = (out * torch.tensor(dout)).sum() + (lse.masked_fill(empty, 0.0) * torch.tensor(dlse)).sum()
    loss.backward()
    return {f"d{n}": x.grad.numpy() for n, x in t.items()}


@pytest.mark.parametrize("sinks,bias,softcap", [
    (None, None, None), (True, None, 2.0), (True, True, None), (None, True, 1.5)])
def test_dlse_matches_autograd(sinks, bias, softcap):
    rng = np.random.default_rng(0)
    B, Hq, Hkv, Tq, Tk, D = 2, 4, 2, 7, 5, 3           # Tq > Tk: rows 0, 1 see no key
    q = rng.standard_normal((B, Hq, Tq, D))
    k, v = (rng.standard_normal((B, Hkv, Tk, D)) for _ in range(2))
    dout, dlse = rng.standard_normal((B, Hq, Tq, D)), rng.standard_normal((B, Hq, Tq))
    sinks = rng.standard_normal(Hq) if sinks else None
    bias = rng.standard_normal((Tq, Tk)) if bias else None
    want = dense(q, k, v, dout, dlse, bias, sinks, softcap, Tk)
    options = dict(causal=True, align="bottom-right", softcap=softcap, bias=bias, sinks=sinks)
    got = reference_attention(q, k, v, dout, dlse=dlse,
                              **{n: x for n, x in options.items() if x is not None})
    for name, w in want.items():
        err = np.abs(got[name] - w).max() / max(np.abs(w).max(), 1e-300)
        assert err <= 1e-12, (name, err)
