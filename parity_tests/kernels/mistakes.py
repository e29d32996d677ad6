"""The catalogue of mistakes attention kernels make, each recomputed in float64.

Each entry is the reference computed *under that mistake*, on the same rounded
inputs and upstream gradient: when a failing tensor sits within its bound of
one of them, that is what the kernel does.  Forward mistakes are a dense
float64 PyTorch attention with one thing changed, differentiated by autograd
(so dq, dk, dv are the gradients a kernel with that forward would produce);
backward mistakes change one step of the backward formulas::

    S = scale Q K^T (masked)   P = softmax(S)   O = P V
    dV = P^T dO   dP = dO V^T   D = rowsum(dO ∘ O)   dS = P ∘ (dP - D)
    dQ = scale dS K            dK = scale dS^T Q

dV has no scale in it, so "missing the scale" applies to dQ and dK only.

A `Hypothesis` has an ``id`` (stable, for tests and JSON), the words that
complete "matches the reference with ...", and ``predict()`` -> a dict of the
tensors it models (``out``, ``dq``, ``dk``, ``dv``), float64 NumPy, (B, H, T, D);
``predict(grads=False)`` gives out alone, without autograd (a forward mistake
that does not reproduce the output is not tried on the gradients).
Two entries are judged elsewhere, since no recomputation reproduces them:
dropout left on (the kernel disagrees with itself on a second call) and a
wrong softmax denominator (out is the reference with each row multiplied by
its own factor, fitted row by row); see ``diagnosis``.
"""

from dataclasses import dataclass

import torch

__all__ = ["Hypothesis", "catalogue", "STALE_BLOCKS", "attention64"]

# Key-block sizes tried for the stale running maximum (a kernel's B_c is not known).
STALE_BLOCKS = (16, 32, 64, 128, 256)


@dataclass
class Hypothesis:
    id: str
    says: str
    predict: object          # (grads=True) -> {tensor: array}; grads=False: out alone
    tensors: tuple = ("out", "dq", "dk", "dv")


def _mask(tq, tk, offset):
    i = torch.arange(tq)[:, None]
    j = torch.arange(tk)[None, :]
    return j > i + offset                       # True: hidden


def _softmax(S, axis):
    """Softmax with rows (or columns) that see nothing set to 0, not NaN."""
    seen = torch.isfinite(S).any(axis, keepdim=True)
    P = torch.softmax(S.masked_fill(~seen, 0.0), dim=axis)
    return P * seen


def _stale_max(S, v, block):
    """Online softmax over key blocks that forgets to rescale by exp(m_old - m_new)."""
    m = torch.full(S.shape[:-1], -torch.inf, dtype=S.dtype)
    l = torch.zeros(S.shape[:-1], dtype=S.dtype)
    acc = torch.zeros(S.shape[:-1] + (v.shape[-1],), dtype=S.dtype)
    # split, not S[..., j0:j1]: a slice's backward writes a full-size zero gradient per block
    for Sb, vb in zip(S.split(block, dim=-1), v.split(block, dim=-2)):
        m = torch.maximum(m, Sb.amax(-1))
        shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(Sb - shift[..., None])
        l = l + p.sum(-1)                       # the mistake: l and acc not multiplied
        acc = acc + p @ vb                      # by exp(m_old - m_new)
    return acc / torch.where(l > 0, l, torch.ones_like(l))[..., None]


def attention64(q, k, v, *, scale, causal, offset, axis=-1, stale_block=None):
    """Dense float64 attention with the knobs the catalogue turns.  (B, H, T, D) tensors."""
    S = (q @ k.transpose(-1, -2)) * scale                     # (B, H, Tq, Tk)
    if causal:
        S = S.masked_fill(_mask(q.shape[-2], k.shape[-2], offset), -torch.inf)
    if stale_block is not None:
        return _stale_max(S, v, stale_block)
    return _softmax(S, axis) @ v


