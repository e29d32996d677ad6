"""Every tolerance of the parity suite, in one place, each with its reason.

The error metric
----------------
One number per compared tensor, the normwise relative error::

    error(a, ref) = max|a - ref| / max(max|ref|, SCALE_FLOOR * case_scale)

``case_scale`` is the largest magnitude among the reference tensors of the same
kind in the same case (the output alone; or every gradient: input and
parameters).  The floor exists for gradients that are zero in exact arithmetic
and pure rounding noise in practice: the key bias, for instance (adding
``q . b_k`` to every score of a row leaves its softmax unchanged, so
``dL/db_k = 0``).  Relative to their own size such tensors would compare noise
with noise; relative to the case they are held to the accuracy of the gradients
they are computed from.

float64: the two implementations directly
-----------------------------------------
NumPy and PyTorch are compared with each other.  Both are backward-stable chains
of a few matrix products (the longest reduction is batch x tokens <= 18 terms,
for the weight gradients), a softmax and a few sums; each step adds a relative
error of at most about ``n * eps64`` (eps64 = 2.2e-16, so ~4e-15), and the
softmax Jacobian amplifies it by about ``max|attn_scores|`` (a few units for the
suite's inputs).  Agreeing code lands at 1e-16..1e-14 (measured maximum over the
default matrix: 1.4e-14); `FLOAT64_BOUND` = 1e-10 leaves a margin of 1e4 above
that, and is 1e7 below the 1e-3..1 a real mistake (a missing term, a wrong
scale, a transposed gradient) produces (measured: >= 5e-3 on every row a
planted fault breaks).

Lower precision: each side against a float64 golden reference
-------------------------------------------------------------
In float32, bfloat16 and float16 the two sides legitimately differ by rounding,
so neither is compared with the other.  Instead the weights and inputs are
rounded to the low dtype once, and the same rounded numbers are run through the
NumPy reference in float64: the *golden* result, exact up to 1e-16.  Each side's
error against the golden result is held to::

    error <= LOW_PRECISION_FACTOR * baseline + FLOOR_ULPS[dtype] * u_dtype

where ``baseline`` is the error of an *ordinary, independent* computation in
the same dtype against the same golden result (the approach of PyTorch's SDPA
tests and FlashAttention's tests: a kernel may be a few times less accurate
than the plain math in its own dtype, never orders of magnitude):

- PyTorch modules in float32: baseline = the larger drift of two ordinary
  float32 computations, the NumPy reference run in float32 (different code,
  different kernels) and the plain functional PyTorch computation.  NumPy alone
  is not enough: its float32 can be much *more* accurate than any PyTorch
  float32 computation (measured: SelfAttention_v1, T 6, d_in 3, D 2, B 3, bias,
  W_query's gradient, NumPy 5.3e-7 against 4.1e-6 for both the module and the
  plain functional PyTorch, over all four draws), and a bound from it fails
  PyTorch for being exactly as accurate as plain PyTorch (one fresh thorough
  run in three failed this way).  Since plain PyTorch's drift is measured
  against the NumPy golden, the golden is itself checked against PyTorch in
  float64 (rows ``golden vs torch f64``, held to `FLOAT64_BOUND`, in every
  low-precision dtype), so a NumPy fault cannot widen the bound unseen;
- NumPy reference in float32: baseline = a plain functional PyTorch
  computation of the chapter's formulas in float32 (`parity_tests.functional`,
  sharing no code with either implementation);
- PyTorch modules in bfloat16/float16 (NumPy has no bfloat16): baseline = the
  same plain functional computation, in that dtype, on the same device.
  (Plain PyTorch shares kernels with the modules, so the bound is tight where
  the module code is the chapter's and wide only where a kernel differs, as the
  fused SDPA kernel does.)  bfloat16 and float16 also run on CPU, where
  PyTorch supports them; the command checks them only when asked (``--dtype``).

The ``FLOOR_ULPS[dtype] * u_dtype`` term covers tensors where the baseline happens to
be exact (one token: the weight is exactly 1 and the output is exactly the
values) while the tested side is a few rounding steps off.

The baseline is a largest error over several draws of rounding
---------------------------------------------------------------
"A few times the baseline" presumes the baseline measures how far an ordinary
computation drifts on this case.  One run measures it well for a tensor of many
entries (its largest error is the maximum of many roughly independent rounding
errors, a stable figure), but a tensor of one or two entries -- every weight
gradient when ``d_in`` and ``head_dim`` are 1 -- gives *one draw* of a rounding
error, and one draw can land near zero by chance while the tested side lands at
its typical size: the ratio of two such draws is heavy-tailed (about one pair in
six differs by more than 4x).  Nor does the floor cover it: when a gradient
cancels (near-uniform attention, a weight near 0) the rounding noise, set by the
magnitudes summed, reaches tens to a hundred units of roundoff of the small
result it is measured against (measured: 57 u on ``W_value.weight`` of
SelfAttention_v2, T 4, d_in 1, head_dim 1, bias, against a 6 u baseline).  So
the baseline is the largest error of `BASELINE_DRAWS` runs of the ordinary
computation: the case itself, and the case with every weight, input and upstream
gradient entry moved one ulp up or down at random, each against its own golden
result.  The nudged problems have the same size and conditioning and fresh
rounding in every intermediate, so their largest error is a stable measure of
the dtype's drift on this case, and the factor 4 compares with that.
"""

