"""``dropout``: dropout on the attention weights, after the softmax (the chapter's
``nn.Dropout`` on ``attn_weights``; FlashAttention's and SDPA's ``dropout_p``).  The
callable receives ``dropout_p=float`` and draws its own mask from torch's global RNG.

Seeded: before every call of the target on a dropout case, ``torch.manual_seed`` (on the
devices the machine has: ``common.seeding``) with a seed fixed by the case's fields
(`hand`), so that one forward and its backward share one mask, and any call with the same
shapes draws that mask again.

The mask is recovered from the kernel itself, as FlashAttention's tests do (`recover`):
calls with ``v`` set to columns of the identity (Dv of them at a time, so that Dv stays the
case's) return ``out = P ∘ keep / (1 − p)``, the dropped weights; keep = out ≠ 0 where the
float64 weights P are > 0.  The same calls carry ``dout`` = columns of the identity over the
queries, so that ``dv = Wᵀ dO`` returns the weights *the backward* used: a backward that
drops other weights than its forward is caught there, named.  Then:

- the share of weights kept (over the entries with P > 0) passes a two-sided binomial test
  at ``1 − p`` (exact, `binomial_pvalue`; p-value above `ALPHA`); at p = 0 nothing may be
  dropped;
- out, dq, dk, dv are judged against ``reference_attention(keep=..., dropout_p=p)`` with
  the recovered mask (the baseline, ``dense``, gets the same mask).

Cases: p = 0, 0.1 and 0.5 at T = 77 (D = 64), 0.1 at 45 x 113 (D = 32), 0.5 at 113 x 45
(D = 40), causal and not.  Invited mistakes: the 1/(1 − p) rescale left out or applied
twice; the scores dropped (masked out of the softmax) instead of the weights after it; a
backward mask other than the forward's (in the dQ pass's dP, or in a dK/dV pass's own);
dropout left on at dropout_p = 0; a mask the seed does not reproduce."""

import math
import warnings
import zlib
from dataclasses import astuple

import numpy as np

from parity_tests.common.seeding import manual_seed
from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import Calling, Feature, Input, Option

# A correct kernel fails the keep-rate test with this probability per case.
ALPHA = 1e-6
P_VALUES = (0.0, 0.1, 0.5)


def cases(causal, plan):
    return [Case(1, 2, 77, 77, 64, causal, (("dropout", p),)) for p in P_VALUES] + \
        [Case(2, 2, 45, 113, 32, causal, (("dropout", 0.1),)), Case(1, 3, 113, 45, 40, causal, (("dropout", 0.5),))]


def seed_of(case):
    """torch's seed for every call of the target on ``case`` (fixed by its fields)."""
    return zlib.crc32(repr(("dropout",) + astuple(case)).encode())


def hand(case, args, kw):
    """Nothing changes in what the callable gets; torch is seeded just before the call."""
    manual_seed(seed_of(case))
    return args, kw


def reference(dropout, inputs):
    if "keep" not in inputs:                 # a draw the mask was not recovered for
        return {}
    return {"keep": inputs["keep"], "dropout_p": float(dropout)}


# ----------------------------------------------------------------------------
# The mask, from the kernel

class Finding:
    """What the recovery found wrong: the tensors it fails, a diagnosis id and its sentence;
    ``alike``: the mistake it names moves each of those tensors off the reference, so one of
    them right on its own refutes it (a backward mask read through a probe the kernel answers
    otherwise than its real call)."""

    def __init__(self, tensors, id, sentence, alike=False):
        self.tensors, self.id, self.sentence, self.alike = tensors, id, sentence, alike


def _identity_columns(n, first, width, lead):
    """(*lead, n, width): columns first .. first + width − 1 of the n x n identity (zero past n)."""
    a = np.zeros(lead + (n, width))
    j = np.arange(first, min(first + width, n))
    a[..., j, j - first] = 1.0
    return a


def _probe(caller, rounded):
    """The target's answer on other inputs (the caller's own time limit, failures and seed)."""
    with caller.given(rounded):
        return caller()


