"""The check across ranks: the ring attention example passes with both shardings, each planted
mistake fails and is named with the rank, misbehaving ranks fail in bounded time, nothing is
left running.  The checks that pass share one world of 2 ranks (starting one costs seconds)."""

import os
import socket
import time

import numpy as np
import pytest

from numpy_ref import reference_attention
from parity_tests.kernels.ranks import diagnosis as rank_diagnosis
from parity_tests.kernels.ranks import world as rank_world
from parity_tests.kernels.cases import Case
from parity_tests.kernels.ranks import check_ranks, shard_positions
from examples import ring_attention
import ring_twins
from processes import children as _children
from sampled import moved

SMALL = dict(dtypes=["float32"], tokens=[67], timeout=60)


def _shared_memory_files():
    """Files in /dev/shm that this process's multiprocessing or PyTorch left (named by its pid)."""
    mine = (f"pym-{os.getpid()}-", f"torch_{os.getpid()}_")
    return [f for f in os.listdir("/dev/shm") if f.startswith(mine)] if os.path.isdir("/dev/shm") else []


def _port_is_closed(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.fixture(scope="module")
def world():
    """One world of 2 ranks for the checks below; once closed, no process and no port remain."""
    with rank_world.World(2) as w:
        port = w.store.port
        yield w
    assert _children() == [] and _port_is_closed(port)


def test_shards_cover_the_sequence_once():
    for t in (8, 67, 256):
        for sharding in ("contiguous", "head-tail"):
            pos = shard_positions(t, 2, sharding)
            assert sorted(np.concatenate(pos).tolist()) == list(range(t))
    assert [p.tolist() for p in shard_positions(8, 2, "head-tail")] == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_the_dense_ring_with_nothing_changed_is_the_reference():
    case = Case(1, 4, 23, 23, 8, True, (("gqa", 2),))
    rng = np.random.default_rng(0)
    q, dout = rng.standard_normal((2, 1, 4, 23, 8))
    k, v = rng.standard_normal((2, 1, 2, 23, 8))
    gold = reference_attention(q, k, v, dout, causal=True)
    sim = rank_diagnosis.simulate((q, k, v, dout), case, shard_positions(23, 2, "head-tail"))
    for n in ("out", "lse", "dq", "dk", "dv"):
        np.testing.assert_allclose(sim[n], gold[n], rtol=0, atol=1e-12, err_msg=n)


def test_more_ranks_than_cpus_is_refused_before_any_work():
    cpus = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"world_size {cpus + 1} .* {cpus} usable CPU"):
        check_ranks(ring_attention.attention, world_size=cpus + 1)
    assert _children() == []


