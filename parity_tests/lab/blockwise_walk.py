"""``backprop --blockwise [--tile N] [--token N]``: the chapter's example in tiles.

The same six tokens, weights and upstream gradient G as ``backprop`` (CausalAttention,
d_out = 2), computed the way FlashAttention-2 does: never the whole (T, T) matrix
at once, but tiles of B_r query rows by B_c key columns (B_r = B_c = N, default 2).
S is the softmax input, S = Q Kᵀ / √d_k (the chapter's ω̃/√d_k).

Forward, for each query tile i, over its key tiles j (a tile wholly in the future
is skipped, a tile that crosses the diagonal is masked)::

    m_new = max(m, rowmax(S_ij))          the running maximum
    α     = exp(m − m_new)                rescales what was summed under the old m
    P̃_ij  = exp(S_ij − m_new)
    ℓ     = α ℓ + rowsum(P̃_ij)            the running sum
    Õ     = α Õ + P̃_ij V_j                the unnormalised output
    then  O_i = Õ / ℓ,   L_i = m + log ℓ  (the log-sum-exp of the row)

Backward, D_i = rowsum(dO_i ∘ O_i) in place of the chapter's ⟨w, g⟩: since
O = P V, Σ_c dO_c O_c = Σ_j P_j Σ_c dO_c V_jc = Σ_j P_j dP_j = ⟨w, g⟩.  Then,
for each key tile j and each query tile i that sees it::

    P_ij  = exp(S_ij − L_i)               the softmax, rebuilt from L alone
    dP_ij = dO_i V_jᵀ
    dS_ij = P_ij ∘ (dP_ij − D_i)          the chapter's w ⊙ (g − ⟨w, g⟩)
    dV_j += P_ijᵀ dO_i,   dK_j += dS_ijᵀ Q_i / √d_k,   dQ_i += dS_ij K_j / √d_k

Every quantity is printed beside the dense computation's numbers for the same
rows (the full softmax; a running quantity after key tile j is the dense one over
keys 1..end of tile j), with their difference; each must agree within the
suite's float64 bound.
"""

from dataclasses import dataclass, field

import numpy as np

from numpy_ref.visibility import Visibility, visible_mask
from parity_tests.common.finite_diff import rel_error
from parity_tests.common.tolerances import FLOAT64_BOUND
from parity_tests.lab import example
from parity_tests.lab.zoom import _signed, num

DEFAULT_TILE = 2


# --- the chapter's numbers ---------------------------------------------------------

def chapter_qkv():
    """Q, K, V (T, d_out), the upstream dO = G (T, d_out) and d_k, in float64."""
    m_t, _ = example.build("CausalAttention")
    x = example.inputs("CausalAttention")[0]
    sd = {k: v.numpy() for k, v in m_t.state_dict().items()}

    def project(layer):
        bias = sd.get(f"{layer}.bias")
        return x @ sd[f"{layer}.weight"].T + (0.0 if bias is None else bias)

    q, k, v = project("W_query"), project("W_key"), project("W_value")
    dO = example.upstream((1,) + q.shape)[0]
    return q, k, v, dO, q.shape[-1]


def dense(q, k, v, dO, d_k):
    """The whole-matrix computation, the chapter's way: S, P = softmax(S), O = P V,
    dP = dO Vᵀ, dS = P ∘ (dP − ⟨w, g⟩) with ⟨w, g⟩ = rowsum(P ∘ dP)."""
    T = q.shape[0]
    S = q @ k.T / np.sqrt(d_k)
    S = np.where(visible_mask(T, T, causal=True), S, -np.inf)
    m = S.max(axis=1, keepdims=True)
    E = np.exp(S - m)
    P = E / E.sum(axis=1, keepdims=True)
    O = P @ v
    L = m + np.log(E.sum(axis=1, keepdims=True))
    dP = dO @ v.T
    wg = np.sum(P * dP, axis=1, keepdims=True)
    dS = P * (dP - wg)
    return dict(S=S, P=P, O=O, L=L, dP=dP, wg=wg, dS=dS, dq=dS @ k / np.sqrt(d_k),
                dk=dS.T @ q / np.sqrt(d_k), dv=P.T @ dO)


