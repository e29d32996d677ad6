"""Blockwise attention (FlashAttention-2): exact softmax attention without a T x T array.

``MultiHeadAttention`` forms the (Tq, Tk) scores, weights and their gradients;
at T = 16384 each is 1 GiB per head.  The same numbers come out of tiles of
B_r queries against B_c keys, keeping per query row only two numbers in the
forward and one in the backward.  Letters as in FlashAttention-2 (Dao, 2023):
``S`` scores, ``P`` their exponentials, ``m`` running maximum, ``ℓ`` running
sum, ``L`` log-sum-exp, ``D`` the backward's row correction, ``B_r`` x ``B_c``
the tile.

Shapes: q (..., Tq, D), k and v (..., Tk, D), out (..., Tq, D), lse (..., Tq).

Forward: the online softmax
---------------------------
The chapter's stable softmax rests on ``softmax(x) = softmax(x - c)`` for any
constant c: ``exp(x_j - c) / sum_k exp(x_k - c)``, the ``exp(-c)`` cancels.  So
the shift need not be the row's true maximum, only *some* number, and it may
change mid-row if every partial result is re-expressed with the new one.
A row meets its keys tile by tile; after tiles 1..t it holds::

    m_t   = max of the scores seen so far                      (running maximum)
    ℓ_t   = sum_j exp(S_j - m_t)                                 (running sum)
    acc_t = sum_j exp(S_j - m_t) v_j                             (unnormalised output)

Tile t+1 brings scores S'.  With ``m_{t+1} = max(m_t, max S')`` and
``alpha = exp(m_t - m_{t+1})`` (<= 1)::

    exp(S_j - m_{t+1}) = exp(S_j - m_t) * alpha       for every old j, so
    ℓ_{t+1}   = alpha * ℓ_t   + sum_j' exp(S'_j' - m_{t+1})
    acc_{t+1} = alpha * acc_t + exp(S' - m_{t+1}) @ v'

Every exponent stays <= 0 (no overflow) because ``m`` is updated *before*
exponentiating.  After the last tile ``out = acc / ℓ`` (the softmax
denominator, shift cancelled), and the forward keeps one number per row for the
backward, the log of that denominator with the shift put back::

    L = m + log ℓ = log sum_j exp(S_j),  so that  P_ij = exp(S_ij - L_i)

is the softmax weight w_ij itself, recomputable from S alone.

Backward: D from the chapter's Jacobian
---------------------------------------
With ``w = softmax(s)`` for one query row, ``out = sum_j w_j v_j`` and an
upstream gradient ``dO = dL/dout``:

1. ``dV_j += w_j dO`` and ``g_j = dL/dw_j = dO · v_j`` (``dP = dO V^T``).
2. The chapter: ``J = diag(w) - w w^T``, so
   ``dL/ds_j = sum_i g_i J_ij = w_j g_j - w_j sum_i w_i g_i = w_j (g_j - <w, g>)``.
3. ``<w, g>`` needs the whole row of w.  But
   ``<w, g> = sum_i w_i (dO · v_i) = dO · (sum_i w_i v_i) = dO · out``:
   the output already holds that sum.  So per row
   ``D = rowsum(dO ∘ O)``, computed once before the tiles, and per tile
   ``dS = P ∘ (dP - D)`` with no weight of another tile needed.
4. ``S = scale · Q K^T`` gives ``dQ += scale · dS K`` and ``dK += scale · dS^T Q``.

Dropout on the weights (keep-mask M scaled by 1/(1-p)) changes steps 1-3 to
``dV += (P∘M)^T dO`` and ``dP ∘= M``; D stays ``rowsum(dO ∘ O)`` because
``<w, g ∘ M> = dO · sum_i w_i M_i v_i = dO · out``.

Causal attention: query i sees key j iff ``j <= i + causal_offset`` (0:
top-left alignment, ``is_causal`` of PyTorch's SDPA; ``Tk - Tq``: bottom-right,
FlashAttention's; ``numpy_ref.visibility.alignment_offset``).  One object
answers "which keys does query i see", ``numpy_ref.visibility.Visibility``,
the same the production reference uses: key tiles entirely in a query tile's
future are skipped (``key_range``), tiles cut by the diagonal are masked with
-inf (``tile_mask``), the others run unmasked.

A row that sees no key (``i + causal_offset < 0``) follows the rule of the
production reference (``numpy_ref.reference``, FlashAttention and SDPA): its
softmax is over an empty set, so its output row is 0 (ℓ = 0 and acc = 0: not
0/0), its L is ``-inf`` (the log of an empty sum), its dq row is 0 and it adds
nothing to dk and dv (the backward gives it ``L = +inf``, so ``P = 0``, and
``D = 0``).  The chapter's modules differ there: their softmax of an all
``-inf`` row is NaN.

Memory: O(T) per head besides the inputs: the (B_r, B_c) tile, ``m``, ``ℓ``,
``L``, ``D``.  No T x T array is allocated.  Computation is in the inputs' dtype.

The small helpers below (``_update_max``, ``_rescale``, ``_log_sum_exp``,
``_scores_grad``, ``_key_tiles``) are the steps a blockwise code gets
wrong; the tests replace each with a faulty twin and watch a check fail.
"""

