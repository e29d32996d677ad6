"""Kernels with production features, right and deliberately wrong: one wrong kernel per
catalogued feature mistake.  Written apart from the check's own formulas (``dense``):
the sink as one more softmax column dropped afterwards (gpt-oss's reference), masks
built from positions, varlen as a loop over ``cu_seqlens``.  Each computes in float64
and returns the input's dtype (lse in float32, as FlashAttention's)."""

import math

import torch


class _OneHeadExpand(torch.autograd.Function):
    """kv heads repeated for their group; the backward takes the gradient of query
    head ``r`` of each group alone instead of summing the group."""

    @staticmethod
    def forward(ctx, x, group, r):
        ctx.group, ctx.r = group, r
        return x.repeat_interleave(group, 1)

    @staticmethod
    def backward(ctx, g):
        b, h, t, d = g.shape
        return g.view(b, h // ctx.group, ctx.group, t, d)[:, :, ctx.r], None, None


class _NoGradient(torch.autograd.Function):
    """Identity forward; the backward passes nothing on (a kernel that ignores dlse)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g)


class _CapWithoutDerivative(torch.autograd.Function):
    """c · tanh(S / c) forward; the backward passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, S, c):
        return c * torch.tanh(S / c)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _CapOtherDerivative(torch.autograd.Function):
    """c · tanh(S / c) forward; the backward multiplies by 1 − tanh²(capped / c) ("of-capped": the
    recomputed capped score fed to the derivative) or by 1 − capped² ("capped-squared")."""

    @staticmethod
    def forward(ctx, S, c, form):
        capped = c * torch.tanh(S / c)
        ctx.save_for_backward(capped)
        ctx.c, ctx.form = c, form
        return capped

    @staticmethod
    def backward(ctx, g):
        capped, = ctx.saved_tensors
        slope = 1 - torch.tanh(capped / ctx.c) ** 2 if ctx.form == "of-capped" else 1 - capped ** 2
        return g * slope, None, None


class _CappedSoftmaxDerivativeOnDp(torch.autograd.Function):
    """P = softmax(c · tanh(R / c)) over the keys ``seen`` sees, from the scaled scores R; the
    backward written as a kernel's tile code does, with the cap's derivative applied to dP alone:
    dR = P ∘ ((1 − t²) dP − D), t = tanh(R / c), D = rowsum(P ∘ dP), where the chain rule gives
    (1 − t²) ∘ P ∘ (dP − D) (the softmax's backward first, then the cap's)."""

    @staticmethod
    def forward(ctx, R, c, seen):
        S = (c * torch.tanh(R / c)).masked_fill(~seen, -math.inf)
        P = torch.nan_to_num(torch.softmax(S, dim=-1))                 # a row that sees nothing: 0
        ctx.save_for_backward(R, P)
        ctx.c = c
        return P

    @staticmethod
    def backward(ctx, dP):
        R, P = ctx.saved_tensors
        t = torch.tanh(R / ctx.c)
        D = (P * dP).sum(-1, keepdim=True)
        return P * ((1 - t * t) * dP - D), None, None


class _BackwardRedraws(torch.autograd.Function):
    """W = P ∘ keep / (1 − p) forward; the backward draws a fresh mask from torch's RNG
    instead of reusing the forward's."""

    @staticmethod
    def forward(ctx, P, keep, p):
        ctx.save_for_backward(P)
        ctx.p = p
        return P * keep / (1 - p)

    @staticmethod
    def backward(ctx, g):
        P, = ctx.saved_tensors
        again = torch.rand(P.shape, dtype=P.dtype) >= ctx.p
        return g * again / (1 - ctx.p), None, None


def _dropout(P, S, dropout_p, mistake):
    """(P, S) with dropout: the mask drawn from torch's global RNG, ``mistake`` planted."""
    p = 0.1 if mistake == "dropout-at-zero" and not dropout_p else dropout_p
    if not p:
        return P, S
    keep = torch.rand(P.shape, dtype=P.dtype) >= p
    if mistake == "dropout-before-softmax":                 # the scores dropped, renormalised
        return None, S.masked_fill(~keep, -math.inf)
    if mistake == "dropout-backward-mask":
        return _BackwardRedraws.apply(P, keep, p), S
    scale = {"dropout-no-rescale": 1.0, "dropout-rescaled-twice": (1 - p) ** 2, "dropout-rescaled-by-1/p": p,
             "dropout-times-keep": 1 / (1 - p)}.get(mistake, 1 - p)
    return P * keep / scale, S


