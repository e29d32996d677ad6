"""``attention-parity audit`` and ``parity_tests.audit(...)``: which bugs does your tolerance let through?

Most attention kernels are tested in their authors' own suites with
``torch.testing.assert_close(out, ref, atol=..., rtol=...)``, a cosine, or a share of
matching elements.  The audit holds such an acceptance rule to the catalogue: at the user's
shapes, dtypes and features (the plan of ``check``), it runs

- every planted mistake that applies (``planted.MISTAKES``) and reports those the rule
  **accepts** (lets through), beside whether ``check``'s own bound catches each;
- the correct formulations (``planted.correct``: online softmax, exp2, P rounded to the input
  dtype, split-KV merged through the lse; and PyTorch's SDPA backends) and reports those
  the rule **rejects** (too tight);

against the reference a user's test compares with: the same computation written plainly in
PyTorch in the tested dtype (``reference="same-dtype"``, the common case) or in float32.
A kernel is accepted when the rule accepts every tensor (out, lse when returned, dq, dk, dv,
dbias, dsinks) on every case it ran; a kernel that raises or gives no gradient is rejected
(a test would error).  One golden, one reference and one baseline per case, shared by every
kernel (``runner.prepared``, ``golden``, ``baseline``): an audit costs one target call per
kernel and case, where ``check`` makes two to three and a diagnosis.

From the correct kernels' own errors it derives a suggestion (``audit_report``): per dtype and tensor, the
``atol``/``rtol`` pair that rejects no correct kernel at these shapes and lets the fewest
mistakes through, and which mistakes even that pair misses: the honest limit of an
elementwise tolerance, next to ``check``'s bound.

    attention-parity audit --atol 1e-2 --rtol 1e-2 --dtype bfloat16
    attention-parity audit --cosine 0.999 --tokens 128,77x200 --features gqa,window

Exit status: 0 the rule misses no mistake and rejects no correct kernel, 1 otherwise,
2 bad arguments.
"""

import argparse
import math
import re
import sys
import textwrap
import time

import numpy as np
import torch

import parity_tests.kernels.features as feat
import parity_tests.kernels.runner as runner
import parity_tests.kernels.targets as targets
from parity_tests.common import capabilities, outputs
from parity_tests.common.help_text import Parser
from parity_tests.kernels import planted, run
from parity_tests.kernels.audit_report import ASSERT_CLOSE, AuditReport, write
from parity_tests.kernels.call import Caller
from parity_tests.kernels.planted import correct
from parity_tests.kernels.row import Row

__all__ = ["audit", "main", "build_parser", "Rule", "AuditReport", "REFERENCES"]

REFERENCES = ("same-dtype", "float32")


# ----------------------------------------------------------------------------
# The rule

