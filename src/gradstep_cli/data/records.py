"""JSONL records for ``--data`` / ``--val-data``: read, checked, then encoded to tokens.

One JSON object per line (blank lines are skipped); a file may mix the three formats:

* ``{"text": str}``: language modelling on every token (a document);
* ``{"prompt": str, "completion": str}``: one sequence, trained on the completion only;
* ``{"messages": [{"role": str, "content": str}, ...]}``: one conversation, rendered with
  the tokenizer's chat template, trained on the assistant's turns only.

Other keys (an ``id``, a ``source``) are ignored. A record that cannot be used (invalid
JSON, not an object, no format's fields or two formats' fields, a wrong type, an empty
text, prompt or completion, a malformed message) is an error naming the file and line, or,
with ``--skip-bad-records``, skipped and counted.

:class:`Encoder` turns text and records into token arrays with a per-token "is a target"
mask: the tokenizer's ids, or UTF-8 bytes for the demo GPT (no tokenizer, no EOS).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradstep.errors import GradstepError

__all__ = [
    "KINDS",
    "BadRecords",
    "DataError",
    "Encoded",
    "Encoder",
    "EncodedRecords",
    "Record",
    "TemplateError",
    "check",
    "read_jsonl",
]

FIELDS = {
    "text": ("text",),
    "prompt/completion": ("prompt", "completion"),
    "messages": ("messages",),
}
KINDS = tuple(FIELDS)
EXAMPLES = 3  # bad records named in the summary when they are skipped
# transformers marks assistant tokens from text rendered inside {% generation %} blocks.
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class DataError(GradstepError, ValueError):
    """The data named by ``--data`` / ``--val-data`` cannot be used; the message says why
    and where (the flag, and the file and line when one is at fault)."""


class _Bad(Exception):
    """Why one record cannot be used (raised while checking it)."""


@dataclass(frozen=True)
class Record:
    """One usable record: its format, its checked value, and where it came from."""

    where: str
    """``FILE line N``, for messages about it."""
    kind: str
    """One of :data:`KINDS`."""
    value: Any
    """The text; the (prompt, completion) pair; the list of messages."""
    line: str
    """The line as read: what the validation split hashes (duplicates land together)."""


@dataclass
class BadRecords:
    """Records skipped with ``--skip-bad-records``: how many, and the first few."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(message)


