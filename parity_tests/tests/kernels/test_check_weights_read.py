"""The weights a kernel gives, read by calling it on one-hot values (``diagnosis.weights``): where
no catalogued mistake or fitted reading names out, the kernel is called on the case's q and k with
v one-hot on a slice, then on a key, and its weights are compared with the reference's.  Each kernel
below is right but for one slip that only such a reading locates."""

import numpy as np
import pytest
import torch

from parity_tests.kernels import runner, targets
from parity_tests.kernels.cases import Case
from parity_tests.kernels.diagnosis import weights
from parity_tests.kernels.diagnosis.diagnose import Diagnosis
from parity_tests.kernels.features import REGISTRY, Plan
from parity_tests.kernels.planted import fp8 as fp8_gallery
from parity_tests.kernels.report import Report
from parity_tests.kernels.row import Row
from crashing_kernels import sdpa
from sampled import moved

pytestmark = pytest.mark.usefixtures("without_input_classes")   # (conftest.py)


def _out(kernel, case):
    """The failing out row's diagnosis of ``kernel`` on ``case``, float32."""
    rows = runner.run_case(targets.resolve(kernel), case, "float32", "cpu")
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed
    return out.diagnosis


def _masked(q, k, v, scale, keep):
    """Attention with the boolean ``keep`` (Tq, Tk) as its mask."""
    s = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v


def test_keys_read_from_other_head_dim_columns_past_the_first_tile_are_named_as_scores_off_on_those_keys():
    def k_pointer_off(q, k, v, *, causal, scale):             # key tiles after the first: k's columns rolled
        k = torch.cat([k[:, :, :16], k[:, :, 16:].roll(4, -1)], 2)
        return sdpa(q, k, v, causal=causal, scale=scale)
    d = _out(k_pointer_off, Case(1, 2, 45, 77, 16, False, ()))
    assert d.id == "weights-read", d.sentence
    assert "query rows 0 .. 44 of 45 in every (batch, head) weigh keys whose scores differ from the reference's " \
        "(keys 16 .. 76 in all" in d.sentence, d.sentence
    assert "each such key in nearly every row that weighs it (the key's k read otherwise)" in d.sentence, d.sentence
    assert "hides" not in d.sentence and "no weight" not in d.sentence, d.sentence


def test_queries_of_a_last_partial_tile_read_otherwise_are_named_as_whole_rows_scored_otherwise():
    def last_tile_q_rolled(q, k, v, *, causal, scale):       # rows 64 .. 76: q's head dim rolled
        q = torch.cat([q[:, :, :64], q[:, :, 64:].roll(4, -1)], 2)
        return sdpa(q, k, v, causal=causal, scale=scale)
    d = _out(last_tile_q_rolled, Case(1, 2, 77, 77, 16, False, ()))
    assert d.id == "weights-read", d.sentence
    assert "query rows 64 .. 76 of 77 in every (batch, head) weigh keys whose scores differ" in d.sentence and \
        "on each such row nearly every key it weighs (the row's q, or its scale, read otherwise)" in d.sentence, \
        d.sentence


def test_a_page_of_another_sequence_is_named_with_the_slice_it_belongs_to():
    def page_of_sequence_0(q, k, v, *, causal, scale):        # sequence 1's keys 32 .. 47 from sequence 0's page
        k, v = k.clone(), v.clone()
        k[1, :, 32:48], v[1, :, 32:48] = k[0, :, 32:48], v[0, :, 32:48]
        return sdpa(q, k, v, causal=causal, scale=scale)
    d = _out(page_of_sequence_0, Case(2, 2, 64, 64, 16, False, ()))
    assert d.id == "weights-read", d.sentence
    assert "2 of 4 (batch, head) slices weigh the values of other slices" in d.sentence, d.sentence
    assert "(batch, head) (1, 0) rows 0 .. 63 give" in d.sentence and \
        "to the values of (batch, kv head) (0, 0), their own (1, 0)" in d.sentence, d.sentence