class Rule:
    """A user's acceptance rule on one tensor: ``accept(out, ref)`` (a callable returning a bool,
    or None / raising AssertionError as ``assert_close`` does), or built of ``atol``/``rtol`` (as
    ``torch.testing.assert_close``), ``cosine`` (at least this cosine similarity) and
    ``matched_ratio`` (at least this share of elements within ``atol + rtol·|ref|``); all given
    must hold.  ``out`` comes in the tested dtype (lse in float32), ``ref`` in the reference's."""

    def __init__(self, accept=None, atol=None, rtol=None, cosine=None, matched_ratio=None):
        if accept is not None and not callable(accept):
            raise TypeError(f"rule must be a callable accept(out, ref), got {type(accept).__name__}")
        if accept is not None and any(x is not None for x in (atol, rtol, cosine, matched_ratio)):
            raise ValueError("rule: give a callable or atol/rtol, cosine, matched_ratio, not both")
        if (atol is None) != (rtol is None):
            raise ValueError("atol and rtol: give both, as torch.testing.assert_close takes them")
        for name, value, low, high in (("atol", atol, 0.0, math.inf), ("rtol", rtol, 0.0, math.inf),
                                       ("cosine", cosine, -1.0, 1.0), ("matched_ratio", matched_ratio, 0.0, 1.0)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not low <= value <= high or (name == "matched_ratio" and value == 0):
                raise ValueError(f"{name} must be in [{low:g}, {high:g}]"
                                 + (" and above 0" if name == "matched_ratio" else "") + f", got {value!r}")
        if accept is None and atol is None and cosine is None and matched_ratio is None:
            raise ValueError("rule: give an acceptance rule: atol and rtol, cosine, matched_ratio, "
                             "or a callable accept(out, ref)")
        self.accept, self.atol, self.rtol, self.cosine, self.matched_ratio = accept, atol, rtol, cosine, matched_ratio
        self.by_tensor = accept is not None and _names_tensor(accept)

    def __str__(self):
        if self.accept is not None:
            return getattr(self.accept, "__name__", "your callable")
        parts = []
        if self.atol is not None and self.matched_ratio is None:
            parts.append(f"assert_close(atol={self.atol:g}, rtol={self.rtol:g})")
        if self.matched_ratio is not None:
            within = "assert_close's default atol, rtol" if self.atol is None else f"atol={self.atol:g}, rtol={self.rtol:g}"
            parts.append(f"{self.matched_ratio:g} of the elements within {within}")
        if self.cosine is not None:
            parts.append(f"cosine >= {self.cosine:g}")
        return " and ".join(parts)

    def __call__(self, out, ref, dtype, tensor):
        """Whether the rule accepts ``out`` against ``ref`` (torch tensors) in ``dtype``; a callable
        whose signature names ``tensor`` receives the tensor's name (out, dq, ...) as well."""
        if self.accept is not None:
            try:
                said = self.accept(out, ref, tensor=tensor) if self.by_tensor else self.accept(out, ref)
            except AssertionError:
                return False
            return True if said is None else bool(said)
        a, b = out.double(), ref.double()
        if self.atol is not None and self.matched_ratio is None:
            if a.shape != b.shape or not _within(a.numpy(), b.numpy(), self.atol, self.rtol).all():
                return False                  # assert_close's test, without building its message
        if self.matched_ratio is not None:
            atol, rtol = (self.atol, self.rtol) if self.atol is not None else ASSERT_CLOSE[dtype]
            if a.numel() and float(_within(a.numpy(), b.numpy(), atol, rtol).mean()) < self.matched_ratio:
                return False
        if self.cosine is not None and cosine_similarity(a, b) < self.cosine:
            return False
        return True


def _names_tensor(fn):
    import inspect
    try:
        return "tensor" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _within(a, b, atol, rtol):
    """`within` on float64 NumPy arrays (the same test, a tenth of the time on small tensors)."""
    with np.errstate(invalid="ignore"):
        return (a == b) | (np.abs(a - b) <= atol + rtol * np.abs(b))


def within(a, b, atol, rtol):
    """Elementwise ``|a − b| <= atol + rtol·|b|``, infinities equal to themselves, NaN never
    (``torch.testing.assert_close``'s test, as ``torch.isclose`` makes it)."""
    return torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=False)


def cosine_similarity(a, b):
    """The cosine similarity of ``a`` and ``b`` flattened (1 when both are zero; NaN anywhere: -1)."""
    a, b = a.reshape(-1), b.reshape(-1)
    finite = torch.isfinite(b)
    if torch.isnan(a).any() or not torch.equal(torch.isfinite(a), finite):
        return -1.0
    a, b = a[finite], b[finite]
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float((a @ b) / (na * nb))


# ----------------------------------------------------------------------------
# The kernels

