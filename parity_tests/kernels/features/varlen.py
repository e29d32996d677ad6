"""``varlen``: FlashAttention's packed layout ``thd``: q (total_q, H, D), k and v
(total_k, Hkv, D), with ``cu_seqlens_q``/``cu_seqlens_k`` (int32, cumulative, from 0) and
``max_seqlen_q``/``max_seqlen_k``.  Every case of the run is packed (a batch of equal
lengths is a varlen batch too); the packed tensors are views of buffers whose tail is
NaN, so a kernel that reads past a sequence's end poisons its output.  Its own cases:
a zero-length sequence, one-token sequences, lengths not multiples of 64 or 128,
Tq ≠ Tk per sequence.  Invited mistakes: no boundary between the sequences, the last
sequence left out."""

import math

import numpy as np
import torch

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Calling, Feature, Shrinking

KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
# The padding of a packed buffer past its last token, filled with NaN.
NAN_TAIL = 64


def cu_seqlens(lengths, device):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


def pack(x, lengths, tail=NAN_TAIL):
    """(B, H, T, D) -> (total, H, D): sequence b's first lengths[b] rows, one after another,
    in a buffer whose ``tail`` rows past the end are NaN (a kernel reading there shows it)."""
    total = int(sum(lengths))
    buf = torch.full((total + tail,) + tuple(x.shape[1:2]) + tuple(x.shape[3:]), torch.nan,
                     dtype=x.dtype, device=x.device)
    if total:
        buf[:total] = torch.cat([x[n, :, :int(t)].transpose(0, 1) for n, t in enumerate(lengths)])
    return buf


