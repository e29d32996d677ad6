"""How the check judges and names, on one small case each: lse on rows that see no key,
the mean error beside the max, the sentences of a wrong output's gradients, a row never
stored, the input classes a run adds and when one is a gap, the strides verdict; and what
it asks of a kernel's call and answer: the lse dtype it accepts, a second call that fails
even where both draws have one answer, the notes a row keeps."""

import math

import torch

import parity_tests
from parity_tests.common import tolerances as tol
from parity_tests.kernels import runner, targets, variations
from parity_tests.kernels.cases import Case, case_rng
from parity_tests.kernels.features import REGISTRY
from parity_tests.kernels.diagnosis.diagnose import Diagnosis
from parity_tests.kernels.report import Row, find_growth, find_precision_refuted, find_strides
from parity_tests.kernels.planted.chapter import GALLERY, scores
from crashing_kernels import sdpa
from needs import needs_dtype
from parity_tests.kernels.planted.featured import _OneHeadExpand, attend, kernel, one_unit_off_every_other_call, varlen

SMALL = Case(1, 2, 17, 17, 16, True)


def _rows(fn, case, dtype="float32", wanted=(), align="top-left"):
    return {r.tensor: r for r in runner.run_case(targets.resolve(fn), case, dtype, "cpu", align=align,
                                                  wanted=tuple(wanted))}



def test_lse_is_judged_on_the_rows_that_see_a_key_and_nan_fails_on_those_that_see_none():
    fewer_keys = Case(1, 2, 45, 20, 16, True)            # bottom-right: query rows 0 .. 24 see no key

    def nan_where_unseen(q, k, v, *, causal, scale, align="top-left"):
        out, lse = attend(q, k, v, causal=causal, scale=scale, align=align)
        return out, torch.where(torch.isfinite(lse), lse, torch.nan)
    lse = lambda fn: _rows(fn, fewer_keys, wanted=["lse"], align="bottom-right")["lse"]
    right = lse(kernel())
    assert right.passed and math.isfinite(right.baseline)          # the baseline's error on the judged rows
    assert right.bound > tol.check_bound("float32", 0.0)            # ... counted in the bound beside the floor
    assert lse(nan_where_unseen).failed
    assert lse(kernel("lse-base-2")).failed


def test_an_error_under_the_max_bound_on_every_entry_fails_on_its_mean():
    case = Case(1, 2, 64, 64, 16, False)
    bound = _rows(sdpa, case)["out"].bound

    def offset(q, k, v, *, causal, scale):               # every entry off by 0.8 of the bound
        out = sdpa(q, k, v, causal=causal, scale=scale)
        return out + 0.8 * bound * out.detach().abs().max()
    out = _rows(offset, case)["out"]
    assert out.error <= out.bound and out.failed, (out.error, out.bound)
    assert "mean error" in out.note and "above its bound" in out.note


def test_the_gradients_of_a_wrong_output_are_not_said_to_follow_a_right_one():
    rows = _rows(GALLERY["no_scale"][0], SMALL)
    assert rows["out"].failed and rows["out"].diagnosis.id == "no-scale"
    grads = [r for n, r in rows.items() if n != "out" and r.failed]
    assert grads and not any("the output is right" in r.diagnosis.sentence for r in grads)


def test_the_last_query_row_never_stored_is_named():
    def last_row_left_zero(q, k, v, *, causal, scale):
        out = sdpa(q, k, v, causal=causal, scale=scale)
        stored = torch.ones(out.shape[-2], 1, dtype=out.dtype)
        stored[-1] = 0.0
        return out * stored
    out = _rows(last_row_left_zero, SMALL)["out"]
    assert out.diagnosis.id == "row-not-stored", out.diagnosis.sentence
    assert "out of query row 16 never stored" in out.diagnosis.sentence


def test_an_input_class_run_in_one_dtype_is_no_gap_and_classes_keep_the_runs_mask():
    def float32_at_d40_only(q, k, v, *, causal, scale):       # takes the padded-rows class, in float32
        if q.dtype != torch.float32 or q.shape[-1] != 40:
            raise targets.Unsupported(f"no {q.dtype} D{q.shape[-1]} tile")
        return sdpa(q, k, v, causal=causal, scale=scale)
    report = parity_tests.check(float32_at_d40_only, tokens=["17"], head_dims=[16], heads=[2], batch=[1],
                                dtypes=["float32", "bfloat16"], causal="no")
    assert report.passed, str(report)
    assert len(report.gaps) == len(variations.CLASSES) - 1, report.gaps
    assert not any(g.startswith("q, k, v rows padded past D") for g in report.gaps), report.gaps
    assert not any(r.dims["causal"] for r in report.rows)
    for causal in ((True,), (False,)):
        assert all(c.causal in causal for _, tried in variations.grid_cases(causal, [(1, 2, 17, 17, 16)]) for c in tried)


