"""The demo trainer: a small GPT on a byte-level corpus, trained with gradstep's public API.

It shows the library in a complete training loop (config, data, model, checkpoints,
metrics, distributed launch) and backs the ``gradstep`` command line. It is an example
and a test bed, not part of the library: :mod:`gradstep` never imports it.

- :mod:`.model`: the GPT (RoPE, pre-norm, tied embeddings);
- :mod:`.data`: the default corpus (the Python standard library's sources, no download),
  byte tokenizer, resumable batches;
- :mod:`.config`: ``TrainConfig`` and its TOML loading;
- :mod:`.train`: the training loop;
- :mod:`.cli`: ``gradstep train`` and ``gradstep report``.
"""
