"""NumPy kernels: each module replaces one reference op (or, encoder.py, a chain of them) with the same
numbers, faster; threads.py is the machinery they share. tinyvit.kernels.kernel_for picks them.

Importing this package, which happens when the switchboard first picks a CPU kernel (or when a
command such as `tinyvit train` or `tinyvit bench` starts, through threads.py), makes OpenBLAS's idle
threads sleep at once after each matrix product (blas.configure_blas_threads: the kernels' own
threads need those cores between products). So `import tinyvit` alone changes nothing in OpenBLAS or
the environment, and the import order of NumPy and tinyvit does not matter: the threads are
restarted, if they need to be, before the first kernel runs.
"""
from .blas import configure_blas_threads

configure_blas_threads()      # "already" when OpenBLAS read OPENBLAS_THREAD_TIMEOUT at load; else a restart