def test_ignoring_strides_is_named_only_when_a_contiguous_case_passed():
    def row(case, verdict, features):
        r = Row("k", case, {"features": features}, "float32", "cpu", "out", verdict=verdict, error=1.0, bound=0.1)
        r.diagnosis = Diagnosis("none", "out matches none of the catalogued mistakes") if verdict == "FAIL" else None
        return r
    fused, padded = row("fused", "FAIL", ["strides"]), row("padded", "pass", ["strides"])
    find_strides([fused, padded, row("plain", "not supported", [])])     # no contiguous case ran
    assert fused.diagnosis.id == "none"
    find_strides([fused, padded, row("plain", "pass", [])])
    assert fused.diagnosis.id == "ignores-strides"


def test_growth_with_length_needs_two_passing_lengths_below_the_failing_ones():
    def row(tk, verdict, error):
        r = Row("k", f"T{tk}", {"tk": tk, "head_dim": 64, "features": []}, "float32", "cpu", "out",
                verdict=verdict, error=error, bound=1e-6)
        if verdict == "FAIL":
            r.diagnosis = Diagnosis("none", "out matches none of the catalogued mistakes", spread=True, rounding=True)
        return r
    once = [row(17, "pass", 5e-7), row(1023, "FAIL", 3e-6)]
    find_growth(once)
    assert once[1].diagnosis.id == "none"
    twice = [row(1, "pass", 1e-7), row(17, "pass", 5e-7), row(1023, "FAIL", 3e-6)]
    find_growth(twice)
    assert twice[2].diagnosis.id == "grows-with-length"
    assert "passes up to Tk = 17, fails from Tk = 1023" in twice[2].diagnosis.sentence


def test_a_lower_precision_is_withdrawn_where_the_same_tensor_errs_past_every_precision_elsewhere():
    def row(cap, error, named, dtype="float32", tensor="dq", past=False):
        case = Case(1, 2, 77, 77, 64, True, (("softcap", cap),))
        return Row("k", str(case), case.as_dict(), dtype, "cpu", tensor, error=error, bound=1e-6, verdict="FAIL",
                   case_def=case, diagnosis=Diagnosis(named, f"{tensor}'s error {error:.1e} is the size of "
                                                      "bfloat16's: the kernel appears to compute in bfloat16 inside "
                                                      f"this {dtype} check; where: rows 3 .. 9", past_precision=past))
    low = row(50.0, 4e-3, "lower-precision")
    elsewhere = [row(1.0, 1.9, "none", dtype="bfloat16", past=True), row(1.0, 1.9, "none", tensor="dk", past=True),
                 row(30.0, 2e-2, "none")]              # another dtype, another tensor, within a precision's reach
    find_precision_refuted([low] + elsewhere)
    assert low.diagnosis.id == "lower-precision"
    find_precision_refuted([low, row(1.0, 1.9, "none", past=True), row(1.0, 0.5, "none", past=True)] + elsewhere)
    assert low.diagnosis.id == "none"
    said = low.diagnosis.sentence
    assert "yet not a precision: dq errs 1.9e+00 on B1 H2 T77 D64 causal softcap 1" in said, said
    assert "its largest error by softcap: 50 → 4.0e-03, 30 → 2.0e-02, 1 → 1.9e+00; where: rows 3 .. 9" in said, said
    assert "appears to compute" not in said


class _HalfTheCapsSlope(torch.autograd.Function):
    """c tanh(S / c) forward; the backward's slope 1 − t²/2 for 1 − t²: a half precision's size at c = 50."""

    @staticmethod
    def forward(ctx, S, c):
        ctx.save_for_backward(S)
        ctx.c = c
        return c * torch.tanh(S / c)

    @staticmethod
    def backward(ctx, g):
        t = torch.tanh(ctx.saved_tensors[0] / ctx.c)
        return g * (1 - 0.5 * t * t), None


