"""No wrong kernel makes the check raise: every planted mistake of the galleries
(``parity_tests.kernels.planted``) against every feature, then every pair of features (``-m slow``), at
small sizes.  A diagnosis that raises raises here (the suite sets ``PARITY_DIAGNOSIS_RAISES``);
no row may say it could not diagnose."""

from dataclasses import replace
from itertools import combinations

import pytest

from parity_tests.kernels import run
from parity_tests.kernels.diagnosis import diagnose, row_block
from parity_tests.kernels.cases import Case, case_rng
from parity_tests.kernels.features import FEATURES, REGISTRY, parse_features
from parity_tests.kernels import planted
from parity_tests.kernels.planted.featured import FEATURE_GALLERY
from sampled import one_in

# the small case a set of features is added to (4 heads: GQA keeps 2 kv heads)
BASE = Case(2, 4, 13, 21, 16, True)
# the features that add no `apply` of their own and are not run-wide
OWN = {"decode": lambda c: replace(c, tq=3, align="bottom-right").with_feature("decode", True),
       "splits": lambda c: c.with_feature("splits", 3),
       "dropout": lambda c: c.with_feature("dropout", 0.1)}


def test_every_feature_without_apply_or_run_wide_form_has_its_small_case():
    lacking = {n for n, f in REGISTRY.items() if f.apply is None and not f.calling.run_wide}
    assert lacking == set(OWN), lacking


def small_case(features):
    """``BASE`` with each feature added (the run-wide ones the runner adds itself)."""
    case = BASE
    for name in FEATURES:
        if name in features:
            if REGISTRY[name].apply is not None:
                case = REGISTRY[name].apply(case, case_rng(0, case, name))
            elif name in OWN:
                case = OWN[name](case)
    return case


# How a case is diagnosed (``diagnosis``, ``row_block``), each forced at this size:
# "whole" as it is; "screened", as a large case, out's mistakes tried on a block of 8 query
# rows first; "rows", as a case too large to recompute, on a block of 8 rows of one slice.
SIZES = ("whole", "screened", "rows")


def as_if(size, monkeypatch):
    if size in ("screened", "rows"):
        monkeypatch.setattr(row_block, "SCREEN_FROM", 0)
        monkeypatch.setattr(row_block, "MAX_ROWS", 8)
        monkeypatch.setattr(row_block, "MIN_ROWS", 8)
    if size == "rows":
        monkeypatch.setattr(diagnose, "DENSE_LIMIT", 1)


def check_mistakes(names, features):
    """Each mistake of ``names`` planted in a kernel for ``features`` and checked on their
    small case, as ``check`` runs a case (its plan: the features' keywords required first)."""
    rows = []
    for name in names:
        fn = planted.kernel(name, features)
        dtypes = [REGISTRY[f].judging.dtypes[0] for f in features if REGISTRY[f].judging.dtypes] or ["float32"]
        plan = run._plan(fn, "cpu", dtypes[:1], None, None, None, None, "yes", "top-left", "bhtd", False,
                         features)
        report = run._run(plan._replace(grid=[small_case(plan.wanted)], classes=[]), "top-left", 0, False)
        rows += [(name, r) for r in report.rows]
    assert not [(n, r.diagnosis.sentence) for n, r in rows
                if r.diagnosis is not None and "could not diagnose" in r.diagnosis.sentence]
    failed = [r for _, r in rows if r.failed]
    assert all(r.note or r.diagnosis is not None for r in failed)          # a FAIL always says why
    return rows


def plantable(features):
    return [m for m in planted.MISTAKES if planted.plantable(m, features)]


def _own(name, feature):
    """Whether ``name`` is one of ``feature``'s own mistakes (its gallery's, its twins)."""
    return feature in FEATURE_GALLERY.get(name, ()) or name.startswith(feature + "-") or \
        planted.MISTAKES[name].layout == feature


def sampled(feature):
    """The default suite's share: the feature's own mistakes, and every len(FEATURES)-th of
    the others (each mistake runs on some feature; each feature meets the chapter's)."""
    turn = FEATURES.index(feature)
    return [m for i, m in enumerate(planted.MISTAKES)
            if planted.plantable(m, [feature]) and (_own(m, feature) or i % len(FEATURES) == turn)]


def test_the_default_share_runs_every_mistake_and_each_feature_meets_several():
    shares = {f: sampled(f) for f in FEATURES}
    assert set().union(*shares.values()) == set(planted.MISTAKES)
    assert all(len(s) >= 2 for s in shares.values()), shares


@pytest.mark.parametrize("feature", one_in(3, FEATURES))
def test_no_planted_mistake_makes_the_check_raise_on_a_feature(feature, monkeypatch):
    as_if("screened", monkeypatch)            # the whole case's diagnosis, and a block's before it
    rows = check_mistakes(sampled(feature), [feature])
    assert any(r.failed and r.diagnosis is not None for _, r in rows)      # the diagnosis ran


@pytest.mark.parametrize("mistake, features, size", [
    ("no-scale", ["paged"], "rows"),                          # a paged case sliced to one sequence
    ("no-scale", ["bias", "paged"], "whole"),                 # more keys read than the bias covers
    ("varlen-neighbours", ["varlen", "lse_grad"], "whole"),   # dlse packed as q is
], ids=["paged-rows", "bias+paged", "varlen+lse_grad"])
def test_the_crashes_the_pairs_found_stay_fixed(mistake, features, size, monkeypatch):
    as_if(size, monkeypatch)
    rows = check_mistakes([mistake], features)
    assert any(r.failed and r.diagnosis is not None for _, r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("feature", FEATURES)
def test_no_planted_mistake_makes_the_check_raise_on_any_feature(feature, size, monkeypatch):
    as_if(size, monkeypatch)
    check_mistakes(plantable([feature]), [feature])


PAIRS = [list(p) for p in combinations(FEATURES, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("features", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_no_planted_mistake_makes_the_check_raise_on_any_pair_of_features(features, monkeypatch):
    try:
        parse_features(features)
    except ValueError as e:                   # a usage error, before any case: not a crash
        assert "cannot be combined" in str(e)
        return
    as_if("screened", monkeypatch)
    check_mistakes(plantable(features), features)
