"""Name the mistake behind a failing tensor.

For each failing tensor, in this order:

0. What needs no recomputation: a gradient that never reached bias or sinks, a
   kernel that is not deterministic.
1. *NaN or infinity*: how many entries, in which rows, and -- when the case has
   query rows that see no key (causal, bottom-right, Tq > Tk) -- what the check
   expects there and why.  No formula of the catalogue gives a NaN, and a NaN
   differs from itself, so this comes before the second call below.
2. *Dropout left on* (or any random draw): the target is called a second time on
   the same inputs; if the tensor moves by more than its bound, no fixed
   formula can explain it, and that is the diagnosis.
3. The catalogue (``mistakes``: the chapter's and the case's features'; where out is
   right, with the backward-only twins of its visibility mistakes, and where those explain
   nothing, of every mistake of the scores, `mistakes.option_twins`, and a gradient's
   product formed otherwise, `_backward_products`), plus the readings
   fitted to the target's own tensors (`FITTED`, fewest fitted numbers first: one
   factor on a tensor, lse's maximum added back k times, the last keys no query sees,
   each sequence's offset, a per-slice value read from another slice, another head map
   for dk and dv, a broadcast gradient summed over some slices, a sink counted another
   number of times, a *wrong softmax denominator* for out (each row the reference
   times its own factor c_i), a backward's D or P off row by row): each
   hypothesis's residual is the tensor's error measured
   against the hypothesis instead of the reference, with the same denominator;
   the smallest residual within the tensor's bound is the match: "out matches
   the reference with bottom-right causal alignment to 3e-07 (bound 2e-06)".
   The bound is the *reference's* rounding budget; a mistake that sharpens the
   softmax (no scale, 1/D) rounds more than the reference does in the kernel's
   dtype, so a residual above the bound also matches when it is at most
   `MATCH_SHARE` of the error against the reference (and `MATCH_WITHIN` bounds).
4. Slice by slice: when no hypothesis explains the whole tensor, the (batch,
   head) slices that fail are compared on their own -- one head with a mistake
   and the others right reads "head 1 matches ... ; the other slices match the
   reference".
5. A case too large to recompute whole: on its worst (batch, head) slice, or,
   when that is too large too, on a block of that slice's query rows
   (``row_block``: out, lse and dq exactly; dk and dv only against the mistakes
   the reference itself gives, else "not judged"); the sentence says which part.
6. Otherwise "matches none of the catalogued mistakes", with the closest one
   when it comes closer than the reference; then, when the error is the size of
   a plain computation's in a lower precision, that is said instead.

What is not claimed: a mistake whose prediction is zero everywhere (any kernel
returning zeros matches it: the shifted mask at T = 1), or zero on each slice it is
matched on; a reading fitted to the target that is zero on every row where the target
is off and blank (a range of keys read as none says no more than "nothing written"); a
fitted denominator with a factor <= 0 or with one key (it then fits any multiple of v).  When out
passed, its gradients are tried only against backward mistakes, and their
sentence begins "the output is right; only the backward is wrong".

A pattern across cases -- the error growing with the sequence length -- is
found afterwards, over the rows of a whole run (``report``).
"""

import copy
import functools
import itertools
import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from parity_tests.common import capabilities
from parity_tests.common import tolerances as tol
import parity_tests.kernels.diagnosis.mistakes as mistakes
from parity_tests.kernels import dense, targets
from parity_tests.kernels.cases import offset_of
from parity_tests.kernels.diagnosis import poisoned, row_block, weights
from parity_tests.kernels.diagnosis.location import TILES, locate, ranges
from parity_tests.kernels.features import INPUT_GRADS, INPUTS, NO_GRAD, PER_HEAD, key_ranges, per_head, stored_inputs

__all__ = ["Diagnosis", "Evidence", "diagnose", "slice_errors", "rounding_ceiling", "DENSE_LIMIT"]

# Dense float64 recomputation: at most this many (query, key) pairs in all
# (2^25 x 8 bytes = 256 MiB per array).  Larger cases are diagnosed on the
# (batch, head) slice holding the largest error, if that slice fits; else on a
# block of that slice's query rows around its worst row (``row_block``).
DENSE_LIMIT = 2 ** 25

GRADS = ("dq", "dk", "dv") + INPUT_GRADS           # with those of the extra inputs: dbias, dsinks

# The per-row factor of the "wrong denominator" entry is fitted to the target's
# output, so it always explains *some* of the error; it counts only when what
# is left is at most this share of the error (a true row scaling leaves rounding).
FIT_SHARE = 0.1
# Hypotheses fitted to the target, fewest fitted parameters first: a catalogued mistake that
# explains as well wins over them, and among them the first that explains is named (a tensor off
# by one factor is also each row off by its own).
FITTED = ("constant-factor", "lse-offset", "lse-max-factor", "axes-permuted", "state-carried", "keys-unseen",
          "last-tile-only", "keys-weighted", "sequence-offsets", "slice-values", "head-map", "dq-head-map",
          "broadcast-sum", "backward-blocks", "backward-counts", "tile-factors", "rows-weighted", "rows-rescaled",
          "key-tile-ranges", "tile-masks", "key-spans", "sink-counted", "sink-weighed", "rows-moved", "scores-scaled",
          "denominator", "deferred-rescale", "tiles-weighted", "tiles-left-out", "tiles-scaled", "values-read-as-zero",
          "wrong-delta", "dp-scaled", "backward-p-scaled", "out-channels-moved", "blocks-unmasked")

# A catalogued mistake that leaves at most this share of the error against the
# reference explains the tensor, even where its own rounding exceeds the bound
# (measured: a float32 kernel without the 1/sqrt(D) scale leaves 1e-6 of its error
# of ~1; a wrong alignment or mask leaves < 1e-7; across the gallery the runner-up
# hypothesis leaves at least 0.2 of the error, so 1e-3 sits far from both).
MATCH_SHARE = 1e-3
# ... and never past this many bounds: on outlier inputs a tensor can be off by 50 times its scale,
# and 1e-3 of that admitted a backward mistake 21 bounds away from a kernel whose real slip was in
# its forward's accumulator; an FP8 split-KV kernel storing its partials unnormalised (an error of
# 4e3) read as FP8's descales inverted at 7 bounds.  The sharpened softmaxes above sit within 1.5.
MATCH_WITHIN = 4.0

# A kernel computing in a lower precision than it is checked in: its error sits within
# this factor of a plain computation's in that precision (measured: bfloat16 inside a
# float32 check gives 0.4 .. 1.3 x the bfloat16 baseline's error; float16's is ~8x smaller).
LOWER_SHARE = 3.0
LOWER = {"float64": ("float32", "bfloat16", "float16"), "float32": ("bfloat16", "float16")}

# An error read as a precision's (a lower one, or an accumulator's growing with length) must
# look like rounding, whatever its size says:
# - at most ROUNDING_ULPS units of roundoff (eps) of the lowest precision in question,
#   relative to the tensor (a plain bfloat16 computation errs 0.3 .. 1x bfloat16's eps;
#   a maximum never rescaled errs 0.1 .. 2, ~10^5 x a float32 bound);
# - not concentrated in the rows whose running maximum moved past the first FIRST_KEYS keys
#   (rounding falls on every row alike; a rescale left out spares the rows whose maximum
#   never moved): those rows must hold at least MOVED_SHARE of the others' median error;
# - not the same gap again when the target runs in float64 (a float64 run that computes in
#   float64, its values off the float32 grid, within SAME_GAP of the error is a formula or
#   a convention, not a precision).
ROUNDING_ULPS = 4.0
EPS = {d: 2 * u for d, u in tol.UNIT_ROUNDOFF.items()}          # machine epsilon: twice the unit roundoff
FIRST_KEYS = 16
# A hypothesis that explains nothing is named as the "closest" only within this many bounds
# and leaving at most CLOSEST_SHARE of the error: a guess farther off reads as a cause (a running
# maximum not carried across tiles was given a different wrong "closest" on each case; on 14
# kernels written outside, the guesses leaving more than a tenth of the error were all unrelated).
CLOSEST_WITHIN = 10.0
CLOSEST_SHARE = 0.05
MOVED_SHARE = 0.1
SAME_GAP = 0.5
# Weights flat over the keys each row sees: many slips give them (a scale or a descale far too small);
# where one of them predicts what this does within ALIKE_WITHIN of the bound, this is said, not it.
FLAT = "scores-flat"
# A cause is named only with a clear margin: its hypothesis within NAMED_WITHIN of the bound (a
# kernel's own rounding sits near 1/CHECK_FACTOR of it; measured over every planted mistake in
# float32 and bfloat16: 99 % of the right names within 0.4, the wrong ones at 0.75 .. 1.0), or
# within MATCH_SHARE of the error; and every hypothesis that predicts something else (more than
# the bound away from it) at least RUNNER_UP times farther (the right names: >= 25x; the wrong
# ones: 1.1 .. 1.3x).  Otherwise what is seen is said, and no cause.
NAMED_WITHIN = 0.5
RUNNER_UP = 4.0
# A tensor off by one fitted factor c names a constant (`_constants`) within this share of it.
CONSTANT_WITHIN = 1e-3
CONSTANT_FROM = 16
# The last keys seen by no query (`_keys_unseen`): at most this many.  The dense weights P those
# readings fit from (`_dense_weights`): on a case of at most UNSEEN_LIMIT (query, key) pairs in all,
# and as many (key, key) pairs (v the identity).
UNSEEN_KEYS = 256
UNSEEN_LIMIT = 2 ** 22
# Mistakes whose predictions differ by at most this share of the bound are said with the one
# named ("on this case the same as ..."): a loose bound alone would list mistakes that differ.
ALIKE_WITHIN = 0.1


def explains(residual, error, bound):
    """A hypothesis at ``residual`` from the target explains a tensor that is at
    ``error`` from the reference (arrays or numbers, elementwise)."""
    return (residual <= bound) | ((residual <= MATCH_SHARE * error) & (residual <= MATCH_WITHIN * bound))


def _alike(best, others, bound, denom):
    """The ids of the other catalogued mistakes whose prediction is within ALIKE_WITHIN of the
    bound of ``best``'s (residual, id, says, prediction): on this case they give the same."""
    pred = best[3]
    return sorted({o[1] for o in others if o[1] not in (best[1],) + FITTED and
                   slice_errors(o[3], pred, _own_scale(pred, denom)).max() <= ALIKE_WITHIN * bound})


def _unclear(best, others, error, bound, denom):
    """Why the hypothesis ``best`` (residual, id, says, prediction) is not named although it
    explains the tensor, or "" when it is named: too near the bound (`NAMED_WITHIN`), or another
    hypothesis that predicts something else comes within `RUNNER_UP` of it."""
    residual, _, says, pred = best
    if residual > NAMED_WITHIN * bound and not (residual <= MATCH_SHARE * error and residual <= MATCH_WITHIN * bound):
        return f"{says} comes to {_fmt(residual)}, {residual / bound:.2f} of the bound: too near it to name a cause"
    for other in sorted(others, key=lambda o: o[0]):
        if other[1] == best[1] or other[0] >= RUNNER_UP * residual:
            continue
        if slice_errors(other[3], pred, _own_scale(pred, denom)).max() > bound:    # it predicts something else
            return (f"{says} ({_fmt(residual)}) and {other[2]} ({_fmt(other[0])}) come too close to each "
                    "other to name one")
    return ""


@dataclass
class Diagnosis:
    id: str                  # a catalogue id, "non-finite", "dropout", "denominator", "none", "not-diagnosed"
    sentence: str
    residual: float = float("nan")
    bound: float = float("nan")
    slices: list = field(default_factory=list)     # [(batch, head)] when only some slices
    where: str = ""          # the location signature: where the error sits, whatever its cause
    spread: bool = False     # the error over most rows alike: no place of its own
    unbiased: bool = False   # and of either sign alike, as rounding is (a constant offset is not)
    rounding: bool = False   # unnamed, and its size, rows and float64 run all fit rounding (`_rounding_like`)
    past_precision: bool = False  # its error past what any lower precision makes on this case (`rounding_ceiling`)
    error_map: object = field(default=None, repr=False)  # (rows, batch x head) error over the bound, for report.plot
    also: tuple = ()         # "zeros", "scores-flat": the mistakes that give the same on this case (not claimed)
    against: tuple = ()      # the catalogued mistakes tried on this tensor that do not reproduce it
    infinite: bool = False   # non-finite, with infinite entries (not NaN alone): an overflow can make them

    def as_dict(self):
        return {"id": self.id, "sentence": self.sentence, "residual": _finite(self.residual),
                "bound": _finite(self.bound), "slices": [list(s) for s in self.slices], "where": self.where,
                "spread": self.spread, "unbiased": self.unbiased}


@dataclass
class Evidence:
    """Everything one failing case offers its diagnosis (``runner.run_case`` fills it)."""
    case: object
    align: str
    dtype: str
    device: str
    wanted: tuple
    rounded: dict          # the inputs, float64, rounded to the dtype
    opts: dict             # reference_attention's options
    gold: dict             # judged (4-D) reference, lse zero where unjudged
    gold_raw: dict         # the reference in its own shapes
    den: dict
    bounds: dict
    arrays: dict           # the target's tensors, 4-D (`as_4d`)
    got: dict              # the target's raw answer
    second: object         # a second call's answer, or None
    caller: object         # calls the target again
    logits: float = 0.0    # the case's largest |score| (its largest finite |lse|)
    baseline_in: object = None   # dtype -> the plain computation's tensors in that dtype
    rows: tuple = None     # (first, total): the row-wise tensors hold a block of query rows (``row_block``)
    in_float64: object = None    # the target's answer on the same inputs in float64 (`_float64_run`), once
    keyless: object = None       # (B, H, Tq) bool: the query rows that see no key (the reference's lse -inf)
    # what several readings start from, computed once per evidence (`_out_weights`); a copy made
    # by `replace` (a block of rows, one slice) starts empty
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)


def as_4d(arrays):
    """Every tensor as a 4-D array, so that each is sliced by (batch, head): lse (B, H, T)
    -> (B, H, T, 1), a bias of fewer dims padded in front, a gradient per head (dsinks: (H,))
    -> (1, H, 1, 1)."""
    out = {}
    for n, a in arrays.items():
        a = np.asarray(a, dtype=np.float64)
        if n == "lse":
            a = a[..., None]
        elif n[1:] in PER_HEAD:
            a = a.reshape(1, -1, 1, 1)
        elif a.ndim < 4:
            a = a.reshape((1,) * (4 - a.ndim) + a.shape)
        out[n] = a
    return out


def _finite(x):
    return float(x) if np.isfinite(x) else None


def _fmt(x):
    return f"{x:.1e}"


def slice_errors(a, ref, denom):
    """(B, H) array: max |a - ref| over each (batch, head) slice, over ``denom``; inf if non-finite."""
    diff = np.abs(np.asarray(a, dtype=np.float64) - ref)
    worst = np.where(np.isfinite(diff), diff, np.inf).max(axis=(-1, -2))
    return worst / denom


def diagnose(failing, rows, ev):
    """Set ``rows[n].diagnosis`` for each tensor ``n`` in ``failing``."""
    result = {}
    for n in failing:                                  # what needs no recomputation
        note = rows[n].note
        if n in INPUT_GRADS and "no gradient reached" in note:
            result[n] = Diagnosis(NO_GRAD[n], f"{n}: no gradient reached {n[1:]} (None or detached): "
                                  f"the {n[1:]} is used without its gradient")
        elif "not deterministic" in note:
            result[n] = Diagnosis("not-deterministic", f"{n} differs between two calls on the same inputs: "
                                  "the kernel is not deterministic (atomic adds, or a reduction in varying order)")
        elif n in ev.arrays and not np.isfinite(ev.arrays[n]).all():
            rejected = []
            result[n] = name_non_finite(n, ev, rejected) or _padding_rows_seen(n, rows, ev) or \
                _non_finite(n, ev.arrays[n], ev.case, ev.align, ev.keyless)
            if result[n].id == "non-finite" and n == "out":
                result[n].sentence += _nan_where_weights_underflow(ev)
            result[n].against = tuple(rejected)
    rest = [n for n in failing if n not in result and n in ev.arrays]
    if rest and ev.second is None:
        ev.second = ev.caller()
    for n in list(rest):
        again = ev.second.get(n) if isinstance(ev.second, dict) else None
        if isinstance(again, np.ndarray):
            first, again = as_4d({n: ev.got[n]})[n], as_4d({n: again})[n]
            moved = slice_errors(np.where(first == again, 0.0, again), np.where(first == again, 0.0, first),
                                 ev.den[n]).max()
            if moved > ev.bounds[n]:
                result[n] = Diagnosis("dropout", f"{n} changes between two calls on the same inputs (by "
                                      f"{_fmt(moved)}, bound {_fmt(ev.bounds[n])}): dropout left on, or another "
                                      "random draw in the kernel", moved, ev.bounds[n])
                rest.remove(n)
    if rest:
        result.update(_catalogue(rest, rows, ev))
    for n, d in result.items():
        if n in ev.arrays:
            d.where, d.spread, d.error_map = locate(n, ev.arrays[n], ev.gold[n], ev.den[n], ev.bounds[n])
            diff = ev.arrays[n] - ev.gold[n]
            d.unbiased = bool(np.isfinite(diff).all() and abs(diff.mean()) <= UNBIASED * np.abs(diff).mean())
    for n, d in result.items():
        if d.id == "none" and d.spread and n in ev.arrays:
            d.rounding, why, said = _rounding_like(n, rows, ev)
            if said:
                d.sentence += f"; not rounding: {why}"
    for n, d in result.items():
        if d.id == "none" and n in ("out", "lse", "dq") and n in ev.arrays:
            d.id, d.sentence = _tiles_unwritten(n, ev) or (d.id, d.sentence)
        if d.id == "none" and n in ("out", "dq") and n in ev.arrays:
            d.sentence += _only_rows_without_keys(n, ev)
        if d.id == "none" and n in ("dq", "dk") and n in ev.arrays:
            d.sentence += _only_where_zero(n, ev)
    _lower_precision(result, rows, ev)
    d = result.get("out")                 # what no reading names: the kernel's weights, read by calling it
    if d is not None and d.id == "none" and not d.rounding and np.isfinite(ev.arrays.get("out", np.nan)).all():
        d.id, d.sentence = weights.read(ev, _dense_weights(ev)) or (d.id, d.sentence)
    unnamed_dkdv = [result[n] for n in ("dv", "dk")
                    if n in result and result[n].id == "none" and not result[n].rounding]
    if unnamed_dkdv and "out" not in failing and "dv" in failing and np.isfinite(ev.arrays["dv"]).all():
        found = weights.read_backward(ev, _dense_weights(ev))      # the weights the dK/dV pass gives dv
        for d in unnamed_dkdv if found else ():
            d.id, d.sentence = found
    _summaries(result, rows, ev)
    for n, d in result.items():
        if d.where:
            d.sentence += f"; where: {d.where}"
    for n, d in result.items():
        error = rows[n].error
        d.past_precision = bool(error is not None and np.isfinite(error) and ev.logits <= tol.LOGIT_SCALE
                                and error > rounding_ceiling(ev.dtype)[1])
        rows[n].diagnosis = d


def _catalogue(rest, rows, ev):
    """The catalogue's best match for each tensor, on the whole case, its worst slice, or
    a block of that slice's query rows (``row_block``)."""
    sub, sel, said = _recomputed_part(rest, ev)
    if sub is None:
        return {n: Diagnosis("not-diagnosed", f"{n} not diagnosed: {said} for the dense float64 "
                             f"recomputation (limit {DENSE_LIMIT}); rerun with --tokens 4096 or less")
                for n in rest}
    out_right = "out" in rows and rows["out"].passed
    hyps = _catalogue_of(sub, twins=out_right)
    if sub is ev and _screened(rest, ev):                  # large: its out mistakes first on a block
        hyps = row_block.screen(hyps, ev, _catalogue_of, explains, slice_errors)
    cache, result = {}, {}
    # the readings fitted to the target are formed only where no catalogued mistake explains clearly
    plain = lambda names: not all(_explained(n, hyps, cache, sub, out_right) for n in names if n in sub.arrays)
    if out_right and plain(rest):                          # readings of a backward alone
        if "dq" in rest:
            hyps += _wrong_delta(sub) + _backward_p_scaled(sub) + _delta_per_tile(sub, rest) + _dp_scaled(sub)
        if "dk" in rest:
            hyps += _head_map(sub)
        hyps += _padding_rows_from_next_slice(sub, rest)
        if "dq" in rest:
            hyps += _dq_head_map(sub)
        entry = _backward_by_entry(sub, rest)           # one dense forward, shared by the readings of entries
        blocks = _backward_blocks(sub, rest, entry)
        hyps += _last_tile_only(sub, rest, entry) + blocks + _backward_counts(sub, rest, entry, blocks) + \
            _blocks_unmasked(sub, rest, entry) + \
            _delta_unweighted(sub, rest, entry) + _delta_pointer_advanced(sub, rest, entry) + \
            _tile_factors(sub, rest, entry) + (_rows_weighted(sub, rest, entry) or _rows_rescaled(sub, rest, entry))
        hyps += mistakes.option_twins(_mistakes_context(sub), hyps) + _backward_products(sub, rest, entry) + \
            _rows_read_as_zero(sub, rest, entry) + _do_read_otherwise(sub, rest, entry) + \
            _lse_across_tile(sub, rest, entry) + _inputs_rounded(sub, ("dout",))
        hyps += [h for n in rest if n in INPUT_GRADS for h in _broadcast_sum(sub, n)]
        hyps += [h for n in rest if n in ("dq", "dk", "dv") for h in _rows_moved(sub, n) + _tiles_accumulated(sub, n)]
    if "out" in rest and plain(["out"]):
        fitted = _keys_unseen(sub) + _sequence_offsets(sub) + _state_carried(sub) + _keys_weighted(sub) + \
            _key_tile_ranges(sub) + _tile_masks(sub) + _key_spans(sub) + _values_from_other_slices(sub) + \
            _sink_counted(sub) + _rows_moved(sub) + _scores_scaled(sub) + _deferred_rescale(sub) + \
            _tiles_weighted(sub) + \
            _tiles_left_out(sub) + _values_read_as_zero(sub) + _values_from_other_tiles(sub) + \
            _output_rounded(sub) + _inputs_rounded(sub) + _inputs_sign_lost(sub) + _channels_permuted(sub) + \
            _out_channels_moved(sub) + _kv_head_map(sub)
        hyps += [h for h in fitted if not _zeros_where_wrong(sub.arrays["out"], sub.gold["out"],   # rows left blank
                                                             _predict(h, cache, grads=False)["out"], sub.den["out"],
                                                             sub.bounds["out"])]
    hyps += _axes_permuted(sub, rest)
    if "lse" in rest:
        hyps += _lse_max_factor(sub) + _lse_stale_max(sub)
    backward_only = [h for h in hyps if "out" not in h.tensors]
    out_fits = {} if out_right or "out" not in sub.arrays or not np.isfinite(sub.arrays["out"]).all() else \
        _out_fits(hyps, cache, sub.arrays, sub.gold["out"], sub.den["out"], sub.bounds["out"])
    constants = _constants(sub)
    for n in rest:
        if sub.rows is not None and n not in row_block.ROW_TENSORS:
            result[n] = _summed_over_rows(n, hyps, cache, sub, sel)
            continue
        tried = hyps if n in ("out", "lse") else backward_only if out_right else \
            [h for h in hyps if "out" not in h.tensors or out_fits.get(id(h), True)]
        result[n] = _diagnose_tensor(n, tried, cache, sub.arrays, sub.gold, sub.den[n], sub.bounds[n], sel,
                                     constants)
        result[n].sentence += said
    grads = [n for n in result if n not in ("out", "lse")]
    if sub.rows is None:
        _sibling_times_constant(result, grads, hyps, cache, sub, constants)
    # a gradient of the case that a mistake named on another gradient does not reproduce (a forward's
    # mistake named on out says less of the backward: the kernel's may differ from the one it predicts)
    named = {result[n].id for n in grads if result[n].id not in ("none", "not-diagnosed")}
    for n in grads:
        if result[n].id == "none" and not result[n].residual <= result[n].bound:
            result[n].against = tuple(sorted(set(result[n].against) | named))
    named = result.get("out")
    if named is not None and named.id not in ("none", "not-diagnosed"):
        for n in rest:                # a gradient no entry explains, of an output one does
            if result[n].id == "none" or (result[n].id == "not-diagnosed" and sub.rows is not None):
                result[n].sentence += f" (out of this case: {named.id})"
    return result


def _sibling_times_constant(result, grads, hyps, cache, sub, constants):
    """A gradient no mistake names, that the mistake named on another gradient of the case
    reproduces up to one factor c, a constant of the case (`_constants`): "dq matches the mistake
    named on dk, dv times one constant, 8 (1/scale)".  A backward that recomputes its P wrong and
    scales one gradient otherwise (a q saved already scaled: dk takes the scale twice, dq once).
    ``result`` is updated in place; the gradient takes the sibling's id, its mechanism."""
    named = {}
    for n in grads:
        if result[n].id not in ("none", "not-diagnosed") and result[n].id not in FITTED:
            named.setdefault(result[n].id, []).append(n)
    for n in grads:
        if result[n].id != "none" or not np.isfinite(sub.arrays[n]).all():
            continue
        got, gold, bound = sub.arrays[n], sub.gold[n], sub.bounds[n]
        error = slice_errors(got, gold, sub.den[n]).max()
        for hyp in hyps:
            on = named.get(hyp.id)
            if not on or n not in hyp.tensors:
                continue
            pred = _predict(hyp, cache).get(n)
            pp = 0.0 if pred is None else float((pred * pred).sum())
            if pp == 0.0:
                continue
            c = float((got * pred).sum()) / pp
            words = _named_constant(c, constants)
            residual = slice_errors(got, c * pred, _own_scale(c * pred, sub.den[n])).max()
            if words is None or not explains(residual, error, bound):
                continue
            result[n] = Diagnosis(hyp.id, f"{n} matches the mistake named on {', '.join(on)} ({hyp.says}) times one "
                                  f"constant, {c:.6g} ({words}), to {_fmt(residual)} (bound {_fmt(bound)}): that "
                                  f"mistake, and {n} scaled otherwise than the other gradients", residual, bound)
            break


def _explained(n, hyps, cache, sub, out_right):
    """Whether a catalogued mistake of ``hyps`` (one changing the backward alone where the output is
    right) reproduces tensor ``n`` whole with a clear margin: within NAMED_WITHIN of its bound, or
    MATCH_SHARE of its error (`explains`).  Predictions go to ``cache``, as `_diagnose_tensor` uses them."""
    got = sub.arrays[n]
    if not np.isfinite(got).all():
        return False
    error, bound = slice_errors(got, sub.gold[n], sub.den[n]).max(), sub.bounds[n]
    for hyp in hyps:
        if n in hyp.tensors and not (out_right and "out" in hyp.tensors):
            pred = _predict(hyp, cache, grads=n not in ("out", "lse")).get(n)
            if pred is not None and np.any(pred) and \
                    explains(slice_errors(got, pred, _own_scale(pred, sub.den[n])).max(), error, NAMED_WITHIN * bound):
                return True
    return False


def _catalogue_of(sub, twins=False):
    """The catalogue's mistakes, recomputed from the evidence ``sub`` (a case, a slice or a
    block of rows), each predicting the judged form (lse on the rows the reference judges);
    ``twins``: with the backward-only twins of its visibility mistakes (``backward_twins``),
    tried where the output is right."""
    ctx = _mistakes_context(sub)
    hyps = mistakes.catalogue(ctx)
    return hyps + mistakes.backward_twins(ctx, hyps) if twins else hyps


def _mistakes_context(sub):
    """``mistakes.Context`` of the evidence ``sub``."""
    unjudged = ~np.isfinite(as_4d({"lse": sub.gold_raw["lse"]})["lse"]) if "lse" in sub.gold else None

    def judge(raw):
        out = as_4d(raw)
        if unjudged is not None and "lse" in out:
            out["lse"] = np.where(unjudged, 0.0, out["lse"])
        return out
    r = sub.rounded
    return mistakes.Context(sub.case, sub.align, (r["q"], r["k"], r["v"], r["dout"]), r.get("dlse"), sub.opts,
                            sub.gold_raw, judge, sub.wanted, rows=sub.rows, arrays=r)


def _dq_to_fit(sub):
    """The target's dq, which a backward hypothesis is fitted to, or None where the fit cannot
    tell anything apart (one key: dq is 0 whatever the backward) or is not computed (non-finite,
    a block of rows)."""
    got = sub.arrays.get("dq")
    if got is None or not np.isfinite(got).all() or sub.case.tk <= 1 or sub.rows is not None:
        return None
    return got


def _wrong_delta(sub):
    """The backward right but for its D = rowsum(dO ∘ O), each row's off by its own amount
    (computed from O before its normalisation, from another O, or in a low precision): a
    hypothesis fitted to the target's dq, then checked on dk.

    dS_ij = P_ij (dP_ij − D_i), so dq_i = scale (Σ_j P_ij dP_ij k_j − D_i u_i), u_i = Σ_j P_ij k_j
    (attention with k for v); a D_i + δ_i moves dq_i by −scale δ_i u_i: δ_i is fitted per row by
    least squares.  A D off by δ_i is the right backward with an lse gradient lowered by δ_i
    (the lse gradient enters dS as P_ij dlse_i): the prediction of every gradient.  [] where dq
    cannot be fitted (`_dq_to_fit`)."""
    got = _dq_to_fit(sub)
    P = None if got is None else _dense_weights(sub)
    if got is None or (P is not None and ((P > 0).sum(-1) <= 1).all()):
        return []                       # one key a row: dq_i ∥ k_j whatever dS is, and a D per row fits any
    r = sub.rounded
    scale = sub.opts["scale"]
    u = _dense_forward(sub, v=r["k"])[0]                                            # (B, Hq, Tq, D)
    delta = -((got - sub.gold["dq"]) * u).sum(-1) / np.maximum((u * u).sum(-1), 1e-300) / scale
    given = r["dlse"] if r.get("dlse") is not None else 0.0
    dlse = given - delta
    q, k, v, dout = r["q"], r["k"], r["v"], r["dout"]
    ratio = ""
    if "out" in sub.gold:
        terms = sub.gold["out"] * r["dout"]
        lse = sub.gold.get("lse")                                 # a per-row tensor a kernel may read for dlse
        keyed = (u * u).sum(-1) > 0                               # (rows that see no key: any D fits them)
        read = () if lse is None else tuple(
            (formula, words, np.where(keyed, x, given - delta)) for formula, words, x in (
                ("lse", "the saved lse", lse.reshape(keyed.shape)),
                ("lse · log2(e)", "the saved lse in base 2", lse.reshape(keyed.shape) / math.log(2))))
        ratio = _delta_rows(delta, terms.sum(-1) - given, given, _constants(sub), read) + \
            _delta_past_head_dim(delta, terms)

    def predict(grads=True):
        return as_4d(dense.run(q, k, v, dout, sub.opts, grads=grads, dlse=dlse))
    return [mistakes.Hypothesis("wrong-delta", "the backward's D = rowsum(dO ∘ O) off by each row's own amount"
                                + ratio, predict, ("dq", "dk") + INPUT_GRADS, fitted=("dq",))]


