"""Section 6 of ``attention-parity claims``: the chapter's memory model.

The chapter's example: M = [[1, 2, 3], [4, 5, 6]] is six consecutive cells.
``.view(3, 2)`` re-reads them (no copy); ``.transpose`` re-reads them with
jumps (logical order 1 4 2 5 3 6, memory order 1 2 3 4 5 6: non-contiguous);
``.view`` then refuses, and ``.contiguous()`` copies into a new block.
NumPy says the same with ``np.shares_memory`` and ``flags['C_CONTIGUOUS']``;
its ``reshape`` copies silently where PyTorch's ``view`` raises.
"""

import warnings

import numpy as np
import torch

from parity_tests.common.verdicts import verdict


def _order(a):
    return " ".join(str(int(v)) for v in np.asarray(a).ravel())


def numpy_rows():
    M = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32)
    V = M.reshape(3, 2)
    T = M.T
    flat = T.reshape(6)
    C = np.ascontiguousarray(T)
    return [
        ("numpy: M.reshape(3, 2) shares M's memory (a view)",
         f"shares_memory={np.shares_memory(M, V)}, rows {V.tolist()}", "no copy",
         verdict(np.shares_memory(M, V) and V.base is M)),
        ("numpy: M.T shares memory, is not C-contiguous",
         f"shares_memory={np.shares_memory(M, T)}, C_CONTIGUOUS={T.flags['C_CONTIGUOUS']}, "
         f"strides {T.strides}", "non contigu",
         verdict(np.shares_memory(M, T) and not T.flags["C_CONTIGUOUS"])),
        ("numpy: M.T.reshape(6) must copy (logical order != memory order)",
         f"shares_memory={np.shares_memory(M, flat)}, order {_order(flat)}", "1 4 2 5 3 6",
         verdict(not np.shares_memory(M, flat) and _order(flat) == "1 4 2 5 3 6")),
        ("numpy: ascontiguousarray(M.T) copies into a new block",
         f"shares_memory={np.shares_memory(M, C)}, C_CONTIGUOUS={C.flags['C_CONTIGUOUS']}",
         "copie", verdict(not np.shares_memory(M, C) and C.flags["C_CONTIGUOUS"])),
    ]


def _view_raises(t, shape):
    try:
        t.view(*shape)
    except RuntimeError as e:
        return True, str(e).split(" (")[0][:48]
    return False, "no error"


def torch_rows():
    M = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    V = M.view(3, 2)
    T = M.transpose(0, 1)
    raised, msg = _view_raises(T, (6,))
    C = T.contiguous()
    ctx = torch.zeros(2, 2, 6, 3).transpose(1, 2)          # (b, H, T, d_h) -> (b, T, H, d_h)
    ctx_raised, _ = _view_raises(ctx, (2, 6, 6))
    ok_view = ctx.contiguous().view(2, 6, 6).shape == (2, 6, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shape_T = tuple(torch.zeros(2, 6, 3).T.shape)
    return [
        ("torch: M.view(3, 2) has M's data_ptr (no copy)",
         f"same data_ptr={V.data_ptr() == M.data_ptr()}, rows {V.tolist()}",
         "[[1, 2], [3, 4], [5, 6]]",
         verdict(V.data_ptr() == M.data_ptr() and V.tolist() == [[1, 2], [3, 4], [5, 6]])),
        ("torch: M.transpose(0, 1) has M's data_ptr, is not contiguous",
         f"same data_ptr={T.data_ptr() == M.data_ptr()}, is_contiguous={T.is_contiguous()}, "
         f"stride {T.stride()}", "non contigu",
         verdict(T.data_ptr() == M.data_ptr() and not T.is_contiguous())),
        ("torch: .view on the transposed tensor raises", f"{raised}: {msg}", "erreur",
         verdict(raised)),
        ("torch: .contiguous() copies, in logical order",
         f"same data_ptr={C.data_ptr() == M.data_ptr()}, is_contiguous={C.is_contiguous()}, "
         f"memory {_order(C.flatten())}", "nouveau bloc, 1 4 2 5 3 6",
         verdict(C.data_ptr() != M.data_ptr() and C.is_contiguous()
                 and _order(C.flatten()) == "1 4 2 5 3 6")),
        ("torch: MHA step 5, (b,T,H,d_h).view(b,T,d_out) raises; .contiguous().view works",
         f"raises={ctx_raised}, after contiguous ok={ok_view}", "erreur ; ok",
         verdict(ctx_raised and ok_view)),
        ("torch: .T on a 3-D (b, T, d) tensor reverses every axis",
         f"{shape_T}{' (deprecated: a warning)' if caught else ''}", "(d_out, num_tokens, b)",
         verdict(shape_T == (3, 6, 2))),
    ]


def memory_rows():
    return numpy_rows() + torch_rows()
