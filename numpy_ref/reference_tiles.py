"""The tile loop of ``numpy_ref.reference_attention``, for a range of query rows
of one (batch, query head).

For a tile of queries [q0, q1) (``B_r`` rows):

1. `Visibility.key_range` gives the keys some query of the tile may see; only
   those are visited, ``B_c`` at a time (a window of W keys costs about
   ``(W + B_r) / T`` of the full work).
2. `_tile_scores`: ``S = (scale · q) kᵀ``, then the head's list of score ops
   (``variants.score_ops``: softcap, ALiBi, bias, in that order, like
   FlexAttention's ``score_mod``; ``variants.scores_forward``), then ``-inf``
   where `Visibility.tile_mask` says a key is unseen (no mask at all for a
   tile seen whole).
3. The online softmax of ``numpy_ref.blockwise`` (`_online_softmax`), its
   running state started with the sink (`sink_forward`): ``m``, ``ℓ``,
   ``acc``; then ``out = acc / ℓ`` and ``L = m + log ℓ`` (`_finish`).

With a backward (`attention_rows`), the tile of queries keeps each key tile's
``P̃ = exp(S − m_t)`` (and what its ops saved: softcap its ``tanh``) and, once
its L is known, goes over them again with ``P = P̃ ∘ exp(m_t − L)``, walking
the list of ops in reverse (``variants.scores_backward``)::

    dV += Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − D')      D' = D − dL (variants.lse_row_term)
    dbias += dS (summed over its broadcast axes);  ALiBi: nothing;
    softcap: dS_raw = dS ∘ (1 − tanh²);   dQ += scale · dS_raw K,  dK += dS_rawᵀ (scale · Q)
    dsink = −Σ_i p_sink,i D'_i

With dropout (``head.dropout``, ``variants.Dropout``), each tile's factor
``M = keep / (1 − p)`` enters in three places: the forward adds ``(P̃ ∘ M) V``
to acc while ℓ keeps summing the undropped P̃ (lse is the undropped one); the
backward's ``dV += (P ∘ M)ᵀ dO`` and ``dP = (dO Vᵀ) ∘ M``
(``variants.dropout_backward``: D stays rowsum(dO ∘ O) of the dropped O).

This is the chapter's FlashAttention-2 backward without its recomputation of
``q kᵀ`` and ``exp``: the kept weights cost B_r × the keys seen (O(T)).  The
elementwise steps run in place on the tile (each one pass over it), so that
the tile's time goes to its matrix products.
"""

import numpy as np

from numpy_ref import variants

__all__ = ["Head", "with_ones", "forward_rows", "attention_rows"]


class Head:
    """One (batch, query head): its scale, its list of score ops
    (``variants.score_ops``: softcap, ALiBi, bias), its sink (or None) and its
    dropout on the weights (``variants.Dropout``, or None)."""

    def __init__(self, scale, ops, sink, dropout=None):
        self.scale, self.ops, self.sink, self.dropout = scale, ops, sink, dropout


def _tile_scores(q_i, k_j, tile, head, mask):
    """Scores of the scaled queries q_i (rows tile.q0..) against keys k_j
    (columns tile.k0..), every score op applied in order, then ``-inf`` where
    ``mask`` is False -> (S, what the ops saved for their backward)."""
    S, saved = variants.scores_forward(head.ops, q_i @ k_j.T, tile)   # (B_r, B_c)
    if mask is not None:
        np.copyto(S, -np.inf, where=~mask)
    return S, saved


def _online_softmax(q_i, k, v1, head, vis, q0, q1, B_c, keep):
    """The online softmax of queries [q0, q1) (q_i already scaled) over the keys
    they may see -> (m, acc1, kept).  ``v1 = [v | 1]`` (Tk, Dv + 1): one product
    ``P̃ v1`` gives both the unnormalised output and the row sum ℓ, so
    ``acc1 = [acc | ℓ]``.  With ``keep``, ``kept`` lists each key tile's
    (tile, P̃ = exp(S − m_t), m_t, what its ops saved) for the backward."""
    dtype = q_i.dtype
    real = np.arange(q0, q1) < vis.nq                                # not padding
    m = np.full(q1 - q0, -np.inf, dtype=dtype)                       # running maximum
    acc1 = np.zeros((q1 - q0, v1.shape[1]), dtype=dtype)             # [acc | ℓ]
    if head.sink is not None:
        m, acc1[:, -1] = variants.sink_forward(m, acc1[:, -1], head.sink, real)
    kept = []
    k_lo, k_hi = vis.key_range(q0, q1)
    for k0 in range(k_lo, k_hi, B_c):
        k1 = min(k0 + B_c, k_hi)
        tile = variants.Tile(q0, q1, k0, k1)
        S, saved = _tile_scores(q_i, k[k0:k1], tile, head, vis.tile_mask(q0, q1, k0, k1))
        m_new = np.maximum(m, S.max(axis=-1))
        shift = np.where(np.isneginf(m_new), 0, m_new).astype(dtype, copy=False)
        alpha = np.exp(m - shift)                                    # 0 while nothing is seen
        S -= shift[:, None]
        P = np.exp(S, out=S)                                         # P̃ = exp(S − m_t)
        acc1 *= alpha[:, None]
        if head.dropout is None:
            acc1 += P @ v1[k0:k1]                                    # [P̃ v | rowsum P̃]
        else:                                                        # [(P̃ ∘ M) v | rowsum P̃]
            M = head.dropout.factor(tile, dtype)
            acc1[:, :-1] += variants.dropout_forward(P, M) @ v1[k0:k1, :-1]
            acc1[:, -1] += P.sum(axis=-1)
        m = m_new
        if keep:
            kept.append((tile, P, shift, saved))
    return np.where(real, m, -np.inf), acc1, kept


