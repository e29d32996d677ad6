"""Merges of partial attention states for ``check --merge``: one right, and one for
each classic mistake.  Each takes ``(out_a, lse_a, out_b, lse_b)``: out (B, H, T, D),
lse (B, H, T) natural log, an empty partial lse -inf with any out."""

import math

import torch


def _empty_to_zero(out, lse):
    """An empty partial's out (NaN, garbage) as 0, before anything multiplies it."""
    return torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(out), out)


def _rescaled(out_a, lse_a, out_b, lse_b, exp, log):
    """The online softmax's merge with ``exp``/``log`` of a base: m = max, α = exp(lse − m)."""
    m = torch.maximum(lse_a, lse_b).detach()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)        # both empty: shift by 0
    alpha_a, alpha_b = exp(lse_a - m), exp(lse_b - m)
    total = alpha_a + alpha_b
    safe = torch.where(total == 0, torch.ones_like(total), total)
    out = (alpha_a[..., None] * _empty_to_zero(out_a, lse_a)
           + alpha_b[..., None] * _empty_to_zero(out_b, lse_b)) / safe[..., None]
    lse = torch.where(total == 0, torch.full_like(total, -math.inf), m + log(safe))
    return out.to(out_a.dtype), lse


def merge(out_a, lse_a, out_b, lse_b):
    """Right: the online softmax's rescale, empty partials contribute nothing."""
    return _rescaled(out_a, lse_a, out_b, lse_b, torch.exp, torch.log)


def merge_base2(out_a, lse_a, out_b, lse_b):
    """FlashAttention's exp2 trick without the conversion: every lse read and written in base 2."""
    return _rescaled(out_a, lse_a, out_b, lse_b, torch.exp2, torch.log2)


def merge_no_max(out_a, lse_a, out_b, lse_b):
    """exp(lse) straight away: right until exp overflows (lse > 88.7 in float32)."""
    e_a, e_b = torch.exp(lse_a), torch.exp(lse_b)
    total = e_a + e_b
    out = (e_a[..., None] * _empty_to_zero(out_a, lse_a)
           + e_b[..., None] * _empty_to_zero(out_b, lse_b)) / total[..., None]
    return out.to(out_a.dtype), torch.log(total)


def merge_empty_nan(out_a, lse_a, out_b, lse_b):
    """The max subtracted, but an empty partial's out multiplied by its 0 weight: 0 * NaN."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - lse), torch.exp(lse_b - lse)
    return (w_a[..., None] * out_a + w_b[..., None] * out_b).to(out_a.dtype), lse


def merge_not_normalised(out_a, lse_a, out_b, lse_b):
    """The rescale factors used as weights, never divided by their sum."""
    m = torch.maximum(lse_a, lse_b).detach()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    alpha_a, alpha_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = alpha_a + alpha_b
    safe = torch.where(total == 0, torch.ones_like(total), total)
    out = alpha_a[..., None] * _empty_to_zero(out_a, lse_a) + alpha_b[..., None] * _empty_to_zero(out_b, lse_b)
    lse = torch.where(total == 0, torch.full_like(total, -math.inf), m + torch.log(safe))
    return out.to(out_a.dtype), lse


def merge_lse_detached(out_a, lse_a, out_b, lse_b):
    """The weights exp(lse_x - lse) with the merged lse detached, as the maximum may be: the
    forward right, each partial lse's gradient short of its -<dO, out> term."""
    both = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    zero = lambda l: torch.where(both, torch.zeros_like(l), l)
    lse = torch.logaddexp(zero(lse_a), zero(lse_b))
    w_a, w_b = torch.exp(zero(lse_a) - lse.detach()), torch.exp(zero(lse_b) - lse.detach())
    out = w_a[..., None] * _empty_to_zero(out_a, lse_a) + w_b[..., None] * _empty_to_zero(out_b, lse_b)
    return out.to(out_a.dtype), torch.where(both, torch.full_like(lse, -math.inf), lse)



def merge_dout_b_weighed_by_a(out_a, lse_a, out_b, lse_b):
    """The forward right; its backward gives out_b the gradient w_a dout where w_b dout is meant
    (the line for b's output gradient copied from a's), the lse gradients right (an empty b's
    gradient left 0)."""
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    both = torch.stack([lse_a, lse_b]).detach().float()
    w_a, w_b = torch.nan_to_num(torch.softmax(both, dim=0))[..., None]       # each piece's weight
    b = _empty_to_zero(out_b, lse_b)
    return out + ((w_a - w_b) * (b - b.detach())).to(out.dtype), lse         # its value 0; ∂/∂out_b: w_a - w_b



class _HandedWhole(torch.autograd.Function):
    """0 forward; backward: (1 − w_a) g and (1 − w_b) g to lse_a and lse_b, where the merge's own
    backward gives w_x g: the two together hand each piece g whole."""

    @staticmethod
    def forward(ctx, lse_a, lse_b, w_a, w_b):
        ctx.save_for_backward(w_a, w_b)
        return torch.zeros_like(lse_a)

    @staticmethod
    def backward(ctx, g):
        w_a, w_b = ctx.saved_tensors
        return (1 - w_a) * g, (1 - w_b) * g, None, None


def merge_dlse_unweighted(out_a, lse_a, out_b, lse_b):
    """The forward right; its backward hands the merged lse's gradient to each piece whole,
    dlse_x = w_x <dO, out_x - out> + dlse (d lse / d lse_x taken as 1, w_x meant)."""
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    w_a, w_b = torch.nan_to_num(torch.softmax(torch.stack([lse_a, lse_b]).detach().float(), dim=0))
    return out, lse + _HandedWhole.apply(lse_a, lse_b, w_a, w_b).to(lse.dtype)
