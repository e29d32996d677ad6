"""What production kernels change in attention, as forward/backward pairs.

Every variant a FlashAttention-style kernel offers is one of two things:

- a change to the scores ``S`` of a tile before its softmax (softcap, ALiBi,
  an additive bias), or one more column in that softmax (a sink).  Each is an
  op pair below, the forward directly above its backward, in the style of
  ``numpy_ref.ops``: the backward takes the gradient ``dS`` of the changed
  scores and returns the gradient of the scores it was given;
- a mask: which keys a query sees (causal, sliding window, padding).  That is
  one step, `numpy_ref.visibility.Visibility` (re-exported here), asked once
  per tile: "which keys of this tile does each query see?"  The answer is
  "none" (the tile is skipped), "all" (no mask is built) or a boolean
  (B_r, B_c) mask.  A masked score is ``-inf``, its weight 0, its gradient 0:
  masks need no backward.

One change acts after the softmax: dropout on the weights (`dropout_forward` /
`dropout_backward`, the chapter's ``nn.Dropout`` on the attention weights),
``W = P ∘ keep / (1 − p)`` before ``W V``; the tile loop asks `Dropout` for each
tile's factor ``M``.

Which kv head a query head reads (GQA) is a pair too: `gqa_forward` /
`gqa_backward`, the dense form of the map `kv_head` the reference reads
through (it never builds the repeated heads; the tests hold the reference's
dk, dv to ``gqa_backward`` of per-query-head ones, and the pair to being
adjoints: ``<gqa_forward(x), y> = <x, gqa_backward(y)>``).

The score changes of one head form a list (`score_ops`), like FlexAttention's
``score_mod``: `scores_forward` applies them in order, `scores_backward` walks
the same list in reverse, each op's backward given what its forward saved.  A
new score change is one op (a forward above its backward) and one list entry.

Order of the changes, as FlashAttention applies them::

    S = scale · q kᵀ          (raw scores)
    S ← softcap(S)            c · tanh(S / c)
    S ← S − slope · |i + offset − j|  + bias
    S ← −inf where key j is not visible to query i
    softmax over the row's visible keys, and its sink if there is one
    W = P ∘ keep / (1 − p)    dropout on the weights; out = W V

Shape legend: B_r queries by B_c keys in a tile; rows ``i`` and columns ``j``
are the tile's absolute query and key positions.
"""

import numpy as np

from numpy_ref.visibility import Visibility

__all__ = [
    "kv_head", "gqa_forward", "gqa_backward",
    "softcap_forward", "softcap_backward",
    "alibi_forward", "alibi_backward",
    "bias_forward", "bias_backward",
    "sink_forward", "sink_backward", "lse_row_term",
    "dropout_forward", "dropout_backward", "Dropout",
    "Tile", "Softcap", "Alibi", "Bias", "score_ops", "scores_forward", "scores_backward",
    "Visibility",
]


# ----------------------------------------------------------------------------
# GQA / MQA: several query heads share one key/value head

def kv_head(h, num_q_heads, num_kv_heads):
    """The kv head query head ``h`` reads: ``h // (Hq // Hkv)``, consecutive query
    heads sharing one (SDPA's ``enable_gqa``, FlashAttention's MQA/GQA)."""
    return h // (num_q_heads // num_kv_heads)


def gqa_forward(kv, num_q_heads):
    """The kv heads as the query heads read them: ``repeat_interleave`` on the
    head axis, query head ``h`` reading kv head ``h // (Hq // Hkv)``.

    kv: (B, Hkv, T, D)  ->  (B, Hq, T, D).  Dense: the blockwise code reads
    ``kv[:, h // group]`` instead of building this."""
    group = num_q_heads // kv.shape[1]
    return np.repeat(kv, group, axis=1)


