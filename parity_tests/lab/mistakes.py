"""The catalogue of classic backprop mistakes, and which one explains a wrong answer.

Each mistake is computed, not guessed: for the function exercises a formula with
the slip in it; for the module exercises ``numpy_ref``'s own module run with one
op swapped for a slipped one (the suite's planted faults, `common.faults`, and
more).  `diagnose` compares the learner's tensors with every mistake's and ranks
the mistakes by residual: the largest relative difference over every tensor
(infinite where a shape differs).  A residual at rounding level means the
learner's code computes exactly what that mistake computes.

``breaks`` is the line of the derivation the mistake contradicts: the chapter's
own (its softmax Jacobian) or the step of ``numpy_ref.ops`` that derives it.
"""

from dataclasses import dataclass

import numpy as np


MATCH_BOUND = 1e-8      # a residual below this: the learner's result *is* this mistake

SOFTMAX_LINE = ("chapter, softmax Jacobian: ∂w_i/∂x_j = w_i (δ_ij − w_j), so "
                "dL/dx_j = Σ_i g_i w_i (δ_ij − w_j) = w_j (g_j − ⟨w, g⟩)")


@dataclass(frozen=True)
class Mistake:
    name: str
    title: str
    breaks: str
    compute: object = None      # function exercises: compute(*inputs) -> tuple of arrays
    fault: str = None           # module exercises: a planted fault of common.faults ...
    swaps: object = None        # ... or swaps(module) -> [(target, attribute, replacement)]
    only: tuple = ()            # module exercises it applies to (empty: all)


def _wg(w, g, axis=-1):
    return np.sum(w * g, axis=axis, keepdims=True)


SOFTMAX = [
    Mistake("softmax-no-sum", "the −w⟨w, g⟩ term dropped (dx = w ⊙ g: J taken as diag(w))",
            "chapter, case i ≠ j: ∂w_i/∂x_j = −w_i w_j, not 0 (every weight depends on "
            "every score through Z)", compute=lambda w, g: (w * g,)),
    Mistake("softmax-diagonal-only", "only the Jacobian's diagonal used: dx = w(1 − w) ⊙ g",
            "chapter: the two cases unite as ∂w_i/∂x_j = w_i (δ_ij − w_j); the i ≠ j "
            "entries −w_i w_j are part of dL/dx_j = Σ_i g_i J_ij",
            compute=lambda w, g: (w * (1 - w) * g,)),
    Mistake("softmax-sum-wrong-axis", "⟨w, g⟩ summed down the columns instead of along each row",
            "dL/dx_j = Σ_i g_i w_i (δ_ij − w_j): i runs over the weights of the same softmax "
            "row (the axis the softmax normalised)",
            compute=lambda w, g: (w * (g - _wg(w, g, axis=-2)),)),
    Mistake("softmax-sign-flipped", "the −w⟨w, g⟩ term added instead of subtracted",
            "chapter, case i ≠ j: ∂w_i/∂x_j = (0·Z − e^{x_i} e^{x_j}) / Z² = −w_i w_j",
            compute=lambda w, g: (w * (g + _wg(w, g)),)),
    Mistake("softmax-missing-w", "the leading w_j factor forgotten: dx = g − ⟨w, g⟩",
            SOFTMAX_LINE, compute=lambda w, g: (g - _wg(w, g),)),
]

SCORES_LINE = ("numpy_ref.ops.scores_backward: ω_ij = Σ_d q_id k_jd / √d_k, so "
                "dQ = dω K / √d_k and dK = dωᵀ Q / √d_k")


def _scores(ds, q, k, scale, transpose=True):
    dsT = np.swapaxes(ds, -1, -2) if transpose else ds
    return ds @ k * scale, dsT @ q * scale


SCORES = [
    Mistake("scores-backward-unscaled", "1/√d_k missing in the backward",
            "the forward divides by √d_k (the chapter's scaled dot-product), so its "
            "backward does too: " + SCORES_LINE,
            compute=lambda ds, q, k: _scores(ds, q, k, 1.0)),
    Mistake("scores-divided-by-d_k", "divided by d_k instead of √d_k", SCORES_LINE,
            compute=lambda ds, q, k: _scores(ds, q, k, 1.0 / k.shape[-1])),
    Mistake("scores-multiplied-by-sqrt-d_k", "multiplied by √d_k instead of divided", SCORES_LINE,
            compute=lambda ds, q, k: _scores(ds, q, k, k.shape[-1] ** 0.5)),
    Mistake("scores-dkeys-not-transposed", "dK = dω Q: the transpose of dω forgotten",
            "numpy_ref.ops.scores_backward: dk_jd = Σ_i dω_ij q_id / √d_k  ->  dK = dωᵀ Q / √d_k",
            compute=lambda ds, q, k: _scores(ds, q, k, k.shape[-1] ** -0.5, transpose=False)),
    Mistake("scores-dq-dk-swapped", "dqueries and dkeys returned in each other's place",
            SCORES_LINE, compute=lambda ds, q, k: _scores(ds, q, k, k.shape[-1] ** -0.5)[::-1]),
]

