"""Exercise: CausalAttention's backward pass, the whole module.

The forward is written for you: the chapter's CausalAttention in NumPy, keeping in
self.cache what the backward needs.  Write backward(dout): return dL/dx and fill
self.grads with the gradient of every weight (same names and shapes as self.params,
as PyTorch's named_parameters() would).  The grader runs it with dropout and biases
on, a batch of two sequences, the chapter's input.

Check it:   attention-parity grade causal_attention.py
"""

import numpy as np


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class CausalAttention:
    """The chapter's CausalAttention in NumPy: forward(x, keep_mask), backward(dout).

    x: (B, T, d_in) -> context_vec (B, T, d_out).  Weights in nn.Linear's layout,
    named as in PyTorch: "W_query.weight" (d_out, d_in), "W_query.bias" (d_out,) ...
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        self.dropout = dropout
        self.params = {}
        for name in ("W_query", "W_key", "W_value"):
            self.params[name + ".weight"] = np.zeros((d_out, d_in))
            if qkv_bias:
                self.params[name + ".bias"] = np.zeros(d_out)
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

    def forward(self, x, keep_mask=None):
        """x: (B, T, d_in); keep_mask: (B, T, T) bool, True = kept by dropout."""
        T = x.shape[1]
        queries = self._linear("W_query", x)                  # (B, T, d_out)
        keys = self._linear("W_key", x)
        values = self._linear("W_value", x)
        d_k = keys.shape[-1]
        attn_scores = queries @ keys.transpose(0, 2, 1)       # (B, T, T)
        masked = np.where(self.mask[:T, :T], -np.inf, attn_scores)
        attn_weights = softmax(masked / np.sqrt(d_k))
        dropped = attn_weights
        if keep_mask is not None and self.dropout > 0:
            dropped = attn_weights * keep_mask / (1 - self.dropout)
        context_vec = dropped @ values                        # (B, T, d_out)
        self.cache = dict(x=x, queries=queries, keys=keys, values=values,
                          attn_weights=attn_weights, dropped=dropped,
                          keep_mask=keep_mask if self.dropout > 0 else None)
        return context_vec

    def backward(self, dout):
        """dout = dL/dcontext_vec, (B, T, d_out).  Returns dL/dx; fills self.grads
        with one gradient per name of self.params, same shape.

        Hint, the derivation's first line: walk the forward's passes in reverse,
        pass 6 first:  context_vec = dropped @ values,  so
            dL/ddropped = dout @ valuesᵀ   and   dL/dvalues = droppedᵀ @ dout
        """
        c = self.cache
        x, queries, keys, values = c["x"], c["queries"], c["keys"], c["values"]
        attn_weights, dropped, keep_mask = c["attn_weights"], c["dropped"], c["keep_mask"]
        # pass 6: context_vec = dropped @ values
        # pass 5: dropout (keep_mask is None when there was none)
        # pass 4: softmax (the chapter's Jacobian: J = diag(w) - w wᵀ)
        # pass 3: the causal mask (self.mask, True where a score was set to -inf)
        # pass 2: attn_scores = queries @ keys.T, divided by sqrt(d_k)
        # pass 1: the three projections (self.grads["W_query.weight"] ...), and dx
        raise NotImplementedError("CausalAttention.backward: fill in the body")
