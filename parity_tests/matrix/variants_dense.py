"""Dense PyTorch witnesses of the production variants, differentiated by autograd.

`dense_attention` writes ``numpy_ref.reference_attention``'s definition the
plain way: the whole (B, Hq, Tq, Tk) score array, the kv heads repeated with
``repeat_interleave``, the sink as one more softmax column, the masks as one
boolean array, and autograd for every gradient.  It shares no code with the
NumPy reference.  `sdpa_attention` and `flex_attention` say the same in
PyTorch's own conventions, where PyTorch can express the variant.
"""


import torch

from parity_tests.common import capabilities
from parity_tests.common.flex import attend as flex_attend

__all__ = ["dense_attention", "visible_mask", "sdpa_attention", "flex_attention"]


def _lengths(seqlens, B, T):
    return torch.full((B,), T) if seqlens is None else torch.as_tensor(seqlens).long()


def _offsets(o, B, Tq, Tk):
    """(B, 1, 1, 1) diagonal offsets: 0 top-left, nk - nq bottom-right."""
    nq, nk = _lengths(o.get("seqlens_q"), B, Tq), _lengths(o.get("seqlens_k"), B, Tk)
    off = nk - nq if o.get("align", "top-left") == "bottom-right" else torch.zeros(B).long()
    return off.view(B, 1, 1, 1), nq.view(B, 1, 1, 1), nk.view(B, 1, 1, 1)


def _sees(i, j, off, nq, nk, o):
    """Query i sees key j (index tensors, broadcast): i < nq, j < nk and, a = i + off its
    diagonal, a − left ≤ j ≤ a + right (−1 unbounded; causal: right = 0).  Written here, not
    taken from numpy_ref or kernels.dense: a witness shares no code with what it witnesses."""
    left, right = o.get("window") or (-1, -1)
    right = 0 if o.get("causal") else right
    seen = (j < nk) & (i < nq)
    if left >= 0:
        seen = seen & (j >= i + off - left)
    if right >= 0:
        seen = seen & (j <= i + off + right)
    return seen


def visible_mask(B, Tq, Tk, **o):
    """(B, 1, Tq, Tk) bool: query i of batch b sees key j (`_sees`)."""
    return _sees(torch.arange(Tq).view(1, 1, Tq, 1), torch.arange(Tk).view(1, 1, 1, Tk), *_offsets(o, B, Tq, Tk), o)


