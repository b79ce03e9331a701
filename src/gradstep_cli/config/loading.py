"""Settings from a TOML file and overrides: defaults < TOML file < flags.

A TOML file is flat (or under a ``[train]`` table), its keys are :class:`TrainConfig`'s
field names (``a-b`` is accepted for ``a_b``), and an unknown key is an error, so a typo
never silently runs with the default. Both names are importable from
:mod:`gradstep_cli.config.settings` too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gradstep_cli.config.settings import ConfigError, TrainConfig, field_names

__all__ = ["load_toml", "resolve"]


def _tomllib() -> Any:
    """The TOML reader: the standard library's, or before Python 3.11 the cli extra's
    tomli (imported here, so the command line starts without it and says what is missing)."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli  # pragma: no cover - Python 3.10 only

    return tomli  # pragma: no cover


def _read(path: str | Path) -> dict[str, Any]:
    """The TOML file, or a ConfigError naming it and what is wrong."""
    tomllib = _tomllib()
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a folder, not a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a flat TOML file of TrainConfig keys (``a-b`` is accepted for ``a_b``).

    Keys may also sit under a ``[train]`` table. Unknown keys are an error rather than being
    ignored, so a typo never silently runs with the default.
    """
    raw = _read(path)
    tables = [("top level", {k: v for k, v in raw.items() if k != "train"})]
    if isinstance(raw.get("train"), dict):
        tables.append(("[train]", raw["train"]))
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for table, items in tables:
        for key, value in items.items():
            name = key.replace("-", "_")
            if name in values:  # max_steps and max-steps, or the same key in two tables
                raise ConfigError(
                    f"{str(path)!r} sets {name} twice ({where[name]} and {table} {key!r}); keep one"
                )
            values[name], where[name] = value, f"{table} {key!r}"
    known = field_names()
    for key in values:
        if key not in known:
            raise ConfigError(
                f"unknown key {key!r} in {str(path)!r}; valid keys: {', '.join(known)}"
            )
    return values


def resolve(config_file: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Defaults, then the TOML file, then ``overrides`` (None values mean "not given")."""
    values = load_toml(config_file) if config_file is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(values) - set(field_names()))
    if unknown:
        raise ConfigError(f"unknown config parameter(s): {', '.join(unknown)}")
    return TrainConfig(**values)
