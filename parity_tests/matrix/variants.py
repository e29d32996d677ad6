"""The production variants' family of the parity matrix (rows of module
``reference_attention``).

Each case is one named mix of variants (`CONFIGS`): GQA and MQA, a value head
dim of its own, Tq ≠ Tk, causal in both alignments, windows, softcap, ALiBi,
bias in several broadcast shapes, sinks, per-batch lengths, all at once.

- float64: ``numpy_ref.reference_attention`` against the dense PyTorch
  computation differentiated by autograd (`variants_dense.dense_attention`),
  check "numpy vs torch", every tensor (out, lse, dq, dk, dv, dbias, dsinks) at
  `tolerances.VARIANTS_FLOAT64_BOUND`; and, where SDPA expresses the case (no softcap, no
  sink), against ``scaled_dot_product_attention`` ("numpy vs sdpa").
- float32: the reference run in float32 against itself in float64 on the same
  rounded numbers ("numpy vs golden"), held to `tolerances.low_precision_bound`
  with the dense PyTorch float32 computation's drift as the baseline (largest
  of `tolerances.BASELINE_DRAWS` one-ulp nudges); the golden is itself checked
  against the dense float64 computation ("golden vs torch f64").

NumPy and CPU PyTorch only: the family runs on the cpu device.
"""

import zlib
from dataclasses import dataclass

import numpy as np

from numpy_ref import reference_attention
from parity_tests.common import tolerances as tol
from parity_tests.matrix import variants_dense as dense

__all__ = ["MODULE", "CONFIGS", "VariantCase", "build_cases", "run_case", "compare",
           "relative_error", "random_case", "TENSORS"]

MODULE = "reference_attention"

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


# ----------------------------------------------------------------------------
# The family's cases

@dataclass(frozen=True)
class VariantConfig:
    """Shapes (B, Hq, Hkv, Tq, Tk, Dqk, Dv), the options, and the tiles (B_r, B_c)."""

    label: str
    options: tuple = ()           # (name, value) pairs; arrays are built by `_options`
    shape: tuple = (2, 4, 2, 9, 13, 5, 3)
    tiles: tuple = (4, 5)


@dataclass(frozen=True)
class _Spec:
    name: str = MODULE


@dataclass(frozen=True)
class VariantCase:
    """A case of the family, shaped like `harness.Case` (spec.name, config.label)."""

    config: VariantConfig
    dtype: str
    device: str = "cpu"
    mode: str = "eval"
    spec: _Spec = _Spec()

    @property
    def seed(self):
        return zlib.crc32(f"{MODULE}|{self.config.label}".encode())


EVERYTHING = (("causal", True), ("align", "bottom-right"), ("window", (4, -1)),
              ("softcap", 2.0), ("alibi_slopes", "(B, Hq)"), ("bias", "(B, 1, Tq, Tk)"),
              ("sinks", "(Hq,)"), ("seqlens_q", (9, 6)), ("seqlens_k", (13, 4)), ("scale", 0.6))

CONFIGS = (
    VariantConfig("GQA 4:2, Dv 3 != Dqk 5, Tq 9 < Tk 13"),
    VariantConfig("MQA 4:1, scale 0.3", (("scale", 0.3),), shape=(2, 4, 1, 9, 13, 5, 3)),
    VariantConfig("causal top-left, Tq 13 > Tk 9", (("causal", True),), shape=(2, 4, 2, 13, 9, 5, 3)),
    VariantConfig("causal bottom-right, Tq 9 < Tk 13", (("causal", True), ("align", "bottom-right"))),
    VariantConfig("window (3, 2)", (("window", (3, 2)),)),
    VariantConfig("window (0, 0), bottom-right", (("window", (0, 0)), ("align", "bottom-right"))),
    VariantConfig("window (4, -1), causal bottom-right",
                  (("window", (4, -1)), ("causal", True), ("align", "bottom-right"))),
    VariantConfig("softcap 1.5", (("softcap", 1.5), ("scale", 1.0))),
    VariantConfig("ALiBi (Hq,), bottom-right", (("alibi_slopes", "(Hq,)"), ("align", "bottom-right"))),
    VariantConfig("bias (Tq, Tk)", (("bias", "(Tq, Tk)"),)),
    VariantConfig("bias (1, Hq, 1, Tk)", (("bias", "(1, Hq, 1, Tk)"),)),
    VariantConfig("bias (B, 1, Tq, Tk), causal", (("bias", "(B, 1, Tq, Tk)"), ("causal", True))),
    VariantConfig("sinks", (("sinks", "(Hq,)"),)),
    VariantConfig("seqlens q (9, 0), k (7, 3): padding, an empty batch",
                  (("seqlens_q", (9, 0)), ("seqlens_k", (7, 3))), shape=(2, 4, 2, 9, 13, 5, 3)),
    VariantConfig("everything, bottom-right", EVERYTHING),
)


