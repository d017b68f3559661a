"""The ANDREA training engine: the model written once (recipe.py), its layout and buffer plan
(model.py), the op contract and its NumPy reference (ops_numpy.py, threads in pool.py; CuPy twins
in andrea/cuda), the flat-buffer engine and the one step loop (engine.py), AdamW schedule
(schedule.py), checkpoint I/O (checkpoint.py) and the backend contract (backend.py; which backend
a run gets: andrea/backends.py). See each module's docstring."""
