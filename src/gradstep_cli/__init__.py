"""The ``gradstep`` command line: train, plan, export and report, built on the library.

``gradstep train`` fine-tunes a Hugging Face causal LM (``--model hf:DIR``, full or LoRA)
or trains the default model, a small byte-level GPT on the Python standard library's
sources ("the demo": ``make train``), with the exact step of :mod:`gradstep`; ``plan``
fits a run into a memory budget, ``export`` writes a run as a folder ``from_pretrained``
loads, ``report`` plots run folders. It is a separate package on purpose: :mod:`gradstep`
never imports it (the one exception is the entry point ``python -m gradstep``), and it
imports only the library's public names (``tests/cli/test_boundary.py`` checks both). It
needs the ``cli`` extra: ``pip install 'gradstep[cli]'``.

One package per concern:

- :mod:`.cli` (the sub-commands), :mod:`.train` (``gradstep train`` as one pipeline: checks
  -> data -> model -> plan -> run, each stage a small value in its concern's package, then
  the loop), :mod:`.report` (``gradstep report``);
- :mod:`.config`: ``TrainConfig`` (flags, TOML), its checks, what is refused before anything
  is built;
- :mod:`.data`: files and records (text, JSONL formats), token streams, batches and windows;
- :mod:`.models`: the default GPT, Hugging Face models and LoRA, how a model is laid over
  the ranks;
- :mod:`.plan`: ``--micro-batch-size auto`` and ``gradstep plan``, in the library's memory
  model's terms;
- :mod:`.run`: a training run's launch, folder, lock, resume, schedule, evaluation,
  optimizer, loop and summary;
- :mod:`.export`: a run's checkpoint as a Hugging Face folder.
"""
