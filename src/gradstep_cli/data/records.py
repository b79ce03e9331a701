"""Records encoded to tokens, and the errors of the data stage.

The formats and the checks a record passes are :mod:`.formats`'; reading them (JSONL line
by line, other files and Hub datasets through ``datasets``) is :mod:`.reading`'. A bad
record is an error naming the flag, the file and the line (or row), or, with
``--skip-bad-records``, skipped and counted (:class:`BadRecords`).

:class:`Encoder` turns text and records into token arrays with a per-token "is a target"
mask: the tokenizer's ids, or UTF-8 bytes for the demo GPT (no tokenizer, no EOS).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradstep.errors import GradstepError

__all__ = ["KINDS", "BadRecords", "DataError", "Encoded", "Encoder", "TemplateError"]

KINDS = ("text", "prompt/completion", "messages")
EXAMPLES = 3  # bad records named in the summary when they are skipped
SKIP_HINT = (
    "fix the record, or pass --skip-bad-records to skip (and count) records that cannot be used"
)
# Texts the tokenizer's backend must encode as the tokenizer does before it is used alone.
_PROBES = ("def f(x):\n    return x\n", "Über naïve café 東京 12345.", "  a  b\t\n\nc", "x")
# transformers marks assistant tokens from text rendered inside {% generation %} blocks.
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class DataError(GradstepError, ValueError):
    """The data named by ``--data`` / ``--val-data`` cannot be used; the message says why
    and where (the flag, and the file and line when one is at fault)."""


@dataclass
class BadRecords:
    """Records skipped with ``--skip-bad-records``: how many, and the first few."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(message)


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
    """Text and records to token arrays: ``tokenizer``'s ids, or UTF-8 bytes (None).
    ``template_kwargs``: ``--chat-template-kwargs``, passed to every conversation."""

    def __init__(
        self,
        tokenizer: Any = None,
        bytes_why: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # Why there is no tokenizer, for refusing chat records: the demo GPT by default.
        self.bytes_why = (
            bytes_why or "the demo GPT reads bytes: give text or prompt/completion records"
        )
        self.eos = None if tokenizer is None else getattr(tokenizer, "eos_token_id", None)
        self.unit = "bytes" if tokenizer is None else "tokens"
        self.dtype: type = np.uint8 if tokenizer is None else np.int32
        self.template_kwargs = dict(template_kwargs or {})
        self._fast: Any = None  # the backend that encodes batches (False: none; None: not asked)

    def ids(self, texts: list[str], special: bool) -> list[list[int]]:
        """Each text's ids, with the tokenizer's special tokens (BOS) when ``special``."""
        if not texts:
            return []
        if self._fast is None:
            self._fast = self._fast_backend() or False
        if self._fast:
            return [e.ids for e in self._fast.encode_batch_fast(texts, add_special_tokens=special)]
        return self._slow(texts, special)

    def _slow(self, texts: list[str], special: bool) -> list[list[int]]:
        # verbose=False: a document longer than the model's context is expected (it is cut).
        out = self.tokenizer(texts, add_special_tokens=special, verbose=False)
        return [list(ids) for ids in out["input_ids"]]

    def _fast_backend(self) -> Any:
        """The fast tokenizer's backend, when it gives the tokenizer's own ids on probe
        texts (it skips the offsets and Python objects the tokenizer's call makes)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if not hasattr(backend, "encode_batch_fast"):
            return None
        for special in (True, False):
            got = [e.ids for e in backend.encode_batch_fast(_PROBES, add_special_tokens=special)]
            if got != self._slow(list(_PROBES), special):
                return None
        return backend

    def with_eos(self, ids: list[int]) -> list[int]:
        """A document or completion ends with EOS (trained: the model learns to stop)."""
        if self.eos is None or (ids and ids[-1] == self.eos):
            return ids
        return [*ids, self.eos]

    def documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's tokens (the tokenizer's BOS, if it adds one) and EOS; bytes as is."""
        if self.tokenizer is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        return [np.array(self.with_eos(ids), dtype=np.int32) for ids in self.ids(list(texts), True)]

    def prompt_completions(self, pairs: Sequence[tuple[str, str]]) -> list[Encoded]:
        """Prompt and completion tokenized separately (the prompt with the tokenizer's
        special tokens, as it will be at inference), concatenated, EOS appended; only the
        completion and EOS are targets."""
        if self.tokenizer is None:
            prompts = [p.encode("utf-8") for p, _ in pairs]
            completions = [c.encode("utf-8") for _, c in pairs]
        else:
            prompts = self.ids([p for p, _ in pairs], True)
            completions = [self.with_eos(c) for c in self.ids([c for _, c in pairs], False)]
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

    def conversation(
        self, messages: list[dict[str, Any]], where: str, tools: list | None = None
    ) -> Encoded:
        """The template's own tokens (never rendered text re-encoded: a second BOS) and its
        assistant mask: the targets. ``tools`` (the record's) go to the template. Raises
        ValueError for a conversation the template refuses (the record's fault),
        TemplateError when it marks no assistant token."""
        out = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **self.template_kwargs,
        )
        ids = np.array(out["input_ids"], dtype=np.int32)
        trainable = np.array(out["assistant_masks"], dtype=bool)
        spoken = any(
            m["role"] == "assistant" and isinstance(m.get("content"), str) and m["content"].strip()
            for m in messages
        )
        if spoken and not trainable.any():
            raise TemplateError(
                f"{where}: the chat template marked none of the assistant's tokens; its "
                "{% generation %} block must hold the assistant's content"
            )
        return Encoded(ids, trainable)

    def refused(self, exc: Exception, where: str) -> str:
        """Why the template did not render a record (raises when the template is at fault)."""
        return _refused(exc, where, getattr(self.tokenizer, "name_or_path", ""))


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