def dense_attention(q, k, v, dout=None, **o):
    """NumPy arrays in, dict of NumPy arrays out (the reference's keys), in q's dtype."""
    t = {n: torch.tensor(a, requires_grad=True) for n, a in
         dict(q=q, k=k, v=v, bias=o.get("bias"), sinks=o.get("sinks")).items() if a is not None}
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    k_rep = t["k"].repeat_interleave(Hq // Hkv, dim=1)
    v_rep = t["v"].repeat_interleave(Hq // Hkv, dim=1)
    scale = o.get("scale") or D ** -0.5
    S = scale * (t["q"] @ k_rep.transpose(-1, -2))                  # (B, Hq, Tq, Tk)
    if o.get("softcap") is not None:
        S = o["softcap"] * torch.tanh(S / o["softcap"])
    off, nq, _ = _offsets(o, B, Tq, Tk)
    if o.get("alibi_slopes") is not None:
        slopes = torch.as_tensor(o["alibi_slopes"], dtype=S.dtype).expand(B, Hq).view(B, Hq, 1, 1)
        dist = (torch.arange(Tq).view(1, 1, Tq, 1) + off - torch.arange(Tk).view(1, 1, 1, Tk)).abs()
        S = S - slopes * dist
    if "bias" in t:
        S = S + t["bias"]
    seen = visible_mask(B, Tq, Tk, **o).expand(B, Hq, Tq, Tk)
    S = S.masked_fill(~seen, float("-inf"))
    real = (torch.arange(Tq).view(1, 1, Tq, 1) < nq).expand(B, Hq, Tq, 1)
    if "sinks" in t:                                                # one more column, no value
        sink = t["sinks"].view(1, Hq, 1, 1).expand(B, Hq, Tq, 1)
        S = torch.cat([S, sink.masked_fill(~real, float("-inf"))], dim=-1)
    any_seen = ~torch.isneginf(S).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(S.masked_fill(~any_seen, 0.0), dim=-1, keepdim=True)
    P = torch.exp(S - lse)                                          # 0 on rows that see nothing
    out = P[..., :Tk] @ v_rep
    lse = lse.squeeze(-1).masked_fill(~any_seen.squeeze(-1), float("-inf"))
    result = {"out": out.detach().numpy(), "lse": lse.detach().numpy()}
    if dout is None:
        return result
    (out * torch.tensor(dout)).sum().backward()
    result.update(dq=t["q"].grad.numpy(), dk=t["k"].grad.numpy(), dv=t["v"].grad.numpy())
    if "bias" in t:
        result["dbias"] = t["bias"].grad.numpy()
    if "sinks" in t:
        result["dsinks"] = t["sinks"].grad.numpy()
    return result


def sdpa_attention(q, k, v, dout=None, **o):
    """``scaled_dot_product_attention`` with ``attn_mask`` (the bias, ALiBi and masks
    as one additive float mask) and grouped heads (``capabilities.sdpa``: ``enable_gqa`` from
    PyTorch 2.5, k and v repeated before).  No softcap, no sinks.
    A row that sees no key gives out 0 and no gradient (the reference's convention), on
    every PyTorch: it is masked out after the call, not by -inf."""
    B, Hq, Tq, _ = q.shape
    Tk = k.shape[2]
    t = {n: torch.tensor(a, requires_grad=True) for n, a in dict(q=q, k=k, v=v).items()}
    off, _, _ = _offsets(o, B, Tq, Tk)
    add = torch.zeros(B, Hq, Tq, Tk, dtype=t["q"].dtype)
    if o.get("alibi_slopes") is not None:
        slopes = torch.as_tensor(o["alibi_slopes"], dtype=add.dtype).expand(B, Hq).view(B, Hq, 1, 1)
        dist = (torch.arange(Tq).view(1, 1, Tq, 1) + off - torch.arange(Tk).view(1, 1, 1, Tk)).abs()
        add = add - slopes * dist
    if o.get("bias") is not None:
        t["bias"] = torch.tensor(o["bias"], requires_grad=True)
        add = add + t["bias"]
    seen = visible_mask(B, Tq, Tk, **o)
    # A row that sees no key keeps its scores and is zeroed after the call: before PyTorch 2.5
    # SDPA gives NaN on a row of -inf, and its backward spreads the NaN to dk and dv.
    some = seen.any(-1, keepdim=True)
    add = add.masked_fill(~seen & some, float("-inf"))
    out = capabilities.sdpa(t["q"], t["k"], t["v"], attn_mask=add, scale=o.get("scale")) * some
    result = {"out": out.detach().numpy()}
    if dout is not None:
        (out * torch.tensor(dout)).sum().backward()
        result.update({f"d{n}": x.grad.numpy() for n, x in t.items()})
    return result


def flex_attention(q, k, v, **o):
    """FlexAttention's forward: softcap, ALiBi and bias as ``score_mod``, the masks
    as ``mask_mod``, GQA by ``enable_gqa``; returns {"out", "lse"}."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, Hq, Tq, _ = q.shape
    Tk = k.shape[2]
    off, nq, nk = (x.view(B) for x in _offsets(o, B, Tq, Tk))
    cap, slopes = o.get("softcap"), o.get("alibi_slopes")
    slopes = None if slopes is None else torch.as_tensor(slopes, dtype=torch.float64).expand(B, Hq)
    bias = None if o.get("bias") is None else torch.as_tensor(o["bias"]).expand(B, Hq, Tq, Tk)

    def score_mod(score, b, h, i, j):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[b, h].to(score.dtype) * (i + off[b] - j).abs()
        if bias is not None:
            score = score + bias[b, h, i, j]
        return score

    def mask_mod(b, h, i, j):
        return _sees(i, j, off[b], nq[b], nk[b], o)

    block_mask = create_block_mask(mask_mod, B, None, Tq, Tk, device="cpu")
    out, lse = flex_attend(torch.tensor(q), torch.tensor(k), torch.tensor(v), score_mod=score_mod,
                           block_mask=block_mask, scale=o.get("scale"), enable_gqa=True, return_lse=True)
    return {"out": out.numpy(), "lse": lse.numpy()}
