"""Merging two partial attention states: split-KV decoding and ring attention.

A *state* is what attention over a subset of the keys leaves for each query row:
its output ``out`` (the softmax-weighted mean of that subset's values) and its
``lse`` (the natural log of that subset's softmax denominator,
``log Σ_j exp(S_j)``).  Two states over disjoint key sets A and B merge into
the state of A ∪ B without looking at a key again.  This is FlashAttention-2's
online softmax (``numpy_ref.blockwise``) taken one level up: there a key tile
joins the running ``(m, ℓ, acc)``; here a whole partial result joins another.

Forward
-------
Per query row, with ``ℓ_A = exp(lse_a)``, ``ℓ_B = exp(lse_b)``::

    ℓ    = ℓ_A + ℓ_B                     ->  lse = logaddexp(lse_a, lse_b)
    out  = (ℓ_A out_a + ℓ_B out_b) / ℓ   =   w_a out_a + w_b out_b
    w_a  = exp(lse_a − lse),  w_b = exp(lse_b − lse),  w_a + w_b = 1

Computed as the online softmax does: ``m = max(lse_a, lse_b)``,
``α_a = exp(lse_a − m)``, ``α_b = exp(lse_b − m)`` (the rescale factors, ≤ 1, one
of them 1), ``lse = m + log(α_a + α_b)``, ``w = α / (α_a + α_b)``.  Without the
max, ``exp(lse)`` overflows at lse ≈ 709 (float64), 88.7 (float32).

An *empty* partial (no key seen) has ``lse = −inf`` and any ``out``, NaN
included: its weight is 0 and its term is taken as 0, never ``0 · NaN``.  Both
empty: out 0, lse −inf (the state of an empty key set, as
``reference_attention`` returns for a row that sees no key).

Backward, from the chapter's softmax Jacobian
---------------------------------------------
``(w_a, w_b) = softmax((lse_a, lse_b))``: a softmax over two logits, so the
chapter's ``J = diag(w) − w wᵀ`` gives ``∂w_a/∂lse_a = w_a(1 − w_a)``,
``∂w_b/∂lse_a = −w_b w_a``, and symmetrically.  And ``∂lse/∂lse_a = w_a`` (the
derivative of logaddexp).  With upstream gradients ``dout`` (…, D) and ``dlse``:

1. ``out`` is linear in out_a, out_b:  ``dout_a = w_a dout``,  ``dout_b = w_b dout``.
2. Through the weights, ``g_a = ∂L/∂w_a = ⟨dout, out_a⟩``, ``g_b = ⟨dout, out_b⟩``,
   and the chapter's ``ds = w ∘ (g − ⟨w, g⟩)`` with
   ``⟨w, g⟩ = ⟨dout, w_a out_a + w_b out_b⟩ = ⟨dout, out⟩`` (the D-trick of
   ``numpy_ref.blockwise``):  ``w_a (⟨dout, out_a⟩ − ⟨dout, out⟩) = w_a ⟨dout, out_a − out⟩``.
3. Through lse:  ``dlse · w_a``.

So ``dlse_a = w_a (⟨dout, out_a − out⟩ + dlse)`` and
``dlse_b = w_b (⟨dout, out_b − out⟩ + dlse)``.  An empty side has ``w = 0``: its
gradients are 0, and ``out_a − out`` (NaN there) is never formed.  Both empty:
every gradient is 0.

The backward recomputes ``w`` and ``out`` from the inputs (as FlashAttention
recomputes P), so it needs nothing kept from the forward.

Shapes: out (B, H, T, D), lse (B, H, T); float32 or float64, one dtype.
"""

import numpy as np

__all__ = ["merge_states", "merge_states_backward", "split_states", "merge_many",
           "merge_many_backward", "merge_plan", "ORDERS"]

ORDERS = ("ring", "tree")


def _weights(lse_a, lse_b):
    """The two-way softmax of (lse_a, lse_b) and its log-normaliser -> (w_a, w_b, lse).

    ``m = max(lse_a, lse_b)`` (0 where both are −inf), ``α = exp(lse − m)``: the
    online softmax's rescale; an empty side gets α = 0, hence w = 0."""
    m = np.maximum(lse_a, lse_b)
    m = np.where(np.isneginf(m), 0, m).astype(lse_a.dtype, copy=False)
    alpha_a, alpha_b = np.exp(lse_a - m), np.exp(lse_b - m)
    total = alpha_a + alpha_b                                  # in [1, 2], or 0 if both empty
    safe = np.where(total == 0, 1, total).astype(lse_a.dtype, copy=False)
    with np.errstate(divide="ignore"):
        lse = m + np.log(total)                                # -inf when both are empty
    return alpha_a / safe, alpha_b / safe, lse


def _term(w, out_x, lse_x):
    """``w · out_x`` per row, 0 where the partial is empty (its out may be NaN)."""
    empty = np.isneginf(lse_x)[..., None]
    return np.where(empty, 0, w[..., None] * np.where(empty, 0, out_x))


def _centred(out_x, out, empty):
    """``out_x − out``: the partial's output less the merged one (its weight's share
    of the chapter's ``g − ⟨w, g⟩``); 0 on an empty partial's rows."""
    return np.where(empty[..., None], 0, np.where(empty[..., None], 0, out_x) - out)


def merge_states(out_a, lse_a, out_b, lse_b):
    """The state of the union of two disjoint key sets -> ``(out, lse)``.

    out_a, out_b: (B, H, T, D); lse_a, lse_b: (B, H, T), natural log; an empty
    partial has lse −inf and any out.  ``lse = logaddexp(lse_a, lse_b)``,
    ``out = w_a out_a + w_b out_b`` with ``w_a = exp(lse_a − lse)`` (derivation in
    the module docstring).  Computed in the inputs' dtype; nothing is modified."""
    out_a, lse_a, out_b, lse_b = _check(out_a, lse_a, out_b, lse_b)
    w_a, w_b, lse = _weights(lse_a, lse_b)
    out = _term(w_a, out_a, lse_a) + _term(w_b, out_b, lse_b)
    return out, lse