def _offset(tq, tk, align):
    return 0 if align == "top-left" else tk - tq


def attend(q, k, v, *, causal, scale, align="top-left", window=None, softcap=None, alibi_slopes=None,
           bias=None, sinks=None, dropout_p=0.0, mistake=None):
    """(out, lse) of attention with the features, (B, H, T, D); ``mistake`` plants one."""
    dt = q.dtype
    work = torch.bfloat16 if mistake == "in-bfloat16" else torch.float64     # a float32 kernel in bf16
    q, k, v = (t.to(work) for t in (q, k, v))
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    if mistake == "gqa-repeat":
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    elif mistake == "gqa-grad-one-head":
        k, v = _OneHeadExpand.apply(k, group, 0), _OneHeadExpand.apply(v, group, 0)
    else:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    off = _offset(tq, tk, align)
    if mistake == "decode-top-left" and tq < 16:
        off = 0
    S = q @ k.transpose(-1, -2)
    raw = S * scale                                         # "softcap-derivative-on-dp" forms P from it
    if softcap is not None and mistake == "softcap-after-bias":
        S = S * scale                                       # capped below, after ALiBi and the bias
    elif softcap is not None:
        if mistake == "softcap-before-scale":
            S = softcap * torch.tanh(S / softcap) * scale
        elif mistake == "softcap-no-derivative":
            S = _CapWithoutDerivative.apply(S * scale, softcap)
        elif mistake in ("softcap-derivative-of-capped", "softcap-derivative-capped-squared"):
            S = _CapOtherDerivative.apply(S * scale, softcap, mistake.split("derivative-")[1])
        elif mistake == "softcap-positive-only":
            S = S * scale
            S = torch.where(S > 0, softcap * torch.tanh(S / softcap), S)
        elif mistake == "softcap-clamped":
            S = (S * scale).clamp(-softcap, softcap)
        else:
            S = softcap * torch.tanh(S * scale / softcap)
    else:
        S = S * scale
    i = torch.arange(tq, dtype=work)[:, None]
    j = torch.arange(tk, dtype=work)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(work)
        if mistake == "alibi-reversed":
            slopes = slopes.flip(0)
        elif mistake == "alibi-per-kv-head":
            slopes = slopes[torch.arange(hq) // group]
        sign = -1.0 if mistake == "alibi-sign" else 1.0
        dist = (i - j).abs() if mistake == "alibi-no-offset" else (i + off - j).abs()
        if mistake == "alibi-other-alignment":             # FlashAttention's bottom-right offset whatever align is
            other = "top-left" if align == "bottom-right" else "bottom-right"
            dist = (i + _offset(tq, tk, other) - j).abs()
        if mistake == "alibi-signed":                      # right under a causal mask only
            dist = i + off - j
        if mistake == "alibi-positions-bfloat16":          # positions from arange(..., dtype=bfloat16)
            dist = ((i + off).bfloat16() - j.bfloat16()).abs().to(work)
        S = S - sign * slopes[:, None, None] * dist
    if bias is not None:
        added = (bias.detach() if mistake == "bias-no-grad" else bias).to(work)
        if mistake == "dbias-after-softcap-derivative":    # dbias from dS x (1 - tanh^2): S is c tanh(s / c) here
            added = added.detach() + (added - added.detach()) * (1 - (S / softcap) ** 2).detach()
        S = S + added
    if softcap is not None and mistake == "softcap-after-bias":
        S = softcap * torch.tanh(S / softcap)
    seen = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        seen &= j <= i + off
    if window is not None:
        left, right = window
        if mistake == "window-swapped":
            left, right = right, left
        # an unbounded side (-1) stays unbounded, a 0-wide one is not narrowed
        left += {"window-left-wider": left >= 0, "window-left-narrower": -(left >= 1)}.get(mistake, 0)
        right += {"window-right-wider": right >= 0, "window-right-narrower": -(right >= 1)}.get(mistake, 0)
        w_off = _offset(tq, tk, "bottom-right" if align == "top-left" else "top-left") \
            if mistake == "window-other-alignment" else off
        if left >= 0:
            seen &= j >= i + w_off - left
        if right >= 0:
            seen &= j <= i + w_off + right
    S = S.masked_fill(~seen, -math.inf)
    if sinks is not None and mistake != "sink-ignored":
        s = (sinks.detach() if mistake == "sink-no-grad" else sinks).to(work)
        S = torch.cat([S, s[None, :, None, None].expand(b, hq, tq, 1)], dim=-1)
    lse = torch.logsumexp(S, dim=-1)                                   # -inf where nothing is seen
    P = torch.exp(S - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    if S.shape[-1] > tk:
        P = P[..., :tk]                                                # the sink's column dropped
    if mistake == "softcap-derivative-on-dp" and softcap is not None:   # softcap alone: no ALiBi, bias, sink
        P = _CappedSoftmaxDerivativeOnDp.apply(raw, softcap, seen.expand_as(raw))
    P, dropped = _dropout(P, S, dropout_p, mistake)
    if P is None:                                                      # the softmax of what is left
        lse_dropped = torch.logsumexp(dropped, dim=-1)
        P = torch.exp(dropped - torch.where(torch.isfinite(lse_dropped), lse_dropped, 0.0)[..., None])
    out = _stale(S[..., :tk], v, 32) if mistake == "stale-max" else P @ v
    if mistake == "lse-base-2":
        lse = lse / math.log(2.0)
    elif mistake == "lse-no-max":
        m = S.amax(-1)
        lse = torch.where(torch.isfinite(m), lse - m, lse)
    if mistake == "lse-grad-dropped":
        lse = _NoGradient.apply(lse)
    return out.to(dt), lse.float()


def _stale(S, v, block):
    """Online softmax over key blocks that never rescales l and acc when the maximum moves."""
    m = torch.full(S.shape[:-1], -math.inf, dtype=S.dtype)
    l, acc = torch.zeros(S.shape[:-1], dtype=S.dtype), torch.zeros(S.shape[:-1] + v.shape[-1:], dtype=S.dtype)
    for j0 in range(0, S.shape[-1], block):
        Sb = S[..., j0:j0 + block]
        m = torch.maximum(m, Sb.amax(-1))
        p = torch.exp(Sb - torch.where(torch.isfinite(m), m, 0.0)[..., None])
        l, acc = l + p.sum(-1), acc + p @ v[..., j0:j0 + block, :]
    return acc / torch.where(l > 0, l, 1.0)[..., None]


def varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mistake=None, core=None,
           **options):
    """The packed layout (total, H, D): one sequence at a time, as FlashAttention's varlen;
    ``core``: the (out, lse) of one sequence, (1, H, t, D) (default `attend`)."""
    core = core or attend
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if mistake == "varlen-neighbours":                 # the whole pack as one sequence
        cq, ck = [0, cq[-1]], [0, ck[-1]]
    outs, lses = [], []
    count = len(cq) - 1 - (mistake == "varlen-dropped-last")
    for n in range(count):
        seq = lambda x, c: x[c[n]:c[n + 1]].transpose(0, 1)[None]      # (1, H, t, D)
        out, lse = core(seq(q, cq), seq(k, ck), seq(v, ck), mistake=mistake, **options)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    total = cq[-1]
    out = torch.cat(outs) if outs else q.new_zeros((0,) + q.shape[1:2] + v.shape[2:])
    lse = torch.cat(lses, dim=-1) if lses else torch.zeros(q.shape[1], 0)
    if out.shape[0] < total:                            # a dropped sequence: left as zeros
        out = torch.cat([out, out.new_zeros((total - out.shape[0],) + out.shape[1:])])
        lse = torch.cat([lse, lse.new_zeros(lse.shape[0], total - lse.shape[1])], dim=-1)
    return out, lse


def kernel(mistake=None, *, returns_lse=True, packed=False):
    """A kernel taking every feature's keyword (and ``align``), with ``mistake`` planted."""
    if packed:
        def fn(q, k, v, *, causal, scale, align="top-left", window=None, softcap=None, alibi_slopes=None,
               sinks=None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            out, lse = varlen(q, k, v, causal=causal, scale=scale, align=align, window=window, softcap=softcap,
                              alibi_slopes=alibi_slopes, sinks=sinks, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                              max_seqlen_k=max_seqlen_k, mistake=mistake)
            return (out, lse) if returns_lse else out
    else:
        def fn(q, k, v, *, causal, scale, align="top-left", window=None, softcap=None, alibi_slopes=None,
               bias=None, sinks=None, dropout_p=0.0):
            out, lse = attend(q, k, v, causal=causal, scale=scale, align=align, window=window, softcap=softcap,
                              alibi_slopes=alibi_slopes, bias=bias, sinks=sinks, dropout_p=dropout_p,
                              mistake=mistake)
            return (out, lse) if returns_lse else out
    fn.__name__ = fn.__qualname__ = (mistake or "right").replace("-", "_")
    return fn


# diagnosis id -> the features its kernel is checked with (the id is also the mistake planted)
def one_unit_off_every_other_call(draws=False):
    """A right kernel whose every other call is one unit of roundoff off on out's first
    entry, as atomics' reordering leaves it; ``draws``: it also draws from torch's RNG."""
    calls = [0]

    def kernel(q, k, v, *, causal, scale):
        calls[0] += 1
        if draws:
            torch.rand(1)
        out = attend(q, k, v, causal=causal, scale=scale)[0]
        if calls[0] % 2:
            first = out.detach().reshape(-1)[0]
            nudge = torch.zeros_like(out)
            nudge.view(-1)[0] = torch.nextafter(first, torch.tensor(float("inf"), dtype=out.dtype)) - first
            out = out + nudge
        return out
    return kernel


FEATURE_GALLERY = {
    "gqa-repeat": ["gqa"],
    "gqa-grad-one-head": ["gqa"],
    "window-left-wider": ["window"],
    "window-left-narrower": ["window"],
    "window-right-wider": ["window"],
    "window-right-narrower": ["window"],
    "window-swapped": ["window"],
    "window-other-alignment": ["window"],
    "softcap-before-scale": ["softcap"],
    "softcap-no-derivative": ["softcap"],
    "softcap-derivative-of-capped": ["softcap"],
    "softcap-derivative-capped-squared": ["softcap"],
    "softcap-derivative-on-dp": ["softcap"],
    "softcap-after-bias": ["softcap", "alibi"],
    "softcap-positive-only": ["softcap"],
    "softcap-clamped": ["softcap"],
    "alibi-sign": ["alibi"],
    "alibi-signed": ["alibi"],
    "alibi-reversed": ["alibi"],
    "alibi-no-offset": ["alibi"],
    "alibi-other-alignment": ["alibi"],
    "alibi-per-kv-head": ["gqa", "alibi"],
    "bias-no-grad": ["bias"],
    "dbias-after-softcap-derivative": ["softcap", "bias"],
    "sink-ignored": ["sinks"],
    "sink-no-grad": ["sinks"],
    "varlen-neighbours": ["varlen"],
    "varlen-dropped-last": ["varlen"],
    "lse-base-2": ["lse"],
    "lse-no-max": ["lse"],
    "decode-top-left": ["decode"],
    "lse-grad-dropped": ["lse_grad"],
    "dropout-no-rescale": ["dropout"],
    "dropout-rescaled-twice": ["dropout"],
    "dropout-rescaled-by-1/p": ["dropout"],
    "dropout-times-keep": ["dropout"],
    "dropout-before-softmax": ["dropout"],
    "dropout-backward-mask": ["dropout"],
    "dropout-at-zero": ["dropout"],
}


def wrong_kernel(mistake):
    """The gallery kernel of ``mistake`` and the features to check it with (lse always on)."""
    features = FEATURE_GALLERY[mistake]
    return kernel(mistake, packed="varlen" in features), list(dict.fromkeys(features + ["lse"]))


# Three of dropout's mistakes as ``check`` targets (the README's example).
dropout_no_rescale, dropout_before_softmax, dropout_backward_mask = (
    kernel(m, returns_lse=False) for m in ("dropout-no-rescale", "dropout-before-softmax", "dropout-backward-mask"))
