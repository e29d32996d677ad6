"""Inputs as kernels meet them (``kernels/variations.py``), and what a kernel must not do:
each kernel here is right but for one thing the grid's plain cases never show."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import parity_tests
from block_examples import WRONG, block_attention
from parity_tests.kernels.planted.featured import attend
from sampled import one_in

SMALL = dict(tokens=["17"], head_dims=[16], heads=[2], batch=[1], dtypes=["float32"], causal="yes")


def sdpa(q, k, v, *, causal, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _failing_cases(report):
    return {r.case for r in report.failures}


def test_a_right_kernel_passes_every_input_and_the_grid_has_them():
    report = parity_tests.check(sdpa, **SMALL)
    assert report.passed, str(report)
    cases = {r.case for r in report.rows}
    for words in ("strides fused", "strides padded", "scale 0.3", "inputs outliers", "inputs integers", "T77x45"):
        assert any(words in c for c in cases), words


def test_a_kernel_that_ignores_strides_fails_on_views():
    def contiguous_strides_assumed(q, k, v, *, causal, scale):
        def as_if_contiguous(x):          # reads the storage as if the view were contiguous
            return torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset())
        return sdpa(*(as_if_contiguous(t) for t in (q, k, v)), causal=causal, scale=scale)
    report = parity_tests.check(contiguous_strides_assumed, **SMALL)
    failing = _failing_cases(report)
    assert failing and all("strides" in c for c in failing), failing
    assert report.diagnosis == "ignores-strides", str(report)
    assert "reads its inputs as if contiguous" in report.failures[0].diagnosis.sentence


def test_a_kernel_that_ignores_its_scale_fails_and_is_named():
    def default_scale(q, k, v, *, causal, scale):
        return sdpa(q, k, v, causal=causal, scale=None)
    report = parity_tests.check(default_scale, **SMALL)
    assert _failing_cases(report) == {"B1 H2 T64 D64 causal scale 0.3"}
    assert report.diagnosis == "scale-ignored", str(report)


def test_a_softmax_without_its_max_overflows_on_large_logits():
    def no_max(q, k, v, *, causal, scale):
        S = (q @ k.transpose(-1, -2)) * scale
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -torch.inf) if causal else S
        P = torch.exp(S)
        return (P / P.sum(-1, keepdim=True)) @ v
    report = parity_tests.check(no_max, **SMALL)
    failing = _failing_cases(report)
    assert failing and all("outliers" in c for c in failing), failing
    assert report.diagnosis == "non-finite"


def test_a_kernel_that_writes_into_its_inputs_fails_and_is_named():
    def scales_q_in_place(q, k, v, *, causal, scale):
        with torch.no_grad():
            q.mul_(1.0 + 1e-3)
        return sdpa(q, k, v, causal=causal, scale=scale)
    report = parity_tests.check(scales_q_in_place, **SMALL)
    assert not report.passed and report.diagnosis == "wrote-into-input", str(report)
    assert "the kernel wrote into q" in report.failures[0].note


def test_a_kernel_that_caches_by_shape_fails_and_is_named():
    cache = {}

    def cached(q, k, v, *, causal, scale):
        key = (q.shape, k.shape, causal, q.dtype)
        if key not in cache:
            cache[key] = sdpa(q, k, v, causal=causal, scale=scale).detach()
        return cache[key] + 0 * q.sum()
    report = parity_tests.check(cached, **SMALL)
    assert not report.passed and report.diagnosis == "previous-output", str(report)


def test_a_change_of_the_global_rng_state_is_reported_not_judged():
    def draws(q, k, v, *, causal, scale):
        torch.rand(1)
        return sdpa(q, k, v, causal=causal, scale=scale)
    report = parity_tests.check(draws, **SMALL)
    assert report.passed, str(report)
    assert all("changed torch's global RNG state" in r.note for r in report.rows)


def test_the_rng_note_is_added_to_a_rows_own_note():
    def draws(q, k, v, *, causal, scale, alibi_slopes=None):
        torch.rand(1)
        return attend(q, k, v, causal=causal, scale=scale, alibi_slopes=alibi_slopes)
    report = parity_tests.check(draws, features=["alibi", "lse"], **SMALL)
    assert report.passed, str(report)
    notes = {r.note for r in report.rows if r.tensor == "lse" and "alibi" in r.case}
    assert notes == {"lse in the reference's ALiBi form; changed torch's global RNG state"}


def test_lse_nan_fails_wherever_it_appears():
    def nan_where_nothing_is_seen(q, k, v, *, causal, scale, align="top-left"):
        out, lse = attend(q, k, v, causal=causal, scale=scale, align=align)
        return out, torch.where(torch.isinf(lse), torch.nan, lse)
    report = parity_tests.check(nan_where_nothing_is_seen, features=["lse"], **SMALL, align="bottom-right")
    assert {r.tensor for r in report.failures} == {"lse"}, str(report)
    assert all("T77x45" in r.case for r in report.failures)
    assert report.diagnosis == "non-finite"


def test_each_row_reports_time_and_error_beside_sdpas():
    report = parity_tests.check(sdpa, **SMALL)
    timed = [r for r in report.rows if r.sdpa_seconds]
    assert len(timed) == len(report.rows) and all(r.seconds > 0 for r in timed)
    assert all((r.sdpa_error is not None) == (r.tensor == "out") for r in report.rows)
    assert "err/SDPA" in report.table() and "time/SDPA" in report.table()


@pytest.mark.slow                     # 2.4 s of heat maps
def test_plot_draws_each_located_failure(tmp_path):
    pytest.importorskip("matplotlib")

    def row_0_not_stored(q, k, v, *, causal, scale):
        out = sdpa(q, k, v, causal=causal, scale=scale)
        return torch.cat([torch.zeros_like(out[..., :1, :]), out[..., 1:, :]], dim=-2)
    report = parity_tests.check(row_0_not_stored, **SMALL)
    assert report.diagnosis == "row-not-stored", str(report)
    located = [d for r, d in report.diagnoses if r.tensor == "out"]
    assert located and all(d.where.startswith("only query row 0 of ") for d in located)
    paths = report.plot(tmp_path)
    assert len(paths) == len([d for _, d in report.diagnoses if d.where])
    assert all(p.endswith(".png") and (tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in paths)


def test_a_packed_kernel_reading_past_its_sequence_is_told_so():
    def one_key_too_many(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        outs, cq, ck = [], cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for n in range(len(cq) - 1):
            a, b = ck[n], ck[n + 1] + (n == len(cq) - 2)          # the last sequence reads one key past its end
            past = lambda x: torch.as_strided(x, (b - a,) + x.shape[1:], x.stride(), x.storage_offset() + a * x.stride(0))
            o = sdpa(q[cq[n]:cq[n + 1]].transpose(0, 1)[None], past(k).transpose(0, 1)[None],
                     past(v).transpose(0, 1)[None], causal=False, scale=scale)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)
    report = parity_tests.check(one_key_too_many, features=["varlen"], layout="thd", **{**SMALL, "causal": "no"})
    assert report.diagnosis == "non-finite"
    assert "read past a sequence's end (cu_seqlens)" in report.failures[0].diagnosis.sentence


def test_a_packed_kernel_dividing_0_by_0_on_rows_that_see_no_key_is_not_said_to_read_past():
    def unguarded(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        outs, cq, ck = [], cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for n in range(len(cq) - 1):
            g = q.shape[1] // k.shape[1]
            qs = q[cq[n]:cq[n + 1]].transpose(0, 1)
            ks, vs = (x[ck[n]:ck[n + 1]].transpose(0, 1).repeat_interleave(g, 0) for x in (k, v))
            s = (qs @ ks.transpose(-2, -1)) * scale
            tq, tk = s.shape[-2:]
            if tk == 0:
                outs.append(torch.zeros_like(q[cq[n]:cq[n + 1]]))
                continue
            seen = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
            s = s.masked_fill(~seen, float("-inf"))
            p = torch.exp(s - s.amax(-1, keepdim=True))           # NaN where a row sees no key: -inf - -inf
            p = p / p.sum(-1, keepdim=True)
            outs.append((p @ vs).transpose(0, 1))
        return torch.cat(outs)
    report = parity_tests.check(unguarded, features=["varlen", "gqa"], layout="thd", align="bottom-right",
                                **{**SMALL, "tokens": ["77x45"]})
    out = [r.diagnosis.sentence for r in report.failures if r.tensor == "out"]
    assert out and report.diagnosis == "non-finite", str(report)
    assert not any("read past" in d for d in out), out
    assert all("no key" in d for d in out) and any("every one of those rows sees no key" in d for d in out), out
    grads = [r.diagnosis.sentence for r in report.failures if r.tensor in ("dk", "dv")]
    assert all("read past" not in d and "see no key" in d for d in grads), grads
    assert any("its sequence has query rows that see no key" in d for d in grads), grads


def test_nan_on_rows_that_see_a_key_keeps_the_read_past_the_end():
    from types import SimpleNamespace
    from parity_tests.kernels.diagnosis.diagnose import _non_finite
    case = SimpleNamespace(seqlens=([4], [2]), causal=True, tq=4, tk=2, offset=lambda align: 0)
    keyless = np.array([[[True, False, False, False]]])             # row 0 sees no key
    a = np.zeros((1, 1, 4, 2))
    a[0, 0, 0] = np.nan
    assert "read past" not in _non_finite("out", a, case, "top-left", keyless).sentence
    a[0, 0, 2] = np.nan                                               # and a row that sees keys
    assert "read past a sequence's end" in _non_finite("out", a, case, "top-left", keyless).sentence


BLOCK = dict(tokens=["128"], head_dims=[64], heads=[1], batch=[1], dtypes=["float32"], causal="yes")


def test_a_block_kernel_meets_every_input_class_at_a_shape_it_takes():
    report = parity_tests.check(block_attention, **BLOCK)
    assert report.passed, str(report)
    ran = {r.case for r in report.rows if r.verdict == "pass"}
    for words in ("strides fused", "strides padded", "scale 0.3", "inputs outliers", "inputs integers"):
        assert any(words in c and "T128" in c for c in ran), (words, ran)
    # Tq > Tk cannot run on a kernel that needs Tq = Tk: a gap, named with the kernel's reason
    assert report.gaps == ["Tq > Tk (every case refused: T must be a multiple of 128 (and Tq = Tk))"]
    assert "never ran: Tq > Tk (every case refused: T must be a multiple of 128" in report.summary()
    assert "not supported, by reason:" in str(report) and str(report).count("T must be a multiple of 128") == 2   # once listed, once in the gap


@pytest.mark.parametrize("ignores, diagnosis", one_in(3, [("scale", "scale-ignored"), ("strides", "ignores-strides"),
                                                          ("max", "non-finite")]))
def test_a_block_kernel_ignoring_an_input_class_fails_named(ignores, diagnosis):
    report = parity_tests.check(WRONG[ignores], **BLOCK)
    assert not report.passed and report.diagnosis == diagnosis, str(report)
    assert all("T128" in r.case and "moved from T" in r.note and "refused" in r.note for r in report.failures)


def test_an_input_class_no_shape_carries_is_a_gap_not_a_pass():
    report = parity_tests.check(WRONG["scale"], **{**BLOCK, "tokens": ["100"]})
    assert not report.passed and "nothing was checked" in str(report)
    assert len(report.gaps) == 6 and all("every case refused" in g for g in report.gaps)
    assert "scale ≠ 1/√D (every case refused: T must be a multiple of 128" in report.summary()
    assert report.as_dict()["summary"]["gaps"] == report.gaps


def test_a_planted_mistake_near_a_loose_bound_is_not_given_another_name():
    # computing in bfloat16 throughout, on the outlier inputs: its dq came to 0.75 of the bound
    # from "a backward that applies a causal mask its forward does not", and 1.3x from the next
    kernel = parity_tests.mistake("in-bfloat16")
    report = parity_tests.check(kernel, tokens=["17", "45x77"], head_dims=[32], heads=[2], batch=[1],
                                dtypes=["bfloat16"])
    assert not {d.id for _, d in report.diagnoses} & {"backward-masked", "dq-missing-scale"}, \
        [d.sentence for _, d in report.diagnoses]