def _forward_mistake(inputs, dout, **knobs):
    """Predict out, dq, dk, dv of a kernel whose forward is ``attention64(**knobs)``."""
    swap = knobs.pop("swap_layout", False)

    def predict(grads=True):
        q, k, v = (torch.tensor(a, requires_grad=grads) for a in inputs)
        if swap:       # (B, T, H, D) read as (B, H, T, D): attention runs across the heads
            out = attention64(*(t.transpose(1, 2) for t in (q, k, v)), **knobs).transpose(1, 2)
        else:
            out = attention64(q, k, v, **knobs)
        if not grads:
            return {"out": out.numpy()}
        grads = torch.autograd.grad(out, (q, k, v), torch.from_numpy(dout))
        return {name: t.detach().numpy() for name, t in zip(("out", "dq", "dk", "dv"), (out,) + grads)}
    return predict


def _no_delta(inputs, dout, case, offset):
    """Backward with dS = P ∘ dP: the D = rowsum(dO ∘ O) correction dropped."""
    def predict(grads=True):
        q, k, v = (torch.from_numpy(a) for a in inputs)
        dO = torch.from_numpy(dout)
        S = (q @ k.transpose(-1, -2)) * case.scale
        if case.causal:
            S = S.masked_fill(_mask(case.tq, case.tk, offset), -torch.inf)
        P = _softmax(S, -1)
        dS = P * (dO @ v.transpose(-1, -2))
        return {"dq": ((dS @ k) * case.scale).numpy(),
                "dk": ((dS.transpose(-1, -2) @ q) * case.scale).numpy()}
    return predict


def catalogue(case, offset, align, inputs, dout, golden):
    """The hypotheses that can be told apart from the reference on this case
    (``golden``: tensor name -> the reference's array)."""
    fwd = lambda **knobs: _forward_mistake(inputs, dout, **knobs)
    base = dict(scale=case.scale, causal=case.causal, offset=offset)
    out = []
    if case.causal:
        out.append(Hypothesis("no-causal-mask", "no causal mask", fwd(**{**base, "causal": False})))
        out.append(Hypothesis("mask-one-future", "the causal mask shifted one diagonal "
                              "(each query also sees the next key)", fwd(**{**base, "offset": offset + 1})))
        out.append(Hypothesis("mask-one-past", "the causal mask shifted one diagonal "
                              "the other way (each query misses its own key)", fwd(**{**base, "offset": offset - 1})))
        if case.tq != case.tk:
            other = "bottom-right" if align == "top-left" else "top-left"
            other_offset = case.tk - case.tq if other == "bottom-right" else 0
            out.append(Hypothesis("other-alignment", f"{other} causal alignment (the check assumed {align})",
                                  fwd(**{**base, "offset": other_offset})))
    d = case.head_dim
    if d > 1:
        out.append(Hypothesis("scale-1/D", "scale 1/D instead of 1/sqrt(D)", fwd(**{**base, "scale": 1.0 / d})))
        out.append(Hypothesis("no-scale", "no scale (1 instead of 1/sqrt(D))", fwd(**{**base, "scale": 1.0})))
    if case.tq > 1:
        out.append(Hypothesis("softmax-over-queries", "the softmax taken over the query axis "
                              "instead of the key axis", fwd(**base, axis=-2)))
    if case.tq == case.tk and case.tq > 1:
        out.append(Hypothesis("layout-bthd-as-bhtd", "(B, T, H, D) read as (B, H, T, D): "
                              "attention across the heads instead of the tokens", fwd(**base, swap_layout=True)))
    for block in STALE_BLOCKS:
        if case.tk > block:
            out.append(Hypothesis("stale-max", f"a stale running maximum (key blocks of {block} "
                                  "not rescaled when the maximum moves)", fwd(**base, stale_block=block)))
    if case.tk > 1:
        out.append(Hypothesis("backward-no-D", "the backward's D = rowsum(dO ∘ O) term dropped",
                              _no_delta(inputs, dout, case, offset), tensors=("dq", "dk")))
        s = case.scale
        out.append(Hypothesis("dq-missing-scale", "dq missing the scale",
                              lambda grads=True: {"dq": golden["dq"] / s}, tensors=("dq",)))
        out.append(Hypothesis("dk-missing-scale", "dk missing the scale",
                              lambda grads=True: {"dk": golden["dk"] / s}, tensors=("dk",)))
    return out
