"""ANDREA's CUDA backend: kernel pairs in ``*.cu`` (package data), compiled at run time by CuPy
through ``andrea.cuda.loader``; ``andrea.cuda.backend`` holds the op mirror and ``GpuEngine``.

Importing this package needs neither CuPy nor a GPU (``andrea.cuda.backend.probe()`` says why
the backend is not usable on a machine).
"""
