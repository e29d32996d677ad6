"""The mistakes production features invite, each recomputed in float64.

As in ``mistakes``, each entry is the reference computed *under that mistake*
on the same rounded inputs and upstream gradient (``dense.run`` with one knob
turned, gradients by autograd), and a failing tensor that sits within its bound
of one of them is named after it.  Arrays come back in the judged form of
``featured.judged`` (4-D, so that every tensor is sliced by (batch, head)).

===========================  ===================================================
id                           the kernel ...
===========================  ===================================================
gqa-repeat                   maps kv heads with ``repeat`` (h % Hkv) instead of
                             ``repeat_interleave`` (h // (Hq / Hkv))
gqa-grad-one-head            takes dk, dv of a kv head from one query head of
                             its group instead of summing over the group
window-left-wider/-narrower  the window one key off on its left edge
window-right-wider/-narrower the same on its right edge
window-swapped               (right, left) for (left, right)
window-other-alignment       the window placed with the other alignment
softcap-before-scale         c · tanh(q·k / c) · scale
softcap-no-derivative        the backward without tanh's 1 − tanh²
alibi-sign                   S + slope · |i − j|
alibi-reversed               the slopes in reverse head order
alibi-no-offset              |i − j| where |i + offset − j| is meant
bias-no-grad / sink-no-grad  the gradient never reaches bias / sinks
sink-ignored                 the sink left out of the softmax
varlen-neighbours            sequences see their neighbours' keys
varlen-dropped-last          the last sequence of the batch left out
lse-base-2 / lse-no-max      lse as log2, or log ℓ without the running max m
decode-top-left              decode queries placed top-left
===========================  ===================================================

Plus the chapter's mistakes that make sense with every feature (no causal mask,
the mask one diagonal off, the other alignment, the scale, the softmax axis, a
gradient missing its scale), recomputed with the case's features on.
"""

import math

import numpy as np

from parity_tests.kernels import dense
from parity_tests.kernels.mistakes import Hypothesis

__all__ = ["catalogue"]


def _other(align):
    return "bottom-right" if align == "top-left" else "top-left"


def _forward(judged, inputs, opts, **knobs):
    """A forward mistake: ``dense.run`` with ``opts`` changed and ``knobs`` turned."""
    q, k, v, dout = inputs

    def predict(grads=True):
        return judged(dense.run(q, k, v, dout if grads else None, opts, grads=grads, **knobs))
    return predict


def _packed_as_one(judged, inputs, opts, case):
    """Varlen without the document mask: the packed batch attended as one sequence."""
    q, k, v, dout = inputs
    lq, lk = case.seqlens_q, case.seqlens_k
    cat = lambda x, lens: np.concatenate([x[n, :, :t] for n, t in enumerate(lens)], axis=1)[None]
    one = {key: val for key, val in opts.items() if key not in ("seqlens_q", "seqlens_k")}

    def split(x, lens, t):
        out = np.zeros((len(lens),) + x.shape[1:2] + (t,) + x.shape[3:])
        start = 0
        for n, size in enumerate(lens):
            out[n, :, :size] = x[0, :, start:start + size]
            start += size
        return out

    def predict(grads=True):
        r = dense.run(cat(q, lq), cat(k, lk), cat(v, lk), cat(dout, lq) if grads else None, one, grads=grads)
        r["lse"] = r["lse"][..., None]
        got = {"out": split(r["out"], lq, case.tq), "lse": split(r["lse"], lq, case.tq)[..., 0]}
        if grads:
            got.update(dq=split(r["dq"], lq, case.tq), dk=split(r["dk"], lk, case.tk),
                       dv=split(r["dv"], lk, case.tk))
            if "dsinks" in r:
                got["dsinks"] = r["dsinks"]
        return judged(got)
    return predict


def _changed(golden_raw, judged, **arrays):
    return lambda grads=True: judged({**golden_raw, **arrays})