def test_a_softcap_slope_written_otherwise_is_not_read_as_a_precision_on_any_case():
    def half_slope(q, k, v, *, causal, scale, softcap=None):         # computes in float32 whatever it is given
        if softcap is None:
            return attend(q, k, v, causal=causal, scale=scale)
        q, k, v = (x.float() for x in (q, k, v))
        S = _HalfTheCapsSlope.apply(q @ k.transpose(-1, -2) * scale, softcap)
        if causal:
            S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
        return torch.softmax(S, -1) @ v, torch.logsumexp(S, -1)
    report = parity_tests.check(half_slope, features=["softcap", "lse"], tokens=["17"], head_dims=[16], heads=[2],
                                batch=[1], dtypes=["float32"], causal="yes")
    said = [d.sentence for _, d in report.diagnoses]
    assert report.failures and not any(d.id == "lower-precision" for _, d in report.diagnoses), said
    assert any("yet not a precision" in s and "its largest error by softcap: 50 → " in s for s in said), said


def test_varlen_met_with_other_features_leaves_a_sequence_empty_only_past_two():
    apply = REGISTRY["varlen"].apply
    two, three = (apply(Case(b, 4, 61, 83, 64, True), case_rng(0, Case(b, 4, 61, 83, 64, True), "varlen"))
                  for b in (2, 3))
    lq, lk = two.seqlens
    assert (lq[0], lk[0]) == (61, 83) and min(lq) > 0 and min(lk) > 0
    lq, lk = three.seqlens
    assert (lq[0], lk[0]) == (61, 83) and lq[-1] == lk[-1] == 0


def test_a_causal_kernel_ignoring_its_left_window_is_not_said_to_swap_the_sides():
    def window_ignored(q, k, v, *, causal, scale, window=None):
        return attend(q, k, v, causal=causal, scale=scale)[0]
    out = _rows(window_ignored, Case(1, 2, 17, 17, 16, True, (("window", (3, -1)),)), wanted=["window"])["out"]
    assert out.failed and out.diagnosis.id != "window-swapped", out.diagnosis.sentence


def test_dk_dv_taken_from_the_last_query_head_of_each_group_are_named():
    def last_head_grad(q, k, v, *, causal, scale):
        group = q.shape[1] // k.shape[1]
        k, v = (_OneHeadExpand.apply(x, group, group - 1) for x in (k, v))
        return attend(q, k, v, causal=causal, scale=scale)[0]
    rows = _rows(last_head_grad, Case(1, 4, 17, 17, 16, True, (("gqa", 2),)), wanted=["gqa"])
    assert rows["out"].passed and rows["dq"].passed
    for n in ("dk", "dv"):
        assert rows[n].diagnosis.id == "gqa-grad-one-head", rows[n].diagnosis.sentence
        assert "from query head 1 of its group" in rows[n].diagnosis.sentence


