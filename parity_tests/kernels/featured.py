"""One case of a run with ``features``: every tensor the case has, judged and diagnosed.

Like ``measure.run_case``, with what the features add:

1. The callable receives the keywords of the case's own feature only
   (``features.kwargs``), ``align`` when its signature names it, and with
   ``varlen`` the packed ``thd`` tensors and ``cu_seqlens``/``max_seqlen``.
   With ``lse`` it returns ``(out, lse)``.
2. Judged: out, lse, dq, dk, dv, dbias, dsinks, whichever the case has (decode:
   out and lse only), each to ``CHECK_FACTOR × baseline + floor`` on its max error
   *and* on its mean error (FlexAttention's criterion), the baseline being the
   features' formulas in plain PyTorch in the tested dtype (``reference``).  The
   cosine between the kernel's tensor and the reference's is reported beside
   them: a gradient pointing the wrong way is named so.
3. lse is judged on the rows that see a key (kernels store −inf, +inf or 0 on the
   others); with ALiBi, FlashAttention's causal form (``+slope·j``, each row's
   constant ``−slope·(i + offset)`` left out) is accepted as well, and the row's
   note says which form the kernel returns.
4. A gradient that does not reach ``bias`` or ``sinks`` FAILS its row; so does
   an exception, a wrong shape, dtype or device ("not supported" is only a
   built-in's declared refusal, ``targets.Unsupported``).
5. ``deterministic``: the case runs twice, every tensor must be bitwise equal.
6. Failing tensors are diagnosed against ``feature_mistakes`` (and, on a case
   with no feature of its own, the chapter's ``mistakes`` as well), and the
   sentence says first what a user asks: "the output is right; only the
   backward is wrong", "only sequence 3 of the batch".
"""

import math

import numpy as np
import torch

from parity_tests.common import tolerances as tol
import parity_tests.kernels.diagnosis as diagnosis
import parity_tests.kernels.feature_mistakes as feature_mistakes
import parity_tests.kernels.features as feat
import parity_tests.kernels.measure as measure
import parity_tests.kernels.mistakes as mistakes
import parity_tests.kernels.reference as reference
import parity_tests.kernels.targets as targets
from parity_tests.kernels.cases import Case
from parity_tests.kernels.report import Row

__all__ = ["run_feature_case", "judged", "tensor_errors"]

DTYPES = measure.DTYPES
ORDER = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")
GRADS = ("dq", "dk", "dv", "dbias", "dsinks")


def judged(arrays):
    """Every tensor as a 4-D array, so that each is sliced by (batch, head): lse (B, H, T)
    -> (B, H, T, 1), a bias of fewer dims padded in front, dsinks (H,) -> (1, H, 1, 1)."""
    out = {}
    for n, a in arrays.items():
        a = np.asarray(a, dtype=np.float64)
        if n == "lse":
            a = a[..., None]
        elif n == "dsinks":
            a = a.reshape(1, -1, 1, 1)
        elif a.ndim < 4:
            a = a.reshape((1,) * (4 - a.ndim) + a.shape)
        out[n] = a
    return out


def tensor_errors(a, ref, denom):
    """(max error, where, mean error, cosine) of ``a`` against ``ref`` (normwise, over
    ``denom``); inf at the first non-finite entry."""
    bad = ~np.isfinite(a)
    if bad.any():
        return math.inf, tuple(int(i) for i in np.unravel_index(np.argmax(bad), a.shape)[:3]), math.inf, math.nan
    if a.size == 0:
        return 0.0, None, 0.0, 1.0
    diff = np.abs(a - ref)
    flat = int(np.argmax(diff))
    where = tuple(int(i) for i in np.unravel_index(flat, a.shape)[:3])
    na, nr = float(np.linalg.norm(a)), float(np.linalg.norm(ref))
    cosine = float((a * ref).sum() / (na * nr)) if na > 0 and nr > 0 else (1.0 if na == nr else 0.0)
    return float(diff.flat[flat] / denom), where, float(diff.mean() / denom), cosine


