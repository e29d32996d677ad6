"""Attention with every production feature, written densely in PyTorch.

One function serves three purposes: in float64 it stands in for the golden
result where ``numpy_ref.reference_attention`` is not there; in the tested dtype
it is the *baseline* (the plain computation an engineer would write); and with
one knob turned it is a catalogued mistake (``feature_mistakes``).  Gradients
come from autograd, so each variant's dq, dk, dv, dbias, dsinks are those of its
own forward.  The order of the contract (``CONTRACT.md``, "Beyond the chapter")::

    S = scale · Q Kᵀ                 (query head h reads kv head h // (Hq / Hkv))
    S ← c · tanh(S / c)              softcap
    S ← S − slope_h · |i + o − j|    ALiBi,  o = the alignment's offset
    S ← S + bias
    S ← −inf where j is hidden       causal (j ≤ i + o), window, lengths
    P = softmax([S | sink_h])  with the sink's column dropped after it
    O = P V,  lse_i = log(exp(sink_h) + Σ_j exp(S_ij))

A row that sees no key and no sink gives out 0 (its lse −inf); a padding query
(i ≥ seqlens_q[b]) is such a row even with a sink.

Knobs (the catalogue's mistakes; each None/False means "right"):
``kv_map="repeat"`` (kv heads tiled instead of interleaved), ``softcap_first``
(the cap applied to the unscaled scores), ``softcap_no_grad`` (the cap's
derivative 1 − tanh² left out of the backward), ``shift`` (added to every
offset: the causal mask one diagonal off), ``window_align`` (the window placed
with another alignment than the causal mask), ``alibi_no_offset`` (the ALiBi
distance |i − j| whatever the alignment), ``axis`` (the softmax over queries).
"""

import torch

__all__ = ["attention", "alibi_slopes", "offsets"]


def alibi_slopes(heads):
    """ALiBi's slopes (Press et al., 2022): for H a power of two, 2^(−8 h / H), h = 1..H;
    otherwise those of the nearest power of two below, then every other slope of
    the next one (the authors' ``get_slopes``)."""
    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    n = 1
    while n * 2 <= heads:
        n *= 2
    slopes = power_of_two(n)
    if n < heads:
        slopes += power_of_two(2 * n)[0::2][: heads - n]
    return slopes


def offsets(tq, tk, seqlens_q, seqlens_k, align, batch):
    """Per-batch offset o: query i sees key j iff j ≤ i + o (bottom-right: Tk − Tq
    of each sequence)."""
    if align == "top-left":
        return [0] * batch
    if seqlens_q is None:
        return [tk - tq] * batch
    return [int(lk) - int(lq) for lq, lk in zip(seqlens_q, seqlens_k)]


