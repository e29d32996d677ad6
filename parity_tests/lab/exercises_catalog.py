"""What each exercise asks for, the inputs it is graded on, and the right answers.

An exercise is one template of ``exercises/``.  `case(name)` builds its inputs
(the chapter's six tokens, seeded weights, a random upstream gradient: never
``out.sum()``, whose softmax gradient is ~0) and two sets of right answers: the
reference (``numpy_ref``'s backward) and centred finite differences of the
forward.  `probe(name)` gives inputs of other shapes where the interface
promises any leading axes.  `run(name, learner, case)` calls the learner's code
on copies of the inputs and returns its tensors under the same names, and the
names of the inputs it changed in place.
"""

from dataclasses import dataclass

import numpy as np
import torch

import numpy_ref
import torch_impl
from numpy_ref import ops
from numpy_ref.visibility import visible_mask
from parity_tests.common import chapter_values as cv
from parity_tests.common.finite_diff import eval_numerical_gradient_array, numerical_grads

GRADIENT_SEED = 2024       # numpy.random.default_rng: the upstream gradients
KEEP_SEED = 123            # numpy.random.default_rng: the dropout keep-masks


@dataclass(frozen=True)
class Exercise:
    name: str              # template file stem
    entry: str             # what the learner's file defines
    kind: str              # "function" or "module"
    summary: str
    outputs: tuple         # names of the tensors returned (functions)
    args: tuple            # names of the arguments, to say which one was changed in place


EXERCISES = {e.name: e for e in (
    Exercise("softmax_backward", "softmax_backward", "function",
             "the softmax backward (w, g) -> dx", ("dx",), ("w", "g")),
    Exercise("scores_backward", "scores_backward", "function",
             "the scores backward (dscores, queries, keys) -> (dqueries, dkeys)",
             ("dqueries", "dkeys"), ("dscores", "queries", "keys")),
    Exercise("linear_backward", "linear_backward", "function",
             "the linear layer backward (dout, x, W, b) -> (dx, dW, db)", ("dx", "dW", "db"),
             ("dout", "x", "W", "b")),
    Exercise("online_softmax", "online_softmax", "function",
             "the online softmax of one row over tiles (s, V, B_c) -> (out, L)",
             ("out", "L"), ("s", "V", "B_c")),
    Exercise("tile_backward", "tile_backward", "function",
             "the blockwise backward of one tile (q, k, v, dO, L, D) -> (dq, dk, dv)",
             ("dq", "dk", "dv"), ("q", "k", "v", "dO", "L", "D")),
    Exercise("softcap_backward", "softcap_backward", "function",
             "the softcap's backward (dS, S, cap) -> dS_raw", ("dS_raw",), ("dS", "S", "cap")),
    Exercise("sink_gradient", "sink_gradient", "function",
             "an attention sink's gradient (dO, O, p_sink) -> dsink", ("dsink",),
             ("dO", "O", "p_sink")),
    Exercise("gqa_backward", "gqa_backward", "function",
             "dk and dv under grouped-query attention (dS, P, dO, q) -> (dk, dv)",
             ("dk", "dv"), ("dS", "P", "dO", "q")),
    Exercise("causal_attention", "CausalAttention", "module",
             "CausalAttention's forward(x, keep_mask) and backward(dout) -> dx, grads", (),
             ("x", "keep_mask", "dout")),
    Exercise("multihead_attention", "MultiHeadAttention", "module",
             "MultiHeadAttention's forward(x, keep_mask) and backward(dout) -> dx, grads", (),
             ("x", "keep_mask", "dout")),
)}
BY_ENTRY = {e.entry: e for e in EXERCISES.values()}

# constructor arguments of the module exercises: dropout and biases on, so that
# every pass of the backward has something to get wrong
MODULE_ARGS = {
    "CausalAttention": dict(d_in=3, d_out=2, context_length=6, dropout=0.5, qkv_bias=True),
    "MultiHeadAttention": dict(d_in=3, d_out=4, context_length=6, dropout=0.5, num_heads=2,
                               qkv_bias=True),
}


