"""Causes read from the kernel's own tensors rather than from a catalogue entry: one gradient off
by one factor, the last keys seen by no query, dk and dv summed over another map of query heads,
a broadcast input's gradient kept from one slice, a numeric option off by a factor, and a backward
that masks otherwise than its forward.  Each kernel below is right but for that one slip."""

import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

import parity_tests
from parity_tests.kernels import runner, targets
from parity_tests.kernels.cases import Case
from parity_tests.kernels.features import REGISTRY, Plan
from parity_tests.kernels.diagnosis import diagnose
from parity_tests.kernels.planted.featured import attend, wrong_kernel
from crashing_kernels import sdpa, with_backward
from sampled import moved, one_in

pytestmark = pytest.mark.usefixtures("without_input_classes")   # (conftest.py)

ONE = dict(dtypes=["float32"], head_dims=[16], heads=[2], batch=[1])


def _failing(report):
    return {(r.case, r.tensor): d for r, d in report.diagnoses}


def _said(kernel, case):
    """{tensor: diagnosis} of the failing rows of ``kernel`` on ``case``, float32."""
    rows = runner.run_case(targets.resolve(kernel), case, "float32", "cpu")
    return {r.tensor: r.diagnosis for r in rows if not r.passed}


def test_a_gradient_off_by_one_factor_is_named_with_the_option_it_equals():
    def dk_scaled_twice(q, k, v, *, causal, scale):          # q pre-scaled, and dk scaled once more
        return sdpa(q, with_backward(k, lambda g: g * scale), v, causal=causal, scale=scale)
    report = parity_tests.check(dk_scaled_twice, tokens=["17", "45x77"], causal="yes", **ONE)
    found = _failing(report)
    assert {t for _, t in found} == {"dk"}
    for d in found.values():
        assert d.id == "constant-factor", d.sentence
        assert "dk multiplied by one constant, 0.25 (scale = 0.25)" in d.sentence, d.sentence


def test_one_factor_is_not_fitted_to_a_handful_of_numbers():
    a, r = np.full((1, 4, 1, 1), 3.0), np.arange(1.0, 5.0).reshape(1, 4, 1, 1)
    assert diagnose._constant_factor("dsinks", a, r, 1.0, 10.0, []) == []      # 4 entries
    a, r = np.full((1, 1, 4, 4), 3.0) * np.arange(16.0).reshape(1, 1, 4, 4), np.arange(16.0).reshape(1, 1, 4, 4)
    (residual, hid, says, _), = diagnose._constant_factor("dq", a, r, 1.0, 1e-9, [(3.0, "three")])
    assert hid == "constant-factor" and "3 (three)" in says and residual.max() < 1e-12


def test_the_last_keys_seen_by_no_query_are_counted():
    def five_splits_floored(q, k, v, *, causal, scale):      # split size Tk // 5: the tail left out
        kept = k.shape[2] // 5 * 5
        return sdpa(q, k[:, :, :kept], v[:, :, :kept], causal=causal, scale=scale)
    report = parity_tests.check(five_splits_floored, tokens=["45x77"], causal="no", **ONE)
    found = _failing(report)
    assert {t for _, t in found} == {"out", "dq", "dk", "dv"}
    assert all(d.id == "keys-unseen" for d in found.values()), [d.sentence for d in found.values()]
    assert "keys 75 .. 76 seen by no query" in found["B1 H2 T45x77 D16 full", "out"].sentence


def _tiled(x, group):                  # the value of repeat_interleave, the gradient of repeat
    return x.repeat(1, group, 1, 1) + (x.repeat_interleave(group, 1) - x.repeat(1, group, 1, 1)).detach()


def test_dk_and_dv_summed_over_another_head_map_are_named_with_the_map():
    def backward_tiled(q, k, v, *, causal, scale):
        group = q.shape[1] // k.shape[1]
        return sdpa(q, _tiled(k, group), _tiled(v, group), causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(backward_tiled), Case(1, 6, 45, 77, 16, True, (("gqa", 2),)),
                           "float32", "cpu", wanted=("gqa",))
    assert {r.tensor for r in rows if not r.passed} == {"dk", "dv"}
    said = [r.diagnosis for r in rows if not r.passed]
    assert all(d.id == "head-map" for d in said), [d.sentence for d in said]
    assert all("kv head 0 from query heads 0, 2, 4 (read by 0, 1, 2)" in d.sentence for d in said), said


@moved
def test_a_broadcast_gradient_kept_from_one_slice_is_named_with_the_slice():
    def last_entry_only(q, k, v, *, causal, scale, bias):  # "=" where "+=" is meant, over the batch
        b = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(q.shape[0], -1, -1, -1)
        b = torch.cat([b[:-1].detach(), b[-1:]])
        return attend(q, k, v, causal=causal, scale=scale, bias=b)[0]
    report = parity_tests.check(last_entry_only, features=["bias"], causal="yes", dtypes=["float32"])
    found = _failing(report)
    assert found and {t for _, t in found} == {"dbias"}
    said = {re.search(r"bias\S+", case).group(0): d for (case, _), d in found.items()}    # by the bias's shape
    assert said["bias1x2x45x77"].id == said["bias45x77"].id == "broadcast-sum"
    assert "dbias summed over 1 of the 2 slices its input is broadcast over: (batch 1), not all" in \
        said["bias1x2x45x77"].sentence
    assert "summed over 2 of the 4 slices its input is broadcast over: (batch 1, head 0), (batch 1, head 1)" in \
        said["bias45x77"].sentence


def test_an_option_off_by_ln_2_is_named_so():
    def slopes_in_base_e(q, k, v, *, causal, scale, alibi_slopes):   # base-2 scores, the bias left in base e
        return attend(q, k, v, causal=causal, scale=scale, alibi_slopes=alibi_slopes * math.log(2))[0]
    rows = runner.run_case(targets.resolve(slopes_in_base_e), Case(1, 6, 45, 77, 16, True, (("alibi", True),)),
                           "float32", "cpu", wanted=("alibi",))
    assert {r.tensor for r in rows if not r.passed} == {"out", "dq", "dk", "dv"}
    said = [r.diagnosis for r in rows if not r.passed]
    assert all(d.id == "alibi_slopes-times-ln2" for d in said), [d.sentence for d in said]
    assert "alibi_slopes multiplied by ln 2 (in base 2 where e is meant)" in said[0].sentence


def _backward_without_left_edge(q, k, v, *, causal, scale, window, align="top-left"):
    """The forward with the window; the backward's P = exp(S − lse) over the keys the window
    without its left edge leaves (the gradients of out + g − g.detach(), g = P' v − rowsum(P') O)."""
    out, lse = attend(q, k, v, causal=causal, scale=scale, window=window, align=align)
    tq, tk = q.shape[2], k.shape[2]
    i, j = torch.arange(tq)[:, None] + (tk - tq if align == "bottom-right" else 0), torch.arange(tk)[None, :]
    seen = (j <= i if causal else torch.ones(tq, tk, dtype=torch.bool))
    if window[1] >= 0:
        seen &= j <= i + window[1]
    S = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~seen, -math.inf)
    lse = lse.detach().double()                                   # saved by the forward: a constant here
    seen_any = torch.isfinite(lse)[..., None]                     # a row that sees no key: P' = 0
    P = torch.exp(S - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]) * seen_any
    O = out.detach().double()
    g = P @ v.double() - P.sum(-1, keepdim=True) * O
    return (O + (g - g.detach())).to(q.dtype)


def test_a_backward_masking_otherwise_than_its_forward_is_named_with_the_forward_mistake_it_mirrors():
    for case in (Case(1, 2, 113, 113, 16, True, (("window", (30, 0)),)),
                 Case(1, 2, 77, 45, 16, True, (("window", (9, 0)),), "bottom-right")):
        rows = runner.run_case(targets.resolve(_backward_without_left_edge), case, "float32", "cpu",
                               wanted=("window",))
        assert {r.tensor for r in rows if not r.passed} == {"dq", "dk", "dv"}, case
        said = [r.diagnosis for r in rows if not r.passed]
        assert all(d.id == "backward-window-left-ignored" for d in said), [d.sentence for d in said]
        assert said[0].sentence.startswith("the output is right; only the backward is wrong: dq matches the reference "
                                           "with a backward that recomputes P = exp(S - lse) under the window's left "
                                           f"edge ignored ((-1, 0) for {case.get('window')}), its forward right")


