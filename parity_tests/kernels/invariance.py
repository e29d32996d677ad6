"""``check --invariance batch,decode,splits,chunks``: the kernel compared with itself, bitwise.

Inference engines ask a kernel for more than accuracy: that a token's attention row is the
same bits whatever else is computed beside it (batch-invariant and deterministic serving,
reinforcement learning that re-scores its rollouts).  Each mode computes the same rows two
ways and compares them with ``torch.equal``'s strictness, element by element:

- ``batch``: a sequence alone (B = 1; of 77 tokens, or the first of `BATCH_TOKENS` the kernel
  takes) against the same sequence inside batches of other
  sizes (`BATCH_SIZES`), first, in the middle and last among other sequences; out, and
  where the kernel has a backward, its dq, dk and dv.  A varlen kernel (its signature takes
  ``cu_seqlens_q``) is called packed, among sequences of other lengths;
- ``decode``: the last row of a causal prefill over kv_len keys (Tq = Tk = kv_len) against
  the same row as a decode call (Tq = 1 over the same keys: it sees them all); a paged
  kernel (its signature takes ``block_table``) reads both from a paged cache, as a serving
  engine does, and so in every mode;
- ``chunks``: a causal prefill's rows computed in chunks of queries (each chunk against the
  keys up to its last query, bottom-right) against all of them at once, per chunk size;
- ``splits``: each ``num_splits`` in `SPLITS` the kernel accepts (one it refuses with
  ``Unsupported`` is left out) against ``num_splits=1``, on decode calls (a kernel whose
  signature takes ``num_splits``).

A difference is not an accuracy failure (both sides may be well within the bound): it is a
verdict of its own, with the number of elements that differ and the largest difference in
units in the last place of the tested dtype.  Each mode sweeps the length that matters over
tile boundaries (kv_len, `LENGTHS`: every multiple of 16 up to 256, and each plus one; the
batch size; the chunk size), narrows the first length that differs to one step, and says
the pattern: "every kv_len ≥ 97: a key tile of 96 ends there".
"""

from dataclasses import dataclass, field

import numpy as np
import torch

import parity_tests.kernels.targets as targets
from parity_tests.common import capabilities
from parity_tests.kernels.features import takes_form

__all__ = ["MODES", "Finding", "parse_modes", "check_invariance"]

MODES = ("batch", "decode", "chunks", "splits")
# kv_len: 1 to 3, then every multiple of 16 up to 256 and each plus one (multiples of 32, 64
# and 128 among them, and 96, 192: FlashAttention-3's tiles).
LENGTHS = (1, 2, 3) + tuple(x for m in range(16, 257, 16) for x in (m, m + 1))
BATCH_SIZES = (2, 3, 4, 5, 8, 9, 16, 17)
BATCH_TOKENS = (77, 64, 128)           # each sequence of the batch mode: the first the kernel takes
PACKED_LENGTHS = (45, 1, 128, 16, 97, 3, 64, 200)       # the others, packed with a varlen kernel
PAGE = 16                              # slots per page of a paged kernel's cache
CHUNK_TOKENS = 193                     # the prefill the chunks mode cuts
CHUNK_SIZES = (1, 16, 17, 32, 33, 64, 65, 96, 97, 128, 129)
SPLITS = (2, 3, 4, 8)
MANTISSA = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_modes(modes):
    """The modes asked for, in `MODES`' order; ValueError naming a wrong one."""
    if modes is None:
        return ()
    if isinstance(modes, str):
        modes = modes.split(",")
    asked = [m.strip() for m in modes if m.strip()]
    wrong = [m for m in asked if m not in MODES]
    if wrong:
        raise ValueError(f"invariance must be among {', '.join(MODES)}; got {', '.join(wrong)}")
    return tuple(m for m in MODES if m in asked)


