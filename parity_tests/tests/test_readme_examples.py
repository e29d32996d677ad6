"""The README's and the docs' example output comes from real runs, and stays true.

Every plain fenced block of README.md and of each page of docs/ that shows output of the
command is rerun:

- a block with a ``$ attention-parity ...`` line is that command's output;
  otherwise a block of matrix rows is the default ``attention-parity`` run;
- each row it shows (cells separated by two or more spaces) must be a row of the
  real output, every cell equal but the rounding figures (see `_same_cell`);
  lines with ``...`` are elisions and skipped;
- its summary line must give the same counts (``N rows, P passed, F failed``,
  devices and dtypes; the seconds are the machine's);
- a ``N checks: ...`` line ending in ``(chapter)`` / ``(claims)`` must be that
  verb's summary, and every other row of such a block must appear in the output
  of one of the chapter verbs.

- a block opening with ``$ attention-parity backprop``, ``grade --list``, ``grade
  --template`` or ``check`` is that command's output: every line it shows (but elisions
  and the seconds of a summary) is a line of the real output.  A ``check`` target is a
  built-in one, a module of this repository (``parity_tests.tests.kernels...``), or the
  reader's file that a ``python`` block earlier on the same page defines (written to a
  temporary folder, as the reader would save it; `READER_EDITS` for one the text
  describes as an edit of another);
- a block opening with ``$ attention-parity grade FILE.py`` grades the exercise's
  solution, or, when the block names a mistake (``[softmax-diagonal-only]``), the
  solution with that mistake written in (``tests/lab/mutations.py``);
- a block that a ``python`` block "prints" is what that block prints.

A verb's block whose summary shows more seconds than its page's `SLOW_FROM` runs with ``-m
slow``.  Left out: the bench tables (their figures belong to a machine, the pages say so), the
``--world-size`` runs (``tests/ranks/test_readme_ranks.py`` holds them) and ``python -m
parity_tests check`` runs of a long grid.
"""

import contextlib
import functools
import importlib.util
import io
import os
import pathlib
import re
import shlex
import shutil
import sys
import tempfile

import pytest

from parity_tests import cli
from parity_tests.chapter.replay_causal import draws_the_chapters_mask
from parity_tests.common import chapter_values

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))
SOLUTIONS = ROOT / "parity_tests" / "lab" / "exercises" / "solutions"
sys.path.insert(0, str(pathlib.Path(__file__).parent / "lab"))
from mutations import MUTATIONS, mutate  # noqa: E402
from needs import needs  # noqa: E402

# A shown run slower than this (its summary's seconds) runs with -m slow: the README's blocks up
# to 10 s stay in every run (the floor and the newest release too), the docs' up to 0.5 s.
SLOW_FROM = {"README.md": 10.0}
SLOW_FROM_DOCS = 0.5
# The reader's files the text describes as an edit of another: name -> (the file, edits).
READER_EDITS = {
    "gqa_window_tiled": ("gqa_window", [("k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)",
                                         "k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)")]),
    "fp8_attention_tiled": ("fp8_attention", [("q_descale.repeat_interleave(group, 1)", "q_descale.repeat(1, group)")]),
}
SUMMARY = re.compile(r"^(\d+) rows, (\d+) passed, (\d+) failed in [\d.]+ s (\(.*\))$")
CHAPTER_VERBS = ("chapter", "jacobian", "claims")

# Blocks whose figures predate a change of the command's rows (keyed by their first
# line).  Each fails today; strict, so that once README.md shows a real run again
# the mark itself fails and must be removed.
STALE = {}


def _fenced(path):
    """Every fenced block of a page: (language, lines, the text before it)."""
    blocks, current, lang, before = [], None, None, []
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current, lang = [], line[3:].strip()
            else:
                blocks.append((lang, current, "\n".join(before[-3:])))
                current, before = None, []
        elif current is not None:
            current.append(line)
        else:
            before.append(line)
    return blocks


def _blocks():
    """The plain fenced blocks of README.md and docs/*.md that show output, as
    (page, lines, python source of the reader's files before it, printing python or None)."""
    found = []
    for path in PAGES:
        sources, previous = [], None
        for lang, lines, before in _fenced(path):
            if lang == "python":
                sources.append("\n".join(lines))
            elif lang == "" and lines:
                printer = previous if previous and before.strip().endswith("prints") else None
                if printer or any(SUMMARY.match(l) or " checks: " in l for l in lines) or \
                        _verb_argv(lines) is not None or _grade_file(lines) is not None:
                    found.append((path.relative_to(ROOT), lines, tuple(sources), printer))
            previous = "\n".join(lines) if lang == "python" else None
    return found


