"""One case of one target in one dtype: the one case runner every case goes through.

A plain case is a case with no features; a featured case differs only in what
its features add (``features/<name>.py``).  For each case:

1. Draw q, k, v, dO (and dlse with ``lse_grad``) and the features' inputs
   (`draw`: a generator fixed by the case's fields), round them to the dtype once.
2. Call the target (``call.Caller``: its layout, the case's strides and keywords, dO and
   dlse backpropagated, every failure of the target a FAIL with its reason, "not
   supported" only what a target declares); then a second call on fresh inputs of the
   same shape (a result cached by shape FAILS, named).
3. Golden: ``numpy_ref.reference_attention`` in float64 on the rounded inputs
   (the contract's reference, the only one); baseline: the same computed plainly
   in PyTorch in the tested dtype on the same device (``dense.run``).
4. Each tensor (out, lse, dq, dk, dv, dbias, dsinks, whichever the case has):
   its max error *and* its mean error against the golden result (FlexAttention's
   criterion), each held to ``tolerances.check_bound`` of the baseline's, the
   cosine with the reference, where the largest error sits.  lse is judged on the
   rows that see a key (kernels store −inf, +inf or 0 on the others, never NaN);
   another form a feature declares (``Judging.lse_form``: ALiBi's in FlashAttention) is
   accepted as well.  The baseline's own error is judged too: past what a plain computation
   in the dtype makes (``tolerances.judge_limit``) it is the check's defect, on the row
   (``Row.judge_defect``), and the run does not pass.  A gradient a feature sums over every
   row (dsinks) is bounded at least by that sum's rounding (`reduction_floors`); FP8's
   quantisation is reported beside the verdict (`_beside`).
5. Beside the verdict: SDPA's forward on the same case (out's error, the time), where
   SDPA expresses the case.
6. ``deterministic``: the case runs twice, every tensor must be bitwise equal.
7. Failing tensors go to ``diagnosis`` (a diagnosis that raises leaves the FAIL standing and
   says "could not diagnose" on the row: `DIAGNOSIS_RAISES`).
8. Each row carries where the case's wall time went (``split``: the target's calls, the
   baseline, the golden, the diagnosis, the rest).

Each call of the target has a time limit (``call.time_limit``).
"""

import contextlib
import math
import os
import time
from typing import NamedTuple

import numpy as np
import torch

from parity_tests.common import capabilities, heap
from parity_tests.common import tolerances as tol
from parity_tests.kernels.diagnosis import diagnose
from parity_tests.kernels.diagnosis.diagnose import as_4d
import parity_tests.kernels.targets as targets
from parity_tests.kernels import dense, variations
from parity_tests.kernels.call import Caller, DTYPES, DEFAULT_TIMEOUT, stored, time_limit      # noqa: F401
from parity_tests.kernels.cases import case_rng
from parity_tests.kernels.features import (REGISTRY, declared, declared_inputs, differentiated_inputs, per_head,
                                          stored_inputs)
from parity_tests.kernels.row import Row

# DTYPES, DEFAULT_TIMEOUT and time_limit are call's, named here for the command's options
__all__ = ["run_case", "DTYPES", "DEFAULT_TIMEOUT", "time_limit", "case_memory", "draw", "as_4d",
           "tensor_errors", "golden", "baseline", "judging_basis", "Basis", "Split", "SPLIT_PARTS"]

GRADS = diagnose.GRADS


# ----------------------------------------------------------------------------
# Inputs, golden, baseline

