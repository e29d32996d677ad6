"""FlashAttention-2 in Triton: the forward of the paper's Algorithm 1 and the backward of
its Algorithm 2, as a callable the check takes.

    TRITON_INTERPRET=1 python -m parity_tests check examples.triton_attention:attention \\
        --dtype float16,bfloat16,float32 --tokens 64,128 --head-dim 32,64      # CPU
    python -m parity_tests check examples.triton_attention:attention --device cuda \\
        --dtype float16,bfloat16 --tokens 128,1024 --head-dim 64,128           # GPU

Letters are the paper's (Dao, "FlashAttention-2", 2023):

- forward (Algorithm 1): one program per (query tile of BLOCK_M rows, batch x head). It
  walks the key tiles of BLOCK_N columns keeping, per row, the running max ``m``, the
  running sum ``l`` of ``exp(S - m)`` and the unnormalised output ``acc``; when a tile
  raises the max, ``acc`` and ``l`` are first rescaled by ``alpha = exp(m_old - m_new)``.
  At the end ``O = acc / l`` and the log-sum-exp ``L = m + log(l)`` is saved.
- backward (Algorithm 2): a preprocess computes ``D = rowsum(dO * O)``; then one program
  per key tile accumulates ``dV = sum P^T dO`` and ``dK = scale * sum dS^T Q`` over the
  query tiles, with ``P = exp(S - L)`` recomputed and ``dS = P * (dP - D)``,
  ``dP = dO V^T``; a third kernel, one program per query tile, accumulates
  ``dQ = scale * sum dS K`` over the key tiles (no atomics: dQ is written once).

``causal`` is top-left (query i sees key j iff j <= i, SDPA's ``is_causal``), applied in
the forward AND the backward only when asked for.  Inputs are read through their strides
(any view works); outputs and gradients are contiguous.

What it takes, and refuses with `Unsupported` otherwise (so the check draws its input
classes at these shapes): q, k, v (B, H, T, D) of one dtype among float16, bfloat16 and
float32, T a multiple of the tile (64) and Tq = Tk, D in 16, 32, 64, 128, the same B and
H for q, k and v; on CUDA natively, or on the CPU under ``TRITON_INTERPRET=1``.

Tile sizes are pinned (no autotuner: its benchmarking needs a GPU).  Nothing here asks
for a GPU when the module is imported.  Under the interpreter (Triton 3.9), ``tl.dot`` of
bfloat16 tiles multiplies their raw bit patterns (bfloat16 is held as uint16 there), so
bfloat16 tiles are widened to float32 after each load (exact), and P and dS are rounded
to bfloat16 and widened again before their products (`_as_input`): the same numbers as
the GPU's bfloat16 MMA with float32 accumulation.  float32 uses ``input_precision="ieee"`` (Triton's default
on GPU is TF32, 10 mantissa bits).
"""

import contextlib
import math

import torch
import triton
import triton.language as tl

from parity_tests.kernels.targets import Unsupported

__all__ = ["attention", "flash_attention", "BLOCK_M", "BLOCK_N", "HEAD_DIMS", "DTYPES"]

BLOCK_M = 64          # query rows per tile (the paper's B_r)
BLOCK_N = 64          # key columns per tile (the paper's B_c); BLOCK_M == BLOCK_N keeps the
                      # causal diagonal inside one tile
HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _fwd_kernel(Q, K, V, O, L,
                sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
                H, T, scale,
                CAUSAL: tl.constexpr, RESCALE: tl.constexpr, UPCAST: tl.constexpr,
                PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)

    # Q_i: this program's BLOCK_M query rows, read through q's strides
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)    # m: running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                  # l: running sum of exp(S - m)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)          # unnormalised O

    # causal: key tiles past the diagonal tile hold no visible key for these rows
    if CAUSAL:
        hi = (start_m + 1) * BLOCK_M
    else:
        hi = T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        # K_j^T (HEAD_D, BLOCK_N) and V_j (BLOCK_N, HEAD_D)
        kT = tl.load(k_base + cols[None, :] * skt + offs_d[:, None] * skd)
        v = tl.load(v_base + cols[:, None] * svt + offs_d[None, :] * svd)
        if UPCAST:
            kT = kT.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kT, input_precision=PRECISION) * scale         # S_ij = scale Q_i K_j^T
        if CAUSAL:
            s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))                         # m_new = max(m_old, rowmax(S_ij))
        alpha = tl.exp(m_i - m_new)                                   # alpha = exp(m_old - m_new)
        p = tl.exp(s - m_new[:, None])                                # P~_ij = exp(S_ij - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)                              # l_new = alpha l_old + rowsum(P~_ij)
        if RESCALE:
            acc = acc * alpha[:, None]                                # O_i <- diag(alpha) O_i ...
        acc = tl.dot(_as_input(p, Q, UPCAST), v, acc, input_precision=PRECISION)   # ... + P~_ij V_j
        m_i = m_new

    acc = acc / l_i[:, None]                                          # O_i = diag(l)^-1 O_i
    tl.store(L + bh.to(tl.int64) * T + offs_m, m_i + tl.log(l_i))     # L_i = m_i + log(l_i)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
             acc.to(O.dtype.element_ty))