def dense_prefix(S, v, rows, end):
    """The running forward quantities over keys 0..end-1, densely: m, ℓ, Õ."""
    s = S[rows, :end]
    m = s.max(axis=1, keepdims=True)
    E = np.exp(s - m)
    return m, E.sum(axis=1, keepdims=True), E @ v[:end]


# --- the tiles -------------------------------------------------------------------

def tiles(T, size):
    """[(start, stop), ...] covering 0..T-1 in steps of ``size``."""
    return [(a, min(a + size, T)) for a in range(0, T, size)]


def causal_tile(rows, cols):
    """``None`` when the tile lies wholly in the future (skipped), else its mask:
    True where the key comes after the query (numpy_ref.visibility's rule)."""
    (r0, r1), (c0, c1) = rows, cols
    vis = Visibility(r1, c1, offset=0, left=-1, right=0)      # causal, top-left
    if c0 >= vis.key_range(r0, r1)[1]:
        return None
    return ~vis.mask(r0, r1, c0, c1)


def online_step(m, ell, acc, S_ij, V_j):
    """One key tile of the online softmax: (m_new, α, ℓ_new, Õ_new)."""
    m_new = np.maximum(m, S_ij.max(axis=1, keepdims=True))
    alpha = np.exp(m - m_new)
    P_tilde = np.exp(S_ij - m_new)
    return m_new, alpha, alpha * ell + P_tilde.sum(axis=1, keepdims=True), \
        alpha * acc + P_tilde @ V_j


def tile_backward(S_ij, L_i, dO_i, D_i, Q_i, K_j, V_j, d_k):
    """One tile of the backward: P, dP, dS and the dq, dk, dv contributions."""
    P = np.exp(S_ij - L_i)
    dP = dO_i @ V_j.T
    dS = P * (dP - D_i)
    root = np.sqrt(d_k)
    return dict(P=P, dP=dP, dS=dS, dq=dS @ K_j / root, dk=dS.T @ Q_i / root, dv=P.T @ dO_i)


# --- the checks ------------------------------------------------------------------

@dataclass
class Check:
    label: str              # where: which tiles, which quantity
    formula: str
    rows: list              # one name per printed row
    blockwise: np.ndarray
    dense: np.ndarray
    error: float = 0.0
    bound: float = FLOAT64_BOUND

    @property
    def passed(self):
        return bool(self.error <= self.bound)


@dataclass
class BlockwiseWalk:
    tile: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dO: np.ndarray
    d_k: int
    dense: dict
    checks: list = field(default_factory=list)
    out: np.ndarray = None
    L: np.ndarray = None
    D: np.ndarray = None
    dq: np.ndarray = None
    dk: np.ndarray = None
    dv: np.ndarray = None

    @property
    def passed(self):
        return all(c.passed for c in self.checks)


