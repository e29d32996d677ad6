"""``check TARGET --repro DIR`` and ``Report.repro(dir)``: each failure, shrunk and handed on.

For each distinct cause among a report's failing rows (the row's diagnosis id), the
smallest case that still fails with that cause is found and written as a script a user
drops into their own suite: ``DIR/<cause>/repro.py`` and ``DIR/<cause>/inputs.npz``.
A tensor of zeros everywhere that a mistake named elsewhere in the run would give there (a
window one key narrower, on a 0-wide window) is that mistake's, not a cause of its own.

Shrinking starts from the cheapest failing case of the cause and re-runs shrunk copies of
it through the one case runner (``runner.run_case``: new inputs drawn for each shape, the
same seed).  A copy is kept when the same tensor still FAILS, above its bound, with the same
diagnosis id.  In turn, each time taking the smallest candidate that keeps the failure:

1. Tq and Tk together, then each alone: halvings and one past each power of two (a tile
   plus one key: 17, 33, 65, ..., where a tile's bug first shows) from the smallest, then the
   steps between the last one that lost the failure and the first that kept it (a
   bisection).  The failure need not shrink monotonically (a length between may fail with
   another cause), so the line then says what one less of each length gave ("Tk 64
   passes");
2. the batch, then the heads (with GQA, kv heads and group size both);
3. the head dim among 16, 32, 64, ... below the case's own;
4. each feature of the case left out, one by one (GQA, a window, strides, a scale ...);

then all of it again while a round shrinks something (a feature left out may let the
heads or the lengths go), `PASSES` rounds at most.

A shape the kernel refuses (``targets.Unsupported``, a "not supported" row) is passed over
for the next size.  Each cause has `BUDGET` seconds; past it the smallest case so far is
written and the line says so.  An error that grows with the sequence length (the
run-wide ``grows-with-length``) keeps its lengths: a shorter case passes.
"""

import importlib
import json
import os
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field, replace

import numpy as np

import parity_tests.kernels.runner as runner
from parity_tests.kernels.cases import halvings
from parity_tests.kernels.features import CORE, REGISTRY, declared, handed_inputs
from parity_tests.kernels.variations import STRIDE_PAD
from parity_tests.kernels.targets import SDPA_BACKENDS

__all__ = ["Repro", "write_repros", "shrink", "cause_of", "importable_name", "BUDGET", "SCRIPT"]

# Seconds of shrinking per cause (on a 2-core CPU a small case runs in 20 .. 60 ms).
BUDGET = 20.0
# head dims tried, smallest first, below the case's own
HEAD_DIMS = (16, 32, 64, 128)
# rounds of the steps below (the last one finds nothing more to take away)
PASSES = 3
# steps of the bisection between a halving that lost the failure and one that kept it
STEPS = 6
# causes found over a whole run (``report.find_growth``, ``find_strides``): one case alone
# shows them as a failure no catalogued mistake explains
RUN_WIDE = {"grows-with-length": ("none",), "ignores-strides": ("none", "wrong-direction")}
# what a failure without a diagnosis is filed under, by its note
NOTES = (("raised", "raises"), ("timed out", "timed-out"), ("no gradient", "no-gradient"),
         ("wrong", "wrong-output"), ("sys.exit", "raises"))
# causes that one call judged against the reference does not show (the case line still names them)
ONE_CALL_CANNOT_SHOW = {"not-deterministic": "this one needs two calls compared bitwise",
                        "previous-output": "this one needs a second call on other inputs",
                        "wrote-into-input": "this one needs the inputs compared before and after the call"}


def cause_of(row):
    """The cause a failing row is filed under: its diagnosis id, else a name from its note."""
    if row.diagnosis is not None:
        return row.diagnosis.id
    for words, name in NOTES:
        if words in (row.note or ""):
            return name
    return "fails"


