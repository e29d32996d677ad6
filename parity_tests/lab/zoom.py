"""``backprop --token N``: one query row of the softmax backward, term by term.

For query i the softmax maps its scores a (one row of ω̃/√d_k) to its weights
w; the chapter's Jacobian of that map is::

    J[j, k] = ∂w_j/∂a_k = w_j (δ_jk − w_k)          J = diag(w) − w wᵀ

and with g = dL/dw (that row of the upstream gradient) the chain rule gives::

    dL/da_k = Σ_j g_j J[j, k] = w_k g_k − w_k Σ_j w_j g_j = w_k (g_k − ⟨w, g⟩)

Both are printed, with every term, beside autograd's dL/da for the same row.
"""

import numpy as np

from numpy_ref.softmax import softmax_jacobian
from parity_tests.lab import example



def num(x, width=8):
    """4 decimals; what rounds to zero prints as 0.0000, never -0.0000."""
    return f"{(x if abs(x) >= 5e-5 else 0.0):{width}.4f}"


def _signed(x):
    """A factor in a written-out product: negatives in parentheses."""
    return f"({num(x, 0)})" if x < -5e-5 else num(x, 0)


def _rows_of(a, token):
    """Every head's row ``token`` of a (..., T, T) array: list of (head label, row)."""
    a = np.asarray(a)
    heads = a.reshape(-1, *a.shape[-2:])
    multi = heads.shape[0] > 1
    return [(f"head {h}" if multi else "", heads[h, token]) for h in range(heads.shape[0])]


def zoom_terms(w, g):
    """The zoom's numbers for one row: J, <w, g>, and the per-key terms."""
    J = softmax_jacobian(w)
    dot = float(np.dot(w, g))
    return dict(J=J, dot=dot, centred=g - dot, product=w * (g - dot), via_J=g @ J)


def print_zoom(walk, token):
    word = example.TOKENS[token]
    print(f"== zoom on query {token + 1} ({word!r}): the softmax backward of its row")
    for prefix, (weights, grads) in walk.softmax_rows.items():
        auto = walk.autograd_softmax[prefix]
        for (head, w), (_, g), (_, a) in zip(_rows_of(weights, token), _rows_of(grads, token),
                                             _rows_of(auto, token)):
            where = " ".join(p for p in (prefix.rstrip("."), head) if p)
            print_row(w, g, a, where)


def print_row(w, g, auto, where=""):
    t = zoom_terms(w, g)
    keys = example.TOKENS[:len(w)]
    title = f"-- {where}: " if where else "-- "
    print(f"{title}w = softmax row, g = dL/dw (upstream, after dropout's backward)")
    print("   J = diag(w) − w wᵀ   (row j: ∂w_j/∂a_k for each key k)")
    print("   " + " " * 9 + " ".join(f"{k:>8}" for k in keys))
    for k, row in zip(keys, t["J"]):
        print(f"   {k:<9}" + " ".join(num(v) for v in row))
    terms = " + ".join(f"{_signed(wj)}·{_signed(gj)}" for wj, gj in zip(w, g) if wj != 0)
    print(f"   ⟨w, g⟩ = Σ_j w_j g_j = {terms} = {num(t['dot'], 0)}")
    print("   key        w_k       g_k   g_k−⟨w,g⟩  w_k(g_k−⟨w,g⟩)   (gᵀJ)_k   autograd   |Δ|")
    for i, k in enumerate(keys):
        print(f"   {k:<9}" + " ".join(num(v) for v in (w[i], g[i], t["centred"][i]))
              + f"   {num(t['product'][i], 11)}   {num(t['via_J'][i])}  {num(auto[i])}"
              + f"   {abs(t['product'][i] - auto[i]):.1e}")
    print()
