"""The float64 reference for what production attention kernels compute.

``reference_attention(q, k, v, dout=None, **options)`` is the chapter's
blockwise attention (``numpy_ref.blockwise``: FlashAttention-2's online
softmax forward, ``D = rowsum(dO ∘ O)`` backward) with every variant of
``numpy_ref.variants`` on top: GQA/MQA, a value head dim of its own, a custom
scale, causal masks in either alignment, sliding windows, softcap, ALiBi, an
additive bias, sinks and per-batch lengths, in any combination, and dropout on
the weights after the softmax (a given keep mask: "Dropout" below).

Shapes: q (B, Hq, Tq, Dqk), k (B, Hkv, Tk, Dqk), v (B, Hkv, Tk, Dv),
dout and out (B, Hq, Tq, Dv), lse (B, Hq, Tq).

The tile loop (``numpy_ref.reference_tiles``)
---------------------------------------------
For a tile of queries: only the keys some query of it may see
(`Visibility.key_range`), ``S = scale · q kᵀ``, the head's list of score ops
(``variants.score_ops``: softcap, ALiBi, bias, like FlexAttention's
``score_mod``), ``-inf`` where `Visibility.tile_mask` says a key is unseen,
the online softmax started with the sink.  The backward takes each tile's
``P = exp(S − L)`` (from the weights its tile of queries kept),
``dS = P ∘ (dP − D)``, walks the ops in reverse, ``dsink = −Σ_i p_sink,i D_i``,
and GQA sums dK, dV over the query heads that share a kv head.

The work, on every usable CPU
-----------------------------
Jobs are (batch, kv head, block of ``ROWS_PER_JOB`` query rows), run by
``numpy_ref._parallel.map_jobs`` (one BLAS thread per worker, as many workers
as CPUs this process may use).  A job runs forward and backward of its rows
for every query head of its kv head: it writes its own rows of out, lse and
dq, and returns partials: dk and dv of its kv head, dsinks of its heads, the
dbias entries it touched.  The partials are added in the fixed order of the
jobs, so the results are bitwise the same for any number of workers.  The
blocks of rows depend on the shape only (not on the CPUs).

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

Dropout
-------
With ``keep`` (bool, broadcastable to (B, Hq, Tq, Tk), True = kept) and
``dropout_p`` = p, the weights after the softmax become ``W = P ∘ M``,
``M = keep / (1 − p)``, and ``out = W V`` (the chapter's ``nn.Dropout`` on the
attention weights, with the mask given rather than drawn: a kernel's own mask,
recovered from it, is what the check passes).  The softmax is the undropped
one: lse does not change.  The backward (``variants.dropout_backward``)::

    dV = (P ∘ M)ᵀ dO,   dP = (dO Vᵀ) ∘ M,   dS = P ∘ (dP − D),   D = rowsum(dO ∘ O)

D is still rowsum(dO ∘ O) because O is the dropped output:
``Σ_j P_ij dP_ij = Σ_j P_ij M_ij dO_i·v_j = dO_i·O_i``; it is *not* the row
term of the undropped output, ``rowsum(P ∘ (dO Vᵀ)) = dO·(P V)``.  With p = 0
and no keep nothing changes; ``keep`` with p = 0 is ``P ∘ keep`` (no rescale).

Rows that see no key
--------------------
A row with no visible key and no sink has an empty softmax: out 0, lse
``-inf`` (the log of an empty sum), dq 0, nothing added to dk, dv (FlashAttention
and SDPA return 0 there).  A padding query (``i ≥ seqlens_q[b]``) is such a
row even with a sink.  A row that sees only its sink gives out 0, lse = sink.
In the backward those rows get ``L = +inf`` (so ``P = 0``) and ``D = 0``.

Memory: O(T) besides the inputs, the outputs and the caller's bias (read
tile by tile; ``dbias`` has its shape).  Per worker: a (B_r, B_c) tile, its
mask, the partials of its job (dk, dv: (Tk, D) each; the dbias entries it
touched), and in the backward the weights its tile of queries keeps
(B_r × the keys it sees, twice with softcap): ``B_r`` (256 by default)
shrinks so that these stay under ``KEPT_BYTES`` (64 MiB), down to 32 rows.
"""

from numbers import Integral, Real

import numpy as np

from numpy_ref import _parallel, variants
from numpy_ref import reference_tiles as tiles
from numpy_ref.blockwise import _same, choose_tiles
from numpy_ref.visibility import ALIGNMENTS, alignment_offset, window_sides

__all__ = ["reference_attention"]

ROWS_PER_JOB = 2048          # query rows of one head per job (rounded to whole tiles)
KEPT_BYTES = 64 * 2 ** 20    # a query tile's kept weights, per worker: B_r shrinks for long Tk ...
MIN_ROWS = 32                # ... down to this many rows


# ----------------------------------------------------------------------------
# The public function

