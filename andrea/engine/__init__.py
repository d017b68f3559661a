"""The ANDREA training engine: model layout (model.py), op pairs (ops_numpy.py; CuPy twins in
andrea/cuda), flat-buffer engine (engine.py), AdamW schedule (schedule.py), checkpoint I/O
(checkpoint.py) and the backend switch (backend.py). See each module's docstring."""
