"""``splits``: split-KV (FlashAttention's ``num_splits``, flash-decoding).  The callable
receives ``num_splits=int`` and must return the unsplit result: the keys cut into
``num_splits`` ranges of ceil(Tk / num_splits), each range's partial state
(out_s, lse_s) computed alone, then merged::

    lse = log Σ_s exp(lse_s)        out = Σ_s exp(lse_s − lse) · out_s

A split that sees no key (a range past Tk, or one the causal mask hides from a row)
has lse_s = −inf and weight 0.  Cases: 1, 2, 3, 7 and 133 splits of Tq = 5 against
Tk = 300; 133 splits of 7 keys (most ranges empty); 7 splits of a prefill chunk; forward
only.  Invited mistakes: the partials merged without their rescaling exp(m_s − m) (each
split's sums kept relative to its own maximum), an empty split's −inf turned into NaN
(0/0 in its normalisation), or left at the workspace's 0 (its partial never written), the
merge done in base 2 on natural-log partials, each split's causal mask placed as if its key
range were the whole sequence."""

import math
from dataclasses import replace

import numpy as np
import torch

from parity_tests.kernels import dense
from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Feature, Judging, Option
from parity_tests.kernels.diagnosis.poisoned import Poisoned

COUNTS = (1, 2, 3, 7, 133)


def cases(causal, plan):
    out = [Case(1, 2, 5, 300, 64, causal, (("splits", s),)) for s in COUNTS]
    out += [Case(2, 2, 1, 7, 64, causal, (("splits", 133),)), Case(1, 2, 30, 45, 64, causal, (("splits", 7),))]
    return [replace(c, align="bottom-right") for c in out] if plan.takes_align else out


def ranges(case, splits):
    """The splits' key ranges [(start, stop)], ceil(Tk / num_splits) keys each, those past Tk left out."""
    width = math.ceil(case.tk / splits)
    return [(s * width, min(case.tk, (s + 1) * width)) for s in range(splits) if s * width < case.tk]


def partials(ctx, splits):
    """(out_s (S, B, H, Tq, Dv), lse_s (S, B, H, Tq), m_s (S, B, H, Tq)) in float64: the
    reference's options with the keys outside each range masked by a −inf bias (Tq: the
    rows q holds, a block of them numbered as in the whole case with ``ctx.rows``).  One dense
    pass per split, not a tile loop: the splits are the kernel's key ranges, and each
    partial state is what a mistaken merge then combines."""
    q, k, v, _ = ctx.inputs
    t = lambda a: torch.as_tensor(np.asarray(a)).double()
    kw = dense.keywords(ctx.opts, arrays=("bias", "alibi_slopes"))          # no sink: a split has none
    bias = kw.pop("bias", 0.0)
    tk = k.shape[2]
    width, j = math.ceil(tk / splits), torch.arange(tk)
    parts = []
    for s in range(splits):
        inside = (j >= s * width) & (j < (s + 1) * width)
        mask = torch.zeros(tk, dtype=torch.float64).masked_fill(~inside, -math.inf)
        parts.append(dense.attention(t(q), t(k), t(v), bias=bias + mask, with_max=True, rows=ctx.rows, **kw))
    return tuple(torch.stack([p[i] for p in parts]).numpy() for i in range(3))