def reference_attention(q, k, v, dout=None, *, dlse=None, scale=None, causal=False,
                        align="top-left", window=None, softcap=None, alibi_slopes=None,
                        bias=None, sinks=None, seqlens_q=None, seqlens_k=None,
                        dropout_p=0.0, keep=None, block_q=None, block_k=None):
    """Attention with the production variants -> dict of NumPy arrays.

    ``"out"`` (B, Hq, Tq, Dv) and ``"lse"`` (B, Hq, Tq), natural log; with
    ``dout`` also ``"dq"``, ``"dk"``, ``"dv"`` (shaped like q, k, v), ``"dbias"``
    (the bias's shape) when ``bias`` is given and ``"dsinks"`` (Hq,) when
    ``sinks`` is.  Computed in q's dtype (float32 or float64).

    ``dlse`` (B, Hq, Tq), q's dtype: an upstream gradient on lse as well, the
    gradients being those of ``Σ out·dout + Σ lse·dlse`` (module docstring,
    "A gradient on lse").  Without ``dout``, dout is taken as zero (only lse
    is used); entries of rows that see no key are ignored (their lse is −∞).

    Options (docs/reference.md): ``scale`` (None: 1/√Dqk),
    ``causal`` and ``align`` ("top-left": offset 0; "bottom-right": offset
    Tk − Tq, per batch with lengths), ``window=(left, right)`` (−1 unbounded),
    ``softcap`` c > 0, ``alibi_slopes`` (Hq,) or (B, Hq), ``bias`` broadcastable
    to (B, Hq, Tq, Tk), ``sinks`` (Hq,), ``seqlens_q`` / ``seqlens_k`` (B,),
    ``keep`` (bool, broadcastable to (B, Hq, Tq, Tk), True = kept) with
    ``dropout_p`` in [0, 1): the weights become ``P ∘ keep / (1 − dropout_p)``
    (module docstring, "Dropout"; dropout_p > 0 needs keep), and
    the tile sizes ``block_q`` (B_r), ``block_k`` (B_c).  Query head h reads kv
    head ``h // (Hq // Hkv)``.  Nothing given is modified.
    """
    q, k, v = _qkv(q, k, v)
    B, Hq, Tq, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    o = _options(q, k, scale, causal, align, window, softcap, alibi_slopes, bias, sinks,
                 seqlens_q, seqlens_k, block_q, block_k, dropout_p, keep)
    if dout is not None:
        dout = _same("dout", dout, (B, Hq, Tq, Dv), q.dtype)
    if dlse is not None:
        dlse = _same("dlse", dlse, (B, Hq, Tq), q.dtype)
        if dout is None:                                             # only lse is used
            dout = np.zeros((B, Hq, Tq, Dv), dtype=q.dtype)
    r = dict(out=np.empty((B, Hq, Tq, Dv), dtype=q.dtype), lse=np.empty((B, Hq, Tq), dtype=q.dtype))
    if dout is not None:
        r.update(dq=np.zeros_like(q), dk=np.zeros_like(k), dv=np.zeros_like(v),
                 dsinks=np.zeros(Hq, dtype=q.dtype))
        if o["bias"] is not None:
            r["dbias"] = np.zeros(o["bias"].shape, dtype=q.dtype)
    per_job = max(o["B_r"], ROWS_PER_JOB // o["B_r"] * o["B_r"])   # whole tiles
    jobs = [(b, g, r0, min(r0 + per_job, Tq))
            for b in range(B) for g in range(Hkv) for r0 in range(0, Tq, per_job)]
    work = _Job(q, k, v, dout, dlse, r, o)
    cost = B * Hq * Tq * k.shape[2] * (q.shape[3] + Dv) * (3 if dout is not None else 1)
    for job, part in zip(jobs, _parallel.map_jobs(work, jobs, cost=cost)):
        work.reduce(job, part)                                       # in the jobs' order
    if dout is None:
        return r
    if "dbias" in r:
        r["dbias"] = r["dbias"].reshape(np.shape(bias))
    if sinks is None:
        del r["dsinks"]
    return r


class _Job:
    """``job(b, g, r0, r1)``: forward (and backward) of query rows [r0, r1) of
    every query head reading kv head g of batch b -> the partials to add."""

    def __init__(self, q, k, v, dout, dlse, r, o):
        self.q, self.k, self.v, self.dout, self.dlse, self.r, self.o = q, k, v, dout, dlse, r, o
        Hq, Hkv = q.shape[1], k.shape[1]                            # GQA: h // (Hq // Hkv)
        self.heads = [[h for h in range(Hq) if variants.kv_head(h, Hq, Hkv) == g]
                      for g in range(Hkv)]

    def __call__(self, job):
        b, g, r0, r1 = job
        q, k, r, o = self.q, self.k[b, g], self.r, self.o
        v1 = tiles.with_ones(self.v[b, g])                            # [v | 1]
        vis = o["visibility"](b)
        if self.dout is None:
            for h in self.heads[g]:
                tiles.forward_rows(q[b, h], k, v1, r["out"][b, h], r["lse"][b, h],
                                   o["head"](b, h, vis.offset), vis, (r0, r1), o["B_r"], o["B_c"])
            return None
        part = dict(dk=np.zeros_like(k), dv=np.zeros_like(self.v[b, g]), dsinks={}, dbias={})
        for h in self.heads[g]:                                      # the query heads reading g
            head = o["head"](b, h, vis.offset, self._dbias_part(part, b, h, r0, r1), r0)
            part["dsinks"][h] = tiles.attention_rows(
                self.dout[b, h], q[b, h], k, v1, r["out"][b, h], r["lse"][b, h],
                None if self.dlse is None else self.dlse[b, h], r["dq"][b, h],
                part["dk"], part["dv"], head, vis, (r0, r1), o["B_r"], o["B_c"])
        return part

    def _dbias_part(self, part, b, h, r0, r1):
        """This job's zeros for the bias entries head h reads (rows r0..r1 of them,
        or the one broadcast row), shared by heads reading the same entries."""
        bias4 = self.o["bias"]
        if bias4 is None:
            return None
        key = (b if bias4.shape[0] > 1 else 0, h if bias4.shape[1] > 1 else 0)
        rows = r1 - r0 if bias4.shape[2] > 1 else 1
        return part["dbias"].setdefault(key, np.zeros((rows, bias4.shape[3]), dtype=self.q.dtype))

    def reduce(self, job, part):
        """Add one job's partials into the results (called in the jobs' order)."""
        if part is None:
            return
        b, g, r0, r1 = job
        r = self.r
        r["dk"][b, g] += part["dk"]
        r["dv"][b, g] += part["dv"]
        for h, dsink in part["dsinks"].items():
            r["dsinks"][h] += dsink
        for (bb, bh), d in part["dbias"].items():
            rows = slice(r0, r1) if r["dbias"].shape[2] > 1 else slice(0, 1)
            r["dbias"][bb, bh, rows] += d


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
             seqlens_q, seqlens_k, block_q, block_k, dropout_p=0.0, keep=None):
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
    p, keep4 = _dropout(dropout_p, keep, (B, Hq, Tq, Tk))
    nq, nk = _lengths("seqlens_q", seqlens_q, B, Tq), _lengths("seqlens_k", seqlens_k, B, Tk)
    auto_q, auto_k = choose_tiles(Tq, Tk, Dqk)
    kept_rows = KEPT_BYTES // max(1, 2 * Tk * q.dtype.itemsize)     # P̃ and softcap's tanh
    auto_q = min(auto_q, max(MIN_ROWS, kept_rows))
    B_r = max(1, auto_q) if block_q is None else _int("block_q", block_q, 1)
    B_c = max(1, auto_k) if block_k is None else _int("block_k", block_k, 1)

    def visibility(b):
        offset = alignment_offset(nq[b], nk[b], align)
        return variants.Visibility(nq[b], nk[b], offset, left, right)

    def head(b, h, offset, dbias=None, dbias_row0=0):
        ops = variants.score_ops(softcap=softcap, offset=offset,
                                 slope=None if slopes is None else slopes[b, h],
                                 bias=None if bias4 is None else _head_view(bias4, b, h),
                                 dbias=dbias, dbias_row0=dbias_row0)
        drop = None if keep4 is None else variants.Dropout(_head_view(keep4, b, h), p)
        return tiles.Head(scale, ops, None if sink is None else sink[h], drop)

    return dict(visibility=visibility, head=head, bias=bias4, B_r=B_r, B_c=B_c)