DELTA_OFF = 1e-3      # `_delta_rows`: a row's D off by more than this share of the largest |D|


def _delta_rows(delta, meant, dlse=0.0, constants=(), read=()):
    """Words for a backward's D = ``meant`` + ``delta`` (B, H, T) where ``meant`` (rowsum(dO ∘ O)
    less the lse gradient ``dlse``) is right: its lse gradient's term multiplied by one factor
    (delta = (1 − c) dlse), or another per-row tensor of ``read`` ((formula, words, (B, H, T)),
    ...) subtracted in its place (the saved lse loaded where dlse is meant), else on which rows it
    is off (all, or which query rows of which batch entries), and there by what factor, or "0:
    never written" where D' is 0 on each."""
    top = np.abs(meant).max(initial=0.0)
    off = np.abs(delta) > DELTA_OFF * top
    if not off.any():
        return ""
    dlse = np.broadcast_to(dlse, delta.shape)
    if np.any(dlse):
        c = 1 - float((delta * dlse).sum() / (dlse * dlse).sum())
        if np.abs(delta - (1 - c) * dlse).max() <= DELTA_OFF * np.abs(delta).max():
            named = _named_constant(c, constants)
            return (f" (its lse gradient's term multiplied by {c:.6g}{f' ({named})' if named else ''}: "
                    "D = rowsum(dO ∘ O) - c dlse)")
        for formula, words, x in read:
            if np.abs(delta - (dlse - x)).max() <= DELTA_OFF * np.abs(delta).max():
                return f" (D = rowsum(dO ∘ O) - {formula}: {words} read where the lse gradient dlse is meant)"
    got = (meant + delta)[off]
    if off.all():
        where = ""
    else:
        b, _, i = np.nonzero(off)
        where = f" on query rows {ranges(sorted(set(i.tolist())))}"
        if len(set(b.tolist())) < off.shape[0]:
            where += f" of batch entry {ranges(sorted(set(b.tolist())))}"
        where += " only"
    if np.abs(got).max() <= DELTA_OFF * top:
        return f" (D' = 0{where}: never written there)"
    f = got / np.where(meant[off] == 0, np.inf, meant[off])
    return f" (D' / D from {f.min():.3g} to {f.max():.3g}, median {np.median(f):.3g}{where})"


def _delta_past_head_dim(delta, terms):
    """Words for a D off by ``delta`` (B, H, T) that is the sum of the next row's first p channels of
    ``terms`` = dO ∘ O (B, H, T, D), the rows in memory order (B, H, T) or (B, T, H): D summed over a
    head-dim block of D + p (a power of two) with its loads unmasked; else ""."""
    b, h, t, dim = terms.shape
    block = 1 << (dim - 1).bit_length()
    if block == dim:
        return ""
    for order, axes in (("(batch, head, row)", (0, 1, 2)), ("(batch, row, head)", (0, 2, 1))):
        flat = terms.transpose(axes + (3,)).reshape(-1, dim)[:, :block - dim]
        after = np.concatenate([flat[1:], np.zeros_like(flat[:1])]).sum(-1)              # the next row's channels
        predicted = after.reshape(tuple(terms.shape[a] for a in axes)).transpose(np.argsort(axes))
        if np.abs(predicted - delta).max() <= FIT_SHARE * np.abs(delta).max():
            return (f"; each row's D also sums the next row's first {block - dim} channels of dO ∘ O, rows in "
                    f"{order} order: a head-dim block of {block} for D = {dim} with its loads unmasked")
    return ""


def _dp_scaled(sub):
    """The backward right but for its dP = dO Vᵀ, off by one factor c (a dropout rescale written
    otherwise there, a scale applied to it), D = rowsum(dO ∘ O) and dv right: dS = P ∘ (c dP − D),
    so dq(c) = dq + (c − 1) A with A = scale (P ∘ dP) K, read as dq(2) − dq from one dense backward
    (`dense.attention`'s ``dp_factor``); c fitted to dq by least squares, then held to dk.  [] where
    dq cannot be fitted (`_dq_to_fit`) or c is 1."""
    got = _dq_to_fit(sub)
    if got is None:
        return []
    r = sub.rounded
    run = lambda c, grads=True: as_4d(dense.run(r["q"], r["k"], r["v"], r["dout"], sub.opts, grads=grads,
                                                dlse=r.get("dlse"), dp_factor=c))
    A = run(2.0)["dq"] - sub.gold["dq"]
    if not np.any(A):
        return []
    c = 1 + float(((got - sub.gold["dq"]) * A).sum() / (A * A).sum())
    if abs(c - 1) <= CONSTANT_WITHIN:
        return []
    named = _named_constant(c, _constants(sub))
    return [mistakes.Hypothesis("dp-scaled", f"the backward's dP = dO V^T multiplied by {c:.6g}"
                                + (f" ({named})" if named else "") + " where its D = rowsum(dO ∘ O) and dv are right",
                                lambda grads=True: run(c, grads), ("dq", "dk"), fitted=("dq",))]