def draw(case, seed=0, wanted=(), fresh=False):
    """float64 NumPy: ``q``, ``k``, ``v``, ``dout`` (B, H, T, D), ``dlse`` with ``lse_grad``,
    and the features' inputs (``bias``, ``sinks``, ``alibi_slopes``); padding rows zero.
    ``fresh``: another draw of the same case (a second call must not return the first's output)."""
    rng = case_rng(seed, case, "fresh") if fresh else case_rng(seed, case)
    b, h, hkv = case.batch, case.heads, case.hkv
    inputs = {"q": rng.standard_normal((b, h, case.tq, case.head_dim)),
              "k": rng.standard_normal((b, hkv, case.tk, case.head_dim)),
              "v": rng.standard_normal((b, hkv, case.tk, case.dv)),
              "dout": rng.standard_normal((b, h, case.tq, case.dv))}
    if declared(wanted, "lse_gradient") and not case.forward_only:
        inputs["dlse"] = rng.standard_normal((b, h, case.tq))
    variations.draw(case, rng, inputs)
    for name, value in case.features:
        if name in REGISTRY and REGISTRY[name].draw is not None:
            inputs.update(REGISTRY[name].draw(case=case, value=value, inputs=inputs, rng=rng, seed=seed))
    return inputs


def reference_options(case, align, inputs):
    """``numpy_ref.reference_attention``'s options for the case (the dense formula's too)."""
    opts = dict(scale=case.scale, causal=case.causal, align=case.align or align)
    for name, value in case.features:
        if name in REGISTRY:
            opts.update(REGISTRY[name].calling.reference(case=case, value=value, inputs=inputs, align=align))
    return opts


def golden(inputs, opts, grads=True):
    """The float64 reference: ``{tensor: array}`` in the reference's own shapes."""
    from numpy_ref import reference_attention
    dout = inputs["dout"] if grads else None
    extra = {"dlse": inputs["dlse"]} if grads and "dlse" in inputs else {}
    got = reference_attention(inputs["q"], inputs["k"], inputs["v"], dout, **extra, **opts)
    return {n: np.asarray(a, dtype=np.float64) for n, a in got.items()}


def baseline(inputs, opts, dtype, device, grads=True, weights="softmax"):
    """The same computed plainly in PyTorch in ``dtype`` on ``device`` (``dense.run``), its
    weights formed as ``weights`` says (``tolerances.BASELINE_FORMULATIONS``)."""
    return dense.run(inputs["q"], inputs["k"], inputs["v"], inputs["dout"] if grads else None, opts,
                     DTYPES[dtype], device, grads=grads, dlse=inputs.get("dlse") if grads else None,
                     weights=weights)


def case_memory(case, dtype, device):
    """``{part: (bytes on the host, bytes on the device)}`` that one case holds at once.

    Counted in sets of the four (B, H, T, D) tensors q, k, v, dO (or out, dq, dk, dv):
    inputs -- drawn and rounded in float64, copied to the device for the target and
    for the baseline, plus the target's gradient dO; golden -- its results and the
    blockwise backward's own accumulators, float64; baseline -- its results, their
    float64 copies, and one chunk of its (rows, Tk) arrays (S, P, dP, dS and autograd's
    saved tensors: 9 at once, in the dtype; ``dense.run`` keeps a chunk near
    ``chunk_rows`` per (batch, head)); target -- its output and gradients, and their
    float64 copies.  Not counted: the target's own workspace (a kernel that forms the
    (Tq, Tk) scores adds B H Tq Tk elements per array it keeps) and a failing case's
    diagnosis (bounded by ``diagnose.DENSE_LIMIT``, or a block of rows: ``row_block``).
    """
    size = torch.empty((), dtype=DTYPES[dtype]).element_size()
    bh, d = case.batch * case.heads, max(case.head_dim, case.dv)
    one_set = bh * (2 * case.tq + 2 * case.tk) * d           # elements of q, k, v, dO
    rows = min(case.tq, dense.chunk_rows(case.tk))
    chunk = 9 * bh * rows * case.tk * size
    host = {"inputs": 2 * one_set * 8, "golden": 2 * one_set * 8, "baseline": one_set * 8, "target": one_set * 8}
    dev = {"inputs": 2 * one_set * size, "golden": 0, "baseline": one_set * size + chunk, "target": one_set * size}
    if torch.device(device).type == "cpu":
        return {part: (host[part] + dev[part], 0) for part in host}
    return {part: (host[part], dev[part]) for part in host}


# ----------------------------------------------------------------------------
# Errors

