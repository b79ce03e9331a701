"""What a run is told: :mod:`.settings` (``TrainConfig``: every field with its help and its
section), :mod:`.loading` (defaults < TOML file < flags), :mod:`.flags` (the flags, grouped
by section), :mod:`.reference` (``docs/reference/flags.md``), :mod:`.checks` (what every
``TrainConfig`` passes when it is built) and :mod:`.preflight` (what is refused before
anything is built or probed)."""