@dataclass
class Finding:
    """One mode's verdict in one dtype: "invariant", "DIFFERS", "not supported", or "FAIL" (the
    kernel raised)."""
    mode: str
    dtype: str
    verdict: str
    compared: int = 0                  # elements compared
    differing: int = 0                 # of them, not bitwise equal
    ulps: float = 0.0                  # the largest difference, in units in the last place
    first: int = None                  # the first length (kv_len, batch size, chunk size) that differs
    pattern: str = ""                  # what the sweep shows, in a sentence
    note: str = ""                     # why not supported, or what the mode compared
    sweep: dict = field(default_factory=dict)     # length -> elements that differ

    @property
    def broken(self):
        return self.verdict in ("DIFFERS", "FAIL")

    def line(self):
        head = f"{self.mode:<7} {self.dtype:<9} {self.verdict}"
        if self.verdict in ("not supported", "FAIL"):
            return f"{head}: {self.note}"
        if not self.broken:
            return f"{head}: {self.compared} elements bitwise equal ({self.note})"
        return (f"{head}: {self.differing} of {self.compared} elements, up to {self.ulps:.3g} ulp; "
                f"{self.pattern} ({self.note})")

    def as_dict(self):
        return {"mode": self.mode, "dtype": self.dtype, "verdict": self.verdict, "compared": self.compared,
                "differing": self.differing, "ulps": self.ulps, "first": self.first, "pattern": self.pattern,
                "note": self.note, "sweep": {str(k): v for k, v in self.sweep.items()}}


def ulps(a, b, dtype):
    """|a − b| in units in the last place of ``dtype`` at the larger magnitude of the two
    (float64 arrays)."""
    m = MANTISSA[dtype]
    tiny = np.finfo(np.float64).tiny if dtype == "float64" else 2.0 ** -126 if dtype in ("float32", "bfloat16") \
        else 2.0 ** -14
    mag = np.maximum(np.maximum(np.abs(a), np.abs(b)), tiny)
    unit = np.exp2(np.floor(np.log2(mag)) - m)
    diff = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    return np.where(np.isfinite(diff), diff / unit, np.inf)


