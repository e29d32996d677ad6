"""Each feature's own cases, pinned: the shapes and values a kernel is held to are part of
what the check promises (a case dropped from a list would weaken it without a sound).
The window's random edges are those of seed 0."""

from dataclasses import replace

import pytest

from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import FEATURES, REGISTRY, Plan

BR = "bottom-right"
# FP8's: the tile boundary plus one, slices 2^6 apart, an outlier, logits x8 and x32, and the long
# case (not causal whatever the run's mask: ``LONG``)
LONG = {"causal": False}
FP8_CASES = [(2, 4, 97, 97, 64, ("amax", 1.0)), (1, 4, 129, 129, 128, ("wide", 1.0)),
             (1, 4, 77, 129, 64, ("outlier", 1.0)), (1, 2, 129, 129, 64, ("amax", 8.0)),
             (1, 2, 129, 129, 64, ("amax", 32.0)), (1, 1, 64, 32769, 64, ("amax", 1.0), LONG)]

# feature -> (B, H, Tq, Tk, D, value[, align]) for causal and not (window: {causal: rows})
OWN_CASES = {
    "gqa": [(2, 4, 77, 77, 64, 1), (1, 6, 45, 77, 40, 2), (1, 8, 113, 203, 64, 4)],
    "value_dim": [(1, 2, 77, 77, 64, 32), (1, 2, 45, 77, 64, 128), (1, 2, 113, 113, 192, 128)],
    "window": {
        True: [(1, 2, 113, 113, 64, (0, 0)), (1, 2, 113, 113, 64, (62, 0)), (1, 2, 113, 113, 64, (62, -1)),
               (1, 2, 45, 77, 64, (0, 0)), (1, 2, 45, 77, 64, (39, 0)), (1, 2, 45, 77, 64, (39, -1)),
               (1, 2, 77, 45, 64, (0, 0)), (1, 2, 77, 45, 64, (9, 0)), (1, 2, 77, 45, 64, (9, -1))],
        False: [(1, 2, 113, 113, 64, (0, 0)), (1, 2, 113, 113, 64, (45, -1)), (1, 2, 113, 113, 64, (-1, 36)),
                (1, 2, 113, 113, 64, (45, 36)),
                (1, 2, 45, 77, 64, (0, 0)), (1, 2, 45, 77, 64, (65, -1)), (1, 2, 45, 77, 64, (-1, 17)),
                (1, 2, 45, 77, 64, (65, 17)),
                (1, 2, 77, 45, 64, (0, 0)), (1, 2, 77, 45, 64, (11, -1)), (1, 2, 77, 45, 64, (-1, 5)),
                (1, 2, 77, 45, 64, (11, 5))]},
    "softcap": [(1, 2, 77, 77, 64, 50.0), (1, 2, 45, 77, 64, 50.0), (1, 2, 77, 77, 64, 1.0)],
    "alibi": [(1, 4, 113, 113, 64, True), (1, 6, 45, 77, 64, True), (2, 8, 77, 45, 32, True)],
    "bias": [(2, 2, 45, 77, 64, (2, 2, 45, 77)), (2, 2, 45, 77, 64, (1, 2, 45, 77)),
             (2, 2, 45, 77, 64, (2, 1, 1, 77)), (2, 2, 45, 77, 64, (45, 77))],
    "sinks": [(1, 4, 77, 77, 64, "large"), (1, 4, 77, 77, 64, "small"), (1, 4, 45, 77, 64, "large"),
              (1, 4, 45, 77, 64, "small")],
    "varlen": [(5, 2, 129, 129, 64, ((37, 0, 1, 129, 65), (37, 0, 1, 129, 65))),
               (5, 2, 130, 200, 64, ((20, 1, 0, 77, 130), (45, 1, 3, 77, 200)))],
    "lse": [],
    "lse_grad": [],
    "decode": [(2, 4, 1, 2500, 64, True), (1, 2, 5, 3077, 64, True), (1, 8, 8, 4109, 64, True)],
    "deterministic": [],
    "paged": [(2, 2, 1, 3000, 64, (16, (3, 3000)), BR), (3, 2, 4, 1000, 64, (256, (1000, 0, 17)), BR),
              (2, 2, 1, 37, 64, (1, (37, 5)), BR), (3, 2, 30, 129, 64, (16, (30, 3, 129)), BR),
              (2, 2, 2, 200, 64, (16, (32, 200)), BR)],
    "splits": [(1, 2, 5, 300, 64, 1), (1, 2, 5, 300, 64, 2), (1, 2, 5, 300, 64, 3), (1, 2, 5, 300, 64, 7),
               (1, 2, 5, 300, 64, 133), (2, 2, 1, 7, 64, 133), (1, 2, 30, 45, 64, 7)],
    "dropout": [(1, 2, 77, 77, 64, 0.0), (1, 2, 77, 77, 64, 0.1), (1, 2, 77, 77, 64, 0.5),
                (2, 2, 45, 113, 32, 0.1), (1, 3, 113, 45, 40, 0.5)],
    "fp8": FP8_CASES,
    "fp8_kv": FP8_CASES + [(1, 4, 129, 129, 192, ("amax", 1.0), {"value_dim": 128})],
}
# a callable that takes ``align`` gets these features' cases with Tq != Tk in both alignments ...
BOTH_ALIGNMENTS = {"window", "alibi"}
# ... and these features' cases bottom-right only
BOTTOM_RIGHT = {"decode", "splits"}


def _expected(name, causal):
    rows = OWN_CASES[name]
    rows = rows[causal] if isinstance(rows, dict) else rows
    return [_case(name, causal, *row) for row in rows]


def _case(name, causal, b, h, tq, tk, d, value, *rest):
    """A row of `OWN_CASES`: its align, or a dict of the case's causal and other features' values."""
    more = rest[0] if rest and isinstance(rest[0], dict) else {}
    align = () if more else tuple(rest)
    others = tuple((n, v) for n, v in more.items() if n != "causal")
    return Case(b, h, tq, tk, d, more.get("causal", causal), others + ((name, value),), *align)


def test_every_feature_has_its_row_in_the_table():
    assert tuple(OWN_CASES) == FEATURES


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", FEATURES)
def test_a_features_own_cases_are_these(name, causal):
    assert REGISTRY[name].cases(causal, Plan()) == _expected(name, causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", FEATURES)
def test_a_callable_taking_align_gets_them_in_the_alignments_they_test(name, causal):
    want = []
    for c in _expected(name, causal):
        if name in BOTH_ALIGNMENTS and c.tq != c.tk:
            want += [replace(c, align="top-left"), replace(c, align=BR)]
        else:
            want.append(replace(c, align=BR) if name in BOTTOM_RIGHT else c)
    assert REGISTRY[name].cases(causal, Plan(takes_align=True)) == want