from numbers import Integral, Real

import numpy as np

from numpy_ref import _parallel
from numpy_ref.visibility import Visibility

__all__ = ["attention_forward", "attention_backward", "choose_tiles"]


# ----------------------------------------------------------------------------
# The steps, one small function each

def _update_max(m, S):
    """``m_new = max(m, rowmax S)``, the running maximum after this tile."""
    return np.maximum(m, S.max(axis=-1))


def _rescale(acc, alpha):
    """Re-express the partial output with the new maximum: ``acc * alpha``."""
    acc *= alpha[:, None]
    return acc


def _log_sum_exp(m, l):
    """``L = m + log ℓ``: the shift put back into the log of the denominator."""
    with np.errstate(divide="ignore"):
        return m + np.log(l)


def _scores_grad(P, dP, D):
    """``dS = P ∘ (dP - D)``: the chapter's ``w ⊙ (g - <w, g>)`` with ``<w, g> = D``
    (written over dP)."""
    dP -= D[:, None]
    dP *= P
    return dP


def _delta(dout, out):
    """``D = rowsum(dO ∘ O)`` (= <w, g> of each row), in the inputs' dtype."""
    return np.einsum("ij,ij->i", dout, out)


def _key_tiles(vis, q0, q1, B_c):
    """[(k0, k1), ...]: the key tiles queries [q0, q1) visit, B_c keys each, the
    last cut at the last key any of them sees (``vis.key_range``: keys in
    every query's future are neither visited nor masked)."""
    k_lo, k_hi = vis.key_range(q0, q1)
    return [(k0, min(k0 + B_c, k_hi)) for k0 in range(k_lo, k_hi, B_c)]


def _mask_hidden(S, vis, q0, k0):
    """Scores of the keys a query does not see -> -inf, in place (a tile cut by
    the diagonal; ``vis.tile_mask`` is None for a tile seen whole).  Returns S."""
    mask = vis.tile_mask(q0, q0 + S.shape[0], k0, k0 + S.shape[1])
    if mask is not None:
        np.copyto(S, -np.inf, where=~mask)
    return S


def causal_visibility(Tq, Tk, causal, causal_offset):
    """The `Visibility` of one head: query i sees key j iff j <= i + causal_offset
    (every key when not causal)."""
    return Visibility(Tq, Tk, causal_offset, -1, 0 if causal else -1)


def choose_tiles(Tq, Tk, D):
    """Automatic (B_r, B_c): large enough that NumPy's per-call overhead (~20 calls
    of a few µs per tile) is small next to the tile's work, small enough that a
    (B_r, B_c) float32 tile (512 KiB) stays in a core's L2 cache.  256 x 512 was
    the fastest of 64..512 x 256..2048 at T = 4096, D = 64 (2 cores, float32)."""
    return min(Tq, 256), min(Tk, 512)


# ----------------------------------------------------------------------------
# One (Tq, D) head; the public functions below loop over the leading axes