@dataclass
class Repro:
    """One cause handed on: the tensor followed, the case it was found in and the case
    written, the runs and seconds the shrinking took, and where the script is (None when no
    script could be written, ``note`` says why)."""
    cause: str
    tensor: str
    dtype: str
    original: object
    case: object
    row: object
    runs: int
    seconds: float
    path: str = None
    note: str = ""
    rows: list = field(default_factory=list)       # every tensor's row on the shrunk case

    def line(self):
        said = _short(self.row)
        where = f"-> {self.path}" if self.path else f"(no script: {self.note})"
        extra = f"; {self.note}" if self.note and self.path else ""
        return (f"{_cause_dir(self.cause)}: shrunk to {self.case} {self.dtype}, still {self.tensor}: {said} {where} "
                f"(from {self.original}, {self.runs} runs, {self.seconds:.1f} s{extra})")


def _short(row):
    """What a diagnosis says, without its numbers and location."""
    d = row.diagnosis
    text = d.sentence if d is not None else (row.note or "fails")
    text = text.split("; where:")[0]
    text = re.sub(r" to [0-9.e+-]+ \(bound [^)]*\)", "", text)
    return re.sub(rf"{row.tensor} matches the reference with ", "", text)


# ----------------------------------------------------------------------------
# Shrinking

class _Trial:
    """Runs shrunk copies of one case and says whether the failure is still there."""

    def __init__(self, target, tensor, cause, dtype, device, align, seed, wanted, timeout, budget):
        self.target, self.tensor, self.cause, self.dtype, self.device = target, tensor, cause, dtype, device
        self.align, self.seed, self.wanted, self.timeout = align, seed, wanted, timeout
        self.start, self.budget, self.runs, self.seen = time.perf_counter(), budget, 0, {}
        self.lost = {}                 # case -> what it gave instead of the cause followed

    @property
    def out_of_time(self):
        return time.perf_counter() - self.start > self.budget

    def __call__(self, case, rows=None):
        """The row of the followed tensor when ``case`` still fails with the cause, else None
        (``rows``: the case's rows already at hand, not run again)."""
        if case is None:
            return None
        if case in self.seen:
            return self.seen[case]
        left = self.budget - (time.perf_counter() - self.start)
        if rows is None and left <= 0:
            return None
        if rows is None:
            rows = self._run(case, left)
        row = next((r for r in rows if r.tensor == self.tensor), None)
        kept = row is not None and row.failed and self._same_cause(row) and (row.ratio is None or row.ratio > 1)
        self.seen[case] = (row, rows) if kept else None
        if not kept:
            self.lost[case] = ("not supported" if row is not None and (row.note or "").startswith("not supported")
                               else "passes" if row is not None and not row.failed
                               else f"fails as {_cause_dir(cause_of(row))}" if row is not None else "does not run")
        return self.seen[case]

    def _run(self, case, left):
        """The case's rows, the target's calls limited to the budget left (a call past it FAILS
        "timed out": not the cause followed)."""
        self.runs += 1
        limit = min(self.timeout or left, left)
        try:
            with runner.one_thread_if_small(case, self.device):
                return runner.run_case(self.target, case, self.dtype, self.device, self.align, self.seed,
                                        self.wanted, limit)
        except ValueError:                      # a shape the features cannot draw
            return []

    def _same_cause(self, row):
        found = cause_of(row)
        return found == self.cause or found in RUN_WIDE.get(self.cause, ())


def _resized(case, values=(), **sizes):
    """``case`` with new sizes (batch, heads, tq, tk, head_dim), the features' new ``values``,
    and each feature's value made to fit them (``Shrinking.fit``: a bias's shape, varlen's and
    paged's lengths, GQA's kv heads); None when one cannot fit."""
    new, values = replace(case, **sizes), dict(values)
    for name, value in case.features:
        if name in REGISTRY:
            fitted = REGISTRY[name].shrinking.fit(new, values.get(name, value))
            if fitted is None:
                return None
            new = new.with_feature(name, fitted)
    return new


def _smallest(trial, best, candidates):
    """The first of ``candidates`` (smallest first) that keeps the failure, else ``best``;
    and the candidate tried just before it (the largest that did not)."""
    before = None
    for c in candidates:
        if c is None:
            continue
        if trial(c):
            return c, before
        before = c
    return best, before


def _bisect(trial, best, lost, size):
    """Between ``lost`` (a smaller case that did not fail) and ``best`` along ``size``: the
    smallest size that still fails, STEPS tries at most."""
    if lost is None:
        return best
    lo, hi = getattr(lost, size), getattr(best, size)
    for _ in range(STEPS):
        if hi - lo <= 1 or trial.out_of_time:
            break
        mid = (lo + hi) // 2
        c = _resized(best, **{size: mid})
        if c is not None and trial(c):
            best, hi = c, mid
        else:
            lo = mid
    return best