def tensor_errors(a, ref, denom):
    """(max error, where, mean error, cosine) of ``a`` against ``ref`` (normwise, over
    ``denom``); inf at the first non-finite entry; where = (batch, head, row)."""
    bad = ~np.isfinite(a)
    if bad.any():
        return math.inf, tuple(int(i) for i in np.unravel_index(np.argmax(bad), a.shape)[:3]), math.inf, math.nan
    if a.size == 0:
        return 0.0, None, 0.0, 1.0
    diff = np.abs(a - ref)
    flat = int(np.argmax(diff))
    where = tuple(int(i) for i in np.unravel_index(flat, a.shape)[:3])
    # norms as sums of squares: np.linalg.norm calls the BLAS's threaded dot, whose threads
    # wait for a CPU on a busy machine (measured: 2.6 ms a call at load 3.5)
    na, nr = math.sqrt(float(np.square(a).sum())), math.sqrt(float(np.square(ref).sum()))
    cosine = float((a * ref).sum() / (na * nr)) if na > 0 and nr > 0 else (1.0 if na == nr else 0.0)
    return float(diff.flat[flat] / denom), where, float(diff.mean() / denom), cosine


def _largest_gradient(gold):
    return max([float(np.abs(gold[n]).max(initial=0.0)) for n in ("dq", "dk", "dv") if n in gold] or [0.0])


def zero_by_theory(gold):
    """The gradients measured against SCALE_FLOOR x the largest gradient (their own is ~0:
    dq = dk = 0 exactly with one key)."""
    grads = _largest_gradient(gold)
    return {n for n in GRADS if n in gold and float(np.abs(gold[n]).max(initial=0.0)) < tol.SCALE_FLOOR * grads}


def denominators(gold):
    """Normwise denominators: each tensor by its own size; gradients floored at SCALE_FLOOR x
    the largest gradient; lse at 1 (it is a log)."""
    grads = _largest_gradient(gold)
    den = {}
    for n, a in gold.items():
        own = float(np.abs(a).max(initial=0.0))
        den[n] = max(1.0, own) if n == "lse" else \
            max(own, tol.SCALE_FLOOR * grads, 1e-300) if n in GRADS else max(own, 1e-300)
    return den


# ----------------------------------------------------------------------------
# The case runner

class Split:
    """Where one case's wall time goes: ``with split("golden"): ...`` adds that block's
    seconds to its part; `done` gives each part, ``other`` (the rest: drawing, judging,
    SDPA's yardstick) and ``wall``, the case's whole time."""

    def __init__(self):
        self.seconds, self.start = dict.fromkeys(SPLIT_PARTS, 0.0), time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, part):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - start

    def done(self):
        wall = time.perf_counter() - self.start
        return {**self.seconds, "other": max(0.0, wall - sum(self.seconds.values())), "wall": wall}


# The parts of a case's time that `Split` measures (its calls of the target: the first, a
# second on fresh inputs, the determinism repeat; the diagnosis's own call is the diagnosis's).
SPLIT_PARTS = ("target", "baseline", "golden", "diagnosis")


# A case with fewer (query, key) pairs than this runs on one PyTorch thread on the CPU.
# Its tensors are small enough that each op's parallel region costs more than it
# saves, and on a busy machine much more: a woken thread waits for a CPU.  Measured on
# 2 cores, sdpa-flash's default grid beside two busy processes: 51 .. 56 s with every
# case on PyTorch's 2 threads, 24 s with this (idle: 4.9 s and 4.0 s, the cosine's norms included).
ONE_THREAD_BELOW = 2 ** 22


