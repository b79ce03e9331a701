"""The data section of ``gradstep train`` (and ``plan``): what trains, what validates, how
records' fields are named, and the sequence length.

:class:`DataFields` holds them (``TrainConfig`` inherits them); :func:`check_data` refuses
what cannot be read, when the config is built. The data stage itself is
:mod:`gradstep_cli.data`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from gradstep_cli.config.checks import ConfigError, flag

__all__ = ["FIELD_FLAGS", "RESERVED_TEMPLATE_KWARGS", "DataFields", "check_data", "is_hub_name"]

FIELD_FLAGS = ("text_field", "prompt_field", "completion_field", "messages_field")
# apply_chat_template's own arguments, which the data stage sets: a kwargs object may not.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
# A Hub dataset id: NAME or OWNER/NAME (letters, digits, '-', '_', '.'), not a path.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_FILE_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet", ".csv", ".arrow", ".py", ".md")


def _f(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"section": "data", "help": help, **extra})


def is_hub_name(value: str) -> bool:
    """True for ``--data`` that names a Hub dataset (``OWNER/NAME`` or ``NAME``): no such
    local path, no glob, no file suffix."""
    return (
        _HUB_NAME.fullmatch(value) is not None
        and not value.lower().endswith(_FILE_SUFFIXES)
        and not os.path.exists(value)
    )


@dataclass(frozen=True)
class DataFields:
    """The run's data: ``--data`` / ``--val-data`` and how their records are read."""

    data: str | None = _f(
        None, "text files (a file, a folder searched recursively, a glob), records (JSONL, "
        "JSON, Parquet, CSV, Arrow, a save_to_disk folder) or a Hub dataset name (OWNER/NAME, "
        "with --data-split); default: stdlib .py",
    )  # fmt: skip
    data_split: str | None = _f(
        None, "the split of --data: a Hub dataset's, a save_to_disk DatasetDict's, or a "
        "dataset folder's (read by datasets.load_dataset)", default_help="train",
    )  # fmt: skip
    val_data: str | None = _f(
        None, "validation data, as --data (then nothing of --data is held out)",
        default_help="--val-fraction of --data held out, with a warning",
    )  # fmt: skip
    val_data_split: str | None = _f(
        None, "the split of --val-data, as --data-split", default_help="validation"
    )
    val_fraction: float = _f(
        0.1, "share of --data held out for validation when --val-data is not given, in (0, "
        "1): whole files or records, never trained on (said in a warning)",
    )  # fmt: skip
    skip_bad_records: bool = _f(
        False, "skip (and count) records that cannot be used instead of stopping"
    )
    text_field: str | None = _f(
        None, "the field holding a {text} record's text (naming a field reads that format "
        "only)", default_help="text",
    )  # fmt: skip
    prompt_field: str | None = _f(None, "the prompt's field", default_help="prompt")
    completion_field: str | None = _f(None, "the completion's field", default_help="completion")
    messages_field: str | None = _f(
        None, "the conversation's field (a list of {role, content}; a record's 'tools' go to "
        "the chat template)", default_help="messages",
    )  # fmt: skip
    chat_template_kwargs: str | None = _f(
        None, 'a JSON object passed to the chat template, e.g. {"enable_thinking": false}'
    )
    seq_len: int = _f(128, "maximum tokens (bytes) per sequence")
    packing: bool = _f(
        False, "pack whole sequences (documents' spans, records) into rows of --seq-len tokens "
        "without padding; attention never crosses a sequence (a block-causal mask; an HF "
        "attention implementation not shown exact is refused, naming it)",
    )  # fmt: skip

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """``--chat-template-kwargs`` as a dict (checked when the config is built)."""
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}


def check_data(cfg: Any) -> None:
    """Raise ConfigError for the first data setting that cannot be used."""
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in (0, 1), got {cfg.val_fraction}")
    for name in ("data", "val_data", "tokenizer"):
        value = getattr(cfg, name)
        if value is not None and not value.strip():
            raise ConfigError(f"{flag(name)} must name a file, folder or glob, got an empty path")
    for name in (*FIELD_FLAGS, "data_split", "val_data_split"):
        value = getattr(cfg, name)
        if value is not None and not value.strip():
            raise ConfigError(f"{flag(name)} must name a field or split, got an empty name")
    names = {getattr(cfg, n) for n in FIELD_FLAGS if getattr(cfg, n) is not None}
    if len(names) < sum(getattr(cfg, n) is not None for n in FIELD_FLAGS):
        given = ", ".join(f"{flag(n)} {getattr(cfg, n)}" for n in FIELD_FLAGS if getattr(cfg, n))
        raise ConfigError(f"the record fields must differ, got {given}")
    _check_template_kwargs(cfg.chat_template_kwargs)


def _check_template_kwargs(text: str | None) -> None:
    if text is None:
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f'--chat-template-kwargs must be a JSON object, e.g. \'{{"enable_thinking": '
            f"false}}'; got {text!r} ({exc.msg})"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"--chat-template-kwargs must be a JSON object, got {type(value).__name__} {text!r}"
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
    if reserved:
        raise ConfigError(
            f"--chat-template-kwargs may not set {', '.join(reserved)}: the data stage sets "
            "them (a record's tools come from its 'tools' field)"
        )
