"""What :func:`gradstep.memory.plan_step` weighed and chose: every :class:`Candidate` (a
micro-batch size, checkpointing on or off and, when planned, the loss's chunking) and the
:class:`Plan`, with the table ``gradstep plan`` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .units import format_bytes

__all__ = ["Candidate", "Plan", "loss_text", "loss_words"]


def loss_text(chunk: int | None) -> str:
    """``--loss-chunk-tokens`` as the table shows it (None: not planned)."""
    return "-" if chunk is None else "whole" if chunk == 0 else str(chunk)


def loss_words(chunk: int | None) -> str:
    """``--loss-chunk-tokens`` as a sentence says it, after a comma ("" when not planned)."""
    if chunk is None:
        return ""
    return (
        ", the loss from the whole logits" if chunk == 0 else f", the loss {chunk} tokens at a time"
    )


@dataclass(frozen=True)
class Candidate:
    micro_batch_size: int
    accum_steps: int
    activation_checkpointing: bool
    predicted_peak_bytes: int
    relative_throughput: float
    """Items per second relative to the fastest candidate that fits (1.0 = the best; above
    1 for faster candidates that do not fit: what the budget costs)."""
    fits: bool
    last_micro_batch_size: int
    """The last micro-batch of a rank's window: shorter when ``mbs`` does not divide it."""
    step_seconds: float
    """Predicted time of one optimizer step (in the units of ``step_time``)."""
    loss_chunk_tokens: int | None = None
    """The loss's ``--loss-chunk-tokens`` (0: the whole logits); None when not planned."""

    @property
    def key(self) -> tuple[int, bool, int | None]:
        return (self.micro_batch_size, self.activation_checkpointing, self.loss_chunk_tokens)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    micro_batch_size: int
    accum_steps: int
    activation_checkpointing: bool
    predicted_peak_bytes: int
    budget_bytes: int
    global_batch: int
    candidates: list[Candidate] = field(default_factory=list)
    world_size: int = 1
    margin: float = 0.1
    per_rank_batch: int = 0
    last_micro_batch_size: int = 0
    timed: bool = True
    """False when the step times are only :func:`default_step_time`'s (no model of the
    step's work, e.g. a caller without shapes): the table then leaves the speed out."""
    tp: int = 1
    """Tensor-parallel ranks per data-parallel rank: ``world_size`` counts the data-parallel
    ranks the global batch is split over, each of them ``tp`` devices."""
    probe_peak_bytes: int = 0
    """The highest peak the probe reached in this process (0: no probe). A run that plans
    itself (``--micro-batch-size auto``) probes first, so its process peaks at
    :attr:`process_peak_bytes`; a run given the choice by hand at the prediction."""
    loss_chunk_tokens: int | None = None
    """The chosen ``--loss-chunk-tokens`` (0: the whole logits); None when not planned."""

    @property
    def process_peak_bytes(self) -> int:
        """The peak of a process that probes, then trains at this plan."""
        return max(self.predicted_peak_bytes, self.probe_peak_bytes)

    @property
    def key(self) -> tuple[int, bool, int | None]:
        return (self.micro_batch_size, self.activation_checkpointing, self.loss_chunk_tokens)

    def to_json(self) -> dict:
        """Plain JSON types; ``candidates`` as dicts."""
        out = asdict(self)
        out["candidates"] = [c.to_json() for c in self.candidates]
        out["process_peak_bytes"] = self.process_peak_bytes
        return out

    def chosen(self, c: Candidate) -> bool:
        """Whether ``c`` is the plan's choice (a candidate of an unplanned loss has none)."""
        planned = c.loss_chunk_tokens is not None
        return c.key[:2] == self.key[:2] and (not planned or c.key[2] == self.key[2])

    def _row(self, c: Candidate, chunks: bool) -> tuple[str, ...]:
        return (
            "*" if self.chosen(c) else "",
            str(c.micro_batch_size),
            str(c.accum_steps),
            str(c.last_micro_batch_size),
            "on" if c.activation_checkpointing else "off",
            *((loss_text(c.loss_chunk_tokens),) if chunks else ()),
            format_bytes(c.predicted_peak_bytes),
            f"{c.predicted_peak_bytes / self.budget_bytes:.0%}",
            f"{c.relative_throughput:.2f}" if self.timed else "-",
            "yes" if c.fits else "no",
        )

    def table(self) -> str:
        """The candidates as an aligned text table, the chosen row marked ``*``."""
        usable = self.budget_bytes * (1 - self.margin)
        ranks = "rank(s)" if self.tp == 1 else f"data-parallel rank(s) x {self.tp} tensor-parallel"
        head = (
            f"budget {format_bytes(self.budget_bytes)} per device, margin {self.margin:.0%} "
            f"-> {format_bytes(usable)} usable; global batch {self.global_batch} over "
            f"{self.world_size} {ranks} = {self.per_rank_batch} per rank"
        )
        chunks = any(c.loss_chunk_tokens is not None for c in self.candidates)
        cols = ("", "mbs", "accum", "last", "ckpt", *(("loss",) if chunks else ()))
        cols += ("peak/device", "of budget", "speed", "fits")
        order = sorted(
            self.candidates,
            key=lambda c: (c.activation_checkpointing, -(c.loss_chunk_tokens or 0), c.key[0]),
        )
        rows = [self._row(c, chunks) for c in order]
        widths = [max(len(r[i]) for r in (cols, *rows)) for i in range(len(cols))]
        lines = [head, "  ".join(h.rjust(w) for h, w in zip(cols, widths, strict=True))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
        if not self.timed:
            lines.append(
                "speed: not modelled (no shapes to count the work of): the candidates are "
                "ranked as if a micro-batch's fixed cost were one item's"
            )
        lines.append(self._chosen_line())
        if self.probe_peak_bytes > self.predicted_peak_bytes:
            lines.append(
                f"the probe itself peaked at {format_bytes(self.probe_peak_bytes)}: a run that "
                "plans itself (--micro-batch-size auto) peaks there"
            )
        return "\n".join(lines)

    def _chosen_line(self) -> str:
        loss = loss_words(self.loss_chunk_tokens)
        return (
            f"chosen: micro-batch {self.micro_batch_size} x {self.accum_steps} accumulation "
            f"steps (last {self.last_micro_batch_size}), activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}{loss}, predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)}"
        )
