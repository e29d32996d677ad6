"""Teeth: every named fault makes the parity matrix fail, and only where it should.

A parity suite that passes whatever the code does proves nothing.  For each fault
of `parity_tests.faults` the command (``--plant-fault``) must exit 1 with failing
rows of the kind the fault breaks; without a fault everything passes; and a
planted fault is removed again when its ``with`` block ends.
"""

import contextlib
import json

import numpy as np
import numpy_ref.ops as ops
import pytest
import torch_impl.attention as torch_attention

from parity_tests.common import faults
from parity_tests.common.variant_faults import VARIANT_FAULTS
from parity_tests.matrix import harness
from parity_tests.matrix import run as run_parity
from sampled import one_in

# What each fault must break (every failing row satisfies it), and where it must show.
CAUSAL = ("CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention",
          "FusedMultiHeadAttention", "BlockwiseMultiHeadAttention")
BLOCKWISE = lambda r: r["module"] == "BlockwiseMultiHeadAttention"  # noqa: E731
SPLIT_HEADS = ("MultiHeadAttention", "FusedMultiHeadAttention")
VARIANT = lambda r: r["module"] == "reference_attention"  # noqa: E731

EXPECTED = {
    "softmax-backward-no-sum": lambda r: r["tensor"] != "output",
    "scores-backward-unscaled": lambda r: r["tensor"] != "output",
    "causal-mask-off-by-one": lambda r: r["module"] in CAUSAL,
    "dropout-not-rescaled": lambda r: r["mode"] == "train",
    "bias-grad-first-batch": lambda r: r["tensor"].endswith(".bias"),
    "weight-grad-transposed": lambda r: r["tensor"].endswith(".weight"),
    "linear-backward-sign": lambda r: r["tensor"] != "output",
    "weighted-sum-no-transpose": lambda r: r["tensor"] != "output",
    "heads-merged-wrong-order": lambda r: r["module"] in SPLIT_HEADS,
    "torch-mask-off-by-one": lambda r: r["module"] in CAUSAL,
    "torch-heads-reversed": lambda r: r["module"] == "MultiHeadAttentionWrapper",
    "blockwise-max-not-updated": lambda r: BLOCKWISE(r) and r["config"] == "T 9, large scores",
    "blockwise-output-not-rescaled": BLOCKWISE,
    "blockwise-lse-without-max": lambda r: BLOCKWISE(r) and r["tensor"] != "output",
    "blockwise-delta-one-tile": lambda r: BLOCKWISE(r) and r["tensor"] != "output",
    "blockwise-causal-skip-off-by-one": BLOCKWISE,
    **{name: VARIANT for name in VARIANT_FAULTS},
}


def test_every_fault_has_an_expectation():
    assert sorted(EXPECTED) == sorted(faults.names())
    assert len(faults.names()) >= 8


def _run(tmp_path, *args):
    path = tmp_path / "rows.json"
    status = run_parity.main(["--quiet", "--json", str(path), *args])
    return status, json.loads(path.read_text())


# faults whose forgotten maximum makes exp overflow on the large-scores case, by design:
# the inf and NaN they leave are what the rows must catch, not news for the test log
OVERFLOWING = ("blockwise-max-not-updated", "blockwise-lse-without-max")


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("name", one_in(4, faults.names()))
def test_planted_fault_fails_the_command(name, tmp_path, capsys):
    quiet = np.errstate(over="ignore", invalid="ignore") if name in OVERFLOWING \
        else contextlib.nullcontext()
    with quiet:
        status, report = _run(tmp_path, "--dtype", "float64", "--plant-fault", name)
    failing = [r for r in report["rows"] if not r["passed"]]
    assert status == 1, f"--plant-fault {name} exited {status}, not 1"
    assert failing, f"{name}: no row failed"
    assert report["summary"]["fault"] == name
    wrong = [r for r in failing if not EXPECTED[name](r)]
    assert not wrong, f"{name} failed unexpected rows:\n" + run_parity.format_rows(wrong[:10])
    out = capsys.readouterr().out
    assert f"planted fault: {name}" in out and "FAIL" in out


@pytest.mark.parametrize("name", ["softmax-backward-no-sum", "dropout-not-rescaled",
                                  "torch-heads-reversed"])
def test_planted_fault_fails_low_precision_rows_too(name):
    """float32 rows compare against a golden result and a baseline; they must flag faults as well."""
    cases = [c for c in harness.build_cases(["float32"]) if c.mode == "train"
             and c.spec.name in ("CausalAttention", "MultiHeadAttentionWrapper")]
    with faults.plant(name):
        rows = harness.run_matrix(cases)
    assert any(not r["passed"] for r in rows), f"{name}: every float32 row passed"


