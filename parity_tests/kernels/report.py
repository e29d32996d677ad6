"""Rows, the report holding them, the table, the summary and the JSON copy.

A row is one tensor (``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``dbias``, ``dsinks``)
of one case in one dtype on one device; ``where`` is the (batch, head, row) of its
largest error -- a query row for out and dq, a key row for dk and dv.  Verdicts:
``pass``; ``FAIL`` (error above the bound, a non-finite value, a wrong shape, a
gradient that never arrived, an input written into); ``not supported`` (the target
refused the case: never counted as a pass).  Beside the verdict, never deciding it:
``err/SDPA``, out's error over PyTorch's SDPA's own on the same case in the same
dtype (a kernel keeping its softmax in bfloat16 passes its bound but shows 2-4x, measured),
and ``time/SDPA``, the target's forward time over SDPA's (``runner.YARDSTICK_CALLS``).

After a run, failing rows that no catalogued mistake explains are looked at
together: when a tensor passes at every shorter key length and fails at every
longer one, the error grows with the sequence length -- the signature of an
accumulator kept in a low precision -- and the rows say so, when the error also looks
like rounding (its size, its rows, a float64 run: ``diagnosis._rounding_like``).
"""

import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

from parity_tests.common.tables import format_table
from parity_tests.kernels import variations
from parity_tests.kernels.diagnosis import weights
from parity_tests.kernels.row import Row

__all__ = ["Row", "Report", "find_growth", "find_strides", "find_precision_refuted", "find_overflow"]

# Diagnosis ids that name no mistake: nothing matched, or the case was too large to try.
UNNAMED = ("none", "not-diagnosed")
# Ids that say what the output looks like rather than which mistake made it: a report names
# a catalogued mistake first when some row has one.
GENERIC = ("zeros", "scores-flat", "non-finite", "float16-overflow", "lower-precision", "wrong-direction",
           "grows-with-length", "dropout", weights.ID)
# ... of which those that locate what is wrong without naming a mistake: a catalogued mistake heads
# the run against them as against the rows no name covers, and a gradient of a case whose out has
# one is not covered by it.
LOCATED = (weights.ID,)
# A row whose bound is this share of its tensor's size or more (bfloat16 on outlier inputs: 0.5 .. 1)
# keeps its reading, but does not name the run: there a forward's slip passes and leaves its gradients
# looking like a backward's (an accumulator rescaled in the wrong order read as "D dropped").
LOOSE_BOUND = 0.25
# A cause heads the run when the rows no name covers are at most this many times its own: one
# slice of one row named among 25 unnamed rows is not the run's cause; a split kernel's mistake
# named on its 23 split cases, among 96 cases without splits where the catalogue has no entry for
# it, is.
HEADLINE_SHARE = 5

# Where the diagnoses a report leaves out are: the command's, and Python's
CLI_MORE = "--json"
PYTHON_MORE = "report.failures, or report.as_dict()"

# target and device are the summary's (one each per report)
HEADERS = ("case", "dtype", "tensor", "error", "baseline", "bound", "ratio", "mean", "cosine",
           "err/SDPA", "time/SDPA", "verdict", "worst at (b, h, row)")


def _sci(x):
    return "-" if x is None else ("inf" if not math.isfinite(x) else f"{x:.1e}")


def _cells(r):
    verdict = f"{r.verdict} ({r.note})" if r.note else r.verdict
    where = "-" if r.where is None else ", ".join(map(str, r.where))
    versus = r.error / r.sdpa_error if r.error is not None and r.sdpa_error else None
    return [r.case, r.dtype, r.tensor, _sci(r.error), _sci(r.baseline), _sci(r.bound), _ratio(r.ratio),
            _sci(r.mean_error), "-" if r.cosine is None else f"{r.cosine:.4f}", _ratio(versus),
            "-" if r.speed is None else f"×{r.speed:.2f}" if r.speed < 100 else f"×{r.speed:.0f}", verdict, where]


def _ratio(x):
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 100 else _sci(x)


