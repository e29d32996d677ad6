"""The diagnosis's own limits and what it may claim."""

import numpy as np
import pytest
import torch

import parity_tests
from parity_tests.kernels import cases, runner, targets
from parity_tests.kernels.diagnosis import diagnose
import crashing_kernels as bad
from sampled import moved

pytestmark = pytest.mark.usefixtures("without_input_classes")   # (conftest.py)

ONE = dict(dtypes=["float32"], head_dims=[16], heads=[2], batch=[1])


def test_a_case_of_exactly_dense_limit_pairs_is_diagnosed_densely():
    case = cases.Case(1, 2, 4096, 4096, 1, True)             # B H Tq Tk = 2^25 = DENSE_LIMIT
    assert case.batch * case.heads * case.tq * case.tk == diagnose.DENSE_LIMIT
    assert diagnose.fits_densely(case)
    assert not diagnose.fits_densely(cases.Case(1, 2, 4096, 4097, 1, True))



def _dk_too_large(q, k, v, *, causal, scale):
    return bad.sdpa(q, bad.with_backward(k, lambda g: g * 1.5), v, causal=causal, scale=scale)


def _times(c):
    def kernel(q, k, v, *, causal, scale):
        return bad.sdpa(q, k, v, causal=causal, scale=scale) * c
    return kernel


def _in_bfloat16(q, k, v, *, causal, scale):
    return bad.sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal, scale=scale).to(q.dtype)


@pytest.mark.parametrize("c", [0.0, 2.0])
def test_at_one_token_no_mistake_is_claimed_that_cannot_be_told_apart(c):
    # with one key every weight is 1: a shifted mask predicts zeros, a fitted denominator fits any c v
    report = parity_tests.check(_times(c), tokens=["1"], causal="both", **ONE)
    assert not report.passed
    claimed = {d.id for r, d in report.diagnoses if " T1 " in r.case}
    assert not claimed & {"mask-one-past", "mask-one-future", "denominator"}, claimed
    assert "row factors 0" not in str(report)
    if c == 0.0:
        assert report.failures[0].case.startswith("B1 H2 T1 ")
        assert report.failures[0].diagnosis.sentence.startswith("out is zero everywhere")


def test_a_backward_only_bug_is_said_so_first_and_given_no_forward_mistake():
    report = parity_tests.check(_dk_too_large, tokens=["17", "45x77"], causal="yes", **ONE)
    assert {r.tensor for r in report.failures} == {"dk"}
    forward = ["stale running maximum", "causal mask", "scale 1/D", "no scale", "alignment", "read as"]
    for row, d in report.diagnoses:
        assert d.sentence.startswith("the output is right; only the backward is wrong: dk "), d.sentence
        assert not any(words in d.sentence for words in forward), d.sentence


def test_errors_the_size_of_a_lower_precision_are_named():
    report = parity_tests.check(_in_bfloat16, tokens=["17", "45x77"], causal="both", **ONE)
    assert report.failures and report.diagnosis == "lower-precision"
    for row, d in report.diagnoses:
        # named on the standard-normal cases; at most silent where logits are huge (outliers:
        # a near one-hot softmax leaves most rows exact, so the error has no spread to match)
        assert d.id == "lower-precision" or (d.id == "none" and "outliers" in row.case), d.sentence
        if d.id == "lower-precision":
            # bfloat16 throughout first; P alone rounded to bfloat16 may err alike (said after it)
            assert d.sentence.split(" is the size of ")[1].startswith(("bfloat16's", "a plain bfloat16")), d.sentence
            assert "inside this float32 check" in d.sentence


# ----------------------------------------------------------------------------
# A precision is read only from an error that looks like rounding

GROWTH = dict(tokens=["8", "32", "128", "512"], head_dims=[16], heads=[1], batch=[1], dtypes=["float32"],
              causal="no")
PRECISION = {"lower-precision", "grows-with-length"}


