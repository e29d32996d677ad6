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


# Kernels that return garbage: not the tensor the case expects, or not a tensor at all.

def returns_a_tuple(q, k, v, *, causal, scale):
    """(out, lse) where out alone is expected."""
    out = sdpa(q, k, v, causal=causal, scale=scale)
    return out, out.sum(-1)


def returns_none(q, k, v, *, causal, scale):
    sdpa(q, k, v, causal=causal, scale=scale)


def returns_numpy(q, k, v, *, causal, scale):
    return sdpa(q, k, v, causal=causal, scale=scale).detach().numpy()


def returns_a_scalar(q, k, v, *, causal, scale):
    return sdpa(q, k, v, causal=causal, scale=scale).sum()


def returns_infinity(q, k, v, *, causal, scale):
    return sdpa(q, k, v, causal=causal, scale=scale) * torch.inf


def returns_out_alone(q, k, v, *, causal, scale):
    """out where (out, lse) is expected."""
    return sdpa(q, k, v, causal=causal, scale=scale)


def returns_lse_of_the_wrong_shape(q, k, v, *, causal, scale):
    out = sdpa(q, k, v, causal=causal, scale=scale)
    return out, out.sum(-1).transpose(1, 2)


def returns_lse_as_a_list(q, k, v, *, causal, scale):
    out = sdpa(q, k, v, causal=causal, scale=scale)
    return out, out.sum(-1).tolist()


def returns_lse_in_integers(q, k, v, *, causal, scale):
    out = sdpa(q, k, v, causal=causal, scale=scale)
    return out, out.sum(-1).int()


def returns_three(q, k, v, *, causal, scale):
    out = sdpa(q, k, v, causal=causal, scale=scale)
    return out, out.sum(-1), None


def nan_gradients(q, k, v, *, causal, scale):
    return with_backward(sdpa(q, k, v, causal=causal, scale=scale), lambda g: g * torch.nan)

