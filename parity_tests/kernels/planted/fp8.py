"""FP8 kernels in FlashAttention-3's convention (``--features fp8``): q, k, v float8_e4m3fn,
``q_descale``, ``k_descale``, ``v_descale`` (B, Hkv) float32, out bfloat16; and in an FP8 KV
cache's (``--features fp8_kv``): q and out in the tested dtype, k and v float8.  Written from
the convention alone: three right ones (FlashAttention-3's own P rounded to e4m3 before P V;
the same with P kept in float32; dequantised and handed to SDPA in bfloat16) and one per
catalogued FP8 mistake (`GALLERY`: its catalogue id -> kernel)."""

import torch
import torch.nn.functional as F


def dequantised(x, descale, heads):
    """float32 ``x`` × its (B, Hkv) descale, query head h taking kv head h // (heads / Hkv)'s."""
    return x.float() * descale.repeat_interleave(heads // descale.shape[1], 1)[:, :, None, None]


def _attend(Q, K, V, causal, scale, p_fp8=True, subtract_max=True, narrow=None, out_dtype=torch.bfloat16,
            prescale=None, offset=0.0):
    """Attention on float32 Q, K, V (K, V with their own heads), FlashAttention-3's way: E = exp(S − m),
    rounded to e4m3 before E V (``p_fp8``), divided by l = Σ E; ``narrow``: E V accumulated key tile by
    key tile (that many keys) in 8 significant bits, truncated as a tensor core's narrow accumulator;
    ``prescale``: a factor E is multiplied by before its cast (a descale folded into P), or
    "normalised": E / l cast, and not divided by l after; ``offset``: E = exp(S − m + offset),
    l its sum (FlashAttention-3's offset of 8 in log2 units, taken in base e)."""
    group = Q.shape[1] // K.shape[1]
    K, V = K.repeat_interleave(group, 1), V.repeat_interleave(group, 1)
    S = scale * Q @ K.transpose(-1, -2)
    if causal:
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool, device=S.device).triu(1), -torch.inf)
    if narrow:
        m = torch.full(S.shape[:-1] + (1,), -torch.inf, device=S.device)
        l, acc = torch.zeros_like(m), torch.zeros(S.shape[:-1] + (V.shape[-1],), device=S.device)
        for t in range(0, S.shape[-1], narrow):
            St = S[..., t:t + narrow]
            new = torch.maximum(m, St.amax(-1, keepdim=True))
            alpha, E = torch.exp(m - new), torch.exp(St - new)
            acc = ((acc * alpha + E @ V[..., t:t + narrow, :]).view(torch.int32) & -65536).view(torch.float32)
            l, m = l * alpha + E.sum(-1, keepdim=True), new
        return (acc / l).to(out_dtype)
    m = S.amax(-1, keepdim=True) if subtract_max else torch.zeros_like(S[..., :1])
    E = torch.exp(S - m + offset)
    l = E.sum(-1, keepdim=True)
    if isinstance(prescale, str):
        return ((E / l).to(torch.float8_e4m3fn).float() @ V).to(out_dtype)
    E = E if prescale is None else E * prescale
    P = E.to(torch.float8_e4m3fn).float() if p_fp8 else E
    return ((P @ V) / l).to(out_dtype)


def _max_before_mask(Q, K, V, causal, scale, block_m=64, block_n=32, offset=0.0, out_dtype=torch.bfloat16):
    """FlashAttention-3's loop over (query tile, key tile) blocks with its running maximum taken over
    the whole key tile before the causal mask (wrong: the mask applied to E after exp), E = exp(S −
    m + ``offset``) rounded to e4m3 for E V; top-left causal only."""
    group = Q.shape[1] // K.shape[1]
    K, V = K.repeat_interleave(group, 1), V.repeat_interleave(group, 1)
    S = scale * Q @ K.transpose(-1, -2)
    tq, tk = S.shape[-2:]
    out = torch.empty(S.shape[:-1] + (V.shape[-1],), device=S.device)
    for m0 in range(0, tq, block_m):
        rows = torch.arange(m0, min(m0 + block_m, tq), device=S.device)[:, None]
        m = torch.full(S.shape[:2] + (len(rows), 1), -torch.inf, device=S.device)
        l, acc = torch.zeros_like(m), torch.zeros(S.shape[:2] + (len(rows), V.shape[-1]), device=S.device)
        for n0 in range(0, min(tk, m0 + block_m) if causal else tk, block_n):
            St = S[..., m0:m0 + block_m, n0:n0 + block_n]
            new = torch.maximum(m, St.amax(-1, keepdim=True))              # before the mask
            keys = torch.arange(n0, n0 + St.shape[-1], device=S.device)[None, :]
            E = torch.exp(St - new + offset) * (keys <= rows if causal else 1.0)
            alpha = torch.exp(m - new)
            acc = acc * alpha + E.to(torch.float8_e4m3fn).float() @ V[..., n0:n0 + block_n, :]
            l, m = l * alpha + E.sum(-1, keepdim=True), new
        out[..., m0:m0 + block_m, :] = acc / l
    return out.to(out_dtype)