def test_keys_past_the_causal_limit_are_named_with_the_rows_that_see_them():
    def late_rows_see_ahead(q, k, v, *, causal, scale):        # rows from 30: also keys 16 .. 17 ahead
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        return _masked(q, k, v, scale, (j <= i) | ((i >= 30) & (j - i >= 16) & (j - i <= 17)))
    d = _out(late_rows_see_ahead, Case(1, 2, 64, 64, 16, True, ()))
    assert d.id == "weights-read", d.sentence
    assert "query rows 30 .. 47 of 64 in every (batch, head) weigh keys the reference hides (keys 46 .. 63 in " \
        "all; row 30 of (0, 0): keys 46 .. 47, its visible keys 0 .. 30" in d.sentence, d.sentence
    assert "differ" not in d.sentence and "no weight" not in d.sentence, d.sentence


def test_keys_a_row_should_weigh_and_does_not_are_named():
    def late_rows_skip_a_tile(q, k, v, *, causal, scale):        # rows from 32 skip keys 8 .. 15
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        return _masked(q, k, v, scale, (j <= i) & ~((i >= 32) & (j >= 8) & (j < 16)))
    d = _out(late_rows_skip_a_tile, Case(1, 2, 64, 64, 16, True, ()))
    assert d.id == "weights-read", d.sentence
    assert "query rows 32 .. 63 of 64 in every (batch, head) give no weight to keys the reference weighs " \
        "(keys 8 .. 15 in all" in d.sentence, d.sentence
    assert "differ" not in d.sentence, d.sentence           # the other keys: each row's own factor, not a score


def test_right_weights_on_values_used_otherwise_are_said_so():
    def v_saturated(q, k, v, *, causal, scale):              # v clipped at 2, as a narrow store would
        return sdpa(q, k, v.clamp(-2, 2), causal=causal, scale=scale)
    d = _out(v_saturated, Case(1, 2, 64, 64, 16, False, ()))
    assert d.id == "weights-read", d.sentence
    assert "are the reference's on every row that sees a key: the weights are right, the error lies in what " \
        "the kernel does with v's values themselves" in d.sentence, d.sentence


def test_a_row_constant_is_the_value_most_of_its_keys_share():
    d = np.array([[0.5, 0.5 + 1e-9, 3.0, 0.5 - 1e-9, np.nan, -2.0]])
    assert weights._row_constant(d, 1e-6)[0, 0] == pytest.approx(0.5, abs=1e-8)
    assert weights._row_constant(np.full((1, 3), np.nan), 1e-6)[0, 0] == 0.0


@moved
def test_an_fp8_cache_is_probed_with_values_its_scale_stores_exactly():
    right = fp8_gallery.RIGHT_KV["fa3"]

    stored = []

    def k_tail_rolled(q, k, v, **kw):                      # key tiles after the first: k's bytes rolled
        stored.append(set(v.float().unique().tolist()))
        b = k.view(torch.uint8)
        return right(q, torch.cat([b[:, :, :16], b[:, :, 16:].roll(4, -1)], 2).view(k.dtype), v, **kw)
    case = next(c for c in REGISTRY["fp8_kv"].cases(False, Plan()) if c.tq == 97)
    rows = runner.run_case(targets.resolve(k_tail_rolled), case, "bfloat16", "cpu", wanted=("fp8_kv",))
    d = next(r for r in rows if r.tensor == "out").diagnosis
    assert stored.count({0.0}) == 1 and stored.count({0.0, 1.0}) >= 2, stored     # v = 0, then one-hot, exact
    assert d.id == "weights-read", d.sentence
    assert "weigh keys whose scores differ from the reference's (keys 16 .. 96 in all" in d.sentence, d.sentence
    assert "hides" not in d.sentence, d.sentence         # (keys scored far down: no weight left in e4m3)


def _pairs_swapped(q, k, v, *, causal, scale):        # P packed two keys a word, the word's halves swapped
    swap = torch.arange(v.shape[2]).view(-1, 2).flip(-1).reshape(-1)
    return sdpa(q, k, v[:, :, swap], causal=causal, scale=scale)


