"""Solution: MultiHeadAttention with a hand-written backward, numpy_ref's interface."""

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
        """dout = dL/d output, (B, T, d_out).  Returns dL/dx; fills self.grads."""
        c = self.cache
        x, queries, keys, values = c["x"], c["queries"], c["keys"], c["values"]
        attn_weights, dropped, keep_mask = c["attn_weights"], c["dropped"], c["keep_mask"]
        B, T, _ = x.shape
        self.grads = {}
        # pass 8: out = merged @ W_o.T + b_o
        dmerged = self._linear_backward("out_proj", dout, c["merged"])
        # pass 7: un-merge (B, T, H*D) -> (B, T, H, D) -> (B, H, T, D)
        dcontext = dmerged.reshape(B, T, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        # pass 6: context = dropped @ values
        ddropped = dcontext @ values.transpose(0, 1, 3, 2)     # (B, H, T, T)
        dvalues = dropped.transpose(0, 1, 3, 2) @ dcontext     # (B, H, T, D)
        # pass 5: dropout
        dattn_weights = ddropped
        if keep_mask is not None:
            dattn_weights = ddropped * keep_mask / (1 - self.dropout)
        # pass 4: softmax
        wg = np.sum(attn_weights * dattn_weights, axis=-1, keepdims=True)
        dscaled = attn_weights * (dattn_weights - wg)
        # pass 3: no gradient into a masked score
        dscaled = np.where(self.mask[:T, :T], 0.0, dscaled)
        # pass 2: scores divided by sqrt(head_dim)
        dscores = dscaled / np.sqrt(self.head_dim)
        dqueries = dscores @ keys                              # (B, H, T, D)
        dkeys = dscores.transpose(0, 1, 3, 2) @ queries
        # pass 1b: un-split (B, H, T, D) -> (B, T, H*D)
        dqueries = dqueries.transpose(0, 2, 1, 3).reshape(B, T, -1)
        dkeys = dkeys.transpose(0, 2, 1, 3).reshape(B, T, -1)
        dvalues = dvalues.transpose(0, 2, 1, 3).reshape(B, T, -1)
        # pass 1: the three projections; x took three roads
        dx_q = self._linear_backward("W_query", dqueries, x)
        dx_k = self._linear_backward("W_key", dkeys, x)
        dx_v = self._linear_backward("W_value", dvalues, x)
        dx = dx_q + dx_k + dx_v
        return dx

    def _linear_backward(self, name, dout, x):
        W = self.params[name + ".weight"]
        dout2 = dout.reshape(-1, dout.shape[-1])              # (B*T, d_out)
        x2 = x.reshape(-1, x.shape[-1])                       # (B*T, d_in)
        self.grads[name + ".weight"] = dout2.T @ x2
        if name + ".bias" in self.params:
            self.grads[name + ".bias"] = dout.sum(axis=(0, 1))
        return dout @ W