import numpy as np

__all__ = [
    "FLOAT64_BOUND",
    "VARIANTS_FLOAT64_BOUND",
    "SCALE_FLOOR",
    "LOW_PRECISION_FACTOR",
    "BASELINE_DRAWS",
    "FLOOR_ULPS",
    "BUFFER_BOUND",
    "FINITE_DIFF_BOUND",
    "UNIT_ROUNDOFF",
    "LOW_PRECISION_DTYPES",
    "float64_bound",
    "low_precision_bound",
]

# Direct NumPy-vs-PyTorch comparison in float64 (derivation in the docstring).
FLOAT64_BOUND = 1e-10

# Gradients smaller than this fraction of the case's largest gradient are
# measured against that fraction instead: zero-by-theory tensors (key bias)
# are rounding noise of the size of eps * (largest gradient), and 0.1 keeps that
# noise within a few units of roundoff (measured: <= 9 u in float32 over 5000
# random rows) while a real mistake still shows at 1e-3..1.
SCALE_FLOOR = 0.1

# A tested computation may drift from the golden result at most this many times
# further than the ordinary computation in its dtype does (PyTorch's SDPA tests
# use 2-4; FlashAttention's tests use 2).
LOW_PRECISION_FACTOR = 4.0

# Runs of the ordinary computation whose largest error is the baseline: the case
# and 3 one-ulp nudges of it (see "several draws" above).  Measured on 3000 random
# float32 cases with d_in, head_dim <= 2: with 1 draw, 6 cases exceed their bound
# (worst 1.4x); with 4 draws none does (worst 0.53x of the bound).
BASELINE_DRAWS = 4

# numpy_ref.reference_attention (the production variants) against a dense float64
# PyTorch computation differentiated by autograd, and against SDPA.  Both sides
# are a few matrix products of at most ~20 terms, one softmax and elementwise
# changes (tanh, a bias), so agreeing code lands at 1e-16..1e-15 (measured
# maximum over 1040 random mixed cases: 2.0e-14, on dk); 1e-12 is the target the
# variants are held to (50x that), 1e9 below a planted variant fault (>= 1e-3).
VARIANTS_FLOAT64_BOUND = 1e-12