def find_growth(rows):
    """Mark failing rows that match nothing but fail only above some key length."""
    from parity_tests.kernels.diagnosis.diagnose import Diagnosis
    groups = {}
    for r in rows:
        if r.verdict in ("pass", "FAIL") and r.error is not None:
            same = (r.target, r.dtype, r.device, r.tensor, r.dims["head_dim"], tuple(r.dims["features"]))
            groups.setdefault(same, []).append(r)
    for group in groups.values():
        # an error with a place of its own, or too large, or concentrated in the rows whose maximum
        # moved, or there again in float64, is not a drift (``diagnosis._rounding_like``)
        unexplained = [r for r in group if r.failed and r.diagnosis is not None and r.diagnosis.id == "none"
                       and r.diagnosis.rounding]
        passing = [r for r in group if r.passed]
        if not unexplained or len({r.dims["tk"] for r in passing}) < 2:
            continue
        fail_from = min(r.dims["tk"] for r in group if r.failed)
        pass_upto = max(r.dims["tk"] for r in passing)
        if pass_upto >= fail_from:
            continue
        short = max(passing, key=lambda r: (r.dims["tk"], r.ratio))
        long = max((r for r in group if r.failed), key=lambda r: r.dims["tk"])
        for r in unexplained:
            r.diagnosis = Diagnosis(
                "grows-with-length",
                f"{r.tensor} error grows with the key length: passes up to Tk = {pass_upto}, fails from "
                f"Tk = {fail_from} (ratio {short.ratio:.2f} at Tk = {short.dims['tk']}, {long.ratio:.2f} at "
                f"Tk = {long.dims['tk']}): the signature of an accumulator kept in a low precision "
                "(no catalogued mistake matches)", r.error, r.bound)


def find_precision_refuted(rows):
    """Withdraw a "lower-precision" reading where the same tensor, in the same dtype, errs on another
    case of the run past what any lower precision makes there (``Diagnosis.past_precision``): a lower
    precision errs alike on every case, while a formula's error moves with the case (the softcap's
    derivative applied to dP alone is a half precision's size at softcap 50, 10^3 times past it at
    softcap 1).  Such a row names nothing, and says how its tensor's error moves with each option
    the run's cases vary."""
    from parity_tests.kernels.diagnosis.diagnose import rounding_ceiling
    groups = {}
    for r in rows:
        if r.verdict in ("pass", "FAIL") and r.error is not None:
            groups.setdefault((r.target, r.dtype, r.device, r.tensor), []).append(r)
    for group in groups.values():
        failed = [r for r in group if r.failed and r.diagnosis is not None]
        low = [r for r in failed if r.diagnosis.id == "lower-precision"]
        past = [r for r in failed if r.diagnosis.past_precision]
        if not low or not past:
            continue
        worst = max(past, key=lambda r: r.error)
        lowest, ceiling = rounding_ceiling(worst.dtype)
        instead = (f"yet not a precision: {worst.tensor} errs {worst.error:.1e} on {worst.case}, past what {lowest} "
                   f"or any precision above it makes ({ceiling:.1e}); its error moves with the case, as a formula's "
                   f"does{_moves_with_options(group)}")
        for r in low:
            r.diagnosis.id = "none"
            r.diagnosis.sentence = re.sub(r"the kernel appears to compute .* inside this \w+ check", instead,
                                          r.diagnosis.sentence)


def find_overflow(rows):
    """Name a half dtype's infinities an overflow: a tensor infinite in float16 on a case whose
    bfloat16 or float32 run is finite (bfloat16 has float32's range, float16 ends at 65504): a value
    past float16's largest, an intermediate kept in float16 before it is scaled down (an accumulator
    stored before its 1/l or its descale, a sum, a product)."""
    finite = {(r.target, r.device, r.tensor, r.case) for r in rows if r.dtype in ("bfloat16", "float32")
              and r.verdict in ("pass", "FAIL") and not (r.diagnosis is not None and r.diagnosis.id == "non-finite")}
    for r in rows:
        d = r.diagnosis
        if r.dtype == "float16" and r.failed and d is not None and d.id == "non-finite" and d.infinite and \
                (r.target, r.device, r.tensor, r.case) in finite:
            d.id = "float16-overflow"
            d.sentence += ("; infinite in float16 alone (the same case is finite in bfloat16 or float32): a value "
                           "past float16's largest, 65504, an intermediate kept in float16 before it is scaled down "
                           "(an accumulator stored before its 1/l or its descale, a sum, a product)")


