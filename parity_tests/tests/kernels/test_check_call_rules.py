"""What the check asks of a kernel's call and answer, case by case: the lse dtype it
accepts, a second call that fails even where both draws have one answer, the notes a
row keeps, and the sentences a diagnosis leads with.  Each runs one small case."""

import torch

from parity_tests.kernels import measure, targets
from parity_tests.kernels.cases import Case
from feature_gallery import attend, varlen


def _rows(fn, case, dtype="float32", wanted=()):
    return {r.tensor: r for r in measure.run_case(targets.resolve(fn), case, dtype, "cpu", wanted=tuple(wanted))}


SMALL = Case(1, 2, 17, 17, 16, True)


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
    calls = [0]

    def stochastic_rounding(q, k, v, *, causal, scale):      # draws from torch's RNG, and differs by a unit
        calls[0] += 1
        torch.rand(1)
        out = attend(q, k, v, causal=causal, scale=scale)[0]
        if calls[0] % 2:
            first = out.detach().reshape(-1)[0]
            nudge = torch.zeros_like(out)
            nudge.view(-1)[0] = torch.nextafter(first, torch.tensor(float("inf"), dtype=out.dtype)) - first
            out = out + nudge
        return out
    out = _rows(stochastic_rounding, SMALL, wanted=["deterministic"])["out"]
    assert out.verdict == "FAIL" and out.diagnosis.id == "not-deterministic"
    assert "changed torch's global RNG state" in out.note and "not deterministic: a second call differs" in out.note


def test_a_mistake_in_every_sequence_is_not_said_to_be_in_only_some():
    def doubled(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return 2 * varlen(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)[0]
    rows = _rows(doubled, Case(2, 2, 17, 17, 16, True), wanted=["varlen"])
    assert rows["out"].failed
    assert all("only sequence" not in r.diagnosis.sentence for r in rows.values() if r.failed), \
        [r.diagnosis.sentence for r in rows.values() if r.failed]