class _Kernel:
    """The target called as the check calls it: its layout, ``align`` where it takes it."""

    def __init__(self, target, device, dtype, align, head_dim, heads, seed):
        self.t, self.device, self.dtype_name, self.align = target, device, dtype, align
        self.dtype, self.head_dim, self.heads = DTYPES[dtype], head_dim, heads
        self.gen = torch.Generator().manual_seed(seed)
        self.takes_splits = takes_form(target.fn, "splits")
        self.packed = takes_form(target.fn, "varlen")            # FlashAttention's varlen form
        self.paged = takes_form(target.fn, "paged")              # its kvcache form: a paged cache

    def draw(self, b, t):
        x = torch.randn(b, self.heads, t, self.head_dim, generator=self.gen, dtype=torch.float64)
        return x.to(self.dtype).to(self.device)

    def bottom_right(self):
        """Whether a causal call with Tq < Tk is bottom-right here (the chunks need it)."""
        return self.t.takes_align or self.align == "bottom-right" or self.paged

    def __call__(self, q, k, v, causal, dout=None, lengths=None, **kw):
        """{"out"}, and with an upstream gradient ``dout`` {"dq", "dk", "dv"} too; (B, H, T, D).
        A varlen kernel is called packed: the batch's sequences one after another, or with
        ``lengths`` the (1, H, total, D) tensors of sequences of those lengths (self-attention).
        A paged kernel reads k and v from a paged cache, forward only."""
        if self.t.takes_align:
            kw["align"] = "bottom-right"
        if self.paged:
            return self._run(q, k, v, True, None, self._paged_keywords(k, kw), lambda x: x.transpose(1, 2),
                             lambda x: x.transpose(1, 2), self._cache)
        if not self.packed:
            return self._run(q, k, v, causal, dout, kw, lambda x: targets.to_layout(x, self.t.layout),
                             lambda x: targets.from_layout(x, self.t.layout))
        if lengths is None:                          # (B, H, T, D) -> (1, H, B T, D), and back
            b = q.shape[0]
            join = lambda x: x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[-1])
            split = lambda x: x[0].reshape(x.shape[1], b, -1, x.shape[-1]).transpose(0, 1)
            got = self(join(q), join(k), join(v), causal, None if dout is None else join(dout),
                       ([q.shape[2]] * b, [k.shape[2]] * b), **kw)
            return {n: split(x) for n, x in got.items()}
        lq, lk = lengths if isinstance(lengths, tuple) else (lengths, lengths)
        cu = lambda n: torch.tensor([0] + list(np.cumsum(n)), dtype=torch.int32, device=q.device)
        kw.update(cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk), max_seqlen_q=max(lq), max_seqlen_k=max(lk))
        return self._run(q, k, v, causal, dout, kw, lambda x: x[0].transpose(0, 1),     # (total, H, D)
                         lambda x: x.transpose(0, 1)[None])

    def _run(self, q, k, v, causal, dout, kw, to, back, kv=None):
        """The kernel on ``to(q), to(k), to(v)`` (``kv``: how k and v are handed instead), its
        output brought ``back`` to (B, H, T, D); backpropagates ``dout``."""
        grad = dout is not None
        q, k, v = (x.detach().clone().requires_grad_(grad) for x in (q, k, v))
        kv = kv or to
        with torch.set_grad_enabled(grad):
            out = self.t.fn(to(q), kv(k), kv(v), causal=causal, scale=self.head_dim ** -0.5, **kw)
        out = back(out[0] if isinstance(out, tuple) else out)
        if not grad:
            return {"out": out.detach()}
        out.backward(dout)
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    def _paged_keywords(self, k, kw):
        """FlashAttention's kvcache form: each sequence's `PAGE`-slot pages in reverse order, an
        unused page between sequences (``block_table``), ``cache_seqlens`` its length;
        bottom-right, as a cache is read (``align`` left out)."""
        b, tk = k.shape[0], k.shape[2]
        per = -(-tk // PAGE)
        self.table = torch.tensor([[s * (per + 1) + per - 1 - p for p in range(per)] for s in range(b)],
                                  dtype=torch.int32, device=k.device)
        kw.pop("align", None)
        return dict(kw, block_table=self.table,
                    cache_seqlens=torch.full((b,), tk, dtype=torch.int32, device=k.device))

    def _cache(self, x):
        """(B, H, T, D) -> the cache (num_pages, PAGE, H, D) of `_paged_keywords`' pages."""
        b, h, t, d = x.shape
        slots = torch.zeros(self.table.numel() + b, PAGE, h, d, dtype=x.dtype, device=x.device)
        rows = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, -t % PAGE))
        slots[self.table.long().flatten()] = rows.reshape(-1, PAGE, h, d)
        return slots


class _Tally:
    """Elements compared and differing, and the largest ulp gap, over a mode's comparisons."""

    def __init__(self, dtype):
        self.dtype, self.compared, self.differing, self.ulps, self.sweep = dtype, 0, 0, 0.0, {}

    def add(self, length, a, b):
        a, b = (x.detach().to("cpu", torch.float64).numpy() for x in (a, b))
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        n = int((~same).sum())
        self.compared += a.size
        self.differing += n
        if n:
            self.ulps = max(self.ulps, float(ulps(a, b, self.dtype)[~same].max()))
        self.sweep[length] = self.sweep.get(length, 0) + n
        return n


def _pattern(sweep, unit, tile_hint=True):
    """(first length that differs, the sentence) from ``{length: elements that differ}``."""
    lengths = sorted(sweep)
    bad = [n for n in lengths if sweep[n]]
    if not bad:
        return None, ""
    first = bad[0]
    if all(sweep[n] for n in lengths if n >= first):
        said = f"every {unit} ≥ {first}"
        if tile_hint and first > 1:
            said += (f": the kernel's key tile changes at {first - 1}" if (first - 1) % 16 == 0 else
                     f": the two part after {unit} {first - 1} (another code path, not a tile of 16 or more)")
        return first, said
    return first, f"{unit} " + ", ".join(map(str, bad[:8])) + (" ..." if len(bad) > 8 else "") + \
        " (not every longer one)"


def _swept(tally, probe, lengths):
    """``probe(n)`` for each of ``lengths`` the kernel takes (one it refuses with `Unsupported`
    is left out of the sweep); its refusal when it takes none."""
    refused = None
    for n in lengths:
        try:
            probe(n)
        except targets.Unsupported as e:
            refused = e
    if not tally.sweep and refused is not None:
        raise refused


