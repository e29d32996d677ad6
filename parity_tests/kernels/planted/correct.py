"""Correct attention kernels, one per standard way of computing it: what the check's bound
must pass at every seed (``tolerances``, "the baseline's formulations").

Written here, independently of the check (a witness must not share the code it
witnesses): each takes ``(q, k, v, *, causal, scale, align)``, (B, H, T, D), computes
in float32 for the half dtypes (as fused kernels do: scores and accumulators in
float32; float64 in float64, where they are tested equal to the reference) and
returns the input's dtype, differentiable.

=================  ==========================================================
kernel             how its weights are formed
=================  ==========================================================
``max_subtracted``  softmax with the row maximum subtracted, divided by the sum
``lse_weights``     ``P = exp(S − lse)`` (every kernel that saves lse for its backward)
``flash2_<Bc>``     FlashAttention-2: online softmax over key tiles of Bc with float32
                    ``m``, ``ℓ`` and accumulator; backward recomputes
                    ``P = exp(S − L)`` per tile and uses ``D = rowsum(dO ∘ O)``
``exp2``            the same with ``log2 e`` folded into the scale (Triton's tutorial,
                    FlashAttention 3): ``exp2(S·log2 e − m₂)``
``p_cast``          FlashAttention-2 with P rounded to the input dtype before ``P V``
                    and ``Pᵀ dO`` (what FlashAttention does in bfloat16 and float16)
``split_kv``        three key splits, each (out_s, lse_s), merged through the lse:
                    ``out = Σ exp(lse_s − lse) out_s``
=================  ==========================================================
"""

import math

import torch

LOG2E = 1.0 / math.log(2.0)


