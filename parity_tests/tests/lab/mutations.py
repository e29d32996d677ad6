"""Each catalogued mistake written into a copy of an exercise's solution: the edits
a learner would make.  ``MUTATIONS[exercise][mistake] = [(old, new), ...]``, each
``old`` found exactly once in the solution (or ``count`` times: the third item)."""

_SQRT = " / np.sqrt(d_k)"

SOFTMAX = {
    "softmax-no-sum": [("dx = w * (g - wg)", "dx = w * g")],
    "softmax-diagonal-only": [("dx = w * (g - wg)", "dx = w * (1 - w) * g")],
    "softmax-sum-wrong-axis": [("axis=-1, keepdims", "axis=-2, keepdims")],
    "softmax-sign-flipped": [("dx = w * (g - wg)", "dx = w * (g + wg)")],
    "softmax-missing-w": [("dx = w * (g - wg)", "dx = g - wg")],
}

SCORES = {
    "scores-backward-unscaled": [(_SQRT, "", 2)],
    "scores-divided-by-d_k": [(_SQRT, " / d_k", 2)],
    "scores-multiplied-by-sqrt-d_k": [(_SQRT, " * np.sqrt(d_k)", 2)],
    "scores-dkeys-not-transposed": [("np.swapaxes(dscores, -1, -2) @ queries", "dscores @ queries")],
    "scores-dq-dk-swapped": [("return dqueries, dkeys", "return dkeys, dqueries")],
}

LINEAR = {
    "weight-grad-transposed": [("dW = dout2.T @ x2", "dW = x2.T @ dout2")],
    "weight-grad-transposed-reshaped": [("dW = dout2.T @ x2", "dW = (x2.T @ dout2).reshape(W.shape)")],
    "weight-grad-first-sequence": [("dW = dout2.T @ x2", "dW = dout[0].T @ x[0]")],
    "bias-not-summed-over-batch": [("dout.sum(axis=(0, 1))", "dout.sum(axis=1)")],
    "bias-first-sequence": [("dout.sum(axis=(0, 1))", "dout[0].sum(axis=0)")],
    "bias-summed-wrong-axis": [("dout.sum(axis=(0, 1))", "dout.sum(axis=-1)")],
    "bias-summed-over-batch-only": [("dout.sum(axis=(0, 1))", "dout.sum(axis=0)")],
    "linear-backward-sign": [("dx = dout @ W", "dx = -(dout @ W)")],
}

_MODULE = {
    "softmax-no-sum": [("dscaled = attn_weights * (dattn_weights - wg)",
                        "dscaled = attn_weights * dattn_weights")],
    "softmax-diagonal-only": [("dscaled = attn_weights * (dattn_weights - wg)",
                               "dscaled = attn_weights * (1 - attn_weights) * dattn_weights")],
    "mask-one-diagonal-high": [("self.mask = np.triu(ones, k=1)", "self.mask = np.triu(ones, k=2)")],
    "mask-one-diagonal-low": [("np.where(self.mask[:T, :T], 0.0, dscaled)",
                               "np.where(np.triu(np.ones((T, T)), k=0) > 0, 0.0, dscaled)")],
    "dropout-backward-not-rescaled": [("dattn_weights = ddropped * keep_mask / (1 - self.dropout)",
                                       "dattn_weights = ddropped * keep_mask")],
    "dropout-not-rescaled": [("dattn_weights = ddropped * keep_mask / (1 - self.dropout)",
                              "dattn_weights = ddropped * keep_mask"),
                             ("dropped = attn_weights * keep_mask / (1 - self.dropout)",
                              "dropped = attn_weights * keep_mask")],
    "weight-grad-transposed": [("= dout2.T @ x2", "= x2.T @ dout2")],
    "weight-grad-transposed-reshaped": [("= dout2.T @ x2", "= (x2.T @ dout2).reshape(W.shape)")],
    "bias-not-summed-over-batch": [("dout.sum(axis=(0, 1))", "dout.sum(axis=1)")],
    "bias-first-sequence": [("dout.sum(axis=(0, 1))", "dout[0].sum(axis=0)")],
    "linear-backward-sign": [("return dout @ W", "return -(dout @ W)")],
    "dx-missing-query-road": [("dx = dx_q + dx_k + dx_v", "dx = dx_k + dx_v")],
    "dx-missing-key-road": [("dx = dx_q + dx_k + dx_v", "dx = dx_q + dx_v")],
    "dx-missing-value-road": [("dx = dx_q + dx_k + dx_v", "dx = dx_q + dx_k")],
}

