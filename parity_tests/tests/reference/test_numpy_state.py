"""state_dict / load_state_dict, named_parameters, train/eval and dropout in the modules."""

import numpy as np
import pytest

import numpy_ref as nr
from numpy_ref import ops

QKV = ["W_query", "W_key", "W_value"]


def linear_keys(layers, bias):
    return [f"{l}.{p}" for l in layers for p in (("weight", "bias") if bias else ("weight",))]


# name -> (factory, expected state_dict keys in PyTorch's order, x shape)
STATE_CASES = {
    "simplified": (lambda: nr.SimplifiedSelfAttention(rng=0), [], (3, 2)),  # rng unused
    "v1": (lambda: nr.SelfAttention_v1(3, 2, rng=0), QKV, (4, 3)),
    "v2": (lambda: nr.SelfAttention_v2(3, 2, rng=0), linear_keys(QKV, False), (4, 3)),
    "v2_bias": (lambda: nr.SelfAttention_v2(3, 2, True, rng=0), linear_keys(QKV, True), (4, 3)),
    "causal": (lambda: nr.CausalAttention(3, 2, 5, 0.5, rng=0),
               ["mask"] + linear_keys(QKV, False), (2, 4, 3)),
    "wrapper": (lambda: nr.MultiHeadAttentionWrapper(3, 2, 5, 0.5, 2, True, rng=0),
                [f"heads.{h}.{k}" for h in range(2) for k in ["mask"] + linear_keys(QKV, True)],
                (2, 4, 3)),
    "mha": (lambda: nr.MultiHeadAttention(3, 4, 5, 0.5, 2, rng=0),
            ["mask"] + linear_keys(QKV, False) + ["out_proj.weight", "out_proj.bias"], (2, 4, 3)),
}


def expected_shape(key, m):
    if key.endswith("mask"):
        return (5, 5)
    if isinstance(m, nr.SelfAttention_v1):
        return (3, 2)
    layer_out = 4 if isinstance(m, nr.MultiHeadAttention) else 2
    in_dim = 4 if key.startswith("out_proj") else 3
    return (layer_out, in_dim) if key.endswith("weight") else (layer_out,)


@pytest.mark.parametrize("name", list(STATE_CASES))
def test_state_dict_keys_shapes_dtypes(name):
    factory, keys, _ = STATE_CASES[name]
    m = factory()
    sd = m.state_dict()
    assert list(sd) == keys
    for key, value in sd.items():
        assert value.shape == expected_shape(key, m), key
        assert value.dtype == np.float32, key
    assert [n for n, _ in m.named_parameters()] == [k for k in keys if not k.endswith("mask")]
    for key in (k for k in keys if k.endswith("mask")):
        np.testing.assert_array_equal(sd[key], np.triu(np.ones((5, 5)), k=1))


@pytest.mark.parametrize("name", list(STATE_CASES))
def test_load_state_dict_round_trip_and_copies(name):
    factory, keys, x_shape = STATE_CASES[name]
    a, b = factory().eval(), factory().eval()
    rng = np.random.default_rng(0)
    sd = {k: (v if k.endswith("mask") else rng.normal(size=v.shape))  # float64 values
          for k, v in a.state_dict().items()}
    a.load_state_dict(sd)
    for key, value in a.state_dict().items():
        assert value.dtype == sd[key].dtype, key                   # dtype kept
        np.testing.assert_array_equal(value, sd[key])
    b.load_state_dict(a.state_dict())
    x = rng.normal(size=x_shape)
    np.testing.assert_array_equal(a(x), b(x))
    for value in a.state_dict().values():                          # copies, not views
        value += 1.0
    np.testing.assert_array_equal(a(x), b(x))


def _bad_loads(sd):
    first = next(iter(sd))
    last = list(sd)[-1]
    missing = dict(sd)
    del missing[last]
    yield "missing", missing, ValueError, "missing"
    yield "unknown", {**sd, "W_extra.weight": sd[first]}, ValueError, "W_extra.weight"
    wrong = {**sd, last: np.zeros(sd[last].shape + (1,))}          # every other key fine
    yield "wrong shape", wrong, ValueError, last.replace(".", r"\.")
    yield "not floating", {**sd, last: sd[last].astype(np.int64)}, TypeError, last.replace(".", r"\.")


@pytest.mark.parametrize("name", [n for n in STATE_CASES if n != "simplified"])
def test_refused_load_changes_nothing(name):
    m = STATE_CASES[name][0]()
    before = m.state_dict()
    new = {k: v + 1.0 for k, v in before.items()}
    for what, sd, exc, match in _bad_loads(new):
        with pytest.raises(exc, match=match):
            m.load_state_dict(sd)
        after = m.state_dict()
        for key in before:
            np.testing.assert_array_equal(after[key], before[key], err_msg=f"{what}: {key}")
    with pytest.raises(TypeError, match="state_dict"):
        m.load_state_dict([("W_query", 1)])


def test_load_state_dict_takes_array_likes():
    m = nr.SelfAttention_v1(2, 1, rng=0)
    m.load_state_dict({"W_query": [[1.0], [2.0]], "W_key": [[0.5], [0.5]],
                       "W_value": np.ones((2, 1), dtype=np.float32)})
    np.testing.assert_array_equal(m.state_dict()["W_query"], [[1.0], [2.0]])


# -- train / eval and dropout ----------------------------------------------------------


