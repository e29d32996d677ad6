"""numpy_ref.reference_attention: finite differences for every variant (dbias and
dsinks included), the conventions of the contract on hand-checkable cases, rows
that see nothing, tile sizes, tile skipping and memory, bad options, and that
nothing the caller passed is modified.  (The PyTorch witnesses are in
tests/mirror/test_reference_variants.py.)"""

import tracemalloc

import numpy as np
import pytest

from numpy_ref import reference_attention
from numpy_ref import reference_tiles as tiles_mod
from parity_tests.common.finite_diff import eval_numerical_gradient_array
from parity_tests.common.tolerances import FINITE_DIFF_BOUND
from parity_tests.matrix.variants import compare

GRADS = ("dq", "dk", "dv", "dbias", "dsinks")


def draw(seed, B=2, Hq=4, Hkv=2, Tq=4, Tk=5, D=3, Dv=2, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Tq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Tk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Tk, Dv)).astype(dtype)
    dout = rng.standard_normal((B, Hq, Tq, Dv)).astype(dtype)
    return q, k, v, dout


# Each variant on its own, then mixed; (B, Hq, Hkv, Tq, Tk, D, Dv) = (2, 4, 2, 4, 5, 3, 2).
VARIANTS = {
    "gqa, Dv != Dqk": {},
    "scale": dict(scale=0.3),
    "causal top-left": dict(causal=True),
    "causal bottom-right": dict(causal=True, align="bottom-right"),
    "window (2, 1)": dict(window=(2, 1)),
    "window (1, -1), bottom-right": dict(window=(1, -1), align="bottom-right"),
    "softcap": dict(softcap=1.5),
    "alibi (B, Hq)": dict(alibi_slopes=np.linspace(0.1, 0.8, 8).reshape(2, 4)),
    "bias (Tq, Tk)": dict(bias=np.linspace(-1, 1, 20).reshape(4, 5)),
    "bias (1, Hq, 1, Tk)": dict(bias=np.linspace(-1, 1, 20).reshape(1, 4, 1, 5)),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0])),
    "seqlens": dict(seqlens_q=np.array([3, 4]), seqlens_k=np.array([0, 4])),
    "everything": dict(causal=True, align="bottom-right", window=(3, -1), softcap=2.0,
                       alibi_slopes=np.array([0.2, 0.1, 0.4, 0.3]),
                       bias=np.linspace(-1, 1, 40).reshape(2, 1, 4, 5),
                       sinks=np.array([0.5, -1.0, 2.0, 0.0]),
                       seqlens_q=np.array([3, 4]), seqlens_k=np.array([5, 3]), scale=0.7),
}
# dropout on the weights, on its own and with everything else (a fixed keep mask, p = 0.4)
KEEP = dict(keep=np.random.default_rng(9).random((2, 4, 4, 5)) >= 0.4, dropout_p=0.4)
VARIANTS |= {"dropout": KEEP, "dropout, causal bottom-right": KEEP | VARIANTS["causal bottom-right"],
             "dropout, everything": KEEP | VARIANTS["everything"]}


@pytest.mark.parametrize("name", VARIANTS)
def test_finite_differences_agree_with_every_gradient(name):
    options = {n: (np.copy(x) if isinstance(x, np.ndarray) else x) for n, x in VARIANTS[name].items()}
    q, k, v, dout = draw(1)
    got = reference_attention(q, k, v, dout, **options)
    inputs = dict(dq=q, dk=k, dv=v)
    if "bias" in options:
        inputs["dbias"] = options["bias"]
    if "sinks" in options:
        inputs["dsinks"] = options["sinks"]
    peak = max(np.abs(got[n]).max() for n in inputs)
    for name_, x in inputs.items():
        def f():
            return reference_attention(q, k, v, **options)["out"]
        numeric = eval_numerical_gradient_array(f, x, dout)
        err = np.abs(numeric - got[name_]).max() / max(np.abs(numeric).max(), 0.1 * peak)
        assert err <= FINITE_DIFF_BOUND, (name_, err)


