"""The parity harness: NumPy reference and PyTorch mirror, held against each other."""