def test_train_eval_as_in_pytorch():
    m = nr.MultiHeadAttentionWrapper(3, 2, 4, 0.5, 2, rng=0)
    assert m.training and all(h.training for h in m.heads)
    assert m.eval() is m and not m.training and not any(h.training for h in m.heads)
    assert m.train() is m and m.training and all(h.training for h in m.heads)
    assert m.train(False) is m and not m.training


CAUSAL = {
    "causal": (lambda p: nr.CausalAttention(3, 2, 4, p, rng=0), lambda b, t: (b, t, t)),
    "wrapper": (lambda p: nr.MultiHeadAttentionWrapper(3, 2, 4, p, 2, rng=0),
                lambda b, t: (2, b, t, t)),
    "mha": (lambda p: nr.MultiHeadAttention(3, 4, 4, p, 2, rng=0), lambda b, t: (b, 2, t, t)),
}


@pytest.mark.parametrize("name", list(CAUSAL))
def test_dropout_identity_in_eval_and_at_p_0(name):
    factory, keep_shape = CAUSAL[name]
    x = np.random.default_rng(0).normal(size=(2, 4, 3))
    no_drop = factory(0.0).eval()(x)
    keep = np.random.default_rng(1).random(keep_shape(2, 4)) >= 0.5
    np.testing.assert_array_equal(factory(0.5).eval()(x), no_drop)
    np.testing.assert_array_equal(factory(0.5).eval()(x, keep), no_drop)   # ignored in eval
    np.testing.assert_array_equal(factory(0.0)(x), no_drop)                # training, p = 0
    assert not np.allclose(factory(0.5)(x, keep), no_drop)                # training, p > 0


@pytest.mark.parametrize("name", list(CAUSAL))
def test_drawn_mask_comes_from_the_module_rng(name):
    factory, keep_shape = CAUSAL[name]
    x = np.random.default_rng(0).normal(size=(2, 4, 3))
    drawn, fixed = factory(0.5), factory(0.5)                 # same seed, same state
    out = drawn(x)
    if name == "wrapper":   # each head draws its own (B, T, T) mask, in head order
        keep = np.stack([ops.draw_keep_mask(fixed.rng, (2, 4, 4), 0.5) for _ in range(2)])
    else:
        keep = ops.draw_keep_mask(fixed.rng, keep_shape(2, 4), 0.5)
    np.testing.assert_array_equal(out, fixed(x, keep))
    assert not np.array_equal(drawn(x), out)                  # a fresh mask each call


def test_dropped_attention_weights_are_survivors_scaled_by_1_over_1_minus_p():
    m = nr.CausalAttention(3, 2, 6, 0.25, rng=0)
    x = np.random.default_rng(0).normal(size=(3, 6, 3))
    keep = np.random.default_rng(1).random((3, 6, 6)) >= 0.25
    m(x, keep)
    weights = m._cache["attn_weights"]                         # softmax output, pre-dropout
    dropped = m._cache["sum"][0]                               # what multiplied the values
    np.testing.assert_array_equal(dropped[keep], weights[keep] * (1 / 0.75))
    assert np.all(dropped[~keep] == 0)


def test_module_drawn_masks_keep_a_fraction_consistent_with_1_minus_p():
    binomtest = pytest.importorskip("scipy.stats").binomtest
    m = nr.MultiHeadAttention(3, 4, 40, 0.3, 2, rng=123)
    m(np.random.default_rng(0).normal(size=(4, 40, 3)))
    keep_mask = m._cache["drop"][0]
    assert keep_mask.shape == (4, 2, 40, 40)
    result = binomtest(int(keep_mask.sum()), keep_mask.size, 0.7)
    assert result.pvalue > 1e-6, f"kept {keep_mask.mean():.4f}, pvalue {result.pvalue:.1e}"


# -- initialisation --------------------------------------------------------------------


def test_init_distributions_v1_uniform_01_linear_kaiming_uniform():
    kstest = pytest.importorskip("scipy.stats").kstest
    v1 = nr.SelfAttention_v1(40, 50, rng=0)
    for name, w in v1.named_parameters():
        assert w.min() >= 0.0 and w.max() < 1.0, name
        assert kstest(w.ravel(), "uniform", args=(0.0, 1.0)).pvalue > 1e-6, name
    mha = nr.MultiHeadAttention(64, 48, 4, 0.0, 4, qkv_bias=True, rng=1)
    for name, w in mha.named_parameters():
        fan_in = 48 if name.startswith("out_proj") else 64
        bound = 1 / np.sqrt(fan_in)
        assert np.abs(w).max() <= bound, name
        if w.size >= 1000:
            assert kstest(w.ravel(), "uniform", args=(-bound, 2 * bound)).pvalue > 1e-6, name


def test_rng_seed_reproducible_and_generator_accepted():
    a = nr.MultiHeadAttention(3, 4, 4, 0.1, 2, rng=7).state_dict()
    b = nr.MultiHeadAttention(3, 4, 4, 0.1, 2, rng=np.random.default_rng(7)).state_dict()
    c = nr.MultiHeadAttention(3, 4, 4, 0.1, 2, rng=8).state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["W_query.weight"], c["W_query.weight"])
    d = nr.MultiHeadAttention(3, 4, 4, 0.1, 2).state_dict()           # fresh entropy
    assert not np.array_equal(a["W_query.weight"], d["W_query.weight"])
