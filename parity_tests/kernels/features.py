"""The features production kernels add, the cases that test each, and what a callable receives.

``check(..., features=[...])`` / ``--features F,...`` add, per feature, cases that
break kernels the way FlashAttention's tests do (``tests/test_flash_attn.py``):

=============  ==================================================================
feature        cases (each causal and not)
=============  ==================================================================
gqa            Hq/Hkv = 4/1 (MQA), 6/2, 8/4
value_dim      Dv 32 and 128 against Dqk 64; Dqk 192, Dv 128 (MLA's shape)
window         windows drawn per case (seeded): 0-wide, left only, right only,
               both; Tq = Tk, Tq < Tk, Tq > Tk (both alignments when the callable
               takes ``align``)
softcap        50, and 1 on scores of spread ~4, where tanh saturates
alibi          ALiBi's slopes for 4, 6 (not a power of two) and 8 heads
bias           (B, H, Tq, Tk), (1, H, Tq, Tk), (B, 1, 1, Tk), (Tq, Tk)
sinks          a large sink (log Tk + 1: most of the weight) and a small one
varlen         packed batches with a zero-length sequence, one-token sequences,
               lengths not multiples of 64 or 128, Tq ≠ Tk per sequence
decode         Tq = 1, 5, 8 against Tk = 2500 .. 4109; forward only
lse            no new case: the callable returns (out, lse) on every case
deterministic  no new case: every case runs twice, bitwise equal
=============  ==================================================================

A keyword is passed only on the cases that test its feature (``kwargs``); a
callable whose signature lacks one of the requested features' keywords is a usage
error before any case runs (``require``).  With ``varlen`` every case runs in the
packed ``thd`` layout (``pack``): q (total_q, H, D), k, v (total_k, Hkv, D), with
``cu_seqlens_q``/``cu_seqlens_k`` (int32, from 0) and ``max_seqlen_q``/``_k``; the
packed tensors are views of buffers whose tail is NaN, so a kernel that reads past
a sequence's end poisons its output.
"""

import inspect
import math
import zlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from parity_tests.kernels import dense

__all__ = ["FEATURES", "FeatureCase", "parse_features", "require", "feature_cases", "draw",
           "kwargs", "as_feature_case", "pack", "unpack", "takes_align"]

FEATURES = ("gqa", "value_dim", "window", "softcap", "alibi", "bias", "sinks", "varlen", "lse",
            "decode", "deterministic")
KEYWORDS = {"window": ("window",), "softcap": ("softcap",), "alibi": ("alibi_slopes",),
            "bias": ("bias",), "sinks": ("sinks",),
            "varlen": ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}
# The padding of a packed buffer past its last token, filled with NaN.
NAN_TAIL = 64


@dataclass(frozen=True)
class FeatureCase:
    """A case of the grid with the features it tests.  ``tq``/``tk`` are the (longest)
    lengths; ``seqlens_*`` the lengths of each sequence when it is a varlen batch."""
    batch: int
    heads: int
    tq: int
    tk: int
    head_dim: int
    causal: bool
    kv_heads: int = None
    v_dim: int = None
    feature: str = ""
    window: tuple = None
    softcap: float = None
    alibi: bool = False
    bias_shape: tuple = None
    sinks: str = None                 # "large" or "small"
    seqlens_q: tuple = None
    seqlens_k: tuple = None
    align: str = None                 # None: the run's
    forward_only: bool = False

    @property
    def hkv(self):
        return self.kv_heads or self.heads

    @property
    def dv(self):
        return self.v_dim or self.head_dim

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.head_dim)

    def offset(self, align):
        return 0 if align == "top-left" else self.tk - self.tq

    def __str__(self):
        t = f"{self.tq}" if self.tq == self.tk else f"{self.tq}x{self.tk}"
        h = f"{self.heads}" if self.hkv == self.heads else f"{self.heads}/{self.hkv}"
        d = f"{self.head_dim}" if self.dv == self.head_dim else f"{self.head_dim}/{self.dv}"
        parts = [f"B{self.batch} H{h} T{t} D{d} {'causal' if self.causal else 'full'}"]
        if self.window is not None:
            parts.append(f"window{self.window}".replace(" ", ""))
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.bias_shape is not None:
            parts.append("bias" + "x".join(map(str, self.bias_shape)))
        if self.sinks:
            parts.append(f"sinks {self.sinks}")
        if self.seqlens_q is not None and self.feature == "varlen":
            lens = ",".join(map(str, self.seqlens_q))
            if self.seqlens_k != self.seqlens_q:
                lens += "x" + ",".join(map(str, self.seqlens_k))
            parts.append(f"lens {lens}")
        if self.feature == "decode":
            parts.append("decode")
        if self.align is not None:
            parts.append(self.align)
        return " ".join(parts)

    def as_dict(self):
        return {"batch": self.batch, "heads": self.heads, "kv_heads": self.hkv, "tq": self.tq,
                "tk": self.tk, "head_dim": self.head_dim, "v_dim": self.dv, "causal": self.causal,
                "feature": self.feature}