def _in_tiles(x, axis, tile, fill=0):
    """``x`` padded with ``fill`` along ``axis`` to whole tiles of ``tile`` and split there into
    (tiles, tile): shape (..., n, tile, ...) where ``axis`` had n·tile − pad entries."""
    axis %= x.ndim
    n = -(-x.shape[axis] // tile)
    width = [(0, 0)] * x.ndim
    width[axis] = (0, n * tile - x.shape[axis])
    return np.pad(x, width, constant_values=fill).reshape(x.shape[:axis] + (n, tile) + x.shape[axis + 1:])


def _delta_per_tile(sub, failing):
    """The backward's D computed within each key tile of `mistakes.KEY_TILES` alone, as a key-major
    kernel that forms it in its tile loop does: D_it = Σ_{j in tile t} P_ij dP_ij (− dlse_i)
    where rowsum(dO ∘ O) − dlse_i is meant, dS_ij = P_ij (dP_ij − D_it(j)); right where a row's
    keys fit one tile.  dq = scale dS K and dk = scale dSᵀ Q, each tile size a hypothesis; nothing
    fitted (`_backward_by_entry`)."""
    found = _backward_by_entry(sub, failing)
    if found is None or not {"dq", "dk"} & set(failing):
        return []
    P, _, _, f = found
    case, r = sub.case, sub.rounded
    dP = f["dO"] @ np.swapaxes(f["V"], -1, -2)
    dlse = r["dlse"][..., None] if r.get("dlse") is not None else 0.0
    scale = sub.opts["scale"]
    out = []
    for t in (t for t in mistakes.KEY_TILES if t < case.tk):
        tiled = _in_tiles(P * dP, -1, t).sum(-1)
        D = np.repeat(tiled, t, axis=-1)[..., :case.tk] - dlse
        dS = P * (dP - D)
        preds = {"dq": scale * dS @ f["K"], "dk": _per_kv(case, scale * np.swapaxes(dS, -1, -2) @ f["Q"])}
        out.append(mistakes.Hypothesis(
            "delta-per-tile", f"the backward's D = rowsum(dO ∘ O) summed over each key tile of {t} alone (D = "
            f"rowsum(P ∘ dP) within the tile, in the tile loop) instead of over the whole row",
            lambda grads=True, preds=preds: {**sub.gold, **preds}, ("dq", "dk")))
    return out


def _delta_pointer_advanced(sub, failing, found):
    """The dQ pass's D loaded inside its key loop from a pointer advanced with the key tiles (the
    load written in the loop where it belongs before it, or its pointer advanced with K's): key tile
    t's dS_ij = P_ij (dP_ij − D_{i + t·n}), rows past the end read as 0 (a masked load), for each
    key tile n of `mistakes.KEY_TILES`, the loop from key tile 0.  dq alone (`_backward_by_entry`);
    nothing fitted."""
    if found is None or "dq" not in failing:
        return []
    P, _, _, f = found
    case, scale = sub.case, sub.opts["scale"]
    dP = f["dO"] @ np.swapaxes(f["V"], -1, -2)
    tq = case.tq
    out = []
    for n in (n for n in mistakes.KEY_TILES if n < case.tk):
        rows = np.arange(tq)[:, None] + (np.arange(case.tk) // n)[None, :] * n          # (Tq, Tk): the row read
        D = np.where(rows < tq, np.take(f["D"], np.minimum(rows, tq - 1), axis=-1), 0.0)
        dq = scale * (P * (dP - D)) @ f["K"]
        out.append(mistakes.Hypothesis(
            "delta-pointer-advanced", f"the dQ pass's D loaded in its key loop from a pointer advanced with the key "
            f"tiles of {n} (key tile t taking the D of row i + {n}t, past the last row 0): a load that belongs "
            "before the loop", lambda grads=True, dq=dq: {**sub.gold, "dq": dq}, ("dq",)))
    return out


def _backward_p_scaled(sub):
    """The backward right but for its P, each row's scaled by its own factor c_i: P recomputed as
    exp(S − lse') from an lse' off by −log c_i (saved in a low precision, without a sink, in
    another base...).  Then dS_i = c_i P_i (dP_i − D_i) and dq_i = c_i dq_i: c fitted to dq row by
    row, then every gradient predicted from that lse' (dk and dv confirm it)."""
    got = _dq_to_fit(sub)
    if got is None or sub.opts.get("keep") is not None:
        return []
    c, _ = _row_scaled(got, sub.gold["dq"])
    c = c[..., 0]                                                        # (B, Hq, Tq)
    if c.min() <= 0:
        return []
    shift = torch.as_tensor(np.log(c))
    r = sub.rounded
    lo, hi = float(c.min()), float(c.max())

    def predict(grads=True):
        return as_4d(dense.run(r["q"], r["k"], r["v"], r["dout"], sub.opts, grads=grads, dlse=r.get("dlse"),
                               backward_lse=lambda lse, first: lse - shift[..., first:first + lse.shape[-1]]))
    return [mistakes.Hypothesis("backward-p-scaled", f"the backward's P scaled row by row (factors {lo:.4g} .. "
                                f"{hi:.4g}): P = exp(S - lse) recomputed from an lse off by each row's own amount",
                                predict, ("dq", "dk", "dv"), fitted=("dq",))]


def _screened(rest, ev):
    """Whether a case recomputed whole has its out mistakes screened on a block of rows first
    (``row_block.screen``): a large slice, out failing with finite values, and none of the
    features that tie rows, heads or batch entries together (as for the block path)."""
    return (ev.case.tq * ev.case.tk > row_block.SCREEN_FROM and "out" in rest and "out" in ev.arrays
            and np.isfinite(ev.arrays["out"]).all() and not _tied(ev))


def _tied(ev):
    """Whether the case's features tie its heads, batch entries or rows together (GQA, a
    bias, sinks, ALiBi, a dropout mask, per-sequence lengths): then no slice or block is
    recomputed alone."""
    case = ev.case
    return case.hkv != case.heads or bool(case.seqlens) or \
        any(n in ev.rounded and i.ties for n, i in INPUTS.items())


def _recomputed_part(rest, ev):
    """(evidence, selection, words) of what the catalogue is recomputed on: ``ev`` itself when
    the case fits densely, else its worst (batch, head) slice (b, h), else a block of that
    slice's query rows; the words say which (appended to each sentence).  (None, None, why)
    when the case's features tie its heads or rows together."""
    case = ev.case
    if fits_densely(case):
        return ev, (slice(None), slice(None)), ""
    # paged: each batch entry its own length, and a page table drawn for the whole case
    if _tied(ev) or ev.opts.get("seqlens_k") is not None:
        return None, None, (f"Tq x Tk = {case.tq * case.tk} is too large" if case.tq * case.tk > DENSE_LIMIT
                            else "a case with features this large is too large")
    b, h = _worst_slice(ev)
    if case.tq * case.tk <= DENSE_LIMIT:
        pick = lambda d: {n: a[b:b + 1, h:h + 1] for n, a in d.items()}
        sub = replace(ev, case=replace(case, batch=1, heads=1), rounded=pick(ev.rounded), gold=pick(ev.gold),
                      gold_raw=pick(ev.gold_raw), arrays=pick(ev.arrays))
        return sub, (b, h), (f" (judged on (batch, head) {(b, h)} alone, the one with the largest error: "
                              "the whole case is too large to recompute)")
    first, end = row_block.block_of_rows(case.tq, case.tk, row_block.worst_row(ev, b, h, rest))
    skipped = list(mistakes.whole_case(case).values())
    return row_block.on_rows(ev, b, h, first, end), (b, h), \
        row_block.where_judged(b, h, first, end, case.tq, skipped)


def _summed_over_rows(n, hyps, cache, sub, sel):
    """dk, dv (sums over every query row) on a block of rows: only the mistakes the reference
    itself gives are judged, on the whole slice; the others are said not to be."""
    tried = [h for h in hyps if getattr(h.predict, "from_reference", False)]
    d = _diagnose_tensor(n, tried, cache, sub.arrays, sub.gold, sub.den[n], sub.bounds[n], sel)
    if d.id != "none":
        if d.id != "zeros":
            d.sentence += f" (judged on (batch, head) ({sel[0]}, {sel[1]}), every row)"
        return d
    why = (f"{n} sums over every query row that sees a key, and this case is too large to recompute under "
           "each mistake")
    own = [h.says for h in tried if n in h.tensors]
    if not own:
        return Diagnosis("not-diagnosed", f"{n} not judged: {why}")
    return Diagnosis("not-diagnosed", f"{n} not judged against the mistakes that change the forward: {why} "
                     f"({'; '.join(own)}: given by the reference itself, does not match)")


def fits_densely(case):
    """Whether the whole case is recomputed densely (else its worst (batch, head) slice)."""
    return case.batch * case.heads * case.tq * case.tk <= DENSE_LIMIT


def _worst_slice(ev):
    """(b, h): the (batch, head) slice with the largest error of out."""
    case = ev.case
    worst = slice_errors(ev.arrays["out"], ev.gold["out"], 1.0) if "out" in ev.arrays else np.zeros((1, 1))
    b, h = (int(i) for i in np.unravel_index(np.argmax(worst), (case.batch, case.heads)))
    return b, h


# Rounding errors take either sign alike: their mean is a small share of their mean size
# (measured: a bfloat16 kernel's 0.02 .. 0.1); a constant offset's is all of it.
UNBIASED = 0.5
# A failing tensor "points the wrong way" below this cosine with the reference (an
# unrelated one sits near 0 either side).
WRONG_WAY = -0.2


# A weight under 2^-DEEP_WEIGHT of its row's largest adds nothing a float32 sum can hold (2^-64 is
# past float32's epsilon squared): non-finite only on rows holding such weights points at an exponential.
DEEP_WEIGHT = 64


def _nan_where_weights_underflow(ev):
    """Where out is non-finite on exactly the query rows whose smallest weight, against the row's
    largest, lies below some 2^-x (each row with a key more than x log2 units under its maximum,
    and only those), in words: an exponential that breaks past some argument.  "" otherwise (on
    a block of rows, or where the dense weights are too large to hold)."""
    P = _dense_weights(ev)
    if P is None:
        return ""
    bad = ~np.isfinite(ev.arrays["out"]).all(-1)                                   # (B, H, Tq)
    seen = P > 0
    with np.errstate(divide="ignore"):
        spread = np.where(seen, np.log2(np.where(seen, P, 1.0)), np.inf).min(-1) - \
            np.log2(np.where(seen.any(-1), P.max(-1), 1.0))                        # ≤ 0; inf: no key
    right = ~bad & seen.any(-1)
    if not bad.any() or not right.any() or not np.isfinite(spread[bad]).all():
        return ""
    deepest_right, shallowest_bad = float(spread[right].min()), float(spread[bad].max())
    why = ": an exponential computed so that it breaks past some argument (a hand-written exp2 without its lower " \
        "clamp, a bit trick on the exponent field, or an underflow turned into NaN)"
    if shallowest_bad < deepest_right:
        return (f"; non-finite on exactly the query rows with a weight below 2^{shallowest_bad:.0f} of their largest "
                f"(a key more than {-shallowest_bad:.0f} log2 units under the row's maximum; the rows whose keys all "
                f"lie within {-deepest_right:.0f} of it are right){why}")
    deep = int((right & (spread <= shallowest_bad)).sum())
    if shallowest_bad <= -DEEP_WEIGHT and deep <= right.sum() / 2:   # rows holding weights no sum can feel
        return (f"; every non-finite row has a weight below 2^{shallowest_bad:.0f} of its largest (a key more than "
                f"{-shallowest_bad:.0f} log2 units under the row's maximum; {deep} of the {int(right.sum())} right "
                f"rows have one too: on some lanes or tiles only){why}")
    return ""


def _non_finite(t, a, case, align, keyless=None):
    """How many entries of ``a`` are NaN or infinite, in which rows, and what the check
    expects in the query rows that see no key (``keyless``: (B, H, Tq), the rows whose
    reference lse is -inf, where known)."""
    bad = ~np.isfinite(a)                                           # (B, H, T, D)
    nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    rows = sorted(int(i) for i in np.nonzero(bad.any(axis=(0, 1, 3)))[0])
    kind = "query" if t in ("out", "dq", "lse") else "key" if t in ("dk", "dv") else t[1:]
    b, h, i = (int(x[0]) for x in np.nonzero(bad)[:3])
    sentence = (f"{t} has {nan} NaN and {inf} infinite entries of {a.size}, in {kind} rows "
                f"{ranges(rows)} (first at (b, h, row) = ({b}, {h}, {i}))")
    # NaN only on query rows that see no key (dk, dv: only in batch entries whose sequence holds such
    # rows): no read past a sequence's end is needed to explain it
    only_keyless = keyless is not None and kind == "query" and keyless.shape == bad.shape[:3] and \
        not (bad.any(-1) & ~keyless).any()
    if keyless is not None and kind == "key" and case.seqlens is not None and len(keyless) == len(bad):
        inner = keyless & (np.arange(keyless.shape[-1]) < np.asarray(case.seqlens[0])[:, None, None])
        only_keyless = bool(inner.any(axis=(1, 2))[bad.any(axis=(1, 2, 3))].all())
    if case.seqlens is not None and nan and not only_keyless:
        sentence += ("; the packed buffers hold NaN past the last sequence's end and nowhere else: the kernel "
                     "read past a sequence's end (cu_seqlens)")
    elif t == "lse" and not nan and (a[bad] < 0).all():
        sentence += ("; -inf where the reference's row sees a key: the kernel gave those rows none (rows taken "
                     "for padding, or for another sequence's)")
    offset = case.offset(align)
    blind = -offset if case.causal and offset < 0 else 0       # query rows 0 .. blind-1 see no key
    zeroed = "(a softmax over no key is 0/0: zero those rows' weights after the softmax)"
    if blind:
        sentence += (f"; query rows 0 .. {blind - 1} see no key ({align} causal mask with Tq = {case.tq} > "
                     f"Tk = {case.tk}): the check expects "
                     f"{'zeros there' if kind == 'query' else 'them to add nothing to dk and dv'}, as SDPA and "
                     f"FlashAttention return {zeroed}")
    elif only_keyless and kind == "query" and case.seqlens is not None:
        sentence += ("; every one of those rows sees no key (its sequence's bottom-right causal mask with more "
                     f"queries than keys): the check expects zeros there, as SDPA and FlashAttention return {zeroed}")
    elif only_keyless and case.seqlens is not None:
        sentence += ("; its sequence has query rows that see no key (its bottom-right causal mask with more queries "
                     f"than keys): a NaN returned there reaches dk and dv through those rows' weights {zeroed}")
    return Diagnosis("non-finite", sentence, float("inf"), float("nan"), infinite=inf > 0)


def _padding_rows_seen(n, rows, ev):
    """dk or dv non-finite on exactly the keys that the padding rows of a last partial query tile
    (rows Tq .. Tq' - 1, Tq' = Tq rounded up to a tile of `mistakes.KEY_TILES`) would see under the
    case's mask, the output and dq right: a dK/dV pass whose masked loads fill those rows so that
    their weights do not vanish (an lse or maximum loaded as -inf: exp(s - (-inf)) = inf, times their
    dO of 0, NaN).  Said only where the keys tell the tile apart (some key not among them); the
    smallest such tile.  None otherwise (packed sequences: not tried)."""
    case, a = ev.case, ev.arrays.get(n)
    if n not in ("dk", "dv") or a is None or case.seqlens is not None or "out" not in rows or not rows["out"].passed:
        return None
    if "dq" in ev.arrays and not np.isfinite(ev.arrays["dq"]).all():
        return None
    bad = (~np.isfinite(a)).any(axis=(0, 1, 3))                        # keys non-finite in some slice
    if bad.all() or not bad.any():
        return None
    for tile in (t for t in mistakes.KEY_TILES if case.tq % t):
        padded = np.arange(case.tq, -(-case.tq // tile) * tile)
        if (_seen_by_rows_past_tq(ev, len(padded)) == bad).all():
            keys = ranges(sorted(int(j) for j in np.nonzero(bad)[0]))
            return Diagnosis("padding-rows-seen", f"{n} is non-finite on keys {keys} of {case.tk} only, exactly the "
                             f"keys that query rows {case.tq} .. {padded[-1]} would see: the padding rows of the last "
                             f"query tile of {tile} (Tq = {case.tq}) weighed in the dK/dV pass (their masked loads "
                             "filled so that P does not vanish: an lse or maximum loaded as -inf gives exp(+inf), "
                             "times their dO of 0, NaN); dq is right", float("inf"), float("nan"))
    return None


def _seen_by_rows_past_tq(ev, count):
    """(Tk,) bool: the keys that some of ``count`` query rows past Tq would see under the case's mask."""
    q = torch.zeros(ev.rounded["q"].shape[:2] + (count, ev.rounded["q"].shape[-1]), dtype=torch.float64)
    with torch.no_grad():
        S = _scores_past_tq(ev, q, torch.as_tensor(np.asarray(ev.rounded["k"]), dtype=torch.float64))
    return np.isfinite(S.numpy()).any(axis=(0, 1, 2))


def _scores_past_tq(ev, q, k):
    """(B, Hq, rows, Tk): the scores of query rows ``q`` (B, Hq, rows, D) placed past the case's Tq,
    against ``k``, as the case forms them (its scale, mask and options but its bias, −inf where
    hidden; the alignment's offset kept: the rows as those of a case that is longer by their count).
    Differentiable in ``k``."""
    case = ev.case
    kw = dense.keywords({n: x for n, x in ev.opts.items() if n not in ("keep", "dropout_p")},
                        arrays=("sinks", "alibi_slopes"))
    total = case.tq + q.shape[2]
    kw["shift"] = kw.get("shift", 0) + case.offset(ev.align) - offset_of(total, case.tk, case.align or ev.align)
    v = torch.zeros(k.shape[:3] + (1,), dtype=torch.float64)
    return dense.attention(q, k, v, rows=(case.tq, total), scores_only=True, **kw)[..., :case.tk]


# ----------------------------------------------------------------------------
# Mistakes that read memory no one should read (``poisoned``): named by where their NaN lands

def _context(ev):
    r = ev.rounded
    return mistakes.Context(ev.case, ev.align, (r["q"], r["k"], r["v"], r["dout"]), r.get("dlse"), ev.opts,
                            ev.gold_raw, as_4d, ev.wanted, arrays=r)


def name_non_finite(n, ev, rejected=None):
    """A `Diagnosis` naming the poisoned mistake behind tensor ``n``'s NaN, or None; ``rejected``
    (a list) takes the ids of those whose NaN rows fit but whose call with the unread memory 0
    does not (`Diagnosis.against`)."""
    if n not in ("out", "lse") or n not in ev.arrays:
        return None
    bad = poisoned.rows_non_finite(ev.arrays[n])
    matches = list(_poisoned_matches(n, ev))
    if bad.all() and any(m[0].zeroed for m in matches):   # no finite row: the call again, unread memory 0
        again = _unread_zero(ev).get(n)
        kept = [m for m in matches if m[0].zeroed is not None and again is not None and np.isfinite(again).all()
                and slice_errors(again, m[0].zeroed()[n], ev.den[n]).max() <= ev.bounds[n]]
        if rejected is not None:
            rejected += [m[0].id for m in matches if m not in kept]
        matches = kept
    # several mistakes making the same rows non-finite, the finite rows all zero as the reference's
    # (rows that see no key): nothing tells them apart, and none is named
    if not matches or (len(matches) > 1 and all(blank for _, _, blank in matches)):
        return None
    (hyp, residual, _), others = matches[0], [h.says for h, _, _ in matches[1:]]
    plain = _non_finite(n, ev.arrays[n], ev.case, ev.align, ev.keyless)
    also = f" (the same rows as: {'; '.join(others)})" if others else ""
    rest = f", the other rows within {residual:.1e} (bound {ev.bounds[n]:.1e})" if not bad.all() else ""
    return Diagnosis(hyp.id, f"{n} matches the reference with {hyp.says}{also}: non-finite in the "
                               f"{int(bad.sum())} rows that mistake makes non-finite{rest}; {plain.sentence}",
                     residual, ev.bounds[n])


def _unread_zero(ev):
    """The target's judged out and lse on the case again, forward only, with the memory no one should
    read holding 0 instead of NaN (`features.HOOKS`, unread); {} where the call fails."""
    caller = copy.copy(ev.caller)
    caller.unread, caller.grads = 0.0, False
    got = caller()
    if not isinstance(got, dict):
        return {}
    arrays = as_4d({n: a for n, a in got.items() if n in ("out", "lse") and isinstance(a, np.ndarray)})
    if "lse" in arrays and "lse" in ev.gold:
        arrays["lse"] = _judged_lse(ev, arrays["lse"])
    return arrays


def _poisoned_matches(n, ev):
    """(hypothesis, residual, blank) of each poisoned hypothesis that explains tensor ``n``; blank:
    its finite rows are all zero in the reference (rows that see no key), so they tell nothing."""
    a = ev.arrays[n]
    bad = poisoned.rows_non_finite(a)
    for hyp in mistakes.catalogue(_context(ev)):
        if not isinstance(hyp, poisoned.Poisoned) or n not in hyp.tensors:
            continue
        pred = hyp.predict(grads=False).get(n)
        if pred is None:
            continue
        if n == "lse":                       # rows that see no key are not judged
            pred = np.where(ev.gold[n] == 0.0, np.where(np.isnan(pred), pred, 0.0), pred)
        sure = poisoned.rows_non_finite(pred)
        maybe = sure | (hyp.maybe() if hyp.maybe is not None else False)
        if not (np.all(bad[sure]) and not np.any(bad & ~maybe)):
            continue
        both = ~bad & ~sure
        residual = float(np.abs(a[both] - pred[both]).max(initial=0.0)) / ev.den[n]
        error = float(np.abs(a[both] - ev.gold[n][both]).max(initial=0.0)) / ev.den[n]
        if explains(residual, error, ev.bounds[n]):
            yield hyp, residual, both.any() and not np.any(ev.gold[n][both])


def _out_fits(hyps, cache, got, golden_out, denom, bound):
    """Whether each forward mistake reproduces the target's out in at least one slice:
    the ones that do not are not tried on the gradients (saves their autograd)."""
    fits = {}
    for hyp in hyps:
        if "out" in hyp.tensors:
            out = _predict(hyp, cache, grads=False)["out"]
            residual = slice_errors(got["out"], out, denom)
            error = slice_errors(got["out"], golden_out, denom)
            fits[id(hyp)] = bool(explains(residual, error, bound).any())
    return fits


def _predict(hyp, cache, grads=True):
    """``hyp``'s prediction, once: with gradients, or (``grads=False``) its forward alone
    (no autograd), or the gradients' prediction where that was made first."""
    key = id(hyp)
    if key in cache:
        return cache[key]
    if grads:
        cache[key] = hyp.predict()
        return cache[key]
    if (key, "forward") not in cache:
        cache[key, "forward"] = hyp.predict(grads=False)
    return cache[key, "forward"]


def _row_scaled(a, ref):
    """out = c_i x reference row i: the best factor per row, and the fitted prediction."""
    num = (a * ref).sum(-1, keepdims=True)
    den = (ref * ref).sum(-1, keepdims=True)
    c = np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)
    return c, c * ref


def _where(slices, shape):
    b, h = shape
    heads = sorted({s[1] for s in slices})
    if b == 1 or len(slices) == len(heads) * b and all((i, hh) in slices for i in range(b) for hh in heads):
        word = "head" if len(heads) == 1 else "heads"
        every = "" if b == 1 else " (every batch)"
        return f"{word} {', '.join(map(str, heads))}{every}"
    return "(batch, head) " + ", ".join(str(tuple(s)) for s in slices)


def _diagnose_tensor(t, hyps, cache, got, ref, denom, bound, sel, constants=()):
    a, r = got[t], ref[t]
    candidates = []                               # (per-slice residuals, id, says, prediction)
    zeros = []                                    # the ids of mistakes that predict zeros everywhere
    for hyp in hyps:
        # a mistake that predicts zeros everywhere (the shifted mask at T = 1) is matched by
        # any kernel returning zeros: it cannot be told apart, so it is not claimed
        if t not in hyp.tensors:
            continue
        pred, says = _predict(hyp, cache, grads=t not in ("out", "lse")).get(t), hyp.says
        if isinstance(hyp, poisoned.Poisoned) and pred is not None and np.isnan(pred).any() and np.isfinite(a).all():
            pred = np.where(poisoned.rows_non_finite(pred)[..., None], 0.0, pred)     # NaN rows a guard zeroes
            says += " (the rows that read a NaN slot returned as 0, as a guard such as l > 0 gives)"
        if pred is not None and np.any(pred):
            candidates.append((slice_errors(a, pred, _own_scale(pred, denom)), hyp.id, says, pred))
        elif pred is not None and hyp.id not in zeros and hyp.id not in FITTED:
            zeros.append(hyp.id)
    if t == "out":
        c, fitted = _row_scaled(a, r)
        residual = slice_errors(a, fitted, denom)
        # a fitted hypothesis must explain the error, not shave it: 90% of it at least; a
        # denominator is positive (a factor 0 is an output of zeros); and with one key it
        # fits any output proportional to v, so it is not claimed there
        one_key = next((ref[n].shape[-2] for n in ("dk", "dv") if n in ref), None) == 1
        if residual.max() <= FIT_SHARE * slice_errors(a, r, denom).max() and c.min() > 0 and not one_key:
            lo, hi = float(c.min()), float(c.max())
            candidates.append((residual, "denominator", f"each row divided by a wrong softmax "
                               f"denominator (row factors {lo:.6g} .. {hi:.6g})", fitted))
    error_now = slice_errors(a, r, denom).max()
    if t != "out":                                # (out: a denominator, each row its own factor)
        candidates += _constant_factor(t, a, r, denom, bound, constants)
    if t == "lse":
        candidates += _constant_offset(a, r, denom, bound, constants)
    fitted = {hyp.id for hyp in hyps if t in getattr(hyp, "fitted", ())} | {"constant-factor", "lse-offset"}
    candidates = [c for c in candidates if c[1] not in fitted or c[0].max() <= FIT_SHARE * error_now]
    candidates = [c for c in candidates if c[1] not in FITTED or not _zeros_where_wrong(a, r, c[3], denom, bound)]
    if not np.any(a) and np.any(r):
        told = f" (as {' or '.join(zeros)} would give here)" if zeros else ""
        return Diagnosis("zeros", f"{t} is zero everywhere (the reference is not): nothing written, "
                         f"or every weight masked{told}", also=tuple(zeros))
    if not candidates:
        return Diagnosis("none", f"{t} matches none of the catalogued mistakes")
    whole = [(res.max(), i, s, p) for res, i, s, p in candidates]
    error = slice_errors(a, r, denom).max()
    against = tuple(sorted({w[1] for w in whole if w[1] not in FITTED and not explains(w[0], error, bound)}))
    d = _reading(t, candidates, whole, error, a, r, denom, bound, sel)
    d.against = tuple(i for i in against if i != d.id)
    return d


def _reading(t, candidates, whole, error, a, r, denom, bound, sel):
    """`_diagnose_tensor`'s reading of tensor ``t`` from its ``candidates``."""
    # a fitted row factor fits any row scaling; a catalogued mistake that explains it too says why
    named = [w for w in whole if w[1] not in FITTED and explains(w[0], error, bound)]
    simplest = sorted((w for w in whole if w[1] in FITTED and w[0] <= bound), key=lambda w: FITTED.index(w[1]))
    if simplest and not named:        # a catalogued mistake in some slices says more than a reading fitted row by row
        by_slice = _by_slice(t, [c for c in candidates if c[1] not in FITTED], a, r, denom, bound, sel)
        if by_slice is not None:
            return by_slice
    best = min(named, key=lambda w: w[0]) if named else simplest[0] if simplest else \
        min(whole, key=lambda w: w[0])
    if named:                 # mistakes that give the same here: the first asked, not the rounding's pick
        best = next(w for w in named if w is best or
                    slice_errors(w[3], best[3], _own_scale(best[3], denom)).max() <= ALIKE_WITHIN * bound)
    if explains(best[0], error, bound):
        unclear = _unclear(best, whole, error, bound, denom)
        if unclear:
            return Diagnosis("none", f"{t} matches none of the catalogued mistakes clearly: {unclear}",
                             best[0], bound)
        # flat weights, which many slips give, before one of them that this case cannot tell from them
        flat = next((w for w in whole if w[1] == FLAT), None)
        if flat is not None and flat[0] <= NAMED_WITHIN * bound and \
                slice_errors(flat[3], best[3], _own_scale(best[3], denom)).max() <= ALIKE_WITHIN * bound:
            best = flat
        beyond = "" if best[0] <= bound else f", {best[0] / error:.0e} of its error {_fmt(error)}"
        same = _alike(best, whole, bound, denom)
        said = f"; on this case the same as {', '.join(same)}" if same else ""
        return Diagnosis(best[1], f"{t} matches the reference with {best[2]} to {_fmt(best[0])} "
                         f"(bound {_fmt(bound)}{beyond}{said})", best[0], bound,
                         also=tuple(same) if best[1] == FLAT else ())
    by_slice = _by_slice(t, candidates, a, r, denom, bound, sel)
    if by_slice is not None:
        return by_slice
    if best[0] > CLOSEST_SHARE * error or best[0] > CLOSEST_WITHIN * bound:     # nothing close: no guess
        return Diagnosis("none", f"{t} matches none of the catalogued mistakes")
    return Diagnosis("none", f"{t} matches none of the catalogued mistakes (closest: {best[2]}, "
                     f"{_fmt(best[0])} vs bound {_fmt(bound)})", best[0], bound)


def _zeros_where_wrong(a, r, pred, denom, bound):
    """Whether ``pred`` is 0 on every row where the target ``a`` is off the reference ``r`` and the
    target is 0 there too: a reading fitted to rows left blank (a tile or key range read as none)
    says no more than "nothing written there", which any kernel leaving them blank matches."""
    wrong = (np.abs(a - r) / np.asarray(denom).reshape(np.shape(denom) + (1, 1))).max(-1) > bound
    return bool(wrong.any() and not np.any(pred[wrong]) and not np.any(a[wrong]))


# The constants of any formula (`_constants`): said only where none of the case's own is.
GENERIC_CONSTANTS = ((-1.0, "-1: its sign flipped"), (2.0, "2"), (0.5, "1/2"), (math.log(2), "ln 2"),
                     (1 / math.log(2), "log2(e)"))


def _constants(sub):
    """(value, words) of the constants a tensor off by one factor is most often off by, the case's
    own first: those of its numeric options (the scale, a softcap, a dropout probability: v, 1/v,
    1 − v, 1/(1 − v) and the last two squared), the group of query heads per kv head, its sizes (a mean
    where a sum is meant: 1/B, 1/H, 1/Tq, 1/Tk, or a sum where a mean is), 2 (a gradient accumulated
    twice), then a few of any formula."""
    case = sub.case
    out = []
    for name, v in sub.opts.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in (0, 1):
            out += [(v, f"{name} = {v:.6g}"), (1 / v, f"1/{name}"), (1 - v, f"1 - {name}"),
                    (1 / (1 - v), f"1/(1 - {name})"), ((1 - v) ** 2, f"(1 - {name})^2: applied twice"),
                    (1 / (1 - v) ** 2, f"1/(1 - {name})^2: applied twice")]
    group = case.heads // case.hkv
    if group > 1:
        out += [(group, f"the group size Hq/Hkv = {group}"),
                (1 / group, f"1/{group}: averaged over the group's query heads")]
    for size, words in ((case.batch, "the batch entries"), (case.heads, "the heads"), (case.tq, "the query rows"),
                        (case.tk, "the keys")):
        if size > 1:
            out += [(1 / size, f"1/{size}: averaged over {words}"), (size, f"{size}: summed over {words}")]
    out += [(2.0, "2: accumulated twice (by two passes, or one pass run twice)")]
    return out + list(GENERIC_CONSTANTS)



def _named_constant(c, constants):
    """The words of those of ``constants`` (value, words) that ``c`` equals within CONSTANT_WITHIN,
    the case's own joined by "or" (a batch of 2 averaged and a group of 2 averaged give the same
    factor), a generic one only where none of the case's is; or None."""
    hits = [w for v, w in constants if abs(c - v) <= CONSTANT_WITHIN * abs(v)]
    own = [w for w in hits if w not in {w for _, w in GENERIC_CONSTANTS}]
    if not own:
        return hits[0] if hits else None
    said = {}                               # "1/2: averaged over the batch entries or averaged over the heads"
    for w in own:
        head, _, rest = w.partition(": ")
        said.setdefault(head, []).append(rest)
    return " or ".join(head + (": " + " or ".join(r for r in rests if r) if any(rests) else "")
                       for head, rests in said.items())


def _constant_factor(t, a, r, denom, bound, constants):
    """[(residual, "constant-factor", words, prediction)] when ``t`` is the reference times one
    factor c, fitted by least squares over the whole tensor, to within its bound: "dbias
    multiplied by one constant, 0.125 (scale = 0.125)".  [] otherwise; on a tensor of fewer than
    `CONSTANT_FROM` entries (one factor fits a few numbers too easily: dsinks, one per head) only
    a factor that is a constant of `_constants`, on two entries at least."""
    if a.size < 2 or not (np.isfinite(a).all() and np.isfinite(r).all()):
        return []
    rr = float((r * r).sum())
    if rr == 0:
        return []
    c = float((a * r).sum()) / rr
    pred = c * r
    residual = slice_errors(a, pred, denom)
    named = _named_constant(c, constants)
    if residual.max() > bound or (a.size < CONSTANT_FROM and named is None):
        return []
    return [(residual, "constant-factor", f"{t} multiplied by one constant, {c:.6g}"
             + (f" ({named})" if named else ""), pred)]


def _constant_offset(a, r, denom, bound, constants):
    """[(residual, "lse-offset", words, prediction)] when lse is the reference plus one constant c
    on every row it judges (the others 0 in both), c their mean, to within its bound, said as
    the log of a constant of the case or k ln 2 where it is one ("lse off by one constant, 5.54518
    (8 ln 2)": a base-2 kernel's exp2 offset of 8 not taken out of log l).  [] otherwise."""
    judged = r != 0.0
    if judged.sum() < 2 or not (np.isfinite(a).all() and np.isfinite(r).all()):
        return []
    c = float((a - r)[judged].mean())
    pred = np.where(judged, r + c, r)
    residual = slice_errors(a, pred, denom)
    if residual.max() > bound or abs(c) <= bound * np.max(denom):
        return []
    logs = [(math.log(v), f"log({w})") for v, w in constants if v > 0 and v != 1] + \
        [(k * math.log(2), f"{k} ln 2") for k in range(1, 17)]
    named = next((w for v, w in logs if abs(c - v) <= CONSTANT_WITHIN * abs(v)), None)
    return [(residual, "lse-offset", f"lse off by one constant, {c:.6g}" + (f" ({named})" if named else ""), pred)]


def _zero_one_fit(parts, got):
    """Weights w, each 0 or 1, with ``parts @ w`` ≈ ``got`` (least squares, then rounded), or None
    where the fitted weights are not within 0.05 of 0 or 1."""
    weights = np.linalg.lstsq(parts, got, rcond=None)[0]
    rounded = np.round(weights)
    if np.abs(weights - rounded).max() > 0.05 or not set(np.unique(rounded)) <= {0.0, 1.0}:
        return None
    return rounded


def _head_map(sub):
    """dk and dv summed onto the kv heads over another map of query heads than the forward's
    (tiled where interleaved is meant, another group size, one head of a group): each query
    head's own dk_h and dv_h recomputed (k and v given a copy per query head), and the map fitted
    to the target's dk by least squares, kv head by kv head, its weights rounded to 0 or 1; then
    checked on dv.  [] with one kv head per query head, or where the fitted weights are not
    0 or 1 (`_constant_factor` reads a map scaled as a whole)."""
    case = sub.case
    got = sub.arrays.get("dk")
    group = case.heads // case.hkv
    if group == 1 or got is None or not np.isfinite(got).all() or sub.rows is not None:
        return []
    r = sub.rounded
    wide = dense.run(r["q"], np.repeat(r["k"], group, 1), np.repeat(r["v"], group, 1), r["dout"], sub.opts,
                     dlse=r.get("dlse"))
    wide = {n: np.asarray(wide[n]) for n in ("dk", "dv")}                     # (B, Hq, Tk, D)
    hq = case.heads
    A = np.moveaxis(wide["dk"], 1, -1).reshape(-1, hq)                        # (B Tk D, Hq)
    y = np.moveaxis(got, 1, -1).reshape(-1, case.hkv)                         # (B Tk D, Hkv)
    rounded = _zero_one_fit(A, y)                                             # (Hq, Hkv)
    right = np.zeros((hq, case.hkv))
    right[np.arange(hq), np.arange(hq) // group] = 1
    if rounded is None or np.array_equal(rounded, right):
        return []
    heads = lambda w, g: ", ".join(str(h) for h in np.nonzero(w[:, g])[0]) or "none"
    says = "; ".join(f"kv head {g} from query heads {heads(rounded, g)} (read by {heads(right, g)})"
                     for g in range(case.hkv) if not np.array_equal(rounded[:, g], right[:, g]))

    def predict(grads=True):
        return {**sub.gold, **{n: np.einsum("bhtd,hg->bgtd", wide[n], rounded) for n in ("dk", "dv")}}
    return [mistakes.Hypothesis("head-map", f"dk and dv summed over another map of query heads than the "
                                f"forward's: {says}", predict, ("dk", "dv"), fitted=("dk",))]


def _dq_head_map(sub):
    """dq whose query heads are written into other heads' slots (an atomic add at the kv head's index
    where the query head's is meant, a head index decoded wrong): each slot the sum of some heads'
    reference dq, the map fitted by least squares over (batch, row, channel) and rounded to 0 or 1.
    [] with one head, or where the map is the identity or not 0 or 1."""
    got, ref = sub.arrays.get("dq"), sub.gold.get("dq")
    hq = sub.case.heads
    if got is None or ref is None or hq < 2 or not np.isfinite(got).all() or sub.rows is not None:
        return []
    A = np.moveaxis(ref, 1, -1).reshape(-1, hq)                                     # (B Tq D, Hq): sources
    rounded = _zero_one_fit(A, np.moveaxis(got, 1, -1).reshape(-1, hq))              # (Hq, Hq): source -> slot
    if rounded is None or np.array_equal(rounded, np.eye(hq)):
        return []
    pred = np.einsum("bhtd,hg->bgtd", ref, rounded)
    heads = lambda g: ", ".join(str(h) for h in np.nonzero(rounded[:, g])[0])
    slots = [f"head {g} holds heads {heads(g)}'s" for g in range(hq) if rounded[:, g].any() and
             not (rounded[:, g] == np.eye(hq)[:, g]).all()]
    empty = [g for g in range(hq) if not rounded[:, g].any()]
    said = "; ".join(slots + ([f"heads {ranges(empty)} left 0"] if empty else []))
    return [mistakes.Hypothesis("dq-head-map", f"dq of each query head written into another head's slot ({said}: "
                                "an atomic add at the kv head's index where the query head's is meant, or a head "
                                "index decoded wrong)", lambda grads=True: {**sub.gold, "dq": pred}, ("dq",),
                                fitted=("dq",))]


PAST_THE_TABLE = "0 (a load past the table's end)"      # a per-head value read as 0 (`_values_from_other_slices`)


def _values_from_other_slices(sub):
    """out right on some (batch, head) slices, and on each of the others as if a value given per
    slice were read from another slice: a per-head option (ALiBi's slopes, the sinks) taken from
    another head, an input's descale (FP8's, per batch entry and kv head) from another slice.  One
    dense forward per source slice, its value put on every slice; each failing slice matched to
    the nearest source (fewest indices apart: two slices' values may be alike) that reproduces it
    within NAMED_WITHIN of the bound (a per-head value also as 0: a masked load past its table's end), or
    the reading is not made.  [] where out is not finite, on
    a block of rows, or past UNSEEN_LIMIT."""
    case, got, r = sub.case, sub.arrays.get("out"), sub.rounded
    if got is None or not np.isfinite(got).all() or sub.rows is not None or \
            case.batch * case.heads * case.tq * case.tk > UNSEEN_LIMIT:
        return []
    den, bound = sub.den["out"], sub.bounds["out"]
    failing = slice_errors(got, sub.gold["out"], den) > bound                  # (B, Hq)
    group = case.heads // case.hkv
    families = []            # (name, the index of slice (b, h), words of an index, [(index, changes, inputs)])
    for n in PER_HEAD:
        a = sub.opts.get(n)
        if a is not None and np.ndim(a) == 1 and len(a) > 1:
            families.append((n, lambda b, h: (h,), lambda i: f"head {i[0]}'s" if i[0] is not None else PAST_THE_TABLE,
                             [((h,), {n: np.full_like(a, a[h])}, None) for h in range(len(a))] +
                             [((None,), {n: np.zeros_like(a)}, None)]))
    scaled = {n: r[i.scale] for n, i in stored_inputs(case).items() if i.scale and n in r and r.get(i.scale) is not None
              and r[i.scale].size > 1}
    # each descale alone, then each set of them together (one slice's read for another's: a schedule's
    # reordering; the scores' two, q's and k's, kept from a persistent program's first tile)
    for names in (c for size in range(1, len(scaled) + 1) for c in itertools.combinations(scaled, size)):
        shape = scaled[names[0]].shape                                      # (B, Hkv)
        moved = lambda b, g: {n: r[n] * per_head(np.full_like(scaled[n], scaled[n][b, g]) / scaled[n], r[n].shape[1])
                              for n in names}
        families.append((" and ".join(stored_inputs(case)[n].scale for n in names), lambda b, h: (b, h // group),
                         lambda i: f"(batch {i[0]}, kv head {i[1]})'s", [((b, g), None, moved(b, g))
                                                                       for b, g in np.ndindex(shape)]))
    out = []
    for name, index, words, sources in families:
        found = [_dense_forward(sub, changes=c, inputs=i)[:2] for _, c, i in sources]
        residual = np.stack([slice_errors(got, o, den) for o, _ in found]) / bound       # (sources, B, Hq)
        apart = np.array([[[sum(a != b for a, b in zip(src, index(b, h))) for h in range(case.heads)]
                           for b in range(case.batch)] for src, _, _ in sources])
        best = np.where(residual <= NAMED_WITHIN, apart + residual, np.inf).argmin(0)
        fit = np.take_along_axis(residual, best[None], 0)[0]
        if not (fit[failing] <= NAMED_WITHIN).all():
            continue
        # a passing slice its own value reproduces less clearly than another's is read as that one too
        own = np.where(apart == 0, residual, np.inf).min(0)
        changed = failing | ((own > NAMED_WITHIN) & (fit <= NAMED_WITHIN) & (apart.min(0) == 0))
        def pick(k, ref):                    # each changed slice from its source's forward, the others ref's
            stacked = np.stack([f[k].reshape(ref.shape) for f in found])      # (sources, B, Hq, ...)
            ones = (1,) * (ref.ndim - 2)
            chosen = np.take_along_axis(stacked, best.reshape((1,) + best.shape + ones), 0)[0]
            return np.where(changed.reshape(changed.shape + ones), chosen, ref)
        pred = {"out": pick(0, sub.gold["out"])}
        if "lse" in sub.gold:
            pred["lse"] = _judged_lse(sub, pick(1, sub.gold["lse"]))
        grads = tuple(n for n in ("dq", "dk", "dv") if n in sub.gold) if case.hkv == case.heads else ()
        given = {(b, h): words(sources[best[b, h]][0]) for b, h in zip(*np.nonzero(changed))}
        by_unit = {}                         # by kv head or head; by (batch, head) where batch entries differ
        for (b, h), src in given.items():
            by_unit.setdefault(words(index(b, h)), set()).add(src)
        per_entry = any(len(v) > 1 for v in by_unit.values())
        said = {(f"(batch {b}, head {h})" if per_entry else words(index(b, h))[:-2]): src
                for (b, h), src in given.items()}
        listed = "; ".join(f"{u} given {src}" for u, src in list(said.items())[:6]) + "; ..." * (len(said) > 6)
        others = "" if changed.all() else "; the other slices right"
        says = f"{name} read from another slice: {listed} ({others[2:] or 'every slice'})"
        if all(src == PAST_THE_TABLE for src in given.values()):          # no slice's value read for another's
            says = f"{name} taken as 0 on {', '.join(said)} (the option absent there: not applied, or scaled down " \
                   f"past what this case shows{others})"
        predict = functools.partial(_slice_values_predict, sub, pred, sources, best, changed, grads)
        out.append(mistakes.Hypothesis("slice-values", says, predict, tuple(pred) + grads))
    return out


def _slice_values_predict(sub, pred, sources, best, changed, names, grads=True):
    """`_values_from_other_slices`' prediction: ``pred`` (out, lse), and with ``grads`` the gradients
    ``names`` of each ``changed`` slice from the dense backward run with its source's value (a backward that
    reads the same slice's value as its forward), the others the reference's; one run per source used.
    Where each (batch, head) slice's dk and dv are its own (no GQA: ``names`` empty otherwise)."""
    if not grads or not names:
        return {**sub.gold, **pred}
    r, found = sub.rounded, {**sub.gold, **pred}
    for k in np.unique(best[changed]):
        _, changes, inputs = sources[k]
        x = {**r, **(inputs or {})}
        run = as_4d(dense.run(x["q"], x["k"], x["v"], r["dout"], {**sub.opts, **(changes or {})}, grads=True,
                              dlse=r.get("dlse")))
        here = changed & (best == k)
        for n in names:
            found[n] = np.where(here.reshape(here.shape + (1, 1)), run[n].reshape(found[n].shape), found[n])
    return found


# A sink's weight counted k_i times in row i's denominator (`_sink_counted`): k_i read only where
# the sink holds at least SINK_WEIGHT of the row's weight, and each within SINK_INTEGER of a whole number.
SINK_WEIGHT = 1e-3
SINK_INTEGER = 0.05


def _sink_extra(sub, extra):
    """The prediction of a sink's weight counted ``extra``/(B, H, Tq) times as much in each row's
    sum: out_i / extra_i, and lse_i + log extra_i where lse is judged."""
    pred = {"out": sub.gold["out"] / extra[..., None]}
    if "lse" in sub.gold:
        pred["lse"] = _judged_lse(sub, sub.gold["lse"] + np.log(extra).reshape(sub.gold["lse"].shape))
    return pred


def _sink_counted(sub):
    """Each row's denominator holding the sink's weight another whole number of times than once:
    a sink folded into every split's or tile's partial (counted once per split), or into the first
    key tile only (not at all on the rows that skip it).  With p_i = exp(sink − lse_i), the sink's
    share of row i, an out scaled by c_i gives 1/c_i = 1 + (k_i − 1) p_i: k_i read row by row,
    rounded, and the prediction out_i / (1 + (k_i − 1) p_i), lse_i + log(1 + (k_i − 1) p_i)."""
    got, sinks = sub.arrays.get("out"), sub.opts.get("sinks")
    if sinks is None or got is None or not np.isfinite(got).all() or sub.rows is not None:
        return []
    lse = _dense_forward(sub)[1]                                              # (B, Hq, Tq)
    p = np.exp(np.asarray(sinks, dtype=np.float64)[None, :, None] - np.where(np.isfinite(lse), lse, np.inf))
    unshifted = _sink_unshifted(sub, p)
    c = _row_scaled(got, sub.gold["out"])[0][..., 0]
    told = (p >= SINK_WEIGHT) & (c > 0)
    k = np.where(told, 1 + (1 / np.where(told, c, 1.0) - 1) / np.where(told, p, 1.0), 1.0)
    whole = np.round(k)
    if not told.any() or np.abs(k - whole)[told].max() > SINK_INTEGER or whole.min() < 0 or (whole == 1).all():
        return unshifted + _sink_weighed(sub, p, k, told)
    pred = _sink_extra(sub, 1 + (whole - 1) * p)
    times = lambda n: "not at all" if n == 0 else "twice" if n == 2 else f"{n} times"
    counts = {n: sorted(set(np.nonzero(whole == n)[2].tolist())) for n in set(whole[whole != 1].astype(int).tolist())}
    if len(counts) == 1 and len(next(iter(counts.values()))) == sub.case.tq:
        said = f"counted {times(next(iter(counts)))} in every row's denominator instead of once"
    else:
        said = "counted " + "; ".join(f"{times(n)} on query rows {ranges(rows)}" for n, rows in sorted(counts.items())) \
            + f" of {sub.case.tq} in their denominators, once on the other rows"
    weighed = [] if slice_errors(got, pred["out"], sub.den["out"]).max() <= sub.bounds["out"] else \
        _sink_weighed(sub, p, k, told)                                        # not a whole number of times
    return unshifted + weighed + [mistakes.Hypothesis(
        "sink-counted", f"the sink's weight {said} (a sink folded into every partial of a split or tile loop, or into "
        "one tile only)", lambda grads=True: {**sub.gold, **pred}, tuple(pred), fitted=("out",))]


def _sink_weighed(sub, p, k, told):
    """The sink's weight in each row's sum multiplied by one factor x_h per head, its logit shifted
    by log x_h (an exp2 offset left out of the sink's term, the scores' cap applied to the sink):
    with k_i read as in `_sink_counted`, x_h the median of k_i over the head's rows where the sink
    weighs, the prediction out_i / (1 + (x_h − 1) p_i) held to the bound.  Tried first as the
    power of two nearest those factors, shared by every head, then as a numeric option c of the
    case capping the sink's logit as the scores are, c tanh(sink / c); the first that holds is said."""
    x = np.array([np.median(k[:, h][told[:, h]]) if told[:, h].any() else 1.0 for h in range(k.shape[1])])
    if np.abs(x - 1).max() <= 1e-2 or (x <= 0).any():
        return []
    sink = np.asarray(sub.opts["sinks"], dtype=np.float64)
    shown = told.any((0, 2))
    e = int(round(float(np.median(np.log2(x[shown])))))
    tried = [(np.full_like(x, 2.0 ** e), f"2^{e} on every head: an exp2 offset of {abs(e)} (log2 units) "
              f"{'left out of' if e < 0 else 'added to'} the sink's term alone (FlashAttention-3's FP8 max offset "
              "is 8)")] if e else []
    tried += [(np.exp(c * np.tanh(sink / c) - sink), f"{', '.join(f'{f:.3g}' for f in x[shown])} by head: the sink's "
               f"logit capped as the scores are, c tanh(sink / c) with c the case's {n} = {c:g}")
              for n, c in mistakes.positive_scalars(sub.opts).items()]
    tried += [(x, f"{x[shown].min():.3g} .. {x[shown].max():.3g} by head")]
    for factor, said in tried:
        pred = _sink_extra(sub, 1 + (factor[None, :, None] - 1) * p)
        if slice_errors(sub.arrays["out"], pred["out"], sub.den["out"]).max() <= sub.bounds["out"]:
            return [mistakes.Hypothesis("sink-weighed", f"the sink's weight in each row's sum multiplied by a factor "
                                        f"of its head, {said}", lambda grads=True, pred=pred: {**sub.gold, **pred},
                                        tuple(pred), fitted=("out",))]
    return []


def _sink_unshifted(sub, p):
    """The sink's term added to each row's sum as exp(sink) where exp(sink − m) is meant, m the row's
    largest key score (the running maximum a key loop ends with): its share p_i of the row counted
    e^{m_i} times, out_i / (1 + (e^{m_i} − 1) p_i) and lse_i + log of the same (the kernel's own,
    m_i + log l_i).  Not fitted."""
    m = _dense_forward(sub, changes={"sinks": None})[2]
    if not np.isfinite(m).any():
        return []
    pred = _sink_extra(sub, 1 + np.expm1(np.where(np.isfinite(m), m, 0.0)) * p)
    return [mistakes.Hypothesis("sink-unshifted", "the sink's exp(sink) added to each row's sum without the row's "
                                "running maximum m subtracted (exp(sink - m) is meant)",
                                lambda grads=True: {**sub.gold, **pred}, tuple(pred))]


def _broadcast_sum(sub, n):
    """The gradient ``n`` of an input broadcast over (batch, head, query row, key) dims summed over
    another set of the slices it is broadcast to (one slice kept, where each should add: ``=`` for
    ``+=``): each slice's own gradient recomputed with the input given at full size, the slices'
    weights fitted to the target by least squares and rounded to 0 or 1.  [] where the input is not
    broadcast, or the weights are not 0 or 1 (`_constant_factor` reads a mean for a sum)."""
    value, got, case = sub.opts.get(n[1:]), sub.arrays.get(n), sub.case
    if not isinstance(value, np.ndarray) or got is None or not np.isfinite(got).all() or sub.rows is not None:
        return []
    full = (case.batch, case.heads, case.tq, case.tk)
    value4 = value.reshape((1,) * (4 - value.ndim) + value.shape)
    dims = [d for d in range(4) if value4.shape[d] == 1 and full[d] > 1]
    if value.ndim > 4 or not dims or any(s not in (1, f) for s, f in zip(value4.shape, full)):
        return []
    r = sub.rounded
    wide = dense.run(r["q"], r["k"], r["v"], r["dout"], {**sub.opts, n[1:]: np.broadcast_to(value4, full).copy()},
                     dlse=r.get("dlse"))[n]                                  # (B, Hq, Tq, Tk): each slice its own
    across = _tiles_summed_across(sub, n, wide, dims)
    slices = list(np.ndindex(*(full[d] for d in dims)))
    pick = lambda idx: wide[tuple(idx[dims.index(d)] if d in dims else slice(None) for d in range(4))]
    parts = np.stack([pick(idx).reshape(-1) for idx in slices], axis=1)      # (entries, slices)
    rounded = _zero_one_fit(parts, got.reshape(-1))
    if rounded is None or rounded.all():
        return across
    axes = ("batch", "head", "query row", "key")
    named = lambda idx: "(" + ", ".join(f"{axes[d]} {i}" for d, i in zip(dims, idx)) + ")"
    kept = [named(idx) for idx, w in zip(slices, rounded) if w]
    pred = (parts @ rounded).reshape(got.shape)

    def predict(grads=True):
        return {**sub.gold, n: pred}
    return across + [mistakes.Hypothesis("broadcast-sum", f"{n} summed over {len(kept)} of the {len(slices)} slices "
                                         f"its input is broadcast over: {', '.join(kept) or 'none'}, not all of them "
                                         "(a slice's gradient written where each should add)", predict, (n,),
                                         fitted=(n,))]


def _tiles_summed_across(sub, n, wide, dims):
    """The gradient ``n`` of an input broadcast over the query rows (a key bias) summed, in each
    square tile of `mistakes.KEY_TILES`, over the tile's keys where its queries are meant (a kernel
    that works on transposed tiles dSᵀ reducing the wrong axis): key position kt·t + c takes the sum
    over tile kt's keys at query row qt·t + c, over every query tile qt.  ``wide``: the gradient at
    full size (B, Hq, Tq, Tk).  Not fitted: one hypothesis per tile size."""
    case, got = sub.case, sub.arrays[n]
    if 2 not in dims or 3 in dims:
        return []
    out = []
    for t in (t for t in mistakes.KEY_TILES if t < max(case.tq, case.tk)):
        tiles = _in_tiles(_in_tiles(wide, 2, t), 4, t)                        # (B, H, nq, t, nk, t)
        flipped = np.swapaxes(tiles, 3, 5).reshape(*wide.shape[:2], tiles.shape[2] * t, -1)[..., :case.tk]
        pred = flipped.sum(axis=tuple(dims), keepdims=True).reshape(got.shape)
        out.append(mistakes.Hypothesis("tiles-summed-across", f"{n} summed over each {t} x {t} tile's keys where "
                                       "its query rows are meant (a transposed tile reduced on the wrong axis: key "
                                       "kt·t + c given the sum of tile kt's keys at query row qt·t + c)",
                                       lambda grads=True, pred=pred: {**sub.gold, n: pred}, (n,)))
    return out


def _lse_max_factor(sub):
    """lse = log Σ_j exp(S_ij − m_i) + k m_i with k ≠ 1: the row maximum m added back unscaled
    (k = 1/scale: the maximum of q·k taken before the scale), in another base, or not at all
    (k = 0): k − 1 fitted by least squares to lse − the reference's over the rows that see a key,
    named when k is a constant of the case (`_constants`)."""
    got, gold = sub.arrays.get("lse"), sub.gold.get("lse")
    if got is None or gold is None or not np.isfinite(got).all() or sub.rows is not None:
        return []
    m = _dense_forward(sub)[2][..., None]                                       # (B, H, Tq, 1)
    m = np.where(np.isfinite(m) & (gold != 0.0), m, 0.0)                       # judged rows only
    mm = float((m * m).sum())
    if mm == 0:
        return []
    k = 1 + float(((got - gold) * m).sum()) / mm
    if not np.isfinite(k):
        return []
    pred = gold + (k - 1) * m
    named = "not at all" if abs(k) < CONSTANT_WITHIN else f"{_named_constant(k, _constants(sub)) or f'{k:.6g}'} times"

    def predict(grads=True):
        return {**sub.gold, "lse": pred}
    return [mistakes.Hypothesis("lse-max-factor", f"lse = log sum_j exp(S_ij - m_i) + {k:.6g} m_i: each row's maximum "
                                f"score m added back {named} instead of once", predict, ("lse",), fitted=("lse",))]


# The thresholds (log2 units) of a conditional rescale `_lse_stale_max` tries: the reference maximum moved
# only when the running one rises past it by more than this (FlashAttention-4: 8; inf: never after the first)
RESCALE_THRESHOLDS = (1, 2, 4, 6, 8, 10, 12, 16, math.inf)


def _lse_stale_max(sub):
    """lse = m + log l formed with the row's running maximum m while l (and acc) were taken against an
    older one, m_ref: an online softmax that moves its reference only when the maximum rises past it by
    more than τ log2 units (FlashAttention-4's conditional rescale; τ = ∞: the first key tile's maximum
    kept), its out right (acc / l: the reference cancels) and its lse too large by m − m_ref ≥ 0 on each
    row whose maximum rose less than τ since the reference was last set.  The maxima from the reference's
    scores (log P) in the key tiles of `mistakes.KEY_TILES`, visited from the first or from the last, τ
    from `RESCALE_THRESHOLDS`: nothing continuous fitted; the backward recomputes P = exp(S − lse) from
    that lse (each row's P too small by exp(m_ref − m)).  Held to the bound on lse; [] where lse is right
    or out wrong."""
    got, gold = sub.arrays.get("lse"), sub.gold.get("lse")
    out = sub.arrays.get("out")
    if got is None or gold is None or not np.isfinite(got).all() or out is None or \
            slice_errors(out, sub.gold["out"], sub.den["out"]).max() > sub.bounds["out"]:
        return []
    error = slice_errors(got, gold, sub.den["lse"]).max()
    P = _dense_weights(sub) if error > sub.bounds["lse"] else None
    if P is None:
        return []
    fits = []
    for tile in sorted(mistakes.KEY_TILES, reverse=True):
        if -(-P.shape[-1] // tile) < 2:
            continue
        with np.errstate(divide="ignore"):
            top = np.log(_in_tiles(P, -1, tile)).max(-1)                         # (B, H, Tq, n), -inf: unseen
        for order, tops in (("first", top), ("last", top[..., ::-1])):
            for tau in RESCALE_THRESHOLDS:
                m = m_ref = np.full(top.shape[:-1], -np.inf)
                for t in range(tops.shape[-1]):
                    m = np.maximum(m, tops[..., t])
                    with np.errstate(invalid="ignore"):
                        moved = ~np.isfinite(m_ref) | (m - m_ref > tau * math.log(2))
                    m_ref = np.where(moved, m, m_ref)
                with np.errstate(invalid="ignore"):                               # -inf - -inf: a row seeing no key
                    delta = np.where(np.isfinite(m), m - m_ref, 0.0)
                if not delta.any():
                    continue
                pred = _judged_lse(sub, gold + delta.reshape(gold.shape))
                residual = slice_errors(got, pred, sub.den["lse"]).max()
                if residual <= sub.bounds["lse"]:
                    fits.append((residual, tile, order, tau, delta))
    if not fits:
        return []
    _, tile, order, tau, delta = min(fits, key=lambda f: f[0])
    taus = [f[3] for f in fits if f[1:3] == (tile, order)]          # the thresholds this case cannot tell apart
    shift = torch.as_tensor(delta)
    r = sub.rounded

    def predict(grads=True):
        lse = {"lse": _judged_lse(sub, gold + delta.reshape(gold.shape))}
        if not grads:
            return {**sub.gold, **lse}
        return {**as_4d(dense.run(r["q"], r["k"], r["v"], r["dout"], sub.opts, grads=True, dlse=r.get("dlse"),
                                  backward_lse=lambda lse, first: lse + shift[..., first:first + lse.shape[-1]])),
                **lse}
    lo, hi = min(taus), max(taus)
    when = "never after the first key tile" if lo == math.inf else \
        f"only when the maximum rose past it by more than a threshold of {lo:g} log2 units or more (each from {lo:g} " \
        "up gives this case; FlashAttention-4's is 8)" if hi == math.inf else \
        f"only when the maximum rose by more than {lo:g} .. {hi:g} log2 units"
    return [mistakes.Hypothesis(
        "lse-stale-max", f"lse formed with the row's running maximum while the sum l was taken against an older "
        f"one (key tiles of {tile}, visited from the {order}; the reference moved {when}: a conditional rescale): "
        f"lse too large by m − m_ref, up to {float(delta.max()):.3g}, on the rows whose maximum rose since; out "
        "right; a backward recomputing P = exp(S − lse) takes each such row's P too small by exp(m_ref − m)",
        predict, ("lse", "dq", "dk", "dv"))]


def _sequence_offsets(sub):
    """Sequences of a batch of per-sequence lengths aligned with another offset than their own
    (query i sees key j ≤ i + o, ALiBi's distances from the same o): each sequence's offset chosen
    among those a kernel slips into, by which reproduces its rows of out: another sequence's, the
    batch's max_seqlen_k − max_seqlen_q, 0 (top-left), its own ± its start difference
    cu_seqlens_k − cu_seqlens_q (a position counted from the other tensor's start), its own ± 1.
    Tried where some sequences are right and others not (the same slip in every sequence is the
    catalogue's: the other alignment, a mask one diagonal off).  [] without per-sequence lengths,
    or where every sequence keeps its own."""
    got, case, r = sub.arrays.get("out"), sub.case, sub.rounded
    lq, lk = sub.opts.get("seqlens_q"), sub.opts.get("seqlens_k")
    if got is None or not np.isfinite(got).all() or lq is None or lk is None or sub.rows is not None or \
            sub.opts.get("keep") is not None:
        return []
    wrong = slice_errors(got, sub.gold["out"], sub.den["out"]).max(axis=1) > sub.bounds["out"]      # (B,)
    if wrong.all() or not wrong.any():
        return []
    lq, lk = [int(x) for x in lq], [int(x) for x in lk]
    own = dense.offsets(case.tq, case.tk, lq, lk, sub.opts.get("align", "top-left"), case.batch)
    starts = [int(d) for d in np.cumsum([0] + lk)[:-1] - np.cumsum([0] + lq)[:-1]]   # cu_seqlens_k − cu_seqlens_q
    absolute = {max(lk) - max(lq): "the batch's max_seqlen_k - max_seqlen_q", 0: "0 (top-left)"}
    absolute.update({o: f"sequence {c}'s" for c, o in reversed(list(enumerate(own))) if o not in absolute})
    runs = ([("its own", [0] * case.batch)] + [(words, [x - o for o in own]) for x, words in absolute.items()]
            + [("its own minus its start difference cu_seqlens_k - cu_seqlens_q", [-d for d in starts]),
               ("its own plus its start difference cu_seqlens_k - cu_seqlens_q", starts),
               ("its own -1", [-1] * case.batch), ("its own +1", [1] * case.batch)])     # (words, shift)
    residuals = {}                                                  # shift -> (B,) residual of each sequence
    for _, shift in runs:
        if tuple(shift) not in residuals:
            pred = as_4d(dense.run(r["q"], r["k"], r["v"], None, sub.opts, grads=False, shift=shift))["out"]
            residuals[tuple(shift)] = slice_errors(got, pred, sub.den["out"]).max(axis=1)
    shift = [min((residuals[tuple(s)][b], n, s[b]) for n, (_, s) in enumerate(runs))[2] for b in range(case.batch)]
    if not any(shift):
        return []
    alike = lambda b: " = ".join(dict.fromkeys(w for w, s in runs if s[b] == shift[b]))    # the same offset
    said = "; ".join(f"sequence {b} with offset {own[b] + d} ({alike(b)}; its lengths give {own[b]})"
                     for b, d in enumerate(shift) if d)

    def predict(grads=True):
        return as_4d(dense.run(r["q"], r["k"], r["v"], r["dout"] if grads else None, sub.opts, grads=grads,
                               dlse=r.get("dlse") if grads else None, shift=shift))
    masked = case.causal or any(sub.opts.get(o) is not None for o in dense.VISIBILITY if o not in ("causal", "align"))
    moved = [words for words, on in (("the mask: query i sees key j <= i + offset", masked),
                                     ("ALiBi's distance |i + offset - j|", sub.opts.get("alibi_slopes") is not None))
             if on] or ["query i sees key j <= i + offset"]
    return [mistakes.Hypothesis("sequence-offsets", f"sequences aligned with another offset than their own lengths "
                                f"give ({' and '.join(moved)}): {said}", predict,
                                ("out", "lse", "dq", "dk", "dv"), fitted=("out",))]


def _padding_rows_from_next_slice(sub, failing):
    """The dK/dV pass's last partial query tile of each (batch, head) slice filled past Tq with the
    next slice's first rows (their q, dO, lse and D: a row mask bounded by the whole buffer's end
    where the slice's length is meant), the last slice's with nothing: row r = Tq + i of slice s
    reads row i of slice s + 1 (flat (batch, head) order), weighed against slice s's keys with that
    row's own lse and D:  P = exp(S − lse'),  dV += Pᵀ dO',  dS = P ∘ (dO' Vᵀ − D'),  dK += ∂(Σ P ∘ c)/∂K
    (c = dO' Vᵀ − D' held: the scale and any option's derivative in S come from autograd).  One
    hypothesis per tile of `mistakes.KEY_TILES` that leaves padding rows, at most Tq of them; []
    with dropout, per-sequence lengths, a block of rows, or dk and dv both right."""
    case, r = sub.case, sub.rounded
    if not {"dk", "dv"} & set(failing) or case.seqlens is not None or sub.rows is not None or \
            sub.opts.get("keep") is not None or case.batch * case.heads < 2:
        return []
    out, lse, _ = _dense_forward(sub)
    D = (r["dout"] * out).sum(-1) - (r["dlse"] if r.get("dlse") is not None else 0.0)
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.float64)
    hyps = []
    for tile in (t_ for t_ in mistakes.KEY_TILES if 0 < -case.tq % t_ <= case.tq):
        pad = -case.tq % tile
        shifted = lambda a, fill: np.concatenate([a.reshape((-1,) + a.shape[2:])[1:, :pad],
                                                  np.full((1, pad) + a.shape[3:], fill)]).reshape(
                                                      a.shape[:2] + (pad,) + a.shape[3:])
        q, dout, lse_n, D_n = shifted(r["q"], 0.0), shifted(r["dout"], 0.0), shifted(lse, np.inf), shifted(D, 0.0)
        k = t(r["k"]).requires_grad_(True)
        S = _scores_past_tq(sub, t(q), k)
        P = torch.exp(S - t(lse_n)[..., None])
        v = np.repeat(r["v"], case.heads // case.hkv, 1)
        c = dout @ np.swapaxes(v, -1, -2) - D_n[..., None]
        (P * t(c)).sum().backward()
        P = P.detach().numpy()
        if not np.isfinite(P).all() or not P.any():
            continue
        extra = {"dk": k.grad.numpy(), "dv": _per_kv(case, np.swapaxes(P, -1, -2) @ dout)}
        pred = {n: sub.gold[n] + extra[n].reshape(sub.gold[n].shape) for n in extra if n in sub.gold}
        hyps.append(mistakes.Hypothesis(
            "padding-rows-from-next-slice", f"the dK/dV pass's last query tile of {tile} of each (batch, head) slice "
            f"filled past Tq = {case.tq} with the next slice's first {pad} rows (their q, dO, lse and D: rows "
            f"{case.tq} .. {case.tq + pad - 1} masked at the whole buffer's end, where the slice's length is meant)",
            lambda grads=True, pred=pred: {**sub.gold, **pred}, tuple(pred)))
    return hyps


def _per_kv(case, a):
    """A gradient per query head (B, Hq, T, D) summed onto the kv heads (B, Hkv, T, D), each kv head
    over its group of query heads (h // group)."""
    return a.reshape(case.batch, case.hkv, case.heads // case.hkv, *a.shape[2:]).sum(2)


def _backward_by_entry(sub, failing):
    """(P, grad, block, factors) for the readings of a backward that leaves some (query, key) entries out: P the
    dense forward's weights (v the identity), and grad(n, keep) the gradient ``n`` (dq, dk or dv)
    from the entries where the (B, Hq, Tq, Tk)-broadcastable ``keep`` holds alone:

        dV = (P ∘ keep)ᵀ dO,   dS = P ∘ (dO Vᵀ − D) ∘ keep,   dQ = scale dS K,   dK = scale dSᵀ Q,

    D = rowsum(dO ∘ O) − dlse (a kernel's D, computed apart, is whole); dk and dv summed onto the
    kv heads.  Held first to the reference's own dq (an option whose derivative dS lacks, a
    softcap's, leaves it out).  ``factors``: {name: array} of the products, per query head (dS
    with its scale).  None with dropout, per-sequence lengths, a block of rows, no failing dq, dk
    or dv, or weights too large to hold."""
    case, r = sub.case, sub.rounded
    wanted = any(n in failing for n in ("dq", "dk", "dv")) and _dq_to_fit(sub) is not None
    P = _dense_weights(sub) if wanted else None
    if P is None:
        return None
    group = case.heads // case.hkv
    k, v = np.repeat(r["k"], group, 1), np.repeat(r["v"], group, 1)
    dout, scale = r["dout"], sub.opts["scale"]
    D = (dout * (P @ v)).sum(-1) - (r["dlse"] if r.get("dlse") is not None else 0.0)
    dS = P * (dout @ np.swapaxes(v, -1, -2) - D[..., None])
    if slice_errors(scale * dS @ k, sub.gold["dq"], sub.den["dq"]).max() > FIT_SHARE * sub.bounds["dq"]:
        return None                                                          # dS is not this case's

    def grad(n, keep):
        if n == "dq":
            return scale * (dS * keep) @ k
        if n == "dk":
            return _per_kv(case, scale * np.swapaxes(dS * keep, -1, -2) @ r["q"])
        return _per_kv(case, np.swapaxes(P * keep, -1, -2) @ dout)

    def block(n, rows, keys):
        """dk or dv of keys ``keys`` (a slice) from query rows ``rows`` (a slice) alone; dq of
        rows ``rows`` from keys ``keys`` alone."""
        if n == "dq":
            return scale * dS[..., rows, keys] @ k[..., keys, :]
        w, x = (dS, scale * r["q"]) if n == "dk" else (P, dout)
        return _per_kv(case, np.swapaxes(w[..., rows, keys], -1, -2) @ x[..., rows, :])
    factors = {"scale · dS": scale * dS, "P": P, "Q": r["q"], "K": k, "V": v, "dO": dout, "D": D}
    return P, grad, block, factors


def _delta_unweighted(sub, failing, found):
    """dS = P ∘ dP − D where P ∘ (dP − D) is meant (a parenthesis lost): the row term D subtracted,
    unweighted, at each key the dQ pass visits, the keys its row sees or every key of the key tiles
    its query tile walks (masked keys on the diagonal included: P is 0 there, D is not), for each
    pair of tile sizes of `mistakes.KEY_TILES`: dq_i = scale (Σ_j P_ij dP_ij k_j − D_i Σ_{j visited}
    k_j).  dq alone (`_backward_by_entry`); nothing fitted."""
    if found is None or "dq" not in failing:
        return []
    P, _, _, f = found
    case, scale = sub.case, sub.opts["scale"]
    weighted = P * (f["dO"] @ np.swapaxes(f["V"], -1, -2))
    seen = P > 0
    visits = [("the keys its row sees", seen)]
    cols = np.arange(case.tk)
    # tile pairs that walk the same keys: the larger query tile said (FA2's dQ pass: BLOCK_M >= BLOCK_N)
    for bm, bn in itertools.product(sorted(mistakes.KEY_TILES, reverse=True), mistakes.KEY_TILES):
        walked = np.zeros_like(seen)
        for r0 in range(0, case.tq, bm):
            tile = seen[..., r0:r0 + bm, :].any(-2)                                  # (B, Hq, Tk)
            first = np.where(tile, cols, case.tk).min(-1) // bn * bn
            end = np.minimum(-(-(np.where(tile, cols, -1).max(-1) + 1) // bn) * bn, case.tk)
            walked[..., r0:r0 + bm, :] = ((cols >= first[..., None]) & (cols < end[..., None]))[..., None, :]
        if not (walked == seen).all() and not any((walked == v).all() for _, v in visits):
            visits.append((f"every key of the key tiles of {bn} its query tile of {bm} walks", walked))
    hyps = []
    for words, visited in visits:
        dq = scale * (weighted - f["D"][..., None] * visited) @ f["K"]
        hyps.append(mistakes.Hypothesis(
            "delta-unweighted", f"dS = P ∘ dP - D where P ∘ (dP - D) is meant (a parenthesis lost: D subtracted "
            f"unweighted at {words})", lambda grads=True, dq=dq: {**sub.gold, "dq": dq}, ("dq",)))
    return hyps


def _last_tile_only(sub, failing, found):
    """A gradient that keeps only its last tile's share: dq_i from the key tile holding row i's
    last visible key alone, dk_j and dv_j from the query tile holding the last row that sees key
    j alone (a tile's partial written with = where += is meant), for each tile size of
    `mistakes.KEY_TILES`; the size fitted to each of dq, dk, dv (`_backward_by_entry`)."""
    if found is None:
        return []
    P, grad, _, _ = found
    case = sub.case
    seen = P > 0
    rows, keys = np.arange(case.tq)[:, None], np.arange(case.tk)[None, :]
    last_key = np.where(seen, keys, -1).max(-1)                             # (B, Hq, Tq)
    last_row = np.where(seen, rows, -1).max(-2)                             # (B, Hq, Tk)
    found, words = {}, []
    for n in ("dq", "dk", "dv"):
        got = sub.arrays.get(n)
        if n not in failing or got is None or not np.isfinite(got).all():
            continue
        best = None
        for tile in mistakes.KEY_TILES:
            if n == "dq":
                keep = keys >= (last_key[..., None] // tile) * tile            # the row's last key tile
            else:
                keep = rows >= (last_row[..., None, :] // tile) * tile         # the key's last query tile
            if keep[seen].all():
                continue                                                       # one tile: the reference
            pred = grad(n, keep)
            residual = slice_errors(got, pred, sub.den[n]).max()
            if best is None or residual < best[0]:
                best = (residual, tile, pred)
        if best is not None and best[0] <= sub.bounds[n]:
            found[n] = best[2]
            words.append(f"{n} from the last {'key' if n == 'dq' else 'query'} tile of {best[1]}")
    if not found:
        return []

    def predict(grads=True):
        return {**sub.gold, **found}
    return [mistakes.Hypothesis("last-tile-only", f"each row's share of {' and '.join(found)} kept from its last tile "
                                f"alone ({'; '.join(words)}): a tile's partial written with = where += is meant",
                                predict, tuple(found), fitted=tuple(found))]


def _tile_factors(sub, failing, found):
    """A gradient whose share from each tile of its loop is multiplied by a factor of its own,
    the same for every row counting back from the last tile its loop visits (an epilogue's scale
    applied inside the tile loop, a rescale taken once per tile):

        dq_i = Σ_t f(last_i - t) dq_i^(t)   over the key tiles t row i visits (dk_j, dv_j: query tiles),

    last_i the last tile row i sees, or the last that any row of its block of `mistakes.KEY_TILES`
    rows sees (a causal loop runs per block of rows: a row early in it is carried through tiles
    it does not see); f fitted by least squares over every row, (batch, head) and channel at once
    (`_tile_factor_fits`), then held to the bound; the largest tile of `mistakes.KEY_TILES` that
    fits (a smaller one fits whatever a larger one does) (`_backward_by_entry`).  Left to
    `_last_tile_only` and `_backward_blocks` where every factor is 0 or 1."""
    if found is None:
        return []
    _, grad, _, _ = found
    case = sub.case
    preds, words = {}, []
    for n in ("dq", "dk", "dv"):
        got = sub.arrays.get(n)
        if n not in failing or got is None or not np.isfinite(got).all():
            continue
        length = case.tk if n == "dq" else case.tq                  # the axis the tile loop walks
        for tile in sorted(mistakes.KEY_TILES, reverse=True):
            if length <= tile:
                continue
            parts = []
            for t in range(-(-length // tile)):
                keep = np.zeros((case.tq, case.tk), bool)
                if n == "dq":
                    keep[:, t * tile:(t + 1) * tile] = True
                else:
                    keep[t * tile:(t + 1) * tile, :] = True
                parts.append(grad(n, keep))
            A = np.moveaxis(np.stack(parts), 3, 0)                   # (rows, tiles, B, H, D)
            A = A.reshape(A.shape[:2] + (-1,))
            y = np.moveaxis(got, 2, 0).reshape(got.shape[2], -1)     # (rows, B H D)
            visited = np.abs(A).max(-1) > 0
            for f, c, block in _tile_factor_fits(A, y, visited):
                pred = np.moveaxis(np.einsum("rt,rtx->rx", c, A).reshape((got.shape[2],) + got.shape[:2] +
                                                                       got.shape[3:]), 0, 2)
                if slice_errors(got, pred, sub.den[n]).max() <= sub.bounds[n]:
                    break
            else:
                continue
            if np.all(np.isclose(f, 0, atol=1e-3) | np.isclose(f, 1, rtol=1e-3)):
                break                                                # tiles kept or left out: said there
            preds[n] = pred
            words.append(f"{n}: " + _tile_ratio(f, "key" if n == "dq" else "query", tile, _constants(sub), block))
            break
    if not preds:
        return []

    def predict(grads=True):
        return {**sub.gold, **preds}
    return [mistakes.Hypothesis("tile-factors", f"each tile's share of {' and '.join(preds)} multiplied by a factor "
                                f"of its own ({'; '.join(words)})", predict, tuple(preds), fitted=tuple(preds))]


def _tile_factor_fits(A, y, visited):
    """Each (f, c, block) of `_tile_factors` for one tile size: f[k], the factor of the tile k before
    the loop's last, fitted by least squares over every row at once (A (rows, tiles, x), y (rows,
    x)), the loop running per row (block None) or per block of rows (the last tile any of its rows
    visits); c (rows, tiles) the factor of each tile of each row."""
    on = [np.nonzero(v)[0] for v in visited]
    own = np.array([o.max() if len(o) else -1 for o in on])
    rows = [i for i, o in enumerate(on) if len(o)]
    if not rows:
        return
    for block in (None,) + tuple(sorted(mistakes.KEY_TILES)):
        last = own if block is None else \
            np.repeat(_in_tiles(own, 0, block, fill=-1).max(-1), block)[:len(own)]
        if block is not None and np.array_equal(last, own):
            continue                                                # as the rows' own loops: tried
        back = np.where(visited, last[:, None] - np.arange(visited.shape[1])[None, :], -1)   # (rows, tiles)
        K = int(back.max()) + 1
        if K < 2:
            continue                                                # one tile a loop: a constant factor
        M = np.stack([np.einsum("rt,rtx->rx", back == k, A) for k in range(K)], -1)          # (rows, x, K)
        f = np.linalg.lstsq(M[rows].reshape(-1, K), y[rows].reshape(-1), rcond=None)[0]
        c = np.where(visited, f[np.maximum(back, 0)], 0.0)
        yield f, c, block


def _tile_ratio(f, axis, tile, constants, block=None):
    """The words for the tile factors ``f`` (f[k]: the tile k before the loop's last): one ratio r
    where f[k] = f[0] r^k (an epilogue applied in the loop, once per tile), else the factors; the
    loop a row's own, or its ``block``'s of rows."""
    ratio = f[1:] / f[:-1] if np.all(f[:-1]) else np.array([np.nan])
    whose = "a row visits" if block is None else f"the row's block of {block} visits"
    if np.allclose(ratio, ratio[0], rtol=1e-3):
        named = _named_constant(float(ratio[0]), constants)
        return (f"the last {axis} tile of {tile} {whose} times {f[0]:.6g}, each earlier one times "
                f"{ratio[0]:.6g} once more{f' ({named})' if named else ''}: a factor applied in the tile loop, "
                "once per tile, where it is meant once after it")
    return f"{axis} tiles of {tile}, from the last {whose} back: " + ", ".join(f"{x:.6g}" for x in f)


ROWS_WEIGHTED_LIMIT = 2 ** 24     # `_rows_weighted`: each query row's share of dk and dv held apart, entries


def _rows_weighted(sub, failing, found):
    """dk and dv with some query rows' shares counted another whole number of times than once (the
    padding rows of a last partial tile loaded as clamped copies of the last row and summed, a
    row skipped): with the output right, dk_j = Σ_i w_i scale dS_ij q_i and dv_j = Σ_i w_i P_ij dO_i,
    each row's weight w_i fitted by least squares to dv (or dk) over every (batch, kv head), key
    and channel, rounded to a whole count, and held to both (`_backward_by_entry`)."""
    grads = [n for n in ("dv", "dk") if n in failing and np.isfinite(sub.arrays.get(n, np.nan)).all()]
    if found is None or not grads:
        return []
    factors, case = found[3], sub.case
    if case.tq * case.batch * case.heads * case.tk * max(case.head_dim, case.dv) > ROWS_WEIGHTED_LIMIT:
        return []
    group = case.heads // case.hkv

    def shares(n):
        """(Tq, B Hkv Tk D): each query row's share of gradient ``n``."""
        w, x = (factors["P"], factors["dO"]) if n == "dv" else (factors["scale · dS"], factors["Q"])
        each = np.moveaxis(w, 2, 0)[..., None] * np.moveaxis(x, 2, 0)[:, :, :, None, :]   # (Tq, B, Hq, Tk, D)
        each = each.reshape(case.tq, case.batch, case.hkv, group, *each.shape[3:]).sum(3)
        return each.reshape(case.tq, -1)
    A = shares(grads[0])
    w = np.linalg.lstsq(A.T, sub.arrays[grads[0]].reshape(-1), rcond=None)[0]
    counts = np.clip(np.round(w), 0, None)
    touched = np.abs(A).max(-1) > 0
    if not touched.any() or np.abs(w - counts)[touched].max() > 0.25 or (counts[touched] == 1).all():
        return []
    counts = np.where(touched, counts, 1.0)
    preds = {}
    for n in ("dk", "dv"):
        if n in sub.gold:
            pred = (counts @ (A if n == grads[0] else shares(n))).reshape(sub.gold[n].shape)
            if n in failing and slice_errors(sub.arrays[n], pred, _own_scale(pred, sub.den[n])).max() > sub.bounds[n]:
                return []                    # (against the prediction's own scale: a row counted 20 times rounds so)
            preds[n] = pred
    said = [f"query {'row' if len(rows) == 1 else 'rows'} {ranges(rows)} " +
            ("left out" if c == 0 else f"counted {int(c)} times" if c > 2 else "counted twice")
            for c in sorted(set(counts.tolist()) - {1.0})
            for rows in [[int(i) for i in np.nonzero(counts == c)[0]]]]

    def predict(grads=True):
        return {**sub.gold, **preds}
    return [mistakes.Hypothesis("rows-weighted", f"{'; '.join(said)} in {' and '.join(preds)}, every other row once "
                                "(a partial tile's padding rows loaded as copies of a real row and summed, or a row "
                                "skipped)", predict, tuple(preds), fitted=tuple(preds))]


def _rows_rescaled(sub, failing, found):
    """dk and dv, dq right, with each query row's share scaled by a factor of its own, c_i, in each (batch,
    head): a dK/dV pass recomputing P = exp(S − lse') from another lse than the forward's (a row's
    lse read at another row, loaded once before the loop over query tiles, kept in a low precision):
    dv_j = Σ_i c_i P_ij dO_i and dk_j = Σ_i c_i scale dS_ij q_i, c fitted to dv by least squares
    per (batch, kv head) (`_backward_by_entry`) and held to dk; failing that, one c_i per key tile
    of `TILES` (a causal pass whose query loop starts at each key tile's first row).  Where lse' =
    lse − log c is, row by row, the lse of row i mod t, that is said: the first query tile's kept."""
    if found is None or "dv" not in failing or "dq" in failing or not np.isfinite(sub.arrays["dv"]).all():
        return []                                   # (dq wrong too: the whole backward's P, `_backward_p_scaled`)
    factors, case = found[3], sub.case
    if case.tq * case.batch * case.heads * case.tk * max(case.head_dim, case.dv) > ROWS_WEIGHTED_LIMIT:
        return []
    group = case.heads // case.hkv
    per_kv = lambda a: a.reshape(case.batch, case.hkv, group * case.tq, *a.shape[3:])    # a group's rows together
    P, dO, dS, Q = (per_kv(factors[n]) for n in ("P", "dO", "scale · dS", "Q"))
    for tile in [case.tk] + [t for t in TILES if t < case.tk]:
        c = np.ones(P.shape[:3] + (-(-case.tk // tile),))                              # (B, Hkv, G Tq, key tiles)
        for b, h, kt in itertools.product(range(case.batch), range(case.hkv), range(c.shape[-1])):
            keys = slice(kt * tile, (kt + 1) * tile)
            A = (P[b, h][:, keys, None] * dO[b, h][:, None, :]).reshape(c.shape[2], -1)  # (G Tq, tile Dv)
            touched = np.abs(A).max(-1) > 0
            if touched.any():
                c[b, h, touched, kt] = np.linalg.lstsq(A[touched].T, sub.arrays["dv"][b, h, keys].reshape(-1),
                                                       rcond=None)[0]
        ck = np.repeat(c, tile, -1)[..., :case.tk]                                       # (B, Hkv, G Tq, Tk)
        preds = {"dv": np.einsum("bhrk,bhrk,bhrd->bhkd", ck, P, dO),
                 "dk": np.einsum("bhrk,bhrk,bhrd->bhkd", ck, dS, Q)}
        if all(slice_errors(sub.arrays[n], pred, _own_scale(pred, sub.den[n])).max() <= sub.bounds[n]
               for n, pred in preds.items() if n in failing):
            break
    else:
        return []
    if c.min() <= 0 or np.abs(c - 1).max() <= CONSTANT_WITHIN:
        return []
    said = "off by each row's own amount" + ("" if tile == case.tk else f", one for each key tile of {tile}")
    if tile == case.tk:
        lse = _dense_forward(sub)[1]
        own = lse - np.log(c.reshape(case.batch, case.heads, case.tq))          # the lse each row's P was taken from
        for t in (t for t in TILES if t < case.tq):
            if np.abs(own - lse[..., np.arange(case.tq) % t])[np.isfinite(lse)].max() <= FIT_SHARE:
                said = f"of row i mod {t} for every row i: the first query tile's lse kept for every tile of {t} " \
                    "(loaded once, before the loop over query tiles)"
                break
    lo, hi = float(c.min()), float(c.max())

    def predict(grads=True):
        return {**sub.gold, **preds}
    return [mistakes.Hypothesis("rows-rescaled", f"each query row's P recomputed in the dK/dV pass from an lse {said} "
                                f"(its share of dk and dv times {lo:.4g} .. {hi:.4g})", predict, tuple(preds),
                                fitted=("dv",))]


def _lse_across_tile(sub, failing, found):
    """dk and dv from a dK/dV pass that works on transposed square tiles (keys x queries) and
    subtracts each query row's lse along the wrong axis of one: P'_ij = exp(S_ij − lse_r), r = qt·t +
    (j mod t) the query row at key j's place in its tile (qt = i // t), +inf past Tq as a masked load
    gives (``lse[:, None]`` where ``lse[None, :]`` is meant); then dv = P'ᵀ dO and dk = scale (P' ∘
    (dP − D))ᵀ Q, D right.  One hypothesis per tile of `TILES` (`_backward_by_entry`)."""
    if found is None or not {"dk", "dv"} & set(failing) or sub.case.seqlens:
        return []
    f, case = found[3], sub.case
    lse = _dense_forward(sub)[1]                                                     # (B, Hq, Tq)
    i, j = np.arange(case.tq)[:, None], np.arange(case.tk)[None, :]
    dP = f["dO"] @ np.swapaxes(f["V"], -1, -2)
    out = []
    for t in (t for t in TILES if t < max(case.tq, case.tk)):
        r = i // t * t + j % t                                                       # (Tq, Tk)
        taken = np.where(r < case.tq, lse[..., np.minimum(r, case.tq - 1)], np.inf)  # (B, Hq, Tq, Tk)
        with np.errstate(over="ignore", invalid="ignore"):
            P = np.nan_to_num(f["P"] * np.exp(np.minimum(lse[..., None] - taken, 700.0)), nan=0.0)
        preds = {"dv": _per_kv(case, np.swapaxes(P, -1, -2) @ f["dO"]),
                 "dk": _per_kv(case, np.swapaxes(P * (dP - f["D"][..., None]) * sub.opts["scale"], -1, -2) @ f["Q"])}
        out.append(mistakes.Hypothesis(
            "lse-across-tile", f"the dK/dV pass's P with each query row's lse subtracted along the keys of its "
            f"transposed {t} x {t} tile (key j given the lse of query row qt·{t} + (j mod {t}): lse[:, None] where "
            "lse[None, :] is meant)", lambda grads=True, preds=preds: {**sub.gold, **preds}, ("dk", "dv")))
    return out


def _do_read_otherwise(sub, failing, found):
    """A backward pass reading dO in another order of its (batch, head, row) axes than it has (a
    layout's strides taken for another tensor's, a transposed view read as contiguous): for each
    order p, dO laid out in that order and read back by reshape, or reshaped to it and its axes put
    back (as `_axes_permuted`), its D = rowsum(dO ∘ O) right (a pass of its own);
    dq's pass (dq = scale (P ∘ (dO' Vᵀ − D)) K) and the dK/dV pass (dv = Pᵀ dO', dk likewise) each
    held to the bound on its failing tensors (`_backward_by_entry`)."""
    if found is None or sub.case.seqlens:
        return []
    f, dout = found[3], sub.rounded["dout"]
    shape = dout.shape
    out = []
    for pass_, tensors in (("dq's pass", ("dq",)), ("the dK/dV pass", ("dk", "dv"))):
        judged = [n for n in tensors if n in failing and np.isfinite(sub.arrays.get(n, np.nan)).all()]
        if not judged:
            continue
        best = None
        for p in itertools.permutations(range(3)):
            if p == (0, 1, 2):
                continue
            moved = tuple(shape[i] for i in p) + shape[3:]
            back = tuple(int(i) for i in np.argsort(p)) + (3,)
            for form, x in ((f"laid out as {moved} and read back by reshape", dout.transpose(p + (3,)).reshape(shape)),
                            (f"reshaped to {moved} and its axes put back", dout.reshape(moved).transpose(back))):
                if np.array_equal(x, dout):
                    continue
                dS = f["P"] * (x @ np.swapaxes(f["V"], -1, -2) - f["D"][..., None]) * sub.opts["scale"]
                preds = {"dq": dS @ f["K"], "dk": _per_kv(sub.case, np.swapaxes(dS, -1, -2) @ f["Q"]),
                         "dv": _per_kv(sub.case, np.swapaxes(f["P"], -1, -2) @ x)}
                residual = max(slice_errors(sub.arrays[n], preds[n], sub.den[n]).max() / sub.bounds[n]
                               for n in judged)
                if best is None or residual < best[0]:
                    best = (residual, form, preds)
        if best is not None and best[0] <= 1.0:
            preds = {n: best[2][n] for n in tensors}
            out.append(mistakes.Hypothesis(
                "dout-read-otherwise", f"{pass_} reading dO in another order: dO of shape {shape} {best[1]} (a "
                "layout's strides taken for another tensor's, or a transposed view read as contiguous)",
                lambda grads=True, preds=preds: {**sub.gold, **preds}, tensors))
    return out


# The right product of each gradient (`_backward_products`): (weights, transposed, operand).
PRODUCTS = {"dq": ("scale · dS", False, "K"), "dk": ("scale · dS", True, "Q"), "dv": ("P", True, "dO")}


def _tiles_transposed(m, t):
    """``m`` (.., Tq, Tk) with each t x t tile transposed in place: (qi t + a, kj t + b) read
    from (qi t + b, kj t + a)."""
    *lead, rows, cols = m.shape
    tiled = m.reshape(*lead, rows // t, t, cols // t, t)
    return np.swapaxes(tiled, -3, -1).reshape(m.shape)


def _backward_products(sub, failing, found):
    """A gradient formed from the right factors in a wrong product: dk = scale · dS Q where
    scale · dSᵀ Q is meant (a transpose left out), also tile by tile, as tl.dot(ds, q) for
    tl.dot(tl.trans(ds), q) on square tiles of `mistakes.KEY_TILES` (each tile's own product
    transposed); dv = Pᵀ V where Pᵀ dO is meant (one operand for another): each product of dS or
    P, transposed or not, with Q, K, V or dO that gives the gradient's shape, the right one
    (`PRODUCTS`) left out; and dq's or dk's pass forming dP = dO Kᵀ where dO Vᵀ is meant (D = Dv);
    dk and dv summed onto the kv heads.  Nothing is fitted: each is a hypothesis on its gradient
    alone."""
    if found is None:
        return []
    factors, case = found[3], sub.case
    name = lambda w, flip, x: f"{w}{'ᵀ' if flip else ''} {x}".strip()
    tiles = [t for t in mistakes.KEY_TILES if t < max(case.tq, case.tk) and case.tq % t == case.tk % t == 0]
    out = []
    for n, right in PRODUCTS.items():
        if n not in failing or n not in sub.gold:
            continue
        tried = [(w, flip, x, None) for w, flip, x in itertools.product(("scale · dS", "P"), (False, True),
                                                                         ("Q", "K", "V", "dO"))]
        tried += [(*right, t) for t in tiles]
        for w, flip, x, t in tried:
            W = factors[w] if t is None else _tiles_transposed(factors[w], t)
            W = np.swapaxes(W, -1, -2) if flip else W
            X = factors[x]
            if ((w, flip, x) == right and t is None) or W.shape[-1] != X.shape[-2]:
                continue
            pred = W @ X if n == "dq" else _per_kv(case, W @ X)
            if pred.shape != sub.gold[n].shape:
                continue
            own = name(w, not flip, x) if t is not None else name(w, flip, x)
            on = f" on each {t} x {t} tile" if t is not None else ""
            short = w.split()[-1]
            wrong = ("" if (w == right[0]) + (x == right[2]) + (flip == right[1] and t is None) < 2 else
                     f": {x} where {right[2]} is meant" if x != right[2] else f": {w} where {right[0]} is meant"
                     if w != right[0] else f": the transpose of {short} left out" if right[1] else
                     f": {short} transposed")
            out.append(mistakes.Hypothesis("backward-product", f"{n} = {own}{on} instead of {name(*right)}{wrong}",
                                           lambda grads=True, n=n, pred=pred: {**sub.gold, n: pred}, (n,)))
    K, Q = factors["K"], factors["Q"]
    if K.shape[-1] == factors["V"].shape[-1]:            # dP = dO Kᵀ has dP's shape: K copied for V
        dS = sub.opts["scale"] * factors["P"] * (factors["dO"] @ np.swapaxes(K, -1, -2) - factors["D"][..., None])
        for n, pred in (("dq", dS @ K), ("dk", _per_kv(case, np.swapaxes(dS, -1, -2) @ Q))):
            if n in failing and n in sub.gold:
                out.append(mistakes.Hypothesis("backward-product", f"{n}'s pass forming dP = dO K^T instead of dO V^T: "
                                               "K where V is meant (the operand of S = Q K^T copied)",
                                               lambda grads=True, n=n, pred=pred: {**sub.gold, n: pred}, (n,)))
    return out


def _rows_read_as_zero(sub, failing, found):
    """A backward pass that loads an operand's rows past a bound as 0 (a masked load bounded by the
    other sequence's length, or at its last tile's start): dk or dq with V's rows from L on read as 0
    in dP = dO Vᵀ (dS = P ∘ (dP − D), D whole), dq with K's, dk with Q's, for L the other length or
    the start of the operand's last partial tile of `mistakes.KEY_TILES`; and dq with K's first rows
    0 .. r − 1 read as 0, dk with Q's, r the remainder of the length by a tile (full tiles laid back
    from the end, as the Triton tutorial's backward lays its unmasked ones: the remainder never
    visited).  Nothing is fitted: each is a hypothesis on its gradient alone."""
    if found is None:
        return []
    P, f, case = found[0], found[3], sub.case
    scale = sub.opts["scale"]
    length = {"Q": case.tq, "K": case.tk, "V": case.tk}
    other = {"Q": case.tk, "K": case.tq, "V": case.tq}
    out = []
    for n, x in (("dk", "V"), ("dq", "V"), ("dq", "K"), ("dk", "Q")):
        if n not in failing or n not in sub.gold:
            continue
        bounds = {other[x]} | {(length[x] - 1) // t * t for t in mistakes.KEY_TILES}
        for L in sorted(b for b in bounds if 0 < b < length[x]):
            op = {**f, x: np.where(np.arange(length[x])[:, None] < L, f[x], 0.0)}
            dS = scale * P * (op["dO"] @ np.swapaxes(op["V"], -1, -2) - f["D"][..., None])
            pred = dS @ op["K"] if n == "dq" else _per_kv(case, np.swapaxes(dS, -1, -2) @ op["Q"])
            why = (f"the other length {'Tq' if x != 'Q' else 'Tk'} = {L}, where {'Tk' if x != 'Q' else 'Tq'} = "
                   f"{length[x]} is meant" if L == other[x] else f"{L}, a tile's start")
            out.append(mistakes.Hypothesis("rows-read-as-zero", f"{n}'s pass reading {x}'s rows {L} .. "
                                           f"{length[x] - 1} as 0 (a load masked at {why})",
                                           lambda grads=True, n=n, pred=pred: {**sub.gold, n: pred}, (n,)))
        if (n, x) not in (("dq", "K"), ("dk", "Q")):
            continue
        said = set()
        for t in sorted(mistakes.KEY_TILES, reverse=True):       # alike (77 mod 64 = 77 mod 16): the largest said
            r = length[x] % t
            if not 0 < r < length[x] or length[x] < t or r in said:
                continue
            said.add(r)
            op = {**f, x: np.where(np.arange(length[x])[:, None] < r, 0.0, f[x])}
            dS = scale * P * (op["dO"] @ np.swapaxes(op["V"], -1, -2) - f["D"][..., None])
            pred = dS @ op["K"] if n == "dq" else _per_kv(case, np.swapaxes(dS, -1, -2) @ op["Q"])
            out.append(mistakes.Hypothesis("rows-read-as-zero", f"{n}'s pass reading {x}'s rows 0 .. {r - 1} as 0 "
                                           f"(full tiles of {t} laid back from row {length[x]}: the first "
                                           f"{length[x]} mod {t} = {r} never visited)",
                                           lambda grads=True, n=n, pred=pred: {**sub.gold, n: pred}, (n,)))
    return out


# (query tile, key tile) blocks a backward leaves out (`_backward_blocks`): at most this many blocks
BLOCKS = 1024


def _blocks_unmasked(sub, failing, found):
    """One gradient of a tiled backward that takes P = exp(S − lse) without its mask inside the blocks
    that need one (a block partly seen: the causal diagonal, a window's edge), the mask applied to P
    after that gradient's product (a dV update moved above the masking line): for dv, dVᵀ's weights
    P + P̃ ∘ hidden, P̃ = exp(S − lse) on the pairs the mask hides within the (query tile, key tile)
    blocks that hold a visible pair; for dq or dk, dS = (P + P̃ ∘ hidden) ∘ (dP − D).  Each failing
    gradient on its own, the tiles of `mistakes.KEY_TILES` that explain with the fewest blocks; the
    others the reference's.  [] without a mask, or where the backward's entries cannot be read
    (`_backward_by_entry`)."""
    if found is None or (found[0] > 0).all():                            # no pair masked
        return []
    P, _, _, f = found
    _, lse, _ = _dense_forward(sub)
    eye = np.ascontiguousarray(np.broadcast_to(np.eye(sub.case.tk), sub.rounded["k"].shape[:2] + (sub.case.tk,) * 2))
    free, free_lse, _ = _dense_forward(sub, v=eye, unmasked=True)
    with np.errstate(over="ignore", invalid="ignore"):
        raw = free * np.exp(free_lse - lse)[..., None]                     # exp(S − lse) on every pair
    raw = np.where(np.isfinite(lse)[..., None] & np.isfinite(raw), raw, 0.0)
    seen = P > 0
    case, scale = sub.case, sub.opts["scale"]
    dP_D = f["dO"] @ np.swapaxes(f["V"], -1, -2) - f["D"][..., None]
    out = []
    for n in ("dv", "dk", "dq"):
        if n not in failing or not np.isfinite(sub.arrays.get(n, np.nan)).all():
            continue
        fits = []                                                        # (blocks, bm, bn, hidden, prediction)
        for bm, bn in itertools.product(sorted(mistakes.KEY_TILES, reverse=True), repeat=2):
            visited = np.kron(_in_tiles(_in_tiles(seen.any((0, 1)), 0, bm), 2, bn).any((1, 3)),
                              np.ones((bm, bn)))[:case.tq, :case.tk].astype(bool)
            hidden = visited & ~seen
            if not hidden.any():
                continue
            W = P + raw * hidden
            pred = _per_kv(case, np.swapaxes(W, -1, -2) @ f["dO"]) if n == "dv" else \
                _per_kv(case, scale * np.swapaxes(W * dP_D, -1, -2) @ f["Q"]) if n == "dk" else \
                scale * (W * dP_D) @ f["K"]
            worst = slice_errors(sub.arrays[n], pred, _own_scale(pred, sub.den[n])).max() / sub.bounds[n]
            blocks = -(-case.tq // bm) * -(-case.tk // bn)
            if worst <= 1:
                fits.append((blocks, bm, bn, hidden, pred))
        if fits:
            _, bm, bn, hidden, pred = min(fits, key=lambda x: x[0])             # the fewest blocks that explain
            alike = [f"{m} x {n_}" for _, m, n_, h, _ in sorted(fits, key=lambda x: x[0])
                     if (m, n_) != (bm, bn) and (h == hidden).all()]
            also = f"; {', '.join(alike)} give the same blocks here" if alike else ""
            out.append(mistakes.Hypothesis(
                "blocks-unmasked", f"{n} formed from P = exp(S − lse) without its mask inside the blocks that need one "
                f"(query tiles of {bm}, key tiles of {bn}{also}: the causal diagonal, a window's edge), every other "
                f"gradient right: the mask applied to P after {n}'s product (a line moved above the masking)",
                lambda grads=True, n=n, pred=pred: {**sub.gold, n: pred}, (n,)))
    return out


def _backward_blocks(sub, failing, found):
    """A backward that leaves out some (query tile, key tile) blocks the forward uses (a tile
    loop's start or end off: query tiles before a key tile's first skipped under another causal
    offset, a last partial tile dropped): for each pair of tile sizes of
    `mistakes.KEY_TILES`, each block's weight fitted to the target's dv (or dk) key tile by key
    tile (or, where dq alone fails, to dq query tile by query tile), by least squares over the
    blocks that hold a weight, rounded to 0 or 1; then held, with those blocks, to every failing
    gradient (`_backward_by_entry`)."""
    fit_to = next((n for n in ("dv", "dk", "dq") if n in failing and np.isfinite(sub.arrays.get(n, np.nan)).all()),
                  None)
    if found is None or fit_to is None:
        return []
    P, grad, block, _ = found
    case = sub.case
    tq, tk = case.tq, case.tk
    got = sub.arrays[fit_to]
    by_rows = fit_to == "dq"               # dq's rows are query rows: fitted query tile by query tile
    best = None
    for bm, bn in itertools.product(mistakes.KEY_TILES, repeat=2):
        nq, nk = -(-tq // bm), -(-tk // bn)
        if nq * nk < 2 or nq * nk > BLOCKS:
            continue
        weight = np.ones((nq, nk))
        for o in range(nq if by_rows else nk):
            parts, active = [], []
            for i in range(nk if by_rows else nq):
                qt, kt = (o, i) if by_rows else (i, o)
                rows, keys = slice(qt * bm, (qt + 1) * bm), slice(kt * bn, (kt + 1) * bn)
                if P[..., rows, keys].any():
                    parts.append(block(fit_to, rows, keys).reshape(-1))
                    active.append(i)
            if not active:
                continue
            own = slice(o * bm, (o + 1) * bm) if by_rows else slice(o * bn, (o + 1) * bn)
            w = _zero_one_fit(np.stack(parts, axis=1), got[..., own, :].reshape(-1))
            if w is None:
                break
            if by_rows:
                weight[o, active] = w
            else:
                weight[active, o] = w
        else:
            if weight.all():
                continue
            keep = np.kron(weight, np.ones((bm, bn)))[:tq, :tk].astype(bool)
            preds = {n: grad(n, keep) for n in ("dq", "dk", "dv") if n in failing and n in sub.arrays}
            worst = max(slice_errors(sub.arrays[n], p, sub.den[n]).max() / sub.bounds[n] for n, p in preds.items())
            if worst <= 1 and (best is None or nq * nk < best[0]):            # the fewest blocks that explain
                best = (nq * nk, bm, bn, weight, preds)
    if best is None:
        return []
    _, bm, bn, weight, preds = best
    skipped = []
    own, other = ("query", "key") if by_rows else ("key", "query")
    for o, line in enumerate(weight if by_rows else weight.T):
        left_out = [int(i) for i in np.nonzero(line == 0)[0]]
        if left_out:
            skipped.append(f"{own} tile {o} without {other} {'tile' if len(left_out) == 1 else 'tiles'} "
                           f"{ranges(left_out)}")
    said = "; ".join(skipped[:4]) + ("; ..." if len(skipped) > 4 else "")
    # the blocks that need a mask: partly seen (the causal diagonal, a window's edge), or a tile of the
    # walked axis past its end (dq walks keys; dk and dv walk query rows)
    seen = (P > 0).any((0, 1))
    masked = np.zeros_like(weight, dtype=bool)
    for qt, kt in np.ndindex(weight.shape):
        part = seen[qt * bm:(qt + 1) * bm, kt * bn:(kt + 1) * bn]
        past = (kt + 1) * bn > tk if by_rows else (qt + 1) * bm > tq
        masked[qt, kt] = part.any() and (past or not part.all())
    walked = "key" if by_rows else "query row"
    why = f"the blocks that need a mask (partly seen, or past the last {walked}), and only those: a stage of " \
        "masked tiles lost" if np.array_equal(masked, weight == 0) else "a tile loop's start or end off"

    def predict(grads=True):
        return {**sub.gold, **preds}
    left = int((weight == 0).sum())
    return [mistakes.Hypothesis("backward-blocks", f"a backward that leaves out {left} (query tile, "
                                f"key tile) blocks of {bm} x {bn} that the forward uses ({said}): {why}",
                                predict, tuple(preds), fitted=(fit_to,))]


def _backward_counts(sub, failing, found, blocks):
    """A backward reduction that adds some terms twice or leaves them out, tile by tile: dq's
    sum over keys (dQ = scale dS K) or dv's (dk's) sum over query rows (dV = Pᵀ dO, dK = scale
    dSᵀ Q, over each kv head's group), each term of a tile counted 0, 1 or 2 times (a key tile
    laid back from the range's end to stay whole, overlapping the one before it; a loop's bound a
    few keys off).  Tiles of the gradient's own rows of each size of `mistakes.KEY_TILES` (the
    largest first: the fewest fitted counts), each term's count fitted tile by tile by least
    squares (`_counts_by_tile`) and rounded, the prediction held to the bound.  Where no count is
    2 and whole blocks are left out, `_backward_blocks` (``blocks``) says it better."""
    fit_to = next((n for n in ("dq", "dv", "dk") if n in failing and np.isfinite(sub.arrays.get(n, np.nan)).all()),
                  None)
    if found is None or fit_to is None:
        return []
    case, got, f = sub.case, sub.arrays[fit_to], found[3]
    grouped = lambda a: a.reshape(case.batch, case.hkv, case.heads // case.hkv, *a.shape[2:])
    swap = lambda a: np.swapaxes(a, -1, -2)
    left, right = {"dq": (f["scale · dS"][:, :, None], f["K"][:, :, None]),
                   "dv": (grouped(swap(f["P"])), grouped(f["dO"])),
                   "dk": (grouped(swap(f["scale · dS"])), grouped(f["Q"]))}[fit_to]
    own_len = left.shape[-2]
    term, own = ("key", "query") if fit_to == "dq" else ("query row", "key")
    for size in sorted({min(t, own_len) for t in mistakes.KEY_TILES}, reverse=True):
        fitted = _counts_by_tile(left, right, got, size)
        if fitted is None:
            continue
        pred, counts = fitted
        if not counts or slice_errors(got, pred, sub.den[fit_to]).max() > sub.bounds[fit_to]:
            continue
        twice = any(tile[2] for tile in counts.values())
        if not twice and blocks:
            return []
        said = [(f"{own} rows {a} .. {b} ({own} tile {a // size} of {size})" if size < own_len else f"every {own} row")
                + ": " + ", ".join(f"{term}s {ranges(tile[c])} {'twice' if c else 'left out'}"
                                   for c in (2, 0) if tile[c]) for (a, b), tile in counts.items()]
        shown = "; ".join(said[:4]) + ("; ..." if len(said) > 4 else "")
        why = "tiles of the reduction that overlap (a last tile laid back to end at the range's end, or a loop " \
            "bound stepped back) add those terms twice" if twice else "a loop's start or end a few terms off"

        def predict(grads=True, pred=pred):
            return {**sub.gold, fit_to: pred}
        return [mistakes.Hypothesis("backward-counts", f"a backward whose {fit_to} counts some {term}s' terms "
                                    f"other than once ({shown}): {why}", predict, (fit_to,), fitted=(fit_to,))]
    return []


def _counts_by_tile(left, right, got, size):
    """(prediction, {(first, last row): {0: [terms], 2: [terms]}} for the tiles with a count other
    than 1) of a gradient y_o = Σ_t c_t Σ_h L^h_ot R^h_t (``left`` (B, K, G, own, terms), ``right``
    (B, K, G, terms, D): G query heads summed onto each of K heads; ``got`` (B, K, own, D)) with
    each term t of each tile of ``size`` own rows counted c_t = 0, 1 or 2 times; None where a fitted
    count is not within 0.05 of one of those.  The counts of a tile solve the normal equations
    Σ_u G_tu c_u = b_t, G_tu = Σ (L^h_ot L^h'_ou)(R^h_t · R^h'_u) and b_t = Σ L^h_ot (y_o · R^h_t)
    (sums over batch, heads, the tile's rows), on the terms any of its rows weighs."""
    pred, counts = np.zeros_like(got), {}
    gram_r = np.einsum("bkhtd,bkgud->bkhgtu", right, right)
    for start in range(0, left.shape[-2], size):
        rows = slice(start, min(start + size, left.shape[-2]))
        L, y = left[..., rows, :], got[..., rows, :]
        G = (np.einsum("bkhot,bkgou->bkhgtu", L, L) * gram_r).sum((0, 1, 2, 3))
        cols = np.nonzero(np.diag(G) > 0)[0]
        if not len(cols):
            continue
        b = np.einsum("bkhot,bkod,bkhtd->t", L, y, right)
        w = np.linalg.lstsq(G[np.ix_(cols, cols)], b[cols], rcond=None)[0]
        whole = np.round(w)
        if np.abs(w - whole).max() > 0.05 or not set(np.unique(whole)) <= {0.0, 1.0, 2.0}:
            return None
        c = np.zeros(left.shape[-1])
        c[cols] = whole
        pred[..., rows, :] = np.einsum("bkhot,t,bkhtd->bkod", L, c, right)
        off = {n: [int(cols[i]) for i in np.nonzero(whole == n)[0]] for n in (0, 2)}
        if off[0] or off[2]:
            counts[start, rows.stop - 1] = off
    return pred, counts


def _keys_unseen(sub):
    """The last keys of each sequence seen by no query (a split or tile size rounded down, a last
    partial tile or page skipped): how many, up to `UNSEEN_KEYS`, fitted to the target's out batch
    entry by batch entry.  Without the keys from J on, row i's output is
    (O_i − Σ_{j≥J} P_ij v_j) / (1 − Σ_{j≥J} P_ij): every J from one dense forward's weights P
    (v the identity).  [] with dropout, on a block of rows, or with weights too large to hold."""
    case, got, r = sub.case, sub.arrays.get("out"), sub.rounded
    tk = case.tk
    found = _out_weights(sub)
    if found is None:
        return []
    P, v, O, _ = found
    lengths = sub.opts.get("seqlens_k")
    ends = [tk if lengths is None else int(lengths[b]) for b in range(case.batch)]
    firsts = []
    for b, n in enumerate(ends):
        out, tail, weight = O[b], 0.0, 0.0
        best = (slice_errors(got[b:b + 1], out[None], sub.den["out"]).max(), n)       # no key left out
        for j in range(n - 1, max(0, n - 1 - UNSEEN_KEYS), -1):
            tail = tail + P[b, ..., j, None] * v[b, :, None, j]
            weight = weight + P[b, ..., j, None]
            left = 1 - weight
            pred = np.where(left > 1e-12, (out - tail) / np.where(left > 1e-12, left, 1.0), 0.0)
            residual = slice_errors(got[b:b + 1], pred[None], sub.den["out"]).max()
            if residual < best[0]:
                best = (residual, j)
        firsts.append(best[1])
    if firsts == ends:
        return []
    opts = sub.opts

    def predict(grads=True):
        return as_4d(dense.run(r["q"], r["k"], r["v"], r["dout"] if grads else None, opts, grads=grads,
                               dlse=r.get("dlse") if grads else None, unseen_from=firsts))
    said = [f"{j} .. {e - 1}" + ("" if case.batch == 1 else f" of sequence {b}")
            for b, (j, e) in enumerate(zip(firsts, ends)) if j < e]
    why = _ranges_lost(case, set(firsts), set(ends)) or "what a split, tile or page size rounded down, or a last " \
        "partial tile skipped, gives"
    return [mistakes.Hypothesis("keys-unseen", f"keys {', '.join(said)} seen by no query ({why})",
                                predict, ("out", "lse", "dq", "dk", "dv"), fitted=("out",))]


def _ranges_lost(case, firsts, ends):
    """Where the keys lost from one first key on are whole key ranges the kernel computes apart
    (`features.key_ranges`: split-KV's splits), which ones, in words; else ""."""
    declared = key_ranges(case)
    if declared is None or len(firsts) != 1 or ends != {case.tk}:
        return ""
    name, spans = declared
    lost = [i for i, (a, _) in enumerate(spans) if a >= min(firsts)]
    if not lost or spans[lost[0]][0] != min(firsts):
        return ""
    which = f"range {lost[0]}" if len(lost) == 1 else f"ranges {lost[0]} .. {lost[-1]}"
    return f"{which} of the {len(spans)} key ranges the kernel computes apart ({name} = " \
        f"{dict(case.features)[name]}), whole: their partial states lost, dropped by the merge or never written"


NARROW = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")     # `_inputs_rounded`'s dtypes


def _narrowed(x, name):
    """(``x`` rounded to torch dtype ``name`` and back to float64, whether any |x| past its largest
    finite value was saturated there), as a cast with no scale gives."""
    dt = getattr(torch, name)
    big = torch.finfo(dt).max
    t = torch.tensor(np.asarray(x), dtype=torch.float64)
    return t.clamp(-big, big).to(dt).double().numpy(), bool((t.abs() > big).any())


def _reference_on(sub, given):
    """A hypothesis's ``predict``: the reference (the case's options) on the inputs ``given`` (the
    rounded ones, some read otherwise)."""
    def predict(grads=True):
        return as_4d(dense.run(given["q"], given["k"], given["v"], given["dout"] if grads else None, sub.opts,
                               grads=grads, dlse=given.get("dlse") if grads else None))
    return predict


def _narrowed_how(name, low, saturated):
    """How ``name`` is rounded to ``low`` in a hypothesis's words (`_narrowed`)."""
    if not low.startswith("float8"):
        return "in the kernel"
    largest = torch.finfo(getattr(torch, low)).max
    return "with no scale" + (f", |{name}| past {largest:g} saturated" if saturated else "")


def _inputs_rounded(sub, names=("q", "k", "v")):
    """Precision lost in one place: one input rounded to a dtype narrower than the case's before its
    use (q cast to an FP8 cache's dtype with no scale, v kept in bfloat16 in a float32 kernel, dO
    rounded in a backward): the reference on that input so rounded, one hypothesis per input of
    ``names`` and dtype of `NARROW` that changes it, the input's own gradient left unclaimed;
    nothing fitted.  [] on a block of rows."""
    if sub.rows is not None or not hasattr(torch, sub.dtype):
        return []
    r, own = sub.rounded, torch.finfo(getattr(torch, sub.dtype)).eps
    out = []
    for name, low in itertools.product(names, NARROW):
        if r.get(name) is None or not hasattr(torch, low) or torch.finfo(getattr(torch, low)).eps <= own:
            continue
        narrowed, saturated = _narrowed(r[name], low)
        if np.array_equal(narrowed, r[name]):
            continue
        predict = _reference_on(sub, {**r, name: narrowed})
        how = _narrowed_how(name, low, saturated)
        # not the rounded input's own gradient: autograd's cast back rounds it too, and a rounding of its
        # float32 value flips where the reference's float64 one does not
        tensors = tuple(n for n in (("dq", "dk", "dv") if name == "dout" else ("out", "lse", "dq", "dk", "dv"))
                        if n != f"d{name}")
        out.append(mistakes.Hypothesis("input-rounded", f"{'dO' if name == 'dout' else name} rounded to {low} "
                                       f"({how}) before its use, the rest in {sub.dtype}", predict, tensors))
    return out


def _inputs_sign_lost(sub):
    """Inputs read with their signs lost: the reference on |x| for k, v, both, q, or all three (a
    sign bit dropped where a kernel decodes or loads its values: a low-precision code read as a
    signed byte and its sign tested as 1, a mask that keeps the magnitude's bits alone); nothing
    fitted.  Only inputs that hold a negative value.  [] on a block of rows."""
    if sub.rows is not None:
        return []
    r, out = sub.rounded, []
    for names in (("k",), ("v",), ("k", "v"), ("q",), ("q", "k", "v")):
        if any(r.get(n) is None or not (r[n] < 0).any() for n in names):
            continue
        said = " and ".join(names)
        out.append(mistakes.Hypothesis("input-sign-lost", f"{said} read with {'its' if len(names) == 1 else 'their'} "
                                       f"signs lost ({', '.join(f'|{n}|' for n in names)}): a sign bit dropped where "
                                       "the values are decoded or loaded",
                                       _reference_on(sub, {**r, **{n: np.abs(r[n]) for n in names}}),
                                       ("out", "lse")))
    return out


def _output_rounded(sub):
    """Precision lost at the store: out rounded to a dtype narrower than the case's, each of `NARROW`
    (an output buffer allocated in the inputs' dtype, FP8, with no scale; bfloat16 in a float32
    kernel), then returned in the case's: the reference's out so rounded; nothing fitted."""
    if sub.rows is not None or not hasattr(torch, sub.dtype) or "out" not in sub.gold:
        return []
    own, out = torch.finfo(getattr(torch, sub.dtype)).eps, []
    for low in NARROW:
        if hasattr(torch, low) and torch.finfo(getattr(torch, low)).eps > own:
            pred, saturated = _narrowed(sub.gold["out"], low)
            out.append(mistakes.Hypothesis("output-rounded", f"out rounded to {low} "
                                           f"({_narrowed_how('out', low, saturated)}) at its store, then "
                                           f"returned in {sub.dtype}: an output buffer allocated in a narrower dtype",
                                           lambda grads=True, pred=pred: {**sub.gold, "out": pred}, ("out",),
                                           fitted=("out",)))
    return out


def _kv_head_map(sub):
    """Query heads of a GQA case reading another kv head than h // group (a kv head index computed for
    another group size, a head block of several groups read against one kv head): each query head's
    out recomputed against every kv head, the nearest taken, the map held to the bound; [] where each
    head's is its own, with one kv head, or on a block of rows."""
    case, r = sub.case, sub.rounded
    if sub.rows is not None or case.hkv < 2 or case.hkv == case.heads or "out" not in sub.arrays or \
            not np.isfinite(sub.arrays["out"]).all():
        return []
    got, group = sub.arrays["out"], case.heads // case.hkv
    outs = [_dense_forward(sub, inputs={n: np.repeat(r[n][:, g:g + 1], case.hkv, 1) for n in ("k", "v")})[0]
            for g in range(case.hkv)]
    errors = np.stack([slice_errors(got, o, sub.den["out"]).max(0) for o in outs])     # (Hkv, Hq)
    read = errors.argmin(0)
    own = np.arange(case.heads) // group
    if (read == own).all() or errors[read, np.arange(case.heads)].max() > sub.bounds["out"]:
        return []
    pred = np.stack([outs[g][:, h] for h, g in enumerate(read)], 1)
    moved = [h for h in range(case.heads) if read[h] != own[h]]
    said = "; ".join(f"query head {h} reads kv head {read[h]} (its own: {own[h]})" for h in moved[:6]) + \
        ("; ..." if len(moved) > 6 else "")
    return [mistakes.Hypothesis("kv-head-map", f"query heads read against another kv head than h // {group} ({said}): "
                                "a kv head index computed for another group size, or a block of heads spanning "
                                "several groups read against one kv head",
                                lambda grads=True: {**sub.gold, "out": pred}, ("out",), fitted=("out",))]


def _channel_orders(d):
    """(words, order) for the channel orders a layout slip gives on a head dim of ``d``: each group of
    n channels, 4 (a vectorised conversion's lanes) or d (rotary's halves), read even channels first,
    then odd (a de-interleave not put back), or its two halves interleaved (put back where it was
    not taken apart); order[p]: the channel read at position p."""
    out = []
    for n in sorted({4, d}):
        if d % n == 0 and n >= 4:
            idx = np.arange(d).reshape(-1, n)
            split = np.concatenate([idx[:, 0::2], idx[:, 1::2]], -1).reshape(-1)
            for order in (split, np.argsort(split)):
                if not any(np.array_equal(order, o) for _, o in out):
                    first = ", ".join(map(str, order[:min(n, 8)])) + (", .." if n > 8 else "")
                    out.append((f"the channels of each group of {n} in the order {first}", order))
    return out


def _channels_permuted(sub):
    """A layout slip in the head dim: q, k or v, or k and v together (one loader), read with their
    channels in another order (`_channel_orders`: a vectorised conversion's lanes left un-permuted,
    rotary's interleaved and split halves taken for each other): the reference on inputs so read,
    one hypothesis each; nothing fitted.  [] on a block of rows."""
    if sub.rows is not None:
        return []
    r, out = sub.rounded, []
    for names in (("k", "v"), ("k",), ("v",), ("q",)):
        d = r[names[0]].shape[-1]
        if any(r[n].shape[-1] != d for n in names):
            continue
        for words, order in _channel_orders(d):
            predict = _reference_on(sub, {**r, **{n: np.ascontiguousarray(r[n][..., order]) for n in names}})
            out.append(mistakes.Hypothesis("channels-permuted", f"{' and '.join(names)} read with {words} (a layout "
                                           "slip in the head dim: lanes of a vectorised load or conversion left "
                                           "un-permuted, or interleaved and split halves taken for each other)",
                                           predict, ("out", "lse")))
    return out


def _out_channels_moved(sub):
    """out's channels in another order, whatever the order: each channel d of the target's out
    matched to the reference's channel nearest it over every row, π(d); named where π is a
    permutation other than the identity (an epilogue's un-shuffle applying a permutation where its
    inverse is meant, lanes stored in another order), said within the smallest group of channels
    it keeps (8: a byte-permute of FP8 lanes).  [] on a block of rows, or where out is not finite."""
    got = sub.arrays.get("out")
    if sub.rows is not None or got is None or not np.isfinite(got).all():
        return []
    gold = sub.gold["out"]
    d = got.shape[-1]
    a, g = got.reshape(-1, d), gold.reshape(-1, d)
    cost = (a * a).sum(0)[:, None] - 2 * a.T @ g + (g * g).sum(0)[None, :]          # |a_d − g_c|², (d, c)
    order = cost.argmin(1)
    if len(set(order.tolist())) != d or (order == np.arange(d)).all():
        return []
    group = next(n for n in (2, 4, 8, 16, 32, 64, d) if d % n == 0 and (order // n == np.arange(d) // n).all())
    shown = ", ".join(map(str, order[:min(group, 8)])) + (", .." if group > 8 else "")
    where = f"within each group of {group} channels, channel p holding the reference's channel {shown}" \
        if group < d else f"channel p holding the reference's channel {shown}"
    return [mistakes.Hypothesis("out-channels-moved", f"out's channels in another order ({where}: an "
                                "epilogue's un-shuffle applying its permutation where the inverse is meant, or lanes "
                                "stored in another order)", lambda grads=True: {**sub.gold, "out": gold[..., order]},
                                ("out",), fitted=("out",))]


MAX_COUNT = 8          # `_keys_weighted`: a key counted up to this many times (split ranges overlapping by a tile)
UNMASKED_LIMIT = 1e6   # ... and a hidden key's weight against the row's own sum up to this (outlier inputs: e^800)


def _keys_weighted(sub):
    """Keys that every query row of a batch entry counts twice, or none sees (split bounds that
    overlap by a key, a merge that keeps one split alone, a page read twice): each key's extra
    weight e_j fitted per batch entry (`_key_counts`), then held to the bound.  Where that does not
    hold, the same fit with each extra count taken whatever the row's mask (weights P_ij + e_j U_ij,
    U the unmasked scores' weights against the row's own sum: a loop's last partial tile bounded by
    a later length than its own, its keys seen unmasked, then again by the next loop).  [] with
    dropout, on a block of rows, or with weights too large to hold."""
    case, r = sub.case, sub.rounded
    found = _out_weights(sub)
    if found is None:
        return []
    P, v, O, _ = found
    weights = _key_counts(sub, P, v, O)
    if not weights.any():
        return []
    w = P * (1 + weights[:, None, None, :])
    unmasked = None
    if not _weights_hold(sub, w, v):
        W = _dense_weights(sub, unmasked=True)
        if W is None or not ((P == 0) & (W > 0)).any():
            return []
        within = (W * (P > 0)).sum(-1, keepdims=True)
        with np.errstate(over="ignore"):
            U = np.where(within > 0, W / np.where(within > 0, within, 1.0), 0.0)   # exp(S_ij - lse_i), every key
        if not np.isfinite(U).all() or U.max() > UNMASKED_LIMIT:             # weights too large to hold
            return []
        weights = _key_counts(sub, U, v, O)
        extra = weights[:, None, None, :]
        w = np.where(extra < 0, P * (1 + extra), P + extra * U)
        if not weights.any() or not _weights_hold(sub, w, v):
            return []
        unmasked = w
    said = []
    for b in range(case.batch):
        of = "" if case.batch == 1 else f" of batch entry {b}"
        for value in [1] + list(range(2, MAX_COUNT)) + [-1]:
            keys = [int(j) for j in np.nonzero(weights[b] == value)[0]]
            words = {1: "counted twice", -1: "seen by no query"}.get(value, f"counted {value + 1} times")
            if keys:
                said.append(f"{'key' if len(keys) == 1 else 'keys'} {ranges(keys)}{of} {words}")
    if unmasked is not None:
        pred = _weighted_out(unmasked, v)
        return [mistakes.Hypothesis("keys-weighted", f"{'; '.join(said)} by every query row whatever its mask (once "
                                    "unmasked, once as its mask says: a loop's last partial tile bounded by a later "
                                    "length than its own, its keys then seen again by the next loop)",
                                    lambda grads=True: {**sub.gold, "out": pred}, ("out",), fitted=("out",))]
    with np.errstate(divide="ignore"):
        extra = torch.as_tensor(np.log1p(weights))[:, None, None, :]          # (B, 1, 1, Tk): log 2, 0, -inf
    opts = sub.opts

    def predict(grads=True):
        bias = extra if opts.get("bias") is None else torch.as_tensor(opts["bias"]) + extra
        found = as_4d(dense.run(r["q"], r["k"], r["v"], r["dout"] if grads else None, {**opts, "bias": bias.numpy()},
                                grads=grads, dlse=r.get("dlse") if grads else None, autograd=True))
        if "lse" in found and "lse" in sub.gold:
            found["lse"] = _judged_lse(sub, found["lse"])
        return {n: a for n, a in found.items() if n in sub.gold}        # (the bias added here has no gradient)
    return [mistakes.Hypothesis("keys-weighted", f"{'; '.join(said)} (the same for every query row: split or page "
                                "bounds that overlap, or skip, the keys between them)", predict,
                                ("out", "lse", "dq", "dk", "dv"), fitted=("out",))]


def _weighted_out(w, v):
    """out with the rows' weights ``w`` (B, Hq, Tq, Tk), normalised here (0 on a row of none)."""
    total = w.sum(-1)
    return np.where(total[..., None] > 0, (w @ v) / np.where(total > 0, total, 1.0)[..., None], 0.0)


def _weights_hold(sub, w, v):
    """Whether out with the rows' weights ``w`` is within its bound (`_weighted_out`)."""
    return slice_errors(sub.arrays["out"], _weighted_out(w, v), sub.den["out"]).max() <= sub.bounds["out"]


def _key_counts(sub, P, v, O):
    """(B, Tk): each key's extra count e_j (−1: seen by no query; 1: counted twice; k − 1: k times, up
    to `MAX_COUNT`), fitted per batch entry by least squares over its rows (a ridge of 1e-6: with few
    rows, many keys are told apart by little) and rounded, the keys counted once (most of them, or
    the fewest counted) setting the weights' common factor.  With the weights, row i's output is
    out_i = (O_i + Σ_j e_j P_ij v_j) / (1 + Σ_j e_j P_ij), so out_i − O_i = Σ_j e_j P_ij (v_j − out_i):
    linear in e, the target's own out_i on the right (its channels projected on `PROJECTIONS` random
    directions, or as many as give four equations a key, up to all of them); v with a copy per query
    head, O the reference's out (`_out_weights`)."""
    case, got = sub.case, sub.arrays["out"]
    dv = v.shape[-1]
    m = min(dv, max(PROJECTIONS, -(-4 * case.tk // (case.heads * case.tq))))     # 4 equations a key at least
    directions = np.eye(dv) if m == dv else np.random.default_rng(0).standard_normal((dv, m))
    weights = np.zeros((case.batch, case.tk))
    for b in range(case.batch):
        A = P[b][..., None] * ((v[b] @ directions)[:, None] - (got[b] @ directions)[:, :, None])   # (Hq, Tq, Tk, m)
        A = np.moveaxis(A, 2, -1).reshape(-1, case.tk)
        G = A.T @ A                 # the normal equations, each key's own term raised by 1e-6 (many keys, few rows)
        ridge = np.where(np.diag(G) > 0, 1e-6 * np.diag(G), 1.0)
        e = np.linalg.solve(G + np.diag(ridge), A.T @ ((got[b] - O[b]) @ directions).reshape(-1))
        # the weights 1 + e are told only up to one factor (the ridge shrinks them alike): the keys
        # counted once set it, most of the keys or the fewest-counted ones, whichever gives whole counts
        w = (1 + e)[P[b].any(axis=(0, 1))]
        ones = [x for x in (np.median(w), np.percentile(w, 2)) if x > 0.25] if w.size else []
        if ones:
            once = min(ones, key=lambda x: np.abs(w / x - np.round(w / x)).mean())
            e = (1 + e) / once - 1
        rounded = np.clip(np.round(e), -1, MAX_COUNT - 1)
        weights[b] = np.where(np.abs(e - rounded) < 0.25, rounded, 0.0)        # only the weights fitted clearly
    return weights


def _key_spans(sub):
    """Rows that see another contiguous range of keys than their own (a mask applied on some
    tiles only, a window or causal edge off by a varying amount, a range taken from another row):
    for each row the range a .. b − 1 that reproduces its out best, each edge fitted in turn with
    the other held (twice, from the row's own range, the end first or the start first), from one
    dense forward's unmasked weights W (v the identity): the row's output is
    Σ_{a≤j<b} W_ij v_j / Σ_{a≤j<b} W_ij, by prefix sums, on `PROJECTIONS` random directions of its
    channels, then held to the bound on all of them.  Rows the reference reproduces keep their own
    range.  [] with dropout, on a block of rows, with weights too large to hold, past `SPAN_WORK`,
    where a row sees keys that are not one range, or where a wrong row sees none."""
    got, r = sub.arrays.get("out"), sub.rounded
    found = _out_weights(sub)
    if found is None:
        return []
    P, v, O, row_error = found
    B, H, Tq, Tk = P.shape
    wrong = row_error > sub.bounds["out"]                                    # (B, H, Tq)
    seen = P > 0
    keys = np.arange(Tk)
    own_a = np.where(seen, keys, Tk).min(-1)
    own_b = np.where(seen, keys, -1).max(-1) + 1
    if not wrong.any() or (seen.sum(-1) != np.maximum(own_b - own_a, 0)).any() or \
            (wrong & ~seen.any(-1)).any() or wrong.sum() * Tk > SPAN_WORK:
        return []                          # (a row that sees no key has no range of its own to move)
    W = _dense_weights(sub, unmasked=True)
    where = np.nonzero(wrong)
    directions = np.random.default_rng(0).standard_normal((v.shape[-1], PROJECTIONS))
    Ww, vw = W[where], (v @ directions)[where[0], where[1]]                 # (n, Tk), (n, Tk, m)
    gw = (got @ directions)[where]                                           # (n, m)
    cw = np.concatenate([np.zeros((len(Ww), 1)), np.cumsum(Ww, -1)], -1)    # (n, Tk + 1)
    cwv = np.concatenate([np.zeros((len(Ww), 1, PROJECTIONS)), np.cumsum(Ww[..., None] * vw, -2)], -2)
    rows_n = np.arange(len(Ww))

    def fit(a, b, edge):
        """Each row's best ``edge`` (0: first key, 1: end) with the other held, and its error."""
        ends = np.arange(Tk + 1)
        lo = a[:, None] if edge else ends[None, :]
        hi = ends[None, :] if edge else b[:, None]
        w = cw[rows_n[:, None], hi] - cw[rows_n[:, None], lo]                  # (n, Tk + 1)
        num = cwv[rows_n[:, None], hi] - cwv[rows_n[:, None], lo]
        e = np.abs(gw[:, None] - num / np.where(w > 1e-300, w, 1.0)[..., None]).max(-1)
        e = np.where((w > 1e-300) & (hi > lo), e, np.inf)
        best = e.argmin(-1)
        return best, e[rows_n, best]
    tries = []
    for order in ((1, 0), (0, 1)):          # each edge in turn, twice: one edge moved, or both; from either
        a_w, b_w = own_a[where].copy(), own_b[where].copy()
        for _ in range(2):
            for edge in order:
                if edge:
                    b_w, e = fit(a_w, b_w, 1)
                else:
                    a_w, e = fit(a_w, b_w, 0)
        tries.append((a_w, b_w, e))
    (a1, b1, e1), (a0, b0, e0) = tries
    a_w, b_w = np.where(e0 < e1, a0, a1), np.where(e0 < e1, b0, b1)
    first, end = own_a.copy(), own_b.copy()
    first[where], end[where] = a_w, b_w
    span = (keys >= first[..., None]) & (keys < end[..., None])
    Wspan = W * span
    total = Wspan.sum(-1, keepdims=True)
    pred = np.where(total > 0, (Wspan / np.where(total > 0, total, 1.0)) @ v, 0.0)
    pred = np.where(wrong[..., None], pred, P @ v)
    if slice_errors(got, pred, sub.den["out"]).max() > sub.bounds["out"]:
        return []
    changed = wrong & ((first != own_a) | (end != own_b))
    if not changed.any():
        return []
    rows = sorted({int(i) for i in where[2][changed[where]]})
    said = []
    for edge, new, own in (("first", first, own_a), ("last", end, own_b)):
        moved = (new - own)[changed]
        if moved.any():
            lo, hi = int(moved.min()), int(moved.max())
            by = f"{abs(lo)} keys" if lo == hi else f"{lo} .. {hi} keys" if lo > 0 else \
                f"{-hi} .. {-lo} keys" if hi < 0 else f"up to {-lo} keys earlier or up to {hi} keys"
            way = "earlier" if hi < 0 else "later"
            tile = next((t for t in sorted(mistakes.KEY_TILES, reverse=True)
                         if np.all((new[changed] % t == 0) | (new[changed] == (0 if edge == "first" else Tk)))), None)
            at = f", each range {'starting' if edge == 'first' else 'ending'} at a multiple of {tile} (a tile's " \
                 "edge)" if tile and tile < Tk else ""
            said.append(f"its {edge} key {by} {way}{at}")
    opts = sub.opts

    def predict(grads=True):
        return as_4d(dense.run(r["q"], r["k"], r["v"], r["dout"] if grads else None, opts, grads=grads,
                               dlse=r.get("dlse") if grads else None, key_span=(first, end)))
    return [mistakes.Hypothesis("key-spans", f"each of query rows {ranges(rows)} seeing another range of keys than "
                                f"its own: {' and '.join(said)}", predict, ("out", "lse", "dq", "dk", "dv"),
                                fitted=("out",))]


def _axes_permuted(sub, failing):
    """A tensor holding the reference's values in another order: written in one order of its axes
    and read in another (a reshape where a transpose is meant: lse built (total_q, H) and reshaped
    to (H, total_q)).  In the shape the target returns it (its layout's), for each order p of the
    axes: the reference laid out in that order and read back by reshape, x.permute(p).reshape(shape),
    and the reference reshaped to the permuted shape and its axes put back, x.reshape(shape[p])
    .permute(p⁻¹); the one closest to the target, held to the bound.  [] on a block of rows, or
    without the target's layout (a tensor it does not return in one: dk and dv of packed sequences)."""
    layout = getattr(sub.caller, "layout", None)
    if layout is None or sub.rows is not None:
        return []
    case = sub.case
    convert = {"out": (layout.upstream, layout.output), "lse": (layout.lse_upstream, layout.lse_output)}
    if case.seqlens is None and hasattr(layout, "name"):            # strided: every tensor as q, k, v are
        convert.update({n: (lambda x, c, name=layout.name: targets.to_layout(x, name),
                            lambda x, c, name=layout.name: targets.from_layout(x, name)) for n in ("dq", "dk", "dv")})
    found = []
    for n in failing:
        got = sub.arrays.get(n)
        if n not in convert or n not in sub.gold_raw or got is None or not np.isfinite(got).all():
            continue
        judged = sub.gold[n] if n != "lse" else sub.gold[n][sub.gold[n] != 0.0]
        values = got if n != "lse" else got[sub.gold[n] != 0.0]
        apart = np.abs(np.sort(values, axis=None) - np.sort(judged, axis=None)).max() if values.size == judged.size \
            else np.inf
        if apart > sub.bounds[n] * np.max(sub.den[n]):
            continue                                       # not the reference's values: no order of them gives it
        to_raw, from_raw = convert[n]
        raw = to_raw(torch.as_tensor(sub.gold_raw[n]), case).contiguous()
        shape = tuple(raw.shape)
        best = None
        for p in itertools.permutations(range(raw.dim())):
            if p == tuple(range(raw.dim())):
                continue
            back = tuple(int(i) for i in np.argsort(p))
            moved = tuple(shape[i] for i in p)
            for form, x in ((f"laid out as {moved} (axes {p}) and read back by reshape", raw.permute(p).reshape(shape)),
                            (f"reshaped to {moved} and its axes put back ({back})", raw.reshape(moved).permute(back))):
                if torch.equal(x, raw):
                    continue
                pred = as_4d({n: from_raw(x, case).numpy()})[n]
                if n == "lse":
                    pred = _judged_lse(sub, pred)
                residual = slice_errors(got, pred, sub.den[n]).max()
                if best is None or residual < best[0]:
                    best = (residual, form, pred)
        if best is not None and best[0] <= sub.bounds[n]:
            found.append(mistakes.Hypothesis(
                "axes-permuted", f"{n}'s values in another order: the reference's {n} of shape {shape} (the target's) "
                f"{best[1]}: a reshape where a transpose is meant, or the reverse",
                lambda grads=True, n=n, pred=best[2]: {**sub.gold, n: pred}, (n,), fitted=(n,)))
    return found


# (failing row, reference row) pairs `_rows_moved` compares at most
MOVED_PAIRS = 2 ** 22


# `_tiles_accumulated`: a persistent grid of at most this many programs (with more, few walk two tiles)
PERSISTENT_PROGRAMS = 16


def _every_nth_summed(work, n):
    """``work`` (W, ...) with each entry w the sum of entries w, w − n, w − 2n, ... (a running sum
    along each of the n strided sequences: what n programs leave, each walking every n-th entry)."""
    m = -(-len(work) // n)
    padded = np.concatenate([work, np.zeros((m * n - len(work),) + work.shape[1:])])
    return np.cumsum(padded.reshape((m, n) + work.shape[1:]), 0).reshape(padded.shape)[:len(work)]


def _tiles_accumulated(sub, n):
    """A gradient ``n`` (over query rows: dq; over key rows: dk, dv) whose tile t holds the sum of
    tiles 0 .. t of the reference, row r of each at row r of t: an accumulator zeroed once per
    (batch, head) or sequence where once per tile is meant (a dQ loop over query tiles, a dK/dV loop
    over key tiles, that never resets it).  One hypothesis per tile of `TILES` that splits the rows;
    not fitted."""
    ref = sub.gold.get(n)
    if ref is None or sub.rows is not None:
        return []
    rows, kind = ref.shape[2], "key" if n in ("dk", "dv") else "query"
    lens = sub.case.seqlens[kind == "key"] if sub.case.seqlens else (rows,) * ref.shape[0]
    past = np.arange(rows) >= np.asarray(lens)[:, None]                     # (B, rows): a sequence's padding
    out = []
    for t in (t for t in TILES if t < rows):
        tiles = _in_tiles(ref, 2, t)                                  # (B, H, n, t, D)
        pred = np.cumsum(tiles, axis=2).reshape(ref.shape[:2] + (-1,) + ref.shape[3:])[:, :, :rows]
        pred = np.where(past[:, None, :, None], ref, pred)
        out.append(mistakes.Hypothesis(
            "tiles-accumulated", f"{n}'s {kind} tiles of {t} each holding the sum of every tile up to it (row r of "
            f"tile t given the rows r of tiles 0 .. t: an accumulator zeroed once per sequence or (batch, head) "
            f"where once per {kind} tile is meant)",
            lambda grads=True, pred=pred: {**sub.gold, n: pred}, (n,)))
        work = tiles.reshape((-1,) + tiles.shape[3:])                # work tiles (batch, head, tile), the tile fastest
        for programs in range(1, min(len(work) - 1, PERSISTENT_PROGRAMS + 1)):
            summed = _every_nth_summed(work, programs).reshape(ref.shape[:2] + (-1,) + ref.shape[3:])[:, :, :rows]
            pred = np.where(past[:, None, :, None], ref, summed)
            out.append(mistakes.Hypothesis(
                "tiles-accumulated", f"{n}'s work tiles of {t} (counted (batch, head, {kind} tile), the tile fastest) "
                f"each holding the sum of every tile {programs} apart up to it: a persistent grid of {programs} "
                "program(s) whose accumulator is not reset between the tiles each walks",
                lambda grads=True, pred=pred: {**sub.gold, n: pred}, (n,)))
    return out


def _rows_moved(sub, n="out"):
    """``n`` right on some rows, and each of the others equal to another row of the reference: an
    index map wrong (a reshape where a transpose is meant inside a group of heads, a head order, a
    packed offset, a padded accumulator read back with the unpadded stride).  Each failing row is
    matched to the reference rows within its bound (the max norm, over its slice's scale), the
    nearest in index among them (rows alike in the reference: one seeing the same single key); a
    gradient's row left 0 reads padding.  None matched, out's row left 0, a row that sees no key,
    or past MOVED_PAIRS: [].  The map is said by what it moves: heads, rows, batch entries."""
    got, ref = sub.arrays.get(n), sub.gold[n]
    if got is None or not np.isfinite(got).all() or sub.rows is not None or got.shape[-1] < 4:
        return []
    b, h, t, d = got.shape
    den = np.broadcast_to(np.asarray(sub.den[n], dtype=np.float64), (b, h))
    bound = sub.bounds[n]
    wrong = np.abs(got - ref).max(-1) / den[..., None] > bound                  # (B, H, T)
    rows = np.argwhere(wrong)
    blank = ~got[wrong].any(-1)
    if not len(rows) or len(rows) * b * h * t > MOVED_PAIRS or blank.all() or (n == "out" and blank.any()) or \
            not ref[wrong].any(-1).all():                     # a row that sees no key: another reading's
        return []
    flat = ref.reshape(-1, d)
    where = np.stack(np.unravel_index(np.arange(b * h * t), (b, h, t)), -1)     # (N, 3)
    moved = {}                                                                  # row -> its source, None: 0
    for start in range(0, len(rows), 16):
        chunk = rows[start:start + 16]
        g = got[tuple(chunk.T)]                                                  # (c, D)
        apart = np.abs(g[:, None, :] - flat[None]).max(-1) / den[chunk[:, 0], chunk[:, 1]][:, None]
        for row, dist, empty in zip(chunk, apart, ~g.any(-1)):
            near = np.nonzero(dist <= bound)[0]
            if empty:
                moved[tuple(row)] = None
            elif not len(near):
                return []
            else:
                moved[tuple(row)] = tuple(where[near[np.argmin(np.abs(where[near] - row).sum(-1))]])
    pred = ref.copy()
    for dst, src in moved.items():
        pred[dst] = 0.0 if src is None else ref[src]
    pairs = sorted((dst, src) for dst, src in moved.items() if src is not None)
    zeros = len(moved) - len(pairs)
    head, row = ("kv head", "key row") if n in ("dk", "dv") else ("head", "query row")
    kinds = [name for axis, name in enumerate(("batch entries", f"{head}s", f"{row}s"))
             if any(dst[axis] != src[axis] for dst, src in pairs)]
    by_slice = {}                          # (b, h) -> {(b', h', rows later)}: one source, or several
    for (db, dh, dt), (sb, sh, st) in pairs:
        by_slice.setdefault((db, dh), set()).add((sb, sh, st - dt))

    def source(srcs):
        if len(srcs) > 1:
            return "rows of several places"
        (sb, sh, later), = srcs
        return f"(batch {sb}, {head} {sh})'s rows" + (f", {abs(later)} {'later' if later > 0 else 'earlier'}"
                                                       if later else "")
    said = [f"(batch {db}, {head} {dh}) holds {source(srcs)}" for (db, dh), srcs in sorted(by_slice.items())]
    shown = "; ".join(said[:4]) + ("; ..." if len(said) > 4 else "")
    left = f"; {zeros} more left 0 (read from padding)" if zeros else ""
    return [mistakes.Hypothesis("rows-moved", f"{n}'s rows in other places: each of {len(pairs)} failing rows is "
                                f"the reference's row of other {' and '.join(kinds) or 'places'} ({shown}){left}: an "
                                "index map wrong (a reshape where a transpose is meant, a head order, a packed or "
                                "padded offset)", lambda grads=True: {**sub.gold, n: pred}, (n,), fitted=(n,))]


def _merged_along(out, lse, order):
    """out and lse of each (batch, head) slice merged with those of every slice before it along
    ``order`` ("batch": each batch entry with the earlier ones, head by head; "head"; "slice": the
    (batch, head) slices in their order), row by row: what an online softmax's state carried over
    gives.  (out, lse), as their inputs."""
    B, H = out.shape[:2]
    if order == "head":
        o, l = out.swapaxes(0, 1), lse.swapaxes(0, 1)
    elif order == "slice":
        o, l = out.reshape((B * H, 1) + out.shape[2:]), lse.reshape((B * H, 1) + lse.shape[2:])
    else:
        o, l = out, lse
    o, l = o.copy(), l.copy()
    for n in range(1, len(o)):
        both = np.logaddexp(l[n - 1], l[n])
        seen = np.isfinite(both)
        w0 = np.where(seen, np.exp(l[n - 1] - np.where(seen, both, 0.0)), 0.0)
        w1 = np.where(seen, np.exp(l[n] - np.where(seen, both, 0.0)), 0.0)
        o[n] = w0[..., None] * o[n - 1] + w1[..., None] * o[n]
        l[n] = both
    if order == "head":
        return o.swapaxes(0, 1), l.swapaxes(0, 1)
    return o.reshape(out.shape), l.reshape(lse.shape)


def _state_carried(sub):
    """An online softmax's state (running maximum, sum, accumulator) carried over from one batch
    entry, head, or (batch, head) slice to the next instead of started afresh: each row merged
    with the same row of every earlier one.  From one dense forward's out and lse; the order that
    reproduces the target's out.  [] with dropout, on a block of rows, or with one slice."""
    case, got = sub.case, sub.arrays.get("out")
    if got is None or not np.isfinite(got).all() or sub.rows is not None or sub.opts.get("keep") is not None or \
            case.batch * case.heads == 1:
        return []
    out, lse, _ = _dense_forward(sub)
    orders = [o for o, size in (("batch", case.batch), ("head", case.heads), ("slice", case.batch)) if size > 1]
    if case.batch == 1 and "slice" in orders:
        orders.remove("slice")
    best = None
    for order in orders:
        o, l = _merged_along(out, lse, order)
        residual = slice_errors(got, o, sub.den["out"]).max()
        if best is None or residual < best[0]:
            best = (residual, order, o, l)
    if best is None or best[0] > sub.bounds["out"]:
        return []
    _, order, o, l = best
    pred = {"out": o}
    if "lse" in sub.gold:
        pred["lse"] = _judged_lse(sub, as_4d({"lse": l})["lse"])
    words = {"batch": "batch entry", "head": "head", "slice": "(batch, head) slice"}[order]
    return [mistakes.Hypothesis(
        "state-carried", f"each {words}'s rows merged with the same rows of every {words} before it: an online "
        f"softmax's running maximum, sum and accumulator carried over from one {words} to the next instead of "
        "started afresh", lambda grads=True: {**sub.gold, **pred}, tuple(pred), fitted=("out",))]


# The random directions the channels of out are projected on to fit each key's weight (`_keys_weighted`).
PROJECTIONS = 4
# The rows x keys a fit of each row's range of keys (`_key_spans`) may take.
SPAN_WORK = 2 ** 22
# A query tile reads another range of key tiles than it sees (`_key_tile_ranges`): the tile sizes of
# `mistakes.KEY_TILES` with at most this many key tiles (each range of them tried, row by row).
RANGE_TILES = 24


def _key_tile_ranges(sub):
    """Query rows that read another range of key tiles than the keys they see span (a tile loop's
    start or end off: a last partial tile skipped, a causal or window bound rounded the wrong way,
    a first tile one too late): for each tile size, each row's range of key tiles chosen among all
    of them by which reproduces its out, rows the reference reproduces keeping theirs.  From one
    dense forward's weights P (v the identity): without the keys outside [a, b), row i's output is
    Σ_{a≤j<b} P_ij v_j / Σ_{a≤j<b} P_ij.  [] with dropout, on a block of rows, or with weights
    too large to hold."""
    got, r = sub.arrays.get("out"), sub.rounded
    found = _out_weights(sub)
    if found is None:
        return []
    P, v, _, row_error = found
    B, H, Tq, Tk = P.shape
    den = np.broadcast_to(sub.den["out"], (B, H))[..., None]
    wrong = row_error > sub.bounds["out"]
    if not wrong.any():
        return []
    where = np.nonzero(wrong)                                                # the rows fitted: (b, h, i) each
    slices = {}
    for w, bh in enumerate(zip(where[0], where[1])):
        slices.setdefault(bh, []).append(w)
    gw, denw = got[where], den[where[0], where[1]]                           # (W, Dv), (W, 1)
    best = None
    for tile in sorted(mistakes.KEY_TILES, reverse=True):                   # the largest tile that explains
        n = -(-Tk // tile)
        if n < 2 or n > RANGE_TILES:
            continue
        Pt = _in_tiles(P[where], -1, tile)                                  # (W, n, tile)
        wv = np.empty((len(Pt), n, v.shape[-1]))
        for (b, h), ws in slices.items():
            vt = _in_tiles(v[b, h], 0, tile)                                # (n, tile, Dv)
            wv[ws] = np.einsum("wnt,ntd->wnd", Pt[ws], vt)
        cw = np.concatenate([np.zeros((len(Pt), 1)), np.cumsum(Pt.sum(-1), -1)], -1)            # (W, n + 1)
        cwv = np.concatenate([np.zeros((len(Pt), 1, wv.shape[-1])), np.cumsum(wv, -2)], -2)     # (W, n + 1, Dv)
        err, lo_w, hi_w = np.full(len(Pt), np.inf), np.zeros(len(Pt), int), np.full(len(Pt), n)
        for a, b in [(0, 0)] + [(a, b) for a in range(n) for b in range(a + 1, n + 1)]:    # (0, 0): none
            w = cw[:, b] - cw[:, a]
            pred = np.where(w[:, None] > 1e-300, (cwv[:, b] - cwv[:, a]) / np.where(w > 1e-300, w, 1.0)[:, None], 0.0)
            e = np.abs(gw - pred).max(-1) / denw[:, 0]
            better = e < err
            err, lo_w, hi_w = np.where(better, e, err), np.where(better, a, lo_w), np.where(better, b, hi_w)
        if err.max() <= sub.bounds["out"]:
            lo, hi = np.zeros((B, H, Tq), int), np.full((B, H, Tq), n)      # the other rows: the reference's
            lo[where], hi[where] = lo_w, hi_w
            best = (err.max(), tile, lo, hi)
            break
    if best is None:
        return []
    _, tile, lo, hi = best
    first, end = lo * tile, np.minimum(hi * tile, Tk)
    seen = P > 0
    keys = np.arange(Tk)
    own_lo = np.where(seen.any(-1), np.where(seen, keys, Tk).min(-1) // tile, 0)
    own_hi = np.where(seen.any(-1), np.where(seen, keys, -1).max(-1) // tile + 1, 0)
    changed = wrong & ((lo > own_lo) | (hi < own_hi) | (lo == hi))
    if not changed.any():
        return []
    groups = {}
    for b, h, i in zip(*np.nonzero(changed)):
        groups.setdefault((int(lo[b, h, i]), int(hi[b, h, i]), int(own_lo[b, h, i]), int(own_hi[b, h, i])),
                          set()).add(int(i))
    tiles = lambda a, b: "no key tile" if a >= b else f"key tile {a}" if b == a + 1 else f"key tiles {a} .. {b - 1}"
    said = "; ".join(f"query rows {ranges(sorted(rows))} read {tiles(a, b)}, their keys span {tiles(oa, ob)}"
                     for (a, b, oa, ob), rows in list(groups.items())[:3]) + ("; ..." if len(groups) > 3 else "")
    opts = sub.opts
    # the tiles kept from the last that raised the row's running maximum on: the rescale came to 0
    top = _in_tiles(np.where(seen, np.log(np.where(seen, P, 1.0)), -np.inf), -1, tile, fill=-np.inf).max(-1)
    before = np.concatenate([np.full(top.shape[:-1] + (1,), -np.inf), np.maximum.accumulate(top, -1)[..., :-1]], -1)
    raised = top > before
    last_raise = raised.shape[-1] - 1 - np.argmax(raised[..., ::-1], -1)
    other = _other_tiles_ranges(groups, np.where(seen.any(-1), own_lo, Tk), np.where(seen.any(-1), own_hi, 0))
    if (lo[changed] == last_raise[changed]).all() and (hi[changed] == own_hi[changed]).all():
        why = "each row's key tiles before the last one that raised its running maximum dropped: a rescale " \
              "exp(m_old - m_new) that comes to 0 (its exponent in other units, or underflowing)"
    elif other:
        why = f"each the key tiles another query tile of {other[0]} spans ({other[1]}): a key range computed for " \
            "another tile's rows (a bound hoisted out of a loop over two query tiles, or a tile index mapped twice)"
    else:
        why = "a tile loop's start or end off"

    def predict(grads=True):
        return as_4d(dense.run(r["q"], r["k"], r["v"], r["dout"] if grads else None, opts, grads=grads,
                               dlse=r.get("dlse") if grads else None, key_range=(first, end)))
    return [mistakes.Hypothesis("key-tile-ranges", f"query rows reading another range of key tiles of {tile} than "
                                f"they see ({said}): {why}", predict,
                                ("out", "lse", "dq", "dk", "dv"), fitted=("out",))]


def _other_tiles_ranges(groups, own_lo, own_hi):
    """(query tile size, words) where each group of `_key_tile_ranges` (rows reading key tiles
    [a, b)) lies in one query tile of a size of `TILES` and reads exactly the key tiles that
    another query tile's rows span together (``own_lo``, ``own_hi``: each row's own, (B, H, Tq),
    rows that see no key neutral); None otherwise."""
    lo, hi = own_lo.min((0, 1)), own_hi.max((0, 1))                           # over every slice
    tq = lo.shape[0]
    for q in (t for t in TILES if t < tq):
        spans = [(int(lo[s:s + q].min()), int(hi[s:s + q].max())) for s in range(0, tq, q)]
        said = []
        for (a, b, _, _), rows in groups.items():
            tiles = {i // q for i in rows}
            others = [u for u, span in enumerate(spans) if span == (a, b) and u not in tiles]
            if len(tiles) != 1 or not others:
                break
            u = others[0]
            last = min(tq, (u + 1) * q) - 1
            said.append(f"rows {ranges(sorted(rows))} read query tile {u}'s (rows {u * q} .. {last})")
        else:
            return q, "; ".join(said)
    return None


def _own_scale(pred, denom):
    """(B, H) denominators of a hypothesis's residual: the tensor's, or the prediction's own
    size where that is larger (a descale left out predicts an output 100 times the reference's,
    and a kernel computing it rounds 100 times more: measured on the reference's scale, the
    right hypothesis would miss by its rounding alone)."""
    own = np.abs(np.where(np.isfinite(pred), pred, 0.0)).max(axis=(-1, -2))
    return np.maximum(denom, own)


def _by_slice(t, candidates, a, r, denom, bound, sel):
    """One mistake in some (batch, head) slices, the reference in the others."""
    plain = slice_errors(a, r, denom)
    bad = plain > bound
    if not bad.any() or bad.all():
        return None
    candidates = [c for c in candidates if np.any(c[3][bad])]       # zeros on those slices: any blank kernel
    fits = [(res[bad].max(), i, s, p) for res, i, s, p in candidates
            if np.all(explains(res[bad], plain[bad], bound))]
    if not fits:
        return None
    best = min(fits, key=lambda f: f[0])
    others = [(res[bad].max(), i, s, p[bad]) for res, i, s, p in candidates]
    if _unclear((best[0], best[1], best[2], best[3][bad]), others, plain[bad].max(), bound,
                np.broadcast_to(denom, plain.shape)[bad]):
        return None
    res, hid, says, _ = best
    offset_b, offset_h = (0, 0) if sel == (slice(None), slice(None)) else sel
    slices = [(int(b) + offset_b, int(h) + offset_h) for b, h in zip(*np.nonzero(bad))]
    where = _where(slices, plain.shape)
    verb = "matches" if len(slices) == 1 else "match"
    return Diagnosis(hid, f"{t}: {where} ({len(slices)} of {plain.size} (batch, head) slices) "
                     f"{verb} the reference with {says} to {_fmt(res)} (bound {_fmt(bound)}); "
                     "the other slices match the reference", res, bound, slices)


def _tiles_unwritten(n, ev):
    """("tiles-unwritten", sentence) when every row of ``n`` past its bound lies in a whole query
    tile (of a size in `TILES`, the largest that fits) left exactly 0 in its (batch, head) slice,
    the rest within the bound: work tiles never run (a persistent grid of fewer programs than its
    scheduler's stride assumes, a tile index decoded past the slices).  The sentence gives those
    tiles' indices in the order (batch, head, query tile), the tile fastest, and a period in them
    where there is one; else None, and on cases of per-sequence lengths."""
    a, ref = ev.arrays[n], ev.gold[n]
    if ev.rows is not None or ev.case.seqlens or not np.isfinite(a).all():
        return None                      # (per-sequence lengths: a short sequence's rows fill no tile of their own)
    bad = ((np.abs(a - ref) / ev.den[n]).max(-1) > ev.bounds[n])                      # (B, H, R)
    blank = (a == 0).all(-1)
    if not bad.any():
        return None
    B, H, R = bad.shape
    for tile in sorted(TILES, reverse=True):                     # rows past R: blank, and right
        m = -(-R // tile)
        hit = _in_tiles(bad, -1, tile, False).any(-1)
        if m > 1 and (_in_tiles(blank, -1, tile, True).all(-1) | ~hit).all():
            break
    else:
        return None
    index = [int(i) for i in np.nonzero(hit.reshape(-1))[0]]
    total = B * H * m
    period = next((p for p in (2 ** k for k in range(1, 12)) if p < total and len({i % p for i in index}) < p and
                   index == [i for i in range(total) if i % p in {j % p for j in index}]), None)
    said = ""
    if period is not None:
        left = sorted({i % period for i in index})
        said = f"; every one whose index mod {period} is {ranges(left)}"
    kind = "query rows" if n != "dq" else "query rows of dq"
    return "tiles-unwritten", (f"{n} matches the reference but for whole query tiles of {tile} left exactly 0 "
                               f"({kind} never written): work tiles {ranges(index)} of {total}, counted (batch, "
                               f"head, query tile) with the tile fastest{said} (a persistent grid with fewer "
                               "programs than its scheduler's stride assumes, or tile indices decoded past the "
                               "work)")


def _only_rows_without_keys(n, ev):
    """"; only on the N query rows that see no key ..." when the rows of ``n`` past its bound are
    rows that see no key (their maximum score −inf), where the check expects 0; else ""."""
    if ev.rows is not None or not fits_densely(ev.case):
        return ""
    blind = ~np.isfinite(_dense_forward(ev)[2])                                          # (B, H, Tq)
    a = ev.arrays[n]
    if a.shape[:3] != blind.shape or not blind.any():
        return ""
    bad = (np.abs(a - ev.gold[n]) / ev.den[n]).max(-1) > ev.bounds[n]
    if not bad.any() or (bad & ~blind).any():
        return ""
    size = float(np.abs(a[bad]).max())
    return (f"; only on the {int(bad.any(axis=(0, 1)).sum())} of {blind.shape[-1]} query rows that see no key, "
            f"where the check expects 0 (as SDPA and FlashAttention give) and the kernel returns values up to "
            f"{size:.3g}")


def _only_where_zero(n, ev):
    """"; only where the reference is exactly 0 ..." when every entry of gradient ``n`` past its
    bound is one the reference gives as exactly 0; with why, where those are the rows that see a
    single key (dq), or keys only such rows read (dk): P = 1 there, so dS = P (dP − D) = 0
    whatever dO, unless dP and D = rowsum(dO ∘ O) are formed in precisions that do not cancel;
    else ""."""
    a, ref = ev.arrays[n], ev.gold[n]
    bad = np.abs(a - ref) / ev.den[n] > ev.bounds[n]
    if not bad.any() or np.any(ref[bad]) or not np.isfinite(a).all():
        return ""
    said = f"; only where the reference is exactly 0 ({int(bad.sum())} entries)"
    P = _dense_weights(ev)                         # None on a block of rows, with dropout, or too large
    if P is None:
        return said
    one = (P > 0).sum(-1) == 1                                                  # (B, Hq, Tq)
    if n == "dq":
        single = not (bad.any(-1) & ~one).any()
    else:                                                                       # keys read by such rows alone
        alone = ~((P > 0) & ~one[..., None]).any(-2) & (P > 0).any(-2)         # (B, Hq, Tk), read by some row
        group = ev.case.heads // ev.case.hkv
        alone = alone.reshape(alone.shape[0], ev.case.hkv, group, -1).all(2)
        single = not (bad.any(-1) & ~alone).any()
    return said + (", on rows that see a single key: dS = P (dP - D) is 0 there (P = 1, dP = D) unless dP and "
                   "D = rowsum(dO ∘ O) are formed in precisions that do not cancel" if single else "")


def _lower_precision(result, rows, ev):
    """Tensors that no mistake explains whose error is the size of a lower precision's say so."""
    named_out = "out" in result and result["out"].id not in ("none", "not-diagnosed")
    unnamed = [n for n, d in result.items() if d.id == "none" and d.rounding and d.unbiased]   # rounding-like
    # a gradient of a named output keeps that name; past LOGIT_SCALE the lower precisions'
    # own errors scatter too widely (one-hot weights) to be told apart
    if named_out or ev.dtype not in LOWER or not unnamed or ev.logits > tol.LOGIT_SCALE:
        return
    low_errors = {}
    r = ev.rounded
    for low in (d for d in LOWER[ev.dtype] if not capabilities.dtype_lacks(d, ev.device)):
        formed = {"whole": ev.baseline_in(low)}
        if f"p-{low}" in dense.P_ROUNDED:              # only P rounded to it, the rest in the case's dtype
            grads = any(n in unnamed for n in GRADS)
            formed["P"] = dense.run(r["q"], r["k"], r["v"], r["dout"] if grads else None, ev.opts,
                                    getattr(torch, ev.dtype), ev.device, grads=grads,
                                    dlse=r.get("dlse") if grads else None, weights=f"p-{low}", autograd=True)
        for part, raw in formed.items():
            base = as_4d({n: a for n, a in raw.items() if n in ev.gold})
            if "lse" in base:
                base["lse"] = np.where(ev.gold["lse"] == 0.0, 0.0, base["lse"])
            for n in unnamed:
                if n in base and _spread_alike(ev.arrays[n], base[n], ev.gold[n], ev.den[n]):
                    low_errors[n, low, part] = float(np.abs(base[n] - ev.gold[n]).max(initial=0.0) / ev.den[n])
    for n in unnamed:                 # the precision whose plain computation errs the most alike
        fits = [(abs(np.log(rows[n].error / e)), low, part, e) for (m, low, part), e in low_errors.items()
                if m == n and e and 1 / LOWER_SHARE <= rows[n].error / e <= LOWER_SHARE]
        if fits:
            fits.sort()
            _, low, part, low_err = fits[0]
            if part == "whole" and len(fits) == 1:
                said = (f"the size of {low}'s (a plain {low} computation: {low_err:.1e}): the kernel appears to "
                        f"compute in {low}")
            else:                     # the size alone cannot tell which: each that fits, closest first
                said = "the size of " + ", or of ".join(
                    f"a plain {lw} computation's ({e:.1e})" if pt == "whole" else
                    f"a {ev.dtype} one's with P rounded to {lw} before P V ({e:.1e})" for _, lw, pt, e in fits) + \
                    ": the kernel appears to compute some of it in a lower precision"
            result[n] = Diagnosis("lower-precision", f"{n}'s error {rows[n].error:.1e} is {said} inside this "
                                  f"{ev.dtype} check", rows[n].error, rows[n].bound)


def _spread_alike(a, low, ref, den):
    """Whether the error of ``a`` is spread over the (batch, head) slices as a lower precision's
    (``low``) is: none of the slices where ``low`` errs at least half its most is left more than
    LOWER_SHARE² below ``a``'s worst slice (a loss of precision errs wherever the computation
    does; an error in one sequence or head of several alike is a slip there, whatever its size)."""
    mine, theirs = slice_errors(a, ref, den), slice_errors(low, ref, den)
    if mine.shape != theirs.shape:
        return True
    alike = theirs >= 0.5 * theirs.max(initial=0.0)
    return not np.any(alike & (mine < mine.max(initial=0.0) / LOWER_SHARE ** 2))


def rounding_ceiling(dtype):
    """(the lowest precision a check in ``dtype`` reads, ROUNDING_ULPS units of its roundoff): the most
    error relative to the tensor that rounding in it makes (`_rounding_like`).  Past LOGIT_SCALE it is
    not: there a lower precision's one-hot weights flip (`_lower_precision` reads none)."""
    lowest = max((dtype,) + LOWER.get(dtype, ()), key=lambda d: EPS.get(d, 0.0))
    return lowest, ROUNDING_ULPS * EPS.get(lowest, 0.0)


def _rounding_like(n, rows, ev):
    """(whether tensor ``n``'s error can be rounding, why not, whether the row says so): its size
    within ROUNDING_ULPS of the lowest precision in question, not concentrated in the rows whose
    maximum moved, and gone when the target computes in float64 (see ROUNDING_ULPS); only the
    float64 run's verdict is news to the reader of the row."""
    lowest, ceiling = rounding_ceiling(ev.dtype)
    error = rows[n].error
    if error is None or not np.isfinite(error):
        return False, "not finite", False
    if error > ceiling:
        return False, f"its error {_fmt(error)} is over {ROUNDING_ULPS:g} units of {lowest}'s roundoff ({_fmt(ceiling)})", False
    if n in ("out", "lse", "dq") and ev.rows is None and fits_densely(ev.case):
        still, moved = _max_moved(ev)
        if still.sum() >= 4 and moved.sum() >= 4:
            per_row = (np.abs(ev.arrays[n] - ev.gold[n]) / ev.den[n]).max(-1)           # (B, H, Tq)
            if np.median(per_row[moved]) > ev.bounds[n] and per_row[still].max() < MOVED_SHARE * np.median(per_row[moved]):
                return False, "its error sits in the rows whose running maximum moved (the rows whose maximum lies in " \
                              f"the first {FIRST_KEYS} keys are right)", False
    if ev.dtype != "float64" and n != "lse" and fits_densely(ev.case):
        got = _float64_run(ev)
        a64 = got.get(n) if isinstance(got, dict) else None
        if isinstance(a64, np.ndarray) and np.isfinite(a64).all():
            a64 = as_4d({n: a64})[n]
            off_grid = bool(np.any(a64.astype(np.float32).astype(np.float64) != a64))
            gap = float(slice_errors(a64, ev.gold[n], ev.den[n]).max())
            if off_grid and gap >= SAME_GAP * error:
                return False, (f"a float64 run of the target shows the same gap ({_fmt(gap)} against {_fmt(error)} in "
                               f"{ev.dtype}): a difference of formula or convention, not of precision"), True
    return True, "", False


def _max_moved(ev):
    """(still, moved): (B, H, Tq) bool, the query rows whose maximum score lies in the first
    FIRST_KEYS keys (a running maximum that never moves after them) and the others that see a key."""
    tk = ev.rounded["k"].shape[2]
    first = torch.zeros(tk, dtype=torch.float64).masked_fill(torch.arange(tk) >= FIRST_KEYS, -np.inf)
    m, m1 = _dense_forward(ev)[2], _dense_forward(ev, extra_bias=first)[2]
    seen = np.isfinite(m)
    still = seen & (m1 == m)
    return still, seen & ~still


def _out_weights(sub):
    """(P, v, O, row_error) that the readings fitted to out row by row start from: the dense
    forward's weights P (`_dense_weights`), v with a copy per query head (B, Hq, Tk, Dv), the
    reference's O = P v, and each row's error against it over out's denominator (B, Hq, Tq);
    None where out is missing or not finite, with one key, or where there are no weights."""
    if "out_weights" in sub.memo:
        return sub.memo["out_weights"]
    case, got = sub.case, sub.arrays.get("out")
    P = _dense_weights(sub) if got is not None and np.isfinite(got).all() and case.tk > 1 else None
    found = None
    if P is not None:
        v = np.repeat(sub.rounded["v"], case.heads // case.hkv, 1)
        O = P @ v
        found = P, v, O, np.abs(got - O).max(-1) / np.broadcast_to(sub.den["out"], P.shape[:2])[..., None]
    sub.memo["out_weights"] = found
    return found


# Block masks (`_tile_masks`): square tiles of these sizes, at most BLOCKS blocks, and at most this many
# changed blocks (each the best single change, taken while it lowers the rows' squared error).
MASK_TILES = (64, 32, 16)
MASK_CHANGES = 16


def _tile_masks(sub):
    """An out whose (query tile, key tile) blocks each apply another mask than their own, one mask for
    every (batch, head): a block skipped, its mask dropped (all its keys seen), or another block's
    mask (a tile mask cached by its shape alone, a block-sparse loop taking a block for full or
    partial): from the unmasked dense weights U (v the identity), a row's output under mask M is
    Σ_j U_ij M_ij v_j / Σ_j U_ij M_ij, so a block's change moves it by that block's terms alone.
    Fitted query tile by query tile, the largest tile first, each step taking the single block
    change that lowers that tile's rows' squared error most (`MASK_CHANGES` at most); held to the
    bound on every row.  [] where the mask differs between slices, with sinks (their weight outside any block), with
    dropout, on a block of rows, or too large."""
    found = _out_weights(sub) if sub.opts.get("sinks") is None else None
    U = _dense_weights(sub, unmasked=True) if found is not None else None
    if U is None:
        return []
    P, v, _, row_error = found
    B, H, Tq, Tk = P.shape
    seen = P > 0
    bound, got = sub.bounds["out"], sub.arrays["out"]
    den = np.broadcast_to(sub.den["out"], (B, H))[..., None, None]
    if not (row_error > bound).any() or (seen != seen[:1, :1]).any():
        return []
    for tile in MASK_TILES:
        nq, nk = -(-Tq // tile), -(-Tk // tile)
        if nq * nk > BLOCKS or nk < 2:
            continue
        mask = _in_tiles(_in_tiles(seen[0, 0], 0, tile), 2, tile)     # (nq, tile, nk, tile)
        own = {}                                                     # pattern -> the first block that has it
        for qi, kj in itertools.product(range(nq), range(nk)):
            own.setdefault(mask[qi, :, kj].tobytes(), (qi, kj))
        shapes = [np.ones((tile, tile), bool), np.zeros((tile, tile), bool)] + \
            [np.frombuffer(b, bool).reshape(tile, tile) for b in own]
        fitted, changes = mask.copy(), {}
        for qi in range(nq):
            rows = slice(qi * tile, min((qi + 1) * tile, Tq))
            if (row_error[..., rows] <= bound).all():
                continue
            n = rows.stop - rows.start
            Ur = U[..., rows, :]
            M = fitted[qi, :n].reshape(n, -1)[:, :Tk]
            num, tot = (Ur * M) @ v, (Ur * M).sum(-1, keepdims=True)
            err = lambda num, tot: ((got[..., rows, :] - np.where(tot > 0, num / np.where(tot > 0, tot, 1), 0))
                                    / den) ** 2
            now = err(num, tot).sum()
            for _ in range(MASK_CHANGES):
                best = None
                for kj in range(nk):
                    cols = slice(kj * tile, min((kj + 1) * tile, Tk))
                    m_old = fitted[qi, :n, kj, :cols.stop - cols.start]
                    for c in shapes:
                        delta = c[:n, :cols.stop - cols.start].astype(float) - m_old
                        if not delta.any():
                            continue
                        Ud = Ur[..., cols] * delta
                        e = err(num + Ud @ v[..., cols, :], tot + Ud.sum(-1, keepdims=True)).sum()
                        if e < now and (best is None or e < best[0]):
                            best = (e, kj, c, Ud, cols)
                if best is None or best[0] > 0.5 * now:
                    break
                now, kj, c, Ud, cols = best
                fitted[qi, :n, kj, :cols.stop - cols.start] = c[:n, :cols.stop - cols.start]
                num, tot = num + Ud @ v[..., cols, :], tot + Ud.sum(-1, keepdims=True)
                changes[qi, kj] = c
        M = fitted.reshape(nq * tile, nk * tile)[:Tq, :Tk]
        if not changes or (M == seen[0, 0]).all():
            continue
        W = U * M
        tot = W.sum(-1, keepdims=True)
        pred = np.where(tot > 0, (W @ v) / np.where(tot > 0, tot, 1), 0)
        if slice_errors(got, pred, sub.den["out"]).max() > bound:
            continue
        said = []
        for (qi, kj), c in sorted(changes.items()):
            if (fitted[qi, :, kj] == mask[qi, :, kj]).all():
                continue
            what = ("every key seen (its mask dropped)" if c.all() else "no key seen (the block skipped)"
                    if not c.any() else "the mask of block (%d, %d)" % own[c.tobytes()])
            said.append(f"({qi}, {kj}): {what}")
        if not said:
            continue
        r, opts = sub.rounded, {n: x for n, x in sub.opts.items() if n not in ("causal", "window")}
        extra = np.where(M, 0.0, -np.inf)[None, None]
        opts["bias"] = extra if opts.get("bias") is None else opts["bias"] + extra

        def predict(grads=True, opts=opts):
            return as_4d(dense.run(r["q"], r["k"], r["v"], r["dout"] if grads else None, opts, grads=grads,
                                   dlse=r.get("dlse") if grads else None))
        listed = "; ".join(said[:4]) + ("; ..." if len(said) > 4 else "")
        return [mistakes.Hypothesis("tile-masks", f"(query tile, key tile) blocks of {tile} masked otherwise than "
                                    f"their own ({len(said)} of {nq * nk}: {listed}): a tile's mask cached or "
                                    "chosen by the wrong key, or a block-sparse loop taking a block for another kind",
                                    predict, ("out", "lse", "dq", "dk", "dv"), fitted=("out",))]
    return []


# Key tiles weighed otherwise (`_tiles_weighted`): a tile's factor is said where its softmax mass is above
# MASS_FLOOR (a weight over a mass of 1e-100 says nothing).
MASS_FLOOR = 1e-6


def _key_tile_parts(sub):
    """(tile, Pt, part, wrong) for the key tiles out is read in (`_tiles_weighted`, `_tiles_left_out`):
    each tile of `mistakes.KEY_TILES`, largest first, that cuts Tk into 2 .. RANGE_TILES tiles; Pt the
    dense weights P in tiles (B, H, Tq, n, tile), part_it = Σ_{j in t} P_ij v_j (B, H, Tq, n, Dv), and
    wrong (B, H, Tq) the rows past the bound.  Nothing with sinks, or where no row is wrong."""
    found = _out_weights(sub) if sub.opts.get("sinks") is None else None
    if found is None:
        return
    P, v, _, row_error = found
    wrong = row_error > sub.bounds["out"]
    if not wrong.any():
        return
    for tile in sorted(mistakes.KEY_TILES, reverse=True):
        if 2 <= -(-P.shape[-1] // tile) <= RANGE_TILES:
            Pt = _in_tiles(P, -1, tile)
            yield tile, Pt, np.einsum("bhqnt,bhntd->bhqnd", Pt, _in_tiles(v, 2, tile)), wrong


def _deferred_rescale(sub):
    """An online softmax that adds key tile t's P V after acc is rescaled for the tile it visits next:
    a software-pipelined loop deferring each tile's product, acc = acc · α + P_t V_t where
    (acc + P_t V_t) · α is meant (α = exp(m_t − m_t+1)), l right.  Tile t's share of row i is then
    multiplied by exp(m_t+1 − m_t), the rise of the row's running maximum at the next tile, the last
    tile's by 1: out_i = Σ_t exp(m_t+1 − m_t) Σ_{j in t} P_ij v_j, the maxima from the reference's
    scores (log P), the tiles of `mistakes.KEY_TILES` visited from the first or from the last.
    Nothing fitted; held to the bound."""
    got, bound = sub.arrays["out"], sub.bounds["out"]
    for tile, Pt, part, wrong in _key_tile_parts(sub):
        with np.errstate(divide="ignore"):
            top = np.log(Pt).max(-1)                                              # (B, H, Tq, n), -inf: unseen
        for order in ("first", "last"):
            m = np.maximum.accumulate(top if order == "first" else top[..., ::-1], axis=-1)
            rise = np.concatenate([m[..., 1:], m[..., -1:]], -1) - np.where(np.isfinite(m), m, 0.0)
            with np.errstate(over="ignore"):                                      # a rise past 709: inf, no fit
                factor = np.where(np.isfinite(m), np.exp(np.where(np.isfinite(rise), rise, 0.0)), 1.0)
            factor = factor if order == "first" else factor[..., ::-1]
            if np.abs(factor[wrong] - 1).max(initial=0.0) <= FIT_SHARE:
                continue
            pred = np.einsum("bhqn,bhqnd->bhqd", factor, part)
            if slice_errors(got, pred, sub.den["out"]).max() <= bound:
                return [mistakes.Hypothesis(
                    "deferred-rescale", f"each key tile's P V (tiles of {tile}, visited from the {order}) added after "
                    "the accumulator is rescaled for the next tile (its share multiplied by exp(m_next − m), the "
                    f"rise of the row's running maximum, up to {float(factor[wrong].max()):.3g}; l right): a "
                    "pipelined loop that defers each tile's product and adds it where (acc + P V) · α is meant",
                    lambda grads=True, pred=pred: {**sub.gold, "out": pred}, ("out",), fitted=("out",))]
    return []


def _tiles_weighted(sub):
    """An out that mixes each row's key tiles with other weights than their softmax mass (an online
    softmax whose state is rescaled inconsistently across key tiles: a tile's weights taken against
    one maximum while acc and l keep another, a per-tile scale on P undone once): row i's output
    Σ_t w_it O_it, O_it its tile t's own normalised output and w_it fitted by least squares with
    Σ_t w_it = 1 (a row that sees one tile is kept as it is), each tile's factor c_it = w_it / mass_it
    (relative to the row's first tile) said by its range; held
    to the bound, the largest tile of `mistakes.KEY_TILES` that explains first.  [] where every
    factor is 1, with sinks, with dropout, on a block of rows, or with weights too large to hold."""
    got, bound = sub.arrays["out"], sub.bounds["out"]
    for tile, Pt, part, wrong in _key_tile_parts(sub):
        B, H, Tq, n = part.shape[:4]
        mass = Pt.sum(-1)                                                         # (B, H, Tq, n)
        Ot = part / np.where(mass > 0, mass, 1.0)[..., None]
        seen = mass > 0
        A = np.where(seen[..., None], Ot, 0.0)                                    # (B, H, Tq, n, D)
        # least squares with Σ_t w_t = 1 (acc and l scaled alike): the normal equations and the sum as one
        # more row and column; a tile the row does not see held at 0
        G = A @ np.swapaxes(A, -1, -2) + np.eye(n) * np.where(seen, 1e-12, 1.0)[..., None]
        K = np.zeros((B, H, Tq, n + 1, n + 1))
        K[..., :n, :n], K[..., :n, n], K[..., n, :n] = G, seen, seen
        K[..., n, n] = ~seen.any(-1)                                              # a row that sees no key: w = 0
        rhs = np.concatenate([np.einsum("bhqnd,bhqd->bhqn", A, got), np.ones((B, H, Tq, 1))], -1)
        w = np.linalg.solve(K, rhs[..., None])[..., :n, 0]                       # a row seeing one tile: w = 1
        pred = np.einsum("bhqn,bhqnd->bhqd", w, A)
        if slice_errors(got, pred, sub.den["out"]).max() > bound:
            continue
        first = np.argmax(seen, -1)[..., None]
        c = w / np.where(mass > MASS_FLOOR, mass, 1.0)
        c = c / np.where(np.take_along_axis(c, first, -1) != 0, np.take_along_axis(c, first, -1), 1.0)
        told = seen & wrong[..., None] & (seen.sum(-1, keepdims=True) > 1) & (mass > MASS_FLOOR)
        if not told.any() or np.abs(c[told] - 1).max() <= CONSTANT_WITHIN:
            return []
        squares = (Pt ** 2).sum(-1)
        keys = mass ** 2 / np.where(squares > 0, squares, 1.0)              # each tile's keys that weigh, in effect
        if not (keys[told & (np.abs(c - 1) > CONSTANT_WITHIN)] >= 2).any():
            return []                                  # one key a tile: keys weighed otherwise, not shown as tiles
        lo, hi = float(c[told].min()), float(c[told].max())
        return [mistakes.Hypothesis("tiles-weighted", f"each row's key tiles of {tile} mixed with other weights than "
                                    f"their softmax mass (a tile's weight off by a factor of its own, {lo:.3g} .. "
                                    f"{hi:.3g} against the row's first tile): an online softmax whose state is "
                                    "rescaled inconsistently across key tiles (a tile's weights taken against one "
                                    "maximum while acc and l keep another, or a per-tile scale on P undone once)",
                                    lambda grads=True, pred=pred: {**sub.gold, "out": pred}, ("out",),
                                    fitted=("out",))]
    return []


def _tiles_left_out(sub):
    """An out whose rows leave some key tiles' values out while their weights stay in the softmax's
    sum: row i's output Σ_t w_it Σ_{j in t} P_ij v_j with each w_it 0 or 1 (fitted row by row by
    least squares and rounded; P the reference's weights, normalised over every key the row sees):
    a tile's P V never added to the accumulator (a partial sum not flushed after the loop, a
    product dropped) while l counts it.  The tiles said by where they sit among those the row
    sees (its last ones).  Held to the bound, the largest tile of `mistakes.KEY_TILES` first; []
    with sinks, or where every weight is 1."""
    got, bound = sub.arrays["out"], sub.bounds["out"]
    for tile, _, part, _ in _key_tile_parts(sub):
        B, H, n = part.shape[0], part.shape[1], part.shape[3]
        seen = np.abs(part).max(-1) > 0
        G = part @ np.swapaxes(part, -1, -2) + np.eye(n) * np.where(seen, 1e-12, 1.0)[..., None]
        w = np.linalg.solve(G, np.einsum("bhqnd,bhqd->bhqn", part, got)[..., None])[..., 0]
        told = np.abs(part).max(-1) / np.broadcast_to(sub.den["out"], (B, H))[..., None, None] > FIT_SHARE * bound
        kept = np.where(told, np.round(w), 1.0)          # a tile weighing a tenth of the bound or less: kept
        if not set(np.unique(kept)) <= {0.0, 1.0} or (kept == 1).all() or np.abs(w - kept)[told].max() > 0.25:
            scaled = _tiles_scaled(sub, tile, part, w, told)
            if scaled:
                return scaled
            continue
        pred = np.einsum("bhqn,bhqnd->bhqd", kept, part)
        if slice_errors(got, pred, sub.den["out"]).max() > bound:
            continue
        out_of = kept == 0
        last = np.cumsum(seen[..., ::-1], -1)[..., ::-1]               # 1: the last tile a row sees, 2: the one before
        dropped = out_of.sum(-1)
        where = "key tiles {} of the rows that see them".format(ranges(sorted(set(np.nonzero(out_of)[-1].tolist()))))
        if (out_of <= (seen & (last <= dropped[..., None]))).all():   # (a light tile among them may be kept)
            k = sorted(set(dropped[dropped > 0].tolist()))
            where = "each row's last key tile" if k == [1] else f"each row's last {ranges(k)} key tiles"
            where += " of those it sees"
        return [mistakes.Hypothesis("tiles-left-out", f"{where} (tiles of {tile}) counted in the softmax's sum but "
                                    "left out of its output (their P V never added to the accumulator: a partial "
                                    "sum not flushed after the loop, or a tile's product dropped)",
                                    lambda grads=True, pred=pred: {**sub.gold, "out": pred}, ("out",),
                                    fitted=("out",))]
    return []


def _values_read_as_zero(sub):
    """V read as 0 in whole (key tile, channel) blocks, the same for every row, head and batch entry
    (a load's mask built from the wrong offsets: the key bound applied to the channel offsets, a
    channel mask taken from another tile): out is linear in each channel of v, so out_ic = O_ic −
    Σ_t z_tc part_itc with part_itc = Σ_{j in t} P_ij v_jc, and z_tc is fitted by least squares over
    every row, channel by channel, then rounded to 0 or 1; held to the bound, the largest tile of
    `mistakes.KEY_TILES` that explains first.  [] where no block is 0."""
    got, bound = sub.arrays["out"], sub.bounds["out"]
    for tile, _, part, _ in _key_tile_parts(sub):
        n, tk = part.shape[3], sub.case.tk
        O = part.sum(3)
        A = part.reshape(-1, n, part.shape[-1])                                    # (rows, n, Dv)
        G = np.einsum("rtc,rsc->cts", A, A) + 1e-12 * np.eye(n)
        rhs = np.einsum("rtc,rc->ct", A, (O - got).reshape(-1, part.shape[-1]))
        z = np.round(np.clip(np.linalg.solve(G, rhs[..., None])[..., 0], 0, 1)).T    # (n, Dv)
        if not z.any():
            return []
        pred = O - np.einsum("bhqtc,tc->bhqc", part, z)
        if slice_errors(got, pred, sub.den["out"]).max() > bound:
            continue
        blocks = [f"keys {t * tile} .. {min(tk, (t + 1) * tile) - 1}, channels {ranges(np.nonzero(z[t])[0].tolist())}"
                  for t in range(n) if z[t].any()]
        starts = np.arange(n)[:, None] * tile + np.arange(z.shape[1])[None, :]
        why = (f"channel c of the tile from key s read as 0 where s + c >= Tk = {tk}: the key bound applied to the "
               "channel offsets") if np.array_equal(z > 0, starts >= tk) else \
            "a load's mask built from other offsets than its own"
        return [mistakes.Hypothesis("values-read-as-zero", f"V read as 0 in whole (key tile, channel) blocks "
                                    f"(tiles of {tile}: {'; '.join(blocks)}): {why}",
                                    lambda grads=True, pred=pred: {**sub.gold, "out": pred}, ("out",),
                                    fitted=("out",))]
    return []


# `_values_from_other_tiles`: at most this many key tiles (the fit holds (rows, n, n, Dv) terms)
SWAP_TILES = 12


def _values_from_other_tiles(sub):
    """V of some key tiles read from another key tile's rows, K's right (a V pointer not advanced with
    K's, or from another start; a V offset taken from another block): out is linear in v, so reading
    tile t's values from tile s moves row i by d_its = Σ_{j in t} P_ij (v_{j + (s − t)·tile} − v_j).
    Each row's swaps (t -> s, each t at most once) are taken greedily, the one that lowers the row's
    squared error most first, while it lowers it by more than half of what is left; the swaps of each
    query tile of `TILES` then said together, the smallest tile whose rows agree.  Held to the bound,
    the largest key tile of `mistakes.KEY_TILES` that explains first.  [] where no swap is taken."""
    got, bound = sub.arrays["out"], sub.bounds["out"]
    for tile, Pt, part, wrong in _key_tile_parts(sub):
        n, tk = part.shape[3], sub.case.tk
        if n > SWAP_TILES:
            continue
        v = np.repeat(sub.rounded["v"], sub.case.heads // sub.case.hkv, 1)
        moved = np.einsum("bhqtk,bhskd->bhqtsd", Pt, _in_tiles(v, 2, tile)) - part[..., None, :]   # d_its
        moved[..., np.arange(n), np.arange(n), :] = 0.0
        moved[..., (np.arange(n) + 1) * tile > tk, :] = 0.0             # no source past the keys' end
        rows = moved.reshape((-1, n * n, moved.shape[-1]))
        left = (got - part.sum(3)).reshape(-1, moved.shape[-1])
        size = (rows ** 2).sum(-1)
        floor = NAMED_WITHIN * bound * sub.den["out"]                      # a row within it is left as it is
        swaps = np.full((len(rows), n), -1)
        for _ in range(n):
            gain = 2 * np.einsum("rc,rmc->rm", left, rows) - size
            gain[np.repeat(swaps >= 0, n, axis=1)] = -np.inf                   # each tile swapped once
            best = gain.argmax(-1)
            take = (np.take_along_axis(gain, best[:, None], -1)[:, 0] > 0.5 * (left ** 2).sum(-1)) & \
                (np.abs(left).max(-1) > floor)
            if not take.any():
                break
            r = np.nonzero(take)[0]
            swaps[r, best[r] // n] = best[r] % n
            left[r] -= rows[r, best[r]]
        if not (swaps >= 0).any():
            continue
        pred = got - left.reshape(got.shape)
        if slice_errors(got, pred, sub.den["out"]).max() > bound:
            continue
        said = _swaps_said(swaps.reshape(part.shape[:3] + (n,)), tile, tk)
        return [mistakes.Hypothesis("values-from-other-tiles", f"V of some key tiles of {tile} read from another "
                                    f"tile's rows, K's right ({said}): V's pointer not advanced with K's, or "
                                    "advanced from another start", lambda grads=True, pred=pred: {**sub.gold, "out": pred},
                                    ("out",), fitted=("out",))]
    return []


def _swaps_said(swaps, tile, tk):
    """`_values_from_other_tiles`' swaps (B, H, Tq, n: the source of each key tile, -1 kept), said per
    query tile of `TILES`: the smallest whose rows' swaps agree (every row's a part of its tile's, each
    key tile from one source), runs of tiles alike said together, the first three; each source the
    first key tiles in order on every query tile is said so (a pointer left at key 0).  "query rows ..."
    where no tile size agrees."""
    keys = lambda t, at: f"{at * tile} .. {at * tile + min(tk, (t + 1) * tile) - t * tile - 1}"   # t's length, from at
    tq = swaps.shape[2]
    for q in (t for t in TILES if t < tq):
        runs, from_start = [], True                     # [first row, last row, {t: s}]
        for start in range(0, tq, q):
            block = swaps[:, :, start:start + q]
            kept = {t: set(block[..., t][block[..., t] >= 0].tolist()) for t in range(swaps.shape[-1])}
            if any(len(src) > 1 for src in kept.values()):
                break
            pairs = {t: src.pop() for t, src in kept.items() if src}
            if not pairs:
                continue
            first = min(pairs)
            from_start &= all(s == t - first for t, s in pairs.items())
            if runs and runs[-1][2] == pairs and runs[-1][1] == start - 1:
                runs[-1][1] = min(tq, start + q) - 1
            else:
                runs.append([start, min(tq, start + q) - 1, pairs])
        else:
            said = "; ".join(f"query rows {a} .. {b}: " + ", ".join(f"keys {keys(t, t)} from {keys(t, s)}"
                                                                    for t, s in pairs.items())
                             for a, b, pairs in runs[:3]) + ("; ..." if len(runs) > 3 else "")
            return said + ("; on each query tile, from the first keys on: a pointer left at key 0" if from_start else "")
    rows = np.nonzero((swaps >= 0).any(axis=(0, 1, 3)))[0].tolist()
    return f"query rows {ranges(rows)}, each with its own"


def _tiles_scaled(sub, tile, part, w, told):
    """`_tiles_left_out`'s fit with its weights kept as fitted: row i's output Σ_t w_it Σ_{j in t}
    P_ij v_j, each tile weighed by a positive factor of its own, not summing to 1 (partial states
    merged without each divided by its own sum: a split's accumulator stored where its output is
    meant).  Only with at most half as many tiles as channels, every weight of the tiles that weigh
    (``told``) positive, and one at least FIT_SHARE from 1 (closer, it fits an accumulator's rounding;
    one factor a row reads first as `denominator`, earlier in FITTED)."""
    got, bound = sub.arrays["out"], sub.bounds["out"]
    if part.shape[-2] > got.shape[-1] // 2 or not told.any() or (w[told] <= 0).any() or \
            not (np.abs(w[told] - 1) > FIT_SHARE).any():
        return []                                # (factors within a tenth of 1: an accumulator's rounding)
    pred = np.einsum("bhqn,bhqnd->bhqd", w, part)
    if slice_errors(got, pred, sub.den["out"]).max() > bound:
        return []
    return [mistakes.Hypothesis("tiles-scaled", f"each row's key tiles of {tile} weighed by factors of their own, "
                                f"{float(w[told].min()):.3g} .. {float(w[told].max()):.3g} times their softmax weight "
                                "(not summing to 1): partial states merged without each divided by its own sum (a "
                                "split's accumulator stored where its normalised output is meant), or rescaled "
                                "otherwise", lambda grads=True: {**sub.gold, "out": pred}, ("out",), fitted=("out",))]


def _scores_scaled(sub):
    """An out whose scores are all multiplied by one factor a and whose output by another, b, in
    each (batch, head) (an FP8 kernel's q or k descale and its v descale off, or a scale taken
    wrong with v rescaled): out = b softmax(a S) v, with S the reference's scores (log P + lse),
    a fitted per slice by golden-section search on log a over 1/16 .. 16, b by least squares.
    Held to the bound; [] where a is 1 throughout (a factor on out alone is said elsewhere)."""
    found = _out_weights(sub)
    if found is None:
        return []
    P, v, O, _ = found
    got = sub.arrays["out"]
    if slice_errors(O, sub.gold["out"], sub.den["out"]).max() > FIT_SHARE * sub.bounds["out"]:
        return []                                                # v is not what the reference multiplied
    with np.errstate(divide="ignore"):
        S = np.log(P)                                             # each row's scores less its lse: a·S shifts alike

    def fit(log_a):
        """(b, prediction, per-slice residual) for each slice's factor exp(log_a)."""
        top = np.max(S, -1, keepdims=True)
        w = np.exp(np.exp(log_a)[..., None, None] * (S - np.where(np.isfinite(top), top, 0.0)))
        w = np.where(np.isfinite(S), w, 0.0)
        total = w.sum(-1, keepdims=True)
        out = np.where(total > 0, (w @ v) / np.where(total > 0, total, 1.0), 0.0)
        b = (got * out).sum((-2, -1)) / np.maximum((out * out).sum((-2, -1)), 1e-300)
        pred = b[..., None, None] * out
        return b, pred, (np.abs(got - pred).max((-2, -1)) / np.broadcast_to(sub.den["out"], b.shape))

    def search(shared):
        """log a per slice (``shared``: one for all, its worst slice's residual least) by golden section."""
        residual = (lambda x: np.broadcast_to(fit(x)[2].max(), x.shape)) if shared else (lambda x: fit(x)[2])
        lo, hi = np.full(P.shape[:2], -math.log(16)), np.full(P.shape[:2], math.log(16))
        g = (math.sqrt(5) - 1) / 2
        x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
        f1, f2 = residual(x1), residual(x2)
        for _ in range(40):                                      # to 1e-7 of log a
            left = f1 < f2                                       # the minimum lies in [lo, x2]
            lo, hi = np.where(left, lo, x1), np.where(left, x2, hi)
            x1, x2, f1, f2 = (np.where(left, hi - g * (hi - lo), x2), np.where(left, x1, lo + g * (hi - lo)),
                              np.where(left, np.nan, f2), np.where(left, f1, np.nan))
            new = residual(np.where(left, x1, x2))
            f1, f2 = np.where(left, new, f1), np.where(left, f2, new)
        return (lo + hi) / 2
    for shared in (True, False):                                 # one factor for all where one explains
        log_a = search(shared)
        b, pred, _ = fit(log_a)
        if slice_errors(got, pred, sub.den["out"]).max() <= sub.bounds["out"]:
            break
    else:
        return []
    a = np.exp(log_a)
    if np.allclose(a, 1, rtol=1e-3):
        return []
    snap = lambda x: np.where(x != 0, 2.0 ** np.round(np.log2(np.where(x != 0, np.abs(x), 1.0))), 0.0) * np.sign(x)
    b_snapped, pred_snapped, _ = fit(np.log(snap(a)))           # powers of two where they explain as well
    for b_try in (snap(b_snapped), b_snapped):
        pred_try = pred_snapped / np.where(b_snapped != 0, b_snapped, 1.0)[..., None, None] * b_try[..., None, None]
        if slice_errors(got, pred_try, sub.den["out"]).max() <= sub.bounds["out"]:
            a, b, pred = snap(a), b_try, pred_try
            break

    def said(x):
        """One factor where every slice's is within 1 % of their median (the fit's own scatter
        in bfloat16), with its power of two where it is one; else the first few (- where the
        output's factor is 0: any factor of the scores gives it)."""
        mid = float(np.nanmedian(x))
        if np.allclose(x[np.isfinite(x)], mid, rtol=1e-2):
            k = round(math.log2(abs(mid))) if mid else None
            return f"{mid:.4g}" + (f" (2^{k})" if k is not None and abs(mid - 2.0 ** k) <= 1e-2 * abs(mid) else "")
        return "a factor per (batch, head): " + ", ".join("-" if np.isnan(y) else f"{y:.3g}" for y in x.flat[:6]) + \
            (", ..." if x.size > 6 else "")
    pred = {"out": pred}
    scores = said(np.where(b == 0, np.nan, a)) if np.any(b) else "any factor"
    return [mistakes.Hypothesis("scores-scaled", f"its scores multiplied by {scores} and its output by {said(b)} "
                                "(in FP8: the q or k descale and the v descale off by those factors)",
                                lambda grads=True: {**sub.gold, **pred}, ("out",), fitted=("out",))]


def _judged_lse(sub, lse):
    """A predicted 4-D lse on the rows the reference judges (0 on the others, as the golden)."""
    return np.where(sub.gold["lse"] == 0.0, 0.0, lse)


def _dense_weights(sub, unmasked=False):
    """P (B, Hq, Tq, Tk): the softmax weights of the dense float64 forward (v the identity;
    ``unmasked``: without the causal mask and window, each sequence's keys all seen), or None
    with dropout, on a block of rows, or past UNSEEN_LIMIT (query or key, key) pairs."""
    case, tk = sub.case, sub.case.tk
    if sub.rows is not None or sub.opts.get("keep") is not None or \
            case.batch * case.heads * max(case.tq, tk) * tk > UNSEEN_LIMIT:
        return None
    eye = np.ascontiguousarray(np.broadcast_to(np.eye(tk), sub.rounded["k"].shape[:2] + (tk, tk)))
    return _dense_forward(sub, v=eye, unmasked=unmasked)[0]


def _dense_forward(sub, v=None, extra_bias=None, unmasked=False, changes=None, inputs=None):
    """(out, lse, m): ``dense.attention`` in float64 on the evidence's rounded inputs (``v`` in
    place of its v, ``extra_bias`` added to the scores; ``changes`` to its options, ``inputs``
    in place of q, k or v), without dropout: m each row's maximum score, −inf where the row sees
    no key.  NumPy arrays."""
    r = {**sub.rounded, **(inputs or {})}
    t = lambda a: torch.tensor(np.asarray(a), dtype=torch.float64)              # a copy: some are read-only
    dropped = ("keep", "dropout_p") + (("causal", "window") if unmasked else ())
    kw = dense.keywords({n: x for n, x in {**sub.opts, **(changes or {})}.items() if n not in dropped})
    if extra_bias is not None:
        kw["bias"] = kw.get("bias", torch.zeros((), dtype=torch.float64)) + extra_bias
    with torch.no_grad():
        found = dense.attention(t(r["q"]), t(r["k"]), t(r["v"] if v is None else v), with_max=True, **kw)
    return tuple(x.numpy() for x in found)


def _float64_run(ev):
    """The target called once more on the same (rounded) inputs, in float64: a dict of its
    arrays, or what the call gave instead (a refusal, a failure)."""
    if ev.in_float64 is None:
        caller = copy.copy(ev.caller)
        caller.dtype = torch.float64
        ev.in_float64 = caller()
    return ev.in_float64


def _group_heads(n, ev):
    """[words] where tensor ``n`` fails in some query heads of a GQA case only, each past the first
    of its kv group (a per-group value updated in place in a loop over the group's heads), or each
    the first (a group's result written once, for its first head); else []."""
    case = ev.case
    if case.hkv == case.heads or n not in ev.arrays or ev.arrays[n].shape[1] != case.heads:
        return []
    per_head = slice_errors(ev.arrays[n], ev.gold[n], ev.den[n]).max(axis=0)
    bad = [int(h) for h in np.nonzero(per_head > ev.bounds[n])[0]]
    group = case.heads // case.hkv
    if not bad or len(bad) == case.heads:
        return []
    heads = f"(heads {ranges(bad)} of {case.heads}, groups of {group} sharing a kv head)"
    if all(h % group for h in bad):
        return [f"only query heads past the first of their kv group {heads}"]
    if all(h % group == 0 for h in bad):
        return [f"only the first query head of each kv group {heads}"]
    return []


def _packed_tile_rows(n, ev, bad):
    """Words where the failing rows of each failing sequence ``bad`` of a varlen case are those it
    shares a packed tile with the sequence before it (its first rows up to the next multiple of a
    tile of `mistakes.KEY_TILES` in the packed token axis): a tile holding two sequences' rows
    taken for the first's alone.  Query rows for out, lse, dq; key rows for dk, dv.  "" otherwise."""
    rows_of = 1 if n in ("dk", "dv") else 0
    if n not in ("out", "lse", "dq", "dk", "dv") or 0 in bad:
        return ""
    lens = [int(x) for x in ev.case.seqlens[rows_of]]
    a, r = ev.arrays[n], ev.gold[n]
    den = np.asarray(ev.den[n]).reshape(np.shape(ev.den[n]) + (1, 1))
    wrong = ((np.abs(a - r) / den).max(-1) > ev.bounds[n]).any(1)                 # (B, T)
    starts = np.cumsum([0] + lens)
    for t in sorted(mistakes.KEY_TILES):
        shared = {b: int(-starts[b] % t) for b in bad}                            # its rows in the previous' tile
        if all(0 < shared[b] < lens[b] and wrong[b].any() and not wrong[b, shared[b]:].any() for b in bad):
            which = "query" if rows_of == 0 else "key"
            said = ", ".join(f"{b}: rows 0 .. {shared[b] - 1}" for b in bad)
            return (f"; in each, only its first {which} rows, those in the packed tile of {t} that also holds the "
                    f"sequence before it ({said}): a tile holding two sequences' rows taken for the first's alone")
    return ""


def _summaries(result, rows, ev):
    """What a user asks first, ahead of the sentence."""
    forward_ok = all(rows[n].passed for n in ("out", "lse") if n in rows)
    case = ev.case
    for n, d in result.items():
        lead = []
        if n in GRADS and forward_ok:
            lead.append("the output is right; only the backward is wrong")
        if case.seqlens is not None and case.batch > 1 and n in ev.arrays and ev.arrays[n].shape[0] == case.batch:
            per_batch = slice_errors(ev.arrays[n], ev.gold[n], ev.den[n]).max(axis=1)
            bad = [int(b) for b in np.nonzero(per_batch > ev.bounds[n])[0]]
            if 0 < len(bad) < case.batch:
                word = "sequence" if len(bad) == 1 else "sequences"
                said = f"only {word} {', '.join(map(str, bad))} of the batch"
                empty = [b for b in range(case.batch) if not all(lens[b] for lens in case.seqlens)]
                after = empty and [b for b in range(empty[0] + 1, case.batch) if b not in empty]
                if after and set(bad) - set(empty) == set(after) and d.id in ("none", weights.ID):   # each after it
                    said += (f", none before the empty sequence {empty[0]} (what an empty sequence shifting the ones "
                             "after it gives)")
                lead.append(said + _packed_tile_rows(n, ev, bad))
        lead += _group_heads(n, ev)
        r = rows[n]
        if r.cosine is not None and r.cosine < WRONG_WAY:
            d.sentence += f"; {n} points the wrong way (cosine {r.cosine:.2f} with the reference)"
            if d.id == "none":
                d.id = "wrong-direction"
        if lead:
            d.sentence = "; ".join(lead) + ": " + d.sentence
