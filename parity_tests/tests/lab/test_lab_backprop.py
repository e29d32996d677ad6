"""``attention-parity backprop``: every intermediate of every chapter module agrees
with autograd within the float64 bound; the numbers are numpy_ref's own; a planted
fault shows up at the step it breaks; the zoom's two products are the same."""

import contextlib
import io
import json

import numpy as np
import pytest
import torch

from parity_tests import cli
from parity_tests.common import faults
from parity_tests.common.tolerances import FLOAT64_BOUND
from parity_tests.lab import example, steps, zoom

from verb_run import HAVE_MATPLOTLIB

WALKS = [(name, p) for name in example.MODULES
         for p in ((0.0, 0.5) if example.SPECS[name].has_dropout else (0.0,))]


def _run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = cli.main(["backprop"] + [str(a) for a in argv])
    return status, out.getvalue()


@pytest.mark.parametrize("name, dropout", WALKS)
def test_every_intermediate_agrees_with_autograd(name, dropout):
    w = steps.walk(name, dropout)
    assert w.passed
    for s in w.steps:
        assert s.numpy.shape == s.autograd.shape, s.key
        assert s.error <= FLOAT64_BOUND, (s.key, s.error)
    keys = [s.key for s in w.steps]
    assert keys[0] == "context_vec" and keys[-1] == "x"
    m_t, _ = example.build(name, dropout)
    for param, _ in m_t.named_parameters():           # every weight gradient is shown
        assert param in keys
    prefixes = [f"heads.{i}." for i in range(2)] if name == "MultiHeadAttentionWrapper" else [""]
    wanted = ["attn_weights", "attn_scores"]
    if example.SPECS[name].has_dropout:
        wanted += ["dropped_weights", "masked_scores", "scaled_scores"]
    if name != "SimplifiedSelfAttention":
        wanted += ["queries", "keys", "values"] if name != "MultiHeadAttention" else \
            ["queries_heads", "keys_heads", "values_heads", "merged", "context_heads"]
    for p in prefixes:
        for k in wanted:
            assert p + k in keys, p + k
    for road in ("query", "key", "value"):
        assert any(k.endswith(f"x.via_{road}") for k in keys)


@pytest.mark.parametrize("name", example.MODULES)
def test_the_numbers_are_numpy_refs_own_and_autograds_own(name):
    """The tapped dx and weight gradients are the module's backward; autograd's
    step-by-step forward gives the gradients torch_impl's own forward gives."""
    w = steps.walk(name)
    m_t, m_n = example.build(name)
    x = example.inputs(name)
    m_n.forward(x)
    by_key = {s.key: s for s in w.steps}
    np.testing.assert_array_equal(by_key["x"].numpy, m_n.backward(w.G))
    for param, g in m_n.grads.items():
        np.testing.assert_array_equal(by_key[param].numpy, g)
    x_t = torch.tensor(x, requires_grad=True)
    m_t(x_t).backward(torch.tensor(w.G))
    np.testing.assert_allclose(by_key["x"].autograd, x_t.grad.numpy(), rtol=0, atol=1e-15)
    for param, p in m_t.named_parameters():
        np.testing.assert_allclose(by_key[param].autograd, p.grad.numpy(), rtol=0, atol=1e-15)


@pytest.mark.parametrize("fault, first_wrong", [
    ("softmax-backward-no-sum", "scaled_scores"),
    ("weighted-sum-no-transpose", "values"),
    ("scores-backward-unscaled", "queries"),
])
def test_a_planted_fault_fails_at_the_step_it_breaks(fault, first_wrong):
    with faults.plant(fault):
        w = steps.walk("CausalAttention")
    assert not w.passed
    assert next(s.key for s in w.steps if not s.passed) == first_wrong


def test_the_zoom_products_agree():
    w = steps.walk("CausalAttention")
    weights, grads = w.softmax_rows[""]
    for t in range(6):
        terms = zoom.zoom_terms(weights[0, t], grads[0, t])
        np.testing.assert_allclose(terms["via_J"], terms["product"], rtol=0, atol=1e-15)
        np.testing.assert_allclose(terms["product"], w.autograd_softmax[""][0, t], rtol=0, atol=1e-15)
        assert abs(terms["J"].sum()) < 1e-15                  # rows and columns sum to 0


def test_the_command_prints_the_table_and_zoom():
    status, out = _run(["--token", "journey"])
    assert status == 0
    assert "16/16 intermediates agree with autograd" in out
    assert "dz = G" in out and "da = w ⊙ (dw − ⟨w, dw⟩)" in out
    assert "journey    0.6000   0.2000" in out                   # G, 4 decimals, by token
    assert "== zoom on query 2 ('journey')" in out and "J = diag(w) − w wᵀ" in out
    assert "-0.0000" not in out


def test_json_and_plots(tmp_path):
    args = ["--module", "MultiHeadAttention", "--json", tmp_path / "bp.json"]
    if HAVE_MATPLOTLIB:
        args += ["--plot", tmp_path]
    status, out = _run(args)
    assert status == 0
    data = json.loads((tmp_path / "bp.json").read_text())
    assert data["passed"] and data["module"] == "MultiHeadAttention"
    assert all(s["error"] <= s["bound"] for s in data["steps"])
    if HAVE_MATPLOTLIB:
        assert len(list(tmp_path.glob("*.png"))) == 3          # one per head, and dx


@pytest.mark.parametrize("argv", [["--token", "7"], ["--token", "banana"], ["--module", "Nope"],
                                  ["--module", "SelfAttention_v2", "--dropout", "0.5"],
                                  ["--dropout", "1.5"]])
def test_bad_arguments_exit_2(argv):
    assert _run(argv)[0] == 2
