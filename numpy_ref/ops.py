"""The chapter's operations as forward/backward pairs, one under the other.

Every forward returns ``(out, cache)`` and its backward takes ``(dout, cache)``;
``cache`` holds only what that backward needs.  Gradients carry a ``d`` prefix:
``dx`` is dL/dx for some scalar loss L whose gradient with respect to the output
is ``dout``.

Shape legend::

    B  batch            T  tokens (Tq queries, Tk keys; equal in self-attention)
    H  heads            D  head_dim = d_out / H
    d_in, d_out         feature sizes;  ...  any leading axes

The modules in ``numpy_ref.attention`` call every op through this module
(``ops.softmax_backward(...)``), so a test can replace one op and watch the
finite-difference checks catch it.
"""

import numpy as np

from numpy_ref.softmax import (  # re-exported: modules call ops.softmax*
    softmax,
    softmax_naive,
    softmax_jacobian,
    softmax_backward,
    sum_normalize,
    sum_normalize_jacobian,
)

__all__ = [
    "softmax", "softmax_naive", "softmax_jacobian", "softmax_backward",
    "sum_normalize", "sum_normalize_jacobian",
    "linear_v1_forward", "linear_v1_backward",
    "linear_forward", "linear_backward",
    "scores_forward", "scores_backward",
    "causal_mask_forward", "causal_mask_backward",
    "draw_keep_mask", "dropout_forward", "dropout_backward",
    "weighted_sum_forward", "weighted_sum_backward",
    "split_heads_forward", "split_heads_backward",
    "merge_heads_forward", "merge_heads_backward",
    "concat_heads_forward", "concat_heads_backward",
]


def _swap(a):
    """Swap the last two axes (the chapter's ``.T`` / ``.transpose(-2, -1)``); a view."""
    return np.swapaxes(a, -1, -2)


def _rows(a):
    """Flatten every leading axis into one: (..., n) -> (N, n)."""
    return a.reshape(-1, a.shape[-1])


# ----------------------------------------------------------------------------
# Linear projection, SelfAttention_v1's layout: W is (d_in, d_out)

def linear_v1_forward(x, W):
    """``out = x @ W`` as in ``SelfAttention_v1`` (``nn.Parameter(torch.rand(d_in, d_out))``).

    x: (..., d_in)   W: (d_in, d_out)   ->   out: (..., d_out)
    """
    out = x @ W
    return out, (x, W)


def linear_v1_backward(dout, cache):
    """Backward of ``out = x @ W``.

    out[n, o] = sum_i x[n, i] W[i, o], so
        dx[n, i] = sum_o dout[n, o] W[i, o]      ->  dx = dout @ W^T
        dW[i, o] = sum_n x[n, i] dout[n, o]      ->  dW = x^T @ dout
    where n runs over every leading position (all rows share one W).

    dout: (..., d_out)  ->  dx: (..., d_in), dW: (d_in, d_out)
    """
    x, W = cache
    dx = dout @ W.T
    dW = _rows(x).T @ _rows(dout)
    return dx, dW


# ----------------------------------------------------------------------------
# Linear projection, nn.Linear's layout: weight is (d_out, d_in)

def linear_forward(x, W, b=None):
    """``out = x @ W^T + b``, exactly what ``nn.Linear(d_in, d_out)`` computes.

    x: (..., d_in)   W: (d_out, d_in)   b: (d_out,) or None  ->  out: (..., d_out)

    The chapter: v1's W equals nn.Linear's weight transposed, ``W = W~^T``.
    """
    out = x @ W.T
    if b is not None:
        out += b                                         # broadcast over rows
    return out, (x, W, b is not None)


def linear_backward(dout, cache):
    """Backward of ``out = x @ W^T + b``.

    out[n, o] = sum_i x[n, i] W[o, i] + b[o], so
        dx[n, i] = sum_o dout[n, o] W[o, i]      ->  dx = dout @ W
        dW[o, i] = sum_n dout[n, o] x[n, i]      ->  dW = dout^T @ x
        db[o]    = sum_n dout[n, o]              (summed over ALL leading axes)

    dout: (..., d_out)  ->  dx: (..., d_in), dW: (d_out, d_in), db: (d_out,) or None
    """
    x, W, has_bias = cache
    dx = dout @ W
    dW = _rows(dout).T @ _rows(x)
    db = _rows(dout).sum(axis=0) if has_bias else None
    return dx, dW, db


# ----------------------------------------------------------------------------
# Scaled dot-product scores

