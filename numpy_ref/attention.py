"""The chapter's six attention modules, each with a hand-written backward pass.

Each forward is written in numbered passes with the chapter's names (keys,
queries, values, attn_scores, attn_weights, context_vec); each backward walks
the same passes in reverse, calling the ops' backwards (see ``numpy_ref.ops``
for every derivation).  Computation happens in the dtype of the input ``x``:
the parameters (float32 by default, as in PyTorch) are cast to it.

``forward`` copies ``x`` and the parameters it uses, and fingerprints a
caller's ``keep_mask``; ``backward`` can be called again and overwrites
``grads`` (details in ``numpy_ref.module``).

Shapes: B batch, T tokens, H heads, D head_dim = d_out / H.
"""

import numpy as np

from numpy_ref import ops
from numpy_ref.module import (
    Module, check_bias, check_dropout, check_input, check_keep_mask,
    check_size, fingerprint, make_rng, uniform,
)

__all__ = [
    "SimplifiedSelfAttention", "SelfAttention_v1", "SelfAttention_v2",
    "CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention",
]


class SimplifiedSelfAttention(Module):
    """``softmax(x x^T) x`` with no weights: x is query, key and value at once.

    ``rng`` is accepted, like every module's, and unused: nothing is drawn."""

    def __init__(self, *, rng=None):
        super().__init__()
        self.rng = make_rng(rng)

    def forward(self, x):
        x = check_input(x, 2)                                           # (T, d)
        # pass 1: attn_scores = x @ x^T, no scaling in the simplified version
        attn_scores, scores_cache = ops.scores_forward(x, x, scaled=False)  # (T, T)
        # pass 2: each row normalised by the softmax
        attn_weights = ops.softmax(attn_scores, axis=-1)                # (T, T)
        # pass 3: context_vec = attn_weights @ x
        context_vec, sum_cache = ops.weighted_sum_forward(attn_weights, x)  # (T, d)
        self._cache = dict(out_shape=context_vec.shape, dtype=x.dtype,
                           scores=scores_cache, attn_weights=attn_weights, sum=sum_cache)
        return context_vec

    def backward(self, grad_out):
        dcontext_vec = self._check_grad_out(grad_out)
        c = self._cache
        # pass 3: x entered as the values
        dattn_weights, dx_as_values = ops.weighted_sum_backward(dcontext_vec, c["sum"])
        # pass 2: softmax VJP, J = diag(w) - w w^T, never formed
        dattn_scores = ops.softmax_backward(c["attn_weights"], dattn_weights)
        # pass 1: x entered as the queries and as the keys
        dx_as_queries, dx_as_keys = ops.scores_backward(dattn_scores, c["scores"])
        # x fed three roads, so its gradient is the sum of the three
        dx = dx_as_queries
        dx += dx_as_keys
        dx += dx_as_values
        self.grads = {}
        return dx


class SelfAttention_v1(Module):
    """Trainable weights as bare matrices W (d_in, d_out), drawn from U[0, 1)."""

    def __init__(self, d_in, d_out, *, rng=None):
        super().__init__()
        self.d_in = check_size("d_in", d_in)
        self.d_out = check_size("d_out", d_out)
        self.rng = make_rng(rng)
        for name in ("W_query", "W_key", "W_value"):
            self._parameters[name] = uniform(self.rng, (self.d_in, self.d_out), 0.0, 1.0)

    def forward(self, x):
        x = check_input(x, 2, self.d_in)                               # (T, d_in)
        # copies: an in-place change to a parameter after forward changes no gradient
        W = {n: p.astype(x.dtype, copy=True) for n, p in self._parameters.items()}
        # pass 1: the three projections, (T, d_out) each
        keys, k_cache = ops.linear_v1_forward(x, W["W_key"])
        queries, q_cache = ops.linear_v1_forward(x, W["W_query"])
        values, v_cache = ops.linear_v1_forward(x, W["W_value"])
        # pass 2: attn_scores = queries @ keys^T / sqrt(d_k)
        attn_scores, scores_cache = ops.scores_forward(queries, keys)  # (T, T)
        # pass 3: softmax over the keys
        attn_weights = ops.softmax(attn_scores, axis=-1)               # (T, T)
        # pass 4: context_vec = attn_weights @ values
        context_vec, sum_cache = ops.weighted_sum_forward(attn_weights, values)
        self._cache = dict(out_shape=context_vec.shape, dtype=x.dtype,
                           k=k_cache, q=q_cache, v=v_cache, scores=scores_cache,
                           attn_weights=attn_weights, sum=sum_cache)
        return context_vec

    def backward(self, grad_out):
        dcontext_vec = self._check_grad_out(grad_out)
        c = self._cache
        # pass 4
        dattn_weights, dvalues = ops.weighted_sum_backward(dcontext_vec, c["sum"])
        # pass 3
        dattn_scores = ops.softmax_backward(c["attn_weights"], dattn_weights)
        # pass 2
        dqueries, dkeys = ops.scores_backward(dattn_scores, c["scores"])
        # pass 1: x fed all three projections, its gradient sums the three
        dx, dW_value = ops.linear_v1_backward(dvalues, c["v"])
        dx_q, dW_query = ops.linear_v1_backward(dqueries, c["q"])
        dx_k, dW_key = ops.linear_v1_backward(dkeys, c["k"])
        dx += dx_q
        dx += dx_k
        self.grads = {"W_query": dW_query, "W_key": dW_key, "W_value": dW_value}
        return dx