def _sizes(n):
    """The lengths tried below ``n``, smallest first: its halvings and one past each power of two."""
    return sorted(set(halvings(n)) | {2 ** p + 1 for p in range(1, n.bit_length()) if 2 ** p + 1 < n})


def _lengths(trial, case):
    """Tq and Tk together, then each alone: `_sizes` smallest first, then the steps between."""
    k = max(case.tq, case.tk).bit_length()
    joint = [_resized(case, tq=max(1, case.tq >> s), tk=max(1, case.tk >> s)) for s in range(k, 0, -1)]
    case, lost = _smallest(trial, case, joint)
    for size in ("tq", "tk"):
        case, lost = _smallest(trial, case, [_resized(case, **{size: n}) for n in _sizes(getattr(case, size))])
        case = _bisect(trial, case, lost, size)
    return case


def _one_less(trial, case):
    """What one less of each length gives (run when not tried yet): why the case is the smallest."""
    said = []
    for size, word in (("tq", "Tq"), ("tk", "Tk")):
        n = getattr(case, size)
        smaller = _resized(case, **{size: n - 1}) if n > 1 else None
        if smaller is None or trial.out_of_time:
            continue
        if trial(smaller) is None and smaller in trial.lost:
            said.append(f"{word} {n - 1} {trial.lost[smaller]}")
    return ", ".join(said)


def _heads(trial, case):
    """Fewer heads, smallest first, as the case's features allow (``Shrinking.head_counts``)."""
    counts = [(h, {}) for h in halvings(case.heads)]
    for name, value in case.features:
        if name in REGISTRY and REGISTRY[name].shrinking.head_counts is not None:
            counts = [(h, {name: v}) for h, v in REGISTRY[name].shrinking.head_counts(case, value)]
    return _smallest(trial, case, [_resized(case, values, heads=h) for h, values in counts])[0]


def _features(trial, case):
    for name, _ in case.features:
        if name in REGISTRY and REGISTRY[name].calling.widen is not None:   # the layout itself (varlen, paged)
            continue
        without = replace(case, features=tuple(f for f in case.features if f[0] != name))
        if trial(without):
            case = without
    return case


def shrink(target, case, tensor, cause, dtype, device, align="top-left", seed=0, wanted=(),
           timeout=runner.DEFAULT_TIMEOUT, budget=BUDGET, rows=None):
    """``(case, row, rows, runs, seconds, note)``: the smallest case found in ``budget``
    seconds on which ``tensor`` still FAILS with ``cause``; ``row`` its row, ``rows`` all
    of its rows; ``note`` says when the lengths were kept or the budget ran out.  ``rows``:
    the starting case's rows when they are at hand (from the report), so it is not run again."""
    trial = _Trial(target, tensor, cause, dtype, device, align, seed, wanted, timeout, budget)
    first = trial(case, rows)
    note = ""
    if first is None:
        return case, None, [], trial.runs, time.perf_counter() - trial.start, "the case no longer fails so"
    keep_lengths = cause == "grows-with-length"
    for _ in range(PASSES):                   # again while a pass shrinks something: a feature left
        before = case                         # out may let the heads or lengths go
        if not keep_lengths:
            case = _lengths(trial, case)
        case = _smallest(trial, case, [_resized(case, batch=b) for b in halvings(case.batch)])[0]
        case = _heads(trial, case)
        case = _smallest(trial, case, [_resized(case, head_dim=d) for d in HEAD_DIMS if d < case.head_dim])[0]
        case = _features(trial, case)
        if case == before:
            break
    if keep_lengths:
        note = f"the lengths kept (Tq {case.tq}, Tk {case.tk}): the error grows with the key length"
    else:
        note = _one_less(trial, case)
    if trial.out_of_time:
        note = "; ".join(x for x in (note, f"stopped at the {trial.budget:g} s budget") if x)
    row, rows = trial(case)
    return case, row, rows, trial.runs, time.perf_counter() - trial.start, note


# ----------------------------------------------------------------------------
# The script