class Kernel:
    """One kernel the audit runs: a planted mistake (``kind`` "mistake") or a correct one; its
    target; and what was found: per (dtype, tensor), whether the rule accepted it everywhere,
    whether check's bound caught it, its worst error over check's bound."""

    def __init__(self, name, kind, target, diagnosis=None, dtypes=None):
        self.name, self.kind, self.target, self.diagnosis = name, kind, target, diagnosis
        self.dtypes = dtypes                 # the dtypes it applies in (None: every one)
        self.cases = 0                       # (case, dtype) pairs it ran on
        self.rejected_on = None              # (case, dtype, tensor) where the rule first rejected it
        self.caught_on = None                # the same for check's bound
        self.worst = (0.0, None)             # (error / check's bound, "tensor on case dtype")
        self.diffs = {}                      # (dtype, tensor) -> list of (|a - ref|, |ref|) arrays
        self.errored = set()                 # dtypes where it raised or gave no tensor (no tolerance accepts that)

    @property
    def ran(self):
        return self.cases > 0

    @property
    def accepted(self):
        return None if not self.ran else self.rejected_on is None

    @property
    def caught_by_check(self):
        return None if not self.ran else self.caught_on is not None


def _planted_kernels(wanted, dtypes, names=None):
    """The planted mistakes that apply to a run of ``wanted`` features: those whose layout the
    run has and whose features it asks for (``in-bfloat16`` only in the dtypes wider than it)."""
    out = []
    for name, p in planted.MISTAKES.items():
        if names is not None and name not in names:
            continue
        if not planted.plantable(name, wanted) or not set(p.needs) <= set(wanted):
            continue
        if feat.declared(p.needs, "random"):
            continue                          # a mask the kernel draws: never (see audit)
        wider = [d for d in dtypes if d in ("float32", "float64")] if name == "in-bfloat16" else None
        if wider == []:
            continue
        fn = planted.kernel(name, wanted)
        out.append(Kernel(name, "mistake", targets.user_target(fn, name=name), p.diagnosis, wider))
    return out


def _correct_kernels(device, wanted):
    """The correct kernels that can be given ``wanted``: the standard formulations
    (``planted.correct``, on the cases of no feature of their own; with lse each returns the lse
    of its scores in float32 as well), PyTorch's SDPA backends on ``device`` (on the cases whose
    features they express), and the answer computed in float64 and rounded once
    (``planted.right``, every feature), with splits the split-KV merge through the lse; with
    fp8 or fp8_kv, that form's right kernels (``planted.FP8_RIGHT``)."""
    returns_lse = feat.declared(wanted, "returns_lse")
    found = []
    if feat.layout(wanted) is None:                      # the formulations take (B, H, T, D) alone
        found += [targets.Target(name.replace("_", "-"), _with_lse(fn) if returns_lse else fn, takes_align=True,
                                 features=frozenset(), returns_lse=returns_lse or None)
                  for name, fn in correct.CORRECT.items()]
    for name in targets.builtin_names(device):
        if name.startswith("sdpa-"):
            t = targets.resolve(name, device)
            try:
                feat.require(t, [f for f in wanted if feat.REGISTRY[f].calling.run_wide])
            except ValueError:
                continue
            found.append(t)
    for form, right in planted.FP8_RIGHT.items():        # FP8's right kernels, in their form
        if form in wanted and set(wanted) <= {form, "gqa"}:
            found += [targets.user_target(fn, name=f"{form}-{name}") for name, fn in right.items()]
    found.append(targets.user_target(planted.right(wanted), name="float64-rounded"))
    if "splits" in wanted:
        found.append(targets.user_target(planted.right(wanted, "split-kv-merged"), name="split-kv-merged"))
    return [Kernel(t.name, "correct", t) for t in found if t.unavailable is None]


# ----------------------------------------------------------------------------
# The run