def _zero_by_theory(gold):
    """The gradients measured against SCALE_FLOOR x the largest gradient (their own is ~0)."""
    grads = max([float(np.abs(gold[n]).max(initial=0.0)) for n in ("dq", "dk", "dv") if n in gold] or [0.0])
    return {n for n in GRADS if n in gold and float(np.abs(gold[n]).max(initial=0.0)) < tol.SCALE_FLOOR * grads}


def _denominators(gold):
    grads = max([float(np.abs(gold[n]).max(initial=0.0)) for n in ("dq", "dk", "dv") if n in gold] or [0.0])
    den = {}
    for n, a in gold.items():
        own = float(np.abs(a).max(initial=0.0))
        if n == "lse":
            den[n] = max(1.0, own)
        elif n in GRADS:
            den[n] = max(own, tol.SCALE_FLOOR * grads, 1e-300)
        else:
            den[n] = max(own, 1e-300)
    return den


class _Fail(Exception):
    """The target's answer is wrong in kind (shape, dtype, device, type): FAIL with the reason."""


def _reason(e):
    return str(e)[:200] if isinstance(e, _Fail) else measure._reason(e)


class _Caller:
    """Calls the target on one case, in its layout, and returns float64 padded arrays."""

    def __init__(self, target, case, dtype, device, align, features, rounded, extra):
        self.target, self.case, self.dtype, self.device = target, case, DTYPES[dtype], device
        self.align, self.features, self.rounded, self.extra = align, features, rounded, extra
        self.thd = "varlen" in features
        self.layout = "thd" if self.thd else target.layout
        self.takes_align = getattr(target.fn, "takes_align", False) or feat.takes_align(target.fn)
        self.grads = not case.forward_only
        self.fn = target.fn.with_lse if "lse" in features and hasattr(target.fn, "with_lse") else target.fn

    def _leaf(self, a, lengths=None, grad=True):
        t = torch.from_numpy(a).to(device=self.device, dtype=self.dtype)
        if self.thd:
            buf = feat.pack(t, lengths).requires_grad_(grad)
            return buf, buf[: int(sum(lengths))]
        t = targets.to_layout(t, self.layout).requires_grad_(grad)
        return t, t

    def _back(self, x, lengths, tq, fill=0.0):
        if self.thd:
            return feat.unpack(x.detach()[: int(sum(lengths))], lengths, tq, fill)
        return targets.from_layout(x.detach(), self.layout)

    def __call__(self, grad=True):
        """``{tensor: array | ("FAIL", why) | "not supported: why"}``."""
        c, (q, k, v, dout) = self.case, self.rounded
        grad = grad and self.grads
        lq, lk = c.seqlens_q, c.seqlens_k
        (bq, tq_), (bk, tk_), (bv, tv_) = (self._leaf(q, lq, grad), self._leaf(k, lk, grad),
                                           self._leaf(v, lk, grad))
        extras, leaves = {}, {}
        for n, a in self.extra.items():
            dt = self.dtype if n == "bias" else torch.float32
            t = torch.from_numpy(np.ascontiguousarray(a)).to(device=self.device, dtype=dt)
            if n in ("bias", "sinks"):
                t.requires_grad_(grad)
                leaves["d" + n] = t
            extras[n] = t
        kw = {"causal": c.causal, "scale": c.scale, **feat.kwargs(c, extras)}
        if self.takes_align:
            kw["align"] = self.align
        if self.thd:
            kw.update(cu_seqlens_q=feat.cu_seqlens(lq, self.device), cu_seqlens_k=feat.cu_seqlens(lk, self.device),
                      max_seqlen_q=int(max(lq)), max_seqlen_k=int(max(lk)))
        with torch.set_grad_enabled(grad):
            result = self.fn(tq_, tk_, tv_, **kw)
        out, lse = self._split(result, tq_)
        got = {"out": self._back(out, lq, c.tq).to("cpu", torch.float64).numpy()}
        if lse is not None:
            got["lse"] = self._lse(lse)
        if not grad:
            return got
        if not out.requires_grad:
            cut = "the output does not require grad (detached, or computed without autograd)"
            return {**got, **{n: ("FAIL", f"no gradient reached {n[1:]}: {cut}") for n in self._grad_names()}}
        try:
            g = torch.from_numpy(dout).to(device=self.device, dtype=out.dtype)
            g = feat.pack(g, lq, tail=0) if self.thd else targets.to_layout(g, self.layout)
            out.backward(g)
        except targets.Unsupported as e:
            return {**got, **{n: f"backward refused: {_reason(e)}" for n in self._grad_names()}}
        except measure.RAISED as e:
            return {**got, **{n: ("FAIL", f"backward {_reason(e)}") for n in self._grad_names()}}
        for n, leaf in (("dq", bq), ("dk", bk), ("dv", bv)):
            got[n] = self._grad(n, leaf, lq if n == "dq" else lk, c.tq if n == "dq" else c.tk)
        for n, leaf in leaves.items():
            got[n] = self._grad(n, leaf)
        return got

    def _grad(self, n, leaf, lengths=None, t=None):
        if leaf.grad is None:
            return ("FAIL", f"no gradient reached {n[1:]}" + (" (None or detached)" if n in ("dbias", "dsinks") else ""))
        wrong = measure._wrong(leaf.grad, n, leaf.shape, leaf.dtype, self.device)
        if wrong:
            return ("FAIL", wrong)
        g = leaf.grad.detach() if lengths is None else self._back(leaf.grad, lengths, t)
        return g.to("cpu", torch.float64).numpy()

    def _grad_names(self):
        return ["dq", "dk", "dv"] + [n for n in ("dbias", "dsinks") if n[1:] in self.extra]

    def _split(self, result, q):
        wants_lse = "lse" in self.features
        if wants_lse:
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise _Fail(f"with lse the target must return (out, lse), got {type(result).__name__}")
            out, lse = result
        else:
            out, lse = result, None
        if not isinstance(out, torch.Tensor):
            raise _Fail(f"returned {type(out).__name__}, expected a tensor")
        wrong = measure._wrong(out, "output", tuple(q.shape[:-1]) + (self.case.dv,), q.dtype, self.device)
        if wrong:
            raise _Fail(wrong)
        if lse is not None:
            c = self.case
            shape = (c.heads, int(sum(c.seqlens_q))) if self.thd else (c.batch, c.heads, c.tq)
            if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != shape:
                got = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
                raise _Fail(f"wrong lse: {got}, expected shape {shape}")
            if lse.dtype not in (q.dtype, torch.float32):
                raise _Fail(f"wrong lse dtype: {lse.dtype}, expected {q.dtype} or torch.float32")
        return out, lse

    def _lse(self, lse):
        c = self.case
        lse = lse.detach()
        if self.thd:
            lse = feat.unpack(lse.transpose(0, 1), c.seqlens_q, c.tq, fill=-math.inf)
        return lse.to("cpu", torch.float64).numpy()