CAUSAL = dict(_MODULE)
CAUSAL.update({
    "scores-backward-unscaled": [("dscores = dscaled / np.sqrt(d_k)", "dscores = dscaled")],
    "weighted-sum-no-transpose": [("dvalues = dropped.transpose(0, 2, 1) @ dout",
                                   "dvalues = dropped @ dout")],
})

MULTIHEAD = dict(_MODULE)
MULTIHEAD.update({
    "scores-backward-unscaled": [("dscores = dscaled / np.sqrt(self.head_dim)",
                                  "dscores = dscaled")],
    "weighted-sum-no-transpose": [("dvalues = dropped.transpose(0, 1, 3, 2) @ dcontext",
                                   "dvalues = dropped @ dcontext")],
    "heads-merged-wrong-order": [
        ("merged = context.transpose(0, 2, 1, 3).reshape(B, T, -1)",
         "merged = context.transpose(0, 2, 3, 1).reshape(B, T, -1)"),
        ("dmerged.reshape(B, T, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)",
         "dmerged.reshape(B, T, self.head_dim, self.num_heads).transpose(0, 3, 1, 2)")],
    "heads-unmerged-wrong-order": [
        ("dmerged.reshape(B, T, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)",
         "dmerged.reshape(B, T, self.head_dim, self.num_heads).transpose(0, 3, 1, 2)")],
})

ONLINE = {
    "online-max-not-rescaled": [("l = alpha * l + np.sum(p)", "l = l + np.sum(p)"),
                                ("o = alpha * o + p @ V_t", "o = o + p @ V_t")],
    "online-alpha-on-l-only": [("o = alpha * o + p @ V_t", "o = o + p @ V_t")],
    "online-alpha-on-o-only": [("l = alpha * l + np.sum(p)", "l = l + np.sum(p)")],
    "lse-without-max": [("L = m + np.log(l)", "L = np.log(l)")],
}

TILE = {
    "tile-D-from-P": [("dS = P * (dP - D[:, None])",
                       "dS = P * (dP - np.sum(P * dP, axis=-1)[:, None])")],
    "tile-P-renormalised": [("P = np.exp(S - L[:, None])",
                             "P = np.exp(S) / np.exp(S).sum(axis=-1, keepdims=True)")],
    "tile-dS-without-D": [("dS = P * (dP - D[:, None])", "dS = P * dP")],
}

SOFTCAP = {
    "softcap-tanh-derivative-left-out": [("dS_raw = dS * (1 - t**2)", "dS_raw = dS")],
    "softcap-outer-c-kept": [("dS_raw = dS * (1 - t**2)", "dS_raw = dS * cap * (1 - t**2)")],
    "softcap-tanh-not-squared": [("dS_raw = dS * (1 - t**2)", "dS_raw = dS * (1 - t)")],
}

SINK = {
    "sink-gradient-sign-flipped": [("dsink = -np.sum(", "dsink = np.sum(")],
    "sink-D-without-output": [("D = np.sum(dO * O, axis=-1)", "D = np.sum(dO, axis=-1)")],
    "sink-not-weighted": [("dsink = -np.sum(p_sink * D, axis=-1)", "dsink = -np.sum(D, axis=-1)")],
}

GQA = {
    "gqa-dk-from-one-query-head": [("dk = dk_heads.reshape(H_q // G, G, Tk, d).sum(axis=1)",
                                    "dk = dk_heads[::G]")],
    "gqa-heads-interleaved": [(".reshape(H_q // G, G, Tk, d).sum(axis=1)",
                               ".reshape(G, H_q // G, Tk, d).sum(axis=0)", 2)],
    "gqa-group-averaged": [(".reshape(H_q // G, G, Tk, d).sum(axis=1)",
                            ".reshape(H_q // G, G, Tk, d).mean(axis=1)", 2)],
}

MUTATIONS = {"softmax_backward": SOFTMAX, "scores_backward": SCORES,
             "linear_backward": LINEAR, "online_softmax": ONLINE,
             "tile_backward": TILE, "softcap_backward": SOFTCAP, "sink_gradient": SINK,
             "gqa_backward": GQA,
             "causal_attention": CAUSAL, "multihead_attention": MULTIHEAD}


def mutate(source, edits):
    """``source`` with every edit applied; each ``old`` must occur as often as stated."""
    for edit in edits:
        old, new, count = (edit + (1,))[:3]
        found = source.count(old)
        if found != count:
            raise AssertionError(f"{old!r} occurs {found} times in the solution, expected {count}")
        source = source.replace(old, new)
    return source
