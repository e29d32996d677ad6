"""Calling a target on one case: the tensors it is handed, what it must give back, time limits.

`Caller` hands a target its case in its layout (`Strided`: ``bhtd`` or ``bthd``, q, k, v as
views of a fused or padded buffer where the case says so; or the layout a feature declares,
varlen's packed ``thd``), with ``causal``, ``scale``, ``align`` when it takes it and
the keywords of the case's features; backpropagates dO (and dlse); and returns float64
arrays in the reference's shapes, or why it cannot be judged.  A target that raises
(anything, even ``sys.exit``) FAILS the case with what it raised, and so does an output or
a gradient of the wrong shape, dtype or device, a gradient that never reaches a leaf, and
an input it wrote into.  "Not supported" is only a declared refusal
(``targets.Unsupported``); a built-in backend that refuses only its backward is checked on
its forward.  Each call has a time limit (`time_limit`).
"""

import contextlib
import math
import signal
import threading
import time

import numpy as np
import torch

import parity_tests.kernels.targets as targets
from parity_tests.common import capabilities
from parity_tests.kernels import variations
from parity_tests.kernels.features import (REGISTRY, declared, differentiated_inputs, handed_inputs,
                                          layout as features_layout, per_head, stored_inputs)

__all__ = ["Caller", "Strided", "stored", "DTYPES", "RAISED", "DEFAULT_TIMEOUT", "CaseTimeout", "time_limit"]

