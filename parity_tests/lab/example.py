"""The chapter's worked example, ready to run backwards.

The six tokens of "Your journey starts with one step" (d_in = 3), each chapter
module built after the chapter's ``torch.manual_seed`` (so its weights are the
chapter's), in float64 on both sides, and one small fixed upstream gradient::

    L = sum(G * context_vec)        so        dL/dcontext_vec = G

G is random-looking on purpose (a softmax row always sums to 1, so with
``L = context_vec.sum()`` much of the backward would be ~0), and rounded to one
decimal so it can be copied onto paper.
"""

from dataclasses import dataclass

import numpy as np
import torch

import numpy_ref
import torch_impl
from parity_tests.common import chapter_values as cv

TOKENS = ["Your", "journey", "starts", "with", "one", "step"]
UPSTREAM_SEED = 3          # numpy.random.default_rng(3), then rounded to 0.1
DROPOUT_SEED = 123         # torch.manual_seed before the forward, as the chapter does


@dataclass(frozen=True)
class Spec:
    """One chapter module: how the chapter builds it."""
    name: str
    seed: int
    args: tuple
    batched: bool          # (B, T, d_in) input; else (T, d_in)
    has_dropout: bool


SPECS = {s.name: s for s in (
    Spec("SimplifiedSelfAttention", 0, (), False, False),
    Spec("SelfAttention_v1", cv.SEED_V1, (cv.D_IN, cv.D_OUT), False, False),
    Spec("SelfAttention_v2", cv.SEED_V2, (cv.D_IN, cv.D_OUT), False, False),
    Spec("CausalAttention", cv.SEED_CAUSAL, (cv.D_IN, cv.D_OUT, 6, 0.0), True, True),
    Spec("MultiHeadAttentionWrapper", cv.SEED_WRAPPER, (cv.D_IN, cv.D_OUT, 6, 0.0, 2), True, True),
    Spec("MultiHeadAttention", 123, (cv.D_IN, cv.D_OUT, 6, 0.0, 2), True, True),
)}
MODULES = list(SPECS)


def _with_dropout(spec, dropout):
    """The constructor arguments, with the dropout rate replaced (the 4th argument)."""
    if not spec.has_dropout:
        return spec.args
    return spec.args[:3] + (float(dropout),) + spec.args[4:]


def build(name, dropout=0.0):
    """``(torch module, numpy module)`` in float64 with the chapter's seeded weights.

    The torch module is built in float32 after ``torch.manual_seed`` (the
    chapter's draws), then both are cast to float64: the weights are the chapter's
    float32 numbers, exactly, and the arithmetic is float64.
    """
    if name not in SPECS:
        raise ValueError(f"module must be one of {', '.join(MODULES)}; got {name!r}")
    spec = SPECS[name]
    args = _with_dropout(spec, dropout)
    torch.manual_seed(spec.seed)
    m_t = getattr(torch_impl, name)(*args).double()
    m_n = getattr(numpy_ref, name)(*args)
    m_n.load_state_dict({k: v.numpy() for k, v in m_t.state_dict().items()})
    if not (spec.has_dropout and dropout > 0):
        m_t.eval()
        m_n.eval()
    return m_t, m_n


def inputs(name):
    """The chapter's input in float64: (6, 3), or (1, 6, 3) for the batched modules."""
    x = np.array(cv.INPUTS, dtype=np.float64)
    return x[None] if SPECS[name].batched else x


def upstream(shape):
    """G = dL/dcontext_vec: small numbers with one decimal, fixed by UPSTREAM_SEED."""
    rng = np.random.default_rng(UPSTREAM_SEED)
    return np.round(rng.uniform(-1.0, 1.0, size=shape), 1) + 0.0     # + 0.0: no -0.0


def output_shape(m_t, x):
    """The shape of the module's output on ``x`` (one forward, no gradient)."""
    with torch.no_grad():
        return tuple(m_t(torch.tensor(x, dtype=torch.float64)).shape)