@contextlib.contextmanager
def one_thread_if_small(case, device):
    """PyTorch on one thread (then as it was) while a small CPU case runs: the target,
    the baseline and the diagnosis alike, so that time/SDPA stays like for like."""
    before = torch.get_num_threads()
    small = device == "cpu" and case.batch * case.heads * case.tq * case.tk < ONE_THREAD_BELOW
    if not small or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_case(target, case, dtype, device, align="top-left", seed=0, wanted=(), timeout=DEFAULT_TIMEOUT):
    """The rows of ``target`` on ``case`` in ``dtype`` on ``device`` (``wanted``: the run's
    features), each call of the target limited to ``timeout`` seconds (`time_limit`); each
    row's ``split``: the case's seconds in the target, baseline, golden, diagnosis (`Split`)."""
    split = Split()
    rows = _run_case(split, target, case, dtype, device, align, seed, wanted, timeout)
    seconds = split.done()
    for r in rows:
        r.split, r.case_def = seconds, case
    return rows


def prepared(case, dtype, seed=0, wanted=()):
    """(case, rounded inputs) as the runner calls the target on them: the case in the form the
    run-wide features give every case (varlen, paged: ``Calling.widen``), its inputs drawn
    and rounded to ``dtype``."""
    for name in wanted:
        if REGISTRY[name].calling.widen is not None:
            case = REGISTRY[name].calling.widen(case)
    return case, round_inputs(draw(case, seed, wanted), dtype, case)


def _run_case(split, target, case, dtype, device, align, seed, wanted, timeout):
    case, rounded = prepared(case, dtype, seed, wanted)
    case_align = case.align or align
    names = ["out"] + (["lse"] if declared(wanted, "returns_lse") else [])
    if not case.forward_only:
        names += ["dq", "dk", "dv"] + ["d" + n for n in differentiated_inputs(case, rounded)]
    row = lambda tensor, **kw: Row(target=target.name, case=str(case), dims=case.as_dict(), dtype=dtype,
                                   device=device, tensor=tensor, align=case_align, **kw)
    refused = capabilities.dtype_lacks(dtype, device) or target.refuses(case, dtype, device, case_align)
    if refused:
        return [row(n, verdict="not supported", note=refused) for n in names]
    caller = Caller(target, case, dtype, device, case_align, wanted, rounded, timeout)
    with split("target"):
        got = caller()
    if isinstance(got, str):
        return [row(n, verdict="not supported", note=got) for n in names]
    if isinstance(got, tuple):
        return [row(n, error=math.inf, verdict="FAIL", note=got[1], diagnosis=_named_failure(got[1]))
                for n in names]
    with split("target"):
        second = caller() if declared(wanted, "repeats") else None     # before any other call
    other = round_inputs(draw(case, seed, wanted, fresh=True), dtype, case)
    with split("target"):
        stale = caller.fresh(other, got["out"])
    if stale and stale.startswith("returned") and _same_answer(case, case_align, rounded, other):
        stale = None                          # both inputs have one answer (a single key, say)
    if stale:
        return [row(n, error=math.inf, verdict="FAIL", note=stale, diagnosis=_named_failure(stale)) for n in names]

    opts = reference_options(case, case_align, rounded)
    findings = []                             # what a feature learns from the target itself (dropout's mask)
    for name, value in case.features:
        calling = REGISTRY[name].calling if name in REGISTRY else None
        if calling and calling.recover is not None:
            with split("target"):
                learnt, found = calling.recover(case=case, value=value, inputs=rounded, opts=opts, caller=caller,
                                                seed=seed, device=device, dtype=dtype, align=case_align)
            rounded = {**rounded, **learnt}
            opts.update(calling.reference(case=case, value=value, inputs=rounded, align=case_align))
            findings += found
    if case.tk > dense.LONG_FROM:
        heap.trim()                           # the target's freed arrays back to the OS (``heap``)
    full, gold_raw, gold, _, bases, logits, unjudged, den, zero, floors = judging_basis(
        case, case_align, rounded, opts, names, dtype, device, split)
    rows, failing, bounds, arrays = {}, [], {}, {}
    for n in names:
        rows[n], bounds[n], a = _judge(n, got.get(n, ("FAIL", f"the target gave no {n}")), gold, bases, den,
                                       n in zero, dtype, logits, unjudged, case, case_align, gold_raw, rounded, row,
                                       floors.get(n, 0.0))
        if a is not None:
            arrays[n] = a
        if rows[n].failed:
            failing.append(n)
    for f in findings:                        # named by what the feature found: not the catalogue's
        if refuted(f, rows, failing):
            continue
        for n in f.tensors:
            if n in rows:
                rows[n].verdict = "FAIL"
                rows[n].diagnosis = diagnose.Diagnosis(f.id, f"{n}: {f.sentence}")
                if n in failing:
                    failing.remove(n)
    yardstick = _yardstick(case, dtype, device, case_align, rounded, timeout, gold, den)
    if declared(dict(case.features), "inputs_error"):
        with split("golden"):
            _beside(rows, golden(draw(case, seed, wanted), opts, grads=False), gold, den, unjudged)
    for n, r in rows.items():
        r.seconds = caller.forward_seconds
        if yardstick:
            r.sdpa_seconds, r.sdpa_error = yardstick[0], yardstick[1].get(n)
        if caller.rng_moved and not _random(case):        # a random feature draws from it, seeded
            r.note = (r.note + "; " if r.note else "") + "changed torch's global RNG state"
    if second is not None:
        for n in names:
            if n in arrays and not _bitwise(second, n, got):
                moved = tensor_errors(as_4d({n: second[n]})[n], as_4d({n: got[n]})[n], den[n])[0] \
                    if isinstance(second, dict) and isinstance(second.get(n), np.ndarray) else math.inf
                r = rows[n]
                r.verdict = "FAIL"
                r.note = (r.note + "; " if r.note else "") + f"not deterministic: a second call differs by {moved:.1e}"
                if n not in failing:
                    failing.append(n)
    if failing:
        evidence = diagnose.Evidence(case, case_align, dtype, device, wanted, rounded, opts, gold, gold_raw,
                                      den, bounds, arrays, got, second, caller, logits,
                                      lambda low: baseline(rounded, opts, low, device, not case.forward_only),
                                      keyless=~np.isfinite(as_4d({"lse": full["lse"]})["lse"][..., 0]))
        with split("diagnosis"):
            _diagnose(failing, rows, evidence)
    return [rows[n] for n in names]


