"""Attention with every production feature, written once, densely, in PyTorch.

One formula serves every torch-side purpose of the check: in the tested dtype it
is the *baseline* (the plain computation an engineer would write, `run`, in
query chunks so that long cases fit); in float64 with one knob turned it is a
catalogued *mistake* (``mistakes``).  Gradients come from autograd, so each
variant's dq, dk, dv, dbias, dsinks are those of its own forward.  The order of
the contract (``CONTRACT.md``, "Beyond the chapter")::

    S = scale · Q Kᵀ                 (query head h reads kv head h // (Hq / Hkv))
    S ← c · tanh(S / c)              softcap
    S ← S − slope_h · |i + o − j|    ALiBi,  o = the alignment's offset
    S ← S + bias
    S ← −inf where j is hidden       causal (j ≤ i + o), window, lengths
    P = softmax([S | sink_h])  with the sink's column dropped after it
    P ← P ∘ keep / (1 − p)           dropout on the weights, the given mask
    O = P V,  lse_i = log(exp(sink_h) + Σ_j exp(S_ij))

A row that sees no key and no sink gives out 0 (its lse −inf); a padding query
(i ≥ seqlens_q[b]) is such a row even with a sink.  Which keys a query sees is
`visible`, the torch mirror of ``numpy_ref``'s definition (tested equal to it).

Knobs (the catalogue's mistakes; each None/False means "right"):
``kv_map="repeat"`` (kv heads tiled instead of interleaved), ``softcap_first``
(the cap applied to the unscaled scores), ``softcap_no_grad`` (the cap's
derivative 1 − tanh² left out of the backward), ``shift`` (added to every
offset, or a list: to each batch entry's: the causal mask one diagonal off, a sequence aligned
with another's lengths), ``window_align`` (the window placed
with another alignment than the causal mask), ``alibi_no_offset`` (the ALiBi
distance |i − j| whatever the alignment), ``alibi_offset_sign=-1`` (|i − o − j|: the
offset's sign flipped), ``alibi_align`` (the ALiBi offset of that alignment, the mask's
its own), ``alibi_signed`` (the distance i + o − j without its absolute value),
``axis`` (the softmax over queries), ``finite_mask`` (hidden
scores set to finfo.min instead of −inf: a row that sees no key averages every v; or a number:
hidden scores set to it, as a cap applied after the mask gives −c),
``no_delta`` (the backward's D = rowsum(dO ∘ O)
dropped: the weights differentiated with their normaliser held constant),
``online=(slip, block)`` (an online softmax's slips, `_online`: neither l nor the
accumulator rescaled by exp(m_old − m_new), the accumulator alone not rescaled, l
started at 1, split-KV partials merged without their rescale), ``backward_options`` (the
backward's own scores, `_recomputed_backward`: {option or knob: value} of `SCORES` in place of
the forward's: another mask, an option left out or scaled),
``softcap_last`` (the cap applied after ALiBi and the bias: x-transformers' order),
``softcap_form`` ("positive": only the positive scores capped; "clamp": clipped at ±c
instead of c·tanh), ``softcap_derivative`` (the backward's 1 − tanh²(S/c) taken as
1 − tanh²(capped/c), "of-capped", or as 1 − capped², "capped-squared"; or applied to dP alone,
"dp-only": dS = P ∘ ((1 − tanh²) dP − D), the row term D outside it), ``positions_dtype``
(ALiBi's positions and distances in a low dtype),
``backward_lse`` ((lse, first query row) -> the lse the backward recomputes P = exp(S − lse)
from: another base, or each row's off by its own amount), ``unseen_from`` (per batch
entry, the keys from that index on seen by no query: a split or tile size rounded down),
``key_range`` ((first, end) integer arrays (B, Hq, Tq): each query row sees only keys first ..
end − 1 of those it would: a tile loop's bounds off), ``key_span`` (the same, whatever the
causal mask and window say: a mask applied on some tiles only), ``channels`` (q, k and v
read on their first channels alone: a head-dim block smaller than D), ``mask_positions_dtype``
(the positions the mask compares formed in a low dtype), ``dp_factor`` (the backward's dP =
dO Vᵀ multiplied by it, D = rowsum(dO ∘ O) and dv right: dS = P ∘ (c dP − D)), ``bias_grad``
(dbias taken where the softcap's derivative has acted, dS ∘ (1 − tanh²(S/c)), "after-cap-derivative",
or that times the scale, the gradient of q·k, "qk"; the bias is added after the cap).
"""

import functools
import math

import torch

from numpy_ref.visibility import window_sides
from parity_tests.common import heap

__all__ = ["attention", "run", "sees", "mask_mod", "visible", "alibi_slopes", "offsets", "chunk_rows", "keywords",
           "PLAIN_OPTIONS", "ARRAY_OPTIONS", "VISIBILITY", "SCORES"]

# Query rows per chunk of the baseline: the (rows, Tk) arrays of one chunk stay
# near CHUNK_ELEMENTS elements per (batch, head); past Tk = 16384 near
# LONG_CHUNK_ELEMENTS (9 such arrays live at once: at Tk = 65536 in float32,
# 256 rows of 64 MiB each instead of 512 rows of 128 MiB).
CHUNK_ELEMENTS = 2 ** 25
LONG_CHUNK_ELEMENTS = 2 ** 24
LONG_FROM = 16384


# The reference's options that `attention` takes as they are, and those that become tensors
# (`keywords`, `run`).  An option outside both is refused (`_known`), never dropped: a feature's
# new option must be taught to the dense formula before a case can pass without it.
PLAIN_OPTIONS = ("scale", "causal", "align", "window", "softcap", "seqlens_q", "seqlens_k", "dropout_p")
ARRAY_OPTIONS = ("bias", "sinks", "alibi_slopes", "keep")