# Absolute floor, in units of the dtype's unit roundoff, for baselines that
# happen to be exact: a chain of ~8 rounded operations with reductions of a few
# terms each.  float32: measured need over 5000 random rows (factor 4) at most
# 9 u; 32 u leaves a margin of 3.5 and is still 2e-6.  bfloat16 and float16:
# their baselines share PyTorch's kernels with the modules, so they are rarely
# exact; measured need over the default matrix at most 0.3 u, and 8 u (3% in
# bfloat16, 0.4% in float16) keeps a slip of a few percent visible.
FLOOR_ULPS = {"float32": 32, "float16": 8, "bfloat16": 8}

# Centred finite differences (parity_tests.finite_diff, step h = 1e-5) against
# either side's gradient, float64: truncation error ~h^2 |f'''| ~ 1e-10 and
# rounding ~eps |f| / h ~ 1e-11, relative; measured 1e-11..1e-9 here.  1e-7
# keeps a margin of 100 and is still 1e4 below a real mistake.
FINITE_DIFF_BOUND = 1e-7

# Buffers (the causal mask) hold exact 0/1 entries: any difference is a fault.
BUFFER_BOUND = 0.0

# Unit roundoff u = 2^-(mantissa bits + 1): the relative error of one rounding.
UNIT_ROUNDOFF = {
    "float64": 2.0 ** -53,
    "float32": 2.0 ** -24,
    "float16": 2.0 ** -11,
    "bfloat16": 2.0 ** -8,
}

# The dtypes checked against a golden float64 reference rather than directly.
LOW_PRECISION_DTYPES = ("float32", "float16", "bfloat16")


def float64_bound():
    """The fixed bound of a direct float64 comparison."""
    return FLOAT64_BOUND


def low_precision_bound(dtype, baseline):
    """Bound for a side's error against the golden result, from its ``baseline``."""
    if dtype not in UNIT_ROUNDOFF or dtype == "float64":
        raise ValueError(f"dtype must be one of {LOW_PRECISION_DTYPES}, got {dtype!r}")
    if not np.isfinite(baseline):
        # A baseline that failed cannot vouch for anything: hold to the floor alone.
        baseline = 0.0
    return LOW_PRECISION_FACTOR * float(baseline) + FLOOR_ULPS[dtype] * UNIT_ROUNDOFF[dtype]


# ---------------------------------------------------------------------------
# attention-parity check: an outside kernel against the float64 reference
# ---------------------------------------------------------------------------
# The method of FlashAttention's and PyTorch's SDPA tests: the kernel's error
# against a float64 golden result, held to a multiple of the error of a plain
# computation of the same formulas in the same dtype on the same device::
#
#     error <= CHECK_FACTOR * baseline + CHECK_FLOOR_ULPS[dtype] * u_dtype
#
# (error: normwise relative, as above; gradients relative to the largest of
# dq, dk, dv, with SCALE_FLOOR for the zero-by-theory ones: dq = dk = 0 with
# one key).  What the literature uses: FlashAttention's tests a factor 2 on
# max-abs errors (3-4 on some backward tensors); PyTorch's SDPA tests per-tensor
# fudge factors of about 2..8 over a same-dtype reference.
#
# Why a kernel may be a few times worse than the baseline: it rounds in other
# places.  A fused kernel keeps P in float32 (better than the baseline's rounded
# P for out and dv), but may round dS or P to the input dtype before a matmul,
# or sum dq over key tiles (worse for dq, dk, dv).  Measured over the default
# grid on CPU, largest error / baseline per kernel and dtype (float32, bfloat16,
# float16, float64): SDPA math 1.9, 0.8, 0.9, 2.3; the CPU flash kernel 2.1,
# 3.1, 2.2, 1.9 (bfloat16: dv of the causal T = 2049 case); torch_impl's
# MultiHeadAttention 1.4 at most; FlexAttention (eager) 1.4 at most.  A factor
# 2 would fail PyTorch's own CPU flash kernel on dv in bfloat16; 4 passes every
# PyTorch kernel here with a margin of 1.3 before the floor is added (2.3 with
# it).  At T = 16384 (--long) the CPU flash kernel's dv in bfloat16 reaches 3.8x
# its baseline (ratio to the bound 0.65 with the floor): the margin narrows
# with T there.  Mistakes land far above the bound: the test gallery's failing
# rows (113x203 and 1023, float32 and bfloat16) sit at 1e1..1e7 x the bound in
# float32 (1e4 and up for every backward mistake); the least visible, 1.04 x,
# is the dropped D term on dk, bfloat16, not causal, T = 1023: the output
# averages 1023 values, so D = rowsum(dO ∘ O) is small, and the bfloat16 bound
# is a few percent of the tensor -- float32 carries the sensitivity, which is
# why it is always in the grid.
CHECK_FACTOR = 4.0

