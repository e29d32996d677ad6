"""The benchmark: ``attention-parity bench`` (``run``), NumPy vs PyTorch forward+backward
time and NumPy's peak memory.  It prints figures; no test asserts any of them."""
