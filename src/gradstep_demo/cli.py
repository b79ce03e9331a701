"""Command line: ``gradstep train`` and ``gradstep report`` (more subcommands plug in the same way).

Flags are generated from :class:`~gradstep.config.TrainConfig` so the CLI, the TOML file
and the dataclass can never disagree about a parameter's name, type or help text. Every
flag defaults to "not given", so only flags actually typed override the TOML file.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable, Sequence

from gradstep.errors import GradstepError

from .config import TrainConfig, load_toml, resolve

__all__ = ["build_parser", "main"]

Handler = Callable[[argparse.Namespace], int]
_METAVARS = {
    "data": "PATH",
    "out": "DIR",
    "resume": "PATH",
    "clip": "SPEC",
    "device": "DEVICE",
    "micro_batch_size": "N|auto",
    "memory_budget": "SIZE",
    "model": "gpt|hf:PATH",
    "lora": "R",
    "aux_loss_coef": "COEF",
}


def _flag_type(hint: typing.Any) -> type:
    """``int``/``float``/``str`` from a field hint (``str | None`` -> ``str``)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="train the demo byte-level GPT with the exact accumulate-and-clip step",
        description="Train a small byte-level GPT. Precedence: defaults < --config < flags.",
    )
    _add_config_flags(parser)
    parser.set_defaults(handler=_run_train)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field (and ``--config``), shared by train and plan."""
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file of train settings")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = f.metadata.get("type") or _flag_type(hints[f.name])
        if kind is bool:  # --flag / --no-flag; argparse's type=bool would take "False" as True
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=f"{f.metadata['help']} (default: {f.default})",
            )
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=kind,
            choices=f.metadata.get("choices"),
            nargs=f.metadata.get("nargs"),
            const=f.metadata.get("const"),
            default=argparse.SUPPRESS,  # absent flags must not override the TOML file
            help=f"{f.metadata['help']} (default: {f.default})",
            metavar=None
            if "choices" in f.metadata
            else _METAVARS.get(f.name, getattr(kind, "__name__", "VALUE").upper()),
        )


def _config(args: argparse.Namespace) -> tuple[TrainConfig, set[str]]:
    """The resolved config, and the settings the user set on purpose (flags, config file):
    a resume checks those against the checkpoint."""
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if hasattr(args, f.name)
    }
    given = set(overrides) | (set(load_toml(args.config)) if args.config else set())
    return resolve(args.config, **overrides), given


def _run_train(args: argparse.Namespace) -> int:
    from .train import train  # deferred: `--help` should not pay for importing the trainer

    cfg, given = _config(args)
    train(cfg, given=given)
    return 0


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan",
        help="choose micro-batch size, accumulation and checkpointing for a memory budget",
        description="Probe the model on this device and print the candidates that split "
        "--global-batch under --memory-budget, and the fastest that fits. Takes every "
        "`gradstep train` flag; under torchrun it plans for the launched ranks.",
    )
    _add_config_flags(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--no-probe", action="store_true", help="analytic estimate only (nothing is allocated)"
    )
    parser.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    import json

    from gradstep import parallel

    from .planning import plan_run

    cfg, _ = _config(args)
    owns_group = not parallel.is_initialized()
    env = parallel.init(cfg.device, timeout_s=cfg.collective_timeout)
    try:
        with parallel.quiet_unless_main():
            planned = plan_run(cfg, env.device, probe=not args.no_probe)
            if args.json:
                print(json.dumps(planned.to_json()))
            else:
                if planned.probe is not None:
                    print(planned.probe.describe())
                print(planned.plan.table())
    finally:
        if owns_group:
            parallel.shutdown(barrier=False)
    return 0


def _add_report_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "report",
        help="plot runs (loss, grad norm, clipping, lr, tokens/s) into PNGs and one HTML page",
        description="Plot one or more run folders; several runs overlay on the same axes. "
        "Works on runs still being written.",
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) holding metrics.jsonl"
    )
    parser.add_argument("--out", metavar="DIR", help="output folder (default: RUN_DIR/report)")
    parser.set_defaults(handler=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from gradstep.report import ReportError, write_report  # deferred: matplotlib is optional

    try:
        page = write_report(args.run_dirs, args.out)
    except (ReportError, ImportError) as exc:
        print(f"gradstep report: error: {exc}", file=sys.stderr)
        return 2
    print(page)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradstep", description="Exact gradient accumulation and clipping, with a demo."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train_parser(sub)
    _add_plan_parser(sub)
    _add_report_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradstep`` script; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except (GradstepError, NotImplementedError, ValueError) as exc:
        print(f"gradstep {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a folder made read-only mid-run: no traceback
        print(f"gradstep {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from gradstep.parallel import collective_failure

        message = collective_failure(exc)
        if message is None:
            raise
        print(f"gradstep {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gradstep {args.command}: interrupted", file=sys.stderr)
        return 130
