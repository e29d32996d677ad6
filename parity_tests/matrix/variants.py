"""The production variants' family of the parity matrix.

``numpy_ref.reference_attention`` against `variants_dense.dense_attention`
(float64 PyTorch autograd) on a grid of cases that mix the variants: GQA, a
value head dim of its own, causal in both alignments, windows, softcap, ALiBi,
bias in several broadcast shapes, sinks and per-batch lengths.
"""

import numpy as np

from parity_tests.common import tolerances as tol

__all__ = ["compare", "relative_error", "random_case", "TENSORS", "VARIANT_FLOAT64_BOUND"]

TENSORS = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")


def _peak(a):
    a = np.asarray(a, np.float64)
    finite = a[np.isfinite(a)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def relative_error(tested, ref, floor=0.0):
    """``max|tested - ref| / max(max|ref|, floor)`` over the finite entries of ref;
    entries where ref is ±inf (lse of a row that sees nothing) or NaN must be the
    same in tested, or the error is inf."""
    if tested is None or ref is None:
        return float("inf")
    a, b = np.asarray(tested, np.float64), np.asarray(ref, np.float64)
    if a.shape != b.shape:
        return float("inf")
    fin = np.isfinite(b)
    same_nonfinite = np.array_equal(a[~fin], b[~fin], equal_nan=True)
    if not same_nonfinite or not np.isfinite(a[fin]).all():
        return float("inf")
    if not fin.any():
        return 0.0
    diff = float(np.abs(a[fin] - b[fin]).max())
    return diff / max(_peak(b), floor, np.finfo(np.float64).tiny)


def compare(tested, ref):
    """{tensor: relative error} for every tensor of ``ref``; the gradients' floor
    is ``SCALE_FLOOR`` x the case's largest gradient (as the matrix's rows), so
    a gradient that is zero by theory (a bias broadcast along keys) is held to
    the accuracy of the others."""
    grad_peak = max((_peak(v) for n, v in ref.items() if n.startswith("d")), default=0.0)
    return {n: relative_error(tested.get(n), ref[n],
                              tol.SCALE_FLOOR * grad_peak if n.startswith("d") else 0.0)
            for n in ref}


# float64 against a dense autograd computation: both are a few matrix products, a
# softmax and (dense side) one logsumexp per row over at most ~40 terms, so agreeing
# code lands at 1e-16..1e-14 (measured maximum over 1000 random mixed cases: see
# README, "The production variants"); 1e-12 is the target the variants are held
# to, 100x above that and 1e9 below a real mistake.
VARIANT_FLOAT64_BOUND = 1e-12

BIAS_SHAPES = ("(Tq, Tk)", "(1, Hq, 1, Tk)", "(B, 1, Tq, Tk)", "(B, Hq, Tq, Tk)", "(Tk,)", "(Tq, 1)")


def _bias_shape(label, B, Hq, Tq, Tk):
    return {"(Tq, Tk)": (Tq, Tk), "(1, Hq, 1, Tk)": (1, Hq, 1, Tk), "(B, 1, Tq, Tk)": (B, 1, Tq, Tk),
            "(B, Hq, Tq, Tk)": (B, Hq, Tq, Tk), "(Tk,)": (Tk,), "(Tq, 1)": (Tq, 1)}[label]


def random_case(seed):
    """(q, k, v, dout, options, tiles) in float64: random shapes (GQA, MQA, Dv ≠ Dqk,
    Tq ≠ Tk) and a random mix of the options, each present with probability ~1/3."""
    r = np.random.default_rng([7, seed])
    Hkv = int(r.choice([1, 2]))
    B, Hq = int(r.integers(1, 3)), Hkv * int(r.choice([1, 2, 3]))
    Tq, Tk, D, Dv = (int(n) for n in r.integers(1, [20, 20, 6, 6]))
    o = {}
    if r.random() < 0.5:
        o["causal"] = True
    if r.random() < 0.5:
        o["align"] = "bottom-right"
    if r.random() < 0.4:
        o["window"] = (int(r.integers(-1, 6)), int(r.integers(-1, 6)))
    if r.random() < 0.3:
        o["softcap"] = float(r.uniform(0.5, 3))
    if r.random() < 0.3:
        o["alibi_slopes"] = r.uniform(0, 1, (Hq,) if r.random() < 0.5 else (B, Hq))
    if r.random() < 0.4:
        o["bias"] = r.standard_normal(_bias_shape(str(r.choice(BIAS_SHAPES)), B, Hq, Tq, Tk))
    if r.random() < 0.3:
        o["sinks"] = r.standard_normal(Hq)
    if r.random() < 0.3:
        o["seqlens_q"] = r.integers(0, Tq + 1, B)
    if r.random() < 0.3:
        o["seqlens_k"] = r.integers(0, Tk + 1, B)
    if r.random() < 0.3:
        o["scale"] = float(r.uniform(0.1, 2))
    q, k = r.standard_normal((B, Hq, Tq, D)), r.standard_normal((B, Hkv, Tk, D))
    v, dout = r.standard_normal((B, Hkv, Tk, Dv)), r.standard_normal((B, Hq, Tq, Dv))
    tiles = dict(block_q=int(r.integers(1, 8)), block_k=int(r.integers(1, 8)))
    return q, k, v, dout, o, tiles
