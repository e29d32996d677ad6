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

__all__ = ["check", "audit", "mistakes", "mistake"]


def check(target, **options):
    """Hold an attention kernel to the float64 NumPy reference: see
    `parity_tests.kernels.run.check` for the options.  Returns a report with
    ``.passed``, ``.rows`` and the diagnosis of each failing tensor.

    Imported on first call, so ``import parity_tests`` does not import PyTorch."""
    from parity_tests.kernels.run import check as run_check
    return run_check(target, **options)


def mistakes():
    """The names of the planted mistakes, the catalogue's (``no-causal-mask``,
    ``mask-one-future``, ``no-scale``, ``stale-max``, ...): each one `mistake` returns."""
    from parity_tests.kernels.planted import mistakes as names
    return names()


def mistake(name, features=None):
    """The planted mistake ``name`` as a kernel with ``check``'s calling convention,
    ``fn(q, k, v, *, causal, scale, ...)``: mutation testing for your own suite (a test that
    passes it has missed that mistake).  ``fn.features``: the features it needs to show (call
    it as ``check(fn, features=fn.features)`` does); ``fn.diagnosis``: the catalogue's id of
    the mistake.  An unknown name: ValueError listing the names."""
    from parity_tests.kernels.planted import mistake as planted
    return planted(name, features)


def audit(rule=None, **options):
    """Which catalogued mistakes your acceptance rule lets through, and which correct kernels
    it rejects: see `parity_tests.kernels.audit.audit` for the rule and the options.  Returns
    an `AuditReport` (``.passed``, ``.missed``, ``.rejected``, ``.suggested``, ``as_dict()``)."""
    from parity_tests.kernels.audit import audit as run_audit
    return run_audit(rule, **options)
