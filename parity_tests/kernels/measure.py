"""One case of one target in one dtype: four rows (out, dq, dk, dv).

1. Draw q, k, v, dO (``cases.draw_inputs``), round them to the dtype once.
2. Golden (float64, blockwise NumPy) and baseline (plain PyTorch, the dtype, the
   device) from the same rounded numbers (``reference``).
3. Call the target on leaf tensors in its layout, backpropagate dO (a random
   upstream gradient, never out.sum(): softmax rows sum to 1, so that gradient
   is ~0 and checks almost nothing).  A target that raises (anything, even
   ``sys.exit``) FAILS the case with what it raised, and so does an output or a
   gradient of the wrong shape, dtype or device.  "Not supported" is only a
   declared refusal, ``targets.Unsupported`` (or the target's ``refuses``); a
   built-in backend that refuses only its backward (FlexAttention on CPU) is
   checked on out, its gradients "not supported (forward only)".
4. Each tensor: error and baseline error against the golden result, the bound
   ``tolerances.check_bound``, the verdict, where the largest error sits.
5. Failing tensors go to ``diagnosis``.

Each call of the target has a time limit (``timeout``, `DEFAULT_TIMEOUT` seconds
per case): a kernel that hangs FAILS the case "timed out after N s" (see
`time_limit` for what a limit cannot interrupt).
"""

import contextlib
import signal
import threading
import time

import numpy as np
import torch

from parity_tests.common import tolerances as tol
import parity_tests.kernels.cases as cases_mod
import parity_tests.kernels.diagnosis as diagnosis
import parity_tests.kernels.reference as reference
import parity_tests.kernels.targets as targets
from parity_tests.kernels.report import Row

__all__ = ["run_case", "DTYPES", "errors_of", "DEFAULT_TIMEOUT", "time_limit", "case_memory"]

DTYPES = {"float64": torch.float64, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16}
TENSORS = ("out", "dq", "dk", "dv")


