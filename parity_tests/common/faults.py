"""Named mistakes to plant in either implementation, to show the parity matrix catches them.

A parity check that cannot fail proves nothing.  Each fault here is a small,
realistic slip in backpropagation code (a dropped term, a missing scale, a wrong
layout) planted by a context manager that swaps one function and puts it back
on exit.  NumPy faults replace a function of ``numpy_ref.ops`` (the modules call
every op as ``ops.<name>``) or a helper of ``numpy_ref.blockwise`` (the
blockwise-only mistakes of `parity_tests.common.blockwise_faults`) or a piece of
the production variants (`parity_tests.common.variant_faults`); PyTorch faults replace a name ``torch_impl.attention``
looks up.  ``attention-parity --plant-fault NAME`` runs the matrix with one planted
and must exit 1; the suite asserts it does, for every fault.

    with plant("softmax-backward-no-sum"):
        rows = harness.run_matrix(cases)       # some rows fail
"""

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

import numpy_ref.blockwise as blockwise
import numpy_ref.ops as ops
import torch_impl.attention as torch_attention
from parity_tests.common.blockwise_faults import BLOCKWISE_FAULTS
from parity_tests.common.variant_faults import VARIANT_FAULTS

__all__ = ["Fault", "FAULTS", "plant", "names"]


@dataclass(frozen=True)
class Fault:
    name: str
    side: str             # "numpy" or "torch"
    description: str
    target: object        # the module whose attribute is replaced
    attribute: str
    make: object          # make(original) -> replacement


def _softmax_backward_no_sum(original):
    # w * g, forgetting the - w <w, g> term: J taken as diag(w) instead of diag(w) - w w^T
    def softmax_backward(w, grad_w, axis=-1, out=None):
        return np.asarray(w) * np.asarray(grad_w)
    return softmax_backward


def _scores_backward_unscaled(original):
    # the 1/sqrt(d_k) of the forward forgotten in the backward (undone on the result)
    def scores_backward(dout, cache):
        dqueries, dkeys = original(dout, cache)
        root = dqueries.shape[-1] ** 0.5
        return dqueries * root, dkeys * root
    return scores_backward


def _causal_mask_off_by_one(original):
    # triu(..., diagonal=2) instead of diagonal=1: each token also sees the next one
    def causal_mask_forward(attn_scores, mask, inplace=False):
        shifted = np.triu(np.ones(mask.shape, dtype=bool), k=2)
        return original(attn_scores, shifted, inplace)
    return causal_mask_forward


def _dropout_not_rescaled(original):
    # survivors kept at their value (forward and backward): the weights shrink by (1 - p)
    def dropout_forward(x, keep_mask, p):
        return original(x, keep_mask, 0.0)
    return dropout_forward


def _bias_grad_first_batch(original):
    # db summed over the tokens of the first sequence only, not over the batch
    def linear_backward(dout, cache):
        dx, dW, db = original(dout, cache)
        if db is not None and dout.ndim == 3:
            db = dout[0].sum(axis=0)
        return dx, dW, db
    return linear_backward


def _weight_grad_transposed(original):
    # dW computed as x^T dout, (d_in, d_out), and stored into the (d_out, d_in) slot
    def linear_backward(dout, cache):
        dx, dW, db = original(dout, cache)
        return dx, np.ascontiguousarray(dW.T).reshape(dW.shape), db
    return linear_backward


def _linear_backward_sign(original):
    # dx = -(dout @ W): a sign slip in the input gradient of nn.Linear
    def linear_backward(dout, cache):
        dx, dW, db = original(dout, cache)
        return -dx, dW, db
    return linear_backward


def _weighted_sum_no_transpose(original):
    # dvalues = w @ dout instead of w^T @ dout
    def weighted_sum_backward(dout, cache):
        attn_weights, values = cache
        dattn_weights, _ = original(dout, cache)
        return dattn_weights, attn_weights @ dout
    return weighted_sum_backward


def _merge_heads_wrong_order(original):
    # heads merged as (B, T, D, H) instead of (B, T, H, D): features interleaved
    def merge_heads_forward(x):
        b, num_heads, num_tokens, head_dim = x.shape
        out = np.ascontiguousarray(x.transpose(0, 2, 3, 1))      # (B, T, D, H)
        return out.reshape(b, num_tokens, num_heads * head_dim), (num_heads, head_dim)
    return merge_heads_forward