class _LinearLayers(Module):
    """Helpers for modules whose projections are ``nn.Linear`` layers, stored as
    ``"<layer>.weight"`` (d_out, d_in) and ``"<layer>.bias"`` (d_out,)."""

    def _add_linear(self, layer, d_in, d_out, bias):
        # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias
        bound = 1.0 / d_in**0.5
        self._parameters[f"{layer}.weight"] = uniform(self.rng, (d_out, d_in), -bound, bound)
        if bias:
            self._parameters[f"{layer}.bias"] = uniform(self.rng, (d_out,), -bound, bound)

    def _linear(self, layer, x):
        """``layer(x)`` in x's dtype -> (out, cache).  The weight is copied (cast
        to x's dtype), so an in-place change to it after forward changes no gradient."""
        W = self._parameters[f"{layer}.weight"].astype(x.dtype, copy=True)
        b = self._parameters.get(f"{layer}.bias")
        b = None if b is None else b.astype(x.dtype, copy=False)   # the sum copies it
        return ops.linear_forward(x, W, b)

    def _linear_backward(self, layer, dout, cache, grads):
        """Backward of ``layer``: returns dx, stores the weight (and bias) grads."""
        dx, dW, db = ops.linear_backward(dout, cache)
        grads[f"{layer}.weight"] = dW
        if db is not None:
            grads[f"{layer}.bias"] = db
        return dx

    def _ordered(self, grads):
        """grads in named_parameters() order."""
        return {name: grads[name] for name in self._parameters}


class SelfAttention_v2(_LinearLayers):
    """SelfAttention_v1 with ``nn.Linear`` layers: weight (d_out, d_in), out = x W^T + b."""

    def __init__(self, d_in, d_out, qkv_bias=False, *, rng=None):
        super().__init__()
        self.d_in = check_size("d_in", d_in)
        self.d_out = check_size("d_out", d_out)
        qkv_bias = check_bias(qkv_bias)
        self.rng = make_rng(rng)
        for layer in ("W_query", "W_key", "W_value"):
            self._add_linear(layer, self.d_in, self.d_out, qkv_bias)

    def forward(self, x):
        x = check_input(x, 2, self.d_in)                               # (T, d_in)
        # pass 1: the three projections, (T, d_out) each
        keys, k_cache = self._linear("W_key", x)
        queries, q_cache = self._linear("W_query", x)
        values, v_cache = self._linear("W_value", x)
        # pass 2: attn_scores = queries @ keys^T / sqrt(d_k)
        attn_scores, scores_cache = ops.scores_forward(queries, keys)  # (T, T)
        # pass 3: softmax over the keys
        attn_weights = ops.softmax(attn_scores, axis=-1)               # (T, T)
        # pass 4: context_vec = attn_weights @ values
        context_vec, sum_cache = ops.weighted_sum_forward(attn_weights, values)
        self._cache = dict(out_shape=context_vec.shape, dtype=x.dtype,
                           k=k_cache, q=q_cache, v=v_cache, scores=scores_cache,
                           attn_weights=attn_weights, sum=sum_cache)
        return context_vec

    def backward(self, grad_out):
        dcontext_vec = self._check_grad_out(grad_out)
        c, grads = self._cache, {}
        # pass 4
        dattn_weights, dvalues = ops.weighted_sum_backward(dcontext_vec, c["sum"])
        # pass 3
        dattn_scores = ops.softmax_backward(c["attn_weights"], dattn_weights)
        # pass 2
        dqueries, dkeys = ops.scores_backward(dattn_scores, c["scores"])
        # pass 1: x fed all three projections, its gradient sums the three
        dx = self._linear_backward("W_value", dvalues, c["v"], grads)
        dx += self._linear_backward("W_query", dqueries, c["q"], grads)
        dx += self._linear_backward("W_key", dkeys, c["k"], grads)
        self.grads = self._ordered(grads)
        return dx