def _without(monkeypatch, *ids):
    """The chapter's catalogue without the entries ``ids``: what a kernel matching none reads as."""
    from parity_tests.kernels.diagnosis import mistakes
    chapter = mistakes.chapter
    monkeypatch.setattr(mistakes, "chapter", lambda ctx: [h for h in chapter(ctx) if h.id not in ids])


@pytest.mark.slow
@pytest.mark.parametrize("name, expected", [("acc_not_rescaled", "acc-not-rescaled"),
                                            ("split_merge_no_rescale", "split-no-rescale")])
def test_a_rescale_left_out_is_never_read_as_a_precision(name, expected, monkeypatch):
    from parity_tests.kernels.planted.chapter import GALLERY
    kernel = GALLERY[name][0]
    report = parity_tests.check(kernel, **GROWTH)
    assert report.diagnosis == expected, str(report)
    # its errors, 10^5 x the bound, pass short and fail long: a drift by that pattern alone
    _without(monkeypatch, expected, "stale-max", "acc-not-rescaled", "split-no-rescale")
    for float64 in ("runs", "refused"):      # refused: its size alone must tell (and its rows, for out)
        if float64 == "refused":
            monkeypatch.setattr(diagnose, "_float64_run", lambda ev: "not supported: float64")
        report = parity_tests.check(kernel, **GROWTH)
        assert report.failures
        for row, d in report.diagnoses:
            assert d.id not in PRECISION, (float64, d.sentence)
            assert d.rounding is False or d.id != "none", (float64, d.sentence)


def _xt_attend(q, k, v, *, causal, scale, softcap=None, alibi_slopes=None):
    """x-transformers' Attend's order, in the input's dtype: the scaled scores, plus ALiBi,
    then the softclamp, then the causal mask."""
    S = (q @ k.transpose(-1, -2)) * scale
    i = torch.arange(S.shape[-2], dtype=q.dtype)[:, None]
    j = torch.arange(S.shape[-1], dtype=q.dtype)[None, :]
    if alibi_slopes is not None:
        S = S - alibi_slopes.to(q.dtype)[:, None, None] * (i - j).abs()
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    if causal:
        S = S.masked_fill(j > i, -torch.inf)
    return torch.softmax(S, dim=-1) @ v


XT = dict(features=["softcap", "alibi"], tokens=["17"], head_dims=[16], heads=[2], batch=[1], dtypes=["float32"],
          causal="both")


def test_the_softcap_after_alibi_is_named_a_convention():
    report = parity_tests.check(_xt_attend, **XT)
    assert report.failures and report.diagnosis == "softcap-after-bias", str(report)
    for row, d in report.diagnoses:
        assert d.id == "softcap-after-bias", d.sentence
        assert "softcap applied after ALiBi" in d.sentence


@moved
def test_a_gap_a_float64_run_shows_again_is_not_a_precision(monkeypatch):
    from parity_tests.kernels.features import softcap
    monkeypatch.setattr(softcap, "after_bias", lambda ctx, cap: [])
    report = parity_tests.check(_xt_attend, **XT)
    assert report.failures
    for row, d in report.diagnoses:            # its error is the size of bfloat16's: only float64 tells
        assert d.id not in PRECISION, d.sentence
        if d.id == "none" and d.spread:
            assert "not rounding: a float64 run of the target shows the same gap" in d.sentence, d.sentence
    assert any(d.id == "none" and d.spread for _, d in report.diagnoses)       # the reading above was tried


def test_a_kernel_in_bfloat16_whatever_its_input_is_still_read_as_bfloat16():
    # in float64 it returns bfloat16's values again (on the float32 grid): its float64 run says nothing
    report = parity_tests.check(_in_bfloat16, tokens=["17", "45x77"], causal="yes", **ONE)
    named = [d for r, d in report.diagnoses if "outliers" not in r.case]
    assert named and all(d.id == "lower-precision" for d in named), [d.sentence for d in named]