def audit(rule=None, *, atol=None, rtol=None, cosine=None, matched_ratio=None, reference="same-dtype",
          device="cpu", dtypes=None, tokens=None, head_dims=None, heads=None, batch=None, causal="both",
          align="top-left", features=None, seed=0, mistakes=None, timeout=runner.DEFAULT_TIMEOUT,
          progress=False):
    """Hold an acceptance rule to the catalogue; returns an `AuditReport`.

    ``rule``: a callable ``accept(out, ref) -> bool`` (or one that raises AssertionError, as
    ``torch.testing.assert_close``), called per tensor with ``out`` in the tested dtype and
    ``ref`` in the reference's (and ``tensor=`` "out", "dq", ... when its signature names it); or ``atol`` and ``rtol`` (as ``assert_close``), ``cosine``,
    ``matched_ratio`` (the share of elements within atol + rtol·|ref|; assert_close's default
    atol and rtol for the dtype unless given).  ``reference``: "same-dtype" (the attention
    written plainly in PyTorch in the tested dtype) or "float32".  ``mistakes``: names among
    ``parity_tests.mistakes()`` (default: every one that applies).  The shapes, dtypes and
    features are ``check``'s (``parity_tests.check``), dropout excepted: its reference depends
    on the kernel's own mask."""
    judge = Rule(rule, atol, rtol, cosine, matched_ratio)
    if reference not in REFERENCES:
        raise ValueError(f"reference must be 'same-dtype' or 'float32', got {reference!r}")
    if mistakes is not None:
        mistakes = [mistakes] if isinstance(mistakes, str) else list(mistakes)
        unknown = [m for m in mistakes if m not in planted.MISTAKES]
        if unknown:
            raise ValueError(f"mistakes: no planted mistake {', '.join(map(repr, unknown))}; "
                             f"the catalogue's: {', '.join(planted.MISTAKES)}")
    wanted = feat.parse_features(features)
    drawn = [f for f in wanted if feat.REGISTRY[f].calling.recover is not None or feat.REGISTRY[f].calling.random]
    if drawn:
        raise ValueError(f"features: {drawn[0]!r} is not audited (its reference depends on the mask the "
                         "kernel itself draws; check it with check --features dropout)")
    layout = "thd" if any(feat.layout_name(feat.REGISTRY[f].calling.layout) == "thd" for f in wanted) else "bhtd"
    plan = run._plan(planted.kernel("no-causal-mask", wanted), device, dtypes, tokens, head_dims, heads, batch, causal, align, layout, False,
                     wanted, seed)
    kernels = _planted_kernels(plan.wanted, plan.dtypes, mistakes) + _correct_kernels(plan.device, plan.wanted)
    start = time.perf_counter()
    work = [(case, d) for d in plan.dtypes for case in plan.grid]
    for i, (case, dtype) in enumerate(work, 1):
        with runner.one_thread_if_small(case, plan.device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)           # a kernel drawing from torch's RNG draws the same each run
            _one_case(kernels, case, dtype, plan, align, seed, judge, reference, timeout)
        if progress:
            print(f"\r  audit: {i}/{len(work)} cases {time.perf_counter() - start:6.1f} s",
                  end="\n" if i == len(work) else "", file=sys.stderr, flush=True)
    settings = {"device": plan.device, "dtypes": plan.dtypes, "reference": reference, "features": list(plan.wanted),
                "cases": len(plan.grid), "align": align}
    return AuditReport(str(judge), kernels, time.perf_counter() - start, settings)


