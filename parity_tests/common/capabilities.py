"""What the installed PyTorch can do, and the first release that could.

The project runs on PyTorch 2.1 and later (``pyproject.toml``; CI proves the floor and the
newest release).  A few things it calls came later; each is probed here once (an import, an
attribute, a keyword tried on a tiny call), never read off the version string, so a
nightly or a backport answers for itself.  ``lacks(name)`` is None where the installed
PyTorch has it, else the sentence a built-in target answers with::

    needs PyTorch ≥ 2.5: scaled_dot_product_attention(enable_gqa=) (this is 2.1.2)

``refusal(e)`` reads an exception PyTorch raised inside a built-in target: its own words
when they are a refusal of the shape, dtype or backend (``NYI``, "not supported", "not
implemented", "No available kernel"), else None.  Only the built-in targets translate a
refusal into "not supported"; a user's kernel that raises FAILS, whatever it says.
"""

import contextlib
import functools
import importlib
import re

import torch

__all__ = ["NEEDS", "lacks", "has", "dtype_lacks", "sdpa_backend", "sdpa", "refusal", "version"]


def version():
    """The installed PyTorch's version, without its local build tag (``2.1.2``)."""
    return torch.__version__.split("+")[0]


def _imports(module, *names):
    def probe():
        try:
            m = importlib.import_module(module)
        except ImportError:
            return False
        return all(hasattr(m, n) for n in names)
    return probe


def _sdpa_takes_enable_gqa():
    q = torch.zeros(1, 2, 1, 1)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


def _sdpa_zero_rows():
    q = torch.ones(1, 1, 2, 1)
    seen = torch.tensor([[False, False], [True, True]])              # row 0 sees no key
    with sdpa_backend("MATH"):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=seen)
    return bool(torch.isfinite(out).all())


def _cpu_float16_matmul():
    a = torch.ones(2, 2, dtype=torch.float16)
    try:
        a @ a
    except RuntimeError:                 # "addmm_impl_cpu_" not implemented for 'Half'
        return False
    return True


def _flex_any_head_dim():
    from parity_tests.common.flex import attend
    q = torch.zeros(1, 1, 2, 3)
    try:
        attend(q, q, q[..., :2])
    except ValueError:                   # "NYI: Currently non power of 2 embedding dimension ..."
        return False
    return True


# name -> (the first PyTorch release that has it, what it is, how to tell it is here)
NEEDS = {
    "cpu_float16_matmul": ("2.2", "float16 matrix products on the CPU", _cpu_float16_matmul),
    "sdpa_kernel": ("2.3", "torch.nn.attention.sdpa_kernel",
                    _imports("torch.nn.attention", "sdpa_kernel", "SDPBackend")),
    "sdpa_cudnn": ("2.3", "SDPA's cuDNN backend (SDPBackend.CUDNN_ATTENTION)",
                   lambda: _imports("torch.nn.attention", "SDPBackend")()
                   and hasattr(importlib.import_module("torch.nn.attention").SDPBackend, "CUDNN_ATTENTION")),
    "enable_gqa": ("2.5", "scaled_dot_product_attention(enable_gqa=)", _sdpa_takes_enable_gqa),
    "sdpa_zero_rows": ("2.5", "scaled_dot_product_attention's zeros on a row that sees no key (NaN before)",
                       _sdpa_zero_rows),
    "flex_attention": ("2.5", "torch.nn.attention.flex_attention",
                       _imports("torch.nn.attention.flex_attention", "flex_attention", "create_block_mask")),
    "flex_any_head_dim": ("2.7", "FlexAttention on head dims that are not powers of 2, and Dv ≠ Dqk",
                          lambda: has("flex_attention") and _flex_any_head_dim()),
    "paged_attention": ("2.6", "torch.nn.attention.experimental._paged_attention.PagedAttention",
                        _imports("torch.nn.attention.experimental._paged_attention", "PagedAttention")),
    "set_stance": ("2.6", "torch.compiler.set_stance", lambda: hasattr(torch.compiler, "set_stance")),
}


@functools.lru_cache(maxsize=None)
def has(name):
    """Whether the installed PyTorch has ``name`` (a key of `NEEDS`)."""
    return bool(NEEDS[name][2]())


def lacks(*names):
    """None where the installed PyTorch has each of ``names``, else why not (the first it
    lacks), as a target answers."""
    for name in names:
        if not has(name):
            first, what, _ = NEEDS[name]
            return f"needs PyTorch ≥ {first}: {what} (this is {version()})"
    return None


def dtype_lacks(dtype, device):
    """None where the installed PyTorch computes attention in ``dtype`` (a name) on
    ``device``, else why not (float16 on the CPU: matrix products from PyTorch 2.2)."""
    if dtype == "float16" and torch.device(device).type == "cpu":
        return lacks("cpu_float16_matmul")
    return None


# SDPA's backends by the names of torch.nn.attention.SDPBackend; before it (PyTorch 2.1, 2.2)
# the same choice is torch.backends.cuda.sdp_kernel's flags, which rule the CPU too.
_SDP_KERNEL_FLAGS = {"MATH": "enable_math", "FLASH_ATTENTION": "enable_flash",
                     "EFFICIENT_ATTENTION": "enable_mem_efficient"}


def sdpa_backend(backend):
    """A context restricting ``scaled_dot_product_attention`` to ``backend`` (an SDPBackend
    member's name; None: PyTorch's own choice).  ValueError with `lacks`'s sentence where
    the installed PyTorch cannot select it."""
    if backend is None:
        return contextlib.nullcontext()
    if has("sdpa_kernel"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if not hasattr(SDPBackend, backend):
            raise ValueError(lacks("sdpa_cudnn") if backend == "CUDNN_ATTENTION" else
                             f"PyTorch {version()} has no SDPA backend {backend}")
        return sdpa_kernel([getattr(SDPBackend, backend)])
    if backend not in _SDP_KERNEL_FLAGS:
        raise ValueError(lacks("sdpa_cudnn" if backend == "CUDNN_ATTENTION" else "sdpa_kernel"))
    return torch.backends.cuda.sdp_kernel(**{flag: flag == _SDP_KERNEL_FLAGS[backend]
                                             for flag in _SDP_KERNEL_FLAGS.values()})


def sdpa(q, k, v, **kwargs):
    """``scaled_dot_product_attention`` with grouped heads on every PyTorch: ``enable_gqa``
    where it exists, else k and v repeated to q's heads (the same arithmetic; autograd sums
    each group's gradients back into its kv head)."""
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1 and not has("enable_gqa"):
        k, v = (t.repeat_interleave(groups, dim=-3) for t in (k, v))
    elif groups > 1:
        kwargs["enable_gqa"] = True
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)


# PyTorch's words when it declines a shape, dtype or backend (RuntimeError, ValueError,
# NotImplementedError or dynamo's own, depending on the release).
_REFUSAL = re.compile(r"\bNYI\b|not (yet )?supported|not implemented|no available kernel|unsupported",
                      re.IGNORECASE)


def refusal(e):
    """PyTorch's own words when ``e`` is its refusal of a case (first line), else None."""
    if not isinstance(e, (RuntimeError, ValueError, NotImplementedError)) and \
            not type(e).__module__.startswith("torch"):
        return None
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200] if _REFUSAL.search(str(e)) or isinstance(e, NotImplementedError) else None
