"""``check(..., features=["dropout"])``: the seeded mask recovered from the kernel, the
binomial test of the kept share, every invited mistake failing named, and SDPA's backends.

Default tests run one dropout case (p = 0.1, or p = 0 for the mistake that shows there)
beside a one-case grid; the feature's full list of cases runs under ``slow``."""

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

import parity_tests
from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import REGISTRY
from parity_tests.kernels.features import dropout as dropout_mod
from parity_tests.kernels.planted.chapter import scores
from parity_tests.kernels.planted.featured import attend, kernel, wrong_kernel
from sampled import moved

TINY = dict(tokens=["5"], head_dims=[16], heads=[1], batch=[1], dtypes=["float32"], causal="yes")


@pytest.fixture
def one_case(monkeypatch):
    """The feature's cases cut to one (B1 H2 T45x77 D32, causal), at dropout ``p``."""
    def use(p):
        only = lambda causal, plan: [Case(1, 2, 45, 77, 32, causal, (("dropout", p),))]
        monkeypatch.setitem(REGISTRY, "dropout", replace(REGISTRY["dropout"], cases=only))
    return use


def _dropout_rows(report):
    return [r for r in report.rows if "dropout" in r.case]


def test_a_right_kernel_passes_and_its_mask_is_the_one_recovered(one_case, monkeypatch):
    one_case(0.1)
    masks = []
    real = dropout_mod.recover

    def spy(case, dropout, inputs, opts, caller):
        learnt, found = real(case, dropout, inputs, opts, caller)
        masks.append(learnt["keep"].copy())
        return learnt, found
    feature = REGISTRY["dropout"]
    monkeypatch.setitem(REGISTRY, "dropout", replace(feature, calling=replace(feature.calling, recover=spy)))
    report = parity_tests.check(kernel(returns_lse=False), features=["dropout"], **TINY)
    assert report.passed, str(report)
    assert {r.tensor for r in _dropout_rows(report)} == {"out", "dq", "dk", "dv"}
    # the kernel's own draw, replayed with the case's seed: the mask the check recovered
    keep = masks[0]
    torch.manual_seed(dropout_mod.seed_of(Case(1, 2, 45, 77, 32, True, (("dropout", 0.1),))))
    drawn = (torch.rand(keep.shape, dtype=torch.float64) >= 0.1).numpy()
    visible = np.tril(np.ones((45, 77), dtype=bool))
    assert np.array_equal(keep[..., visible], drawn[..., visible])
    assert 0.85 < keep[..., visible].mean() < 0.95


@pytest.mark.parametrize("mistake, p", [("dropout-no-rescale", 0.1), ("dropout-rescaled-twice", 0.1),
                                        ("dropout-before-softmax", 0.1), ("dropout-backward-mask", 0.1),
                                        ("dropout-at-zero", 0.0)])
def test_each_invited_mistake_fails_and_is_named(one_case, mistake, p):
    one_case(p)
    fn, features = wrong_kernel(mistake)
    report = parity_tests.check(fn, features=features, **TINY)
    rows = [r for r in _dropout_rows(report) if r.failed]
    assert {r.tensor for r in rows} >= ({"dq"} if mistake == "dropout-backward-mask" else {"out", "dq"})
    assert {r.diagnosis.id for r in rows} == {mistake}, [r.diagnosis.sentence for r in rows]
    if mistake == "dropout-at-zero":      # dropping at p = 0 everywhere: the plain cases move between calls
        assert {r.diagnosis.id for r in report.failures if r not in rows} == {"dropout"}
    else:
        assert report.diagnosis == mistake
        assert all(r.passed for r in report.rows if r not in rows)            # only the dropout case


def _dropping(how):
    """A kernel whose dropout is wrong in ``how``, the rest right."""
    def fn(q, k, v, *, causal, scale, dropout_p=0.0):
        S = (q.double() @ k.double().transpose(-1, -2)) * scale
        if causal:
            S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
        if how == "scores":                          # nn.Dropout on the scores, then the softmax
            S = torch.nn.functional.dropout(S.masked_fill(S.isinf(), -1e30), dropout_p)
        P = torch.softmax(S, dim=-1)
        if how == "half-rate":
            P = torch.nn.functional.dropout(P, dropout_p / 2)
        elif how == "own-generator":
            g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
            keep = torch.rand(P.shape, generator=g, dtype=P.dtype) >= dropout_p
            P = P * keep / (1 - dropout_p) if dropout_p else P
        return (P @ v.double()).to(q.dtype)
    return fn


@pytest.mark.parametrize("how, named, words", [
    ("half-rate", "dropout-keep-rate", "is not 1 - p = 0.9"),
    ("scores", "dropout-keep-rate", "no weight was dropped to 0"),
    ("own-generator", "dropout-not-seeded", "does not come from torch's global RNG"),
])
def test_a_mask_at_the_wrong_rate_or_not_from_the_seed_is_named(one_case, how, named, words):
    one_case(0.1)
    report = parity_tests.check(_dropping(how), features=["dropout"], **TINY)
    assert not report.passed
    assert report.diagnosis == named
    assert any(words in d.sentence for _, d in report.diagnoses), [d.sentence for _, d in report.diagnoses][:4]