def _narrow(tally, probe):
    """Adds to the sweep the lengths between the last equal one and the first that differs."""
    ordered = sorted(tally.sweep)
    bad = [n for n in ordered if tally.sweep[n]]
    if not bad:
        return
    below = [n for n in ordered if n < bad[0]]
    _swept(tally, probe, range(below[-1] + 1 if below else 1, bad[0]))


def _decode(k, tally, sweep):
    lengths = list(sweep.get("lengths", LENGTHS))

    def probe(n):
        q, kk, vv = k.draw(1, n), k.draw(1, n), k.draw(1, n)
        prefill = k(q, kk, vv, causal=True)["out"][:, :, -1:]
        decode = k(q[:, :, -1:], kk, vv, causal=False)["out"]
        return tally.add(n, decode, prefill)
    _swept(tally, probe, lengths)
    _narrow(tally, probe)
    return _pattern(tally.sweep, "kv_len") + ("the last row of a causal prefill against a decode call (Tq = 1) "
                                              f"over kv_len = 1 .. {max(lengths)} keys",)


def _chunks(k, tally, sweep):
    if not k.bottom_right():
        return None
    t, sizes = sweep.get("chunk_tokens", CHUNK_TOKENS), sweep.get("chunk_sizes", CHUNK_SIZES)
    q, kk, vv = k.draw(1, t), k.draw(1, t), k.draw(1, t)
    whole = k(q, kk, vv, causal=True)["out"]

    def probe(size):
        parts = [k(q[:, :, a:a + size], kk[:, :, :a + size], vv[:, :, :a + size], causal=True)["out"]
                 for a in range(0, t, size)]
        return tally.add(size, torch.cat(parts, dim=2), whole)
    _swept(tally, probe, sizes)
    sizes = sorted(tally.sweep)
    bad = [s for s in sizes if tally.sweep[s]]
    said = f"chunks of {', '.join(map(str, bad))} queries differ" if bad else ""
    return (bad or [None])[0], said, f"a causal prefill of {t} tokens in chunks of {', '.join(map(str, sizes))} queries"


def _splits(k, tally, sweep):
    if not k.takes_splits:
        return None
    lengths = list(sweep.get("lengths", LENGTHS))

    taken = []
    q, kk, vv = k.draw(1, 1), k.draw(1, 64), k.draw(1, 64)
    for s in SPLITS:                                  # the split counts the kernel accepts
        try:
            k(q, kk, vv, causal=False, num_splits=s)
            taken.append(s)
        except targets.Unsupported:
            pass
    if not taken:
        raise targets.Unsupported(f"the kernel refuses num_splits {', '.join(map(str, SPLITS))}")

    def probe(n):
        q, kk, vv = k.draw(1, 1), k.draw(1, n), k.draw(1, n)
        one = k(q, kk, vv, causal=False, num_splits=1)["out"]
        return sum(tally.add(n, k(q, kk, vv, causal=False, num_splits=s)["out"], one) for s in taken)
    _swept(tally, probe, lengths)
    _narrow(tally, probe)
    first, said = _pattern(tally.sweep, "kv_len", tile_hint=False)
    return first, said, f"num_splits {', '.join(map(str, taken))} against 1, on decode calls over kv_len up to {max(lengths)}"


