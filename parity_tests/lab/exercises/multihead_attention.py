"""Exercise: MultiHeadAttention's backward pass, heads, out_proj and all.

The forward is written for you: the chapter's MultiHeadAttention in NumPy, keeping in
self.cache what the backward needs.  Write backward(dout): return dL/dx and fill
self.grads with the gradient of every weight (same names and shapes as self.params).
The grader runs it with d_out = 4, two heads of head_dim 2, dropout and biases on,
a batch of two sequences, the chapter's input.

Check it:   attention-parity grade multihead_attention.py
"""

import numpy as np


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class MultiHeadAttention:
    """The chapter's MultiHeadAttention in NumPy, with out_proj (bias included).

    x: (B, T, d_in) -> (B, T, d_out).  One projection of width d_out split into
    num_heads heads of head_dim = d_out // num_heads.  Weights in nn.Linear's layout.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        self.dropout = dropout
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.params = {}
        for name in ("W_query", "W_key", "W_value"):
            self.params[name + ".weight"] = np.zeros((d_out, d_in))
            if qkv_bias:
                self.params[name + ".bias"] = np.zeros(d_out)
        self.params["out_proj.weight"] = np.zeros((d_out, d_out))
        self.params["out_proj.bias"] = np.zeros(d_out)
        ones = np.ones((context_length, context_length))
        self.mask = np.triu(ones, k=1).astype(bool)       # True above the diagonal
        self.grads = {}

    def load_state_dict(self, state_dict):
        for name in self.params:
            self.params[name] = np.array(state_dict[name], dtype=np.float64)

    def _linear(self, name, x):
        out = x @ self.params[name + ".weight"].T
        if name + ".bias" in self.params:
            out = out + self.params[name + ".bias"]
        return out

    def _split(self, a):
        B, T, d_out = a.shape                                  # (B, T, H*D) -> (B, H, T, D)
        return a.reshape(B, T, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def forward(self, x, keep_mask=None):
        """x: (B, T, d_in); keep_mask: (B, H, T, T) bool, True = kept by dropout."""
        B, T, _ = x.shape
        queries = self._split(self._linear("W_query", x))     # (B, H, T, D)
        keys = self._split(self._linear("W_key", x))
        values = self._split(self._linear("W_value", x))
        attn_scores = queries @ keys.transpose(0, 1, 3, 2)    # (B, H, T, T)
        masked = np.where(self.mask[:T, :T], -np.inf, attn_scores)
        attn_weights = softmax(masked / np.sqrt(self.head_dim))
        dropped = attn_weights
        if keep_mask is not None and self.dropout > 0:
            dropped = attn_weights * keep_mask / (1 - self.dropout)
        context = dropped @ values                            # (B, H, T, D)
        merged = context.transpose(0, 2, 1, 3).reshape(B, T, -1)   # (B, T, H*D)
        out = self._linear("out_proj", merged)
        self.cache = dict(x=x, queries=queries, keys=keys, values=values,
                          attn_weights=attn_weights, dropped=dropped, merged=merged,
                          keep_mask=keep_mask if self.dropout > 0 else None)
        return out

    def backward(self, dout):
        """dout = dL/d output, (B, T, d_out).  Returns dL/dx; fills self.grads with
        one gradient per name of self.params, same shape.

        Hint, the derivation's first line: walk the forward's passes in reverse,
        pass 8 first:  out = merged @ W_oᵀ + b_o,  so  dL/dmerged = dout @ W_o
        """
        c = self.cache
        x, queries, keys, values = c["x"], c["queries"], c["keys"], c["values"]
        attn_weights, dropped, keep_mask = c["attn_weights"], c["dropped"], c["keep_mask"]
        # pass 8: out_proj
        # pass 7: un-merge the heads: (B, T, H*D) -> (B, H, T, D)
        # pass 6: context = dropped @ values
        # pass 5: dropout (keep_mask is None when there was none)
        # pass 4: softmax (the chapter's Jacobian: J = diag(w) - w wᵀ)
        # pass 3: the causal mask (self.mask, True where a score was set to -inf)
        # pass 2: attn_scores = queries @ keys.T, divided by sqrt(head_dim)
        # pass 1b: un-split the heads: (B, H, T, D) -> (B, T, H*D)
        # pass 1: the three projections (self.grads["W_query.weight"] ...), and dx
        raise NotImplementedError("MultiHeadAttention.backward: fill in the body")
