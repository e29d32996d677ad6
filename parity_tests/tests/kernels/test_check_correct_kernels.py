"""No false alarm: every standard correct way of computing attention passes every case
and input class, at any seed, in float32 and bfloat16 (``kernels/planted/correct.py``; the bound's
derivation: ``tolerances``, "the baseline's formulations")."""

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

import parity_tests
from numpy_ref import reference_attention

from parity_tests.kernels import runner, targets
from parity_tests.kernels.cases import Case
from parity_tests.kernels.planted.correct import CORRECT, SINKS, rowsum_d

DTYPES = ["float32", "bfloat16"]


def _ratios(report):
    """(worst error / bound, where) over the judged rows."""
    judged = [r for r in report.rows if r.bound]
    worst = max(judged, key=lambda r: r.error / r.bound)
    return worst.error / worst.bound, f"{worst.dtype} {worst.case} {worst.tensor}"


def _check_passes(kernel, seed, tokens):
    report = parity_tests.check(kernel, dtypes=DTYPES, tokens=tokens, seed=seed)
    assert report.passed, f"seed {seed}: {_ratios(report)}\n{report}"
    assert not report.unsupported and not report.gaps           # every input class ran


@pytest.mark.parametrize("name", list(CORRECT))
def test_each_correct_formulation_passes_every_input_class(name):
    # T = 1 (every gradient but dv zero by theory) plus the input classes every run draws; seeds 1 .. 19 below
    _check_passes(CORRECT[name], 0, ["1"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CORRECT))
def test_each_correct_formulation_passes_at_twenty_seeds_and_on_the_default_grid(name):
    for seed in range(1, 20):
        _check_passes(CORRECT[name], seed, ["1", "113x203"])
    _check_passes(CORRECT[name], 0, None)


@pytest.mark.parametrize("name", list(CORRECT))
def test_each_correct_formulation_is_attention_in_float64(name):
    # a witness must be right: out and every gradient equal the reference's to 1e-12,
    # causal or not, both alignments, Tq < Tk and Tq > Tk (rows that see no key)
    rng = np.random.default_rng(0)
    for (tq, tk), causal, align in itertools.product(((9, 13), (13, 9)), (True, False), ("top-left", "bottom-right")):
        q, k, v, dout = (rng.standard_normal((2, 3, t, 8)) for t in (tq, tk, tk, tq))
        ref = reference_attention(q, k, v, dout, scale=0.3, causal=causal, align=align)
        Q, K, V = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        out = CORRECT[name](Q, K, V, causal=causal, scale=0.3, align=align)
        out.backward(torch.tensor(dout))
        for n, got in (("out", out), ("dq", Q.grad), ("dk", K.grad), ("dv", V.grad)):
            err = np.abs(got.detach().numpy() - ref[n]).max() / max(np.abs(ref[n]).max(), 1.0)
            assert err < 1e-12, (name, tq, tk, causal, align, n, err)


@pytest.mark.parametrize("name", list(SINKS))
def test_each_sinks_formulation_passes_with_its_dsinks_at_three_seeds(name):
    """dsinks sums every row into one number per head: the sink column concatenated to the
    scores (gpt-oss's eager attention) and the sink written into the denominator round its
    terms apart, and both pass (``tolerances.reduction_floor``; without it the first FAILed
    dsinks at 1.10 x the bound in float32 on B1 H2 T17, seed 0)."""
    for seed in range(3):
        report = parity_tests.check(SINKS[name], features=["sinks"], dtypes=DTYPES, tokens=["17"], seed=seed)
        assert report.passed, f"seed {seed}: {_ratios(report)}\n{report}"
        assert any(r.tensor == "dsinks" for r in report.rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SINKS))
def test_each_sinks_formulation_passes_at_twenty_seeds(name):
    for seed in range(3, 20):
        report = parity_tests.check(SINKS[name], features=["sinks"], dtypes=DTYPES, tokens=["17"], seed=seed)
        assert report.passed, f"seed {seed}: {_ratios(report)}\n{report}"
    assert parity_tests.check(SINKS[name], features=["sinks"], dtypes=DTYPES).passed