def _batch():
    """The chapter's batch: torch.stack((inputs, inputs)), (2, 6, 3), float64."""
    x = np.array(cv.INPUTS, dtype=np.float64)
    return np.stack([x, x])


def _seeded_state(entry):
    """Weights drawn by torch_impl after torch.manual_seed(123), as float64 arrays."""
    torch.manual_seed(123)
    m = getattr(torch_impl, entry)(**MODULE_ARGS[entry])
    return {k: v.double().numpy() for k, v in m.state_dict().items()}


def reference_module(entry, state):
    """numpy_ref's module with ``state`` loaded, in training mode (dropout on)."""
    m = getattr(numpy_ref, entry)(**MODULE_ARGS[entry], rng=0)
    m.load_state_dict(state)
    return m


SOFTCAP = 2.0               # the softcap exercise's c
SINKS = (0.5, -1.0)         # the sink exercise's logits, one head each


def _sink_forward(S, values, sinks):
    """Causal attention with one sink column per head: (O (H, T, d), p_sink (H, T))."""
    T = S.shape[-1]
    masked = np.where(visible_mask(T, T, causal=True), S, -np.inf)
    logits = np.concatenate([np.broadcast_to(masked, (len(sinks), T, T)),
                             np.broadcast_to(sinks[:, None, None], (len(sinks), T, 1))], axis=-1)
    P = numpy_ref.softmax(logits)
    return P[..., :T] @ values, P[..., T]


ONLINE_ROW = (0.5, -1.0, 1.5, 0.2, 2.5, -0.3)   # the online softmax exercise's scores
TILE_ROWS, TILE_COLS = slice(2, 4), slice(0, 2)    # the tile exercise's tile
GQA_SEED = 11              # numpy.random.default_rng: the GQA exercise's query heads


def _gqa_forward(q, k, v):
    """Full (not causal) attention, query head h on kv head h // 2: (O, P)."""
    k_rep, v_rep = np.repeat(k, 2, axis=0), np.repeat(v, 2, axis=0)
    P = numpy_ref.softmax(q @ np.swapaxes(k_rep, -1, -2) / np.sqrt(q.shape[-1]))
    return P @ v_rep, P


