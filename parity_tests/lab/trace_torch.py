"""Autograd's side of the walkthrough: ``torch_impl``'s forward, line by line,
with ``retain_grad()`` on every intermediate.

``torch_impl``'s modules keep their intermediates in local variables, out of
reach of autograd's ``.grad``; so each forward is written out again here, the
same lines in the same order with the module's own layers and dropout, keeping
each tensor as it goes.  Two changes, neither of which changes a number:

- the mask is applied with ``masked_fill`` (out of place) instead of
  ``masked_fill_``, so the raw scores and the masked scores are two tensors;
- ``x`` enters each projection through its own ``x.view_as(x)``, so the three
  roads by which ``x`` reaches the output (query, key, value) each get a gradient.

`trace` checks that the output equals the module's own forward, bit for bit.
"""

import torch

import torch_impl


class _Keeper(dict):
    """name -> tensor, each asked to keep its gradient; ``masks``: the dropout
    keep-masks drawn, by head prefix."""

    def __init__(self):
        super().__init__()
        self.masks = {}

    def __call__(self, name, t):
        t.retain_grad()
        self[name] = t
        return t


def _three_roads(keep, x, prefix=""):
    return (keep(f"{prefix}x.via_query", x.view_as(x)),
            keep(f"{prefix}x.via_key", x.view_as(x)),
            keep(f"{prefix}x.via_value", x.view_as(x)))


def _simplified(m, x, keep):
    xq, xk, xv = _three_roads(keep, x)
    attn_scores = keep("attn_scores", xq @ xk.T)                        # (T, T)
    attn_weights = keep("attn_weights", torch.softmax(attn_scores, dim=-1))
    return keep("context_vec", attn_weights @ xv)                       # (T, d_in)


def _self_attention(m, x, keep):
    xq, xk, xv = _three_roads(keep, x)
    if isinstance(m, torch_impl.SelfAttention_v1):
        keys = keep("keys", xk @ m.W_key)                               # (T, d_out)
        queries = keep("queries", xq @ m.W_query)
        values = keep("values", xv @ m.W_value)
    else:
        keys = keep("keys", m.W_key(xk))
        queries = keep("queries", m.W_query(xq))
        values = keep("values", m.W_value(xv))
    attn_scores = keep("attn_scores", queries @ keys.T)                  # (T, T)
    scaled = keep("scaled_scores", attn_scores / keys.shape[-1]**0.5)
    attn_weights = keep("attn_weights", torch.softmax(scaled, dim=-1))
    return keep("context_vec", attn_weights @ values)                   # (T, d_out)


def _attend(m, queries, keys, values, keep, prefix, out_name="context_vec"):
    """scores -> mask -> softmax -> dropout -> weighted sum, as CausalAttention
    and MultiHeadAttention write it; (..., T, D) in, (..., T, D) out."""
    num_tokens = queries.shape[-2]
    attn_scores = keep(f"{prefix}attn_scores", queries @ keys.transpose(-2, -1))
    mask_bool = m.mask.bool()[:num_tokens, :num_tokens]
    masked = keep(f"{prefix}masked_scores", attn_scores.masked_fill(mask_bool, -torch.inf))
    scaled = keep(f"{prefix}scaled_scores", masked / keys.shape[-1]**0.5)
    attn_weights = keep(f"{prefix}attn_weights", torch.softmax(scaled, dim=-1))
    dropped = keep(f"{prefix}dropped_weights", _dropout(m, attn_weights, keep, prefix))
    return keep(f"{prefix}{out_name}", dropped @ values)


def _dropout(m, attn_weights, keep, prefix):
    """``m.dropout(attn_weights)``, and the keep-mask it drew (``keep.masks``): the
    same draws again, on ones, from the same generator state."""
    before = torch.get_rng_state()
    dropped = m.dropout(attn_weights)
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    with torch.no_grad():
        keep.masks[prefix] = (m.dropout(torch.ones_like(attn_weights)) != 0).numpy()
    torch.set_rng_state(after)
    return dropped


def _causal(m, x, keep, prefix=""):
    xq, xk, xv = _three_roads(keep, x, prefix)
    keys = keep(f"{prefix}keys", m.W_key(xk))                            # (b, T, d_out)
    queries = keep(f"{prefix}queries", m.W_query(xq))
    values = keep(f"{prefix}values", m.W_value(xv))
    return _attend(m, queries, keys, values, keep, prefix)


def _wrapper(m, x, keep):
    outs = [_causal(head, x, keep, prefix=f"heads.{i}.") for i, head in enumerate(m.heads)]
    return keep("context_vec", torch.cat(outs, dim=-1))


def _multihead(m, x, keep):
    b, num_tokens, _ = x.shape
    xq, xk, xv = _three_roads(keep, x)
    keys = keep("keys", m.W_key(xk))                                     # (b, T, d_out)
    queries = keep("queries", m.W_query(xq))
    values = keep("values", m.W_value(xv))
    split = (b, num_tokens, m.num_heads, m.head_dim)
    keys = keep("keys_heads", keys.view(*split).transpose(1, 2))         # (b, H, T, D)
    queries = keep("queries_heads", queries.view(*split).transpose(1, 2))
    values = keep("values_heads", values.view(*split).transpose(1, 2))
    context = _attend(m, queries, keys, values, keep, "", "context_heads")  # (b, H, T, D)
    merged = keep("merged", context.transpose(1, 2).contiguous().view(b, num_tokens, m.d_out))
    return keep("context_vec", m.out_proj(merged))                      # (b, T, d_out)


_FORWARDS = {
    "SimplifiedSelfAttention": _simplified,
    "SelfAttention_v1": _self_attention,
    "SelfAttention_v2": _self_attention,
    "CausalAttention": _causal,
    "MultiHeadAttentionWrapper": _wrapper,
    "MultiHeadAttention": _multihead,
}


def trace(m, x, G, dropout_seed):
    """Run ``m``'s forward step by step on ``x`` (NumPy, float64), backpropagate
    ``G``, and return ``(tensors, dx, param_grads, keep_masks)``: every kept
    intermediate with its ``.grad``, dL/dx, dL/d each parameter (by
    ``named_parameters()`` name) and, for the causal modules, the dropout
    keep-masks drawn (``{prefix: bool array}``), for NumPy to reuse.
    """
    name = type(m).__name__
    x_t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    keep = _Keeper()
    torch.manual_seed(dropout_seed)
    out = _FORWARDS[name](m, x_t, keep)
    torch.manual_seed(dropout_seed)
    with torch.no_grad():
        reference = m(torch.tensor(x, dtype=torch.float64))
    if not torch.equal(out.detach(), reference):
        raise AssertionError(f"the step-by-step forward of {name} differs from the module's")
    m.zero_grad(set_to_none=True)
    out.backward(torch.tensor(G, dtype=torch.float64))
    params = {n: p.grad.numpy().copy() for n, p in m.named_parameters()}
    return keep, x_t.grad.numpy().copy(), params, keep.masks
