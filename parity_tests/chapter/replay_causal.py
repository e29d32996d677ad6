"""Sections 3.5-3.6 of ``attention-parity chapter``: causal mask, dropout, batched
modules; and the matrices ``--plot`` draws.  Helpers: `compare`."""

import numpy as np
import torch

import numpy_ref
import torch_impl
from numpy_ref import ops
from parity_tests.common import plots
from parity_tests.chapter.compare import agrees, inputs, matrix_rows, seeded, shape_row
from parity_tests.common.verdicts import PASS, SKIP, fmt, verdict


def _weights_n(sa_v2):
    """sa_v2's W_query and W_key as NumPy (d_out, d_in) arrays, nn.Linear layout."""
    sd = sa_v2.state_dict()
    return sd["W_query.weight"].numpy(), sd["W_key.weight"].numpy()


def causal_steps(v):
    """Every matrix of the chapter's causal walk-through, torch and NumPy: dict of
    name -> (torch, numpy)."""
    torch.manual_seed(v.SEED_V2)
    sa_v2 = torch_impl.SelfAttention_v2(v.D_IN, v.D_OUT)
    x_t = inputs()
    with torch.no_grad():                                 # the chapter's lines
        queries, keys = sa_v2.W_query(x_t), sa_v2.W_key(x_t)
        attn_scores = queries @ keys.T                    # (6, 6)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)
        context_length = attn_scores.shape[0]
        mask_simple = torch.tril(torch.ones(context_length, context_length))
        masked_simple = attn_weights * mask_simple
        masked_simple_norm = masked_simple / masked_simple.sum(dim=-1, keepdim=True)
        mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)
        masked = attn_scores.masked_fill(mask.bool(), -torch.inf)
        causal_weights = torch.softmax(masked / keys.shape[-1]**0.5, dim=-1)
    Wq, Wk = _weights_n(sa_v2)
    x_n = x_t.numpy()
    q_n, k_n = x_n @ Wq.T, x_n @ Wk.T                     # nn.Linear: x W^T
    scores_n = q_n @ k_n.T
    d_k = k_n.shape[-1]
    weights_n = numpy_ref.softmax(scores_n / np.sqrt(d_k))
    simple_n = weights_n * np.tril(np.ones((6, 6), dtype=np.float32))
    masked_n, _ = ops.causal_mask_forward(scores_n, np.triu(np.ones((6, 6)), 1).astype(bool))
    return {
        "attn_weights (no mask)": (attn_weights, weights_n, v.CAUSAL_ATTN_WEIGHTS_UNMASKED),
        "masked_simple = attn_weights * tril": (masked_simple, simple_n, v.CAUSAL_MASKED_SIMPLE),
        "masked_simple_norm (renormalised)":
            (masked_simple_norm, simple_n / simple_n.sum(axis=-1, keepdims=True),
             v.CAUSAL_ATTN_WEIGHTS),
        "masked = attn_scores.masked_fill(-inf)": (masked, masked_n, v.CAUSAL_MASKED_SCORES),
        "softmax(masked / sqrt(d_k))":
            (causal_weights, numpy_ref.softmax(masked_n / np.sqrt(d_k)), v.CAUSAL_ATTN_WEIGHTS),
    }


def mask_rows(v):
    rows = []
    for name, (t, n, printed) in causal_steps(v).items():
        rows += matrix_rows(name, t, n, printed, v.PRINTED_ATOL)
    return rows


def dropout_draws(v):
    """The chapter's two dropout calls, each after manual_seed(SEED_DROPOUT)."""
    dropout = torch.nn.Dropout(v.DROPOUT_P)
    torch.manual_seed(v.SEED_DROPOUT)
    on_ones = dropout(torch.ones(6, 6))
    t, n, _ = causal_steps(v)["softmax(masked / sqrt(d_k))"]
    torch.manual_seed(v.SEED_DROPOUT)
    on_weights = dropout(t)
    return on_ones, on_weights, t, n


