"""What can be checked: built-in targets by name, or a user's ``module.path:callable``.

Every target is called as ``fn(q, k, v, *, causal, scale)`` with tensors in its
layout -- (B, H, T, D), or (B, T, H, D) for ``layout="bthd"`` (the layout of
``flash_attn_func``) -- and returns the output in the same layout.  A target
that declares it cannot run a case raises `Unsupported` (or names the case in
its ``refuses``): the check reports that case "not supported" with the message,
never as a pass.  Any other exception is a failure of the case.

Built in:

- ``sdpa-math``, ``sdpa-flash`` (CPU and CUDA), ``sdpa-efficient``,
  ``sdpa-cudnn`` (CUDA): ``scaled_dot_product_attention`` restricted to one
  backend with ``torch.nn.attention.sdpa_kernel`` (``torch.backends.cuda.sdp_kernel``
  before PyTorch 2.3: ``capabilities.sdpa_backend``).  Causal is ``is_causal``
  (top-left) or, for bottom-right alignment with Tq != Tk, the
  ``causal_lower_right`` bias.
- ``torch_impl-mha``: the attention core of ``torch_impl.MultiHeadAttention``
  (mask, softmax, weights @ values), reached through the module itself with
  projections that select q, k and v out of one input and an identity output
  projection: selecting with 0/1 weights is exact in every dtype, so the module's
  own arithmetic is what is measured.  Self-attention: Tq = Tk only.  Not
  causal: the ``mask`` buffer zeroed.
- ``torch_impl-fused``: the same through ``FusedMultiHeadAttention``; causal only
  (it always passes ``is_causal=True``).
- ``flex``: ``flex_attention`` with a causal ``mask_mod``; compiled on CUDA,
  eager (unfused) on CPU, where PyTorch refuses its backward (from 2.13; 2.5 to 2.9 run
  it): forward only.

A built-in target that needs more than the installed PyTorch has (`NEEDS`,
``common.capabilities``) refuses every case with the release that brought it, and what
PyTorch raises inside one when it declines a case (``NYI: ...``) is "not supported" in its
words (``kernels.call``): built-in targets never FAIL on PyTorch's own refusals.
"""

import importlib
import os
import sys
from dataclasses import dataclass, field

import torch

from parity_tests.common import capabilities

__all__ = ["Target", "Unsupported", "builtin_names", "resolve", "user_target", "to_layout", "from_layout"]

ALIGNMENTS = ("top-left", "bottom-right")
FLASH = ("flash", "flash-varlen", "flash-kvcache")        # flash_attn's, when it imports (CUDA)


class Unsupported(Exception):
    """A target refuses a case (a backend that does not take the shape or dtype).
    The only exception the check reports as "not supported": any other FAILS the case."""


@dataclass
class Target:
    """A kernel and what it can do.  ``features``: the features it expresses (None for a
    user callable: its signature says); ``takes_align``: it receives ``align`` on every
    case; ``returns_lse``: True, False, or None when not known (a user callable);
    ``lse_fn``: the same kernel returning ``(out, lse)``, where that is another function;
    ``builtin``: one of PyTorch's (or FlashAttention's) own, whose refusals of a case
    (``NYI``, "not supported") are "not supported" rather than the kernel's failure;
    ``unavailable``: why the installed PyTorch cannot run it at all (`capabilities.lacks`)."""
    name: str
    fn: object                       # fn(q, k, v, *, causal, scale) -> out
    layout: str = "bhtd"
    description: str = ""
    # returns None when the case can run, else why not (checked before calling)
    refuses: object = field(default=lambda case, dtype, device, align: None)
    features: frozenset = None
    takes_align: bool = False
    returns_lse: bool = None
    lse_fn: object = None
    builtin: bool = False
    unavailable: str = None


def _sdpa(name, backend, description):
    from parity_tests.kernels.targets import builtin as feature_targets
    return Target(name, feature_targets.sdpa(backend, Unsupported), description=description,
                  features=feature_targets.SDPA_FEATURES, takes_align=True, returns_lse=False)


def _selection_module(cls, case, dtype, device, causal):
    """``cls(3 H D, H D, T, 0.0, H)`` whose projections pick q, k, v out of x = [q | k | v]."""
    h, d = case.heads, case.head_dim
    width = h * d
    m = cls(3 * width, width, max(case.tq, 1), 0.0, h).to(device=device, dtype=dtype).eval()
    eye = torch.eye(width, dtype=dtype, device=device)
    zero = torch.zeros(width, width, dtype=dtype, device=device)
    with torch.no_grad():
        m.W_query.weight.copy_(torch.cat([eye, zero, zero], dim=1))      # (H D, 3 H D)
        m.W_key.weight.copy_(torch.cat([zero, eye, zero], dim=1))
        m.W_value.weight.copy_(torch.cat([zero, zero, eye], dim=1))
        m.out_proj.weight.copy_(eye)
        m.out_proj.bias.zero_()
        if not causal:
            m.mask.zero_()
    return m


