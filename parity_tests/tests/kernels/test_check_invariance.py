"""``check --invariance``: the kernel against itself, bitwise.  An invariant kernel holds every
mode; each mistake of ``invariance_gallery`` breaks the one it breaks, at the boundary it has,
and none of them is called inaccurate.  Sweeps shortened to what each boundary needs."""

import json

import numpy as np
import pytest
import torch

import parity_tests
from parity_tests import cli
from parity_tests.kernels import targets
from parity_tests.kernels.invariance import MODES, check_invariance, parse_modes, ulps
import invariance_gallery as gallery
from sampled import one_in

SWEEP = dict(lengths=(1, 2, 16, 17, 95, 96, 97, 98, 129), batch_sizes=(2, 4, 5, 8), chunk_tokens=65,
             chunk_sizes=(1, 16, 17))
ACCURACY = dict(dtypes=["float32"], tokens=["17", "45x77"], head_dims=[16], heads=[2], batch=[2], align="bottom-right")


def _found(fn, modes=MODES, dtypes=("float32",), **sweep):
    return {(f.mode, f.dtype): f for f in check_invariance(targets.resolve(fn), modes, dtypes, align="bottom-right",
                                                             head_dim=16, **{**SWEEP, **sweep})}


def test_an_invariant_kernel_holds_every_invariance_it_can_be_asked():
    found = _found(gallery.invariant, dtypes=("float32", "bfloat16"))
    for (mode, dtype), f in found.items():
        if mode == "splits":
            assert f.verdict == "not supported" and "num_splits" in f.note
        else:
            assert f.verdict == "invariant" and f.compared > 0 and f.differing == 0, f.line()


def test_decode_and_prefill_in_other_tiles_differ_from_the_first_kv_len_past_the_tile():
    f = _found(gallery.decode_tile_96, ("decode", "batch"))
    decode = f["decode", "float32"]
    assert decode.broken and decode.first == 97 and 0 < decode.differing < decode.compared
    assert decode.pattern == "every kv_len ≥ 97: the kernel's key tile changes at 96"
    assert all(decode.sweep[n] == 0 for n in decode.sweep if n <= 96) and all(decode.sweep[n] for n in (97, 98, 129))
    assert f["batch", "float32"].verdict == "invariant"


def test_the_first_length_is_narrowed_between_two_swept_ones():
    decode = _found(gallery.decode_tile_96, ("decode",), lengths=(1, 64, 128, 129))["decode", "float32"]
    assert decode.first == 97 and set(range(65, 128)) <= set(decode.sweep)


def test_a_split_count_from_the_batch_size_breaks_batch_invariance_past_four_sequences():
    f = _found(gallery.splits_from_batch, ("batch", "splits", "decode"))
    batch = f["batch", "float32"]
    assert batch.broken and batch.first == 5 and batch.pattern == "only when the batch holds more than 4 sequences"
    assert batch.sweep[2] == batch.sweep[4] == 0 and batch.sweep[5] and batch.sweep[8]
    assert f["splits", "float32"].broken and f["decode", "float32"].verdict == "invariant"


def test_a_padded_block_whose_rows_reach_each_other_breaks_batch_invariance_only():
    f = _found(gallery.padded_block_max, ("batch", "decode", "chunks"))
    assert f["batch", "float32"].broken and all(f["batch", "float32"].sweep.values())
    assert f["decode", "float32"].verdict == f["chunks", "float32"].verdict == "invariant"


def test_a_reduction_order_that_follows_the_position_in_the_batch_is_located_by_position():
    batch = _found(gallery.order_by_position, ("batch",), batch_sizes=(2, 5))["batch", "float32"]
    # size 2: the middle and last places are position 1 (odd); size 5: 2 and 4 (even)
    assert batch.broken and batch.sweep == {2: batch.sweep[2], 5: 0} and batch.sweep[2] > 0
    assert batch.pattern == "in batches of 2, only where the sequence sits middle or last"


def test_a_varlen_kernel_is_checked_packed_among_sequences_of_other_lengths():
    right = _found(gallery.varlen_invariant, ("batch", "decode", "chunks"))
    assert all(f.verdict == "invariant" for f in right.values()), [f.line() for f in right.values()]
    assert "packed (varlen)" in right["batch", "float32"].note
    batch = _found(gallery.varlen_tiles_from_buffer_start, ("batch",))["batch", "float32"]
    assert batch.broken and batch.pattern.endswith("only where the sequence sits middle or last")


