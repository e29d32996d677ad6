"""One rule for "which keys does query i see": numpy_ref's `visible_mask`, the torch forms
built on it (``kernels.dense``: the whole mask `visible`, FlexAttention's `mask_mod` on index
grids and through FlexAttention's own ``create_mask``) and the matrix's witness, which keeps
its own copy (``matrix.variants_dense``), give the same boolean on random configurations:
lengths, both alignments, causal, windows (−1 unbounded), per-sequence lengths."""

import itertools
import warnings

import numpy as np
import torch

from numpy_ref import Visibility, visible_mask
from numpy_ref.visibility import window_sides
from parity_tests.kernels import dense
from parity_tests.matrix import variants_dense
from needs import needs


def _configurations(n, seed):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        b = int(rng.integers(1, 4))
        tq, tk = (int(x) for x in rng.integers(1, 24, 2))
        nq, nk = rng.integers(0, tq + 1, b), rng.integers(0, tk + 1, b)
        if rng.integers(3) == 0:
            nq, nk = np.full(b, tq), np.full(b, tk)                  # no padding
        causal, align = bool(rng.integers(2)), ("top-left", "bottom-right")[rng.integers(2)]
        window = None if rng.integers(3) == 0 else tuple(int(x) for x in rng.integers(-1, 7, 2))
        yield b, tq, tk, nq, nk, causal, align, window


def _mask_mod(b, tq, tk, nq, nk, causal, align, window):
    offs = dense.offsets(tq, tk, nq.tolist(), nk.tolist(), align, b)
    return dense.mask_mod(causal=causal, window=window, offset=torch.tensor(offs), nq=torch.tensor(nq),
                          nk=torch.tensor(nk))


def test_every_torch_form_is_numpy_refs_mask():
    for b, tq, tk, nq, nk, causal, align, window in _configurations(300, seed=33):
        where = (b, tq, tk, nq.tolist(), nk.tolist(), causal, align, window)
        want = np.stack([visible_mask(tq, tk, causal=causal, align=align, window=window, seqlen_q=lq, seqlen_k=lk)
                         for lq, lk in zip(nq, nk)])                  # (B, Tq, Tk)
        offs = dense.offsets(tq, tk, nq.tolist(), nk.tolist(), align, b)
        whole = torch.stack([dense.visible(torch.arange(tq), tk, causal=causal, offset=offs[s], window=window,
                                           nq=int(nq[s]), nk=int(nk[s])) for s in range(b)])
        assert np.array_equal(whole.numpy(), want), where
        mod = _mask_mod(b, tq, tk, nq, nk, causal, align, window)
        grid = mod(torch.arange(b).view(b, 1, 1), 0, torch.arange(tq).view(1, tq, 1), torch.arange(tk).view(1, 1, tk))
        assert np.array_equal(grid.expand(b, tq, tk).numpy(), want), where
        witness = variants_dense.visible_mask(b, tq, tk, causal=causal, align=align, window=window,
                                              seqlens_q=nq, seqlens_k=nk)[:, 0]
        assert np.array_equal(witness.numpy(), want), where


@needs("flex_attention")
def test_flex_attention_evaluates_the_mask_mod_as_numpy_ref():
    """``dense.mask_mod`` as FlexAttention evaluates it (vmap, ``create_mask``)."""
    from torch.nn.attention.flex_attention import create_mask
    for b, tq, tk, nq, nk, causal, align, window in itertools.islice(_configurations(300, seed=33), 0, None, 10):
        want = np.stack([visible_mask(tq, tk, causal=causal, align=align, window=window, seqlen_q=lq, seqlen_k=lk)
                         for lq, lk in zip(nq, nk)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex = create_mask(_mask_mod(b, tq, tk, nq, nk, causal, align, window), b, 1, tq, tk, device="cpu")
        assert np.array_equal(flex[:, 0].numpy(), want), (b, tq, tk, nq.tolist(), nk.tolist(), causal, align, window)


def test_a_window_on_another_diagonal_is_the_causal_mask_and_the_shifted_window():
    """``dense.visible``'s ``window_offset`` (the catalogued window placed with the other
    alignment): the causal mask on its offset, the window's sides on the other."""
    for b, tq, tk, nq, nk, causal, align, window in _configurations(100, seed=34):
        if window is None:
            continue
        lq, lk = int(nq[0]), int(nk[0])
        offset, moved = dense.offsets(tq, tk, [lq], [lk], align, 1)[0], tk - tq
        left, right = window_sides(causal, window)
        want = Visibility(lq, lk, offset, -1, 0 if causal else -1).mask(0, tq, 0, tk) & \
            Visibility(lq, lk, moved, left, -1 if causal else right).mask(0, tq, 0, tk)
        got = dense.visible(torch.arange(tq), tk, causal=causal, offset=offset, window=window, nq=lq, nk=lk,
                            window_offset=moved)
        assert np.array_equal(got.numpy(), want), (tq, tk, lq, lk, causal, align, window)