class _Causal(_LinearLayers):
    """Shared by CausalAttention and MultiHeadAttention: sizes, the causal mask
    buffer, dropout, and the masked-softmax-dropout-weighted-sum core."""

    def _setup(self, d_in, d_out, context_length, dropout, qkv_bias, rng):
        self._setup_sizes(d_in, d_out, context_length, dropout, qkv_bias, rng)
        # register_buffer('mask', torch.triu(torch.ones(ctx, ctx), diagonal=1))
        ones = np.ones((self.context_length, self.context_length), dtype=np.float32)
        self._buffers["mask"] = np.triu(ones, k=1)

    def _setup_sizes(self, d_in, d_out, context_length, dropout, qkv_bias, rng):
        """The constructor's arguments, checked and kept (everything but the buffer)."""
        self.d_in = check_size("d_in", d_in)
        self.d_out = check_size("d_out", d_out)
        self.context_length = check_size("context_length", context_length)
        self.dropout = check_dropout(dropout)
        self.qkv_bias = check_bias(qkv_bias)
        self.rng = make_rng(rng)

    def _keep_mask(self, keep_mask, shape, layout):
        """(keep-mask this forward uses, guards): the mask is None when dropout is
        the identity (eval mode or p = 0, where a given keep_mask is ignored),
        else the given one, validated, or one drawn from the module's rng.  A
        given mask stays the caller's array: ``guards`` holds its fingerprint,
        checked by backward, instead of a copy the size of the attention weights."""
        check_dropout(self.dropout)         # a public attribute: it may have been set since
        if not self.training or self.dropout == 0.0:
            return None, []
        if keep_mask is None:
            return ops.draw_keep_mask(self.rng, shape, self.dropout), []
        keep_mask = check_keep_mask(keep_mask, shape, layout)
        return keep_mask, [("keep_mask", keep_mask, fingerprint(keep_mask))]

    def _attend(self, queries, keys, values, keep_mask, mask_bool=None):
        """Passes 2-6 on (..., Tq, D) queries and (..., Tk, D) keys and values
        -> (context_vec, caches).  ``mask_bool`` (Tq, Tk), True where a key is
        hidden, defaults to the buffer's top-left (T, T) corner."""
        if mask_bool is None:
            num_tokens = queries.shape[-2]
            mask_bool = self._buffers["mask"][:num_tokens, :num_tokens].astype(bool)
        # pass 2: attn_scores = queries @ keys^T / sqrt(d_k)      (..., T, T)
        attn_scores, scores_cache = ops.scores_forward(queries, keys)
        # pass 3: future tokens -> -inf (masked_fill_, in place)
        attn_scores, mask_cache = ops.causal_mask_forward(attn_scores, mask_bool, inplace=True)
        # pass 4: softmax over the keys; exp(-inf) = 0 hides the future
        attn_weights = ops.softmax(attn_scores, axis=-1)
        # pass 5: dropout on the attention weights (training only)
        dropped, drop_cache = attn_weights, None
        if keep_mask is not None:
            dropped, drop_cache = ops.dropout_forward(attn_weights, keep_mask, self.dropout)
        # pass 6: context_vec = attn_weights @ values               (..., T, D)
        context_vec, sum_cache = ops.weighted_sum_forward(dropped, values)
        caches = dict(scores=scores_cache, mask=mask_cache, attn_weights=attn_weights,
                      drop=drop_cache, sum=sum_cache)
        return context_vec, caches

    def _attend_backward(self, dcontext_vec, c):
        """Passes 6-2 in reverse -> (dqueries, dkeys, dvalues)."""
        # pass 6
        dattn_weights, dvalues = ops.weighted_sum_backward(dcontext_vec, c["sum"])
        # pass 5
        if c["drop"] is not None:
            dattn_weights = ops.dropout_backward(dattn_weights, c["drop"])
        # pass 4: written over dattn_weights, one (..., T, T) array fewer alive
        dattn_scores = ops.softmax_backward(c["attn_weights"], dattn_weights,
                                            out=dattn_weights)
        # pass 3: no gradient flows into a masked (future) score
        dattn_scores = ops.causal_mask_backward(dattn_scores, c["mask"], inplace=True)
        # pass 2
        dqueries, dkeys = ops.scores_backward(dattn_scores, c["scores"])
        return dqueries, dkeys, dvalues


