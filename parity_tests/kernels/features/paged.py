"""``paged``: FlashAttention's kvcache form.  The callable receives q (B, Tq, Hq, D)
and, in place of k and v, ``k_cache`` and ``v_cache`` (num_pages, page_size, Hkv, D)
(Dv for v), with ``block_table`` (B, max_pages) int32 and ``cache_seqlens`` (B,) int32:
the keys of sequence b are the first cache_seqlens[b] slots of pages block_table[b, 0],
block_table[b, 1], ... in order; bottom-right alignment; it returns out (B, Tq, Hq, Dv),
forward only.  Paging is a layout, not another attention: the reference is
``numpy_ref.reference_attention`` on the gathered keys with ``seqlens_k`` = cache_seqlens.

Every case of the run is paged (16-slot pages, each sequence its full length), and the
feature adds its own: decode (Tq = 1 .. 4) and a prefill chunk (Tq = 30) against the
cache; pages of 1, 16 and 256 slots, shuffled among unused ones (not adjacent, not in
order); lengths that end mid-page and on a page boundary; lengths 3 and 3000 in one
batch; a sequence of length 0.  Every unused page, every spare block-table entry and the
tail of every last page is NaN: a kernel that reads a slot it should not shows it (the
block table's spare entries point at other sequences' full pages: a kernel that reads
them reads the wrong keys, and where it did so is told from its finite rows).
Invited mistakes: cache_seqlens ignored (every slot of the table's pages read), the
block table read one page off or with a wrong row stride, the page size taken as twice its size, the last
partial page dropped, every slot multiplied in with weight 0 (0 × NaN: what a kernel
that masks the unused slots instead of skipping them returns).
"""

import math
from dataclasses import replace

import numpy as np
import torch

from parity_tests.kernels import dense
from parity_tests.kernels.cases import Case, case_rng
from parity_tests.kernels.features import Calling, Feature, Judging, Shrinking
from parity_tests.kernels.diagnosis.poisoned import Poisoned

KEYWORDS = ("block_table", "cache_seqlens")
DEFAULT_PAGE = 16           # the page size of the run's own cases, paged


def cases(causal, plan):
    def paged(tq, size, lengths):
        return Case(len(lengths), 2, tq, max(max(lengths), 1), 64, causal, (("paged", (size, lengths)),),
                    "bottom-right")
    return [paged(1, 16, (3, 3000)),            # decode; lengths 1000x apart
            paged(4, 256, (1000, 0, 17)),       # a few queries; 256-slot pages; an empty sequence
            paged(1, 1, (37, 5)),               # 1-slot pages
            paged(30, 16, (30, 3, 129)),        # a prefill chunk (rows of the length-3 one see no key)
            paged(2, 16, (32, 200))]            # a length that ends on a page boundary


def widen(case):
    """Every case of the run as a paged one (each sequence its full length), bottom-right."""
    if case.get("paged") is None:
        case = case.with_feature("paged", (DEFAULT_PAGE, (case.tk,) * case.batch))
    return replace(case, align="bottom-right")


def label(value):
    size, lengths = value
    return f"paged {size}" + ("" if len(set(lengths)) == 1 else " lens " + ",".join(map(str, lengths)))


