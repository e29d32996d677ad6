"""Pure NumPy attention: every mechanism of the chapter, forward and hand-written backward.

Imports NumPy only.  Read each forward with its backward directly below it.
"""

from numpy_ref.softmax import (
    softmax,
    softmax_naive,
    softmax_jacobian,
    softmax_backward,
    sum_normalize,
    sum_normalize_jacobian,
)
