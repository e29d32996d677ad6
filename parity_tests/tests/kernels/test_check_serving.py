"""Serving kernels: ``paged`` (FlashAttention's kvcache form) and ``splits`` (split-KV).

The kernels checked are ``planted.serving``, written plainly apart from the check's
formulas; each mistaken twin must fail and be named.  The default tests run the
features' own cases at small sizes in float32; the whole runs are slow."""

import math
from collections import Counter

import pytest
import torch

import parity_tests
from parity_tests.kernels import cases, runner, targets
from parity_tests.kernels.diagnosis import row_block
from parity_tests.kernels.features import REGISTRY, Plan
from parity_tests.kernels.planted import serving as ex
from needs import needs
from sampled import moved, one_in

pytestmark = pytest.mark.usefixtures("without_input_classes")   # (conftest.py)

SMALL = dict(tokens=["17"], head_dims=[16], heads=[2], batch=[1], dtypes=["float32"])
PAGED_TWINS = {"paged-past-seqlens": ex.paged_decode_past_seqlens,
               "paged-off-by-one-page": ex.paged_decode_off_by_one_page,
               "paged-table-stride": ex.paged_decode_table_stride,
               "paged-page-size": ex.paged_decode_page_size,
               "paged-last-page-dropped": ex.paged_decode_last_page_dropped,
               "paged-tile-in-one-page": ex.paged_decode_tile_in_one_page,
               "paged-offset-mod-tile": ex.paged_decode_offset_mod_tile,
               "paged-pages-sorted": ex.paged_decode_pages_sorted,
               "paged-offset-mask": ex.paged_decode_offset_mask}
WORDS = {"paged-past-seqlens": "cache_seqlens ignored", "paged-off-by-one-page": "one page off",
         "paged-table-stride": "row stride", "paged-page-size": "page size taken as",
         "paged-last-page-dropped": "last partial page dropped",
         "paged-tile-in-one-page": "from the page of its first key", "paged-offset-mod-tile": "position % 16",
         "paged-pages-sorted": "ascending physical order", "paged-offset-mask": "the mask's - 1 left out"}
SPLIT_TWINS = {"splits-not-rescaled": ex.split_decode_not_rescaled,
               "splits-empty-nan": ex.split_decode_empty_nan,
               "splits-empty-lse-zero": ex.split_decode_empty_zero,
               "splits-lse-base-2": ex.split_decode_base_2,
               "splits-aligned-alone": ex.split_decode_aligned_alone}


def _own_cases(feature, fn, causal=True):
    return REGISTRY[feature].cases(causal, Plan(takes_align=targets.resolve(fn).takes_align))


def _run(fn, case, feature, dtype="float32"):
    return runner.run_case(targets.resolve(fn), case, dtype, "cpu", wanted=(feature,))


