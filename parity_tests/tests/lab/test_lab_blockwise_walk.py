"""``attention-parity backprop --blockwise``: every tile's number agrees with the
dense computation within the float64 bound; any tile size gives the dense result;
the dense side is numpy_ref's own; a planted mistake in a step fails the walk; the
zoom's D is ⟨w, g⟩; a bad --tile is refused."""

import contextlib
import io

import numpy as np
import pytest

from parity_tests import cli
from parity_tests.common.tolerances import FLOAT64_BOUND
from parity_tests.lab import blockwise_walk as bw
from parity_tests.lab import steps

TILES = [1, 2, 3, 4, 6]
TILE_BACKWARD = bw.tile_backward        # the right one, for the planted mistakes to call


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["backprop", "--blockwise"] + [str(a) for a in argv])
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def walks():
    return {t: bw.walk(t) for t in TILES}


@pytest.mark.parametrize("tile", TILES)
def test_every_number_agrees_with_the_dense_one(walks, tile):
    w = walks[tile]
    assert w.passed and w.checks
    for c in w.checks:
        assert c.blockwise.shape == c.dense.shape == (len(c.rows), c.blockwise.shape[1]), c.label
        assert np.array_equal(np.isneginf(c.blockwise), np.isneginf(c.dense)), c.label
        finite = ~np.isneginf(c.dense)
        scale = max(1.0, float(np.max(np.abs(c.dense[finite]), initial=0.0)))
        assert np.max(np.abs(c.blockwise[finite] - c.dense[finite]), initial=0.0) <= FLOAT64_BOUND * scale
        assert c.error <= FLOAT64_BOUND, (c.label, c.error)
    quantities = {c.label.rsplit(": ", 1)[1] for c in w.checks}
    assert {"S", "m", "ℓ", "Õ", "L", "O", "D", "P", "dP", "dS", "dq", "dk", "dv"} <= quantities
    if tile < 6:
        assert "α" in quantities


@pytest.mark.parametrize("tile", TILES)
def test_any_tile_gives_the_dense_backward(walks, tile):
    w = walks[tile]
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(w, name), w.dense[name], rtol=0, atol=1e-12)
    np.testing.assert_allclose(w.out, w.dense["O"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(w.L, w.dense["L"], rtol=0, atol=1e-12)


def test_the_tiles_skip_the_future_and_mask_the_diagonal():
    assert bw.causal_tile((0, 2), (2, 4)) is None                     # wholly in the future
    assert not bw.causal_tile((2, 4), (0, 2)).any()                   # wholly in the past
    assert bw.causal_tile((2, 4), (2, 4)).tolist() == [[False, True], [False, False]]
    w = bw.walk(2)
    forward_tiles = [c.label for c in w.checks if c.label.endswith(": S")]
    assert len(forward_tiles) == 1 + 2 + 3


def test_the_dense_side_is_numpy_refs_own_backward():
    """The dense computation this walk compares with is the chapter's: numpy_ref's
    CausalAttention, tapped by ``backprop``, gives the same out-gradients of Q, K, V."""
    w = bw.walk(2)
    ref = {s.key: s.numpy[0] for s in steps.walk("CausalAttention").steps}
    np.testing.assert_allclose(w.dense["dq"], ref["queries"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(w.dense["dk"], ref["keys"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(w.dense["dv"], ref["values"], rtol=0, atol=1e-12)


def _alpha_not_on_the_output(m, ell, acc, S_ij, V_j):
    m_new = np.maximum(m, S_ij.max(axis=1, keepdims=True))
    alpha = np.exp(m - m_new)
    P_tilde = np.exp(S_ij - m_new)
    return m_new, alpha, alpha * ell + P_tilde.sum(axis=1, keepdims=True), acc + P_tilde @ V_j


def _D_left_out(S_ij, L_i, dO_i, D_i, Q_i, K_j, V_j, d_k):
    return TILE_BACKWARD(S_ij, L_i, dO_i, np.zeros_like(D_i), Q_i, K_j, V_j, d_k)


@pytest.mark.parametrize("step, fault, first_wrong", [
    ("online_step", _alpha_not_on_the_output, ": Õ"),
    ("tile_backward", _D_left_out, ": dS"),
])
def test_a_planted_mistake_fails_the_walk(monkeypatch, step, fault, first_wrong):
    """Tiles of 1: with tiles of 2 every row's maximum ('journey') is in its first
    key tile, so α = 1 throughout and a missing α cannot show there."""
    alphas = [c.blockwise for c in bw.walk(1).checks if c.label.endswith(": α")]
    assert min(float(a.min()) for a in alphas) < 0.99
    monkeypatch.setattr(bw, step, fault)
    w = bw.walk(1)
    assert not w.passed
    first = next(c for c in w.checks if not c.passed)
    assert first.label.endswith(first_wrong), first.label
    assert first.error > 1e-3
    status, out, _ = _run(["--tile", 1])
    assert status == 1 and "FAIL" in out


def test_the_zoom_shows_D_is_w_dot_g():
    w = bw.walk(2)
    for token in range(6):
        t = bw.zoom_terms(w, token)
        assert len(t["P"]) == token + 1                               # causal: keys 1..token
        np.testing.assert_allclose(t["D_terms"], w.dO[token] * w.out[token])
        np.testing.assert_allclose(t["wg_terms"], t["P"] * t["dP"])
        assert abs(t["D"] - np.sum(t["D_terms"])) <= 1e-15
        assert abs(t["D"] - t["wg"]) <= 1e-12
        assert abs(t["wg"] - w.dense["wg"][token, 0]) <= 1e-12


def test_the_command_prints_every_check_and_the_zoom():
    w = bw.walk(3)
    status, out, _ = _run(["--tile", 3, "--token", "starts"])
    assert status == 0
    assert out.count("\n[") == len(w.checks)
    assert f"{len(w.checks)}/{len(w.checks)} blockwise intermediates agree" in out
    assert out.count(": ok") == len(w.checks) and "FAIL" not in out
    assert "== zoom on query 3 ('starts')" in out and "|D − ⟨w, g⟩|" in out


@pytest.mark.parametrize("argv, flag", [
    (["--tile", "0"], "--tile"), (["--tile", "-1"], "--tile"), (["--tile", "two"], "--tile"),
    (["--tile", "1.5"], "--tile"),
])
def test_a_bad_tile_exits_2(argv, flag):
    status, _, err = _run(argv)
    assert status == 2
    assert f"error: argument {flag}: {flag} must be a positive integer" in err


def test_tile_without_blockwise_and_blockwise_with_another_module_exit_2():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(["backprop", "--tile", "2"]) == 2
        assert cli.main(["backprop", "--blockwise", "--module", "SelfAttention_v2"]) == 2
    assert "--tile" in err.getvalue() and "--blockwise" in err.getvalue()


@pytest.mark.parametrize("tile", [0, -2])
def test_walk_refuses_a_bad_tile(tile):
    with pytest.raises(ValueError, match="tile"):
        bw.walk(tile)
    with pytest.raises(TypeError, match="tile"):
        bw.walk(2.0)
