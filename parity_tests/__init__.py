"""The parity suite: the NumPy reference and the PyTorch mirror held against each other,
and the ``attention-parity`` command.  One sub-package per verb family:

- ``matrix``   the parity matrix (``attention-parity`` with no verb)
- ``chapter``  the chapter verbs (``chapter``, ``jacobian``, ``claims``)
- ``bench``    the benchmark (``attention-parity bench``)
- ``check``    outside kernels against the reference (``attention-parity check``,
               ``parity_tests.check(...)``)
- ``common``   what more than one family uses: tolerances, finite differences,
               planted faults, the chapter's values, tables, verdicts, plots

``cli`` is the entry point; imports run one way: ``cli`` -> a family -> ``common``
-> ``numpy_ref`` / ``torch_impl``.
"""

__all__ = ["check"]


def __getattr__(name):
    # ``parity_tests.check(fn, ...)``: the sub-package is callable (see its docstring);
    # imported on first use, so importing parity_tests does not import PyTorch.
    if name == "check":
        import importlib
        return importlib.import_module("parity_tests.check")
    raise AttributeError(f"module 'parity_tests' has no attribute {name!r}")