def test_a_paged_kernel_reads_both_sides_from_a_paged_cache():
    right = _found(gallery.paged_invariant, ("decode", "chunks", "batch"))
    assert all(f.verdict == "invariant" for f in right.values()), [f.line() for f in right.values()]
    decode = _found(gallery.paged_decode_tile_96, ("decode",))["decode", "float32"]
    assert decode.broken and decode.first == 97 and decode.pattern.endswith("the kernel's key tile changes at 96")


@pytest.mark.parametrize("name, features", one_in(3, [
    ("decode_tile_96", None), ("splits_from_batch", None), ("padded_block_max", None), ("order_by_position", None),
    ("varlen_tiles_from_buffer_start", ["varlen"]), ("paged_decode_tile_96", ["paged"])]))
def test_no_mistake_of_invariance_is_called_inaccurate(name, features):
    report = parity_tests.check(getattr(gallery, name), features=features, **ACCURACY)
    assert not report.failures and any(r.passed for r in report.rows), str(report)


def test_one_ulp_in_one_element_at_one_length_is_found_and_not_called_every_length():
    def slipped(q, k, v, *, causal, scale):
        out = gallery.invariant(q, k, v, causal=causal, scale=scale)
        if q.shape[2] == 1 and k.shape[2] == 17:                     # one decode call, one element
            out = out.clone()
            out[0, 0, 0, 3] = torch.nextafter(out[0, 0, 0, 3], torch.tensor(np.inf, dtype=out.dtype))
        return out
    decode = _found(slipped, ("decode",))["decode", "float32"]
    assert decode.broken and decode.differing == 1 and decode.ulps == 1.0 and decode.first == 17
    assert decode.pattern == "kv_len 17 (not every longer one)"


def test_lengths_a_kernel_refuses_are_left_out_of_the_sweep_and_all_refused_is_not_supported():
    def multiples_of_16(q, k, v, *, causal, scale):
        if k.shape[2] % 16:
            raise targets.Unsupported("kv_len must be a multiple of 16")
        return gallery.decode_tile_96(q, k, v, causal=causal, scale=scale)
    decode = _found(multiples_of_16, ("decode",), lengths=(1, 16, 17, 96, 97, 128, 129))["decode", "float32"]
    assert set(decode.sweep) == {16, 96, 112, 128} and decode.first == 112    # 97 .. 111 refused
    none = _found(multiples_of_16, ("decode",), lengths=(1, 17))["decode", "float32"]
    assert none.verdict == "not supported" and none.note == "kv_len must be a multiple of 16"


def test_the_report_fails_on_a_broken_invariance_and_says_which():
    report = parity_tests.check(gallery.decode_tile_96, invariance=["decode"], **ACCURACY)
    assert not report.failures and not report.passed and [f.mode for f in report.broken] == ["decode"]
    assert report.summary().endswith("; invariance: broken: decode")
    assert "decode  float32   DIFFERS: " in str(report)
    assert parity_tests.check(gallery.invariant, invariance=["chunks"], **ACCURACY).passed


def test_the_command_exits_1_on_a_broken_invariance_and_writes_it_to_json(tmp_path, capsys):
    path = tmp_path / "r.json"
    argv = ["check", "parity_tests.tests.kernels.invariance_gallery:padded_block_max", "--invariance", "batch",
            "--tokens", "17", "--head-dim", "16", "--dtype", "float32", "--align", "bottom-right", "-q",
            "--json", str(path)]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "invariance (the kernel against itself, bitwise):" in out and "batch   float32   DIFFERS" in out
    (found,) = json.loads(path.read_text())["invariance"]
    assert found["mode"] == "batch" and found["verdict"] == "DIFFERS" and found["differing"] > 0


def test_a_mode_that_is_not_one_is_refused_by_name(capsys):
    with pytest.raises(ValueError, match="invariance must be among batch, decode, chunks, splits; got tiles"):
        parse_modes("decode,tiles")
    assert cli.main(["check", "sdpa-math", "--invariance", "tiles"]) == 2
    assert "invariance must be among" in capsys.readouterr().err
    assert parse_modes("splits,batch") == ("batch", "splits")
    with pytest.raises(ValueError, match="invariance compares a kernel target with itself"):
        parity_tests.check(gallery.invariant, invariance=["decode"], world_size=2)


def test_units_in_the_last_place():
    one = np.array([1.0])
    assert ulps(one + 2.0 ** -23, one, "float32")[0] == 1.0
    assert ulps(one + 2.0 ** -7, one, "bfloat16")[0] == 1.0
    assert ulps(np.array([2.0 ** -22]), np.array([0.0]), "float32")[0] == 2.0 ** 23     # at the larger's magnitude