# The floor covers baselines that are exact by accident (one key: the weight is
# exactly 1 and out = v) while a kernel is a rounding or two off.  Measured
# need with the factor 4 over the default grid: 0 for every PyTorch kernel (at
# factor 3: 0.1 u).  It is kept small so that it never dominates the bound of a
# real case: float32 8 u = 4.8e-7 against baselines of 0.2e-6..3e-6; bfloat16
# and float16 2 u (0.8 %, 0.1 %) against baselines of 1 u to 4.4 u.
CHECK_FLOOR_ULPS = {"float64": 8, "float32": 8, "float16": 2, "bfloat16": 2}


# A gradient that is zero by theory (its reference below SCALE_FLOOR x the case's
# largest gradient: dq and dk when every row sees one key, as with T = 1 or a 0-wide
# window of --features window) is measured against that floor, and the baseline, whose
# P is exactly 1 there, has no error at all to scale.  A kernel does: FlashAttention-2's
# backward forms dS = P ∘ (dP − D) from dP = dO vᵀ (a matmul) and D = rowsum(dO ∘ O), two
# sums of the same D products in different orders when O = v, so dS is their rounding
# difference, up to ~√D u Σ|dO v| per row, and dk = scale dSᵀ q carries it.  Measured,
# float32: PyTorch's CPU flash kernel on 0-wide windows 59 float32 units (bfloat16 alike:
# it accumulates in float32); the test gallery's FlashAttention-2 kernels
# (``correct_gallery``) at T = 1 up to 137 units over 20 seeds.  A mistake there is of the
# size of the floor itself (>= 1e-1).  256 float32 units (1.5e-5), or the usual bound
# where that is larger.
CHECK_ZERO_FLOOR = {"float64": 256 * 2.0 ** -53, "float32": 256 * 2.0 ** -24,
                    "bfloat16": 256 * 2.0 ** -24, "float16": 256 * 2.0 ** -24}


# The baseline's formulations.  "A few times a plain computation's error" presumes one
# plain computation: but correct kernels form the weights in two ways, and on large
# logits the two round differently.  Softmax with the row maximum subtracted has S − m
# exact at the maximum (m is one of the scores) and no error common to a row.  Weights
# formed through the log-sum-exp, P = exp(S − lse) -- FlashAttention-2's backward, every
# kernel that saves lse, every split-KV or ring merge weighing its partials by
# exp(lse_s − lse) -- carry lse's own rounding, an absolute u |lse| in the exponent, on
# every weight of the row at once: a relative u |lse| on the row's output, and in the
# backward on dS = P ∘ (dP − D) a term u |lse| P D that does not shrink with dS.  With
# standard-normal inputs |lse| <= log Tk + 4 (<= 16 at Tk <= 16384, LOGIT_SCALE) and the
# term is the size of the ordinary rounding; on the heavy-tailed inputs every check draws
# (``kernels/variations.py``: scores of 900 .. 2900) it is 60 .. 180 u, past the plain
# computation's error in dq and dk.  Measured before this rule, a correct float32 kernel
# with P = exp(S − lse) failed dq or dk at 1.06 .. 3.13 x the bound in 5 seeds of 10.
#
# So past LOGIT_SCALE (a case whose largest finite |lse| exceeds it) the baseline is
# computed in both formulations and each tensor's baseline error is the larger of the
# two: FlashAttention's tests bound a kernel by the less accurate of two plain
# computations in the same way.  The lse is kept in float32 for the half dtypes, as
# kernels keep it (a bfloat16 lse would put 3.5 in the exponent at |lse| = 900).  Below
# LOGIT_SCALE the second formulation would cost a second baseline and change no bound
# beyond the factor's margin: measured, every formulation of the test gallery
# (``tests/kernels/correct_gallery.py``) over 20 seeds at worst 0.76 x its bound, with
# the plain formulation alone on standard-normal cases.
#
# The floor grows with the logits past LOGIT_SCALE as well: a relative rounding u of a
# score S is an absolute u |S| in the exponent, and which computation rounds its largest
# scores luckily is chance -- one draw against another, where a near one-hot row leaves
# a tensor's largest error to a few entries.  Measured: SDPA's math backend in float64
# at scores ~900, 9x its baseline on out; FlexAttention on an H200 in float32, dv of the
# heavy-tailed case, 5.8x the larger of the two baselines.  Neither formulation of the
# baseline covers that alone, nor does the floor cover the lse's row-wide term (the
# lse-weighted kernel failed with it in place): both are needed, and a test removes each.
LOGIT_SCALE = 16.0
BASELINE_FORMULATIONS = ("softmax", "lse")