def test_values_read_in_swapped_pairs_are_named_with_the_keys_whose_weights_they_take():
    d = _out(_pairs_swapped, Case(1, 2, 64, 64, 16, False, ()))
    assert d.id == "weights-read", d.sentence
    assert "64 of 64 keys are weighed as other keys are (each key's column of weights, over every row, the " \
        "reference's of another key: key j given key j + 1's on keys 0, 2, 4, 6, ...; key j given key j - 1's " \
        "on keys 1, 3, 5, 7, ...)" in d.sentence, d.sentence


def test_a_value_tile_sliced_at_its_k_steps_index_is_named_with_the_keys_whose_weights_move():
    def kstep_index_for_offset(q, k, v, *, causal, scale, tile=64, step=32):
        """P V as the k-steps of a tensor-core product, V's rows taken at the step's index ks where its
        offset ks · step is meant (P's columns at the offset)."""
        s = (q @ k.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(s, -1)
        vp = torch.cat([v, v.new_zeros(v.shape[:2] + (tile, v.shape[-1]))], 2)      # masked loads past Tk read 0
        out = torch.zeros_like(q)
        for n0 in range(0, k.shape[2], tile):
            for ks in range(tile // step):
                cols = p[..., n0 + ks * step:n0 + (ks + 1) * step]
                out += cols @ vp[:, :, n0 + ks:n0 + ks + cols.shape[-1]]
        return out
    d = _out(kstep_index_for_offset, Case(1, 2, 45, 77, 16, True, ()))
    assert d.id == "keys-mixed", d.sentence
    assert "each key's weight falls on other keys' values (W = P M over every row read, M of 0s and 1s: key k's " \
        "weight on value k - 31 for keys 32 .. 44; the values of keys 32 .. 44 given no weight" in d.sentence, \
        d.sentence
    # a permutation is said by its pairs, not as a mix
    assert "falls on other keys' values" not in _out(_pairs_swapped, Case(1, 2, 64, 64, 16, False, ())).sentence


def test_query_rows_scored_with_keys_from_a_reused_buffer_are_named_with_the_rows_they_took():
    def q_copied_after_the_first_k_tile(q, k, v, *, causal, scale, tile=32, shared=16):
        """Each query tile's rows 0 .. 15 read from a buffer the first key tile has overwritten."""
        q2 = q.clone()
        for m0 in range(0, q.shape[2], tile):
            n = min(shared, q.shape[2] - m0, k.shape[2])
            q2[:, :, m0:m0 + n] = k[:, :, :n]
        return sdpa(q2, k, v, causal=causal, scale=scale)
    d = _out(q_copied_after_the_first_k_tile, Case(1, 2, 45, 77, 16, True, ()))
    assert d.id == "rows-scored-with", d.sentence
    assert "query rows 1 .. 15, 32 .. 44 of 45 in every (batch, head) are scored with another vector in place of " \
        "their own q (log W − log P = scale (x − q_i) · k_j up to a constant per row: rows 1 .. 15 with k's row i; " \
        "rows 32 .. 44 with k's row i - 32)" in d.sentence, d.sentence


def test_keys_mixed_by_four_shifts_say_the_three_that_move_the_most_keys():
    rng = np.random.default_rng(0)
    s = 3.0 * rng.standard_normal((1, 1, 40, 24))
    P = np.exp(s) / np.exp(s).sum(-1, keepdims=True)                    # peaked rows, as softmax weights are
    M = np.eye(24)
    moves = {8: 1, 9: 2, 16: 3, 17: 4, 18: 5, 20: 6, 23: 7, 22: 9}   # key -> the value its weight lands on
    for key, value in moves.items():
        M[key, key], M[key, value] = 0.0, 1.0
    said = weights._keys_mixed(P @ M, P, P.max(-1), np.ones((1, 1, 40), dtype=bool), (1e-3, 1e-6))
    assert said is not None and said.count("key k's weight on value") == 3 and "; ...; " in said, said
    assert "key k's weight on value k - 13 for keys 16 .. 18" in said, said


def _failed(case, tensor, named):
    return Row("k", case, {}, "float32", "cpu", tensor, error=1.0, bound=1e-6, verdict="FAIL",
               diagnosis=Diagnosis(named, named))


def test_rows_only_located_keep_one_catalogued_row_from_heading_the_run():
    located = [_failed(f"c{i}", "out", "weights-read") for i in range(6)]
    one = [_failed("c9", "out", "rows-moved")]
    assert Report("k", rows=located + one).diagnosis is None            # 1 named against 6 only located
    assert Report("k", rows=located[:1] + one * 3).diagnosis == "rows-moved"
    # the gradients of a case whose out is only located are not covered by it: they count as unnamed
    grads = [_failed(f"c{i}", t, "none") for i in range(6) for t in ("dq", "dk")]
    assert Report("k", rows=located + grads).diagnosis is None
    assert Report("k", rows=located).diagnosis == "weights-read"


def _grads(kernel, case):
    """{tensor: row} of ``kernel`` on ``case``, float32."""
    return {r.tensor: r for r in runner.run_case(targets.resolve(kernel), case, "float32", "cpu")}


def test_a_dkdv_pass_reading_the_rows_before_its_slice_is_located_by_the_backwards_weights():
    def dv_from_the_slice_before(q, k, v, *, causal, scale):   # each slice's keys 0 .. 15 also take the last one's dO
        out = sdpa(q, k, v, causal=causal, scale=scale)
        B, H, T, D = q.shape
        flat = lambda x: x.reshape(B * H, -1, D)
        p = torch.softmax((flat(q) @ flat(k).transpose(-1, -2)) * scale, -1).detach()
        extra = torch.cat([p[:-1, :, :16] @ flat(v)[1:, :16], torch.zeros_like(flat(out)[:1])]).reshape(out.shape)
        return out + extra - extra.detach()                    # out as it is; dv of the slice after added to
    rows = _grads(dv_from_the_slice_before, Case(2, 2, 17, 40, 16, False, ()))
    assert rows["out"].passed and rows["dk"].passed and rows["dv"].failed
    d = rows["dv"].diagnosis
    assert d.id == "weights-read", d.sentence
    assert "3 of 4 (batch, kv head) slices take dO from the query rows of other slices" in d.sentence and \
        "(batch, kv head) (0, 1) keys 0 .. 15 take the dO of query (batch, head) (0, 0); (batch, kv head) (1, 0) " \
        "keys 0 .. 15 take the dO of query (batch, head) (0, 1)" in d.sentence, d.sentence
    assert "each the query slice just before its own in memory ((batch, head) order): rows read before its " \
        "slice's first row" in d.sentence, d.sentence


def test_keys_read_past_a_slices_end_from_the_next_slice_are_said_so():
    def last_tile_unmasked(q, k, v, *, causal, scale):        # 3 keys past Tk: the next slice's first (0 past the last)
        B, H, T, D = k.shape
        past = lambda x: torch.cat([x.reshape(B * H, T, D)[1:, :3], x.new_zeros(1, 3, D)]).reshape(B, H, 3, D)
        return sdpa(q, torch.cat([k, past(k)], 2), torch.cat([v, past(v)], 2), causal=causal, scale=scale)
    d = _out(last_tile_unmasked, Case(2, 2, 17, 45, 16, False, ()))
    assert d.id == "weights-read", d.sentence
    assert "(batch, head) (0, 0) rows 0 .. 16 give" in d.sentence and "to the values of (batch, kv head) (0, 1), " \
        "their own (0, 0)" in d.sentence and "each the slice just after its own in memory ((batch, kv head) order): " \
        "keys read past its slice's end" in d.sentence, d.sentence


def test_a_dkdv_pass_masking_each_row_as_the_next_tiles_is_named_with_the_shift():
    def mask_of_the_next_tile(q, k, v, *, causal, scale):      # dv = P'ᵀ dO, P' = exp(S − lse) under row i + 16's mask
        out = sdpa(q, k, v, causal=causal, scale=scale)
        s = (q @ k.transpose(-1, -2)).detach() * scale
        i, j = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None, :]
        lse = torch.logsumexp(s.masked_fill(j > i, float("-inf")), -1, keepdim=True)
        shifted = torch.exp(s - lse).masked_fill((j > i + 16) | (i + 16 >= s.shape[-2]), 0.0)
        extra = shifted @ v - torch.softmax(s.masked_fill(j > i, float("-inf")), -1) @ v
        return out + extra - extra.detach()                    # out as it is; dv from the shifted mask's weights
    rows = _grads(mask_of_the_next_tile, Case(1, 2, 45, 45, 16, True, ()))
    assert rows["out"].passed and rows["dq"].passed and rows["dv"].failed
    d = rows["dv"].diagnosis
    assert d.id == "rows-masked-as", d.sentence
    assert "each query row i weighs the keys row i + 16 sees (every row read: masked as the row 16 later; rows " \
        "29 .. 44 weigh no key (past the last row))" in d.sentence, d.sentence


def test_a_dkdv_pass_recomputing_some_keys_scores_otherwise_is_located_on_those_keys():
    def dv_of_keys_rolled(q, k, v, *, causal, scale):          # dv = P'ᵀ dO, P' from k's channels rolled past key 15
        out = sdpa(q, k, v, causal=causal, scale=scale)
        rolled = torch.cat([k[:, :, :16], k[:, :, 16:].roll(4, -1)], 2).detach()
        moved = (sdpa(q.detach(), rolled, v, causal=causal, scale=scale) -
                 sdpa(q.detach(), k.detach(), v, causal=causal, scale=scale))
        return out + moved - moved.detach()                    # out as it is; dv from the rolled keys' weights
    rows = _grads(dv_of_keys_rolled, Case(1, 2, 17, 40, 16, False, ()))
    assert rows["out"].passed and rows["dq"].passed and rows["dv"].failed
    d = rows["dv"].diagnosis
    assert d.id == "weights-read", d.sentence
    assert "query rows 0 .. 16 of 17 in every (batch, head) weigh keys whose scores differ from the reference's " \
        "(keys 16 .. 39 in all" in d.sentence and "(the key's k read otherwise)" in d.sentence, d.sentence


def test_a_dkdv_pass_whose_weights_are_right_says_so():
    class _DOSaturated(torch.autograd.Function):               # dO clipped at ±1 (a narrow store): one-hot dO exact
        @staticmethod
        def forward(ctx, out):
            return out.clone()

        @staticmethod
        def backward(ctx, g):
            return g.clamp(-1.0, 1.0)

    def saturated(q, k, v, *, causal, scale):
        return _DOSaturated.apply(sdpa(q, k, v, causal=causal, scale=scale))
    rows = _grads(saturated, Case(1, 2, 17, 40, 16, True, ()))
    assert rows["out"].passed and rows["dv"].failed and rows["dk"].failed
    for d in (rows["dv"].diagnosis, rows["dk"].diagnosis):                # dk comes from the same pass
        assert d.id == "weights-read" and "are the reference's: the dK/dV pass weighs the right rows" in d.sentence, \
            d.sentence


def test_the_backward_is_not_read_where_out_is_wrong():
    def k_pointer_off(q, k, v, *, causal, scale):             # the forward's slip: its gradients follow from out
        k = torch.cat([k[:, :, :16], k[:, :, 16:].roll(4, -1)], 2)
        return sdpa(q, k, v, causal=causal, scale=scale)
    rows = _grads(k_pointer_off, Case(1, 2, 17, 40, 16, False, ()))
    assert rows["out"].failed and rows["dv"].failed
    assert "one-hot dO" not in rows["dv"].diagnosis.sentence and "one-hot dO" not in rows["dk"].diagnosis.sentence


def test_a_kv_head_reading_its_neighbours_values_in_half_the_slices_is_not_said_to_read_past_its_end():
    def even_heads_read_the_next(q, k, v, *, causal, scale):   # a paged cache's slots and kv heads transposed, say
        v = torch.stack([v[:, 1], v[:, 1]], 1)
        return sdpa(q, k, v, causal=causal, scale=scale)
    d = _out(even_heads_read_the_next, Case(2, 2, 17, 45, 16, False, ()))
    assert d.id == "weights-read" and "(batch, head) (0, 0) rows 0 .. 16 give" in d.sentence, d.sentence
    assert "just after" not in d.sentence, d.sentence             # (0, 1) and (1, 1) read their own
