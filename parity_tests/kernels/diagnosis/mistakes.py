"""The catalogue of mistakes attention kernels make, each recomputed in float64.

Each entry is the reference computed *under that mistake*, on the same rounded
inputs and upstream gradients: when a failing tensor sits within its bound of
one of them, that is what the kernel does.  A mistake is the one dense formula
(``dense.attention``) with an option changed or a knob turned, differentiated by
autograd (so dq, dk, dv are the gradients a kernel with that forward would
produce), or the reference with one tensor changed::

    S = scale Q K^T (masked)   P = softmax(S)   O = P V
    dV = P^T dO   dP = dO V^T   D = rowsum(dO ∘ O)   dS = P ∘ (dP - D)
    dQ = scale dS K            dK = scale dS^T Q

dV has no scale in it, so "missing the scale" applies to dQ and dK only.

The chapter's mistakes (`chapter`) apply to every case, with the case's features
on; each feature adds its own (``features/<name>.py``, its ``mistakes``), and
those come first: where one coincides with a chapter mistake on a case (the
other alignment of a 0-wide causal window), the feature's name is the answer.

A `Hypothesis` has an ``id`` (stable, for tests and JSON), the words that
complete "matches the reference with ...", and ``predict()`` -> a dict of the
tensors it models, float64 NumPy in the judged (4-D) form;
``predict(grads=False)`` gives the forward alone, without autograd (a forward
mistake that does not reproduce the output is not tried on the gradients).
Two entries are judged elsewhere, since no recomputation reproduces them:
dropout left on (the kernel disagrees with itself on a second call) and a
wrong softmax denominator (out is the reference with each row multiplied by
its own factor, fitted row by row); see ``diagnosis``.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from parity_tests.kernels import dense
from parity_tests.kernels.features import INPUT_GRADS, REGISTRY

__all__ = ["Hypothesis", "Context", "catalogue", "backward_twins", "option_twins", "whole_case", "padding_seen",
           "STALE_BLOCKS"]

# Key-block sizes tried for the stale running maximum (a kernel's B_c is not known).
STALE_BLOCKS = (16, 32, 64, 128, 256)
# Key-tile sizes tried for the slips of a kernel's last partial tile (dropped, padded, its diagonal)
KEY_TILES = (16, 32, 64, 128)
# head-dim blocks a kernel may load in place of all D channels (D above the block)
HEAD_DIM_BLOCKS = (32, 64, 128)


@dataclass
class Hypothesis:
    id: str
    says: str
    predict: object          # (grads=True) -> {tensor: array}; grads=False: the forward alone
    tensors: tuple = ("out", "dq", "dk", "dv")
    fitted: tuple = ()       # the tensors it was fitted to: it explains those only with FIT_SHARE left


class Context:
    """What a mistake is recomputed from: the case, its alignment, the rounded inputs
    (q, k, v, dout) and upstream lse gradient, the reference's options and result
    (``golden_raw``, its own shapes), and ``judged`` (raw dict -> judged form).  ``rows``:
    (first, total) when q, dout, dlse and the row-wise results hold a block of query rows
    of a long case (``row_block``; k, v, dk and dv whole).  ``arrays``: every rounded input by
    name, those only the kernel receives included (FP8's descales)."""

    def __init__(self, case, align, inputs, dlse, opts, golden_raw, as_4d, wanted, rows=None, arrays=None):
        self.case, self.align, self.inputs, self.dlse, self.opts = case, align, inputs, dlse, opts
        self.arrays = arrays or {}
        self.rows = rows
        self.golden_raw, self.as_4d, self.wanted = golden_raw, as_4d, wanted
        self.present = tuple(n for n in ("out", "lse", "dq", "dk", "dv") + INPUT_GRADS if n in golden_raw)
        self.other_align = "bottom-right" if align == "top-left" else "top-left"
        lens = case.seqlens or (None, None)
        self.offsets = dense.offsets(case.tq, case.tk, lens[0], lens[1], align, case.batch)
        # the other alignment differs where some sequence's Tq != Tk (a varlen batch's, even when the case's are equal)
        self.aligned_apart = list(self.offsets) != list(
            dense.offsets(case.tq, case.tk, lens[0], lens[1], self.other_align, case.batch))

    def dense(self, q, k, v, dout, opts, grads=True, dlse="same", **knobs):
        """``dense.run`` in float64 with the case's upstream gradients (``dlse``: another, or None)."""
        dlse = self.dlse if isinstance(dlse, str) and dlse == "same" else dlse
        return dense.run(q, k, v, dout if grads else None, opts, grads=grads,
                         dlse=dlse if grads and dout is not None else None, rows=self.rows, **knobs)

    def fwd(self, changes=None, dlse="same", inputs=None, **knobs):
        """A forward mistake: the dense formula with ``changes`` to the options, ``knobs`` turned
        (``inputs``: {name: array} read in place of q, k or v)."""
        q, k, v, dout = self.inputs
        q, k, v = (inputs or {}).get("q", q), (inputs or {}).get("k", k), (inputs or {}).get("v", v)
        opts = {**self.opts, **(changes or {})}

        def predict(grads=True):
            return self.as_4d(self.dense(q, k, v, dout, opts, grads=grads, dlse=dlse, **knobs))
        seen = {**(changes or {}), **knobs}
        if seen and not inputs and set(seen) <= set(dense.SCORES):
            predict.scores = seen             # it changes only the scores (`option_twins`) ...
            if set(seen) <= set(dense.VISIBILITY):
                predict.visible = seen        # ... or only which keys a query sees (`backward_twins`)
        return predict

    def changed(self, **arrays):
        """The reference with some tensors replaced (``from_reference``: no recomputation, so
        judged on whole tensors even on a block of rows)."""
        predict = lambda grads=True: self.as_4d({**self.golden_raw, **arrays})
        predict.from_reference = True
        return predict

    def H(self, hid, says, predict, tensors=None):
        return Hypothesis(hid, says, predict, self.present if tensors is None else tensors)

    def row_max(self):
        """m: each row's maximum score (the sink included), from the dense forward."""
        q, k, v, _ = self.inputs
        t = lambda a: torch.as_tensor(a).double()
        m = dense.attention(t(q), t(k), t(v), **dense.keywords(self.opts), rows=self.rows, with_max=True)[2].numpy()
        return np.where(np.isfinite(m), m, 0.0)


def catalogue(ctx):
    """The hypotheses that can be told apart from the reference on this case: the
    features' own (the case's, then the run's own such as lse's), then the chapter's."""
    out = []
    for name, value in ctx.case.features:
        if name in REGISTRY:
            out += REGISTRY[name].mistakes(ctx, value)
    for name in ctx.wanted:
        if REGISTRY[name].calling.run_wide and ctx.case.get(name) is None:
            out += REGISTRY[name].mistakes(ctx, True)
    known = {(h.id, h.says) for h in out}
    return out + [h for h in chapter(ctx) if (h.id, h.says) not in known]


def chapter(ctx):
    """The chapter's mistakes, and the blockwise kernel's, with the case's features on."""
    case, fwd, H = ctx.case, ctx.fwd, ctx.H
    out = []
    if case.causal:
        out += [H("no-causal-mask", "no causal mask", fwd({"causal": False})),
                H("mask-one-future", "the causal mask shifted one diagonal (each query also sees "
                  "the next key)", fwd(shift=1)),
                H("mask-one-past", "the causal mask shifted one diagonal the other way (each "
                  "query misses its own key)", fwd(shift=-1))]
    if max(case.tq + max(abs(o) for o in ctx.offsets), case.tk) > 256:     # bfloat16's integers end at 256
        out.append(H("mask-positions-bfloat16", "the positions the mask compares (arange(Tq) + offset, "
                     "arange(Tk)) formed in bfloat16: past 256 they round, and rows see keys after them or "
                     "miss their own", fwd(mask_positions_dtype=torch.bfloat16)))
    features = [REGISTRY[n] for n, _ in case.features if n in REGISTRY]
    aligned = any(f.judging.aligned for f in features)
    if ctx.aligned_apart and (case.causal or aligned):
        hid, says = "other-alignment", (f"{ctx.other_align} {'alignment' if aligned else 'causal alignment'} "
                                        f"(the check assumed {ctx.align})")
        for f in features:                     # a feature's own name for it (decode: the queries placed top-left)
            named = f.judging.alignment_mistake(ctx) if f.judging.alignment_mistake is not None else None
            if named:
                hid, says = named
                break
        out.append(H(hid, says, fwd({"align": ctx.other_align})))
    if case.causal and any(ctx.offsets):
        out.append(H("offset-sign", "the alignment's offset with its sign flipped (query i seeing keys j <= i - "
                     "offset, offset = Tk - Tq: Tq - Tk written where Tk - Tq is meant)",
                     fwd(shift=[-2 * o for o in ctx.offsets])))
    d = case.head_dim
    if d > 1:
        default = 1.0 / math.sqrt(d)
        twice = " (the scale applied twice: q scaled before a kernel that scales too)" \
            if math.isclose(case.scale, default) else ""
        out += [H("scale-1/D", f"scale 1/D instead of 1/sqrt(D){twice}", fwd({"scale": 1.0 / d})),
                H("no-scale", "no scale (1 instead of 1/sqrt(D))", fwd({"scale": 1.0}))]
        if not twice and not math.isclose(case.scale ** 2, 1.0 / d):
            out.append(H("scale-twice", f"the scale applied twice ({case.scale:.4g}^2 = {case.scale ** 2:.4g}: q "
                         "scaled before a kernel that scales too)", fwd({"scale": case.scale ** 2})))
        if not math.isclose(case.scale, default):
            out.append(H("scale-ignored", f"the scale argument ignored (1/sqrt(D) = {default:.4g} used instead "
                         f"of the {case.scale:.4g} given)", fwd({"scale": default})))
    whole = whole_case(case) if ctx.rows is None else {}      # every query row at once: not on a block
    if "softmax-over-queries" in whole:
        out.append(H("softmax-over-queries", "the softmax taken over the query axis instead of the "
                     "key axis", fwd(axis=-2)))
    if "layout-bthd-as-bhtd" in whole:
        out.append(H("layout-bthd-as-bhtd", "(B, T, H, D) read as (B, H, T, D): attention across the "
                     "heads instead of the tokens", _swapped(ctx)))
    if "out" in ctx.present:
        blocks = [block for block in STALE_BLOCKS if case.tk > block]
        out += [H("stale-max", f"a stale running maximum (key blocks of {block} not rescaled when the "
                  "maximum moves)", fwd(online=("stale", block))) for block in blocks]
        out += [H("acc-not-rescaled", f"the output accumulator not rescaled by exp(m_old - m_new) when the "
                  f"maximum moves while the running sum l is (key blocks of {block})", fwd(online=("acc", block)))
                for block in blocks]
        out += [H("acc-rescaled-late", "the output accumulator rescaled by exp(m_old - m_new) after each key "
                  "block's P V is added instead of before (the first block a row reads lost, each later one shrunk "
                  f"where the maximum moves; key blocks of {block})", fwd(online=("acc-late", block)))
                for block in blocks + [case.tk]]                 # one block: the whole output lost
        out += [H(f"rescale-{wrong}-for-{right}", f"the running rescale {right}(m_old - m_new) of a {base} kernel "
                  f"taken with {wrong} (each factor raised to the power {power}: key blocks read before the maximum "
                  f"moves weigh too {less}; key blocks of {block})", fwd(online=(f"rescale-{wrong}", block)))
                for right, wrong, base, power, less in (("exp2", "exp", "base-2", "log2(e)", "little"),
                                                        ("exp", "exp2", "base-e", "ln 2", "much"))
                for block in blocks]
        out += [H("max-not-carried", f"each key block's weights exp(S - m_block) taken against that block's own "
                  f"maximum, not the running one (l and acc rescaled as they should; key blocks of {block})",
                  fwd(online=("own-max", block))) for block in blocks]
        out += [H("l-starts-at-one", "the running sum l started at 1 instead of 0 (" +
                  (f"key blocks of {block}: the 1 stays in the denominator as exp(m_first - m), m_first the "
                   "first block's maximum)" if block < case.tk else "one pass: l = 1 + sum exp(S - m))"),
                  fwd(online=("l-one", block))) for block in blocks + [case.tk]]
    if "out" in ctx.present and case.tk > 1:
        out.append(H("scores-flat", "weights flat over the keys each row sees (its scores about 0: q·k scaled "
                     "far down, or lost)", fwd({"scale": 0.0}), ("out", "dv")))
    out += _option_factors(ctx) + _hidden_scored(ctx)
    out += _kernel_bugs(ctx)
    if "dq" in ctx.present and case.tk > 1 and ctx.opts.get("sinks") is None:
        grads = tuple(n for n in ctx.present if n != "out" and n != "lse")
        if case.causal:
            out.append(H("backward-unmasked", "a backward without the causal mask its forward applies (P = "
                         "exp(S - lse) recomputed over every key)", fwd(backward_options={"causal": False}), grads))
        else:
            out.append(H("backward-masked", "a backward that applies a causal mask its forward does not (P = "
                         "exp(S - lse) recomputed under the causal mask: a backward written for causal "
                         "attention only)", fwd(backward_options={"causal": True}), grads))
        other = "causal" if not case.causal else "non-causal"
        out.append(H("backward-other-mask", f"the gradients of the {other} attention (its own softmax and output) "
                     f"in place of this one's: a backward written for {other} attention only",
                     fwd({"causal": not case.causal}), grads))
        out += [H("backward-lse-base-2", "the backward's P = 2^(S log2(e) - lse) recomputed from the natural-log lse "
                  "(base 2 where e is meant: P off by exp((1 - ln 2) lse) per row)",
                  fwd(backward_lse=lambda lse, first: lse * math.log(2)), grads),
                H("backward-lse-base-e", "the backward's P = exp(S - lse) recomputed from an lse in base 2 (P off "
                  "by exp((1 - log2(e)) lse) per row)", fwd(backward_lse=lambda lse, first: lse / math.log(2)), grads)]
    if "dq" in ctx.present and case.tk > 1:
        g, s = ctx.golden_raw, case.scale
        out += [H("backward-no-D", "the backward's D = rowsum(dO ∘ O) term dropped", fwd(no_delta=True),
                  ("dq", "dk")),
                H("dq-missing-scale", "dq missing the scale", ctx.changed(dq=g["dq"] / s), ("dq",)),
                H("dk-missing-scale", "dk missing the scale", ctx.changed(dk=g["dk"] / s), ("dk",))]
    g = ctx.golden_raw
    out += [H("gradient-negated", f"{n} with its sign flipped (+ where − is meant)", ctx.changed(**{n: -g[n]}), (n,))
            for n in ("dq", "dk", "dv") + INPUT_GRADS if n in ctx.present]
    return out


# A numeric option off by one of these factors (id suffix, words): a formula written in base 2
# where e is meant (or the other way), a factor 2 or 1/2, an array option's sign flipped.
OPTION_FACTORS = (("ln2", math.log(2), "ln 2 (in base 2 where e is meant)"),
                  ("log2e", 1 / math.log(2), "log2(e) (in base e where 2 is meant)"),
                  ("doubled", 2.0, "2"), ("halved", 0.5, "1/2"), ("negated", -1.0, "-1 (its sign flipped)"))


def positive_scalars(opts):
    """{name: value} of the case's positive real options (the scale, a softcap), a probability
    (dropout_p) left out: the numbers a formula may use on the wrong side."""
    return {n: v for n, v in opts.items() if isinstance(v, float) and v > 0 and n != "dropout_p"}


def _option_factors(ctx):
    """Each numeric option of the case (the scale, a softcap, per-head slopes or sinks, a bias)
    multiplied by each of `OPTION_FACTORS`, and the others by the scale or its inverse (added
    before the scores are scaled, or divided by it): the sign only for arrays (a cap's sign does
    not change c·tanh(S / c)), never a probability."""
    out = []
    scale = ctx.opts.get("scale")
    by_scale = (("scaled", scale, "the scale (applied before the scores are scaled)"),
                ("unscaled", 1 / scale, "1/scale (divided by the scale)")) if scale else ()
    scalars = positive_scalars(ctx.opts)
    for name, value in ctx.opts.items():
        array = isinstance(value, np.ndarray) and value.dtype.kind == "f" and np.any(value)
        scalar = name in scalars
        factors = OPTION_FACTORS + (by_scale if name != "scale" else ())
        for tag, factor, words in factors if array or scalar else ():
            if scalar and factor < 0:
                continue
            out.append(ctx.H(f"{name}-times-{tag}", f"{name} multiplied by {words}", ctx.fwd({name: value * factor})))
    return out


def _hidden_scored(ctx):
    """The keys a query must not see given a finite score instead of −∞, so that each row also
    weighs them by exp(c − m): c = −v for each positive numeric option v (a cap c·tanh applied
    after the mask gives −c), −10000 (a finite mask constant), 0 (masked to zero).  Only where
    some key is hidden from some query."""
    case, opts = ctx.case, ctx.opts
    if not (case.causal or opts.get("seqlens_k") is not None or
            any(opts.get(n) is not None for n in dense.VISIBILITY if n not in ("causal", "align"))):
        return []
    values = [(f"minus-{n}", -v, f"-{n} (the {n} applied after the mask: c tanh(-inf) = -c)")
              for n, v in positive_scalars(opts).items() if n != "scale"]
    values += [("finite", -1e4, "-10000 (a finite mask constant)"), ("zero", 0.0, "0 (masked to zero, not to -inf)")]
    return [ctx.H(f"hidden-scored-{tag}", f"the hidden keys scored {words} instead of -inf: each row also weighs "
                  "the keys it must not see", ctx.fwd(finite_mask=value)) for tag, value, words in values]


def backward_twins(ctx, hyps):
    """For each of ``hyps`` that changes only which keys a query sees (a mask, a window edge, an
    alignment), its backward-only twin: the forward right, and the backward's P = exp(S − lse)
    recomputed under that visibility (`dense._recomputed_backward`), as a fused backward that builds
    its own mask gets it wrong.  Not with sinks (their column is not masked), nor with one key."""
    if "dq" not in ctx.present or ctx.case.tk <= 1 or ctx.opts.get("sinks") is not None:
        return []
    grads = tuple(n for n in ctx.present if n not in ("out", "lse"))
    made = [{"causal": not ctx.case.causal}]            # the chapter's own (backward-unmasked, -masked)
    out = []
    for h in hyps:
        seen = getattr(h.predict, "visible", None)
        if seen is None or seen in made:
            continue
        made.append(seen)
        out.append(ctx.H(f"backward-{h.id}", f"a backward that recomputes P = exp(S - lse) under {h.says}, its "
                         "forward right", ctx.fwd(backward_options=seen), grads))
    return out


def option_twins(ctx, hyps):
    """The backward-only twin of each of ``hyps`` that changes only the scores (an option's value,
    the form of a formula: `dense.SCORES`), and of each option of the scores left out: the forward
    right, the backward's P = exp(S' − lse) recomputed from those other scores S', then the right
    backward of that P' (`dense._recomputed_backward`), as a fused backward that recomputes its
    scores by its own code gets it wrong (ALiBi left out there, a sink scaled there).  Those of
    `backward_twins` left out; with one key, none."""
    if "dq" not in ctx.present or ctx.case.tk <= 1:
        return []
    grads = tuple(n for n in ctx.present if n not in ("out", "lse"))
    tried = [(f"backward-{h.id}", h.predict.scores, f"with {h.says}") for h in hyps
             if getattr(h.predict, "scores", None) is not None and getattr(h.predict, "visible", None) is None]
    tried += [(f"backward-without-{n}", {n: None}, f"without the {n}") for n in dense.SCORES   # the terms a
              if n not in ("causal", "scale") and ctx.opts.get(n) is not None              # backward can drop
              and not isinstance(ctx.opts[n], (bool, str))]
    d = ctx.case.head_dim
    tried += [("backward-head-dim-block", {"channels": cut}, f"and dP = dO V^T from the first {cut} of {d} head-dim "
               f"channels alone (a head-dim block of {cut}; the gradient's channels {cut} .. {d - 1} never written)")
              for cut in HEAD_DIM_BLOCKS if d > cut]
    return [ctx.H(hid, f"a backward that recomputes P = exp(S - lse) {says}, its forward right",
                  ctx.fwd(backward_options=changes), grads) for hid, changes, says in tried]


def whole_case(case):
    """{id: words} of the chapter's mistakes on ``case`` that need every query row at once
    (so are not tried on a block of rows, ``row_block``)."""
    out = {}
    if case.tq > 1:
        out["softmax-over-queries"] = "the softmax over the query axis"
    if case.tq == case.tk > 1 and not any(n in REGISTRY for n, _ in case.features):
        out["layout-bthd-as-bhtd"] = "(B, T, H, D) read as (B, H, T, D)"
    return out


def _keys_cut(ctx, n):
    """The options with every sequence's keys cut at ``n`` (the alignment's offset unchanged:
    the dense formula places the diagonal by Tk, not by the cut)."""
    own = ctx.opts.get("seqlens_k")
    return {"seqlens_k": np.minimum(own, n) if own is not None else np.full(ctx.case.batch, n)}


def _kernel_bugs(ctx):
    """The slips of a hand-written kernel: strides, tiles, rows never stored, split merges."""
    case, fwd, H, out = ctx.case, ctx.fwd, ctx.H, []
    q, k, v, _ = ctx.inputs
    if case.batch > 1:
        out.append(H("batch-stride", "every batch entry reading batch 0's keys and values (the batch "
                     "stride left out)", _reshaped(fwd(inputs={"k": np.repeat(k[:1], case.batch, 0),
                                                                "v": np.repeat(v[:1], case.batch, 0)}),
                                                   _onto_batch_0)))
    for cut in HEAD_DIM_BLOCKS:
        if case.head_dim > cut:
            trunc = {"q": q[..., :cut], "k": k[..., :cut], "v": np.where(np.arange(v.shape[-1]) < cut, v, 0.0)}
            pad = lambda g, d=case.head_dim: np.concatenate([g, np.zeros(g.shape[:-1] + (d - g.shape[-1],))], -1)
            out.append(H("head-dim-truncated", f"head dims above {cut} truncated (q.k over the first {cut} "
                         f"channels, output channels from {cut} on never written)",
                         _reshaped(fwd(inputs=trunc), lambda r: {**r, **{n: pad(r[n]) for n in ("dq", "dk") if n in r}})))
    if "out" not in ctx.present:
        return out
    cuts = {}
    for tile in KEY_TILES:
        if case.tk % tile and case.tk // tile:
            cuts.setdefault(case.tk // tile * tile, []).append(str(tile))
    for whole, tiles in cuts.items():
        sizes = tiles[0] if len(tiles) == 1 else ", ".join(tiles[:-1]) + " or " + tiles[-1]
        out.append(H("last-key-tile-dropped", f"the last partial key tile dropped (keys {whole} .. {case.tk - 1} "
                     f"past the last whole tile of {sizes})", fwd(_keys_cut(ctx, whole))))
    out += _padding_seen(ctx) + _last_tile_diagonal(ctx)
    if case.tk > case.tq > 1 and not case.seqlens:
        out.append(H("keys-bounded-at-tq", f"the key loop stopping at Tq = {case.tq} (keys {case.tq} .. "
                     f"{case.tk - 1} never visited)", fwd(_keys_cut(ctx, case.tq))))
        past = lambda x: np.where(np.arange(case.tk)[:, None] < case.tq, x, 0.0)
        out.append(H("keys-read-as-zero-at-tq", f"k and v rows {case.tq} .. {case.tk - 1} loaded as 0 (a load masked "
                     f"at Tq = {case.tq} where Tk is meant; each such key still weighed, its score 0)",
                     fwd(inputs={"k": past(k), "v": past(v)})))
    widths = {}                                  # keys per split: by a count of splits, or fixed
    for splits in (2, 3, 4):
        widths.setdefault(-(-case.tk // splits), f"{splits} split-KV partials")
    for width in STALE_BLOCKS:
        widths.setdefault(width, f"split-KV partials of {width} keys")
    for width, what in widths.items():
        if case.tk > width:
            out.append(H("split-no-rescale", f"{what} merged without their rescale exp(m_s - m) (each "
                         "partial relative to its own maximum)", fwd(online=("split", width))))
    if case.causal and case.offset(ctx.align) < 0:
        out.append(H("finite-mask", "a finite mask value (finfo.min) in place of -inf: rows that see no key "
                     "return the mean of v instead of 0", fwd(finite_mask=True)))
    g, first = ctx.golden_raw, (ctx.rows or (0,))[0]
    for n in ("out", "dq"):
        if n in g and case.tq > 1:
            for row in (0, case.tq - 1):
                if not 0 <= row - first < g[n].shape[-2]:           # not in this block of rows
                    continue
                changed = g[n].copy()
                changed[..., row - first, :] = 0.0
                out.append(H("row-not-stored", f"{n} of query row {row} never stored (left 0)",
                             ctx.changed(**{n: changed}), (n,)))
    return out


def _last_tile_diagonal(ctx):
    """The causal mask one key off on its diagonal in the last partial key tile only (the
    boundary tile's own mask written with j < i where the others use j <= i): each query whose
    own key lies there misses it.  As a bias of −inf on those keys, on causal cases without a
    bias, lengths or a dropout mask of their own, where every such query still sees key 0."""
    case = ctx.case
    if not case.causal or case.seqlens or any(ctx.opts.get(o) is not None for o in ("bias", "seqlens_k", "keep")):
        return []
    o = case.offset(ctx.align)
    first = (ctx.rows or (0,))[0]                       # a block of rows holds rows first .. of the case
    i = first + np.arange(ctx.inputs[0].shape[-2])[:, None]
    j = np.arange(case.tk)[None, :]
    out, done = [], set()
    for tile in KEY_TILES:
        start = case.tk // tile * tile
        if not case.tk % tile or start == 0 or start in done or start <= o:
            continue
        done.add(start)
        bias = np.where((j == i + o) & (j >= start), -np.inf, 0.0)
        if not bias.any():
            continue
        out.append(ctx.H("last-tile-mask-one-past", f"the causal mask shifted one diagonal the other way in the last "
                         f"partial key tile only (keys {start} .. {case.tk - 1}, tiles of {tile}: each query whose own "
                         "key lies there misses it)", ctx.fwd({"bias": bias})))
    return out


def _padding_seen(ctx):
    """The keys a kernel pads Tk with to whole tiles left unmasked (`padding_seen`)."""
    case = ctx.case
    pads = {}
    for tile in KEY_TILES:
        if case.tk % tile:
            pads.setdefault(-(-case.tk // tile) * tile - case.tk, f"key tiles of {tile}")
    return [h for n, what in sorted(pads.items()) for h in padding_seen(ctx, n, what)]


def padding_seen(ctx, n, what):
    """[the hypothesis] that ``n`` zero keys padding Tk to ``what`` were left unmasked (score 0,
    value 0: each row's softmax counts exp(0 − m) once per padded key); [] on cases where a
    key's position matters otherwise (a mask, a bias, ALiBi, a window, per-sequence lengths, a
    dropout mask)."""
    case, (_, k, v, _) = ctx.case, ctx.inputs
    if case.causal or case.seqlens or any(ctx.opts.get(o) is not None
                                          for o in ("bias", "alibi_slopes", "window", "seqlens_k", "keep")):
        return []
    zeros = lambda a: np.zeros(a.shape[:-2] + (n,) + a.shape[-1:])
    padded = {"k": np.concatenate([k, zeros(k)], -2), "v": np.concatenate([v, zeros(v)], -2)}
    trim = lambda r, tk=case.tk: {m: a[..., :tk, :] if m in ("dk", "dv") else a for m, a in r.items()}
    keys = "zero key that pads" if n == 1 else "zero keys that pad"
    return [ctx.H("padding-seen", f"the {n} {keys} Tk = {case.tk} to {what} left unmasked (each counted in "
                  "the softmax as a score of 0)", _reshaped(ctx.fwd(inputs=padded), trim))]


def _reshaped(predict, change):
    """A prediction with ``change`` applied to its dict of tensors."""
    return lambda grads=True: change(predict(grads))


def _onto_batch_0(r):
    """Keys read from batch 0 by every batch entry: their gradients all land on batch 0."""
    moved = {n: np.concatenate([r[n].sum(0, keepdims=True), 0 * r[n][1:]]) for n in ("dk", "dv") if n in r}
    return {**r, **moved}


def _swapped(ctx):
    """(B, T, H, D) read as (B, H, T, D): the plain formula on the tensors with T and H exchanged."""
    q, k, v, dout = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in ctx.inputs)
    opts = {n: ctx.opts[n] for n in ("scale", "causal", "align")}

    def predict(grads=True):
        r = dense.run(q, k, v, dout if grads else None, opts, grads=grads)
        return ctx.as_4d({n: r[n].swapaxes(1, 2) for n in ("out", "dq", "dk", "dv") if n in r})
    return predict
