"""What a run is told: :mod:`.settings` (``TrainConfig``: defaults < TOML < flags, and the
flag groups), :mod:`.checks` (what every ``TrainConfig`` passes when it is built) and
:mod:`.preflight` (what is refused before anything is built or probed)."""