def binomial_pvalue(k, n, prob):
    """The exact two-sided p-value of k successes in n trials at ``prob``: the probability of
    every count no likelier than k (scipy.stats.binomtest's, without importing scipy, which
    is a test dependency only and takes seconds to import)."""
    if prob >= 1.0 or prob <= 0.0 or n == 0:
        return 1.0 if k == round(n * prob) else 0.0
    i = np.arange(n + 1)
    lg = np.array([math.lgamma(x + 1) for x in range(n + 1)])
    logpmf = lg[n] - lg - lg[::-1] + i * math.log(prob) + (n - i) * math.log1p(-prob)
    pmf = np.exp(logpmf)
    return float(min(1.0, pmf[pmf <= pmf[k] * (1 + 1e-7)].sum()))


def recover(case, dropout, inputs, opts, caller):
    """Recover the kernel's forward and backward masks (module docstring): ({"keep": the
    forward's mask}, the `Finding` s: empty when the mask is sound)."""
    p, rounded = dropout, inputs
    from numpy_ref import reference_attention
    b, h, hkv, tq, tk, dv = case.batch, case.heads, case.hkv, case.tq, case.tk, case.dv
    W_f, W_b = np.zeros((b, h, tq, tk)), np.zeros((b, h, tq, tk))
    first_slice = None
    for s in range(max(-(-tk // dv), -(-tq // dv))):
        got = _probe(caller, {**rounded, "v": _identity_columns(tk, s * dv, dv, (b, hkv)),
                              "dout": _identity_columns(tq, s * dv, dv, (b, h))})
        if not isinstance(got, dict) or not isinstance(got.get("out"), np.ndarray):
            why = got[1] if isinstance(got, tuple) else str(got)
            return {}, [Finding(("out", "dq", "dk", "dv"), "dropout-not-recovered",
                            f"the dropout mask could not be recovered (a call with v = columns of the "
                            f"identity: {why})")]
        k0, k1, q0, q1 = s * dv, min(tk, (s + 1) * dv), s * dv, min(tq, (s + 1) * dv)
        W_f[..., k0:k1] = got["out"][..., : max(0, k1 - k0)]
        if isinstance(got.get("dv"), np.ndarray) and hkv == h:
            W_b[..., q0:q1, :] = got["dv"][..., : max(0, q1 - q0)].swapaxes(-1, -2)
        if s == 0:
            first_slice = got["out"]
    again = _probe(caller, {**rounded, "v": _identity_columns(tk, 0, dv, (b, hkv)),
                            "dout": _identity_columns(tq, 0, dv, (b, h))})
    # the float64 weights P (the case's own options, no dropout): out with v = the identity
    eye = np.broadcast_to(np.eye(tk), (b, hkv, tk, tk))
    P = reference_attention(rounded["q"], rounded["k"], eye, **opts)["out"]
    seen = P > 0
    kept_f = (W_f != 0) & seen
    learnt = {"keep": kept_f | ~seen}                # hidden keys: kept or not, their weight is 0
    n, k = int(seen.sum()), int(kept_f.sum())
    found = []
    if isinstance(again, dict) and isinstance(again.get("out"), np.ndarray) and \
            not np.array_equal((again["out"] != 0), (first_slice != 0)):
        moved = int(((again["out"] != 0) != (first_slice != 0)).sum())
        found.append(Finding(("out", "dq", "dk", "dv"), "dropout-not-seeded",
                             f"two calls after the same torch.manual_seed drop different weights ({moved} of "
                             f"{first_slice.size} differ): the kernel's mask does not come from torch's global RNG "
                             "(its own generator, or a state the seed does not set)"))
        return learnt, found
    pvalue = binomial_pvalue(k, n, 1.0 - p)
    if p == 0 and k < n:
        found.append(Finding(("out", "dq", "dk", "dv"), "dropout-at-zero",
                             f"dropout left on at dropout_p = 0: {n - k} of {n} weights dropped "
                             f"(kept {k / n:.3f}; nothing may be dropped)"))
    elif pvalue < ALPHA:
        what = "no weight was dropped to 0 (dropout_p ignored, or applied to the scores, where a dropped " \
               "score of 0 still takes weight)" if k == n else \
            f"the kept share {k / n:.4f} is not 1 - p = {1 - p:g}"
        found.append(Finding(("out", "dq", "dk", "dv"), "dropout-keep-rate",
                             f"{what}: {k} of {n} weights kept, two-sided binomial test at {1 - p:g}: "
                             f"p-value {pvalue:.1e} < {ALPHA:g}"))
    differ = int((((W_b != 0) & seen) != kept_f).sum()) if hkv == h else 0
    if differ:
        how, where = f"{differ} of {n} weights kept in one and dropped in the other (the backward's mask read " \
            "from dv with dO = the identity)", ("dq", "dk", "dv")
    else:                                  # dv read the forward's mask: dP's, seen through dq, then through dk
        lost, gained, dq_unmasked = _softmax_backward_mask(caller, case, rounded, opts, kept_f, "dq")
        dk_unmasked = _softmax_backward_mask(caller, case, rounded, opts, kept_f, "dk")[2]   # a sample: no counts
        unmasked = "no weight dropped in the {} (its mask left out, the 1/(1 - p) kept or not) (read from {} = " \
            "the identity)"
        how, where = "", ("dq", "dk")
        if dq_unmasked and not dk_unmasked:                  # the other pass masked: this pass's alone
            how = unmasked.format("backward's dP", "dq with k")
        elif lost:
            how = f"{lost} of the {k} weights the forward kept are dropped in the backward's dP (read from dq with " \
                "k = the identity)"
        elif gained:
            how = "weights the forward dropped are kept in the backward's dP (read from dq with k = the identity)"
        elif dk_unmasked and not dq_unmasked:
            how, where = unmasked.format("dK/dV pass's dP", "dk with q"), ("dk",)
    if how:
        found.append(Finding(where, "dropout-backward-mask", f"the backward drops other weights than the forward: "
                             f"{how}", alike=True))
    return learnt, found


def _softmax_backward_mask(caller, case, rounded, opts, kept_f, grad="dq"):
    """How many weights the mask inside the softmax's backward (dP = (dO Vᵀ) ∘ M) keeps or drops
    otherwise than the forward's ``kept_f``, seen through ``grad``.  With every v_j and dO_i the
    first unit vector, dO Vᵀ = 1 and dP = M.  Through dq: with k = columns of the identity (D
    keys at a time), dq_i = scale dS_i over those keys.  Through dk (a dK/dV pass computing its
    own dP): with q = columns of the identity over the first D query rows, on the first query
    head of each kv group (the others' q 0, so that only its rows reach dk), dk_j = scale dS_j
    over those rows: one call, enough to tell a dP with no mask at all.  dS_ij / P_ij = M_ij −
    R_i (R_i the row term, whatever the kernel takes for it), P from the probe's own inputs.  So
    within a row, the keys the forward kept share one value of dS / P, and those it dropped
    another: a key off its class's value by more than half a step of M (M is 0 or at least 1)
    was masked otherwise in the backward.  Rows with one key are left out (their dS is 0: their
    mask cannot be seen).  Returns (how many keys the forward kept sit off their class's value:
    dropped in the backward, exactly when most of them are kept there; whether any key the
    forward dropped sits off its class's value; whether the two classes share one value, in the
    median row that holds both: no mask in dP at all)."""
    from numpy_ref import reference_attention
    b, h, hkv, tq, tk, d, dv = case.batch, case.heads, case.hkv, case.tq, case.tk, case.head_dim, case.dv
    unit_v, unit_o = np.zeros((b, hkv, tk, dv)), np.zeros((b, h, tq, dv))
    unit_v[..., 0], unit_o[..., 0] = 1.0, 1.0
    eye = np.broadcast_to(np.eye(tk), (b, hkv, tk, tk))
    lost, gained, gaps = 0, False, []
    for s in range(-(-tk // d)) if grad == "dq" else (0,):                        # dk: its first rows alone
        if grad == "dq":
            inputs = {**rounded, "k": _identity_columns(tk, s * d, d, (b, hkv)), "v": unit_v, "dout": unit_o}
        else:
            q = np.zeros((b, h, tq, d))
            q[:, ::h // hkv] = _identity_columns(tq, 0, d, (b, hkv))              # each group's first head
            inputs = {**rounded, "q": q, "v": unit_v, "dout": unit_o}
        got = _probe(caller, inputs)
        if not isinstance(got, dict) or not isinstance(got.get(grad), np.ndarray):
            return 0, False, False              # nothing to read: the gradients are judged as they are
        P = reference_attention(inputs["q"], inputs["k"], eye, **opts)["out"]          # (b, h, tq, tk)
        if grad == "dq":
            a0, a1 = s * d, min(tk, (s + 1) * d)
            P, kept, x_of = P[..., a0:a1], kept_f[..., a0:a1], got["dq"][..., : a1 - a0] / case.scale
        else:                                   # rows 0 .. D - 1 of each group's first head; dk (b, hkv, tk, d)
            rows = min(tq, d)
            P, kept = P[:, ::h // hkv, :rows], kept_f[:, ::h // hkv, :rows]
            x_of = got["dk"][..., :rows].swapaxes(-1, -2) / case.scale             # (b, hkv, rows, tk)
        seen = P > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            x = np.where(seen, x_of / np.where(seen, P, 1.0), np.nan)
        rows = seen.sum(-1) >= 2
        mids = []
        for is_kept, cls in ((True, kept), (False, ~kept)):
            xc = np.where(cls & seen, x, np.nan)
            has = rows & ((cls & seen).sum(-1) >= 1)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mid = np.nanmedian(np.where(has[..., None], xc, 0.0), axis=-1)
            mids.append(np.where(has, mid, np.nan))
            off = int(((np.abs(xc - mid[..., None]) > 0.5) & has[..., None]).sum())
            if is_kept:
                lost += off
            else:
                gained = gained or off > 0
        both = np.isfinite(mids[0]) & np.isfinite(mids[1])         # rows with kept and dropped keys
        if both.any():
            gaps.append(np.abs(mids[0] - mids[1])[both])
    # no mask at all: kept and dropped keys alike in every row (M is 1/(1 − p) on the kept, 0 on the dropped)
    unmasked = bool(gaps) and float(np.median(np.concatenate(gaps))) < 0.5
    return lost, gained, unmasked


# ----------------------------------------------------------------------------
# The catalogue's dropout mistakes

def mistakes(ctx, p):
    keep = ctx.opts.get("keep")
    if keep is None or p == 0:
        return []
    hidden = np.where(keep, 0.0, -np.inf)
    bias = hidden if ctx.opts.get("bias") is None else np.asarray(ctx.opts["bias"]) + hidden
    return [ctx.H("dropout-no-rescale", f"the survivors not rescaled by 1/(1 - p) (P ∘ keep, p = {p:g})",
                  ctx.fwd({"dropout_p": 0.0})),
            ctx.H("dropout-rescaled-twice", f"the survivors rescaled by 1/(1 - p) twice (p = {p:g})",
                  ctx.fwd({"dropout_p": 1.0 - (1.0 - p) ** 2})),
            ctx.H("dropout-rescaled-by-1/p", f"the survivors rescaled by 1/p instead of 1/(1 - p) (the keep and "
                  f"drop probabilities swapped, p = {p:g})", ctx.fwd({"dropout_p": 1.0 - p})),
            ctx.H("dropout-times-keep", f"the survivors multiplied by 1 - p instead of divided by it (p = {p:g})",
                  ctx.fwd({"dropout_p": -p / (1.0 - p)})),
            ctx.H("dropout-before-softmax", "the scores dropped before the softmax (dropped keys masked out, "
                  "the survivors renormalised, as DropKey) instead of the weights after it",
                  ctx.fwd({"keep": None, "dropout_p": 0.0, "bias": bias}))]


FEATURE = Feature("dropout", "dropout_p=float, dropout on the weights after the softmax, the mask drawn from "
                  "torch's global RNG (seeded by the check) and recovered from the kernel; p = 0, 0.1, 0.5",
                  cases=cases, label=lambda p: f"dropout {p:g}",
                  options=(Option("dropout_p", float, to=("kernel",)),), inputs=(Input("keep", to=("reference",)),),
                  mistakes=mistakes,
                  excludes=dict.fromkeys(("paged", "varlen"), "its mask read back from (B, H, Tq, Tk) weights"),
                  calling=Calling(reference=reference, hand=hand, recover=recover, random=True))