def test_an_error_of_bfloat16s_size_in_one_batch_entry_of_three_is_not_read_as_a_precision():
    # a loss of precision errs in every entry alike: one entry rounded among three is a slip there
    # (rounded one step down, float32 to bfloat16, float64 to float32: a float64 run shows no gap)
    def one_entry(q, k, v, *, causal, scale):
        out = bad.sdpa(q, k, v, causal=causal, scale=scale)
        low = torch.bfloat16 if q.dtype == torch.float32 else torch.float32
        one = bad.sdpa(*(x[1:2].to(low) for x in (q, k, v)), causal=causal, scale=scale).to(q.dtype)
        return torch.cat([out[:1], one, out[2:]])
    rows = runner.run_case(targets.resolve(one_entry), cases.Case(3, 2, 45, 77, 16, False), "float32", "cpu")
    failing = [r for r in rows if not r.passed]
    assert "out" in {r.tensor for r in failing}
    assert not {r.diagnosis.id for r in failing} & PRECISION, [r.diagnosis.sentence for r in failing]
    every = runner.run_case(targets.resolve(_in_bfloat16), cases.Case(3, 2, 45, 77, 16, False), "float32", "cpu")
    assert {r.diagnosis.id for r in every if not r.passed} == {"lower-precision"}      # the guard blinds no one

    def one_entry_coarse(q, k, v, *, causal, scale):           # the other two with 1/50 of bfloat16's error
        out = one_entry(q, k, v, causal=causal, scale=scale)
        share = torch.tensor([0.02, 0.0, 0.02], dtype=q.dtype)[:, None, None, None]
        return out + (_in_bfloat16(q, k, v, causal=causal, scale=scale) - out) * share
    rows = runner.run_case(targets.resolve(one_entry_coarse), cases.Case(3, 2, 45, 77, 16, False), "float32", "cpu")
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id not in PRECISION, out.diagnosis.sentence


def test_a_diagnosis_that_raises_leaves_the_fail_and_says_it_could_not_diagnose(monkeypatch):
    from parity_tests.kernels import runner
    from parity_tests.kernels.diagnosis import mistakes

    def broken(ctx):
        raise IndexError("planted in the catalogue")
    monkeypatch.setattr(mistakes, "catalogue", broken)
    monkeypatch.delenv(runner.DIAGNOSIS_RAISES, raising=False)
    report = parity_tests.check(_times(1.5), tokens=["17"], causal="yes", **ONE)
    assert not report.passed and report.failures
    assert all(r.verdict == "FAIL" for r in report.rows if r.tensor == "out")
    assert {d.sentence for _, d in report.diagnoses} == {"could not diagnose: IndexError: planted in the catalogue"}
    assert len(report.diagnoses) == len(report.failures) and report.diagnosis is None
    assert "could not diagnose: IndexError" in str(report)
    monkeypatch.setenv(runner.DIAGNOSIS_RAISES, "1")            # the suite's own setting: the defect raises
    with pytest.raises(IndexError, match="planted in the catalogue"):
        parity_tests.check(_times(1.5), tokens=["17"], causal="yes", **ONE)


def _named(residuals, bound=0.1):
    """What `_diagnose_tensor` names for a tensor of 1s (the reference: 0s) that sits at
    ``residuals[i]`` from hypothesis i, the first below it and the others above."""
    import numpy as np
    from parity_tests.kernels.diagnosis.mistakes import Hypothesis
    ref = np.zeros((1, 1, 4, 4))
    hyps, got = [], ref + 1.0
    for i, res in enumerate(residuals):
        pred = got + (1 if i else -1) * res
        hyps.append(Hypothesis(f"h{i}", f"hypothesis {i}", lambda grads=True, p=pred: {"dq": p}, ("dq",)))
    return diagnose._diagnose_tensor("dq", hyps, {}, {"dq": got}, {"dq": ref}, 1.0, bound, (slice(None),) * 2)


