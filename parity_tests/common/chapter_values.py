"""The chapter's inputs and every number it prints, transcribed once.

Each value is exactly what the chapter shows, to its 4 printed decimals; tests and
the ``chapter`` verb compare against these with an absolute tolerance of
`PRINTED_ATOL` (half a unit in the last printed place, plus float slack).  Plain
Python lists keep this file free of NumPy and PyTorch.
"""

# Half a unit in the 4th decimal, plus room for float32 rounding of the value itself.
PRINTED_ATOL = 5.1e-5

# "Your journey starts with one step.", embedded in 3 dimensions (x^1 .. x^6).
INPUTS = [
    [0.43, 0.15, 0.89],  # Your     (x^1)
    [0.55, 0.87, 0.66],  # journey  (x^2)
    [0.57, 0.85, 0.64],  # starts   (x^3)
    [0.22, 0.58, 0.33],  # with     (x^4)
    [0.77, 0.25, 0.10],  # one      (x^5)
    [0.05, 0.80, 0.55],  # step     (x^6)
]
D_IN = 3
D_OUT = 2

# --- Simplified self-attention (no weights), query x^2 "journey" ----------------
SIMPLE_ATTN_SCORES_2 = [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865]
SIMPLE_DOT_X1_QUERY = 0.9544
SIMPLE_SUM_NORMALIZED_2 = [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656]
SIMPLE_ATTN_WEIGHTS_2 = [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]
SIMPLE_CONTEXT_VEC_2 = [0.4419, 0.6515, 0.5683]
# inputs @ inputs.T: the chapter prints the first two rows only.
SIMPLE_ATTN_SCORES_FIRST_ROWS = [
    [0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
    [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
]
SIMPLE_ALL_CONTEXT_VECS = [
    [0.4421, 0.5931, 0.5790],
    [0.4419, 0.6515, 0.5683],
    [0.4431, 0.6496, 0.5671],
    [0.4304, 0.6298, 0.5510],
    [0.4671, 0.5910, 0.5266],
    [0.4177, 0.6503, 0.5645],
]

# --- Trainable weights, step by step: torch.manual_seed(123), three torch.rand(3, 2)
# drawn in the order W_query, W_key, W_value ------------------------------------------
SEED_WEIGHTS_STEP_BY_STEP = 123
QUERY_2 = [0.4306, 1.4551]
ATTN_SCORES_2 = [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440]
ATTN_WEIGHTS_2 = [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820]
CONTEXT_VEC_2 = [0.3061, 0.8210]

# --- SelfAttention_v1, torch.manual_seed(123) ---------------------------------------
SEED_V1 = 123
SA_V1_OUTPUT = [
    [0.2996, 0.8053],
    [0.3061, 0.8210],
    [0.3058, 0.8203],
    [0.2948, 0.7939],
    [0.2927, 0.7891],
    [0.2990, 0.8040],
]

# --- SelfAttention_v2, torch.manual_seed(789) ---------------------------------------
SEED_V2 = 789
SA_V2_OUTPUT = [
    [-0.0739, 0.0713],
    [-0.0748, 0.0703],
    [-0.0749, 0.0702],
    [-0.0760, 0.0685],
    [-0.0763, 0.0679],
    [-0.0754, 0.0693],
]

# --- Causal masking, with sa_v2's weights (seed 789) --------------------------------
# softmax(queries @ keys.T / sqrt(d_k)) before any mask
CAUSAL_ATTN_WEIGHTS_UNMASKED = [
    [0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510],
    [0.2041, 0.1659, 0.1662, 0.1496, 0.1665, 0.1477],
    [0.2036, 0.1659, 0.1662, 0.1498, 0.1664, 0.1480],
    [0.1869, 0.1667, 0.1668, 0.1571, 0.1661, 0.1564],
    [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.1585],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
# the unmasked weights times tril(ones): rows no longer sum to 1
CAUSAL_MASKED_SIMPLE = [
    [0.1921, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.2041, 0.1659, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.2036, 0.1659, 0.1662, 0.0000, 0.0000, 0.0000],
    [0.1869, 0.1667, 0.1668, 0.1571, 0.0000, 0.0000],
    [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.0000],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
# renormalised rows; the -inf-before-softmax approach prints the same matrix
CAUSAL_ATTN_WEIGHTS = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5517, 0.4483, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3800, 0.3097, 0.3103, 0.0000, 0.0000, 0.0000],
    [0.2758, 0.2460, 0.2462, 0.2319, 0.0000, 0.0000],
    [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0.0000],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
NEG_INF = float("-inf")
# attn_scores.masked_fill(mask.bool(), -inf): raw scores, not yet divided by sqrt(d_k)
CAUSAL_MASKED_SCORES = [
    [0.2899, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF],
    [0.4656, 0.1723, NEG_INF, NEG_INF, NEG_INF, NEG_INF],
    [0.4594, 0.1703, 0.1731, NEG_INF, NEG_INF, NEG_INF],
    [0.2642, 0.1024, 0.1036, 0.0186, NEG_INF, NEG_INF],
    [0.2183, 0.0874, 0.0882, 0.0177, 0.0786, NEG_INF],
    [0.3408, 0.1270, 0.1290, 0.0198, 0.1290, 0.0078],
]

# --- Dropout, p = 0.5, torch.manual_seed(123) before each call ----------------------
# The chapter warns that these draws may differ between operating systems.  They differ
# between PyTorch releases too: on the CPU, 2.7 and later draw the printed mask (21 kept of
# 36); 2.1 to 2.6 draw another (15 kept).
SEED_DROPOUT = 123
DROPOUT_MASK_FROM = "2.7"                 # the first PyTorch release that draws the printed mask
DROPOUT_P = 0.5
DROPOUT_ON_ONES = [
    [2.0, 2.0, 0.0, 2.0, 2.0, 0.0],
    [0.0, 0.0, 0.0, 2.0, 0.0, 2.0],
    [2.0, 2.0, 2.0, 2.0, 0.0, 2.0],
    [0.0, 2.0, 2.0, 0.0, 0.0, 2.0],
    [0.0, 2.0, 0.0, 2.0, 0.0, 2.0],
    [0.0, 2.0, 2.0, 2.0, 2.0, 0.0],
]
DROPOUT_ON_CAUSAL_WEIGHTS = [
    [2.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.7599, 0.6194, 0.6206, 0.0000, 0.0000, 0.0000],
    [0.0000, 0.4921, 0.4925, 0.0000, 0.0000, 0.0000],
    [0.0000, 0.3966, 0.0000, 0.3775, 0.0000, 0.0000],
    [0.0000, 0.3327, 0.3331, 0.3084, 0.3331, 0.0000],
]

# --- Batched modules: batch = torch.stack((inputs, inputs)) -------------------------
BATCH_SHAPE = [2, 6, 3]
SEED_CAUSAL = 123
CAUSAL_CONTEXT_VECS_SHAPE = [2, 6, 2]  # CausalAttention(3, 2, 6, 0.0)

SEED_WRAPPER = 123
# MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2); both sequences print the same
_WRAPPER_ONE_SEQUENCE = [
    [-0.4519, 0.2216, 0.4772, 0.1063],
    [-0.5874, 0.0058, 0.5891, 0.3257],
    [-0.6300, -0.0632, 0.6202, 0.3860],
    [-0.5675, -0.0843, 0.5478, 0.3589],
    [-0.5526, -0.0981, 0.5321, 0.3428],
    [-0.5299, -0.1081, 0.5077, 0.3493],
]
WRAPPER_CONTEXT_VECS = [_WRAPPER_ONE_SEQUENCE, _WRAPPER_ONE_SEQUENCE]
WRAPPER_CONTEXT_VECS_SHAPE = [2, 6, 4]
# Exercise 3.2: d_out=1 per head with num_heads=2 gives 2-dimensional context vectors.
EXERCISE_3_2_SHAPE = [2, 6, 2]