def scores_forward(queries, keys, scaled=True):
    """``attn_scores = queries @ keys^T / sqrt(d_k)`` with ``d_k = keys.shape[-1]``.

    queries: (..., Tq, D)   keys: (..., Tk, D)   ->   attn_scores: (..., Tq, Tk)

    ``scaled=False`` gives the simplified attention's raw ``x @ x^T``.  The
    chapter masks before dividing; the order does not matter because
    ``-inf / sqrt(d_k) = -inf`` and the kept entries are untouched by the mask.

    The division is applied to the queries, ``(q / sqrt(d_k)) @ k^T``: the same
    numbers (exactly so when sqrt(d_k) is a power of two, as for d_k = 64) for
    one pass over Tq x D entries instead of Tq x Tk.
    """
    if scaled:
        queries_scaled = queries / keys.shape[-1]**0.5   # (..., Tq, D)
    else:
        queries_scaled = queries
    attn_scores = queries_scaled @ _swap(keys)           # (..., Tq, Tk)
    return attn_scores, (queries, keys, scaled)


def scores_backward(dout, cache):
    """Backward of ``s = q @ k^T / sqrt(d_k)``.

    s[i, j] = sum_d q[i, d] k[j, d] / sqrt(d_k), so with ds = dout / sqrt(d_k):
        dq[i, d] = sum_j ds[i, j] k[j, d]        ->  dq = ds @ k
        dk[j, d] = sum_i ds[i, j] q[i, d]        ->  dk = ds^T @ q

    dout: (..., Tq, Tk)  ->  dqueries: (..., Tq, D), dkeys: (..., Tk, D)

    The 1/sqrt(d_k) is applied to the (..., T, D) products rather than to the
    (..., Tq, Tk) gradient: the same numbers, a smaller pass.
    """
    queries, keys, scaled = cache
    dqueries = dout @ keys                               # (..., Tq, D)
    dkeys = _swap(dout) @ queries                        # (..., Tk, D)
    if scaled:
        scale = 1.0 / keys.shape[-1]**0.5
        dqueries *= scale
        dkeys *= scale
    return dqueries, dkeys


# ----------------------------------------------------------------------------
# Causal mask: future positions set to -inf before the softmax

def causal_mask_forward(attn_scores, mask, inplace=False):
    """``attn_scores.masked_fill_(mask, -inf)``: future tokens get score -inf.

    attn_scores: (..., T, T)   mask: (T, T) bool, True above the diagonal
    (``triu(ones(T, T), diagonal=1).bool()``)  ->  out: (..., T, T)
    (any (Tq, Tk) block of scores with the matching block of the mask works too)

    ``inplace=True`` writes into ``attn_scores`` like ``masked_fill_``; the modules
    use it because nothing else needs the unmasked scores.
    """
    out = attn_scores if inplace else attn_scores.copy()
    np.copyto(out, -np.inf, where=mask)                  # mask broadcast over (...)
    return out, mask


def causal_mask_backward(dout, cache, inplace=False):
    """Backward of the mask.  A masked entry is the constant -inf, whatever the
    score was, so its gradient is 0; a kept entry is copied, gradient 1:
        dscores = dout where not masked, 0 where masked.

    dout: (..., T, T)  ->  dattn_scores: (..., T, T)

    ``inplace=True`` zeroes the masked entries of ``dout`` itself; the modules use
    it on the softmax's fresh gradient, which nothing else reads.
    """
    mask = cache
    dattn_scores = dout if inplace else dout.copy()
    np.copyto(dattn_scores, 0, where=mask)
    return dattn_scores


# ----------------------------------------------------------------------------
# Dropout on the attention weights

def draw_keep_mask(rng, shape, p):
    """Boolean keep-mask, each entry kept (True) with probability ``1 - p``."""
    return rng.random(shape, dtype=np.float32) >= p     # float32 draws: half the memory


def dropout_forward(x, keep_mask, p):
    """``out = x * keep_mask / (1 - p)``: dropped entries become 0, survivors are
    scaled by 1/(1-p) so the expected value of each entry is unchanged.

    x: (...)   keep_mask: bool, shape of x   p: drop probability in [0, 1]
    ->  out: (...)

    p = 1 drops everything whatever the mask says, as ``nn.Dropout(1.0)`` (which
    multiplies by 0): the scale is 0 instead of 1/0.
    """
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    out = x * keep_mask
    out *= scale
    return out, (keep_mask, scale)


