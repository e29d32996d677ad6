"""Shared settings of the suite.

- PyTorch runs single-threaded: every tensor here is tiny, and on a small machine
  thread hand-offs cost more than the arithmetic (the parity matrix runs ~5x
  faster with one thread on 2 cores).
- Hypothesis: no deadline (the first example pays PyTorch's warm-up) and
  derandomized, so CI runs the same examples every time.  The property tests
  scale their example counts with the profile's ``max_examples``:
  ``PARITY_HYPOTHESIS_PROFILE=thorough pytest`` runs ten times more.
- A diagnosis that raises raises (``PARITY_DIAGNOSIS_RAISES``, ``measure.DIAGNOSIS_RAISES``):
  outside the tests the row says "could not diagnose", which a test would pass over.
"""

import os

os.environ.setdefault("PARITY_DIAGNOSIS_RAISES", "1")       # here too for the CLI's subprocesses

try:
    import torch
except ImportError:     # the NumPy-only tests (tests/reference/) run without PyTorch
    torch = None
if torch is not None:
    torch.set_num_threads(1)

try:
    from hypothesis import HealthCheck, settings
except ImportError:     # ... and without hypothesis: only the property tests use it
    settings = None
if settings is not None:
    settings.register_profile("parity", deadline=None, derandomize=True, max_examples=100,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("thorough", deadline=None, max_examples=1000,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("PARITY_HYPOTHESIS_PROFILE", "parity"))
