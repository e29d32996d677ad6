"""The rows of the walkthrough: every intermediate gradient, in reverse order of
the forward, with its formula in the chapter's notation and both sides' values.

Notation (the chapter's): x the inputs, Q = x W_Q, K = x W_K, V = x W_V (v1
writes x @ W; nn.Linear stores W transposed, so v2 and after compute x Wᵀ),
ω = Q Kᵀ the attention scores, ω̃ the masked scores (-inf above the diagonal),
w = softmax(ω̃ / √d_k) the attention weights, w' = dropout(w), z = w' V the
context vectors.  ``d`` before a name is dL/d(that), L = sum(G ⊙ z).

numpy_ref folds 1/√d_k into its scores backward (it scales the queries in the
forward), so its gradients of ω and ω̃ are its softmax-input gradient divided
by √d_k there: the same numbers, one multiplication later.
"""

from dataclasses import dataclass, field

import numpy as np

from parity_tests.common.finite_diff import rel_error
from parity_tests.common.tolerances import FLOAT64_BOUND, SCALE_FLOOR
from parity_tests.lab import example, trace_numpy, trace_torch


@dataclass
class Step:
    key: str                 # name on autograd's side (trace_torch) or parameter name
    label: str               # what a learner calls it
    formula: str
    numpy: np.ndarray
    autograd: np.ndarray
    error: float = 0.0
    bound: float = FLOAT64_BOUND

    @property
    def passed(self):
        return bool(self.error <= self.bound)


@dataclass
class Walk:
    module: str
    x: np.ndarray
    G: np.ndarray
    dropout: float
    steps: list = field(default_factory=list)
    # per head prefix: attention weights w and their upstream gradient dw (NumPy)
    softmax_rows: dict = field(default_factory=dict)
    autograd_softmax: dict = field(default_factory=dict)

    @property
    def passed(self):
        return all(s.passed for s in self.steps)


class _Calls:
    """The tapped calls, read in order."""

    def __init__(self, calls):
        self.calls = list(calls)

    def next(self, name):
        while self.calls:
            op, args, result = self.calls.pop(0)
            if op == name:
                return args, result
        raise LookupError(f"numpy_ref made no further call of ops.{name}")

    def peek(self, name):
        return any(op == name for op, _, _ in self.calls)


def _attention_rows(calls, prefix, d_k, qkv, causal):
    """Rows from the context vectors back to Q, K, V for one attention (one head,
    or every head at once): list of (key, label, formula, numpy value)."""
    q, k, v = qkv
    (dz, _), (d_dropped, dvalues) = calls.next("weighted_sum_backward")
    rows = []
    if causal:
        rows.append((f"{prefix}dropped_weights", "attn_weights after dropout  w'",
                     "dw' = dz · Vᵀ", d_dropped))
    rows.append((f"{prefix}{v}", "values  V", "dV = w'ᵀ · dz" if causal else "dV = wᵀ · dz",
                 dvalues))
    dweights = d_dropped
    if causal and calls.peek("dropout_backward"):
        _, dweights = calls.next("dropout_backward")
    if causal:
        rows.append((f"{prefix}attn_weights", "attn_weights  w",
                     "dw = dw' ⊙ m / (1 − p)   (m: kept entries; identity when p = 0)", dweights))
    else:
        rows.append((f"{prefix}attn_weights", "attn_weights  w", "dw = dz · Vᵀ", dweights))
    (w, g), da = calls.next("softmax_backward")
    root = 1.0 if d_k is None else d_k ** 0.5
    if causal:
        rows.append((f"{prefix}scaled_scores", "softmax input  ω̃/√d_k",
                     "da = w ⊙ (dw − ⟨w, dw⟩)   row by row: J = diag(w) − w wᵀ", da))
        rows.append((f"{prefix}masked_scores", "masked scores  ω̃", "dω̃ = da / √d_k", da / root))
        _, dunmasked = calls.next("causal_mask_backward")
        rows.append((f"{prefix}attn_scores", "attn_scores  ω = Q Kᵀ",
                     "dω = dω̃, 0 where masked (key after query)", dunmasked / root))
    elif d_k is None:
        rows.append((f"{prefix}attn_scores", "attn_scores  ω = x xᵀ",
                     "dω = w ⊙ (dw − ⟨w, dw⟩)   row by row: J = diag(w) − w wᵀ", da))
    else:
        rows.append((f"{prefix}scaled_scores", "softmax input  ω/√d_k",
                     "da = w ⊙ (dw − ⟨w, dw⟩)   row by row: J = diag(w) − w wᵀ", da))
        rows.append((f"{prefix}attn_scores", "attn_scores  ω = Q Kᵀ", "dω = da / √d_k",
                     da / root))
    _, (dq, dk) = calls.next("scores_backward")
    if d_k is None:
        return rows + [("x.via_query", "x as the queries", "dx_q = dω · x", dq),
                       ("x.via_key", "x as the keys", "dx_k = dωᵀ · x", dk),
                       ("x.via_value", "x as the values", "dx_v = wᵀ · dz", dvalues)], (w, g)
    rows.append((f"{prefix}{q}", "queries  Q", "dQ = dω · K", dq))
    rows.append((f"{prefix}{k}", "keys  K", "dK = dωᵀ · Q", dk))
    return rows, (w, g)


