"""Argument checks shared by every module of ``torch_impl``.

The chapter's code fails on bad input with whatever PyTorch happens to say
(``The size of tensor a (7) must match the size of tensor b (6)`` for one token
too many).  These helpers refuse it first, with a message that names the
argument and says what was expected: ``TypeError`` for a wrong type,
``ValueError`` for a wrong value.  They only read their arguments, so a refused
call leaves every module exactly as it was.

``CheckedModule`` gives ``load_state_dict`` the same guarantee: ``nn.Module``'s
own copies every matching entry and only then raises ``RuntimeError`` for the
bad ones, leaving a half-loaded model; here every entry is checked first.
"""

import numbers
import operator
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn as nn

# What each input rank means, for the messages.
_LAYOUTS = {2: "(num_tokens, d_in)", 3: "(batch, num_tokens, d_in)"}


def check_size(name, value):
    """``value`` as a positive ``int``; bools and floats are refused."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive integer, got the bool {value!r}")
    try:
        size = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a positive integer, got {type(value).__name__} {value!r}"
        ) from None
    if size <= 0:
        raise ValueError(f"{name} must be a positive integer, got {size}")
    return size


def check_dropout(dropout):
    """``dropout`` as a float in ``[0, 1]``; 1.0 drops every weight, as ``nn.Dropout(1.0)``."""
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(
            f"dropout must be a number in [0, 1], got {type(dropout).__name__} {dropout!r}"
        )
    p = float(dropout)
    if not 0.0 <= p <= 1.0:  # also refuses NaN
        raise ValueError(f"dropout must be in [0, 1], got {p}")
    return p


def check_flag(name, value):
    """``value`` as a bool: catches ``num_heads`` passed by position into ``qkv_bias``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_heads(d_out, num_heads):
    """``d_out`` splits evenly into ``num_heads`` heads of ``head_dim = d_out // num_heads``."""
    d_out = check_size("d_out", d_out)
    num_heads = check_size("num_heads", num_heads)
    if d_out % num_heads != 0:
        raise ValueError(
            f"d_out must be divisible by num_heads, got d_out={d_out} and num_heads={num_heads}"
        )
    return d_out, num_heads


def check_input(x, ndim, d_in=None, context_length=None, weight=None):
    """Refuse an ``x`` the forward pass cannot mean.

    ``x`` must be a floating-point ``torch.Tensor`` with ``ndim`` dimensions,
    a last dimension of ``d_in`` (when given) and at most ``context_length``
    tokens (when given: the causal mask is built for that many), and on the
    device and in the dtype of ``weight`` (when given).  Values are not
    inspected: NaN and infinity propagate, as in PyTorch.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must hold floating-point numbers, got dtype {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(
            f"x must be {ndim}-D {_LAYOUTS[ndim]}, got {x.dim()}-D with shape {tuple(x.shape)}"
        )
    if d_in is not None and x.shape[-1] != d_in:
        raise ValueError(
            f"x's last dimension must be d_in={d_in}, got {x.shape[-1]} (shape {tuple(x.shape)})"
        )
    num_tokens = x.shape[-2]
    if num_tokens == 0:
        raise ValueError(f"x must hold at least one token, got shape {tuple(x.shape)}")
    if context_length is not None and num_tokens > context_length:
        raise ValueError(
            f"x has {num_tokens} tokens but context_length={context_length}: "
            f"the causal mask covers at most context_length tokens"
        )
    if weight is not None:
        _check_like(x, weight)


def _check_like(x, weight):
    """``x`` on the weights' device, in their dtype (unless autocast picks dtypes)."""
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the module's weights are on "
                         f"{weight.device}: move one of them with .to(...)")
    if x.dtype != weight.dtype and not _autocast_enabled(x.device.type):
        raise TypeError(f"x has dtype {x.dtype} but the module's weights have "
                        f"{weight.dtype}: convert x with .to({weight.dtype}) or the "
                        f"module with .to({x.dtype})")


def _autocast_enabled(device_type):
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:                    # PyTorch before 2.4 takes no device type: its
        if device_type == "cpu":         # is_autocast_enabled() is CUDA's
            return torch.is_autocast_cpu_enabled()
        return torch.is_autocast_enabled()


class CheckedModule(nn.Module):
    """``nn.Module`` whose ``load_state_dict`` checks every entry before any weight
    changes, as ``numpy_ref`` does: a missing or unknown key (when ``strict``), a
    wrong shape or a value that is not floating-point numbers is refused with an
    error naming the key, and then no parameter or buffer has changed.

    ``strict=False`` keeps PyTorch's meaning: unknown keys are ignored and missing
    ones left as they are (both listed in the returned ``missing_keys`` /
    ``unexpected_keys``); a wrong shape is still refused.  Values may be tensors
    or anything ``numpy.asarray`` takes (a NumPy module's ``state_dict()``).
    """

    def load_state_dict(self, state_dict, strict=True, assign=False):
        checked = check_state_dict(self.state_dict(), state_dict, strict)
        return super().load_state_dict(checked, strict=strict, assign=assign)


def check_state_dict(expected, state_dict, strict):
    """``state_dict`` with every value expected in ``expected`` as a tensor of the
    expected shape; raises before anything is loaded."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, "
                        f"got {type(state_dict).__name__}")
    if strict:
        missing = [k for k in expected if k not in state_dict]
        unknown = [k for k in state_dict if k not in expected]
        if missing:
            raise ValueError(f"state_dict is missing key(s) {missing}")
        if unknown:
            raise ValueError(f"state_dict has unexpected key(s) {unknown}; "
                             f"expected {list(expected)}")
    checked = OrderedDict()
    for key, value in state_dict.items():
        if key in expected:
            value = _as_tensor(value, key)
            if value.shape != expected[key].shape:
                raise ValueError(f"state_dict[{key!r}] must have shape "
                                 f"{tuple(expected[key].shape)}, got {tuple(value.shape)}")
        checked[key] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:                      # PyTorch's per-module versions
        checked._metadata = metadata
    return checked


def _as_tensor(value, key):
    """A state_dict entry as a floating-point tensor (a NumPy array is wrapped, not copied)."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"state_dict[{key!r}] must be a tensor of floating-point "
                            f"numbers, got {type(value).__name__} ({e})") from None
    if not value.is_floating_point():
        raise TypeError(f"state_dict[{key!r}] must hold floating-point numbers, "
                        f"got dtype {value.dtype}")
    return value