def refuted(finding, rows, failing):
    """Whether a feature's finding whose mistake moves each of its tensors alike (``alike``) is
    refuted by one of them right on its own (not in ``failing``): the tensors are then judged and
    diagnosed as any others."""
    return getattr(finding, "alike", False) and any(n in rows and n not in failing for n in finding.tensors)


# A diagnosis that raises is the check's own defect, never the kernel's: the rows keep their
# FAIL and say "could not diagnose: ...".  With this variable set to 1 it raises instead (the
# test suite sets it, so that no test passes over such a defect).
DIAGNOSIS_RAISES = "PARITY_DIAGNOSIS_RAISES"


def _diagnose(failing, rows, evidence):
    """``diagnose.diagnose``, its failure written on each failing row (`DIAGNOSIS_RAISES`)."""
    try:
        diagnose.diagnose(failing, rows, evidence)
    except Exception as e:
        if os.environ.get(DIAGNOSIS_RAISES) == "1":
            raise
        for n in failing:
            rows[n].diagnosis = diagnose.Diagnosis("not-diagnosed", f"could not diagnose: {type(e).__name__}: {e}")


def _random(case):
    """Whether a feature of ``case`` has its kernel draw from torch's RNG (``Feature.random``)."""
    return declared(dict(case.features), "random")


class Basis(NamedTuple):
    """What every tensor of a case is judged against (`judging_basis`)."""
    full: dict         # the golden, every tensor the reference gives (lse included)
    gold_raw: dict     # the judged tensors of it, in the reference's shapes
    gold: dict         # the same, 4-D (``as_4d``), lse 0 on the rows that see no key
    raw_bases: list    # the baseline in each formulation, its own shapes
    bases: list        # the same, judged form
    logits: float      # the largest finite |lse|: how large the scores run
    unjudged: object   # the rows that see no key (lse's), or None
    den: dict
    zero: set
    floors: dict


