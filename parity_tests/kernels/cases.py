"""The shapes a kernel is checked at, and the inputs each case draws.

A *case* is (B, H, Tq, Tk, D, causal) plus the production features it tests
(``features``: GQA's kv heads, a window, a softcap, ...), each a (name, value)
pair that the feature's own module reads.  A plain case is a case with no
features.  The default grid is chosen to break the things kernels get wrong,
after FlashAttention's tests (lengths that are not multiples of any tile, head
dims that are not powers of two, query and key lengths that differ), while
finishing in about a minute on a 2-core CPU:

====  ===  ===========  ====  ==================================================
B     H    Tq x Tk      D     why
====  ===  ===========  ====  ==================================================
2     3    1 x 1        64    one token: the weight is exactly 1 (dq = dk = 0)
1     4    17 x 17      40    a prime length; a head_dim not a power of two
2     2    113 x 203    80    lengths differ, odd, not a multiple of any tile
1     1    1023 x 1023  128   one head; one short of a power of two
1     2    2049 x 2049  64    a few thousand; one past a power of two
====  ===  ===========  ====  ==================================================

each causal and not.  ``--long`` adds T = 16384 (and 32768 on a GPU), causal and not, and on
the CPU T = 65536, causal only (the non-causal case holds twice the pairs).

Inputs: q, k, v and the upstream gradient dO are standard normal (as in
FlashAttention's tests: scores q.k/sqrt(D) of unit spread), drawn in float64
from a seed fixed by the case's *fields* (editing how a case prints reseeds
nothing), then rounded to the tested dtype once.  The golden result is computed
from the *rounded* numbers, so the check measures the kernel's arithmetic, not
the rounding of its inputs.
"""

import math
import zlib
from dataclasses import astuple, dataclass, replace

import numpy as np

__all__ = ["Case", "DEFAULT_SHAPES", "LONG_LENGTHS", "build_grid", "parse_tokens", "case_rng",
           "offset_of"]

# (B, H, Tq, Tk, D): see the table above
DEFAULT_SHAPES = (
    (2, 3, 1, 1, 64),
    (1, 4, 17, 17, 40),
    (2, 2, 113, 203, 80),
    (1, 1, 1023, 1023, 128),
    (1, 2, 2049, 2049, 64),
)
# --long: one head of one sequence at these lengths (key = query length), D = 64
LONG_LENGTHS = {"cpu": (16384, 65536), "cuda": (16384, 32768)}
# lengths past this one run causal only (with --causal no they are not run)
LONG_BOTH_UP_TO = 32768

# When some of --tokens/--head-dim/--heads/--batch are given, the others take these.
DEFAULT_TOKENS = ((1, 1), (17, 17), (113, 203), (1023, 1023), (2049, 2049))
DEFAULT_HEAD_DIM, DEFAULT_HEADS, DEFAULT_BATCH = 64, 2, 1


def offset_of(tq, tk, align):
    """The alignment's offset: query i sees key j iff j <= i + offset (causal)."""
    from numpy_ref import alignment_offset
    return alignment_offset(tq, tk, align)


# How a case reads its features: filled by the feature registry (``features/__init__``)
# when it loads, so that this module, which every feature module imports, imports none.
FEATURE_VIEWS = {"ordered": lambda values: tuple(values.items()),
                 "label": lambda name, value: f"{name} {value}",
                 "forward_only": lambda name: False,
                 "shape": lambda name: None}         # the shape field a feature's value is (Shrinking.shape)


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    tq: int
    tk: int
    head_dim: int
    causal: bool
    features: tuple = ()          # ((feature name, value), ...) in the registry's order
    align: str = None             # None: the run's alignment

    def get(self, name, default=None):
        """The value of feature ``name`` on this case (``default`` when it does not test it)."""
        return dict(self.features).get(name, default)

    def with_feature(self, name, value):
        return replace(self, features=FEATURE_VIEWS["ordered"](dict(self.features, **{name: value})))

    def _shape(self, field, default):
        """The value of the feature that declares it is ``field`` (``Shrinking.shape``), else ``default``."""
        shape = FEATURE_VIEWS["shape"]
        return next((v for n, v in self.features if shape(n) == field), default)

    @property
    def hkv(self):
        return self._shape("kv_heads", self.heads)

    @property
    def dv(self):
        return self._shape("v_dim", self.head_dim)

    @property
    def seqlens(self):
        """(seqlens_q, seqlens_k) of a batch of sequences of their own lengths, else None."""
        return self._shape("seqlens", None)

    @property
    def forward_only(self):
        return any(FEATURE_VIEWS["forward_only"](n) for n, _ in self.features)

    @property
    def scale(self):
        return self.get("scale", 1.0 / math.sqrt(self.head_dim))

    def offset(self, align):
        return offset_of(self.tq, self.tk, self.align or align)

    def __str__(self):
        label = FEATURE_VIEWS["label"]
        t = f"{self.tq}" if self.tq == self.tk else f"{self.tq}x{self.tk}"
        h = f"{self.heads}" if self.hkv == self.heads else f"{self.heads}/{self.hkv}"
        d = f"{self.head_dim}" if self.dv == self.head_dim else f"{self.head_dim}/{self.dv}"
        parts = [f"B{self.batch} H{h} T{t} D{d} {'causal' if self.causal else 'full'}"]
        parts += [p for p in (label(n, v) for n, v in self.features) if p]
        if self.align is not None:
            parts.append(self.align)
        return " ".join(parts)

    def as_dict(self):
        return {"batch": self.batch, "heads": self.heads, "kv_heads": self.hkv, "tq": self.tq,
                "tk": self.tk, "head_dim": self.head_dim, "v_dim": self.dv, "causal": self.causal,
                "features": [n for n, _ in self.features]}


def halvings(n):
    """n // 2, n // 4, ..., 1, smallest first: the sizes a shrunk case tries."""
    out = []
    while n > 1:
        n //= 2
        out.append(n)
    return sorted(set(out))


def case_rng(seed, case, *salt):
    """A generator fixed by the seed and the case's fields (never by its label)."""
    key = repr((seed,) + astuple(case) + salt)
    return np.random.default_rng(zlib.crc32(key.encode()))


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
    """The plain cases: the default grid, or the product of the sizes given (others defaulted)."""
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
    grid = [Case(b, h, tq, tk, d, c) for (b, h, tq, tk, d) in shapes for c in causal]
    if long:
        grid += [Case(1, 1, t, t, 64, c) for t in LONG_LENGTHS.get(device, LONG_LENGTHS["cpu"]) for c in causal
                 if c or t <= LONG_BOTH_UP_TO]
    return grid
