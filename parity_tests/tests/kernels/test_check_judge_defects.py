"""The judge's own check: the baseline (``dense``) shares its rules with the catalogue's
mistakes and nothing else, so a rule planted wrong there must not widen the bound silently.
Each shared rule planted wrong in turn -- a window's edge, the alignment's offset, the
softcap's formula, ALiBi's sign, the GQA head map, dropout's scale -- makes the run fail as
the check's own defect (``Row.judge_defect``, exit status 3), and no wrong kernel of the
gallery passes under it (``tolerances.judge_limit``)."""

import numpy as np
import pytest

import parity_tests
from parity_tests.common import tolerances as tol
from parity_tests.kernels import dense, planted, run

SMALL = dict(tokens=["17", "45x77"], head_dims=[16], dtypes=["float32"], causal="yes")


def _window_edge(monkeypatch):
    sees = dense.sees

    def wrong(i, j, *, window=None, **kw):          # the left edge one key wider
        if window is not None and window[0] >= 0:
            window = (window[0] + 1, window[1])
        return sees(i, j, window=window, **kw)
    monkeypatch.setattr(dense, "sees", wrong)


def _alignment(monkeypatch):
    offsets = dense.offsets
    monkeypatch.setattr(dense, "offsets", lambda *a, **kw: [o + 1 for o in offsets(*a, **kw)])


def _attention_option(name, change):
    def plant(monkeypatch):
        attention = dense.attention

        def wrong(*a, **kw):
            if kw.get(name) is not None:
                kw[name] = change(kw[name])
            return attention(*a, **kw)
        monkeypatch.setattr(dense, "attention", wrong)
    return plant


def _gqa_map(monkeypatch):
    run_dense = dense.run

    def wrong(q, k, v, *a, **kw):                    # kv head h % Hkv for query head h: a repeat
        b, hkv = k.shape[:2]
        group = q.shape[1] // hkv
        got = run_dense(q, np.tile(k, (1, group, 1, 1)), np.tile(v, (1, group, 1, 1)), *a, **kw)
        for n in ("dk", "dv"):                       # the repeat's adjoint: a sum over the tiles
            if n in got:
                got[n] = got[n].reshape((b, group, hkv) + got[n].shape[2:]).sum(1)
        return got
    monkeypatch.setattr(dense, "run", wrong)


RULES = {
    "window edge": (_window_edge, ["window"], "window-left-wider"),
    "alignment offset": (_alignment, [], "mask-one-future"),
    "softcap formula": (_attention_option("softcap", lambda c: 2 * c), ["softcap"], "softcap-before-scale"),
    "ALiBi sign": (_attention_option("alibi_slopes", lambda s: -s), ["alibi"], "alibi-sign"),
    "GQA head map": (_gqa_map, ["gqa"], "gqa-repeat"),
    "dropout scale": (_attention_option("dropout_p", lambda p: 1 - (1 - p) ** 2), ["dropout"], "dropout-rescaled-twice"),
}


@pytest.mark.parametrize("rule", [r if r in ("window edge", "alignment offset", "GQA head map") else
                                  pytest.param(r, marks=pytest.mark.slow) for r in RULES])   # the rest: -m slow
def test_a_shared_rule_planted_wrong_is_the_checks_own_defect_and_nothing_passes(rule, monkeypatch):
    plant, features, wrong_kernel = RULES[rule]
    right = planted.right(features)
    wrong = planted.mistake(wrong_kernel, features)
    assert parity_tests.check(right, features=features, **SMALL).passed          # the rule as it is
    plant(monkeypatch)
    for fn in (right, wrong):
        report = parity_tests.check(fn, features=features, **SMALL)
        assert not report.passed and report.judge_defects, (rule, fn.__name__)
        assert run.exit_status(report) == 3
        assert "the check's own defect" in report.render() and "past what a plain float32" in \
            report.judge_defects[0].judge_defect


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_judges_limit_guards_each_dtype(dtype, monkeypatch):
    """A window edge planted wrong is the check's defect in the dtype's own limit (1024 units in
    float32, the cap of 1/8 in bfloat16); loosened, it would pass as the kernel's."""
    _window_edge(monkeypatch)
    right = planted.right(["window"])
    small = {**SMALL, "dtypes": [dtype]}
    assert parity_tests.check(right, features=["window"], **small).judge_defects
    monkeypatch.setattr(tol, "JUDGE_LIMIT_ULPS", 10 ** 9)
    monkeypatch.setattr(tol, "JUDGE_LIMIT_CAP", 100.0)
    assert not parity_tests.check(right, features=["window"], **small).judge_defects


def test_the_judges_limit_is_far_above_a_plain_computation_and_far_below_a_wrong_rule():
    assert tol.judge_limit("float32") == 1024 * 2.0 ** -24
    assert tol.judge_limit("bfloat16") == 2.0 ** -3                          # capped: 1024 u is 4
    assert tol.judge_limit("float32", logits=160.0) == 10 * tol.judge_limit("float32")