def _projection_rows(calls, grads, prefix, v1=False):
    """Rows of the three projections, in the order numpy_ref backpropagates them."""
    rows, roads = [], []
    for role in ("value", "query", "key"):
        layer = f"W_{role}"
        letter = role[0].upper()
        if v1:
            _, (dx, dW) = calls.next("linear_v1_backward")
            rows.append((f"{prefix}{layer}", f"weight {layer}  (d_in, d_out)",
                         f"d{layer} = xᵀ · d{letter}", grads[f"{prefix}{layer}"]))
            roads.append((f"{prefix}x.via_{role}", f"x as input of {layer}",
                          f"dx_{letter.lower()} = d{letter} · {layer}ᵀ", dx))
            continue
        _, (dx, dW, db) = calls.next("linear_backward")
        rows.append((f"{prefix}{layer}.weight", f"weight {layer}  (d_out, d_in)",
                     f"d{layer} = d{letter}ᵀ · x   (summed over every token)",
                     grads[f"{prefix}{layer}.weight"]))
        if db is not None:
            rows.append((f"{prefix}{layer}.bias", f"bias of {layer}",
                         f"db = Σ_tokens d{letter}", grads[f"{prefix}{layer}.bias"]))
        roads.append((f"{prefix}x.via_{role}", f"x as input of {layer}",
                      f"dx_{letter.lower()} = d{letter} · {layer}", dx))
    order = {"query": 0, "key": 1, "value": 2}
    roads.sort(key=lambda r: order[r[0].rsplit("_", 1)[1]])
    return rows + roads


