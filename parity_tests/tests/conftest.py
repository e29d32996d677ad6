"""Shared settings of the suite.

- PyTorch runs single-threaded: every tensor here is tiny, and on a small machine
  thread hand-offs cost more than the arithmetic (the parity matrix runs ~5x
  faster with one thread on 2 cores).
- Hypothesis profiles: "default" keeps property tests within the suite's time
  budget (hundreds of examples in all); ``--hypothesis-profile=thorough`` runs
  ten times more.  No deadline: the first example pays PyTorch's warm-up.
"""

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)

settings.register_profile("default", deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=2000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("default")