def _moves_with_options(rows):
    """'; its largest error by softcap: 50 → 3.9e-03, 30 → 1.2e-02, 1 → 1.9e+00' for each feature
    option whose value the cases of ``rows`` vary ('' where none varies)."""
    by = {}
    for r in rows:
        for name, value in (r.case_def.features if r.case_def is not None else ()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                by.setdefault(name, {}).setdefault(value, []).append(r.error)
    said = [f"{name}: " + ", ".join(f"{v:g} → {max(e):.1e}" for v, e in sorted(values.items(), reverse=True))
            for name, values in by.items() if len(values) > 1]
    return f"; its largest error by {'; by '.join(said)}" if said else ""


def find_strides(rows):
    """Name failing rows when only the cases whose q, k, v are views (``variations.py``'s strides
    cases) fail and every contiguous case passes: the kernel reads as if contiguous."""
    from parity_tests.kernels.diagnosis.diagnose import Diagnosis
    judged = [r for r in rows if r.verdict in ("pass", "FAIL")]
    strided = lambda r: variations.viewed(r.dims.get("features", ()))
    failing = [r for r in judged if r.failed]
    if not failing or not all(strided(r) for r in failing) or not any(r.passed and not strided(r) for r in judged):
        return
    for r in failing:
        if r.diagnosis is None or r.diagnosis.id in UNNAMED + LOCATED + ("wrong-direction",):
            where = f"; where: {r.diagnosis.where}" if r.diagnosis is not None and r.diagnosis.where else ""
            r.diagnosis = Diagnosis("ignores-strides", f"{r.tensor} fails only where q, k, v are views of a larger "
                                    "buffer (a fused qkv, a padded row) and every contiguous case passes: the kernel "
                                    "reads its inputs as if contiguous (read through their strides, or call "
                                    f".contiguous() first){where}", r.error, r.bound)


def _other(align):
    return "bottom-right" if align == "top-left" else "top-left"


# Diagnosis ids that name a convention rather than a mistake of the arithmetic, and what fixes
# each (from the run's settings): said once when every failing row has it (`Report.convention`).
def _align_flag(settings):
    other = _other(settings.get("align", "top-left"))
    return f'rerun with --align {other} (from Python: align="{other}")'


CONVENTIONS = {
    "other-alignment": _align_flag,
    "window-other-alignment": _align_flag,
    "layout-bthd-as-bhtd": lambda s: "the kernel takes (B, T, H, D): rerun with --layout bthd (from Python: "
                                     "layout=\"bthd\")",
    "lse-base-2": lambda s: "lse is the natural log, as FlashAttention and SDPA give it: a base-2 lse times ln 2 "
                            "(and a natural-log lse times log2(e) before exp2)",
    "scale-ignored": lambda s: "use the scale argument the kernel is given (a case of every run passes "
                               "one other than 1/sqrt(D))",
}


# Conventions that one flag fixes together (each the same as itself otherwise)
SAME_FIX = {"window-other-alignment": "other-alignment"}


def _cause(sentence):
    """(what a diagnosis says the kernel does: its sentence after "matches the reference with"
    and before the row's figures, the advice it gives after them or None)."""
    for words in ("matches the reference with ", "reference with "):
        if words in sentence:
            sentence = sentence.split(words, 1)[1]
            break
    # up to the row's own figures: "... to 9.3e-09 (bound 8.0e-07)"
    figures = re.search(r" to \S+ \(bound \S+\)", sentence)
    if figures is None:
        return sentence.split("; where:")[0].rstrip("."), None
    after = sentence[figures.end():]
    return sentence[:figures.start()], (after[2:].split("; where:")[0] if after.startswith(": ") else None)


@dataclass(repr=False)
class Report:
    target: str
    rows: list = field(default_factory=list)
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)
    # input classes (``variations.CLASSES``) that never ran: every case of theirs refused, why
    gaps: list = field(default_factory=list)
    # what a kernel run needs to rerun its cases (`repro`): target, spec, align, seed, wanted, timeout
    context: dict = field(default=None, compare=False)
    # why the installed PyTorch cannot run this built-in target at all (``Target.unavailable``)
    unavailable: str = None
    # --invariance: the kernel against itself, bitwise (``invariance.Finding``, one per mode and dtype)
    invariance: list = field(default_factory=list)

    @property
    def failures(self):
        return [r for r in self.rows if r.failed]

    @property
    def unsupported(self):
        return [r for r in self.rows if r.verdict == "not supported"]

    @property
    def passed(self):
        """Every row passed or was not supported, and at least one row passed (or the target is
        a built-in the installed PyTorch lacks: an answer, not a failure)."""
        return not self.failures and not self.broken and not self.judge_defects and (
            any(r.passed for r in self.rows) or self.unavailable is not None)

    @property
    def judge_defects(self):
        """The rows whose baseline is past what a plain computation makes (``Row.judge_defect``):
        the check's own defect, never the kernel's; such a run does not pass."""
        return [r for r in self.rows if r.judge_defect]

    @property
    def broken(self):
        """The invariances asked for that the kernel breaks (``invariance.Finding``)."""
        return [f for f in self.invariance if f.broken]

    @property
    def diagnoses(self):
        """``[(row, Diagnosis)]`` of every failing row that has one."""
        return [(r, r.diagnosis) for r in self.failures if r.diagnosis is not None]

    @property
    def diagnosis(self):
        """The catalogued mistake explaining the most failing rows (a description such as
        ``non-finite`` only where no row has a catalogued one: a kernel whose mistake leaves
        NaN on some cases is named by the mistake), or None when no failing row is named
        (each row's own ``.diagnosis`` says why).  A description heads the run only when it covers
        at least as many failing rows as no name covers (one row read as a lower precision
        among three unnamed is not the run's cause; a gradient of a case whose out is named is
        covered: it follows from out), a catalogued mistake when it covers at least
        1/`HEADLINE_SHARE` of as many and of the rows only located (`LOCATED`), and when it
        explains no fewer failing cases than it is contradicted on: a case where a failing tensor
        was tried against it and not reproduced (``Diagnosis.against``; a mistake that reproduces
        dk and dv while dq fails, or 5 cases of 30, is a coincidence), unless it names the case's
        out (what follows from out, its lse, is not).  Rows judged to a bound of `LOOSE_BOUND` or
        more are not counted."""
        judged = [(r, d) for r, d in self.diagnoses if not (r.bound or 0.0) >= LOOSE_BOUND]
        ids = Counter(d.id for r, d in judged if d.id not in UNNAMED)
        specific = Counter({i: c for i, c in ids.items() if i not in GENERIC})
        named_out = {(r.case, r.dtype) for r, d in self.diagnoses
                     if r.tensor == "out" and d.id not in UNNAMED + LOCATED}
        unnamed = sum(1 for r, d in self.diagnoses if d.id in UNNAMED and (r.case, r.dtype) not in named_out)
        located = sum(1 for r, d in self.diagnoses if d.id in LOCATED)
        cases = {}                         # (case, dtype) -> (ids named, ids named on out, ids against)
        for r, d in judged:
            named, on_out, against = cases.setdefault((r.case, r.dtype), (set(), set(), set()))
            named.add(d.id)
            if r.tensor == "out":
                on_out.add(d.id)
            against.update(d.against)
        for best, count in specific.most_common():
            if count * HEADLINE_SHARE < unnamed + located:
                return None
            # a case whose out it names is for it (the rest follows from out); else a tensor refuting it is against
            holds = [best in on_out or (best in named and best not in against)
                     for named, on_out, against in cases.values()]
            wrong = sum(not h and best in against for h, (_, _, against) in zip(holds, cases.values()))
            if sum(holds) >= wrong:
                return best
        if specific:
            return None
        best = ids.most_common(1)[0] if ids else None
        return best[0] if best and best[1] >= unnamed else None

    def summary(self):
        counts = Counter(r.verdict for r in self.rows)
        text = (f"{self.target}: {len(self.rows)} rows, {counts['pass']} pass, {counts['FAIL']} FAIL, "
                f"{counts['not supported']} not supported in {self.seconds:.1f} s")
        if self.settings:
            s = self.settings
            text += f" ({s.get('device')}; {', '.join(s.get('dtypes', []))}; causal {s.get('align')})"
        if self.gaps and not self.unavailable:
            text += "; never ran: " + "; ".join(self.gaps)
        if self.unavailable:
            text += f"; {self.target} is not supported here: {self.unavailable}"
        if self.judge_defects:
            text += f"; the check's own baseline is wrong on {len(self.judge_defects)} rows (its defect)"
        if self.invariance:
            broken = sorted({f.mode for f in self.broken}, key=lambda m: [f.mode for f in self.invariance].index(m))
            text += "; invariance: " + (f"broken: {', '.join(broken)}" if broken else "held")
        return text

    def invariance_lines(self):
        """``--invariance``: one line per mode and dtype."""
        if not self.invariance:
            return []
        return ["invariance (the kernel against itself, bitwise):"] + [f"  {f.line()}" for f in self.invariance]

    def refusals(self):
        """``{reason: rows}`` of the rows not supported, each reason once."""
        return Counter(r.note for r in self.unsupported)

    def table(self, rows=None):
        rows = self.rows if rows is None else rows
        return format_table(HEADERS, [_cells(r) for r in rows])

    def render(self, quiet=False):
        """What the command prints: the table (``quiet``: the failing rows alone), the
        diagnoses, the summary."""
        parts = []
        if not quiet:
            parts.append(self.table())
            if self.diagnoses:
                parts.append("\ndiagnosis:\n" + "\n".join(self.diagnosis_lines(more=CLI_MORE)))
        elif self.failures:
            parts.append(self._text(CLI_MORE).rsplit("\n", 1)[0])
        if self.invariance and not (quiet and (self.failures or not self.broken)):   # else in str(self)
            parts.append("\n".join([""] + self.invariance_lines()))
        if self.judge_defects:
            parts.append("\n".join([""] + self.judge_lines()))
        parts.append(("\n" if not quiet or self.failures or self.broken else "") + self.summary())
        return "\n".join(parts)

    def judge_lines(self, limit=10):
        """The check's own defects, apart from the kernel's verdicts."""
        found = self.judge_defects
        lines = ["the check's own defect (not the kernel's; please report it):"]
        lines += [f"  {r.case} {r.dtype} {r.tensor}: {r.judge_defect}" for r in found[:limit]]
        return lines + ([f"  ... and {len(found) - limit} more rows"] if len(found) > limit else [])

    def diagnosis_lines(self, limit=40, more=PYTHON_MORE):
        """A line per diagnosed failing row (``limit`` of them, then how many more and where all
        of them are: ``more``); one line when every failing row has one convention as its cause
        (`convention`), with what fixes it."""
        one = self.convention()
        if one is not None:
            return [f"  {one}"]
        lines = [f"  {r.case} {r.dtype}: {d.sentence}" for r, d in self.diagnoses[:limit]]
        if len(self.diagnoses) > limit:
            lines.append(f"  ... and {len(self.diagnoses) - limit} more (all of them in {more})")
        apart = self.failing_apart()
        return lines + ([f"  the failing cases: {apart}"] if apart else [])

    def failing_apart(self):
        """What sets the failing cases apart from the passing ones, when something does: each
        trait (a feature, the causal mask, Tq = Tk, the dtype) that every failing case of the run
        has and no passing one, or the other way round ("exactly those with softcap (10 of 38)");
        else ""."""
        runs = {}                                 # (case, dtype) -> (cases.Case, failed)
        for r in self.rows:
            if r.case_def is not None and r.verdict != "not supported":
                runs[r.case, r.dtype] = (r.case_def, runs.get((r.case, r.dtype), (None, False))[1] or r.failed)
        failing = [(c, d) for (_, d), (c, f) in runs.items() if f]
        passing = [(c, d) for (_, d), (c, f) in runs.items() if not f]
        if not failing or not passing:
            return ""
        traits = [(f"with {n}", f"without {n}", lambda c, d, n=n: c.get(n) is not None)
                  for n in dict.fromkeys(n for c, _ in failing + passing for n, _ in c.features)]
        traits += [("causal", "not causal", lambda c, d: c.causal),
                   ("with Tq = Tk", "with Tq != Tk", lambda c, d: c.tq == c.tk)]
        traits += [(f"in {d}", f"not in {d}", lambda c, dd, d=d: dd == d) for d in dict.fromkeys(d for _, d in failing)]
        said = []
        for yes, no, has in traits:
            on = {has(c, d) for c, d in failing}, {has(c, d) for c, d in passing}
            if on in (({True}, {False}), ({False}, {True})):
                said.append(yes if on[0] == {True} else no)
        if not said:
            return ""
        return (f"exactly those {' and '.join(said)} ({len(failing)} of {len(failing) + len(passing)} cases and "
                "dtypes fail; every other passes)")

    def convention(self):
        """When every failing row is diagnosed with one convention (`CONVENTIONS`: the causal
        alignment, the layout, lse's base, the scale argument): one sentence saying so once,
        with the flag or the change that fixes it; else None."""
        failing = self.failures
        ids = {r.diagnosis.id if r.diagnosis is not None else None for r in failing}
        if None in ids or not ids <= set(CONVENTIONS) or len({SAME_FIX.get(i, i) for i in ids}) != 1:
            return None
        if len(ids) > 1:                      # the causal mask's and a window's alignment: one flag
            other = _other(self.settings.get("align", "top-left"))
            said, own = f"{other} alignment, of the causal mask and the windows (the check assumed {_other(other)})", None
        else:
            said, own = _cause(failing[0].diagnosis.sentence)
        fix = own or CONVENTIONS[failing[0].diagnosis.id](self.settings)
        return f"every failing row ({len(failing)} of {len(self.rows)}) matches one convention: {said}; {fix}"

    def __repr__(self):
        return f"<Report {self.summary()}>"

    def __str__(self):
        """The failing rows, their diagnoses and the summary: ``assert report.passed, str(report)``."""
        return self._text()

    def _text(self, more=PYTHON_MORE):
        parts = []
        if self.failures:
            parts += ["failing rows:", self.table(self.failures)]
            if self.diagnoses:
                parts += ["", "diagnosis:"] + self.diagnosis_lines(more=more)
        if not any(r.passed or r.failed for r in self.rows):
            parts.append("no row passed: nothing was checked (every case was not supported)")
        if self.unsupported:
            parts += ["not supported, by reason:"] + [f"  {n} rows: {why}" for why, n in self.refusals().items()]
        parts += self.invariance_lines()
        parts.append(self.summary())
        return "\n".join(parts)

    def as_dict(self):
        counts = Counter(r.verdict for r in self.rows)
        return {"rows": [r.as_dict() for r in self.rows],
                "summary": {"target": self.target, "passed": self.passed, "rows": len(self.rows),
                            "pass": counts["pass"], "fail": counts["FAIL"],
                            "not_supported": counts["not supported"], "seconds": self.seconds,
                            "diagnosis": self.diagnosis, "failing_apart": self.failing_apart(), "gaps": self.gaps,
                            **self.settings},
                **({"invariance": [f.as_dict() for f in self.invariance]} if self.invariance else {})}

    def plot(self, directory):
        """A PNG per failing tensor with a located error: its error over the bound
        (log10, clipped at -2 .. 4) by row (query rows for out, lse, dq; key rows for dk,
        dv) and (batch, head), titled with its location signature.  Returns the paths."""
        import os
        import textwrap
        import numpy as np
        from parity_tests.common import plots
        paths = []
        for i, (r, d) in enumerate(self.diagnoses):
            if d.error_map is None or not d.where:
                continue
            m = np.log10(np.clip(np.nan_to_num(d.error_map, posinf=1e4), 1e-2, 1e4))
            name = "".join(c if c.isalnum() else "_" for c in f"{i:03d}_{r.case}_{r.dtype}_{r.tensor}")
            rows = "key" if r.tensor in ("dk", "dv") else "query"
            heads = r.dims["kv_heads"] if rows == "key" else r.dims["heads"]
            labels = [f"{b},{h}" for b in range(r.dims["batch"]) for h in range(heads)]
            labels = labels if len(labels) == m.shape[1] <= 16 else None
            paths.append(plots.heatmap(os.path.join(directory, name.strip("_") + ".png"), m,
                                       "\n".join(textwrap.wrap(d.where, 60)), labels=labels, vmin=-2, vmax=4, cmap="magma",
                                       axis_titles=("(batch, head)", f"{rows} row"), aspect="auto",
                                       suptitle=f"{r.case} {r.dtype} {r.tensor}: log10(error / bound)"))
        return paths

    def repro(self, directory, budget=None):
        """Shrink each distinct failing cause to the smallest case that still fails with it and
        write ``directory/<cause>/repro.py`` and ``inputs.npz`` (``parity_tests.kernels.repro``);
        returns a list of ``repro.Repro`` (``.line()`` says what was written where)."""
        from parity_tests.kernels import repro
        return repro.write_repros(self, directory, repro.BUDGET if budget is None else budget)

    def write_json(self, path):
        """The rows and the summary as JSON to ``path`` ("-": standard output)."""
        if path == "-":
            json.dump(self.as_dict(), sys.stdout, indent=1)
            print()
            return
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)