LINEAR_LINE = ("numpy_ref.ops.linear_backward: out[n, o] = Σ_i x[n, i] W[o, i] + b[o], so "
                "dW = doutᵀ x and db = Σ_n dout, n over every (batch, token) row")


def _rows(a):
    return a.reshape(-1, a.shape[-1])


def _linear(dout, x, W, b, dx=None, dW=None, db=None):
    ref = (dout @ W, _rows(dout).T @ _rows(x), _rows(dout).sum(axis=0))
    return tuple(r if v is None else v for r, v in zip(ref, (dx, dW, db)))


LINEAR = [
    Mistake("weight-grad-transposed", "the weight gradient transposed: xᵀ dout, (d_in, d_out)",
            "nn.Linear stores W as (d_out, d_in): dW[o, i] = Σ_n dout[n, o] x[n, i], "
            "i.e. dW = doutᵀ x",
            compute=lambda dout, x, W, b: _linear(dout, x, W, b, dW=_rows(x).T @ _rows(dout))),
    Mistake("weight-grad-transposed-reshaped",
            "the weight gradient transposed, then reshaped into W's (d_out, d_in) shape",
            "dW[o, i] = Σ_n dout[n, o] x[n, i]: a reshape moves numbers, it does not transpose",
            compute=lambda dout, x, W, b: _linear(
                dout, x, W, b, dW=(_rows(x).T @ _rows(dout)).reshape(W.shape))),
    Mistake("weight-grad-first-sequence", "the weight gradient from the first sequence only",
            LINEAR_LINE, compute=lambda dout, x, W, b: _linear(dout, x, W, b, dW=dout[0].T @ x[0])),
    Mistake("bias-not-summed-over-batch", "the bias gradient not summed over the batch: (B, d_out)",
            LINEAR_LINE, compute=lambda dout, x, W, b: _linear(dout, x, W, b, db=dout.sum(axis=1))),
    Mistake("bias-first-sequence", "the bias gradient summed over the first sequence only",
            LINEAR_LINE, compute=lambda dout, x, W, b: _linear(dout, x, W, b, db=dout[0].sum(axis=0))),
    Mistake("bias-summed-wrong-axis", "the bias gradient summed over the features, not the rows",
            LINEAR_LINE, compute=lambda dout, x, W, b: _linear(dout, x, W, b, db=dout.sum(axis=-1))),
    Mistake("bias-summed-over-batch-only", "the bias gradient summed over the batch, not the tokens",
            LINEAR_LINE, compute=lambda dout, x, W, b: _linear(dout, x, W, b, db=dout.sum(axis=0))),
    Mistake("linear-backward-sign", "the input gradient with the wrong sign",
            "numpy_ref.ops.linear_backward: dx[n, i] = Σ_o dout[n, o] W[o, i], dx = dout W",
            compute=lambda dout, x, W, b: _linear(dout, x, W, b, dx=-(dout @ W))),
]

SOFTCAP_LINE = ("capped = c · tanh(S / c), so dS_raw = dS ∘ c · (1 − tanh²(S / c)) · (1 / c) "
                "= dS ∘ (1 − tanh²(S / c))")

SOFTCAP = [
    Mistake("softcap-tanh-derivative-left-out", "the softcap's 1 − tanh² left out: dS_raw = dS",
            SOFTCAP_LINE, compute=lambda dS, S, c: (dS.copy(),)),
    Mistake("softcap-outer-c-kept", "the outer c kept, the inner 1/c forgotten: "
            "dS ∘ c (1 − tanh²)", SOFTCAP_LINE,
            compute=lambda dS, S, c: (dS * c * (1 - np.tanh(S / c) ** 2),)),
    Mistake("softcap-tanh-not-squared", "1 − tanh instead of 1 − tanh²", SOFTCAP_LINE,
            compute=lambda dS, S, c: (dS * (1 - np.tanh(S / c)),)),
]

SINK_LINE = ("the sink is a softmax column whose value is 0: dL/ds = Σ_i p_sink,i "
             "(0 − ⟨P_i, dP_i⟩) = −Σ_i p_sink,i D_i, D_i = rowsum(dO ∘ O)")


def _D(dO, O):
    return np.sum(dO * O, axis=-1)


SINK = [
    Mistake("sink-gradient-sign-flipped", "the sink's gradient with the wrong sign: +Σ p_sink D",
            SINK_LINE, compute=lambda dO, O, p: (np.sum(p * _D(dO, O), axis=-1),)),
    Mistake("sink-D-without-output", "D taken as rowsum(dO), without the output O",
            SINK_LINE, compute=lambda dO, O, p: (-np.sum(p * dO.sum(axis=-1), axis=-1),)),
    Mistake("sink-not-weighted", "the rows' D summed without their sink weight p_sink",
            SINK_LINE, compute=lambda dO, O, p: (-np.sum(_D(dO, O), axis=-1),)),
]

ONLINE_LINE = ("when the maximum moves from m to m_new every term summed so far shrinks by "
               "α = exp(m − m_new): ℓ ← α ℓ + Σ exp(s_t − m_new), o ← α o + exp(s_t − m_new) V_t, "
               "and log Σ exp(s) = m + log ℓ")