def as_feature_case(case):
    """A plain grid case (``cases.Case``) as a `FeatureCase` testing nothing new."""
    return FeatureCase(case.batch, case.heads, case.tq, case.tk, case.head_dim, case.causal)


def parse_features(features):
    """A list of feature names (from a list or ``"a,b"``); ValueError naming an unknown one."""
    if features is None:
        return []
    if isinstance(features, str):
        features = features.split(",")
    names = [str(f).strip().replace("-", "_") for f in features if str(f).strip()]
    unknown = [f for f in names if f not in FEATURES]
    if unknown:
        raise ValueError(f"features must be among {', '.join(FEATURES)}; got {', '.join(unknown)}")
    if "varlen" in names and "bias" in names:
        raise ValueError("features: bias and varlen cannot be combined (a bias has no packed layout)")
    return list(dict.fromkeys(names))


def _parameters(fn):
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None


def _accepts(fn, keyword):
    params = _parameters(fn)
    if params is None:
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    p = params.get(keyword)
    return p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def takes_align(fn):
    """Whether the callable's signature names ``align`` (it then receives it on every case)."""
    params = _parameters(fn)
    return params is not None and "align" in params


def require(name, fn, features):
    """ValueError, before any case, for a feature whose keywords ``fn``'s signature lacks."""
    if "lse" in features and getattr(fn, "returns_lse", None) is False and not hasattr(fn, "with_lse"):
        raise ValueError(f"features: 'lse' needs a target that returns (out, lse), and {name} returns out alone")
    for f in features:
        missing = [kw for kw in KEYWORDS.get(f, ()) if not _accepts(fn, kw)]
        if missing:
            raise ValueError(f"features: {f!r} passes {', '.join(k + '=' for k in missing)} to the target, "
                             f"and {name}'s signature has no such keyword")


def _rng(*key):
    return np.random.default_rng(zlib.crc32(":".join(map(str, key)).encode()))


def _windows(tk, causal, seed, label):
    """0-wide, left only, right only, both: sizes drawn per case like FlashAttention's tests."""
    rng = _rng(seed, "window", label)
    left, right = (int(x) for x in rng.integers(1, max(2, tk), size=2))
    if causal:
        return [(0, 0), (left, 0), (left, -1)]
    return [(0, 0), (left, -1), (-1, right), (left, right)]


def _both_alignments(cases, align_taker):
    if not align_taker:
        return cases
    out = []
    for c in cases:
        if c.tq != c.tk:
            out += [replace(c, align="top-left"), replace(c, align="bottom-right")]
        else:
            out.append(c)
    return out


def _feature_cases(feature, causal, seed, align_taker):
    C = lambda *a, **kw: FeatureCase(*a, feature=feature, **kw)
    out = []
    for c in causal:
        if feature == "gqa":
            out += [C(2, 4, 77, 77, 64, c, kv_heads=1), C(1, 6, 45, 77, 40, c, kv_heads=2),
                    C(1, 8, 113, 203, 64, c, kv_heads=4)]
        elif feature == "value_dim":
            out += [C(1, 2, 77, 77, 64, c, v_dim=32), C(1, 2, 45, 77, 64, c, v_dim=128),
                    C(1, 2, 113, 113, 192, c, v_dim=128)]
        elif feature == "window":
            for tq, tk in ((113, 113), (45, 77), (77, 45)):
                out += [C(1, 2, tq, tk, 64, c, window=w)
                        for w in _windows(tk, c, seed, f"{tq}x{tk}{c}")]
        elif feature == "softcap":
            out += [C(1, 2, 77, 77, 64, c, softcap=50.0), C(1, 2, 45, 77, 64, c, softcap=50.0),
                    C(1, 2, 77, 77, 64, c, softcap=1.0)]
        elif feature == "alibi":
            out += [C(1, 4, 113, 113, 64, c, alibi=True), C(1, 6, 45, 77, 64, c, alibi=True),
                    C(2, 8, 77, 45, 32, c, alibi=True)]
        elif feature == "bias":
            out += [C(2, 2, 45, 77, 64, c, bias_shape=s) for s in ((2, 2, 45, 77), (1, 2, 45, 77),
                                                                   (2, 1, 1, 77), (45, 77))]
        elif feature == "sinks":
            out += [C(1, 4, t, 77, 64, c, sinks=s) for t in (77, 45) for s in ("large", "small")]
        elif feature == "varlen":
            for lq, lk in (((37, 0, 1, 129, 65), (37, 0, 1, 129, 65)),
                           ((20, 1, 0, 77, 130), (45, 1, 3, 77, 200))):
                out.append(C(len(lq), 2, max(lq), max(lk), 64, c, seqlens_q=lq, seqlens_k=lk))
        elif feature == "decode":
            out += [C(2, 4, 1, 2500, 64, c, forward_only=True), C(1, 2, 5, 3077, 64, c, forward_only=True),
                    C(1, 8, 8, 4109, 64, c, forward_only=True)]
    if feature in ("window", "alibi"):
        out = _both_alignments(out, align_taker)
    if feature == "decode" and align_taker:
        out = [replace(x, align="bottom-right") for x in out]
    return out


