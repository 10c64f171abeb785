"""CuPy kernels (CUDA C++ through cupy.RawKernel), one op per file, each beside the reference op it
replaces and turned on only once its tests have passed on a real GPU. None yet: on CuPy arrays every
op runs its reference (tinyvit/ops/, the same code as on NumPy)."""
