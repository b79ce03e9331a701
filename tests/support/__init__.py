"""Helpers shared by the test suite and the benchmarks (``bench/`` imports them too).

* ``models``: the tiny models (``TinyLM``, ``tiny_gpt``, ``BF16Linear``);
* ``batches``: right-padded LM micro-batches (``collate``, ``make_window``, ``make_windows``,
  ``concat``);
* ``reference``: the LM loss (``lm_loss``) and the plain full-batch reference step;
* ``multiproc``: real multi-process gloo runs (``run_ranks``, ``free_port``);
* ``asserts``: comparisons (``rel_err``, ``rel_err_named``, ``snapshot``,
  ``assert_bitwise_equal``).
"""