def _verb_argv(block):
    """The argv of a block showing a verb's output that we can run again."""
    if not block[0].startswith("$ attention-parity "):
        return None
    argv = shlex.split(block[0][2:])[1:]
    if argv[:1] == ["backprop"] or argv[:2] in (["grade", "--list"], ["grade", "--template"]):
        return tuple(argv)
    if argv[:1] == ["check"] and len(argv) > 1 and "--world-size" not in argv:
        return tuple(argv)
    if argv[:1] == ["audit"] and "-" not in argv:
        return tuple(argv)
    return None


def _grade_file(block):
    """(file, the description of its exercise) of a ``grade FILE.py`` block, or None."""
    argv = shlex.split(block[0][2:]) if block[0].startswith("$ attention-parity grade ") else []
    if len(argv) != 3 or not argv[2].endswith(".py") or len(block) < 2:
        return None
    header = re.match(r"^== .+? from (\S+): (.+)$", block[1])
    return (argv[2], header.group(2)) if header else None


def _seconds(block):
    """The seconds a block's run shows: a check's "in 1.3 s (", an audit's "; 9 cases; 1.5 s)"."""
    found = [re.search(r" in ([\d.]+) s \(|cases; ([\d.]+) s\)", line) for line in block]
    shown = [float(m.group(1) or m.group(2)) for m in found if m]
    return max(shown, default=0.0)


def _untimed(line):
    """``line`` with its seconds ("in 1.3 s", "6 runs, 0.1 s)") as "- s", where its largest
    error of rounding level sits left out, and an invariance's counts of elements and ulps
    as letters: they are the machine's."""
    line = _ROUNDING_PLACE.sub(lambda m: m.group(1) + ")" if float(m.group(2)) <= ROUNDING_LEVEL else m.group(0), line)
    line = _INVARIANCE_COUNTS.sub("N of M elements, up to X ulp", line)
    return re.sub(r"(?<=[ (])[\d.]+ s\b", "- s", line)


def _cells(line):
    return tuple(c for c in re.split(r"\s{2,}", line.strip()) if c)


@functools.lru_cache(maxsize=None)
def _output(argv, files=(), cwd=None):
    """stdout of ``attention-parity argv``, run in ``cwd`` (importable, as the current
    directory is to the command) after writing ``files`` ((name, source) pairs) there."""
    out = io.StringIO()
    here = os.getcwd()
    folder = cwd or tempfile.mkdtemp(prefix="readme-example-")
    for name, source in files:
        pathlib.Path(folder, name).write_text(source)
    sys.path.insert(0, folder)
    try:
        os.chdir(folder)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            cli.main(list(argv))
    finally:
        os.chdir(here)
        sys.path.remove(folder)
        for name, _ in files:
            sys.modules.pop(name[:-3], None)
        if cwd is None:
            shutil.rmtree(folder, ignore_errors=True)
    return out.getvalue()


def _reader_files(argv, sources):
    """The reader's module a ``check`` target names, from the page's python blocks: ((name.py,
    source),), or () for a built-in target or a module of this repository."""
    target = next((a for a in argv[1:] if ":" in a), None)
    if target is None:
        return ()
    module, fn = target.split(":", 1)
    try:
        if importlib.util.find_spec(module) is not None:
            return ()
    except ModuleNotFoundError:
        pass
    base, edits = READER_EDITS.get(module, (module, []))
    defining = [s for s in sources if re.search(rf"^def {re.escape(fn)}\(", s, re.M)]
    assert defining, f"no python block on the page defines {fn} for `{module}`"
    return ((f"{module}.py", mutate(defining[-1], edits)),)


def _rows_of(output):
    return {_cells(l) for l in output.splitlines() if l.strip()}


# A figure in scientific notation (an error, a baseline) or with two decimals (a
# ratio of errors) measures rounding, which belongs to the machine: the BLAS kernel,
# its summation order and the PyTorch release move it by a factor of a few.  Such a
# cell matches a real one within ROUNDING_SPREAD, or when both sit at or below
# float64's bound (FLOAT64_BOUND, 1e-10: float64 rounding and finite differences'
# rounding, ~1e-11, both land there; a mistake lands at 5e-3 and up); where the largest
# rounding error sits ("b, h, row", or a sentence's "(largest error 5.2e-15, WHERE)")
# matches any such place; a time ratio ("×1.17", the time/SDPA column) matches any
# other, or none ("-").
ROUNDING_SPREAD = 10.0
ROUNDING_LEVEL = 1e-10
_ROUNDING_PLACE = re.compile(r"(largest error (\d\.\de[+-]\d\d)), .*\)$")
# --invariance: how many elements differ and by how many ulps is the machine's rounding too
_INVARIANCE_COUNTS = re.compile(r"\d+ of \d+ elements, up to [\d.e+]+ ulp")
_ROUNDING_FIGURE = re.compile(r"^-?(\d\.\d+e[+-]\d\d|\d+\.\d\d)$")
_PLACE = re.compile(r"^\d+, \d+, \d+$")


