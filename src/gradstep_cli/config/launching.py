"""How ``gradstep train`` (and ``plan``) launches its worker processes: ``--nproc-per-node N``
and the options of torch's launcher (``torch.distributed.run``, torchrun) it passes on.

:class:`LaunchFields` holds them (the ``parallel`` section of ``TrainConfig``, which
inherits them); :func:`check_launch` refuses what cannot launch, when the config is built.
The launch itself is :mod:`gradstep_cli.run.launch`'s. Where a run runs is never a run's
setting: a resume takes these from its own command line, never from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradstep_cli.config.checks import ConfigError, flag

__all__ = ["LAUNCH_FIELDS", "LaunchFields", "check_launch", "node_range"]

RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


def _f(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"section": "parallel", "help": help, **extra})


@dataclass(frozen=True)
class LaunchFields:
    """torchrun's options, as ``gradstep train`` flags (used with ``--nproc-per-node``)."""

    nproc_per_node: int | None = _f(
        None, "launch N worker processes on this node through torch's launcher (torchrun): "
        "the flags are checked once, before any starts; one error line if a worker fails",
    )  # fmt: skip
    nnodes: str = _f("1", "nodes of the job: N, or MIN:MAX for an elastic one")
    node_rank: int = _f(0, "this node's rank, with --rdzv-backend static")
    master_addr: str = _f("127.0.0.1", "rank 0's node, with --rdzv-backend static")
    master_port: int | None = _f(
        None, "rank 0's port, with --rdzv-backend static",
        default_help="29500; on one node a free port",
    )  # fmt: skip
    rdzv_backend: str = _f("static", "torchrun's rendezvous backend", choices=RDZV_BACKENDS)
    rdzv_endpoint: str = _f("", "the rendezvous' HOST:PORT (c10d, etcd)")
    rdzv_id: str = _f("none", "the job's id, the same on every node (c10d, etcd)")
    rdzv_conf: str = _f("", "the rendezvous' KEY=VALUE,... options (torchrun's --rdzv-conf)")
    max_restarts: int = _f(
        0, "restart the workers up to N times after a failure (needs --resume-or-start: a "
        "restart continues from the newest checkpoint)",
    )  # fmt: skip


LAUNCH_FIELDS = tuple(LaunchFields.__dataclass_fields__)
"""The launch's settings: never a checkpoint's (run_folder.ENVIRONMENT)."""


def node_range(nnodes: str) -> tuple[int, int]:
    """``--nnodes``: ``N`` -> (N, N), ``MIN:MAX`` -> (MIN, MAX); ConfigError otherwise."""
    low, colon, high = str(nnodes).strip().partition(":")
    try:
        bounds = (int(low), int(high if colon else low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise ConfigError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {nnodes!r}")
    return bounds


def check_launch(cfg: Any) -> None:
    """Refuse launch settings that cannot launch, or that do nothing."""
    if cfg.nproc_per_node is None:
        defaults = LaunchFields()
        changed = [n for n in LAUNCH_FIELDS if getattr(cfg, n) != getattr(defaults, n)]
        if changed:
            raise ConfigError(
                f"{flag(changed[0])} is an option of the launch: it needs --nproc-per-node N "
                "(or torchrun's own options, under torchrun)"
            )
        return
    if cfg.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {cfg.nproc_per_node}")
    node_range(cfg.nnodes)
    if cfg.node_rank < 0 or cfg.max_restarts < 0:
        name = "node_rank" if cfg.node_rank < 0 else "max_restarts"
        raise ConfigError(f"{flag(name)} must be >= 0, got {getattr(cfg, name)}")
    if cfg.master_port is not None and not 0 < cfg.master_port < 65536:
        raise ConfigError(f"--master-port must be in [1, 65535], got {cfg.master_port}")
    if cfg.max_restarts and not cfg.resume_or_start:
        raise ConfigError(
            f"--max-restarts {cfg.max_restarts} restarts every worker with this command "
            "line: add --resume-or-start (and --save-every N) so that a restart continues the "
            "run from its newest checkpoint instead of being refused by its own run folder"
        )
