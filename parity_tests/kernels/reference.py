"""The golden result and the baseline a kernel is judged against.

Golden: the blockwise NumPy attention (``numpy_ref.blockwise``) in float64 on the
inputs already rounded to the tested dtype: out and dq, dk, dv, exact to ~1e-16,
in O(T) memory, so T = 16384 runs on a laptop.

Baseline: the same formulas written plainly in PyTorch, in the tested dtype, on
the same device -- what an engineer would write without a fused kernel::

    S  = scale * Q K^T ; masked with -inf       P  = softmax(S)      O = P V
    dV = P^T dO        ; dP = dO V^T             D  = rowsum(dO ∘ O)
    dS = P ∘ (dP - D)  ; dQ = scale * dS K       dK = scale * dS^T Q

Its error against the golden result says how far an ordinary computation in
that dtype drifts; the kernel is allowed a few times that (see
``tolerances.CHECK_FACTOR``).  Query rows are taken in chunks so the (Tq, Tk)
arrays stay under ~2^25 elements; up to T ~ 8000 there is one chunk, i.e. the
plain dense computation.  Where there are several, dK and dV are summed over
the chunks in float32, as a single matmul would accumulate them before its one
final rounding.

Rows that see no key (causal, bottom-right alignment, Tq > Tk: query i with
i + Tk - Tq < 0): softmax over an empty set.  The check expects what
FlashAttention and PyTorch's SDPA return there: an output row of zeros, a dq
row of zeros, and no contribution to dk or dv.  (The chapter's modules and
``numpy_ref.blockwise`` return NaN for such a row; the reference here solves
only the rows that see a key and pads the others with zeros.)
"""

import numpy as np
import torch

__all__ = ["golden", "baseline", "first_visible_row"]

_CHUNK_ELEMENTS = 2 ** 25


def _blockwise():
    from numpy_ref import blockwise       # the O(T)-memory float64 reference
    return blockwise.attention_forward, blockwise.attention_backward


def first_visible_row(case, offset):
    """Index of the first query row that sees at least one key."""
    return max(0, -offset) if case.causal else 0


def golden(q, k, v, dout, case, offset, functions=None):
    """(out, dq, dk, dv) in float64, (B, H, T, D); ``functions`` replaces the
    blockwise pair ``(attention_forward, attention_backward)`` (tests only)."""
    forward, backward = functions or _blockwise()
    r0 = min(first_visible_row(case, offset), case.tq)
    out, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    if r0 == case.tq:                       # no row sees a key
        return out, dq, dk, dv
    qs, ds = q[..., r0:, :], dout[..., r0:, :]
    opts = dict(scale=case.scale, causal=case.causal, causal_offset=offset + r0)
    o, lse = forward(qs, k, v, **opts)
    gq, dk, dv = backward(ds, qs, k, v, o, lse, **opts)
    out[..., r0:, :], dq[..., r0:, :] = o, gq
    return out, dq, dk, dv


def _visible(tq, tk, r0, r1, causal, offset, device):
    """(r1 - r0, Tk) boolean: True where query i sees key j."""
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    return (j <= i + offset) if causal else torch.ones(r1 - r0, tk, dtype=torch.bool, device=device)


def baseline(q, k, v, dout, case, offset):
    """(out, dq, dk, dv) as float64 NumPy arrays from the plain computation in q's
    dtype on q's device (torch tensors in, (B, H, T, D))."""
    scale, tq, tk = case.scale, case.tq, case.tk
    chunk = max(64, _CHUNK_ELEMENTS // max(tk, 1))
    several = chunk < tq
    acc = torch.float32 if several and q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    with torch.no_grad():
        for r0 in range(0, tq, chunk):
            r1 = min(tq, r0 + chunk)
            qc, doc = q[..., r0:r1, :], dout[..., r0:r1, :]
            seen = _visible(tq, tk, r0, r1, case.causal, offset, q.device)     # (rows, Tk)
            S = (qc @ k.transpose(-1, -2)) * scale                             # (B, H, rows, Tk)
            S = S.masked_fill(~seen, -torch.inf)
            P = torch.softmax(S, dim=-1)
            P = torch.where(seen.any(-1, keepdim=True), P, torch.zeros((), dtype=P.dtype, device=P.device))
            O = P @ v                                                          # (B, H, rows, D)
            dP = doc @ v.transpose(-1, -2)                                     # (B, H, rows, Tk)
            D = (doc * O).sum(-1, keepdim=True)                                # (B, H, rows, 1)
            dS = P * (dP - D)
            out[..., r0:r1, :] = O
            dq[..., r0:r1, :] = (dS @ k) * scale
            dk += ((dS.transpose(-1, -2) @ qc) * scale).to(acc)
            dv += (P.transpose(-1, -2) @ doc).to(acc)
    return tuple(_numpy(t.to(q.dtype)) for t in (out, dq, dk, dv))


def _numpy(t):
    return t.detach().to("cpu", torch.float64).numpy()


# ---------------------------------------------------------------------------
# The production features (``features``): golden and baseline of one case
# ---------------------------------------------------------------------------

def feature_golden(q, k, v, dout, opts):
    """The float64 reference of a feature case: a dict of NumPy arrays ``out``, ``lse``
    and, with ``dout``, ``dq``, ``dk``, ``dv`` (``dbias``, ``dsinks`` with a bias or sinks).
    ``opts``: ``numpy_ref.reference_attention``'s options.  (``dense.run(q, k, v, dout, opts)``
    computes the same densely with autograd: it agrees to ~1e-15 on every feature case.)"""
    from numpy_ref import reference_attention
    return {n: np.asarray(a, dtype=np.float64) for n, a in reference_attention(q, k, v, dout, **opts).items()}


def feature_baseline(q, k, v, dout, opts, dtype, device):
    """The same computed plainly in PyTorch in ``dtype`` on ``device`` (the features'
    formulas in ``dense``, gradients by autograd): float64 NumPy arrays."""
    from parity_tests.kernels import dense
    return dense.run(q, k, v, dout, opts, dtype, device)
