"""The run stage of ``gradstep train``: everything the loop touches, built once (:class:`Run`).

The model is built here, once (same seed on every rank), laid over the ranks, and given its
optimizer and :class:`~gradstep.Stepper`; this rank's stream and validation batches are cut
from the data stage's data; the LR schedule, the batch ramp and the checkpointer follow the
plan's layout; a resume loads the checkpoint the checks found.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from gradstep import GradientNoiseScale, Stepper
from gradstep.checkpoint import Checkpointer, CheckpointInfo
from gradstep.memory import checkpoint_blocks
from gradstep.policies import clip_policies
from gradstep_cli.config.preflight import gns_notes, note
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.batching import Layout, rank_batches
from gradstep_cli.data.load import Data
from gradstep_cli.data.sources import Batch, TextSource, TrainBatches
from gradstep_cli.models import parallel_plan
from gradstep_cli.models.compile import check_compile, compile_blocks, compile_note
from gradstep_cli.models.spec import ModelSpec
from gradstep_cli.plan.batch import BatchPlan
from gradstep_cli.plan.planning import Planned
from gradstep_cli.run import resume
from gradstep_cli.run.components import build_optimizer
from gradstep_cli.run.evaluation import sample_note
from gradstep_cli.run.launch import Launch
from gradstep_cli.run.schedule import BatchRamp, LRSchedule, run_length, shape_of
from gradstep_cli.run.start import Checked

__all__ = ["Run", "build_run", "say"]


@dataclass
class Run:
    """Everything the loop touches."""

    cfg: TrainConfig
    """The settings the run runs (config.json): the checked ones, with the plan's split."""
    launch: Launch
    data: Data
    layout: Layout
    model: nn.Module
    stepper: Stepper
    schedule: LRSchedule
    train_iter: TrainBatches
    val: list[Batch]
    planned: Planned | None = None
    gns: GradientNoiseScale | None = None
    ramp: BatchRamp | None = None
    progress: resume.Progress = field(default_factory=resume.Progress)
    start: int = 0
    """Steps already taken: the step of the checkpoint resumed from."""
    checkpointer: Checkpointer | None = None
    notes: tuple[str, ...] = ()
    """What the setup decided, said before the first step."""

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def device(self) -> torch.device:
        return self.launch.device

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def data_ranks(self) -> int:
        return self.launch.data_ranks

    @property
    def is_main(self) -> bool:
        return self.launch.is_main

    @property
    def source(self) -> TextSource:
        return self.data.source

    @property
    def tokenizer(self) -> Any:
        """The HF model's tokenizer (None: bytes)."""
        return self.data.tokenizer

    @property
    def accum_steps(self) -> int:
        """Micro-batches per window on each rank."""
        return self.layout.micro_batches

    @property
    def planned_peak_mb(self) -> float | None:
        """The plan's predicted peak (--micro-batch-size auto), logged next to the measured one."""
        return None if self.planned is None else self.planned.plan.predicted_peak_bytes / 2**20

    @property
    def budget(self) -> int:
        """Micro-batches per rank the run trains on (ramped runs end on it)."""
        return self.cfg.max_steps * self.accum_steps

    def finished(self, steps: int) -> bool:
        if self.ramp is None:
            return steps >= self.cfg.max_steps
        return self.progress.micro_batches >= self.budget


def build_run(checked: Checked, data: Data, model: ModelSpec, plan: BatchPlan) -> Run:
    """The run of the checked settings, their data, model and plan; resumed from the
    checkpoint the checks found."""
    cfg, launch, layout, info = plan.cfg, checked.launch, plan.layout, checked.resume
    torch.manual_seed(cfg.seed)
    if cfg.compile:
        check_compile(launch.device)  # before the model is built
    module, stepper, gns = _model_and_stepper(cfg, model, launch.device, plan.planned)
    train_iter, val = rank_batches(cfg, data.source, layout, launch.data_rank, launch.data_ranks)
    per_step = layout.stream_items_per_window * launch.data_ranks
    cfg, length = run_length(cfg, train_iter, per_step, layout.stream_rows)  # --epochs
    schedule = _schedule(cfg, layout, launch, checked.horizon)
    run = Run(cfg, launch, data, layout, module, stepper, schedule, train_iter, val)
    run.planned, run.gns = plan.planned, gns
    mesh = parallel_plan.data_ranks_note(cfg, launch.world_size)
    if mesh is not None:
        say(run, mesh)
    say(run, f"data: {data.source.describe()}")  # what trains, and every record cut or left out
    if length is not None:
        say(run, length)
    if (sampled := sample_note(cfg, data.source, layout)) is not None:
        say(run, sampled)  # --eval-batches: the validation loss is a sample's
    if cfg.batch_ramp is not None:
        run.ramp = BatchRamp.from_spec(cfg.batch_ramp, layout.micro_batches, launch.data_ranks)
    _resume(run, info)
    idle = gns_notes(cfg, layout.micro_batches, launch.data_ranks, checked.given)
    run.notes = (*checked.notes, *plan.notes, *idle)
    return run


def _model_and_stepper(
    cfg: TrainConfig, model: ModelSpec, device: torch.device, planned: Planned | None
) -> tuple[nn.Module, Stepper, GradientNoiseScale | None]:
    # Same seed on every rank: DDP and FSDP2 both start from identical weights.
    module = model.build().to(device)
    if cfg.activation_checkpointing:
        checkpoint_blocks(module)  # before sharding, as FSDP2 expects
    if cfg.compile:
        # The checkpointed block is compiled (recompute in the graph), inside FSDP2/DDP. The
        # compile itself happens at the first step: after --tp has split the block, as
        # torchtitan orders it (tensor parallel, checkpointing, compile, sharding).
        compile_blocks(module)
        note(compile_note(module))
    module = parallel_plan.prepare(module, cfg)
    optimizer = build_optimizer(module, cfg)  # after sharding: FSDP2 steps its shards
    clip = clip_policies(cfg.clip, cfg.spike_guard, module)  # agc: output layer excluded
    gns = GradientNoiseScale(cfg.gns_beta) if cfg.measures_gns else None
    stepper = Stepper(
        module,
        optimizer,
        clip=clip,
        precision=cfg.precision,
        # A planned micro-batch is a prediction: if it is wrong, split it rather than crash.
        on_oom="split" if planned is not None else "raise",
        hooks=[gns] if gns is not None else None,
    )
    return module, stepper, gns


def _schedule(cfg: TrainConfig, layout: Layout, launch: Launch, horizon: int | None) -> LRSchedule:
    # A resume keeps the checkpoint's horizon (loaded with the schedule's state; older
    # checkpoints: their run's max_steps), however far this invocation trains.
    shape = shape_of(cfg, horizon or cfg.max_steps)
    return LRSchedule(shape, cfg.lr, layout.micro_batches, cfg.lr_scaling, launch.data_ranks)


def _resume(run: Run, info: CheckpointInfo | None) -> None:
    """Load the checkpoint the run continues; give the run its checkpointer."""
    for line in resume.load(run, info) if info is not None else []:
        say(run, line)
    if run.cfg.save_every or info is not None or run.cfg.keep_best is not None:
        run.checkpointer = resume.checkpointer(run)


def say(run: Run, line: str) -> None:
    """A line for the user on stderr, from rank 0 only (above the progress bar)."""
    if run.is_main:
        tqdm.write(line, file=sys.stderr)
