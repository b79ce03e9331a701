"""The command-line flags of ``gradstep train`` and ``gradstep plan``, generated from
:class:`~gradstep_cli.config.settings.TrainConfig`: one flag per field, in argument groups by
the field's section (:data:`~gradstep_cli.config.settings.SECTIONS`, in that order), so the
CLI, the TOML file and the dataclass can never disagree about a parameter's name, type or
help text. Every flag defaults to "not given", so only flags actually typed override the
TOML file. :mod:`.reference` renders the same flags as ``docs/reference/flags.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from gradstep_cli.config.settings import SECTIONS, TrainConfig

__all__ = ["Flag", "add_config_flags", "flags"]

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
    "sample_prompts": "FILE",
    "report_to": "LIST",
}


@dataclass(frozen=True)
class Flag:
    """One ``TrainConfig`` field as a flag."""

    field: dataclasses.Field
    kind: Any
    """argparse's ``type=`` (``bool``: a ``--flag`` / ``--no-flag`` pair)."""

    @property
    def name(self) -> str:
        """The field, and the TOML key."""
        return self.field.name

    @property
    def section(self) -> str:
        return self.field.metadata["section"]

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def default(self) -> Any:
        """The default as shown: an automatic one says how it is chosen."""
        return self.field.metadata.get("default_help", self.field.default)

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.field.metadata.get("choices")

    @property
    def metavar(self) -> str | None:
        if self.kind is bool or self.choices is not None:
            return None
        return _METAVARS.get(self.name, getattr(self.kind, "__name__", "VALUE").upper())


def _flag_type(hint: Any) -> Any:
    """``int``/``float``/``str`` from a field hint (``str | None`` -> ``str``)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def flags() -> list[Flag]:
    """Every field's flag, in field order."""
    hints = typing.get_type_hints(TrainConfig)
    return [
        Flag(f, f.metadata.get("type") or _flag_type(hints[f.name]))
        for f in dataclasses.fields(TrainConfig)
    ]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, grouped by section (and ``--config``), shared by
    train and plan."""
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file of train settings")
    groups = {name: parser.add_argument_group(name, text) for name, text in SECTIONS.items()}
    for flag in sorted(flags(), key=lambda flag: list(SECTIONS).index(flag.section)):
        group, text = groups[flag.section], f"{flag.help} (default: {flag.default})"
        if flag.kind is bool:  # --flag / --no-flag; type=bool would take "False" as True
            group.add_argument(
                flag.option,
                dest=flag.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=text,
            )
            continue
        group.add_argument(
            flag.option,
            dest=flag.name,
            type=flag.kind,
            choices=flag.choices,
            nargs=flag.field.metadata.get("nargs"),
            const=flag.field.metadata.get("const"),
            default=argparse.SUPPRESS,  # absent flags must not override the TOML file
            help=text,
            metavar=flag.metavar,
        )