def fp8_kernel(missing=(), twice=(), by_query_head=False, v_into_p=False, inverted=False, max_before_mask=None,
               **attend):
    """A FlashAttention-3-convention kernel: ``missing`` descales not applied, ``twice`` applied
    twice, every one divided by (``inverted``: another library's scale convention), q's descale
    read at query head h % Hkv (``by_query_head``), v's folded into P before its cast to e4m3
    (``v_into_p``: the weights multiplied by ~1e-2 first), its running maximum taken before the
    causal mask (``max_before_mask``: `_max_before_mask`'s keywords)."""
    def kernel(q, k, v, *, causal, scale, q_descale, k_descale, v_descale):
        h = q.shape[1]
        group = h // k.shape[1]
        ds = {"q": q_descale.repeat(1, group) if by_query_head else q_descale.repeat_interleave(group, 1),
              "k": k_descale, "v": v_descale}
        x = {n: t.float() for n, t in (("q", q), ("k", k), ("v", v))}
        for n in x:
            times = -1 if inverted else (n not in missing) + (n in twice) - (n == "v" and v_into_p)
            x[n] = x[n] * ds[n][:, :, None, None] ** times
        folded = {"prescale": v_descale.repeat_interleave(group, 1)[:, :, None, None]} if v_into_p else {}
        if max_before_mask is not None:
            return _max_before_mask(x["q"], x["k"], x["v"], causal, scale, **max_before_mask)
        return _attend(x["q"], x["k"], x["v"], causal, scale, **attend, **folded)
    return kernel


def in_bfloat16(q, k, v, *, causal, scale, q_descale, k_descale, v_descale):
    """Dequantised to bfloat16, then SDPA: right too (its error is bfloat16's, below the bound)."""
    group = q.shape[1] // k.shape[1]
    Q = dequantised(q, q_descale, q.shape[1]).to(torch.bfloat16)
    K, V = (dequantised(x, s, x.shape[1]).to(torch.bfloat16) for x, s in ((k, k_descale), (v, v_descale)))
    return F.scaled_dot_product_attention(Q, K.repeat_interleave(group, 1), V.repeat_interleave(group, 1),
                                          is_causal=causal, scale=scale)


def kv_kernel(missing=(), twice=(), v_with_k=False, rope_as_stored=False, **attend):
    """An FP8-KV-cache kernel: q and out in q's dtype, k and v dequantised from float8 (v with
    k's descale: ``v_with_k``; k's channels past v's head dim read as stored: ``rope_as_stored``,
    an MLA cache's rope part taken as kept in another format)."""
    def kernel(q, k, v, *, causal, scale, k_descale, v_descale):
        x = {"k": k.float(), "v": v.float()}
        ds = {"k": k_descale, "v": k_descale if v_with_k else v_descale}
        for n in x:
            x[n] = x[n] * ds[n][:, :, None, None] ** ((n not in missing) + (n in twice))
        if rope_as_stored:
            x["k"] = torch.cat([x["k"][..., :v.shape[-1]], k[..., v.shape[-1]:].float()], -1)
        return _attend(q.float(), x["k"], x["v"], causal, scale, out_dtype=q.dtype, **attend)
    return kernel


fa3 = fp8_kernel()
p_float32 = fp8_kernel(p_fp8=False)
RIGHT = {"fa3": fa3, "p-float32": p_float32, "in-bfloat16": in_bfloat16}
RIGHT_KV = {"fa3": kv_kernel(), "p-float32": kv_kernel(p_fp8=False)}

GALLERY = {
    **{f"fp8-{n}-descale-missing": fp8_kernel(missing=(n,)) for n in "qkv"},
    **{f"fp8-{n}-descale-twice": fp8_kernel(twice=(n,)) for n in "qkv"},
    "fp8-descale-query-head": fp8_kernel(by_query_head=True),
    "fp8-descales-inverted": fp8_kernel(inverted=True),
    "fp8-p-without-max": fp8_kernel(subtract_max=False),
    "fp8-p-offset-in-base-e": fp8_kernel(offset=8.0),
    "fp8-p-normalised": fp8_kernel(prescale="normalised"),
    "fp8-p-times-v-descale": fp8_kernel(v_into_p=True),
    "fp8-pv-narrow-accumulator": fp8_kernel(narrow=128),
    "fp8-max-before-mask": fp8_kernel(max_before_mask={}),
    "output-dtype": fp8_kernel(out_dtype=torch.float32),
}
GALLERY_KV = {
    **{f"fp8-{n}-descale-missing": kv_kernel(missing=(n,)) for n in "kv"},
    **{f"fp8-{n}-descale-twice": kv_kernel(twice=(n,)) for n in "kv"},
    "fp8-v-descale-from-k": kv_kernel(v_with_k=True),
    "fp8-k-descale-missing-past-dv": kv_kernel(rope_as_stored=True),
    "fp8-pv-narrow-accumulator": kv_kernel(narrow=128),
}
