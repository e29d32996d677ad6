"""A block kernel as Triton's fused-attention tutorial writes one: T a multiple of its
block of 128 rows, Tq = Tk, D a power of two from 32; it refuses every other shape
(``targets.Unsupported``), so the check draws its input classes at shapes it takes.
``block_attention`` is right; each other is right but for what its name says."""

import torch
import torch.nn.functional as F

from parity_tests.kernels.targets import Unsupported

BLOCK = 128


def _refuse(q, k):
    t, d = q.shape[-2], q.shape[-1]
    if t % BLOCK or k.shape[-2] != t:
        raise Unsupported(f"T must be a multiple of {BLOCK} (and Tq = Tk)")
    if d not in (32, 64, 128, 256):
        raise Unsupported("D must be 32, 64, 128 or 256")


def block_attention(q, k, v, *, causal, scale):
    _refuse(q, k)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def ignores_scale(q, k, v, *, causal, scale):
    _refuse(q, k)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)        # 1/√D whatever it is given


def ignores_strides(q, k, v, *, causal, scale):
    _refuse(q, k)
    q, k, v = (torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset()) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def no_max_subtracted(q, k, v, *, causal, scale):
    _refuse(q, k)
    t = q.shape[-2]
    S = (q @ k.transpose(-1, -2)) * scale
    S = S.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf) if causal else S
    P = torch.exp(S)
    return (P / P.sum(-1, keepdim=True)) @ v


WRONG = {"scale": ignores_scale, "strides": ignores_strides, "max": no_max_subtracted}