def test_a_cause_is_named_only_well_inside_the_bound_and_clearly_closer_than_the_next():
    assert _named([0.01, 0.5]).id == "h0"
    near = _named([0.09, 0.5])                                # 0.9 of the bound: no cause
    assert near.id == "none" and "0.90 of the bound: too near it to name a cause" in near.sentence
    close = _named([0.04, 0.07])              # the next 1.6x farther, predicting something else
    assert close.id == "none" and "hypothesis 0 (4.0e-02) and hypothesis 1 (6.5e-02) come too close" \
        in close.sentence
    assert _named([0.04, 0.3]).id == "h0"                     # the next 5.8x farther: clear
    assert _named([0.045, 0.5]).id == "h0"                    # 0.45 of the bound


def test_a_runner_up_withholds_the_name_where_it_predicts_otherwise_in_any_one_slice():
    """Two (batch, head) slices; the runner-up (1.6x farther) predicts what the first does in one
    and something else in the other: no cause.  One predicting the same everywhere (within the
    bound of it) is no rival: the first is named."""
    from parity_tests.kernels.diagnosis.mistakes import Hypothesis
    ref = np.zeros((1, 2, 4, 4))
    got, bound = ref + 1.0, 0.1

    def named(first, second):
        hyps = [Hypothesis(f"h{i}", f"hypothesis {i}", lambda grads=True, p=p: {"dq": p}, ("dq",))
                for i, p in enumerate((first, second))]
        return diagnose._diagnose_tensor("dq", hyps, {}, {"dq": got}, {"dq": ref}, 1.0, bound, (slice(None),) * 2)

    first = got - 0.04
    otherwise_in_one = got + 0.065
    otherwise_in_one[0, 0] = first[0, 0]                      # the same as the first in slice 0 only
    assert named(first, otherwise_in_one).id == "none"
    assert named(first, first - 0.02).id == "h0"              # 0.06 away, but the first's prediction again


def test_a_share_of_a_large_error_is_a_match_only_within_four_bounds():
    assert diagnose.explains(1.5, 1e4, 1.0)                   # a sharper softmax rounds past the bound
    assert diagnose.explains(3.5, 1e4, 1.0)
    assert not diagnose.explains(7.0, 3e4, 1.0)               # 2e-4 of a huge error, 7 bounds off (an FP8 case)
    assert not diagnose.explains(21.0, 5e4, 1.0)              # 4e-4 of a huge error, but 21 bounds off
    assert diagnose.explains(0.9, 5e4, 1.0)


def test_a_closest_guess_is_given_only_when_it_leaves_little_of_the_error():
    near = _named([0.004, 0.5], bound=0.001)               # 4 bounds off, 0.4 % of the error left
    assert near.id == "none" and "(closest: hypothesis 0, 4.0e-03 vs bound 1.0e-03)" in near.sentence
    for far in ([0.2, 0.5], [0.02, 0.5]):                  # a fifth of the error left; 20 bounds off
        said = _named(far, bound=0.001).sentence
        assert said == "dq matches none of the catalogued mistakes", said



def _backward_by_hand(slip):
    """Attention with its backward written out (dS = P ∘ (dO Vᵀ − D), dQ = scale dS K, dK = scale
    dSᵀ Q, dV = Pᵀ dO) and one ``slip`` in it: "unnormalised-o" (D = rowsum(dO ∘ O) from O before
    its division by l), "exp2" (P = 2^(S log2(e) − lse) from the natural-log lse), "bfloat16-lse"
    (P = exp(S − lse) from lse saved in bfloat16)."""
    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            s = q @ k.transpose(-1, -2) * scale
            if causal:
                s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            lse = torch.logsumexp(s, -1, keepdim=True)
            out = torch.exp(s - lse) @ v
            ctx.save_for_backward(q, k, v, s, lse, out)
            ctx.scale = scale
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, s, lse, out = ctx.saved_tensors
            p = torch.exp2(s * 1.4426950408889634 - lse) if slip == "exp2" else \
                torch.exp(s - lse.bfloat16().to(s.dtype)) if slip == "bfloat16-lse" else torch.exp(s - lse)
            o = out * torch.exp(lse - s.amax(-1, keepdim=True)) if slip == "unnormalised-o" else out   # O l
            ds = p * (dout @ v.transpose(-1, -2) - (dout * o).sum(-1, keepdim=True))
            return ds @ k * ctx.scale, ds.transpose(-1, -2) @ q * ctx.scale, p.transpose(-1, -2) @ dout, None, None

    def attention(q, k, v, *, causal, scale):
        return Attention.apply(q, k, v, causal, scale)
    return attention


