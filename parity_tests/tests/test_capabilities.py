"""``common.capabilities``: what the installed PyTorch lacks, and the paths the project takes
instead.  The fallbacks of old releases run here too, forced: each must do what the newer
call does."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from parity_tests.common import capabilities
from needs import as_if_lacking

# the aten op each SDPA backend runs on the CPU
CPU_OPS = {"MATH": "aten::_scaled_dot_product_attention_math",
           "FLASH_ATTENTION": "aten::_scaled_dot_product_flash_attention_for_cpu"}


def _ops_run(backend):
    q = torch.randn(1, 2, 16, 8)
    with profile() as p, capabilities.sdpa_backend(backend):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return {e.name for e in p.events() if "scaled_dot_product" in e.name}


@pytest.mark.filterwarnings("ignore:.*sdp_kernel.*is deprecated:FutureWarning")     # forced on a new release
@pytest.mark.parametrize("lacking", [(), ("sdpa_kernel",)], ids=["sdpa_kernel", "sdp_kernel (before 2.3)"])
@pytest.mark.parametrize("backend", list(CPU_OPS))
def test_the_backend_named_is_the_backend_run(monkeypatch, backend, lacking):
    as_if_lacking(monkeypatch, *lacking)
    ran = _ops_run(backend)
    flash = any("flash" in op for op in ran)                 # its op's name moved between releases
    assert (CPU_OPS["MATH"] in ran) == (backend == "MATH") and flash == (backend == "FLASH_ATTENTION"), ran


def test_a_backend_the_release_lacks_is_refused_with_the_release_that_brought_it(monkeypatch):
    as_if_lacking(monkeypatch, "sdpa_kernel", "sdpa_cudnn")
    with pytest.raises(ValueError, match=r"^needs PyTorch ≥ 2\.3: SDPA's cuDNN backend"):
        capabilities.sdpa_backend("CUDNN_ATTENTION")


def test_grouped_heads_without_enable_gqa_are_the_same_arithmetic(monkeypatch):
    """Before PyTorch 2.5 k and v are repeated to q's heads; autograd sums each group back."""
    g = torch.Generator().manual_seed(0)
    q, do = torch.randn(2, 6, 9, 8, generator=g, dtype=torch.float64), torch.randn(2, 6, 9, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))

    def run():
        t = [x.clone().requires_grad_() for x in (q, k, v)]
        out = capabilities.sdpa(*t, scale=0.3)
        out.backward(do)
        return [out] + [x.grad for x in t]
    reference = run()
    expanded = [q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)]
    assert torch.allclose(reference[0], F.scaled_dot_product_attention(*expanded, scale=0.3), rtol=0, atol=1e-14)
    as_if_lacking(monkeypatch, "enable_gqa")
    for a, b in zip(run(), reference):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-14)


def test_a_lack_names_the_release_and_what_it_lacks(monkeypatch):
    monkeypatch.setattr(capabilities, "has", lambda name: name not in ("flex_attention", "paged_attention"))
    said = f"(this is {capabilities.version()})"
    assert capabilities.lacks("flex_attention", "paged_attention") == \
        f"needs PyTorch ≥ 2.5: torch.nn.attention.flex_attention {said}"
    assert capabilities.lacks("paged_attention").startswith("needs PyTorch ≥ 2.6: ")
    assert capabilities.lacks("set_stance", "sdpa_kernel") is capabilities.lacks() is None
    for first, what, _ in capabilities.NEEDS.values():     # every entry names a release
        assert first.startswith("2.") and what


@pytest.mark.parametrize("raised, words", [
    (ValueError("NYI: Currently non power of 2 embedding dimension are not supported. Got E=40."),
     "NYI: Currently non power of 2 embedding dimension are not supported. Got E=40."),
    (NotImplementedError("FlexAttention does not support backward on CPU.\nPlease set ..."),
     "FlexAttention does not support backward on CPU."),
    (RuntimeError("No available kernel. Aborting execution."), "No available kernel. Aborting execution."),
    (RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\''), '"addmm_impl_cpu_" not implemented for \'Half\''),
    (RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"), None),
    (TypeError("got an unexpected keyword argument 'enable_gqa' (not supported)"), None),
    (AssertionError("not supported"), None),
])
def test_pytorchs_refusals_are_read_and_nothing_else(raised, words):
    assert capabilities.refusal(raised) == words
