"""Run a chapter verb in-process, as its test module's one full run.

``--plot`` is optional (matplotlib is the ``plot`` extra): the run plots only
where matplotlib is installed, and the tests that read the plots skip elsewhere.
"""

import contextlib
import importlib.util
import io

import pytest

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")


def run_verb(main, plot_dir):
    """``(exit status, stdout, plot_dir)`` of ``main(["--plot", plot_dir])``."""
    args = ["--plot", str(plot_dir)] if HAVE_MATPLOTLIB else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(args)
    return status, out.getvalue(), plot_dir