class CausalAttention(_Causal):
    """Single-head attention with a causal mask and dropout on the attention weights.

    ``forward(x, keep_mask=None)``: x (B, T, d_in) -> (B, T, d_out); keep_mask
    (B, T, T) bool replaces the drawn dropout mask in training mode.
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False, *, rng=None):
        super().__init__()
        self._setup(d_in, d_out, context_length, dropout, qkv_bias, rng)
        for layer in ("W_query", "W_key", "W_value"):
            self._add_linear(layer, self.d_in, self.d_out, self.qkv_bias)

    def forward(self, x, keep_mask=None):
        x = check_input(x, 3, self.d_in, self.context_length)         # (B, T, d_in)
        b, num_tokens, _ = x.shape
        keep_mask, guards = self._keep_mask(keep_mask, (b, num_tokens, num_tokens),
                                            "(batch, num_tokens, num_tokens)")
        # pass 1: the three projections, (B, T, d_out) each
        keys, k_cache = self._linear("W_key", x)
        queries, q_cache = self._linear("W_query", x)
        values, v_cache = self._linear("W_value", x)
        # passes 2-6: scores, mask, softmax, dropout, weighted sum
        context_vec, caches = self._attend(queries, keys, values, keep_mask)  # (B, T, d_out)
        self._cache = dict(out_shape=context_vec.shape, dtype=x.dtype, guards=guards,
                           k=k_cache, q=q_cache, v=v_cache, **caches)
        return context_vec

    def backward(self, grad_out):
        dcontext_vec = self._check_grad_out(grad_out)
        c, grads = self._cache, {}
        # passes 6-2
        dqueries, dkeys, dvalues = self._attend_backward(dcontext_vec, c)
        # pass 1: x fed all three projections, its gradient sums the three
        dx = self._linear_backward("W_value", dvalues, c["v"], grads)
        dx += self._linear_backward("W_query", dqueries, c["q"], grads)
        dx += self._linear_backward("W_key", dkeys, c["k"], grads)
        self.grads = self._ordered(grads)
        return dx


class MultiHeadAttentionWrapper(Module):
    """num_heads independent CausalAttention heads, outputs concatenated.

    ``forward(x, keep_mask=None)``: x (B, T, d_in) -> (B, T, num_heads * d_out);
    keep_mask (num_heads, B, T, T), one slice per head in head order.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads,
                 qkv_bias=False, *, rng=None):
        super().__init__()
        self.num_heads = check_size("num_heads", num_heads)
        self.rng = make_rng(rng)
        # the heads share one generator: initialised (and dropped out) in head order
        self.heads = [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias,
                                      rng=self.rng) for _ in range(self.num_heads)]
        self._children = {f"heads.{i}": head for i, head in enumerate(self.heads)}

    def forward(self, x, keep_mask=None):
        head0 = self.heads[0]
        # every check before any head runs: a refusal leaves every head's cache as it was
        # not copied here: each head copies it
        x = check_input(x, 3, head0.d_in, head0.context_length, copy=False)  # (B, T, d_in)
        b, num_tokens, _ = x.shape
        for head in self.heads:
            check_dropout(head.dropout)
        if not self.training or head0.dropout == 0.0:
            keep_mask = None                             # ignored: dropout is the identity
        elif keep_mask is not None:
            keep_mask = check_keep_mask(keep_mask, (self.num_heads, b, num_tokens, num_tokens),
                                        "(num_heads, batch, num_tokens, num_tokens)")
        # pass 1: every head on the same x, (B, T, d_out) each
        head_outputs = [head.forward(x, None if keep_mask is None else keep_mask[i])
                        for i, head in enumerate(self.heads)]
        # pass 2: torch.cat(..., dim=-1)
        context_vec, cat_cache = ops.concat_heads_forward(head_outputs)  # (B, T, H*d_out)
        self._cache = dict(out_shape=context_vec.shape, dtype=x.dtype, cat=cat_cache)
        return context_vec

    def backward(self, grad_out):
        dcontext_vec = self._check_grad_out(grad_out)
        for head in self.heads:             # every head's keep_mask before any head's grads
            head._check_unchanged()
        # pass 2: each head gets its slice of the gradient
        dhead_outputs = ops.concat_heads_backward(dcontext_vec, self._cache["cat"])
        # pass 1: every head saw the same x, so x's gradient sums over heads
        dx = None
        grads = {}
        for i, (head, dhead) in enumerate(zip(self.heads, dhead_outputs)):
            dx_head = head.backward(dhead)
            if dx is None:
                dx = dx_head
            else:
                dx += dx_head
            grads.update({f"heads.{i}.{n}": g for n, g in head.grads.items()})
        self.grads = grads
        return dx