@triton.jit
def _bwd_preprocess(O, DO, Delta,
                    sob, soh, sot, sod, sdb, sdh, sdt, sdd,
                    H, T,
                    BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd).to(tl.float32)
    tl.store(Delta + bh.to(tl.int64) * T + offs_m, tl.sum(do * o, 1))   # D_i = rowsum(dO_i * O_i)


@triton.jit
def _tile_p(q, k, Li, offs_m, offs_n, scale, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """A tile's P_ij = exp(S_ij - L_i), S = scale Q_i K_j^T, masked when causal (both passes)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale          # S_ij
    if CAUSAL:
        s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    return tl.exp(s - Li[:, None])


@triton.jit
def _as_input(x, Q, UPCAST: tl.constexpr):
    """``x`` rounded to the inputs' dtype for the next product (widened back under the
    interpreter's bfloat16: the numbers of a bfloat16 MMA with float32 accumulation)."""
    x = x.to(Q.dtype.element_ty)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _tile_ds(p, do, v, Di, Q, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dS_ij = P_ij * (dP_ij - D_i), dP_ij = dO_i V_j^T, rounded for its product."""
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                # dP_ij = dO_i V_j^T
    return _as_input(p * (dp - Di[:, None]), Q, UPCAST)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, L, Delta, DK, DV,
                     sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                     sdb, sdh, sdt, sdd,
                     H, T, scale,
                     CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)

    # K_j, V_j: this program's BLOCK_N keys, held while the query tiles stream past
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svt + offs_d[None, :] * svd)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    q_base = Q + b * sqb + h * sqh
    do_base = DO + b * sdb + h * sdh
    row_base = bh.to(tl.int64) * T

    # causal: query tiles before this key tile see none of its keys
    if CAUSAL:
        lo = start_n * BLOCK_N
    else:
        lo = 0
    for start_m in range(lo, T, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :] * sqd)
        do = tl.load(do_base + offs_m[:, None] * sdt + offs_d[None, :] * sdd)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        Li = tl.load(L + row_base + offs_m)                                 # L_i
        Di = tl.load(Delta + row_base + offs_m)                             # D_i
        p = _tile_p(q, k, Li, offs_m, offs_n, scale, CAUSAL, PRECISION)    # P_ij = exp(S_ij - L_i)
        dv = tl.dot(tl.trans(_as_input(p, Q, UPCAST)), do, dv, input_precision=PRECISION)   # dV_j += P_ij^T dO_i
        ds = _tile_ds(p, do, v, Di, Q, UPCAST, PRECISION)                   # dS_ij = P_ij * (dP_ij - D_i)
        dk = tl.dot(tl.trans(ds), q, dk, input_precision=PRECISION)        # dK_j += dS_ij^T Q_i
    dk = dk * scale                                                         # (S = scale Q K^T)
    tl.store(DK + bh.to(tl.int64) * T * HEAD_D + offs_n[:, None] * HEAD_D + offs_d[None, :],
             dk.to(DK.dtype.element_ty))
    tl.store(DV + bh.to(tl.int64) * T * HEAD_D + offs_n[:, None] * HEAD_D + offs_d[None, :],
             dv.to(DV.dtype.element_ty))


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, L, Delta, DQ,
                   sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                   sdb, sdh, sdt, sdd,
                   H, T, scale,
                   CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    row_base = bh.to(tl.int64) * T

    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    Li = tl.load(L + row_base + offs_m)
    Di = tl.load(Delta + row_base + offs_m)
    dq = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh

    if CAUSAL:
        hi = (start_m + 1) * BLOCK_M
    else:
        hi = T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_base + cols[:, None] * skt + offs_d[None, :] * skd)
        v = tl.load(v_base + cols[:, None] * svt + offs_d[None, :] * svd)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = _tile_p(q, k, Li, offs_m, cols, scale, CAUSAL, PRECISION)      # P_ij = exp(S_ij - L_i)
        ds = _tile_ds(p, do, v, Di, Q, UPCAST, PRECISION)                   # dS_ij = P_ij * (dP_ij - D_i)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)                  # dQ_i += dS_ij K_j
    dq = dq * scale
    tl.store(DQ + row_base * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :],
             dq.to(DQ.dtype.element_ty))


def _interpreted():
    """True when Triton's interpreter runs the kernels (``TRITON_INTERPRET=1`` when
    this module was imported: ``triton.jit`` decides then, not at launch)."""
    return type(_fwd_kernel).__name__ == "InterpretedFunction"


def _refuse(q, k, v):
    """Raise `Unsupported` for what the kernels cannot take; returns nothing."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise Unsupported("q, k and v must be 4-D (B, H, T, D)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise Unsupported("dtype must be float16, bfloat16 or float32, the same for q, k and v")
    B, H, T, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise Unsupported("q, k and v must have the same batch and heads (no GQA)")
    if k.shape[2] != T or v.shape[2] != T:
        raise Unsupported("Tq must equal Tk")
    if T == 0 or T % BLOCK_M:
        raise Unsupported(f"T must be a multiple of {BLOCK_M} (the tile)")
    if D not in HEAD_DIMS or k.shape[3] != D or v.shape[3] != D:
        raise Unsupported(f"D must be one of {', '.join(map(str, HEAD_DIMS))}, the same for q, k and v")
    if not (q.device == k.device == v.device):
        raise Unsupported("q, k and v must be on one device")
    if q.device.type == "cpu" and not _interpreted():
        raise Unsupported("on the CPU the kernels run only under TRITON_INTERPRET=1")
    if q.device.type not in ("cpu", "cuda"):
        raise Unsupported(f"device {q.device.type} is not CUDA")


def _config(q):
    """The pinned launch: constexprs and warps (no autotuning)."""
    upcast = _interpreted() and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"   # tf32 is ignored for 16-bit inputs
    num_warps = 8 if q.shape[-1] == 128 else 4
    return upcast, precision, num_warps


def _device(q):
    return torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, rescale):
        B, H, T, D = q.shape
        upcast, precision, num_warps = _config(q)
        o = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
        with _device(q):
            _fwd_kernel[(T // BLOCK_M, B * H)](
                q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                H, T, scale,
                CAUSAL=causal, RESCALE=rescale, UPCAST=upcast, PRECISION=precision,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=D, num_warps=num_warps, num_stages=2)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        upcast, precision, num_warps = _config(q)
        delta = torch.empty_like(lse)
        dq = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
        dk = torch.empty((B, H, T, D), dtype=k.dtype, device=q.device)
        dv = torch.empty((B, H, T, D), dtype=v.dtype, device=q.device)
        with _device(q):
            _bwd_preprocess[(T // BLOCK_M, B * H)](
                o, do, delta, *o.stride(), *do.stride(), H, T,
                BLOCK_M=BLOCK_M, HEAD_D=D)
            strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
            _bwd_dkdv_kernel[(T // BLOCK_N, B * H)](
                q, k, v, do, lse, delta, dk, dv, *strides, H, T, ctx.scale,
                CAUSAL=ctx.causal, UPCAST=upcast, PRECISION=precision,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=D, num_warps=num_warps, num_stages=1)
            _bwd_dq_kernel[(T // BLOCK_M, B * H)](
                q, k, v, do, lse, delta, dq, *strides, H, T, ctx.scale,
                CAUSAL=ctx.causal, UPCAST=upcast, PRECISION=precision,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=D, num_warps=num_warps, num_stages=1)
        return dq, dk, dv, None, None, None


def flash_attention(q, k, v, *, causal=False, scale=None, rescale=True):
    """FlashAttention-2 of q, k, v (B, H, T, D); ``rescale=False`` drops the accumulator's
    ``alpha = exp(m_old - m_new)`` (the planted mistake of `examples.triton_attention_bug`)."""
    _refuse(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _FlashAttention.apply(q, k, v, bool(causal), scale, bool(rescale))


def attention(q, k, v, *, causal, scale):
    """The check's callable: ``fn(q, k, v, *, causal, scale) -> out``."""
    return flash_attention(q, k, v, causal=causal, scale=scale)
