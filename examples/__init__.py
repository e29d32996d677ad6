"""Worked examples of kernels the check holds to the reference (``examples.ring_attention``;
``examples.triton_attention``, FlashAttention-2 in Triton, and ``examples.triton_attention_bug``,
the same with one planted mistake)."""
