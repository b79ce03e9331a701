"""The data of a run: :mod:`.files` (which files ``--data`` names), :mod:`.records` (JSONL
records: read, checked, encoded), :mod:`.sources` (text and records split into training and
validation, the default corpus), :mod:`.tokenized` (the resumable stream of token rows),
:mod:`.batching` (how a window is cut into micro-batches) and :mod:`.load` (the data stage:
the tokenizer and the data, read once)."""