def test_a_backward_wrong_only_in_its_delta_term_is_said_so_with_its_per_row_factors():
    report = parity_tests.check(_backward_by_hand("unnormalised-o"), tokens=["17", "45x77"], causal="both", **ONE)
    assert {r.tensor for r in report.failures} == {"dq", "dk"}          # dv and out right
    for row, d in report.diagnoses:
        assert d.id == "wrong-delta", d.sentence
        assert d.residual <= diagnose.NAMED_WITHIN * d.bound
        assert "the backward's D = rowsum(dO ∘ O) off by each row's own amount (D' / D from " in d.sentence
        low = float(d.sentence.split("(D' / D from ")[1].split()[0])
        assert low >= 1.0                                               # D' = l D, l >= 1


def _padded_to_tiles_of_32(q, k, v, *, causal, scale):
    """Keys padded with zeros to whole tiles of 32 and the padding left unmasked."""
    pad = -k.shape[-2] % 32
    zeros = lambda a: torch.zeros(a.shape[:-2] + (pad,) + a.shape[-1:], dtype=a.dtype)
    return bad.sdpa(q, torch.cat([k, zeros(k)], -2), torch.cat([v, zeros(v)], -2), causal=causal, scale=scale)


def test_padding_keys_left_unmasked_are_named_with_their_count():
    report = parity_tests.check(_padded_to_tiles_of_32, tokens=["45x77"], causal="no", **ONE)
    assert not report.passed and report.diagnosis == "padding-seen"
    out = next(d for r, d in report.diagnoses if r.tensor == "out" and " T45x77 " in r.case)
    assert "the 19 zero keys that pad Tk = 77 to key tiles of 32 left unmasked" in out.sentence


def _max_not_carried(q, k, v, *, causal, scale):
    """An online softmax over key blocks of 32 whose weights take each block's own maximum,
    while l and acc are rescaled by the running one."""
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    m = torch.full(s.shape[:-1] + (1,), float("-inf"), dtype=s.dtype)
    l, acc = torch.zeros_like(m), torch.zeros(s.shape[:-1] + v.shape[-1:], dtype=s.dtype)
    finite = lambda x: torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    for start in range(0, s.shape[-1], 32):
        block = s[..., start:start + 32]
        new = torch.maximum(m, block.amax(-1, keepdim=True))
        alpha = torch.exp(finite(m) - finite(new)) * torch.isfinite(m)
        p = torch.exp(block - finite(block.amax(-1, keepdim=True)))        # the block's own maximum
        l, acc, m = l * alpha + p.sum(-1, keepdim=True), acc * alpha + p @ v[..., start:start + 32, :], new
    return acc / torch.where(l > 0, l, torch.ones_like(l))


def test_a_maximum_not_carried_into_the_weights_is_named_with_its_block():
    report = parity_tests.check(_max_not_carried, tokens=["45x77"], causal="both", **ONE)
    outs = [d for r, d in report.diagnoses if r.tensor == "out"]
    assert outs and all(d.id == "max-not-carried" for d in outs), [d.sentence for d in outs]
    assert "key blocks of 32" in outs[0].sentence


def _sinks_gradient_negated(q, k, v, *, causal, scale, sinks=None):
    from parity_tests.kernels.planted.featured import kernel
    sinks = None if sinks is None else bad.with_backward(sinks, lambda g: -g)
    return kernel(returns_lse=False)(q, k, v, causal=causal, scale=scale, sinks=sinks)


