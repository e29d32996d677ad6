"""Checking outside kernels: ``attention-parity check TARGET`` and ``parity_tests.check(...)``.

Holds any attention kernel (PyTorch's SDPA backends, FlexAttention, this
project's modules, or a user's ``module.path:callable``) to the float64 NumPy
reference, at the shapes and dtypes kernels actually run, and names the
mistake when a tensor fails.  One judge: every case, plain or featured, goes
through one runner against one golden result.

- ``cases``      a case (shape, causal, the features it tests), the default grid
- ``features/``  one module per production feature (GQA, windows, softcap, ALiBi,
                 bias, sinks, varlen, lse, lse_grad, decode, determinism, and the
                 serving kernels' paged KV cache and split-KV): its
                 cases, inputs, reference options, keywords and mistakes; the
                 package's ``__init__`` is the registry
- ``targets``    built-in targets by name (their capabilities as fields), user callables
- ``feature_targets``  SDPA, FlexAttention and flash_attn with the features
- ``serving_targets``  PyTorch's paged attention on FlexAttention (``flex-paged``)
- ``dense``      attention with every option written once in PyTorch: the baseline
                 (plain, in the tested dtype) and, with one knob turned, a mistake
- ``measure``    the case runner: draw, golden (``numpy_ref.reference_attention``),
                 baseline, errors, bounds, verdicts, one row per tensor
- ``call``       calling a target on a case: what it is handed, what it must give back,
                 time limits
- ``mistakes``   the catalogue: the chapter's mistakes and each feature's, recomputed
- ``diagnosis``  the best match named, or the error's size and place said
- ``location``   where an error sits (batches, heads, rows, channels, a last tile)
- ``poisoned``   a NaN output named by where its NaN lands (mistakes that read NaN slots)
- ``report``     the rows, their table, the summary, the JSON copy
- ``run``        the command line and ``check(...)``, the Python entry point

Beside kernels, two other kinds of target:

- ``merge``, ``merge_diagnosis``  ``--merge``: a merge of partial states (split-KV,
                 ring attention) held to ``numpy_ref.merge_states``
- ``ranks``, ``rank_world``, ``rank_diagnosis``, ``rank_targets``, ``rank_bench``
                 ``--world-size N``: context-parallel kernels on ``torch.distributed``,
                 the ranks started and stopped by the check itself
"""
