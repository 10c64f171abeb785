"""NumPy kernels: each module replaces one reference op (or, encoder.py, a chain of them) with the same
numbers, faster; threads.py is the machinery they share. tinyvit.kernels.kernel_for picks them."""
