"""The README's example output comes from real runs, and stays true.

Every plain fenced block of README.md that shows output of the command is rerun:

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

- a block opening with ``$ attention-parity backprop``, ``grade --list`` or
  ``check`` on a built-in target is that command's output: every line it shows
  (but elisions and the seconds of a summary) is a line of the real output.

The bench table is left out: its figures belong to a machine (the README says so);
so are the blocks that need a file of the reader's (``grade FILE``, ``check
module:callable``).
"""

import contextlib
import functools
import io
import pathlib
import re
import shlex

import pytest

from parity_tests import cli

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
SUMMARY = re.compile(r"^(\d+) rows, (\d+) passed, (\d+) failed in [\d.]+ s (\(.*\))$")
CHAPTER_VERBS = ("chapter", "jacobian", "claims")

# Blocks whose figures predate a change of the command's rows (keyed by their first
# line).  Each fails today; strict, so that once README.md shows a real run again
# the mark itself fails and must be removed.
STALE = {}


def _blocks():
    """The plain (no language) fenced blocks of README.md, as lists of lines."""
    blocks, current = [], None
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current = [] if line.strip() == "```" else False
            else:
                if current:
                    blocks.append(current)
                current = None
        elif current is not False and current is not None:
            current.append(line)
    return [b for b in blocks if any(SUMMARY.match(l) or " checks: " in l for l in b)
            or _verb_argv(b) is not None]


def _verb_argv(block):
    """The argv of a block showing a verb's output that needs no file of the reader's."""
    if not block[0].startswith("$ attention-parity "):
        return None
    argv = shlex.split(block[0][2:])[1:]
    if argv[:1] == ["backprop"] or argv[:2] == ["grade", "--list"]:
        return tuple(argv)
    if argv[:1] == ["check"] and len(argv) > 1 and ":" not in argv[1]:
        return tuple(argv)
    return None


def _untimed(line):
    return re.sub(r" in [\d.]+ s\b", " in - s", line)


def _cells(line):
    return tuple(c for c in re.split(r"\s{2,}", line.strip()) if c)


@functools.lru_cache(maxsize=None)
def _output(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        cli.main(list(argv))
    return out.getvalue()


def _rows_of(output):
    return {_cells(l) for l in output.splitlines() if l.strip()}


# A figure in scientific notation (an error, a baseline) or with two decimals (a
# ratio of errors) measures rounding, which belongs to the machine: the BLAS kernel
# and its summation order move it by a factor of a few.  Such a cell matches a
# real one within ROUNDING_SPREAD, or when both sit at float64's rounding level;
# where the largest rounding error sits ("b, h, row") matches any such place; a time
# ratio ("×1.17", the time/SDPA column) matches any other, or none ("-").
ROUNDING_SPREAD = 10.0
ROUNDING_LEVEL = 1e-14
_ROUNDING_FIGURE = re.compile(r"^-?(\d\.\d+e[+-]\d\d|\d+\.\d\d)$")
_PLACE = re.compile(r"^\d+, \d+, \d+$")


def _same_cell(shown, real):
    if shown == real or (_PLACE.match(shown) and _PLACE.match(real)):
        return True
    if "×" in shown[:1] + real[:1] and {shown[:1], real[:1]} <= {"×", "-"}:   # a time ratio, or none
        return True                                         # below a millisecond: the machine's
    words, real_words = shown.split(), real.split()
    if len(words) > 1 and len(words) == len(real_words):   # a sentence: word by word
        return all(_same_cell(a.rstrip(",:;"), b.rstrip(",:;")) for a, b in zip(words, real_words))
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
            assert shown in outputs[verb.group(1)].splitlines(), (line, verb.group(1))
        else:
            assert _is_row_of(_cells(line), every_row), f"not a row of the chapter verbs: {line}"


def _check_verb_block(block):
    argv = _verb_argv(block)
    real = {_cells(_untimed(l)) for l in _output(argv).splitlines() if l.strip()}
    for line in block[1:]:
        if "..." in line or not line.strip("- "):
            continue                       # an elision, a blank or a rule
        assert _is_row_of(_cells(_untimed(line)), real), f"not a line of `attention-parity {' '.join(argv)}`: {line}"


def _params():
    for block in _blocks():
        marks = [pytest.mark.xfail(strict=True, reason=STALE[block[0]])] if block[0] in STALE else []
        yield pytest.param(block, marks=marks, id=block[0][:40])


@pytest.mark.parametrize("block", list(_params()))
def test_readme_example_is_a_real_run(block):
    if _verb_argv(block) is not None:
        _check_verb_block(block)
    elif any(SUMMARY.match(l) for l in block):
        _check_matrix_block(block)
    else:
        _check_chapter_block(block)


def test_the_readme_has_examples_to_check():
    blocks = _blocks()
    assert len(blocks) >= 3
    assert any(l.startswith("$ attention-parity --plant-fault") for b in blocks for l in b)
