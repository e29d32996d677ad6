"""A small stand-in for ``nn.Module``: parameters, buffers, grads, state_dict, train/eval.

Parameters live in ``_parameters`` under their PyTorch names (``"W_query.weight"``),
buffers (the causal ``mask``) in ``_buffers``, sub-modules in ``_children``
(``"heads.0"`` ...).  Keys are listed in PyTorch's order: ``named_parameters()``
gives own parameters then each child's; ``state_dict()`` gives own buffers, own
parameters, then each child's (the PyTorch modules keep their weights in
``nn.Linear`` children, which come after the module's own ``mask`` buffer).

Between ``forward`` and ``backward``
------------------------------------
``backward`` differentiates exactly what ``forward`` saw, whatever the caller
does in between:

- ``x`` is copied by ``forward`` (one array of the input's size), so changing
  the caller's ``x`` in place changes no gradient;
- the parameters are copied by ``forward`` too, in the input's dtype (float32
  and float64 inputs alike), so an in-place change to a parameter (an optimiser
  step taken too early) changes no gradient either;
- a ``keep_mask`` given by the caller is *not* copied (it is as large as the
  attention weights); ``forward`` keeps a CRC-32 fingerprint of it instead and
  ``backward`` refuses, with a ``ValueError`` naming ``keep_mask``, if it has
  changed, before any gradient is written.

``backward`` may be called more than once after one ``forward``: each call
computes from the forward's cache (which it does not consume) and *overwrites*
``grads`` with a new dict of new arrays.  PyTorch instead accumulates into
``.grad``; to accumulate here, add the dicts yourself.
"""

import warnings
import zlib
from collections.abc import Mapping
from numbers import Integral, Real

import numpy as np


class Module:
    """Base class of the NumPy attention modules."""

    def __init__(self):
        self.training = True
        self._parameters = {}
        self._buffers = {}
        self._children = {}
        self.grads = {}
        self._cache = None

    # -- calling --------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, x):
        raise NotImplementedError

    def backward(self, grad_out):
        """Gradient with respect to the last forward's ``x``; fills ``grads``.

        May be called again after one forward: each call *overwrites* ``grads``
        (a new dict of new arrays), it never adds to it as PyTorch's ``.grad``
        does.  Refused if a caller's ``keep_mask`` changed since the forward."""
        raise NotImplementedError

    # -- parameters and state -------------------------------------------------

    def named_parameters(self):
        """List of (name, array) in PyTorch's order; the arrays are the live ones."""
        out = list(self._parameters.items())
        for prefix, child in self._children.items():
            out += [(f"{prefix}.{n}", a) for n, a in child.named_parameters()]
        return out

    def _slots(self):
        """(key, owner, store, local name) for every state_dict entry, in order."""
        out = [(n, self, self._buffers, n) for n in self._buffers]
        out += [(n, self, self._parameters, n) for n in self._parameters]
        for prefix, child in self._children.items():
            out += [(f"{prefix}.{k}", o, s, n) for k, o, s, n in child._slots()]
        return out

    def state_dict(self):
        """Copies of every parameter and buffer, keyed and shaped as in PyTorch."""
        return {key: store[name].copy() for key, _, store, name in self._slots()}

    def load_state_dict(self, state_dict):
        """Load arrays (or anything ``np.asarray`` takes) keeping their dtype.

        Every key is checked before any weight changes: a refused load changes
        nothing.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to arrays, "
                            f"got {type(state_dict).__name__}")
        slots = self._slots()
        expected = [key for key, *_ in slots]
        missing = [k for k in expected if k not in state_dict]
        unknown = [k for k in state_dict if k not in expected]
        if missing:
            raise ValueError(f"state_dict is missing key(s) {missing}")
        if unknown:
            raise ValueError(f"state_dict has unexpected key(s) {unknown}; "
                             f"expected {expected}")
        new = {}
        for key, _, store, name in slots:
            value = _as_array(state_dict[key], key)
            if not np.issubdtype(value.dtype, np.floating):
                raise TypeError(f"state_dict[{key!r}] must hold floating-point "
                                f"numbers, got dtype {value.dtype}")
            if value.shape != store[name].shape:
                raise ValueError(f"state_dict[{key!r}] must have shape "
                                 f"{store[name].shape}, got {value.shape}")
            new[key] = np.array(value, copy=True)
        for key, _, store, name in slots:
            store[name] = new[key]

    # -- modes ------------------------------------------------------------------

    def train(self, mode=True):
        """Training mode (dropout active) or not; returns self, as in PyTorch."""
        if not isinstance(mode, (bool, np.bool_)):
            raise TypeError(f"mode must be True or False, got {type(mode).__name__} {mode!r}")
        self.training = bool(mode)
        for child in self._children.values():
            child.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- shared checks ------------------------------------------------------------

    def _check_unchanged(self):
        """Refuse a backward when an array the forward kept by reference (a caller's
        keep_mask) has changed since: its fingerprint no longer matches."""
        if self._cache is None:
            raise ValueError(f"{type(self).__name__}.backward(grad_out) called before "
                             f"forward: there is no forward pass to differentiate")
        for name, array, print_ in self._cache.get("guards", ()):
            if fingerprint(array) != print_:
                raise ValueError(f"{name} was changed in place between forward and "
                                 f"backward: the backward would not match the forward; "
                                 f"run forward again (or pass a copy of {name})")

    def _check_grad_out(self, grad_out):
        """grad_out as an array of the last output's shape and dtype."""
        self._check_unchanged()
        out_shape, dtype = self._cache["out_shape"], self._cache["dtype"]
        grad_out = read_array(grad_out, "grad_out")
        if not np.issubdtype(grad_out.dtype, np.floating):
            raise TypeError(f"grad_out must hold floating-point numbers, "
                            f"got dtype {grad_out.dtype}")
        if grad_out.shape != out_shape:
            raise ValueError(f"grad_out must have the shape of the last output "
                             f"{out_shape}, got {grad_out.shape}")
        return grad_out.astype(dtype, copy=False)


