"""The one list of clip policies that have a short name (``"zclip:3"``).

Each policy file registers itself with one :func:`register` call. The ``--clip`` grammar,
its help text and the error messages that list the allowed policies are all generated
from here, so a new policy is one file plus one ``register`` line (and one import line in
``policies/__init__.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .base import ClipPolicy

__all__ = ["PolicySpec", "policy_classes", "register", "registered", "spec_grammar"]


@dataclass(frozen=True)
class PolicySpec:
    name: str
    """The short name in a spec string (``"norm"``)."""
    cls: type
    make: Callable[[float | None], ClipPolicy]
    """Builds the policy from the spec's number (None when the spec gives none)."""
    arg: str | None = None
    """How the help text names the number (``"MAX"``), None when it takes none."""
    required: bool = False
    """True when the number must be given (``value:V``)."""
    help: str = ""
    order: int = 100
    """Position in the grammar and help text (lower first; ties by registration)."""

    @property
    def grammar(self) -> str:
        if self.arg is None:
            return self.name
        return f"{self.name}:{self.arg}" if self.required else f"{self.name}[:{self.arg}]"


_REGISTRY: dict[str, PolicySpec] = {}
# Policies without a short name (SpikeGuard is its own flag) still belong in error texts.
_UNNAMED: list[type] = []


def register(
    name: str,
    cls: type,
    make: Callable[[float | None], ClipPolicy] | None = None,
    *,
    arg: str | None = None,
    required: bool = False,
    help: str = "",
    order: int = 100,
) -> PolicySpec:
    """Give ``cls`` the short name ``name``; ``make(number_or_None)`` builds it.

    ``name=""`` lists the class among the policies without giving it a spec name.
    """
    if not name:
        _UNNAMED.append(cls)
        return PolicySpec("", cls, make or cls)
    if name in _REGISTRY or name == "none" or not name.isidentifier():
        raise ValueError(f"register: policy name {name!r} is taken or not an identifier")
    spec = PolicySpec(name, cls, make or cls, arg, required, help, order)
    _REGISTRY[name] = spec
    return spec


def registered() -> dict[str, PolicySpec]:
    """Every named policy, by ``order``, then registration order."""
    return dict(sorted(_REGISTRY.items(), key=lambda kv: kv[1].order))


def policy_classes() -> list[type]:
    """Every known policy class, named ones first (for error messages)."""
    return [s.cls for s in registered().values()] + [c for c in _UNNAMED if c not in _REGISTRY]


def spec_grammar() -> str:
    """``"none, norm[:MAX], value:V, ..."``: the allowed forms of a spec string."""
    return ", ".join(["none", *(s.grammar for s in registered().values())])