def _rows(name, calls, grads, dx, m_n):
    c = _Calls(calls)
    rows, softmax = [], {}
    if name == "SimplifiedSelfAttention":
        r, softmax[""] = _attention_rows(c, "", None, ("", "", ""), causal=False)
        # no V here: x is the values, its gradient on that road is the x.via_value row
        rows += [(k, l, f, v) for k, l, f, v in r if k != ""]
    elif name in ("SelfAttention_v1", "SelfAttention_v2", "CausalAttention"):
        d_k = m_n.d_out
        r, softmax[""] = _attention_rows(c, "", d_k, ("queries", "keys", "values"),
                                         causal=name == "CausalAttention")
        rows += r + _projection_rows(c, grads, "", v1=name == "SelfAttention_v1")
    elif name == "MultiHeadAttentionWrapper":
        _, slices = c.next("concat_heads_backward")
        for i, head in enumerate(m_n.heads):
            p = f"heads.{i}."
            r, softmax[p] = _attention_rows(c, p, head.d_out, ("queries", "keys", "values"), True)
            rows += [(f"{p}context_vec", f"head {i} output  z_{i}",
                      f"dz_{i} = dz[..., {i * head.d_out}:{(i + 1) * head.d_out}]   (cat undone)",
                      slices[i])]
            rows += r + _projection_rows(c, grads, p)
    else:                                           # MultiHeadAttention
        (_, (dmerged, dW_o, db_o)) = c.next("linear_backward")
        rows += [("out_proj.weight", "weight out_proj", "dW_o = dzᵀ · z_merged   (every token)",
                  grads["out_proj.weight"]),
                 ("out_proj.bias", "bias of out_proj", "db_o = Σ_tokens dz", grads["out_proj.bias"]),
                 ("merged", "merged heads  z_merged  (b, T, H·D)", "dz_merged = dz · W_o", dmerged)]
        _, dheads = c.next("merge_heads_backward")
        rows.append(("context_heads", "context per head  (b, H, T, D)",
                     "un-merge: (b, T, H·D) → (b, T, H, D) → (b, H, T, D)", dheads))
        r, softmax[""] = _attention_rows(c, "", m_n.head_dim,
                                         ("queries_heads", "keys_heads", "values_heads"), True)
        rows += r
        for role in ("queries", "keys", "values"):
            _, d = c.next("split_heads_backward")
            rows.append((role, f"{role}  (b, T, d_out), before the split",
                         "un-split: (b, H, T, D) → (b, T, H, D) → (b, T, H·D)", d))
        rows += _projection_rows(c, grads, "")
    rows.append(("x", "inputs  x   dL/dx", "dx = dx_q + dx_k + dx_v"
                 + ("   (summed over the heads)" if name == "MultiHeadAttentionWrapper" else ""),
                 dx))
    return rows, softmax


def _first_row(G):
    return ("context_vec", "context vectors  z   (the output)", "dz = G   (given: L = Σ G ⊙ z)", G)


def walk(name="CausalAttention", dropout=0.0):
    """Both sides' backward of the chapter's example through module ``name``."""
    if name not in example.SPECS:
        raise ValueError(f"module must be one of {', '.join(example.MODULES)}; got {name!r}")
    if not (0.0 <= dropout < 1.0):
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if dropout and not example.SPECS[name].has_dropout:
        raise ValueError(f"dropout: {name} has no dropout (only the causal modules do)")
    m_t, m_n = example.build(name, dropout)
    x = example.inputs(name)
    G = example.upstream(example.output_shape(m_t, x))
    tensors, dx_t, params_t, keep_masks = trace_torch.trace(m_t, x, G, example.DROPOUT_SEED)
    _, dx_n, grads_n, calls = trace_numpy.run(m_n, x, G, keep_masks)
    rows, softmax = _rows(name, calls, grads_n, dx_n, m_n)
    rows.insert(0, _first_row(G))
    result = Walk(name, x, G, dropout)
    result.softmax_rows = softmax
    for key, label, formula, value in rows:
        if key == "x":
            auto = dx_t
        elif key in params_t:
            auto = params_t[key]
        else:
            auto = tensors[key].grad.numpy().copy()
        result.steps.append(Step(key, label, formula, np.asarray(value, dtype=np.float64),
                                 auto))
    for p in softmax:
        result.autograd_softmax[p] = tensors[f"{p}scaled_scores"].grad.numpy().copy() \
            if f"{p}scaled_scores" in tensors else tensors[f"{p}attn_scores"].grad.numpy().copy()
    scale = max(float(np.max(np.abs(s.autograd))) for s in result.steps)
    for s in result.steps:
        s.error = rel_error(s.numpy, s.autograd, SCALE_FLOOR * scale)
    return result
