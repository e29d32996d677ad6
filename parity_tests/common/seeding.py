"""``manual_seed``: ``torch.manual_seed`` on the devices this machine has.

PyTorch's own also seeds every accelerator it knows (CUDA, MPS, XPU, MTIA).  One that is
not initialised yet -- on a CPU-only machine, all of them, for ever -- gets the seeding
queued for its start, with the caller's stack formatted into the queue: 2.4 ms a call,
and a queue that only grows.  The parity matrix seeds every module it builds and the
check seeds every call on a dropout case: thousands of calls in the test suite.
"""

import torch

__all__ = ["manual_seed"]


def manual_seed(seed):
    """``torch.manual_seed(seed)``, skipping the accelerators the machine lacks."""
    seed = int(seed)
    for name in ("cuda", "xpu", "mtia"):                 # (xpu and mtia: not in every PyTorch >= 2.1)
        device = getattr(torch, name, None)
        if device is not None and device.is_available():
            device.manual_seed_all(seed)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(seed)
    return torch.default_generator.manual_seed(seed)
