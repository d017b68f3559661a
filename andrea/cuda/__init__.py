"""ANDREA's CUDA backend: kernel pairs in ``*.cu`` (package data), compiled at run time by CuPy
through ``andrea.cuda.loader``; ``kernels`` (launch geometry, argument checks, cuBLAS), ``mirror``
(the fp32 op mirror), ``engine`` (``GpuEngine`` and its op set), ``backend`` (``CupyBackend``).

Importing this package needs neither CuPy nor a GPU (``andrea.cuda.backend.probe()`` says why
the backend is not usable on a machine).
"""