SCRIPT = """\
\"""{said}
Shrunk by `attention-parity check --repro` from {original} to {case} ({dtype}, {device}).
Usage: python repro.py [TARGET]   TARGET: module.path:callable or path/to/file.py:callable (default:
$ATTENTION_REPRO_TARGET, else {target}).  Prints each failing tensor's error against numpy_ref's
float64 answer, its bound and its worst (batch, head, row); exits 1 while the mistake is there, 0 once gone.
\"""
import functools, importlib, json, os, runpy, sys, types
import numpy as np
import torch
from numpy_ref import reference_attention

DATA = np.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "inputs.npz"))
META = json.loads(str(DATA["meta"]))                  # the check's call, options and bounds
DT, DEV = getattr(torch, META["dtype"]), META["device"]
TARGET = (sys.argv[1:] or [os.environ.get("ATTENTION_REPRO_TARGET") or META["target"]])[0]
lay = (lambda x: x.transpose(1, 2)) if META["layout"] == "bthd" else (lambda x: x)   # (B, H, T, D) <-> (B, T, H, D)
{builtin}

def load(spec):                                       # imported as the check did, or run from a file
    path, _, name = spec.rpartition(":")
    sys.path[:0] = [os.getcwd()] + META["search"]
    module = types.SimpleNamespace(**runpy.run_path(path)) if path.endswith(".py") else path and importlib.import_module(path)
    return functools.reduce(getattr, name.split("."), module) if path else BUILTIN

def call(fn):
    \"""q, k, v handed as the check did (views of a fused buffer, rows padded past D, or plain), dout backpropagated.\"""
    g, t, pad = META["grads"], {{n: torch.from_numpy(DATA[n]).to(DEV, DT) for n in ("q", "k", "v", "dout")}}, META["pad"] * (META["strides"] == "padded")
    buf = torch.stack([t[n].transpose(1, 2) for n in "qkv"], 2).requires_grad_(g) if META["strides"] == "fused" else None
    qkv = [lay(buf[:, :, i].transpose(1, 2)) if buf is not None else torch.nn.functional.pad(lay(t[n]), (0, pad))
           .contiguous().requires_grad_(g)[..., :t[n].shape[-1]] for i, n in enumerate("qkv")]
    extra = {{n: torch.from_numpy(DATA[n]).to(DEV, torch.float32 if how["float32"] else DT) for n, how in META["tensors"].items()}}
    learnt = {{"d" + n: extra[n].requires_grad_(g) for n, how in META["tensors"].items() if how["grad"]}}
    out = fn(*qkv, **{{k: tuple(v) if isinstance(v, list) else v for k, v in META["kw"].items()}}, **extra)
    out, lse = out if META["lse"] else (out, None)
    got = {{"out": lay(out), "lse": lse}}
    if g:
        ups = [(out, lay(t["dout"]))] + ([(lse, torch.from_numpy(DATA["dlse"]).to(DEV, lse.dtype))] if "dlse" in DATA else [])
        grads = torch.autograd.grad([u[0] for u in ups], qkv + list(learnt.values()), [u[1] for u in ups], allow_unused=True)
        got.update(zip(["dq", "dk", "dv"] + list(learnt), [lay(x) if x is not None and i < 3 else x for i, x in enumerate(grads)]))
    return {{n: None if x is None else x.detach().double().cpu().numpy() for n, x in got.items()}}

got = call(load(TARGET))
ref = reference_attention(*(DATA[n] for n in ("q", "k", "v", "dout")), **{{n: DATA[n] for n in META["arrays"]}}, **META["ref"])
largest = max([np.abs(ref[n]).max(initial=0.0) for n in ("dq", "dk", "dv") if n in ref] or [0.0])
four = lambda n, a: a[..., None] if n == "lse" else a.reshape(1, -1, 1, 1) if n == "dsinks" else a.reshape((1,) * (4 - a.ndim) + a.shape)
failed = False
for n, bound in META["bounds"].items():               # as the check: max |got - ref| / max |ref|, lse where a key is seen
    r, a = four(n, ref[n]), None if got.get(n) is None else four(n, got[n])
    a, r = (np.where(~np.isfinite(r) & ~np.isnan(a), 0.0, a), np.where(np.isfinite(r), r, 0.0)) if n == "lse" else (a, r)
    den = max(np.abs(r).max(initial=0.0), 1.0 if n == "lse" else 1e-300, 0.1 * largest if n[0] == "d" else 0.0)
    diff = np.full_like(r, np.inf) if a is None else np.where(np.isfinite(a), np.abs(a - r), np.inf)
    error, where = diff.max() / den, tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape)[:3])
    failed |= not error <= bound
    print(f"{{n}}: error {{error:.3e}}, bound {{bound:.3e}}, worst at (batch, head, row) {{where}}: {{'pass' if error <= bound else 'FAIL'}}")
sys.exit(1 if failed else 0)
"""

