"""A training run around the step: :mod:`.folder` and :mod:`.lock` (one run per folder,
honest resumes), :mod:`.resume` (starting or continuing a run), :mod:`.components` (its
optimizer and loss), :mod:`.schedule` (LR schedule and batch ramp), :mod:`.evaluation`
(validation loss) and :mod:`.summary` (the end of a run)."""
