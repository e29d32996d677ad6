"""The package layout is the architecture: imports run one way, the entry point
dispatches every verb from one table, and the top-level help lists them all."""

import ast
import contextlib
import io
import pathlib
import re

import pytest

from parity_tests import cli
import test_docs_links  # noqa: E402  (beside this file: GitHub's anchors)

ROOT = pathlib.Path(__file__).resolve().parents[1]            # parity_tests/
REPO = ROOT.parent
FAMILIES = sorted(p.name for p in ROOT.iterdir()
                  if (p / "__init__.py").exists() and p.name not in ("common", "tests"))


def _imports(path):
    """Every parity_tests.* module a file imports (module-level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("parity_tests"):
            names = [f"{node.module}.{a.name}" for a in node.names]
            found.update(names)
            if not all(_is_module(n) for n in names):       # `from room import submodule` needs only those
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("parity_tests"))
    return found


def _is_module(name):
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _room(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


SOURCES = [p for p in ROOT.rglob("*.py") if "tests" not in p.relative_to(ROOT).parts]


def test_every_room_opens_with_a_docstring():
    for room in FAMILIES + ["common"]:
        doc = ast.get_docstring(ast.parse((ROOT / room / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"parity_tests/{room}/__init__.py needs a docstring"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    """cli -> a family -> common -> numpy_ref / torch_impl; a family never imports
    another family, common never imports a family."""
    rel = path.relative_to(ROOT).parts
    here = rel[0] if len(rel) > 1 else None                  # None: cli, __main__, __init__
    for target in _imports(path):
        room = _room(target)
        if room in FAMILIES:
            assert here is None or here == room, f"{path.name} ({here}) imports {target}"
        if target == "parity_tests.cli" or target.endswith(".cli"):
            assert here is None, f"{path.name} imports the entry point"


def test_no_import_cycle_between_modules():
    graph = {}
    for path in SOURCES:
        name = ".".join(("parity_tests",) + path.relative_to(ROOT).with_suffix("").parts)
        graph[name.removesuffix(".__init__")] = {t for t in _imports(path)}
    modules = set(graph)
    edges = {m: {t for t in targets if t in modules and t != m} for m, targets in graph.items()}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for t in edges[m]:
            assert state.get(t) != "open", "import cycle: " + " -> ".join(stack + [m, t])
            if t not in state:
                visit(t, stack + [m])
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            visit(m, [])


def _help(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue() + err.getvalue()


def test_top_level_help_lists_every_verb_from_the_table():
    status, text = _help(["--help"])
    assert status == 0
    for verb, (module, line) in cli.VERBS.items():
        assert f"  {verb}" in text and line in text
        assert module.split(".")[1] in FAMILIES


@pytest.mark.parametrize("typo, verb", [("chapters", "chapter"), ("bnech", "bench"), ("claim", "claims")])
def test_a_mistyped_verb_names_the_nearest_one(typo, verb):
    status, text = _help([typo])
    assert status == 2
    assert f"did you mean '{verb}'?" in text


def test_help_as_a_verb():
    assert _help(["help"])[0] == 0
    status, text = _help(["help", "bench"])
    assert status == 0 and "attention-parity bench" in text


@pytest.mark.parametrize("argv", [["--help"]] + [[verb, "--help"] for verb in cli.VERBS])
def test_help_pages_are_plain_text_not_rst(argv):
    status, text = _help(argv)
    assert status == 0 and len(text) > 200
    assert "`" not in text, text                     # ``literal`` or `reference` markup
    assert not any(line.rstrip().endswith("::") for line in text.splitlines()), text
    assert "parity_tests/tolerances.py" not in text  # the file lives in common/


# Each verb's --help fits one screen (at 80 columns) and names the page that says more.
SCREEN_LINES = 60


@pytest.mark.parametrize("argv", [["--help"]] + [[verb, "--help"] for verb in cli.VERBS])
def test_help_fits_one_screen_and_points_at_its_page(argv, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    status, text = _help(argv)
    assert status == 0
    assert len(text.rstrip("\n").splitlines()) <= SCREEN_LINES, text
    pages = re.findall(r"\bdocs/[\w-]+\.md(?:#[\w-]+)?", text)
    assert pages, f"{' '.join(argv)} names no page of docs/"
    for page in pages:
        path, _, anchor = page.partition("#")
        assert (REPO / path).exists(), page
        if anchor:
            assert anchor in test_docs_links.anchors(REPO / path), page


ARCHITECTURE = REPO / "docs" / "architecture.md"


def _architecture_blocks():
    text, blocks, current = ARCHITECTURE.read_text(), [], None
    for line in text.splitlines():
        if line.startswith("```"):
            current = [] if current is None else blocks.append(current)
        elif current is not None:
            current.append(line)
    return blocks


def test_the_architecture_page_names_files_that_exist():
    """Every path the page names (in its diagram, its layout and its text) is there."""
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"(?<![\w./])((?:[a-z_]+/)+(?:[a-z0-9_-]+\.(?:py|md))?)(?![\w/])", text))
    assert len(named) > 20
    missing = [p for p in named if not any((base / p).exists() for base in
                                           (REPO, ROOT, ROOT / "tests", ROOT / "kernels", ROOT / "lab"))]
    assert not missing, missing


def test_the_architecture_layout_is_the_layout():
    """The layout block names every family of parity_tests/ and every folder of its tests, and
    the diagram's steps run through modules of parity_tests/kernels/ that exist."""
    layout = next(b for b in _architecture_blocks() if b[0].startswith("numpy_ref/"))
    named = {l.split()[0] for l in layout if re.match(r"^  \S", l) and l.split()[0].endswith("/")}
    assert named == {f"{p}/" for p in FAMILIES + ["common", "tests"]}, named
    tests_line = " ".join(l for l in layout if "one folder per room" in l or l.startswith(" " * 22))
    for folder in (ROOT / "tests").iterdir():
        if folder.is_dir() and folder.name != "__pycache__":
            assert f"{folder.name}/" in tests_line, folder.name
    diagram = next(b for b in _architecture_blocks() if any("kernels/runner.py" in l for l in b))
    steps = [l.split()[1] for l in diagram if re.match(r"^\s+\d ", l)]
    assert steps == ["draw", "target", "golden", "baseline", "judge", "diagnosis"]
    for module in re.findall(r"kernels/[\w/]+\.py", "\n".join(diagram)):
        assert (ROOT / module).exists(), module