def pages(case, value):
    """(block_table (B, max_pages) int array, num_pages): each sequence's pages drawn at
    random among all (seeded by the case), unused pages between them, the last physical
    page never used; spare table entries point at the other sequences' full pages (stale
    entries, as a serving engine leaves them), or at unused pages when there are none."""
    size, lengths = value
    need = [math.ceil(n / size) for n in lengths]
    num = sum(need) + len(lengths) + 2
    rng = case_rng(0, case, "pages")
    order = rng.permutation(num - 1)
    used, unused = order[:sum(need)], np.concatenate([order[sum(need):], [num - 1]])
    table = np.zeros((len(lengths), max(need) + 1), dtype=np.int64)
    own = [p if len(p) < 2 or np.any(np.diff(p) < 0) else p[::-1]         # never in order
           for p in np.split(used, np.cumsum(need)[:-1])]
    full = [p[: lengths[c] // size] for c, p in enumerate(own)]       # pages with no NaN slot
    for b, n in enumerate(need):                # spare entries: stale full pages of the other sequences
        others = np.concatenate([p for c, p in enumerate(full) if c != b] + [[]]).astype(np.int64)
        table[b] = rng.choice(others if len(others) else unused, size=table.shape[1])
        table[b, :n] = own[b]
    return table, num


def slots(table, size, b, length, column=0, step=None, stride=None, tile=None, within=None, bits=None):
    """The flat slot (page · size + offset) of each key position of sequence b; ``column``
    shifts the table column read, ``step`` is the page size the positions are cut by,
    ``stride`` the row stride the table is read with (its flat entries); ``tile``: each key
    tile of that many read as contiguous slots from its first key's slot; ``within``: the
    offset in the page taken modulo that instead of the page size; ``bits``: the offset taken
    as pos & bits."""
    step = step or size
    pos = np.arange(length)
    if within is not None:
        return table[b, pos // step] * size + pos % within
    if bits is not None:
        return table[b, pos // step] * size + (pos & bits)
    if tile is not None:
        first = pos - pos % tile
        return table[b, first // step] * size + first % step + pos % tile
    if stride is not None:
        return table.reshape(-1)[b * stride + pos // step] * size + pos % step
    return table[b, pos // step + column] * size + pos % step


def _sorted_pages(table, b, used):
    """``table`` with sequence b's first ``used`` pages in ascending order."""
    table = table.copy()
    table[b, :used] = np.sort(table[b, :used])
    return table


def cache(x, table, size, num, lengths, unread=math.nan):
    """x (B, T, H, D) -> (num, size, H, D): each sequence's keys in its pages, ``unread`` elsewhere."""
    flat = torch.full((num * size,) + tuple(x.shape[2:]), unread, dtype=x.dtype, device=x.device)
    for b, n in enumerate(lengths):
        if n:
            flat[torch.as_tensor(slots(table, size, b, n), device=x.device)] = x[b, :n]
    return flat.view((num, size) + tuple(x.shape[2:]))


def hand(case, paged, args, kw, device, unread):
    size, lengths = paged
    table, num = pages(case, paged)
    k, v = args["k"].detach(), args["v"].detach()                      # (B, Tk, Hkv, D): bthd
    kw = {**kw, "block_table": torch.tensor(table, dtype=torch.int32, device=device),
          "cache_seqlens": torch.tensor(lengths, dtype=torch.int32, device=device)}
    return {"q": args["q"], "k_cache": cache(k, table, size, num, lengths, unread),
            "v_cache": cache(v, table, size, num, lengths, unread)}, kw


def draw(paged, inputs):
    """Keys past a sequence's length zero."""
    out = {n: inputs[n].copy() for n in ("k", "v")}
    for b, n in enumerate(paged[1]):
        for x in out.values():
            x[b, :, n:] = 0.0
    return out


def reference(case, paged):
    return {"seqlens_q": np.full(case.batch, case.tq), "seqlens_k": np.array(paged[1]), "align": "bottom-right"}


def _read(ctx, value, hid, says, positions):
    """The kernel reading sequence b's keys from the flat slots ``positions(table, b)``,
    on the poisoned cache (NaN where nothing was written, and past its end), lengths its own."""
    size, lengths = value
    q, k, v, _ = ctx.inputs
    table, num = pages(ctx.case, value)
    flat = {n: np.concatenate([cache(torch.from_numpy(x).transpose(1, 2), table, size, num, lengths).reshape(
        (num * size,) + x.shape[1:2] + x.shape[3:]).numpy(), np.full((1,) + x.shape[1:2] + x.shape[3:], np.nan)])
        for n, x in (("k", k), ("v", v))}
    read = [np.minimum(positions(table, b), num * size) for b in range(ctx.case.batch)]
    longest = max(1, max(len(s) for s in read))
    got = {n: np.zeros(x.shape[:2] + (longest,) + x.shape[3:]) for n, x in (("k", k), ("v", v))}
    for n in got:
        for b, s in enumerate(read):
            got[n][b, :, :len(s)] = flat[n][s].transpose(1, 0, 2)
    nan_key = np.isnan(got["k"]).any(axis=(1, 3)) | np.isnan(got["v"]).any(axis=(1, 3))     # (B, L)
    lens = np.array([len(s) for s in read])
    opts = {**ctx.opts, "seqlens_k": lens}
    if opts.get("bias") is not None:          # the bias over the keys read: 0 past the case's, cut short before
        bias = np.asarray(opts["bias"])[..., :longest]
        opts["bias"] = np.pad(bias, [(0, 0)] * (bias.ndim - 1) + [(0, longest - bias.shape[-1])])
    offs = dense.offsets(ctx.case.tq, longest, opts["seqlens_q"], lens, ctx.align, ctx.case.batch)
    # the query rows q holds: every row, or a block of them (``row_block``), numbered in the whole case
    first = (ctx.rows or (0,))[0]
    query = torch.arange(first, first + q.shape[2])
    sure = np.stack([(dense.visible(query, longest, causal=opts["causal"], offset=offs[b],
                                    window=opts.get("window"), nk=int(lens[b])).numpy()
                      & nan_key[b][None, :]).any(-1) for b in range(ctx.case.batch)])        # (B, rows)
    shape = (ctx.case.batch, ctx.case.heads, len(query))

    def predict(grads=True, unread=np.nan):    # unread: what the slots no one should read hold
        r = ctx.dense(q, np.nan_to_num(got["k"]), np.nan_to_num(got["v"]), None, opts, grads=False)
        if np.isnan(unread):
            rows = np.broadcast_to(sure[:, None, :], shape)
            r["out"][rows] = np.nan
            r["lse"][rows] = np.nan
        return ctx.as_4d({n: r[n] for n in ("out", "lse")})

    def maybe():
        return np.broadcast_to(nan_key.any(-1)[:, None, None], shape)
    tensors = tuple(n for n in ("out", "lse") if n in ctx.present)
    return Poisoned(hid, says, predict, tensors, maybe, zeroed=lambda: predict(unread=0.0))


def _everywhere(ctx):
    def predict(grads=True):
        return ctx.as_4d({n: np.full_like(ctx.golden_raw[n], np.nan) for n in ("out", "lse") if n in ctx.golden_raw})
    return predict


def mistakes(ctx, value):
    size, lengths = value
    widest = pages(ctx.case, value)[0].shape[1]
    # first: where every row is NaN nothing tells the readings apart, and this one claims the least
    out = [Poisoned("paged-masked-nan", "every slot of the cache multiplied in with weight 0 (a masked slot's "
                    "weight is 0, but 0 × NaN = NaN: the unused slots' values reach every row)",
                    _everywhere(ctx), tuple(n for n in ("out", "lse") if n in ctx.present),
                    zeroed=lambda: ctx.as_4d(ctx.golden_raw))]
    out += [_read(ctx, value, "paged-past-seqlens", "cache_seqlens ignored: every slot of the block table's "
                  f"{widest} pages read as keys, the NaN slots past cache_seqlens included",
                  lambda t, b: slots(t, size, b, widest * size)),
            _read(ctx, value, "paged-off-by-one-page", "the block table read one page off (logical page p "
                  "taken from block_table[b, p + 1])", lambda t, b: slots(t, size, b, lengths[b], column=1)),
            _read(ctx, value, "paged-table-stride", f"the block table read with a row stride of {widest - 1} "
                  f"instead of {widest} (sequence b's pages taken from the wrong row)",
                  lambda t, b: slots(t, size, b, lengths[b], stride=widest - 1)),
            _read(ctx, value, "paged-page-size", f"the page size taken as {2 * size} instead of {size} "
                  "(positions cut into pages of the wrong size)",
                  lambda t, b: slots(t, size, b, lengths[b], step=2 * size))]
    out += [_read(ctx, value, "paged-tile-in-one-page", f"each key tile of {t} read as {t} contiguous slots from "
                  f"the page of its first key (pages of {size} slots: a tile crossing a page boundary reads the "
                  "slots after its first page, not the next page of the block table)",
                  lambda tb, b, t=t: slots(tb, size, b, lengths[b], tile=t))
            for t in (16, 32, 64, 128) if size < t < max(lengths, default=0)]
    out += [_read(ctx, value, "paged-offset-mod-tile", f"the offset in a page taken as position % {t} (a key "
                  f"tile's size) instead of % {size} (the page size): a cache block and a key block mixed up",
                  lambda tb, b, t=t: slots(tb, size, b, lengths[b], within=t))
            for t in (16, 32, 64, 128) if t != size and min(t, size) < max(lengths, default=0)]
    if size & (size - 1) == 0:                        # a power of two: the offset a mask
        out.append(_read(ctx, value, "paged-offset-mask", f"the offset in a page taken as pos & {size} where pos & "
                         f"{size - 1} is meant (the mask's - 1 left out: 0 or the page size, so every key reads the "
                         "first slot of its page or of the page after it)",
                         lambda t, b: slots(t, size, b, lengths[b], bits=size)))
    out.append(_read(ctx, value, "paged-pages-sorted", "each sequence's pages read in ascending physical order, not "
                     "the block table's (its order lost: the page list sorted, as torch.unique or a set gives)",
                     lambda t, b: slots(_sorted_pages(t, b, -(-lengths[b] // size)), size, b, lengths[b])))
    whole = [n // size * size for n in lengths]
    if size > 1 and whole != list(lengths):
        out.append(ctx.H("paged-last-page-dropped", f"the last partial page dropped (keys {whole} "
                         f"instead of cache_seqlens {list(lengths)})", ctx.fwd({"seqlens_k": np.array(whole)})))
    return out


FEATURE = Feature("paged", "FlashAttention's kvcache form: k_cache, v_cache (num_pages, page_size, Hkv, D), "
                  "block_table, cache_seqlens; q and out (B, T, H, D); bottom-right; forward only",
                  cases=cases, label=label, draw=draw, mistakes=mistakes,
                  excludes=dict.fromkeys(("varlen", "lse_grad"), "a forward-only kvcache call"),
                  calling=Calling(keywords=KEYWORDS, reference=reference, run_wide=True, hand=hand, layout="bthd",
                                  widen=widen),
                  judging=Judging(forward_only=True),
                  shrinking=Shrinking(fit=lambda case, v: (v[0], tuple(min(x, case.tk) for x in v[1][:case.batch]))))
