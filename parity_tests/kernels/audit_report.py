"""What an audit found (``audit``): the suggestion derived from the correct kernels' own errors,
the report, its table, its sentence and its JSON.

The suggestion: per dtype and tensor, among the rtols tried (`RTOLS` and ``assert_close``'s
default for the dtype), each with the smallest atol that accepts every correct kernel at these
shapes, the pair that rejects the most mistakes there (the smaller atol on a tie); then the
mistakes that pass every tensor's pair -- what an elementwise tolerance cannot catch here, and
``check``'s bound beside it.
"""

import json
import math
import sys

import numpy as np

from parity_tests.common.tables import format_table

__all__ = ["AuditReport", "suggest", "write", "ASSERT_CLOSE", "RTOLS"]

# assert_close's own defaults (torch.testing), per dtype: what --matched-ratio uses without --atol/--rtol
ASSERT_CLOSE = {"float64": (1e-7, 1e-7), "float32": (1e-5, 1.3e-6), "bfloat16": (1e-5, 1.6e-2),
                "float16": (1e-5, 1e-3)}
# rtol values the suggestion tries (with assert_close's default for the dtype), each with the
# smallest atol that accepts every correct kernel
RTOLS = (0.0, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)


# ----------------------------------------------------------------------------
# The suggestion

def _needed_atol(gaps, rtol):
    """The smallest atol with |a − b| <= atol + rtol·|b| everywhere in ``gaps``."""
    need = 0.0
    for d, b in gaps:
        if d.size:
            need = max(need, float(np.max(d - rtol * b)))
    return _round_up(max(need, 0.0))


def _round_up(x):
    """``x`` rounded up to two significant digits (0 stays 0)."""
    if x == 0 or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x)) - 1
    up = math.ceil(x / 10 ** e - 1e-9) * 10 ** e
    short = float(f"{up:.2g}")                   # 0.7, not 0.7000000000000001
    return short if short >= x else up


def _accepts(gaps, atol, rtol):
    return all(not d.size or bool(np.all(d <= atol + rtol * b)) for d, b in gaps)


def suggest(kernels):
    """``{dtype: {tensor: (atol, rtol)}}`` and ``{dtype: [mistakes it misses]}``: per dtype and
    tensor, among the rtols tried (`RTOLS` and assert_close's default), each with the smallest
    atol that accepts every correct kernel, the pair that rejects the most mistakes there (the
    smaller atol on a tie); then the mistakes that pass every tensor's pair."""
    right = [k for k in kernels if k.kind == "correct" and k.ran]
    wrong = [k for k in kernels if k.kind == "mistake" and k.caught_by_check]
    pairs, misses = {}, {}
    for dtype, n in dict.fromkeys(key for k in right for key in k.diffs):
        gaps = [g for k in right for g in k.diffs.get((dtype, n), [])]
        best = None
        for rtol in sorted(set(RTOLS) | {ASSERT_CLOSE[dtype][1]}):
            atol = _needed_atol(gaps, rtol)
            if not math.isfinite(atol):
                continue
            caught = sum(not _accepts(k.diffs.get((dtype, n), []), atol, rtol) for k in wrong)
            if best is None or (caught, -atol) > (best[0], -best[1]):
                best = (caught, atol, rtol)
        if best is not None:
            pairs.setdefault(dtype, {})[n] = (best[1], best[2])
    for dtype, pair in pairs.items():
        misses[dtype] = [k.name for k in wrong if any((dtype, n) in k.diffs for n in pair)
                         and dtype not in k.errored and all(_accepts(k.diffs.get((dtype, n), []), *pair[n]) for n in pair)]
    return pairs, misses


# ----------------------------------------------------------------------------
# The report

