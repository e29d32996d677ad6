"""The parity suite: the NumPy reference and the PyTorch mirror held against each other,
and the ``attention-parity`` command.  One sub-package per verb family:

- ``matrix``   the parity matrix (``attention-parity`` with no verb)
- ``chapter``  the chapter verbs (``chapter``, ``jacobian``, ``claims``)
- ``bench``    the benchmark (``attention-parity bench``)
- ``common``   what more than one family uses: tolerances, finite differences,
               planted faults, the chapter's values, tables, verdicts, plots

``cli`` is the entry point; imports run one way: ``cli`` -> a family -> ``common``
-> ``numpy_ref`` / ``torch_impl``.
"""
