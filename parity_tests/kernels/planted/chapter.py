"""A gallery of deliberately wrong attention kernels, one per catalogued mistake plus
subtle ones.  Each takes (q, k, v, *, causal, scale), (B, H, T, D), and computes in
float64 (so only its mistake shows), returning the input's dtype."""

import torch
import torch.nn.functional as F


def _mask(tq, tk, offset, device):
    i = torch.arange(tq, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    return j > i + offset                                   # True: hidden


def _weights(q, k, *, causal, scale, offset=0, axis=-1):
    S = (q @ k.transpose(-1, -2)) * scale                   # (B, H, Tq, Tk)
    if causal:
        S = S.masked_fill(_mask(q.shape[-2], k.shape[-2], offset, q.device), -torch.inf)
    seen = torch.isfinite(S).any(axis, keepdim=True)
    return torch.softmax(S.masked_fill(~seen, 0.0), dim=axis) * seen


def attention(q, k, v, *, causal, scale, offset=0, axis=-1):
    """Right, up to the knobs; float64 inside."""
    dt = q.dtype
    q, k, v = (t.double() for t in (q, k, v))
    return (_weights(q, k, causal=causal, scale=scale, offset=offset, axis=axis) @ v).to(dt)


def scores(q, k, *, causal, scale):
    """S = scale q kᵀ, causal (top-left) keys hidden with -inf when asked."""
    S = (q @ k.transpose(-1, -2)) * scale
    if causal:
        S = S.masked_fill(_mask(q.shape[-2], k.shape[-2], 0, q.device), -torch.inf)
    return S


def _online(q, k, v, *, causal, scale, block, acc_rescaled=True, l_rescaled=True, l_start=0.0, acc_late=False):
    """FlashAttention's loop over key blocks, with m starting at -inf and the rescale
    exp(m_old - m_new) taken as 1 while m_old is still -inf (nothing to rescale yet);
    ``acc_late``: the accumulator rescaled after the block's P V is added, by exp(m_old - m_new)
    taken as 1 only while m_new is -inf (a block the row does not see)."""
    dt = q.dtype
    q, k, v = (t.double() for t in (q, k, v))
    S = scores(q, k, causal=causal, scale=scale)
    m = torch.full(S.shape[:-1], -torch.inf, dtype=S.dtype)
    l = torch.full(S.shape[:-1], l_start, dtype=S.dtype)
    acc = torch.zeros(S.shape[:-1] + (v.shape[-1],), dtype=S.dtype)
    for j0 in range(0, S.shape[-1], block):
        Sb, vb = S[..., j0:j0 + block], v[..., j0:j0 + block, :]
        m_new = torch.maximum(m, Sb.amax(-1))
        alpha = torch.where(torch.isfinite(m), torch.exp(m - m_new), 1.0)
        p = torch.exp(Sb - torch.where(torch.isfinite(m_new), m_new, 0.0)[..., None])
        l = (l * alpha if l_rescaled else l) + p.sum(-1)
        if acc_late:
            acc = (acc + p @ vb) * torch.where(torch.isfinite(m_new), torch.exp(m - m_new), 1.0)[..., None]
        else:
            acc = (acc * alpha[..., None] if acc_rescaled else acc) + p @ vb
        m = m_new
    return (acc / torch.where(l > 0, l, 1.0)[..., None]).to(dt)


def no_causal_mask(q, k, v, *, causal, scale):
    return attention(q, k, v, causal=False, scale=scale)


def mask_one_future(q, k, v, *, causal, scale):
    return attention(q, k, v, causal=causal, scale=scale, offset=1)


def mask_one_past(q, k, v, *, causal, scale):
    return attention(q, k, v, causal=causal, scale=scale, offset=-1)


def bottom_right(q, k, v, *, causal, scale):
    return attention(q, k, v, causal=causal, scale=scale, offset=k.shape[-2] - q.shape[-2])


def offset_sign(q, k, v, *, causal, scale):
    """Bottom-right alignment with its offset's sign flipped (Tq − Tk where Tk − Tq is meant): to be
    checked with ``align="bottom-right"`` (its mistake, ``offset-sign``, exists only there)."""
    return attention(q, k, v, causal=causal, scale=scale, offset=q.shape[-2] - k.shape[-2])


def scale_one_over_d(q, k, v, *, causal, scale):
    return attention(q, k, v, causal=causal, scale=1.0 / q.shape[-1])


def no_scale(q, k, v, *, causal, scale):
    return attention(q, k, v, causal=causal, scale=1.0)


def softmax_over_queries(q, k, v, *, causal, scale):
    return attention(q, k, v, causal=causal, scale=scale, axis=-2)


def layout_bthd_as_bhtd(q, k, v, *, causal, scale):
    """Written for flash_attn_func's (B, T, H, D), handed (B, H, T, D)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return attention(q, k, v, causal=causal, scale=scale).transpose(1, 2)


def stale_max(q, k, v, *, causal, scale, block=32):
    """Online softmax over key blocks of 32 that never rescales l and acc."""
    return _online(q, k, v, causal=causal, scale=scale, block=block, acc_rescaled=False, l_rescaled=False)


def dropout_left_on(q, k, v, *, causal, scale):
    dt = q.dtype
    q, k, v = (t.double() for t in (q, k, v))
    P = _weights(q, k, causal=causal, scale=scale)
    return (F.dropout(P, p=0.1, training=True) @ v).to(dt)


class _Backward(torch.autograd.Function):
    """Right forward; backward with one of three planted mistakes."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, mistake):
        P = _weights(q, k, causal=causal, scale=scale)
        out = P @ v
        ctx.save_for_backward(q, k, v, P, out)
        ctx.scale, ctx.mistake = scale, mistake
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, P, out = ctx.saved_tensors
        dP = dout @ v.transpose(-1, -2)
        D = (dout * out).sum(-1, keepdim=True)
        dS = P * dP if ctx.mistake == "no-D" else P * (dP - D)
        dq = dS @ k * (1.0 if ctx.mistake == "dq" else ctx.scale)
        dk = dS.transpose(-1, -2) @ q * (1.0 if ctx.mistake == "dk" else ctx.scale)
        return dq, dk, P.transpose(-1, -2) @ dout, None, None, None


def _with_backward(mistake):
    def kernel(q, k, v, *, causal, scale):
        dt = q.dtype
        return _Backward.apply(q.double(), k.double(), v.double(), causal, scale, mistake).to(dt)
    kernel.__name__ = f"backward_{mistake}"
    return kernel


backward_no_delta = _with_backward("no-D")
dq_missing_scale = _with_backward("dq")
dk_missing_scale = _with_backward("dk")


def one_head_wrong(q, k, v, *, causal, scale):
    """Head 1 forgets the causal mask; the other heads are right."""
    right = attention(q, k, v, causal=causal, scale=scale)
    wrong = attention(q, k, v, causal=False, scale=scale)
    head = torch.arange(q.shape[1], device=q.device)[None, :, None, None]
    return torch.where(head == 1, wrong, right)


def bf16_denominator(q, k, v, *, causal, scale, block=16):
    """The softmax denominator summed block by block in bfloat16: once l is large,
    a block's contribution is rounded away, l comes out short, out too large."""
    dt = q.dtype
    q, k, v = (t.double() for t in (q, k, v))
    P = _weights(q, k, causal=causal, scale=scale)          # right weights, normalised
    S = scores(q, k, causal=causal, scale=scale)
    e = torch.exp(S - S.amax(-1, keepdim=True))
    l = torch.zeros(S.shape[:-1], dtype=torch.bfloat16)
    for j0 in range(0, S.shape[-1], block):
        l = l + e[..., j0:j0 + block].sum(-1).to(torch.bfloat16)
    exact = e.sum(-1)
    return ((P @ v) * (exact / l.double())[..., None]).to(dt)


def _toward_zero(x, dtype):
    """x rounded to dtype toward zero (a hand-written conversion that chops the
    mantissa); the gradient passes straight through."""
    near = x.to(dtype)
    chopped = torch.where(near.double().abs() > x.detach().abs(),
                          torch.nextafter(near.detach(), torch.zeros_like(near)), near.detach())
    return near + (chopped - near).detach()


def low_precision_accumulator(q, k, v, *, causal, scale, block=2):
    """The output accumulator kept in the input dtype across key blocks of 2 and
    converted by truncation: each block shrinks it by up to one unit of roundoff,
    an error that grows with the number of blocks."""
    dt = q.dtype
    q, k, v = (t.double() for t in (q, k, v))
    S = scores(q, k, causal=causal, scale=scale)
    e = torch.exp(S - S.amax(-1, keepdim=True))
    acc = torch.zeros(S.shape[:-1] + (v.shape[-1],), dtype=dt)
    for e_blk, v_blk in zip(e.split(block, dim=-1), v.split(block, dim=-2)):
        acc = _toward_zero(acc.double() + e_blk @ v_blk, dt)
    return (acc.double() / e.sum(-1, keepdim=True)).to(dt)


class _MaskedAsTold(torch.autograd.Function):
    """The forward with its own causal flag; the backward recomputing P = exp(S - lse) from
    the forward's lse under another mask (``bwd_causal``), D from the forward's output, as
    a fused kernel's backward does when it masks whatever it was written for."""

    @staticmethod
    def forward(ctx, q, k, v, causal, bwd_causal, scale):
        S, masked = scores(q, k, causal=False, scale=scale), scores(q, k, causal=True, scale=scale)
        lse = torch.logsumexp(masked if causal else S, dim=-1, keepdim=True)
        out = torch.exp((masked if causal else S) - lse) @ v
        P_bwd = torch.exp((masked if bwd_causal else S) - lse)
        ctx.save_for_backward(q, k, v, P_bwd, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, P, out = ctx.saved_tensors
        dS = P * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
        return dS @ k * ctx.scale, dS.transpose(-1, -2) @ q * ctx.scale, P.transpose(-1, -2) @ dout, None, None, None


def backward_masked(q, k, v, *, causal, scale):
    """A backward written for causal attention only: it masks even when the forward did not."""
    dt = q.dtype
    return _MaskedAsTold.apply(q.double(), k.double(), v.double(), causal, True, scale).to(dt)


def backward_unmasked(q, k, v, *, causal, scale):
    """The reverse: the forward masks as told, the backward never does."""
    dt = q.dtype
    return _MaskedAsTold.apply(q.double(), k.double(), v.double(), causal, False, scale).to(dt)


def acc_not_rescaled(q, k, v, *, causal, scale):
    """Blocks of 32 keys: l is rescaled when the maximum moves, the output accumulator is not."""
    return _online(q, k, v, causal=causal, scale=scale, block=32, acc_rescaled=False)


def acc_rescaled_late(q, k, v, *, causal, scale):
    """Blocks of 32 keys, acc = (acc + P V) * exp(m_old - m_new): the rescale after the add."""
    return _online(q, k, v, causal=causal, scale=scale, block=32, acc_late=True)


def l_starts_at_one(q, k, v, *, causal, scale):
    """Blocks of 32 keys, the running sum l started at 1 instead of 0."""
    return _online(q, k, v, causal=causal, scale=scale, block=32, l_start=1.0)


def split_merge_no_rescale(q, k, v, *, causal, scale, width=64):
    """Split-KV over ranges of 64 keys, each partial (acc_s, l_s) relative to its own maximum
    m_s, merged as sum acc_s / sum l_s: the rescale exp(m_s - m) left out."""
    dt = q.dtype
    q, k, v = (t.double() for t in (q, k, v))
    S = scores(q, k, causal=causal, scale=scale)
    acc, l = 0.0, 0.0
    for Sb, vb in zip(S.split(width, dim=-1), v.split(width, dim=-2)):
        m_s = Sb.amax(-1, keepdim=True)
        p = torch.exp(Sb - torch.where(torch.isfinite(m_s), m_s, 0.0))
        acc, l = acc + p @ vb, l + p.sum(-1, keepdim=True)
    return (acc / torch.where(l > 0, l, 1.0)).to(dt)


# name -> (kernel, the diagnosis id it must get first)
GALLERY = {
    "no_causal_mask": (no_causal_mask, "no-causal-mask"),
    "mask_one_future": (mask_one_future, "mask-one-future"),
    "mask_one_past": (mask_one_past, "mask-one-past"),
    "bottom_right": (bottom_right, "other-alignment"),
    "scale_one_over_d": (scale_one_over_d, "scale-1/D"),
    "no_scale": (no_scale, "no-scale"),
    "softmax_over_queries": (softmax_over_queries, "softmax-over-queries"),
    "layout_bthd_as_bhtd": (layout_bthd_as_bhtd, "layout-bthd-as-bhtd"),
    "stale_max": (stale_max, "stale-max"),
    "dropout_left_on": (dropout_left_on, "dropout"),
    "backward_no_delta": (backward_no_delta, "backward-no-D"),
    "dq_missing_scale": (dq_missing_scale, "dq-missing-scale"),
    "dk_missing_scale": (dk_missing_scale, "dk-missing-scale"),
    "one_head_wrong": (one_head_wrong, "no-causal-mask"),
    "bf16_denominator": (bf16_denominator, "denominator"),
    "low_precision_accumulator": (low_precision_accumulator, "grows-with-length"),
    "backward_masked": (backward_masked, "backward-masked"),
    "backward_unmasked": (backward_unmasked, "backward-unmasked"),
    "acc_not_rescaled": (acc_not_rescaled, "acc-not-rescaled"),
    "acc_rescaled_late": (acc_rescaled_late, "acc-rescaled-late"),
    "l_starts_at_one": (l_starts_at_one, "l-starts-at-one"),
    "split_merge_no_rescale": (split_merge_no_rescale, "split-no-rescale"),
}