# -- argument checks shared by the constructors and forwards ---------------------

_RAGGED = getattr(np, "exceptions", np).VisibleDeprecationWarning    # np.exceptions from NumPy 1.25

def read_array(value, name):
    """``np.asarray(value)``, with an error naming ``name`` when NumPy cannot read
    it: TypeError for an object it cannot convert (a tensor that requires grad,
    a bfloat16 tensor), ValueError for a ragged nest of lists."""
    try:
        with warnings.catch_warnings():      # NumPy < 1.24 reads a ragged nest as an object
            warnings.simplefilter("error", _RAGGED)      # array, with this warning
            return np.asarray(value)
    except (ValueError, _RAGGED) as e:
        raise ValueError(f"{name} must be a rectangular array of numbers, "
                         f"got a {type(value).__name__} NumPy cannot shape: {e}") from None
    except (TypeError, RuntimeError) as e:
        hint = ""
        if hasattr(value, "detach") and hasattr(value, "cpu"):
            hint = f"; pass a NumPy array, e.g. {name}.detach().cpu().double().numpy()"
        raise TypeError(f"{name} must be an array NumPy can read, got a "
                        f"{type(value).__name__} it cannot ({e}){hint}") from None


def _as_array(value, key):
    """A state_dict entry as a NumPy array.  A PyTorch tensor (recognised by its
    ``detach`` method: NumPy is the only import here) is detached and brought to
    the CPU first, so a CUDA module's or a trained module's state loads too."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
    try:
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"state_dict[{key!r}] must be an array of floating-point numbers "
                        f"(NumPy cannot read {type(value).__name__}: {e})") from None


def check_size(name, value):
    """A positive int (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def check_dropout(value):
    """A drop probability in [0, 1]; 1.0 drops every weight, as ``nn.Dropout(1.0)``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"dropout must be a number in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:         # also refuses NaN
        raise ValueError(f"dropout must be in [0, 1], got {value}")
    return float(value)


def check_bias(value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"qkv_bias must be True or False, got {value!r}")
    return bool(value)


def make_rng(rng):
    """A numpy Generator from a Generator, an int seed, or None (fresh entropy)."""
    if rng is None or (isinstance(rng, Integral) and not isinstance(rng, bool)):
        if rng is not None and rng < 0:
            raise ValueError(f"rng must be a numpy.random.Generator, a non-negative int "
                             f"seed or None, got {rng}")
        return np.random.default_rng(rng)
    if isinstance(rng, np.random.Generator):
        return rng
    raise TypeError(f"rng must be a numpy.random.Generator, an int seed or None, "
                    f"got {type(rng).__name__}")


def fingerprint(array):
    """CRC-32 of an array's bytes: a cheap check that it has not changed since
    (reads the array once; copies it only if it is not contiguous)."""
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8))


def check_input(x, ndim, d_in=None, context_length=None, copy=True):
    """x as a floating array of ``ndim`` dimensions, last axis d_in, at most
    context_length tokens (axis -2); a copy of the caller's array unless
    ``copy=False``, so that changing it after forward changes no gradient."""
    x = read_array(x, "x")
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"x must hold floating-point numbers, got dtype {x.dtype}")
    layout = "(num_tokens, d_in)" if ndim == 2 else "(batch, num_tokens, d_in)"
    if x.ndim != ndim:
        raise ValueError(f"x must be {ndim}-D {layout}, got shape {x.shape}")
    if d_in is not None and x.shape[-1] != d_in:
        raise ValueError(f"x's last dimension must equal d_in={d_in}, got shape {x.shape}")
    num_tokens = x.shape[-2]
    if num_tokens == 0:
        raise ValueError(f"x must hold at least one token, got shape {x.shape}")
    if context_length is not None and num_tokens > context_length:
        raise ValueError(f"x has {num_tokens} tokens, more than "
                         f"context_length={context_length}")
    return np.array(x, copy=True) if copy else x


def check_keep_mask(keep_mask, shape, layout):
    """A boolean array of exactly ``shape``."""
    keep_mask = read_array(keep_mask, "keep_mask")
    if keep_mask.dtype != np.bool_:
        raise TypeError(f"keep_mask must be a boolean array (True = kept), "
                        f"got dtype {keep_mask.dtype}")
    if keep_mask.shape != tuple(shape):
        raise ValueError(f"keep_mask must have shape {layout} = {tuple(shape)}, "
                         f"got {keep_mask.shape}")
    return keep_mask


def uniform(rng, shape, low, high):
    """float32 draws from U[low, high), like PyTorch's default parameters
    (drawn in float32 so that U[0, 1) never rounds up to 1.0)."""
    u = rng.random(shape, dtype=np.float32)
    if (low, high) == (0.0, 1.0):
        return u
    return np.float32(low) + np.float32(high - low) * u