def _alibi_fa_form(gold_lse, case, align, slopes):
    """lse in FlashAttention's causal ALiBi form: + slope_h · (i + offset) per row."""
    offs = np.array(feat.dense.offsets(case.tq, case.tk, case.seqlens_q, case.seqlens_k, align, case.batch))
    i = np.arange(case.tq)[None, None, :] + offs[:, None, None]                  # (B, 1, Tq)
    return gold_lse + np.asarray(slopes)[None, :, None] * i


def run_feature_case(target, case, dtype, device, align="top-left", seed=0, features=(),
                     timeout=measure.DEFAULT_TIMEOUT):
    """The rows of ``target`` on the `features.FeatureCase` ``case``, each call of the
    target limited to ``timeout`` seconds (``measure.time_limit``)."""
    case_align = case.align or align
    if "varlen" in features:
        case = feat.with_lengths(case)
    tdtype = DTYPES[dtype]
    q, k, v, dout, extra = feat.draw(case, seed)
    round_to = lambda a, dt: torch.from_numpy(np.asarray(a)).to(dt).to(torch.float64).numpy()
    rounded = [round_to(a, tdtype) for a in (q, k, v, dout)]
    extra = {n: round_to(a, tdtype if n == "bias" else torch.float32) for n, a in extra.items()}
    names = ["out"] + (["lse"] if "lse" in features else [])
    if not case.forward_only:
        names += ["dq", "dk", "dv"] + [n for n in ("dbias", "dsinks") if n[1:] in extra]
    row = lambda tensor, **kw: Row(target=target.name, case=str(case), dims=case.as_dict(), dtype=dtype,
                                   device=device, tensor=tensor, align=case_align, **kw)
    refused = target.refuses(case, dtype, device, case_align)
    if refused:
        return [row(n, verdict="not supported", note=refused) for n in names]
    caller = _Caller(target, case, dtype, device, case_align, features, rounded, extra)
    caller.timeout = timeout
    got = _call(caller)
    if isinstance(got, str):
        return [row(n, verdict="not supported", note=got) for n in names]
    if isinstance(got, tuple):
        return [row(n, error=math.inf, verdict="FAIL", note=got[1]) for n in names]

    opts = feat.options(case, case_align, extra)
    dq_ = None if case.forward_only else rounded[3]
    gold_raw = reference.feature_golden(*rounded[:3], dq_, opts)
    base_raw = reference.feature_baseline(*rounded[:3], dq_, opts, tdtype, device)
    gold_raw = {n: gold_raw[n] for n in names}
    gold, base = judged(gold_raw), judged({n: base_raw[n] for n in names})
    unjudged = None
    if "lse" in names:
        unjudged = ~np.isfinite(gold["lse"])
        base["lse"] = np.where(unjudged, 0.0, base["lse"])
        gold["lse"] = np.where(unjudged, 0.0, gold["lse"])
    den, zero = _denominators(gold), _zero_by_theory(gold)
    rows, failing, bounds, arrays = {}, [], {}, {}
    for n in names:
        base_err, _, base_mean, _ = tensor_errors(base[n], gold[n], den[n])
        bounds[n] = tol.check_bound(dtype, base_err)
        if n in zero:
            bounds[n] = max(bounds[n], tol.CHECK_ZERO_FLOOR[dtype])
        value = got.get(n, ("FAIL", f"the target gave no {n}"))
        if isinstance(value, str):
            rows[n] = row(n, verdict="not supported", note=value)
            continue
        if isinstance(value, tuple):
            rows[n] = row(n, error=math.inf, baseline=base_err, bound=bounds[n], verdict="FAIL", note=value[1])
            failing.append(n)
            continue
        a = judged({n: value})[n]
        ref, note = gold[n], ""
        if n == "lse":
            a = np.where(unjudged, 0.0, a)
            if case.alibi:
                fa = np.where(unjudged, 0.0, judged({"lse": _alibi_fa_form(gold_raw["lse"], case, case_align,
                                                                            extra["alibi_slopes"])})["lse"])
                if tensor_errors(a, fa, den[n])[0] < tensor_errors(a, ref, den[n])[0]:
                    ref, note = fa, "lse in FlashAttention's causal ALiBi form (+slope j)"
                else:
                    note = "lse in the reference's ALiBi form"
            gold[n] = ref
        arrays[n] = a
        err, where, mean, cosine = tensor_errors(a, ref, den[n])
        mean_bound = max(tol.check_bound(dtype, base_mean), bounds[n] if n in zero else 0.0)
        ok = err <= bounds[n] and mean <= mean_bound
        if err <= bounds[n] and not ok:
            note = (note + "; " if note else "") + f"mean error {mean:.1e} above its bound {mean_bound:.1e}"
        rows[n] = row(n, error=err, baseline=base_err, bound=bounds[n], verdict="pass" if ok else "FAIL",
                      where=where, note=note, mean_error=mean, cosine=cosine)
        if not ok:
            failing.append(n)
    second = None
    if "deterministic" in features:
        second = _call(caller)
        for n in names:
            if n in arrays and not _bitwise(second, n, got):
                moved = tensor_errors(judged({n: second[n]})[n], judged({n: got[n]})[n], den[n])[0] \
                    if isinstance(second, dict) and isinstance(second.get(n), np.ndarray) else math.inf
                r = rows[n]
                r.verdict = "FAIL"
                r.note = (r.note + "; " if r.note else "") + f"not deterministic: a second call differs by {moved:.1e}"
                if n not in failing:
                    failing.append(n)
    if failing:
        _diagnose(failing, rows, arrays, gold, gold_raw, den, bounds, case, case_align, rounded, opts,
                  features, caller, second, got)
    return [rows[n] for n in names]