def _through_module(cls_name):
    def fn(q, k, v, *, causal, scale):
        import torch_impl
        from parity_tests.kernels.cases import Case
        b, h, t, d = q.shape                                            # (B, H, T, D)
        case = Case(b, h, t, t, d, causal)
        with torch.random.fork_rng(devices=[]):        # the module's own init draws: not the kernel's
            m = _selection_module(getattr(torch_impl, cls_name), case, q.dtype, q.device, causal)
        merge = lambda x: x.transpose(1, 2).reshape(b, t, h * d)          # (B, T, H D)
        x = torch.cat([merge(q), merge(k), merge(v)], dim=-1)            # (B, T, 3 H D)
        out = m(x)                                                       # (B, T, H D)
        return out.view(b, t, h, d).transpose(1, 2)                      # (B, H, T, D)
    return fn


def _self_attention_only(case, dtype, device, align):
    if case.tq != case.tk:
        return "self-attention module: query and key lengths must be equal"
    if abs(case.scale * case.head_dim ** 0.5 - 1) > 1e-12:
        return "the chapter's modules scale by 1/sqrt(head_dim) only"
    return None


def _causal_self_attention_only(case, dtype, device, align):
    if not case.causal:
        return "FusedMultiHeadAttention is causal by construction"
    return _self_attention_only(case, dtype, device, align)


# The built-in SDPA targets: name -> the torch.nn.attention.SDPBackend member each selects.
SDPA_BACKENDS = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
                 "sdpa-cudnn": "CUDNN_ATTENTION"}


def _builtins(device):
    sdpa = lambda name, text: _sdpa(name, SDPA_BACKENDS[name], text)
    targets = {
        "sdpa-math": sdpa("sdpa-math", "SDPA, math backend"),
        "sdpa-flash": sdpa("sdpa-flash", "SDPA, FlashAttention backend (the CPU flash kernel on CPU)"),
    }
    if device == "cuda":
        targets["sdpa-efficient"] = sdpa("sdpa-efficient", "SDPA, memory-efficient backend")
        targets["sdpa-cudnn"] = sdpa("sdpa-cudnn", "SDPA, cuDNN backend")
    plain = dict(features=frozenset({"deterministic"}), returns_lse=False)
    targets["torch_impl-mha"] = Target(
        "torch_impl-mha", _through_module("MultiHeadAttention"),
        description="torch_impl.MultiHeadAttention's attention core", refuses=_self_attention_only, **plain)
    targets["torch_impl-fused"] = Target(
        "torch_impl-fused", _through_module("FusedMultiHeadAttention"),
        description="torch_impl.FusedMultiHeadAttention's attention core (SDPA, causal)",
        refuses=_causal_self_attention_only, **plain)
    from parity_tests.kernels.targets import builtin as feature_targets
    targets["flex"] = Target("flex", feature_targets.flex(Unsupported), description="FlexAttention (forward only on CPU)",
                             features=feature_targets.FLEX_FEATURES, takes_align=True, returns_lse=True,
                             lse_fn=feature_targets.flex(Unsupported, lse=True))
    from parity_tests.kernels.targets import serving as serving_targets
    targets["flex-paged"] = Target("flex-paged", serving_targets.flex_paged(Unsupported), "bthd",
                                   "PyTorch's paged attention on FlexAttention (--features paged; forward only)",
                                   serving_targets.refuses, features=serving_targets.FLEX_PAGED_FEATURES,
                                   returns_lse=False)
    if device == "cuda" and feature_targets.flash_unavailable() is None:
        targets.update(feature_targets.flash_targets(
            lambda name, fn, layout, description, refuses, features: Target(
                name, fn, layout, description, refuses, features=features, returns_lse=False)))
    return {name: _builtin(t, capabilities.lacks(*NEEDS.get(name, ()))) for name, t in targets.items()}


# What each built-in target needs of PyTorch beyond the floor (`capabilities.NEEDS`'s names).
NEEDS = {"sdpa-cudnn": ("sdpa_cudnn",), "flex": ("flex_attention",),
         "flex-paged": ("flex_attention", "paged_attention")}