def _merged(ctx, parts, how):
    def predict(grads=True):
        out_s, lse_s, m_s = parts()
        seen = np.isfinite(lse_s)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if how == "not-rescaled":                 # Σ acc_s / Σ l_s, each relative to its own max
                l_s = np.where(seen, np.exp(np.where(seen, lse_s - m_s, 0.0)), 0.0)
                total = l_s.sum(0)
                out = (out_s * l_s[..., None]).sum(0) / np.where(total > 0, total, 1.0)[..., None]
                lse = np.logaddexp.reduce(lse_s, axis=0)
            elif how == "empty-zero":                 # an empty split's lse 0 and out 0: a term exp(0) each
                lse_0 = np.where(seen, lse_s, 0.0)
                lse = np.logaddexp.reduce(lse_0, axis=0)
                out = (np.exp(lse_0 - lse)[..., None] * np.where(seen[..., None], out_s, 0.0)).sum(0)
            else:                                     # base 2: lse = log2 Σ 2^lse_s, weights 2^(lse_s − lse)
                top = np.where(seen, lse_s, -np.inf).max(0)
                shift = np.where(np.isfinite(top), top, 0.0)
                lse = shift + np.log2(np.where(seen, np.exp2(lse_s - shift), 0.0).sum(0))
                w = np.where(seen, np.exp2(np.where(seen, lse_s, 0.0) - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
                out = (w[..., None] * out_s).sum(0)
        return ctx.as_4d({"out": out, "lse": lse})
    return predict


def _aligned_alone(ctx, splits):
    """out, lse of splits whose causal mask is placed as if each key range were a whole sequence
    (a split kernel handed its slice of k and v without the slice's start and the whole length):
    row i sees key j of the range [start, end) iff j − start ≤ i + o, o = (end − start) − Tq
    bottom-right, 0 top-left; the partials then merged right."""
    q, k, v, _ = ctx.inputs
    t = lambda a: torch.as_tensor(np.asarray(a)).double()
    kw = {**dense.keywords(ctx.opts, arrays=("bias", "alibi_slopes")), "causal": False}
    bias = kw.pop("bias", 0.0)
    tk = k.shape[2]
    first, total = ctx.rows or (0, q.shape[2])
    i, j = torch.arange(first, first + q.shape[2])[:, None], torch.arange(tk)
    width = math.ceil(tk / splits)

    def predict(grads=True):
        outs, lses = [], []
        for start in range(0, tk, width):
            end = min(tk, start + width)
            o = end - start - total if ctx.align == "bottom-right" else 0
            seen = (j >= start) & (j < end) & (j - start <= i + o)
            mask = torch.zeros(seen.shape, dtype=torch.float64).masked_fill(~seen, -math.inf)
            out_s, lse_s = dense.attention(t(q), t(k), t(v), bias=bias + mask, rows=ctx.rows, **kw)
            outs.append(out_s.numpy())
            lses.append(lse_s.numpy())
        lse_s = np.stack(lses)
        lse = np.logaddexp.reduce(lse_s, axis=0)
        with np.errstate(invalid="ignore"):
            w = np.where(np.isfinite(lse_s), np.exp(lse_s - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
        out = (w[..., None] * np.nan_to_num(np.stack(outs))).sum(0)
        return ctx.as_4d({"out": out, "lse": lse})
    return predict


def _empty_nan(ctx, parts):
    def predict(grads=True):
        lse_s = parts()[1]
        rows = ~np.isfinite(lse_s).all(0)                 # (B, H, Tq): a split this row does not see
        g = {n: ctx.golden_raw[n].copy() for n in ("out", "lse") if n in ctx.golden_raw}
        for a in g.values():
            a[rows] = np.nan
        return ctx.as_4d(g)
    return predict


def mistakes(ctx, splits):
    if splits < 2 or ctx.opts.get("sinks") is not None:
        return []
    present = lambda *names: tuple(n for n in names if n in ctx.present)
    once = []

    def parts():                                      # computed once for the three
        if not once:
            once.append(partials(ctx, splits))
        return once[0]
    from parity_tests.kernels.diagnosis.mistakes import padding_seen     # (which imports the features)
    width = -(-ctx.case.tk // splits)                  # keys per split, the last one padded to it
    padded = padding_seen(ctx, splits * width - ctx.case.tk, f"{splits} splits of {width} keys") \
        if ctx.case.tk % splits else []
    return padded + [
            ctx.H("splits-not-rescaled", f"the {splits} partial states merged without their rescaling "
                  "exp(m_s − m) (each split's sums kept relative to its own maximum)",
                  _merged(ctx, parts, "not-rescaled"), present("out")),
            Poisoned("splits-empty-nan", "an empty split's lse −inf turned into NaN (0/0 in a split that "
                     "sees no key, instead of weight 0)", _empty_nan(ctx, parts), present("out", "lse")),
            ctx.H("splits-empty-lse-zero", "an empty split's partial never written: the merge reading its "
                  "workspace's lse 0 (not −inf) and out 0, a term exp(0) in each row's sum",
                  _merged(ctx, parts, "empty-zero"), present("out", "lse")),
            ctx.H("splits-lse-base-2", "the partial states merged in base 2 (lse = log2 Σ 2^lse_s, weights "
                  "2^(lse_s − lse)) while each split's lse is a natural log", _merged(ctx, parts, "base-2"),
                  present("out", "lse"))] + \
        ([ctx.H("splits-aligned-alone", f"each split's causal mask placed as if its key range were the whole "
                f"sequence ({ctx.align}: the split's start and the whole length not handed to the split kernel)",
                _aligned_alone(ctx, splits), present("out", "lse"))] if ctx.case.causal else [])


FEATURE = Feature("splits", "num_splits=int, FlashAttention's split-KV: the unsplit result for 1, 2, 3, 7 and "
                  "133 splits, splits that see no key included; forward only",
                  cases=cases, label=lambda s: f"splits {s}", options=(Option("num_splits", int, to=("kernel",)),),
                  mistakes=mistakes, judging=Judging(forward_only=True, key_ranges=ranges))
