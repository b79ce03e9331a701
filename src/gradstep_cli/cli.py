"""Command line: ``gradstep train``, ``plan``, ``report`` and ``export`` (more plug in the
same way).

The flags of ``train`` and ``plan`` are generated from
:class:`~gradstep_cli.config.settings.TrainConfig` (:mod:`gradstep_cli.config.flags`), in
groups by section.

Every user mistake ends as one line ``gradstep COMMAND: error: ...`` and exit status 2
(``gradstep plan --json`` also prints it as ``{"error": ...}`` on stdout); a failure of the
machine (a full disk, a dead rank) as one line naming the file or the timeout, status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import json
import os
import re
import sys
import time
import typing
from collections.abc import Callable, Sequence

from gradstep.errors import GradstepError
from gradstep_cli.config.flags import add_config_flags
from gradstep_cli.config.loading import load_toml, resolve
from gradstep_cli.config.settings import TrainConfig

__all__ = ["CLI_EXTRA", "build_parser", "main"]

CLI_EXTRA = ("tqdm", "tomli") if sys.version_info < (3, 11) else ("tqdm",)
"""What the command line needs beyond the library: ``pip install 'gradstep[cli]'``."""

Handler = Callable[[argparse.Namespace], int]


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="train the demo GPT or a Hugging Face causal LM with the exact "
        "accumulate-and-clip step",
        description="Train the demo's small byte-level GPT on text, or fine-tune a Hugging "
        "Face causal LM (--model hf:DIR: its weights and tokenizer) on text files or records "
        "(JSONL, Parquet, CSV, Arrow or a datasets folder: text, prompt/completion, chat "
        "messages), with the exact accumulate-and-clip step. Precedence: defaults < --config "
        "< flags.",
    )
    add_config_flags(parser)
    parser.set_defaults(handler=_run_train)


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
    from gradstep_cli.train import (
        train,  # deferred: `--help` should not pay for importing the trainer
    )

    cfg, given = _config(args)
    if _launches(cfg):
        return _launch(args, cfg, given)
    train(cfg, given=given)
    return 0


def _launches(cfg: TrainConfig) -> bool:
    """``--nproc-per-node`` given, and this process is not one of the workers it starts."""
    from gradstep_cli.run.launch import wants_launch

    return wants_launch(cfg)


def _launch(args: argparse.Namespace, cfg: TrainConfig, given: set[str]) -> int:
    """``--nproc-per-node N``: every flag checked here, once, then the workers started
    through torch's launcher; a failed worker ends in one line naming its rank."""
    from gradstep_cli.config.preflight import check_before_launch
    from gradstep_cli.run.launch import launch_workers

    check_before_launch(cfg, frozenset(given), planning=args.command == "plan")
    status, error = launch_workers(cfg, args.argv)
    if error is not None:
        _fail(args.command, error, getattr(args, "json", False), status)
    return status


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan",
        help="choose micro-batch size, accumulation and checkpointing for a memory budget",
        description="Probe the model train would build (the demo GPT or --model hf:DIR) on "
        "this device at the data's lengths and print the candidates that split "
        "--global-batch under --memory-budget, and the fastest that fits. Takes every "
        "`gradstep train` flag and refuses, before probing, what train would refuse; under "
        'torchrun it plans for the launched ranks. With --json, errors are {"error": ...} too.',
    )
    add_config_flags(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--no-probe", action="store_true", help="analytic estimate only (nothing is allocated)"
    )
    parser.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    """The first stages of ``gradstep train`` (checks, data, model), then the planner."""
    from gradstep import parallel
    from gradstep_cli.data.load import load_data
    from gradstep_cli.models.spec import resolve_model
    from gradstep_cli.plan import planning
    from gradstep_cli.run.launch import Launch
    from gradstep_cli.run.start import check_plan

    cfg, given = _config(args)
    if _launches(cfg):
        return _launch(args, cfg, given)
    started = time.perf_counter()
    owns_group = not parallel.is_initialized()
    env = parallel.init(cfg.device, timeout_s=cfg.collective_timeout)
    try:
        # What train would refuse, refused the same way before anything is probed.
        checked = check_plan(cfg, Launch.of(cfg, env), frozenset(given))
        with parallel.quiet_unless_main():
            data = load_data(checked)
            model = resolve_model(checked)
            setup = time.perf_counter() - started
            planned = planning.plan_for(
                checked.cfg,
                checked.launch,
                model,
                data.source,
                probe=not args.no_probe,
                given=checked.given,  # as train's: a --loss-chunk-tokens given is kept
            )
            took = planning.timing_line(planned, time.perf_counter() - started, setup)
            _print_plan(planned, args.json, took)
    finally:
        if owns_group:
            parallel.shutdown(barrier=False)
    return 0


