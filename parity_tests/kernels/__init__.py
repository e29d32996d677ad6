"""Checking outside kernels: ``attention-parity check TARGET`` and ``parity_tests.check(...)``.

Holds any attention kernel (PyTorch's SDPA backends, FlexAttention, this
project's modules, or a user's ``module.path:callable``) to the float64 NumPy
reference, at the shapes and dtypes kernels actually run, and names the
mistake when a tensor fails.  One judge: every case, plain or featured, goes
through one runner against one golden result.

- ``run``         the command line and ``check(...)``, the Python entry point: the plan
- ``runner``      one case: draw, golden (``numpy_ref.reference_attention``), baseline,
                  errors, bounds, verdicts, one row per tensor
- ``call``        calling a target on a case: what it is handed, what it must give back,
                  time limits
- ``dense``       attention with every option written once in PyTorch: the baseline
                  (plain, in the tested dtype) and, with one knob turned, a mistake
- ``cases``       a case (shape, causal, the features it tests), the default grid
- ``variations``  the input classes every run adds (strides, a scale, large logits,
                  integers, Tq > Tk), at the kernel's own shapes
- ``report``, ``row``, ``repro``  the rows, their table, the JSON copy; a failure as a
                  standalone script
- ``time_split``  one case's time by part (``bench --check-split``)

and its rooms:

- ``features/``   one module per production feature (GQA, windows, softcap, ALiBi,
                  bias, sinks, varlen, lse, lse_grad, decode, determinism, dropout, and
                  the serving kernels' paged KV cache and split-KV): its cases, inputs,
                  reference options, keywords and mistakes; ``__init__`` is the registry
- ``targets/``    built-in targets by name (``__init__``), with the features they express
                  (``features``: SDPA, FlexAttention, flash_attn; ``serving``: paged Flex)
- ``diagnosis/``  the best match named (``diagnose``), the catalogue (``mistakes``),
                  where an error sits (``location``), long cases on a block of rows
                  (``row_block``), NaN named by where it lands (``poisoned``)
- ``merge/``      ``--merge``: a merge of partial states (split-KV, ring attention) held
                  to ``numpy_ref.merge_states``
- ``ranks/``      ``--world-size N``: context-parallel kernels on ``torch.distributed``
                  (``world``: the ranks the check starts and stops; ``builtin``,
                  ``diagnosis``, ``bench``)
"""
