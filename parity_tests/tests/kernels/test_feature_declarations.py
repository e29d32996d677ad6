"""A feature is declarations the runner asks, never a name it tests: hooks name the arguments
they use (checked when the feature is registered, as pluggy checks its hooks), each receives
every argument its call offers, and the runner, the call and the diagnosis never spell a
feature's name or its inputs' (``dbias``, ``dsinks``)."""

import inspect
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from parity_tests.kernels import call, runner, targets
from parity_tests.kernels.cases import Case
from parity_tests.kernels.diagnosis import diagnose, location, mistakes
from parity_tests.kernels.features import (FEATURES, HOOKS, INPUTS, REGISTRY, Calling, Feature, Hook, Input,
                                           Judging)
from parity_tests.kernels import repro


def test_a_hook_naming_what_its_call_does_not_offer_is_refused_at_registration():
    with pytest.raises(TypeError, match=r"'demo': its draw hook names 'dtype'; draw offers case, value, inputs"):
        Feature("demo", "a demo", draw=lambda value, dtype: {})
    with pytest.raises(TypeError, match="its hand hook names 'kwargs'"):
        Feature("demo", "a demo", calling=Calling(hand=lambda args, **kwargs: (args, {})))
    with pytest.raises(TypeError, match="its lse_form hook names 'seed'"):
        Feature("demo", "a demo", judging=Judging(lse_form=lambda lse, seed: lse))
    # the feature's own name is its value: softcap's draw names "softcap"
    assert "softcap" in inspect.signature(REGISTRY["softcap"].draw.fn).parameters


def test_every_hook_of_every_feature_is_checked_at_registration():
    """Each function a feature declares under a name of `HOOKS` is wrapped (`features.Hook`):
    a hook added to a group but left out of the wrapping would be called unchecked."""
    for f in REGISTRY.values():
        for name in HOOKS:
            group = next(g for g in (f, f.calling, f.judging, f.shrinking) if hasattr(g, name))
            hook = getattr(group, name)
            assert hook is None or isinstance(hook, Hook), (f.name, name)


def test_each_hook_receives_every_argument_its_call_offers(monkeypatch):
    """A feature whose hooks name every argument gets each, filled in: the seed, the device,
    the dtype and the alignment the run uses (not a half-filled context)."""
    seen = {}

    def record(hook, result):
        def fn(**kw):
            seen.setdefault(hook, kw)
            return result(**kw)
        fn.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY)
                                              for n in HOOKS[hook]])
        return fn
    softcap = REGISTRY["softcap"]
    demo = replace(softcap,
                   draw=record("draw", lambda **kw: {}),
                   calling=replace(softcap.calling,
                                   reference=record("reference", lambda value, **kw: {"softcap": value}),
                                   arguments=record("arguments", lambda value, **kw: {"softcap": value}),
                                   hand=record("hand", lambda args, kw, **rest: (args, kw))))
    monkeypatch.setitem(REGISTRY, "softcap", demo)
    case = Case(1, 2, 9, 11, 16, True, (("softcap", 30.0),), "bottom-right")

    def kernel(q, k, v, *, causal, scale, softcap):
        S = softcap * torch.tanh(scale * q @ k.transpose(-1, -2) / softcap)
        hidden = torch.ones(S.shape[-2:], dtype=torch.bool).triu(k.shape[2] - q.shape[2] + 1)
        return torch.softmax(S.masked_fill(hidden, -torch.inf), -1) @ v
    rows = runner.run_case(targets.resolve(kernel), case, "bfloat16", "cpu", seed=7, wanted=["softcap"])
    assert [r.verdict for r in rows] == ["pass"] * 4, [(r.tensor, r.note) for r in rows]
    assert set(seen) == {"draw", "reference", "arguments", "hand"}
    assert seen["draw"]["seed"] == 7 and isinstance(seen["draw"]["rng"], np.random.Generator)
    assert seen["draw"]["value"] == 30.0 and seen["draw"]["case"] == case
    for hook in ("arguments", "hand"):
        assert (seen[hook]["dtype"], seen[hook]["device"], seen[hook]["align"]) == ("bfloat16", "cpu", "bottom-right")
    assert seen["reference"]["align"] == "bottom-right"


def test_an_input_says_where_it_goes_its_dtype_and_whether_it_is_differentiated():
    assert INPUTS["sinks"] == Input("sinks", dtype="float32", grad=True, per_head=True, no_grad="sink-no-grad")
    assert INPUTS["keep"].to == ("reference",) and not INPUTS["keep"].handed          # learnt, never handed
    assert REGISTRY["fp8"].keywords == ("q_descale", "k_descale", "v_descale")           # q, k, v declared again
    assert {i.name: i.scale for i in REGISTRY["fp8"].inputs if i.scale} == \
        {n: n + "_descale" for n in ("q", "k", "v")}
    assert diagnose.GRADS == ("dq", "dk", "dv", "dbias", "dsinks")                     # from the declarations


MODULES = [runner, call, diagnose, location, mistakes, repro]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_the_runner_never_tests_a_features_name_or_spells_its_gradients(module):
    """No ``== "window"``, ``"paged" in``, ``.get("alibi")``, ``["varlen"]`` for a feature, and no
    ``"dbias"``/``"dsinks"`` at all: what a feature changes is a field of its declaration.
    (The reference's own options, ``bias=`` or ``sinks=``, are numpy_ref's API, not a feature's.)"""
    code = Path(module.__file__).read_text()
    code = re.sub(r'"""[\s\S]*?"""|#.*', "", code)             # docstrings and comments may name them
    names = [f for f in FEATURES if f != "lse" and f not in INPUTS]       # lse is a tensor too; sinks, an option
    tested = [f for f in names if re.search(rf'==\s*["\']{f}["\']|["\']{f}["\']\s+in\b|'
                                               rf'\.get\(["\']{f}["\']|\[["\']{f}["\']\]', code)]
    assert not tested, tested
    assert not re.search(r'["\']d(bias|sinks)["\']', code)