def test_without_the_reduction_floor_the_concatenated_sinks_fail_dsinks(monkeypatch):
    from parity_tests.common import tolerances
    monkeypatch.setattr(tolerances, "reduction_floor", lambda dtype, mass: 0.0)
    failing = set()
    for seed in range(3):                     # which seed shows it is the release's rounding
        report = parity_tests.check(SINKS["sinks-concatenated"], features=["sinks"], dtypes=DTYPES, tokens=["17"],
                                    seed=seed)
        failing |= {r.tensor for r in report.failures}
    assert failing == {"dsinks"}


def test_flash2s_backward_passes_a_gradient_through_lse_on_rows_that_see_one_key():
    """On a 0-wide window each row sees one key and dS = dlse: the softmax's own backward forms it
    exactly, FlashAttention-2's D = rowsum(dO ∘ O) − dlse does not (``runner.one_key_terms``;
    without that floor, dq and dk FAILed at 1.6 .. 3.3 x the bound in float32, every seed)."""
    for seed in range(3):
        report = parity_tests.check(rowsum_d, features=["window", "lse_grad"], dtypes=["float32"], tokens=["45x77"],
                                    seed=seed)             # (bfloat16's bound is wider than this rounding)
        assert report.passed, f"seed {seed}: {_ratios(report)}\n{report}"
        assert any("window(0,0)" in r.case for r in report.rows)


ONE_KEY = Case(1, 2, 45, 77, 64, False, (("window", (0, 0)),))


def _one_key_rows(kernel):
    return runner.run_case(targets.resolve(kernel), ONE_KEY, "float32", "cpu", wanted=("window", "lse_grad"))


def test_without_the_one_key_floor_flash2s_backward_fails_dq_and_dk_on_one_key_rows(monkeypatch):
    assert all(r.passed for r in _one_key_rows(rowsum_d))
    monkeypatch.setattr(runner, "one_key_terms", lambda inputs, golden, opts: {})
    assert {r.tensor for r in _one_key_rows(rowsum_d) if not r.passed} == {"dq", "dk"}


def test_the_one_key_floor_holds_only_where_every_row_sees_one_key():
    for window, floored in (((0, 0), True), ((1, 0), False), ((0, 1), False)):
        case = replace(ONE_KEY, features=(("window", window),))
        inputs = runner.draw(case, wanted=("window", "lse_grad"))
        opts = runner.reference_options(case, "top-left", inputs)
        terms = runner.one_key_terms(inputs, runner.golden(inputs, opts), opts)
        assert (set(terms) == {"dq", "dk"}) == floored, window


def test_the_one_key_floor_still_fails_the_lse_gradient_dropped_on_one_key_rows():
    dropped = parity_tests.mistake("lse-grad-dropped", ["window", "lse_grad"])
    assert {r.tensor for r in _one_key_rows(dropped) if not r.passed} == {"dq", "dk"}


def test_the_one_key_witness_is_attention_in_float64():
    rng = np.random.default_rng(0)
    for window, align in itertools.product(((0, 0), (3, -1), (-1, 2), (2, 1)), ("top-left", "bottom-right")):
        q, k, v, dout = (rng.standard_normal((2, 3, t, 8)) for t in (9, 13, 13, 9))
        dlse = rng.standard_normal((2, 3, 9))
        ref = reference_attention(q, k, v, dout, scale=0.3, causal=False, align=align, window=window, dlse=dlse)
        Q, K, V = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        out, lse = rowsum_d(Q, K, V, causal=False, scale=0.3, align=align, window=window)
        torch.autograd.backward([out, lse], [torch.tensor(dout), torch.tensor(dlse)])
        for n, got in (("out", out), ("lse", lse), ("dq", Q.grad), ("dk", K.grad), ("dv", V.grad)):
            err = np.abs(got.detach().numpy() - ref[n]).max() / max(np.abs(ref[n]).max(), 1.0)
            assert err < 1e-12, (window, align, n, err)