def _nothing_unread_is_finite(k_cache, v_cache, block_table, cache_seqlens):
    """(every slot no sequence owns is NaN, in both caches; the pages of each sequence are
    neither adjacent nor in order)."""
    size = k_cache.shape[1]
    unread = torch.ones(k_cache.shape[0] * size, dtype=torch.bool)
    scattered = True
    for b, n in enumerate(cache_seqlens.tolist()):
        pages = block_table[b, : math.ceil(n / size)].long()
        pos = torch.arange(n)
        unread[pages[pos // size] * size + pos % size] = False
        if len(pages) >= 3:
            scattered &= not bool(((pages[1:] - pages[:-1]) == 1).all())
    flat = lambda c: c.reshape(-1, *c.shape[2:])[unread]
    return bool(unread.any() and flat(k_cache).isnan().all() and flat(v_cache).isnan().all()), scattered


def test_the_paged_example_passes_and_no_slot_it_must_not_read_is_finite():
    seen = []

    def recorded(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
        seen.append((k_cache.shape[1], tuple(cache_seqlens.tolist()),
                     _nothing_unread_is_finite(k_cache, v_cache, block_table, cache_seqlens)))
        return ex.paged_decode(q, k_cache, v_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                               causal=causal, scale=scale)
    report = parity_tests.check(recorded, features=["paged"], **SMALL, causal="yes")
    assert report.passed, str(report)
    assert {r.tensor for r in report.rows} == {"out"} and all("paged" in r.case for r in report.rows)
    assert len(seen) == 2 * len(report.rows)                  # each case: its call and a fresh one
    assert all(nan for _, _, (nan, _) in seen)                 # every case ran with NaN where no one reads
    assert all(scattered for _, _, (_, scattered) in seen)
    assert {size for size, _, _ in seen} >= {1, 16, 256}
    assert any(0 in lens for _, lens, _ in seen) and any(max(lens) >= 1000 * max(1, min(lens))
                                                          for _, lens, _ in seen)


def test_a_paged_kernel_returning_lse_is_judged_on_it():
    report = parity_tests.check(ex.paged_decode_with_lse, features=["paged", "lse"], **SMALL, causal="yes")
    assert report.passed, str(report)
    assert {r.tensor for r in report.rows} == {"out", "lse"}


def test_a_paged_kernel_that_writes_into_its_cache_fails_named():
    def writes(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):
        out = ex.paged_decode(q, k_cache, v_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                              causal=causal, scale=scale)
        k_cache.mul_(2.0)
        return out
    rows = _run(writes, _own_cases("paged", writes)[4], "paged")
    assert rows[0].verdict == "FAIL" and "wrote into k_cache" in rows[0].note


def test_paged_asks_for_its_keywords_before_any_case():
    with pytest.raises(ValueError, match="block_table="):
        parity_tests.check(ex.split_decode, features=["paged"], **SMALL)
    with pytest.raises(ValueError, match="cannot be combined"):
        parity_tests.check(ex.paged_decode, features=["paged", "varlen"], **SMALL)


# Lengths 32 (two full pages) and 200 (a partial last page): a case whose finite rows tell
# every paged reading apart (where every row is NaN, nothing can).
TELLING = 4
PAGES_256 = 1           # pages of 256 slots: an offset taken modulo a key tile of 16 shows


@pytest.mark.parametrize("mistake", list(PAGED_TWINS))
def test_a_wrong_paged_kernel_fails_and_is_named(mistake):
    fn = PAGED_TWINS[mistake]
    rows = _run(fn, _own_cases("paged", fn)[PAGES_256 if mistake == "paged-offset-mod-tile" else TELLING], "paged")
    assert rows[0].verdict == "FAIL" and rows[0].diagnosis.id == mistake, rows[0].diagnosis.sentence


def test_a_paged_mistake_whose_nan_rows_a_guard_returns_as_zero_is_still_named():
    def guarded(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale):     # o = l > 0 ? acc / l : 0
        out = ex.paged_decode_tile_in_one_page(q, k_cache, v_cache, block_table=block_table,
                                               cache_seqlens=cache_seqlens, causal=causal, scale=scale)
        return torch.where(out.isnan().any(-1, keepdim=True), 0.0, out)
    (row,) = _run(guarded, _own_cases("paged", guarded)[TELLING], "paged")
    assert row.verdict == "FAIL" and row.diagnosis.id == "paged-tile-in-one-page", row.diagnosis.sentence
    assert "(the rows that read a NaN slot returned as 0, as a guard such as l > 0 gives)" in row.diagnosis.sentence


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(PAGED_TWINS))
def test_every_wrong_paged_kernel_is_named_on_the_cases_that_tell(mistake):
    report = parity_tests.check(PAGED_TWINS[mistake], features=["paged"], **SMALL, causal="both")
    assert not report.passed
    named = Counter(d.id for r, d in report.diagnoses if "lens" in r.case)   # the feature's own cases
    if mistake == "paged-tile-in-one-page":    # its NaN rows are a page size of 32's, asked first, on most cases
        assert named[mistake] > 0 and set(named) <= {mistake, "paged-page-size"}, named
        return
    # where every row is NaN the readings cannot be told apart: each sentence names this one too
    assert all(WORDS[mistake] in d.sentence for _, d in report.diagnoses), \
        [d.sentence for _, d in report.diagnoses if WORDS[mistake] not in d.sentence][:2]


def test_a_paged_kernel_dropping_its_last_page_is_named_when_screened_on_a_block_of_rows(monkeypatch):
    """A large case has its out mistakes screened on a block of query rows first
    (``row_block.screen``): each paged mistake is predicted on the block's rows alone (its
    NaN rows once raised IndexError, a mask of the whole case's rows on the block's)."""
    case = cases.Case(1, 2, 97, 97, 16, True, (("paged", (16, (97,))),), "bottom-right")
    fn = ex.paged_decode_last_page_dropped
    whole = _run(fn, case, "paged")[0]
    monkeypatch.setattr(row_block, "SCREEN_FROM", 97 * 97 - 1)        # screened, on blocks of 16 rows
    monkeypatch.setattr(row_block, "MAX_ROWS", 16)
    monkeypatch.setattr(row_block, "MIN_ROWS", 16)
    screened = []
    screen = row_block.screen
    monkeypatch.setattr(row_block, "screen", lambda hyps, *a: screened.append(hyps) or screen(hyps, *a))
    row = _run(fn, case, "paged")[0]
    assert screened and row.verdict == "FAIL" and row.diagnosis.id == "paged-last-page-dropped", \
        row.diagnosis.sentence
    assert row.diagnosis.sentence == whole.diagnosis.sentence


@needs("paged_attention")
def test_flex_paged_is_right_but_lets_the_unused_slots_nan_reach_every_row():
    fn = targets.resolve("flex-paged").fn
    rows = _run("flex-paged", _own_cases("paged", fn)[4], "paged")
    assert rows[0].verdict == "FAIL" and rows[0].diagnosis.id == "paged-masked-nan", rows[0].diagnosis.sentence

    def finite_slots(q, k_cache, v_cache, **kw):              # the same kernel with the NaN slots zeroed
        return fn(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), **kw)
    assert _run(finite_slots, _own_cases("paged", fn)[4], "paged")[0].passed


def test_the_split_example_passes_every_count_of_splits():
    report = parity_tests.check(ex.split_decode, features=["splits"], **SMALL, causal="both")
    assert report.passed, str(report)
    counts = {int(r.case.split("splits ")[1].split()[0]) for r in report.rows if "splits" in r.case}
    assert counts == {1, 2, 3, 7, 133}


@moved
def test_keys_lost_as_whole_splits_are_said_as_those_splits():
    fn = ex.split_decode_last_dropped
    rows = [r for c in _own_cases("splits", fn) if c.tk == 300 for r in _run(fn, c, "splits")]
    failed = [r for r in rows if not r.passed]
    assert all(r.diagnosis.id == "keys-unseen" for r in failed), [r.diagnosis.sentence for r in failed]
    said = {r.case_def.get("splits"): r.diagnosis.sentence for r in failed if r.tensor == "out"}
    assert said.keys() == {2, 3, 7}, said                        # 1 split: none dropped; of 133, the last is empty
    assert "keys 200 .. 299 seen by no query (range 2 of the 3 key ranges the kernel computes apart (splits = 3), " \
        "whole: their partial states lost, dropped by the merge or never written)" in said[3], said[3]
    assert "keys 258 .. 299 seen by no query (range 6 of the 7 key ranges" in said[7], said[7]


@pytest.mark.parametrize("mistake", one_in(2, list(SPLIT_TWINS)))
def test_a_wrong_split_kernel_fails_and_is_named(mistake):
    fn = SPLIT_TWINS[mistake]
    cases = [c for c in _own_cases("splits", fn) if c.get("splits") == 133 or c.tq == 30]
    rows = [r for c in cases for r in _run(fn, c, "splits")]
    if mistake == "splits-aligned-alone":    # a split of one key is seen by a decode row whichever way it is aligned
        assert all(r.passed for r in rows if r.case_def.tq == 1)
        rows = [r for r in rows if r.case_def.tq > 1]
    assert rows and all(r.verdict == "FAIL" for r in rows)
    if mistake == "splits-not-rescaled":     # one key per split: the states merged unrescaled weigh each key alike
        flat = [r for r in rows if r.diagnosis.id == "scores-flat"]
        assert flat and all(mistake in r.diagnosis.also and r.case_def.tk <= 133 for r in flat)
        rows = [r for r in rows if r not in flat]
    assert rows and {r.diagnosis.id for r in rows} == {mistake}, [r.diagnosis.sentence for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("mistake", one_in(2, list(SPLIT_TWINS)))
def test_every_wrong_split_kernel_is_named_in_both_dtypes(mistake):
    report = parity_tests.check(SPLIT_TWINS[mistake], features=["splits"],
                                **{**SMALL, "dtypes": ["float32", "bfloat16"]}, causal="both")
    assert not report.passed and report.diagnosis == mistake, str(report)


@pytest.mark.slow
def test_the_serving_examples_pass_together_in_both_dtypes():
    def both(q, k_cache, v_cache, *, block_table, cache_seqlens, causal, scale, num_splits=1):
        return ex.paged_decode(q, k_cache, v_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                               causal=causal, scale=scale)
    report = parity_tests.check(both, features=["paged", "splits"], **{**SMALL, "dtypes": ["float32", "bfloat16"]},
                                causal="both")
    assert report.passed, str(report)
