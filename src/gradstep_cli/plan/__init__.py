"""``--micro-batch-size auto`` and ``gradstep plan``: :mod:`.batch` (the plan stage: how each
window is cut), :mod:`.planning` (the run's model, probed and planned), :mod:`.budget` (the
memory budget, and the prediction of a fixed micro-batch size) and :mod:`.estimate` (the
run in the terms of the library's memory model)."""