def _string(obj: dict[str, Any], key: str) -> str:
    """A non-blank string field (an empty prompt would leave the completion's first token
    nothing to be predicted from; an empty text or completion trains nothing)."""
    value = obj[key]
    if not isinstance(value, str):
        raise _Bad(f"{key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _Bad(f"{key!r} is empty")
    return value


def _message(index: int, message: Any) -> dict[str, str]:
    where = f"message {index + 1}"
    if not isinstance(message, dict):
        got = type(message).__name__
        raise _Bad(f"{where} must be an object with 'role' and 'content', got {got}")
    for key in ("role", "content"):
        if key not in message:
            raise _Bad(f"{where} has no {key!r}")
        if not isinstance(message[key], str):
            raise _Bad(f"{where}: {key!r} must be a string, got {type(message[key]).__name__}")
    if not message["role"].strip():
        raise _Bad(f"{where}: 'role' is empty")
    return dict(message)  # other keys (tool calls, names) are the template's to render


def _messages(obj: dict[str, Any]) -> list[dict[str, str]]:
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        got = json.dumps(messages)[:40]
        raise _Bad(f"'messages' must be a non-empty list of {{role, content}} objects, got {got}")
    return [_message(i, m) for i, m in enumerate(messages)]


def check(obj: Any) -> tuple[str, Any]:
    """(kind, value) of one parsed JSON value, or _Bad saying what is wrong with it."""
    if not isinstance(obj, dict):
        raise _Bad(f"a record must be a JSON object, got {type(obj).__name__}")
    formats = [kind for kind, keys in FIELDS.items() if any(key in obj for key in keys)]
    if not formats:
        keys = ", ".join(repr(k) for k in obj) or "none"
        raise _Bad(f"no 'text', 'prompt' and 'completion', or 'messages' field (its keys: {keys})")
    if len(formats) > 1:
        raise _Bad(f"fields of two formats ({' and '.join(formats)}): give one per record")
    kind = formats[0]
    if kind == "text":
        return kind, _string(obj, "text")
    if kind == "messages":
        return kind, _messages(obj)
    missing = [key for key in FIELDS[kind] if key not in obj]
    if missing:
        raise _Bad(f"a prompt/completion record needs both fields; {missing[0]!r} is missing")
    return kind, (_string(obj, "prompt"), _string(obj, "completion"))


def _lines(path: Path, flag: str) -> list[bytes]:
    try:
        return path.read_bytes().split(b"\n")
    except OSError as exc:
        raise DataError(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}") from None


def _parse(raw: bytes) -> tuple[str, Any]:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Bad(f"not UTF-8 text (byte {exc.start + 1})") from None
    try:
        return line, json.loads(line)
    except json.JSONDecodeError as exc:
        raise _Bad(f"invalid JSON ({exc.msg} at column {exc.colno})") from None


def read_jsonl(path: Path, name: str, flag: str, skip_bad: bool, bad: BadRecords) -> list[Record]:
    """The usable records of one JSONL file (``name``: how messages show it).

    A bad record raises :class:`DataError` naming ``flag``, the file and the line, or, with
    ``skip_bad``, is counted in ``bad`` and left out.
    """
    records = []
    for number, raw in enumerate(_lines(path, flag), start=1):
        if number == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark some editors write
        if not raw.strip():
            continue
        where = f"{name} line {number}"
        try:
            line, obj = _parse(raw)
            kind, value = check(obj)
        except _Bad as reason:
            if not skip_bad:
                raise DataError(
                    f"{flag} {where}: {reason}; fix the record, or pass --skip-bad-records "
                    "to skip (and count) records that cannot be used"
                ) from None
            bad.add(f"{where}: {reason}")
            continue
        records.append(Record(where, kind, value, line.strip()))
    return records


class TemplateError(DataError):
    """The tokenizer cannot render ``messages`` records for training (no template, no
    assistant marks); the data is not at fault, so no record can be skipped for it."""


@dataclass(frozen=True)
class Encoded:
    """One record's tokens and which of them are targets."""

    ids: np.ndarray
    trainable: np.ndarray
    """Per token: is it a target. The first token never is (nothing comes before it)."""

    def targets(self) -> int:
        """Tokens this record trains on."""
        return int(self.trainable[1:].sum())

    def first_target(self) -> int:
        """Index of the first target (0 when there is none)."""
        return 1 + int(np.argmax(self.trainable[1:])) if self.targets() else 0


class Encoder:
    """Text and records to token arrays: ``tokenizer``'s ids, or UTF-8 bytes (None)."""

    def __init__(self, tokenizer: Any = None, bytes_why: str | None = None) -> None:
        self.tokenizer = tokenizer
        # Why there is no tokenizer, for refusing chat records: the demo GPT by default.
        self.bytes_why = (
            bytes_why or "the demo GPT reads bytes: give text or prompt/completion records"
        )
        self.eos = None if tokenizer is None else getattr(tokenizer, "eos_token_id", None)
        self.unit = "bytes" if tokenizer is None else "tokens"
        self.dtype: type = np.uint8 if tokenizer is None else np.int32

    def _ids(self, texts: list[str], special: bool) -> list[list[int]]:
        if not texts:
            return []
        # verbose=False: a document longer than the model's context is expected (it is cut).
        out = self.tokenizer(texts, add_special_tokens=special, verbose=False)
        return [list(ids) for ids in out["input_ids"]]

    def _with_eos(self, ids: list[int]) -> list[int]:
        """A document or completion ends with EOS (trained: the model learns to stop)."""
        if self.eos is None or (ids and ids[-1] == self.eos):
            return ids
        return [*ids, self.eos]

    def documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's tokens (the tokenizer's BOS, if it adds one) and EOS; bytes as is."""
        if self.tokenizer is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        return [
            np.array(self._with_eos(ids), dtype=np.int32) for ids in self._ids(list(texts), True)
        ]

    def prompt_completions(self, pairs: Sequence[tuple[str, str]]) -> list[Encoded]:
        """Prompt and completion tokenized separately (the prompt with the tokenizer's
        special tokens, as it will be at inference), concatenated, EOS appended; only the
        completion and EOS are targets."""
        if self.tokenizer is None:
            prompts = [p.encode("utf-8") for p, _ in pairs]
            completions = [c.encode("utf-8") for _, c in pairs]
        else:
            prompts = self._ids([p for p, _ in pairs], True)
            completions = [self._with_eos(c) for c in self._ids([c for _, c in pairs], False)]
        out = []
        for p, c in zip(prompts, completions, strict=True):
            ids = np.array([*p, *c], dtype=self.dtype)
            trainable = np.arange(len(ids)) >= len(p)
            out.append(Encoded(ids, trainable))
        return out

    def check_template(self, where: str) -> None:
        """Refuse ``messages`` records the tokenizer cannot render for training."""
        if self.tokenizer is None:
            raise TemplateError(
                f'{where}: {{"messages"}} records need a tokenizer with a chat template '
                f"(--model hf:DIR); {self.bytes_why}"
            )
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        if not template:
            raise TemplateError(
                f'{where}: the tokenizer has no chat template, so {{"messages"}} records '
                "cannot be rendered; use a tokenizer that has one (--tokenizer PATH) or give "
                "prompt/completion records"
            )
        if not _GENERATION.search(template):
            raise TemplateError(
                f"{where}: the tokenizer's chat template marks no assistant tokens (no "
                "{% generation %} ... {% endgeneration %} around the assistant's content), so "
                "the loss cannot be kept to assistant turns; give a template with those marks "
                "(--tokenizer PATH) or prompt/completion records"
            )

    def conversation(self, messages: list[dict[str, str]], where: str) -> Encoded:
        """The template's own tokens (never rendered text re-encoded: a second BOS) and its
        assistant mask: the targets. Raises ValueError for a conversation the template
        refuses (the record's fault), TemplateError when it marks no assistant token."""
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = np.array(out["input_ids"], dtype=np.int32)
        trainable = np.array(out["assistant_masks"], dtype=bool)
        spoken = any(m["role"] == "assistant" and m["content"].strip() for m in messages)
        if spoken and not trainable.any():
            raise TemplateError(
                f"{where}: the chat template marked none of the assistant's tokens; its "
                "{% generation %} block must hold the assistant's content"
            )
        return Encoded(ids, trainable)

    def encode(
        self, records: Sequence[Record], flag: str, skip_bad: bool, bad: BadRecords
    ) -> EncodedRecords:
        """Every record's tokens, in file order: text records as documents, the others as
        one sequence each; those with no token to train on are left out (counted)."""
        out = EncodedRecords()
        texts = [r for r in records if r.kind == "text"]
        out.documents = self.documents([r.value for r in texts])
        pairs = [i for i, r in enumerate(records) if r.kind == "prompt/completion"]
        values = self.prompt_completions([records[i].value for i in pairs])
        encoded: dict[int, Encoded] = dict(zip(pairs, values, strict=True))
        chats = [i for i, r in enumerate(records) if r.kind == "messages"]
        if chats:
            self.check_template(f"{flag} {records[chats[0]].where}")
        for i in chats:
            where = f"{flag} {records[i].where}"
            try:
                encoded[i] = self.conversation(records[i].value, where)
            except TemplateError:
                raise
            except Exception as exc:  # the template refused this conversation (jinja2 errors)
                reason = _refused(exc, where, getattr(self.tokenizer, "name_or_path", ""))
                if not skip_bad:
                    raise DataError(
                        f"{where}: {reason}; fix the record, or pass --skip-bad-records to "
                        "skip (and count) records that cannot be used"
                    ) from None
                bad.add(f"{records[i].where}: {reason}")
        kept = ["text"] * len(texts)
        for i in sorted(encoded):  # file order
            if encoded[i].targets() == 0:
                out.no_target += 1  # e.g. a conversation with no assistant turn
                continue
            out.records.append(encoded[i])
            kept.append(records[i].kind)
        out.kinds = {kind: kept.count(kind) for kind in KINDS if kind in kept}
        return out


def _refused(exc: Exception, where: str, tokenizer: str) -> str:
    """Why the chat template did not render a record: the record's fault (the reason), or
    the template's (raised: no record can be skipped for it).

    ``raise_exception('...')`` raises a plain jinja2 ``TemplateError``: the template's own
    check refusing this record. A sandbox ``SecurityError`` or a syntax error comes from the
    template whatever the record holds."""
    from jinja2 import exceptions as jinja  # there whenever a tokenizer renders templates

    template = "the tokenizer's chat template"
    if tokenizer:
        template = f"the chat template of the tokenizer in {tokenizer!r}"
    name, said = type(exc).__name__, str(exc).rstrip(".")
    if isinstance(exc, (jinja.SecurityError, jinja.TemplateSyntaxError)):
        raise TemplateError(
            f"{where}: {template} is at fault, not the record: rendering raised {name}: "
            f"{said}. Fix the template (chat_template.jinja, or chat_template in "
            "tokenizer_config.json) or use another tokenizer (--tokenizer PATH)"
        ) from None
    if type(exc) is jinja.TemplateError:
        return f"the chat template refused it ({name}: {exc})"
    return f"{template} failed on it ({name}: {exc})"


@dataclass
class EncodedRecords:
    """The records of one side of the data, encoded."""

    documents: list[np.ndarray] = field(default_factory=list)
    """``{"text"}`` records: cut into windows like text files."""
    records: list[Encoded] = field(default_factory=list)
    """Prompt/completion and messages records: one sequence each."""
    kinds: dict[str, int] = field(default_factory=dict)
    """Records kept, by kind."""
    no_target: int = 0
    """Records left out: not one token to train on."""
