"""The float64 reference for what production attention kernels compute.

``reference_attention(q, k, v, dout=None, **options)`` is the chapter's
blockwise attention (``numpy_ref.blockwise``: FlashAttention-2's online
softmax forward, ``D = rowsum(dO ∘ O)`` backward) with every variant of
``numpy_ref.variants`` on top: GQA/MQA, a value head dim of its own, a custom
scale, causal masks in either alignment, sliding windows, softcap, ALiBi, an
additive bias, sinks and per-batch lengths, in any combination.

Shapes: q (B, Hq, Tq, Dqk), k (B, Hkv, Tk, Dqk), v (B, Hkv, Tk, Dv),
dout and out (B, Hq, Tq, Dv), lse (B, Hq, Tq).

The tile loop
-------------
For one (batch, head) and a tile of queries [q0, q1) (``B_r`` rows):

1. `Visibility.key_range` gives the keys some query of the tile may see; only
   those are visited, ``B_c`` at a time (a window of W keys costs about
   ``(W + B_r) / T`` of the full work).
2. `_tile_scores`: ``S = scale · q kᵀ``, then the head's list of score ops
   (``variants.score_ops``: softcap, ALiBi, bias, in that order, like
   FlexAttention's ``score_mod``; ``variants.scores_forward``), then ``-inf``
   where `Visibility.tile_mask` says a key is unseen (no mask at all for a
   tile seen whole).
3. The online softmax of ``numpy_ref.blockwise``, its running state started
   with the sink (`sink_forward`): ``m``, ``ℓ``, ``acc``; then
   ``out = acc / ℓ`` and ``L = m + log ℓ``.

The backward recomputes each tile's S (each op saving what its backward
needs: softcap its ``tanh``), its weights ``P = exp(S − L)``, and walks the
list of ops in reverse (``variants.scores_backward``)::

    dV += Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − D)          (the chapter's J)
    dbias += dS (summed over its broadcast axes);  ALiBi: nothing;
    softcap: dS_raw = dS ∘ (1 − tanh²);   dQ += scale · dS_raw K,  dK += scale · dS_rawᵀ Q
    dsink = −Σ_i p_sink,i D_i

and GQA sums dK, dV over the query heads that share a kv head.

A gradient on lse
-----------------
With an upstream ``dL_i = ∂loss/∂lse_i`` too (``dlse``; the ``lse_grad``
check), the loss is ``Σ out·dO + Σ_i L_i dL_i``.  From the chapter's Jacobian,
``L_i = log(exp(sink) + Σ_j exp(S_ij))`` has ``∂L_i/∂S_ij = exp(S_ij − L_i)
= P_ij``, so the scores' gradient gains ``P_ij dL_i``::

    dS_ij = P_ij (dP_ij − D_i) + P_ij dL_i = P_ij (dP_ij − (D_i − dL_i))

the chapter's form with the row term ``D_i`` replaced by ``D_i − dL_i``.
dV = Pᵀ dO does not involve L: unchanged.  The sink: ``∂L_i/∂sink =
exp(sink − L_i) = p_sink,i``, so ``dsink`` gains ``+Σ_i p_sink,i dL_i``, and
``dsink = −Σ_i p_sink,i D_i + Σ_i p_sink,i dL_i = −Σ_i p_sink,i (D_i − dL_i)``:
the same replacement (``variants.sink_backward`` with ``D − dL``).  A row that
sees no key has no L to differentiate (lse ``−∞``, constant): it contributes
nothing (its ``D`` is set to 0 and ``P = 0``).  A row that sees only its sink
(``p_sink = 1``) adds ``dL_i`` to ``dsink``.

Rows that see no key
--------------------
A row with no visible key and no sink has an empty softmax: out 0, lse
``-inf`` (the log of an empty sum), dq 0, nothing added to dk, dv (FlashAttention
and SDPA return 0 there).  A padding query (``i ≥ seqlens_q[b]``) is such a
row even with a sink.  A row that sees only its sink gives out 0, lse = sink.
In the backward those rows get ``L = +inf`` (so ``P = 0``) and ``D = 0``.

Memory: per head the (B_r, B_c) tile, its mask and a few (Tq,) / (Tk, D)
arrays; the caller's bias is read tile by tile and ``dbias`` has its shape.
"""

from numbers import Integral, Real

import numpy as np

from numpy_ref import variants
from numpy_ref.blockwise import _same, choose_tiles
from numpy_ref.visibility import ALIGNMENTS, alignment_offset, window_sides

__all__ = ["reference_attention"]


