"""``attention-parity chapter [--plot DIR]``

Replays every worked example of the chapter, section by section, with both
implementations: ``torch_impl`` (and the chapter's own lines of PyTorch) after
the chapter's ``torch.manual_seed``, and ``numpy_ref`` given PyTorch's seeded
weights through ``np_mod.load_state_dict(torch_mod.state_dict())``.  Each value
is printed beside the one the chapter prints; a row passes when both sides agree
with it to the printed 4 decimals (`chapter_values.PRINTED_ATOL`).  The computed
column shows PyTorch's value, and NumPy's too wherever the two print differently.

The chapter's numbers come from `parity_tests.common.chapter_values`; `run(values)`
takes any object with the same attributes, so a test can plant a wrong one.
"""

import argparse

import numpy as np
import torch

import numpy_ref
import torch_impl
from parity_tests.chapter import replay_causal as causal
from parity_tests.chapter.compare import inputs, matrix_rows, seeded, value_row
from parity_tests.common import chapter_values, plots
from parity_tests.common.help_text import Parser, plain
from parity_tests.common.verdicts import parse_verb_args, print_section, summary, exit_status


# --- 3.3 simplified self-attention --------------------------------------------------

def simplified_rows(v):
    atol = v.PRINTED_ATOL
    x_t, x_n = inputs(), np.array(v.INPUTS, dtype=np.float32)
    query = x_t[1]                                     # x^(2), "journey"
    attn_scores_2 = torch.empty(x_t.shape[0])
    for i, x_i in enumerate(x_t):                      # the chapter's loop
        attn_scores_2[i] = torch.dot(x_i, query)
    scores_n = x_n @ x_n[1]                            # (6,)
    w_sum_t = attn_scores_2 / attn_scores_2.sum()
    w_t = torch.softmax(attn_scores_2, dim=0)
    w_n = numpy_ref.softmax(scores_n)
    ctx_t = torch.zeros(query.shape)
    for i, x_i in enumerate(x_t):
        ctx_t += w_t[i] * x_i
    scores_all_t, scores_all_n = x_t @ x_t.T, x_n @ x_n.T
    all_t = torch_impl.SimplifiedSelfAttention()(x_t)
    all_n = numpy_ref.SimplifiedSelfAttention()(x_n)
    return [
        value_row("attn_scores_2 (dot products with x^2)", attn_scores_2, scores_n,
                  v.SIMPLE_ATTN_SCORES_2, atol),
        value_row("torch.dot(inputs[0], query)", torch.dot(x_t[0], query), x_n[0] @ x_n[1],
                  v.SIMPLE_DOT_X1_QUERY, atol),
        value_row("attn_scores_2 / attn_scores_2.sum()", w_sum_t, numpy_ref.sum_normalize(scores_n),
                  v.SIMPLE_SUM_NORMALIZED_2, atol),
        value_row("softmax(attn_scores_2)", w_t, w_n, v.SIMPLE_ATTN_WEIGHTS_2, atol),
        value_row("softmax weights sum", w_t.sum(), w_n.sum(), 1.0, atol),
        value_row("context_vec_2", ctx_t, w_n @ x_n, v.SIMPLE_CONTEXT_VEC_2, atol),
        *matrix_rows("attn_scores = inputs @ inputs.T", scores_all_t[:2], scores_all_n[:2],
                     v.SIMPLE_ATTN_SCORES_FIRST_ROWS, atol),
        *matrix_rows("all_context_vecs", all_t, all_n, v.SIMPLE_ALL_CONTEXT_VECS, atol),
    ]


# --- 3.4 trainable weights ----------------------------------------------------------