def _bitwise(second, n, got):
    return isinstance(second, dict) and isinstance(second.get(n), np.ndarray) and \
        np.array_equal(second[n], got[n], equal_nan=True)


def _call(caller):
    """The target's arrays; a str (not supported) or ("FAIL", why) when it cannot be judged."""
    try:
        with measure.time_limit(caller.timeout):
            return _call_once(caller)
    except measure.CaseTimeout:
        return ("FAIL", f"timed out after {caller.timeout:g} s")


def _call_once(caller):
    try:
        return caller()
    except targets.Unsupported as e:
        if caller.grads:                              # a backend with a forward only (FlexAttention on CPU)
            try:
                got = caller(grad=False)
            except targets.Unsupported:
                return _reason(e)
            except measure.RAISED as e2:
                return ("FAIL", _reason(e2))
            missing = f"forward only: {_reason(e)}"
            return {**got, **{n: missing for n in caller._grad_names()}}
        return _reason(e)
    except _Fail as e:
        return ("FAIL", _reason(e))
    except measure.RAISED as e:                       # a callable that raises FAILS
        return ("FAIL", _reason(e))


def _plain(case):
    return (case.hkv == case.heads and case.dv == case.head_dim and case.window is None and
            case.softcap is None and not case.alibi and case.bias_shape is None and case.sinks is None and
            case.seqlens_q is None)