def _merge_heads_wrong_order_backward(original):
    def merge_heads_backward(dout, cache):
        num_heads, head_dim = cache
        b, num_tokens, _ = dout.shape
        d = dout.reshape(b, num_tokens, head_dim, num_heads)     # (B, T, D, H)
        return d.transpose(0, 3, 1, 2)                           # (B, H, T, D)
    return merge_heads_backward


def _torch_mask_off_by_one(original):
    # the PyTorch modules' mask buffer built with diagonal=2
    def _causal_mask(context_length):
        return torch.triu(torch.ones(context_length, context_length), diagonal=2)
    return _causal_mask


def _torch_heads_reversed(original):
    # torch.cat of the wrapper's heads in reverse order
    def cat(tensors, dim=0):
        return torch.cat(list(tensors)[::-1], dim=dim)
    return _TorchWith(cat=cat)


class _TorchWith:
    """Stands in for the ``torch`` module inside ``torch_impl.attention``: every name
    is torch's except the overridden ones."""

    def __init__(self, **overrides):
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(torch, name)


FAULTS = {f.name: f for f in (
    Fault("softmax-backward-no-sum", "numpy", "softmax backward drops the -w<w,g> term",
          ops, "softmax_backward", _softmax_backward_no_sum),
    Fault("scores-backward-unscaled", "numpy", "scores backward forgets 1/sqrt(d_k)",
          ops, "scores_backward", _scores_backward_unscaled),
    Fault("causal-mask-off-by-one", "numpy", "causal mask one diagonal too high (sees the next token)",
          ops, "causal_mask_forward", _causal_mask_off_by_one),
    Fault("dropout-not-rescaled", "numpy", "dropout survivors not scaled by 1/(1-p)",
          ops, "dropout_forward", _dropout_not_rescaled),
    Fault("bias-grad-first-batch", "numpy", "bias gradient summed over the first sequence only",
          ops, "linear_backward", _bias_grad_first_batch),
    Fault("weight-grad-transposed", "numpy", "nn.Linear weight gradient laid out transposed",
          ops, "linear_backward", _weight_grad_transposed),
    Fault("linear-backward-sign", "numpy", "nn.Linear input gradient with the wrong sign",
          ops, "linear_backward", _linear_backward_sign),
    Fault("weighted-sum-no-transpose", "numpy", "values gradient w @ dout instead of w^T @ dout",
          ops, "weighted_sum_backward", _weighted_sum_no_transpose),
    Fault("heads-merged-wrong-order", "numpy", "heads merged as (T, D, H) instead of (T, H, D)",
          ops, "merge_heads_forward", _merge_heads_wrong_order),
    Fault("torch-mask-off-by-one", "torch", "PyTorch mask buffer one diagonal too high",
          torch_attention, "_causal_mask", _torch_mask_off_by_one),
    Fault("torch-heads-reversed", "torch", "PyTorch wrapper concatenates its heads in reverse",
          torch_attention, "torch", _torch_heads_reversed),
) + tuple(Fault(name, "numpy", description, blockwise, helper, make)
          for name, (helper, make, description) in BLOCKWISE_FAULTS.items())
  + tuple(Fault(name, "numpy", description, target, attribute, make)
          for name, (target, attribute, make, description) in VARIANT_FAULTS.items())}

# A fault that needs a matching change elsewhere to stay self-consistent.
_COMPANIONS = {
    "heads-merged-wrong-order": [(ops, "merge_heads_backward", _merge_heads_wrong_order_backward)],
}


def names():
    return list(FAULTS)


@contextlib.contextmanager
def plant(name):
    """Plant fault ``name`` for the duration of the ``with`` block; everything is restored after."""
    if name not in FAULTS:
        raise ValueError(f"fault must be one of {', '.join(FAULTS)}; got {name!r}")
    fault = FAULTS[name]
    with swapped([(fault.target, fault.attribute, fault.make)] + _COMPANIONS.get(name, [])):
        yield fault


@contextlib.contextmanager
def swapped(swaps):
    """For the ``with`` block, ``target.attribute = make(original)`` for each
    ``(target, attribute, make)``; every original is restored after, in reverse."""
    saved = []
    try:
        for target, attribute, make in swaps:
            original = getattr(target, attribute)
            saved.append((target, attribute, original))
            setattr(target, attribute, make(original))
        yield
    finally:
        for target, attribute, original in reversed(saved):
            setattr(target, attribute, original)
