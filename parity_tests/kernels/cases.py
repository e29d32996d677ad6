"""The shapes a kernel is checked at, and the inputs each case draws.

A *case* is (B, H, Tq, Tk, D, causal).  The default grid is chosen to break the
things kernels get wrong, after FlashAttention's tests (lengths that are not
multiples of any tile, head dims that are not powers of two, query and key
lengths that differ), while finishing in about a minute on a 2-core CPU:

====  ===  ===========  ====  ==================================================
B     H    Tq x Tk      D     why
====  ===  ===========  ====  ==================================================
2     3    1 x 1        64    one token: the weight is exactly 1 (dq = dk = 0)
1     4    17 x 17      40    a prime length; a head_dim not a power of two
2     2    113 x 203    80    lengths differ, odd, not a multiple of any tile
1     1    1023 x 1023  128   one head; one short of a power of two
1     2    2049 x 2049  64    a few thousand; one past a power of two
====  ===  ===========  ====  ==================================================

each causal and not.  ``--long`` adds T = 16384 (and 32768 on a GPU).

Inputs: q, k, v and the upstream gradient dO are standard normal (as in
FlashAttention's tests: scores q.k/sqrt(D) of unit spread), drawn in float64
from a seed fixed per case, then rounded to the tested dtype once.  The golden
result is computed from the *rounded* numbers, so the check measures the
kernel's arithmetic, not the rounding of its inputs.
"""

import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["Case", "DEFAULT_SHAPES", "LONG_LENGTHS", "build_grid", "parse_tokens", "draw_inputs"]

# (B, H, Tq, Tk, D): see the table above
DEFAULT_SHAPES = (
    (2, 3, 1, 1, 64),
    (1, 4, 17, 17, 40),
    (2, 2, 113, 203, 80),
    (1, 1, 1023, 1023, 128),
    (1, 2, 2049, 2049, 64),
)
# --long: one head of one sequence at these lengths (key = query length), D = 64
LONG_LENGTHS = {"cpu": (16384,), "cuda": (16384, 32768)}

# When some of --tokens/--head-dim/--heads/--batch are given, the others take these.
DEFAULT_TOKENS = ((1, 1), (17, 17), (113, 203), (1023, 1023), (2049, 2049))
DEFAULT_HEAD_DIM, DEFAULT_HEADS, DEFAULT_BATCH = 64, 2, 1


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    tq: int
    tk: int
    head_dim: int
    causal: bool

    def __str__(self):
        t = f"{self.tq}" if self.tq == self.tk else f"{self.tq}x{self.tk}"
        return (f"B{self.batch} H{self.heads} T{t} D{self.head_dim} "
                f"{'causal' if self.causal else 'full'}")

    @property
    def scale(self):
        return 1.0 / float(np.sqrt(self.head_dim))

    def offset(self, align):
        """``causal_offset``: query i sees key j iff j <= i + offset."""
        return 0 if align == "top-left" else self.tk - self.tq

    def as_dict(self):
        return {"batch": self.batch, "heads": self.heads, "tq": self.tq, "tk": self.tk,
                "head_dim": self.head_dim, "causal": self.causal}


def parse_tokens(text):
    """``"128x512"`` -> (128, 512); ``"1024"`` -> (1024, 1024)."""
    parts = str(text).lower().split("x")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) == 1:
        sizes = sizes * 2
    if len(sizes) != 2 or min(sizes) < 1:
        raise ValueError(f"tokens must be a positive length T or TqxTk (e.g. 128x512), got {text!r}")
    return sizes


def _positive(name, values):
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be positive integers, got {v!r}")
        out.append(int(v))
    return out


def build_grid(*, tokens=None, head_dims=None, heads=None, batch=None, causal=(True, False),
               long=False, device="cpu"):
    """The cases: the default grid, or the product of the sizes given (others defaulted)."""
    causal = list(dict.fromkeys(causal))
    if tokens is None and head_dims is None and heads is None and batch is None:
        shapes = list(DEFAULT_SHAPES)
    else:
        toks = [parse_tokens(t) if not isinstance(t, tuple) else parse_tokens("x".join(map(str, t)))
                for t in (tokens or DEFAULT_TOKENS)]
        shapes = [(b, h, tq, tk, d)
                  for b in _positive("batch", batch or [DEFAULT_BATCH])
                  for h in _positive("heads", heads or [DEFAULT_HEADS])
                  for tq, tk in toks
                  for d in _positive("head_dim", head_dims or [DEFAULT_HEAD_DIM])]
    if long:
        shapes += [(1, 1, t, t, 64) for t in LONG_LENGTHS.get(device, LONG_LENGTHS["cpu"])]
    return [Case(b, h, tq, tk, d, c) for (b, h, tq, tk, d) in shapes for c in causal]


def draw_inputs(case, seed=0):
    """q, k, v, dout as float64 arrays, (B, H, T, D), from a seed fixed by the case."""
    key = f"{seed}:{case.batch},{case.heads},{case.tq},{case.tk},{case.head_dim},{case.causal}"
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    b, h, d = case.batch, case.heads, case.head_dim
    q = rng.standard_normal((b, h, case.tq, d))
    k = rng.standard_normal((b, h, case.tk, d))
    v = rng.standard_normal((b, h, case.tk, d))
    dout = rng.standard_normal((b, h, case.tq, d))
    return q, k, v, dout