class Head:
    """One (batch, query head): its scale, its list of score ops
    (``variants.score_ops``: softcap, ALiBi, bias) and its sink (or None)."""

    def __init__(self, scale, ops, sink):
        self.scale, self.ops, self.sink = scale, ops, sink


# ----------------------------------------------------------------------------
# One tile's scores, forward and backward

def _tile_scores(q_i, k_j, tile, head, mask):
    """Scores of the scaled queries q_i (rows tile.q0..) against keys k_j
    (columns tile.k0..), every score op applied in order, then ``-inf`` where
    ``mask`` is False -> (S, what the ops saved for their backward)."""
    S, saved = variants.scores_forward(head.ops, q_i @ k_j.T, tile)   # (B_r, B_c)
    if mask is not None:
        np.copyto(S, -np.inf, where=~mask)
    return S, saved


# ----------------------------------------------------------------------------
# One (batch, head)

def forward_head(q, k, v, out, lse, hs, vis, B_r, B_c):
    """Forward of one head: q (Tq, Dqk), k (Tk, Dqk), v (Tk, Dv) -> written into
    out (Tq, Dv) and lse (Tq,)."""
    Tq, dtype = q.shape[0], q.dtype
    for q0 in range(0, Tq, B_r):
        q1 = min(q0 + B_r, Tq)
        real = np.arange(q0, q1) < vis.nq                            # not padding
        m = np.full(q1 - q0, -np.inf, dtype=dtype)                   # running maximum
        l = np.zeros(q1 - q0, dtype=dtype)                           # running sum ℓ
        acc = np.zeros((q1 - q0, v.shape[1]), dtype=dtype)           # unnormalised output
        if hs.sink is not None:
            m, l = variants.sink_forward(m, l, hs.sink, real)
        q_i = q[q0:q1] * dtype.type(hs.scale)
        k_lo, k_hi = vis.key_range(q0, q1)
        for k0 in range(k_lo, k_hi, B_c):
            k1 = min(k0 + B_c, k_hi)
            tile = variants.Tile(q0, q1, k0, k1)
            S, _ = _tile_scores(q_i, k[k0:k1], tile, hs, vis.tile_mask(q0, q1, k0, k1))
            m_new = np.maximum(m, S.max(axis=-1))
            shift = np.where(np.isneginf(m_new), 0, m_new).astype(dtype, copy=False)
            alpha = np.exp(m - shift)                                # 0 while nothing is seen
            P = np.exp(S - shift[:, None])
            l = l * alpha + P.sum(axis=-1)
            acc = acc * alpha[:, None] + P @ v[k0:k1]
            m = m_new
        # a row that saw nothing has ℓ = 0 and acc = 0: out 0 (as SDPA), not 0/0
        out[q0:q1] = acc / np.where(l == 0, 1, l)[:, None]
        with np.errstate(divide="ignore"):
            lse[q0:q1] = np.where(real, m + np.log(l), -np.inf)


def backward_head(dout, q, k, v, out, lse, dlse, dq, dk, dv, hs, vis, B_r, B_c):
    """Backward of one head into dq (Tq, Dqk), dk (Tk, Dqk), dv (Tk, Dv) (added
    to) and, through its Bias op, dbias; returns dsink (0 without sink).
    ``dlse`` (Tq,) or None: the upstream gradient on lse, carried by the row
    term (``D − dL``, module docstring)."""
    Tq, dtype = q.shape[0], q.dtype
    scale = dtype.type(hs.scale)
    D = np.einsum("ij,ij->i", dout, out)                             # rowsum(dO ∘ O)
    D = variants.lse_row_term(D, dlse)                               # D − dL: ∂L_i/∂S_ij = P_ij
    seen = ~np.isneginf(lse)                                         # rows with a softmax
    L = np.where(seen, lse, np.inf).astype(dtype, copy=False)        # P = exp(S - L) = 0 if not
    D = np.where(seen, D, 0).astype(dtype, copy=False)
    dsink = dtype.type(0)
    for q0 in range(0, Tq, B_r):
        q1 = min(q0 + B_r, Tq)
        dO_i = dout[q0:q1]
        dq_i = np.zeros((q1 - q0, q.shape[1]), dtype=dtype)
        q_i = q[q0:q1] * scale
        k_lo, k_hi = vis.key_range(q0, q1)
        for k0 in range(k_lo, k_hi, B_c):
            k1 = min(k0 + B_c, k_hi)
            tile = variants.Tile(q0, q1, k0, k1)
            S, saved = _tile_scores(q_i, k[k0:k1], tile, hs, vis.tile_mask(q0, q1, k0, k1))
            P = np.exp(S - L[q0:q1, None])                           # the softmax weights
            dv[k0:k1] += P.T @ dO_i
            dP = dO_i @ v[k0:k1].T                                   # dL/dP
            dS = P * (dP - D[q0:q1, None])                           # P ∘ (dP - D)
            dS = variants.scores_backward(hs.ops, dS, saved, tile)  # the ops in reverse
            dq_i += dS @ k[k0:k1]
            dk[k0:k1] += (dS.T @ q[q0:q1]) * scale
        dq[q0:q1] = dq_i * scale
        if hs.sink is not None:
            p_sink = np.exp(dtype.type(hs.sink) - L[q0:q1])          # the sink's weight
            dsink += variants.sink_backward(p_sink, D[q0:q1])
    return dsink