def _one_case(kernels, case, dtype, plan, align, seed, judge, reference, timeout):
    """Every kernel on ``case`` in ``dtype``: one golden, one reference, one baseline, shared."""
    device, wanted = plan.device, plan.wanted
    case, rounded = runner.prepared(case, dtype, seed, wanted)
    case_align = case.align or align
    names = ["out"] + (["lse"] if feat.declared(wanted, "returns_lse") else [])
    grads = not case.forward_only
    if grads:
        names += ["dq", "dk", "dv"] + ["d" + n for n in feat.differentiated_inputs(case, rounded)]
    opts = runner.reference_options(case, case_align, rounded)
    full, gold_raw, gold, raw_bases, bases, logits, unjudged, den, zero, floors = runner.judging_basis(
        case, case_align, rounded, opts, names, dtype, device)
    ref_dtype = dtype if reference == "same-dtype" else "float32"
    ref = raw_bases[0] if ref_dtype == dtype else runner.baseline(rounded, opts, ref_dtype, device, grads)
    row = lambda tensor, **kw: Row(target="", case=str(case), dims=case.as_dict(), dtype=dtype, device=device,
                                   tensor=tensor, align=case_align, **kw)
    for k in kernels:
        if k.dtypes is not None and dtype not in k.dtypes:
            continue
        if capabilities.dtype_lacks(dtype, device) or k.target.refuses(case, dtype, device, case_align):
            continue
        if not _takes(k.target, case):
            continue
        got = Caller(k.target, case, dtype, device, case_align, wanted, rounded, timeout)()
        if isinstance(got, str):             # the target refused the case: not run
            continue
        k.cases += 1
        where = f"{case} {dtype}"
        if isinstance(got, tuple):           # it raised: a test would error
            k.rejected_on = k.rejected_on or f"{where} ({_short(got[1])})"
            k.caught_on = k.caught_on or where
            k.worst = (math.inf, f"{where}: {got[1]}")
            k.errored.add(dtype)
            continue
        for n in names:
            value = got.get(n, ("FAIL", f"no {n}"))
            if isinstance(value, str):       # refused its backward: its forward is judged alone
                continue
            if isinstance(value, tuple):
                k.rejected_on = k.rejected_on or f"{n} on {where} ({_short(value[1])})"
                k.caught_on = k.caught_on or f"{n} on {where}"
                k.worst = (math.inf, f"{n} on {where}: {value[1]}")
                k.errored.add(dtype)
                continue
            kept = n == "lse" or (n[1:] in feat.INPUTS and feat.INPUTS[n[1:]].dtype == "float32")   # dsinks
            low = torch.float32 if kept else runner.DTYPES[dtype]
            out_t = torch.from_numpy(value).to(low)
            ref_t = torch.from_numpy(np.asarray(ref[n], dtype=np.float64)).to(runner.DTYPES[ref_dtype])
            if not judge(out_t, ref_t, dtype, n) and k.rejected_on is None:
                k.rejected_on = f"{n} on {where}"
            checked = runner._judge(n, value, dict(gold), bases, den, n in zero, dtype, logits, unjudged, case,
                                    case_align, gold_raw, rounded, row, floors.get(n, 0.0))[0]
            if checked.failed and k.caught_on is None:
                k.caught_on = f"{n} on {where}"
            ratio = checked.ratio if checked.ratio is not None else 0.0
            if ratio > k.worst[0]:
                k.worst = (ratio, f"{n} on {where}")
            a, b = out_t.double(), ref_t.double()
            k.diffs.setdefault((dtype, n), []).append(_gaps(a, b))


def _short(reason):
    """A failure's reason, to its first colon: "raised RuntimeError", "no gradient reached q"."""
    return reason.split(":", 1)[0]


def _with_lse(fn):
    """``fn`` returning ``(out, lse)``: the lse of its scores, in float32 (differentiable)."""
    def kernel(q, k, v, *, causal, scale, align="top-left"):
        S = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            tq, tk = S.shape[-2:]
            offset = tk - tq if align == "bottom-right" else 0
            S = S.masked_fill(torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(offset + 1), -math.inf)
        return fn(q, k, v, causal=causal, scale=scale, align=align), torch.logsumexp(S, -1)
    return kernel


def _takes(target, case):
    """Whether ``target`` can be given ``case``'s features (a correct kernel without a window's
    keyword runs on the plain cases alone)."""
    named = [n for n, _ in case.features if n in feat.REGISTRY]
    try:
        feat.require(target, named)
    except ValueError:
        return False
    return True


def _gaps(a, b):
    """(needed, |ref|): per element, how far ``a`` is from ``b`` (0 where equal, infinities and
    NaN included as assert_close compares them; inf where one is not finite and they differ)."""
    a, b = a.reshape(-1).numpy(), b.reshape(-1).numpy()
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b)
    d = np.where(a == b, 0.0, np.where(np.isfinite(d), d, math.inf))
    return d, np.nan_to_num(np.abs(b), nan=0.0, posinf=0.0, neginf=0.0)