def unpack(x, lengths, tq, fill=0.0):
    """(total, H, ...) -> (B, H, T, ...), rows past each length filled with ``fill``."""
    out = torch.full((len(lengths), x.shape[1], tq) + tuple(x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    start = 0
    for n, t in enumerate(lengths):
        out[n, :, :int(t)] = x[start:start + int(t)].transpose(0, 1)
        start += int(t)
    return out


class Packed:
    """The layout ``thd`` (the methods of ``call.Strided``): q (total_q, H, D), k and v
    (total_k, Hkv, D), views of buffers whose tail is NaN; out and dO packed as q, lse
    (H, total_q); the callable also receives ``cu_seqlens_q/k`` and ``max_seqlen_q/k``."""
    name = "thd"

    @staticmethod
    def _lengths(case):
        lq, lk = case.seqlens
        return {"q": (lq, case.tq), "k": (lk, case.tk), "v": (lk, case.tk)}

    def handed(self, case, t, grad):
        lens = self._lengths(case)
        bufs = {n: pack(x, lens[n][0]).requires_grad_(grad) for n, x in t.items()}
        given = {n: b[: int(sum(lens[n][0]))] for n, b in bufs.items()}
        read = {n: (lambda n=n: None if bufs[n].grad is None else unpack(
            bufs[n].grad[: given[n].shape[0]], *lens[n])) for n in t}
        return given, read

    def keywords(self, case, device):
        lq, lk = case.seqlens
        return dict(cu_seqlens_q=cu_seqlens(lq, device), cu_seqlens_k=cu_seqlens(lk, device),
                    max_seqlen_q=int(max(lq)), max_seqlen_k=int(max(lk)))

    def output(self, out, case):
        lq = case.seqlens[0]
        return unpack(out[: int(sum(lq))], lq, case.tq)

    def upstream(self, dout, case):
        return pack(dout, case.seqlens[0], tail=0)

    def lse_shape(self, case):
        return (case.heads, int(sum(case.seqlens[0])))

    def lse_output(self, lse, case):
        return unpack(lse.transpose(0, 1), case.seqlens[0], case.tq, fill=-math.inf)

    def lse_upstream(self, dlse, case):
        return pack(dlse[..., None], case.seqlens[0], tail=0)[..., 0].transpose(0, 1)


def cases(causal, plan):
    out = []
    for lq, lk in (((37, 0, 1, 129, 65), (37, 0, 1, 129, 65)), ((20, 1, 0, 77, 130), (45, 1, 3, 77, 200))):
        out.append(Case(len(lq), 2, max(lq), max(lk), 64, causal, (("varlen", (lq, lk)),)))
    return out


def with_lengths(case):
    """A case as a varlen batch: equal lengths when it has none of its own."""
    if case.seqlens is not None:
        return case
    return case.with_feature("varlen", ((case.tq,) * case.batch, (case.tk,) * case.batch))


def label(lengths):
    lq, lk = lengths
    if set(lq) <= {max(lq)} and set(lk) <= {max(lk)}:     # every sequence full: a plain batch packed
        return ""
    text = ",".join(map(str, lq))
    return "lens " + (text if lk == lq else text + "x" + ",".join(map(str, lk)))


def draw(varlen, inputs):
    """Padding rows zero."""
    names = [n for n in ("q", "dout", "k", "v", "dlse") if n in inputs]
    out = {n: inputs[n].copy() for n in names}
    for n, (lq, lk) in enumerate(zip(*varlen)):
        for name in names:
            out[name][n, :, lk if name in ("k", "v") else lq:] = 0.0
    return out


def reference(varlen):
    return {"seqlens_q": np.array(varlen[0]), "seqlens_k": np.array(varlen[1])}


def _packed_as_one(ctx, lengths):
    """Varlen without the document mask: the packed batch attended as one sequence."""
    q, k, v, dout = ctx.inputs
    lq, lk = lengths
    cat = lambda x, lens: np.concatenate([x[n, :, :t] for n, t in enumerate(lens)], axis=1)[None]
    one = {key: val for key, val in ctx.opts.items() if key not in ("seqlens_q", "seqlens_k")}

    def split(x, lens, t):
        out = np.zeros((len(lens),) + x.shape[1:2] + (t,) + x.shape[3:])
        start = 0
        for n, size in enumerate(lens):
            out[n, :, :size] = x[0, :, start:start + size]
            start += size
        return out

    def predict(grads=True):
        dlse = None if ctx.dlse is None else cat(ctx.dlse, lq)          # (B, H, Tq) packed as q is
        r = ctx.dense(cat(q, lq), cat(k, lk), cat(v, lk), cat(dout, lq) if grads else None, one, grads=grads,
                      dlse=dlse)
        got = {"out": split(r["out"], lq, ctx.case.tq), "lse": split(r["lse"][..., None], lq, ctx.case.tq)[..., 0]}
        if grads:
            got.update(dq=split(r["dq"], lq, ctx.case.tq), dk=split(r["dk"], lk, ctx.case.tk),
                       dv=split(r["dv"], lk, ctx.case.tk))
            if "dsinks" in r:
                got["dsinks"] = r["dsinks"]
        return ctx.as_4d(got)
    return predict


def mistakes(ctx, lengths):
    out = []
    if sum(1 for t in lengths[0] if t) > 1:
        out.append(ctx.H("varlen-neighbours", "no boundary between the packed sequences (each sees its "
                         "neighbours' keys)", _packed_as_one(ctx, lengths)))
    last = ctx.case.batch - 1

    def dropped(grads=True):
        g = {n: a.copy() for n, a in ctx.golden_raw.items()}
        for n in ("out", "dq", "dk", "dv"):
            if n in g:
                g[n][last] = 0.0
        if "lse" in g:
            g["lse"][last] = -np.inf
        return ctx.as_4d(g)
    if ctx.case.batch > 1:
        out.append(ctx.H("varlen-dropped-last", f"the last sequence of the batch (sequence {last}) left out",
                         dropped))
    return out


def apply(case, rng):
    """Lengths drawn per sequence, the longest filling the case (one of them 0 when B > 2)."""
    lq, lk = (rng.integers(1, t + 1, size=case.batch) for t in (case.tq, case.tk))
    lq[0], lk[0] = case.tq, case.tk
    if case.batch > 2:
        lq[-1] = lk[-1] = 0
    return case.with_feature("varlen", (tuple(int(x) for x in lq), tuple(int(x) for x in lk)))


FEATURE = Feature("varlen", "with --layout thd, FlashAttention's packed varlen layout and cu_seqlens",
                  cases=cases, label=label, draw=draw, mistakes=mistakes, apply=apply,
                  excludes={"bias": "a bias has no packed layout"},
                  calling=Calling(keywords=KEYWORDS, reference=reference, run_wide=True, layout=Packed(),
                                  widen=with_lengths),
                  shrinking=Shrinking(shape="seqlens", fit=lambda case, lens: tuple(
                      tuple(min(x, t) for x in ls[:case.batch]) for ls, t in zip(lens, (case.tq, case.tk)))))
