"""``--micro-batch-size auto`` and ``gradstep plan``: :mod:`.planning` (the run's model,
probed and planned) and :mod:`.estimate` (the run in the terms of the library's memory
model)."""