def _function_case(name):
    rng = np.random.default_rng(GRADIENT_SEED)
    state = _seeded_state("CausalAttention")
    x = _batch()
    W_q, b_q = state["W_query.weight"], state["W_query.bias"]
    W_k, b_k = state["W_key.weight"], state["W_key.bias"]
    queries, keys = x @ W_q.T + b_q, x @ W_k.T + b_k                    # (2, 6, 2)
    if name == "softmax_backward":
        scores = (queries[0] @ keys[0].T) / np.sqrt(2)                   # (6, 6)
        w = numpy_ref.softmax(scores)
        g = rng.standard_normal(w.shape)
        f = lambda: numpy_ref.softmax(scores)
        return dict(inputs=(w, g), reference={"dx": numpy_ref.softmax_backward(w, g)},
                    fd={"dx": eval_numerical_gradient_array(f, scores, g)},
                    described="w = softmax(ω/√d_k) of the chapter's input, (6, 6); "
                              "g random, (6, 6)")
    if name == "scores_backward":
        ds = rng.standard_normal((2, 6, 6))
        dq, dk = ops.scores_backward(ds, (queries, keys, True))
        f = lambda: ops.scores_forward(queries, keys)[0]
        return dict(inputs=(ds, queries, keys), reference={"dqueries": dq, "dkeys": dk},
                    fd={"dqueries": eval_numerical_gradient_array(f, queries, ds),
                        "dkeys": eval_numerical_gradient_array(f, keys, ds)},
                    described="queries, keys of the chapter's batch, (2, 6, 2), d_k = 2; "
                              "dscores random, (2, 6, 6)")
    if name == "online_softmax":
        V = x[0] @ state["W_value.weight"].T + state["W_value.bias"]        # (6, 2)
        row = np.array(ONLINE_ROW)
        w = numpy_ref.softmax(row)
        return dict(inputs=(row, V, 2),
                    reference={"out": w @ V, "L": np.array(np.log(np.sum(np.exp(row))))},
                    described=f"s = {ONLINE_ROW} (its maximum rises in every tile), V the "
                              f"chapter's values (6, 2), B_c = 2")
    if name == "tile_backward":
        v = x[0] @ state["W_value.weight"].T + state["W_value.bias"]
        q, k = queries[0], keys[0]                                        # (6, 2) each
        dO = rng.standard_normal(q.shape)
        S = q @ k.T / np.sqrt(2)
        P = numpy_ref.softmax(S)                                          # the dense weights
        L, D = np.log(np.sum(np.exp(S), axis=-1)), np.sum(dO * (P @ v), axis=-1)
        dS = P * (dO @ v.T - D[:, None])
        r, c = TILE_ROWS, TILE_COLS
        return dict(inputs=(q[r], k[c], v[c], dO[r], L[r], D[r]),
                    reference={"dq": dS[r, c] @ k[c] / np.sqrt(2),
                               "dk": dS[r, c].T @ q[r] / np.sqrt(2), "dv": P[r, c].T @ dO[r]},
                    described="the chapter's q, k, v (one head, 6 tokens, no mask), dO random; "
                              "query tile 2 (rows 3-4) × key tile 1 (keys 1-2), B_r = B_c = 2, "
                              "L and D of the dense computation")
    if name == "softcap_backward":
        S = 3 * (queries @ np.swapaxes(keys, -1, -2))           # (2, 6, 6), some near the cap
        dS = rng.standard_normal(S.shape)
        f = lambda: SOFTCAP * np.tanh(S / SOFTCAP)
        return dict(inputs=(dS, S, SOFTCAP),
                    reference={"dS_raw": dS * (1 - np.tanh(S / SOFTCAP) ** 2)},
                    fd={"dS_raw": eval_numerical_gradient_array(f, S, dS)},
                    described=f"S = 3 q kᵀ of the chapter's batch, (2, 6, 6), cap = {SOFTCAP}; "
                              f"dS random, (2, 6, 6)")
    if name == "sink_gradient":
        values = x[0] @ state["W_value.weight"].T + state["W_value.bias"]      # (6, 2)
        S = queries[0] @ keys[0].T / np.sqrt(2)
        sinks = np.array(SINKS)
        dO = rng.standard_normal((len(SINKS), 6, 2))
        O, p_sink = _sink_forward(S, values, sinks)
        f = lambda: _sink_forward(S, values, sinks)[0]
        return dict(inputs=(dO, O, p_sink), reference={"dsink": -np.sum(p_sink * np.sum(
                        dO * O, axis=-1), axis=-1)},
                    fd={"dsink": eval_numerical_gradient_array(f, sinks, dO)},
                    described=f"causal attention of the chapter's input, one head per sink "
                              f"s = {SINKS}: O (2, 6, 2) and p_sink (2, 6); dO random, (2, 6, 2)")
    if name == "gqa_backward":
        q = np.random.default_rng(GQA_SEED).standard_normal((4, 6, 2))    # H_q = 4
        k, v = keys, x @ state["W_value.weight"].T + state["W_value.bias"]   # H_kv = 2
        dO = rng.standard_normal(q.shape)
        f_k = lambda: _gqa_forward(q, k, v)[0]
        O, P = _gqa_forward(q, k, v)
        v_rep = np.repeat(v, 2, axis=0)
        dP = dO @ np.swapaxes(v_rep, -1, -2)
        dS = P * (dP - np.sum(dO * O, axis=-1, keepdims=True))           # D = rowsum(dO ∘ O)
        dk = (np.swapaxes(dS, -1, -2) @ q / np.sqrt(2)).reshape(2, 2, 6, 2).sum(axis=1)
        dv = (np.swapaxes(P, -1, -2) @ dO).reshape(2, 2, 6, 2).sum(axis=1)
        return dict(inputs=(dS, P, dO, q), reference={"dk": dk, "dv": dv},
                    fd={"dk": eval_numerical_gradient_array(f_k, k, dO),
                        "dv": eval_numerical_gradient_array(f_k, v, dO)},
                    described="4 query heads (random q, (4, 6, 2)) sharing the chapter "
                              "batch's 2 keys and values heads ((2, 6, 2)), G = 2; dS, P of "
                              "each query head, dO random")
    dout = rng.standard_normal((2, 6, 2))
    W, b = W_q.copy(), b_q.copy()
    dx, dW, db = ops.linear_backward(dout, (x, W, True))
    f = lambda: ops.linear_forward(x, W, b)[0]
    return dict(inputs=(dout, x, W, b), reference={"dx": dx, "dW": dW, "db": db},
                fd={"dx": eval_numerical_gradient_array(f, x, dout),
                    "dW": eval_numerical_gradient_array(f, W, dout),
                    "db": eval_numerical_gradient_array(f, b, dout)},
                described="x the chapter's batch (2, 6, 3), W_query (2, 3) and its bias (2,); "
                          "dout random, (2, 6, 2)")


