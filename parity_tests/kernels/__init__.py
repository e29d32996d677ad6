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

With ``--features`` (production kernels: GQA, windows, softcap, ALiBi, bias,
sinks, varlen, lse, decode, determinism):

- ``features``          the feature names, their cases, what a callable receives
- ``dense``             every feature written densely in PyTorch: the baseline,
                        and the catalogue's mistakes with one knob turned
- ``featured``          one feature case: call, judge every tensor, diagnose
- ``feature_mistakes``  the mistakes the features invite
- ``feature_targets``   SDPA, FlexAttention and flash_attn with the features

Across ranks (``--world-size N``: context-parallel kernels on ``torch.distributed``):

- ``ranks``           ``check_ranks``: shard, run, reassemble, judge
- ``rank_world``      the N ranks the check starts and stops itself
- ``rank_diagnosis``  where a failure sits (rank, chunk) and the sharding mistakes
- ``rank_targets``    ``cp-ring``, PyTorch's context-parallel SDPA (CUDA only)
- ``rank_bench``      where the time of a check across ranks goes
"""