def test_results_do_not_depend_on_the_tile_sizes():
    q, k, v, dout = draw(2, Tq=11, Tk=13)
    options = VARIANTS["everything"] | dict(bias=np.linspace(-1, 1, 2 * 11 * 13).reshape(2, 1, 11, 13),
                                            seqlens_q=np.array([9, 11]), seqlens_k=np.array([13, 4]))
    one = reference_attention(q, k, v, dout, block_q=1, block_k=1, **options)
    for tiles in [(3, 5), (11, 13), (4, 100)]:
        other = reference_attention(q, k, v, dout, block_q=tiles[0], block_k=tiles[1], **options)
        assert max(compare(other, one).values()) <= 1e-13, tiles


def test_plain_case_matches_the_chapter_formula():
    """No option: softmax(q kᵀ / √D) v with kv head h // 2, by hand."""
    q, k, v, dout = draw(3)
    got = reference_attention(q, k, v)
    kr, vr = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    S = q @ kr.swapaxes(-1, -2) / np.sqrt(3)
    w = np.exp(S - S.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(got["out"], w @ vr, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(got["lse"], np.log(np.exp(S).sum(-1)), rtol=1e-13)


def test_windows_and_alignment_select_the_documented_keys():
    """One query head, v = identity: out row i is the weights, so the keys seen
    are its nonzero columns."""
    Tq, Tk = 3, 6
    q = np.zeros((1, 1, Tq, 1))
    k = np.zeros((1, 1, Tk, 1))
    v = np.eye(Tk)[None, None]
    def seen(**o):
        return [np.flatnonzero(row).tolist() for row in reference_attention(q, k, v, **o)["out"][0, 0]]
    assert seen(causal=True) == [[0], [0, 1], [0, 1, 2]]
    assert seen(causal=True, align="bottom-right") == [[0, 1, 2, 3], [0, 1, 2, 3, 4], list(range(6))]
    assert seen(window=(0, 0)) == [[0], [1], [2]]                     # 0-wide: the diagonal only
    assert seen(window=(0, 0), align="bottom-right") == [[3], [4], [5]]
    assert seen(window=(1, -1)) == [list(range(6)), list(range(6)), [1, 2, 3, 4, 5]]
    assert seen(window=(-1, 1)) == [[0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert seen(window=(1, 2), causal=True) == [[0], [0, 1], [1, 2]]  # causal: right side 0
    assert seen(seqlens_k=np.array([2])) == [[0, 1]] * 3


def test_alibi_uses_the_alignment():
    """Equal keys and values 0..Tk-1: the weights are softmax(-slope |i + offset - j|)."""
    q, k = np.zeros((1, 1, 2, 1)), np.zeros((1, 1, 4, 1))
    v = np.eye(4)[None, None]
    for align, offset in (("top-left", 0), ("bottom-right", 2)):
        w = reference_attention(q, k, v, alibi_slopes=np.array([0.5]), align=align)["out"][0, 0]
        expect = np.exp(-0.5 * np.abs(np.arange(2)[:, None] + offset - np.arange(4)))
        np.testing.assert_allclose(w, expect / expect.sum(-1, keepdims=True), rtol=1e-14)


def test_rows_that_see_nothing_follow_the_contract():
    q, k, v, dout = draw(4, B=2, Tq=4, Tk=5)
    sinks = np.array([0.3, -0.2, 1.0, 2.0])
    o = dict(seqlens_q=np.array([2, 4]), seqlens_k=np.array([3, 0]), sinks=sinks)
    r = reference_attention(q, k, v, dout, **o)
    assert np.all(r["out"][0, :, 2:] == 0) and np.all(r["dq"][0, :, 2:] == 0)   # padding queries
    assert np.all(np.isneginf(r["lse"][0, :, 2:]))                              # even with a sink
    assert np.all(r["out"][1] == 0) and np.all(r["dq"][1] == 0)                 # only the sink seen
    np.testing.assert_array_equal(r["lse"][1], np.broadcast_to(sinks[:, None], (4, 4)))
    assert np.all(r["dk"][0, :, 3:] == 0) and np.all(r["dv"][0, :, 3:] == 0)    # padding keys
    assert np.all(r["dk"][1] == 0) and np.all(r["dv"][1] == 0)
    no_sink = reference_attention(q, k, v, dout, causal=True, align="bottom-right",
                                  seqlens_q=np.array([4, 4]), seqlens_k=np.array([2, 5]))
    # batch 0: offset -2, rows 0 and 1 see no key: out 0, lse -inf, dq 0
    assert np.all(no_sink["out"][0, :, :2] == 0) and np.all(np.isneginf(no_sink["lse"][0, :, :2]))
    assert np.all(no_sink["dq"][0, :, :2] == 0) and np.isfinite(no_sink["lse"][0, :, 2:]).all()


def test_sink_logits_are_raw():
    """lse = log(exp(sink) + Σ exp(S)), the sink neither scaled nor capped."""
    q, k, v, _ = draw(5, B=1, Hq=2, Hkv=1)
    sinks = np.array([3.0, -1.0])
    o = dict(scale=0.5, softcap=1.0)
    plain = reference_attention(q, k, v, **o)
    got = reference_attention(q, k, v, sinks=sinks, **o)
    np.testing.assert_allclose(got["lse"], np.logaddexp(plain["lse"], sinks[None, :, None]), rtol=1e-14)
    np.testing.assert_allclose(got["out"], plain["out"] * np.exp(plain["lse"] - got["lse"])[..., None],
                               rtol=1e-13)


def test_dbias_has_the_bias_shape_for_each_broadcast():
    q, k, v, dout = draw(6)
    for shape in [(5,), (4, 1), (4, 5), (1, 4, 1, 5), (2, 1, 4, 5), (2, 4, 4, 5), (1, 1, 1, 1)]:
        bias = np.random.default_rng(0).standard_normal(shape)
        full = reference_attention(q, k, v, dout, bias=np.broadcast_to(bias, (2, 4, 4, 5)).copy())
        got = reference_attention(q, k, v, dout, bias=bias)
        assert got["dbias"].shape == shape
        axes = tuple(range(4 - len(shape))) + tuple(
            4 - len(shape) + i for i, n in enumerate(shape) if n == 1)
        expect = full["dbias"].sum(axis=axes).reshape(shape)
        np.testing.assert_allclose(got["dbias"], expect, rtol=1e-12, atol=1e-14)


def test_float32_is_computed_in_float32():
    q, k, v, dout = draw(7, dtype=np.float32)
    r = reference_attention(q, k, v, dout, sinks=np.zeros(4, np.float32),
                            bias=np.zeros((4, 5), np.float32))
    assert all(a.dtype == np.float32 for a in r.values()), {n: a.dtype for n, a in r.items()}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_and_inf_values_propagate():
    q, k, v, dout = draw(8)
    v[0, 0, 2, 0] = np.nan
    q[1, 3, 1, 0] = np.inf
    r = reference_attention(q, k, v, dout)
    assert np.isnan(r["out"][0, :2, :, 0]).all()          # every query head reading kv head 0
    assert not np.isfinite(r["out"][1, 3, 1]).all()


def test_nothing_the_caller_passed_is_modified():
    q, k, v, dout = draw(9)
    o = dict(VARIANTS["everything"])
    before = [a.copy() for a in (q, k, v, dout)] + [np.copy(x) for x in o.values()
                                                   if isinstance(x, np.ndarray)]
    reference_attention(q, k, v, dout, **o)
    after = [q, k, v, dout] + [x for x in o.values() if isinstance(x, np.ndarray)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("options,match", [
    (dict(window=(-2, 0)), "window left must be >= -1"),
    (dict(window=(0, -3)), "window right must be >= -1"),
    (dict(window=3), "window must be a pair"),
    (dict(window=(1.5, 0)), "window left must be an int"),
    (dict(alibi_slopes=np.ones(3)), "alibi_slopes must have shape"),
    (dict(sinks=np.ones((2, 4))), "sinks must have shape"),
    (dict(seqlens_q=np.array([6, 1])), r"seqlens_q must lie in \[0, 4\]"),
    (dict(seqlens_k=np.array([-1, 1])), "seqlens_k must lie in"),
    (dict(seqlens_k=np.array([1])), "seqlens_k must have shape"),
    (dict(seqlens_q=np.array([1.0, 2.0])), "seqlens_q must be integers"),
    (dict(softcap=0.0), "softcap must be > 0"),
    (dict(softcap="big"), "softcap must be a real number"),
    (dict(scale="a"), "scale must be a real number"),
    (dict(scale=float("inf")), "scale must be finite"),
    (dict(align="center"), "align must be one of"),
    (dict(causal=1), "causal must be True or False"),
    (dict(bias=np.ones((3, 5))), "bias must broadcast"),
    (dict(bias=np.ones((2, 4, 4, 5), dtype=np.int64)), "bias must hold floating"),
    (dict(block_q=0), "block_q must be >= 1"),
])
def test_bad_options_are_refused_naming_the_option(options, match):
    q, k, v, _ = draw(10)
    with pytest.raises((ValueError, TypeError), match=match):
        reference_attention(q, k, v, **options)


@pytest.mark.parametrize("shapes,match", [
    (dict(k=(2, 3, 5, 3), v=(2, 3, 5, 2)), r"Hq % Hkv == 0"),
    (dict(q=(2, 4, 4)), "q must be 4-D"),
    (dict(k=(2, 2, 5, 4)), "k must be"),
    (dict(v=(2, 2, 6, 2)), "v must be"),
    (dict(dout=(2, 4, 4, 3)), "dout must have shape"),
])
def test_bad_shapes_are_refused_naming_the_argument(shapes, match):
    q, k, v, dout = draw(11)
    args = dict(q=q, k=k, v=v, dout=dout)
    for name, shape in shapes.items():
        args[name] = np.zeros(shape)
    with pytest.raises(ValueError, match=match):
        reference_attention(**args)


def test_a_window_visits_only_its_tiles(monkeypatch):
    """Tile skipping: the tile products scale with the window, not with T."""
    calls = []
    original = tiles_mod._tile_scores
    monkeypatch.setattr(tiles_mod, "_tile_scores",
                        lambda q_i, k_j, *a: calls.append(q_i.shape[0] * k_j.shape[0]) or
                        original(q_i, k_j, *a))
    T, window = 4096, 256
    q, k, v, _ = draw(12, B=1, Hq=1, Hkv=1, Tq=T, Tk=T, D=2, Dv=2)
    reference_attention(q, k, v, window=(window, 0), block_q=128, block_k=128)
    assert sum(calls) <= (window + 2 * 128) * T, sum(calls) / T
    assert sum(calls) >= window * T // 2


def peak_with_a_window(T, D=8):
    """Peak traced bytes of one forward + backward with a window of 256 and a sink."""
    q, k, v, dout = draw(13, B=1, Hq=1, Hkv=1, Tq=T, Tk=T, D=D, Dv=D, dtype=np.float32)
    tracemalloc.start()
    reference_attention(q, k, v, dout, window=(256, 0), sinks=np.zeros(1, np.float32))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


# 16 (T, D) arrays (inputs, outputs, gradients, the head's (T,) rows) and a few tiles
def memory_bound(T, D=8):
    return 16 * T * D * 4 + 4 * 256 * 512 * 8


def test_no_t_by_t_array_with_a_window():
    T = 4096
    assert peak_with_a_window(T) < memory_bound(T), f"a T x T array is {T * T * 4} B"


@pytest.mark.slow
def test_no_t_by_t_array_at_16384_tokens_with_a_window():
    T = 16384
    assert peak_with_a_window(T) < memory_bound(T), f"a T x T array is {T * T * 4} B"