def forward_head(q, k, v, out, lse, scale, causal, causal_offset, B_r, B_c, keep=None):
    """Forward of one head, written into ``out`` (Tq, Dv) and ``lse`` (Tq,).

    ``keep(q0, q1, k0, k1)``, if given, returns the tile's dropout keep-mask
    already scaled by 1/(1-p) (or None for no dropout there)."""
    Tq, dtype = q.shape[0], q.dtype
    vis = causal_visibility(Tq, k.shape[0], causal, causal_offset)
    for q0 in range(0, Tq, B_r):
        q1 = min(q0 + B_r, Tq)
        q_i = q[q0:q1] * dtype.type(scale)                       # (B_r, D)
        m = np.full(q1 - q0, -np.inf, dtype=dtype)               # running maximum
        l = np.zeros(q1 - q0, dtype=dtype)                       # running sum ℓ
        acc = np.zeros((q1 - q0, v.shape[1]), dtype=dtype)       # unnormalised output
        for k0, k1 in _key_tiles(vis, q0, q1, B_c):
            S = q_i @ k[k0:k1].T                                 # (B_r, B_c) scores
            _mask_hidden(S, vis, q0, k0)                         # -inf where not seen
            m_new = _update_max(m, S)
            # rows that have seen no key yet keep m = -inf: shift them by 0
            shift = np.where(np.isneginf(m_new), 0, m_new).astype(dtype, copy=False)
            alpha = np.exp(m - shift)                            # <= 1; 0 on the first tile
            S -= shift[:, None]
            P = np.exp(S, out=S)                                 # (B_r, B_c), <= 1
            l *= alpha
            l += P.sum(axis=-1)
            if keep is not None:
                P *= keep(q0, q1, k0, k1)
            acc = _rescale(acc, alpha)
            acc += P @ v[k0:k1]
            m = m_new
        # a row that saw no key has ℓ = 0 and acc = 0: out 0, not 0/0
        np.divide(acc, np.where(l == 0, 1, l)[:, None], out=out[q0:q1])
        lse[q0:q1] = _log_sum_exp(m, l)                      # -inf where ℓ = 0


def backward_head(dout, q, k, v, D, lse, dq, dk, dv, scale, causal, causal_offset,
                  B_r, B_c, keep=None):
    """Backward of one head, written into dq (Tq, D), dk (Tk, D), dv (Tk, Dv);
    ``D = _delta(dout, out)`` (Tq,) is the <w, g> of each row.  Key tiles in the
    outer loop, so each tile's dk, dv are summed in place and written once."""
    Tq, dtype = q.shape[0], q.dtype
    scale = dtype.type(scale)
    vis = causal_visibility(Tq, k.shape[0], causal, causal_offset)
    sees_none = np.isneginf(lse)
    # P = exp(S - L); a row that sees no key gets L = +inf, so P = 0 on it
    L = np.where(sees_none, np.inf, lse).astype(dtype, copy=False)
    D = np.where(sees_none, 0, D).astype(dtype, copy=False)
    q_scaled = q * scale                                         # (Tq, D)
    visits = {}                                                  # k0 -> [(q0, q1, k1), ...]
    for q0 in range(0, Tq, B_r):
        q1 = min(q0 + B_r, Tq)
        for k0, k1 in _key_tiles(vis, q0, q1, B_c):
            visits.setdefault(k0, []).append((q0, q1, k1))
    dq[...], dk[...], dv[...] = 0, 0, 0
    for k0, tiles in sorted(visits.items()):
        n_max = max(k1 for _, _, k1 in tiles) - k0
        k_j, v_j = k[k0:k0 + n_max], v[k0:k0 + n_max]            # (B_c, D)
        dk_j = np.zeros(k_j.shape, dtype=dtype)
        dv_j = np.zeros(v_j.shape, dtype=dtype)
        for q0, q1, k1 in tiles:
            n = k1 - k0                                          # keys of the tile it sees
            S = q_scaled[q0:q1] @ k_j[:n].T                      # (B_r, n), recomputed
            _mask_hidden(S, vis, q0, k0)
            S -= L[q0:q1, None]
            P = np.exp(S, out=S)                                 # the softmax weights w
            dO_i = dout[q0:q1]
            dP = dO_i @ v_j[:n].T                                # (B_r, n) = dL/dw
            if keep is not None:
                mask = keep(q0, q1, k0, k1)
                dv_j[:n] += (P * mask).T @ dO_i
                dP *= mask
            else:
                dv_j[:n] += P.T @ dO_i
            dS = _scores_grad(P, dP, D[q0:q1])                   # (B_r, n)
            dq[q0:q1] += dS @ k_j[:n]
            dk_j[:n] += dS.T @ q[q0:q1]
        dk[k0:k0 + n_max] = dk_j * scale
        dv[k0:k0 + n_max] = dv_j
    dq *= scale


# ----------------------------------------------------------------------------
# Public functions: (..., T, D) arrays, every leading index one head