def _print_plan(planned: typing.Any, as_json: bool, took: str) -> None:
    """The plan (or one JSON object), and how long planning took (stderr, or its key)."""
    if as_json:
        print(json.dumps({**planned.to_json(), "took": took}))
        return
    if planned.probe is not None:
        print(planned.probe.describe())
    print(planned.plan.table())
    print(took, file=sys.stderr)


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
    from gradstep_cli.report import ReportError, write_report  # deferred: matplotlib is optional

    try:
        page = write_report(args.run_dirs, args.out)
    except (ReportError, ImportError) as exc:
        print(f"gradstep report: error: {exc}", file=sys.stderr)
        return 2
    print(page)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, keeping the last usage error so ``plan --json`` can print it as JSON."""

    last_error: str | None = None

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, **kwargs)
        # `--lr -1e-3` is a value, not an option: Python < 3.13 knows only -1 and -.5 as
        # negative numbers and said "expected one argument" instead of naming the range.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> typing.NoReturn:
        _Parser.last_error = message
        super().error(message)


def _add_export_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export",
        help="write a trained hf: run as a folder Hugging Face loads (from_pretrained)",
        description="Export a run's checkpoint: the full model and its tokenizer for full "
        "fine-tuning; for LoRA the PEFT adapter folder, or with --merge-lora the merged model.",
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="run folder, its checkpoints/, or one step-N folder"
    )
    parser.add_argument("--out", metavar="DIR", required=True, help="folder to write")
    parser.add_argument(
        "--step", type=int, metavar="N", help="checkpoint step (default: the newest valid one)"
    )
    parser.add_argument(
        "--merge-lora", action="store_true", help="merge LoRA adapters into the base weights"
    )
    parser.add_argument(
        "--best",
        action="store_true",
        help="export the best checkpoint (a run trained with --keep-best METRIC)",
    )
    parser.add_argument(
        "--base-name",
        metavar="NAME",
        help="an adapter's base_model_name_or_path: a Hub id or a path relative to where the "
        "adapter is loaded (default: the base folder's absolute path)",
    )
    parser.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from gradstep_cli.export.run import (
        export_run,  # deferred: transformers is imported only when exporting
    )

    print(
        export_run(
            args.run_dir,
            args.out,
            step=args.step,
            merge_lora=args.merge_lora,
            best=args.best,
            base_name=args.base_name,
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gradstep",
        description="Exact gradient accumulation and clipping: train, plan, report, export.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train_parser(sub)
    _add_plan_parser(sub)
    _add_report_parser(sub)
    _add_export_parser(sub)
    return parser


def _wants_json(argv: Sequence[str]) -> bool:
    """``gradstep plan ... --json``, read from the raw arguments: also for usage errors."""
    return bool(argv) and argv[0] == "plan" and "--json" in argv


def _os_error(exc: OSError, command: str) -> str:
    """An OSError as one line naming the file and what to do about it."""
    what = exc.strerror or str(exc)
    files = [f for f in (exc.filename, exc.filename2) if f is not None]
    where = f" ({' -> '.join(repr(os.fsdecode(f)) for f in files)})" if files else ""
    hint = {
        errno.EFBIG: "the file-size limit (ulimit -f) was reached: raise it, or write the "
        "run elsewhere (--out)",
        errno.ENOSPC: "the disk is full: free space, or write the run elsewhere (--out)",
        errno.EDQUOT: "the disk quota is used up: free space, or write the run elsewhere (--out)",
        errno.EROFS: "the file system is read-only: write the run elsewhere (--out)",
        errno.EACCES: "permission denied: make it writable, or write the run elsewhere (--out)",
    }.get(exc.errno)
    if hint is None:
        return f"{what}{where}"
    if command == "export":  # written beside --out and renamed: never half a folder
        return f"{what}{where}: {hint.replace('the run', 'the export')}; nothing was published"
    if command != "train":
        return f"{what}{where}: {hint}"
    # Checkpoints are written to a temporary folder and renamed: the saved ones are whole.
    return f"{what}{where}: {hint}; any checkpoint saved before is intact (--resume continues)"


def _fail(command: str, message: str, as_json: bool, status: int = 2) -> None:
    """One error line on stderr; with ``plan --json`` also ``{"error": ...}`` on stdout (rank
    0 only: a launcher's stdout should hold one JSON object, not one per rank). A worker of
    ``--nproc-per-node`` leaves its line to the launching process, which prints it once
    with the rank; under any torch launcher the line also goes into the worker's error file
    (torchrun's summary shows it)."""
    from gradstep_cli.run.launch import is_worker, record_worker_error

    if record_worker_error(message, status) and is_worker():
        return
    print(f"gradstep {command}: error: {message}", file=sys.stderr)
    if as_json and os.environ.get("RANK", "0") == "0":
        print(json.dumps({"error": message}))


def _record_crash(exc: BaseException) -> None:
    """A worker's unexpected exception (its traceback follows on stderr), in its error file:
    the launching process names the rank and the exception in its one line."""
    from gradstep_cli.run.launch import record_worker_error

    record_worker_error(f"{type(exc).__name__}: {exc}", 1)


def _missing_extra() -> list[str]:
    """The packages of :data:`CLI_EXTRA` this Python cannot import."""
    missing = []
    for name in CLI_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradstep`` script; returns the process exit status."""
    missing = _missing_extra()
    if missing:  # the library alone was installed: say what to install, not a traceback
        print(
            f"gradstep: the command line needs {', '.join(missing)}, which the library does "
            "not: pip install 'gradstep[cli]'",
            file=sys.stderr,
        )
        return 1
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = _wants_json(argv)
    _Parser.last_error = None
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the error on stderr
        if exc.code == 2 and as_json and _Parser.last_error is not None:
            print(json.dumps({"error": _Parser.last_error}))
        raise
    handler: Handler = args.handler
    args.argv = argv  # what --nproc-per-node's workers run
    try:
        return handler(args)
    except (GradstepError, NotImplementedError, ValueError) as exc:
        # A write that failed (a checkpoint's file on a full disk) is the environment's
        # failure, as an OSError is: 1. Refused settings and input: 2.
        status = 1 if getattr(exc, "filename", None) else 2
        _fail(args.command, str(exc), as_json, status)
        return status
    except OSError as exc:  # a full disk, a folder made read-only mid-run: no traceback
        _fail(args.command, _os_error(exc, args.command), as_json, 1)
        return 1
    except Exception as exc:
        from gradstep.parallel import collective_failure

        message = collective_failure(exc)
        if message is None:
            _record_crash(exc)
            raise
        _fail(args.command, message, as_json, 1)
        return 1
    except KeyboardInterrupt:
        print(f"gradstep {args.command}: interrupted", file=sys.stderr)
        if as_json:
            print(json.dumps({"error": "interrupted"}))
        return 130