def test_a_gradient_with_its_sign_flipped_is_named():
    report = parity_tests.check(_sinks_gradient_negated, features=["sinks"], tokens=["17"], causal="yes", **ONE)
    assert {r.tensor for r in report.failures} == {"dsinks"}
    assert {d.id for _, d in report.diagnoses} == {"gradient-negated"}


def test_a_backward_recomputing_p_in_another_base_is_named():
    report = parity_tests.check(_backward_by_hand("exp2"), tokens=["17", "45x77"], causal="both", **ONE)
    assert {r.tensor for r in report.failures} == {"dq", "dk", "dv"}
    assert {d.id for _, d in report.diagnoses} == {"backward-lse-base-2"}, [d.sentence for _, d in report.diagnoses]


def _gradients_of_the_causal_one(q, k, v, *, causal, scale):
    """The right output, with the gradients of the causal attention whatever ``causal`` says."""
    out = bad.sdpa(q, k, v, causal=causal, scale=scale)
    masked = bad.sdpa(q, k, v, causal=True, scale=scale)
    return out.detach() + (masked - masked.detach())


def test_a_backward_of_another_mask_with_its_own_normalisation_is_named():
    report = parity_tests.check(_gradients_of_the_causal_one, tokens=["17", "45x77"], causal="no", **ONE)
    assert report.failures and {r.tensor for r in report.failures} <= {"dq", "dk", "dv"}
    assert {d.id for _, d in report.diagnoses} == {"backward-other-mask"}, [d.sentence for _, d in report.diagnoses]
    assert "the gradients of the causal attention (its own softmax and output)" in report.diagnoses[0][1].sentence


def _keyless_rows_given_v0(q, k, v, *, causal, scale):
    """Bottom-right causal attention whose rows that see no key return the first key's value, not 0."""
    tq, tk = q.shape[-2], k.shape[-2]
    sees = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq) if causal else \
        torch.ones(tq, tk, dtype=torch.bool)
    blind = ~sees.any(-1, keepdim=True)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~sees | blind, float("-inf")).masked_fill(blind, 0.0)
    return torch.where(blind, v[..., :1, :], torch.softmax(s, -1) @ v)


def test_rows_that_see_no_key_returned_otherwise_than_zero_are_said_so():
    report = parity_tests.check(_keyless_rows_given_v0, tokens=["77x45"], causal="yes", align="bottom-right", **ONE)
    outs = [d for r, d in report.diagnoses if r.tensor == "out"]
    assert outs and all("only on the 32 of 77 query rows that see no key, where the check expects 0" in d.sentence
                        for d in outs), [d.sentence for d in outs]