def _error(a, b):
    """rel_error over the finite entries; -inf (masked) must sit in the same places."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.array_equal(np.isneginf(a), np.isneginf(b)):
        return float("inf")
    keep = ~np.isneginf(a)
    return rel_error(a[keep], b[keep]) if keep.any() else 0.0


def _names(a, b):
    return example.TOKENS[a:b]


def _span(a, b):
    return ", ".join(_names(a, b))


def walk(tile=DEFAULT_TILE):
    """The blockwise forward and backward of the chapter's example, every step
    beside the dense computation's numbers."""
    if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)):
        raise TypeError(f"tile must be a positive int, got {type(tile).__name__}")
    if tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile}")
    q, k, v, dO, d_k = chapter_qkv()
    ref = dense(q, k, v, dO, d_k)
    T = q.shape[0]
    w = BlockwiseWalk(int(tile), q, k, v, dO, d_k, ref)
    def add(label, formula, rows, blockwise, dense_value):
        w.checks.append(Check(label, formula, rows, blockwise, dense_value))

    root = np.sqrt(d_k)
    out, L = np.zeros_like(q), np.zeros((T, 1))
    blocks = tiles(T, w.tile)

    # forward: for each query tile, the online softmax over its key tiles
    for i, (r0, r1) in enumerate(blocks, 1):
        rows = _names(r0, r1)
        n = r1 - r0
        m, ell, acc = np.full((n, 1), -np.inf), np.zeros((n, 1)), np.zeros((n, v.shape[1]))
        m_prev_dense = m
        for j, (c0, c1) in enumerate(blocks, 1):
            mask = causal_tile((r0, r1), (c0, c1))
            if mask is None:
                continue
            where = f"forward  q tile {i} ({_span(r0, r1)}) · k tile {j} ({_span(c0, c1)})"
            S_ij = np.where(mask, -np.inf, q[r0:r1] @ k[c0:c1].T / root)
            masked = "   (keys after the query masked: -inf)" if mask.any() else ""
            add(f"{where}: S", "S_ij = Q_i K_jᵀ / √d_k" + masked, rows, S_ij, ref["S"][r0:r1, c0:c1])
            m_old = m
            m, alpha, ell, acc = online_step(m, ell, acc, S_ij, v[c0:c1])
            dm, dl, dacc = dense_prefix(ref["S"], v, slice(r0, r1), c1)
            add(f"{where}: m", "m = max(m_old, rowmax(S_ij))", rows, m, dm)
            if np.isfinite(m_old).all():
                add(f"{where}: α", "α = exp(m_old − m)", rows, alpha, np.exp(m_prev_dense - dm))
            add(f"{where}: ℓ", "ℓ = α ℓ_old + rowsum(exp(S_ij − m))", rows, ell, dl)
            add(f"{where}: Õ", "Õ = α Õ_old + exp(S_ij − m) V_j   (unnormalised)", rows, acc, dacc)
            m_prev_dense = dm
        out[r0:r1] = acc / ell
        L[r0:r1] = m + np.log(ell)
        where = f"forward  q tile {i} ({_span(r0, r1)})"
        add(f"{where}: L", "L = m + log ℓ   (dense: log Σ_k exp(S_k))", rows, L[r0:r1], ref["L"][r0:r1])
        add(f"{where}: O", "O = Õ / ℓ   (dense: P V)", rows, out[r0:r1], ref["O"][r0:r1])

    # backward: D from the output, then for each key tile its query tiles
    D = np.sum(dO * out, axis=1, keepdims=True)
    for i, (r0, r1) in enumerate(blocks, 1):
        add(f"backward q tile {i} ({_span(r0, r1)}): D", "D = rowsum(dO ∘ O)   (dense: ⟨w, g⟩)",
            _names(r0, r1), D[r0:r1], ref["wg"][r0:r1])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for j, (c0, c1) in enumerate(blocks, 1):
        for i, (r0, r1) in enumerate(blocks, 1):
            mask = causal_tile((r0, r1), (c0, c1))
            if mask is None:
                continue
            S_ij = np.where(mask, -np.inf, q[r0:r1] @ k[c0:c1].T / root)
            t = tile_backward(S_ij, L[r0:r1], dO[r0:r1], D[r0:r1], q[r0:r1], k[c0:c1],
                              v[c0:c1], d_k)
            dq[r0:r1] += t["dq"]
            dk[c0:c1] += t["dk"]
            dv[c0:c1] += t["dv"]
            where = f"backward k tile {j} ({_span(c0, c1)}) · q tile {i} ({_span(r0, r1)})"
            rows, cols = _names(r0, r1), _names(c0, c1)
            sl = (slice(r0, r1), slice(c0, c1))
            dS_d, P_d = ref["dS"][sl], ref["P"][sl]
            add(f"{where}: P", "P = exp(S_ij − L_i)   (dense: softmax(S))", rows, t["P"], P_d)
            add(f"{where}: dP", "dP = dO_i V_jᵀ", rows, t["dP"], ref["dP"][sl])
            add(f"{where}: dS", "dS = P ∘ (dP − D)", rows, t["dS"], dS_d)
            add(f"{where}: dq", "dQ_i += dS K_j / √d_k   (this tile's part)", rows,
                t["dq"], dS_d @ k[c0:c1] / root)
            add(f"{where}: dk", "dK_j += dSᵀ Q_i / √d_k   (this tile's part)", cols,
                t["dk"], dS_d.T @ q[r0:r1] / root)
            add(f"{where}: dv", "dV_j += Pᵀ dO_i   (this tile's part)", cols,
                t["dv"], P_d.T @ dO[r0:r1])
    names = list(example.TOKENS)
    add("result: dQ", "dQ, summed over the key tiles   (dense: dS K / √d_k)", names, dq, ref["dq"])
    add("result: dK", "dK, summed over the query tiles   (dense: dSᵀ Q / √d_k)", names, dk, ref["dk"])
    add("result: dV", "dV, summed over the query tiles   (dense: Pᵀ dO)", names, dv, ref["dv"])
    for c in w.checks:
        c.error = _error(c.blockwise, c.dense)
    w.out, w.L, w.D, w.dq, w.dk, w.dv = out, L, D, dq, dk, dv
    return w