def judging_basis(case, align, rounded, opts, names, dtype, device, split=None):
    """The golden, the baseline in its formulations (`formulations`), the denominators and
    the floors that tensors ``names`` of ``case`` are judged against: once per case, whoever
    is judged on it (the runner's target, or every kernel of an audit).  ``split``: a `Split`
    timing the golden and the baseline."""
    timed = split or (lambda part: contextlib.nullcontext())
    grads = not case.forward_only
    with timed("golden"):
        full = golden(rounded, opts, grads)
    finite_lse = full["lse"][np.isfinite(full["lse"])]
    logits = float(np.abs(finite_lse).max(initial=0.0))
    gold_raw = {n: a for n, a in full.items() if n in names}
    gold = as_4d(gold_raw)
    with timed("baseline"):
        raw_bases = [baseline(rounded, opts, dtype, device, grads, w) for w in formulations(case, logits)]
    bases = [as_4d({n: a for n, a in b.items() if n in names}) for b in raw_bases]
    unjudged = None
    if "lse" in names:                    # rows that see no key: not judged (NaN there still FAILS)
        unjudged = ~np.isfinite(gold["lse"])
        for base in bases:
            base["lse"] = np.where(unjudged, 0.0, base["lse"])
        gold["lse"] = np.where(unjudged, 0.0, gold["lse"])
    den = denominators(gold)
    return Basis(full, gold_raw, gold, raw_bases, bases, logits, unjudged, den, zero_by_theory(gold),
                 reduction_floors(case, rounded, full, den, dtype, align, opts))


def reduction_floors(case, rounded, full, den, dtype, align, opts):
    """{tensor: the least bound} of the gradients formed from sums whose terms cancel: those a
    feature sums over rows into a few numbers (`features.Judging.reduced`: dsinks, one per head),
    and dq, dk on a case whose rows each see one key, with a gradient through lse (`one_key_terms`):
    ``tolerances.reduction_floor`` of the sum of its terms' sizes, over the tensor's own size."""
    masses = [one_key_terms(rounded, full, opts)] if "dlse" in rounded else []
    for name, value in case.features:
        reduced = REGISTRY[name].judging.reduced if name in REGISTRY else None
        if reduced is not None:
            masses.append(reduced(case=case, value=value, inputs=rounded, golden=full, align=align))
    return {n: tol.reduction_floor(dtype, float(np.max(mass)) / den[n]) for m in masses for n, mass in m.items()
            if n in den}


# The one-key rows' terms (`one_key_terms`) are looked for on cases of at most this many (query, key) pairs.
ONE_KEY_PAIRS = 2 ** 22


def one_key_terms(inputs, golden, opts):
    """{dq, dk: the sizes of the terms of their cancelling sums} on a case where every row that sees
    a key sees exactly one (a window (0, 0)), with an upstream gradient on lse; {} elsewhere.  There
    dS_i = P_i (dP_i − D_i + dlse_i) = dlse_i exactly, as P_i = 1 and O_i = v_j: the softmax's own
    backward forms it exactly (Σ_j P_ij dP_ij is dP_ij itself), so the baseline's error is no
    yardstick; FlashAttention-2 forms D = rowsum(dO ∘ O) and dP = dO · v_j as two sums of d terms
    rounded apart, and dS carries their difference, up to u Σ_c |dO_ic| (|v_jc| + |O_ic|) per unit
    of rounding: times scale |k_j| in dq_i, and scale |q_i| summed over key j's rows in dk_j.
    {} past ONE_KEY_PAIRS too."""
    q, k, v, dout = (np.asarray(inputs[n], dtype=np.float64) for n in ("q", "k", "v", "dout"))
    b, hq, tq, _ = q.shape
    tk, group = k.shape[2], hq // k.shape[1]
    if b * hq * tq * tk > ONE_KEY_PAIRS or not tq * tk or np.shape(golden["out"]) != dout.shape:
        return {}
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)
    with torch.no_grad():
        S = dense.attention(t(q), t(k), t(v), scores_only=True, **dense.keywords(opts)).numpy()
    counts = np.isfinite(S).sum(-1)                                         # (a sink's column counted too)
    if (counts > 1).any() or not counts.any():
        return {}
    one = np.isfinite(S[..., :tk]).astype(np.float64)                       # (B, Hq, Tq, Tk): the key each row sees
    m = (np.abs(dout) * (one @ np.abs(np.repeat(v, group, 1)) + np.abs(golden["out"]))).sum(-1, keepdims=True)
    dk = opts["scale"] * np.swapaxes(one, -1, -2) @ (m * np.abs(q))                       # (B, Hq, Tk, D)
    return {"dq": opts["scale"] * m * (one @ np.abs(np.repeat(k, group, 1))),
            "dk": dk.reshape(b, -1, group, tk, dk.shape[-1]).sum(2)}