def test_a_varlen_kernel_aligning_bottom_right_is_named_where_only_an_inner_sequence_has_tq_below_tk():
    def bottom_right(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return varlen(q, k, v, causal=causal, scale=scale, align="bottom-right", cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)[0]
    square = Case(2, 2, 17, 17, 16, True, (("varlen", ((17, 9), (17, 13))),))     # Tq = Tk, not sequence 1's
    rows = _rows(bottom_right, square, wanted=["varlen"])
    assert all(r.diagnosis.id == "other-alignment" for r in rows.values()), [r.diagnosis.sentence for r in rows.values()]
    assert rows["out"].diagnosis.sentence.startswith("only sequence 1 of the batch: out matches the reference with "
                                                     "bottom-right causal alignment (the check assumed top-left)")


def _lse_as(dtype):
    def kernel(q, k, v, *, causal, scale):
        out, lse = attend(q, k, v, causal=causal, scale=scale)
        return out, lse.to(dtype)
    return kernel


def test_lse_may_be_float32_below_float32_and_nothing_wider_than_the_run():
    # lse in q's dtype, or float32 (FlashAttention's, whatever q is); float64 in a float32 run is refused
    assert all(r.passed for r in _rows(_lse_as(torch.float32), SMALL, "bfloat16", ["lse"]).values())
    assert all(r.passed for r in _rows(_lse_as(torch.bfloat16), SMALL, "bfloat16", ["lse"]).values())
    rows = _rows(_lse_as(torch.float64), SMALL, "float32", ["lse"])
    assert {r.verdict for r in rows.values()} == {"FAIL"}
    assert rows["lse"].note.startswith("wrong lse dtype: torch.float64")


def test_a_kernel_that_fails_on_its_second_call_fails_even_where_both_draws_have_one_answer():
    # every sequence empty: any draw's answer is zeros, yet a second call that raises is a failure
    calls = [0]

    def breaks_when_called_again(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k):
        calls[0] += 1
        if calls[0] > 1:
            raise RuntimeError("workspace already freed")
        return varlen(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)[0]
    empty = Case(2, 2, 5, 5, 16, True, (("varlen", ((0, 0), (0, 0))),))
    rows = _rows(breaks_when_called_again, empty, wanted=["varlen"])
    assert {r.verdict for r in rows.values()} == {"FAIL"}
    assert rows["out"].note == "a second call on new inputs: raised RuntimeError: workspace already freed"


def test_not_deterministic_is_added_to_a_rows_note_not_written_over_it():
    out = _rows(one_unit_off_every_other_call(draws=True), SMALL, wanted=["deterministic"])["out"]
    assert out.verdict == "FAIL" and out.diagnosis.id == "not-deterministic"
    assert "changed torch's global RNG state" in out.note and "not deterministic: a second call differs" in out.note


def test_a_mistake_in_every_sequence_is_not_said_to_be_in_only_some():
    def doubled(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return 2 * varlen(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)[0]
    rows = _rows(doubled, Case(2, 2, 17, 17, 16, True), wanted=["varlen"])
    assert rows["out"].failed and rows["out"].diagnosis.id == "denominator"
    assert all("only sequence" not in r.diagnosis.sentence for r in rows.values() if r.failed), \
        [r.diagnosis.sentence for r in rows.values() if r.failed]


class _SavesTheScaledQ(torch.autograd.Function):
    """softmax(scale q kᵀ) v, its backward written out (FlashAttention-2's), from a q the forward
    saved after scaling it: P = exp(scale · (scale q) kᵀ − lse), dq = scale dS k, dk = scale dSᵀ (scale q)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        q = q * scale                                  # the scale folded into q once ...
        S = q @ k.transpose(-1, -2)
        if causal:
            S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
        lse = torch.logsumexp(S, -1)
        out = torch.exp(S - lse[..., None]) @ v
        ctx.save_for_backward(q, k, v, out, lse)       # ... and saved so, for a backward that scales again
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        S = ctx.scale * q @ k.transpose(-1, -2)
        if ctx.causal:
            S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
        P = torch.exp(S - lse[..., None])
        dS = P * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
        return ctx.scale * dS @ k, ctx.scale * dS.transpose(-1, -2) @ q, P.transpose(-1, -2) @ dout, None, None


def test_a_backward_from_a_q_saved_already_scaled_is_named_on_every_gradient():
    def saves_scaled_q(q, k, v, *, causal, scale):
        return _SavesTheScaledQ.apply(q, k, v, scale, causal)
    for scale, said in ((None, "scale 1/D instead of 1/sqrt(D) (the scale applied twice"),
                        (0.3, "the scale applied twice (0.3^2 = 0.09")):
        rows = _rows(saves_scaled_q, Case(1, 2, 17, 17, 16, True, () if scale is None else (("scale", scale),)))
        assert rows["out"].passed
        for n in ("dk", "dv"):
            assert rows[n].diagnosis.id.startswith("backward-scale-") and said in rows[n].diagnosis.sentence, \
                rows[n].diagnosis.sentence
        dq = rows["dq"].diagnosis       # the same P, and dq scaled once where dk is twice: 1/scale apart
        assert dq.id == rows["dk"].diagnosis.id and "named on dk, dv" in dq.sentence, dq.sentence
        assert f"times one constant, {1 / (scale or 0.25):.6g} (1/scale)" in dq.sentence, dq.sentence


class _DqWritten(torch.autograd.Function):
    """softmax(scale q kᵀ) v (``causal``: top-left), its backward written out with dk and dv right
    and dq = ``dq_of``(P, dP, D, k, scale) (D = rowsum(dO ∘ O), (..., Tq, 1)): one dQ pass's slip."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, dq_of):
        P = torch.softmax(scores(q, k, causal=causal, scale=scale), -1)
        ctx.save_for_backward(q, k, v, P)
        ctx.scale, ctx.dq_of = scale, dq_of
        return P @ v

    @staticmethod
    def backward(ctx, dout):
        q, k, v, P = ctx.saved_tensors
        dP, D = dout @ v.transpose(-1, -2), (dout * (P @ v)).sum(-1, keepdim=True)
        dS = P * (dP - D)
        return ctx.dq_of(P, dP, D, k, ctx.scale), ctx.scale * dS.transpose(-1, -2) @ q, \
            P.transpose(-1, -2) @ dout, None, None, None


def _dq_written(dq_of):
    """A kernel whose dQ pass is ``dq_of`` (`_DqWritten`)."""
    return lambda q, k, v, *, causal, scale: _DqWritten.apply(q, k, v, scale, causal, dq_of)


def test_a_dq_pass_that_loses_its_masked_stage_is_told_from_one_that_skips_a_block():
    said = {}
    for lost, kept, tk in (("masked", 1 - torch.eye(3), 96),                               # the diagonal's blocks
                           ("past", torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]), 45),  # ... and keys 32 .. 44
                           ("interior", torch.ones(3, 3).index_put_((torch.tensor(2), torch.tensor(0)),
                                                                    torch.tensor(0.0)), 96)):  # (2, 0), seen whole
        keep = torch.kron(kept, torch.ones(32, 32))[:96, :tk]         # dq from the blocks of 32 x 32 kept
        dq_from_some_blocks = _dq_written(lambda P, dP, D, k, scale, keep=keep: scale * (P * (dP - D) * keep) @ k)
        rows = _rows(dq_from_some_blocks, Case(1, 2, 96, tk, 16, True))
        assert rows["out"].passed and rows["dk"].passed and rows["dv"].passed
        dq = rows["dq"].diagnosis
        assert dq.id == "backward-blocks", dq.sentence
        said[lost] = dq.sentence
    mask = "the blocks that need a mask (partly seen, or past the last key), and only those"
    assert "blocks of 32 x 32 that the forward uses (query tile 0 without key tile 0; query tile 1 without key " \
        f"tile 1; query tile 2 without key tile 2): {mask}" in said["masked"], said["masked"]
    assert f"query tile 2 without key tile 1): {mask}" in said["past"], said["past"]       # keys 32 .. 44 of 45
    # the fewest blocks that explain: the block of 32 x 32 left out is the share of a 64 x 32 one that is seen
    assert "(query tile 1 without key tile 0): a tile loop's start or end off" in said["interior"], said