class MultiHeadAttention(_Causal):
    """Heads by weight splitting: one projection of size d_out cut into num_heads
    heads of head_dim = d_out / num_heads, then an output projection (with bias).

    ``forward(x, keep_mask=None)``: x (B, T, d_in) -> (B, T, d_out); keep_mask
    (B, num_heads, T, T) bool replaces the drawn dropout mask in training mode.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads,
                 qkv_bias=False, *, rng=None):
        super().__init__()
        num_heads = check_size("num_heads", num_heads)
        d_out_checked = check_size("d_out", d_out)
        if d_out_checked % num_heads != 0:
            raise ValueError(f"d_out must be divisible by num_heads, "
                             f"got d_out={d_out} and num_heads={num_heads}")
        self._setup(d_in, d_out, context_length, dropout, qkv_bias, rng)
        self.num_heads = num_heads
        self.head_dim = self.d_out // num_heads
        for layer in ("W_query", "W_key", "W_value"):
            self._add_linear(layer, self.d_in, self.d_out, self.qkv_bias)
        self._add_linear("out_proj", self.d_out, self.d_out, True)

    def forward(self, x, keep_mask=None):
        x = check_input(x, 3, self.d_in, self.context_length)         # (B, T, d_in)
        b, num_tokens, _ = x.shape
        keep_mask, guards = self._keep_mask(keep_mask,
                                            (b, self.num_heads, num_tokens, num_tokens),
                                            "(batch, num_heads, num_tokens, num_tokens)")
        # pass 1: one projection each, (B, T, d_out)
        keys, k_cache = self._linear("W_key", x)
        queries, q_cache = self._linear("W_query", x)
        values, v_cache = self._linear("W_value", x)
        # pass 1b: .view(b, T, H, D).transpose(1, 2) -> (B, H, T, D)
        keys, _ = ops.split_heads_forward(keys, self.num_heads)
        queries, _ = ops.split_heads_forward(queries, self.num_heads)
        values, _ = ops.split_heads_forward(values, self.num_heads)
        # passes 2-6, every head at once; d_k = head_dim     -> (B, H, T, D)
        context_vec, caches = self._attend(queries, keys, values, keep_mask)
        # pass 7: .transpose(1, 2).contiguous().view(b, T, d_out)
        context_vec, merge_cache = ops.merge_heads_forward(context_vec)  # (B, T, d_out)
        # pass 8: out_proj
        context_vec, out_cache = self._linear("out_proj", context_vec)   # (B, T, d_out)
        self._cache = dict(out_shape=context_vec.shape, dtype=x.dtype, guards=guards, k=k_cache,
                           q=q_cache, v=v_cache, merge=merge_cache, out=out_cache, **caches)
        return context_vec

    def backward(self, grad_out):
        dcontext_vec = self._check_grad_out(grad_out)
        c, grads = self._cache, {}
        # pass 8
        dcontext_vec = self._linear_backward("out_proj", dcontext_vec, c["out"], grads)
        # pass 7: (B, T, d_out) -> (B, H, T, D)
        dcontext_vec = ops.merge_heads_backward(dcontext_vec, c["merge"])
        # passes 6-2
        dqueries, dkeys, dvalues = self._attend_backward(dcontext_vec, c)
        # pass 1b: (B, H, T, D) -> (B, T, d_out)
        dqueries = ops.split_heads_backward(dqueries, self.num_heads)
        dkeys = ops.split_heads_backward(dkeys, self.num_heads)
        dvalues = ops.split_heads_backward(dvalues, self.num_heads)
        # pass 1: x fed all three projections, its gradient sums the three
        dx = self._linear_backward("W_value", dvalues, c["v"], grads)
        dx += self._linear_backward("W_query", dqueries, c["q"], grads)
        dx += self._linear_backward("W_key", dkeys, c["k"], grads)
        self.grads = self._ordered(grads)
        return dx