def _diagnose(failing, rows, arrays, gold, gold_raw, den, bounds, case, align, rounded, opts, features,
              caller, second, got_raw):
    Diagnosis = diagnosis.Diagnosis
    result = {}
    for n in failing:                                  # what needs no recomputation
        note = rows[n].note
        if n in ("dbias", "dsinks") and "no gradient reached" in note:
            what = n[1:]
            result[n] = Diagnosis(f"{'bias' if what == 'bias' else 'sink'}-no-grad",
                                  f"{n}: no gradient reached {what} (None or detached): the {what} is used "
                                  "without its gradient")
        elif "not deterministic" in note:
            result[n] = Diagnosis("not-deterministic", f"{n} differs between two calls on the same inputs: "
                                  "the kernel is not deterministic (atomic adds, or a reduction in varying order)")
    if second is None and any(n not in result for n in failing):
        second = _call(caller)
    for n in failing:
        if n in result or n not in arrays or not isinstance(second, dict):
            continue
        if isinstance(second.get(n), np.ndarray):
            first, again = judged({n: got_raw[n]})[n], judged({n: second[n]})[n]
            moved = diagnosis.slice_errors(np.where(first == again, 0.0, again), np.where(first == again, 0.0, first),
                                           den[n]).max()
            if moved > bounds[n]:
                result[n] = Diagnosis("dropout", f"{n} changes between two calls on the same inputs (by "
                                      f"{moved:.1e}, bound {bounds[n]:.1e}): dropout left on, or another "
                                      "random draw in the kernel", moved, bounds[n])
    rest = [n for n in failing if n not in result and n in arrays]
    if rest:
        if case.tq * case.tk * case.batch * case.heads > diagnosis.DENSE_LIMIT:
            for n in rest:
                result[n] = Diagnosis("not-diagnosed", f"{n} not diagnosed: the case is too large for the "
                                      "dense float64 recomputation")
        else:
            result.update(_match(rest, arrays, gold, gold_raw, den, bounds, case, align, rounded, opts, features))
    _summaries(result, rows, arrays, gold, den, bounds, case)
    for n, d in result.items():
        rows[n].diagnosis = d