def _finish(m, acc1, out_i, lse_i):
    """``out = acc / ℓ`` (0 for a row that saw nothing: ℓ = 0 and acc = 0, not
    0/0) and ``L = m + log ℓ`` (−∞ there, and on padding rows: m = −∞).

    ℓ is copied out of its column first: NumPy 1.x takes its vector log on a
    strided view only when the new output lies past the view's last stride,
    else its scalar log, whose last bit differs; where the allocator put the
    output would then change lse's bits from run to run."""
    l = np.ascontiguousarray(acc1[:, -1])
    np.divide(acc1[:, :-1], np.where(l == 0, 1, l)[:, None], out=out_i)
    with np.errstate(divide="ignore"):
        lse_i[...] = np.where(np.isneginf(m), -np.inf, m + np.log(l))


def with_ones(v):
    """``[v | 1]`` (Tk, Dv + 1), for `_online_softmax`."""
    return np.concatenate([v, np.ones((v.shape[0], 1), dtype=v.dtype)], axis=1)


def forward_rows(q, k, v1, out, lse, head, vis, rows, B_r, B_c):
    """Forward of query rows ``rows = (r0, r1)`` of one head: q (Tq, Dqk), k (Tk,
    Dqk), v1 = `with_ones` (v) -> written into out[r0:r1] and lse[r0:r1]."""
    for q0 in range(rows[0], rows[1], B_r):
        q1 = min(q0 + B_r, rows[1])
        q_i = q[q0:q1] * q.dtype.type(head.scale)
        m, acc1, _ = _online_softmax(q_i, k, v1, head, vis, q0, q1, B_c, keep=False)
        _finish(m, acc1, out[q0:q1], lse[q0:q1])


def attention_rows(dout, q, k, v1, out, lse, dlse, dq, dk, dv, head, vis, rows, B_r, B_c):
    """Forward and backward of query rows ``rows = (r0, r1)`` of one head, a tile
    of queries at a time: out, lse and dq of the rows written; dk (Tk, Dqk) and
    dv (Tk, Dv) added to, and dbias through the head's Bias op; returns dsink
    (0 without sink).  ``dlse`` (Tq,) or None: the upstream gradient on lse.

    Each tile of queries keeps its weights ``P̃ = exp(S − m_t)`` from its
    forward (B_r × the keys it sees: O(T)), so the backward needs neither
    ``q kᵀ`` nor its exp again: ``P = P̃ ∘ c`` with ``c_i = exp(m_t,i − L_i)``
    per row, and ``c`` goes into the (B_r, Dv) rows of dO rather than over the
    (B_r, B_c) tile."""
    dtype = q.dtype
    scale = dtype.type(head.scale)
    dsink = dtype.type(0)
    for q0 in range(rows[0], rows[1], B_r):
        q1 = min(q0 + B_r, rows[1])
        q_i = q[q0:q1] * scale
        m, acc1, kept = _online_softmax(q_i, k, v1, head, vis, q0, q1, B_c, keep=True)
        _finish(m, acc1, out[q0:q1], lse[q0:q1])
        dO_i = dout[q0:q1]
        D = np.einsum("ij,ij->i", dO_i, out[q0:q1])                  # rowsum(dO ∘ O)
        D = variants.lse_row_term(D, None if dlse is None else dlse[q0:q1])
        seen = ~np.isneginf(lse[q0:q1])                              # rows with a softmax
        L = np.where(seen, lse[q0:q1], np.inf).astype(dtype, copy=False)  # P = 0 if not
        D = np.where(seen, D, 0).astype(dtype, copy=False)
        dO1 = np.concatenate([dO_i, -D[:, None]], axis=1)            # [dO | −D']
        dq_i = np.zeros((q1 - q0, q.shape[1]), dtype=dtype)
        for tile, P, shift, saved in reversed(kept):             # the latest still in cache
            k0, k1 = tile.k0, tile.k1
            c = np.exp(shift - L)[:, None]                           # P = P̃ ∘ c, row by row
            dO_c = dO1 * c                                           # c folded into dO's rows
            if head.dropout is None:
                dv[k0:k1] += P.T @ dO_c[:, :-1]                      # Pᵀ dO = P̃ᵀ (c ∘ dO)
                dS = dO_c @ v1[k0:k1].T                              # c ∘ (dP − D') = [c dO | −c D'] [v | 1]ᵀ
            else:
                M = head.dropout.factor(tile, dtype)
                dv[k0:k1] += variants.dropout_forward(P, M).T @ dO_c[:, :-1]   # (P ∘ M)ᵀ dO
                dS = variants.dropout_backward(dO_c[:, :-1] @ v1[k0:k1, :-1].T, M)  # c ∘ (dO Vᵀ) ∘ M
                dS += dO_c[:, -1:]                                   # − c D'
            dS *= P                                                  # P ∘ (dP − D')
            dS = variants.scores_backward(head.ops, dS, saved, tile)  # the ops in reverse
            dq_i += dS @ k[k0:k1]
            dk[k0:k1] += dS.T @ q_i                                  # scale · dSᵀ Q
        dq[q0:q1] = dq_i * scale
        if head.sink is not None:
            p_sink = np.exp(dtype.type(head.sink) - L)               # the sink's weight
            dsink += variants.sink_backward(p_sink, D)
    return dsink