def draws_the_chapters_mask(v):
    """Whether this PyTorch's dropout draws the chapter's keep-mask from its seed (PyTorch
    ``v.DROPOUT_MASK_FROM`` and later, on the CPU)."""
    return np.array_equal(dropout_draws(v)[0].numpy() != 0, np.asarray(v.DROPOUT_ON_ONES) != 0)


def dropout_rows(v):
    """PyTorch's draws are compared with the chapter's when they reproduce here; the
    chapter warns they may differ between systems (and PyTorch releases differ: see
    ``chapter_values.DROPOUT_MASK_FROM``), and then the rows say skip, with the release.
    NumPy is given PyTorch's keep-mask (a dropped entry is exactly 0 on the ones)."""
    atol = v.PRINTED_ATOL
    on_ones, on_weights, w_t, w_n = dropout_draws(v)
    keep = on_ones.numpy() != 0                          # (6, 6) bool, True = kept
    ones_n, _ = ops.dropout_forward(np.ones((6, 6), dtype=np.float32), keep, v.DROPOUT_P)
    weights_n, _ = ops.dropout_forward(w_n, keep, v.DROPOUT_P)
    same_mask = np.array_equal(keep, np.asarray(v.DROPOUT_ON_ONES) != 0)
    drawn = f"{int(keep.sum())} kept of 36, " + ("the same positions" if same_mask else "another mask")
    rows = [(f"PyTorch {torch.__version__.split('+')[0]} draws the chapter's keep-mask "
             f"(PyTorch ≥ {v.DROPOUT_MASK_FROM} on the CPU does)", drawn,
             f"{int((np.asarray(v.DROPOUT_ON_ONES) != 0).sum())} kept", PASS if same_mask else SKIP)]
    rows += matrix_rows("dropout(torch.ones(6, 6))", on_ones, ones_n, v.DROPOUT_ON_ONES, atol)
    rows += matrix_rows("dropout(attn_weights)", on_weights, weights_n,
                        v.DROPOUT_ON_CAUSAL_WEIGHTS, atol)
    if not same_mask:          # keep the NumPy-vs-PyTorch check, drop the chapter's
        rows = rows[:1] + [(c, comp, ch, SKIP) for c, comp, ch, _ in rows[1:]]
        rows.append(("numpy_ref.ops.dropout_forward with torch's mask == torch",
                     fmt(np.abs(weights_n - on_weights.detach().numpy()).max()), "0",
                     verdict(agrees(weights_n, on_weights.detach().numpy(), 1e-6))))
    return rows


def batched_rows(v):
    atol = v.PRINTED_ATOL
    batch_t = torch.stack((inputs(), inputs()), dim=0)   # (2, 6, 3)
    batch_n = batch_t.numpy()
    T = batch_t.shape[1]
    ca_t, ca_n = seeded(torch_impl.CausalAttention, numpy_ref.CausalAttention,
                        v.SEED_CAUSAL, v.D_IN, v.D_OUT, T, 0.0)
    mha_t, mha_n = seeded(torch_impl.MultiHeadAttentionWrapper,
                          numpy_ref.MultiHeadAttentionWrapper, v.SEED_WRAPPER,
                          v.D_IN, v.D_OUT, T, 0.0, 2)
    ex_t, ex_n = seeded(torch_impl.MultiHeadAttentionWrapper,
                        numpy_ref.MultiHeadAttentionWrapper, v.SEED_WRAPPER, v.D_IN, 1, T, 0.0, 2)
    with torch.no_grad():
        ca_out, mha_out, ex_out = ca_t(batch_t), mha_t(batch_t), ex_t(batch_t)
    mha_out_n = mha_n(batch_n)
    rows = [
        shape_row("batch = torch.stack((inputs, inputs)).shape", batch_t, batch_n, v.BATCH_SHAPE),
        shape_row("CausalAttention(3, 2, 6, 0.0)(batch).shape", ca_out, ca_n(batch_n),
                  v.CAUSAL_CONTEXT_VECS_SHAPE),
        ("register_buffer: 'mask' in state_dict() (torch ; numpy)",
         f"{'mask' in ca_t.state_dict()} ; {'mask' in ca_n.state_dict()}", "True",
         verdict("mask" in ca_t.state_dict() and "mask" in ca_n.state_dict())),
    ]
    for b in range(2):
        rows += matrix_rows(f"MultiHeadAttentionWrapper(..., num_heads=2)(batch)[{b}]",
                            mha_out[b], mha_out_n[b], v.WRAPPER_CONTEXT_VECS[b], atol)
    rows.append(shape_row("MultiHeadAttentionWrapper context_vecs.shape", mha_out, mha_out_n,
                          v.WRAPPER_CONTEXT_VECS_SHAPE))
    rows.append(shape_row("exercise 3.2: d_out=1, num_heads=2 -> shape", ex_out, ex_n(batch_n),
                          v.EXERCISE_3_2_SHAPE))
    rows.append(final_mha_row(v, batch_t))
    return rows


