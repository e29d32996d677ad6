"""The diagnosis: what is wrong with a failing tensor, and where.

- ``diagnose``: names the mistake behind each failing tensor (the order of the tests, the
  catalogue's residuals, the slices, the lower precision); the entry point
  ``diagnose.diagnose``.
- ``mistakes``: the catalogue, the chapter's mistakes and each feature's, recomputed by
  the dense formula.
- ``location``: where a failure sits (heads, query rows, key ranges).
- ``row_block``: a case too long to recompute whole, judged on a block of query rows.
- ``poisoned``: mistakes that read memory no kernel should read, named by where their
  NaN lands.
"""