def _hidden(tq, tk, off, w_off, causal, window, lq, lk, device):
    """(Tq, Tk) bool, True where query i does not see key j."""
    i = torch.arange(tq, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    hidden = (i >= lq) | (j >= lk)
    if causal:
        hidden |= j > i + off
    if window is not None:
        left, right = window
        if left >= 0:
            hidden |= j < i + w_off - left
        if right >= 0 and not causal:
            hidden |= j > i + w_off + right
    return hidden


def attention(q, k, v, *, scale, causal=False, align="top-left", window=None, softcap=None,
              alibi_slopes=None, bias=None, sinks=None, seqlens_q=None, seqlens_k=None,
              kv_map="interleave", softcap_first=False, softcap_no_grad=False, shift=0,
              window_align=None, alibi_no_offset=False, axis=-1, with_max=False):
    """(out, lse): out (B, Hq, Tq, Dv), lse (B, Hq, Tq), in q's dtype; torch tensors,
    differentiable.  ``with_max``: (out, lse, m), m the row maximum of the scores."""
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    if group > 1:
        if kv_map == "repeat":            # head h reads kv head h % Hkv: the tiling mistake
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        else:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    S = q @ k.transpose(-1, -2)                                        # (B, Hq, Tq, Tk)
    if softcap is not None:
        if softcap_first:
            S = softcap * torch.tanh(S / softcap) * scale
        else:
            S = S * scale
            capped = softcap * torch.tanh(S / softcap)
            S = S + (capped - S).detach() if softcap_no_grad else capped
    else:
        S = S * scale
    offs = [o + shift for o in offsets(tq, tk, seqlens_q, seqlens_k, align, b)]
    w_offs = offs if window_align is None else offsets(tq, tk, seqlens_q, seqlens_k, window_align, b)
    lq = [tq] * b if seqlens_q is None else [int(x) for x in seqlens_q]
    lk = [tk] * b if seqlens_k is None else [int(x) for x in seqlens_k]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(S.dtype)
        slopes = slopes.expand(b, hq) if slopes.dim() == 1 else slopes          # (B, Hq)
        a_offs = [0] * b if alibi_no_offset else offs
        i = torch.arange(tq, device=q.device, dtype=S.dtype)[:, None]
        j = torch.arange(tk, device=q.device, dtype=S.dtype)[None, :]
        dist = torch.stack([(i + o - j).abs() for o in a_offs])                 # (B, Tq, Tk)
        S = S - slopes[:, :, None, None] * dist[:, None]
    if bias is not None:
        S = S + bias.to(S.dtype)
    hidden = torch.stack([_hidden(tq, tk, offs[n], w_offs[n], causal, window, lq[n], lk[n], q.device)
                          for n in range(b)])[:, None]                          # (B, 1, Tq, Tk)
    S = S.masked_fill(hidden, -torch.inf)
    padding_row = torch.stack([torch.arange(tq, device=q.device) >= lq[n] for n in range(b)])
    padding_row = padding_row[:, None, :, None]                                # (B, 1, Tq, 1)
    if sinks is not None:
        sink = sinks.to(S.dtype)[None, :, None, None].expand(b, hq, tq, 1)
        sink = sink.masked_fill(padding_row, -torch.inf)
        S = torch.cat([S, sink], dim=-1)                                       # (B, Hq, Tq, Tk + 1)
    seen = torch.isfinite(S).any(axis, keepdim=True)
    S_safe = S.masked_fill(~seen, 0.0)
    P = torch.softmax(S_safe, dim=axis) * seen
    lse = torch.logsumexp(S_safe, dim=-1).masked_fill(~torch.isfinite(S).any(-1), -torch.inf)
    if sinks is not None:
        P = P[..., :-1]
    out = P @ v.to(P.dtype)
    if with_max:
        return out, lse, S.detach().amax(-1)
    return out, lse


def run(q, k, v, dout, opts, dtype=torch.float64, device="cpu", grads=True, **knobs):
    """``attention`` on NumPy inputs in ``dtype``: a dict of float64 NumPy arrays, ``out``
    and ``lse`` and, with ``grads`` and a ``dout``, ``dq``, ``dk``, ``dv`` (plus ``dbias``,
    ``dsinks`` when the options hold a bias or sinks), from autograd.  ``opts``: the
    reference's options (NumPy arrays for bias, sinks, alibi_slopes, seqlens)."""
    grads = grads and dout is not None
    t = lambda a, grad=False, dt=dtype: torch.as_tensor(a).to(device=device, dtype=dt).requires_grad_(grad)
    leaves = {"q": t(q, grads), "k": t(k, grads), "v": t(v, grads)}
    kw = {n: opts[n] for n in ("scale", "causal", "align", "window", "softcap", "seqlens_q", "seqlens_k")
          if n in opts}
    if opts.get("bias") is not None:
        leaves["bias"] = kw["bias"] = t(opts["bias"], grads)
    if opts.get("sinks") is not None:
        leaves["sinks"] = kw["sinks"] = t(opts["sinks"], grads)
    if opts.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = t(opts["alibi_slopes"])
    with torch.set_grad_enabled(grads):
        out, lse = attention(leaves["q"], leaves["k"], leaves["v"], **kw, **knobs)
        result = {"out": out, "lse": lse}
        if grads:
            names = list(leaves)
            found = torch.autograd.grad(out, [leaves[n] for n in names], t(dout), allow_unused=True)
            for n, g in zip(names, found):
                result["d" + n] = torch.zeros_like(leaves[n]) if g is None else g
    return {n: x.detach().to("cpu", torch.float64).numpy() for n, x in result.items()}