# ----------------------------------------------------------------------------
# The public function

def reference_attention(q, k, v, dout=None, *, dlse=None, scale=None, causal=False, align="top-left",
                        window=None, softcap=None, alibi_slopes=None, bias=None, sinks=None,
                        seqlens_q=None, seqlens_k=None, block_q=None, block_k=None):
    """Attention with the production variants -> dict of NumPy arrays.

    ``"out"`` (B, Hq, Tq, Dv) and ``"lse"`` (B, Hq, Tq), natural log; with
    ``dout`` also ``"dq"``, ``"dk"``, ``"dv"`` (shaped like q, k, v), ``"dbias"``
    (the bias's shape) when ``bias`` is given and ``"dsinks"`` (Hq,) when
    ``sinks`` is.  Computed in q's dtype (float32 or float64).

    ``dlse`` (B, Hq, Tq), q's dtype: an upstream gradient on lse as well, the
    gradients being those of ``Σ out·dout + Σ lse·dlse`` (module docstring,
    "A gradient on lse").  Without ``dout``, dout is taken as zero (only lse
    is used); entries of rows that see no key are ignored (their lse is −∞).

    Options (README, "The production variants"): ``scale`` (None: 1/√Dqk),
    ``causal`` and ``align`` ("top-left": offset 0; "bottom-right": offset
    Tk − Tq, per batch with lengths), ``window=(left, right)`` (−1 unbounded),
    ``softcap`` c > 0, ``alibi_slopes`` (Hq,) or (B, Hq), ``bias`` broadcastable
    to (B, Hq, Tq, Tk), ``sinks`` (Hq,), ``seqlens_q`` / ``seqlens_k`` (B,) and
    the tile sizes ``block_q`` (B_r), ``block_k`` (B_c).  Query head h reads kv
    head ``h // (Hq // Hkv)``.  Nothing given is modified.
    """
    q, k, v = _qkv(q, k, v)
    B, Hq, Tq, _ = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    dtype = q.dtype
    o = _options(q, k, scale, causal, align, window, softcap, alibi_slopes, bias, sinks,
                 seqlens_q, seqlens_k, block_q, block_k)
    if dout is not None:
        dout = _same("dout", dout, (B, Hq, Tq, Dv), dtype)
    if dlse is not None:
        dlse = _same("dlse", dlse, (B, Hq, Tq), dtype)
        if dout is None:                                             # only lse is used
            dout = np.zeros((B, Hq, Tq, Dv), dtype=dtype)
    kv = [variants.kv_head(h, Hq, Hkv) for h in range(Hq)]          # GQA: h // (Hq // Hkv)
    out = np.empty((B, Hq, Tq, Dv), dtype=dtype)
    lse = np.empty((B, Hq, Tq), dtype=dtype)
    for b in range(B):
        vis = o["visibility"](b)
        for h in range(Hq):
            forward_head(q[b, h], k[b, kv[h]], v[b, kv[h]], out[b, h], lse[b, h],
                         o["head"](b, h, vis.offset), vis, o["B_r"], o["B_c"])
    result = {"out": out, "lse": lse}
    if dout is None:
        return result
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dbias = None if o["bias"] is None else np.zeros(o["bias"].shape, dtype=dtype)
    dsinks = np.zeros(Hq, dtype=dtype)
    for b in range(B):
        vis = o["visibility"](b)
        for h in range(Hq):
            hs = o["head"](b, h, vis.offset, None if dbias is None else _head_view(dbias, b, h))
            dsinks[h] += backward_head(dout[b, h], q[b, h], k[b, kv[h]], v[b, kv[h]],
                                       out[b, h], lse[b, h], None if dlse is None else dlse[b, h],
                                       dq[b, h], dk[b, kv[h]],
                                       dv[b, kv[h]], hs, vis, o["B_r"], o["B_c"])
    result.update(dq=dq, dk=dk, dv=dv)
    if dbias is not None:
        result["dbias"] = dbias.reshape(np.shape(bias))
    if sinks is not None:
        result["dsinks"] = dsinks
    return result