def attention_forward(q, k, v, *, scale=None, causal=False, causal_offset=0,
                      block_q=None, block_k=None):
    """``softmax(scale · q k^T [+ causal mask]) v`` by tiles -> (out, lse).

    q: (..., Tq, D)   k: (..., Tk, D)   v: (..., Tk, Dv), same leading axes and
    dtype (float32 or float64; computed in it).  ``scale`` defaults to
    1/sqrt(D).  ``causal``: query i sees key j iff j <= i + causal_offset.
    ``block_q``, ``block_k`` (B_r, B_c) default to `choose_tiles`.
    Returns out (..., Tq, Dv) and lse (..., Tq), the row log-sum-exp L of the
    scaled, masked scores (derivations in the module docstring)."""
    q, k, v, scale, causal_offset, (B_r, B_c) = _check(
        q, k, v, scale, causal, causal_offset, block_q, block_k)
    lead, Tq = q.shape[:-2], q.shape[-2]
    out = np.empty(lead + (Tq, v.shape[-1]), dtype=q.dtype)
    lse = np.empty(lead + (Tq,), dtype=q.dtype)

    def head(idx):
        forward_head(q[idx], k[idx], v[idx], out[idx], lse[idx], scale, causal,
                     causal_offset, B_r, B_c)
    _parallel.run_jobs(head, np.ndindex(lead), cost=_cost(q, k, v, 1))   # heads over the usable CPUs
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, causal_offset=0,
                       block_q=None, block_k=None):
    """Backward of `attention_forward` -> (dq, dk, dv), shaped like q, k, v.

    Needs only the inputs, the output and lse: each tile's weights are
    recomputed as ``P = exp(S - L)``, and ``D = rowsum(dout ∘ out)`` stands in
    for the softmax's ``<w, g>``.  Any tile sizes give the same gradients (up
    to rounding)."""
    q, k, v, scale, causal_offset, (B_r, B_c) = _check(
        q, k, v, scale, causal, causal_offset, block_q, block_k)
    lead, Tq = q.shape[:-2], q.shape[-2]
    dout = _same("dout", dout, lead + (Tq, v.shape[-1]), q.dtype)
    out = _same("out", out, lead + (Tq, v.shape[-1]), q.dtype)
    lse = _same("lse", lse, lead + (Tq,), q.dtype)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)

    def head(idx):
        D = _delta(dout[idx], out[idx])                          # (Tq,) = rowsum(dO ∘ O)
        backward_head(dout[idx], q[idx], k[idx], v[idx], D, lse[idx],
                      dq[idx], dk[idx], dv[idx], scale, causal, causal_offset, B_r, B_c)
    _parallel.run_jobs(head, np.ndindex(lead), cost=_cost(q, k, v, 3))   # heads over the usable CPUs
    return dq, dk, dv


def _cost(q, k, v, products):
    """Multiply-adds of ``products`` passes of q kᵀ and P v over every head (for
    `_parallel`: small work runs on the calling thread)."""
    return int(np.prod(q.shape[:-1])) * k.shape[-2] * (q.shape[-1] + v.shape[-1]) * products


# ----------------------------------------------------------------------------
# Argument checks

def _floating(name, a):
    a = np.asarray(a)
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be a float32 or float64 array, got dtype {a.dtype}")
    return a


def _same(name, a, shape, dtype):
    a = _floating(name, a)
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    if a.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} like q, got {a.dtype}")
    return a


def _block(name, value, default):
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return int(value)


def _check(q, k, v, scale, causal, causal_offset, block_q, block_k):
    q, k, v = _floating("q", q), _floating("k", k), _floating("v", v)
    if q.ndim < 2:
        raise ValueError(f"q must be (..., Tq, D), got shape {q.shape}")
    if k.ndim != q.ndim or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must be (..., Tk, D) with q's leading axes and D "
                         f"{q.shape[:-2]}, {q.shape[-1]}; got q {q.shape}, k {k.shape}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v must be (..., Tk, Dv) with k's leading axes and Tk; "
                         f"got k {k.shape}, v {v.shape}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if 0 in q.shape[-2:] or 0 in k.shape[-2:] or v.shape[-1] == 0:
        raise ValueError(f"q, k and v need at least one token and one feature, "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if isinstance(causal_offset, bool) or not isinstance(causal_offset, Integral):
        raise TypeError(f"causal_offset must be an int, got {causal_offset!r}")
    if scale is None:
        scale = 1.0 / q.shape[-1] ** 0.5
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    elif not np.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    auto_q, auto_k = choose_tiles(q.shape[-2], k.shape[-2], q.shape[-1])
    tiles = _block("block_q", block_q, auto_q), _block("block_k", block_k, auto_k)
    return q, k, v, float(scale), int(causal_offset), tiles
