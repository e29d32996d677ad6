"""A module docstring as a verb's ``--help`` text: plain words, no reStructuredText.

The verbs' docstrings are written for readers of the code (``literal``,
`reference`, ``::`` before a block); their ``--help`` shows the same text to a
user at a terminal, where that markup is noise.  `plain` removes it; the first
line, when it is only the verb's usage as a literal, is dropped too: argparse
prints its own ``usage:`` line right above.
"""

import argparse
import re

_LITERAL = re.compile(r"``(.+?)``", re.S)
_REFERENCE = re.compile(r"(?<![\w`])`([^`\n]+?)`(?![\w`])")


def plain(doc):
    """``doc`` without reST markup: ``x`` and `x` become x, a closing ``::`` becomes ``:``."""
    text = (doc or "").strip("\n")
    lines = text.splitlines()
    if lines and _LITERAL.fullmatch(lines[0].strip()):
        text = "\n".join(lines[1:]).strip("\n")
    text = _LITERAL.sub(r"\1", text)
    text = _REFERENCE.sub(r"\1", text)
    text = re.sub(r"(\S)::$", r"\1:", text, flags=re.M)      # "with ...::" -> "with ...:"
    return re.sub(r"^\s*::$\n?", "", text, flags=re.M)        # a lone "::" line goes


class Parser(argparse.ArgumentParser):
    """A verb's parser that names the page explaining the verb (``page``, e.g.
    ``docs/lab.md#...``) in every usage error, ``error: argument --x: ... (see docs/...)``,
    and, unless given another epilog, at the foot of ``--help`` (``More: docs/...``)."""

    def __init__(self, *args, page, **kwargs):
        kwargs.setdefault("epilog", f"More: {page}")
        super().__init__(*args, **kwargs)
        self.page = page

    def error(self, message):
        super().error(f"{message} (see {self.page})")