LOW_DTYPES = [d for d in ("bfloat16", "float16") if harness.dtype_supported(d, "cpu")]
ONE_CONFIG = "T 5 < ctx 8, bias"            # bias, batch 2, head_dim 3, two heads
BLOCKWISE_CONFIG = "T 13, tiles 3x4, bias"  # several query and key tiles
# Shows only where scores rise by thousands: the blockwise family's "large
# scores" config, which runs in float64 alone (see harness.CONFIGS_BLOCKWISE).
FLOAT64_ONLY = ("blockwise-max-not-updated",)
# The variants' family runs in float64 and float32 (NumPy has no lower precision):
# its faults are tested there (test_planted_variant_fault_fails_float32_rows).


@pytest.mark.parametrize("name", [n for n in faults.names()
                                  if n not in FLOAT64_ONLY and n not in VARIANT_FAULTS])
def test_planted_fault_fails_bfloat16_and_float16_runs(name):
    """In these dtypes NumPy is only the golden reference: its faults must still show
    (as "golden vs torch f64" rows), and PyTorch's in its own rows (against the
    golden, or its mask buffer)."""
    module = "MultiHeadAttentionWrapper" if name == "torch-heads-reversed" else "MultiHeadAttention"
    config = ONE_CONFIG
    if name.startswith("blockwise-"):
        module, config = "BlockwiseMultiHeadAttention", BLOCKWISE_CONFIG
    cases = [c for c in harness.build_cases(LOW_DTYPES, ["cpu"], [module])
             if c.config.label == config]
    with faults.plant(name):
        rows = harness.run_matrix(cases)
    failing = [r for r in rows if not r["passed"]]
    for dtype in LOW_DTYPES:
        assert any(r["dtype"] == dtype for r in failing), f"{name}: every {dtype} row passed"
    wrong = [r for r in failing if not EXPECTED[name](r)]
    assert not wrong, f"{name} failed unexpected rows:\n" + run_parity.format_rows(wrong[:10])
    golden_check = [r for r in failing if r["check"] == "golden vs torch f64"]
    if faults.FAULTS[name].side == "numpy":
        assert golden_check, f"{name}: the golden's own check did not fail"
    else:
        assert len(golden_check) < len(failing), f"{name}: only the golden's check failed"


def test_without_a_fault_everything_passes(tmp_path, capsys):
    status, report = _run(tmp_path)
    assert status == 0
    assert report["summary"]["failed"] == 0 and report["summary"]["rows"] > 500
    assert all(r["passed"] for r in report["rows"])


def test_plant_restores_everything():
    before = {n: getattr(ops, n) for n in ops.__all__}
    torch_before = (torch_attention._causal_mask, torch_attention.torch)
    for name in faults.names():
        with faults.plant(name):
            pass
    assert {n: getattr(ops, n) for n in ops.__all__} == before
    assert (torch_attention._causal_mask, torch_attention.torch) == torch_before


def test_plant_restores_after_an_exception():
    original = ops.softmax_backward
    with pytest.raises(RuntimeError):
        with faults.plant("softmax-backward-no-sum"):
            assert ops.softmax_backward is not original
            raise RuntimeError("boom")
    assert ops.softmax_backward is original


def test_unknown_fault_is_refused(capsys):
    with pytest.raises(ValueError, match="fault must be one of"):
        with faults.plant("no-such-fault"):
            pass
    assert run_parity.main(["--plant-fault", "no-such-fault"]) == 2
    assert "--plant-fault must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_a_numpy_fault_fails_a_low_precision_only_command(dtype, tmp_path, capsys):
    """``--dtype bfloat16`` alone: NumPy has no side of its own there, and still its
    fault makes the command exit 1."""
    status, report = _run(tmp_path, "--dtype", dtype, "--module", "SelfAttention_v2",
                          "--plant-fault", "softmax-backward-no-sum")
    assert status == 1
    assert {r["check"] for r in report["rows"] if not r["passed"]} == {"golden vs torch f64"}


@pytest.mark.parametrize("name", list(VARIANT_FAULTS))
def test_planted_variant_fault_fails_float32_rows(name):
    """The variants' float32 rows hold the reference to its float64 golden: a
    fault in the code shows there too (as the golden's own check or the float32 side)."""
    cases = [c for c in harness.build_cases(["float32"], ["cpu"], ["reference_attention"])]
    with faults.plant(name):
        rows = harness.run_matrix(cases)
    assert any(not r["passed"] for r in rows), f"{name}: every float32 row passed"
