"""The lab's notebook runs top to bottom, and is kept with its outputs stripped so
that a change to it reads as a change to its code and prose."""

import importlib.util
import pathlib
import time

import pytest

# looked up, not imported, at collection: every worker collects this file, one runs it
MISSING = [m for m in ("nbformat", "nbclient", "ipykernel", "matplotlib") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"could not find {', '.join(MISSING)} (the test and plot extras)")

ROOT = pathlib.Path(__file__).resolve().parents[3]
NOTEBOOK = ROOT / "notebooks" / "backprop_lab.ipynb"
LIMIT_S = 60


def test_the_notebook_is_stored_without_outputs():
    import nbformat
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow                                     # a kernel started, every cell run: 4 s
def test_the_notebook_runs_top_to_bottom_in_under_a_minute(tmp_path, monkeypatch):
    """Whatever matplotlib backend the environment names (CI systems often set Agg,
    which shows nothing) the kernel shows its figures; and the notebook leaves
    nothing behind in the temporary folder (the kernel's own, empty at start)."""
    import nbclient
    import nbformat
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.perf_counter()
    # the repository root as working directory: the kernel imports this checkout
    nbclient.NotebookClient(nb, timeout=LIMIT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    elapsed = time.perf_counter() - start
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum(o.output_type == "display_data" for o in outputs) == 3      # the heatmaps
    text = "".join(o.get("text", "") for o in outputs)
    assert "[softmax-diagonal-only]" in text and "exit status: 1" in text
    assert "From the chapter's Jacobian to FlashAttention" in "".join(c.source for c in nb.cells)
    assert "online out" in text and "<w, g> =" in text          # the second part ran
    assert list(tmp_path.iterdir()) == []
    assert elapsed < LIMIT_S
