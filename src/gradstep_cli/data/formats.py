"""The three record formats, and the checks one record passes before it is encoded.

* ``{"text": str}``: language modelling on every token (a document);
* ``{"prompt": str, "completion": str}``: one sequence, trained on the completion only;
* ``{"messages": [{"role": str, "content": str}, ...], "tools": [...]}``: one conversation,
  rendered with the tokenizer's chat template (its ``tools``, when the record has any, go to
  the template), trained on the assistant's turns only.

The fields may be named otherwise (``--text-field``, ``--prompt-field``,
``--completion-field``, ``--messages-field``): naming one reads that format only, so a
dataset's other columns (a ``text`` beside ``instruction``/``output``) are ignored. Other
keys (an ``id``, a ``source``) are always ignored. A record that cannot be used (not an
object, no format's fields or two formats', a wrong type, an empty text, prompt or
completion, a malformed message) raises :class:`Bad` saying why; the reader names the file
and line (or row).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_FIELDS", "Bad", "Fields", "check"]


class Bad(Exception):
    """Why one record cannot be used (raised while checking it)."""


@dataclass(frozen=True)
class Fields:
    """Where each format's values are in a record, and which formats are read."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"
    kinds: tuple[str, ...] = ("text", "prompt/completion", "messages")
    """The formats read: all three, or those whose field was named."""
    keys: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        every = {
            "text": (self.text,),
            "prompt/completion": (self.prompt, self.completion),
            "messages": (self.messages,),
        }
        object.__setattr__(self, "keys", {k: every[k] for k in self.kinds})

    @classmethod
    def of(cls, cfg: Any) -> Fields:
        """The fields ``cfg`` names (``--text-field`` ...; None: the standard name)."""
        named = {
            "text": cfg.text_field,
            "prompt": cfg.prompt_field,
            "completion": cfg.completion_field,
            "messages": cfg.messages_field,
        }
        given = {k: v for k, v in named.items() if v is not None}
        if not given:
            return cls()
        kinds = {"text": "text", "prompt": "prompt/completion", "completion": "prompt/completion"}
        kinds["messages"] = "messages"
        order = ("text", "prompt/completion", "messages")
        chosen = tuple(k for k in order if k in {kinds[name] for name in given})
        return cls(**given, kinds=chosen)

    def describe(self) -> str:
        """``'text', 'prompt' and 'completion', or 'messages'`` (the formats read)."""
        parts = [" and ".join(repr(k) for k in keys) for keys in self.keys.values()]
        return ", or ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 2 else parts)


DEFAULT_FIELDS = Fields()


def _string(obj: dict[str, Any], key: str) -> str:
    """A non-blank string field (an empty prompt would leave the completion's first token
    nothing to be predicted from; an empty text or completion trains nothing)."""
    value = obj[key]
    if not isinstance(value, str):
        raise Bad(f"{key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise Bad(f"{key!r} is empty")
    return value


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"message {index + 1}"
    if not isinstance(message, dict):
        got = type(message).__name__
        raise Bad(f"{where} must be an object with 'role' and 'content', got {got}")
    # An assistant turn that only calls tools may have no content (OpenAI's format).
    calls = isinstance(message.get("tool_calls"), list) and message.get("content") is None
    for key in ("role",) if calls else ("role", "content"):
        if key not in message:
            raise Bad(f"{where} has no {key!r}")
        if not isinstance(message[key], str):
            raise Bad(f"{where}: {key!r} must be a string, got {type(message[key]).__name__}")
    if not message["role"].strip():
        raise Bad(f"{where}: 'role' is empty")
    return dict(message)  # other keys (tool calls, names) are the template's to render


def _messages(obj: dict[str, Any], key: str) -> tuple[list[dict[str, Any]], list | None]:
    messages = obj[key]
    if not isinstance(messages, list) or not messages:
        got = json.dumps(messages, default=str)[:40]
        raise Bad(f"{key!r} must be a non-empty list of {{role, content}} objects, got {got}")
    tools = obj.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise Bad(f"'tools' must be a list of objects (function schemas), got {tools!r:.40}")
    return [_message(i, m) for i, m in enumerate(messages)], tools or None


def check(obj: Any, fields: Fields = DEFAULT_FIELDS) -> tuple[str, Any]:
    """(kind, value) of one parsed record, or :class:`Bad` saying what is wrong with it. The
    value is the text; the (prompt, completion) pair; the (messages, tools) pair."""
    if not isinstance(obj, dict):
        raise Bad(f"a record must be a JSON object, got {type(obj).__name__}")
    formats = [kind for kind, keys in fields.keys.items() if any(key in obj for key in keys)]
    if not formats:
        keys = ", ".join(repr(k) for k in obj) or "none"
        raise Bad(f"no {fields.describe()} field (its keys: {keys})")
    if len(formats) > 1:
        raise Bad(f"fields of two formats ({' and '.join(formats)}): give one per record")
    kind = formats[0]
    if kind == "text":
        return kind, _string(obj, fields.text)
    if kind == "messages":
        return kind, _messages(obj, fields.messages)
    missing = [key for key in fields.keys[kind] if key not in obj]
    if missing:
        raise Bad(f"a prompt/completion record needs both fields; {missing[0]!r} is missing")
    return kind, (_string(obj, fields.prompt), _string(obj, fields.completion))
