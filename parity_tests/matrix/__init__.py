"""The parity matrix: ``attention-parity`` (``python -m parity_tests``) with no verb.

Every module of the chapter in NumPy and in PyTorch, on the same weights, inputs and
random upstream gradient, over configurations x modes x dtypes x devices; one row
per compared tensor.

- ``harness``     the cases and the comparisons (``build_cases``, ``run_case``)
- ``functional``  a plain-PyTorch forward from a dict of parameters: the baseline of
                  the low-precision rows
- ``run``         the command: arguments, the table, the summary, ``--json``
"""