@moved                      # every probe of both passes: 3 s
def test_a_backward_mask_read_through_a_probe_is_refuted_by_a_gradient_right_on_its_own(one_case):
    # dq alone wrong, from the next key's k (and another draw): the probe with k = the identity reads
    # it as another mask in dP, which would move dk too; dk is right, so no mask is claimed
    one_case(0.1)
    right = kernel(returns_lse=False)

    def dq_from_the_next_key(q, k, v, *, causal, scale, **kw):
        out = right(q.detach(), k, v, causal=causal, scale=scale, **kw)
        shifted = right(q, torch.roll(k, 1, 2).detach(), v.detach(), causal=causal, scale=scale, **kw)
        return out + (shifted - shifted.detach())
    report = parity_tests.check(dq_from_the_next_key, features=["dropout"], **TINY)
    rows = {r.tensor: r for r in _dropout_rows(report)}
    assert rows["dq"].failed and not rows["dk"].failed and not rows["dv"].failed, str(report)
    assert "dropout-backward-mask" not in {r.diagnosis.id for r in report.failures if r.diagnosis}, str(report)


class _DkPassUnmasked(torch.autograd.Function):
    """Dropout on the weights, its backward written out: dv and the dQ pass's dP masked, the dK/dV
    pass's dP only rescaled, dP ∘ keep / (1 - p) meant (one pass's mask left out)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, p):
        P = torch.softmax(scores(q, k, causal=causal, scale=scale), -1)
        kept = (torch.rand(P.shape, dtype=P.dtype) >= p) / (1 - p)
        out = (P * kept) @ v
        ctx.save_for_backward(q, k, v, P, kept, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, P, kept, out = ctx.saved_tensors
        dP, D = g @ v.transpose(-1, -2), (g * out).sum(-1, keepdim=True)
        dq = ctx.scale * (P * (dP * kept - D)) @ k
        dk = ctx.scale * (P * (dP * kept.max() - D)).transpose(-1, -2) @ q          # the mask left out
        return dq, dk, (P * kept).transpose(-1, -2) @ g, None, None, None


def test_a_dk_dv_pass_that_leaves_the_mask_out_of_its_dp_is_named_so(one_case):
    one_case(0.1)

    def dk_unmasked(q, k, v, *, causal, scale, dropout_p):
        return _DkPassUnmasked.apply(q, k, v, scale, causal, dropout_p)
    report = parity_tests.check(dk_unmasked, features=["dropout"], **TINY)
    rows = {r.tensor: r for r in _dropout_rows(report)}
    assert rows["dk"].failed and not rows["dq"].failed and not rows["dv"].failed, str(report)
    said = rows["dk"].diagnosis
    assert said.id == "dropout-backward-mask" and "no weight dropped in the dK/dV pass's dP (its mask left out" \
        in said.sentence, said.sentence


@pytest.mark.slow                      # importing scipy.stats takes seconds
def test_the_binomial_test_is_scipys_exact_two_sided_one():
    binomtest = pytest.importorskip("scipy.stats").binomtest
    for k, n, prob in [(5400, 6006, 0.9), (5300, 6006, 0.9), (3100, 6006, 0.5), (2, 12, 0.5), (12, 12, 0.9)]:
        assert dropout_mod.binomial_pvalue(k, n, prob) == pytest.approx(binomtest(k, n, prob).pvalue, rel=1e-9)
    assert dropout_mod.binomial_pvalue(6006, 6006, 1.0) == 1.0
    assert dropout_mod.binomial_pvalue(6005, 6006, 1.0) == 0.0


def test_sdpa_math_passes_and_the_cpu_flash_kernel_refuses_dropout_named(one_case):
    one_case(0.5)
    report = parity_tests.check("sdpa-math", features=["dropout"], **{**TINY, "dtypes": ["float32", "bfloat16"]})
    assert report.passed, str(report)
    flash = parity_tests.check("sdpa-flash", features=["dropout"], **TINY)
    rows = _dropout_rows(flash)
    assert rows and all(r.verdict == "not supported" for r in rows)
    assert "do not support non-zero dropout" in rows[0].note
    assert not flash.failures


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdpa-math", "sdpa-flash"])
def test_sdpa_on_the_features_own_cases(name):
    report = parity_tests.check(name, features=["dropout"], **{**TINY, "dtypes": ["float32", "bfloat16"],
                                                                "causal": "both"})
    assert not report.failures, str(report)
    if name == "sdpa-flash":           # p = 0 runs; p > 0 is refused on CPU
        assert {r.verdict for r in _dropout_rows(report) if "dropout 0 " in r.case + " "} == {"pass"}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["dropout-no-rescale", "dropout-rescaled-twice", "dropout-before-softmax",
                                     "dropout-backward-mask", "dropout-at-zero"])
def test_each_mistake_on_the_features_own_cases_in_both_dtypes(mistake):
    fn, features = wrong_kernel(mistake)
    report = parity_tests.check(fn, features=features, **{**TINY, "dtypes": ["float32", "bfloat16"],
                                                          "causal": "both"})
    assert report.diagnosis == mistake, [d.sentence for _, d in report.diagnoses][:6]


def test_a_keyword_reaches_only_dropout_cases_and_each_call_is_seeded(one_case):
    one_case(0.1)
    seen = []

    def recording(q, k, v, *, causal, scale, dropout_p=0.0):
        seen.append((dropout_p, torch.rand(()).item()))           # the first draw after the seed
        return attend(q, k, v, causal=causal, scale=scale, dropout_p=dropout_p)[0]
    report = parity_tests.check(recording, features=["dropout"], **TINY)
    assert report.passed, str(report)
    draws = {d for p, d in seen if p}
    assert {p for p, _ in seen} == {0.0, 0.1} and len(draws) == 1      # every dropout call: one seed
    assert len({d for p, d in seen if not p}) > 1                       # the others: not seeded
