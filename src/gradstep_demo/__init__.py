"""The demo trainer: a small GPT on a byte-level corpus (or a Hugging Face causal LM),
trained with gradstep's public API.

It shows the library in a complete training loop (config, data, model, checkpoints,
metrics, distributed launch, memory planning) and backs the ``gradstep`` command line. It
is an example and a test bed, not part of the library: :mod:`gradstep` never imports it
(the one exception is the entry point ``python -m gradstep``), and it imports only the
library's public names (docs/demo.md, "The library and the demo"). It needs the ``demo``
extra: ``pip install 'gradstep[demo]'``.

- :mod:`.cli`: ``gradstep train``, ``plan``, ``report`` and ``export``;
- :mod:`.train`: the training script (entry, setup, loop);
- :mod:`.resume`: starting or resuming a run (the run folder claimed, the checkpoint
  continued, what a checkpoint holds); :mod:`.run_folder`: the run-folder rules;
- :mod:`.config`, :mod:`.config_checks`, :mod:`.preflight`: ``TrainConfig``, its TOML
  loading and what is refused before anything runs;
- :mod:`.model`: the GPT (RoPE, pre-norm, tied embeddings); :mod:`.hf_model`,
  :mod:`.hf_lora`: Hugging Face models and LoRA;
- :mod:`.data`, :mod:`.records`, :mod:`.tokenized`, :mod:`.batching`: the default corpus
  (the Python standard library's sources, no download), text and JSONL records, resumable
  batches and windows;
- :mod:`.schedule`, :mod:`.evaluation`, :mod:`.summary`: LR schedule and batch ramp,
  validation loss, the end of a run;
- :mod:`.planning`: ``--micro-batch-size auto`` and ``gradstep plan``; :mod:`.estimate`: the
  run in the terms of the library's memory model;
- :mod:`.export`: a run's checkpoint as a Hugging Face folder.
"""