def _same_cell(shown, real):
    if shown == real or (_PLACE.match(shown) and _PLACE.match(real)):
        return True
    if "×" in shown[:1] + real[:1] and {shown[:1], real[:1]} <= {"×", "-"}:   # a time ratio, or none
        return True                                         # below a millisecond: the machine's
    words, real_words = shown.split(), real.split()
    if len(words) > 1 and len(words) == len(real_words):   # a sentence: word by word
        return all(_same_cell(a.strip("(),:;"), b.strip("(),:;")) for a, b in zip(words, real_words))
    if not (_ROUNDING_FIGURE.match(shown) and _ROUNDING_FIGURE.match(real)):
        return False
    a, b = abs(float(shown)), abs(float(real))
    if max(a, b) <= ROUNDING_LEVEL:
        return True
    return min(a, b) > 0 and max(a, b) / min(a, b) <= ROUNDING_SPREAD


def _is_row_of(cells, real):
    """``cells`` is one of the ``real`` rows: same length, every cell the same (`_same_cell`)."""
    return cells in real or any(len(r) == len(cells) and all(map(_same_cell, cells, r)) for r in real)


def _check_matrix_block(block):
    commands = [l[2:] for l in block if l.startswith("$ ")]
    argv = tuple(shlex.split(commands[0])[1:]) if commands else ()
    output = _output(argv)
    real = _rows_of(output)
    summary = next(SUMMARY.match(l) for l in output.splitlines()[::-1] if SUMMARY.match(l))
    for line in block:
        if line.startswith("$ ") or "..." in line or not line.strip("- "):
            continue                       # a command, an elision, a blank or a rule
        shown = SUMMARY.match(line)
        if shown:
            assert shown.groups()[:3] == summary.groups()[:3], (line, summary.group(0))
            assert shown.group(4) == summary.group(4), (line, summary.group(0))
        elif _cells(line)[0] != "module":
            assert _is_row_of(_cells(line), real), f"not a row of `attention-parity {' '.join(argv)}`: {line}"


def _check_chapter_block(block):
    outputs = {verb: _output((verb,)) for verb in CHAPTER_VERBS}
    every_row = set().union(*(_rows_of(o) for o in outputs.values()))
    for line in block:
        if "..." in line or not line.strip():
            continue
        verb = re.search(r"\((\w+)\)\s*$", line)
        if " checks: " in line and verb:
            shown = line[:verb.start()].strip()
            if verb.group(1) == "chapter" and not draws_the_chapters_mask(chapter_values):
                continue                   # before PyTorch 2.7 the dropout rows skip (test_chapter.py)
            assert shown in outputs[verb.group(1)].splitlines(), (line, verb.group(1))
        else:
            assert _is_row_of(_cells(line), every_row), f"not a row of the chapter verbs: {line}"


def _check_verb_block(block, sources=()):
    argv = _verb_argv(block)
    files = _reader_files(argv, sources) if argv[0] == "check" else ()
    real = {_cells(_untimed(l)) for l in _output(argv, files).splitlines() if l.strip()}
    for line in block[1:]:
        if "..." in line or not line.strip("- "):
            continue                       # an elision, a blank or a rule
        assert _is_row_of(_cells(_untimed(line)), real), f"not a line of `attention-parity {' '.join(argv)}`: {line}"


def _exercise(description):
    listing = _output(("grade", "--list"))
    names = [l.split()[0] for l in listing.splitlines()[1:] if l.strip() and description in l]
    assert len(names) == 1, f"no exercise described as {description!r} in grade --list"
    return names[0]


def _check_grade_block(block):
    name, description = _grade_file(block)
    exercise = _exercise(description)
    source = (SOLUTIONS / f"{exercise}.py").read_text()
    named = re.search(r"  \[([\w-]+)\]$", "\n".join(block), re.M)
    if named:
        source = mutate(source, MUTATIONS[exercise][named.group(1)])
    real = {_cells(l) for l in _output(("grade", name), ((name, source),)).splitlines() if l.strip()}
    for line in block[1:]:
        if "..." in line or not line.strip():
            continue
        assert _is_row_of(_cells(line), real), f"not a line of `attention-parity grade {name}`: {line}"