def catalogue(case, align, inputs, opts, golden_raw, judged, features):
    """The hypotheses that can be told apart from the reference on this feature case.

    inputs: (q, k, v, dout) float64, padded (B, H, T, D); opts: the reference's options
    (with the case's alignment); golden_raw: the reference's dict in its own shapes;
    judged: raw dict -> judged form."""
    fwd = lambda o=None, **knobs: _forward(judged, inputs, {**opts, **(o or {})}, **knobs)
    present = tuple(n for n in ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks") if n in golden_raw)
    H = lambda hid, says, predict, tensors=present: Hypothesis(hid, says, predict, tensors)
    return _features(case, align, inputs, opts, golden_raw, judged, features, fwd, present, H) + \
        _chapter(case, align, golden_raw, judged, fwd, H)


def _chapter(case, align, golden_raw, judged, fwd, H):
    """The chapter's mistakes, with the case's features on."""
    out = []
    if case.causal:
        out += [H("no-causal-mask", "no causal mask", fwd({"causal": False})),
                H("mask-one-future", "the causal mask shifted one diagonal (each query also sees "
                  "the next key)", fwd(shift=1)),
                H("mask-one-past", "the causal mask shifted one diagonal the other way (each "
                  "query misses its own key)", fwd(shift=-1))]
    if case.tq != case.tk and (case.causal or case.window or case.alibi):
        if case.feature == "decode" and align == "bottom-right":
            out.append(H("decode-top-left", "the decode queries placed top-left (query i sees keys j <= i; "
                         "bottom-right is meant: the last query sees every key)", fwd({"align": "top-left"})))
        else:
            out.append(H("other-alignment", f"{_other(align)} alignment (the check assumed {align})",
                         fwd({"align": _other(align)})))
    if case.head_dim > 1:
        out += [H("scale-1/D", "scale 1/D instead of 1/sqrt(D)", fwd({"scale": 1.0 / case.head_dim})),
                H("no-scale", "no scale (1 instead of 1/sqrt(D))", fwd({"scale": 1.0}))]
    if case.tq > 1:
        out.append(H("softmax-over-queries", "the softmax taken over the query axis instead of the "
                     "key axis", fwd(axis=-2)))
    if "dq" in golden_raw and case.tk > 1:
        s = case.scale
        out += [H("dq-missing-scale", "dq missing the scale",
                  _changed(golden_raw, judged, dq=golden_raw["dq"] / s), ("dq",)),
                H("dk-missing-scale", "dk missing the scale",
                  _changed(golden_raw, judged, dk=golden_raw["dk"] / s), ("dk",))]
    return out


def _features(case, align, inputs, opts, golden_raw, judged, features, fwd, present, H):
    """The features' own entries; they come first: where one coincides with a chapter
    mistake on a case (the other alignment of a 0-wide causal window), the feature's
    name is the answer."""
    out = []
    offsets = dense.offsets(case.tq, case.tk, case.seqlens_q, case.seqlens_k, align, case.batch)
    out += _gqa(case, inputs, opts, golden_raw, judged, fwd, H)
    out += _window(case, align, fwd, H)
    if case.softcap is not None:
        out += [H("softcap-before-scale", f"the softcap applied before the scale (c tanh(q.k / c) x scale, "
                  f"c = {case.softcap:g})", fwd(softcap_first=True)),
                H("softcap-no-derivative", "the softcap's derivative 1 - tanh^2 left out of the backward",
                  fwd(softcap_no_grad=True), tuple(n for n in present if n.startswith("d")))]
    if case.alibi:
        slopes = opts["alibi_slopes"]
        out.append(H("alibi-sign", "the ALiBi bias with its sign flipped (S + slope |i - j|)",
                     fwd({"alibi_slopes": -slopes})))
        if case.heads > 1:
            out.append(H("alibi-reversed", "the ALiBi slopes in reverse head order",
                         fwd({"alibi_slopes": slopes[::-1].copy()})))
        if any(offsets):
            out.append(H("alibi-no-offset", "the ALiBi distance |i - j| without the alignment's offset "
                         "(|i + offset - j| is meant)", fwd(alibi_no_offset=True)))
    if "dbias" in golden_raw:
        out.append(H("bias-no-grad", "the bias without its gradient (dbias = 0)",
                     _changed(golden_raw, judged, dbias=0 * golden_raw["dbias"]), ("dbias",)))
    if "dsinks" in golden_raw:
        no_sink = {key: val for key, val in opts.items() if key != "sinks"}
        ignored = _forward(judged, inputs, no_sink)
        out += [H("sink-ignored", "the sink left out of the softmax",
                  lambda grads=True: {**ignored(grads), "dsinks": judged({"dsinks": 0 * golden_raw["dsinks"]})["dsinks"]}),
                H("sink-no-grad", "the sinks without their gradient (dsinks = 0)",
                  _changed(golden_raw, judged, dsinks=0 * golden_raw["dsinks"]), ("dsinks",))]
    out += _varlen(case, inputs, opts, golden_raw, judged, H)
    if "lse" in present and "lse" in features:
        lse = golden_raw["lse"]
        out.append(H("lse-base-2", "lse in base 2 (log2 of the sum instead of the natural log)",
                     _changed(golden_raw, judged, lse=lse / math.log(2.0)), ("lse",)))
        m = _row_max(inputs, opts)
        out.append(H("lse-no-max", "lse without the running maximum added back (log l instead of m + log l)",
                     _changed(golden_raw, judged, lse=np.where(np.isfinite(lse), lse - m, lse)), ("lse",)))
    return out


def _row_max(inputs, opts):
    """m: each row's maximum score (the sink included), from the dense forward."""
    import torch
    q, k, v, _ = inputs
    t = lambda a: torch.as_tensor(a)
    kw = {n: opts[n] for n in ("scale", "causal", "align", "window", "softcap", "seqlens_q", "seqlens_k")
          if n in opts}
    for n in ("bias", "sinks", "alibi_slopes"):
        if opts.get(n) is not None:
            kw[n] = t(opts[n]).double()
    _, _, m = dense.attention(t(q), t(k), t(v), **kw, with_max=True)
    m = m.numpy()
    return np.where(np.isfinite(m), m, 0.0)


def _gqa(case, inputs, opts, golden_raw, judged, fwd, H):
    group = case.heads // case.hkv
    if group == 1:
        return []
    out = []
    if case.hkv > 1:
        out.append(H("gqa-repeat", "kv heads mapped with repeat (query head h reads kv head h % Hkv) "
                     "instead of repeat_interleave (h // (Hq/Hkv))", fwd(kv_map="repeat")))
    if "dk" in golden_raw:
        q, k, v, dout = inputs
        wide = lambda: dense.run(q, np.repeat(k, group, 1), np.repeat(v, group, 1), dout, opts)
        cache = {}

        def one_head(r):
            def predict(grads=True):
                if "wide" not in cache:
                    cache["wide"] = wide()
                w = cache["wide"]
                return judged({**golden_raw, "dk": w["dk"][:, r::group], "dv": w["dv"][:, r::group]})
            return predict
        for r in sorted({0, group - 1}):
            out.append(H("gqa-grad-one-head", f"dk, dv of each kv head taken from query head {r} of its "
                         f"group alone (not summed over the group's {group} heads)", one_head(r), ("dk", "dv")))
    return out


def _window(case, align, fwd, H):
    if case.window is None:
        return []
    left, right = case.window
    out = []
    edge = lambda side, w, what: H(f"window-{side}-{what}", f"the window one key {what} on its {side} edge "
                                   f"({w} for {case.window}: only the keys at the window's {side} edge differ)",
                                   fwd({"window": w}))
    if left >= 0:
        out.append(edge("left", (left + 1, right), "wider"))
        if left >= 1:
            out.append(edge("left", (left - 1, right), "narrower"))
    if right >= 0 and not case.causal:
        out.append(edge("right", (left, right + 1), "wider"))
        if right >= 1:
            out.append(edge("right", (left, right - 1), "narrower"))
    if left != right:
        out.append(H("window-swapped", f"the window's sides swapped ({(right, left)} for {case.window})",
                     fwd({"window": (right, left)})))
    if case.tq != case.tk:
        out.append(H("window-other-alignment", f"the window placed {_other(align)} (the causal mask and "
                     f"the check: {align})", fwd(window_align=_other(align))))
    return out


def _varlen(case, inputs, opts, golden_raw, judged, H):
    if case.seqlens_q is None:
        return []
    out = []
    if sum(1 for t in case.seqlens_q if t) > 1:
        out.append(H("varlen-neighbours", "no boundary between the packed sequences (each sees its "
                     "neighbours' keys)", _packed_as_one(judged, inputs, opts, case)))
    last = case.batch - 1

    def dropped(grads=True):
        g = {n: a.copy() for n, a in golden_raw.items()}
        for n in ("out", "dq", "dk", "dv"):
            if n in g:
                g[n][last] = 0.0
        if "lse" in g:
            g["lse"][last] = -np.inf
        return judged(g)
    out.append(H("varlen-dropped-last", f"the last sequence of the batch (sequence {last}) left out", dropped))
    return out