# FP8 (``--features fp8``, ``fp8_kv``).  The golden is the reference on the dequantised
# inputs (stored float8 × descale, exact in float64), so the quantisation itself is no error
# of the kernel's: it is reported beside the verdict.  What a right FP8 kernel adds to it is
# its own rounding, and FlashAttention-3's forward rounds in one place no bfloat16 computation
# does: P = exp(S − m), rounded to e4m3 (3 stored bits, unit roundoff 2^-4; 2^-9 apart below
# 2^-6) before P V, divided by l = Σ P after.  That is a relative error of up to 6 % on every
# weight, random in sign: on out, ~3.5 % of its size over many keys, fifteen times a bfloat16
# rounding.  So a feature adds that formulation to the baseline's (``Judging.baselines``:
# ``dense.fp8_weights``, "fp8") and each tensor's baseline error is the larger, as with the
# two above; the factor and the floor stay the others'.  Measured over the default grid with
# gqa, seeds 0 .. 2: FlashAttention-3's formulation at 0.30 of the bound at worst with it; the
# baseline in bfloat16 alone put it at 1.2 .. 1.6 x its bound on the integer inputs and 0.95 ..
# 1.02 x on the long case (``tests/kernels/test_check_fp8.py`` removes it and sees the FAIL).
# A kernel keeping P in float32, and one dequantising to bfloat16 for SDPA, pass as well, at
# 20 seeds (``-m slow``).  What the wider bound lets by: an error below ~4 x the e4m3 rounding
# of P, so a narrow accumulator shows only on the long case (257 key tiles: 2.4 x its bound).


def baseline_formulations(logits):
    """How the baseline forms its weights on a case whose largest finite |lse| is ``logits``
    (``dense.attention``'s ``weights``): the plain softmax, and past LOGIT_SCALE the
    log-sum-exp form as well."""
    return BASELINE_FORMULATIONS if logits > LOGIT_SCALE else BASELINE_FORMULATIONS[:1]