def _judge(n, value, gold, bases, den, zero, dtype, logits, unjudged, case, align, gold_raw, rounded, row,
           floor=0.0):
    """(row, bound, the target's judged array or None) of tensor ``n``: max and mean error
    against the golden result, each held to `tolerances.check_bound` of the baseline's (the
    larger over the baseline's formulations ``bases``).  lse is judged on the rows that see a
    key (NaN there still FAILS); a feature's other lse form (``Judging.lse_form``) is accepted too and
    ``gold[n]`` becomes the form the kernel returns."""
    errors = [tensor_errors(base[n], gold[n], den[n]) for base in bases]
    base_err, base_mean = max(e[0] for e in errors), max(e[2] for e in errors)
    bound = max(tol.check_bound(dtype, base_err, logits), floor)
    if zero:
        bound = max(bound, tol.CHECK_ZERO_FLOOR[dtype])
    limit = tol.judge_limit(dtype, logits)
    defect = None if base_err <= limit or zero else (
        f"the check's own baseline is {base_err:.1e} from the golden, past what a plain {dtype} computation makes "
        f"({limit:.1e}): a defect of the check (its dense formula), not of the kernel")
    if isinstance(value, str):
        return row(n, verdict="not supported", note=value), bound, None
    if isinstance(value, tuple):                      # ("FAIL", why)
        return row(n, error=math.inf, baseline=base_err, bound=bound, verdict="FAIL", note=value[1],
                   judge_defect=defect), bound, None
    a, ref, note = as_4d({n: value})[n], gold[n], ""
    if n == "lse":
        a = np.where(unjudged & ~np.isnan(a), 0.0, a)
        for name, value in case.features:                 # another lse form a feature's kernels return
            lse_form = REGISTRY[name].judging.lse_form if name in REGISTRY else None
            if lse_form is not None:
                form, said, else_said = lse_form(case=case, value=value, inputs=rounded, align=align,
                                                 lse=gold_raw["lse"])
                form = np.where(unjudged, 0.0, as_4d({"lse": form})["lse"])
                if tensor_errors(a, form, den[n])[0] < tensor_errors(a, ref, den[n])[0]:
                    ref, note = form, said
                else:
                    note = else_said
        gold[n] = ref
    err, where, mean, cosine = tensor_errors(a, ref, den[n])
    mean_bound = max(tol.check_bound(dtype, base_mean, logits), bound if zero else 0.0, floor)
    ok = err <= bound and mean <= mean_bound
    if err <= bound and not ok:
        note = (note + "; " if note else "") + f"mean error {mean:.1e} above its bound {mean_bound:.1e}"
    return row(n, error=err, baseline=base_err, bound=bound, verdict="pass" if ok else "FAIL", where=where,
               note=note, mean_error=mean, cosine=cosine, judge_defect=defect), bound, a


