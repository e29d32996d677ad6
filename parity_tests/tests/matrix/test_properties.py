"""Property-based parity: random shapes, head counts, bias, mode and dtype all agree.

Each example is one case of the harness (`parity_tests.harness.run_case`) with a
randomly drawn `Config`; shapes stay small so a few hundred examples take seconds.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import numpy_ref
from parity_tests.matrix import harness
from parity_tests.matrix.run import format_rows

# Example counts relative to the loaded profile (100 by default; see conftest.py).
N = settings.default.max_examples


# The chapter's modules.  The blockwise family has property tests of its own
# (reference/test_blockwise_*.py, over tile sizes too); leaving it out keeps the
# derandomized examples drawn here what they were.
SPECS = [s for s in harness.MODULES if s.name != "BlockwiseMultiHeadAttention"]


@st.composite
def cases(draw, dtypes=("float64", "float32")):
    spec = draw(st.sampled_from(SPECS))
    tokens = draw(st.integers(1, 6))
    config = harness.Config(
        label="",                                   # set below: it seeds the case
        tokens=tokens,
        d_in=draw(st.integers(1, 6)),
        head_dim=draw(st.integers(1, 4)),
        batch=draw(st.integers(1, 3)),
        num_heads=draw(st.integers(1, 3)),
        context_length=tokens + draw(st.integers(0, 3)),
        qkv_bias=draw(st.booleans()),
    )
    label = (f"T{config.tokens} ctx{config.ctx} d_in{config.d_in} D{config.head_dim} "
             f"B{config.batch} H{config.num_heads}{' bias' if config.qkv_bias else ''} "
             f"s{draw(st.integers(0, 999))}")
    config = harness.Config(label, *[getattr(config, f) for f in
                                     ("tokens", "d_in", "head_dim", "batch", "num_heads",
                                      "context_length", "qkv_bias")])
    return harness.Case(spec, config, draw(st.sampled_from(spec.modes)),
                        draw(st.sampled_from(dtypes)), "cpu")


@settings(max_examples=int(1.6 * N))
@given(cases())
def test_random_cases_agree(case):
    rows = harness.run_case(case)
    failing = [r for r in rows if not r["passed"]]
    assert rows and not failing, f"{case.config.label}\n" + format_rows(failing)


@settings(max_examples=int(0.8 * N))
@given(cases(dtypes=("float64",)), st.integers(0, 2**32 - 1))
def test_weights_round_trip_both_ways(case, seed):
    """torch -> numpy -> torch in the contract's one line each way: same state, same output."""
    module = harness.build_torch(case).eval()
    args = harness._ctor_args(case.spec, case.config)
    np_mod = getattr(numpy_ref, case.spec.reference)(*args, rng=seed) if args else \
        getattr(numpy_ref, case.spec.reference)()
    np_mod.load_state_dict(module.state_dict())
    back = harness.build_torch(harness.Case(case.spec, case.config, case.mode, "float64", "cpu"))
    with torch.no_grad():                       # scramble it so the load must do the work
        for p in back.parameters():
            p.add_(1.0)
    back.load_state_dict({k: torch.from_numpy(v) for k, v in np_mod.state_dict().items()})
    for key, value in module.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    x, _, _ = harness.make_inputs(case)
    np_mod.eval()
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
        assert np.array_equal(back.eval()(torch.from_numpy(x)).numpy(), expected)
    error, where = harness.relative_error(np_mod.forward(x), expected)
    assert error <= harness.tol.FLOAT64_BOUND, (error, where)


@settings(max_examples=int(0.4 * N))
@given(cases(dtypes=tuple(d for d in ("bfloat16", "float16") if harness.dtype_supported(d, "cpu"))))
def test_random_low_precision_cases_stay_within_their_baseline(case):
    """bfloat16/float16 on CPU: the PyTorch side within a few times the plain computation's drift."""
    rows = harness.run_case(case)
    failing = [r for r in rows if not r["passed"]]
    assert rows and not failing, f"{case.config.label}\n" + format_rows(failing)


# Found by the thorough profile: float32, d_in 1 and head_dim 1, so every weight
# gradient is one entry and its baseline one draw of rounding (tolerances.py,
# "several draws").  Each failed at 1.0-1.7x its bound with a single-draw baseline.
ONE_ENTRY_GRADIENTS = [
    ("SelfAttention_v2", "eval", harness.Config(f"T4 ctx5 d_in1 D1 B2 H3 bias s{draw}", tokens=4,
     d_in=1, head_dim=1, batch=2, num_heads=3, context_length=5, qkv_bias=True))
    for draw in (0, 21, 142, 153, 189)
] + [
    ("MultiHeadAttentionWrapper", "train", harness.Config("T5 ctx6 d_in1 D1 B1 H1 s323", tokens=5,
     d_in=1, head_dim=1, batch=1, num_heads=1, context_length=6)),
]


@pytest.mark.parametrize("module, mode, config", ONE_ENTRY_GRADIENTS,
                         ids=[f"{m} {c.label}" for m, _, c in ONE_ENTRY_GRADIENTS])
def test_one_entry_weight_gradients_in_float32_stay_within_their_bound(module, mode, config):
    spec = next(s for s in harness.MODULES if s.name == module)
    rows = harness.run_case(harness.Case(spec, config, mode, "float32", "cpu"))
    failing = [r for r in rows if not r["passed"]]
    assert rows and not failing, format_rows(failing)