def _broadcast4(name, a, full):
    """``a`` as a 4-D view broadcastable to ``full`` = (B, Hq, Tq, Tk); ValueError naming it."""
    if a.ndim > 4:
        raise ValueError(f"{name} must broadcast to (B, Hq, Tq, Tk) = {full}, got shape {a.shape}")
    a4 = a.reshape((1,) * (4 - a.ndim) + a.shape)                    # a view
    if any(n not in (1, f) for n, f in zip(a4.shape, full)):
        raise ValueError(f"{name} must broadcast to (B, Hq, Tq, Tk) = {full}, got shape {a.shape}")
    return a4


def _bias(bias, full):
    a = np.asarray(bias)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"bias must hold floating-point numbers, got dtype {a.dtype}")
    return _broadcast4("bias", a, full)


def _dropout(p, keep, full):
    """(p, the 4-D view of keep or None).  ``dropout_p`` in [0, 1) (1 would scale by
    1/0); ``keep`` bool, broadcastable to (B, Hq, Tq, Tk); p > 0 needs keep."""
    p = _real("dropout_p", p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {p!r}")
    if keep is None:
        if p > 0:
            raise ValueError(f"dropout_p = {p!r} needs keep, the mask of kept weights (bool, "
                             f"broadcastable to (B, Hq, Tq, Tk) = {full}); the reference draws none")
        return p, None
    a = np.asarray(keep)
    if a.dtype != np.bool_:
        raise TypeError(f"keep must be a bool array (True = kept), got dtype {a.dtype}")
    return p, _broadcast4("keep", a, full)