def _dq_over_key_tiles(starts):
    """dq summed over key tiles of 16 starting at ``starts(tk)``: each tile's scale dS K added once."""
    def dq_of(P, dP, D, k, scale):
        dS = P * (dP - D)
        return scale * sum(dS[..., s:s + 16] @ k[..., s:s + 16, :] for s in starts(k.shape[-2]))
    return _dq_written(dq_of)


def test_keys_a_dq_pass_adds_twice_or_leaves_out_are_named_with_their_rows():
    laid_back = _dq_over_key_tiles(lambda tk: [*range(0, tk - 16, 16), tk - 16])    # the last tile kept whole
    dq = _rows(laid_back, Case(1, 2, 45, 45, 16, True))["dq"].diagnosis
    assert dq.id == "backward-counts" and "(every query row: keys 29 .. 31 twice): tiles of the reduction that " \
        "overlap" in dq.sentence, dq.sentence
    last_key_lost = _dq_written(lambda P, dP, D, k, scale: scale * (P * (dP - D))[..., :-1] @ k[..., :-1, :])
    dq = _rows(last_key_lost, Case(1, 2, 45, 45, 16, False))["dq"].diagnosis
    assert dq.id == "backward-counts" and "(every query row: keys 44 left out): a loop's start or end" in dq.sentence, \
        dq.sentence


def test_a_pipelined_loop_adding_each_tiles_product_after_the_rescale_is_named():
    def deferred(q, k, v, *, causal, scale):                 # key tiles of 16, P V of a tile added one step late
        S = scores(q, k, causal=causal, scale=scale)
        m = torch.full(S.shape[:-1] + (1,), -math.inf, dtype=S.dtype)
        acc, l, late = torch.zeros_like(q), torch.zeros_like(m), None
        for t in range(0, S.shape[-1], 16):
            new = torch.maximum(m, S[..., t:t + 16].amax(-1, keepdim=True))
            alpha = torch.exp(m - new).nan_to_num(0.0)
            P = torch.exp(S[..., t:t + 16] - new)
            l, m = l * alpha + P.sum(-1, keepdim=True), new
            acc = acc * alpha + (late if late is not None else 0.0)       # (acc + late) * alpha is meant
            late = P @ v[..., t:t + 16, :]
        return (acc + late) / l
    out = _rows(deferred, Case(1, 2, 45, 45, 16, True))["out"].diagnosis
    assert out.id == "deferred-rescale" and "(tiles of 16, visited from the first) added after the accumulator is " \
        "rescaled for the next tile" in out.sentence, out.sentence