def _known(opts):
    unknown = sorted(set(opts) - set(PLAIN_OPTIONS) - set(ARRAY_OPTIONS))
    if unknown:
        raise TypeError(f"dense formula: no such option {', '.join(unknown)} (it takes "
                        f"{', '.join(PLAIN_OPTIONS + ARRAY_OPTIONS)})")


def keywords(opts, arrays=("bias", "sinks", "alibi_slopes")):
    """The reference's options ``opts`` as `attention`'s float64 keywords on the CPU: the plain
    ones as they are, those of ``arrays`` present as tensors (the other arrays left out)."""
    _known(opts)
    kw = {n: opts[n] for n in PLAIN_OPTIONS if n in opts}
    kw.update({n: torch.as_tensor(opts[n], dtype=torch.float64) for n in arrays if opts.get(n) is not None})
    return kw


def chunk_rows(tk):
    """Query rows per chunk of ``run`` at key length ``tk`` (at least 64)."""
    elements = CHUNK_ELEMENTS if tk <= LONG_FROM else min(CHUNK_ELEMENTS, LONG_CHUNK_ELEMENTS)
    return max(64, elements // max(tk, 1))


def alibi_slopes(heads):
    """ALiBi's slopes (Press et al., 2022): for H a power of two, 2^(−8 h / H), h = 1..H;
    otherwise those of the nearest power of two below, then every other slope of
    the next one (the authors' ``get_slopes``)."""
    def power_of_two(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]
    n = 1
    while n * 2 <= heads:
        n *= 2
    slopes = power_of_two(n)
    if n < heads:
        slopes += power_of_two(2 * n)[0::2][: heads - n]
    return slopes


def offsets(tq, tk, seqlens_q, seqlens_k, align, batch):
    """Per-batch offset o: query i sees key j iff j ≤ i + o (``numpy_ref.alignment_offset``
    of each sequence's lengths)."""
    from numpy_ref import alignment_offset
    if seqlens_q is None:
        return [alignment_offset(tq, tk, align)] * batch
    return [alignment_offset(lq, lk, align) for lq, lk in zip(seqlens_q, seqlens_k)]


def _shifted(offs, shift):
    """Each batch entry's offset plus ``shift``: one int for all, or one per batch entry."""
    return [o + (shift[n] if isinstance(shift, (list, tuple)) else shift) for n, o in enumerate(offs)]


def sees(i, j, *, causal=False, window=None, offset=0, nq=None, nk=None):
    """Query i sees key j, elementwise over index tensors (broadcast): ``numpy_ref.visibility``'s
    rule, written once for torch, for whole masks (`visible`) and FlexAttention's ``mask_mod``s
    alike:  i < nq  and  j < nk  and  i + offset − left ≤ j ≤ i + offset + right, the sides
    ``numpy_ref.window_sides(causal, window)`` (−1: unbounded; causal: right = 0).  ``offset``,
    ``nq``, ``nk``: ints, or tensors broadcasting with i and j (one per batch entry)."""
    left, right = window_sides(causal, window)
    ok = [c for c in ((i < nq) if nq is not None else None, (j < nk) if nk is not None else None,
                      (j >= i + offset - left) if left >= 0 else None,
                      (j <= i + offset + right) if right >= 0 else None) if c is not None]
    if not ok:
        return torch.ones(torch.broadcast_shapes(torch.as_tensor(i).shape, torch.as_tensor(j).shape),
                          dtype=torch.bool, device=getattr(i, "device", None))
    return functools.reduce(torch.logical_and, ok)


def mask_mod(*, causal=False, window=None, offset=0, nq=None, nk=None):
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` of `sees`.  ``offset``, ``nq``, ``nk``:
    ints, or tensors of one entry per batch (indexed by b: `offsets`, the sequences' lengths)."""
    at = lambda x, b: x[b] if torch.is_tensor(x) and x.ndim else x
    return lambda b, h, i, j: sees(i, j, causal=causal, window=window, offset=at(offset, b), nq=at(nq, b),
                                   nk=at(nk, b))


def visible(rows, tk, *, causal=False, offset=0, window=None, nq=None, nk=None, window_offset=None,
            device="cpu", positions_dtype=None):
    """(len(rows), Tk) bool: True where query ``rows[i]`` sees key j (`sees`).  ``window_offset``:
    the window placed on another diagonal than the causal mask; ``positions_dtype``: the positions
    the mask compares, arange(Tq) + offset and arange(Tk), formed in that dtype (catalogued mistakes)."""
    i = torch.as_tensor(rows, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    if positions_dtype is not None:          # rounded past 256 in bfloat16: rows see keys after them
        ip, jp = (i.to(positions_dtype) + offset).double(), j.to(positions_dtype).double()
        return sees(ip, jp, causal=causal, window=window) & sees(i, j, nq=nq, nk=nk)
    if window_offset is None or window_offset == offset or window is None:
        return sees(i, j, causal=causal, window=window, offset=offset, nq=nq, nk=nk)
    return sees(i, j, causal=causal, offset=offset, nq=nq, nk=nk) & \
        sees(i, j, window=(window[0], -1 if causal else window[1]), offset=window_offset)


# `_online`'s slips of a rescale taken in the other base: the power its factor is raised to
RESCALE_POWER = {"rescale-exp": 1 / math.log(2), "rescale-exp2": math.log(2)}


def _online(S, v, block, slip):
    """An online softmax over key blocks of ``block`` (from key 0) with one slip, in closed
    form.  Right: per block b, m_b = max(m_{b-1}, max_j∈b S_j), l_b = l_{b-1} e^{m_{b-1}-m_b}
    + Σ_j∈b e^{S_j-m_b}, acc_b likewise with e^{S_j-m_b} v_j, out = acc/l; every term ends
    relative to the row's maximum m, and out = Σ e^{S-m} v / Σ e^{S-m}.  Each slip leaves the
    terms of key j relative to another M_j (M_j = m gives the reference):

    "acc":   acc never multiplied by e^{m_old-m_new}, l is:   out = Σ_j e^{S_j-M_j} v_j / Σ_j e^{S_j-m},
             M_j = the running maximum when j's block was read (keys read before the maximum
             moved weigh e^{m-M_j} ≥ 1 times too much);
    "l-one": l started at 1 with m at −inf, its first rescale (m_old = −inf) taken as 1 so
             that −inf − (−inf) gives no NaN: the 1 stays relative to m_1, the maximum of the
             first block holding a visible key:  out = Σ e^{S-m} v / (e^{m_1-m} + Σ e^{S-m});
             a block at least the row's length gives l = 1 + Σ e^{S-m};
    "split": each block a split-KV partial (acc_s, l_s) relative to its own maximum m_s,
             merged as Σ_s acc_s / Σ_s l_s (the weights e^{m_s-m} left out):
             out = Σ_j e^{S_j-M_j} v_j / Σ_j e^{S_j-M_j}, M_j = m_s of j's split;
    "stale": neither acc nor l rescaled: the same with M_j = the
             running maximum when j's block was read;
    "acc-late": acc multiplied by a_b = e^{m_{b-1}-m_b} after block b's terms are added instead
             of before, l right: key j's term weighs a_b times too little (m_0 = −inf: the
             first block holding a visible key weighs 0):  out = Σ_j a_b(j) e^{S_j-m} v_j / Σ_j e^{S_j-m};
    "rescale-exp": a base-2 kernel's rescale exp2(m_old − m_new) taken with exp (its maxima in log2
             units): each factor a^γ, γ = log2(e), where a is meant, for l and acc alike; the
             factors of the blocks after j's telescope to e^{γ(m_b − m)}: M_j = γ m + (1 − γ) m_b,
             m_b the running maximum when j's block was read ("rescale-exp2": a base-e kernel's
             taken with exp2, γ = ln 2; γ = 0 is "stale");
    "own-max": the maximum not carried into the weights: each block's e^{S_j-m_b'} taken
             against that block's own maximum m_b', while acc and l are rescaled by the
             running one as they should: M_j = m_b' − m_b + m (m_b the running maximum
             after j's block), the same in out's numerator and denominator.

    Returns (out, lse): lse the kernel's own, m + log l, for the rescale slips (their l is off
    as their weights are), None for the others (their lse is not modelled: the reference's is
    used).  A row that sees no key gives 0.  The maxima are not detached: autograd differentiates
    the kernel's forward as written (for the reference's form their share cancels)."""
    tk = S.shape[-1]
    nb = -(-tk // block)
    pad = nb * block - tk
    Sp = torch.nn.functional.pad(S, (0, pad), value=-torch.inf) if pad else S
    blocks = Sp.reshape(S.shape[:-1] + (nb, block))
    own = blocks.amax(-1)                                                # (..., nb): each block's max
    finite0 = lambda x: torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    m = S.amax(-1)
    if slip == "l-one":
        e = torch.exp(S - finite0(m)[..., None])
        seen = torch.isfinite(own)
        first = torch.where(seen.any(-1), seen.float().argmax(-1), torch.zeros_like(m, dtype=torch.long))
        m1 = own.gather(-1, first[..., None])[..., 0]
        extra = torch.where(torch.isfinite(m1), torch.exp(finite0(m1) - finite0(m)), torch.ones_like(m))
        return (e @ v) / (extra + e.sum(-1))[..., None], None
    running = torch.cummax(own, dim=-1).values
    if slip == "acc-late":
        before = torch.cat([torch.full_like(running[..., :1], -torch.inf), running[..., :-1]], dim=-1)
        late = torch.where(torch.isfinite(running), torch.exp(before - finite0(running)), torch.ones_like(running))
        e = torch.exp(S - finite0(m)[..., None])
        l = e.sum(-1)
        w = e * late.repeat_interleave(block, dim=-1)[..., :tk]
        return (w @ v) / torch.where(l > 0, l, torch.ones_like(l))[..., None], None
    if slip in RESCALE_POWER:
        gamma = RESCALE_POWER[slip]
        M = gamma * finite0(m)[..., None] + (1 - gamma) * finite0(running)
    elif slip == "own-max":
        M = finite0(own) - finite0(running) + finite0(m)[..., None]      # per block
    else:
        M = finite0(own if slip == "split" else running)
    M = M.repeat_interleave(block, dim=-1)[..., :tk]                     # per key
    w = torch.exp(S - M)
    if slip == "acc":
        l = torch.exp(S - finite0(m)[..., None]).sum(-1)
    else:
        l = w.sum(-1)
    out = (w @ v) / torch.where(l > 0, l, torch.ones_like(l))[..., None]
    if slip not in RESCALE_POWER:
        return out, None
    # the kernel's lse = m + log l, its l relative to the final maximum m: off as its weights are
    return out, torch.where(l > 0, finite0(m) + torch.log(torch.where(l > 0, l, torch.ones_like(l))), -torch.inf)


def _first_channels(x, n):
    """``x`` with its head-dim channels from ``n`` on read as 0 (differentiably: their gradient 0)."""
    return x * (torch.arange(x.shape[-1], device=x.device) < n).to(x.dtype)


def _recomputed_backward(out, lse, S_b, lse_b, v, drop, extra=None):
    """(out, lse) of the forward; backward as a fused kernel's that recomputes its weights from
    other scores than its forward's: P' = exp(S' − lse') with S' = ``S_b`` (masked, the sink's
    column last; differentiable) and lse' = ``lse_b`` (the forward's, or another), not
    renormalised; D = rowsum(dO ∘ O) from the forward's O; then the right backward of P':

        dV = (P' ∘ drop)ᵀ dO,   dS = P' ∘ (dO Vᵀ ∘ drop − D + dlse),

    dS carried back to q and k through S' (the backward's own scale, cap or mask), and to the
    bias and the sinks through ``extra`` (the forward's bias, the sinks' column last): what a
    kernel writes for them is dS itself.  As autograd: Pg = P' exp(C − C.detach()), C = S' +
    extra, has P''s value and ∂Pg/∂C = P'; g = (Pg ∘ drop) V − rowsum(Pg) O with O held
    constant has ∂g/∂C = P' ∘ (dO Vᵀ ∘ drop − D) and ∂g/∂V = (P' ∘ drop)ᵀ dO; s = rowsum(Pg)
    gives lse's term ∂s/∂C = P'.  out + (g − g.detach()) and lse + (s − s.detach()) keep their
    values and take those gradients (``drop``: keep / (1 − p), or None)."""
    finite = torch.isfinite(lse_b)
    P_b = torch.exp(S_b.detach() - torch.where(finite, lse_b, 0.0).detach()[..., None]) * finite[..., None]
    C = torch.where(torch.isfinite(S_b), S_b, 0.0) + (0.0 if extra is None else extra)
    Pg = P_b * torch.exp(C - C.detach())
    keys = Pg[..., :v.shape[-2]]
    O = out.detach()
    g = (keys if drop is None else keys * drop) @ v.to(Pg.dtype) - Pg.sum(-1, keepdim=True) * O
    s = Pg.sum(-1)
    return O + (g - g.detach()), lse.detach() + (s - s.detach())       # g - g.detach() is 0 exactly


def _own_scores(given, changes, like):
    """(S', extra) of `_recomputed_backward`: the scores of the call ``given`` with ``changes``,
    the bias and sinks held constant there (−inf for the sinks' column where the changes leave
    them out: weight 0), and the forward's bias and sinks as the columns of ``like`` take them."""
    kept = {n: given[n].detach() for n in ("bias", "sinks") if given[n] is not None}
    S_b = attention(**{**given, **kept, **changes, "backward_options": None, "scores_only": True})
    if S_b.shape[-1] < like.shape[-1]:
        S_b = torch.cat([S_b, torch.full_like(like[..., S_b.shape[-1]:], -torch.inf)], dim=-1)
    if not kept:
        return S_b, None
    bias, sinks, tk = given["bias"], given["sinks"], given["v"].shape[-2]
    cols = [torch.zeros_like(like[..., :tk]) + (0.0 if bias is None else bias.to(like.dtype))]
    if sinks is not None:
        cols.append(sinks.to(like.dtype)[None, :, None, None].expand_as(like[..., tk:]))
    return S_b, torch.cat(cols, dim=-1)


def attention(q, k, v, *, scale, causal=False, align="top-left", window=None, softcap=None,
              alibi_slopes=None, bias=None, sinks=None, seqlens_q=None, seqlens_k=None, rows=None,
              kv_map="interleave", softcap_first=False, softcap_no_grad=False, shift=0,
              window_align=None, alibi_no_offset=False, alibi_offset_sign=1, alibi_signed=False, alibi_align=None,
              axis=-1,
              no_delta=False, finite_mask=False, with_max=False, keys=None, online=None, backward_options=None,
              softcap_last=False, weights="softmax", keep=None, dropout_p=0.0, softcap_form="tanh",
              positions_dtype=None, backward_lse=None, unseen_from=None, key_range=None,
              key_span=None, scores_only=False, fp8_prescale=None, softcap_derivative=None, channels=None,
              mask_positions_dtype=None, dp_factor=None, bias_grad=None):
    """(out, lse): out (B, Hq, Tq, Dv), lse (B, Hq, Tq), in q's dtype; torch tensors,
    differentiable.  ``rows``: (first, total) when q holds query rows first .. of a case
    with ``total`` query rows (the baseline's chunks); the bias then holds those rows too.
    ``with_max``: (out, lse, m), m the row maximum of the scores.  ``keys``: the case's key
    length when k and v hold only its first keys (those past every row's last visible key
    left out).  ``weights``: how the right weights are formed, "softmax" (the row maximum
    subtracted, divided by the sum) or "lse" (``P = exp(S − lse)``, lse kept in float32 or
    wider, as FlashAttention's backward and every merge through the log-sum-exp form
    them): the baseline's two formulations (``tolerances``, "the baseline"); or "fp8"
    (`fp8_weights`, the FP8 features' baseline).  ``keep``: a
    bool tensor broadcastable to (B, Hq, Tq, Tk) (these rows), the weights becoming
    ``P ∘ keep / (1 − dropout_p)``, the factor formed in the dtype as ``nn.Dropout`` does.
    ``scores_only``: the scores the softmax takes alone (masked, the sinks' column last).
    ``fp8_prescale``: `fp8_weights`'s ``prescale`` (a factor folded into P before its cast).
    ``channels``: q, k and v read on their first ``channels`` head-dim channels alone, the rest
    as 0 (a head-dim block smaller than D); in ``backward_options``, the backward's S' and dP' so."""
    given = dict(locals())                 # the call itself: `backward_options` recomputes its scores
    if channels is not None:
        q, k, v = (_first_channels(x, channels) for x in (q, k, v))
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    tk_case = keys or tk
    first, total = rows or (0, tq)
    group = hq // hkv
    if group > 1:
        if kv_map == "repeat":            # head h reads kv head h % Hkv: the tiling mistake
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        else:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    S = q @ k.transpose(-1, -2)                                        # (B, Hq, Tq, Tk)
    if softcap is not None and softcap_last:
        S = S * scale                      # capped after ALiBi and the bias, below
    elif softcap is not None:
        if softcap_first:
            S = softcap * torch.tanh(S / softcap) * scale
        else:
            S = S * scale
            uncapped = S
            capped = softcap * torch.tanh(S / softcap)
            if softcap_form == "positive":             # the negative scores left uncapped
                capped = torch.where(S > 0, capped, S)
            elif softcap_form == "clamp":
                capped = S.clamp(-softcap, softcap)
            cap_gap = capped - S                     # "dp-only": its derivative minus 1 reaches dS through it
            if softcap_derivative in ("of-capped", "capped-squared"):   # at the capped score, or without the /c
                slope = 1 - torch.tanh(capped / softcap) ** 2 if softcap_derivative == "of-capped" else 1 - capped ** 2
                capped = capped.detach() + (S - S.detach()) * slope.detach()
            S = S + (capped - S).detach() if softcap_no_grad else capped
    else:
        S = S * scale
    offs = _shifted(offsets(total, tk_case, seqlens_q, seqlens_k, align, b), shift)
    lq = [total] * b if seqlens_q is None else [int(x) for x in seqlens_q]
    lk = [tk_case] * b if seqlens_k is None else [int(x) for x in seqlens_k]
    i = torch.arange(first, first + tq, device=q.device)
    if alibi_slopes is not None:
        # positions and the bias in float32 at least, as a kernel forms them (in bfloat16, positions
        # past 256 round: a baseline that did so would err as such a kernel does, and pass it)
        wide = torch.promote_types(S.dtype, torch.float32)
        slopes = alibi_slopes.to(wide)
        slopes = slopes.expand(b, hq) if slopes.dim() == 1 else slopes          # (B, Hq)
        a_offs = offs if alibi_align is None else \
            _shifted(offsets(total, tk_case, seqlens_q, seqlens_k, alibi_align, b), shift)
        a_offs = [0] * b if alibi_no_offset else [alibi_offset_sign * o for o in a_offs]
        j = torch.arange(tk, device=q.device, dtype=wide)[None, :]
        if positions_dtype is None:
            dist = torch.stack([(i.to(wide)[:, None] + o - j) for o in a_offs])         # (B, Tq, Tk)
            dist = dist if alibi_signed else dist.abs()
        else:                                      # positions, and their differences, in a low dtype
            pd = positions_dtype
            dist = torch.stack([((i + o).to(pd)[:, None] - j.to(pd)).abs().to(wide) for o in a_offs])
        S = S - (slopes[:, :, None, None] * dist[:, None]).to(S.dtype)
    if bias is not None:
        added = bias.to(S.dtype)
        if bias_grad is not None and softcap is not None and not (softcap_last or softcap_first):
            slope = (1 - torch.tanh(uncapped / softcap) ** 2) * (scale if bias_grad == "qk" else 1.0)
            added = added.detach() + (added - added.detach()) * slope.detach()     # the same bias, dbias x slope
        S = S + added
    if softcap is not None and softcap_last:
        S = softcap * torch.tanh(S / softcap)
    def mask(causal=causal, window=window, align=align, shift=shift, window_align=window_align):
        """(B, 1, Tq, Tk): which keys each query sees."""
        o = _shifted(offsets(total, tk_case, seqlens_q, seqlens_k, align, b), shift)
        w_o = o if window_align is None else offsets(total, tk_case, seqlens_q, seqlens_k, window_align, b)
        return torch.stack([visible(i, tk, causal=causal, offset=o[n], window=window, nq=lq[n], nk=lk[n],
                                    window_offset=w_o[n], device=q.device, positions_dtype=mask_positions_dtype)
                            for n in range(b)])[:, None]
    seen = mask()
    if unseen_from is not None:            # the keys from there on (per batch entry) seen by no query
        firsts = torch.tensor(unseen_from, device=q.device).reshape(-1, 1, 1, 1)
        seen = seen & (torch.arange(tk, device=q.device) < firsts)
    for knob, within in ((key_range, seen), (key_span, None)):
        if knob is not None:               # each row's keys first .. end - 1 (of those it sees, or of its sequence's)
            lo, hi = (torch.as_tensor(x, device=q.device)[..., first:first + tq, None] for x in knob)
            j = torch.arange(tk, device=q.device)
            seen = (mask(causal=False, window=None) if within is None else within) & (j >= lo) & (j < hi)
    if finite_mask is not False:           # finfo.min (or the value) for "hidden": a row that sees no key averages v
        S = S.masked_fill(~seen, torch.finfo(S.dtype).min if finite_mask is True else float(finite_mask))
    S = S.masked_fill(~seen, -torch.inf) if finite_mask is False else S        # (B, Hq, Tq, Tk)
    if sinks is not None:
        padding_row = torch.stack([i >= lq[n] for n in range(b)])[:, None, :, None]   # (B, 1, Tq, 1)
        sink = sinks.to(S.dtype)[None, :, None, None].expand(b, hq, tq, 1)
        S = torch.cat([S, sink.masked_fill(padding_row, -torch.inf)], dim=-1)   # (B, Hq, Tq, Tk + 1)
    if scores_only:
        return S
    finite = torch.isfinite(S)
    row_seen = finite.any(-1)
    seen_along = row_seen[..., None] if axis in (-1, S.dim() - 1) else finite.any(axis, keepdim=True)
    del finite
    S_safe = S.masked_fill(~seen_along, 0.0)
    lse = torch.logsumexp(S_safe, dim=-1).masked_fill(~row_seen, -torch.inf)
    if online is not None:
        out, own_lse = _online(S[..., :tk], v.to(S.dtype), online[1], online[0])
        lse = lse if own_lse is None or sinks is not None else own_lse
        return (out, lse, S.detach().amax(-1)) if with_max else (out, lse)
    if no_delta:                                # P = exp(S − lse) with lse held constant: dS = P ∘ dP
        P = torch.exp(S_safe - lse.detach().masked_fill(~row_seen, 0.0)[..., None]) * row_seen[..., None]
    elif weights == "lse":                      # through the log-sum-exp, rounded where a kernel keeps it
        wide = S_safe.to(torch.promote_types(S.dtype, torch.float32))
        L = torch.logsumexp(wide, dim=-1).masked_fill(~row_seen, 0.0)[..., None]
        P = (torch.exp(wide - L) * row_seen[..., None]).to(S.dtype)
    elif weights in ("fp8", "fp8-no-max"):      # FlashAttention-3's FP8 forward (`fp8_weights`)
        P = fp8_weights(S_safe, row_seen[..., None], weights == "fp8", prescale=fp8_prescale).to(S.dtype)
    elif weights in P_ROUNDED:                 # E = exp(S − m) rounded for P V, l of the unrounded E
        P = fp8_weights(S_safe, row_seen[..., None], to=P_ROUNDED[weights]).to(S.dtype)
    else:
        P = torch.softmax(S_safe, dim=axis) * seen_along
    if sinks is not None:
        P = P[..., :-1]
    drop = None if keep is None else keep.to(P.dtype) / (1 - dropout_p)
    weights_before_drop = P
    if keep is not None:
        P = P * drop
    out = P @ v.to(P.dtype)
    if dp_factor is not None:              # dS = P ∘ (c dP − D): the dP term alone scaled, dv right
        C = S_safe[..., :P.shape[-1]]
        C = torch.where(torch.isfinite(C), C, 0.0)
        Pg = weights_before_drop.detach() * torch.exp(C - C.detach())        # its value P, ∂Pg/∂S = P
        w = (Pg if drop is None else Pg * drop) @ v.detach().to(Pg.dtype)
        out = out + (dp_factor - 1) * (w - w.detach())
    if softcap_derivative == "dp-only":   # dS = P ∘ ((1 − tanh²) dP − D): the row term D outside the derivative
        phi = (weights_before_drop.detach() * cap_gap).sum(-1, keepdim=True)    # ∂φ_i/∂S_ij = P_ij (−tanh²)
        out = out + out.detach() * (phi - phi.detach())                         # × D_i = rowsum(dO ∘ O)
    if backward_options is not None or backward_lse is not None:
        S_b, extra = (S, None) if backward_options is None else _own_scores(given, backward_options, S)
        lse_b = lse if backward_lse is None else backward_lse(lse, first)
        cut = (backward_options or {}).get("channels")
        v_b = v if cut is None else _first_channels(v, cut)
        out, lse = _recomputed_backward(out, lse, S_b, lse_b, v_b, drop, extra)
    if with_max:
        return out, lse, S.detach().amax(-1)
    return out, lse


# The options and knobs of `attention` that change only which keys a query sees.
VISIBILITY = ("causal", "window", "align", "shift", "window_align", "mask_positions_dtype")
# ... and those that change only the scores the softmax takes (`backward_options`).
SCORES = VISIBILITY + ("scale", "softcap", "alibi_slopes", "bias", "sinks", "softcap_first", "softcap_form",
                       "softcap_last", "alibi_no_offset", "alibi_offset_sign", "alibi_signed", "alibi_align",
                       "positions_dtype", "finite_mask")

# weights= of `attention`: E = exp(S − m) rounded to a half dtype before P V (the rest in the
# dtype run): how a kernel that keeps only its P in a lower precision errs
P_ROUNDED = {"p-bfloat16": torch.bfloat16, "p-float16": torch.float16}


def fp8_weights(S, seen=None, subtract_max=True, to=torch.float8_e4m3fn, prescale=None):
    """FlashAttention-3's FP8 weights: E = exp(S − m) in float32 (m the row's maximum), rounded
    to float8_e4m3fn for the P V matmul, divided by l = Σ_j E_ij of the unrounded E (returned
    in float32, the 1/l applied as the kernel applies it to its accumulator: once per row).
    E ≤ 1, so e4m3's largest value 448 is never reached; weights below its smallest
    subnormal 2^-9 are 0.  ``seen``: (.., rows, 1) False on rows that see no key (weights 0).
    ``subtract_max=False``: the mistake of casting exp(S) itself (past 448 it saturates; below
    2^-9 it vanishes; l overflows to inf past S = 88).  ``to``: another dtype E is rounded to
    (FlashAttention-2's P in bfloat16 or float16 for its P V matmul, `P_ROUNDED`).  ``prescale``:
    a factor E is multiplied by before its rounding and divided by after (a descale folded into
    P, broadcastable to S), or "normalised": E / l rounded (P normalised before the cast)."""
    wide = S.to(torch.promote_types(S.dtype, torch.float32))
    m = wide.amax(-1, keepdim=True) if subtract_max else torch.zeros_like(wide[..., :1])
    E = torch.exp(wide - torch.where(torch.isfinite(m), m, 0.0))
    if seen is not None:
        E = E * seen
    l = E.sum(-1, keepdim=True)
    a = 1 / torch.where(l > 0, l, 1.0) if isinstance(prescale, str) else 1.0 if prescale is None else prescale
    return (E * a).to(to).to(wide.dtype) / a / torch.where(l > 0, l, 1.0)


def run(q, k, v, dout, opts, dtype=torch.float64, device="cpu", grads=True, dlse=None, rows=None,
        weights="softmax", autograd=False, **knobs):
    """``attention`` on NumPy inputs in ``dtype``: a dict of float64 NumPy arrays, ``out``
    and ``lse`` and, with ``grads`` and a ``dout``, ``dq``, ``dk``, ``dv`` (plus ``dbias``,
    ``dsinks`` when the options hold a bias or sinks), from autograd; ``dlse`` (B, Hq, Tq)
    is an upstream gradient on lse as well.  ``opts``: the reference's options (NumPy
    arrays for bias, sinks, alibi_slopes, seqlens).  Query rows go in chunks (`CHUNK_ELEMENTS`):
    dq and out row by row, dk, dv, dbias and dsinks summed over the chunks, in float32 for
    a half dtype (as a single matmul accumulates them before its one final rounding).
    ``rows``: (first, total) when q, dout and dlse hold query rows first .. of a case with
    ``total`` query rows (a block of rows of a long case); dk, dv are then those rows' share.
    Plain options without a knob or ``dlse`` take `_written_out` (the same, its backward
    written out), unless ``autograd``."""
    grads = grads and dout is not None
    _known(opts)
    if not (knobs or autograd) and dlse is None and _plain(opts):
        return _written_out(q, k, v, dout if grads else None, opts, dtype, device, rows, weights)
    tq, tk = q.shape[-2], k.shape[-2]
    first, total = rows or (0, tq)
    chunk = chunk_rows(tk)
    t = lambda a, dt=dtype: torch.as_tensor(a).to(device=device, dtype=dt)
    kw = {n: opts[n] for n in PLAIN_OPTIONS if n in opts}
    if opts.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = t(opts["alibi_slopes"])
    four = lambda a: a.reshape((1,) * (4 - a.dim()) + tuple(a.shape))    # broadcastable to (B, Hq, Tq, Tk)
    keep4 = None if opts.get("keep") is None else four(t(opts["keep"], torch.bool))
    bias = None if opts.get("bias") is None else t(opts["bias"])
    bias4 = None if bias is None else four(bias)
    sinks = None if opts.get("sinks") is None else t(opts["sinks"]).requires_grad_(grads)
    acc = torch.float32 if chunk < tq and dtype in (torch.float16, torch.bfloat16) else dtype
    changes = dict(knobs.pop("backward_options", None) or {})     # its arrays made tensors as the options are
    for n, x in changes.items():
        if n in ARRAY_OPTIONS and x is not None:
            changes[n] = four(t(x)) if n == "bias" else t(x)
    Q, K, V = t(q).requires_grad_(grads), t(k).requires_grad_(grads), t(v).requires_grad_(grads)
    parts, totals = {}, {}
    last_key = _last_keys(opts, total, tk, q.shape[0], first) if tk > LONG_FROM and bias4 is None and not knobs \
        else lambda r1: tk
    for r0 in range(0, max(tq, 1), chunk):
        r1 = min(tq, r0 + chunk)
        if tk > LONG_FROM:
            heap.trim()                   # the arrays of the last chunk (or call), freed, back to the OS
        kend = last_key(r1)
        Kc, Vc = (K, V) if kend == tk else (K[..., :kend, :], V[..., :kend, :])
        rows_of = lambda a: a if a.shape[2] == 1 else a[:, :, r0:r1]          # this chunk's query rows
        piece = None if bias4 is None else rows_of(bias4).detach().requires_grad_(grads)
        if keep4 is not None:
            kept = rows_of(keep4)
            kw["keep"] = kept if kend == tk or kept.shape[3] == 1 else kept[..., :kend]
        if changes:
            knobs["backward_options"] = {n: rows_of(x) if n == "bias" and x is not None else x
                                         for n, x in changes.items()}
        with torch.set_grad_enabled(grads):
            qc = Q[..., r0:r1, :].detach().requires_grad_(grads) if grads else Q[..., r0:r1, :]
            out, lse = attention(qc, Kc, Vc, bias=piece, sinks=sinks, rows=(first + r0, total), keys=tk,
                                 weights=weights, **kw, **knobs)
        _put(parts, "out", out.detach())
        _put(parts, "lse", lse.detach())
        if grads:
            leaves = {"dq": qc, "dk": K, "dv": V, "dbias": piece, "dsinks": sinks}
            leaves = {n: x for n, x in leaves.items() if x is not None}
            ups = [(out, t(dout[..., r0:r1, :]))] + ([(lse, t(dlse[..., r0:r1]))] if dlse is not None else [])
            found = torch.autograd.grad([o for o, _ in ups], list(leaves.values()), [g for _, g in ups],
                                        allow_unused=True)
            for n, g in zip(leaves, found):
                g = torch.zeros_like(leaves[n]) if g is None else g
                if n == "dq" or (n == "dbias" and bias4.shape[2] > 1):
                    _put(parts, n, g)
                else:
                    totals[n] = totals.get(n, 0) + g.to(acc)
    result = {n: torch.cat(p, dim=2) if p[0].dim() >= 3 else p[0] for n, p in parts.items()}
    result.update({n: g.to(dtype) for n, g in totals.items()})
    if "dbias" in result:
        result["dbias"] = result["dbias"].reshape(bias.shape)
    return {n: x.detach().to("cpu", torch.float64).numpy() for n, x in result.items()}


def _last_keys(opts, total, tk, batch, first):
    """r1 -> the keys a causal chunk of rows .. first + r1 - 1 reads: up to the last one any of
    its rows sees (the rest, hidden from every row of the chunk, left out: half the work of
    a long causal case); every key when the case is not causal."""
    if not opts.get("causal"):
        return lambda r1: tk
    offs = offsets(total, tk, opts.get("seqlens_q"), opts.get("seqlens_k"), opts.get("align", "top-left"), batch)
    return lambda r1: int(min(tk, max(1, first + r1 + max(offs))))


def _put(parts, name, x):
    parts.setdefault(name, []).append(x)


# ---------------------------------------------------------------------------
# The common case written out: the baseline's cost

# The options `_written_out` takes (every other option, a knob or an upstream gradient on
# lse goes through `attention` and autograd).
WRITTEN_OUT_OPTIONS = ("scale", "causal", "align", "window", "seqlens_q", "seqlens_k", "dropout_p")
# Query rows per chunk of `_written_out`, at most: a causal or windowed chunk reads only the
# keys its rows see, so smaller chunks skip more of what no row sees.
WRITTEN_OUT_ROWS = 256


def _plain(opts):
    """Whether ``opts`` are among `WRITTEN_OUT_OPTIONS` or None (no keep mask: dropout_p alone is 0)."""
    return all(n in WRITTEN_OUT_OPTIONS or opts[n] is None for n in opts)


def _written_out(q, k, v, dout, opts, dtype, device, rows, weights):
    """``run`` for plain options (`_plain`: scale, causal, alignment, a window, per-sequence
    lengths), the backward written out from the forward instead of taken by autograd, and
    the keys no row of a chunk sees left out.  Forward, per chunk of query rows, in ``dtype``:

        S = scale · Q Kᵀ,  S ← −inf where query i does not see key j (`sees`),
        P = softmax(S)  (or, with ``weights="lse"``, exp(S − lse) with lse in float32 or
        wider),  O = P V,  lse = log Σ_j exp(S_ij);  a row that sees no key: O = 0, lse = −inf.

    Backward (the chapter's Jacobian ∂P_ij/∂S_ik = P_ij(δ_jk − P_ik), summed against dP):

        dV = Pᵀ dO,  dP = dO Vᵀ,  D_i = Σ_j P_ij dP_ij  (= Σ_d dO_id O_id),
        dS = P ∘ (dP − D),  dQ = scale · dS K,  dK = scale · dSᵀ Q,

    a hidden key's P_ij = 0 giving it dS_ij = 0.  dS is formed in float32 or wider and
    rounded once, with D from P and dP, as PyTorch's softmax backward forms it (and from the
    unrounded weights with ``weights="lse"``, as autograd through exp(S − lse) would): the
    rounding of the autograd path this replaces, so the bound it gives is the same.  Query
    head h reads kv head h // (Hq/Hkv), so dK, dV sum over each group.  dK, dV sum over the
    chunks in float32 for a half dtype (as ``run``); ``rows`` as in ``run``.  Tested equal to
    ``run``'s autograd path in float64 (``tests/kernels/test_dense_knobs.py``)."""
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    first, total = rows or (0, tq)
    t = lambda a: torch.as_tensor(a).to(device=device, dtype=dtype)
    Q, K, V = t(q), t(k), t(v)
    K, V = (K.repeat_interleave(group, 1), V.repeat_interleave(group, 1)) if group > 1 else (K, V)
    dO = None if dout is None else t(dout)
    scale, causal, window = opts["scale"], opts.get("causal", False), opts.get("window")
    lq, lk = opts.get("seqlens_q"), opts.get("seqlens_k")
    offs = offsets(total, tk, lq, lk, opts.get("align", "top-left"), b)
    left, right = window_sides(causal, window)
    per_batch = lambda x: torch.as_tensor(x, device=device).view(b, 1, 1, 1)
    where = dict(causal=causal, window=window, offset=per_batch(offs), nq=None if lq is None else per_batch(lq),
                 nk=None if lk is None else per_batch(lk))
    masked = causal or window is not None or lq is not None
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    wide = torch.promote_types(dtype, torch.float32)
    out = torch.zeros(b, hq, tq, V.shape[-1], dtype=dtype, device=device)
    lse = torch.full((b, hq, tq), -torch.inf, dtype=dtype, device=device)
    grads = {} if dO is None else {"dq": torch.zeros_like(Q), "dk": torch.zeros(K.shape, dtype=acc, device=device),
                                   "dv": torch.zeros(V.shape, dtype=acc, device=device)}
    chunk = min(chunk_rows(tk), WRITTEN_OUT_ROWS)
    for r0 in range(0, tq, chunk):
        r1 = min(tq, r0 + chunk)
        # the keys [k0, k1) some row of the chunk may see (`sees`: lo(i) and hi(i) never decrease)
        k0 = max(0, first + r0 + min(offs) - left) if left >= 0 else 0
        k1 = min(tk, first + r1 + max(offs) + right) if right >= 0 else tk
        if k1 <= k0:
            continue                                                # no row of the chunk sees a key
        Kc, Vc = K[:, :, k0:k1], V[:, :, k0:k1]
        S = (Q[:, :, r0:r1] @ Kc.transpose(-1, -2)).mul_(scale)
        blind = None
        if masked:
            i = torch.arange(first + r0, first + r1, device=device).view(1, 1, -1, 1)
            seen = sees(i, torch.arange(k0, k1, device=device).view(1, 1, 1, -1), **where)   # (B or 1, 1, rows, keys)
            S.masked_fill_(~seen, -torch.inf)
            blind = ~seen.any(-1, keepdim=True)                      # rows that see no key
            if blind.any():
                S.masked_fill_(blind, 0.0)
            else:
                blind = None
        L = torch.logsumexp(S, dim=-1)
        if weights in ("fp8", "fp8-no-max"):
            Pw = fp8_weights(S, None if blind is None else ~blind, weights == "fp8")
            P = Pw.to(dtype)
        elif weights == "lse":
            Sw = S.to(wide)                                         # lse kept in float32 or wider
            Pw = torch.exp(Sw - (L[..., None] if wide == dtype else torch.logsumexp(Sw, dim=-1, keepdim=True)))
            if blind is not None:
                Pw.masked_fill_(blind, 0.0)
            P = Pw.to(dtype)
        else:
            P = torch.softmax(S, dim=-1)
            if blind is not None:
                P.masked_fill_(blind, 0.0)
            Pw = P.to(wide)
        O = P @ Vc
        out[:, :, r0:r1] = O
        lse[:, :, r0:r1] = L if blind is None else L.masked_fill(blind[..., 0], -torch.inf)
        if dO is None:
            continue
        dOc = dO[:, :, r0:r1]
        grads["dv"][:, :, k0:k1] += (P.transpose(-1, -2) @ dOc).to(acc)
        dP = (dOc @ Vc.transpose(-1, -2)).to(wide)
        D = (Pw * dP).sum(-1, keepdim=True)
        dS = dP.sub_(D).mul_(Pw).to(dtype).mul_(scale)              # as softmax's backward forms it
        grads["dq"][:, :, r0:r1] = dS @ Kc
        grads["dk"][:, :, k0:k1] += (dS.transpose(-1, -2) @ Q[:, :, r0:r1]).to(acc)
    if dO is not None and group > 1:
        for n in ("dk", "dv"):
            grads[n] = grads[n].view(b, hkv, group, tk, -1).sum(2)
    result = {"out": out, "lse": lse, **{n: g.to(dtype) for n, g in grads.items()}}
    return {n: x.to("cpu", torch.float64).numpy() for n, x in result.items()}