def _match(rest, arrays, gold, gold_raw, den, bounds, case, align, rounded, opts, features):
    unjudged = ~np.isfinite(judged({"lse": gold_raw["lse"]})["lse"]) if "lse" in gold else None

    def judge(raw):                         # a prediction, in the judged form, lse on the judged rows
        out = judged(raw)
        if unjudged is not None and "lse" in out:
            out["lse"] = np.where(unjudged, 0.0, out["lse"])
        return out
    hyps = feature_mistakes.catalogue(case, align, rounded, opts, gold_raw, judge, features)
    if _plain(case) and "dq" in gold:
        plain = Case(case.batch, case.heads, case.tq, case.tk, case.head_dim, case.causal)
        ref4 = {n: gold[n] for n in ("out", "dq", "dk", "dv")}
        known = {h.id for h in hyps}
        hyps += [h for h in mistakes.catalogue(plain, case.offset(align), align, tuple(rounded[:3]), rounded[3], ref4)
                 if h.id not in known]
    cache, result = {}, {}
    out_fits = diagnosis._out_fits(hyps, cache, arrays, gold["out"], den["out"], bounds["out"]) \
        if "out" in arrays else {}
    everything = (slice(None), slice(None))
    for n in rest:
        if not np.all(np.isfinite(arrays[n])):
            where = tuple(int(i) for i in np.unravel_index(np.argmax(~np.isfinite(arrays[n])), arrays[n].shape)[:3])
            result[n] = diagnosis.Diagnosis("non-finite", f"{n} has non-finite values where the reference is "
                                            f"finite (the first at (b, h, row) {where})")
            continue
        tried = hyps if n == "out" else [h for h in hyps if "out" not in h.tensors or out_fits.get(id(h), True)]
        result[n] = diagnosis._diagnose_tensor(n, tried, cache, arrays, gold, den[n], bounds[n], everything)
    return result


def _summaries(result, rows, arrays, gold, den, bounds, case):
    """What a user asks first, ahead of the sentence."""
    forward_ok = all(rows[n].passed for n in ("out", "lse") if n in rows)
    for n, d in result.items():
        lead = []
        if n in GRADS and forward_ok:
            lead.append("the output is right; only the backward is wrong")
        if case.seqlens_q is not None and case.batch > 1 and n in arrays and n != "dsinks":
            per_batch = diagnosis.slice_errors(arrays[n], gold[n], den[n]).max(axis=1)
            bad = [int(b) for b in np.nonzero(per_batch > bounds[n])[0]]
            if 0 < len(bad) < case.batch:
                word = "sequence" if len(bad) == 1 else "sequences"
                lead.append(f"only {word} {', '.join(map(str, bad))} of the batch")
        r = rows[n]
        if r.cosine is not None and r.cosine < 0:
            d.sentence += f"; {n} points the wrong way (cosine {r.cosine:.2f} with the reference)"
            if d.id == "none":
                d.id = "wrong-direction"
        if lead:
            d.sentence = "; ".join(lead) + ": " + d.sentence