def build_cases(dtypes=("float64", "float32"), devices=("cpu",)):
    return [VariantCase(config, dtype) for dtype in dtypes if dtype in ("float64", "float32")
            for config in CONFIGS if "cpu" in devices]


def _draw_case(case):
    """(q, k, v, dout, options) in float64 from the case's seed."""
    B, Hq, Hkv, Tq, Tk, D, Dv = case.config.shape
    r = np.random.default_rng(case.seed)
    q, k = r.standard_normal((B, Hq, Tq, D)), r.standard_normal((B, Hkv, Tk, D))
    v, dout = r.standard_normal((B, Hkv, Tk, Dv)), r.standard_normal((B, Hq, Tq, Dv))
    options = {}
    for name, value in case.config.options:
        if name in ("seqlens_q", "seqlens_k"):
            value = np.array(value)
        elif name == "bias":
            value = r.standard_normal(_bias_shape(value, B, Hq, Tq, Tk))
        elif name == "alibi_slopes":
            value = r.uniform(0.1, 1.0, (Hq,) if value == "(Hq,)" else (B, Hq))
        elif name == "sinks":
            value = r.standard_normal(Hq)
        options[name] = value
    return q, k, v, dout, options


# ----------------------------------------------------------------------------
# Running a case

def _row(case, check, tensor, error, bound, baseline=None):
    return {"module": MODULE, "config": case.config.label, "mode": case.mode,
            "dtype": case.dtype, "device": case.device, "check": check, "tensor": tensor,
            "error": error, "bound": bound, "baseline": baseline,
            "passed": bool(np.isfinite(error) and error <= bound), "where": None}


def _floats(arrays, dtype):
    return {n: (a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a)
            for n, a in arrays.items()}


def _nudged(arrays, rng):
    """Every float entry moved one ulp (of its float32 dtype) up or down at random."""
    return {n: (np.nextafter(a, np.where(rng.random(a.shape) < 0.5, np.inf, -np.inf).astype(a.dtype))
                if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a)
            for n, a in arrays.items()}


def run_case(case):
    q, k, v, dout, options = _draw_case(case)
    tiles = dict(block_q=case.config.tiles[0], block_k=case.config.tiles[1])
    if case.dtype == "float64":
        got = reference_attention(q, k, v, dout, **options, **tiles)
        ref = dense.dense_attention(q, k, v, dout, **options)
        rows = [_row(case, "numpy vs torch", n, e, tol.VARIANTS_FLOAT64_BOUND)
                for n, e in compare(got, ref).items()]
        if "softcap" not in options and "sinks" not in options:
            sdpa = dense.sdpa_attention(q, k, v, dout, **options)
            rows += [_row(case, "numpy vs sdpa", n, e, tol.VARIANTS_FLOAT64_BOUND)
                     for n, e in compare(got, sdpa).items()]
        return rows
    arrays = _floats(dict(q=q, k=k, v=v, dout=dout, **options), np.float32)
    rng = np.random.default_rng([case.seed, 1])
    draws = [arrays] + [_nudged(arrays, rng) for _ in range(tol.BASELINE_DRAWS - 1)]
    baselines, first = {}, None
    for a in draws:
        a64 = _floats(a, np.float64)
        golden = reference_attention(**a64)
        plain = dense.dense_attention(**a)
        for n, e in compare(plain, golden).items():
            baselines[n] = max(baselines.get(n, 0.0), e)
        if first is None:
            first = golden, reference_attention(**a, **tiles), dense.dense_attention(**a64)
    golden, ours, torch64 = first
    rows = [_row(case, "golden vs torch f64", n, e, tol.VARIANTS_FLOAT64_BOUND)
            for n, e in compare(golden, torch64).items()]
    rows += [_row(case, "numpy vs golden", n, e, tol.low_precision_bound("float32", baselines[n]),
                  baselines[n]) for n, e in compare(ours, golden).items()]
    return rows