def _wide(x):
    """x in float32, or float64 when it is float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _hidden(tq, tk, causal, align, device):
    """(Tq, Tk) bool, True where query i does not see key j (top-left: j > i;
    bottom-right: j > i + Tk − Tq)."""
    if not causal:
        return torch.zeros(tq, tk, dtype=torch.bool, device=device)
    offset = tk - tq if align == "bottom-right" else 0
    i = torch.arange(tq, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    return j > i + offset


def _scores(q, k, scale, causal, align):
    S = (_wide(q) @ _wide(k).transpose(-1, -2)) * scale
    return S.masked_fill(_hidden(q.shape[-2], k.shape[-2], causal, align, q.device), -torch.inf)


def _empty_rows_zero(S):
    """Scores with the rows that see no key set to 0 (their weights are zeroed after)."""
    seen = torch.isfinite(S).any(-1, keepdim=True)
    return S.masked_fill(~seen, 0.0), seen


def max_subtracted(q, k, v, *, causal, scale, align="top-left"):
    S, seen = _empty_rows_zero(_scores(q, k, scale, causal, align))
    m = S.amax(-1, keepdim=True)
    E = torch.exp(S - m)
    P = E / E.sum(-1, keepdim=True) * seen
    return (P @ _wide(v)).to(q.dtype)


def lse_weights(q, k, v, *, causal, scale, align="top-left"):
    S, seen = _empty_rows_zero(_scores(q, k, scale, causal, align))
    P = torch.exp(S - torch.logsumexp(S, -1, keepdim=True)) * seen
    return (P @ _wide(v)).to(q.dtype)


class _Flash2(torch.autograd.Function):
    """FlashAttention-2's Algorithms 1 and 2 over key tiles (the query rows whole), float32
    inside.  ``base2``: scores in units of log 2 (``exp2``); ``p_dtype``: the dtype P is
    rounded to before it meets V or dO."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, align, block, base2, p_dtype):
        q32, k32, v32 = _wide(q), _wide(k), _wide(v)
        b, h, tq, _ = q.shape
        tk = k.shape[-2]
        c = scale * LOG2E if base2 else scale
        ex = torch.exp2 if base2 else torch.exp
        hidden = _hidden(tq, tk, causal, align, q.device)
        m = torch.full((b, h, tq, 1), -torch.inf, dtype=q32.dtype, device=q.device)
        l = torch.zeros((b, h, tq, 1), dtype=q32.dtype, device=q.device)
        acc = torch.zeros((b, h, tq, v.shape[-1]), dtype=q32.dtype, device=q.device)
        for j0 in range(0, tk, block):
            j1 = min(tk, j0 + block)
            S = (q32 @ k32[..., j0:j1, :].transpose(-1, -2)) * c
            S = S.masked_fill(hidden[:, j0:j1], -torch.inf)
            m_new = torch.maximum(m, S.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            alpha = ex(m - m_safe)                    # exp(m_old − m_new); 0 when m_old = −inf
            P = ex(S - m_safe)
            l = alpha * l + P.sum(-1, keepdim=True)
            acc = alpha * acc + P.to(p_dtype).to(P.dtype) @ v32[..., j0:j1, :]
            m = m_new
        seen = l > 0
        out = torch.where(seen, acc / torch.where(seen, l, torch.ones_like(l)), torch.zeros_like(acc))
        L = torch.where(seen, m + (torch.log2(l) if base2 else torch.log(l)), torch.full_like(l, -torch.inf))
        ctx.save_for_backward(q32, k32, v32, out, L)
        ctx.args = (c, hidden, block, ex, p_dtype, q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q32, k32, v32, out, L = ctx.saved_tensors
        c, hidden, block, ex, p_dtype, qd, kd, vd = ctx.args
        dO = _wide(dout)
        D = (dO * out).sum(-1, keepdim=True)          # rowsum(dO ∘ O)
        L_safe = torch.where(torch.isfinite(L), L, torch.zeros_like(L))
        dq = torch.zeros_like(q32)
        dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
        for j0 in range(0, k32.shape[-2], block):
            j1 = min(k32.shape[-2], j0 + block)
            kj, vj = k32[..., j0:j1, :], v32[..., j0:j1, :]
            S = (q32 @ kj.transpose(-1, -2)) * c
            P = ex(S.masked_fill(hidden[:, j0:j1], -torch.inf) - L_safe) * torch.isfinite(L)
            dv[..., j0:j1, :] = P.to(p_dtype).to(P.dtype).transpose(-1, -2) @ dO
            dP = dO @ vj.transpose(-1, -2)
            dS = P * (dP - D)
            dq += dS @ kj
            dk[..., j0:j1, :] = dS.transpose(-1, -2) @ q32
        s = c / LOG2E if ex is torch.exp2 else c      # dS is with respect to S = scale · q kᵀ
        return (dq * s).to(qd), (dk * s).to(kd), dv.to(vd), None, None, None, None, None, None


def flash2(block, base2=False, cast_p=False):
    def kernel(q, k, v, *, causal, scale, align="top-left"):
        p_dtype = q.dtype if cast_p else torch.float64
        return _Flash2.apply(q, k, v, scale, causal, align, block, base2, p_dtype)
    kernel.__name__ = f"flash2_{block}" + ("_exp2" if base2 else "") + ("_p_cast" if cast_p else "")
    return kernel


def split_kv(q, k, v, *, causal, scale, align="top-left", splits=3):
    """Partials over ``splits`` key ranges, merged through their lse (autograd through all)."""
    S = _scores(q, k, scale, causal, align)
    bounds = [round(i * S.shape[-1] / splits) for i in range(splits + 1)]
    outs, lses = [], []
    for j0, j1 in zip(bounds, bounds[1:]):
        Sj, seen = _empty_rows_zero(S[..., j0:j1])
        lse_j = torch.logsumexp(Sj, -1, keepdim=True).masked_fill(~seen, -torch.inf)
        outs.append((torch.exp(Sj - torch.where(seen, lse_j, torch.zeros_like(lse_j))) * seen) @ _wide(v[..., j0:j1, :]))
        lses.append(lse_j)
    parts = torch.cat(lses, -1)
    seen = torch.isfinite(parts).any(-1, keepdim=True)          # a row that sees no key: out 0
    lse = torch.logsumexp(parts.masked_fill(~seen, 0.0), -1, keepdim=True)
    out = sum(torch.exp(l_s - lse) * o_s for l_s, o_s in zip(lses, outs))
    return out.to(q.dtype)


CORRECT = {f.__name__: f for f in (max_subtracted, lse_weights, flash2(16), flash2(64), flash2(128),
                                   flash2(64, base2=True), flash2(64, cast_p=True), flash2(128, True, True),
                                   split_kv)}


# ----------------------------------------------------------------------------
# A gradient through lse (``--features lse_grad``) under a window: on a 0-wide window each row
# sees one key and dS_i = dlse_i, which the softmax's own backward forms exactly, and
# FlashAttention-2's D = rowsum(dO ∘ O) − dlse does not (``runner.one_key_terms``).

class _RowsumD(torch.autograd.Function):
    """(out, lse) in float32 or wider, P = exp(S − lse) for the rows that see a key; backward as
    FlashAttention-2's: D = rowsum(dO ∘ O) − dlse, formed apart from dP = dO Vᵀ."""

    @staticmethod
    def forward(ctx, q, k, v, scale, hidden):
        q32, k32, v32 = _wide(q), _wide(k), _wide(v)
        S = ((q32 @ k32.transpose(-1, -2)) * scale).masked_fill(hidden, -torch.inf)
        lse = torch.logsumexp(S, -1, keepdim=True)
        seen = torch.isfinite(lse)
        P = torch.exp(S - torch.where(seen, lse, torch.zeros_like(lse))) * seen
        out = P @ v32
        ctx.save_for_backward(q32, k32, v32, P, out)
        ctx.scale, ctx.dtypes = scale, (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype), lse[..., 0]

    @staticmethod
    def backward(ctx, dout, dlse):
        q32, k32, v32, P, out = ctx.saved_tensors
        dO = _wide(dout)
        D = (dO * out).sum(-1, keepdim=True) - (0.0 if dlse is None else _wide(dlse)[..., None])
        dS = P * (dO @ v32.transpose(-1, -2) - D) * ctx.scale
        qd, kd, vd = ctx.dtypes
        return (dS @ k32).to(qd), (dS.transpose(-1, -2) @ q32).to(kd), (P.transpose(-1, -2) @ dO).to(vd), None, None


def rowsum_d(q, k, v, *, causal, scale, align="top-left", window=None):
    """FlashAttention-2's backward by formula, returning (out, lse), under a window (left, right),
    −1 unbounded, about the diagonal the alignment puts the last query on."""
    tq, tk = q.shape[-2], k.shape[-2]
    left, right = (-1, -1) if window is None else window
    right = 0 if causal else right
    offset = tk - tq if align == "bottom-right" else 0
    i = torch.arange(tq, device=q.device)[:, None] + offset
    j = torch.arange(tk, device=q.device)[None, :]
    hidden = ((j < i - left) if left >= 0 else torch.zeros_like(j < i)) | \
        ((j > i + right) if right >= 0 else torch.zeros_like(j < i))
    return _RowsumD.apply(q, k, v, scale, hidden)


# ----------------------------------------------------------------------------
# Sinks (``--features sinks``): one logit per head in every row's denominator, no value.
# dsinks is a sum over every row of terms that cancel, and each formulation rounds them its
# own way: both must pass (``tolerances.reduction_floor``).

def sinks_concatenated(q, k, v, *, causal, scale, align="top-left", sinks=None):
    """transformers' gpt-oss eager attention: the sink column concatenated to the scores, the
    row maximum subtracted, softmax, the column dropped; autograd gives dsinks."""
    S = (q @ k.transpose(-1, -2)) * scale
    S = S.masked_fill(_hidden(q.shape[-2], k.shape[-2], causal, align, q.device), -torch.inf)
    sink = _sink(sinks, q).to(S.dtype).expand(S.shape[0], -1, S.shape[2], 1)
    combined = torch.cat([S, sink], dim=-1)
    combined = combined - combined.amax(-1, keepdim=True).detach()
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


def sinks_in_denominator(q, k, v, *, causal, scale, align="top-left", sinks=None):
    """The sink written into the denominator: out = Σ_j e^{S_j − m} v_j / (Σ_j e^{S_j − m} + e^{sink − m}),
    in float32 or wider; autograd gives dsinks.  (Without sinks, the softmax: autograd through
    E / Σ E rounds a one-key row's dq about 1.0 x the plain bound, measured once in 17 seeds.)"""
    if sinks is None:
        return max_subtracted(q, k, v, causal=causal, scale=scale, align=align)
    S = _scores(q, k, scale, causal, align)
    sink = _wide(_sink(sinks, q))
    m = torch.maximum(S.amax(-1, keepdim=True), sink).detach()
    E = torch.exp(S - m)
    return ((E @ _wide(v)) / (E.sum(-1, keepdim=True) + torch.exp(sink - m))).to(q.dtype)


def _sink(sinks, q):
    """The sinks as (1, H, 1, 1); −inf (no sink) on the cases without them."""
    if sinks is None:
        return torch.full((1, q.shape[1], 1, 1), -torch.inf, dtype=q.dtype, device=q.device)
    return sinks.reshape(1, -1, 1, 1)


SINKS = {f.__name__.replace("_", "-"): f for f in (sinks_concatenated, sinks_in_denominator)}