def test_the_layout_names_every_room_of_the_checker_and_every_module_in_it():
    """kernels/ is a core of modules and rooms (features/, targets/, diagnosis/, merge/,
    ranks/): the layout block lists each room on its own indented line, and names every
    module of the core and of each room where it describes them."""
    layout = next(b for b in _architecture_blocks() if b[0].startswith("numpy_ref/"))
    start = next(i for i, l in enumerate(layout) if l.startswith("  kernels/"))
    end = next(i for i in range(start + 1, len(layout)) if re.match(r"^  \S", layout[i]))
    block = layout[start:end]
    room_lines = {l.split()[0]: i for i, l in enumerate(block) if re.match(r"^    \S", l)}
    rooms = sorted(p.name for p in (ROOT / "kernels").iterdir() if (p / "__init__.py").exists())
    assert sorted(r.rstrip("/") for r in room_lines) == rooms
    first_room = min(room_lines.values())
    core = " ".join(block[:first_room])
    for path in (ROOT / "kernels").glob("*.py"):
        if path.stem != "__init__":
            assert re.search(rf"\b{path.stem}\b", core), f"kernels/{path.name} is not in the layout"
    bounds = sorted(room_lines.values()) + [len(block)]
    for room, i in room_lines.items():
        text = " ".join(block[i:bounds[bounds.index(i) + 1]])
        for path in (ROOT / "kernels" / room).glob("*.py"):
            if path.stem != "__init__" and room != "features/":      # features/: one module per feature, its own table
                assert re.search(rf"\b{path.stem}\b", text), f"kernels/{room}{path.name} is not in the layout"


def test_the_readme_layout_names_every_room_of_the_checker():
    readme = (REPO / "README.md").read_text()
    layout = readme[readme.index("## Layout"):readme.index("## Documentation")]
    for p in (ROOT / "kernels").iterdir():
        if (p / "__init__.py").exists():
            assert f"{p.name}/" in layout, f"kernels/{p.name}/ is not in the README's Layout"