# ----------------------------------------------------------------------------
# The command

def build_parser():
    p = Parser(
        page="docs/audit.md", prog="attention-parity audit", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="attention-parity audit (--atol A --rtol R | --cosine C | --matched-ratio M) [options]",
        description=textwrap.fill(
            "Which bugs does your test's tolerance let through? Runs every planted mistake that "
            "applies and the correct kernels at your shapes, holds each to your acceptance rule "
            "against the reference your test uses, and reports the mistakes it accepts, the correct "
            "kernels it rejects, whether check's bound catches each, and a derived atol/rtol. "
            "docs/audit.md", 88),
        epilog="Exit status: 0 the rule misses no mistake and rejects no correct kernel, 1 otherwise, "
               "2 bad arguments.")
    p.add_argument("--atol", type=float, help="absolute tolerance, as torch.testing.assert_close")
    p.add_argument("--rtol", type=float, help="relative tolerance, as torch.testing.assert_close")
    p.add_argument("--cosine", type=float, metavar="C", help="accept a tensor whose cosine similarity is >= C")
    p.add_argument("--matched-ratio", type=float, metavar="M",
                   help="accept when a share >= M of elements is within atol + rtol*|ref| "
                        "(assert_close's defaults without --atol/--rtol)")
    p.add_argument("--reference", choices=REFERENCES, default="same-dtype",
                   help="what your test compares with: plain PyTorch in the tested dtype (default) or float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", action="append", metavar="DTYPE", help="as check (default float32,bfloat16)")
    p.add_argument("--tokens", action="append", metavar="T|TqxTk", help="sequence lengths, as check")
    p.add_argument("--head-dim", action="append", metavar="D")
    p.add_argument("--heads", action="append", metavar="H")
    p.add_argument("--batch", action="append", metavar="B")
    p.add_argument("--causal", choices=list(run.CAUSAL), default="both")
    p.add_argument("--align", choices=list(targets.ALIGNMENTS), default="top-left")
    p.add_argument("--features", action="append", metavar="F,...", help="as check (dropout excepted)")
    p.add_argument("--mistakes", action="append", metavar="NAME,...", help="only these planted mistakes")
    p.add_argument("--seed", type=outputs.seed, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the findings as JSON to PATH (-: standard output)")
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    problem = args.json not in (None, "-") and outputs.output_file_problem("--json", args.json)
    if problem:
        print(f"attention-parity audit: error: {problem}", file=sys.stderr)
        return 2
    try:
        split = lambda values, flag, convert=str: run._split(values, flag, convert)
        report = audit(atol=args.atol, rtol=args.rtol, cosine=args.cosine, matched_ratio=args.matched_ratio,
                       reference=args.reference, device=args.device, dtypes=split(args.dtype, "--dtype"),
                       tokens=split(args.tokens, "--tokens"), head_dims=split(args.head_dim, "--head-dim", int),
                       heads=split(args.heads, "--heads", int), batch=split(args.batch, "--batch", int),
                       causal=args.causal, align=args.align, features=split(args.features, "--features"),
                       mistakes=split(args.mistakes, "--mistakes"), seed=args.seed,
                       progress=sys.stderr.isatty())
    except (ValueError, TypeError) as e:
        said = re.sub(r"^(atol and rtol|atol|rtol|cosine|matched_ratio|reference|mistakes|features)\b",
                      lambda m: " and ".join("--" + w.replace("_", "-") for w in m.group(1).split(" and ")), str(e))
        print(f"attention-parity audit: error: {said} (see attention-parity audit --help)", file=sys.stderr)
        return 2
    # --json -: the JSON alone on standard output, the table on standard error
    print(report.render(), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        write(args.json, report.as_dict())
    return 0 if report.passed else 1