def final_mha_row(v, batch_t):
    """The chapter stops before printing MultiHeadAttention's output: compare the two
    implementations to the same 4 decimals instead."""
    mha_t, mha_n = final_mha(v)
    with torch.no_grad():
        out_t = mha_t(batch_t)
    out_n = mha_n(batch_t.numpy())
    ok = agrees(out_n, out_t.numpy(), v.PRINTED_ATOL)
    return ("MultiHeadAttention(3, 2, 6, 0.0, num_heads=2), seed 123: numpy == torch",
            f"max |diff| {np.abs(out_n - out_t.numpy()).max():.1e} ; shape {tuple(out_t.shape)}",
            "(not printed) (2, 6, 2)", verdict(ok and tuple(out_t.shape) == (2, 6, 2)))


def final_mha(v):
    return seeded(torch_impl.MultiHeadAttention, numpy_ref.MultiHeadAttention,
                  v.SEED_WRAPPER, v.D_IN, v.D_OUT, 6, 0.0, 2)


# --- --plot ------------------------------------------------------------------------

def head_weights(mha_n, x):
    """Each head's causal attention weights, (H, T, T), from the module's weights."""
    sd = mha_n.state_dict()
    b, T, _ = x.shape
    H = mha_n.num_heads
    q = (x @ sd["W_query.weight"].T).reshape(b, T, H, -1).transpose(0, 2, 1, 3)  # (b, H, T, d_h)
    k = (x @ sd["W_key.weight"].T).reshape(b, T, H, -1).transpose(0, 2, 1, 3)
    scores, _ = ops.scores_forward(q, k)                                          # (b, H, T, T)
    scores, _ = ops.causal_mask_forward(scores, np.triu(np.ones((T, T)), 1).astype(bool))
    return numpy_ref.softmax(scores)[0]


def write_plots(plot_dir, v):
    x = np.array(v.INPUTS, dtype=np.float32)
    simple = numpy_ref.softmax(x @ x.T)
    steps = causal_steps(v)
    causal = steps["softmax(masked / sqrt(d_k))"][1]
    _, mha_n = final_mha(v)
    heads = head_weights(mha_n, x[None])
    on_ones = dropout_draws(v)[0].numpy()
    paths = [
        plots.heatmap(f"{plot_dir}/attention_simplified.png", simple,
                      "softmax(inputs @ inputs.T)", plots.TOKENS, 0, 1),
        plots.heatmap(f"{plot_dir}/attention_causal.png", causal,
                      "causal attn_weights (sa_v2, seed 789)", plots.TOKENS, 0, 1),
        plots.heatmaps(f"{plot_dir}/attention_heads.png", list(heads),
                       [f"head {h}" for h in range(len(heads))],
                       suptitle="MultiHeadAttention (seed 123)", labels=plots.TOKENS,
                       vmin=0, vmax=1),
        # a 6 x 6 matrix of ones, not attention weights: its axes are rows and columns
        plots.heatmap(f"{plot_dir}/dropout_mask.png", on_ones,
                      "Dropout(0.5) on ones, seed 123", None, 0, 2, cmap="gray",
                      axis_titles=("column", "row")),
    ]
    return paths
