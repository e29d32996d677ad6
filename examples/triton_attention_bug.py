"""`examples.triton_attention` with one planted mistake: the forward drops the
accumulator's rescale ``alpha = exp(m_old - m_new)`` (``acc`` is no longer multiplied by
alpha when a key tile raises a row's max; ``l`` still is).  Every row whose max moves after
its first key tile comes out wrong, so T must span at least two tiles (T >= 128) for the
mistake to show.

    TRITON_INTERPRET=1 python -m parity_tests check examples.triton_attention_bug:attention \\
        --dtype float16 --tokens 128 --head-dim 32     # exit status 1, the mistake named
"""

from examples.triton_attention import flash_attention

__all__ = ["attention"]


def attention(q, k, v, *, causal, scale):
    """The check's callable, with the rescale of the accumulator dropped."""
    return flash_attention(q, k, v, causal=causal, scale=scale, rescale=False)