@pytest.mark.parametrize("options, match", [
    (dict(sharding="zigzag"), "sharding must be among contiguous, head-tail"),
    (dict(tokens=[3]), "tokens must be at least 2 x world_size = 4"),
    (dict(tokens=["16x32"]), "self-attention"),
    (dict(features=["softcap"]), "features across ranks must be among gqa, window, lse"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        check_ranks(ring_attention.attention, **options)


def test_a_target_without_the_rank_keywords_or_not_importable_is_refused():
    def local(q, k, v, *, causal, scale, group, q_positions, k_positions):
        return q
    with pytest.raises(ValueError, match="top level of a module"):
        check_ranks(local)
    with pytest.raises(ValueError, match="has no group, q_positions, k_positions"):
        check_ranks(ring_twins.single_device)


@moved                      # one process per rank, its own world (no live ranks left for the slow tests after it): 5 s
def test_a_target_in_a_file_runs_on_every_rank(tmp_path):
    # no rank can import a file by name: each loads it again by its path
    path = tmp_path / "my_ring.py"
    root = os.path.dirname(os.path.dirname(ring_attention.__file__))
    path.write_text(f"import sys\nsys.path.insert(0, {root!r})\nfrom examples import ring_attention\n\n\n"
                    "def attention(q, k, v, **kw):          # defined here: a module no rank can import by name\n"
                    "    return ring_attention.attention(q, k, v, **kw)\n")
    with rank_world.World(2) as world:
        report = check_ranks(f"{path}:attention", causal="yes", sharding="head-tail", world=world, **SMALL)
    assert report.passed and report.rows, str(report)
    assert _children() == []


def test_a_gradient_averaged_over_the_ranks_is_named_with_the_world_size(world):
    report = check_ranks(ring_twins.dkdv_averaged, causal="yes", sharding="head-tail", world=world, **SMALL)
    said = {r.tensor: r.diagnosis for r in report.failures}
    assert set(said) == {"dk", "dv"} and {d.id for d in said.values()} == {"constant-factor"}, str(report)
    assert "Matches the reference times 0.5 (1 / the world size, 2: a gradient averaged over the ranks where it " \
           "is summed)" in said["dk"].sentence, said["dk"].sentence


def test_the_ring_example_passes_with_both_shardings(world):
    report = check_ranks("examples.ring_attention:attention", causal="both", world=world, **SMALL)
    assert report.passed, str(report)
    assert {r.dims["sharding"] for r in report.rows} == {"contiguous", "head-tail"}
    assert {r.tensor for r in report.rows} == {"out", "dq", "dk", "dv"}
    assert all("2 ranks" in r.case for r in report.rows)


@pytest.mark.parametrize("twin, name, sharding", [
    (ring_twins.local_positions, "contiguous-mask", "head-tail"),
    (ring_twins.no_lse_merge, "no-lse-merge", "contiguous"),
    (ring_twins.lse_base_2, "lse-base-2", "head-tail"),
    (ring_twins.dkdv_not_reduced, "dkdv-not-reduced", "head-tail"),
    (ring_twins.own_block_lse_backward, "own-block-lse", "head-tail"),
    (ring_twins.block_local_mask, "block-local-mask", "contiguous"),
])
def test_each_planted_mistake_fails_and_is_named_with_its_rank(world, twin, name, sharding):
    report = check_ranks(twin, causal="yes", sharding=sharding, world=world, **SMALL)
    assert not report.passed
    assert report.diagnosis == name, str(report)
    for row in report.failures:
        assert row.diagnosis.id == name, row.diagnosis.sentence
        assert row.note.startswith("rank ") and f"worst at {row.note}," in row.diagnosis.sentence


def test_a_mistake_no_sharding_mistake_names_is_located_then_read_as_one_kernels(world):
    """The scale left out of every block: no sharding mistake, but the single-device catalogue
    names it on the ranks' rows put back in their global order."""
    report = check_ranks(ring_twins.scale_ignored, causal="yes", sharding="head-tail", world=world, **SMALL)
    assert not report.passed and report.diagnosis == "no-scale", str(report)
    for row in report.failures:
        said = row.diagnosis.sentence
        assert row.diagnosis.id == "no-scale" and "Matches none of the sharding mistakes; read as one kernel over " \
            "the whole sequence (the ranks' rows in their global order): " in said, said
        assert "closest" not in said                      # each sharding mistake is as far from it as the reference is
        assert f"worst at {row.note}," in said


def test_local_positions_are_right_when_the_shards_are_contiguous(world):
    assert check_ranks(ring_twins.local_positions, causal="yes", sharding="contiguous", world=world,
                       **SMALL).passed


def test_a_rank_that_raises_fails_the_case_with_its_number(world):
    start = time.monotonic()
    report = check_ranks(ring_twins.raises_on_rank_1, causal="yes", sharding="head-tail", world=world, **SMALL)
    assert time.monotonic() - start < 30
    assert [r.verdict for r in report.rows] == ["FAIL"] * 4
    assert all(r.note.startswith("rank 1 raised RuntimeError: no buffer for this shard") for r in report.rows)
    assert world.closed and _children() == []


@pytest.mark.slow                                      # waits out its 1 s timeout: 3-4 s
def test_a_rank_that_hangs_fails_in_bounded_time_and_nothing_is_left():
    start = time.monotonic()
    report = check_ranks(ring_twins.hangs_on_rank_1, causal="yes", sharding="head-tail",
                         dtypes=["float32"], tokens=[67], timeout=1)
    assert time.monotonic() - start < 40
    assert all(r.note.startswith("rank 1 timed out after 1 s, still in its own code (rank 0 waiting")
               for r in report.rows), report.rows[0].note
    assert _children() == [] and _shared_memory_files() == []


@pytest.mark.slow
def test_a_rank_that_exits_fails_the_case_with_its_exit_code():
    report = check_ranks(ring_twins.exits_on_rank_1, causal="yes", sharding="contiguous", **SMALL)
    assert all(r.note == "rank 1 exited (exit code 3) without a result" for r in report.rows)
    assert _children() == []


@pytest.mark.slow
def test_the_ring_example_passes_the_default_grid_and_its_features():
    assert check_ranks("examples.ring_attention:attention", features=["gqa", "window"]).passed
    report = check_ranks("examples.ring_attention:attention_lse", features=["lse"], dtypes=["float32"])
    assert report.passed and "lse" in {r.tensor for r in report.rows}


@pytest.mark.slow
@pytest.mark.parametrize("twin, name", [(ring_twins.no_lse_merge, "no-lse-merge"),
                                        (ring_twins.lse_base_2, "lse-base-2")])
def test_the_merge_mistakes_are_named_in_bfloat16_and_with_gqa(twin, name):
    report = check_ranks(twin, dtypes=["bfloat16"], features=["gqa"], tokens=[67])
    ids = [r.diagnosis.id for r in report.failures]
    # named, or silent where bfloat16's rounding blurs a row (never another cause)
    assert report.diagnosis == name and set(ids) <= {name, "none"} and ids.count(name) >= 0.8 * len(ids), ids


@pytest.mark.parametrize("argv, words", [
    (["--world-size", "3"], "world_size 3 is more than this machine can run"),
    (["--world-size", "2", "--sharding", "diagonal"], "sharding must be among"),
])
def test_the_command_refuses_bad_rank_options_with_status_2(argv, words, capsys):
    from parity_tests import cli
    if "3" in argv and len(os.sched_getaffinity(0)) > 2:
        pytest.skip("this machine has more than 2 CPUs")
    assert cli.main(["check", "examples.ring_attention:attention", *argv]) == 2
    assert words in capsys.readouterr().err


def test_cp_ring_says_why_it_does_not_run_on_cpu(capsys):
    from parity_tests import cli
    assert cli.main(["check", "cp-ring", "--world-size", "2"]) == 2
    assert "_scaled_dot_product_flash_attention_for_cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_runs_the_example_across_ranks(tmp_path, capsys):
    from parity_tests import cli
    path = tmp_path / "rows.json"
    argv = ["check", "examples.ring_attention:attention", "--world-size", "2", "--tokens", "67",
            "--dtype", "float32", "--json", str(path)]
    assert cli.main(argv) == 0
    assert "/ 2 ranks head-tail" in capsys.readouterr().out
    assert '"world_size": 2' in path.read_text()
