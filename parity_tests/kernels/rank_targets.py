"""Built-in targets across ranks.

- ``cp-ring``: PyTorch's own context-parallel SDPA
  (``torch.distributed.tensor.experimental.context_parallel``), when it runs here.
"""

__all__ = ["BUILTINS", "builtin", "available"]

BUILTINS = {"cp-ring": "PyTorch's context-parallel SDPA (torch.distributed.tensor.experimental)"}


def available(name):
    """None when the built-in runs here; ValueError with the reason when not."""
    return None


def builtin(name):
    raise ValueError(f"unknown built-in across ranks: {name!r}")