def _head_view(bias4, b, h):
    """(batch b, head h)'s 2-D view of a 4-D (possibly broadcast) bias."""
    return bias4[b if bias4.shape[0] > 1 else 0, h if bias4.shape[1] > 1 else 0]


# ----------------------------------------------------------------------------
# Argument checks

def _qkv(q, k, v):
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.dtype not in (np.float32, np.float64):
            raise TypeError(f"{name} must be a float32 or float64 array, got dtype {a.dtype}")
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D (B, H, T, D), got shape {a.shape}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k must be (B, Hkv, Tk, Dqk) with q's B and Dqk; "
                         f"got q {q.shape}, k {k.shape}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be (B, Hkv, Tk, Dv) with k's B, Hkv and Tk; "
                         f"got k {k.shape}, v {v.shape}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"k's heads must divide q's (Hq % Hkv == 0), "
                         f"got Hq = {q.shape[1]}, Hkv = {k.shape[1]}")
    return q, k, v


def _int(name, value, minimum):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _real(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _per_head(name, a, shapes):
    a = np.asarray(a)
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)) \
            or a.dtype == np.bool_:
        raise TypeError(f"{name} must hold real numbers, got dtype {a.dtype}")
    if a.shape not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {a.shape}")
    return a.astype(np.float64)


def _lengths(name, a, B, T):
    if a is None:
        return np.full(B, T)
    a = np.asarray(a)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {a.dtype}")
    if a.shape != (B,):
        raise ValueError(f"{name} must have shape ({B},), got {a.shape}")
    if a.size and (a.min() < 0 or a.max() > T):
        raise ValueError(f"{name} must lie in [0, {T}], got {a.tolist()}")
    return a.astype(np.int64)


def _window(window, causal):
    if window is not None:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window must be a pair (left, right) or None, got {window!r}") from None
        window = _int("window left", left, -1), _int("window right", right, -1)
    return window_sides(causal, window)


def _options(q, k, scale, causal, align, window, softcap, alibi_slopes, bias, sinks,
             seqlens_q, seqlens_k, block_q, block_k):
    """Every option checked (before any work) -> what the tile loop needs."""
    B, Hq, Tq, Dqk = q.shape
    Tk = k.shape[2]
    scale = 1.0 / Dqk ** 0.5 if scale is None else _real("scale", scale)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    left, right = _window(window, causal)
    if softcap is not None and _real("softcap", softcap) <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
    slopes = None if alibi_slopes is None else np.broadcast_to(
        _per_head("alibi_slopes", alibi_slopes, [(Hq,), (B, Hq)]), (B, Hq))
    sink = None if sinks is None else _per_head("sinks", sinks, [(Hq,)])
    bias4 = None if bias is None else _bias(bias, (B, Hq, Tq, Tk))
    nq, nk = _lengths("seqlens_q", seqlens_q, B, Tq), _lengths("seqlens_k", seqlens_k, B, Tk)
    auto_q, auto_k = choose_tiles(Tq, Tk, Dqk)
    B_r = max(1, auto_q) if block_q is None else _int("block_q", block_q, 1)
    B_c = max(1, auto_k) if block_k is None else _int("block_k", block_k, 1)

    def visibility(b):
        offset = alignment_offset(nq[b], nk[b], align)
        return variants.Visibility(nq[b], nk[b], offset, left, right)

    def head(b, h, offset, dbias=None):
        ops = variants.score_ops(softcap=softcap, offset=offset,
                                 slope=None if slopes is None else slopes[b, h],
                                 bias=None if bias4 is None else _head_view(bias4, b, h),
                                 dbias=dbias)
        return Head(scale, ops, None if sink is None else sink[h])

    return dict(visibility=visibility, head=head, bias=bias4, B_r=B_r, B_c=B_c)


def _bias(bias, full):
    a = np.asarray(bias)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"bias must hold floating-point numbers, got dtype {a.dtype}")
    if a.ndim > 4:
        raise ValueError(f"bias must broadcast to (B, Hq, Tq, Tk) = {full}, got shape {a.shape}")
    a4 = a.reshape((1,) * (4 - a.ndim) + a.shape)                    # a view
    if any(n not in (1, f) for n, f in zip(a4.shape, full)):
        raise ValueError(f"bias must broadcast to (B, Hq, Tq, Tk) = {full}, got shape {a.shape}")
    return a4