class AuditReport:
    """What an audit found: ``.mistakes`` and ``.correct`` (`Kernel`s that ran), ``.missed`` (the
    mistakes the rule accepts, among those that show at these shapes), ``.unseen`` (the mistakes
    that do not show here: check's bound misses them too, a causal-only backward slip on
    causal cases, say), ``.rejected`` (the correct kernels it rejects), ``.passed`` (none missed,
    none rejected), ``.suggested`` (``{dtype: {tensor: (atol, rtol)}}``) and ``.suggested_misses``."""

    def __init__(self, rule, kernels, seconds, settings):
        self.rule, self.seconds, self.settings = rule, seconds, settings
        self.mistakes = [k for k in kernels if k.kind == "mistake" and k.ran]
        self.correct = [k for k in kernels if k.kind == "correct" and k.ran]
        self.never_ran = [k.name for k in kernels if not k.ran]
        self.suggested, self.suggested_misses = suggest(kernels)

    @property
    def shown(self):
        """The mistakes that show at these shapes: check's bound catches them."""
        return [k for k in self.mistakes if k.caught_by_check]

    @property
    def unseen(self):
        return [k for k in self.mistakes if not k.caught_by_check]

    @property
    def missed(self):
        return [k for k in self.shown if k.accepted]

    @property
    def rejected(self):
        return [k for k in self.correct if not k.accepted]

    @property
    def passed(self):
        return not self.missed and not self.rejected and bool(self.shown)

    def sentence(self):
        missed, rejected = self.missed, self.rejected
        text = f"your rule misses {len(missed)} of {len(self.shown)} catalogued mistakes at these shapes"
        if missed:
            worst = max(missed, key=lambda k: k.worst[0])
            text += f" (largest: {worst.name}, {_times(worst.worst[0])} x check's bound on {worst.worst[1]})"
        text += f"; it rejects {len(rejected)} of {len(self.correct)} correct kernels"
        if self.unseen:
            one = len(self.unseen) == 1
            text += (f" ({len(self.unseen)} more {'mistake does' if one else 'mistakes do'} not show at these "
                     f"shapes, check's bound misses {'it' if one else 'them'} too: "
                     f"{', '.join(k.name for k in self.unseen)})")
        return text

    def table(self):
        rows = []
        for k in self.mistakes + self.correct:
            if k.kind == "mistake" and not k.caught_by_check:
                rule = "accepts" if k.accepted else f"rejects ({k.rejected_on})"
                check = "misses: does not show here"
            elif k.kind == "mistake":
                rule = "MISSED: accepts" if k.accepted else f"rejects ({k.rejected_on})"
                check = "catches"
            else:
                rule = "accepts" if k.accepted else f"REJECTS ({k.rejected_on})"
                check = "FAILS" if k.caught_by_check else "passes"
            rows.append([k.kind, k.name, rule, check, _times(k.worst[0]), str(k.cases)])
        return format_table(("kind", "kernel", "your rule", "check's bound", "error/bound", "cases"), rows)

    def suggestion_lines(self):
        lines = []
        for dtype, pairs in self.suggested.items():
            said = ", ".join(f"{n} atol={a:.2g} rtol={r:.2g}" for n, (a, r) in pairs.items())
            lines.append(f"  {dtype}: {said}")
            misses = self.suggested_misses.get(dtype, [])
            lines.append(f"    even that misses {len(misses)} of {len(self.shown)}: {', '.join(misses)}"
                         if misses else "    and that catches every mistake here")
        return lines

    def render(self):
        ref = self.settings["reference"]
        parts = [f"audit of {self.rule} against the {ref} reference "
                 f"({self.settings['device']}; {', '.join(self.settings['dtypes'])}; "
                 f"{self.settings['cases']} cases; {self.seconds:.1f} s)", "", self.table()]
        if self.suggested:
            parts += ["", "suggested: per tensor, the atol/rtol that rejects no correct kernel here and the most "
                          "mistakes, and what even that lets through:"] + self.suggestion_lines()
        if self.never_ran:
            parts += ["", "never ran (refused every case): " + ", ".join(self.never_ran)]
        parts += ["", self.sentence()]
        return "\n".join(parts)

    __str__ = render

    def __repr__(self):
        return f"<AuditReport {self.sentence()}>"

    def as_dict(self):
        return {"rule": self.rule,
                "mistakes": [{"name": k.name, "accepted": k.accepted, "caught_by_check": k.caught_by_check,
                              "missed": k.accepted and k.caught_by_check,
                              "diagnosis": k.diagnosis, "worst_over_bound": _num(k.worst[0]),
                              "rejected_on": k.rejected_on, "cases": k.cases} for k in self.mistakes],
                "correct": [{"name": k.name, "accepted": k.accepted, "caught_by_check": k.caught_by_check,
                             "rejected_on": k.rejected_on, "cases": k.cases} for k in self.correct],
                "suggested": {"atol": {d: {n: p[0] for n, p in ps.items()} for d, ps in self.suggested.items()},
                              "rtol": {d: {n: p[1] for n, p in ps.items()} for d, ps in self.suggested.items()},
                              "misses": self.suggested_misses},
                "summary": {"passed": self.passed, "sentence": self.sentence(), "seconds": self.seconds,
                            **self.settings}}

    def write_json(self, path):
        """The findings as JSON to ``path`` ("-": standard output)."""
        write(path, self.as_dict())


def write(path, data):
    """``data`` as JSON to ``path`` (\"-\": standard output)."""
    if path == "-":
        json.dump(data, sys.stdout, indent=1)
        print()
        return
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _num(x):
    return None if x is None or not math.isfinite(x) else float(x)


def _times(x):
    return "inf" if not math.isfinite(x) else f"{x:.2g}" if x < 100 else f"{x:.0f}"
