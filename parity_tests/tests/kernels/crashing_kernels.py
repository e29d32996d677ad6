"""Kernels that crash, exit or return the wrong kind of tensor, each otherwise right
(SDPA's math), for the tests that a failure of a callable is never "not supported"."""

import sys

import torch
import torch.nn.functional as F


def sdpa(q, k, v, *, causal, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def forward_crashes_on_long_keys(q, k, v, *, causal, scale):
    if k.shape[-2] > 100:
        raise RuntimeError(f"no tile for Tk = {k.shape[-2]}")
    return sdpa(q, k, v, causal=causal, scale=scale)


class _Identity(torch.autograd.Function):
    """Identity forward; the backward is ``backward(g)`` of the incoming gradient."""
    @staticmethod
    def forward(ctx, x, backward):
        ctx.backward_of = backward
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.backward_of(g), None


def with_backward(x, backward):
    """``x`` unchanged, its gradient replaced by ``backward(g)``: a backward-only bug."""
    return _Identity.apply(x, backward)


def _not_written(g):
    raise RuntimeError("backward not written yet")


def backward_crashes(q, k, v, *, causal, scale):
    return with_backward(sdpa(q, k, v, causal=causal, scale=scale), _not_written)


def scales_q_in_place(q, k, v, *, causal, scale):
    q.mul_(scale)                       # a leaf that requires grad: autograd refuses
    return sdpa(q, k, v, causal=causal, scale=1.0)


def detached(q, k, v, *, causal, scale):
    return sdpa(q, k, v, causal=causal, scale=scale).detach()


def not_implemented(q, k, v, *, causal, scale):
    raise NotImplementedError("head_dim 16 is not supported")


def computes_in_float64(q, k, v, *, causal, scale):
    return sdpa(q.double(), k.double(), v.double(), causal=causal, scale=scale)


def on_the_meta_device(q, k, v, *, causal, scale):
    return torch.empty(q.shape, dtype=q.dtype, device="meta")


def exits(q, k, v, *, causal, scale):
    sys.exit(3)


def hangs(q, k, v, *, causal, scale):
    while True:                          # a pure-Python loop: only a signal stops it
        pass
