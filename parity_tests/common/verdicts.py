"""Rows of claim / computed / chapter / verdict, shared by ``chapter``, ``jacobian``
and ``claims``.

A row is a 4-tuple of strings.  Four verdicts:

- ``pass``       the computed value agrees with what the chapter says or prints;
- ``imprecise``  it disagrees with the chapter's wording but agrees with the
                 precise statement given in the notes (the code is right, the
                 sentence is loose); still checked: it becomes FAIL otherwise;
- ``FAIL``       it agrees with neither: the verb exits with status 1;
- ``skip``       not comparable on this system (the chapter's dropout draws,
                 which it says may differ between operating systems).
"""

import sys

import numpy as np

from parity_tests.common import outputs, plots
from parity_tests.common.tables import format_table

PASS, IMPRECISE, FAIL, SKIP = "pass", "imprecise", "FAIL", "skip"
HEADERS = ("claim", "computed", "chapter", "verdict")


def verdict(ok):
    return PASS if ok else FAIL


def loose(chapter_holds, precise_holds):
    """Verdict of a sentence the chapter words loosely: ``pass`` when it holds as
    written, ``imprecise`` when only the precise statement holds, else ``FAIL``."""
    if chapter_holds:
        return PASS
    return IMPRECISE if precise_holds else FAIL


def fmt(x, decimals=4):
    """A number or an array, printed the way the chapter prints tensors."""
    a = np.asarray(x, dtype=float)
    if a.ndim == 0:
        v = float(a)
        if v != 0 and (abs(v) < 10.0 ** -decimals or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.{decimals}f}"
    return np.array2string(a, precision=decimals, floatmode="fixed", separator=", ",
                           max_line_width=10_000, threshold=10_000)


def sci(x):
    return f"{float(x):.2e}"


def print_section(title, rows):
    print(f"== {title}")
    print(format_table(HEADERS, rows))
    print()


def summary(rows):
    counts = {v: sum(r[3] == v for r in rows) for v in (PASS, IMPRECISE, FAIL, SKIP)}
    parts = [f"{counts[PASS]} pass"]
    if counts[IMPRECISE]:
        parts.append(f"{counts[IMPRECISE]} imprecise (the chapter's wording, see the notes)")
    if counts[SKIP]:
        parts.append(f"{counts[SKIP]} skip")
    parts.append(f"{counts[FAIL]} FAIL")
    return f"{len(rows)} checks: " + ", ".join(parts)


def exit_status(rows):
    return 1 if any(r[3] == FAIL for r in rows) else 0


def parse_verb_args(parse_args, argv):
    """A verb's ``(args, None)`` when it can run, else ``(None, exit status)``:
    0 after --help, 2 for a refused argument, --plot without matplotlib, or a
    ``--plot DIR`` / ``--json PATH`` that cannot be written (checked before any work)."""
    try:
        args = parse_args([] if argv is None else list(argv))
    except SystemExit as e:
        return None, int(e.code or 0)
    plot_dir, json_path = getattr(args, "plot", None), getattr(args, "json", None)
    status = plots.check_available(plot_dir)
    if status is not None:
        return None, status
    problem = outputs.output_file_problem("--json", json_path)
    if problem:
        print(f"attention-parity: error: {problem}", file=sys.stderr)
        return None, 2
    return args, None