def _builtin(t, unavailable=None):
    """``t`` marked built in; one the installed PyTorch cannot run (``unavailable``: why)
    refuses every case with why."""
    t.builtin, t.unavailable = True, unavailable
    if t.unavailable:
        t.refuses = lambda case, dtype, device, align, why=t.unavailable: why
        t.description += f" -- not supported: {t.unavailable}"
    return t


def sdpa_yardstick():
    """SDPA with PyTorch's own choice of backend: what each row's time and error are set beside."""
    return _builtin(_sdpa("sdpa", None, "SDPA, PyTorch's choice of backend"))


def builtin_names(device="cpu"):
    """``{name: description}`` of the built-in targets on ``device``."""
    return {n: t.description for n, t in _builtins(device).items()}


def _plain_name(fn):
    """``attention`` for a closure (not ``make.<locals>.attention``), ``Cls.method`` for a method."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return name.rsplit("<locals>.", 1)[-1]


def user_target(fn, layout="bhtd", name=None):
    """A user's callable: what it takes is read from its signature (``align``)."""
    if not callable(fn):
        raise TypeError(f"target must be a callable or a name, got {type(fn).__name__}")
    return Target(name or _plain_name(fn), fn, layout=layout, description="user callable",
                  takes_align=_names_align(fn))


def _names_align(fn):
    """Only a signature that names ``align`` receives it (not one taking ``**kwargs``)."""
    import inspect
    try:
        return "align" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _one_line(e):
    """``Type: message`` (with the file and line of a SyntaxError)."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({os.path.basename(e.filename or '?')}, line {e.lineno})"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}".rstrip(": ")


def _import_callable(spec):
    """The callable ``module.path:name`` or ``path/to/file.py:name`` names (a file's folder is
    searched for its own imports, as ``python file.py`` would)."""
    module_name, _, attr = spec.rpartition(":") if ".py:" in spec else spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"target must be a built-in name, module.path:callable or file.py:callable, got {spec!r}")
    if module_name.endswith(".py") and not os.path.isfile(os.path.expanduser(module_name)):
        raise ValueError(f"target {spec!r}: no file {module_name}")
    if os.getcwd() not in sys.path:         # a module in the current directory, as python -m would
        sys.path.insert(0, os.getcwd())
    try:
        obj = _load_file(spec, module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"target {spec!r}: cannot import {module_name!r} ({e})") from None
    except SystemExit as e:
        raise ValueError(f"target {spec!r}: importing {module_name!r} called sys.exit({e.code!r})") from None
    except Exception as e:                            # noqa: BLE001 - the module's own error, in one line
        raise ValueError(f"target {spec!r}: importing {module_name!r} raised {_one_line(e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"target {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _load_file(spec, path):
    """The module of the file ``path``, loaded once under a name of its own."""
    import importlib.util
    full = os.path.abspath(os.path.expanduser(path))
    name = "_attention_target_" + "".join(c if c.isalnum() else "_" for c in full)
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    loader = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    try:
        loader.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def resolve(target, device="cpu", layout="bhtd"):
    """A `Target` from a built-in name, ``module.path:callable`` or a callable."""
    if layout not in ("bhtd", "bthd"):
        raise ValueError(f"layout must be 'bhtd' or 'bthd', got {layout!r}")
    if isinstance(target, Target):
        return target
    if callable(target):
        return user_target(target, layout)
    if not isinstance(target, str):
        raise TypeError(f"target must be a callable or a name, got {type(target).__name__}")
    builtins = _builtins(device)
    if target in FLASH and target not in builtins:
        from parity_tests.kernels.targets.builtin import flash_unavailable
        why = "it runs on CUDA only" if device != "cuda" else flash_unavailable()
        raise ValueError(f"target {target!r} (FlashAttention) is not available here: {why}")
    if target in builtins:
        if layout != "bhtd":
            raise ValueError(f"layout applies to user callables; the built-in {target!r} takes (B, H, T, D)")
        return builtins[target]
    if ":" not in target:
        raise ValueError(f"target must be one of {', '.join(builtins)} on {device}, "
                         f"or module.path:callable; got {target!r}")
    return user_target(_import_callable(target), layout, name=target)


def to_layout(x, layout):
    """(B, H, T, D) -> the target's layout (a view: ``call`` chooses the strides)."""
    return x.transpose(1, 2) if layout == "bthd" else x


def from_layout(x, layout):
    """The target's layout -> (B, H, T, D)."""
    return x.transpose(1, 2) if layout == "bthd" else x