# --- printing --------------------------------------------------------------------

def _delta(a, b):
    with np.errstate(invalid="ignore"):                # -inf − -inf: both masked, Δ = 0
        d = np.where(np.isneginf(a) & np.isneginf(b), 0.0, np.abs(a - b))
    return float(np.max(d))


def _cells(row):
    return " ".join(num(x) for x in row)


def print_walk(w):
    print(f"blockwise CausalAttention on the chapter's input (\"Your journey starts with one "
          f"step\", d_in = 3), float64, tiles of B_r = B_c = {w.tile}")
    print("S = Q Kᵀ / √d_k; upstream dO = G, as in `backprop`; dense: the whole (6, 6) matrices")
    print()
    for n, c in enumerate(w.checks, 1):
        print(f"[{n}] {c.label}   {c.formula}")
        width = max(c.blockwise.shape[1] * 9 - 1, len("blockwise"))
        print(f"    {'':<8}  {'blockwise':<{width}}   {'dense':<{width}}   max |Δ|")
        for name, a, b in zip(c.rows, c.blockwise, c.dense):
            print(f"    {name:<8}  {_cells(a)}   {_cells(b)}   {_delta(a, b):.1e}")
        print(f"    error {c.error:.1e} <= {c.bound:.0e}: {'ok' if c.passed else 'FAIL'}")
        print()
    worst = max(w.checks, key=lambda c: c.error)
    n_ok = sum(c.passed for c in w.checks)
    print(f"{n_ok}/{len(w.checks)} blockwise intermediates agree with the dense computation "
          f"within the float64 bound {FLOAT64_BOUND:.0e} (largest error {worst.error:.1e}, "
          f"{worst.label})")


def zoom_terms(w, token):
    """For one row: D = Σ_c dO_c O_c and ⟨w, g⟩ = Σ_j P_j dP_j, term by term."""
    P, dP = w.dense["P"][token], w.dense["dP"][token]
    keys = int(np.count_nonzero(P))                  # the causal row sees keys 0..token
    return dict(dO=w.dO[token], O=w.out[token], D_terms=w.dO[token] * w.out[token],
                D=float(w.D[token, 0]), P=P[:keys], dP=dP[:keys], wg_terms=P[:keys] * dP[:keys],
                wg=float(np.sum(P[:keys] * dP[:keys])))


def print_zoom(w, token):
    t = zoom_terms(w, token)
    print(f"== zoom on query {token + 1} ({example.TOKENS[token]!r}): D = rowsum(dO ∘ O) is the "
          f"chapter's ⟨w, g⟩")
    d_terms = " + ".join(f"{_signed(a)}·{_signed(b)}" for a, b in zip(t["dO"], t["O"]))
    print(f"   D = Σ_c dO_c O_c = {d_terms} = {num(t['D'], 0)}")
    wg_terms = " + ".join(f"{_signed(a)}·{_signed(b)}" for a, b in zip(t["P"], t["dP"]))
    print(f"   ⟨w, g⟩ = Σ_j w_j g_j = {wg_terms} = {num(t['wg'], 0)}   (w = P row, g = dP row)")
    print("   why: O_c = Σ_j w_j V_jc and g_j = Σ_c dO_c V_jc, so both sums are Σ_j Σ_c w_j dO_c V_jc")
    print("   key        w_j       g_j    w_j·g_j")
    for name, a, b, c in zip(example.TOKENS, t["P"], t["dP"], t["wg_terms"]):
        print(f"   {name:<9}" + " ".join(num(x) for x in (a, b, c)))
    print(f"   |D − ⟨w, g⟩| = {abs(t['D'] - t['wg']):.1e}")
