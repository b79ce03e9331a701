"""What ``gradstep train`` refuses before it builds or probes anything, in one place.

``gradstep plan`` runs the same checks (``planning=True`` adds what the planner cannot
plan), so the two commands refuse exactly the same settings with the same message, and a
refusal costs no probe. Every check is a pure function of the config and the launch, so
every rank of a torchrun job reaches the same verdict without a collective. :func:`note`
is how the command line tells the user what it did (rank 0 only).
"""

from __future__ import annotations

import sys

import torch

from gradstep import parallel
from gradstep_cli.config.evaluation import check_prompt_file, check_trackers
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.run.launch import Launch

__all__ = ["check_before_launch", "check_global_batch", "check_run", "gns_notes"]


def check_run(cfg: TrainConfig, env: parallel.DistEnv | Launch, *, planning: bool = False) -> None:
    """Raise :class:`ConfigError` for a run ``cfg`` cannot be on this launch ``env``.

    ``planning``: the caller plans ``cfg`` (``gradstep plan``) rather than training it;
    also refuse what the planner cannot plan.
    """
    launch = env if isinstance(env, Launch) else Launch.of(cfg, env)
    _check_launch(cfg, launch)
    _check_mesh(cfg, launch.world_size)
    _check_device(cfg, launch.device)
    if not planning:  # before the run folder is touched
        check_trackers(cfg)
        check_prompt_file(cfg)
    data_ranks = launch.data_ranks  # tensor-parallel peers read the same data
    if cfg.eval_batches is not None and cfg.eval_batches < data_ranks:
        raise ConfigError(
            f"--eval-batches must be >= the number of {_ranks(cfg)} ({data_ranks}): every "
            f"rank evaluates at least one batch, got {cfg.eval_batches}"
        )
    if cfg.global_batch is not None:
        check_global_batch(cfg.global_batch, data_ranks, _ranks(cfg))
    if planning:
        _check_plannable(cfg)


def check_before_launch(cfg: TrainConfig, given: frozenset[str], *, planning: bool) -> None:
    """``--nproc-per-node``: what the workers would refuse, refused once in the launching
    process, before any worker starts: the launch (torchrun's own, or the ranks the flags
    need), every check of :func:`check_run` on the planned ranks, and (``gradstep train``)
    the run folder's rules and a resume's settings. What only a worker can see (its
    data, its model's files) it reports itself, once, through the launcher."""
    from gradstep_cli.run import folder as run_folder
    from gradstep_cli.run.launch import planned_launch

    if parallel.launched_by_torchrun():
        raise ConfigError(
            "--nproc-per-node starts the workers itself: under torchrun, drop it (torchrun's "
            "own options say how many), or run gradstep without torchrun"
        )
    launch = planned_launch(cfg)
    cuda = launch is not None and launch.device.type == "cuda"
    if cuda and cfg.nproc_per_node > torch.cuda.device_count():
        raise ConfigError(
            f"--nproc-per-node {cfg.nproc_per_node}: this node has "
            f"{torch.cuda.device_count()} CUDA device(s), one per worker"
        )
    if launch is not None:
        check_run(cfg, launch, planning=planning)
    if planning:
        return
    info = run_folder.find_checkpoint(cfg)
    run_folder.prepare(cfg, info, delete=False)  # the workers' rank 0 deletes (--overwrite)
    if launch is not None:
        run_folder.resumed_settings(cfg, info, given, launch.data_ranks)


def check_global_batch(global_batch: int, world_size: int, ranks: str = "ranks") -> None:
    """A global batch every rank takes an equal, non-empty share of (train splits it so).

    ``world_size``: the ranks that read different data (``ranks`` says which, in the
    message: "data-parallel ranks" under ``--tp``)."""
    if global_batch % world_size:  # also covers global_batch < world_size (it is >= 1)
        below = global_batch - global_batch % world_size
        nearest = f"{below} or {below + world_size}" if below else str(world_size)
        raise ConfigError(
            f"--global-batch ({global_batch}) must be a multiple of the number of {ranks} "
            f"({world_size}): every rank takes the same number of sequences per step; "
            f"use e.g. {nearest}"
        )


def _ranks(cfg: TrainConfig) -> str:
    return "data-parallel ranks" if cfg.tp > 1 else "ranks"


def _check_mesh(cfg: TrainConfig, world: int) -> None:
    """--tp and --hsdp divide the launched ranks (a 2-D mesh of them), and so does their
    product when both are given (a 3-D mesh: replicate x shard x tp)."""
    for name, value in (("tp", cfg.tp), ("hsdp", cfg.hsdp)):
        if world % value:
            fits = [n for n in range(1, world + 1) if world % n == 0]
            raise ConfigError(
                f"--{name} {value} must divide the number of ranks ({world}): use --{name} "
                f"{' or '.join(map(str, fits))}, or launch a multiple of {value} processes"
            )
    if world % (cfg.tp * cfg.hsdp):
        raise ConfigError(
            f"--hsdp {cfg.hsdp} x --tp {cfg.tp} = {cfg.hsdp * cfg.tp} must divide the number "
            f"of ranks ({world}): launch a multiple of {cfg.hsdp * cfg.tp} processes"
        )


def _check_launch(cfg: TrainConfig, env: Launch) -> None:
    """--strategy and the launcher must agree: N processes without a strategy would train N
    unrelated models, and a strategy without torchrun has no other rank to sync with."""
    if cfg.strategy == "none" and env.world_size > 1:
        raise ConfigError(
            f"launched as {env.world_size} processes but strategy='none'; "
            "use --strategy ddp or --strategy fsdp"
        )
    if cfg.strategy != "none" and env.backend is None:
        raise ConfigError(
            f"strategy={cfg.strategy!r} needs a torchrun launch, e.g. torchrun "
            f"--nproc_per_node=2 -m gradstep train --strategy {cfg.strategy}"
        )


def _check_device(cfg: TrainConfig, device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device!r}: this torch build or machine has no CUDA")
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"device={cfg.device!r}: only {torch.cuda.device_count()} CUDA device(s) here"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={cfg.device!r}: MPS is not available on this machine")


def _check_plannable(cfg: TrainConfig) -> None:
    """What the planner needs that a run does not: the global batch it splits."""
    if cfg.global_batch is None:
        raise ConfigError(
            "gradstep plan needs --global-batch (sequences per optimizer step): the planner "
            "chooses how to split it"
        )


def gns_notes(cfg: TrainConfig, micro_batches: int, world: int, given: frozenset[str]) -> list[str]:
    """Noise-scale settings that would silently do nothing (``micro_batches``: per window
    on each rank); lines to print, not refusals."""
    if not cfg.measures_gns:
        if "gns_beta" in given:
            return ["note: --gns-beta has no effect without --gns or --batch-ramp gns"]
        return []
    if micro_batches * world < 2:
        what = "--global-batch" if cfg.global_batch is not None else "--accum-steps"
        return [
            "note: --gns compares the micro-batches of a step with their sum and needs at "
            f"least 2 per step over all ranks; with 1, gns_b_simple stays null: raise {what}"
        ]
    return []


def note(line: str) -> None:
    """A line for the user on stderr, from rank 0 only (model loading, LoRA, the plan)."""
    if parallel.is_main():
        print(line, file=sys.stderr)