def merge_states_backward(dout, dlse, out_a, lse_a, out_b, lse_b):
    """Backward of `merge_states` -> ``(dout_a, dlse_a, dout_b, dlse_b)``.

    ``dout_a = w_a dout``, ``dlse_a = w_a (⟨dout, out_a − out⟩ + dlse)``, and the
    same for b; 0 for an empty partial (module docstring: the two-way softmax's
    Jacobian and ``⟨w, g⟩ = ⟨dout, out⟩``)."""
    out_a, lse_a, out_b, lse_b = _check(out_a, lse_a, out_b, lse_b)
    dout = _like("dout", dout, out_a)
    dlse = _like("dlse", dlse, lse_a)
    w_a, w_b, _ = _weights(lse_a, lse_b)
    out = _term(w_a, out_a, lse_a) + _term(w_b, out_b, lse_b)
    grads = []
    for w, out_x, lse_x in ((w_a, out_a, lse_a), (w_b, out_b, lse_b)):
        empty = np.isneginf(lse_x)
        g = np.einsum("...d,...d->...", dout, _centred(out_x, out, empty))   # ⟨dout, out_x − out⟩
        dlse_x = np.where(empty, 0, w * (g + dlse))
        dout_x = np.where(empty[..., None], 0, w[..., None] * dout)
        grads += [dout_x.astype(out_a.dtype, copy=False), dlse_x.astype(lse_a.dtype, copy=False)]
    return tuple(grads)


# ----------------------------------------------------------------------------
# Many partials: cut one attention at key ranges, merge the pieces back

def split_states(q, k, v, cuts, bias=None, **options):
    """The partial states of one attention whose keys are cut at ``cuts``
    (increasing, from 0 to Tk): ``[(out, lse)]``, one per range
    ``k[..., a:b, :]``, each from `reference_attention` (``bias`` sliced with
    its keys; ``options`` passed on).  A range with no key gives out NaN, lse −inf."""
    from numpy_ref.reference import reference_attention
    states = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a == b:
            shape = q.shape[:-1] + (v.shape[-1],)
            states.append((np.full(shape, np.nan, q.dtype), np.full(shape[:-1], -np.inf, q.dtype)))
            continue
        part_bias = None if bias is None else bias[..., a:b]
        r = reference_attention(q, k[..., a:b, :], v[..., a:b, :], bias=part_bias, **options)
        states.append((r["out"], r["lse"]))
    return states


def merge_plan(n, order):
    """The merges of ``n`` states in ``order`` as ``[(i, j)]``: state i := merge(i, j).
    ring: a left fold (0 += 1, 0 += 2, ...); tree: neighbours pairwise, level by level."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "ring":
        return [(0, j) for j in range(1, n)]
    steps, alive = [], list(range(n))
    while len(alive) > 1:
        steps += [(alive[i], alive[i + 1]) for i in range(0, len(alive) - 1, 2)]
        alive = alive[::2]
    return steps


def merge_many(states, order="ring"):
    """Merge ``[(out, lse)]`` (two or more) in ``order`` -> ``(out, lse)``."""
    if len(states) < 2:
        raise ValueError(f"states must hold at least two (out, lse) pairs, got {len(states)}")
    work = list(states)
    for i, j in merge_plan(len(states), order):
        work[i] = merge_states(*work[i], *work[j])
    return work[0]


def merge_many_backward(dout, dlse, states, order="ring"):
    """Backward of `merge_many` -> ``[(dout_i, dlse_i)]``, one per state: the
    merges replayed forward, then `merge_states_backward` in reverse order."""
    work, tape = list(states), []
    for i, j in merge_plan(len(states), order):
        tape.append((i, j, work[i], work[j]))
        work[i] = merge_states(*work[i], *work[j])
    grads = [None] * len(states)
    grads[0] = (dout, dlse)
    for i, j, s_i, s_j in reversed(tape):
        di_out, di_lse, dj_out, dj_lse = merge_states_backward(*grads[i], *s_i, *s_j)
        grads[i], grads[j] = (di_out, di_lse), (dj_out, dj_lse)
    return grads


# ----------------------------------------------------------------------------
# Argument checks

def _floating(name, a):
    a = np.asarray(a)
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be a float32 or float64 array, got dtype {a.dtype}")
    return a


def _like(name, a, ref):
    a = _floating(name, a)
    if a.shape != ref.shape:
        raise ValueError(f"{name} must have shape {ref.shape}, got {a.shape}")
    if a.dtype != ref.dtype:
        raise TypeError(f"{name} must have dtype {ref.dtype} like out_a, got {a.dtype}")
    return a


def _check(out_a, lse_a, out_b, lse_b):
    out_a = _floating("out_a", out_a)
    if out_a.ndim != 4:
        raise ValueError(f"out_a must be 4-D (B, H, T, D), got shape {out_a.shape}")
    out_b = _like("out_b", out_b, out_a)
    lse_a = _floating("lse_a", lse_a)
    if lse_a.shape != out_a.shape[:-1]:
        raise ValueError(f"lse_a must have shape (B, H, T) = {out_a.shape[:-1]} like out_a, "
                         f"got {lse_a.shape}")
    if lse_a.dtype != out_a.dtype:
        raise TypeError(f"lse_a must have dtype {out_a.dtype} like out_a, got {lse_a.dtype}")
    lse_b = _like("lse_b", lse_b, lse_a)
    return out_a, lse_a, out_b, lse_b
