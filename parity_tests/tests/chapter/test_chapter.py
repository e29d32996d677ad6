"""``attention-parity chapter``: every worked example replayed by both
implementations, and a planted wrong chapter value that must fail the verb."""

import copy
import re
import types

import pytest
import torch

from parity_tests.chapter import replay as chapter
from parity_tests.chapter import replay_causal as chapter_causal
from parity_tests.common import chapter_values
from parity_tests.common import plots
from parity_tests.common.verdicts import FAIL, PASS, SKIP
from verb_run import needs_matplotlib, run_verb


def planted(**changes):
    """chapter_values as a namespace (deep copy), with ``changes`` applied."""
    values = {k: copy.deepcopy(getattr(chapter_values, k))
              for k in dir(chapter_values) if k.isupper()}
    values.update(changes)
    return types.SimpleNamespace(**values)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return run_verb(chapter.main, tmp_path_factory.mktemp("chapter_plots"))


def test_every_printed_number_is_reproduced_by_both_sides(full_run):
    status, out, _ = full_run
    assert status == 0
    # a few values, as the chapter prints them
    assert "[0.4419, 0.6515, 0.5683]" in out                       # context_vec_2
    assert "[0.3061, 0.8210]" in out                               # step-by-step z^(2)
    assert "[0.4656, 0.1723,   -inf,   -inf,   -inf,   -inf]" in out  # masked scores
    release = torch.__version__.split("+")[0]
    if chapter_causal.draws_the_chapters_mask(chapter_values):
        assert "91 checks: 91 pass, 0 FAIL" in out
        assert "[0.0000, 0.3327, 0.3331, 0.3084, 0.3331, 0.0000]" in out  # dropout row 6
        assert f"PyTorch {release} draws the chapter's keep-mask" in out
    else:       # PyTorch < 2.7: the chapter's 13 dropout rows skip, the release named; NumPy
        assert "92 checks: 79 pass, 13 skip, 0 FAIL" in out    # is held to PyTorch's own mask
        assert re.search(rf"PyTorch {re.escape(release)} draws the chapter's keep-mask .* another mask .* skip", out)
        assert re.search(r"numpy_ref.ops.dropout_forward with torch's mask == torch .* pass", out)


@needs_matplotlib
def test_chapter_plots_have_the_promised_size(full_run):
    _, _, plot_dir = full_run
    expected = {"attention_simplified.png": 1, "attention_causal.png": 1,
                "attention_heads.png": 2, "dropout_mask.png": 1}
    for name, panels in expected.items():
        data = (plot_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        size = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert size == plots.pixel_size(panels), name


def test_a_wrong_printed_value_fails_the_verb(capsys):
    values = planted()
    values.SA_V2_OUTPUT[0][0] = -0.0741                # the chapter prints -0.0739
    assert chapter.run(values) == 1
    out = capsys.readouterr().out
    row = next(l for l in out.splitlines() if l.startswith("sa_v2(inputs), seed 789[0]"))
    assert row.endswith(FAIL)
    assert "1 FAIL" in out


def test_half_a_printed_unit_is_tolerated_more_is_not():
    ok = planted()
    ok.QUERY_2[0] += 0.00004                            # still 0.4306 once printed
    bad = planted()
    bad.QUERY_2[0] += 0.0001
    assert chapter.step_by_step_rows(ok)[0][3] == PASS
    assert chapter.step_by_step_rows(bad)[0][3] == FAIL


def test_a_wrong_shape_fails_without_crashing():
    values = planted(SIMPLE_ALL_CONTEXT_VECS=chapter_values.SIMPLE_ALL_CONTEXT_VECS[:5])
    rows = chapter.simplified_rows(values)
    assert [r[3] for r in rows if r[0].startswith("all_context_vecs")] == [FAIL]


def test_a_wrong_mask_position_fails():
    values = planted()
    values.CAUSAL_MASKED_SCORES[0][1] = 0.1234          # not -inf
    rows = chapter_causal.mask_rows(values)
    assert next(r for r in rows if r[0].startswith("masked = ") and r[0].endswith("[0]"))[3] == FAIL


def test_other_dropout_draws_are_skipped_not_failed():
    """The chapter warns its dropout draws may differ between systems: a keep-mask
    other than the one PyTorch draws here gives 'skip' rows, and NumPy is still
    checked against PyTorch with PyTorch's own mask."""
    values = planted()
    values.DROPOUT_ON_ONES[0][0] = 0.0
    rows = chapter_causal.dropout_rows(values)
    assert rows[0][3] == SKIP
    assert all(r[3] == SKIP for r in rows[1:-1])
    assert rows[-1][3] == PASS and "dropout_forward" in rows[-1][0]