DTYPES = {"float64": torch.float64, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Fail(Exception):
    """The target's answer is wrong in kind (shape, dtype, device, type): FAIL with the reason."""


# What a target may throw at the check: any exception, and sys.exit (SystemExit).
# Only targets.Unsupported is a refusal; everything else FAILS the case.
RAISED = (Exception, SystemExit)


def _reason(e):
    """One line naming what a target raised (``sys.exit`` included); a refusal's own words."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, (targets.Unsupported, _Fail)):
        return text[:200]
    return f"raised {type(e).__name__}: {text}".rstrip(": ")[:200]


def _wrong(t, what, shape, dtype, device):
    """Why tensor ``t`` (the output, or a gradient) is not what the case expects, or None."""
    name = lambda x: str(x).replace("torch.", "")
    problems = [f"wrong {kind}: {what} {name(got)}, expected {name(want)}" for kind, got, want in (
        ("shape", tuple(t.shape), tuple(shape)), ("dtype", t.dtype, dtype),
        ("device", t.device.type, torch.device(device).type)) if got != want]
    return "; ".join(problems) or None


def _unchanged(handed, kept):
    """_Fail naming the first input the kernel wrote into (NaN equal to NaN)."""
    for n, x in handed.items():
        a, b = x.detach(), kept[n]
        if a.is_floating_point() and a.element_size() == 1:       # float8: bitwise (PyTorch 2.1 has no
            a, b = a.view(torch.uint8), b.view(torch.uint8)         # equal or == for it on the CPU)
        if not torch.equal(a, b) and not bool(((a == b) | (a.isnan() & b.isnan())).all()):
            raise _Fail(f"the kernel wrote into {n}: its values changed during the call (work on a copy)")


def stored(x, scale, dtype):
    """``x / scale`` in ``dtype`` (a float8 name), a torch tensor: FP8's stored values,
    clipped to the dtype's largest finite value (float8_e4m3fn has no infinity)."""
    dt = getattr(torch, dtype)
    top = float(torch.finfo(dt).max)
    return torch.from_numpy(np.clip(np.asarray(x) / scale, -top, top)).to(dt)


class Strided:
    """The target's strided layout, ``bhtd`` or ``bthd``: what q, k, v, out, lse and their
    gradients look like on the target's side.  A layout a feature declares instead
    (``Calling.layout``: varlen's packed one) has the same methods.

    q, k, v are handed contiguous, or as the views the case's variation declares
    (``variations.views``: of one fused qkv buffer, rows padded past D)."""

    def __init__(self, name):
        self.name = name

    def handed(self, case, t, grad):
        """(given, read): the q, k, v handed (leaves of autograd), and for each a function
        giving its gradient as (B, H, T, D) (None when none arrived)."""
        views = variations.views(case)
        if views is not None:
            return views(t, self.name, grad)
        given = {n: targets.to_layout(x, self.name).clone(memory_format=torch.contiguous_format).requires_grad_(grad)
                 for n, x in t.items()}                       # a copy: the kernel never holds the check's arrays
        read = {n: lambda leaf=leaf: None if leaf.grad is None else targets.from_layout(leaf.grad, self.name)
                for n, leaf in given.items()}
        return given, read

    def keywords(self, case, device):
        """What the callable receives besides q, k, v to read this layout."""
        return {}

    def output(self, out, case):
        """out (detached), as the target returned it -> (B, H, Tq, Dv)."""
        return targets.from_layout(out, self.name)

    def upstream(self, dout, case):
        """dO (B, H, Tq, Dv) -> the target's layout."""
        return targets.to_layout(dout, self.name)

    def lse_shape(self, case):
        return (case.batch, case.heads, case.tq)

    def lse_output(self, lse, case):
        return lse

    def lse_upstream(self, dlse, case):
        return dlse


LAYOUTS = {name: Strided(name) for name in ("bhtd", "bthd")}


class Caller:
    """Calls the target on one case, in its layout, and returns float64 arrays in the
    reference's shapes: ``{tensor: array | ("FAIL", why) | "not supported: why"}``."""

    def __init__(self, target, case, dtype, device, align, wanted, rounded, timeout):
        self.target, self.case, self.dtype, self.dtype_name, self.device = target, case, DTYPES[dtype], dtype, device
        self.align, self.wanted, self.rounded, self.timeout = align, wanted, rounded, timeout
        layout = features_layout(wanted) or target.layout
        self.layout = LAYOUTS[layout] if isinstance(layout, str) else layout
        self.lse = declared(wanted, "returns_lse")
        self.fn = target.lse_fn if self.lse and target.lse_fn is not None else target.fn
        self.grads = not case.forward_only
        self.handed = handed_inputs(case)                     # a bias, sinks, slopes, descales
        self.stored = stored_inputs(case)                     # q, k, v in another dtype (FP8's)
        self.extras = differentiated_inputs(case, rounded)
        self.seconds, self.forward_seconds, self.rng_moved = None, None, False
        self.unread = math.nan            # what memory no one should read holds (`features.HOOKS`)

    def grad_names(self):
        return ["dq", "dk", "dv"] + ["d" + n for n in self.extras]

    def __call__(self):
        """The target's arrays within the time limit; a str (not supported) or ("FAIL", why)."""
        try:
            with time_limit(self.timeout):
                return self._refusals()
        except CaseTimeout:
            return ("FAIL", f"timed out after {self.timeout:g} s")

    def _refusals(self):
        try:
            return self._call(self.grads)
        except targets.Unsupported as e:
            if not self.grads:
                return _reason(e)
            try:                                # a backend with a forward only (FlexAttention on CPU)
                got = self._call(False)
            except targets.Unsupported:
                return _reason(e)
            except _Fail as e2:
                return ("FAIL", _reason(e2))
            except RAISED as e2:
                return ("FAIL", _reason(e2))
            return {**got, **{n: f"forward only: {_reason(e)}" for n in self.grad_names()}}
        except _Fail as e:
            return ("FAIL", _reason(e))
        except RAISED as e:                         # a callable that raises FAILS
            return ("FAIL", _reason(e))

    @contextlib.contextmanager
    def given(self, rounded):
        """The caller's calls on other inputs of the case's shapes, then on its own again."""
        first, self.rounded = self.rounded, rounded
        try:
            yield self
        finally:
            self.rounded = first

    def called_on(self, rounded, grads=False):
        """The target's tensors (``{out, ...}``, float64 in the reference's shapes) on other inputs
        of the case's shapes (a forward call, and with ``grads`` a backward one on their dout,
        within the time limit); or why not, a str."""
        try:
            with self.given(rounded), time_limit(self.timeout):
                return self._call(grads)
        except CaseTimeout:
            return f"timed out after {self.timeout:g} s"
        except (_Fail, targets.Unsupported) + RAISED as e:
            return _reason(e)

    def forward_on(self, rounded):
        """The target's out on other inputs of the case's shapes (`called_on`), or why not, a str."""
        got = self.called_on(rounded)
        return got if isinstance(got, str) else got["out"]

    def fresh(self, rounded, first_out):
        """Why a forward call on other inputs of the same shape is wrong, or None: a kernel
        returning the previous call's output (a cache keyed by shape) is caught here."""
        again = self.forward_on(rounded)
        if isinstance(again, str):
            return f"a second call on new inputs: {again}"
        self.forward_seconds = self.seconds
        # a constant output (zeros where every key is masked, NaN rows) repeats without any cache
        live = np.isfinite(first_out) & (first_out != 0)
        constant = not live.any() or np.ptp(first_out[live]) == 0
        return None if constant or not np.array_equal(again[live], first_out[live]) else \
            "returned the previous call's output for new inputs of the same shape (a result cached by shape?)"

    def _call(self, grad):
        c, r = self.case, self.rounded
        t = {n: self._tensor(n, r) for n in ("q", "k", "v")}
        given, read = self.layout.handed(c, t, grad and not self.stored)
        tensors, leaves = {}, {}
        for n, spec in self.handed.items():
            if n in r:
                dt = self.dtype if spec.dtype == "case" else getattr(torch, spec.dtype)
                tensors[n] = torch.from_numpy(np.ascontiguousarray(r[n])).to(device=self.device, dtype=dt)
                if n in self.extras:
                    leaves["d" + n] = tensors[n].requires_grad_(grad)
        kw = {"causal": c.causal, "scale": c.scale}
        offered = dict(case=c, inputs=r, device=self.device, dtype=self.dtype_name, align=self.align,
                       unread=self.unread)
        for name, value in c.features:
            if name in REGISTRY:
                kw.update(REGISTRY[name].calling.arguments(value=value, tensors=tensors, **offered))
        if self.target.takes_align:
            kw["align"] = self.align
        kw.update(self.layout.keywords(c, self.device))
        args = {n: given[n] for n in ("q", "k", "v")}
        for name, value in c.features:            # a feature may hand the callable another form
            hand = REGISTRY[name].calling.hand if name in REGISTRY else None
            if hand is not None:
                args, kw = hand(value=value, args=args, kw=kw, **offered)
        handed = {**args, **tensors, **{n: x for n, x in kw.items() if isinstance(x, torch.Tensor)}}
        kept = {n: x.detach().clone() for n, x in handed.items()}
        rng = torch.get_rng_state()
        start = time.perf_counter()
        with torch.set_grad_enabled(grad), self._pytorch_refusals():
            result = self.fn(*args.values(), **kw)
        out, lse = self._split(result, given["q"])
        got = {"out": self.layout.output(out.detach(), c).to("cpu", torch.float64).numpy()}
        if lse is not None:
            got["lse"] = self._lse(lse)
        if grad and out.requires_grad:
            try:
                with self._pytorch_refusals():
                    self._backward(out, lse)
            except targets.Unsupported as e:
                return {**got, **{n: f"backward refused: {_reason(e)}" for n in self.grad_names()}}
            except RAISED as e:
                return {**got, **{n: ("FAIL", f"backward {_reason(e)}") for n in self.grad_names()}}
        self.seconds = time.perf_counter() - start
        _unchanged(handed, kept)
        self.rng_moved = not torch.equal(rng, torch.get_rng_state())
        if not grad:
            return got
        if not out.requires_grad:
            cut = "the output does not require grad (detached, or computed without autograd)"
            return {**got, **{n: ("FAIL", f"no gradient reached {n[1:]}: {cut}") for n in self.grad_names()}}
        for n in ("q", "k", "v"):
            got["d" + n] = self._grad("d" + n, read[n](), given[n])
        for n, leaf in leaves.items():
            got[n] = self._grad(n, leaf.grad, leaf)
        return got

    @contextlib.contextmanager
    def _pytorch_refusals(self):
        """A built-in target's call: PyTorch's own refusal of the case (``NYI``, "not
        supported", ...) is `targets.Unsupported` in PyTorch's words.  A user's kernel that
        raises FAILS, whatever it says."""
        try:
            yield
        except RAISED as e:
            said = self.target.builtin and capabilities.refusal(e)
            if said:
                raise targets.Unsupported(said) from None
            raise

    def _tensor(self, n, r):
        """q, k or v on the device: in the tested dtype, or as the case's features store it
        (`features.Input.dtype`: FP8's ``r[n] / scale`` in float8, exact)."""
        spec = self.stored.get(n)
        if spec is None:
            return torch.from_numpy(r[n]).to(device=self.device, dtype=self.dtype)
        return stored(r[n], per_head(r[spec.scale], r[n].shape[1]), spec.dtype).to(self.device)

    def _backward(self, out, lse):
        g = torch.from_numpy(self.rounded["dout"]).to(device=self.device, dtype=out.dtype)
        outs, ups = [out], [self.layout.upstream(g, self.case)]
        if "dlse" in self.rounded:
            if not lse.requires_grad:
                raise _Fail("lse does not require grad: the gradient through lse cannot reach q and k")
            dl = torch.from_numpy(self.rounded["dlse"]).to(device=self.device, dtype=lse.dtype)
            outs.append(lse)
            ups.append(self.layout.lse_upstream(dl, self.case))
        torch.autograd.backward(outs, ups)

    def _grad(self, n, g, given):
        """A gradient as float64 (B, H, T, D) (bias and sinks in their own shapes), or why not."""
        extra = n[1:] in self.extras                  # a bias, sinks: judged in their own shapes
        if g is None:
            return ("FAIL", f"no gradient reached {n[1:]}" + (" (None or detached)" if extra else ""))
        want = given.shape if extra else g.shape
        wrong = _wrong(g, n, want, given.dtype, self.device)
        if wrong:
            return ("FAIL", wrong)
        return g.detach().to("cpu", torch.float64).numpy()

    def _split(self, result, q):
        if self.lse:
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise _Fail(f"with lse the target must return (out, lse), got {type(result).__name__}")
            out, lse = result
        else:
            out, lse = result, None
        if not isinstance(out, torch.Tensor):
            raise _Fail(f"returned {type(out).__name__}, expected a tensor")
        wrong = _wrong(out, "output", tuple(q.shape[:-1]) + (self.case.dv,), self.dtype, self.device)
        if wrong:
            raise _Fail(wrong)
        if lse is not None:
            shape = self.layout.lse_shape(self.case)
            if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != shape:
                got = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
                raise _Fail(f"wrong lse: {got}, expected shape {shape}")
            if lse.dtype not in (self.dtype, torch.float32):
                raise _Fail(f"wrong lse dtype: {lse.dtype}, expected {self.dtype} or torch.float32")
        return out, lse

    def _lse(self, lse):
        return self.layout.lse_output(lse.detach(), self.case).to("cpu", torch.float64).numpy()


# ----------------------------------------------------------------------------
# Time limits

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