def _batch(k, tally, sweep):
    sizes, t = sweep.get("batch_sizes", BATCH_SIZES), _first_taken(k, BATCH_TOKENS)
    grad = _has_backward(k, t)
    # q, k, v and its upstream gradient; packed, the other sequences have other lengths
    draw = lambda n=t: [k.draw(1, n) for _ in range(4)]
    seq = draw()
    alone = _batched(k, [seq], 0, grad)
    places = {}
    for size in sizes:
        others = [draw(PACKED_LENGTHS[i % len(PACKED_LENGTHS)] if k.packed else t) for i in range(size - 1)]
        for where, at in (("first", 0), ("middle", size // 2), ("last", size - 1)):
            got = _batched(k, others[:at] + [seq] + others[at:], at, grad)
            n = sum(tally.add(size, got[name], alone[name]) for name in alone)
            places[where] = places.get(where, 0) + n
    first, said = _pattern(tally.sweep, "batch size", tile_hint=False)
    if first is not None:
        bad = [s for s in sizes if tally.sweep[s]]
        said = (f"only when the batch holds more than {first - 1} sequences" if said.startswith("every") and first > 2
                else f"in batches of {', '.join(map(str, bad))}")
        where = [w for w, n in places.items() if n]
        if len(where) < 3:
            said += f", only where the sequence sits {' or '.join(where)}"
    tensors = "out, dq, dk and dv" if grad else "out"
    form = ", packed (varlen) among sequences of other lengths" if k.packed else ""
    return first, said, (f"a sequence of {t} tokens alone against inside batches of {', '.join(map(str, sizes))}"
                         f"{form}, first, middle and last: {tensors}")


def _batched(k, seqs, at, grad):
    """Sequence ``at``'s rows of the kernel's call on ``seqs`` ([q, k, v, dout] each (1, H, T_b,
    D)): one batch, or one packed batch for a varlen kernel."""
    parts = [torch.cat([s[i] for s in seqs], dim=2 if k.packed else 0) for i in range(4)]
    got = k(*parts[:3], causal=True, dout=parts[3] if grad else None,
            lengths=[s[0].shape[2] for s in seqs] if k.packed else None)
    if k.packed:
        start = sum(s[0].shape[2] for s in seqs[:at])
        return {n: x[:, :, start:start + seqs[at][0].shape[2]] for n, x in got.items()}
    return {n: x[at:at + 1] for n, x in got.items()}


def _first_taken(k, lengths):
    """The first of ``lengths`` the kernel takes for a causal self-attention call; else its
    refusal of the last."""
    for n in lengths:
        q = k.draw(1, n)
        try:
            k(q, q, q, causal=True)
            return n
        except targets.Unsupported:
            if n == lengths[-1]:
                raise


def _has_backward(k, t):
    """Whether the kernel gives gradients on a causal self-attention call of ``t`` tokens."""
    q = k.draw(1, t)
    try:
        got = k(q, q, q, causal=True, dout=q)
    except Exception:                  # noqa: BLE001 - refused, or not differentiable: out alone
        return False
    return got.get("dq") is not None


def check_invariance(target, modes, dtypes, device="cpu", align="top-left", head_dim=64, heads=2, seed=0,
                     **sweep):
    """``[Finding]``: each of ``modes`` in each of ``dtypes`` for ``target`` (a `targets.Target`).
    ``sweep`` may shorten the sweeps (``lengths``, ``batch_sizes``, ``chunk_tokens``,
    ``chunk_sizes``; the tests' smaller ones)."""
    found = []
    for dtype in dtypes:
        lacking = capabilities.dtype_lacks(dtype, device)
        for mode in modes:
            if lacking:
                found.append(Finding(mode, dtype, "not supported", note=lacking))
                continue
            k = _Kernel(target, device, dtype, align, head_dim, heads, seed)
            tally = _Tally(dtype)
            try:
                result = {"batch": _batch, "decode": _decode, "chunks": _chunks, "splits": _splits}[mode](k, tally, sweep)
            except targets.Unsupported as e:
                found.append(Finding(mode, dtype, "not supported", note=str(e).splitlines()[0][:200]))
                continue
            except Exception as e:                    # noqa: BLE001 - the kernel's own failure, said
                said = capabilities.refusal(e) if target.builtin else None
                found.append(Finding(mode, dtype, "not supported" if said else "FAIL",
                                     note=said or f"raised {type(e).__name__}: {str(e).splitlines()[0][:160]}"))
                continue
            if result is None:
                why = ("the kernel's signature has no num_splits" if mode == "splits" else
                       "needs bottom-right causal chunks: --align bottom-right, or an align keyword")
                found.append(Finding(mode, dtype, "not supported", note=why))
                continue
            first, pattern, note = result
            found.append(Finding(mode, dtype, "DIFFERS" if tally.differing else "invariant", tally.compared,
                                 tally.differing, tally.ulps, first, pattern, note, dict(sorted(tally.sweep.items()))))
    return found
