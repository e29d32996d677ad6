"""Shared settings of the suite.

- PyTorch runs single-threaded: every tensor here is tiny, and on a small machine
  thread hand-offs cost more than the arithmetic (the parity matrix runs ~5x
  faster with one thread on 2 cores).
- Hypothesis: no deadline (the first example pays PyTorch's warm-up) and
  derandomized, so CI runs the same examples every time.  The property tests
  scale their example counts with the profile's ``max_examples``:
  ``PARITY_HYPOTHESIS_PROFILE=thorough pytest`` runs ten times more.
- The whole suite (``pytest`` with no path, as the README runs it, or ``-m slow``) runs
  on every core, up to `MAX_WORKERS`, when pytest-xdist is installed (the ``test``
  extra brings it): the tests are independent and each runs single-threaded.  A
  run of chosen files or tests stays in one process (starting workers costs more than
  it saves there); ``-n 0`` or ``-p no:xdist`` keeps any run in one, ``-n N`` sets N.
- A diagnosis that raises raises (``PARITY_DIAGNOSIS_RAISES``, ``runner.DIAGNOSIS_RAISES``):
  outside the tests the row says "could not diagnose", which a test would pass over.
"""

import gc
import os
import sys

import pytest

os.environ.setdefault("PARITY_DIAGNOSIS_RAISES", "1")       # here too for the CLI's subprocesses


def pytest_configure(config):
    """PyTorch single-threaded and hypothesis's profile, in every process that runs tests
    (not in xdist's controller, which only hands tests out: no PyTorch import there, 1-2 s
    before any worker starts)."""
    if _controller(config):
        return
    try:
        import torch
    except ImportError:     # the NumPy-only tests (tests/reference/) run without PyTorch
        torch = None
    if torch is not None:
        torch.set_num_threads(1)
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:     # ... and without hypothesis: only the property tests use it
        return
    settings.register_profile("parity", deadline=None, derandomize=True, max_examples=100,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("thorough", deadline=None, max_examples=1000,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("PARITY_HYPOTHESIS_PROFILE", "parity"))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """In an xdist worker, every object left is frozen out of the garbage collector once the
    tests are done: the interpreter's exit then frees them without tracing the whole heap
    again (1-3 s per worker at the end of a whole-suite run, which the controller waits for).
    Not after Triton (the slow suite's interpreted kernel): its bindings count what is still
    alive at exit and print every frozen object as a leak."""
    if hasattr(config, "workerinput") and "triton" not in sys.modules:
        gc.freeze()


def _controller(config):
    """Whether this process is pytest-xdist's controller: its workers run the tests."""
    return (not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))
            and getattr(config.option, "dist", "no") != "no")


# Workers for a whole-suite run: each imports PyTorch and collects every test (a few
# seconds and a few hundred MB), so more than this costs more than it saves.
MAX_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A whole-suite run on every core (before xdist reads ``-n``); see the docstring."""
    whole_suite = not config.args or config.args == list(config.getini("testpaths"))
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput") and whole_suite
            and config.option.numprocesses is None and not config.option.usepdb
            and not config.option.collectonly):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if cores > 1:
            config.option.numprocesses = min(cores, MAX_WORKERS)
            if config.option.dist == "no":
                config.option.dist = "worksteal"      # long tests last do not leave a core idle


@pytest.fixture
def without_input_classes(request, monkeypatch):
    """``check`` runs its grid and its features' cases alone, without the input classes every
    run adds (``kernels.variations.CLASSES``: strides, a scale, large logits, integers, Tq > Tk, at
    T = 45-77 and D = 40-64): half a small check's cost.  For a default test whose subject is a
    feature, a verdict or a diagnosis on its own small cases; the classes themselves are
    test_check_inputs.py's, every README and docs run keeps them, and so does every ``slow``
    test (the full grids) but those only moved there for time (``moved``: `sampled.MOVED`)."""
    if request.node.get_closest_marker("slow") is None or request.node.get_closest_marker("moved") is not None:
        from parity_tests.kernels import variations
        monkeypatch.setattr(variations, "CLASSES", ())