def _check_printed_block(block, printer):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(printer, "<the page's python block>", "exec"), {"__name__": "__page__"})
    real = {tuple(_words(l)) for l in out.getvalue().splitlines() if l.strip()}
    for line in block:
        shown = tuple(_words(line))
        assert shown in real or any(len(r) == len(shown) and all(map(_same_cell, shown, r)) for r in real), \
            f"not a line the python block prints: {line}"


def _words(line):
    """A printed line's words, brackets and commas apart, so that each figure is a cell."""
    return re.sub(r"[\[\](){}',:]", " ", line).split()


def _needs(block):
    """What of PyTorch's a shown ``check`` run used (the pages show runs on the newest release):
    its built-in target's (`targets.NEEDS`), SDPA's ``enable_gqa`` for gqa (the target's, or the
    SDPA yardstick's err/SDPA), float16 on the CPU; an audit's, SDPA as 2.5 and later run it."""
    from parity_tests.kernels import targets
    argv = _verb_argv(block)
    if argv is not None and argv[0] == "audit":       # SDPA's backends among its correct kernels, as
        return ("enable_gqa", "sdpa_zero_rows")       # releases since 2.5 run them
    if argv is None or argv[0] != "check":
        return ()
    features = " ".join(a for a, flag in zip(argv[1:], argv) if flag == "--features")
    return targets.NEEDS.get(argv[1], ()) + (("enable_gqa",) if "gqa" in features else ()) + \
        (("cpu_float16_matmul",) if any(d in argv for d in ("float16", "fp16", "f16", "half")) else ())


def _params():
    for page, block, sources, printer in _blocks():
        marks = [pytest.mark.xfail(strict=True, reason=STALE[block[0]])] if block[0] in STALE else []
        marks.append(needs(*_needs(block)))
        slow_from = SLOW_FROM.get(str(page), SLOW_FROM_DOCS)
        if _verb_argv(block) is not None and _seconds(block) > slow_from:     # the matrix: always
            marks.append(pytest.mark.slow)
        yield pytest.param(block, sources, printer, marks=marks, id=f"{page}: {block[0][:40]}")


@pytest.mark.parametrize("block, sources, printer", list(_params()))
def test_readme_example_is_a_real_run(block, sources, printer):
    if printer is not None:
        _check_printed_block(block, printer)
    elif _grade_file(block) is not None:
        _check_grade_block(block)
    elif _verb_argv(block) is not None:
        _check_verb_block(block, sources)
    elif any(SUMMARY.match(l) for l in block):
        _check_matrix_block(block)
    else:
        _check_chapter_block(block)


def test_the_readme_has_examples_to_check():
    blocks = [b for page, b, _, _ in _blocks() if page == README.relative_to(ROOT)]
    assert len(blocks) >= 3
    assert any(l.startswith("$ attention-parity --plant-fault") for b in blocks for l in b)
    assert any(l.startswith("$ attention-parity check ") for b in blocks for l in b)
    assert any(l.startswith("$ attention-parity grade ") for b in blocks for l in b)


def test_every_page_of_docs_is_read():
    pages = {page for page, _, _, _ in _blocks()}
    for name in ("check.md", "features.md", "serving.md", "lab.md", "parity.md", "chapter.md", "blockwise.md",
                 "reference.md"):
        assert pathlib.Path("docs", name) in pages, name


@pytest.mark.parametrize("shown, real, same", [
    ("to 2.6e-07 (bound 2.3e-06); where: rows 1 .. 127", "to 2.2e-07 (bound 2.6e-06); where: rows 1 .. 127", True),
    ("to 2.6e-07 (bound 2.3e-06); where: rows 1 .. 127", "to 2.6e-07 (bound 2.3e-04); where: rows 1 .. 127", False),
    ("to 2.6e-07 (bound 2.3e-06); where: rows 1 .. 127", "to 2.6e-07 (bound 2.3e-06); where: rows 0 .. 127", False),
    ("(from B1 H2 T17 D32 full, 6 runs, 0.1 s)", "(from B1 H2 T17 D32 full, 6 runs, 0.0 s)", True),
    ("(from B1 H2 T17 D32 full, 6 runs, 0.1 s)", "(from B1 H2 T17 D32 full, 7 runs, 0.1 s)", False),
    ("44 rows, 36 pass in 1.3 s (cpu)", "44 rows, 36 pass in 0.7 s (cpu)", True),
])
def test_a_shown_line_matches_a_real_one_but_for_rounding_and_seconds(shown, real, same):
    assert _is_row_of(_cells(_untimed(shown)), {_cells(_untimed(real))}) is same