def _yardstick(case, dtype, device, align, rounded, timeout, gold, den):
    """(seconds, {"out": error}) of PyTorch's SDPA's forward on the same case, or None where
    SDPA cannot express the case: what each row's time and out's error are set beside (never
    a verdict)."""
    from parity_tests.kernels.targets.builtin import SDPA_FEATURES
    features = {n for n, _ in case.features if n in REGISTRY}
    if not features <= SDPA_FEATURES or _random(case):      # SDPA's own draw: not the kernel's
        return None
    sdpa = Caller(targets.sdpa_yardstick(), case, dtype, device, align, (), rounded, timeout)
    sdpa.grads = False                        # its forward: out's error, and its time
    got = sdpa()
    if not isinstance(got, dict):
        return None
    best = math.inf
    for _ in range(YARDSTICK_CALLS):          # its forward once warm (the call above warmed it)
        sdpa._call(False)
        best = min(best, sdpa.seconds)
    return best, {n: tensor_errors(as_4d({n: a})[n], gold[n], den[n])[0]
                  for n, a in got.items() if isinstance(a, np.ndarray) and n in gold}


# Time is the forward's: the target's second call (on new inputs of the same shape, so
# past its warm-up) against the best of this many of SDPA's, each after a first full call
# (more cost more than they steady: one is 0.7 s of the default grid's 5 s).
YARDSTICK_CALLS = 1


def _same_answer(case, align, first, other):
    """Whether the reference gives one output for both draws (then a repeat is no mistake)."""
    outs = [golden(x, reference_options(case, align, x), grads=False)["out"] for x in (first, other)]
    return np.allclose(*outs, rtol=0, atol=1e-12 * max(1.0, np.abs(outs[0]).max(initial=0.0)))


def round_inputs(raw, dtype, case):
    """The drawn inputs rounded to the tested dtype, as float64: those declared otherwise
    (`features.Input.dtype`) to theirs, sinks and slopes to float32, FP8's q, k, v to
    float8 after dividing by their scale (``stored``), then multiplied back."""
    declared = {**declared_inputs(dict(case.features)), **stored_inputs(case)}
    low = lambda n: DTYPES[dtype] if n not in declared or declared[n].dtype == "case" else \
        getattr(torch, declared[n].dtype)
    out = {n: torch.from_numpy(np.asarray(a)).to(low(n)).to(torch.float64).numpy() for n, a in raw.items()
           if n not in declared or declared[n].scale is None}
    for n, spec in declared.items():
        if spec.scale is not None and n in raw:
            s = per_head(out[spec.scale], raw[n].shape[1])
            out[n] = stored(raw[n], s, spec.dtype).to(torch.float64).numpy() * s
    return out


def _beside(rows, unrounded, gold, den, unjudged):
    """Each forward row's ``inputs_error``, in its note too: the golden on the drawn inputs
    (``unrounded``) against the golden on the rounded ones, what the inputs' own rounding
    costs (FP8's quantisation), never part of the verdict."""
    for n in ("out", "lse"):
        if n in rows and n in unrounded:
            a = as_4d({n: unrounded[n]})[n]
            if n == "lse":
                a = np.where(unjudged | ~np.isfinite(a), 0.0, a) if unjudged is not None else a
            r = rows[n]
            r.inputs_error = tensor_errors(a, gold[n], den[n])[0]
            r.note = (r.note + "; " if r.note else "") + f"quantisation alone {r.inputs_error:.1e}"


def formulations(case, logits):
    """How the baseline forms its weights on ``case`` (``tolerances.baseline_formulations``),
    and the formulations its features add (`features.Judging.baselines`: FP8's e4m3 P)."""
    return tol.baseline_formulations(logits) + tuple(
        w for n, _ in case.features if n in REGISTRY for w in REGISTRY[n].judging.baselines)


# What a kernel must not do, named from the reason its case failed.
MUST_NOT = (("the kernel wrote into", "wrote-into-input"), ("returned the previous call's output", "previous-output"),
            ("wrong dtype: output", "output-dtype"))


def _named_failure(reason):
    for words, hid in MUST_NOT:
        if words in reason:
            return diagnose.Diagnosis(hid, reason)
    return None


def _bitwise(second, n, got):
    return isinstance(second, dict) and isinstance(second.get(n), np.ndarray) and \
        np.array_equal(second[n], got[n], equal_nan=True)