def test_the_headline_is_the_catalogued_cause_of_most_failing_rows_not_the_first_met():
    from parity_tests.kernels.diagnosis.diagnose import Diagnosis
    from parity_tests.kernels.report import Report
    from parity_tests.kernels.row import Row

    def failing(i, hid):
        return Row("k", f"case {i}", {}, "float32", "cpu", "out", verdict="FAIL", diagnosis=Diagnosis(hid, hid))
    rows = [failing(i, "non-finite") for i in range(4)] + [failing(i, "stale-max") for i in range(4, 20)]
    assert Report("k", rows).diagnosis == "stale-max"
    rows = [failing(i, "no-scale") for i in range(4)] + [failing(i, "stale-max") for i in range(4, 9)]
    assert Report("k", rows).diagnosis == "stale-max"                          # the most rows
    rows = [failing(i, "no-scale") for i in range(4)] + [failing(i, "non-finite") for i in range(4, 20)]
    assert Report("k", rows).diagnosis == "no-scale"          # a description names no mistake: the catalogued one
    rows = [failing(i, "lower-precision") for i in range(4)] + [failing(i, "non-finite") for i in range(4, 20)]
    assert Report("k", rows).diagnosis == "non-finite"
    rows = [failing(0, "lower-precision")] + [failing(i, "none") for i in range(1, 4)]
    assert Report("k", rows).diagnosis is None                # a description of one row in four heads nothing
    rows = [failing(i, "lower-precision") for i in range(2)] + [failing(i, "none") for i in range(2, 4)]
    assert Report("k", rows).diagnosis == "lower-precision"
    rows = [failing(i, "none") for i in range(6)] + [failing(i, "backward-no-D") for i in range(6, 8)]
    for r in rows[6:]:
        r.bound = 0.5                                          # bfloat16 on outlier inputs
    assert Report("k", rows).diagnosis is None                # a reading under so loose a bound names no run
    rows[6].bound = 0.2
    assert Report("k", rows).diagnosis is None                # one row named among six unnamed: not the run's
    rows[7].bound = 0.2
    assert Report("k", rows).diagnosis == "backward-no-D"     # two among six: a fifth of as many at least
    rows = [failing(i, "none") for i in range(25)] + [failing(25, "sinks-scaled")]
    assert Report("k", rows).diagnosis is None
    assert Report("k", rows[20:]).diagnosis == "sinks-scaled"
    # a gradient of a case whose out is named follows from out: not a row no name covers
    grads = [Row("k", f"case {i}", {}, "float32", "cpu", n, verdict="FAIL", diagnosis=Diagnosis("none", "none"))
             for i in range(2) for n in ("dq", "dk", "dv")]
    rows = [failing(i, "key-tile-ranges") for i in range(2)] + grads + [failing(i, "none") for i in range(2, 8)]
    assert Report("k", rows).diagnosis == "key-tile-ranges"
    for r in grads:
        r.case = "case 9"                                      # the same rows, of a case whose out is not named
    assert Report("k", rows).diagnosis is None


def test_a_mistake_contradicted_on_more_cases_than_it_explains_heads_nothing():
    from parity_tests.kernels.diagnosis.diagnose import Diagnosis
    from parity_tests.kernels.report import Report
    from parity_tests.kernels.row import Row

    def failing(case, tensor, hid, against=()):
        return Row("k", case, {}, "float32", "cpu", tensor, verdict="FAIL",
                   diagnosis=Diagnosis(hid, hid, against=tuple(against)))
    # dk and dv reproduced from their last tile alone while dq, tried against it, fails: a coincidence
    case = [failing("a", "dq", "none", ["last-tile-only"]), failing("a", "dk", "last-tile-only"),
            failing("a", "dv", "last-tile-only")]
    assert Report("k", case).diagnosis is None
    whole = [failing("b", n, "last-tile-only") for n in ("dk", "dv")]
    assert Report("k", case + whole).diagnosis == "last-tile-only"          # one case each way
    other = [failing(c, "out", "none", ["fp8-k-descale-twice"]) for c in "cdefgh"]
    named = [failing(c, "out", "fp8-k-descale-twice") for c in "ijklm"]
    assert Report("k", other + named).diagnosis is None                       # 5 cases explained, 6 not
    assert Report("k", other[:2] + named).diagnosis == "fp8-k-descale-twice"
    assert Report("k", other + named + case + whole).diagnosis == "last-tile-only"   # the next one that holds
    # a case whose out it names holds for it, what follows from out (its lse) refuting it or not
    dropped = [failing(c, "out", "varlen-dropped-last") for c in "xy"] + \
        [failing(c, "lse", "none", ["varlen-dropped-last"]) for c in "xy"]
    assert Report("k", dropped).diagnosis == "varlen-dropped-last"