def gqa_backward(dkv_per_q_head, num_kv_heads):
    """Backward of ``repeat_interleave``: each kv head fed ``group`` query heads,
    so by the chain rule its gradient is the sum of theirs::

        kv_rep[:, h] = kv[:, h // group]  ->  dkv[:, g] = Σ_{h // group = g} dkv_rep[:, h]

    (B, Hq, T, D)  ->  (B, Hkv, T, D)."""
    B, Hq, T, D = dkv_per_q_head.shape
    return dkv_per_q_head.reshape(B, num_kv_heads, Hq // num_kv_heads, T, D).sum(axis=2)


# ----------------------------------------------------------------------------
# Softcap (Gemma 2): scores squashed into (-c, c)

def softcap_forward(S, cap):
    """``S ← c · tanh(S / c)``, applied to the scaled scores before any bias.
    Returns (capped scores, t) with ``t = tanh(S / c)`` for the backward."""
    t = np.tanh(S / S.dtype.type(cap))
    return t * S.dtype.type(cap), t


def softcap_backward(dS, t):
    """Backward of ``c · tanh(S / c)``: ``d/dS [c tanh(S/c)] = 1 − tanh²(S/c)``, so
    ``dS_raw = dS ∘ (1 − t²)`` (elementwise: the Jacobian is diagonal)."""
    return dS * (1 - t * t)


# ----------------------------------------------------------------------------
# ALiBi (MPT, BLOOM): a linear penalty on the distance to the query's diagonal

def alibi_forward(S, slope, rows, cols, offset):
    """``S ← S − slope · |i + offset − j|`` for rows i and columns j of the tile;
    ``offset`` is the alignment's (0 top-left, Tk − Tq bottom-right)."""
    distance = np.abs((rows[:, None] + offset) - cols[None, :])
    S -= S.dtype.type(slope) * distance
    return S


def alibi_backward(dS):
    """Backward of ALiBi: the penalty does not depend on S (nor on q, k), so
    ``dS_raw = dS``; the slopes are constants (no gradient is asked of them)."""
    return dS


# ----------------------------------------------------------------------------
# Additive bias: any (Tq, Tk) term broadcast into the scores

def bias_forward(S, bias_tile):
    """``S ← S + bias``; ``bias_tile`` broadcasts to the tile ((1, B_c) or (B_r, 1)
    when the bias is broadcast along queries or keys)."""
    S += bias_tile
    return S


def bias_backward(dS, bias_tile_shape):
    """Backward of ``S + bias``: ``∂S_ij / ∂bias_ij = 1``, so ``dbias = dS``, summed
    over every axis along which the bias was broadcast (one bias entry fed all
    of them).  Returns (dS, dbias of ``bias_tile_shape``)."""
    dbias = dS
    for axis, n in enumerate(bias_tile_shape):
        if n == 1 and dS.shape[axis] != 1:
            dbias = dbias.sum(axis=axis, keepdims=True)
    return dS, dbias


# ----------------------------------------------------------------------------
# Sinks (gpt-oss): one more softmax column with no value

def sink_forward(m, l, sink, rows_with_sink):
    """Start a row's online softmax with its sink: one more column of score
    ``sink`` (a raw logit: not scaled, not capped) whose value vector is 0.

    The running state (m, ℓ) of the chapter's online softmax becomes
    ``m = sink``, ``ℓ = exp(sink − m) = 1`` before the first key tile, so that
    ``L = log(exp(sink) + Σ_j exp(S_j))`` and ``out = Σ_j P_j v_j`` with the
    sink's weight ``p_sink = exp(sink − L)`` taking its share of the row but
    adding nothing to ``out``.  Rows not in ``rows_with_sink`` (padding
    queries) keep ``m = -inf, ℓ = 0``.  Returns (m, ℓ)."""
    m = np.where(rows_with_sink, m.dtype.type(sink), m)
    with np.errstate(invalid="ignore"):          # sink = -inf: exp(-inf - -inf)
        shift = np.where(np.isneginf(m), 0, m)
        l = np.where(rows_with_sink, np.exp(m - shift), l).astype(l.dtype, copy=False)
    return m, l


def sink_backward(p_sink, D):
    """Gradient of the sink logit.  With ``P_j = exp(S_j − L)`` and
    ``L = log(exp(sink) + Σ_j exp(S_j))``: ``∂P_j / ∂sink = −P_j p_sink``, so for
    ``g_j = dO · v_j``::

        dsink = Σ_i Σ_j g_ij ∂P_ij/∂sink = −Σ_i p_sink,i Σ_j P_ij g_ij = −Σ_i p_sink,i D_i

    with ``D_i = rowsum(dO ∘ O)_i`` (the sink's own g is 0: its value is 0).
    The scores' gradient keeps the chapter's form ``dS = P ∘ (dP − D)``, since
    ``<w, g>`` over the row, sink included, is still D."""
    return -(p_sink * D).sum()


# ----------------------------------------------------------------------------
# A gradient on lse (the lse_grad check): one more term in each row's D

def lse_row_term(D, dlse):
    """The row term of ``dS = P ∘ (dP − D)`` when lse has an upstream gradient
    ``dlse`` too: ``L_i = log Σ_j exp(S_ij)`` has ``∂L_i/∂S_ij = P_ij``, so
    ``dS_ij = P_ij (dP_ij − D_i) + P_ij dL_i = P_ij (dP_ij − (D_i − dL_i))``:
    returns ``D − dlse`` (``D`` itself when ``dlse`` is None).  The sink's
    ``∂L_i/∂sink = p_sink,i`` makes `sink_backward` take the same ``D − dL``."""
    return D if dlse is None else D - dlse


# ----------------------------------------------------------------------------
# Dropout on the weights (the chapter's dropout): after the softmax, before W V

def dropout_forward(P, M):
    """``W = P ∘ M`` with ``M = keep / (1 − p)``: the weights of the dropped keys
    set to 0, the survivors scaled by 1/(1 − p) so that E[W] = P.  ``out = W V``;
    the softmax, and so lse, are those of the undropped scores."""
    return P * M


def dropout_backward(dW, M):
    """Backward of ``W = P ∘ M`` (elementwise: the Jacobian is diagonal, as for
    the softcap): ``dP = dW ∘ M``.  With ``out = W V`` the whole backward is::

        dW = dO Vᵀ                 (out_i = Σ_j W_ij v_j)
        dV = Wᵀ dO = (P ∘ M)ᵀ dO
        dP = dW ∘ M = (dO Vᵀ) ∘ M
        dS = P ∘ (dP − D),   D_i = Σ_j P_ij dP_ij

    the last line from the chapter's softmax Jacobian ∂P_j/∂S_k = P_j (δ_jk − P_k):
    dS_k = Σ_j dP_j P_j (δ_jk − P_k) = P_k dP_k − P_k Σ_j P_j dP_j.

    The row term is still the chapter's ``D = rowsum(dO ∘ O)``, provided O is the
    *dropped* output the forward returned::

        Σ_j P_ij dP_ij = Σ_j P_ij M_ij (dO_i · v_j) = dO_i · Σ_j W_ij v_j = dO_i · O_i

    What it is not: ``rowsum(P ∘ (dO Vᵀ))`` (dP without its M: that is
    dO_i · (P V)_i, the undropped output's), nor ``rowsum(dO ∘ P V)`` from an
    output recomputed without dropout, nor ``rowsum(W ∘ dP)`` (M counted twice).
    So a kernel keeps FlashAttention's D = rowsum(dO ∘ O) and applies M in two
    places only: to P in dV, to dP before the softmax's backward.  lse, and with
    it ``∂lse_i/∂S_ij = P_ij`` (``lse_row_term``) and the sink's gradient, do not
    involve M."""
    return dW * M


class Dropout:
    """One (batch, query head)'s keep mask, 2-D ``(Tq or 1, Tk or 1)`` (a view of
    the broadcast (B, Hq, Tq, Tk) mask), and ``1 / (1 − p)``: `factor` gives a
    tile's ``M = keep / (1 − p)`` in the tile's dtype."""

    def __init__(self, keep, p):
        self.keep, self.scale = keep, 1.0 / (1.0 - p)

    def factor(self, tile, dtype):
        M = np.where(self.keep[tile.index(self.keep)], dtype.type(self.scale), dtype.type(0))
        return np.broadcast_to(M, (tile.q1 - tile.q0, tile.k1 - tile.k0))


# ----------------------------------------------------------------------------
# The score changes of one head as a list of ops, applied in order

class Tile:
    """Where a (B_r, B_c) tile sits in its head: query rows [q0, q1), keys [k0, k1)."""

    def __init__(self, q0, q1, k0, k1):
        self.q0, self.q1, self.k0, self.k1 = q0, q1, k0, k1

    def rows(self):
        return np.arange(self.q0, self.q1)

    def cols(self):
        return np.arange(self.k0, self.k1)

    def index(self, a):
        """The tile's (rows, cols) slices into a 2-D ``a`` broadcast along a length-1 axis."""
        return (slice(self.q0, self.q1) if a.shape[0] > 1 else slice(0, 1),
                slice(self.k0, self.k1) if a.shape[1] > 1 else slice(0, 1))


class Softcap:
    """``S ← c · tanh(S / c)``; backward ``dS ∘ (1 − tanh²)`` (`softcap_forward`,
    `softcap_backward`: the Jacobian is diagonal).  Saves ``tanh(S / c)``."""

    def __init__(self, cap):
        self.cap = cap

    def forward(self, S, tile):
        return softcap_forward(S, self.cap)

    def backward(self, dS, saved, tile):
        return softcap_backward(dS, saved)


class Alibi:
    """``S ← S − slope · |i + offset − j|``; backward ``dS`` unchanged, the penalty
    being a constant of S (`alibi_forward`, `alibi_backward`)."""

    def __init__(self, slope, offset):
        self.slope, self.offset = slope, offset

    def forward(self, S, tile):
        return alibi_forward(S, self.slope, tile.rows(), tile.cols(), self.offset), None

    def backward(self, dS, saved, tile):
        return alibi_backward(dS)


class Bias:
    """``S ← S + bias``; backward ``dS`` unchanged, and ``dbias = dS`` summed over
    the bias's broadcast axes (`bias_forward`, `bias_backward`), added into
    ``grad``: the 2-D bias's shape (rows 1 or Tq, columns 1 or Tk), or only
    its rows from ``grad_row0`` on (a partial for some of the queries)."""

    def __init__(self, bias, grad=None, grad_row0=0):
        self.bias, self.grad, self.grad_row0 = bias, grad, grad_row0

    def _index(self, tile):
        return tile.index(self.bias)

    def forward(self, S, tile):
        return bias_forward(S, self.bias[self._index(tile)]), None

    def backward(self, dS, saved, tile):
        rows, cols = self._index(tile)
        dS, dbias = bias_backward(dS, self.bias[rows, cols].shape)
        if self.grad is not None:
            if self.bias.shape[0] > 1:
                rows = slice(rows.start - self.grad_row0, rows.stop - self.grad_row0)
            self.grad[rows, cols] += dbias
        return dS


def score_ops(*, softcap=None, slope=None, offset=0, bias=None, dbias=None, dbias_row0=0):
    """One head's score changes in FlashAttention's order: softcap, ALiBi, bias
    (each left out when None).  ``dbias`` receives the bias's gradient (its
    rows from ``dbias_row0`` on)."""
    ops = []
    if softcap is not None:
        ops.append(Softcap(softcap))
    if slope is not None:
        ops.append(Alibi(slope, offset))
    if bias is not None:
        ops.append(Bias(bias, dbias, dbias_row0))
    return ops


def scores_forward(ops, S, tile):
    """Every op's forward in order -> (S, what each saved for its backward)."""
    saved = []
    for op in ops:
        S, keep = op.forward(S, tile)
        saved.append(keep)
    return S, saved


def scores_backward(ops, dS, saved, tile):
    """The chain rule through the list: every op's backward in reverse order."""
    for op, keep in zip(reversed(ops), reversed(saved)):
        dS = op.backward(dS, keep, tile)
    return dS