def dropout_backward(dout, cache):
    """Backward of ``out = x * m / (1 - p)`` with the mask m fixed:
        dx = dout * m / (1 - p)
    (a dropped entry passes no gradient, a survivor passes it scaled).
    """
    keep_mask, scale = cache
    dx = dout * keep_mask
    dx *= scale
    return dx


# ----------------------------------------------------------------------------
# Weighted sum of the values

def weighted_sum_forward(attn_weights, values):
    """``context_vec = attn_weights @ values``: row i is sum_j w[i, j] v[j].

    attn_weights: (..., Tq, Tk)   values: (..., Tk, D)  ->  context_vec: (..., Tq, D)
    """
    context_vec = attn_weights @ values
    return context_vec, (attn_weights, values)


def weighted_sum_backward(dout, cache):
    """Backward of ``z = w @ v``:
        dw[i, j] = sum_d dout[i, d] v[j, d]      ->  dw = dout @ v^T
        dv[j, d] = sum_i w[i, j] dout[i, d]      ->  dv = w^T @ dout

    dout: (..., Tq, D)  ->  dattn_weights: (..., Tq, Tk), dvalues: (..., Tk, D)
    """
    attn_weights, values = cache
    dattn_weights = dout @ _swap(values)
    dvalues = _swap(attn_weights) @ dout
    return dattn_weights, dvalues


# ----------------------------------------------------------------------------
# Head split and merge (MultiHeadAttention)

def split_heads_forward(x, num_heads):
    """The chapter's ``x.view(b, T, H, D).transpose(1, 2)``.

    x: (B, T, d_out)  ->  (B, T, H, D) by view  ->  (B, H, T, D) by transpose.
    Both steps are views: no number moves.  Nothing is cached but the head count.

    Then, unlike the chapter, one copy to contiguous memory: the (T, T) matrix
    products that follow run up to a third faster on contiguous heads, and the
    copy is only B * T * d_out numbers.
    """
    b, num_tokens, d_out = x.shape
    head_dim = d_out // num_heads
    out = x.reshape(b, num_tokens, num_heads, head_dim)  # (B, T, H, D), view
    out = out.transpose(0, 2, 1, 3)                      # (B, H, T, D), view
    return np.ascontiguousarray(out), num_heads


def split_heads_backward(dout, cache):
    """A split only re-indexes entries, so its backward re-indexes the gradient the
    other way: ``dout`` (B, H, T, D) -> (B, T, H, D) -> (B, T, d_out)."""
    b, num_heads, num_tokens, head_dim = dout.shape
    dx = np.ascontiguousarray(dout.transpose(0, 2, 1, 3))   # (B, T, H, D)
    return dx.reshape(b, num_tokens, num_heads * head_dim)


def merge_heads_forward(x):
    """The chapter's ``x.transpose(1, 2).contiguous().view(b, T, d_out)``.

    x: (B, H, T, D)  ->  (B, T, H, D) by transpose  ->  copied to contiguous
    memory  ->  (B, T, H * D) by view.  Token i's row holds head 0's D numbers,
    then head 1's, and so on.
    """
    b, num_heads, num_tokens, head_dim = x.shape
    out = np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # (B, T, H, D), copied
    out = out.reshape(b, num_tokens, num_heads * head_dim)  # (B, T, d_out), view
    return out, num_heads


def merge_heads_backward(dout, cache):
    """Inverse re-indexing: ``dout`` (B, T, d_out) -> (B, T, H, D) -> (B, H, T, D)."""
    num_heads = cache
    b, num_tokens, d_out = dout.shape
    dx = dout.reshape(b, num_tokens, num_heads, d_out // num_heads)  # (B, T, H, D)
    return np.ascontiguousarray(dx.transpose(0, 2, 1, 3))           # (B, H, T, D)


# ----------------------------------------------------------------------------
# Concatenation of head outputs (MultiHeadAttentionWrapper)

def concat_heads_forward(head_outputs):
    """``torch.cat([head(x) for head in heads], dim=-1)``.

    head_outputs: list of H arrays (..., d_k)  ->  out: (..., sum of d_k)
    """
    out = np.concatenate(head_outputs, axis=-1)
    sizes = [h.shape[-1] for h in head_outputs]
    return out, sizes


def concat_heads_backward(dout, cache):
    """Each head owns a slice of the last axis, so its gradient is that slice:
    ``dhead_h = dout[..., offset_h : offset_h + d_k]`` (views, no copy)."""
    sizes = cache
    bounds = np.cumsum([0] + list(sizes))
    return [dout[..., lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