def _packed(offset_of):
    """Packed sequences, each causal with ``offset_of(b, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)`` as sequence b's offset (query i sees key j <= i + offset)."""
    def kernel(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        outs = []
        for b in range(len(cu_seqlens_q) - 1):
            cut = lambda x, c: x[int(c[b]):int(c[b + 1])].transpose(0, 1)        # (H, t, D)
            qs, ks, vs = cut(q, cu_seqlens_q), cut(k, cu_seqlens_k), cut(v, cu_seqlens_k)
            S = qs @ ks.transpose(-1, -2) * scale
            if causal:
                i, j = torch.arange(qs.shape[1])[:, None], torch.arange(ks.shape[1])[None, :]
                S = S.masked_fill(j > i + offset_of(b, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                                  -math.inf)
            outs.append(torch.softmax(S, -1).nan_to_num(0.0) @ vs)                # no key seen: 0
        return torch.cat([o.transpose(0, 1) for o in outs])
    return kernel


own_offset = lambda b, cq, ck: int(ck[b + 1] - ck[b]) - int(cq[b + 1] - cq[b])   # bottom-right: len_k - len_q
KERNELS = {   # the batch's max_seqlen_k - max_seqlen_q for every sequence; key positions counted from cu_seqlens_q
    "max_seqlen": _packed(lambda b, cq, ck, mq, mk: mk - mq),
    "start": _packed(lambda b, cq, ck, mq, mk: own_offset(b, cq, ck) - int(ck[b] - cq[b])),
}
# lengths 20x45, 1x1, 0x3, 77x77, 130x200 (starts apart by 0, 25, 25, 28, 28)
SAID = {"max_seqlen": "sequence 0 with offset 70 (the batch's max_seqlen_k - max_seqlen_q; its lengths give 25); "
                      "sequence 3 with offset 70",
        "start": "sequence 3 with offset -28 (its own minus its start difference cu_seqlens_k - cu_seqlens_q; its "
                 "lengths give 0); sequence 4 with offset 42 (its own minus"}


@pytest.mark.slow
@pytest.mark.parametrize("slip", ["max_seqlen", "start"])
def test_sequences_aligned_with_another_offset_are_named_with_the_offset_and_where_it_comes_from(slip):
    case = replace(next(c for c in REGISTRY["varlen"].cases(True, Plan()) if c.tq != c.tk), align="bottom-right")
    rows = runner.run_case(targets.resolve(KERNELS[slip]), case, "float32", "cpu", wanted=("varlen",))
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id == "sequence-offsets", out.diagnosis.sentence
    assert SAID[slip] in out.diagnosis.sentence, out.diagnosis.sentence


def test_an_lse_whose_maximum_is_added_back_unscaled_is_named_with_the_factor():
    def lse_from_raw_maximum(q, k, v, *, causal, scale):     # m tracked on q·k, added back without the scale
        out, lse = attend(q, k, v, causal=causal, scale=scale)
        S = (q.double() @ k.double().transpose(-1, -2)).masked_fill(
            torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1) if causal else False, -math.inf)
        m = S.amax(-1)
        return out, lse + ((1 / scale - 1) * scale * m).float()
    rows = runner.run_case(targets.resolve(lse_from_raw_maximum), Case(1, 2, 17, 17, 16, True), "float32", "cpu",
                           wanted=("lse",))
    assert {r.tensor for r in rows if not r.passed} == {"lse"}
    d = next(r.diagnosis for r in rows if r.tensor == "lse")
    assert d.id == "lse-max-factor" and "+ 4 m_i: each row's maximum score m added back 1/scale times" in d.sentence, \
        d.sentence


def test_hidden_keys_given_minus_the_cap_are_named_a_cap_applied_after_the_mask():
    def capped_after_masking(q, k, v, *, causal, scale, softcap):
        S = (q @ k.transpose(-1, -2)) * scale
        if causal:
            S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
        return torch.softmax(softcap * torch.tanh(S / softcap), -1) @ v     # tanh(-inf) = -1: -softcap
    rows = runner.run_case(targets.resolve(capped_after_masking), Case(1, 2, 17, 17, 16, True, (("softcap", 1.0),)),
                           "float32", "cpu", wanted=("softcap",))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert said and all(d.id == "hidden-scored-minus-softcap" for d in said.values()), \
        [d.sentence for d in said.values()]
    assert "the hidden keys scored -softcap (the softcap applied after the mask" in said["out"].sentence


def test_a_bias_added_before_the_scale_is_named_so():
    def bias_then_scale(q, k, v, *, causal, scale, bias):
        S = (q @ k.transpose(-1, -2) + bias) * scale                         # the bias scaled too
        if causal:
            S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
        return torch.softmax(S, -1) @ v
    rows = runner.run_case(targets.resolve(bias_then_scale), Case(1, 2, 17, 17, 16, True, (("bias", (17, 17)),)),
                           "float32", "cpu", wanted=("bias",))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert said["out"].id == "bias-times-scaled", said["out"].sentence
    assert "bias multiplied by the scale (applied before the scores are scaled)" in said["out"].sentence


def test_dq_written_per_key_tile_instead_of_added_is_named_with_its_tile():
    def dq_of_the_last_tile(q, k, v, *, causal, scale):   # dq = ... per key tile where dq += ... is meant
        tq, tk = q.shape[2], k.shape[2]
        i, j = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
        last = i if causal else torch.full((tq, 1), tk - 1)                 # each row's last visible key
        far = j < (last // 32) * 32                                          # before its last key tile of 32
        S = torch.where(far, q.detach() @ k.transpose(-1, -2), q @ k.transpose(-1, -2)) * scale
        if causal:
            S = S.masked_fill(j > i, -math.inf)
        return torch.softmax(S, -1) @ v                                      # dk, dv right; dq: the last tile's
    rows = runner.run_case(targets.resolve(dq_of_the_last_tile), Case(1, 2, 77, 77, 16, True), "float32", "cpu",
                           wanted=())
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq"}, {n: d.sentence for n, d in said.items()}
    assert said["dq"].id == "last-tile-only" and "(dq from the last key tile of 32)" in said["dq"].sentence, \
        said["dq"].sentence


def test_one_factor_on_a_few_numbers_is_named_only_as_a_constant_of_the_case():
    a, r = np.array([0.5, 1.5]).reshape(1, 2, 1, 1), np.array([1.0, 3.0]).reshape(1, 2, 1, 1)
    constants = [(0.5, "1/2: averaged over the batch entries"), (0.5, "1/2: averaged over the heads"), (0.25, "x")]
    (_, hid, says, _), = diagnose._constant_factor("dsinks", a, r, 1.0, 1e-9, constants)
    assert "0.5 (1/2: averaged over the batch entries or averaged over the heads)" in says, says
    assert diagnose._constant_factor("dsinks", a * 1.1, r, 1.0, 1e-9, constants) == []      # 0.55: no constant
    assert diagnose._constant_factor("dsinks", a[:, :1], r[:, :1], 1.0, 1e-9, constants) == []   # one number


def test_a_gradient_averaged_over_the_batch_is_named_so():
    def dk_averaged(q, k, v, *, causal, scale):               # dk reduced with mean() over the batch
        return sdpa(q, with_backward(k, lambda g: g / k.shape[0]), v, causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(dk_averaged), Case(3, 2, 17, 17, 16, True), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dk"} and said["dk"].id == "constant-factor", {n: d.sentence for n, d in said.items()}
    assert "0.333333 (1/3: averaged over the batch entries)" in said["dk"].sentence, said["dk"].sentence


def test_a_gradient_accumulated_twice_is_named_so():
    def dv_twice(q, k, v, *, causal, scale):                  # dv added by two passes
        return sdpa(q, k, with_backward(v, lambda g: 2 * g), causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(dv_twice), Case(1, 1, 17, 17, 16, True), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dv"} and said["dv"].id == "constant-factor", {n: d.sentence for n, d in said.items()}
    assert "one constant, 2 (2: accumulated twice (by two passes, or one pass run twice))" in said["dv"].sentence, \
        said["dv"].sentence


@pytest.mark.parametrize("slip, said", [
    (lambda lse: lse.transpose(1, 2).contiguous().reshape(lse.shape),      # built (B, T, H), reshaped to (B, H, T)
     "laid out as (1, 17, 2) (axes (0, 2, 1)) and read back by reshape"),
    (lambda lse: lse.reshape(lse.shape[0], lse.shape[2], lse.shape[1]).transpose(1, 2),   # reshaped, then transposed
     "reshaped to (1, 17, 2) and its axes put back ((0, 2, 1))")])
def test_an_lse_reshaped_where_a_transpose_is_meant_is_named_with_the_shapes(slip, said):
    def lse_reshaped(q, k, v, *, causal, scale):
        out, lse = attend(q, k, v, causal=causal, scale=scale)
        return out, slip(lse)
    rows = runner.run_case(targets.resolve(lse_reshaped), Case(1, 2, 17, 17, 16, True), "float32", "cpu",
                           wanted=("lse",))
    found = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(found) == {"lse"} and found["lse"].id == "axes-permuted", {n: d.sentence for n, d in found.items()}
    assert f"the reference's lse of shape (1, 2, 17) (the target's) {said}" in found["lse"].sentence, \
        found["lse"].sentence


def _merged_over_the_batch(out, lse):                       # an online softmax's state never reset
    for b in range(1, out.shape[0]):
        both = torch.logaddexp(lse[b - 1], lse[b])
        out[b] = torch.exp(lse[b - 1] - both)[..., None] * out[b - 1] + torch.exp(lse[b] - both)[..., None] * out[b]
        lse[b] = both
    return out, lse


def test_state_carried_from_one_batch_entry_to_the_next_is_named_so():
    def carried(q, k, v, *, causal, scale):
        out, lse = attend(q, k, v, causal=causal, scale=scale)
        return _merged_over_the_batch(out.detach().clone(), lse.detach().clone())[0]
    rows = runner.run_case(targets.resolve(carried), Case(3, 2, 17, 45, 16, True), "float32", "cpu")
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id == "state-carried", out.diagnosis.sentence
    assert "each batch entry's rows merged with the same rows of every batch entry before it" in out.diagnosis.sentence


def _block_kernel(keep_of):
    """sdpa whose softmax sees only the (query, key) entries where keep_of(i, j) holds."""
    def kernel(q, k, v, *, causal, scale):
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        S = (q @ k.transpose(-1, -2)) * scale
        return torch.softmax(S.masked_fill(~keep_of(i, j) | ((j > i) if causal else False), -math.inf), -1) @ v
    return kernel


def test_query_tiles_reading_too_few_key_tiles_are_named_with_the_tiles():
    # each query tile of 32 reads key tiles 0 .. its own + 1 (a causal tile bound in a kernel without the mask)
    kernel = _block_kernel(lambda i, j: j // 32 <= i // 32 + 1)
    rows = runner.run_case(targets.resolve(kernel), Case(1, 2, 45, 130, 16, False), "float32", "cpu")
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id == "key-tile-ranges", out.diagnosis.sentence
    assert "query rows 0 .. 31 read key tiles 0 .. 1, their keys span key tiles 0 .. 4; query rows 32 .. 44 read " \
           "key tiles 0 .. 2" in out.diagnosis.sentence, out.diagnosis.sentence
    assert all(r.diagnosis.id == "key-tile-ranges" for r in rows if not r.passed), \
        [r.diagnosis.sentence for r in rows if not r.passed]


def test_a_backward_leaving_out_blocks_is_named_with_the_blocks():
    def blocks_skipped(q, k, v, *, causal, scale):            # the backward's query tile 0 skips key tiles >= 1
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        S = (q @ k.transpose(-1, -2)) * scale
        lse = torch.logsumexp(S, -1, keepdim=True).detach()
        out = (torch.softmax(S, -1) @ v).detach()
        P = torch.exp(S.masked_fill((i // 32 == 0) & (j // 32 >= 1), -math.inf) - lse)
        g = P @ v - P.sum(-1, keepdim=True) * out                 # the gradients of the kept entries, D whole
        return out + (g - g.detach())
    rows = runner.run_case(targets.resolve(blocks_skipped), Case(1, 2, 77, 77, 16, False), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq", "dk", "dv"}, {n: d.sentence for n, d in said.items()}
    for d in said.values():
        assert d.id == "backward-blocks", d.sentence
        assert "leaves out 2 (query tile, key tile) blocks of 32 x 32 that the forward uses (key tile 1 without " \
               "query tile 0; key tile 2 without query tile 0)" in d.sentence, d.sentence


def test_a_key_counted_twice_by_every_row_is_named_with_the_key():
    def overlapping_splits(q, k, v, *, causal, scale):        # splits [0, 41) and [40, Tk): key 40 in both
        tq, tk = q.shape[2], k.shape[2]
        j = torch.cat([torch.arange(41), torch.arange(40, tk)])
        S = (q @ k[:, :, j].transpose(-1, -2)) * scale
        if causal:
            S = S.masked_fill(j[None, :] > torch.arange(tq)[:, None] + tk - tq, -math.inf)
        return torch.softmax(S, -1) @ v[:, :, j]
    rows = runner.run_case(targets.resolve(overlapping_splits), Case(1, 2, 5, 77, 16, True), "float32", "cpu",
                           align="bottom-right")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert said and all(d.id == "keys-weighted" for d in said.values()), {n: d.sentence for n, d in said.items()}
    assert "with key 40 counted twice (the same for every query row" in said["out"].sentence, said["out"].sentence


def test_keys_counted_more_than_twice_are_named_with_their_counts():
    def tile_past_each_split(q, k, v, *, causal, scale):      # splits of 7 keys, each reading a whole tile of 16
        tk = k.shape[2]
        j = torch.cat([torch.arange(s, min(s + 16, tk)) for s in range(0, tk, 7)])
        return torch.softmax((q @ k[:, :, j].transpose(-1, -2)) * scale, -1) @ v[:, :, j]
    rows = runner.run_case(targets.resolve(tile_past_each_split), Case(1, 2, 30, 45, 16, False), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert said and all(d.id == "keys-weighted" for d in said.values()), {n: d.sentence for n, d in said.items()}
    assert "keys 7 .. 13, 16 .. 20, 23 .. 27, 30 .. 34, ... counted twice; keys 14 .. 15, 21 .. 22, 28 .. 29, " \
           "35 .. 36, ... counted 3 times" in said["out"].sentence, said["out"].sentence


def test_the_causal_mask_left_off_the_diagonal_tiles_is_named_with_the_blocks():
    # the causal mask left off the diagonal tiles of 32: each row sees up to its tile's last key
    def diagonal_tiles_unmasked(q, k, v, *, causal, scale):
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        S = (q @ k.transpose(-1, -2)) * scale
        return torch.softmax(S.masked_fill(j >= (i // 32 + 1) * 32, -math.inf), -1) @ v
    rows = runner.run_case(targets.resolve(diagonal_tiles_unmasked), Case(1, 2, 77, 77, 16, True), "float32", "cpu")
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id == "tile-masks", out.diagnosis.sentence
    assert "blocks of 32 masked otherwise than their own (3 of 9: (0, 0): every key seen (its mask dropped); (1, 1): " \
           "every key seen (its mask dropped); (2, 2): every key seen (its mask dropped))" in out.diagnosis.sentence, \
        out.diagnosis.sentence


def test_a_window_edge_masked_on_the_first_tile_only_is_named_with_the_tile_starts():
    # window (6, 4): the left edge applied on the first key tile of 32 alone, so a row whose edge
    # lies in a later tile sees from that tile's start (its end, the right edge, is right)
    def left_edge_on_first_tile(q, k, v, *, causal, scale, window):
        (left, right), i, j = window, torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        start = torch.where(i - left >= 32, (i - left) // 32 * 32, (i - left).clamp(min=0))
        S = (q @ k.transpose(-1, -2)) * scale
        return torch.softmax(S.masked_fill((j < start) | (j > i + right), -math.inf), -1) @ v
    case = Case(1, 2, 45, 77, 16, False, (("window", (6, 4)),))
    rows = runner.run_case(targets.resolve(left_edge_on_first_tile), case, "float32", "cpu", wanted=("window",))
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id == "key-spans", out.diagnosis.sentence
    assert "each of query rows 39 .. 44 seeing another range of keys than its own: its first key 1 .. 6 keys " \
           "earlier, each range starting at a multiple of 32" in out.diagnosis.sentence, out.diagnosis.sentence


def test_rows_left_blank_are_said_so_not_read_as_a_range_of_keys():
    def rows_past_32_blank(q, k, v, *, causal, scale):         # a later tile's rows never written
        out = sdpa(q, k, v, causal=causal, scale=scale)
        return torch.cat([out[:, :, :32], torch.zeros_like(out[:, :, 32:])], 2)
    rows = runner.run_case(targets.resolve(rows_past_32_blank), Case(2, 2, 77, 77, 16, True), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"out", "dq", "dk", "dv"} and not {d.id for d in said.values()} & set(diagnose.FITTED), \
        {n: d.sentence for n, d in said.items()}
    assert "exactly 0 on query rows 32 .. 76 of 77 (the reference is not)" in said["out"].sentence, \
        said["out"].sentence


def _recomputing(q, k, v, out, lse, own_scores):
    """``out`` (the forward's) with the gradients of a backward that recomputes P' = exp(S' − lse)
    from scores S' = own_scores(q, k) of its own (out + g − g.detach(), g = P' v − rowsum(P') O)."""
    lse = lse.detach().double()
    P = torch.exp(own_scores(q.double(), k.double()) - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    O = out.detach().double()
    g = P @ v.double() - P.sum(-1, keepdim=True) * O
    return (O + (g - g.detach())).to(q.dtype)


def test_a_backward_recomputing_its_scores_without_an_option_is_named_with_the_option():
    def backward_without_alibi(q, k, v, *, causal, scale, alibi_slopes):
        out, lse = attend(q, k, v, causal=causal, scale=scale, alibi_slopes=alibi_slopes)
        tq, tk = q.shape[2], k.shape[2]
        hidden = torch.arange(tk)[None, :] > torch.arange(tq)[:, None]
        return _recomputing(q, k, v, out, lse, lambda q, k: (q @ k.transpose(-1, -2) * scale).masked_fill(
            hidden & causal, -math.inf))
    rows = runner.run_case(targets.resolve(backward_without_alibi), Case(1, 6, 45, 77, 16, True, (("alibi", True),)),
                           "float32", "cpu", wanted=("alibi",))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq", "dk", "dv"}, {n: d.sentence for n, d in said.items()}
    assert {d.id for d in said.values()} == {"backward-without-alibi_slopes"}, [d.sentence for d in said.values()]
    assert "with a backward that recomputes P = exp(S - lse) without the alibi_slopes, its forward right" in \
        said["dq"].sentence, said["dq"].sentence


def test_a_backward_reading_a_head_dim_block_smaller_than_d_is_named_with_the_block():
    def backward_of_32_channels(q, k, v, *, causal, scale):        # D = 40, the backward's block 32
        out, lse = attend(q, k, v, causal=causal, scale=scale)
        cut = (torch.arange(q.shape[-1]) < 32).to(q.dtype)
        hidden = torch.arange(k.shape[2])[None, :] > torch.arange(q.shape[2])[:, None]
        return _recomputing(q * cut, k * cut, v * cut, out, lse, lambda q, k: (q @ k.transpose(-1, -2) * scale)
                            .masked_fill(hidden & causal, -math.inf))
    rows = runner.run_case(targets.resolve(backward_of_32_channels), Case(1, 2, 45, 77, 40, True, ()), "float32",
                           "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq", "dk", "dv"}, {n: d.sentence for n, d in said.items()}
    assert {d.id for d in said.values()} == {"backward-head-dim-block"}, [d.sentence for d in said.values()]
    assert "from the first 32 of 40 head-dim channels alone (a head-dim block of 32; the gradient's channels " \
           "32 .. 39 never written), its forward right" in said["dq"].sentence, said["dq"].sentence


class _ByHand(torch.autograd.Function):
    """Attention in float64, (out, lse), with its backward written out in one of the forms under
    test: dS = P ∘ (``dp_factor`` dP − D), D = ``row_term(P, dP, dlse)`` (right: rowsum(P ∘ dP) −
    dlse); ``dk_tile``: dk = scale dS Q on each tile of that size (Tq for the whole: the transpose
    of dS left out) where scale dSᵀ Q is meant; ``dq_tile``: dq summed over key tiles of that size
    with its scale applied inside the loop, once per tile, where it is meant once after it (a pair:
    (key tile, query tile), each query tile looping over the key tiles its causal mask reaches);
    ``dk_v_rows``: dk's dP formed with v's rows from that one on read as 0."""
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, row_term, dp_factor, dk_tile, dq_tile=None, dk_v_rows=None):
        S = q.double() @ k.double().transpose(-1, -2) * scale
        if causal:
            S = S.masked_fill(torch.ones_like(S, dtype=torch.bool).triu(1), -math.inf)
        P = torch.softmax(S, -1)
        ctx.save_for_backward(q, k, v, P)
        ctx.forms, ctx.causal = (scale, row_term, dp_factor, dk_tile, dq_tile, dk_v_rows), causal
        return (P @ v.double()).to(q.dtype), torch.logsumexp(S, -1).float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, P = (x.double() for x in ctx.saved_tensors)
        scale, row_term, dp_factor, dk_tile, dq_tile, dk_v_rows = ctx.forms
        dout = dout.double()
        dlse = torch.zeros(P.shape[:-1], dtype=P.dtype) if dlse is None else dlse.double()
        dP = dout @ v.transpose(-1, -2)
        D = (row_term or (lambda P, dP, dlse: (P * dP).sum(-1, keepdim=True) - dlse[..., None]))(P, dP, dlse)
        dS = P * (dp_factor * dP - D)
        dk = dS.transpose(-1, -2) @ q * scale
        if dk_v_rows is not None:
            dP_k = dout @ torch.cat([v[..., :dk_v_rows, :], 0 * v[..., dk_v_rows:, :]], 2).transpose(-1, -2)
            dk = (P * (dP_k - D)).transpose(-1, -2) @ q * scale
        if dk_tile:
            t, dk = dk_tile, torch.zeros_like(k)
            for qs in range(0, q.shape[2], t):
                for ks in range(0, k.shape[2], t):
                    dk[..., ks:ks + t, :] += dS[..., qs:qs + t, ks:ks + t] @ q[..., qs:qs + t, :] * scale
        dq = dS @ k * scale
        if dq_tile:
            (t, m), dq = (dq_tile if isinstance(dq_tile, tuple) else (dq_tile, q.shape[2])), torch.zeros_like(q)
            for qs in range(0, q.shape[2], m):           # causal: the key tiles up to the query tile's last row
                for ks in range(0, min(k.shape[2], qs + m) if ctx.causal else k.shape[2], t):
                    dq[..., qs:qs + m, :] = (dq[..., qs:qs + m, :] + dS[..., qs:qs + m, ks:ks + t] @
                                             k[..., ks:ks + t, :]) * scale
        return (dq.to(q.dtype), dk.to(q.dtype), (P.transpose(-1, -2) @ dout).to(q.dtype),
                None, None, None, None, None, None, None)


def _by_hand(returns_lse=False, row_term=None, dp_factor=1.0, dk_tile=None, dq_tile=None, dk_v_rows=None):
    """``fn(q, k, v, *, causal, scale)`` of `_ByHand` in those forms: out, or (out, lse)."""
    def fn(q, k, v, *, causal, scale):
        out, lse = _ByHand.apply(q, k, v, scale, causal, row_term, dp_factor, dk_tile, dq_tile,
                                 q.shape[2] if dk_v_rows == "Tq" else dk_v_rows)
        return (out, lse) if returns_lse else out
    return fn


def _row_term_per_tile(P, dP, dlse):
    """D = rowsum(P ∘ dP) within each key tile of 32 alone, less dlse (a key-major tile loop's)."""
    return torch.cat([(P[..., ks:ks + 32] * dP[..., ks:ks + 32]).sum(-1, keepdim=True).expand(
        *P.shape[:-1], min(32, P.shape[-1] - ks)) for ks in range(0, P.shape[-1], 32)], -1) - dlse[..., None]


def test_a_row_term_summed_per_key_tile_less_the_lse_gradient_is_named_with_the_tile():
    report = parity_tests.check(_by_hand(returns_lse=True, row_term=_row_term_per_tile), features=["lse_grad"],
                                tokens=["45x77"], causal="no", **ONE)
    said = {d.id for r, d in report.diagnoses if r.tensor in ("dq", "dk")}
    assert said == {"delta-per-tile"}, [d.sentence for _, d in report.diagnoses]


def test_a_backward_whose_row_term_is_summed_per_key_tile_is_named_with_the_tile():
    rows = runner.run_case(targets.resolve(_by_hand(row_term=_row_term_per_tile)),
                           Case(1, 2, 45, 77, 16, False, ()), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq", "dk"}, {n: d.sentence for n, d in said.items()}
    assert {d.id for d in said.values()} == {"delta-per-tile"}, [d.sentence for d in said.values()]
    assert "summed over each key tile of 32 alone" in said["dq"].sentence, said["dq"].sentence


def test_rows_put_in_other_places_are_named_with_where_they_come_from():
    def heads_in_group_order(q, k, v, *, causal, scale):        # (B, G, Hkv) read as (B, Hkv, G)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        b, h, t, d = out.shape
        return out.reshape(b, 2, h // 2, t, d).transpose(1, 2).reshape(b, h, t, d)
    rows = runner.run_case(targets.resolve(heads_in_group_order), Case(1, 4, 45, 77, 16, True, ()), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert said["out"].id == "rows-moved", said["out"].sentence
    assert "each of 90 failing rows is the reference's row of other heads ((batch 0, head 1) holds (batch 0, " \
           "head 2)'s rows; (batch 0, head 2) holds (batch 0, head 1)'s rows)" in said["out"].sentence, \
        said["out"].sentence


def _base_2_online(q, k, v, *, causal, scale, rescale):
    """A base-2 online softmax over key blocks of 32, its maxima in log2 units, rescaled by ``rescale``."""
    dt, q, k, v = q.dtype, q.double(), k.double(), v.double()
    S = q @ k.transpose(-1, -2) * (scale / math.log(2))
    if causal:
        S = S.masked_fill(torch.ones_like(S, dtype=torch.bool).triu(1), -math.inf)
    m = torch.full(S.shape[:-1], -math.inf, dtype=S.dtype)
    l, acc = torch.zeros_like(m), torch.zeros(S.shape[:-1] + (v.shape[-1],), dtype=S.dtype)
    for j in range(0, S.shape[-1], 32):
        m_new = torch.maximum(m, S[..., j:j + 32].amax(-1))
        alpha = torch.where(torch.isfinite(m), rescale(m - m_new), 1.0)
        p = torch.exp2(S[..., j:j + 32] - m_new[..., None])
        l, acc, m = l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v[..., j:j + 32, :], m_new
    return (acc / l[..., None]).to(dt)


@pytest.mark.parametrize("rescale", [torch.exp, torch.exp2], ids=["exp", "exp2-right"])
def test_an_online_rescale_taken_in_the_other_base_is_named_with_the_base(rescale):
    kernel = lambda q, k, v, *, causal, scale: _base_2_online(q, k, v, causal=causal, scale=scale, rescale=rescale)
    said = _said(kernel, Case(1, 2, 45, 77, 16, True, ()))
    if rescale is torch.exp2:                                  # the kernel as it should be
        assert not said, {n: d.sentence for n, d in said.items()}
        return
    assert said["out"].id == "rescale-exp-for-exp2", said["out"].sentence
    assert "the running rescale exp2(m_old - m_new) of a base-2 kernel taken with exp (each factor raised to the " \
           "power log2(e)" in said["out"].sentence, said["out"].sentence


def test_the_lse_gradient_left_out_of_one_gradient_alone_is_named_on_it():
    def dsinks_without_dlse(q, k, v, *, causal, scale, sinks=None):
        out, _ = attend(q, k, v, causal=causal, scale=scale, sinks=sinks)
        held = None if sinks is None else sinks.detach()                 # lse's path misses the sinks
        _, lse = attend(q, k, v, causal=causal, scale=scale, sinks=held)
        return out, lse
    report = parity_tests.check(dsinks_without_dlse, features=["sinks", "lse_grad"], tokens=["45x77"], **ONE)
    said = {d.id for r, d in report.diagnoses if r.tensor == "dsinks"}
    assert {r.tensor for r in report.failures} == {"dsinks"}, str(report)
    assert said == {"lse-grad-dropped"}, [d.sentence for _, d in report.diagnoses]


def test_a_causal_mask_of_positions_in_bfloat16_is_named_so():
    def positions_in_bfloat16(q, k, v, *, causal, scale):
        i, j = torch.arange(q.shape[2], dtype=torch.bfloat16), torch.arange(k.shape[2], dtype=torch.bfloat16)
        seen = (j[None, :] <= i[:, None]) if causal else None
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale)
    rows = runner.run_case(targets.resolve(positions_in_bfloat16), Case(1, 2, 300, 300, 16, True, ()), "float32",
                           "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert said and {d.id for d in said.values()} == {"mask-positions-bfloat16"}, \
        {n: d.sentence for n, d in said.items()}


def test_a_backward_whose_dp_alone_is_off_by_one_factor_is_named_with_the_factor():
    rows = runner.run_case(targets.resolve(_by_hand(dp_factor=0.5)),
                           Case(1, 3, 45, 77, 16, False, ()), "float32", "cpu")      # 3 heads: 1/2 is no mean
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq", "dk"}, {n: d.sentence for n, d in said.items()}
    assert {d.id for d in said.values()} == {"dp-scaled"}, [d.sentence for d in said.values()]
    assert "dP = dO V^T multiplied by 0.5 (1/2) where its D = rowsum(dO ∘ O) and dv are right" in \
        said["dq"].sentence, said["dq"].sentence


def test_a_scale_applied_in_the_tile_loop_is_named_with_its_ratio_and_tile():
    case = Case(1, 2, 45, 77, 16, False, ())
    rows = runner.run_case(targets.resolve(_by_hand(dq_tile=32)), case, "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq"} and said["dq"].id == "tile-factors", {n: d.sentence for n, d in said.items()}
    assert ("the last key tile of 32 a row visits times 1, each earlier one times 0.25 once more (scale = 0.25): "
            "a factor applied in the tile loop, once per tile") in said["dq"].sentence, said["dq"].sentence
    assert all(r.passed for r in runner.run_case(targets.resolve(_by_hand()), case, "float32", "cpu"))
    # causal, the loop per query tile of 32: its early rows carried through key tiles they do not see
    rows = runner.run_case(targets.resolve(_by_hand(dq_tile=(16, 32))), Case(1, 2, 77, 77, 16, True, ()), "float32",
                           "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq"} and said["dq"].id == "tile-factors", {n: d.sentence for n, d in said.items()}
    assert "the last key tile of 16 the row's block of 32 visits times 1, each earlier one times 0.25 once more" in \
        said["dq"].sentence, said["dq"].sentence


def test_a_query_row_counted_more_than_once_in_dk_and_dv_is_named_with_its_count():
    # a last partial tile's 4 padding rows loaded as clamped copies of the last row, summed into dk, dv
    def clamped_padding_rows(q, k, v, *, causal, scale):
        t = q.shape[2]
        padded = torch.cat([q, q[:, :, -1:].detach().expand(-1, -1, 4, -1)], 2)
        full = sdpa(padded, k, v, causal=causal, scale=scale)
        extra = (full[:, :, t:] - full[:, :, t:].detach()).sum(2, keepdim=True)
        return torch.cat([full[:, :, :t - 1], full[:, :, t - 1:t] + extra], 2)
    rows = runner.run_case(targets.resolve(clamped_padding_rows), Case(1, 2, 45, 77, 16, False), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dk", "dv"} and {d.id for d in said.values()} == {"rows-weighted"}, \
        {n: d.sentence for n, d in said.items()}
    assert "query row 44 counted 5 times in dk and dv, every other row once" in said["dk"].sentence


def test_an_lse_off_by_one_constant_is_named_with_the_constant():
    def lse_with_its_offset(q, k, v, *, causal, scale):      # a base-2 kernel's exp2(S - m + 8), 8 kept
        out, lse = attend(q, k, v, causal=causal, scale=scale)
        return out, lse + 8 * math.log(2)
    report = parity_tests.check(lse_with_its_offset, features=["lse"], tokens=["45x77"], **ONE)
    assert {r.tensor for r in report.failures} == {"lse"}, str(report)
    assert report.diagnosis == "lse-offset", [d.sentence for _, d in report.diagnoses]
    assert "lse off by one constant, 5.54518 (8 ln 2)" in report.failures[0].diagnosis.sentence


class _GradientMapped(torch.autograd.Function):
    """An input as it is; its gradient passed through ``mapped`` (a kernel writing it back wrong)."""
    @staticmethod
    def forward(ctx, x, mapped):
        ctx.mapped = mapped
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.mapped(g), None


def _read_back_shifted(g):
    """dq read back as from a padded accumulator with the wrong row stride: head h's rows from 2h
    rows earlier, its first 2h rows 0."""
    out = torch.zeros_like(g)
    for h in range(g.shape[1]):
        out[:, h, 2 * h:] = g[:, h, :g.shape[2] - 2 * h]
    return out


def test_gradient_rows_read_back_from_other_places_are_named_with_the_shift():
    def shifted_dq(q, k, v, *, causal, scale):
        return attend(_GradientMapped.apply(q, _read_back_shifted), k, v, causal=causal, scale=scale)[0]
    rows = runner.run_case(targets.resolve(shifted_dq), Case(1, 3, 45, 77, 16, True, ()), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq"} and said["dq"].id == "rows-moved", {n: d.sentence for n, d in said.items()}
    assert "(batch 0, head 1) holds (batch 0, head 1)'s rows, 2 earlier; (batch 0, head 2) holds (batch 0, head 2)'s " \
           "rows, 4 earlier); 6 more left 0 (read from padding)" in said["dq"].sentence, said["dq"].sentence


@pytest.mark.parametrize("tile, said", one_in(2, [
    (None, "dk = scale · dS Q instead of scale · dSᵀ Q: the transpose of dS left out"),
    (32, "dk = scale · dS Q on each 32 x 32 tile instead of scale · dSᵀ Q")]))
def test_a_gradient_formed_with_a_transpose_left_out_is_named_with_the_product(tile, said):
    dk_untransposed = _by_hand(dk_tile=tile or 64)                     # 64: Tq, the whole product
    rows = runner.run_case(targets.resolve(dk_untransposed), Case(1, 2, 64, 64, 16, True), "float32", "cpu",
                           wanted=())
    found = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(found) == {"dk"} and found["dk"].id == "backward-product", \
        {n: d.sentence for n, d in found.items()}
    assert said in found["dk"].sentence, found["dk"].sentence


@pytest.mark.slow                     # every case of a run: 3 s (the one-case twin below stays)
def test_a_descale_read_from_another_batch_entry_is_named_with_the_slices():
    from parity_tests.kernels.planted import fp8 as planted

    def batch_0s_k_descale(q, k, v, *, causal, scale, k_descale, v_descale):
        return planted.kv_kernel()(q, k, v, causal=causal, scale=scale, k_descale=k_descale[:1].expand_as(k_descale),
                                   v_descale=v_descale)
    report = parity_tests.check(batch_0s_k_descale, features=["fp8_kv", "gqa"], tokens=["45x77"], causal="yes",
                                dtypes=["bfloat16"], head_dims=[32], batch=[2])
    found = _failing(report)
    assert report.diagnosis == "slice-values" and {t for _, t in found} == {"out"}
    wide = [d.sentence for (case, _), d in found.items() if case.endswith(" wide")]     # its slices 2^6 apart
    assert len(wide) == 2 and all("k_descale read from another slice: (batch 1, kv head 0) given (batch 0, kv head "
                                  "0)'s (the other slices right)" in s for s in wide), wide


def test_descales_read_together_from_another_batch_entry_are_named_together():
    from parity_tests.kernels.planted import fp8 as planted

    def sequences_reordered(q, k, v, *, causal, scale, k_descale, v_descale):   # descales left in the old order
        flip = lambda x: x.flip(0)
        return planted.kv_kernel()(q, k, v, causal=causal, scale=scale, k_descale=flip(k_descale),
                                   v_descale=flip(v_descale))
    case = Case(2, 2, 45, 77, 32, True, (("gqa", 2), ("fp8_kv", ("wide", 1.0))))
    rows = runner.run_case(targets.resolve(sequences_reordered), replace(case, heads=4), "bfloat16", "cpu",
                           wanted=("fp8_kv",))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"out"} and said["out"].id == "slice-values", {n: d.sentence for n, d in said.items()}
    assert "k_descale and v_descale read from another slice: (batch 0, kv head 0) given (batch 1, kv head 0)'s" \
        in said["out"].sentence, said["out"].sentence


def test_a_slope_read_from_another_head_is_named_with_the_heads():
    def heads_1_and_3_swapped(q, k, v, *, causal, scale, alibi_slopes):
        return attend(q, k, v, causal=causal, scale=scale, alibi_slopes=alibi_slopes[[0, 3, 2, 1]])[0]
    rows = runner.run_case(targets.resolve(heads_1_and_3_swapped), Case(1, 4, 45, 77, 16, True, (("alibi", True),)),
                           "float32", "cpu", wanted=("alibi",))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"out", "dq", "dk", "dv"}, {n: d.sentence for n, d in said.items()}
    # the gradients too: a backward that reads the same slope as its forward
    assert {d.id for d in said.values()} == {"slice-values"}, {n: d.sentence for n, d in said.items()}
    assert "alibi_slopes read from another slice: head 1 given head 3's; head 3 given head 1's (the other slices " \
        "right)" in said["out"].sentence, said["out"].sentence


def test_slopes_read_with_a_batch_stride_of_one_are_named_with_the_load_past_the_table():
    def batch_stride_one(q, k, v, *, causal, scale, alibi_slopes):     # (batch b, head h) reads slopes[b + h], 0 past
        h = q.shape[1]
        padded = torch.cat([alibi_slopes, torch.zeros(h, dtype=alibi_slopes.dtype)])
        return torch.cat([attend(q[n:n + 1], k[n:n + 1], v[n:n + 1], causal=causal, scale=scale,
                                 alibi_slopes=padded[n:n + h])[0] for n in range(q.shape[0])])
    rows = runner.run_case(targets.resolve(batch_stride_one), Case(2, 4, 45, 77, 16, True, (("alibi", True),)),
                           "float32", "cpu", wanted=("alibi",))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"out", "dq", "dk", "dv"} and {d.id for d in said.values()} == {"slice-values"}, \
        {n: d.sentence for n, d in said.items()}
    assert "alibi_slopes read from another slice: head 0 given head 1's; head 1 given head 2's; head 2 given head " \
        "3's; head 3 given 0 (a load past the table's end) (the other slices right)" in said["out"].sentence, \
        said["out"].sentence
    assert "only batch entries 1 of 2" in said["out"].sentence


def test_slopes_all_but_absent_on_some_heads_are_not_said_read_from_another():
    def shrunk(q, k, v, *, causal, scale, alibi_slopes):          # a factor meant for other units: 1e-3
        return attend(q, k, v, causal=causal, scale=scale, alibi_slopes=alibi_slopes * 1e-3)[0]
    rows = runner.run_case(targets.resolve(shrunk), Case(1, 4, 45, 77, 16, True, (("alibi", True),)), "bfloat16",
                           "cpu", wanted=("alibi",))                 # (float32 tells 1e-3 from 0)
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id == "slice-values", out.diagnosis.sentence
    assert "alibi_slopes taken as 0 on head 0, head 1" in out.diagnosis.sentence and \
        "given" not in out.diagnosis.sentence, out.diagnosis.sentence


def test_slopes_read_by_a_grid_decoded_the_wrong_way_are_named_per_batch_entry_and_head():
    def grid_over_batch(q, k, v, *, causal, scale, alibi_slopes):   # program b H + h reads slopes[(b H + h) // B]
        b, h = q.shape[:2]
        per = torch.stack([alibi_slopes[torch.arange(n * h, (n + 1) * h) // b] for n in range(b)])
        outs = [attend(q[n:n + 1], k[n:n + 1], v[n:n + 1], causal=causal, scale=scale, alibi_slopes=per[n])
                for n in range(b)]
        return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])
    rows = runner.run_case(targets.resolve(grid_over_batch), Case(2, 4, 45, 77, 16, True, (("alibi", True),)),
                           "float32", "cpu", wanted=("alibi", "lse"))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert said["out"].id == said["lse"].id == "slice-values", {n: d.sentence for n, d in said.items()}
    assert "alibi_slopes read from another slice: (batch 0, head 1) given head 0's; (batch 0, head 2) given head " \
        "1's; (batch 0, head 3) given head 1's; (batch 1, head 0) given head 2's; (batch 1, head 1) given head 2's; " \
        "(batch 1, head 2) given head 3's (the other slices right)" in said["out"].sentence, said["out"].sentence


def test_a_sink_counted_once_per_split_or_skipped_past_the_first_tile_is_named_with_the_count():
    def sink_per_split(q, k, v, *, causal, scale, sinks):      # two splits, each starting from the sink
        return attend(q, k, v, causal=causal, scale=scale, sinks=sinks + math.log(2))[0]

    def sink_in_tile_0(q, k, v, *, causal, scale, sinks, window):   # rows whose window starts past key 32: none
        first = torch.arange(q.shape[2]) - window[0]
        with_sink = attend(q, k, v, causal=causal, scale=scale, sinks=sinks, window=window)[0]
        without = attend(q, k, v, causal=causal, scale=scale, window=window)[0]
        return torch.where((first >= 32)[:, None], without, with_sink)
    said = {}
    for fn, case in ((sink_per_split, Case(1, 4, 77, 77, 16, True, (("sinks", "large"),))),
                     (sink_in_tile_0, Case(1, 4, 77, 77, 16, True, (("sinks", "large"), ("window", (17, 0)))))):
        rows = runner.run_case(targets.resolve(fn), case, "float32", "cpu", wanted=("sinks", "window"))
        said[fn.__name__] = next(r.diagnosis for r in rows if r.tensor == "out")
    assert {d.id for d in said.values()} == {"sink-counted"}, {n: d.sentence for n, d in said.items()}
    assert "the sink's weight counted twice in every row's denominator instead of once" in \
        said["sink_per_split"].sentence
    assert "the sink's weight counted not at all on query rows 49 .. 76 of 77 in their denominators, once on the " \
        "other rows" in said["sink_in_tile_0"].sentence, said["sink_in_tile_0"].sentence


def test_of_the_slices_whose_value_reproduces_a_slice_the_nearest_is_named(monkeypatch):
    """Slice (batch 1, kv head 0) reproduced by the descales of (0, 0) and of (0, 1) alike (within
    the bound, (0, 1) a little closer): the one fewer indices apart, (0, 0), is named."""
    from types import SimpleNamespace
    gold = np.zeros((2, 2, 3, 4))
    got = gold.copy()
    got[1, 0] = 1.0                                            # slice (1, 0) off
    near, far = got.copy(), got.copy()
    far[1, 0] += 1e-8                                          # (0, 0)'s value: a residual of 1e-8
    preds = {(0, 0): far, (0, 1): near, (1, 0): gold, (1, 1): gold}     # (0, 1)'s: none
    calls = iter(preds.values())
    monkeypatch.setattr(diagnose, "_dense_forward", lambda sub, changes=None, inputs=None: (next(calls), None))
    monkeypatch.setattr(diagnose, "stored_inputs", lambda case: {"k": SimpleNamespace(scale="k_descale")})
    sub = SimpleNamespace(case=SimpleNamespace(batch=2, heads=2, hkv=2, tq=3, tk=3), arrays={"out": got},
                          rounded={"k": np.ones((2, 2, 3, 4)), "k_descale": np.ones((2, 2))}, opts={}, rows=None,
                          gold={"out": gold}, den={"out": 1.0}, bounds={"out": 1e-6})
    (hyp,) = diagnose._values_from_other_slices(sub)
    assert "k_descale read from another slice: (batch 1, kv head 0) given (batch 0, kv head 0)'s" in hyp.says, hyp.says


def test_a_gradient_off_only_where_the_reference_is_exactly_zero_is_said_so_with_why():
    def delta_not_cancelling(q, k, v, *, causal, scale):      # dS = dP - D off by D's rounding on one-key rows
        return sdpa(with_backward(q, lambda g: g + 1e-3 * k.detach().sum(-2, keepdim=True)), k, v,
                    causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(delta_not_cancelling), Case(1, 2, 1, 1, 16, True), "float32", "cpu",
                           wanted=())
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq"} and said["dq"].id == "none", {n: d.sentence for n, d in said.items()}
    assert "only where the reference is exactly 0 (32 entries), on rows that see a single key: dS = P (dP - D) " \
        "is 0 there (P = 1, dP = D) unless dP and D = rowsum(dO ∘ O) are formed in precisions that do not cancel" \
        in said["dq"].sentence, said["dq"].sentence

    def unseen_keys_written(q, k, v, *, causal, scale):        # keys 17 .. 44 no query sees: dk 0 there
        return sdpa(q, with_backward(k, lambda g: g + 1e-3 * (torch.arange(k.shape[2]) >= 17)[:, None]), v,
                    causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(unseen_keys_written), Case(1, 2, 17, 45, 16, True), "float32", "cpu",
                           wanted=())
    said = {r.tensor: r.diagnosis.sentence for r in rows if not r.passed}
    assert set(said) == {"dk"} and "only where the reference is exactly 0 (896 entries);" in said["dk"], said

    def keyless_rows_written(q, k, v, *, causal, scale, align):   # rows 0 .. 31 see no key: dq 0 there
        q = with_backward(q, lambda g: g + 1e-3 * (torch.arange(q.shape[2]) < 32)[:, None])
        return attend(q, k, v, causal=causal, scale=scale, align=align)[0]
    rows = runner.run_case(targets.resolve(keyless_rows_written), Case(1, 2, 77, 45, 16, True, (), "bottom-right"),
                           "float32", "cpu", wanted=())
    said = {r.tensor: r.diagnosis.sentence for r in rows if not r.passed}
    assert set(said) == {"dq"} and "only where the reference is exactly 0 (1024 entries);" in said["dq"], said


def test_scores_shrunk_to_about_zero_are_read_as_flat_weights_not_as_a_mistake_they_resemble():
    def scale_by_integer_division(q, k, v, *, causal, scale):         # 1 // sqrt(D) = 0
        return attend(q, k, v, causal=causal, scale=1 // math.sqrt(q.shape[-1]))[0]
    report = parity_tests.check(scale_by_integer_division, tokens=["45x77"], causal="both", **ONE)
    assert report.failures and report.diagnosis == "scores-flat", str(report)
    assert {r.diagnosis.id for r in report.failures if r.tensor in ("out", "dv")} == {"scores-flat"}, str(report)
    assert "weights flat over the keys each row sees" in report.failures[0].diagnosis.sentence


def test_what_sets_the_failing_cases_apart_is_said():
    def flat_with_softcap(q, k, v, *, causal, scale, softcap=None):
        s = 1 // math.sqrt(q.shape[-1]) if softcap else scale       # wrong only where a cap is given
        return attend(q, k, v, causal=causal, scale=s, softcap=softcap)[0]
    report = parity_tests.check(flat_with_softcap, features=["softcap"], tokens=["45x77"], causal="yes", **ONE)
    apart = report.failing_apart()
    assert apart.startswith("exactly those with softcap (") and "every other passes" in apart, apart
    assert f"  the failing cases: {apart}" in report.diagnosis_lines()
    assert parity_tests.check(sdpa, tokens=["45x77"], **ONE).failing_apart() == ""     # nothing fails

    def flat_unless_causal(q, k, v, *, causal, scale):
        return attend(q, k, v, causal=causal, scale=scale if causal else 1 // math.sqrt(q.shape[-1]))[0]
    apart = parity_tests.check(flat_unless_causal, tokens=["45x77"], causal="both", **ONE).failing_apart()
    assert apart.startswith("exactly those not causal ("), apart


def _tiles_skipped(every, skipped, tile=16):
    """SDPA with the work tiles (batch, head, query tile of ``tile``, the tile fastest) whose index
    mod ``every`` is in ``skipped`` left 0: a persistent grid running fewer programs than its stride."""
    def kernel(q, k, v, *, causal, scale):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        m = -(-q.shape[2] // tile)
        keep = torch.ones(q.shape[0] * q.shape[1] * m, dtype=torch.bool)
        keep[[i for i in range(keep.numel()) if i % every in skipped]] = False
        rows = keep.reshape(q.shape[0], q.shape[1], m).repeat_interleave(tile, -1)[..., :q.shape[2]]
        return out * rows[..., None]
    return kernel


@moved
def test_query_tiles_never_written_are_named_with_their_work_indices():
    report = parity_tests.check(_tiles_skipped(8, (4, 5, 6, 7)), tokens=["100"], dtypes=["float32"],
                                head_dims=[16], heads=[3], batch=[2])
    outs = [r for r in report.failures if r.tensor == "out"]
    assert outs and {r.diagnosis.id for r in outs} == {"tiles-unwritten"}, str(report)
    assert "query tiles of 16 left exactly 0" in outs[0].diagnosis.sentence, outs[0].diagnosis.sentence
    assert "every one whose index mod 8 is 4 .. 7" in outs[0].diagnosis.sentence, outs[0].diagnosis.sentence
    assert report.diagnosis == "tiles-unwritten", str(report)
    # a blank tile beside another wrong row is not read so
    def also_row_0_off(q, k, v, *, causal, scale):
        out = _tiles_skipped(8, (4, 5, 6, 7))(q, k, v, causal=causal, scale=scale)
        return torch.cat([out[:, :, :1] * 1.5, out[:, :, 1:]], dim=2)
    report = parity_tests.check(also_row_0_off, tokens=["100"], dtypes=["float32"], head_dims=[16], heads=[3],
                                batch=[2])
    outs = [r for r in report.failures if r.tensor == "out"]
    assert outs and "tiles-unwritten" not in {r.diagnosis.id for r in outs}, str(report)
    # nor a packed batch's first sequence left 0: its rows, padded to the longest, fill no tile of their own
    def first_sequence_blank(q, k, v, *, causal, scale, cu_seqlens_q, **kw):
        out = _packed(lambda b, cq, ck, mq, mk: own_offset(b, cq, ck))(q, k, v, causal=causal, scale=scale,
                                                                       cu_seqlens_q=cu_seqlens_q, **kw)
        return torch.cat([0 * out[:int(cu_seqlens_q[1])], out[int(cu_seqlens_q[1]):]])
    case = Case(3, 2, 40, 50, 16, True, (("varlen", ((20, 40, 33), (20, 50, 41))),), align="bottom-right")
    rows = runner.run_case(targets.resolve(first_sequence_blank), case, "float32", "cpu", wanted=("varlen",))
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id != "tiles-unwritten", out.diagnosis.sentence


def test_a_backward_loading_v_with_the_query_length_is_named_with_the_rows_it_lost():
    rows = runner.run_case(targets.resolve(_by_hand(dk_v_rows="Tq")), Case(1, 2, 45, 77, 16, False, ()), "float32",
                           "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dk"} and said["dk"].id == "rows-read-as-zero", {n: d.sentence for n, d in said.items()}
    assert "reading V's rows 45 .. 76 as 0 (a load masked at the other length Tq = 45, where Tk = 77 is meant)" in \
        said["dk"].sentence, said["dk"].sentence


def test_a_forward_loading_k_and_v_with_the_query_length_is_named_so():
    def loads_bounded_by_tq(q, k, v, *, causal, scale):
        seen = (torch.arange(k.shape[2]) < q.shape[2])[:, None]
        return sdpa(q, k * seen, v * seen, causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(loads_bounded_by_tq), Case(1, 2, 45, 77, 16, False, ()), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert said.get("out") is not None and said["out"].id == "keys-read-as-zero-at-tq", \
        {n: d.sentence for n, d in said.items()}


def _blocks_masked(change, tile=32):
    """Causal SDPA (bottom-right) whose block mask is the right one with ``change(mask, tile)`` applied."""
    def kernel(q, k, v, *, causal, scale, align="bottom-right"):
        tq, tk = q.shape[2], k.shape[2]
        offset = tk - tq if align == "bottom-right" else 0
        seen = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + offset if causal else \
            torch.ones(tq, tk, dtype=torch.bool)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=change(seen.clone(), tile),
                                                                scale=scale)
    return kernel


def _stale_tile_mask(seen, t):             # block (0, 1) given block (0, 0)'s mask: a mask cached by tile shape
    seen[:t, t:2 * t] = seen[:t, :t]
    return seen


def _diagonal_unmasked(seen, t):           # block (1, 1) on the diagonal taken for a full one
    seen[t:2 * t, t:2 * t] = True
    return seen


@pytest.mark.parametrize("change, said", [(_stale_tile_mask, "(0, 1): the mask of block (0, 0)"),
                                          (_diagonal_unmasked, "(1, 1): every key seen (its mask dropped)")])
def test_blocks_masked_otherwise_are_named_with_the_blocks(change, said):
    rows = runner.run_case(targets.resolve(_blocks_masked(change)), Case(1, 2, 61, 83, 16, True, ()), "float32", "cpu",
                           align="bottom-right")
    found = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert found.get("out") is not None and found["out"].id == "tile-masks", {n: d.sentence for n, d in found.items()}
    assert f"blocks of 32 masked otherwise than their own (1 of 6: {said})" in found["out"].sentence, \
        found["out"].sentence
    assert {d.id for d in found.values()} == {"tile-masks"}, {n: d.sentence for n, d in found.items()}


@moved
def test_a_sink_added_without_the_row_maximum_is_named_so():
    def sink_unshifted(q, k, v, *, causal, scale, sinks):
        S = (q.double() @ k.double().transpose(-1, -2)) * scale
        if causal:
            S = S.masked_fill(torch.ones_like(S, dtype=torch.bool).triu(1), -math.inf)
        m = S.amax(-1, keepdim=True)
        e = torch.exp(S - m)
        l = e.sum(-1, keepdim=True) + torch.exp(sinks.double())[None, :, None, None]   # exp(sink - m) is meant
        return ((e @ v.double()) / l).to(q.dtype)
    report = parity_tests.check(sink_unshifted, features=["sinks"], tokens=["45x77"], causal="yes", **ONE)
    said = {d.id for r, d in report.diagnoses if r.tensor == "out"}
    assert said == {"sink-unshifted"}, [d.sentence for _, d in report.diagnoses]
    assert report.diagnosis == "sink-unshifted", str(report)


def _sink_logit_as(sink_logit):
    """An attention with sinks whose sink enters each row's sum as exp(sink_logit(sinks, softcap) - m)."""
    def kernel(q, k, v, *, causal, scale, sinks, softcap=None):
        S = (q.double() @ k.double().transpose(-1, -2)) * scale
        if softcap is not None:
            S = softcap * torch.tanh(S / softcap)
        if causal:
            S = S.masked_fill(torch.ones_like(S, dtype=torch.bool).triu(1), -math.inf)
        m = torch.maximum(S.amax(-1, keepdim=True), sinks.double()[None, :, None, None])
        e = torch.exp(S - m)
        l = e.sum(-1, keepdim=True) + torch.exp(sink_logit(sinks.double(), softcap)[None, :, None, None] - m)
        return ((e @ v.double()) / l).to(q.dtype)
    return kernel


@moved
def test_a_sinks_weight_off_by_a_factor_per_head_is_named_with_its_cause():
    offset_left_out = _sink_logit_as(lambda s, cap: s - 8 * math.log(2))     # FA3's max offset, in the keys' only
    report = parity_tests.check(offset_left_out, features=["sinks"], tokens=["45x77"], causal="yes", **ONE)
    out = {d.sentence for r, d in report.diagnoses if r.tensor == "out" and d.id == "sink-weighed"}
    assert report.diagnosis == "sink-weighed" and out, [d.sentence for _, d in report.diagnoses]
    assert all("multiplied by a factor of its head, 2^-8 on every head: an exp2 offset of 8 (log2 units) left out "
               "of the sink's term alone" in said for said in out), out


@moved                      # softcap's cases and sinks': 2 s
def test_a_sink_capped_as_the_scores_are_is_named_with_the_cap():
    capped_too = _sink_logit_as(lambda s, cap: cap * torch.tanh(s / cap))
    report = parity_tests.check(capped_too, features=["softcap", "sinks"], tokens=["45x77"], causal="yes", **ONE)
    out = {d.sentence for r, d in report.diagnoses if r.tensor == "out"}
    assert report.diagnosis == "sink-weighed", [d.sentence for _, d in report.diagnoses]
    assert any("by head: the sink's logit capped as the scores are, c tanh(sink / c) with c the case's softcap = "
               in said for said in out), out


def test_key_tiles_weighed_against_another_maximum_are_named_with_their_factors():
    def lazy_rescale(q, k, v, *, causal, scale, tile=32, threshold=8.0):
        """A lazy online softmax: acc and l rescaled only when the maximum moves by more than the
        threshold, each tile's weights taken against the new maximum all the same."""
        S = (q.double() @ k.double().transpose(-1, -2)) * scale
        m_use = torch.full(S.shape[:-1] + (1,), -math.inf, dtype=S.dtype)
        acc, l = torch.zeros(S.shape[:-1] + (v.shape[-1],), dtype=S.dtype), torch.zeros_like(m_use)
        for t in range(0, S.shape[-1], tile):
            St = S[..., t:t + tile]
            m_new = torch.maximum(m_use, St.amax(-1, keepdim=True))
            moved = (m_new - m_use > threshold) | torch.isinf(m_use)
            alpha = torch.where(moved, torch.exp(m_use - m_new), torch.ones_like(m_use))
            acc, l, m_use = acc * alpha, l * alpha, torch.where(moved, m_new, m_use)
            p = torch.exp(St - m_new)                                   # m_use is meant
            acc, l = acc + p @ v.double()[..., t:t + tile, :], l + p.sum(-1, keepdim=True)
        return (acc / l).to(q.dtype)
    rows = runner.run_case(targets.resolve(lazy_rescale), Case(1, 2, 45, 77, 16, False, ()), "float32", "cpu")
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id == "tiles-weighted", out.diagnosis.sentence
    assert "each row's key tiles of 32 mixed with other weights than their softmax mass" in out.diagnosis.sentence


def _lazy_lse(lse_max, offset=0.0, tile=32, threshold=8.0):
    """An online softmax that moves its reference maximum only when the running one rises past it by
    more than ``threshold`` log2 units (FlashAttention-4's conditional rescale), out right, returning
    (out, lse) with lse formed against ``lse_max`` ("running" or "reference", the right one) + ``offset``."""
    def attention(q, k, v, *, causal, scale):
        S = (q.double() @ k.double().transpose(-1, -2)) * scale
        if causal:
            S = S.masked_fill(torch.ones_like(S, dtype=torch.bool).triu(1), -math.inf)
        m_run = m_ref = torch.full(S.shape[:-1] + (1,), -math.inf, dtype=S.dtype)
        acc, l = torch.zeros(S.shape[:-1] + (v.shape[-1],), dtype=S.dtype), torch.zeros_like(m_run)
        for t in range(0, S.shape[-1], tile):
            St = S[..., t:t + tile]
            m_run = torch.maximum(m_run, St.amax(-1, keepdim=True))
            moved = torch.isinf(m_ref) | (m_run - m_ref > threshold * math.log(2))
            alpha = torch.where(moved, torch.exp(m_ref - m_run).nan_to_num(0.0), torch.ones_like(m_ref))
            acc, l, m_ref = acc * alpha, l * alpha, torch.where(moved, m_run, m_ref)
            p = torch.exp(St - m_ref)
            acc, l = acc + p @ v.double()[..., t:t + tile, :], l + p.sum(-1, keepdim=True)
        lse = (m_run if lse_max == "running" else m_ref) + torch.log(l) + offset
        return (acc / l).to(q.dtype), lse[..., 0].float()
    return attention


def test_an_lse_formed_with_the_running_maximum_of_a_conditional_rescale_is_named_with_its_tiles():
    report = parity_tests.check(_lazy_lse("running"), features=["lse"], tokens=["45x77"], causal="yes",
                                forward_only=True, **ONE)
    lse = [d.sentence for r, d in report.diagnoses if r.tensor == "lse"]
    assert report.diagnosis == "lse-stale-max" and lse, [d.sentence for _, d in report.diagnoses]
    assert all("lse formed with the row's running maximum while the sum l was taken against an older one (key tiles "
               "of 32, visited from the first" in said for said in lse), lse
    # nor with out wrong too: the reading holds only where acc / l cancels the stale maximum
    def out_wrong_too(q, k, v, *, causal, scale):
        out, lse = _lazy_lse("running")(q, k, v, causal=causal, scale=scale)
        return out * 1.01, lse
    report = parity_tests.check(out_wrong_too, features=["lse"], tokens=["45x77"], causal="yes", forward_only=True,
                                **ONE)
    assert "lse-stale-max" not in {d.id for _, d in report.diagnoses}, str(report)
    # the right lse off by one constant is not that: each row's amount is the rise of its own maximum
    report = parity_tests.check(_lazy_lse("reference", offset=0.5), features=["lse"], tokens=["45x77"],
                                causal="yes", forward_only=True, **ONE)
    assert report.failures and report.diagnosis not in (None, "lse-stale-max"), str(report)


def test_dv_taken_before_the_mask_inside_the_diagonal_blocks_is_named_with_its_tiles():
    def dv_update_above_the_masking(q, k, v, *, causal, scale, bm=16, bn=32):
        """dV += Pᵀ dO with P = exp(S − lse) before the causal mask is applied, in each (query tile,
        key tile) block the pass visits (those holding a visible pair); dk and dq from the masked P."""
        out = sdpa(q, k, v, causal=causal, scale=scale)
        s = (q @ k.transpose(-1, -2)).detach() * scale
        i, j = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None, :]
        lse = torch.logsumexp(s.masked_fill(j > i, float("-inf")), -1, keepdim=True)
        visited = (j // bn * bn) <= (i // bm * bm + bm - 1)                   # the block holds a key some row sees
        extra = torch.exp(s - lse).masked_fill(~visited | (j <= i), 0.0) @ v
        return out + extra - extra.detach()                    # out as it is; dv takes the hidden pairs too
    rows = runner.run_case(targets.resolve(dv_update_above_the_masking), Case(1, 2, 45, 77, 16, True, ()), "float32",
                           "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dv"} and said["dv"].id == "blocks-unmasked", {n: d.sentence for n, d in said.items()}
    assert "dv formed from P = exp(S − lse) without its mask inside the blocks that need one (query tiles of 32, " \
        "key tiles of 32; 16 x 32 give the same blocks here: the causal diagonal, a window's edge), every other " \
        "gradient right" in said["dv"].sentence, said["dv"].sentence
    assert "16 x 16" not in said["dv"].sentence                      # key tiles of 16 hide other pairs


@moved
def test_alibi_distances_from_packed_positions_are_named_as_an_offset_of_alibi():
    def packed_alibi(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     alibi_slopes):
        outs = []
        for b in range(len(cu_seqlens_q) - 1):
            cq, ck = (int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])), (int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
            qs, ks, vs = q[cq[0]:cq[1]].transpose(0, 1), k[ck[0]:ck[1]].transpose(0, 1), v[ck[0]:ck[1]].transpose(0, 1)
            i, j = torch.arange(*cq)[:, None], torch.arange(*ck)[None, :]       # positions in the packed tensors
            S = qs @ ks.transpose(-1, -2) * scale - alibi_slopes[:, None, None] * (i - j).abs()
            outs.append(torch.softmax(S, -1).nan_to_num(0.0) @ vs)
        return torch.cat([o.transpose(0, 1) for o in outs])
    report = parity_tests.check(packed_alibi, features=["varlen", "alibi"], causal="no", **ONE)
    outs = [d for r, d in report.diagnoses if r.tensor == "out" and d.id == "sequence-offsets"]
    assert outs, str(report)
    assert all("give (ALiBi's distance |i + offset - j|): sequence" in d.sentence for d in outs), outs[0].sentence


class _KeyBiasSummedAcross(torch.autograd.Function):
    """Attention with an additive bias whose (B, 1, 1, Tk) gradient is reduced, in each 32 x 32 tile
    of dSᵀ, over the tile's keys where its query rows are meant; every other gradient right."""
    @staticmethod
    def forward(ctx, q, k, v, bias, scale, causal):
        ctx.save_for_backward(q, k, v, bias)
        ctx.opts = scale, causal
        return _KeyBiasSummedAcross.plain(q, k, v, bias, scale, causal)

    @staticmethod
    def plain(q, k, v, bias, scale, causal):
        S = q @ k.transpose(-1, -2) * scale + bias
        if causal:
            S = S.masked_fill(torch.ones_like(S, dtype=torch.bool).triu(1), -math.inf)
        return torch.softmax(S, -1) @ v

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias = ctx.saved_tensors
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)] + \
                [bias.detach().expand(shape).clone().requires_grad_()]
            dq, dk, dv, dS = torch.autograd.grad(_KeyBiasSummedAcross.plain(*leaves, *ctx.opts), leaves, dout)
        if bias.dim() == 4 and bias.shape[1] == bias.shape[2] == 1:
            t, (tq, tk) = 32, shape[2:]
            nq, nk = -(-tq // t), -(-tk // t)
            tiles = torch.nn.functional.pad(dS, (0, nk * t - tk, 0, nq * t - tq)).reshape(*shape[:2], nq, t, nk, t)
            dS = tiles.transpose(3, 5).reshape(*shape[:2], nq * t, nk * t)[..., :tk]
        dims = [d for d in range(4) if bias.dim() < 4 and d < 2 or bias.dim() == 4 and bias.shape[d] == 1]
        dbias = dS.sum(dim=dims, keepdim=True) if dims else dS           # (sum over no dim sums over all)
        return dq, dk, dv, dbias.reshape(bias.shape), None, None


def test_a_key_bias_gradient_summed_across_its_tiles_is_named_with_the_tile():
    def kernel(q, k, v, *, causal, scale, bias=None):
        if bias is None:
            return _KeyBiasSummedAcross.plain(q, k, v, 0.0, scale, causal)
        return _KeyBiasSummedAcross.apply(q, k, v, bias, scale, causal)
    report = parity_tests.check(kernel, features=["bias"], tokens=["45x77"], causal="yes", **ONE)
    said = {(r.case, r.tensor): r.diagnosis for r in report.failures}
    assert said and all("x1x1x" in c and n == "dbias" for c, n in said), list(said)
    assert {d.id for d in said.values()} == {"tiles-summed-across"}, [d.sentence for d in said.values()]
    assert "dbias summed over each 32 x 32 tile's keys where its query rows are meant" in \
        next(iter(said.values())).sentence


def _accumulated_across_tiles(g):
    """Each tile of 32 rows summed with every tile before it (a dQ loop's accumulator zeroed once per
    (batch, head), never per query tile)."""
    b, h, t, d = g.shape
    n = -(-t // 32)
    tiles = torch.nn.functional.pad(g, (0, 0, 0, n * 32 - t)).reshape(b, h, n, 32, d)
    return tiles.cumsum(2).reshape(b, h, n * 32, d)[:, :, :t]


def test_a_gradient_accumulated_across_its_tiles_is_named_with_the_tile():
    def dq_never_reset(q, k, v, *, causal, scale):
        return sdpa(_GradientMapped.apply(q, _accumulated_across_tiles), k, v, causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(dq_never_reset), Case(1, 2, 100, 100, 16, False, ()), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq"} and said["dq"].id == "tiles-accumulated", {n: d.sentence for n, d in said.items()}
    assert "dq's query tiles of 32 each holding the sum of every tile up to it" in said["dq"].sentence, \
        said["dq"].sentence



class _OneSlip(torch.autograd.Function):
    """Attention without a mask in float64, its backward written out (D = rowsum(dO ∘ O), dS = P ∘ (dP
    − D)) with one slip: ``slip(S, lse, P, dO, O)`` -> a dict replacing some of "D" (both passes), "dO_dq"
    (the dO dq's pass reads) and "P_kv" (the P the dK/dV pass recomputes)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, slip):
        S = q.double() @ k.double().transpose(-1, -2) * scale
        ctx.save_for_backward(q, k, v, S)
        ctx.scale, ctx.slip = scale, slip
        return (torch.softmax(S, -1) @ v.double()).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, S = ctx.saved_tensors
        dO, q64, k64, v64 = dout.double(), q.double(), k.double(), v.double()
        lse = S.logsumexp(-1, keepdim=True)
        P = (S - lse).exp()
        O = P @ v64
        parts = {"D": (dO * O).sum(-1, keepdim=True), "dO_dq": dO, "P_kv": P}
        parts.update(ctx.slip(S, lse, P, dO, O))
        dS = lambda p, do: p * (do @ v64.transpose(-1, -2) - parts["D"]) * ctx.scale
        return (dS(P, parts["dO_dq"]) @ k64).to(q.dtype), (dS(parts["P_kv"], dO).transpose(-1, -2) @ q64).to(k.dtype), \
            (parts["P_kv"].transpose(-1, -2) @ dO).to(v.dtype), None, None


def _slip_said(slip, head_dim=16):
    """{tensor: diagnosis} of the failing rows of `_OneSlip` with ``slip`` on B1 H2 T45x77, float32."""
    kernel = lambda q, k, v, *, causal, scale: _OneSlip.apply(q, k, v, scale, slip)
    rows = runner.run_case(targets.resolve(kernel), Case(1, 2, 45, 77, head_dim, False, ()), "float32", "cpu")
    return {r.tensor: r.diagnosis for r in rows if not r.passed}


def _lse_of_tile_zero(S, lse, P, dO, O):
    """The dK/dV pass's P from the lse of row i mod 16, its first query tile's, for every query tile
    (loaded once, before the loop)."""
    return {"P_kv": (S - lse[..., torch.arange(S.shape[-2]) % 16, :]).exp()}


def test_a_dk_dv_pass_taking_its_first_query_tiles_lse_for_every_tile_is_named_so():
    said = _slip_said(_lse_of_tile_zero)
    assert set(said) == {"dk", "dv"}, {n: d.sentence for n, d in said.items()}
    assert {d.id for d in said.values()} == {"rows-rescaled"}, [d.sentence for d in said.values()]
    assert "from an lse of row i mod 16 for every row i: the first query tile's lse kept" in said["dk"].sentence, \
        said["dk"].sentence


def _delta_left_zero_from(first):
    """D never written on query rows ``first`` .. (a preprocess grid of 16-row programs rounded down)."""
    def slip(S, lse, P, dO, O):
        D = (dO * O).sum(-1, keepdim=True)
        D[..., first:, :] = 0
        return {"D": D}
    return slip


def test_a_d_never_written_on_a_tail_of_rows_is_said_with_its_rows_on_packed_sequences():
    def packed(q, k, v, *, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        first = max_seqlen_q // 16 * 16                                 # from the batch's longest sequence
        cut = lambda x, c, b: x[int(c[b]):int(c[b + 1])].transpose(0, 1)[None]
        outs = [_OneSlip.apply(cut(q, cu_seqlens_q, b), cut(k, cu_seqlens_k, b), cut(v, cu_seqlens_k, b), scale,
                               _delta_left_zero_from(first))[0].transpose(0, 1) for b in range(len(cu_seqlens_q) - 1)]
        return torch.cat(outs)
    case = Case(2, 2, 40, 50, 16, False, (("varlen", ((40, 20), (50, 30))),))
    rows = runner.run_case(targets.resolve(packed), case, "float32", "cpu", wanted=("varlen",))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq", "dk"}, {n: d.sentence for n, d in said.items()}
    assert {d.id for d in said.values()} == {"wrong-delta"}, [d.sentence for d in said.values()]
    assert "(D' = 0 on query rows 32 .. 39 of batch entry 0 only: never written there)" in said["dq"].sentence, \
        said["dq"].sentence
    said = _slip_said(_delta_left_zero_from(32))                  # one batch entry: no entry said
    assert "(D' = 0 on query rows 32 .. 44 only: never written there)" in said["dq"].sentence, said["dq"].sentence


def _out_row(kernel, case=Case(1, 2, 100, 100, 16, False, ()), **options):
    """The failing out row of ``kernel`` on ``case`` (B1 H2 T100 D16, not causal), float32."""
    rows = runner.run_case(targets.resolve(kernel), case, "float32", "cpu", **options)
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed
    return out


def _last_tiles_not_flushed(q, k, v, *, causal, scale):
    """An online softmax over key tiles of 16 whose P V goes to a second accumulator, added into the
    first every 4 tiles and not after the loop: each row's last (tiles it visits mod 4) tiles count in
    l alone.  In closed form, float64, forward only."""
    dt, q, k, v = q.dtype, q.double(), k.double(), v.double()
    S = q @ k.transpose(-1, -2) * scale
    i, j = torch.arange(S.shape[-2])[:, None], torch.arange(S.shape[-1])[None, :]
    if causal:
        S = S.masked_fill(j > i, -math.inf)
    visited = (torch.div(i, 16, rounding_mode="floor") + 1) if causal else torch.full_like(i, -(-S.shape[-1] // 16))
    flushed = torch.div(visited, 4, rounding_mode="floor") * 4 * 16
    return ((torch.softmax(S, -1) * (j < flushed)) @ v).to(dt)


def test_key_tiles_counted_in_the_sum_but_left_out_of_the_output_are_named_so():
    out = _out_row(_last_tiles_not_flushed)
    assert out.diagnosis.id == "tiles-left-out", out.diagnosis.sentence
    assert "each row's last key tile of those it sees (tiles of 64) counted in the softmax's sum but left out of " \
           "its output" in out.diagnosis.sentence, out.diagnosis.sentence


def _delta_past_head_dim(S, lse, P, dO, O):
    """D loaded in a head-dim block of 32 for D = 24 without masking the channels past D: each row's
    D = rowsum(dO ∘ O) also sums the next row's (in (batch, head, row) order) first 8 channels."""
    terms = (dO * O).reshape(-1, O.shape[-1])
    read = torch.cat([terms, torch.cat([terms[1:, :8], torch.zeros_like(terms[:1, :8])])], 1)
    return {"D": read.sum(-1).reshape(P.shape[:-1] + (1,))}


def test_a_row_term_read_past_the_head_dim_is_named_with_the_block():
    said = _slip_said(_delta_past_head_dim, head_dim=24)
    assert set(said) == {"dq", "dk"} and {d.id for d in said.values()} == {"wrong-delta"}, \
        {n: d.sentence for n, d in said.items()}
    assert "each row's D also sums the next row's first 8 channels of dO ∘ O, rows in (batch, head, row) order: " \
           "a head-dim block of 32 for D = 24 with its loads unmasked" in said["dq"].sentence, said["dq"].sentence


def _do_read_as_row_major(S, lse, P, dO, O):
    """dq's pass reading dO, (B, H, T, D) in memory, as if it were laid out (B, T, H, D) (another
    tensor's strides); D and the dK/dV pass right."""
    return {"dO_dq": dO.contiguous().reshape(dO.shape[0], dO.shape[2], dO.shape[1], -1).transpose(1, 2)}


def test_a_dq_pass_reading_do_in_another_order_is_named_with_the_order():
    said = _slip_said(_do_read_as_row_major)
    assert set(said) == {"dq"} and said["dq"].id == "dout-read-otherwise", {n: d.sentence for n, d in said.items()}
    assert "dq's pass reading dO in another order: dO of shape (1, 2, 45, 16) reshaped to (1, 45, 2, 16) and its " \
           "axes put back" in said["dq"].sentence, said["dq"].sentence


def test_a_bottom_right_offset_with_its_sign_flipped_is_named():
    from parity_tests.kernels.planted.chapter import offset_sign
    report = parity_tests.check(offset_sign, tokens=["45x77", "77x45"], align="bottom-right", causal="yes", **ONE)
    assert report.diagnosis == "offset-sign", str(report)
    assert {r.tensor for r in report.failures if r.diagnosis.id == "offset-sign"} >= {"out"}, str(report)


def _splits_left_unnormalised(q, k, v, *, causal, scale):
    """Split-K over 3 ranges of 48 keys, each split's accumulator Σ_j e^(S_ij − m_s) v_j stored
    without dividing by its own sum l_s, merged with the weights exp(lse_s − lse) that assume it was."""
    dt, q, k, v = q.dtype, q.double(), k.double(), v.double()
    S = q @ k.transpose(-1, -2) * scale
    parts, lses = [], []
    for j0 in range(0, S.shape[-1], 48):
        s = S[..., j0:j0 + 48]
        m = s.amax(-1, keepdim=True)
        e = (s - m).exp()
        parts.append(e @ v[..., j0:j0 + 48, :])
        lses.append(m + e.sum(-1, keepdim=True).log())
    lse = torch.logsumexp(torch.stack(lses), 0)
    return sum((l - lse).exp() * p for l, p in zip(lses, parts)).to(dt)


def test_key_ranges_weighed_by_factors_of_their_own_are_said_so():
    out = _out_row(_splits_left_unnormalised)
    assert out.diagnosis.id == "tiles-scaled", out.diagnosis.sentence
    assert "each row's key tiles of 16 weighed by factors of their own" in out.diagnosis.sentence, \
        out.diagnosis.sentence


def _lse_across_the_tile(S, lse, P, dO, O):
    """The dK/dV pass, on transposed 16 x 16 tiles (keys x queries), subtracting lse along the keys: key
    j of a tile takes the lse of query row qt·16 + (j mod 16) (+inf past Tq, as a masked load gives)."""
    i, j = torch.arange(S.shape[-2])[:, None], torch.arange(S.shape[-1])[None, :]
    r = i // 16 * 16 + j % 16
    return {"P_kv": (S - torch.where(r < S.shape[-2], lse[..., 0][..., r.clamp(max=S.shape[-2] - 1)], torch.inf)).exp()}


def test_an_lse_subtracted_along_the_wrong_axis_of_a_transposed_tile_is_named_with_the_tile():
    said = _slip_said(_lse_across_the_tile)
    assert set(said) == {"dk", "dv"} and {d.id for d in said.values()} == {"lse-across-tile"}, \
        {n: d.sentence for n, d in said.items()}
    assert "lse subtracted along the keys of its transposed 16 x 16 tile" in said["dv"].sentence, said["dv"].sentence


def _at_kv_head(g):
    """Each query head's dq added into the slot of its kv head (group 2), the rest 0."""
    b, h, t, d = g.shape
    return torch.cat([g.reshape(b, h // 2, 2, t, d).sum(2), torch.zeros_like(g[:, h // 2:])], 1)


def test_dq_written_into_the_kv_heads_slots_is_named_with_the_map():
    def dq_at_kv_head(q, k, v, *, causal, scale):
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        return sdpa(_GradientMapped.apply(q, _at_kv_head), k, v, causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(dq_at_kv_head), Case(1, 4, 45, 77, 16, False, (("gqa", 2),)),
                           "float32", "cpu", wanted=("gqa",))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq"} and said["dq"].id == "dq-head-map", {n: d.sentence for n, d in said.items()}
    assert "head 0 holds heads 0, 1's; head 1 holds heads 2, 3's; heads 2 .. 3 left 0" in said["dq"].sentence, \
        said["dq"].sentence


def test_a_key_range_weighed_negatively_is_not_read_as_tiles_scaled():
    def last_keys_subtracted(q, k, v, *, causal, scale):         # no softmax gives a weight below 0
        P = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, -1)
        return (P @ v.double() - 1.5 * P[..., 64:] @ v.double()[..., 64:, :]).to(q.dtype)
    out = _out_row(last_keys_subtracted)
    assert out.diagnosis.id != "tiles-scaled", out.diagnosis.sentence


def test_one_input_rounded_to_a_narrower_dtype_is_named_with_the_input_and_the_dtype():
    def v_in_bfloat16(q, k, v, *, causal, scale):
        return sdpa(q, k, v.bfloat16().to(v.dtype), causal=causal, scale=scale)

    def dout_in_bfloat16(q, k, v, *, causal, scale):
        return _GradientMapped.apply(sdpa(q, k, v, causal=causal, scale=scale), lambda g: g.bfloat16().to(g.dtype))
    case = Case(1, 2, 45, 77, 16, False, ())
    for kernel, failing, words in ((v_in_bfloat16, {"out", "dq", "dk", "dv"}, "v rounded to bfloat16 (in the kernel)"),
                                   (dout_in_bfloat16, {"dq", "dk", "dv"}, "dO rounded to bfloat16 (in the kernel)")):
        said = {r.tensor: r.diagnosis for r in runner.run_case(targets.resolve(kernel), case, "float32", "cpu")
                if not r.passed}
        assert set(said) == failing, {n: d.sentence for n, d in said.items()}
        said.pop("dv" if kernel is v_in_bfloat16 else None, None)      # v's own gradient: rounded back, unclaimed
        assert {d.id for d in said.values()} == {"input-rounded"}, [d.sentence for d in said.values()]
        assert all(words in d.sentence for d in said.values()), [d.sentence for d in said.values()]


def test_values_read_as_zero_in_key_tile_and_channel_blocks_are_named_with_the_blocks():
    def channel_mask_from_key_offsets(q, k, v, *, causal, scale):      # Vᵀ tile mask: (start + c < Tk), c a channel
        start = torch.arange(k.shape[2]) // 32 * 32
        kept = (start[:, None] + torch.arange(v.shape[-1])[None, :]) < k.shape[2]
        return sdpa(q, k, v * kept, causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(channel_mask_from_key_offsets), Case(1, 2, 45, 77, 64, False, ()),
                           "float32", "cpu")
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id == "values-read-as-zero", out.diagnosis.sentence
    assert "(tiles of 32: keys 32 .. 63, channels 45 .. 63; keys 64 .. 76, channels 13 .. 63): channel c of the " \
        "tile from key s read as 0 where " \
        "s + c >= Tk = 77" in out.diagnosis.sentence, out.diagnosis.sentence


def test_heads_past_the_first_of_each_kv_group_are_said_so():
    def scale_grown_per_group(q, k, v, *, causal, scale):       # `scale *= 2` in the loop over a group's heads
        group = q.shape[1] // k.shape[1]
        grown = torch.tensor([2.0 ** (h % group) for h in range(q.shape[1])])[:, None, None]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return sdpa(q * grown, k, v, causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(scale_grown_per_group), Case(1, 6, 45, 77, 16, False, (("gqa", 2),)),
                           "float32", "cpu", wanted=("gqa",))
    said = [r.diagnosis.sentence for r in rows if not r.passed and r.tensor in ("out", "dq")]   # per query head
    assert len(said) == 2 and all(s.startswith("only query heads past the first of their kv group (heads 1 .. 2, "
                                               "4 .. 5 of 6, groups of 3 sharing a kv head)") for s in said), said

    def first_group_only(q, k, v, *, causal, scale):             # heads 0, 1, 2: a first and two past it
        group = q.shape[1] // k.shape[1]
        grown = torch.tensor([2.0 if h < group else 1.0 for h in range(q.shape[1])])[:, None, None]
        return sdpa(q * grown, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), causal=causal, scale=scale)
    rows = runner.run_case(targets.resolve(first_group_only), Case(1, 6, 45, 77, 16, False, (("gqa", 2),)),
                           "float32", "cpu", wanted=("gqa",))
    said = [r.diagnosis.sentence for r in rows if not r.passed and r.tensor in ("out", "dq")]
    assert said and not any("kv group" in s for s in said), said


def test_alibis_offset_from_the_other_alignment_under_the_right_mask_is_named_so():
    fn, features = wrong_kernel("alibi-other-alignment")              # bottom-right's offset in a top-left run
    rows = runner.run_case(targets.resolve(fn), Case(1, 2, 77, 45, 16, True, (("alibi", True),)), "float32", "cpu",
                           wanted=tuple(features))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert said and {d.id for d in said.values()} == {"alibi-other-alignment"}, [d.sentence for d in said.values()]
    assert "the ALiBi distance with the bottom-right alignment's offset while the mask keeps its own (top-left)" in \
        said["out"].sentence


class _DpWithK(torch.autograd.Function):
    """Attention without a mask in float64, its dQ pass forming dP = dO Kᵀ where dO Vᵀ is meant (the
    operand of S = Q Kᵀ copied); ``one_key``: a window of (0, 0) (each row sees its own key), its
    dq half the term dO Kᵀ alone, along k_i as every one-key row's dq is ("half")."""

    @staticmethod
    def forward(ctx, q, k, v, scale, one_key):
        S = q.double() @ k.double().transpose(-1, -2) * scale
        if one_key:
            S = S.masked_fill(~torch.eye(S.shape[-1], dtype=torch.bool), -math.inf)
        P = torch.softmax(S, -1)
        ctx.save_for_backward(q, k, v, P)
        ctx.scale, ctx.one_key = scale, one_key
        return (P @ v.double()).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, P = (x.double() for x in ctx.saved_tensors)
        dO = dout.double()
        D = (dO * (P @ v)).sum(-1, keepdim=True)
        dS = P * (dO @ v.transpose(-1, -2) - D) * ctx.scale
        dS_q = P * (dO @ k.transpose(-1, -2) - (0 if ctx.one_key == "half" else D)) * ctx.scale / (
            2 if ctx.one_key == "half" else 1)
        return (dS_q @ k).to(q.dtype), (dS.transpose(-1, -2) @ q).to(k.dtype), (P.transpose(-1, -2) @ dO).to(v.dtype), \
            None, None


def test_a_dq_pass_forming_dp_with_k_for_v_is_named_so_and_one_key_rows_fit_no_row_term():
    rows = runner.run_case(targets.resolve(lambda q, k, v, *, causal, scale: _DpWithK.apply(q, k, v, scale, False)),
                           Case(1, 2, 45, 77, 16, False, ()), "float32", "cpu")
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq"} and said["dq"].id == "backward-product", {n: d.sentence for n, d in said.items()}
    assert "dq's pass forming dP = dO K^T instead of dO V^T: K where V is meant" in said["dq"].sentence
    # each row sees one key: dq_i is along k_i whatever dS is, and a D of its own per row would fit any
    def one_key(q, k, v, *, causal, scale, window):
        return _DpWithK.apply(q, k, v, scale, "half")
    rows = runner.run_case(targets.resolve(one_key), Case(1, 2, 45, 45, 16, False, (("window", (0, 0)),)),
                           "float32", "cpu", wanted=("window",))
    said = {r.tensor: r.diagnosis for r in rows if not r.passed}
    assert set(said) == {"dq"} and said["dq"].id == "none", said["dq"].sentence


def test_a_row_term_whose_lse_gradient_is_scaled_is_named_with_the_factor():
    ln2_term = lambda P, dP, dlse: (P * dP).sum(-1, keepdim=True) - math.log(2) * dlse[..., None]
    report = parity_tests.check(_by_hand(returns_lse=True, row_term=ln2_term), features=["lse_grad"],
                                tokens=["45x77"], causal="no", **ONE)
    said = [d for r, d in report.diagnoses if r.tensor in ("dq", "dk")]
    assert said and {d.id for d in said} == {"wrong-delta"}, [d.sentence for d in said]
    assert all("its lse gradient's term multiplied by 0.693147 (ln 2)" in d.sentence for d in said), said[0].sentence


def test_tiles_dropped_before_the_last_that_raised_the_maximum_are_said_so():
    def rescale_to_zero(q, k, v, *, causal, scale):       # alpha = exp2(m_old - m_new) on raw-unit maxima: 0 or 1
        return _base_2_online(q, k, v, causal=causal, scale=scale, rescale=lambda d: (d == 0).double())
    rows = runner.run_case(targets.resolve(rescale_to_zero), Case(1, 2, 45, 77, 16, False, ()), "float32", "cpu")
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.diagnosis.id == "key-tile-ranges", out.diagnosis.sentence
    assert "each row's key tiles before the last one that raised its running maximum dropped" in out.diagnosis.sentence


def test_k_and_v_read_with_their_channels_in_another_order_are_named_with_the_order():
    def lanes_not_put_back(q, k, v, *, causal, scale):     # a widening that leaves [c0, c2, c1, c3] per 4 channels
        order = torch.arange(k.shape[-1]).reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(-1)
        return sdpa(q, k[..., order], v[..., order], causal=causal, scale=scale)
    out = _out_row(lanes_not_put_back, Case(1, 2, 45, 77, 16, False, ()))
    assert out.diagnosis.id == "channels-permuted", out.diagnosis.sentence
    assert "k and v read with the channels of each group of 4 in the order 0, 2, 1, 3" in out.diagnosis.sentence


class _PaddedQueryTile(torch.autograd.Function):
    """Attention (causal: top-left) in float64 whose dK/dV pass walks query tiles of 16, the last one
    filled out past Tq with q = dO = O = 0 and the lse loaded as ``fill``: +inf makes those rows'
    weights vanish (right), -inf makes them exp(+inf) (a slip); "next": q, dO, O and lse read on
    from the next (batch, head) slice's first rows, the last slice's as +inf (a slip)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, fill, causal=True, offset=0):
        seen = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(offset if causal else k.shape[-2])
        S = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~seen, -math.inf)
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.fill, ctx.lse = scale, fill, S.logsumexp(-1, keepdim=True)
        ctx.diagonal = offset if causal else k.shape[-2]
        ctx.out = torch.softmax(S, -1) @ v.double()
        return ctx.out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = (x.double() for x in ctx.saved_tensors)
        tq, pad = q.shape[-2], -q.shape[-2] % 16
        padded = lambda x, lse=False: torch.cat([x, _past_tq(x, pad, ctx.fill, lse)], -2)
        seen = torch.ones(tq + pad, k.shape[-2], dtype=torch.bool).tril(ctx.diagonal)
        S = padded(q) @ k.transpose(-1, -2) * ctx.scale
        P = (S - padded(ctx.lse, lse=True)).exp().masked_fill(~seen, 0.0)
        dO = padded(dout.double())
        dS = P * (dO @ v.transpose(-1, -2) - (dO * padded(ctx.out)).sum(-1, keepdim=True)) * ctx.scale
        return (dS @ k)[..., :tq, :].to(q.dtype), (dS.transpose(-1, -2) @ padded(q)).float(), \
            (P.transpose(-1, -2) @ dO).float(), None, None, None, None


def _past_tq(x, pad, fill, lse):
    """The ``pad`` rows `_PaddedQueryTile` loads past Tq in each slice of ``x`` (B, H, T, n): 0, or
    ``fill`` for the lse; with ``fill`` "next", the next slice's first rows, the last slice's 0 (+inf
    for the lse)."""
    blank = x.new_full(x.shape[:-2] + (pad, x.shape[-1]), fill if lse and fill != "next" else 0.0)
    if fill != "next":
        return blank
    last = blank.flatten(0, 1)[:1].fill_(math.inf if lse else 0.0)
    return torch.cat([x.flatten(0, 1)[1:, :pad], last]).view_as(blank)


@pytest.mark.parametrize("fill", [math.inf, -math.inf])
def test_padding_rows_of_a_last_query_tile_weighed_in_dk_and_dv_are_named_with_their_rows(fill):
    kernel = lambda q, k, v, *, causal, scale: _PaddedQueryTile.apply(q, k, v, scale, fill)
    said = _said(kernel, Case(1, 2, 45, 77, 16, True, ()))
    if fill > 0:                                            # the fixed twin passes
        assert not said, {n: d.sentence for n, d in said.items()}
        return
    assert set(said) == {"dk", "dv"} and {d.id for d in said.values()} == {"padding-rows-seen"}, \
        {n: d.sentence for n, d in said.items()}
    assert "non-finite on keys 0 .. 47 of 77 only, exactly the keys that query rows 45 .. 47 would see: the " \
        "padding rows of the last query tile of 16" in said["dk"].sentence, said["dk"].sentence


def test_padding_rows_seeing_every_key_are_not_told_from_other_nan():
    kernel = lambda q, k, v, *, causal, scale: _PaddedQueryTile.apply(q, k, v, scale, -math.inf, causal)
    said = _said(kernel, Case(1, 2, 45, 77, 16, False, ()))
    assert set(said) == {"dk", "dv"} and {d.id for d in said.values()} == {"non-finite"}, \
        {n: d.sentence for n, d in said.items()}


def test_values_of_the_diagonal_tiles_read_from_the_first_keys_are_named_with_the_tiles():
    def v_not_advanced(q, k, v, *, causal, scale):     # the diagonal stage's V pointer left at key 0, K's advanced
        S = (q @ k.transpose(-1, -2) * scale).masked_fill(torch.ones(77, 77, dtype=torch.bool).triu(1), -math.inf)
        P = torch.softmax(S, -1)
        tiles = [P[..., m:m + 32, :m] @ v[..., :m, :] + P[..., m:m + 32, m:m + 32] @ v[..., :min(32, 77 - m), :]
                 for m in range(0, 77, 32)]
        return torch.cat(tiles, -2)
    out = _out_row(v_not_advanced, Case(1, 2, 77, 77, 16, True, ()))
    assert out.diagnosis.id == "values-from-other-tiles", out.diagnosis.sentence
    assert "V of some key tiles of 32 read from another tile's rows, K's right (query rows 32 .. 63: keys 32 .. 63 " \
        "from 0 .. 31; query rows 64 .. 76: keys 64 .. 76 from 0 .. 12; on each query tile, from the first keys " \
        "on: a pointer left at key 0)" in out.diagnosis.sentence, out.diagnosis.sentence


def test_keys_seen_once_unmasked_and_once_masked_are_named_with_the_keys():
    def context_tile_past_its_end(q, k, v, *, causal, scale):  # the context loop's last tile masked at Tk, not 25
        E = (q @ k.transpose(-1, -2) * scale).double().exp()
        seen = torch.ones(20, 45, dtype=torch.bool).tril(25)              # bottom-right: 25 keys of context
        again = (torch.arange(45) >= 25) & (torch.arange(45) < 32)       # its last tile of 16: keys 25 .. 31
        w = E * seen + E * again
        return ((w @ v.double()) / w.sum(-1, keepdim=True)).to(q.dtype)
    out = _out_row(context_tile_past_its_end, Case(1, 2, 20, 45, 16, True, (), "bottom-right"))
    assert out.diagnosis.id == "keys-weighted", out.diagnosis.sentence
    assert "keys 25 .. 31 counted twice by every query row whatever its mask" in out.diagnosis.sentence, \
        out.diagnosis.sentence


@pytest.mark.parametrize("align", one_in(2, ["top-left", "bottom-right"]))
def test_padding_rows_read_from_the_next_slice_in_the_dk_dv_pass_are_named_so(align):
    offset = 32 if align == "bottom-right" else 0                 # its padding rows see keys up to 79 .. 80
    kernel = lambda q, k, v, *, causal, scale: _PaddedQueryTile.apply(q, k, v, scale, "next", True, offset)
    said = _said(kernel, Case(2, 2, 45, 77, 16, True, (), align))
    assert set(said) == {"dk", "dv"} and {d.id for d in said.values()} == {"padding-rows-from-next-slice"}, \
        {n: d.sentence for n, d in said.items()}
    assert "last query tile of 16 of each (batch, head) slice filled past Tq = 45 with the next slice's first 3 " \
        "rows" in said["dv"].sentence, said["dv"].sentence


def test_an_output_stored_in_a_narrower_dtype_is_named_with_the_dtype():
    def stored_in_bfloat16(q, k, v, *, causal, scale):      # an output buffer allocated as bfloat16
        return sdpa(q, k, v, causal=causal, scale=scale).to(torch.bfloat16).to(q.dtype)
    out = _out_row(stored_in_bfloat16, Case(1, 2, 45, 77, 16, True, ()))
    assert out.diagnosis.id == "output-rounded", out.diagnosis.sentence
    assert "out rounded to bfloat16 (in the kernel) at its store, then returned in float32" in out.diagnosis.sentence


def _carried_over_programs(programs, tile=32):
    """dq as a persistent grid of ``programs`` programs leaves it: work tiles (batch, head, query tile),
    the tile fastest, each adding the tile ``programs`` before it (an accumulator never reset)."""
    def carried(g):
        b, h, t, d = g.shape
        work = torch.cat([g, g.new_zeros(b, h, -t % tile, d)], 2).reshape(-1, tile, d).clone()
        for w in range(programs, len(work)):
            work[w] += work[w - programs]
        return work.reshape(b, h, -1, d)[:, :, :t]
    return carried


def test_a_persistent_programs_accumulator_carried_across_its_tiles_is_named_with_the_programs():
    def stale_dq(q, k, v, *, causal, scale):
        return sdpa(_GradientMapped.apply(q, _carried_over_programs(3)), k, v, causal=causal, scale=scale)
    said = _said(stale_dq, Case(2, 3, 45, 77, 16, True, ()))
    assert set(said) == {"dq"} and said["dq"].id == "tiles-accumulated", {n: d.sentence for n, d in said.items()}
    assert "dq's work tiles of 32 (counted (batch, head, query tile), the tile fastest) each holding the sum of " \
        "every tile 3 apart up to it: a persistent grid of 3 program(s)" in said["dq"].sentence, said["dq"].sentence


def test_query_heads_read_against_another_kv_head_are_named_with_the_heads():
    def head_block_of_16(q, k, v, *, causal, scale):        # a block of heads wider than the group: kv head 0 for all
        return sdpa(q, k[:, [0] * 6], v[:, [0] * 6], causal=causal, scale=scale)
    out = _out_row(head_block_of_16, Case(1, 6, 45, 77, 16, True, (("gqa", 2),)), wanted=("gqa",))
    assert out.diagnosis.id == "kv-head-map", out.diagnosis.sentence
    assert "query head 3 reads kv head 0 (its own: 1); query head 4 reads kv head 0 (its own: 1); query head 5 " \
        "reads kv head 0 (its own: 1)" in out.diagnosis.sentence, out.diagnosis.sentence