# The script's BUILTIN: none for a user's kernel; a built-in SDPA backend rebuilt (the check's
# own, less the features' masks).
NO_BUILTIN = "BUILTIN = None                                        # the kernel is named by TARGET\n"
SDPA_SCRIPT = """\
def BUILTIN(q, k, v, *, causal, scale, align="top-left"):   # {name}: PyTorch's SDPA on its {backend} backend alone
    off = k.shape[-2] - q.shape[-2] if causal and align == "bottom-right" else 0     # rows i see keys j <= i + off
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(off) if off else None
    from parity_tests.common.capabilities import sdpa, sdpa_backend            # the same call on every PyTorch >= 2.1
    with sdpa_backend("{backend}"):
        return sdpa(q, k, v, attn_mask=mask, is_causal=causal and not off, scale=scale)
"""


# ----------------------------------------------------------------------------
# Writing

def importable_name(fn):
    """``module:qualname`` of a callable when importing that gives it back, else None."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        return None
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{name}" if obj is fn else None


def _search(spec):
    """The directory a ``module.path:callable`` was imported from (the script looks there
    too, so it runs from any directory)."""
    module = sys.modules.get((spec or "").partition(":")[0])
    path = getattr(module, "__file__", None)
    if not path or ":" not in spec:
        return []
    root = os.path.dirname(os.path.abspath(path))
    depth = spec.partition(":")[0].count(".") + (os.path.basename(path) == "__init__.py")
    for _ in range(depth):
        root = os.path.dirname(root)
    return [root]


def _unwritable(cause, case, wanted, target, spec):
    """Why no script can be written for this case, or None."""
    if cause in ONE_CALL_CANNOT_SHOW:
        return f"the script judges one call against the reference; {ONE_CALL_CANNOT_SHOW[cause]}"
    features = [REGISTRY[n] for n in dict.fromkeys(list(wanted) + [n for n, _ in case.features]) if n in REGISTRY]
    unwritten = [f.name for f in features if f.calling.widen or f.calling.hand or f.calling.recover
                 or any(i.name in CORE for i in f.inputs)]
    if unwritten:                           # a layout or a call the script does not rebuild
        return (f"{', '.join(unwritten)}: the script calls the kernel plainly (no other layout or dtype of q, "
                "k, v, no seeded mask read back); the case above reproduces it in the check")
    if spec is None and target.name in SDPA_BACKENDS:
        spec = target.name
    if spec is None or (":" not in spec and spec not in SDPA_BACKENDS):
        return f"{target.name} has no importable module.path:callable and is not a built-in the script rebuilds"
    keyworded = [f.name for f in features if f.keywords]
    if spec in SDPA_BACKENDS and keyworded:
        return f"the script's {spec} is rebuilt without the keywords of {', '.join(keyworded)}"
    return None


def _meta(found, target, spec, dtype, device, align, wanted, rounded):
    case = found.case
    case_align = case.align or align
    kw = {"causal": case.causal, "scale": case.scale}
    handed = handed_inputs(case)
    placeholders = {n: None for n in handed}
    for name, value in case.features:
        if name in REGISTRY:
            kw.update(REGISTRY[name].calling.arguments(case=case, value=value, tensors=placeholders, inputs=rounded,
                                                       device=device, dtype=dtype, align=case_align))
    tensors = {n: {"float32": handed[n].dtype == "float32", "grad": handed[n].grad}
               for n, v in kw.items() if v is None and n in placeholders}
    kw = {n: v for n, v in kw.items() if n not in tensors}
    if target.takes_align:
        kw["align"] = case_align
    opts = runner.reference_options(case, align, rounded)
    arrays = [n for n, v in opts.items() if isinstance(v, np.ndarray)]
    bounds = {r.tensor: r.bound if r.bound is not None else 0.0 for r in found.rows
              if (r.failed and cause_of(r) == cause_of(found.row)) or r is found.row}
    return {"target": spec, "search": _search(spec), "dtype": dtype, "device": device,
            "layout": target.layout, "strides": case.get("strides"), "pad": STRIDE_PAD, "kw": kw, "tensors": tensors,
            "lse": declared(wanted, "returns_lse"), "grads": not case.forward_only,
            "ref": {n: v for n, v in opts.items() if n not in arrays}, "arrays": arrays, "bounds": bounds}


def _cause_dir(cause):
    """The folder and name of a cause, in every line that says it: its id (``none``, no
    catalogued mistake, as ``unnamed``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "unnamed" if cause == "none" else cause).strip("-.") or "fails"


