"""Every relative link of README.md and docs/*.md resolves: the file (or folder, or picture)
exists, and an anchor (``page.md#a-heading``, ``#a-heading``) names a heading of that page,
spelled as GitHub spells it: lower case, punctuation dropped but ``-`` and ``_``, each
space a ``-``, and ``-1``, ``-2`` ... after a heading met before."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+).+?\1")


def _prose(text):
    """The page's lines outside fenced blocks, inline code removed."""
    lines, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            lines.append(CODE_SPAN.sub("", line))
    return lines


def slug(heading):
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # a link: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    seen, found = {}, set()
    fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return found


def _links(path):
    for number, line in enumerate(_prose(path.read_text()), 1):
        for m in LINK.finditer(line):
            target = m.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):        # http:, https:, mailto:
                yield number, target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for number, target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if ROOT in dest.parents else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_slugs_are_githubs():
    assert slug("The production variants: `numpy_ref.reference_attention`") == \
        "the-production-variants-numpy_refreference_attention"
    assert slug("The golden under load, and a long check's time") == "the-golden-under-load-and-a-long-checks-time"
    assert slug("1. `attention-parity backprop`: every intermediate gradient, step by step") == \
        "1-attention-parity-backprop-every-intermediate-gradient-step-by-step"
    assert slug("`--blockwise`: the same backward in tiles, FlashAttention-2's way") == \
        "--blockwise-the-same-backward-in-tiles-flashattention-2s-way"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[there](#a-page) [gone](#nowhere) [file](missing.md) `[code](x.md)`\n")
    targets = [t for _, t in _links(page)]
    assert targets == ["#a-page", "#nowhere", "missing.md"]
    assert anchors(page) == {"a-page"}


def test_a_heading_twice_gets_a_number(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n## Notes\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"notes", "notes-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_heading_is_repeated(page):
    headings = [l for l in _prose(page.read_text()) if re.match(r"^#{1,6} ", l)]
    assert len(headings) == len(set(headings)), [h for h in headings if headings.count(h) > 1]


def test_every_page_of_docs_is_linked_from_the_readme():
    linked = {t.partition("#")[0] for _, t in _links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in linked, f"README.md does not link docs/{page.name}"
