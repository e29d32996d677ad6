"""reference_attention(..., dlse=...): the gradients of Σ out·dout + Σ lse·dlse
against float64 finite differences, for every input (bias and sinks included),
with rows that see no key and rows that see only their sink; dlse without dout;
a planted backward that drops the dlse term is caught; a bad dlse is refused
naming it.  (The PyTorch autograd witness: tests/mirror/test_lse_grad_autograd.py.)"""

import numpy as np
import pytest

from numpy_ref import reference_attention, variants
from parity_tests.common.finite_diff import eval_numerical_gradient_array
from parity_tests.common.tolerances import FINITE_DIFF_BOUND

GRADS = ("dq", "dk", "dv", "dbias", "dsinks")
CASES = {
    "plain, gqa": {},
    "causal bottom-right, rows that see no key": dict(causal=True, align="bottom-right"),
    "sinks, window, lengths": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0]), window=(1, 0),
                                   align="bottom-right", seqlens_q=np.array([6, 4]),
                                   seqlens_k=np.array([4, 5])),
    "everything": dict(causal=True, softcap=2.0, alibi_slopes=np.array([0.2, 0.1, 0.4, 0.3]),
                       bias=np.linspace(-1, 1, 30).reshape(6, 5),
                       sinks=np.array([0.5, -1.0, 2.0, 0.0]), align="bottom-right"),
}


def draw(seed, B=2, Hq=4, Hkv=2, Tq=6, Tk=5, D=3, Dv=2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Tq, D))
    k = rng.standard_normal((B, Hkv, Tk, D))
    v = rng.standard_normal((B, Hkv, Tk, Dv))
    return q, k, v, rng.standard_normal((B, Hq, Tq, Dv)), rng.standard_normal((B, Hq, Tq))


def outputs(q, k, v, **options):
    """out and lse side by side (lse −∞ of rows that see no key as 0: a constant)."""
    r = reference_attention(q, k, v, **options)
    lse = np.where(np.isneginf(r["lse"]), 0.0, r["lse"])
    return np.concatenate([r["out"].ravel(), lse.ravel()])


def fd_errors(options, dout, dlse, q, k, v):
    got = reference_attention(q, k, v, dout, dlse=dlse, **options)
    upstream = np.concatenate([(np.zeros_like(got["out"]) if dout is None else dout).ravel(),
                               dlse.ravel()])
    inputs = dict(dq=q, dk=k, dv=v)
    inputs.update({f"d{n}": options[n] for n in ("bias", "sinks") if n in options})
    peak = max(np.abs(got[n]).max() for n in inputs)
    errs = {}
    for name, x in inputs.items():
        numeric = eval_numerical_gradient_array(lambda: outputs(q, k, v, **options), x, upstream)
        errs[name] = np.abs(numeric - got[name]).max() / max(np.abs(numeric).max(), 0.1 * peak)
    return errs


@pytest.mark.parametrize("name", CASES)
def test_finite_differences_of_out_and_lse(name):
    options = {n: (np.copy(x) if isinstance(x, np.ndarray) else x) for n, x in CASES[name].items()}
    q, k, v, dout, dlse = draw(1)
    errs = fd_errors(options, dout, dlse, q, k, v)
    assert max(errs.values()) <= FINITE_DIFF_BOUND, errs


def test_dlse_without_dout_is_the_gradient_of_lse_alone_and_dv_is_zero():
    options = dict(CASES["everything"])
    q, k, v, _, dlse = draw(2)
    errs = fd_errors(options, None, dlse, q, k, v)
    assert max(errs.values()) <= FINITE_DIFF_BOUND, errs
    r = reference_attention(q, k, v, dlse=dlse, **options)
    assert not r["dv"].any() and np.abs(r["dq"]).max() > 0.1
    zero = reference_attention(q, k, v, np.zeros((2, 4, 6, 2)), dlse=dlse, **options)
    assert all(np.array_equal(r[n], zero[n]) for n in GRADS)


def test_dv_is_unchanged_by_dlse_and_rows_that_see_no_key_ignore_it():
    q, k, v, dout, dlse = draw(3)
    options = dict(causal=True, align="bottom-right")     # Tq 6 > Tk 5: row 0 sees no key
    plain = reference_attention(q, k, v, dout, **options)
    with_lse = reference_attention(q, k, v, dout, dlse=dlse, **options)
    assert np.array_equal(plain["dv"], with_lse["dv"])
    assert not np.allclose(plain["dq"], with_lse["dq"])
    assert np.isneginf(with_lse["lse"][..., 0]).all()
    dlse[..., 0] = np.nan                                 # not read: that row has no lse to move
    again = reference_attention(q, k, v, dout, dlse=dlse, **options)
    assert all(np.array_equal(again[n], with_lse[n]) for n in ("dq", "dk", "dv"))


def test_a_row_that_sees_only_its_sink_gives_dsinks_its_dlse():
    """lse_i = sink there (p_sink = 1): dsinks[h] = Σ over such rows of dlse."""
    q, k, v, dout, dlse = draw(4)
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    r = reference_attention(q, k, v, dout, dlse=dlse, sinks=sinks,
                            seqlens_k=np.array([0, 0]))      # no keys at all
    assert np.allclose(r["lse"], sinks[None, :, None])
    assert np.allclose(r["dsinks"], dlse.sum(axis=(0, 2)), rtol=1e-14)


def test_a_planted_backward_without_the_dlse_term_is_caught(monkeypatch):
    monkeypatch.setattr(variants, "lse_row_term", lambda D, dlse: D)
    q, k, v, dout, dlse = draw(1)
    options = dict(CASES["everything"])
    errs = fd_errors(options, dout, dlse, q, k, v)
    assert errs["dq"] > 1e-3 and errs["dk"] > 1e-3 and errs["dsinks"] > 1e-3, errs


@pytest.mark.parametrize("dlse,error,said", [
    (np.zeros((2, 4, 5)), ValueError, r"dlse must have shape \(2, 4, 6\)"),
    (np.zeros((2, 4, 6), dtype=np.float32), TypeError, "dlse must have dtype float64"),
    (np.zeros((2, 4, 6), dtype=np.int64), TypeError, "dlse must be a float32 or float64"),
])
def test_a_bad_dlse_is_refused_naming_it(dlse, error, said):
    q, k, v, dout, _ = draw(5)
    with pytest.raises(error, match=said):
        reference_attention(q, k, v, dout, dlse=dlse)
