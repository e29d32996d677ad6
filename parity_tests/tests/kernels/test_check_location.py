"""The location signature, phrase by phrase: where an error sits, in the words and the
numbers a kernel author reads (rows, tiles, heads, batch entries, channels)."""

import numpy as np
import pytest
import torch

import parity_tests
from parity_tests.kernels.diagnosis.location import locate
from crashing_kernels import sdpa
from sampled import moved


def _where(n, bad, shape=(2, 3, 100, 8)):
    """locate's signature for tensor ``n`` of ``shape`` wrong (by 1, bound 0.5) where ``bad`` is."""
    ref = np.zeros(shape)
    a = ref.copy()
    a[bad] = 1.0
    where, _, _ = locate(n, a, ref, np.ones(shape), 0.5)
    return where


# the smallest tile of which the first wrong row is a multiple and the rows after it a part
@pytest.mark.parametrize("rows, first, tile", [(100, 64, 64), (45, 32, 16), (200, 128, 128), (90, 64, 32),
                                               (300, 256, 64), (17, 15, 0), (70, 48, 0)])
def test_the_last_partial_tile_is_named_with_its_tile(rows, first, tile):
    where = _where("out", (slice(None), slice(None), slice(first, None)), (2, 3, rows, 8))
    phrase = f"confined to query rows {first} .. {rows - 1} of {rows}"
    if tile:
        phrase += f": the last partial tile (tiles of {tile} or a larger power of two)"
    assert where == phrase


@pytest.mark.parametrize("rows, first, last", [(100, 64, 98), (100, 63, 99), (128, 64, 127), (100, 0, 49)])
def test_rows_that_are_not_a_last_partial_tile_are_not_called_one(rows, first, last):
    # ending short of the last row; starting off a tile; a full last tile; starting at row 0
    where = _where("dk", (slice(None), slice(None), slice(first, last + 1)), (2, 3, rows, 8))
    assert where == f"confined to key rows {first} .. {last} of {rows}"


def test_each_place_is_said_in_its_own_words():
    assert _where("out", (1, 2, slice(None), slice(None))) == "only batch entries 1 of 2; only heads 2 of 3"
    assert _where("dq", (slice(None), slice(0, 2), 7, slice(None))) == "only heads 0 .. 1 of 3; only query row 7 of 100"
    assert _where("dv", (slice(None), slice(None), slice(None), [0, 3, 4])) == "only head-dim channels 0, 3 .. 4 of 8"
    assert _where("lse", (slice(None), slice(None), slice(None), slice(None)), (2, 3, 100, 1)) == \
        "spread over every batch, head and query row"
    assert _where("dbias", (0, slice(None), slice(10, 20), slice(None))) == \
        "only batch entries 0 of 2; confined to bias rows 10 .. 19 of 100"
    # a bias's columns are keys, not head-dim channels
    assert _where("dbias", (0, 0, 5, 3)) == "only batch entries 0 of 2; only heads 0 of 3; only bias row 5 of 100"
    assert _where("out", (0, 0, 0, 0), (2, 3, 1, 8)) == \
        "only batch entries 0 of 2; only heads 0 of 3; only head-dim channels 0 of 8"     # one row: nothing to confine
    assert _where("out", np.zeros((2, 3, 100, 8), dtype=bool)) == ""


def _last_tile_wrong(q, k, v, *, causal, scale):
    out = sdpa(q, k, v, causal=causal, scale=scale)
    return torch.cat([out[..., :64, :], 1.5 * out[..., 64:, :]], dim=-2)   # rows past the last multiple of 64


@moved
def test_a_kernel_wrong_in_its_last_partial_tile_is_told_so():
    report = parity_tests.check(_last_tile_wrong, tokens=["100"], head_dims=[16], heads=[2], batch=[1],
                                dtypes=["float32"], causal="yes")
    where = {r.tensor: d for r, d in report.diagnoses if r.case == "B1 H2 T100 D16 causal"}
    assert set(where) == {"out", "dq", "dk", "dv"}, str(report)
    phrase = "confined to query rows 64 .. 99 of 100: the last partial tile (tiles of 64 or a larger power of two)"
    for n in ("out", "dq"):
        assert where[n].where == phrase and where[n].sentence.endswith("; where: " + phrase), where[n].sentence
    assert where["dv"].where == "spread over every batch, head and key row"
    assert not where["dq"].sentence.startswith("the output is right")           # it is not


def test_rows_left_exactly_zero_are_said_with_their_tile():
    from parity_tests.kernels.diagnosis.location import exact_zeros, locate
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 2, 100, 8))
    a = ref.copy()
    a[:, :, 32:64] = 0.0                                   # one key tile's rows never written
    assert exact_zeros(a, ref, "query rows") == \
        "exactly 0 on query rows 32 .. 63 of 100 (the reference is not): one tile of 32"
    signature, _, _ = locate("out", a, ref, 1.0, 1e-6)
    assert "exactly 0 on query rows 32 .. 63 of 100 (the reference is not): one tile of 32" in signature
    a[:, :, 32:64] = ref[:, :, 32:64]
    a[:, :, 5] = 0.0
    assert exact_zeros(a, ref, "query rows") == "exactly 0 on query rows 5 of 100 (the reference is not)"
    assert exact_zeros(np.zeros_like(ref), ref, "query rows") == ""     # all of it: the zeros diagnosis's


def test_head_dim_channels_left_exactly_zero_are_said_and_a_power_of_two_before_them():
    from parity_tests.kernels.diagnosis.location import locate, zero_channels
    ref = np.random.default_rng(0).standard_normal((1, 2, 9, 40))
    a = ref.copy()
    a[0, 1, :, 32:] = 0.0                                     # a head-dim block rounded down to 32 (one head)
    assert zero_channels(a, ref) == "exactly 0 on head-dim channels 32 .. 39 of 40 (the reference is not): " \
        "those past the first 32"
    assert "exactly 0 on head-dim channels 32 .. 39" in locate("dq", a, ref, 1.0, 1e-6)[0]
    a[0, 1, 0, 32] = 1.0                                      # one row written: not a channel left blank
    assert zero_channels(a, ref) == "exactly 0 on head-dim channels 33 .. 39 of 40 (the reference is not)"
    assert zero_channels(np.zeros_like(ref), ref) == ""       # all of it: the zeros diagnosis's
