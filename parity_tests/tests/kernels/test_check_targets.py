"""The built-in targets pass; refusals are "not supported", never passes; layouts,
alignments and dtypes are what they say."""

import pytest
import torch
import torch.nn.functional as F

import parity_tests
from parity_tests import cli
from parity_tests.common import capabilities
from parity_tests.kernels import targets
from parity_tests.kernels.planted.chapter import GALLERY
from needs import as_if_lacking, needs

TINY = dict(tokens=["1", "17", "45x77"], head_dims=[40], heads=[2], batch=[2])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _one_key_dq_is_not_zero(name):
    """Whether ``name``'s bfloat16 backward leaves dq ≠ 0 with one key, where dS = P ∘ (dP − D)
    is 0 in exact arithmetic (P = 1, O = v): it rounds dP = dO vᵀ and D = rowsum(dO ∘ O)
    to bfloat16 apart, where FlashAttention's kernels keep both in float32.  PyTorch's own:
    the CPU flash kernel of 2.1 and 2.2, FlexAttention's eager backward of 2.5 to 2.9 (2.13
    refuses it on the CPU)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, 1, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    q.requires_grad_()
    try:
        if name == "flex":
            from parity_tests.common.flex import attend
            out = attend(q, k, v)
        else:
            with capabilities.sdpa_backend("FLASH_ATTENTION"):
                out = F.scaled_dot_product_attention(q, k, v)
        out.backward(do)
    except (RuntimeError, NotImplementedError):          # no backward here: nothing to round
        return False
    return bool(q.grad.abs().max() > 0)


def _expected_of(name, report):
    """The rows a built-in target fails on this PyTorch: PyTorch's own precision loss, found."""
    if name in ("sdpa-flash", "flex") and _one_key_dq_is_not_zero(name):
        return {(r.case, r.dtype, r.tensor) for r in report.rows
                if " T1 " in r.case and r.dtype == "bfloat16" and r.tensor in ("dq", "dk") and r.verdict != "not supported"}
    return set()


# flex-paged takes the paged form only, and on CPU lets the NaN of unused pages through:
# test_check_serving.py holds it to that.  FlexAttention takes D = 64 on every release (2.5 and
# 2.6 refuse 40: "NYI: non power of 2 embedding dimension").
@pytest.mark.parametrize("name", [pytest.param(n, marks=needs(*targets.NEEDS.get(n, ())))
                                  for n in targets.builtin_names("cpu") if n != "flex-paged"])
def test_every_builtin_target_passes_on_cpu(name):
    tiny = {**TINY, "head_dims": [40, 64]} if name == "flex" else TINY
    report = parity_tests.check(name, dtypes=["float32", "bfloat16"], **tiny)
    failing = {(r.case, r.dtype, r.tensor) for r in report.failures}
    assert failing == _expected_of(name, report), str(report)
    ran = [r for r in report.rows if r.verdict == "pass"]
    assert ran and all(r.error <= r.bound for r in ran)


def test_a_kernel_that_refuses_its_backward_is_checked_on_its_forward():
    def forward_only(q, k, v, *, causal, scale):
        if q.requires_grad:
            raise targets.Unsupported("no backward on this device")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    report = parity_tests.check(forward_only, dtypes=["float32"], tokens=["17"], causal="yes")
    assert report.passed, str(report)
    rows = {r.tensor: (r.verdict, r.note) for r in report.rows if r.case == "B1 H2 T17 D64 causal"}
    assert rows["out"][0] == "pass"
    assert all(rows[g] == ("not supported", "forward only: no backward on this device") for g in ("dq", "dk", "dv"))


@needs("flex_attention")
def test_flex_is_checked_forward_only_on_cpu_where_its_backward_is_refused():
    report = parity_tests.check("flex", dtypes=["float32"], tokens=["17"], head_dims=[64], causal="yes")
    verdicts = {r.tensor: (r.verdict, r.note) for r in report.rows}
    assert verdicts["out"][0] == "pass"
    for grad in ("dq", "dk", "dv"):                     # PyTorch 2.5 to 2.9 run it on the CPU
        assert verdicts[grad][0] == "pass" or \
            verdicts[grad][0] == "not supported" and verdicts[grad][1].startswith("forward only")


def test_a_builtin_target_this_pytorch_lacks_is_not_supported_and_passes(monkeypatch, capsys):
    """A built-in whose PyTorch feature is missing answers every case "not supported" with
    the release that brought it; the run passes (an answer about the installed PyTorch, not a
    failure of the kernel), from Python and from the command.  Forced here on any PyTorch."""
    as_if_lacking(monkeypatch, "flex_attention")
    report = parity_tests.check("flex", dtypes=["float32"], tokens=["17"])
    want = f"needs PyTorch ≥ 2.5: torch.nn.attention.flex_attention (this is {capabilities.version()})"
    assert report.rows and {(r.verdict, r.note) for r in report.rows} == {("not supported", want)}
    assert report.passed and report.unavailable == want
    assert cli.main(["check", "flex", "--dtype", "float32", "--tokens", "17", "-q"]) == 0
    assert f"flex is not supported here: {want}" in capsys.readouterr().out