def feature_cases(features, causal, seed, align_taker):
    """The added cases of every requested feature, in the order of ``FEATURES``."""
    return [c for f in FEATURES if f in features for c in _feature_cases(f, causal, seed, align_taker)]


def with_lengths(case):
    """A case as a varlen batch: equal lengths when it has none of its own."""
    if case.seqlens_q is not None:
        return case
    return replace(case, seqlens_q=(case.tq,) * case.batch, seqlens_k=(case.tk,) * case.batch)


def draw(case, seed=0):
    """float64 NumPy: q, k, v, dout (padded (B, H, T, D)), and the feature inputs
    (``bias``, ``sinks``, ``alibi_slopes``) the case tests; padding rows are zero."""
    rng = _rng(seed, case)
    b, h, hkv = case.batch, case.heads, case.hkv
    q = rng.standard_normal((b, h, case.tq, case.head_dim))
    if case.softcap is not None and case.softcap < 10:
        q *= 4.0                           # scores of spread ~4: tanh saturates at softcap 1
    k = rng.standard_normal((b, hkv, case.tk, case.head_dim))
    v = rng.standard_normal((b, hkv, case.tk, case.dv))
    dout = rng.standard_normal((b, h, case.tq, case.dv))
    if case.seqlens_q is not None:
        for n, (lq, lk) in enumerate(zip(case.seqlens_q, case.seqlens_k)):
            q[n, :, lq:], dout[n, :, lq:] = 0.0, 0.0
            k[n, :, lk:], v[n, :, lk:] = 0.0, 0.0
    extra = {}
    if case.bias_shape is not None:
        extra["bias"] = rng.standard_normal(case.bias_shape)
    if case.sinks is not None:
        base = math.log(case.tk) + 1.0 if case.sinks == "large" else -1.0
        extra["sinks"] = base + 0.5 * rng.standard_normal(h)
    if case.alibi:
        extra["alibi_slopes"] = np.array(dense.alibi_slopes(h))
    return q, k, v, dout, extra


def options(case, align, extra):
    """The reference's options for the case (``numpy_ref.reference_attention``'s names)."""
    opts = dict(scale=case.scale, causal=case.causal, align=align)
    if case.window is not None:
        opts["window"] = case.window
    if case.softcap is not None:
        opts["softcap"] = case.softcap
    if case.seqlens_q is not None:
        opts["seqlens_q"], opts["seqlens_k"] = np.array(case.seqlens_q), np.array(case.seqlens_k)
    opts.update(extra)
    return opts


def kwargs(case, extra_tensors):
    """The feature keywords the callable receives on this case (and only these)."""
    kw = {}
    if case.window is not None:
        kw["window"] = tuple(case.window)
    if case.softcap is not None:
        kw["softcap"] = float(case.softcap)
    kw.update(extra_tensors)
    return kw


def cu_seqlens(lengths, device):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


def pack(x, lengths, tail=NAN_TAIL):
    """(B, H, T, D) -> (total, H, D): sequence b's first lengths[b] rows, one after another,
    as a view of a buffer whose ``tail`` rows past the end are NaN."""
    rows = [x[n, :, :int(t)].transpose(0, 1) for n, t in enumerate(lengths)]          # (t, H, D)
    total = int(sum(lengths))
    buf = torch.full((total + tail,) + tuple(x.shape[1:2]) + tuple(x.shape[3:]), torch.nan,
                     dtype=x.dtype, device=x.device)
    if total:
        buf[:total] = torch.cat(rows)
    return buf


def unpack(x, lengths, tq, fill=0.0):
    """(total, H, ...) -> (B, H, T, ...), rows past each length filled with ``fill``."""
    out = torch.full((len(lengths), x.shape[1], tq) + tuple(x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    start = 0
    for n, t in enumerate(lengths):
        t = int(t)
        out[n, :, :t] = x[start:start + t].transpose(0, 1)
        start += t
    return out
