"""Solution: CausalAttention with a hand-written backward, numpy_ref's interface."""

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
        """dout = dL/dcontext_vec, (B, T, d_out).  Returns dL/dx; fills self.grads."""
        c = self.cache
        x, queries, keys, values = c["x"], c["queries"], c["keys"], c["values"]
        attn_weights, dropped, keep_mask = c["attn_weights"], c["dropped"], c["keep_mask"]
        d_k = keys.shape[-1]
        # pass 6: context_vec = dropped @ values
        ddropped = dout @ values.transpose(0, 2, 1)           # (B, T, T)
        dvalues = dropped.transpose(0, 2, 1) @ dout           # (B, T, d_out)
        # pass 5: dropout, the same mask and the same scale as the forward
        dattn_weights = ddropped
        if keep_mask is not None:
            dattn_weights = ddropped * keep_mask / (1 - self.dropout)
        # pass 4: softmax, dL/da_j = w_j (g_j - <w, g>) row by row
        wg = np.sum(attn_weights * dattn_weights, axis=-1, keepdims=True)
        dscaled = attn_weights * (dattn_weights - wg)
        # pass 3: no gradient into a masked score
        T = x.shape[1]
        dscaled = np.where(self.mask[:T, :T], 0.0, dscaled)
        # pass 2: attn_scores = queries @ keys.T, then divided by sqrt(d_k)
        dscores = dscaled / np.sqrt(d_k)
        dqueries = dscores @ keys                             # (B, T, d_out)
        dkeys = dscores.transpose(0, 2, 1) @ queries
        # pass 1: the three projections; x took three roads, its gradient sums them
        self.grads = {}
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