def _module_case(entry):
    rng = np.random.default_rng(GRADIENT_SEED)
    state = _seeded_state(entry)
    x = _batch()
    args = MODULE_ARGS[entry]
    heads = (args["num_heads"],) if "num_heads" in args else ()
    keep_mask = np.random.default_rng(KEEP_SEED).random((2, *heads, 6, 6)) >= args["dropout"]
    ref = reference_module(entry, state)
    out = ref.forward(x, keep_mask)
    G = rng.standard_normal(out.shape)
    reference = {"output": out, "input": ref.backward(G), **ref.grads}
    fd = numerical_grads(ref, x, G, keep_mask)
    fd["output"] = out
    return dict(inputs=(x, keep_mask, G), state=state, reference=reference, fd=fd,
                described=f"{entry}({', '.join(f'{k}={v}' for k, v in args.items())}), "
                          f"seeded weights, the chapter's batch (2, 6, 3), a fixed dropout "
                          f"keep-mask, upstream gradient random {tuple(out.shape)}")


def case(name):
    """Inputs and right answers of exercise ``name`` (a dict, see the module docstring)."""
    ex = EXERCISES[name]
    c = _module_case(ex.entry) if ex.kind == "module" else _function_case(name)
    c["exercise"] = ex
    return c


PROBE_SEED = 7            # numpy.random.default_rng: the inputs of the other shapes
PROMISES = {             # exercises whose interface promises more than the chapter's input shows
    "softmax_backward": "w and g are (..., n), the softmax along the last axis",
    "scores_backward": "dscores is (..., Tq, Tk), queries (..., Tq, d_k), keys (..., Tk, d_k)",
    "online_softmax": "s is any row of scores: its maximum may fall from one tile to the next",
}
# What a learner right on the chapter's input and wrong on the probe has missed, by exercise.
AXES = ("any number of leading axes: count axes from the end (axis=-1, np.swapaxes(a, -1, -2)), not "
        "from the front (axis=1, .T)")
ADVICE = {"softmax_backward": AXES, "scores_backward": AXES,
          "online_softmax": "the running maximum is carried across tiles, m_new = max(m, max(s_t)): a tile's own "
                            "maximum alone rescales by exp(m − m_new) > 1 where the maximum falls, and overflows"}
# The probe's row for the online softmax: a huge first score, then tiles whose maximum falls
# (a maximum not carried gives exp(798) = inf, then NaN)
FALLING_ROW = (800.0, 0.0, 1.0, 2.0, -3.0, 5.0)


