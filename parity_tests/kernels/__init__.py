"""Checking outside kernels: ``attention-parity check TARGET`` and ``parity_tests.check(...)``.

Holds any attention kernel (PyTorch's SDPA backends, FlexAttention, this
project's modules, or a user's ``module.path:callable``) to the float64 NumPy
reference, at the shapes and dtypes kernels actually run, and names the
mistake when a tensor fails.

- ``cases``      the grid of shapes, the inputs drawn and rounded to the dtype
- ``targets``    built-in targets by name, user callables, calling one on a case
- ``reference``  the golden result (blockwise NumPy, float64) and the baseline
                 (plain PyTorch in the tested dtype, same device)
- ``measure``    one case: errors, bounds, verdicts, one row per tensor
- ``diagnosis``  the catalogue of mistakes, recomputed, the best match named
- ``report``     the rows, their table, the summary, the JSON copy
- ``run``        the command line and ``check(...)``, the Python entry point
"""
