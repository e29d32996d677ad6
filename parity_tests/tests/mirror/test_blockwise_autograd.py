"""The blockwise ops and module against PyTorch autograd (float64): the ops against
softmax attention written with torch ops and against SDPA (both causal alignments),
the module against torch_impl.MultiHeadAttention with weights moved across."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import numpy_ref as nr
import torch_impl
from numpy_ref.blockwise import attention_backward, attention_forward
from parity_tests.common.finite_diff import SCALE_FLOOR_FRACTION, rel_error
from parity_tests.common.tolerances import FLOAT64_BOUND


def torch_attention(q, k, v, causal, causal_offset, dout):
    """out, lse and the autograd gradients of softmax(q k^T / sqrt(D) + mask) v."""
    q, k, v = (torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        Tq, Tk = scores.shape[-2:]
        hidden = torch.arange(Tk)[None, :] > torch.arange(Tq)[:, None] + causal_offset
        scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    out.backward(torch.from_numpy(dout))
    lse = torch.logsumexp(scores.detach(), dim=-1)
    return [t.detach().numpy() for t in (out, lse, q.grad, k.grad, v.grad)]


def errors(got, want):
    floor = SCALE_FLOOR_FRACTION * max(np.abs(w).max() for w in want[2:])
    return {n: rel_error(g, w, floor if i >= 2 else 0.0)
            for i, (n, g, w) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, want))}


@pytest.mark.parametrize("Tq,Tk,D,causal,offset,tiles", [
    (113, 203, 40, False, 0, (32, 64)),
    (128, 217, 16, True, 217 - 128, (32, 48)),       # bottom-right: FlashAttention's
    (50, 70, 8, True, 0, (7, 9)),                     # top-left: SDPA's is_causal
    (33, 33, 80, True, 0, (None, None)),
])
def test_ops_match_autograd(Tq, Tk, D, causal, offset, tiles):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, T, D)) for T in (Tq, Tk, Tk))
    dout = rng.standard_normal((2, 3, Tq, D))
    kw = dict(causal=causal, causal_offset=offset, block_q=tiles[0], block_k=tiles[1])
    out, lse = attention_forward(q, k, v, **kw)
    got = [out, lse, *attention_backward(dout, q, k, v, out, lse, **kw)]
    errs = errors(got, torch_attention(q, k, v, causal, offset, dout))
    assert max(errs.values()) <= FLOAT64_BOUND, errs


def test_ops_match_sdpa_is_causal():
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 2, 37, 12)) for _ in range(4))
    qt, kt, vt = (torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))
    out_t = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    out_t.backward(torch.from_numpy(dout))
    out, lse = attention_forward(q, k, v, causal=True, block_q=8, block_k=5)
    grads = attention_backward(dout, q, k, v, out, lse, causal=True, block_q=8, block_k=5)
    for g, w in zip((out,) + grads, (out_t, qt.grad, kt.grad, vt.grad)):
        assert rel_error(g, w.detach().numpy()) <= FLOAT64_BOUND


class FixedDropout(torch.nn.Module):
    """nn.Dropout with a given keep-mask: ``w * keep / (1 - p)``."""

    def __init__(self, keep, p):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, w):
        return w * self.keep / (1.0 - self.p)


@pytest.mark.parametrize("dropout", [0.0, 0.4])
def test_module_matches_torch_multihead_attention(dropout):
    """Weights from torch_impl; in training mode the torch module's nn.Dropout is
    replaced by the blockwise module's keep-mask, applied the chapter's way."""
    torch.manual_seed(0)
    t_mod = torch_impl.MultiHeadAttention(6, 8, 20, dropout, 2, qkv_bias=True).double()
    m = nr.BlockwiseMultiHeadAttention(6, 8, 20, dropout, 2, qkv_bias=True, rng=0)
    m.load_state_dict(t_mod.state_dict())
    m.block_q, m.block_k = 4, 3
    rng = np.random.default_rng(2)
    x, dout = rng.standard_normal((2, 15, 6)), rng.standard_normal((2, 15, 8))
    if dropout == 0.0:
        t_mod.eval(), m.eval()
    out = m.forward(x)
    dx = m.backward(dout)
    if dropout:
        keep = torch.from_numpy(m.last_keep_mask())
        t_mod.dropout = FixedDropout(keep, dropout)
    x_t = torch.from_numpy(x).requires_grad_(True)
    out_t = t_mod(x_t)
    out_t.backward(torch.from_numpy(dout))
    assert rel_error(out, out_t.detach().numpy()) <= FLOAT64_BOUND
    assert rel_error(dx, x_t.grad.numpy()) <= FLOAT64_BOUND
    floor = SCALE_FLOOR_FRACTION * np.abs(dx).max()
    for name, p in t_mod.named_parameters():
        assert rel_error(m.grads[name], p.grad.numpy(), floor) <= FLOAT64_BOUND, name
