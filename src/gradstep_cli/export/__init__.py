"""``gradstep export``: :mod:`.run` (a run's checkpoint rebuilt and written as a Hugging
Face folder) and :mod:`.folder` (published complete or not at all)."""
