"""The data of a run, prepared once: :mod:`.specs` (what ``--data`` names: text files, record
files, a saved or Hub dataset), :mod:`.files` (which files, and which are usable text),
:mod:`.reading` (records one at a time: JSONL here, other formats through ``datasets``),
:mod:`.formats` (the record formats and their checks), :mod:`.records` (records encoded to
tokens), :mod:`.scan` and :mod:`.build` (the two passes: everything checked and the split
decided, then tokenized), :mod:`.chunks` (long documents tokenized in pieces, exactly),
:mod:`.store` (the token store on disk), :mod:`.prepare` (store reused or built, opened),
:mod:`.sources` (the data stage's entry point, the default corpus), :mod:`.sides` and
:mod:`.tokenized` (the resumable stream of token rows), :mod:`.batching` (how a window is cut
into micro-batches) and :mod:`.load` (the data stage: the tokenizer and the data, once)."""