def write_one(directory, found, target, spec, dtype, device, align, seed, wanted):
    """``DIR/<cause>/repro.py`` and ``inputs.npz`` for a shrunk case; returns the script's path."""
    case, rounded = runner.prepared(found.case, dtype, seed, wanted)     # as the case runner draws them
    meta = _meta(replace(found, case=case), target, spec, dtype, device, align, wanted, rounded)
    builtin = NO_BUILTIN
    if spec is None or spec in SDPA_BACKENDS:           # a built-in: rebuilt in the script
        meta["target"] = spec or target.name
        builtin = SDPA_SCRIPT.format(name=meta["target"], backend=SDPA_BACKENDS[meta["target"]])
    folder = os.path.join(directory, _cause_dir(found.cause))
    os.makedirs(folder, exist_ok=True)
    np.savez(os.path.join(folder, "inputs.npz"), meta=np.array(json.dumps(meta)), **rounded)
    said = f"{_cause_dir(found.cause)}: {found.tensor} of {target.name} fails: {_short(found.row)}"
    text = SCRIPT.format(said=textwrap.shorten(said, 110, placeholder=" ..."), original=found.original,
                         case=found.case, dtype=dtype, device=device, target=meta["target"] or "none (name it)",
                         builtin=builtin)
    path = os.path.join(folder, "repro.py")
    with open(path, "w") as f:
        f.write(text)
    return path


def write_repros(report, directory, budget=BUDGET):
    """Shrink each distinct cause of ``report``'s failures and write its script; a list of `Repro`."""
    ctx = getattr(report, "context", None)
    if ctx is None:
        raise ValueError("repro: this report holds no kernel run to shrink (a --merge or --world-size report?)")
    os.makedirs(directory, exist_ok=True)
    groups = {}
    for r in report.failures:
        if r.case_def is not None:
            groups.setdefault(cause_of(r), []).append(r)
    # zeros everywhere that a mistake named elsewhere in the run would give: one cause, one folder
    for cause in [c for c, rows in groups.items() if all(set(_also(r)) & set(groups) - {c} for r in rows)]:
        del groups[cause]
    done = []
    for cause, rows in groups.items():
        first = min(rows, key=lambda r: (_size(r.case_def), r.tensor != "out"))
        known = [r for r in report.rows if r.case_def == first.case_def and r.dtype == first.dtype]
        case, row, rows_now, runs, seconds, note = shrink(
            ctx["target"], first.case_def, first.tensor, cause, first.dtype, first.device, ctx["align"], ctx["seed"],
            ctx["wanted"], ctx["timeout"], budget, known)
        found = Repro(cause, first.tensor, first.dtype, first.case_def, case, row or first, runs, seconds, note=note,
                      rows=rows_now or [first])
        why = _unwritable(cause, case, ctx["wanted"], ctx["target"], ctx["spec"]) if row is not None else note
        if why:
            found.note = why
        else:
            found.path = write_one(directory, found, ctx["target"], ctx["spec"], first.dtype, first.device,
                                   ctx["align"], ctx["seed"], ctx["wanted"])
        done.append(found)
    return done


def _also(row):
    return row.diagnosis.also if row.diagnosis is not None else ()


def _size(case):
    return case.batch * case.heads * case.tq * case.tk * max(case.head_dim, case.dv)