def probe(name):
    """Inputs the chapter's do not show, where the interface promises them (`PROMISES`), with
    the reference's answers and what a learner wrong there has missed (``advice``); None
    elsewhere.  Leading axes (2, 3) and unequal sizes: an axis counted from the front
    (``axis=1``, ``.T``) or a Tq taken for a Tk gives other numbers; a row whose maximum falls
    from one tile to the next: a maximum not carried across tiles overflows."""
    if name not in PROMISES:
        return None
    found = _probe(name, np.random.default_rng(PROBE_SEED))
    return {**found, "advice": ADVICE[name]}


def _probe(name, rng):
    if name == "online_softmax":
        row, V = np.array(FALLING_ROW), rng.standard_normal((len(FALLING_ROW), 2))
        top = row.max()
        return dict(inputs=(row, V, 2), reference={"out": numpy_ref.softmax(row) @ V,
                                                    "L": np.array(top + np.log(np.sum(np.exp(row - top))))},
                    described=f"{PROMISES[name]}: s = {FALLING_ROW}, V random (6, 2), B_c = 2")
    if name == "softmax_backward":
        w = numpy_ref.softmax(rng.standard_normal((2, 3, 4, 5)))
        g = rng.standard_normal(w.shape)
        return dict(inputs=(w, g), reference={"dx": numpy_ref.softmax_backward(w, g)},
                    described=f"{PROMISES[name]}: w, g random, (2, 3, 4, 5)")
    q, k = rng.standard_normal((2, 3, 4, 3)), rng.standard_normal((2, 3, 5, 3))
    ds = rng.standard_normal((2, 3, 4, 5))
    dq, dk = ops.scores_backward(ds, (q, k, True))
    return dict(inputs=(ds, q, k), reference={"dqueries": dq, "dkeys": dk},
                described=f"{PROMISES[name]}: random, Tq = 4, Tk = 5, d_k = 3, "
                          f"leading axes (2, 3)")


def _copies(arrays):
    return tuple(None if a is None else np.array(a) for a in arrays)


def _changed(ex, given, originals):
    """Names of the arguments the learner's code changed in place."""
    return [n for n, a, b in zip(ex.args, given, originals)
            if a is not None and not np.array_equal(a, b, equal_nan=True)]


def run_function(ex, fn, c):
    """The learner's function on copies of the inputs -> ({name: array}, names of the
    arguments it changed in place); a wrong return shape of the result (not a tuple
    of the right length) raises TypeError."""
    given = _copies(c["inputs"])
    result = fn(*given)
    changed = _changed(ex, given, c["inputs"])
    if len(ex.outputs) == 1:
        result = (result,)
    if not isinstance(result, (tuple, list)) or len(result) != len(ex.outputs):
        raise TypeError(f"{ex.entry} must return {len(ex.outputs)} arrays "
                        f"({', '.join(ex.outputs)}), got {type(result).__name__}")
    return {n: (None if r is None else np.asarray(r, dtype=np.float64))
            for n, r in zip(ex.outputs, result)}, changed


def run_module(ex, cls, c):
    """The learner's class: built, loaded, forward, backward -> ({name: array}, names
    of the arguments it changed in place)."""
    given = _copies(c["inputs"])
    x, keep_mask, G = given
    m = cls(**MODULE_ARGS[ex.entry])
    m.load_state_dict({k: np.array(v) for k, v in c["state"].items()})
    out = m.forward(x, keep_mask)
    dx = m.backward(G)
    grads = getattr(m, "grads", None)
    if not isinstance(grads, dict):
        raise TypeError(f"after backward, {ex.entry}.grads must be a dict of parameter "
                        f"name -> gradient, got {type(grads).__name__}")
    tensors = {"output": out, "input": dx}
    tensors.update({k: v for k, v in grads.items()})
    return ({k: (None if v is None else np.asarray(v, dtype=np.float64))
             for k, v in tensors.items()}, _changed(ex, given, c["inputs"]))


def run(ex, learner, c):
    """(tensors, changed): `run_function` or `run_module`; ``c`` needs only the case's
    "inputs" (and "state" for a module)."""
    return (run_module if ex.kind == "module" else run_function)(ex, learner, c)