def test_pytorchs_own_refusal_is_not_supported_in_a_builtin_and_a_failure_in_a_users_kernel(monkeypatch):
    """The words PyTorch 2.5's FlexAttention said for D = 40, raised inside SDPA: the built-in
    target's rows are "not supported" with them; a user's kernel raising the same FAILS."""
    said = "NYI: Currently non power of 2 embedding dimension are not supported. Got E=40 and Ev=40."
    sdpa = F.scaled_dot_product_attention

    def refusing(q, k, v, **kw):
        if q.shape[-1] == 40:
            raise ValueError(said)
        return sdpa(q, k, v, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", refusing)
    report = parity_tests.check("sdpa-math", dtypes=["float32"], tokens=["17"], head_dims=[40, 64])
    assert report.passed, str(report)
    refused = {r.note for r in report.rows if r.verdict == "not supported"}
    assert refused == {said} and any(r.passed for r in report.rows)

    def users(q, k, v, *, causal, scale):
        return refusing(q, k, v, is_causal=causal, scale=scale)
    report = parity_tests.check(users, dtypes=["float32"], tokens=["17"], head_dims=[40, 64])
    assert not report.passed and report.failures
    assert {r.note for r in report.failures} == {f"raised ValueError: {said}"}


needs_stance = needs("flex_attention", "set_stance")


@needs_stance
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_untraced_on_cpu_is_the_traced_call_bit_for_bit(dtype):
    """``common.flex.unfused``: the same unfused computation without dynamo's trace."""
    import warnings
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from parity_tests.common.flex import unfused
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 33, 24, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 40, 24, generator=g).to(dtype) for _ in range(2))
    slopes = torch.rand(4, generator=g)
    score_mod = lambda s, b, h, i, j: 20.0 * torch.tanh(s / 20.0) - slopes[h] * (i + 7 - j).abs()
    mask = create_block_mask(lambda b, h, i, j: (j <= i + 7) & (j > i - 9), None, None, 33, 40, device="cpu")
    call = lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # "called without torch.compile"
        traced = call()
        with unfused("cpu"):
            untraced = call()
    assert all(torch.equal(a, b) for a, b in zip(traced, untraced))


@needs_stance
def test_the_flex_targets_on_cpu_are_not_traced():
    import torch._dynamo.utils as dynamo
    before = dynamo.counters["stats"]["unique_graphs"]
    assert parity_tests.check("flex", dtypes=["float32"], tokens=["17", "45x77"], features=["softcap"]).passed
    assert dynamo.counters["stats"]["unique_graphs"] == before


def test_a_refused_case_is_not_supported_never_a_pass():
    report = parity_tests.check("torch_impl-fused", dtypes=["float32"], tokens=["17"], causal="no")
    assert {r.verdict for r in report.rows} == {"not supported"}
    assert "causal by construction" in report.rows[0].note
    assert not report.passed                 # nothing ran: nothing was checked

    def refuses(q, k, v, *, causal, scale):
        raise targets.Unsupported("head_dim 40 is not supported")
    report = parity_tests.check(refuses, dtypes=["float32"], tokens=["17"], head_dims=[40])
    assert {r.verdict for r in report.rows} == {"not supported"} and not report.passed
    assert "head_dim 40" in report.rows[0].note


def test_float64_where_the_target_takes_it():
    assert parity_tests.check("sdpa-math", dtypes=["float64"], **TINY).passed


def test_a_user_kernel_in_bthd_layout():
    def flash_like(q, k, v, *, causal, scale):          # (B, T, H, D) in and out
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, scale=scale)
        return out.transpose(1, 2)
    assert parity_tests.check(flash_like, layout="bthd", dtypes=["float32"], **TINY).passed
    wrong = parity_tests.check(flash_like, dtypes=["float32"], **TINY)      # handed (B, H, T, D)
    assert wrong.diagnosis == "layout-bthd-as-bhtd"


def test_bottom_right_alignment_is_an_option():
    kernel = GALLERY["bottom_right"][0]
    grid = dict(tokens=["45x77", "77x45"], head_dims=[16], heads=[2], batch=[1], dtypes=["float32"])
    assert parity_tests.check(kernel, align="bottom-right", causal="yes", **grid).passed
    # SDPA with the causal_lower_right bias; Tq > Tk leaves rows that see no key: zeros
    report = parity_tests.check("sdpa-math", align="bottom-right", causal="yes", **grid)
    assert report.passed, str(report)


def test_wrong_outputs_fail_with_a_reason():
    def wrong_shape(q, k, v, *, causal, scale):
        return q[..., :-1, :]
    report = parity_tests.check(wrong_shape, dtypes=["float32"], tokens=["17"], causal="no")
    assert {r.verdict for r in report.rows} == {"FAIL"} and "wrong shape" in report.rows[0].note

    def nan(q, k, v, *, causal, scale):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal) * torch.nan
    report = parity_tests.check(nan, dtypes=["float32"], tokens=["17"], causal="no")
    assert not report.passed and report.rows[0].where == (0, 0, 0)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(targets.builtin_names("cuda")))
def test_every_builtin_target_on_cuda(name):
    report = parity_tests.check(name, device="cuda", dtypes=["float32", "bfloat16", "float16"], **TINY)
    assert not report.failures, str(report)
