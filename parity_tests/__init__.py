"""The parity suite: the NumPy reference and the PyTorch mirror held against each other,
and the ``attention-parity`` command.  One sub-package per verb family:

- ``matrix``   the parity matrix (``attention-parity`` with no verb)
- ``chapter``  the chapter verbs (``chapter``, ``jacobian``, ``claims``)
- ``bench``    the benchmark (``attention-parity bench``)
- ``kernels``  outside attention kernels held to the reference (``attention-parity
               check``, ``parity_tests.check(...)``)
- ``lab``      the learner's lab (``attention-parity backprop``, ``grade``)
- ``common``   what more than one family uses: tolerances, finite differences,
               planted faults, the chapter's values, tables, verdicts, plots

``cli`` is the entry point; imports run one way: ``cli`` -> a family -> ``common``
-> ``numpy_ref`` / ``torch_impl``.
"""

__all__ = ["check"]


def check(target, **options):
    """Hold an attention kernel to the float64 NumPy reference: see
    `parity_tests.kernels.run.check` for the options.  Returns a report with
    ``.passed``, ``.rows`` and the diagnosis of each failing tensor.

    Imported on first call, so ``import parity_tests`` does not import PyTorch."""
    from parity_tests.kernels.run import check as run_check
    return run_check(target, **options)