def _online(s, V, B_c, alpha_l=True, alpha_o=True, with_m=True):
    """The online softmax with one of its steps left out (or none)."""
    m, l, o = -np.inf, 0.0, np.zeros(V.shape[-1])
    for start in range(0, len(s), B_c):
        s_t, V_t = s[start:start + B_c], V[start:start + B_c]
        m_new = max(m, np.max(s_t))
        alpha = np.exp(m - m_new)
        p = np.exp(s_t - m_new)
        l = (alpha if alpha_l else 1.0) * l + np.sum(p)
        o = (alpha if alpha_o else 1.0) * o + p @ V_t
        m = m_new
    return o / l, np.array((m if with_m else 0.0) + np.log(l))


ONLINE = [
    Mistake("online-max-not-rescaled", "the running maximum moved, the sums not rescaled "
            "(no α at all)", ONLINE_LINE,
            compute=lambda s, V, B_c: _online(s, V, B_c, alpha_l=False, alpha_o=False)),
    Mistake("online-alpha-on-l-only", "α applied to ℓ but not to the output", ONLINE_LINE,
            compute=lambda s, V, B_c: _online(s, V, B_c, alpha_o=False)),
    Mistake("online-alpha-on-o-only", "α applied to the output but not to ℓ", ONLINE_LINE,
            compute=lambda s, V, B_c: _online(s, V, B_c, alpha_l=False)),
    Mistake("lse-without-max", "L = log ℓ, without m", ONLINE_LINE,
            compute=lambda s, V, B_c: _online(s, V, B_c, with_m=False)),
]

TILE_LINE = ("P = exp(S − L) is the whole row's softmax, and ⟨P_i, dP_i⟩ over the whole row is "
             "D_i = rowsum(dO ∘ O): dS = P ∘ (dP − D), dq = dS k/√d, dk = dSᵀ q/√d, dv = Pᵀ dO")


def _tile(q, k, v, dO, L, D, weights=None, delta=None):
    S = q @ k.T / np.sqrt(q.shape[-1])
    P = np.exp(S - L[:, None]) if weights is None else weights(S)
    dP = dO @ v.T
    Dv = D if delta is None else delta(P, dP)
    dS = P * (dP - Dv[:, None])
    d = np.sqrt(q.shape[-1])
    return dS @ k / d, dS.T @ q / d, P.T @ dO


TILE = [
    Mistake("tile-D-from-P", "D taken from P and dP of this tile, not from the output",
            TILE_LINE, compute=lambda q, k, v, dO, L, D: _tile(
                q, k, v, dO, L, D, delta=lambda P, dP: np.sum(P * dP, axis=-1))),
    Mistake("tile-P-renormalised", "P normalised over the tile instead of exp(S − L)",
            TILE_LINE, compute=lambda q, k, v, dO, L, D: _tile(
                q, k, v, dO, L, D, weights=lambda S: np.exp(S) / np.exp(S).sum(-1, keepdims=True))),
    Mistake("tile-dS-without-D", "dS = P ∘ dP: the −D term dropped", TILE_LINE,
            compute=lambda q, k, v, dO, L, D: _tile(q, k, v, dO, L, 0 * D)),
]

GQA_LINE = ("kv head j serves every query head h with h // G = j: dk_j = Σ_h dS_hᵀ q_h / √d "
            "and dv_j = Σ_h P_hᵀ dO_h over those G heads")


def _gqa(dS, P, dO, q, group=lambda a: a.reshape(2, 2, *a.shape[1:]).sum(axis=1),
         dk_group=None):
    dk_heads = np.swapaxes(dS, -1, -2) @ q / np.sqrt(q.shape[-1])
    dv_heads = np.swapaxes(P, -1, -2) @ dO
    return (dk_group or group)(dk_heads), group(dv_heads)


GQA = [
    Mistake("gqa-dk-from-one-query-head", "GQA's dk taken from one query head of each group",
            GQA_LINE, compute=lambda dS, P, dO, q: _gqa(dS, P, dO, q, dk_group=lambda a: a[::2])),
    Mistake("gqa-heads-interleaved", "query head h given kv head h % H_kv instead of h // G",
            GQA_LINE, compute=lambda dS, P, dO, q: _gqa(
                dS, P, dO, q, group=lambda a: a.reshape(2, 2, *a.shape[1:]).sum(axis=0))),
    Mistake("gqa-group-averaged", "the group's terms averaged instead of summed", GQA_LINE,
            compute=lambda dS, P, dO, q: _gqa(
                dS, P, dO, q, group=lambda a: a.reshape(2, 2, *a.shape[1:]).mean(axis=1))),
]

FUNCTION_MISTAKES = {"softmax_backward": SOFTMAX, "scores_backward": SCORES,
                     "linear_backward": LINEAR, "online_softmax": ONLINE,
                     "tile_backward": TILE, "softcap_backward": SOFTCAP,
                     "sink_gradient": SINK, "gqa_backward": GQA}