def case_memory(case, dtype, device):
    """``{part: (bytes on the host, bytes on the device)}`` that one case holds at once.

    Counted in sets of the four (B, H, T, D) tensors q, k, v, dO (or out, dq, dk, dv):
    inputs -- drawn and rounded in float64, copied to the device for the target and
    for the baseline, plus the target's gradient dO; golden -- its results and the
    blockwise backward's own accumulators, float64; baseline -- its results, their
    float64 copies, and one chunk of its (rows, Tk) arrays (S, P, dP, dS and their
    temporaries: 7 at once, measured, in the dtype; ``reference`` keeps a chunk near
    2^25 elements per (batch, head)); target -- its output and gradients, and their float64 copies.
    Not counted: the target's own workspace (a kernel that forms the (Tq, Tk) scores
    adds B H Tq Tk elements per array it keeps) and a failing case's diagnosis
    (bounded by ``diagnosis.DENSE_LIMIT``).
    """
    size = torch.empty((), dtype=DTYPES[dtype]).element_size()
    bh, d = case.batch * case.heads, case.head_dim
    one_set = bh * (2 * case.tq + 2 * case.tk) * d           # elements of q, k, v, dO
    rows = min(case.tq, max(64, reference._CHUNK_ELEMENTS // max(case.tk, 1)))
    chunk = 7 * bh * rows * case.tk * size
    host = {"inputs": 2 * one_set * 8, "golden": 2 * one_set * 8, "baseline": one_set * 8, "target": one_set * 8}
    dev = {"inputs": 2 * one_set * size, "golden": 0, "baseline": one_set * size + chunk, "target": one_set * size}
    if torch.device(device).type == "cpu":
        return {part: (host[part] + dev[part], 0) for part in host}
    return {part: (host[part], dev[part]) for part in host}


def denominators(golden):
    """Normwise denominators: out by its own size; gradients by theirs, floored at
    SCALE_FLOOR x the largest gradient (dq = dk = 0 exactly with one key)."""
    grads = max(float(np.abs(golden[n]).max(initial=0.0)) for n in TENSORS[1:])
    den = {"out": max(float(np.abs(golden["out"]).max(initial=0.0)), 1e-300)}
    for n in TENSORS[1:]:
        den[n] = max(float(np.abs(golden[n]).max(initial=0.0)), tol.SCALE_FLOOR * grads, 1e-300)
    return den


def errors_of(a, ref, denom):
    """(error, (batch, head, row)) of ``a`` against ``ref``; inf at the first non-finite entry."""
    a = np.asarray(a, dtype=np.float64)
    bad = ~np.isfinite(a)
    if bad.any():
        b, h, i, _ = np.unravel_index(np.argmax(bad), a.shape)
        return float("inf"), (int(b), int(h), int(i))
    diff = np.abs(a - ref)
    if diff.size == 0:
        return 0.0, None
    flat = int(np.argmax(diff))
    b, h, i, _ = np.unravel_index(flat, diff.shape)
    return float(diff.flat[flat] / denom), (int(b), int(h), int(i))


def _leaves(arrays, dtype, device, layout, grad):
    return [targets.to_layout(torch.from_numpy(a).to(device=device, dtype=dtype), layout)
            .requires_grad_(grad) for a in arrays]


def _numpy(t, layout):
    return targets.from_layout(t.detach(), layout).to("cpu", torch.float64).numpy()


def _reason(e):
    """One line naming what a target raised (``sys.exit`` included); a refusal's own words."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (text if isinstance(e, targets.Unsupported) else f"raised {type(e).__name__}: {text}".rstrip(": "))[:200]


# What a target may throw at the check: any exception, and sys.exit (SystemExit).
# Only targets.Unsupported is a refusal; everything else FAILS the case.
RAISED = (Exception, SystemExit)


def _wrong(t, what, shape, dtype, device):
    """Why tensor ``t`` (the output, or a gradient) is not what the case expects, or None."""
    name = lambda x: str(x).replace("torch.", "")
    problems = [f"wrong {kind}: {what} {name(got)}, expected {name(want)}" for kind, got, want in (
        ("shape", tuple(t.shape), tuple(shape)), ("dtype", t.dtype, dtype),
        ("device", t.device.type, torch.device(device).type)) if got != want]
    return "; ".join(problems) or None


def _call(target, case, q, k, v, dout, dtype, device, align):
    """The results: tensor -> float64 array; a str (the reason) for what the target
    declares it does not run ("not supported"); ``("FAIL", why)`` for what went wrong."""
    layout = target.layout
    opts = dict(causal=case.causal, scale=case.scale, align=align)
    leaves = _leaves((q, k, v), dtype, device, layout, True)
    expected = targets.to_layout(torch.empty(q.shape[:-1] + (v.shape[-1],), device="meta"), layout).shape
    try:
        out = targets.call(target, *leaves, **opts)
    except targets.Unsupported as e:                  # a declared refusal: perhaps of the backward only
        refusal = _reason(e)
        try:
            with torch.no_grad():
                out = targets.call(target, *_leaves((q, k, v), dtype, device, layout, False), **opts)
        except targets.Unsupported:
            return {n: refusal for n in TENSORS}
        except RAISED as e:
            return {n: ("FAIL", _reason(e)) for n in TENSORS}
        wrong = _wrong(out, "output", expected, dtype, device)
        if wrong:
            return {n: ("FAIL", wrong) for n in TENSORS}
        return {"out": _numpy(out, layout), **{n: f"forward only: {refusal}" for n in TENSORS[1:]}}
    except RAISED as e:
        return {n: ("FAIL", _reason(e)) for n in TENSORS}
    wrong = _wrong(out, "output", expected, dtype, device)
    if wrong:                                         # gradients of a wrong output are not judged
        return {n: ("FAIL", wrong) for n in TENSORS}
    got = {"out": _numpy(out, layout)}
    if not out.requires_grad:
        cut = "the output does not require grad (detached, or computed without autograd)"
        return {**got, **{n: ("FAIL", f"no gradient reached {n[1]}: {cut}") for n in TENSORS[1:]}}
    try:
        out.backward(targets.to_layout(torch.from_numpy(dout).to(device=device, dtype=out.dtype), layout))
    except targets.Unsupported as e:
        return {**got, **{n: f"backward refused: {_reason(e)}" for n in TENSORS[1:]}}
    except RAISED as e:
        return {**got, **{n: ("FAIL", f"backward {_reason(e)}") for n in TENSORS[1:]}}
    for n, leaf in zip(TENSORS[1:], leaves):
        wrong = leaf.grad is not None and _wrong(leaf.grad, n, leaf.shape, dtype, device)
        got[n] = (("FAIL", f"no gradient reached {n[1]}") if leaf.grad is None else
                  ("FAIL", wrong) if wrong else _numpy(leaf.grad, layout))
    return got


# Seconds a target may take on one case (its forward and backward, and the second call
# of a diagnosis), before the case FAILS "timed out".  Generous: the slowest built-in
# target takes well under a second per case of the default grid on a 2-core CPU.
DEFAULT_TIMEOUT = 300.0


class CaseTimeout(BaseException):
    """Raised by the alarm; a BaseException so that a kernel's ``except Exception`` lets it by."""


@contextlib.contextmanager
def time_limit(seconds):
    """Raise `CaseTimeout` in the block once ``seconds`` have passed (None or 0: no limit).

    SIGALRM (``signal.setitimer``): it interrupts Python code between two bytecodes,
    so a pure-Python loop, ``time.sleep`` or a wait in Python stops on time.  What it
    cannot interrupt: one long call into C that does not return to the interpreter (a
    single huge matmul, a CUDA synchronisation, a C extension stuck in a loop) -- the
    case fails when that call returns, not before -- and anything on Windows or outside
    the main thread, where there is no SIGALRM to use and the block runs unlimited.
    An alarm already set (pytest-timeout's, say) is restored afterwards, less the time spent.
    """
    if not seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise CaseTimeout(seconds)
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, stop)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


def _limited_call(timeout, *args):
    """`_call` within ``timeout`` seconds: past it, every tensor FAILS "timed out"."""
    try:
        with time_limit(timeout):
            return _call(*args)
    except CaseTimeout:
        return {n: ("FAIL", f"timed out after {timeout:g} s") for n in TENSORS}


def run_case(target, case, dtype, device, align="top-left", seed=0, reference_functions=None,
             timeout=DEFAULT_TIMEOUT):
    """The four rows of ``target`` on ``case`` in ``dtype`` on ``device``; each call of the
    target limited to ``timeout`` seconds (`time_limit`)."""
    tdtype = DTYPES[dtype]
    offset = case.offset(align)
    raw = cases_mod.draw_inputs(case, seed)
    rounded = [torch.from_numpy(a).to(tdtype).to(torch.float64).numpy() for a in raw]
    q, k, v, dout = rounded
    row = lambda tensor, **kw: Row(target=target.name, case=str(case), dims=case.as_dict(), dtype=dtype,
                                   device=device, tensor=tensor, align=align, **kw)
    refused = target.refuses(case, dtype, device, align)
    if refused:
        return [row(n, verdict="not supported", note=refused) for n in TENSORS]
    got = _limited_call(timeout, target, case, q, k, v, dout, tdtype, device, align)
    if all(isinstance(got[n], str) for n in TENSORS):
        return [row(n, verdict="not supported", note=got[n]) for n in TENSORS]

    gold = dict(zip(TENSORS, reference.golden(q, k, v, dout, case, offset, reference_functions)))
    dev = [torch.from_numpy(a).to(device=device, dtype=tdtype) for a in rounded]
    base = dict(zip(TENSORS, reference.baseline(*dev, case, offset)))
    den = denominators(gold)
    rows, failing, bounds = {}, [], {}
    for n in TENSORS:
        if isinstance(got[n], str):
            rows[n] = row(n, verdict="not supported", note=got[n])
            continue
        base_err, _ = errors_of(base[n], gold[n], den[n])
        bounds[n] = tol.check_bound(dtype, base_err)
        if isinstance(got[n], tuple):                 # ("FAIL", why)
            rows[n] = row(n, error=float("inf"), baseline=base_err, bound=bounds[n], verdict="FAIL",
                          note=got[n][1])
            continue
        err, where = errors_of(got[n], gold[n], den[n])
        ok = err <= bounds[n]
        rows[n] = row(n, error=err, baseline=base_err, bound=bounds[n], verdict="pass" if ok else "FAIL",
                      where=where)
        if not ok:
            failing.append(n)
    if failing:
        arrays = {n: got[n] for n in TENSORS if isinstance(got[n], np.ndarray)}

        def rerun():
            again = _limited_call(timeout, target, case, q, k, v, dout, tdtype, device, align)
            return {n: a for n, a in again.items() if isinstance(a, np.ndarray)}

        found = diagnosis.diagnose(failing, arrays, gold, den, bounds, case, offset, align,
                                   (q, k, v), dout, rerun)
        for n, d in found.items():
            rows[n].diagnosis = d
        _lower_precision(rows, failing, dtype, rounded, case, offset, gold, den, device)
    return [rows[n] for n in TENSORS]


# A kernel computing in a lower precision than it is checked in: its error sits within
# this factor of a plain computation's in that precision (measured: bfloat16 inside a
# float32 check gives 0.4 .. 1.3 x the bfloat16 baseline's error; float16's is ~8x smaller).
LOWER_SHARE = 3.0
LOWER = {"float64": ("float32", "bfloat16", "float16"), "float32": ("bfloat16", "float16")}


def _lower_precision(rows, failing, dtype, rounded, case, offset, gold, den, device):
    """Rows that no mistake explains whose error is the size of a lower precision's say so."""
    named_out = rows["out"].diagnosis is not None and rows["out"].diagnosis.id != "none"
    if named_out or dtype not in LOWER:                   # a gradient of a named output keeps that name
        return
    unnamed = [n for n in failing if rows[n].diagnosis is not None and rows[n].diagnosis.id == "none"]
    if not unnamed:
        return
    for low in LOWER[dtype]:
        dev = [torch.from_numpy(a).to(device=device, dtype=DTYPES[low]) for a in rounded]
        base = dict(zip(TENSORS, reference.baseline(*dev, case, offset)))
        for n in list(unnamed):
            low_err, _ = errors_of(base[n], gold[n], den[n])
            if low_err and 1 / LOWER_SHARE <= rows[n].error / low_err <= LOWER_SHARE:
                d = rows[n].diagnosis
                first = d.sentence[:d.sentence.index(f"{n} matches none")]   # "the output is right; ..."
                d.id, d.residual = "lower-precision", rows[n].error
                d.sentence = (f"{first}{n}'s error {rows[n].error:.1e} is the size of {low}'s (a plain {low} "
                              f"computation: {low_err:.1e}): the kernel appears to compute in {low} inside this "
                              f"{dtype} check")
                unnamed.remove(n)
