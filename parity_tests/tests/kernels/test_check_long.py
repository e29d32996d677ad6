"""Long cases: diagnosed on a block of query rows; a case's time split by part.

The block path is exercised on a small case by lowering the dense limit below one
(batch, head) slice; the real T = 16384 run is ``-m slow``."""

import math
import resource
import time

import numpy as np
import pytest
import torch

import parity_tests
from parity_tests.kernels import cases, dense, targets
from parity_tests.kernels.diagnosis import diagnose
from parity_tests.kernels import runner, time_split
from parity_tests.kernels.diagnosis import row_block
from parity_tests.kernels.planted.chapter import GALLERY
from sampled import one_in

ONE = dict(tokens=["256"], heads=[1], batch=[1], head_dims=[64], dtypes=["float32"], causal="yes")


def no_scale(q, k, v, *, causal, scale):
    """SDPA without the 1/sqrt(D) scale, computed in the input's dtype as a kernel is."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)


def mask_one_future(q, k, v, *, causal, scale):
    """Each query also sees the next key: SDPA's causal mask one row down (a zero query
    put first, then dropped), at any length."""
    q1 = torch.cat([torch.zeros_like(q[..., :1, :]), q], dim=-2)
    return torch.nn.functional.scaled_dot_product_attention(q1, k, v, is_causal=causal, scale=scale)[..., 1:, :]


@pytest.fixture
def rows_only(monkeypatch):
    """A (256, 256) slice is too large to recompute whole: blocks of 64 query rows."""
    monkeypatch.setattr(diagnose, "DENSE_LIMIT", 256 * 256 - 1)
    monkeypatch.setattr(row_block, "MAX_ROWS", 64)


def _long_rows(report, t=256):
    return {r.tensor: r for r in report.rows if r.dims["tq"] == t and not r.dims["features"]}


@pytest.mark.parametrize("kernel, expected", one_in(3, [
    pytest.param(no_scale, "no-scale", id="no-scale"),
    pytest.param(mask_one_future, "mask-one-future", id="mask-one-future"),
    pytest.param(GALLERY["stale_max"][0], "stale-max", id="stale-max")]))
def test_a_case_too_large_for_one_slice_is_named_on_a_block_of_query_rows(rows_only, kernel, expected):
    rows = _long_rows(parity_tests.check(kernel, **ONE))
    assert rows["out"].failed and rows["out"].diagnosis.id == expected, rows["out"].diagnosis.sentence
    sentence = rows["out"].diagnosis.sentence
    assert "judged on (batch, head) (0, 0), query rows " in sentence and " of 256 with every key" in sentence
    assert "not tried on a block of rows: the softmax over the query axis" in sentence
    first, last = map(int, sentence.split("query rows ")[1].split(" of 256")[0].split(" .. "))
    assert last - first + 1 == 64
    if rows["dq"].failed and expected != "stale-max":
        assert rows["dq"].diagnosis.id == expected, rows["dq"].diagnosis.sentence
    for n in ("dk", "dv"):                    # sums over every query row: not claimed from a block
        if rows[n].failed:
            d = rows[n].diagnosis
            assert d.id == "not-diagnosed" and f"{n} not judged" in d.sentence, d.sentence
            assert f"(out of this case: {expected})" in d.sentence


def test_a_correct_kernel_passes_where_the_block_path_would_run(rows_only):
    assert parity_tests.check("sdpa-math", **ONE).passed


def test_dk_missing_its_scale_is_named_on_the_whole_slice_from_the_reference(rows_only):
    rows = _long_rows(parity_tests.check(GALLERY["dk_missing_scale"][0], **ONE))
    assert rows["out"].passed and rows["dk"].diagnosis.id == "dk-missing-scale", rows["dk"].diagnosis.sentence
    assert "judged on (batch, head) (0, 0), every row" in rows["dk"].diagnosis.sentence


def test_the_block_is_centred_on_the_worst_row_and_stays_inside_the_case():
    assert row_block.block_of_rows(16384, 16384, 8191) == (8063, 8319)
    assert row_block.block_of_rows(16384, 16384, 3) == (0, 256)
    assert row_block.block_of_rows(65536, 65536, 65535) == (65472, 65536)        # 64 rows at 65536
    assert row_block.block_of_rows(10, 10, 5) == (0, 10)


def test_a_case_carries_its_time_split_and_the_parts_add_up():
    case = cases.Case(1, 1, 128, 128, 64, True)
    start = time.perf_counter()
    rows = runner.run_case(targets.resolve(no_scale), case, "float32", "cpu")
    wall = time.perf_counter() - start
    split = rows[0].split
    assert all(r.split is split for r in rows) and rows[0].failed
    assert set(split) == {"target", "baseline", "golden", "diagnosis", "other", "wall"}
    assert all(split[p] > 0 for p in ("target", "baseline", "golden", "diagnosis"))
    assert math.isclose(sum(split[p] for p in runner.SPLIT_PARTS) + split["other"], split["wall"], rel_tol=1e-9)
    assert split["wall"] <= wall
    assert rows[0].as_dict()["split"]["diagnosis"] == split["diagnosis"]


def test_a_parts_time_is_the_sum_of_its_blocks(monkeypatch):
    # the target is called up to three times a case (first, determinism repeat, fresh inputs)
    ticks = iter([0.0, 1.0, 3.0, 10.0, 14.0, 20.0, 25.0, 30.0])
    monkeypatch.setattr(runner, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(ticks))}))
    split = runner.Split()
    for part in ("target", "target", "golden"):
        with split(part):
            pass
    assert split.done() == {"target": 6.0, "baseline": 0.0, "golden": 5.0, "diagnosis": 0.0, "other": 19.0,
                            "wall": 30.0}


@pytest.mark.slow
@pytest.mark.parametrize("kernel, expected", [(no_scale, "no-scale"), (mask_one_future, "mask-one-future")],
                         ids=["no-scale", "mask-one-future"])
def test_at_16384_tokens_a_planted_mistake_is_named(kernel, expected):
    # its time beside a passing check's of the same case is printed, not asserted
    case = cases.Case(1, 1, 16384, 16384, 64, True)
    timed = {}
    for name, target in (("pass", time_split.sdpa), ("fail", kernel)):
        start = time.perf_counter()
        rows = {r.tensor: r for r in runner.run_case(targets.resolve(target), case, "float32", "cpu",
                                                      timeout=None)}
        timed[name] = time.perf_counter() - start
        if name == "pass":
            assert all(r.passed for r in rows.values())
    assert rows["out"].diagnosis.id == expected and rows["dq"].diagnosis.id == expected
    assert "query rows" in rows["out"].diagnosis.sentence and "of 16384" in rows["out"].diagnosis.sentence
    print(f"T = 16384: passing {timed['pass']:.1f} s, failing {timed['fail']:.1f} s "
          f"(diagnosis {rows['out'].split['diagnosis']:.1f} s), peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB")


@pytest.mark.parametrize("tq, tk, align", [(200, 200, "top-left"), (150, 230, "bottom-right"),
                                           (230, 150, "bottom-right"), (150, 230, "top-left")])
def test_the_long_baseline_leaves_out_only_keys_no_row_of_a_chunk_sees(monkeypatch, tq, tk, align):
    rng = np.random.default_rng(0)
    q, dout = (rng.standard_normal((1, 2, tq, 16)) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, tk, 16)) for _ in range(2))
    opts = dict(scale=0.25, causal=True, align=align)
    whole = dense.run(q, k, v, dout, opts)
    monkeypatch.setattr(dense, "LONG_FROM", 64)                      # "long" from 64 keys
    monkeypatch.setattr(dense, "LONG_CHUNK_ELEMENTS", 64 * tk)        # chunks of 64 rows
    cut = dense.run(q, k, v, dout, opts)
    for n in ("out", "lse", "dq", "dk", "dv"):
        np.testing.assert_allclose(cut[n], whole[n], rtol=0, atol=1e-12, err_msg=n)


def test_long_adds_16384_both_ways_and_65536_causal_only_on_the_cpu():
    added = lambda causal: [(c.tq, c.causal) for c in cases.build_grid(tokens=["8"], causal=causal, long=True)
                            if c.tq > 8]
    assert added((True, False)) == [(16384, True), (16384, False), (65536, True)]
    assert added((False,)) == [(16384, False)]
    assert [c.tq for c in cases.build_grid(tokens=["8"], causal=(True,), long=True, device="cuda")] == \
        [8, 16384, 32768]


def test_a_run_past_a_minute_says_its_estimate_first_and_a_short_one_does_not(capsys):
    from parity_tests.kernels import run
    long_run = run._plan("sdpa-math", "cpu", ["float32"], None, None, None, None, "both", "top-left", "bhtd", True)
    line = run.estimate_line(long_run)
    assert line.startswith("estimated ") and " GiB peak for 20 cases" in line and "T65536" in line, line
    seconds, peak, _ = run.estimate(long_run)
    assert seconds > run.ESTIMATE_FROM and peak > run.BASE_BYTES
    short = run._plan("sdpa-math", "cpu", ["float32"], ["17"], None, None, None, "yes", "top-left", "bhtd", False)
    assert run.estimate_line(short) is None


SCREENED = dict(tokens=["64x96"], heads=[2], batch=[2], head_dims=[32], dtypes=["float32"], causal="yes")


def _verdicts(kernel, monkeypatch, screen_from):
    monkeypatch.setattr(row_block, "SCREEN_FROM", screen_from)
    report = parity_tests.check(kernel, **SCREENED)
    return [(r.case, r.tensor, r.verdict, r.diagnosis and r.diagnosis.id,
             r.diagnosis and r.diagnosis.id != "none" and r.diagnosis.sentence) for r in report.rows]


def _screening_changes_no_verdict(name, monkeypatch):
    kernel, expected = GALLERY[name]
    dropped = []
    screen = row_block.screen

    def counting(hyps, *args):
        kept = screen(hyps, *args)
        dropped.append(len(hyps) - len(kept))
        return kept
    monkeypatch.setattr(row_block, "screen", counting)
    whole = _verdicts(kernel, monkeypatch, 10 ** 12)               # every mistake on the whole case
    assert not dropped
    screened = _verdicts(kernel, monkeypatch, 64 * 96 - 1)         # out's mistakes on a block first
    assert dropped and max(dropped) > 0                             # the screen ran and dropped some
    assert screened == whole
    assert expected in {v[3] for v in screened}, screened


@pytest.mark.usefixtures("without_input_classes")
@pytest.mark.parametrize("name", ["no_scale", "mask_one_future", "stale_max", "one_head_wrong"])
def test_screening_a_large_case_on_a_block_changes_no_verdict(name, monkeypatch):
    """A case recomputed whole has its out mistakes tried on a block of rows first: the
    mistakes dropped there could not have explained the whole case, so every row's verdict
    and diagnosis are those of the unscreened run."""
    _screening_changes_no_verdict(name, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["no_causal_mask", "mask_one_past", "bottom_right", "scale_one_over_d",
                                  "softmax_over_queries", "bf16_denominator"])
def test_screening_changes_no_verdict_for_the_rest_of_the_gallery(name, monkeypatch):
    _screening_changes_no_verdict(name, monkeypatch)


def _forward_predictions(case, wanted, rows=None):
    """{(id, n-th of that id): out} of each catalogued mistake on ``case``, recomputed on the
    whole case or (``rows`` = (first, end)) on that block of query rows alone, as
    ``row_block.on_rows`` hands it to the catalogue."""
    from parity_tests.kernels.diagnosis import mistakes
    align = case.align or "top-left"
    inputs = runner.round_inputs(runner.draw(case, 0, wanted), "float32", case)
    opts = runner.reference_options(case, align, inputs)
    gold = runner.golden(inputs, opts, grads=False)
    first, end = rows or (0, case.tq)
    cut = lambda a: a[:, :, first:end]
    q, k, v, dout = inputs["q"], inputs["k"], inputs["v"], inputs["dout"]
    ctx = mistakes.Context(case, align, (cut(q), k, v, cut(dout)), None, opts, {n: cut(a) for n, a in gold.items()},
                           diagnose.as_4d, wanted, rows=None if rows is None else (first, case.tq))
    seen, out = {}, {}
    for hyp in mistakes.catalogue(ctx):
        if "out" in hyp.tensors and hyp.id not in mistakes.whole_case(case):
            seen[hyp.id] = seen.get(hyp.id, -1) + 1
            out[hyp.id, seen[hyp.id]] = hyp.predict(grads=False)["out"]
    return out


@pytest.mark.parametrize("feature, case", [
    ("paged", cases.Case(1, 2, 97, 97, 16, True, (("paged", (16, (97,))),), "bottom-right")),
    ("paged", cases.Case(3, 2, 30, 129, 16, True, (("paged", (16, (30, 3, 129))),), "bottom-right")),
    ("splits", cases.Case(1, 2, 30, 45, 16, True, (("splits", 7),), "bottom-right")),
], ids=["paged-prefill", "paged-lengths", "splits"])
def test_every_mistake_predicted_on_a_block_of_rows_is_those_rows_of_the_whole_case(feature, case):
    """The row block's premise (``row_block``): out of a query row depends on that row alone,
    so each mistake recomputed on a block gives exactly the whole case's rows there."""
    whole = _forward_predictions(case, (feature,))
    first, end = 8, 24
    block = _forward_predictions(case, (feature,), (first, end))
    assert any(h.startswith(feature) for h, _ in block) and block.keys() <= whole.keys()
    for key, out in block.items():
        np.testing.assert_allclose(out, whole[key][:, :, first:end], rtol=0, atol=1e-12, err_msg=str(key))
