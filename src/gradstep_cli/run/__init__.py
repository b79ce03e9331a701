"""A training run around the step: :mod:`.launch` (where it runs), :mod:`.start` (the checks
stage: settings checked, run folder claimed, checkpoint found), :mod:`.build` (the run
stage: everything the loop touches), :mod:`.loop` (the loop), :mod:`.folder` and
:mod:`.lock` (one run per folder, honest resumes), :mod:`.resume` (what a checkpoint
holds), :mod:`.components` (the optimizer and loss), :mod:`.schedule` (LR schedule and
batch ramp), :mod:`.evaluation` (validation loss) and :mod:`.summary` (the end of a run)."""
