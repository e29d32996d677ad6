"""The "Beyond one device" page's blocks (docs/ranks.md) are real runs: each ``$ python -m parity_tests check
... --world-size`` block is run again, and every line it shows (but elisions, and the seconds
of the summary) must be a line of the real output, figures of rounding within a factor 10
(as ``test_readme_examples`` holds the other blocks: that test leaves module:callable blocks out)."""

import contextlib
import io
import pathlib
import re
import shlex

import pytest

from parity_tests import cli

PAGE = pathlib.Path(__file__).resolve().parents[3] / "docs" / "ranks.md"
FIGURE = re.compile(r"^-?(\d\.\d+e[+-]\d\d|\d+\.\d\d)$")
PLACE = re.compile(r"^\d+, \d+, \d+$")


def _blocks():
    text = PAGE.read_text()
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return [b for b in blocks if b and b[0].startswith("$ python -m parity_tests check")]


def _cells(line):
    line = re.sub(r" in [\d.]+ s\b", " in - s", line)
    return [c for c in re.split(r"\s{2,}", line.strip()) if c]


def _same(shown, real):
    if shown == real or (PLACE.match(shown) and PLACE.match(real)):
        return True
    if not (FIGURE.match(shown) and FIGURE.match(real)):
        return False
    a, b = abs(float(shown)), abs(float(real))
    return min(a, b) > 0 and max(a, b) / min(a, b) <= 10


def _line_in(shown, real_lines):
    cells = _cells(shown)
    return any(len(r) == len(cells) and all(map(_same, cells, r)) for r in real_lines)


def test_the_section_has_its_runs():
    assert len(_blocks()) == 2


@pytest.mark.slow
@pytest.mark.parametrize("block", _blocks(), ids=lambda b: b[0][:60])
def test_a_block_of_the_section_is_a_real_run(block):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        cli.main(shlex.split(block[0][2:])[3:])
    real = [_cells(l) for l in out.getvalue().splitlines() if l.strip()]
    for line in block[1:]:
        if "..." in line or not line.strip("- "):
            continue
        if line.strip().startswith("B1 ") and ": " in line:          # a diagnosis: its words, figures aside
            words = lambda s: re.sub(r"\d\.\d+e[+-]\d\d", "#", s.strip())
            assert words(line) in {words(l) for l in out.getvalue().splitlines()}, line
            continue
        assert _line_in(line, real), f"not a line of the real run: {line}"