# A gradient summed over every row into a few numbers -- dsinks, one per head: −Σ_{b,i}
# P_sink,i (D_i − dlse_i) -- is a sum whose terms cancel: its size can be far below the sizes
# of its terms, and its rounding follows theirs.  Each term is a product of quantities every
# correct kernel rounds its own way (the sink's weight, D_i = rowsum(dO ∘ O) or the softmax
# backward's Σ_j P_ij dP_ij), so each carries a relative error of a few u, and two correct
# kernels differ by about u Σ |t_i|, however small Σ t_i is.  A plain computation's error is
# one draw of that: measured, a right float32 kernel written as transformers' gpt-oss eager
# attention (the sink column concatenated to the scores, autograd for dsinks) had dsinks up
# to 10 times a direct one's on a given seed, 1.10 x the bound on the B1 H2 T17 case; in
# bfloat16, 1.55 and 1.63 x over 20 seeds.  So such a tensor's bound is at least
# CHECK_FACTOR u Σ |t_i| over its own size (the feature gives Σ |t_i|: ``Judging.reduced``).
# The same floor holds dq and dk where each row sees one key and a gradient flows through lse
# (a 0-wide window): there dS_i = dlse_i exactly, which the softmax's backward forms exactly
# (Σ_j P_ij dP_ij is dP_ij), so the baseline's error says nothing of a kernel that forms
# D = rowsum(dO ∘ O) − dlse and dP = dO · v_j apart, as FlashAttention-2 does: their terms'
# sizes Σ_c |dO_ic| (|v_jc| + |O_ic|), times scale |k_j| (dq) or scale |q_i| (dk), are the sum
# (``runner.one_key_terms``).  Measured: such a kernel, right, FAILed dq and dk at 1.6 .. 3.3 x
# the plain bound in float32 on every seed without it, and sits at 0.13 .. 0.25 of it with it.
# The judge's own check.  The bound is derived from the baseline, and the baseline (``dense``)
# shares its rules -- which keys a window sees, the alignment's offset, the softcap's formula,
# ALiBi's sign, the GQA head map, dropout's scale -- with the catalogue's mistakes and with
# nothing else: a rule planted wrong there moves the baseline away from the golden, widens
# every bound with it, and a wrong kernel sharing the rule would pass (measured: a window
# edge one key off in ``dense.sees`` let the window-left-wider kernel pass all 115 of its
# rows).  So the baseline's own error is judged too: a plain computation in the dtype makes
# at most a few tens of units in the last place, times the logits' amplification (measured
# over the default grid and every feature's cases, the correct kernels' runs: 92 float32
# units at worst, on the varlen heavy-tailed case; FP8's e4m3 formulation 8.5 bfloat16
# units).  Past JUDGE_LIMIT_ULPS units (or JUDGE_LIMIT_CAP, a share of the tensor, in the
# half dtypes, whose 1024 units exceed the tensor itself) it is the check's own defect:
# reported on the row, and the run does not pass (exit status 3).  A rule planted wrong
# moves the baseline by a key's weight or more: 1e-2 .. 1 of the tensor, 10^5 float32 units.
JUDGE_LIMIT_ULPS = 1024
JUDGE_LIMIT_CAP = 2.0 ** -3


def judge_limit(dtype, logits=0.0):
    """The largest error of the check's own baseline against the golden that a plain
    computation in ``dtype`` makes on a case whose largest |lse| is ``logits``."""
    amplified = max(1.0, float(logits) / LOGIT_SCALE)
    return min(JUDGE_LIMIT_ULPS * UNIT_ROUNDOFF[dtype], JUDGE_LIMIT_CAP) * amplified


def reduction_floor(dtype, mass):
    """The least bound of a gradient summed over rows whose terms' sizes add to ``mass`` (in
    units of the tensor's own size: its normwise denominator)."""
    return CHECK_FACTOR * UNIT_ROUNDOFF[dtype] * float(mass)


def check_bound(dtype, baseline, logits=0.0):
    """The bound of ``attention-parity check`` for a tensor whose baseline error is ``baseline``
    (the larger over the baseline's formulations), on a case whose largest |score| (its
    largest finite |lse|) is about ``logits``."""
    if dtype not in CHECK_FLOOR_ULPS:
        raise ValueError(f"dtype must be one of {tuple(CHECK_FLOOR_ULPS)}, got {dtype!r}")
    if not np.isfinite(baseline):
        baseline = 0.0
    amplified = max(1.0, float(logits) / LOGIT_SCALE)
    return CHECK_FACTOR * float(baseline) + CHECK_FLOOR_ULPS[dtype] * UNIT_ROUNDOFF[dtype] * amplified
