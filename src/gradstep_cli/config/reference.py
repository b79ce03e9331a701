"""The flag reference, ``docs/reference/flags.md``, rendered from
:class:`~gradstep_cli.config.settings.TrainConfig`: one table per section, in ``--help``'s
order (flag, TOML key, type or choices, default, help).

``python -m gradstep_cli.config.reference`` writes it (``--check``: exit 1 when the file
differs from what would be written); ``tests/cli/config/test_reference.py`` fails when the
committed file is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradstep_cli.config.flags import Flag, flags
from gradstep_cli.config.settings import SECTIONS

__all__ = ["PATH", "main", "render"]

PATH = Path("docs/reference/flags.md")
"""Where the reference lives, from the repository's root."""

_HEADER = """\
# Flags of `gradstep train` and `gradstep plan`

Generated from `gradstep_cli.config.settings.TrainConfig` by
`python -m gradstep_cli.config.reference`: do not edit by hand
(`tests/cli/config/test_reference.py` fails when this file is stale).

Every flag is also a key of the TOML file `--config` names: flat, or under a `[train]`
table, with `-` or `_` (`max-steps` or `max_steps`). Precedence: defaults < `--config` <
flags. `gradstep plan` takes every flag of `gradstep train`, plus `--json` and
`--no-probe`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flag_cell(flag: Flag) -> str:
    if flag.kind is bool:
        return f"`{flag.option}` / `--no-{flag.option[2:]}`"
    value = flag.metavar or "{" + ",".join(flag.choices or ()) + "}"
    if flag.field.metadata.get("nargs") == "?":
        value = f"[{value}]"
    return f"`{flag.option} {value}`"


def _type_cell(flag: Flag) -> str:
    if "type_help" in flag.field.metadata:
        return flag.field.metadata["type_help"]
    if flag.choices is not None:
        return " or ".join(f"`{choice}`" for choice in flag.choices)
    return getattr(flag.kind, "__name__", "str")


def _default_cell(flag: Flag) -> str:
    if "default_help" in flag.field.metadata:
        return flag.field.metadata["default_help"]
    value = flag.field.default
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def render() -> str:
    """The reference, as written to :data:`PATH`."""
    out = [_HEADER]
    everything = flags()
    for section, text in SECTIONS.items():
        out += [f"## {section}", "", text[0].upper() + text[1:] + ".", ""]
        out += ["| flag | TOML key | type | default | help |", "|---|---|---|---|---|"]
        for flag in (f for f in everything if f.section == section):
            cells = [
                _flag_cell(flag),
                f"`{flag.name}`",
                _type_cell(flag),
                _default_cell(flag),
                flag.help,
            ]
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradstep_cli.config.reference", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("path", nargs="?", default=str(PATH), help=f"default: {PATH}")
    parser.add_argument("--check", action="store_true", help="only say whether it is stale")
    args = parser.parse_args(argv)
    path, text = Path(args.path), render()
    if args.check:
        current = path.read_text() if path.is_file() else None
        if current != text:
            print(f"{path} is stale: run python -m gradstep_cli.config.reference", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
