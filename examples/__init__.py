"""Worked examples of kernels the check holds to the reference (``examples.ring_attention``)."""