def test_query_tiles_reading_their_partners_key_range_are_named_with_the_partner():
    def paired(q, k, v, *, causal, scale):      # causal load balance: tiles t and n-1-t, one key range for both
        S = scale * q @ k.transpose(-1, -2)
        tq, tk = S.shape[-2:]
        n = -(-tq // 32)
        rows, keys = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
        reach = (torch.minimum(rows // 32, n - 1 - rows // 32) + 1) * 32    # the light tile's, for both
        hidden = (keys > rows) | (keys >= reach) if causal else keys >= reach
        return torch.softmax(S.masked_fill(hidden, -math.inf), -1) @ v
    out = _rows(paired, Case(1, 2, 100, 100, 16, True))["out"].diagnosis
    assert out.id == "key-tile-ranges" and "each the key tiles another query tile of 32 spans (rows 64 .. 95 read " \
        "query tile 1's (rows 32 .. 63); rows 96 .. 99 read query tile 0's (rows 0 .. 31)): a key range computed " \
        "for another tile's rows" in out.sentence, out.sentence


def test_nan_on_exactly_the_rows_holding_a_deep_weight_is_said_so():
    def exp_breaking_below_minus_5(q, k, v, *, causal, scale):      # an exponential with no lower clamp
        S = scores(q, k, causal=causal, scale=scale)
        x = S - S.amax(-1, keepdim=True)
        e = torch.where(torch.isinf(x), 0.0, torch.where(x < -5, math.nan, torch.exp(x)))
        return (e @ v) / e.sum(-1, keepdim=True)
    out = _rows(exp_breaking_below_minus_5, Case(1, 2, 45, 45, 16, True))["out"].diagnosis
    assert out.id == "non-finite" and "; non-finite on exactly the query rows with a weight below 2^-7 of their " \
        "largest (a key more than 7 log2 units under the row's maximum" in out.sentence, out.sentence


def test_keys_and_values_read_with_their_signs_lost_are_named():
    def signs_lost(q, k, v, *, causal, scale):
        return attend(q, k.abs(), v.abs(), causal=causal, scale=scale)[0]
    out = _rows(signs_lost, SMALL)["out"]
    assert out.diagnosis.id == "input-sign-lost" and "k and v read with their signs lost (|k|, |v|)" in \
        out.diagnosis.sentence, out.diagnosis.sentence


@needs_dtype("float16")
def test_an_accumulator_stored_in_float16_before_its_scale_is_named_an_overflow(without_input_classes):
    def stored_before_scaled(q, k, v, *, causal, scale):      # the accumulator in raw units 2^17 times out's
        out, _ = attend(q.float(), k.float(), v.float(), causal=causal, scale=scale)
        return ((out * 2.0 ** 17).to(q.dtype) * 2.0 ** -17).to(q.dtype)
    report = parity_tests.check(stored_before_scaled, tokens=["17"], head_dims=[16], heads=[2], batch=[1],
                                dtypes=["bfloat16", "float16"], causal="yes")
    failing = [r for r in report.rows if r.failed and r.tensor == "out"]
    assert failing and all(r.dtype == "float16" and r.diagnosis.id == "float16-overflow" for r in failing), failing
    assert "infinite in float16 alone (the same case is finite in bfloat16 or float32)" in failing[0].diagnosis.sentence
    assert report.diagnosis == "float16-overflow"

    def nan_in_float16(q, k, v, *, causal, scale):            # NaN alone is no overflow
        out, _ = attend(q, k, v, causal=causal, scale=scale)
        return out.masked_fill(torch.ones_like(out, dtype=torch.bool), math.nan) if q.dtype == torch.float16 else out
    report = parity_tests.check(nan_in_float16, tokens=["17"], head_dims=[16], heads=[2], batch=[1],
                                dtypes=["bfloat16", "float16"], causal="yes")
    failing = [r for r in report.rows if r.failed and r.tensor == "out"]
    assert failing and all(r.diagnosis.id == "non-finite" for r in failing), failing


class _SavedLseForItsGradient(torch.autograd.Function):
    """Causal (out, lse), the backward written out, its row term D = rowsum(dO ∘ O) − lse: the saved
    lse loaded where its incoming gradient dlse is meant."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        S = scale * q @ k.transpose(-1, -2)
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
        lse = torch.logsumexp(S, -1)
        P = torch.exp(S - lse[..., None])
        out = P @ v
        ctx.save_for_backward(q, k, v, P, out, lse)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, P, out, lse = ctx.saved_tensors
        D = (dout * out).sum(-1) - lse
        dS = P * (dout @ v.transpose(-1, -2) - D[..., None])
        return ctx.scale * dS @ k, ctx.scale * dS.transpose(-1, -2) @ q, P.transpose(-1, -2) @ dout, None


def test_the_saved_lse_read_for_its_gradient_is_said_in_the_backwards_row_term():
    def lse_for_dlse(q, k, v, *, causal, scale):
        return _SavedLseForItsGradient.apply(q, k, v, scale)
    rows = _rows(lse_for_dlse, SMALL, wanted=["lse_grad"])
    assert rows["out"].passed and rows["lse"].passed and rows["dv"].passed
    for n in ("dq", "dk"):
        assert rows[n].diagnosis.id == "wrong-delta" and "(D = rowsum(dO ∘ O) - lse: the saved lse read where the " \
            "lse gradient dlse is meant)" in rows[n].diagnosis.sentence, rows[n].diagnosis.sentence


def test_a_lost_parenthesis_in_the_dq_passs_ds_is_named_with_the_keys_it_visits():
    t = 45
    seen = torch.ones(t, t).tril()
    tiles = torch.zeros(t, t)                          # query tiles of 32 walk key tiles of 16 up to their last row
    for r0 in range(0, t, 32):
        end = min(t, -(-min(t, r0 + 32) // 16) * 16)
        tiles[r0:r0 + 32, :end] = 1
    for visited, said in ((seen, "the keys its row sees"),
                          (tiles, "every key of the key tiles of 16 its query tile of 32 walks")):
        delta_unweighted = _dq_written(lambda P, dP, D, k, scale, visited=visited: scale * (P * dP - D * visited) @ k)
        rows = _rows(delta_unweighted, Case(1, 2, t, t, 16, True))
        assert rows["out"].passed and rows["dk"].passed and rows["dv"].passed
        assert rows["dq"].diagnosis.id == "delta-unweighted" and f"D subtracted unweighted at {said})" in \
            rows["dq"].diagnosis.sentence, rows["dq"].diagnosis.sentence


def test_keys_before_a_dq_passs_full_tiles_laid_back_from_the_end_are_named():
    def dq_of(P, dP, D, k, scale):          # full key tiles of 64 laid back from Tk, and nothing more
        first = k.shape[-2] % 64
        return scale * (P * (dP - D))[..., first:] @ k[..., first:, :]
    rows = _rows(_dq_written(dq_of), Case(1, 2, 17, 77, 16, False))
    assert rows["out"].passed and rows["dk"].passed and rows["dv"].passed
    assert rows["dq"].diagnosis.id == "rows-read-as-zero" and "dq's pass reading K's rows 0 .. 12 as 0 (full tiles " \
        "of 64 laid back from row 77: the first 77 mod 64 = 13 never visited)" in rows["dq"].diagnosis.sentence, \
        rows["dq"].diagnosis.sentence


class _GradientCut(torch.autograd.Function):
    """x itself; its gradient kept where ``keep`` (rows of the packed token axis) holds alone."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.keep[:, None, None], None


def _gradient_lost(rows_lost):
    def kernel(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        lost = rows_lost(torch.arange(k.shape[0])[:, None], cu_seqlens_k[1:-1]).any(-1)
        k, v = (_GradientCut.apply(x, (~lost).to(x.dtype)) for x in (k, v))
        return varlen(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)[0]
    return kernel


def test_keys_in_a_packed_tile_shared_with_the_sequence_before_are_located_so():
    case = Case(3, 2, 20, 40, 16, False, (("varlen", ((20, 20, 20), (40, 40, 40))),))
    # the rows of the packed tile of 32 that holds the sequence before: 40 .. 63 and 80 .. 95
    rows = _rows(_gradient_lost(lambda r, starts: (r >= starts) & (r < (starts + 31) // 32 * 32)), case,
                 wanted=["varlen"])
    assert rows["out"].passed and rows["dq"].passed
    for n in ("dk", "dv"):
        assert "only sequences 1, 2 of the batch; in each, only its first key rows, those in the packed tile of 32 " \
            "that also holds the sequence before it (1: rows 0 .. 23, 2: rows 0 .. 15)" in rows[n].diagnosis.sentence, \
            rows[n].diagnosis.sentence
    rows = _rows(_gradient_lost(lambda r, starts: r >= starts), case, wanted=["varlen"])     # each whole: no tile
    assert all(rows[n].failed and "packed tile" not in rows[n].diagnosis.sentence for n in ("dk", "dv"))


def test_a_bottom_right_offset_from_the_packed_rows_of_a_gqa_group_is_named():
    def packed_rows_offset(q, k, v, *, causal, scale, align="top-left"):
        group, tq, tk = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
        k, v = (x.repeat_interleave(group, 1) for x in (k, v))
        offset = tk - tq * group if align == "bottom-right" else 0            # Tq x G rows where Tq is meant
        S = scale * q @ k.transpose(-1, -2)
        if causal:
            S = S.masked_fill(torch.arange(tk) > torch.arange(tq)[:, None] + offset, -math.inf)
        return torch.nan_to_num(torch.softmax(S, -1)) @ v
    case = Case(1, 8, 45, 203, 16, True, (("gqa", 4),))
    rows = _rows(packed_rows_offset, case, wanted=["gqa"], align="bottom-right")
    assert rows["out"].diagnosis.id == "gqa-packed-rows-offset" and "computed with the packed rows Tq x 2 for Tq" in \
        rows["out"].diagnosis.sentence, rows["out"].diagnosis.sentence


def test_a_broadcast_bias_read_through_its_own_views_strides_is_named():
    def own_strides(q, k, v, *, causal, scale, bias):
        full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        view = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).contiguous()
        offset = sum(torch.arange(n).reshape([-1 if a == b else 1 for b in range(4)]) * view.stride(a)
                     for a, n in enumerate(full))                        # view.stride(), not the expansion's
        flat = view.reshape(-1)
        read = torch.where(offset < flat.numel(), flat[offset.clamp(max=flat.numel() - 1)], torch.zeros(()))
        S = scale * q @ k.transpose(-1, -2) + read.to(q.dtype)
        if causal:
            S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
        return torch.softmax(S, -1) @ v
    rows = _rows(own_strides, Case(2, 2, 17, 17, 16, True, (("bias", (2, 1, 1, 17)),)), wanted=["bias"])
    for n in ("out", "dq", "dk", "dv", "dbias"):
        assert rows[n].failed and rows[n].diagnosis.id == "bias-own-strides", (n, rows[n].diagnosis.sentence)
    assert "read through the strides of its own view (2, 1, 1, 17), (17, 17, 17, 1)" in rows["out"].diagnosis.sentence


def test_outputs_channels_in_another_order_are_named_with_the_order():
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])              # FP8 lanes' byte-permute, applied twice
    order = torch.cat([perm[perm], 8 + perm[perm]])

    def unshuffled_twice(q, k, v, *, causal, scale):
        return attend(q, k, v, causal=causal, scale=scale)[0][..., order]
    out = _rows(unshuffled_twice, SMALL)["out"]
    assert out.diagnosis.id == "out-channels-moved" and "within each group of 8 channels, channel p holding the " \
        "reference's channel 0, 4, 1, 5, 2, 6, 3, 7" in out.diagnosis.sentence, out.diagnosis.sentence


def test_a_dq_pass_loading_d_from_a_pointer_advanced_with_its_key_tiles_is_named():
    def dq_of(P, dP, D, k, scale):          # key tile t of 16 takes the D of row i + 16 t, 0 past the last row
        tq, tk = P.shape[-2:]
        rows = torch.arange(tq)[:, None] + torch.arange(tk)[None, :] // 16 * 16
        shifted = torch.where(rows < tq, D[..., 0][..., rows.clamp(max=tq - 1)], torch.zeros(()))
        return scale * (P * (dP - shifted)) @ k
    rows = _rows(_dq_written(dq_of), Case(1, 2, 45, 45, 16, True))
    assert rows["out"].passed and rows["dk"].passed and rows["dv"].passed
    assert rows["dq"].diagnosis.id == "delta-pointer-advanced" and "key tile t taking the D of row i + 16t" in \
        rows["dq"].diagnosis.sentence, rows["dq"].diagnosis.sentence