def step_by_step_rows(v):
    """The chapter's three torch.rand(3, 2) after manual_seed(123), step by step."""
    atol = v.PRINTED_ATOL
    x_t = inputs()
    torch.manual_seed(v.SEED_WEIGHTS_STEP_BY_STEP)
    W_query, W_key, W_value = (torch.rand(v.D_IN, v.D_OUT) for _ in range(3))
    query_2, keys, values = x_t[1] @ W_query, x_t @ W_key, x_t @ W_value
    scores_t = query_2 @ keys.T
    d_k = keys.shape[-1]
    w_t = torch.softmax(scores_t / d_k**0.5, dim=-1)
    x_n = x_t.numpy()
    q_n, k_n, v_n = x_n[1] @ W_query.numpy(), x_n @ W_key.numpy(), x_n @ W_value.numpy()
    scores_n = q_n @ k_n.T
    w_n = numpy_ref.softmax(scores_n / np.sqrt(d_k))
    return [
        value_row("query_2 = x_2 @ W_query", query_2, q_n, v.QUERY_2, atol),
        value_row("attn_scores_2 = query_2 @ keys.T", scores_t, scores_n, v.ATTN_SCORES_2, atol),
        value_row("softmax(attn_scores_2 / sqrt(d_k))", w_t, w_n, v.ATTN_WEIGHTS_2, atol),
        value_row("context_vec_2 = attn_weights_2 @ values", w_t @ values, w_n @ v_n,
                  v.CONTEXT_VEC_2, atol),
    ]





def module_rows(v):
    atol = v.PRINTED_ATOL
    x_t = inputs()
    x_n = x_t.numpy()
    v1_t, v1_n = seeded(torch_impl.SelfAttention_v1, numpy_ref.SelfAttention_v1,
                        v.SEED_V1, v.D_IN, v.D_OUT)
    v2_t, v2_n = seeded(torch_impl.SelfAttention_v2, numpy_ref.SelfAttention_v2,
                        v.SEED_V2, v.D_IN, v.D_OUT)
    with torch.no_grad():
        out_v1, out_v2 = v1_t(x_t), v2_t(x_t)
    return (matrix_rows("sa_v1(inputs), seed 123", out_v1, v1_n(x_n), v.SA_V1_OUTPUT, atol)
            + matrix_rows("sa_v2(inputs), seed 789", out_v2, v2_n(x_n), v.SA_V2_OUTPUT, atol))


# --- the whole chapter ------------------------------------------------------------

def sections(values=None):
    """[(title, rows)] for every worked example, against ``values`` (default: the
    chapter's printed numbers)."""
    v = chapter_values if values is None else values
    return [
        ("3.3 simplified self-attention (query x^2, 'journey')", simplified_rows(v)),
        ("3.4 trainable weights, step by step (torch.manual_seed(123), torch.rand)",
         step_by_step_rows(v)),
        ("3.4 SelfAttention_v1 (seed 123) and SelfAttention_v2 (seed 789)", module_rows(v)),
        ("3.5 causal mask, with sa_v2's weights", causal.mask_rows(v)),
        ("3.5 dropout, p = 0.5, torch.manual_seed(123) before each call", causal.dropout_rows(v)),
        ("3.5-3.6 batched modules: CausalAttention, MultiHeadAttentionWrapper, MultiHeadAttention",
         causal.batched_rows(v)),
    ]


def run(values=None, plot_dir=None):
    """Print every section; exit status 1 when any row disagrees with ``values``."""
    rows = []
    for title, section_rows in sections(values):
        print_section(title, section_rows)
        rows += section_rows
    print(summary(rows))
    if plot_dir:
        plots.announce(causal.write_plots(plot_dir, chapter_values if values is None else values))
    return exit_status(rows)


def parse_args(argv):
    p = Parser(page="docs/chapter.md", prog="attention-parity chapter", description=plain(__doc__),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plot", metavar="DIR", default=None,
                   help="write PNG heatmaps of the attention weights (simplified, causal, "
                        "each head of MultiHeadAttention) and the dropout mask into DIR")
    return p.parse_args(argv)


def main(argv=None):
    args, status = parse_verb_args(parse_args, argv)
    if status is not None:
        return status
    return run(plot_dir=args.plot)