def _diagonal_off_in_the_last_tile(q, k, v, *, causal, scale):
    """Causal attention whose last partial key tile of 64 masks with j < i where j <= i is meant."""
    tq, tk = q.shape[-2], k.shape[-2]
    i, j = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    hidden = (j > i) | ((j == i) & (j >= tk // 64 * 64)) if causal else torch.zeros(tq, tk, dtype=torch.bool)
    return torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(hidden, float("-inf")), -1) @ v


def test_a_mask_off_in_the_last_tile_only_is_named_and_its_look_alikes_said():
    report = parity_tests.check(_diagonal_off_in_the_last_tile, tokens=["100", "65"], causal="yes", **ONE)
    said = {r.case.split()[2]: d.sentence for r, d in report.diagnoses if r.tensor == "out"}
    assert {d.id for _, d in report.diagnoses} <= {"last-tile-mask-one-past", "last-key-tile-dropped"}
    assert "in the last partial key tile only (keys 64 .. 99, tiles of 64" in said["T100"]
    assert "on this case the same as" in said["T65"]              # key 64 alone: the tile dropped gives the same


def test_a_backward_whose_p_is_off_by_a_factor_per_row_is_said_so():
    report = parity_tests.check(_backward_by_hand("bfloat16-lse"), tokens=["17", "45x77"], causal="both", **ONE)
    assert report.failures and {r.tensor for r in report.failures} <= {"dq", "dk", "dv"}
    named = [d for _, d in report.diagnoses if d.id == "backward-p-scaled"]
    assert named and report.diagnosis == "backward-p-scaled", [d.sentence for _, d in report.diagnoses]
    assert {r.tensor for r, d in report.diagnoses if d.id == "backward-p-scaled"} >= {"dq", "dk", "dv"}


def test_reads_of_poisoned_memory_told_apart_by_no_finite_row_are_not_named(monkeypatch):
    """Two mistakes making the same rows NaN, and the rows left finite all zero as the reference's
    (rows that see no key): nothing tells them apart, so neither is named; one finite row that
    sees a key and matches, and the first is.  Every row NaN: the one whose prediction with that
    memory holding 0 the target gives when called so."""
    from types import SimpleNamespace
    from parity_tests.kernels.diagnosis import mistakes, poisoned
    gold = np.zeros((1, 1, 4, 2))
    got = gold.copy()
    got[0, 0, 2:] = np.nan                                     # rows 2, 3 read a NaN slot
    pred = got.copy()
    hyps = [poisoned.Poisoned(f"page-{h}", f"a page {h}", lambda grads=True: {"out": pred}, ("out",))
            for h in ("off", "size")]
    monkeypatch.setattr(mistakes, "catalogue", lambda ctx: hyps)
    monkeypatch.setattr(diagnose, "_context", lambda ev: None)
    monkeypatch.setattr(diagnose, "_non_finite", lambda *a: SimpleNamespace(sentence="NaN"))
    ev = SimpleNamespace(arrays={"out": got}, gold={"out": gold}, den={"out": 1.0}, bounds={"out": 1e-6},
                         case=None, align=None, keyless=None)
    assert diagnose.name_non_finite("out", ev) is None
    monkeypatch.setattr(mistakes, "catalogue", lambda ctx: hyps[:1])
    assert diagnose.name_non_finite("out", ev).id == "page-off"      # alone, its NaN rows are the evidence
    monkeypatch.setattr(mistakes, "catalogue", lambda ctx: hyps)
    gold[0, 0, 1] = got[0, 0, 1] = pred[0, 0, 1] = 0.5         # row 1 sees a key, and the mistakes give it
    assert diagnose.name_non_finite("out", ev).id == "page-off"
    got[:] = pred[:] = np.nan                       # every row NaN: the call again with that memory 0 tells
    hyps[0].zeroed, hyps[1].zeroed = (lambda: {"out": gold}), (lambda: {"out": gold + 1.0})
    monkeypatch.setattr(diagnose, "_unread_zero", lambda ev: {"out": gold + 1.0})
    rejected = []
    assert diagnose.name_non_finite("out", ev, rejected).id == "page-size" and rejected == ["page-off"]
    monkeypatch.setattr(diagnose, "_unread_zero", lambda ev: {"out": gold + 2.0})    # neither: both against
    rejected = []
    assert diagnose.name_non_finite("out", ev, rejected) is None and rejected == ["page-off", "page-size"]


def test_an_lse_of_minus_infinity_where_a_key_is_seen_is_said_to_be_given_none_not_read_past_memory():
    lse = np.zeros((1, 1, 4, 1))
    lse[0, 0, 2:] = -np.inf
    said = diagnose._non_finite("lse", lse, cases.Case(1, 1, 4, 4, 16, False, ()), "top-left").sentence
    assert "-inf where the reference's row sees a key: the kernel gave those rows none" in said, said
    assert "read past" not in said
    lse[0, 0, 3] = np.nan
    again = diagnose._non_finite("lse", lse, cases.Case(1, 1, 4, 4, 16, False, ()), "top-left").sentence
    assert "-inf where" not in again
