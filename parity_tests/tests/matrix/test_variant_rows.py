"""The production variants' family of the parity matrix: its rows have the
matrix's keys and pass, the command runs it alone (``--module
reference_attention``), and its float64 bound has teeth."""

import re

import numpy as np
import pytest

from parity_tests.common import tolerances as tol
from parity_tests.matrix import harness, variants
from parity_tests.matrix import run as run_parity

from loosen import loosen


@pytest.mark.parametrize("case", variants.build_cases(), ids=lambda c: f"{c.dtype}-{c.config.label}")
def test_every_variant_row_passes(case):
    rows = harness.run_case(case)
    assert rows and all(tuple(r) == harness.ROW_KEYS for r in rows)
    failing = [r for r in rows if not r["passed"]]
    assert not failing, run_parity.format_rows(failing)


def test_every_gradient_of_a_variant_is_compared():
    """dbias and dsinks come with their options; out, lse, dq, dk, dv always."""
    case = next(c for c in variants.build_cases(["float64"]) if c.config.label.startswith("everything"))
    tensors = {r["tensor"] for r in harness.run_case(case)}
    assert tensors == {"out", "lse", "dq", "dk", "dv", "dbias", "dsinks"}


def test_the_command_runs_the_family_alone(capsys):
    assert run_parity.main(["--module", "reference_attention", "-q"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.match(r"\d+ rows, (\d+) passed, 0 failed", summary), summary


def test_the_default_run_includes_the_family():
    assert sum(isinstance(c, variants.VariantCase) for c in harness.build_cases()) == 2 * len(variants.CONFIGS)


def test_variants_float64_bound_has_teeth(monkeypatch):
    """A slip of 3e-12 of the output's size fails today and passes with the bound
    loosened tenfold."""
    case = variants.build_cases(["float64"])[0]
    dense = variants.dense.dense_attention

    def slipped(*args, **kwargs):
        res = dense(*args, **kwargs)
        res["out"] = res["out"] + 3e-12 * np.abs(res["out"]).max()
        return res

    monkeypatch.setattr(variants.dense, "dense_attention", slipped)
    def out_row():
        return next(r for r in harness.run_case(case)
                    if r["tensor"] == "out" and r["check"] == "numpy vs torch")
    assert not out_row()["passed"]
    loosen(monkeypatch, "VARIANTS_FLOAT64_BOUND")
    assert tol.VARIANTS_FLOAT64_BOUND == 1e-11
    assert out_row()["passed"]
